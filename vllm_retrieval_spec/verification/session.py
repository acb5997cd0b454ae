"""One :class:`SpecSession` per vLLM model runner whose drafter is one of our proposers.

The session is created with the runner (``integration/vllm_patches.py``), handed to the
drafter, and owns everything that lives between drafting and verification:

- the request ids of the rows being drafted for, and which of them sample (temperature > 0),
  from the runner before each ``propose``;
- per-request state (:class:`RequestState`: the last drafted tree and, for sampled candidates,
  the distributions they were drawn from), released when the scheduler reports the request
  finished or aborted;
- the cross-request :class:`~vllm_retrieval_spec.datastores.output_index.OutputIndex` (REST
  with ``use_output_index``), fed with the tokens of every finished request;
- the cross-request :class:`~vllm_retrieval_spec.datastores.live_index.LiveIndex` of the
  requests still in flight (REST with ``use_live_index``), brought up to date when a step
  drafts and rid of each request as it finishes or is aborted;
- the :class:`~vllm_retrieval_spec.datastores.context_states.ContextStates` of the requests in
  flight (REST with ``context_state_votes``): the hidden state that produced each of their
  tokens, prompt tokens included, freed as each request finishes or is aborted;
- the :class:`~vllm_retrieval_spec.datastores.learned_dense.LearnedDenseIndex` a dense proposer
  gives it (``dense_learned_positions``): the keys of every generated token, learned when
  their request finishes, dropped when it is aborted;
- with ``budget: auto``, the :class:`~vllm_retrieval_spec.goodput.GoodputBudget`, whose cost
  model learns from the time between consecutive drafting calls (drafting itself excluded,
  and not at all when the engine waited for requests in between) and the tokens the step in
  between scheduled;
- the plan of every target step our sampler verifies (a tree branches, or a request that
  samples has drafts): the trees and draft distributions the sampler walks and, for branching
  trees, depth positions, the tree-attention fix-up and the KV compaction of the accepted
  paths, per KV cache group (sliding-window and full-attention layers have their own);
- on the CPU build (float32), the :class:`~vllm_retrieval_spec.verification.step_attention.StepAttention`
  that computes its decode and verification steps' attention (``cpu_step_attention``);
- its counters and its one-time check of the attention KV layout (per runner, so a second
  engine in the same process checks its own);
- the runner's Prometheus metrics (``integration/metrics.py``), published once per step
  after drafting.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from vllm_retrieval_spec.candidates import DraftQ
from vllm_retrieval_spec.datastores.context_states import ContextStates
from vllm_retrieval_spec.datastores.learned_dense import LearnedDenseIndex
from vllm_retrieval_spec.datastores.live_index import LiveIndex, LiveMatches
from vllm_retrieval_spec.datastores.output_index import OutputIndex
from vllm_retrieval_spec.goodput import GoodputBudget
from vllm_retrieval_spec.goodput.cost_model import tree_work
from vllm_retrieval_spec.kernels.attention import KVLayout, TreeNodes
from vllm_retrieval_spec.verification import tree_attention as ops
from vllm_retrieval_spec.verification.admission import turned_speculation_off
from vllm_retrieval_spec.verification.step_attention import StepAttention
from vllm_retrieval_spec.verification.trees import DraftTree, TreeStepPlan

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner


PLACEHOLDER_TOKEN = -1  # a draft slot the scheduler filled without a draft (vLLM rejects it)


def without_placeholders(scheduled_tokens: Sequence[int]) -> Sequence[int]:
    """The drafts among a row's scheduled spec tokens: vLLM pads a new request whose prompt
    was all in the prefix cache with ``-1`` placeholders (uniform decode shapes), and
    structured output pads the drafts it rejects the same way, always after the real ones."""
    if PLACEHOLDER_TOKEN not in scheduled_tokens:
        return scheduled_tokens
    return scheduled_tokens[: list(scheduled_tokens).index(PLACEHOLDER_TOKEN)]


class TreeModeError(RuntimeError):
    """Tree verification cannot run in this configuration."""


@dataclass
class TreeVerificationStats:
    """Counters of one runner's tree verification (for tests, benchmarks and operators)."""

    tree_steps: int = 0  # target steps that verified at least one branching tree
    tree_requests: int = 0  # request-steps verified as trees
    branching_requests: int = 0  # of which the tree branched (the tree-attention fix-up ran)
    compacted_slots: int = 0  # K/V slots moved after acceptance
    mcss_requests: int = 0  # request-steps whose candidates were drawn from the drafter's q (verified by MCSS)


class StepMetrics(Protocol):
    """Where a session publishes its runner's counters (``integration.metrics.RunnerMetrics``)."""

    def publish(self, draft_seconds: float) -> None:
        """One step drafted in ``draft_seconds``: publish the counters' growth."""


@dataclass
class RequestState:
    """What the session keeps for one running request."""

    tree: DraftTree | None = None  # the tree (or drawn chain) drafted at the last step
    draft_q: DraftQ | None = None  # the distributions its candidates were drawn from (sampled candidates)
    tree_step: int = -1  # the step it was drafted at


@dataclass
class SpecSession:
    """Per-runner state between our drafter and the verifying target step."""

    tree_mode: bool
    head_size: int = 0
    budget: GoodputBudget | None = None
    output_index: OutputIndex | None = None
    live_index: LiveIndex | None = None
    learned_dense: LearnedDenseIndex | None = None
    context_states: ContextStates | None = None
    metrics: StepMetrics | None = None
    step_attention: StepAttention | None = None  # CPU build, float32: cpu_step_attention
    stats: TreeVerificationStats = field(default_factory=TreeVerificationStats)
    requests: dict[str, RequestState] = field(default_factory=dict)
    step_req_ids: list[str] = field(default_factory=list)
    step_samples: np.ndarray | None = None  # [rows] bool: the row's request samples (temperature > 0)
    step_speculates: np.ndarray | None = None  # [rows] bool: the row's request lets us draft (None: all do)
    unspeculated: set[str] = field(default_factory=set)  # running requests that turned speculation off
    constrained: set[str] = field(default_factory=set)  # running requests with structured outputs
    step: int = 0
    plan: TreeStepPlan | None = None
    layout_checked: bool = False
    _step_started: float | None = field(default=None, init=False, repr=False)
    _runner_started: float | None = field(default=None, init=False, repr=False)  # runner_step_began()
    _draft_seconds: float = field(default=0.0, init=False, repr=False)
    _tree_work: float = field(default=0.0, init=False, repr=False)  # thousand node-context pairs recomputed this step
    _sampled_tokens: int = field(default=0, init=False, repr=False)  # draft tokens of sampling requests this step
    _context_lens: np.ndarray | None = field(default=None, init=False, repr=False)
    _kv_groups: dict[int, ops.TreeKVGroup] = field(default_factory=dict, init=False, repr=False)  # by metadata
    _kv_layout: KVLayout | None = field(default=None, init=False, repr=False)
    _accepted_paths: tuple[int, np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False)
    _trees_published_step: int = field(default=-1, init=False, repr=False)  # the last step publish() got trees
    step_hidden_states: torch.Tensor | None = field(default=None, init=False, repr=False)

    # ------------------------------------------------------------------ drafting side

    def begin_step(self, req_ids: Sequence[str], num_scheduled_tokens: int = 0,
                   samples: np.ndarray | None = None, num_draft_tokens: int = 0) -> None:
        """The runner is about to call ``propose``: ``req_ids`` are its input-batch rows, the
        target step just run scheduled ``num_scheduled_tokens`` tokens, ``num_draft_tokens`` of
        them drafts (the rest beyond one per request: prompt tokens), and ``samples`` tells
        which rows' requests sample (temperature > 0)."""
        now = time.perf_counter()
        if self.budget is not None and self._step_started is not None:
            prefill_tokens = num_scheduled_tokens - len(req_ids) - num_draft_tokens
            # An idle engine's step is not learned from (0 s: every tensor-parallel rank calls
            # observe, which takes the first rank's time and its decision).
            seconds = 0.0 if self._idle_before(now) else now - self._step_started - self._draft_seconds
            self.budget.cost.observe(seconds, len(req_ids), num_scheduled_tokens, self._tree_work,
                                     self._sampled_tokens, prefill_tokens)
        self._step_started = now
        self.step += 1
        self.step_req_ids = list(req_ids)
        self.step_samples = samples
        self.step_speculates = None if not self.unspeculated else np.fromiter(
            (req_id not in self.unspeculated for req_id in self.step_req_ids), bool, len(self.step_req_ids))

    def admit(self, new_requests: Iterable[object]) -> None:
        """Requests the runner starts this step (vLLM's ``NewRequestData``): remember those whose
        own switch turned speculation off (``options.SPECULATE_ARG``) and those with structured
        outputs (their logits are masked after the head) until they finish."""
        for request in new_requests:
            params = request.sampling_params
            if turned_speculation_off(params):
                self.unspeculated.add(request.req_id)
            if params is not None and getattr(params, "structured_outputs", None) is not None:
                self.constrained.add(request.req_id)

    def runner_step_began(self) -> None:
        """The runner started a step (``execute_model``): what came before it since the last
        drafting was the engine's scheduling, or the engine waiting for requests."""
        self._runner_started = time.perf_counter()

    def _idle_before(self, now: float) -> bool:
        """Whether the engine waited for requests before the step ending ``now``: the time between
        the last drafting and the runner's start was longer than the runner's step itself
        (scheduling never is). Early on, before the cost model could call such a step an
        outlier, one idle minute (a readiness probe, then no traffic) priced every later step."""
        started = self._runner_started
        if started is None or self._step_started is None or started < self._step_started:
            return False
        return started - self._step_started - self._draft_seconds > now - started

    def end_step(self) -> None:
        """``propose`` returned: its time is drafting, not the target's."""
        if self._step_started is None:
            return
        self._draft_seconds = time.perf_counter() - self._step_started
        if self.metrics is not None:
            self.metrics.publish(self._draft_seconds)

    def keep_hidden_states(self, sample_hidden_states: torch.Tensor, num_draft_tokens: Sequence[int] | None,
                           sampled_token_ids: Sequence[Sequence[int]], num_tokens: np.ndarray | None = None) -> None:
        """For drafters that read the target's hidden states (DReSD, REST with context states):
        keep, per input-batch row, the hidden state that produced the row's last sampled token
        (``[rows, hidden]``, on the model's device; rows that sampled nothing keep an arbitrary
        one), and with the rows' token counts ``num_tokens`` (sampled tokens included) hand the
        state of every token sampled this step to the learned dense index and the context states."""
        producers, sampled = self._producing_rows(num_draft_tokens, sampled_token_ids)
        rows = np.arange(len(sampled))
        last = producers[rows, np.maximum(sampled, 1) - 1]
        self.step_hidden_states = sample_hidden_states[torch.from_numpy(last).to(sample_hidden_states.device)]
        if (self.learned_dense is None and self.context_states is None) or num_tokens is None or not sampled.any():
            return
        row, column = np.nonzero(np.arange(producers.shape[1]) < sampled[:, None])
        states = sample_hidden_states[torch.from_numpy(producers[row, column]).to(sample_hidden_states.device)]
        states = states.float().cpu().numpy()
        positions = np.asarray(num_tokens, np.int64)[row] - sampled[row] + column
        if self.learned_dense is not None:
            self.learned_dense.record_states(np.asarray(self.step_req_ids, dtype=object)[row], positions, states)
        if self.context_states is not None:
            self.context_states.write(self.step_req_ids, row, positions, states)

    def keep_prompt_states(self, hidden_states: torch.Tensor, num_scheduled: np.ndarray, num_computed: np.ndarray,
                           num_draft_tokens: Sequence[int] | None) -> None:
        """With context states: the states of the prompt tokens this step computed. Row ``i``
        scheduled ``num_scheduled[i]`` tokens after its first ``num_computed[i]`` (``hidden_states``
        holds theirs in row order); a row that scheduled more than its drafts and one token holds
        prompt tokens, each of whose states produced the token after it."""
        if self.context_states is None:
            return
        drafts = np.zeros(len(num_scheduled), np.int64) if num_draft_tokens is None else np.asarray(
            num_draft_tokens, np.int64)[: len(num_scheduled)]
        prompt_rows = np.flatnonzero(num_scheduled > drafts + 1)
        if not len(prompt_rows):
            return
        starts = np.cumsum(num_scheduled) - num_scheduled
        counts = num_scheduled[prompt_rows]
        row = np.repeat(prompt_rows, counts)
        offset = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        index = torch.from_numpy(starts[row] + offset).to(hidden_states.device)
        self.context_states.write(self.step_req_ids, row, num_computed[row] + offset + 1,
                                  hidden_states[index].float().cpu().numpy())

    def _producing_rows(self, num_draft_tokens: Sequence[int] | None,
                        sampled_token_ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """``[rows, width]``: the row of ``sample_hidden_states`` that produced each row's ``j``-th
        sampled token (valid for ``j`` below the row's count, the second array). It holds one row
        per request without drafts, ``n + 1`` with ``n`` drafts; in tree mode token ``j > 0`` was
        produced by the ``j``-th accepted node's row, not the ``j``-th."""
        rows = len(sampled_token_ids)
        sampled = np.fromiter(map(len, sampled_token_ids), dtype=np.int64, count=rows)
        if num_draft_tokens is None:
            return np.arange(rows, dtype=np.int64)[:, None], np.minimum(sampled, 1)
        width = max(int(sampled.max(initial=0)), 1)
        offsets = np.tile(np.arange(width, dtype=np.int64), (rows, 1))
        per_request = np.asarray(num_draft_tokens, dtype=np.int64)[:rows] + 1
        starts = np.concatenate([[0], np.cumsum(per_request)[:-1]])
        if self._accepted_paths is not None and self._accepted_paths[0] == self.step - 1:
            _, path_nodes, _ = self._accepted_paths
            tree_rows, depth = min(len(path_nodes), rows), min(width - 1, path_nodes.shape[1])
            offsets[:tree_rows, 1:1 + depth] = path_nodes[:tree_rows, :depth] + 1
        return starts[:, None] + offsets, sampled

    def publish(self, trees: Mapping[int, DraftTree], draft_q: Mapping[int, DraftQ] | None = None) -> None:
        """This step's trees that branch and chains drawn from ``draft_q``, by input-batch row
        (other rows' drafts are verified as the chains they are); older ones are never verified."""
        draft_q = draft_q or {}
        if trees:
            self._trees_published_step = self.step
        for row, tree in trees.items():
            state = self.requests.setdefault(self.step_req_ids[row], RequestState())
            state.tree, state.draft_q, state.tree_step = tree, draft_q.get(row), self.step

    def learns_from_finished_tokens(self) -> bool:
        """Whether :meth:`release` wants the finished requests' tokens."""
        return self.output_index is not None or self.learned_dense is not None

    def release(self, req_ids: Iterable[str], tokens: Mapping[str, np.ndarray] | None = None) -> None:
        """Forget finished or aborted requests; their ``tokens`` (prompt and output, by request
        id, of those still in the input batch) go to the output index and the learned dense
        index."""
        tokens = tokens or {}
        if self.output_index is not None:
            for sequence in tokens.values():
                self.output_index.add(sequence)
        req_ids = list(req_ids)
        if self.learned_dense is not None:
            self.learned_dense.finish(tokens)
            self.learned_dense.forget(req_id for req_id in req_ids if req_id not in tokens)
        if self.context_states is not None:
            self.context_states.release(req_ids)
        for req_id in req_ids:
            self.requests.pop(req_id, None)
        self.unspeculated.difference_update(req_ids)
        self.constrained.difference_update(req_ids)
        if self.live_index is not None:
            self.live_index.remove(req_ids)

    def follow_live_index(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> None:
        """Bring the live index (when there is one) up to every row's tokens so far
        (``token_ids`` and ``num_tokens``: vLLM's buffers for this step's rows)."""
        if self.live_index is not None:
            self.live_index.update(self.step_req_ids, token_ids, num_tokens)

    def live_matches(self, token_ids: np.ndarray, num_tokens: np.ndarray, rows: np.ndarray, max_matches: int,
                     cont_len: int, num_threads: int = 0) -> LiveMatches | None:
        """Search the live index (followed this step by :meth:`follow_live_index`) for
        ``rows``; None without one."""
        if self.live_index is None:
            return None
        return self.live_index.lookup(self.step_req_ids, token_ids, num_tokens, rows, max_matches, cont_len,
                                      num_threads)

    def tree_for(self, req_id: str, scheduled_tokens: Sequence[int]) -> tuple[DraftTree, DraftQ | None]:
        """The tree behind the tokens the scheduler sent back (it may keep only a prefix) and,
        for drawn candidates, their distributions; a chain of deterministic candidates when the
        tokens are not this step's tree (then a chain is what they are)."""
        state = self.requests.get(req_id)
        if state is None or state.tree is None or state.tree_step != self.step or not state.tree.matches(
                scheduled_tokens):
            return DraftTree.chain(scheduled_tokens), None
        n = len(scheduled_tokens)
        return state.tree.truncated(n), None if state.draft_q is None else state.draft_q.truncated(n)

    # ------------------------------------------------------------- verification side

    def plan_step(self, runner: GPUModelRunner, spec_tokens: Mapping[str, Sequence[int]]) -> None:
        """Build this step's plan when our sampler verifies it (a tree branches, a request
        that samples has drafts, or a request samples with a seed) and move branching trees'
        rotary positions to ``base + depth``. Runs after vLLM's ``_prepare_inputs``."""
        self.plan = self._kv_layout = None
        self._kv_groups = {}
        self._sampled_tokens = 0
        self._tree_work = 0.0
        batch = runner.input_batch
        keyed = bool(batch.generators)  # seeded sampling: our sampler draws each of their tokens
        if not (spec_tokens or keyed):
            return
        num_reqs = batch.num_reqs
        samples = batch.temperature_cpu[:num_reqs] > 0
        if not (self._trees_published_step == self.step or samples.any()):
            return  # chains of greedy requests (no tree of this step branches): vLLM's sampler verifies them exactly
        req_ids = batch.req_ids[:num_reqs]
        scheduled = [spec_tokens.get(req_id, ()) for req_id in req_ids]
        drafted = [self.tree_for(req_id, without_placeholders(tokens)) for req_id, tokens in zip(req_ids, scheduled)]
        plan = TreeStepPlan.build([tree for tree, _ in drafted], runner.query_start_loc.np[:num_reqs],
                                  [q for _, q in drafted], np.fromiter(map(len, scheduled), np.int64, num_reqs))
        plan.positions = batch.num_tokens_no_spec[:num_reqs].astype(np.int64)
        self._sampled_tokens = int(plan.sizes[samples].sum())
        if plan.is_branching():
            self._plan_tree_attention(runner, plan)
        elif not (keyed or (plan.sizes > 0)[samples].any()):
            return
        self.plan = plan

    def _plan_tree_attention(self, runner: GPUModelRunner, plan: TreeStepPlan) -> None:
        """Depth positions, KV slots and context lengths of a step whose trees branch."""
        num_reqs = runner.input_batch.num_reqs
        device = runner.positions.device
        node_rows = torch.from_numpy(plan.node_rows()).to(device)
        roots = torch.from_numpy(np.repeat(plan.query_starts, plan.sizes)).to(device)
        depth = torch.from_numpy(plan.depth).to(device, runner.positions.dtype)
        runner.positions[node_rows] = runner.positions[roots] + depth
        self._context_lens = runner.input_batch.num_computed_tokens_cpu[:num_reqs] + 1
        self._tree_work = float(tree_work(plan.off_chain_counts(), self._context_lens).sum())
        self.stats.tree_steps += 1
        self.stats.tree_requests += int((plan.sizes > 0).sum())
        self.stats.branching_requests += int(plan.branching.sum())

    def attends(self, metadata: object) -> bool:
        """Whether this step's attention layers recompute tree rows (some tree branches)."""
        return self.plan is not None and metadata is not None and self.plan.is_branching()

    def attend(self, tree_layer: ops.TreeLayer, query: torch.Tensor, kv_cache: torch.Tensor, metadata: object,
               output: torch.Tensor) -> None:
        """Recompute the draft rows of this step's branching trees with the tree mask (and the
        layer's sliding window, soft-cap and sinks) unless the step attention computed them; the
        layers of one KV cache group share ``metadata``, and with it the group's node arrays and
        slots."""
        group = self._kv_group(metadata)
        self._kv_layout = tree_layer.layout
        group.add_cache(kv_cache)
        if self.step_attention is None or not self.step_attention.take_computed_tree_rows():
            ops.apply_tree_attention(query, kv_cache, output, group.nodes, tree_layer)

    def tree_rows(self, metadata: object) -> TreeNodes | None:
        """The nodes :meth:`attend` recomputes in this step's group (on the CPU build), which the
        step attention computes with their tree's ancestors; None when no tree branches."""
        return self._kv_group(metadata).nodes if self.attends(metadata) else None

    def _kv_group(self, metadata: object) -> ops.TreeKVGroup:
        group = self._kv_groups.get(id(metadata))
        if group is None:
            group = self._kv_groups[id(metadata)] = ops.TreeKVGroup.build(self.plan, self._context_lens, metadata)
        return group

    def finish_step(self, path_nodes: np.ndarray, num_accepted: np.ndarray) -> None:
        """Move each accepted node's K/V into the draft slot of its depth in every KV cache
        group (each in the caches its layers wrote this step), then retire the plan."""
        plan, self.plan = self.plan, None
        if plan is None:
            return
        self._accepted_paths = (self.step, path_nodes, num_accepted)
        if not plan.is_branching():
            return
        if self._kv_layout is None:
            raise TreeModeError(
                "this step verified draft trees but no attention layer applied the tree mask: the "
                "attention backend is not one tree verification supports (CPU_ATTN on the CPU build, "
                "FLASH_ATTN or TRITON_ATTN on GPUs; pick one with --attention-backend) or use chain mode"
            )
        sources, destinations = plan.accepted_moves(path_nodes, num_accepted)
        self.stats.compacted_slots += len(sources)
        if len(sources):
            moves = torch.from_numpy(np.stack([sources, destinations], axis=1))
            for group in self._kv_groups.values():
                group.compact(self.head_size, self._kv_layout, moves)

    def check_layout(self, layer: object, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     metadata: object, layout: KVLayout) -> None:
        """Once per runner, at the first layer that attends: the cache holds the keys and
        values the backend just wrote where tree attention reads them."""
        if layout is KVLayout.CPU_VEC:
            ops.require_cpu_isa(layer.isa)
        n = metadata.num_actual_tokens
        ops.check_layout(kv_cache, layout, metadata.slot_mapping[:n].long(), key[:n], value[:n])
        self.layout_checked = True
