"""The skinny GEMM against vLLM's oneDNN GEMM on a loaded engine's layers: an in-process engine
running ``RestProposer`` (so every float32 linear layer holds a ``SkinnyLinear``), then every layer
of the model called with the same random input of each row count through the kernel (its weights
packed on 2 MiB pages, as the engine packs them, and a copy of them on torch's own allocation) and
through the layer's own oneDNN GEMM, alternating ``--repeats`` times (best of them kept, so that the
machine's drift falls on all alike). Rows are a step's tokens: 1 at batch 1 without drafts, 1 + k
verifying k drafts, 8 + drafts at 8 in flight.

    python benchmarks/skinny_gemm.py --rows 1 2 3 5 8 12 16 24 32 40
    python benchmarks/skinny_gemm.py --model gemma3 --rows 8 32 48 64 96

Writes results/skinny_gemm[_gemma3][_<tag>].json and prints milliseconds per model step by row count.
"""

from __future__ import annotations

import argparse
import copy as copy_module
import json
import platform
import time

from acceptance import MODELS, RESULTS, model_tag

from vllm_retrieval_spec.evaluation.engine import EngineSpec, build_llm, model_runner_of, shutdown_llm


def kernel_copy(linear, rows: int, small_pages: bool = False):
    """``linear`` taking calls of ``rows`` rows to the kernel whatever the engine's
    ``cpu_gemm_max_rows`` (past it the engine's layer hands them to oneDNN), with its packed weight
    copied to torch's allocator (4 KiB pages under transparent huge pages' ``madvise`` mode) if
    ``small_pages``."""
    copy = copy_module.copy(linear)
    copy.max_rows = max(rows, linear.max_rows)
    if small_pages:
        copy.packed = linear.packed.clone()
    return copy


def layer_times(linears: list, rows: int, repeats: int) -> dict[str, float]:
    """Best milliseconds of one pass over ``linears`` (``SkinnyLinear``s) with ``rows`` rows, through
    the kernel on the engine's packed weights and on their small-page copies, and through each
    layer's own GEMM, alternating."""
    import torch

    inputs = [torch.randn(rows, linear.in_features) for linear in linears]
    calls = {"skinny": [kernel_copy(linear, rows) for linear in linears],
             "skinny_small_pages": [kernel_copy(linear, rows, small_pages=True) for linear in linears],
             "onednn": [linear.fallback for linear in linears]}
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, layers in calls.items():
            start = time.perf_counter()
            for layer, x in zip(layers, inputs):
                layer(x, None, None)
            best[name] = min(best[name], (time.perf_counter() - start) * 1000)
    return best


def print_table(title: str, table: dict[int, dict[str, float]]) -> None:
    """Milliseconds of each GEMM by row count, and their ratios."""
    print(title)
    print(f"{'rows':>5} {'skinny':>8} {'4K pages':>9} {'oneDNN':>8} {'oneDNN÷skinny':>14} {'4K÷2M pages':>12}")
    for rows, times in table.items():
        skinny, small = times["skinny"], times["skinny_small_pages"]
        print(f"{rows:>5} {skinny:>8.1f} {small:>9.1f} {times['onednn']:>8.1f} {times['onednn'] / skinny:>14.2f} "
              f"{small / skinny:>12.2f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 8, 12, 16, 24, 32, 40])
    parser.add_argument("--repeats", type=int, default=7, help="passes per GEMM and row count (best kept)")
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="the engine's model")
    parser.add_argument("--tag", default="")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from vllm_retrieval_spec.kernels.skinny_gemm import SkinnyLinear

    speculative = {"model": "vllm_retrieval_spec.RestProposer", "num_speculative_tokens": 32}
    llm = build_llm(EngineSpec(MODELS[args.model][0](), speculative, max_num_seqs=1))
    try:
        linears = [module.cpu_linear for module in model_runner_of(llm).model.modules()
                   if isinstance(getattr(module, "cpu_linear", None), SkinnyLinear)]
        if not linears:
            raise SystemExit("skinny_gemm: the engine's layers do not run the skinny GEMM on this CPU (it needs "
                             "x86 with AVX2 and a float32 model); nothing to compare")
        largest = max(linears, key=lambda linear: linear.packed.numel())
        table = {rows: layer_times(linears, rows, args.repeats) for rows in args.rows}
        largest_table = {rows: layer_times([largest], rows, args.repeats) for rows in args.rows}
    finally:
        shutdown_llm(llm)
    print_table(f"{len(linears)} layers; milliseconds per pass over all of them (best of {args.repeats})", table)
    print_table(f"the largest layer alone ({largest.out_features} x {largest.in_features})", largest_table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"skinny_gemm{model_tag(args.model)}{'_' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps({
        "model": MODELS[args.model][1], "machine": platform.machine(), "layers": len(linears),
        "repeats": args.repeats, "date": time.strftime("%Y-%m-%d %H:%M"),
        "milliseconds_per_pass": {str(rows): times for rows, times in table.items()},
        "largest_layer": {"out_features": largest.out_features, "in_features": largest.in_features,
                          "milliseconds": {str(rows): times for rows, times in largest_table.items()}},
    }, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
