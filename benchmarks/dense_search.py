"""Dense (DReSD) datastore search latency: one ``DenseDatastore.search`` call (transform, one
batched FAISS call, value rows gathered) per batch of real hidden states.

Queries are the target's last hidden states at every position of the first --prompts raw
HumanEval prompts (one forward pass each). For each batch size, --rounds calls on fresh random
batches; we report p50/p99 of the whole call and of the FAISS call alone, per thread count.
``next-token hit@k``: the share of queries for which some neighbour's stored first token is
the prompt's actual next token (DReSD keeps only such neighbours), a quality signal. ``recall@k``
(IVF stores): the share of the exact k nearest neighbours (every list probed) the index finds.

    python benchmarks/dense_search.py --store python-code-dense --batches 1 8 64

Writes benchmarks/results/dense_search_<store>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def query_states(model_dir: Path, prompts: int) -> tuple[np.ndarray, np.ndarray]:
    """Hidden states ``[Q, H]`` at every prompt position but the last, and each one's next token."""
    import torch

    from vllm_retrieval_spec.datastores.builder import load_tokenizer
    from vllm_retrieval_spec.datastores.dense_builder import last_hidden_states, load_target_model
    from vllm_retrieval_spec.evaluation.prompts import humaneval_prompts

    tokenizer, model = load_tokenizer(model_dir), load_target_model(model_dir)
    states, next_tokens = [], []
    for prompt in humaneval_prompts(prompts):
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
        with torch.inference_mode():
            hidden = last_hidden_states(model, torch.tensor([ids]))[0].numpy()
        states.append(hidden[:-1])
        next_tokens.append(np.asarray(ids[1:]))
    return np.concatenate(states), np.concatenate(next_tokens)


def percentiles(values: list[float]) -> dict[str, float]:
    return {"p50": round(float(np.percentile(values, 50)), 1), "p99": round(float(np.percentile(values, 99)), 1)}


def time_batches(store, states: np.ndarray, batch: int, rounds: int, k: int, seed: int) -> dict[str, dict]:
    """Microseconds of ``store.search`` and of its FAISS call alone, ``rounds`` random batches."""
    rng = np.random.default_rng(seed)
    total, faiss_only = [], []
    store.search(states[:batch], k)  # warm-up
    for _ in range(rounds):
        queries = states[rng.choice(len(states), size=batch, replace=False)]
        start = time.perf_counter()
        store.search(queries, k)
        total.append((time.perf_counter() - start) * 1e6)
        keys = store.transform.apply(queries)
        start = time.perf_counter()
        store.search_keys(keys, k)
        faiss_only.append((time.perf_counter() - start) * 1e6)
    return {"search_us": percentiles(total), "faiss_us": percentiles(faiss_only)}


def next_token_hit(store, states: np.ndarray, next_tokens: np.ndarray, k: int) -> float:
    _, values = store.search(states, k)
    return float((values[:, :, 0] == next_tokens[:, None]).any(axis=1).mean())


def recall_at_k(store, states: np.ndarray, k: int, nprobe: int | None) -> float | None:
    """Share of the exhaustive search's neighbours (every IVF list probed) that ``nprobe`` lists find."""
    nlist = store.manifest.index.nlist
    if not nlist or not nprobe:
        return None
    keys = store.transform.apply(states)
    _, found = store.search_keys(keys, k)
    store.set_nprobe(nlist)
    _, exact = store.search_keys(keys, k)
    store.set_nprobe(nprobe)
    return float(np.mean([len(np.intersect1d(a, b)) / k for a, b in zip(found, exact)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", default="python-code-dense", help="dense store directory or recipe name")
    parser.add_argument("--model", default=None, help="model directory (default: the SmolLM2 checkpoint)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, len(os.sched_getaffinity(0))])
    parser.add_argument("--k", type=int, default=32, help="neighbours per query (the dense_neighbours default)")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--nprobe", type=int, default=None, help="IVF lists probed (default: the manifest's)")
    args = parser.parse_args()

    from vllm_retrieval_spec.datastores.dense import open_dense_datastore_for_model
    from vllm_retrieval_spec.models import ensure_smollm2_checkpoint

    model_dir = Path(args.model) if args.model else ensure_smollm2_checkpoint()
    store = open_dense_datastore_for_model(args.store, model_dir)
    nprobe = args.nprobe or store.manifest.index.nprobe
    if nprobe:
        store.set_nprobe(nprobe)
    states, next_tokens = query_states(model_dir, args.prompts)
    rows = []
    for threads in args.threads:
        store.num_threads = threads
        for batch in args.batches:
            rows.append({"threads": threads, "batch": batch,
                         **time_batches(store, states, batch, args.rounds, args.k, seed=batch)})
    m = store.manifest
    result = {
        "store": str(store.path), "positions": m.num_positions, "dim": m.dim, "index": m.index.describe(),
        "nprobe": nprobe,
        "bytes_per_position": m.bytes_per_position, "k": args.k, "rounds": args.rounds, "queries": len(states),
        "next_token_hit_at_k": round(next_token_hit(store, states, next_tokens, args.k), 4),
        "next_token_hit_at_1": round(next_token_hit(store, states, next_tokens, 1), 4),
        "recall_at_k": recall_at_k(store, states, args.k, nprobe),
        "cpus": len(os.sched_getaffinity(0)), "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = Path(args.store).name if "/" in args.store else args.store
    suffix = f"_nprobe{args.nprobe}" if args.nprobe else ""
    (RESULTS / f"dense_search_{name}{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{m.num_positions:,} positions, index {result['index']} (probing {nprobe}), k={args.k}, "
          f"{len(states)} query states; "
          f"next-token hit@{args.k} {result['next_token_hit_at_k']:.1%}, hit@1 {result['next_token_hit_at_1']:.1%}"
          + (f", recall@{args.k} {result['recall_at_k']:.1%}" if result["recall_at_k"] is not None else ""))
    print(f"{'threads':>7} {'batch':>5} {'search p50 µs':>14} {'p99':>9} {'faiss p50 µs':>13} {'p99':>9}")
    for row in rows:
        search, faiss_only = row["search_us"], row["faiss_us"]
        print(f"{row['threads']:>7} {row['batch']:>5} {search['p50']:>14,.1f} {search['p99']:>9,.1f}"
              f" {faiss_only['p50']:>13,.1f} {faiss_only['p99']:>9,.1f}")


if __name__ == "__main__":
    main()
