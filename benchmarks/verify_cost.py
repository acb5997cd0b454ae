"""The verification cost curve a GPU engine would learn: one target step of a 7B-shaped decoder
(Llama-2-7B: 32 layers, hidden 4096, 32 heads of 128, SwiGLU MLP 11008, RMSNorm; random bf16
weights) for B requests verifying T tokens each (T = 1: no drafts) after C context tokens per
request in a per-layer KV cache, as chains (causal over the new tokens) and trees (a random
tree's ancestor mask). Each shape is captured once in a CUDA graph (as vLLM runs decode-sized
steps) and replayed; reported: the median milliseconds per step, tokens per second, and the
least-squares fit of ``t = a + b·B + c·(N − B)`` (the goodput cost model's form, N = B·T) over
the steps of at most ``--fit-tokens`` tokens — the prior a GPU engine's cost model should start
from (``goodput/cost_model.py`` ``PRIORS["cuda"]``).

    python benchmarks/verify_cost.py                        # needs a CUDA GPU, ~1 minute
    python benchmarks/verify_cost.py --layers 8 --batches 1 8 --tokens 1 8 64

Writes benchmarks/results/verify_cost_<gpu>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Shape:
    """Decoder dimensions (Llama-2-7B's by default)."""

    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    head_size: int = 128
    mlp: int = 11008


class Layer(nn.Module):
    """One pre-norm decoder layer attending over its own KV cache."""

    def __init__(self, shape: Shape, cache: torch.Tensor) -> None:
        super().__init__()
        self.shape, self.cache = shape, cache  # cache [2, B, heads, C + T_max, head_size]
        self.norm1, self.norm2 = nn.RMSNorm(shape.hidden), nn.RMSNorm(shape.hidden)
        self.qkv = nn.Linear(shape.hidden, 3 * shape.hidden, bias=False)
        self.out = nn.Linear(shape.hidden, shape.hidden, bias=False)
        self.gate_up = nn.Linear(shape.hidden, 2 * shape.mlp, bias=False)
        self.down = nn.Linear(shape.mlp, shape.hidden, bias=False)

    def forward(self, x: torch.Tensor, context: int, mask: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        heads, size = self.shape.heads, self.shape.head_size
        q, k, v = self.qkv(self.norm1(x)).view(batch, tokens, 3, heads, size).permute(2, 0, 3, 1, 4)
        self.cache[0, :batch, :, context:context + tokens] = k
        self.cache[1, :batch, :, context:context + tokens] = v
        keys = self.cache[0, :batch, :, : context + tokens]
        values = self.cache[1, :batch, :, : context + tokens]
        attended = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, tokens, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


def step_mask(tokens: int, context: int, tree: bool, rng: np.random.Generator) -> torch.Tensor:
    """``[1, 1, T, C + T]``: every context token, then each new token's ancestors-or-self (a
    chain's predecessors, or a random tree's ancestors)."""
    parents = [int(rng.integers(-1, i)) if tree else i - 1 for i in range(tokens)]
    visible = np.eye(tokens, dtype=bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            visible[node] |= visible[parent]
    mask = np.ones((tokens, context + tokens), dtype=bool)
    mask[:, context:] = visible
    return torch.from_numpy(mask)[None, None].cuda()


def time_step(layers: list[Layer], batch: int, tokens: int, context: int, mask: torch.Tensor,
              repeats: int) -> float:
    """Median milliseconds of one replayed CUDA-graph step."""
    x = torch.randn(batch, tokens, layers[0].shape.hidden, device="cuda", dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        h = x
        for layer in layers:
            h = layer(h, context, mask)
        return h

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the graph (workspace allocation, kernel selection)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    graph.reset()
    return statistics.median(times[1:])


def fit_cost(rows: list[dict], max_tokens: int) -> dict:
    """Least squares ``t = a + b·B + c·(N − B)`` (seconds) over chain steps of ≤ ``max_tokens``."""
    points = [r for r in rows if r["mode"] == "chain" and r["batch"] * r["tokens_per_request"] <= max_tokens]
    x = np.array([[1.0, r["batch"], r["batch"] * (r["tokens_per_request"] - 1)] for r in points])
    y = np.array([r["ms"] / 1e3 for r in points])
    (a, b, c), *_ = np.linalg.lstsq(x, y, rcond=None)
    worst = float(np.max(np.abs(x @ np.array([a, b, c]) - y) / y))
    return {"a": float(a), "b": float(b), "c": float(c), "max_relative_error": worst, "points": len(points),
            "max_tokens": max_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fit-tokens", type=int, default=1024, help="fit the steps of at most this many tokens")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/verify_cost.py needs a CUDA GPU")
    torch.manual_seed(0)
    shape = Shape(layers=args.layers)
    cache_shape = (2, max(args.batches), shape.heads, args.context + max(args.tokens), shape.head_size)
    with torch.device("cuda"):
        layers = [Layer(shape, torch.randn(cache_shape, dtype=torch.bfloat16)).to(torch.bfloat16)
                  for _ in range(shape.layers)]
    rng, rows = np.random.default_rng(0), []
    print(f"{'mode':>5} {'B':>3} {'T':>4} {'ms':>9} {'tokens/s':>10}")
    with torch.inference_mode():
        for mode in ("chain", "tree"):
            for batch in args.batches:
                for tokens in args.tokens:
                    mask = step_mask(tokens, args.context, mode == "tree", rng)
                    ms = time_step(layers, batch, tokens, args.context, mask, args.repeats)
                    rows.append({"mode": mode, "batch": batch, "tokens_per_request": tokens, "ms": ms,
                                 "tokens_per_s": batch * tokens / ms * 1e3})
                    print(f"{mode:>5} {batch:>3} {tokens:>4} {ms:>9.3f} {batch * tokens / ms * 1e3:>10.0f}")
    fit = fit_cost(rows, args.fit_tokens)
    print(f"fit over chain steps of ≤ {fit['max_tokens']} tokens: t = {fit['a'] * 1e3:.3f} ms + "
          f"{fit['b'] * 1e6:.1f} µs·B + {fit['c'] * 1e6:.2f} µs·(N − B) (worst error {fit['max_relative_error']:.0%})")
    gpu = torch.cuda.get_device_name()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"verify_cost_{gpu.split()[1].lower() if ' ' in gpu else 'gpu'}.json"
    meta = {"device": gpu, "torch": torch.__version__, "shape": vars(shape) | {"dtype": "bfloat16"},
            "context": args.context, "cuda_graphs": True}
    out.write_text(json.dumps({**meta, "fit": fit, "rows": rows}, indent=2))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
