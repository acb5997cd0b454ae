"""What verifying a draft token costs on the real engine, and where: the decode steps of
in-process vLLM engines (SmolLM2-135M fp32) under torch's profiler, the model's GEMMs
(``_C::onednn_mm``, LM head included) and attention (``_C::cpu_attention_with_kv_cache``) grouped
by the tokens a step computes (1: no drafts; 1 + k: a request verifying k drafts), one request at
a time. vLLM's ``ngram`` method (k drafts wherever the context repeats) makes the steps of each
size; prefills (steps of more than ``--max-step-tokens`` tokens) are left out. This is the price
the goodput budget weighs every draft token against: a few percent of a step on the 2-core CPU,
~0.4% on an H100 (``verify_cost_h100.json``).

    python benchmarks/verify_profile.py --dataset benchmarks/data/code_edit.jsonl --prompts 2 --k 0 4 8 16

Writes results/verify_profile_<dataset>[_<tag>].json and prints milliseconds per step by step size.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import defaultdict
from pathlib import Path

from acceptance import RESULTS, dataset_prompts, ngram_config

from vllm_retrieval_spec.evaluation.engine import EngineSpec, build_llm, generate, shutdown_llm
from vllm_retrieval_spec.models import ensure_smollm2_checkpoint

# The per-layer kernels profiled, the label each is reported under, and which input's rows are
# the step's tokens (onednn_mm(out, x, bias, handler); attention(query, ...)).
KERNELS = {"_C::onednn_mm": ("gemm", 1), "_C::cpu_attention_with_kv_cache": ("attention", 0)}


def kernel_totals(model: Path, k: int, prompts: list[str], max_tokens: int) -> dict[tuple[str, int], list[float]]:
    """``(kernel label, step tokens) -> [milliseconds, calls]`` over the prompts, one at a time."""
    from torch.profiler import ProfilerActivity, profile

    speculative = ngram_config(k)["speculative_config"] if k else None  # k = 0: no speculation
    llm = build_llm(EngineSpec(model, speculative, max_num_seqs=1))
    try:
        generate(llm, prompts[:1], 8)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            generate(llm, prompts, max_tokens, concurrency=1)
    finally:
        shutdown_llm(llm)
    totals: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key not in KERNELS or not event.input_shapes:
            continue
        label, argument = KERNELS[event.key]
        entry = totals[(label, event.input_shapes[argument][0])]
        entry[0] += event.self_cpu_time_total / 1000
        entry[1] += event.count
    return totals


def per_step(totals: dict[tuple[str, int], list[float]], layers: int, max_step_tokens: int) -> dict[int, dict]:
    """Per step size: steps seen and each kernel's milliseconds per step (a step runs attention
    once per layer)."""
    rows: dict[int, dict] = {}
    for tokens in sorted({t for _, t in totals if t <= max_step_tokens}):
        attention_ms, attention_calls = totals.get(("attention", tokens), (0.0, 0))
        if attention_calls < layers:
            continue
        steps = attention_calls / layers
        gemm_ms = totals.get(("gemm", tokens), (0.0, 0))[0]
        rows[tokens] = {"steps": round(steps), "gemm_ms": gemm_ms / steps, "attention_ms": attention_ms / steps,
                        "total_ms": (gemm_ms + attention_ms) / steps}
    return rows


def merged(reports: list[dict[int, dict]]) -> dict[int, dict]:
    """Every step size's figures from the engine that ran it most often."""
    best: dict[int, dict] = {}
    for report in reports:
        for tokens, row in report.items():
            if tokens not in best or row["steps"] > best[tokens]["steps"]:
                best[tokens] = row
    return dict(sorted(best.items()))


def print_table(rows: dict[int, dict]) -> None:
    """Milliseconds per step by step size, and per draft token against a step of one token."""
    base = rows.get(1)
    print(f"{'step tokens':>11s} {'steps':>6s} {'GEMM ms':>8s} {'attn ms':>8s} {'total ms':>9s} "
          f"{'ms per draft token':>19s} {'% of a 1-token step':>20s}")
    for tokens, row in rows.items():
        extra = (row["total_ms"] - base["total_ms"]) / (tokens - 1) if base and tokens > 1 else None
        share = f"{100 * extra / base['total_ms']:19.1f}%" if extra is not None else f"{'':>20s}"
        print(f"{tokens:11d} {row['steps']:6d} {row['gemm_ms']:8.1f} {row['attention_ms']:8.1f} {row['total_ms']:9.1f} "
              f"{'' if extra is None else f'{extra:.2f}':>19s} {share}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, default=Path(__file__).resolve().parent / "data" / "code_edit.jsonl")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, nargs="+", default=[0, 4, 8, 16],
                        help="ngram drafts per step of each engine (0: no speculation)")
    parser.add_argument("--max-step-tokens", type=int, default=64, help="larger steps are prefills: left out")
    parser.add_argument("--tag", default="")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    model = ensure_smollm2_checkpoint()
    from transformers import AutoConfig, AutoTokenizer

    layers = AutoConfig.from_pretrained(model).num_hidden_layers
    prompts = dataset_prompts(args.dataset, args.prompts, AutoTokenizer.from_pretrained(model))
    rows = merged([per_step(kernel_totals(model, k, prompts, args.max_tokens), layers, args.max_step_tokens)
                   for k in args.k])
    print_table(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"verify_profile_{args.dataset.stem}{'_' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps({
        "dataset": args.dataset.name, "prompts": args.prompts, "max_tokens": args.max_tokens, "k": args.k,
        "model": "SmolLM2-135M-Instruct (float32)", "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"), "per_step_tokens": rows,
    }, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
