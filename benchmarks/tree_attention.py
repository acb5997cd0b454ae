"""Tree attention per layer: our paged kernel vs gathering each request's context out of the
cache and running one masked SDPA (what the tree step did before the kernel), same inputs.

R branching trees of N nodes (two roots, then a chain; the kernel recomputes all but the first
root, the tree's leading chain) over contexts of C tokens. On the CPU:
SmolLM2-135M shapes (9 query heads, 3 kv heads, head size 64, block size 128, float32, vLLM's
CPU cache layout). With ``--device cuda``: Llama-7B shapes (32 heads, 32 kv heads, head size
128, block size 16, bfloat16, the GPU backends' split layout), timed with CUDA events.
Reported: the median milliseconds per layer call, the kernel's GFLOP/s (4 · nodes · heads ·
keys · head size), its rate over the KV bytes each tree reads once (context + nodes, keys and
values: the kernel is memory-bound when this nears the device's bandwidth) and its largest
difference from the SDPA path.

    python benchmarks/tree_attention.py
    python benchmarks/tree_attention.py --trees 1 8 --contexts 300 --threads 1 0
    python benchmarks/tree_attention.py --device cuda --trees 1 8 64 256

Writes benchmarks/results/tree_attention_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from vllm_retrieval_spec.drafts import DraftTree
from vllm_retrieval_spec.kernels.attention import KVLayout, LayerAttention, kv_views, tree_attention
from vllm_retrieval_spec.verification.tree_attention import tree_nodes
from vllm_retrieval_spec.verification.trees import TreeStepPlan, unpack_masks

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Shapes:
    """One layer's attention shapes and cache layout."""

    heads: int
    kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    layout: KVLayout


SHAPES = {"cpu": Shapes(9, 3, 64, 128, torch.float32, KVLayout.CPU_VEC),
          "cuda": Shapes(32, 32, 128, 16, torch.bfloat16, KVLayout.SPLIT_LAST_DIM)}


class Step:
    """One layer's inputs: R trees of N nodes after C context tokens each, shuffled blocks."""

    def __init__(self, trees: int, nodes: int, context: int, device: str, seed: int = 0) -> None:
        shape = self.shape = SHAPES[device]
        gen = torch.Generator().manual_seed(seed)
        parents = (-1, -1, *range(nodes - 2))
        self.plan = TreeStepPlan.build([DraftTree(tuple(range(nodes)), parents)] * trees,
                                       np.arange(trees) * (nodes + 1))
        width = (context + nodes) // shape.block_size + 1
        blocks = torch.randperm(trees * width, generator=gen).reshape(trees, width).to(torch.int32)
        on_device = torch.Generator(device).manual_seed(seed)  # large caches: drawn where they live
        self.cache = torch.randn(trees * width, shape.kv_heads, shape.block_size, 2 * shape.head_size,
                                 generator=on_device, device=device).to(shape.dtype)
        self.query = torch.randn(trees * (nodes + 1), shape.heads * shape.head_size, generator=on_device,
                                 device=device).to(shape.dtype)
        self.nodes = tree_nodes(self.plan, np.full(trees, context), blocks.to(device))
        self.trees, self.node_count, self.context = trees, nodes, context

    def kernel(self, threads: int) -> torch.Tensor:
        out = torch.zeros_like(self.query)
        shape = self.shape
        tree_attention(self.query, self.cache, out, self.nodes, shape.layout,
                       LayerAttention(shape.heads, shape.head_size**-0.5), num_threads=threads)
        return out[self.nodes.rows]

    def gather_sdpa(self) -> torch.Tensor:
        """The first fix-up: copy every tree's context (and nodes) out of the cache, one masked
        SDPA over [R, heads, N, C + N] (every node; the kernel's rows of it are compared)."""
        shape = self.shape
        hs, kv_heads = shape.head_size, shape.kv_heads
        keys, values = kv_views(self.cache, hs, shape.layout)
        r, n, c = self.trees, self.node_count, self.context
        used = (c + n + shape.block_size - 1) // shape.block_size
        table = self.nodes.block_table[:, :used].long()

        def gather(cache: torch.Tensor) -> torch.Tensor:
            return cache[table].transpose(1, 2).reshape(r, kv_heads, -1, hs)[:, :, : c + n]

        visible = torch.from_numpy(unpack_masks(self.plan.ancestors, n).reshape(r, n, n))
        mask = torch.ones(r, 1, n, c + n, dtype=torch.bool)
        mask[..., c:] = visible.unsqueeze(1)
        rows = torch.from_numpy(self.plan.node_rows()).to(self.query.device)
        q = self.query.view(-1, shape.heads, hs)[rows].view(r, n, shape.heads, hs).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, gather(keys), gather(values), attn_mask=mask.to(q.device), scale=hs**-0.5, enable_gqa=True)
        recomputed = torch.from_numpy(self.plan.off_chain).to(out.device)  # the rows the kernel writes
        return out.transpose(1, 2).reshape(r * n, shape.heads * hs)[recomputed]


def median_ms(fn: Callable[[], object], repeats: int, device: str = "cpu") -> float:
    """Median wall time per call (CUDA events around each call on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3


def bench(trees: int, nodes: int, context: int, threads: list[int], repeats: int, device: str) -> dict:
    step = Step(trees, nodes, context, device)
    shape = step.shape
    recomputed = int(step.plan.off_chain.sum())  # all but each tree's first root (its leading chain)
    flops = 4 * recomputed * shape.heads * (context + nodes / 2) * shape.head_size
    kv_bytes = trees * (context + nodes) * shape.kv_heads * 2 * shape.head_size * shape.dtype.itemsize
    row = {"trees": trees, "nodes": nodes, "context": context,
           "gather_sdpa_ms": median_ms(step.gather_sdpa, repeats, device),
           "max_abs_diff": float((step.kernel(0).float() - step.gather_sdpa().float()).abs().max())}
    for count in threads:
        ms = median_ms(lambda count=count: step.kernel(count), repeats, device)
        row[f"kernel_ms_threads_{count or 'all'}"] = ms
        row[f"kernel_gflops_threads_{count or 'all'}"] = flops / ms / 1e6
        row[f"kernel_kv_gbps_threads_{count or 'all'}"] = kv_bytes / ms / 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[300, 1000, 4000])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 0], help="0 = every core")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", choices=sorted(SHAPES), default="cpu")
    args = parser.parse_args()
    device = args.device
    if device == "cuda":
        args.threads = [0]  # one launch on the current stream; no thread pool
    rows = [bench(r, args.nodes, c, args.threads, args.repeats, device) for r in args.trees for c in args.contexts]
    header = (f"{'trees':>5} {'context':>7} {'gather+SDPA ms':>14}"
              + "".join(f" {'kernel ms (' + str(t or 'all') + ' thr)':>20}" for t in args.threads)
              + f" {'speed-up':>8} {'KV GB/s':>8} {'max diff':>9}")
    print(header)
    for row in rows:
        kernel = [row[f"kernel_ms_threads_{t or 'all'}"] for t in args.threads]
        bandwidth = max(row[f"kernel_kv_gbps_threads_{t or 'all'}"] for t in args.threads)
        print(f"{row['trees']:>5} {row['context']:>7} {row['gather_sdpa_ms']:>14.3f}"
              + "".join(f" {ms:>20.3f}" for ms in kernel)
              + f" {row['gather_sdpa_ms'] / min(kernel):>7.2f}x {bandwidth:>8.1f} {row['max_abs_diff']:>9.1e}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"tree_attention_{device}.json"
    shape = {**asdict(SHAPES[device]), "dtype": str(SHAPES[device].dtype), "layout": SHAPES[device].layout.value}
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else device, "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "shapes": shape}
    out.write_text(json.dumps({**meta, "rows": rows}, indent=2))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
