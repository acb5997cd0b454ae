"""The screened language-model head against the full one, on the real model's head weight: the
same random hidden states of each row count (a step's tokens) through ``ScreenedHead`` (its
bfloat16 copy in k-pairs for the dot product where the CPU has AVX512_BF16, and plain on 16- and
8-lane blocks) and through the full float32 head the engine runs otherwise (``SkinnyLinear`` up
to the default ``cpu_gemm_max_rows``, vLLM's oneDNN matmul past it; the dot product screens up
to 256 rows), alternating ``--repeats`` times (medians kept, so that the machine's drift falls on all alike),
with every screened argmax compared against the full one.

    python benchmarks/screened_head.py --rows 1 4 8 16 24 32
    python benchmarks/screened_head.py --model gemma3 --rows 1 8 16 32
    python benchmarks/screened_head.py --rows 32 48 64 96 128 192 256

Writes results/screened_head[_gemma3][_<tag>].json and prints milliseconds a head call by row count.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from acceptance import MODELS, RESULTS, model_tag
from safetensors import safe_open

from vllm_retrieval_spec import _C
from vllm_retrieval_spec.kernels.skinny_gemm import ScreenedHead, SkinnyLinear
from vllm_retrieval_spec.options import RetrievalSpecOptions

HEAD_KEYS = ("lm_head.weight", "model.embed_tokens.weight")  # tied heads keep only the embedding


def head_weight(model: str) -> torch.Tensor:
    """The model's head weight ``[vocab, hidden]`` in float32, from its converted checkpoint."""
    checkpoint = MODELS[model][0]()
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), "pt") as tensors:
            names = set(tensors.keys())
            for key in HEAD_KEYS:
                if key in names:
                    return tensors.get_tensor(key).to(torch.float32).contiguous()
    raise SystemExit(f"screened_head: no {' or '.join(HEAD_KEYS)} in {checkpoint}")


def onednn_head(weight: torch.Tensor):
    """The head as vLLM's CPU GEMM dispatch runs it past the skinny GEMM's rows (oneDNN's matmul)."""
    from vllm import _custom_ops as ops

    if not hasattr(ops, "create_onednn_mm"):
        raise SystemExit("screened_head: this vLLM has no oneDNN matmul (a CPU build of vLLM is needed)")
    handler = ops.create_onednn_mm(weight.t(), 32)
    return lambda x, weight, bias: ops.onednn_mm(handler, x, bias)


def ways(weight: torch.Tensor) -> dict[str, tuple[object, bool]]:
    """Each head to time by name, and whether it runs on the 16-lane blocks."""
    rows, fallback, vocab = RetrievalSpecOptions().cpu_gemm_max_rows, onednn_head(weight), weight.shape[0]
    found = {"full": (SkinnyLinear(weight, fallback, rows), True),
             "screened, 16 lanes": (ScreenedHead(weight, fallback, rows, vocab, pairs=False), True),
             "screened, 8 lanes": (ScreenedHead(weight, fallback, rows, vocab, pairs=False), False)}
    if _C.screened_head_pairs():
        found["screened, dot product"] = (ScreenedHead(weight, fallback, rows, vocab, pairs=True), True)
    return found


def call(head: object, x: torch.Tensor, weight: torch.Tensor, wide: bool) -> tuple[float, torch.Tensor]:
    _C.use_wide_lanes(wide)
    if isinstance(head, ScreenedHead):
        head.screen_next(True)
    start = time.perf_counter()
    out = head(x, weight, None)
    return time.perf_counter() - start, out


def measure(weight: torch.Tensor, rows: list[int], repeats: int) -> dict[int, dict[str, float]]:
    heads = ways(weight)
    table = {}
    generator = torch.Generator().manual_seed(0)
    for count in rows:
        x = torch.randn(count, weight.shape[1], generator=generator) * 2
        seconds = {name: [] for name in heads}
        for _ in range(repeats):
            full = None
            for name, (head, wide) in heads.items():
                elapsed, out = call(head, x, weight, wide)
                seconds[name].append(elapsed)
                full = out if full is None else full
                if not torch.equal(out.argmax(dim=1), full.argmax(dim=1)):
                    raise SystemExit(f"screened_head: {name} at {count} rows took another argmax")
        table[count] = {name: 1000 * statistics.median(times) for name, times in seconds.items()}
        table[count].update({f"{name} / full": table[count][name] / table[count]["full"] for name in heads
                             if name != "full"})
    _C.use_wide_lanes(True)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16, 20, 24, 32])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    weight = head_weight(args.model)
    table = measure(weight, args.rows, args.repeats)
    names = [name for name in table[args.rows[0]] if "/" not in name]
    print(f"head {tuple(weight.shape)}, ms a call (median of {args.repeats}); ratio to the full head")
    print(f"{'rows':>5s}" + "".join(f"{name:>24s}" for name in names))
    for count, row in table.items():
        cells = [f"{row[name]:8.2f}" + (f" ({row[name + ' / full']:.2f}x)" if name != "full" else "")
                 for name in names]
        print(f"{count:5d}" + "".join(f"{cell:>24s}" for cell in cells))
    out = RESULTS / f"screened_head{model_tag(args.model)}{'_' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps({"model": MODELS[args.model][1], "head_shape": list(weight.shape),
                               "machine": platform.machine(), "processor_count": torch.get_num_threads(),
                               "date": time.strftime("%Y-%m-%d %H:%M"), "repeats": args.repeats,
                               "ms_per_call": {str(k): v for k, v in table.items()}}, indent=1) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
