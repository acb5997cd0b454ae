"""Drafting time per request-step: our proposers' kernels vs vLLM's `ngram` and `suffix`.

Contexts are real: HumanEval prompts plus the target's greedy output so far (traces from
replay.py), 200-600 tokens. For each batch size, every repetition drafts for a fresh batch of
contexts; we report p50/p99 of (batch time / batch size) and of the whole batch, plus REST's
breakdown (search, gather, trie, select). Threads: 1 at batch 1 (single-threaded figure), all
cores above.

    python benchmarks/draft_latency.py --datastore code-large --batches 1 16 64 256

Writes benchmarks/results/draft_latency_<datastore>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from vllm_retrieval_spec.evaluation.engine import configure_vllm_environment

configure_vllm_environment(in_process=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay import greedy_traces  # noqa: E402

from vllm_retrieval_spec.datastores.resolve import open_datastore_for_model  # noqa: E402
from vllm_retrieval_spec.kernels.rest import TIMING_PHASES, RestParams, rest_retrieve  # noqa: E402
from vllm_retrieval_spec.models import ensure_smollm2_checkpoint  # noqa: E402
from vllm_retrieval_spec.ngrams.drafts import mixed_drafts  # noqa: E402
from vllm_retrieval_spec.ngrams.table import ModelIdentity, NgramTable, default_table_dir  # noqa: E402
from vllm_retrieval_spec.options import RetrievalSpecOptions  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def sample_contexts(traces, count: int, low: int = 200, high: int = 600, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    pool = []
    for trace in traces:
        full = trace.prompt_ids + trace.output_ids
        for end in range(max(low, len(trace.prompt_ids) + 1), min(high, len(full)) + 1, 7):
            pool.append(full[:end])
    picks = rng.choice(len(pool), size=count, replace=len(pool) < count)
    return [pool[i] for i in picks]


def as_matrix(contexts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(c) for c in contexts)
    matrix = np.zeros((len(contexts), width), dtype=np.int32)
    for row, context in enumerate(contexts):
        matrix[row, : len(context)] = context
    return matrix, np.array([len(c) for c in contexts], dtype=np.int32)


def percentiles(values: list[float]) -> dict:
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


def time_rest(store, params, batches, threads) -> dict:
    per_request, per_batch, phases = [], [], []
    for matrix, lengths in batches:
        start = time.perf_counter()
        out = rest_retrieve(store, matrix, lengths, np.arange(len(lengths)), params,
                            num_threads=threads, profile=True)
        elapsed = time.perf_counter() - start
        per_batch.append(elapsed * 1e3)
        per_request.append(elapsed * 1e6 / len(lengths))
        phases.append(out.timings_ns.mean(axis=0) / 1e3)
    breakdown = dict(zip(TIMING_PHASES, np.mean(phases, axis=0).round(2).tolist()))
    return {"us_per_request": percentiles(per_request), "ms_per_batch": percentiles(per_batch),
            "breakdown_us_per_request": breakdown}


def time_ngrammys(table, batches, k: int, w: int, q: int) -> dict:
    per_request, per_batch = [], []
    for matrix, lengths in batches:
        start = time.perf_counter()
        drafts = mixed_drafts(table, matrix, lengths, np.arange(len(lengths), dtype=np.int32),
                              k=k, w=w, q=q, mixing="context-first")
        [drafts.chain(i) for i in range(len(lengths))]
        elapsed = time.perf_counter() - start
        per_batch.append(elapsed * 1e3)
        per_request.append(elapsed * 1e6 / len(lengths))
    return {"us_per_request": percentiles(per_request), "ms_per_batch": percentiles(per_batch)}


def time_vllm_ngram(batches, k: int) -> dict:
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    width = max(m.shape[1] for m, _ in batches)
    rows = max(len(lengths) for _, lengths in batches)
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(prompt_lookup_min=1, prompt_lookup_max=4, num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=width + 64),
        scheduler_config=SimpleNamespace(max_num_seqs=max(rows, 1024)),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    proposer = NgramProposer(config)
    per_request, per_batch = [], []
    for matrix, lengths in batches:
        padded = np.zeros((len(lengths), width + 64), dtype=np.int32)
        padded[:, : matrix.shape[1]] = matrix
        sampled = [[1]] * len(lengths)
        start = time.perf_counter()
        proposer.propose(k, sampled, lengths, padded)
        elapsed = time.perf_counter() - start
        per_batch.append(elapsed * 1e3)
        per_request.append(elapsed * 1e6 / len(lengths))
    return {"us_per_request": percentiles(per_request), "ms_per_batch": percentiles(per_batch)}


def time_vllm_suffix(batches, k: int) -> dict | None:
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError:
        print("skipping suffix: arctic-inference is not installed (scripts/install-comparators.sh)", file=sys.stderr)
        return None
    per_request, per_batch = [], []
    for batch_index, (matrix, lengths) in enumerate(batches):
        cache = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=10000)
        ids = [f"r{batch_index}-{i}" for i in range(len(lengths))]
        for req_id, row, n in zip(ids, matrix, lengths):
            cache.start_request(req_id, row[: n - 1])
        start = time.perf_counter()
        for req_id, row, n in zip(ids, matrix, lengths):  # one decode step: add the token, speculate
            cache.add_active_response(req_id, [int(row[n - 1])])
            cache.speculate(req_id, row[max(0, n - 24):n], max_spec_tokens=k, max_spec_factor=1.0,
                            min_token_prob=0.1)
        elapsed = time.perf_counter() - start
        per_batch.append(elapsed * 1e3)
        per_request.append(elapsed * 1e6 / len(lengths))
    return {"us_per_request": percentiles(per_request), "ms_per_batch": percentiles(per_batch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datastore", default="python-code", help="directory or recipe name")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=200, help="batches drafted per batch size")
    parser.add_argument("--k", type=int, default=8)
    args = parser.parse_args()

    model = ensure_smollm2_checkpoint()
    store, _ = open_datastore_for_model(args.datastore, model)
    store.prefetch(wait=True)  # steady state: a serving process has the store in the page cache
    options = RetrievalSpecOptions()
    params = RestParams.from_options(options, chain_len=args.k)
    table_dir = default_table_dir(ModelIdentity.of(model))
    table = NgramTable.open(table_dir) if table_dir.exists() else None
    traces = greedy_traces(model, "raw", 164, 128)
    cores = os.cpu_count() or 1
    report = {"datastore": str(store.path), "datastore_tokens": store.manifest.num_tokens,
              "params": params.__dict__, "cores": cores, "results": []}
    print(f"store {store.path.name}: {store.manifest.num_tokens / 1e6:.1f}M tokens; {cores} cores")
    print(f"{'batch':>5s} {'proposer':14s} {'us/req p50':>11s} {'us/req p99':>11s} {'ms/batch p50':>13s} "
          f"{'ms/batch p99':>13s}  breakdown us/req (search gather trie select)")
    for batch in args.batches:
        repeats = max(10, args.repeats * 16 // max(batch, 16))
        contexts = sample_contexts(traces, batch * repeats, seed=batch)
        batches = [as_matrix(contexts[i * batch:(i + 1) * batch]) for i in range(repeats)]
        threads = 1 if batch == 1 else 0
        results = []
        for name, variant in (
            ("rest", params),
            ("rest_datastore", dataclasses.replace(params, use_context=False)),
            ("rest_tree64", dataclasses.replace(params, top_k=64)),
        ):
            results.append({**time_rest(store, variant, batches, threads), "proposer": name})
        if table is not None:
            results.append({**time_ngrammys(table, batches, options.k, args.k, options.q), "proposer": "ngrammys"})
        results.append({**time_vllm_ngram(batches, args.k), "proposer": "vllm_ngram"})
        suffix = time_vllm_suffix(batches, args.k)
        if suffix:
            results.append({**suffix, "proposer": "vllm_suffix"})
        for result in results:
            result["batch"] = batch
            report["results"].append(result)
            b = result.get("breakdown_us_per_request")
            print(f"{batch:5d} {result['proposer']:14s} {result['us_per_request']['p50']:11.1f} "
                  f"{result['us_per_request']['p99']:11.1f} {result['ms_per_batch']['p50']:13.3f} "
                  f"{result['ms_per_batch']['p99']:13.3f}  {' '.join(f'{v:.1f}' for v in b.values()) if b else ''}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"draft_latency_{store.path.name.rsplit('-', 1)[0]}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
