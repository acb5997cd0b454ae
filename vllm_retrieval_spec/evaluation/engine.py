"""In-process vLLM engines on the real model, with per-request decode-step counting.

Call :func:`vllm_retrieval_spec.compat.configure_vllm_environment` before vLLM is imported.
Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so tests can reach the
proposer object), in float32 and eager mode by default: reduced precision and compiled
graphs can change greedy token ids between batch shapes, and with and without speculation
the token ids must be compared exactly.
"""

from __future__ import annotations

import gc
import itertools
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_retrieval_spec.evaluation.metrics import GenerationRecord, SpecDecodeCounters

if TYPE_CHECKING:
    from vllm import LLM, SamplingParams

    from vllm_retrieval_spec.proposers.base import DraftProposer


@dataclass(frozen=True)
class EngineSpec:
    """How to build one engine: the model and, optionally, a speculative configuration."""

    model: str | Path
    speculative_config: Mapping[str, Any] | None = None
    additional_config: Mapping[str, Any] | None = None
    max_num_seqs: int = 8
    max_model_len: int = 2048
    dtype: str = "float32"
    seed: int = 0
    block_size: int | None = None  # KV cache block (None: the platform's); prefix caching reuses full blocks
    max_num_batched_tokens: int | None = None  # tokens per step (None: vLLM's); longer prompts are chunked
    per_request_spec_decode_metrics: str | None = None  # vLLM's per-request acceptance ("summary", "detailed")


def build_llm(spec: EngineSpec) -> LLM:
    """An in-process ``vllm.LLM`` with stats enabled, counting its own spec-decode stats."""
    from vllm import LLM

    llm = LLM(
        model=str(spec.model),
        dtype=spec.dtype,
        enforce_eager=True,
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        speculative_config=dict(spec.speculative_config) if spec.speculative_config else None,
        additional_config=dict(spec.additional_config or {}),
        disable_log_stats=False,
        seed=spec.seed,
        **{key: value for key, value in (("block_size", spec.block_size),
                                         ("max_num_batched_tokens", spec.max_num_batched_tokens),
                                         ("per_request_spec_decode_metrics", spec.per_request_spec_decode_metrics))
           if value is not None},
    )
    _count_spec_decoding(llm)
    return llm


def _count_spec_decoding(llm: LLM) -> None:
    """Add up this engine's spec-decode stats as its steps record them (read by
    :func:`spec_decode_counters`): vLLM's Prometheus registry keeps only the counters of the
    last engine built in a process, and ``acceptance.py --interleave`` runs several at once."""
    manager = llm.llm_engine.logger_manager
    original = manager.record
    totals = [0, 0, 0]

    def record(*args, scheduler_stats=None, **kwargs):
        stats = getattr(scheduler_stats, "spec_decoding_stats", None)
        if stats is not None:
            totals[0] += stats.num_drafts
            totals[1] += stats.num_draft_tokens
            totals[2] += stats.num_accepted_tokens
        return original(*args, scheduler_stats=scheduler_stats, **kwargs)

    manager.record = record
    llm.vrs_spec_decode_totals = totals


def shutdown_llm(llm: LLM) -> None:
    """Shut an in-process engine's core down and collect it, so that the next one built does
    not hold its KV cache and workers beside this one's (unless both are wanted at once)."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def model_runner_of(llm: LLM) -> Any:
    """The model runner of an in-process engine (vLLM's ``GPUModelRunner`` or a subclass)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def drafter_of(llm: LLM) -> DraftProposer | None:
    """The proposer instance of an in-process engine running one of our proposers (``None``
    without speculation)."""
    return getattr(model_runner_of(llm), "drafter", None)


def spec_decode_counters(llm: LLM) -> SpecDecodeCounters:
    """This engine's spec-decode totals since it was built (take differences per run)."""
    return SpecDecodeCounters(*llm.vrs_spec_decode_totals)


def stolen_cpu_seconds() -> float:
    """CPU time the hypervisor has given to others so far, all of this machine's CPUs together
    (``steal`` in ``/proc/stat``; 0 where the kernel does not report it)."""
    try:
        with open("/proc/stat") as stat:
            return int(stat.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


@dataclass(frozen=True)
class GenerationRun:
    """Records in prompt order, the counters' change over the run, its wall time, and the CPU time
    the hypervisor took from the machine meanwhile (a stall on a shared VM, not the engine's)."""

    records: list[GenerationRecord]
    counters: SpecDecodeCounters
    seconds: float
    stolen_seconds: float = 0.0

    @property
    def generated_tokens(self) -> int:
        """The tokens generated over all records."""
        return sum(len(record.output_ids) for record in self.records)


_request_ids = itertools.count()


def request_params(
    count: int, max_tokens: int, seeds: Sequence[int] | None, sampling: Mapping[str, Any],
    extra_args: Sequence[Mapping[str, Any] | None] | None = None,
) -> list[SamplingParams]:
    """Each request's sampling parameters: ``sampling`` (greedy unless it sets a temperature),
    with request ``i`` seeded by ``seeds[i]`` and given ``extra_args[i]`` when they are given."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    for name, per_request, shared_key in (("seeds", seeds, "seed"), ("extra_args", extra_args, "extra_args")):
        if per_request is not None and (len(per_request) != count or shared_key in sampling):
            raise ValueError(f"{name}: give one per prompt ({len(per_request)} for {count}) and no "
                             f"{shared_key}= beside them")
    shared = {"temperature": 0.0, **sampling, "max_tokens": max_tokens, "output_kind": RequestOutputKind.DELTA}
    if seeds is None and extra_args is None:
        return [SamplingParams(**shared)] * count
    return [SamplingParams(**shared, seed=None if seeds is None else seeds[i],
                           extra_args=None if extra_args is None else extra_args[i]) for i in range(count)]


def generate(
    llm: LLM, prompts: Sequence[str], max_tokens: int, concurrency: int = 1, seeds: Sequence[int] | None = None,
    extra_args: Sequence[Mapping[str, Any] | None] | None = None, **sampling: Any,
) -> GenerationRun:
    """Generate with at most ``concurrency`` requests in flight (1 = batch 1), counting for
    every request the engine steps that gave it new tokens after its prefill; with ``seeds``,
    prompt ``i`` samples with seed ``seeds[i]``, with ``extra_args`` it carries ``extra_args[i]``."""
    params = request_params(len(prompts), max_tokens, seeds, sampling, extra_args)
    engine = llm.llm_engine
    pending = list(enumerate(prompts))[::-1]
    by_id: dict[str, dict[str, Any]] = {}
    in_flight = 0
    before = spec_decode_counters(llm)
    stolen_before = stolen_cpu_seconds()
    start = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            index, prompt = pending.pop()
            request_id = f"vrs-{next(_request_ids)}"
            by_id[request_id] = {"index": index, "prompt_ids": None, "output": [], "steps": 0}
            engine.add_request(request_id, prompt, params[index])
            in_flight += 1
        for output in engine.step():
            state = by_id[output.request_id]
            new_tokens = list(output.outputs[0].token_ids)
            if output.prompt_token_ids is not None and state["prompt_ids"] is None:
                state["prompt_ids"] = list(output.prompt_token_ids)
            if new_tokens:
                state["output"].extend(new_tokens)
                state["steps"] += 1
            if output.finished:
                in_flight -= 1
    seconds = time.perf_counter() - start
    ordered = sorted(by_id.values(), key=lambda s: s["index"])
    records = [
        GenerationRecord(s["prompt_ids"] or [], s["output"], max(s["steps"] - 1, 0)) for s in ordered
    ]
    return GenerationRun(records, spec_decode_counters(llm) - before, seconds, stolen_cpu_seconds() - stolen_before)
