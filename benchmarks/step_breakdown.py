"""Where a speculative step's time goes, per config, on the real model (in-process vLLM, fp32):
wall-clock time per step of the runner's phases (the forward, sampling and verification, our
drafting, input preparation, the scheduler) and, for our proposers, of the parts of drafting
(the goodput budget's search skip, choice and read-back, the drafter's search, the metrics), and
how many steps computed the language-model head on its screened path.
Every config's engine is built at once and the prompts run in groups of ``--concurrency``, every
engine in turn with the order rotating (as ``acceptance.py --interleave``), so that the
machine's drift falls on all alike. Methods are timed by plain wrappers (no profiler: a profiler
inflates the many small calls of the drafting path several times).

    python benchmarks/step_breakdown.py --dataset benchmarks/data/code_edit.jsonl --prompts 16 \\
        --max-tokens 96 --concurrency 1 --configs none suffix rest_k32

Writes results/step_breakdown_<dataset>_n<prompts>_t<tokens>_c<concurrency>[_<tag>].json and
prints milliseconds per engine step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import acceptance
from acceptance import (
    RESULTS,
    base_config,
    build_llm,
    configured,
    dataset_prompts,
    generate,
    interleaved_turns,
    shutdown_llm,
)

from vllm_retrieval_spec.drafts import DraftArrays, DraftNodes
from vllm_retrieval_spec.goodput.budget import GoodputBudget
from vllm_retrieval_spec.goodput.calibration import AcceptanceCalibration
from vllm_retrieval_spec.goodput.cost_model import StepCostModel
from vllm_retrieval_spec.integration.metrics import RunnerMetrics
from vllm_retrieval_spec.models import ensure_smollm2_checkpoint
from vllm_retrieval_spec.proposers import rest
from vllm_retrieval_spec.proposers.base import DraftProposer
from vllm_retrieval_spec.verification.session import SpecSession

# The runner's phases (per-engine wrappers) and the scheduler's.
RUNNER_PHASES = ("execute_model", "_model_forward", "_prepare_inputs", "sample_tokens", "_sample",
                 "propose_draft_token_ids", "_bookkeeping_sync", "_update_states")
SCHEDULER_PHASES = ("schedule", "update_from_output")
# Our drafting path's parts (class-level wrappers: only our proposers' engines reach them).
DRAFTING_PARTS: tuple[tuple[object, str, str], ...] = (
    (DraftProposer, "propose", "propose (all of drafting)"),
    (DraftProposer, "_rows_needing_drafts", "rows needing drafts"),
    (rest, "rest_retrieve", "REST kernel (search, trie, selection)"),
    (SpecSession, "live_matches", "live index search"),
    (SpecSession, "follow_live_index", "live index update"),
    (DraftArrays, "nodes", "candidate nodes"),
    (GoodputBudget, "observe", "budget: outcomes read back"),
    (GoodputBudget, "worth_searching", "budget: search skip"),
    (AcceptanceCalibration, "chance_table", "budget: chance table"),
    (GoodputBudget, "choose", "budget: choice"),
    (DraftNodes, "kept", "kept nodes"),
    (SpecSession, "begin_step", "step start (cost model)"),
    (StepCostModel, "observe", "cost model fit"),
    (RunnerMetrics, "publish", "metrics"),
)


class Clock:
    """Seconds and calls per label, from wrapped methods."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner: object, name: str, label: str) -> None:
        """Time ``owner.name`` (an instance's method or a class's function) under ``label``."""
        original: Callable = getattr(owner, name)
        if isinstance(vars(owner).get(name), staticmethod):
            raise TypeError(f"{name} is a staticmethod: time its callers instead")

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def per_step(self, steps: int) -> dict[str, dict[str, float]]:
        return {label: {"ms_per_step": 1000 * seconds / max(steps, 1), "calls": self.calls[label]}
                for label, seconds in sorted(self.seconds.items(), key=lambda item: -item[1])}


def runner_of(llm) -> object:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def timed_engine(model: Path, name: str, args: argparse.Namespace) -> tuple[object, Clock]:
    """``name``'s engine with its runner's and scheduler's phases timed."""
    _, spec = configured(model, name, args)
    llm = build_llm(spec)
    clock = Clock()
    runner = runner_of(llm)
    for phase in RUNNER_PHASES:
        if hasattr(runner, phase):
            clock.wrap(runner, phase, phase)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    for phase in SCHEDULER_PHASES:
        clock.wrap(scheduler, phase, f"scheduler.{phase}")
    return llm, clock


def measure(model: Path, names: list[str], prompts: list[str], args: argparse.Namespace) -> dict:
    """Every config's phases and our drafting parts, in ms per engine step."""
    parts = Clock()
    for owner, method, label in DRAFTING_PARTS:
        parts.wrap(owner, method, label)
    engines = {name: timed_engine(model, name, args) for name in names}
    drafting = {name: Clock() for name in names}
    screened = {}
    try:
        for llm, clock in engines.values():
            generate(llm, prompts[:1], 8)
            clock.clear()
        size = max(args.concurrency, 1)
        wall = dict.fromkeys(names, 0.0)
        for start, name in interleaved_turns(names, len(prompts), size):
            parts.clear()
            began = time.perf_counter()
            generate(engines[name][0], prompts[start:start + size], args.max_tokens, concurrency=args.concurrency)
            wall[name] += time.perf_counter() - began
            for label, seconds in parts.seconds.items():
                drafting[name].seconds[label] += seconds
                drafting[name].calls[label] += parts.calls[label]
        for name, (llm, _) in engines.items():
            head = getattr(runner_of(llm), "vrs_screened_head", None)
            screened[name] = None if head is None else head.screened_calls
    finally:
        for llm, _ in engines.values():
            shutdown_llm(llm)
    results = {}
    for name, (_, clock) in engines.items():
        steps = clock.calls["execute_model"]
        results[name] = {"seconds": wall[name], "steps": steps, "screened_head_calls": screened.get(name),
                         "phases": clock.per_step(steps), "drafting_parts": drafting[name].per_step(steps)}
    return results


def print_table(results: dict) -> None:
    names = list(results)
    labels = list(dict.fromkeys(label for r in results.values() for part in ("phases", "drafting_parts")
                                for label in r[part]))
    print(f"{'ms per engine step':40s}" + "".join(f"{name:>16s}" for name in names))
    print(f"{'wall seconds':40s}" + "".join(f"{results[n]['seconds']:16.2f}" for n in names))
    print(f"{'engine steps':40s}" + "".join(f"{results[n]['steps']:16d}" for n in names))
    screened = ["-" if results[n]["screened_head_calls"] is None else results[n]["screened_head_calls"] for n in names]
    print(f"{'steps on the screened head':40s}" + "".join(f"{calls:>16}" for calls in screened))
    for label in labels:
        cells = []
        for name in names:
            entry = results[name]["phases"].get(label) or results[name]["drafting_parts"].get(label)
            cells.append(f"{entry['ms_per_step']:16.3f}" if entry else f"{'':16s}")
        print(f"{label:40s}" + "".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, required=True, help="JSONL of chat `messages` (or raw `prompt`) "
                        "records, e.g. benchmarks/data/code_edit.jsonl")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    parser.add_argument("--configs", nargs="+", default=["none", "suffix", "rest_k32"],
                        help=f"from {', '.join(acceptance.CONFIGS)}")
    parser.add_argument("--tag", default="", help="suffix of the result file name")
    args = parser.parse_args()
    args.option, args.seed = [], None  # what acceptance.configured reads
    unknown = [name for name in args.configs if base_config(name) not in acceptance.CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(acceptance.CONFIGS)}")

    model = ensure_smollm2_checkpoint()
    from transformers import AutoTokenizer

    prompts = dataset_prompts(args.dataset, args.prompts, AutoTokenizer.from_pretrained(model))
    results = measure(model, list(dict.fromkeys(args.configs)), prompts, args)
    report = {"dataset": args.dataset.stem, "prompts": len(prompts), "max_tokens": args.max_tokens,
              "concurrency": args.concurrency, "model": "SmolLM2-135M-Instruct (float32)",
              "machine": platform.machine(), "processor_count": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "results": results}
    tag = f"_{args.tag}" if args.tag else ""
    path = RESULTS / (f"step_breakdown_{args.dataset.stem}_n{len(prompts)}_t{args.max_tokens}"
                      f"_c{args.concurrency}{tag}.json")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print_table(results)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
