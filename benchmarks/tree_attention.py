"""Tree attention per layer: our paged kernel vs gathering each request's context out of the
cache and running one masked SDPA (what the tree step did before the kernel), same inputs.

SmolLM2-135M shapes (9 query heads, 3 kv heads, head size 64, CPU block size 128), R branching
trees of N nodes (two roots, then a chain) over contexts of C tokens. Reported: the median
milliseconds per layer call, the kernel's GFLOP/s (4 · nodes · heads · keys · head size) and
its largest difference from the SDPA path.

    python benchmarks/tree_attention.py
    python benchmarks/tree_attention.py --trees 1 8 --contexts 300 --threads 1 0

Writes benchmarks/results/tree_attention_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from vllm_retrieval_spec.drafts import DraftTree
from vllm_retrieval_spec.kernels.attention import KVLayout, kv_views, tree_attention
from vllm_retrieval_spec.verification.tree_attention import TreeNodes
from vllm_retrieval_spec.verification.trees import TreeStepPlan, unpack_masks

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 9, 3, 64, 128


class Step:
    """One layer's inputs: R trees of N nodes after C context tokens each, shuffled blocks."""

    def __init__(self, trees: int, nodes: int, context: int, device: str, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        parents = (-1, -1, *range(nodes - 2))
        self.plan = TreeStepPlan.build([DraftTree(tuple(range(nodes)), parents)] * trees,
                                       np.arange(trees) * (nodes + 1))
        width = (context + nodes) // BLOCK_SIZE + 1
        blocks = torch.randperm(trees * width, generator=gen).reshape(trees, width).to(torch.int32)
        self.cache = torch.randn(trees * width, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, generator=gen).to(device)
        self.query = torch.randn(trees * (nodes + 1), HEADS * HEAD_SIZE, generator=gen).to(device)
        self.nodes = TreeNodes.build(self.plan, np.full(trees, context), blocks.to(device))
        self.trees, self.node_count, self.context = trees, nodes, context

    def kernel(self, threads: int) -> torch.Tensor:
        out = torch.zeros_like(self.query)
        n = self.nodes
        tree_attention(self.query, self.cache, KVLayout.CPU_VEC, n.rows, n.block_table, n.request, n.context,
                       n.index, n.ancestors, HEADS, HEAD_SIZE**-0.5, out, num_threads=threads)
        return out[n.rows]

    def gather_sdpa(self) -> torch.Tensor:
        """The previous fix-up: copy every tree's context (and nodes) out of the cache, one
        masked SDPA over [R, heads, N, C + N]."""
        keys, values = kv_views(self.cache, HEAD_SIZE, KVLayout.CPU_VEC)
        r, n, c = self.trees, self.node_count, self.context
        used = (c + n + BLOCK_SIZE - 1) // BLOCK_SIZE
        table = self.nodes.block_table[:, :used].long()

        def gather(cache: torch.Tensor) -> torch.Tensor:
            return cache[table].transpose(1, 2).reshape(r, KV_HEADS, -1, HEAD_SIZE)[:, :, : c + n]

        visible = torch.from_numpy(unpack_masks(self.plan.ancestors, n).reshape(r, n, n))
        mask = torch.ones(r, 1, n, c + n, dtype=torch.bool)
        mask[..., c:] = visible.unsqueeze(1)
        q = self.query.view(-1, HEADS, HEAD_SIZE)[self.nodes.rows].view(r, n, HEADS, HEAD_SIZE).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, gather(keys), gather(values), attn_mask=mask.to(q.device), scale=HEAD_SIZE**-0.5, enable_gqa=True)
        return out.transpose(1, 2).reshape(r * n, HEADS * HEAD_SIZE)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench(trees: int, nodes: int, context: int, threads: list[int], repeats: int, device: str) -> dict:
    step = Step(trees, nodes, context, device)
    flops = 4 * trees * nodes * HEADS * (context + nodes / 2) * HEAD_SIZE
    row = {"trees": trees, "nodes": nodes, "context": context,
           "gather_sdpa_ms": median_ms(step.gather_sdpa, repeats),
           "max_abs_diff": float((step.kernel(0) - step.gather_sdpa()).abs().max())}
    for count in threads:
        ms = median_ms(lambda count=count: step.kernel(count), repeats)
        row[f"kernel_ms_threads_{count or 'all'}"] = ms
        row[f"kernel_gflops_threads_{count or 'all'}"] = flops / ms / 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[300, 1000, 4000])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 0], help="0 = every core")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    device = "cpu"
    rows = [bench(r, args.nodes, c, args.threads, args.repeats, device) for r in args.trees for c in args.contexts]
    header = f"{'trees':>5} {'context':>7} {'gather+SDPA ms':>14}" + "".join(
        f" {'kernel ms (' + str(t or 'all') + ' thr)':>20}" for t in args.threads) + f" {'speed-up':>8} {'max diff':>9}"
    print(header)
    for row in rows:
        kernel = [row[f"kernel_ms_threads_{t or 'all'}"] for t in args.threads]
        print(f"{row['trees']:>5} {row['context']:>7} {row['gather_sdpa_ms']:>14.3f}"
              + "".join(f" {ms:>20.3f}" for ms in kernel)
              + f" {row['gather_sdpa_ms'] / min(kernel):>7.2f}x {row['max_abs_diff']:>9.1e}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"tree_attention_{device}.json"
    meta = {"device": device, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "head_size": HEAD_SIZE, "block_size": BLOCK_SIZE}}
    out.write_text(json.dumps({**meta, "rows": rows}, indent=2))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
