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

With --sampling (--sampling-only: nothing else), the verification cost at temperature > 0 from
logits, for each --threads: (a) today's path, vLLM's apply_top_k_top_p + softmax over every row
then accept_trees on the probabilities, against (b) accept_trees given the logits and
RowSampling, which processes only the rows its walk visits. Deterministic-candidate rule (1),
chains of 8 and random trees of 16 nodes, B = 8 and 64, V = 49152, T = 0.7, top-p 1.0 / 0.9
with and without top-k 50; p50 ms of each, their ratio, the rows (b) processed and how often
(a) and (b) emitted the same tokens (they verify the same distribution, (a) in float32).

    python benchmarks/kernels.py --device cpu --sampling-only --threads 1 2

writes benchmarks/results/kernels_sampling_<device>.json.
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
from tree_attention import median_ms

from vllm_retrieval_spec.kernels.tree import AcceptRule, RowSampling, TreeBatch, accept_trees, pack_tree_masks
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
    trees = TreeBatch(tokens, torch.as_tensor(parents, device=device), torch.as_tensor(offsets, device=device),
                      rules=torch.full((batch,), int(rule), dtype=torch.int32, device=device),
                      seeds=torch.arange(batch, dtype=torch.int64, device=device))
    return dict(scores=scores, batch=trees, draft_probs=draft)


def as_kernel_args(inputs: dict, device: str) -> dict:
    """CUDA tensors as they are; NumPy arrays for the CPU kernels."""
    return inputs if device == "cuda" else as_numpy(inputs)


def as_numpy(inputs: dict) -> dict:
    return {k: v.on_host() if isinstance(v, TreeBatch) else None if v is None else v.cpu().numpy()
            for k, v in inputs.items()}


def time_call(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Median microseconds per call after one warm-up."""
    return median_ms(fn, repeats, device) * 1e3


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


def sampling_inputs(rng: np.random.Generator, batch: int, shape: str, vocab: int, device: str) -> dict:
    """Logits [N + B, V] (scale 3, as tree_inputs, each row's argmax raised to probability 0.8
    at T = 0.7) of chains of 8 or random trees of 16 nodes whose tokens follow the parent's
    argmax 80% of the time (rule 1: retrieval drafts), so about 64% of them are accepted."""
    nodes = 8 if shape == "chain" else 16
    if shape == "chain":
        parents = np.tile(np.arange(-1, nodes - 1, dtype=np.int32), batch)
        offsets = np.arange(0, batch * nodes + 1, nodes, dtype=np.int32)
    else:
        parents, offsets = random_trees(rng, batch, nodes)
    gen = torch.Generator(device=device).manual_seed(int(rng.integers(2**31)))
    logits = torch.randn((len(parents) + batch, vocab), generator=gen, device=device) * 3
    scaled = logits.double() / 0.7
    top, best = scaled.max(dim=1)
    rest = torch.exp(scaled - top[:, None]).sum(dim=1) - 1  # p(best) = 1 / (1 + rest)
    raise_by = 0.7 * torch.log(torch.clamp(4 * rest, min=1.0))  # to 1 / (1 + rest / (4 rest))
    logits[torch.arange(len(logits), device=device), best] += raise_by.float()
    parent_rows = torch.as_tensor(np.arange(len(parents)) // nodes * (nodes + 1) + parents + 1,
                                  device=device)
    follow = torch.as_tensor(rng.random(len(parents)) < 0.8, device=device)
    random_tokens = torch.as_tensor(rng.integers(0, vocab, len(parents)), device=device)
    tokens = torch.where(follow, logits.argmax(dim=1)[parent_rows], random_tokens).to(torch.int32)
    trees = TreeBatch(tokens, torch.as_tensor(parents, device=device), torch.as_tensor(offsets, device=device),
                      rules=torch.full((batch,), int(AcceptRule.CANDIDATES), dtype=torch.int32, device=device),
                      seeds=torch.arange(batch, dtype=torch.int64, device=device))
    return dict(logits=logits, batch=trees, width=nodes + 1)


def bench_sampling(rng: np.random.Generator, batch: int, shape: str, vocab: int, top_p: float,
                   top_k: int, threads: int, device: str, repeats: int) -> dict:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    inputs = sampling_inputs(rng, batch, shape, vocab, device)
    logits, width = inputs["logits"], inputs["width"]
    trees = inputs["batch"] if device == "cuda" else inputs["batch"].on_host()
    counts = np.diff(inputs["batch"].offsets.cpu().numpy()) + 1
    temperature = torch.full((batch,), 0.7, device=device)
    row_temperature = temperature.repeat_interleave(torch.as_tensor(counts, device=device))
    row_k = torch.full((len(logits),), top_k, dtype=torch.long, device=device) if top_k else None
    row_p = torch.full((len(logits),), top_p, device=device) if top_p < 1 else None
    sampling = RowSampling(temperature, torch.full((batch,), top_k, dtype=torch.int32, device=device),
                           torch.full((batch,), top_p, device=device))
    if device == "cpu":
        sampling = RowSampling(*(a.numpy() for a in (sampling.temperature, sampling.top_k, sampling.top_p)))

    def today():  # what TreeRejectionSampler._scores does, then the kernel on probabilities
        probs = apply_top_k_top_p(logits / row_temperature[:, None], row_k, row_p).softmax(dim=-1)
        return accept_trees(probs if device == "cuda" else probs.numpy(), trees, out_width=width,
                            validate=False, num_threads=threads)

    host_logits = logits if device == "cuda" else logits.numpy()

    def lazy():
        return accept_trees(host_logits, trees, out_width=width, validate=False,
                            num_threads=threads, sampling=sampling)

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        today_ms = time_call(today, device, repeats) / 1e3
        lazy_ms = time_call(lazy, device, repeats) / 1e3
        a, b = today(), lazy()
    finally:
        torch.set_num_threads(previous)
    accepted = np.asarray(b.num_accepted.cpu() if device == "cuda" else b.num_accepted)
    same = np.asarray((a.out_tokens == b.out_tokens).all(1).cpu() if device == "cuda"
                      else (a.out_tokens == b.out_tokens).all(1))
    return {"kernel": "verify_sampled", "shape": shape, "batch": batch, "nodes": width - 1,
            "rows": len(logits), "vocab": vocab, "temperature": 0.7, "top_p": top_p,
            "top_k": top_k, "threads": threads, "today_ms": today_ms, "lazy_ms": lazy_ms,
            "speedup": today_ms / lazy_ms, "rows_processed": int(accepted.sum() + batch),
            "mean_accepted": float(accepted.mean()), "same_tokens": float(same.mean())}


def print_sampling_row(r: dict) -> None:
    filters = f"p={r['top_p']:<4} k={r['top_k'] or '-':<3}"
    shape = f"{r['shape']:5s} B={r['batch']:<3d} n={r['nodes']:<3d}"
    print(f"{r['threads']:>3d} {filters:12s} {shape:20s} {r['today_ms']:10.1f} {r['lazy_ms']:9.2f} "
          f"{r['speedup']:8.1f}x {r['rows_processed']:5d}/{r['rows']:<5d} {r['mean_accepted']:6.2f} "
          f"{100 * r['same_tokens']:5.0f}%")


def run_sampling(args: argparse.Namespace, name: str) -> list[dict]:
    print(f"verification at T = 0.7 from logits, V = {args.sampling_vocab}, rule 1; p50 ms "
          f"({args.sampling_repeats} calls; (a) vLLM apply_top_k_top_p + softmax + accept_trees, "
          "(b) accept_trees(logits, sampling=...))")
    print(f"{'thr':>3s} {'filters':12s} {'trees':20s} {'(a) today':>10s} {'(b) lazy':>9s} "
          f"{'(a)/(b)':>9s} {'rows (b)':>11s} {'accept':>6s} {'same':>6s}")
    rng = np.random.default_rng(1)
    results = []
    for threads in args.threads:
        for top_p, top_k in ((1.0, 0), (0.9, 0), (1.0, 50), (0.9, 50)):
            for shape in ("chain", "tree"):
                for batch in args.sampling_batches:
                    results.append(bench_sampling(rng, batch, shape, args.sampling_vocab, top_p,
                                                  top_k, threads, args.device, args.sampling_repeats))
                    print_sampling_row(results[-1])
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"kernels_sampling_{args.device}.json"
    out.write_text(json.dumps({"device": args.device, "device_name": name,
                               "timer": "cuda events" if args.device == "cuda" else "perf_counter",
                               "args": vars(args), "results": results}, indent=2) + "\n")
    print(f"written: {out}")
    return results


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
    parser.add_argument("--sampling", action="store_true",
                        help="also time verification at temperature > 0 from logits")
    parser.add_argument("--sampling-only", action="store_true", help="time only that")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="threads (torch's and the kernels') of the --sampling runs")
    parser.add_argument("--sampling-batches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--sampling-vocab", type=int, default=49152)
    parser.add_argument("--sampling-repeats", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {os.cpu_count()} cores"
    print(f"device: {name} ({'CUDA events' if args.device == 'cuda' else 'CPU perf_counter'})")
    if args.sampling or args.sampling_only:
        run_sampling(args, name)
        if args.sampling_only:
            return
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
