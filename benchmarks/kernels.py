"""Tree kernel timings: packing and acceptance (C++ threads or CUDA) vs the NumPy reference.

Trees are random (half the nodes extend the previous node, so paths go deep) and draft tokens
mostly follow their parent's argmax, so walks accept a few levels as in real verification.
Greedy requests read logits, sampled ones softmax probabilities (MCSS draws from a flatter q).
Reported: the median time per call (CUDA events on a GPU, time.perf_counter on the CPU), the
rate of score bytes on the visited rows (plus q rows for MCSS) and, at small batch, the speedup
over the NumPy reference together with whether both agreed exactly.

    python benchmarks/kernels.py                       # CUDA when available
    python benchmarks/kernels.py --device cpu --batches 1 8 --vocabs 4096 --repeats 3

Writes benchmarks/results/kernels_<device>.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from vllm_retrieval_spec.kernels.tree import AcceptRule, accept_trees, pack_tree_masks
from vllm_retrieval_spec.kernels.tree_reference import accept_trees_reference, pack_tree_masks_reference

RESULTS = Path(__file__).resolve().parent / "results"


def random_trees(rng: np.random.Generator, batch: int, nodes: int) -> tuple[np.ndarray, np.ndarray]:
    parents = [i - 1 if rng.random() < 0.5 else int(rng.integers(-1, i))
               for _ in range(batch) for i in range(nodes)]
    return np.array(parents, np.int32), np.arange(0, batch * nodes + 1, nodes, dtype=np.int32)


def tree_inputs(rng: np.random.Generator, batch: int, nodes: int, vocab: int, rule: AcceptRule,
                device: str) -> dict:
    """Scores [N + B, V], tokens following the parent's argmax 80% of the time, draft probs."""
    parents, offsets = random_trees(rng, batch, nodes)
    gen = torch.Generator(device=device).manual_seed(int(rng.integers(2**31)))
    logits = torch.randn((len(parents) + batch, vocab), generator=gen, device=device) * 3
    parent_rows = torch.as_tensor(np.arange(len(parents)) // nodes * (nodes + 1) + parents + 1,
                                  device=device)
    follow = torch.as_tensor(rng.random(len(parents)) < 0.8, device=device)
    random_tokens = torch.as_tensor(rng.integers(0, vocab, len(parents)), device=device)
    tokens = torch.where(follow, logits.argmax(dim=1)[parent_rows], random_tokens).to(torch.int32)
    draft = torch.softmax(logits * 0.5, dim=1) if rule >= AcceptRule.MCSS else None
    scores = logits if rule == AcceptRule.GREEDY else torch.softmax(logits, dim=1)
    del logits
    return dict(scores=scores, tokens=tokens, parents=torch.as_tensor(parents, device=device),
                offsets=torch.as_tensor(offsets, device=device),
                rules=torch.full((batch,), int(rule), dtype=torch.int32, device=device),
                seeds=torch.arange(batch, dtype=torch.int64, device=device), draft_probs=draft)


def as_kernel_args(inputs: dict, device: str) -> dict:
    """CUDA tensors as they are; NumPy arrays for the CPU kernels."""
    if device == "cuda":
        return inputs
    return {k: None if v is None else v.numpy() for k, v in inputs.items()}


def as_numpy(inputs: dict) -> dict:
    return {k: None if v is None else v.cpu().numpy() for k, v in inputs.items()}


def time_call(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Median microseconds per call after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e6)
    return float(np.median(times))


def time_reference(fn: Callable[[], object]) -> tuple[float, object]:
    begin = time.perf_counter()
    result = fn()
    return (time.perf_counter() - begin) * 1e6, result


def bench_pack(rng: np.random.Generator, trees: int, nodes: int, device: str, repeats: int) -> dict:
    parents, offsets = random_trees(rng, trees, nodes)
    args = (torch.as_tensor(parents).cuda(), torch.as_tensor(offsets).cuda()) if device == "cuda" \
        else (parents, offsets)
    us = time_call(lambda: pack_tree_masks(*args, nodes, validate=False), device, repeats)
    ref_us, expected = time_reference(lambda: pack_tree_masks_reference(parents, offsets, nodes))
    got = pack_tree_masks(*args, nodes)
    same = np.array_equal(np.asarray(got.ancestor_mask.cpu() if device == "cuda" else got.ancestor_mask),
                          expected.ancestor_mask)
    return {"kernel": "pack_tree_masks", "trees": trees, "nodes": nodes, "us": us,
            "reference_us": ref_us, "speedup": ref_us / us, "matches_reference": bool(same)}


def bench_accept(rng: np.random.Generator, batch: int, nodes: int, vocab: int, rule: AcceptRule,
                 device: str, repeats: int, reference_max_batch: int) -> dict:
    inputs = tree_inputs(rng, batch, nodes, vocab, rule, device)
    args = as_kernel_args(inputs, device)
    width = nodes + 1
    us = time_call(functools.partial(accept_trees, **args, out_width=width, validate=False), device, repeats)
    out = accept_trees(**args, out_width=width)
    accepted = np.asarray(out.num_accepted.cpu() if device == "cuda" else out.num_accepted)
    rows_read = int(accepted.sum() + batch) * (2 if rule >= AcceptRule.MCSS else 1)
    result = {"kernel": "accept_trees", "rule": rule.name.lower(), "batch": batch, "nodes": nodes,
              "vocab": vocab, "us": us, "gb_per_s": rows_read * vocab * 4 / us / 1e3,
              "mean_accepted": float(accepted.mean())}
    if batch <= reference_max_batch:
        host = as_numpy(inputs)
        ref_us, expected = time_reference(lambda: accept_trees_reference(**host, out_width=width))
        same = np.array_equal(np.asarray(out.out_tokens.cpu() if device == "cuda" else out.out_tokens),
                              expected.out_tokens)
        result |= {"reference_us": ref_us, "speedup": ref_us / us, "matches_reference": bool(same)}
    del inputs, args
    return result


def print_row(r: dict) -> None:
    shape = (f"{r['trees']} trees x {r['nodes']}" if r["kernel"] == "pack_tree_masks"
             else f"{r['rule']:19s} B={r['batch']:<4d} n={r['nodes']:<3d} V={r['vocab']:<6d}")
    rate = f"{r['gb_per_s']:8.1f}" if "gb_per_s" in r else f"{'':8s}"
    ref = (f"{r['reference_us']:12.0f} {r['speedup']:8.1f}x {'yes' if r['matches_reference'] else 'NO'}"
           if "reference_us" in r else "")
    print(f"{r['kernel']:16s} {shape:46s} {r['us']:11.1f} {rate} {ref}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[49152, 128256])
    parser.add_argument("--rules", nargs="+", default=["greedy", "candidates", "mcss"],
                        choices=[r.name.lower() for r in AcceptRule])
    parser.add_argument("--pack-trees", type=int, default=256)
    parser.add_argument("--pack-nodes", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--reference-max-batch", type=int, default=1,
                        help="run the (slow) NumPy reference up to this batch size")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {os.cpu_count()} cores"
    print(f"device: {name} ({'CUDA events' if args.device == 'cuda' else 'CPU perf_counter'})")
    print(f"{'kernel':16s} {'shape':46s} {'us':>11s} {'GB/s':>8s} {'reference us':>12s} {'speedup':>9s} same")
    results = [bench_pack(rng, args.pack_trees, args.pack_nodes, args.device, args.repeats)]
    print_row(results[-1])
    for rule in (AcceptRule[r.upper()] for r in args.rules):
        for vocab in args.vocabs:
            for nodes in args.nodes:
                for batch in args.batches:
                    results.append(bench_accept(rng, batch, nodes, vocab, rule, args.device,
                                                args.repeats, args.reference_max_batch))
                    print_row(results[-1])
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"kernels_{args.device}.json"
    out.write_text(json.dumps({"device": args.device, "device_name": name,
                               "timer": "cuda events" if args.device == "cuda" else "perf_counter",
                               "args": vars(args),
                               "results": results}, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
