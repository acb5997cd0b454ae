"""Sharded datastores against one suffix array over the same documents (issue 26, items 1 and 4).

The store (default: the embedded ``python-code`` recipe, 73M tokens of the Python standard
library) is split at document boundaries into S shards of near-equal size, each sorted on its own
(in a fresh process; the peak memory of sorting it alone is measured in another), and opened as
a sharded store (and the whole store's tokens are sorted alone once, for the same peak). Contexts
are the 164 HumanEval prompts tokenized and cut at random points (at least 32 tokens). For each
batch size, REST's kernel (serving defaults, chains of 32: the README's configuration) drafts
the same batches from the single store and from each sharded one, in a fresh random order each
batch, after all are read into the page cache: p50/p99 per step, and every draft compared (the drafts must be
identical: 0 differing rows; not compared for synthetic stores, which hold other documents).
Every sharded store is given its merged order (``datastore merge-order``; its time and size
recorded) and drafts through it; ``--without-order`` also times each by selection across its
shards (``--without-cache``: selection without its cache).

    python benchmarks/sharded_store.py --shards 4 16 --batches 1 8 64

At scale (``--scale TOKENS:SHARDS ...``): a synthetic store of TOKENS tokens, the store's
documents repeated, each repetition in a fresh random order (seeded), split at document
boundaries into SHARDS near-equal shards sorted by ``finish_shards`` (``--workers`` processes, or
``--ray`` on a local cluster of ``--workers`` CPUs): build time, the sort's peak memory for one
shard, bytes on disk (what the server maps), and the same search table against the store itself.

    python benchmarks/sharded_store.py --shards --scale 1000000000:2 1000000000:8 --work-dir /tmp/vrs-scale

Writes benchmarks/results/sharded_store_<store>[_<tag>].json and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from draft_latency import as_matrix, percentiles  # benchmarks/ is this script's directory

from vllm_retrieval_spec.datastores.builder import ShardBuilt, ShardWritten, finish_shard, finish_shards
from vllm_retrieval_spec.datastores.format import TOKENS
from vllm_retrieval_spec.datastores.resolve import ensure_recipe_store, open_datastore_for_model
from vllm_retrieval_spec.datastores.sharded import FORMAT_VERSION, ShardedManifest, open_datastore, shard_name
from vllm_retrieval_spec.datastores.sharded_edit import merge_order
from vllm_retrieval_spec.evaluation.prompts import humaneval_prompts
from vllm_retrieval_spec.kernels.rest import RestParams, rest_retrieve
from vllm_retrieval_spec.models import ensure_smollm2_checkpoint
from vllm_retrieval_spec.options import RetrievalSpecOptions

RESULTS = Path(__file__).resolve().parent / "results"
WIDTH = 2048
DRAFT_KEYS = ("chain_tokens", "chain_size", "tree_tokens", "tree_parents", "tree_size", "match_info")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datastore", default="python-code", help="recipe name or store directory")
    parser.add_argument("--shards", type=int, nargs="*", default=[4, 16])
    parser.add_argument("--scale", nargs="*", default=[], metavar="TOKENS:SHARDS",
                        help="synthetic stores of the store's documents repeated and shuffled")
    parser.add_argument("--workers", type=int, default=1, help="scale builds: shards sorted at once")
    parser.add_argument("--ray", action="store_true", help="scale builds: sort on a local Ray cluster")
    parser.add_argument("--without-order", action="store_true",
                        help="also time every sharded store by selection across its shards (its cache on)")
    parser.add_argument("--without-cache", action="store_true",
                        help="also time every sharded store by selection without its cache")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=200, help="batches drafted per batch size (fewer when large)")
    parser.add_argument("--k", type=int, default=32, help="chain length (the README's num_speculative_tokens)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the shards are written and kept, "
                        "reused by the next run (default: a temporary directory, removed at the end)")
    parser.add_argument("--tag", default="")
    return parser.parse_args()


def document_cuts(tokens: np.ndarray, separator: int, shards: int) -> list[int]:
    """Token offsets that split ``tokens`` after a separator into ``shards`` near-equal runs."""
    ends = np.flatnonzero(tokens == separator) + 1
    wanted = np.linspace(0, len(tokens), shards + 1)[1:-1]
    picked = ends[np.minimum(np.searchsorted(ends, wanted), len(ends) - 1)]
    return [0, *sorted(set(picked.tolist())), len(tokens)]


def sort_and_measure(shard: ShardWritten, identity: object, build: dict) -> tuple[ShardBuilt, float]:
    """One shard sorted (and its manifest written) in this fresh process: what it built, seconds."""
    start = time.perf_counter()
    return finish_shard(shard, identity, build, time.time()), time.perf_counter() - start


# VmHWM, not ru_maxrss: the latter keeps the forking parent's peak across exec.
SORT_ALONE = """
import sys
from pathlib import Path
import numpy as np
from pydivsufsort import divsufsort
suffix_array = divsufsort(np.fromfile(sys.argv[1], dtype=sys.argv[2]))
status = Path("/proc/self/status").read_text().splitlines()
print(int(next(line.split()[1] for line in status if line.startswith("VmHWM:"))) / 1024)
"""


def sort_peak_mb(tokens: Path, dtype: str) -> float:
    """Peak resident MB of a process that reads a shard's tokens and sorts them, and nothing
    else (the build's own processes also hold the package's imports)."""
    done = subprocess.run([sys.executable, "-c", SORT_ALONE, str(tokens), dtype], capture_output=True, text=True,
                          check=True)
    return float(done.stdout.split()[-1])


def write_shards(store: object, count: int, root: Path) -> tuple[Path, list[dict]]:
    """``store`` split into ``count`` shards under ``root``, each sorted in a process of its own."""
    tokens = np.asarray(store.tokens)
    cuts = document_cuts(tokens, store.separator, count)
    written = []
    for index, (start, end) in enumerate(itertools.pairwise(cuts)):
        directory = root / shard_name(index)
        directory.mkdir(parents=True)
        tokens[start:end].tofile(directory / TOKENS)
        written.append(ShardWritten(directory, end - start, int((tokens[start:end] == store.separator).sum())))
    build = {"resharded_from": str(store.path)}
    measured = []
    for shard in written:  # one at a time: each process's peak is one shard's
        with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
            built, seconds = pool.submit(sort_and_measure, shard, store.manifest.tokenizer, build).result()
        measured.append({"tokens": built.num_tokens, "sort_seconds": round(seconds, 2),
                         "sort_peak_mb": round(sort_peak_mb(shard.directory / TOKENS, store.manifest.token_dtype)),
                         "bytes_on_disk": built.bytes_on_disk})
    write_store_manifest(store, written, root, build)
    return root, measured


def write_store_manifest(store: object, written: list[ShardWritten], root: Path, build: dict) -> None:
    """The manifest of ``written`` (shards of ``store``'s tokenizer) at ``root``."""
    ShardedManifest(
        format_version=FORMAT_VERSION, shards=[shard.directory.name for shard in written],
        num_tokens=sum(s.num_tokens for s in written), num_documents=sum(s.num_documents for s in written),
        token_dtype=store.manifest.token_dtype, separator=store.separator, tokenizer=store.manifest.tokenizer,
        build=build,
    ).write(root)


def synthetic_shards(store: object, total_tokens: int, count: int, root: Path, seed: int) -> list[ShardWritten]:
    """Token files of ``store``'s documents repeated, each time in a fresh random order, until
    ``total_tokens``, split at document boundaries into ``count`` near-equal shards."""
    tokens = np.asarray(store.tokens)
    ends = np.flatnonzero(tokens == store.separator) + 1
    starts = np.concatenate([[0], ends[:-1]])
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(len(ends)) for _ in range(-(-total_tokens // len(tokens)))])
    filled = np.cumsum((ends - starts)[order])
    order = order[:np.searchsorted(filled, total_tokens) + 1]
    cuts = np.searchsorted(filled[:len(order)], np.linspace(0, filled[len(order) - 1], count + 1)[1:-1]) + 1
    written = []
    for index, documents in enumerate(np.split(order, cuts)):
        directory = root / shard_name(index)
        directory.mkdir(parents=True)
        with open(directory / TOKENS, "wb") as handle:
            for chunk in np.array_split(documents, max(1, len(documents) // 4096)):
                handle.write(np.concatenate([tokens[starts[d]:ends[d]] for d in chunk]).tobytes())
        written.append(ShardWritten(directory, int((ends - starts)[documents].sum()), len(documents)))
    return written


def synthetic_store(store: object, spec: str, root: Path, workers: int, ray: bool) -> tuple[Path, dict]:
    """The synthetic store ``spec`` (``TOKENS:SHARDS``) at ``root`` (made by an earlier run, or
    now: written, sorted by :func:`finish_shards`, one shard's sort peak measured) and its build."""
    measured = root / "build.json"
    if not measured.is_file():
        total, count = (int(v) for v in spec.split(":"))
        print(f"writing {total:,} tokens of repeated, shuffled documents into {count} shards ...", flush=True)
        written = synthetic_shards(store, total, count, root, seed=count)
        build = {"synthetic_from": str(store.path), "repeated_and_shuffled": True}
        start = time.perf_counter()
        built = finish_shards(written, store.manifest.tokenizer, build, time.time(), workers, progress=True,
                              ray_address="local" if ray else None)
        seconds = time.perf_counter() - start
        write_store_manifest(store, written, root, build)
        measured.write_text(json.dumps({
            "tokens": sum(s.num_tokens for s in written), "shards": count, "sorter": "ray" if ray else "processes",
            "workers": workers, "build_seconds": round(seconds, 1),
            "max_shard_tokens": max(s.num_tokens for s in written),
            "sort_peak_mb_one_shard": round(sort_peak_mb(written[0].directory / TOKENS, store.manifest.token_dtype)),
            "bytes_on_disk": sum(b.bytes_on_disk for b in built)}))
    return root, json.loads(measured.read_text())


def sharded_copy(store: object, count: int, root: Path) -> tuple[Path, list[dict]]:
    """``store`` in ``count`` shards at ``root`` (made by an earlier run, or now) and their builds."""
    measured = root / "builds.json"
    if not measured.is_file():
        print(f"splitting {store.manifest.num_tokens:,} tokens into {count} shards ...", flush=True)
        _, builds = write_shards(store, count, root)
        measured.write_text(json.dumps(builds))
    return root, json.loads(measured.read_text())


def with_merged_order(path: Path, workers: int) -> dict:
    """Give the store at ``path`` its merged order (unless an earlier run did): seconds, bytes."""
    measured = path / "merge.json"
    if not measured.is_file():
        print(f"merging the order of {path} ...", flush=True)
        start = time.perf_counter()
        order = merge_order(path, workers=workers).merged_order
        measured.write_text(json.dumps({"merge_seconds": round(time.perf_counter() - start, 1), "workers": workers,
                                        "bytes": order.bytes, "depth": order.depth, "dtype": order.dtype}))
    return json.loads(measured.read_text())


# The growth of a fresh process's resident memory as it opens a store and reads it whole.
RESIDENT = """
import sys
from pathlib import Path
from vllm_retrieval_spec.datastores.sharded import open_datastore

def rss():
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(line.split()[1] for line in status if line.startswith("VmRSS:"))) / 1024

before = rss()
store = open_datastore(sys.argv[1])
store.prefetch(wait=True)
print(rss() - before)
"""


def resident_mb(path: Path) -> float:
    """What a server holds of the store at ``path`` once warm (pages of the page cache, shared
    with every process that maps the store)."""
    done = subprocess.run([sys.executable, "-c", RESIDENT, str(path)], capture_output=True, text=True, check=True)
    return round(float(done.stdout.split()[-1]))


def prompt_contexts(model: Path, count: int, seed: int) -> list[list[int]]:
    """HumanEval prompts, tokenized, cut at random points of at least 32 tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in humaneval_prompts()]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(prompts), count)
    return [prompts[i][: int(rng.integers(min(32, len(prompts[i])), len(prompts[i]) + 1))] for i in picks]


def time_drafts(stores: dict[str, object], batches: list, params: RestParams, seed: int = 0) -> dict[str, dict]:
    """p50/p99 microseconds per step of every store on the same batches (in a fresh random order
    each batch: a store searched right after another over the same shards finds them in the CPU's
    caches), and the rows whose drafts differ from the first store's."""
    times = {name: [] for name in stores}
    differing = dict.fromkeys(stores, 0)
    names = list(stores)
    rng = np.random.default_rng(seed)
    for tokens, lengths in batches:
        rows = np.arange(len(lengths), dtype=np.int32)
        drafts = {}
        for name in rng.permutation(names):
            start = time.perf_counter()
            out = rest_retrieve(stores[name], tokens, lengths, rows, params)
            times[name].append((time.perf_counter() - start) * 1e6)
            drafts[name] = {key: getattr(out, key) for key in DRAFT_KEYS if getattr(out, key) is not None}
        reference = drafts[names[0]]
        for name in names[1:]:
            same = np.ones(len(rows), bool)
            for key, expected in reference.items():
                same &= (drafts[name][key] == expected).reshape(len(rows), -1).all(axis=1)
            differing[name] += int((~same).sum())
    return {name: {**percentiles(times[name]), "differing_rows": differing[name]} for name in stores}


def main() -> None:
    args = parse_args()
    model = ensure_smollm2_checkpoint()
    if Path(args.datastore).expanduser().exists():
        single, _ = open_datastore_for_model(args.datastore, model)
    else:
        single, _ = open_datastore_for_model(str(ensure_recipe_store(args.datastore, model)), model)
    params = RestParams.from_options(RetrievalSpecOptions(), chain_len=args.k)
    with contextlib.ExitStack() as cleanup:
        work = args.work_dir or Path(cleanup.enter_context(tempfile.TemporaryDirectory()))
        stores, builds, scale = {"single": single}, {}, {}
        orders = {}
        for count in args.shards:
            path, builds[count] = sharded_copy(single, count, work / f"shards{count}")
            orders[f"{count} shards"] = with_merged_order(path, args.workers)
            stores[f"{count} shards"] = open_datastore(path, single.manifest.tokenizer)
        for spec in args.scale:
            path, built = synthetic_store(single, spec, work / f"scale{spec.replace(':', '_')}", args.workers,
                                          args.ray)
            name = f"{built['tokens'] / 1e6:,.0f}M tokens in {built['shards']} shards"
            scale[name] = built
            orders[name] = with_merged_order(path, args.workers)
            stores[name] = open_datastore(path, single.manifest.tokenizer)
        sharded = {name: store for name, store in stores.items() if name != "single"}
        if args.without_order:
            stores |= {f"{name} (selection)": dataclasses.replace(store, merged_order=None)
                       for name, store in sharded.items()}
        if args.without_cache:
            stores |= {f"{name} (selection, no cache)": dataclasses.replace(store, merged_order=None,
                                                                            selection_cache=None)
                       for name, store in sharded.items()}
        resident = {name: resident_mb(store.path) for name, store in stores.items() if " (" not in name}
        for store in stores.values():
            store.prefetch(wait=True)
        report = {"datastore": str(single.path), "tokens": single.manifest.num_tokens, "rest_params":
                  dataclasses.asdict(params), "machine": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M"),
                  "builds": {str(count): rows for count, rows in builds.items()}, "scale": scale,
                  "merged_orders": orders, "search": {},
                  "resident_mb": resident,
                  "single_sort_peak_mb": round(sort_peak_mb(single.path / TOKENS, single.manifest.token_dtype))}
        for size in args.batches:
            steps = max(10, args.steps * 8 // max(size, 8))
            contexts = prompt_contexts(model, size * steps, seed=size)
            batches = [as_matrix(contexts[i * size:(i + 1) * size], WIDTH) for i in range(steps)]
            time_drafts(stores, batches[:5], params)  # warm-up
            timed = time_drafts(stores, batches, params)
            for name in timed:  # synthetic stores hold other documents: their drafts are not the store's
                if name.split(" (")[0] in scale:
                    timed[name]["differing_rows"] = None
            report["search"][str(size)] = timed
    print_table(report)
    name = f"sharded_store_{Path(single.path).name.rsplit('-', 1)[0]}{'_' + args.tag if args.tag else ''}.json"
    (RESULTS / name).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {RESULTS / name}")


def print_table(report: dict) -> None:
    print(f"\n{report['tokens']:,} tokens; drafting step (kernel call), microseconds")
    print("| batch | store | p50 | p99 | × single p50 | differing rows |\n|---:|---|---:|---:|---:|---:|")
    for size, rows in report["search"].items():
        for name, row in rows.items():
            print(f"| {size} | {name} | {row['p50']:.0f} | {row['p99']:.0f} | "
                  f"{row['p50'] / rows['single']['p50']:.2f} | "
                  f"{'–' if row['differing_rows'] is None else row['differing_rows']} |")
    print("\n| store | resident MB once read whole |\n|---|---:|")
    for name, megabytes in report["resident_mb"].items():
        print(f"| {name} | {megabytes:,} |")
    print("\n| store | merged order: merge s | threads | GB | bytes/token |\n|---|---:|---:|---:|---:|")
    for name, row in report["merged_orders"].items():
        tokens = report["scale"].get(name, {}).get("tokens", report["tokens"])
        print(f"| {name} | {row['merge_seconds']:.1f} | {row['workers']} | {row['bytes'] / 1e9:.2f} | "
              f"{row['bytes'] / tokens:.1f} |")
    print("\n| shards | tokens per shard | sort s per shard (max) | sort's peak MB per shard (max) |")
    print("|---:|---:|---:|---:|")
    print(f"| 1 (the store itself) | {report['tokens']:,} | – | {report['single_sort_peak_mb']} |")
    for count, rows in report["builds"].items():
        print(f"| {count} | {max(r['tokens'] for r in rows):,} | {max(r['sort_seconds'] for r in rows):.1f} | "
              f"{max(r['sort_peak_mb'] for r in rows)} |")
    if report["scale"]:
        print("\n| synthetic store | build s | sorted by | largest shard | sort's peak MB (one shard) | GB on disk |")
        print("|---|---:|---|---:|---:|---:|")
    for name, row in report["scale"].items():
        print(f"| {name} | {row['build_seconds']:.0f} | {row['workers']} {row['sorter']} | "
              f"{row['max_shard_tokens']:,} | {row['sort_peak_mb_one_shard']:,} | {row['bytes_on_disk'] / 1e9:.1f} |")


if __name__ == "__main__":
    main()
