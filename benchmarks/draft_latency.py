"""Drafting time per step: REST and prompt lookup before (a past commit) and after (this tree),
next to vLLM's `ngram` proposer, on the same batches.

Contexts are real: HumanEval prompts plus the target's greedy output so far, 200-600 tokens. For
each batch size every repetition drafts for a fresh batch of contexts; we report p50/p99 of the
step (the whole batch) and per request. Settings are the serving defaults
(RetrievalSpecOptions: num_threads 0, i.e. up to one thread per core); `_1t` rows run on one
thread. Prompt lookup is PromptLookupProposer's call: k=1, w=8, q 1..4, max_matches 64; vLLM's
ngram proposer gets prompt_lookup_min 1, prompt_lookup_max 4 and 8 tokens.

A step is the kernel call plus per-request draft lists (what vLLM's `propose` returns): before,
built row by row as the old proposers did (`chain(i)` / `draft(i)`); after, from the chain
arrays read with one slice. `kernel` columns time the call alone.

BEFORE and AFTER each run in a fresh worker process: BEFORE on a git worktree of --before whose
extension is built once with CMake (CPU only) inside the worktree, AFTER on this tree; vLLM runs
in this process. Per batch size the three alternate for --rounds rounds, so that all see the same
machine; their timings are pooled.

    python benchmarks/draft_latency.py --datastore code-large --batches 1 8 64 256

Writes benchmarks/results/draft_latency_<datastore>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
Batch = tuple[np.ndarray, np.ndarray]
VERSIONS = ("before", "after", "vllm")
WIDTH = 1024  # tokens per row of the batches (vLLM's max_model_len here)


def sample_contexts(traces, count: int, low: int = 200, high: int = 600, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    pool = []
    for trace in traces:
        full = trace.prompt_ids + trace.output_ids
        for end in range(max(low, len(trace.prompt_ids) + 1), min(high, len(full)) + 1, 7):
            pool.append(full[:end])
    picks = rng.choice(len(pool), size=count, replace=len(pool) < count)
    return [pool[i] for i in picks]


def as_matrix(contexts: list[list[int]], width: int) -> Batch:
    """vLLM's layout: one row per request, ``width`` (> every length) wide."""
    matrix = np.zeros((len(contexts), width), dtype=np.int32)
    for row, context in enumerate(contexts):
        matrix[row, : len(context)] = context
    return matrix, np.array([len(c) for c in contexts], dtype=np.int32)


def percentiles(values: list[float]) -> dict:
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


def time_steps(batches: list[Batch], call: Callable[[Batch], object],
               drafts: Callable[[object], object]) -> dict[str, list[float]]:
    """Microseconds of ``drafts(call(batch))`` (the step) and of ``call(batch)`` (the kernel)."""
    samples: dict[str, list[float]] = {"step_us": [], "kernel_us": []}
    for batch in batches:
        start = time.perf_counter()
        out = call(batch)
        called = time.perf_counter()
        drafts(out)
        end = time.perf_counter()
        samples["step_us"].append((end - start) * 1e6)
        samples["kernel_us"].append((called - start) * 1e6)
    return samples


def summary(samples: dict[str, list[float]], rows: int) -> dict:
    step_us = samples["step_us"]
    return {"step_us": percentiles(step_us), "kernel_us": percentiles(samples["kernel_us"]),
            "step_us_per_request": percentiles([t / rows for t in step_us]), "steps": len(step_us)}


def time_ours(store, batches: list[Batch], rest_params: dict, k: int,
              per_row_drafts: bool) -> dict[str, dict[str, list[float]]]:
    """REST and prompt lookup with whichever ``vllm_retrieval_spec`` is importable (this tree, or
    an old one in the worker); ``per_row_drafts`` reads the drafts row by row (the old API)."""
    from vllm_retrieval_spec.kernels import context_ngram
    from vllm_retrieval_spec.kernels.rest import RestParams, rest_retrieve

    params = RestParams(**rest_params)

    def chains(out) -> list[list[int]]:
        tokens, sizes = out.chain_tokens[:, :k].tolist(), out.chain_size.tolist()
        return [row[:size] for row, size in zip(tokens, sizes)]

    def rest_drafts(out) -> list[list[int]]:
        return [out.chain(i) for i in range(len(out.chain_size))] if per_row_drafts else chains(out)

    def lookup_drafts(out) -> list[list[int]]:
        return [out.draft(i) for i in range(len(out.lengths))] if per_row_drafts else chains(out)

    variants = {}
    for suffix, threads in (("", 0), ("_1t", 1)):
        def rest(batch: Batch, threads: int = threads) -> object:
            rows = np.arange(len(batch[1]), dtype=np.int32)
            return rest_retrieve(store, batch[0], batch[1], rows, params, num_threads=threads)

        def lookup(batch: Batch, threads: int = threads) -> object:
            rows = np.arange(len(batch[1]), dtype=np.int32)
            return context_ngram(batch[0], batch[1], rows, num_drafts=1, draft_len=k, q_min=1, q_max=4, max_matches=64,
                                 num_threads=threads)

        variants["rest" + suffix] = (rest, rest_drafts)
        variants["prompt_lookup" + suffix] = (lookup, lookup_drafts)
    for call, drafts in variants.values():  # warm-up: the variants timed later then find the same caches
        time_steps(batches, call, drafts)
    return {name: time_steps(batches, call, drafts) for name, (call, drafts) in variants.items()}


def vllm_ngram_proposer(width: int, k: int) -> object:
    """vLLM's ngram proposer for rows of ``width`` tokens (max_model_len), JIT-compiled."""
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    return NgramProposer(SimpleNamespace(
        speculative_config=SimpleNamespace(prompt_lookup_min=1, prompt_lookup_max=4, num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=width),
        scheduler_config=SimpleNamespace(max_num_seqs=1024),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    ))


def time_vllm_ngram(proposer, batches: list[Batch], k: int) -> dict[str, list[float]]:
    def propose(batch: Batch) -> list[list[int]]:
        return proposer.propose(k, [[1]] * len(batch[1]), batch[1], batch[0])

    return time_steps(batches, propose, lambda out: out)


def add_samples(samples: dict, version: str, timed: dict[str, dict[str, list[float]]]) -> None:
    """Pools one round's raw timings into ``samples[version, drafter]``."""
    for name, raw in timed.items():
        pooled = samples.setdefault((version, name), {})
        for field, values in raw.items():
            pooled.setdefault(field, []).extend(values)


# ---- BEFORE: an old commit in a worktree, timed in a subprocess ------------------------------


def before_tree(commit: str, root: Path) -> Path:
    """A worktree of ``commit`` at ``root`` with its extension built in place (once)."""
    if not root.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(root), commit], check=True)
    package = root / "vllm_retrieval_spec"
    if not list(package.glob("_C.*")):
        build = root / "build-cmake"
        subprocess.run(["cmake", "-S", str(root / "csrc"), "-B", str(build), "-DVRS_CUDA=OFF",
                        "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1)], check=True,
                       stdout=subprocess.DEVNULL)
        for built in build.glob("_C.*.so"):
            shutil.copy2(built, package / built.name)
    return root


def time_in_worker(root: Path | None, store_path: Path, batches: list[Batch], rest_params: dict,
                   k: int) -> dict:
    """:func:`time_ours` in a fresh :func:`worker` process, on the old tree at ``root`` (with
    ``python -S``, which keeps the editable install's path hook out, so that
    ``vllm_retrieval_spec`` is the worktree's) or, for None, on this tree."""
    with tempfile.TemporaryDirectory() as tmp:
        np.savez(Path(tmp) / "batches.npz", *[array for batch in batches for array in batch])
        spec = {"store": str(store_path), "rest_params": rest_params, "k": k, "per_row_drafts": root is not None,
                "npz": str(Path(tmp) / "batches.npz"), "out": str(Path(tmp) / "out.json")}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        command, env = [sys.executable, __file__, "--worker", str(Path(tmp) / "spec.json")], dict(os.environ)
        if root is not None:
            command.insert(1, "-S")
            env["PYTHONPATH"] = os.pathsep.join([str(root), sysconfig.get_paths()["purelib"]])
        subprocess.run(command, env=env, check=True)
        return json.loads(Path(spec["out"]).read_text())


def worker(spec_path: str) -> None:
    from vllm_retrieval_spec.datastores.reader import TokenDatastore

    spec = json.loads(Path(spec_path).read_text())
    store = TokenDatastore.open(spec["store"])
    store.prefetch(wait=True)  # steady state: a serving process has the store in the page cache
    saved = np.load(spec["npz"])
    arrays = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    batches = list(zip(arrays[0::2], arrays[1::2]))
    results = time_ours(store, batches, spec["rest_params"], spec["k"], spec["per_row_drafts"])
    Path(spec["out"]).write_text(json.dumps(results))


# ---- report ---------------------------------------------------------------------------------


def print_row(batch: int, version: str, name: str, result: dict) -> None:
    step, kernel, per_request = result["step_us"], result["kernel_us"], result["step_us_per_request"]
    print(f"{batch:5d} {version:7s} {name:17s} {step['p50']:10.1f} {step['p99']:10.1f} "
          f"{kernel['p50']:10.1f} {per_request['p50']:9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datastore", default="code-large", help="directory or recipe name")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--repeats", type=int, default=200,
                        help="batches drafted per batch size and round (fewer when large)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of before, after and vLLM per batch size")
    parser.add_argument("--k", type=int, default=8, help="draft length")
    parser.add_argument("--prompts", type=int, default=164, help="HumanEval prompts whose greedy traces give contexts")
    parser.add_argument("--before", default="f4f4462", help="commit timed as BEFORE ('' to skip)")
    parser.add_argument("--before-dir", type=Path, default=None, help="its worktree (default /tmp/vrs-before-<commit>)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return

    from vllm_retrieval_spec.compat import configure_vllm_environment

    configure_vllm_environment(in_process=True)
    from vllm_retrieval_spec.datastores.resolve import open_datastore_for_model
    from vllm_retrieval_spec.evaluation.traces import greedy_traces
    from vllm_retrieval_spec.kernels.extension import load_extension
    from vllm_retrieval_spec.kernels.rest import RestParams
    from vllm_retrieval_spec.models import ensure_smollm2_checkpoint
    from vllm_retrieval_spec.options import RetrievalSpecOptions

    model = ensure_smollm2_checkpoint()
    store, _ = open_datastore_for_model(args.datastore, model)
    rest_params = dataclasses.asdict(RestParams.from_options(RetrievalSpecOptions(), chain_len=args.k))
    traces = greedy_traces(model, "raw", args.prompts, 128)
    batches = {}
    for size in args.batches:
        repeats = max(10, args.repeats * 16 // max(size, 16))
        contexts = sample_contexts(traces, size * repeats, seed=size)
        batches[size] = [as_matrix(contexts[i * size:(i + 1) * size], WIDTH) for i in range(repeats)]

    root = None
    if args.before:
        root = before_tree(args.before, args.before_dir or Path(tempfile.gettempdir()) / f"vrs-before-{args.before}")
    cores = load_extension().available_cores()
    report = {"datastore": str(store.path), "datastore_tokens": store.manifest.num_tokens, "before": args.before,
              "rest_params": rest_params, "k": args.k, "prompts": args.prompts, "rounds": args.rounds,
              "cores": cores, "load_average_before": os.getloadavg(), "results": []}
    print(f"store {store.path.name}: {store.manifest.num_tokens / 1e6:.1f}M tokens; {cores} cores available "
          f"(load average {os.getloadavg()[0]:.1f}); before = {args.before or '-'}")
    print(f"{'batch':>5s} {'version':7s} {'drafter':17s} {'step p50':>10s} {'step p99':>10s} "
          f"{'kernel p50':>10s} {'us/req p50':>9s}   (microseconds)")
    proposer = vllm_ngram_proposer(WIDTH, args.k)
    for size, group in batches.items():
        samples: dict[tuple[str, str], dict[str, list[float]]] = {}
        for _ in range(args.rounds):  # alternate, so that all three see the same machine
            if root is not None:
                add_samples(samples, "before", time_in_worker(root, store.path, group, rest_params, args.k))
            add_samples(samples, "after", time_in_worker(None, store.path, group, rest_params, args.k))
            add_samples(samples, "vllm", {"ngram": time_vllm_ngram(proposer, group, args.k)})
        for version, name in sorted(samples, key=lambda key: (key[1], VERSIONS.index(key[0]))):
            result = summary(samples[version, name], size)
            print_row(size, version, name, result)
            report["results"].append({"batch": size, "version": version, "drafter": name, **result})
    report["load_average_after"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"draft_latency_{store.path.name.rsplit('-', 1)[0]}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
