"""Building a sharded datastore (``sharded.py``), resumably.

The build happens in ``.<name>.resumable/`` next to the target: tokenizing writes the shards'
token files and then ``plan.json`` (what was asked: inputs, tokenizer, shard size; and what
tokenizing produced: each shard's counts); sorting writes each shard's suffix array and then its
manifest; the shards' merged order (``merged_order.py``, for two shards or more) and the store's
manifest come last, and the directory is renamed to the target. A build
killed at any point leaves no store at the target, and the next build of the same plan resumes:
tokenizing is skipped once its plan is written, and every shard whose manifest reads back with
its checksums is kept. A different plan starts over (the directory holds only what a build
writes; anything else in it is refused, never deleted). One build at a time per target (a lock).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from vllm_retrieval_spec.datastores.builder import (
    BuildReport,
    ShardBuilt,
    ShardFiles,
    ShardWritten,
    build_info,
    chat_renderer,
    finish_shards,
    load_tokenizer,
    write_tokens,
)
from vllm_retrieval_spec.datastores.format import (
    DATASTORE,
    SUFFIX_ARRAY,
    TOKENS,
    Manifest,
    separator_for,
    token_dtype_for,
)
from vllm_retrieval_spec.datastores.merged_order import MergedOrderRecord, is_order_file, write_merged_order
from vllm_retrieval_spec.datastores.reader import TokenDatastore
from vllm_retrieval_spec.datastores.sharded import (
    FORMAT_VERSION,
    MAX_SHARD_TOKENS,
    SHARD_NAME,
    ShardedManifest,
    shard_name,
)
from vllm_retrieval_spec.datastores.sources import DocumentStream, InputSpec
from vllm_retrieval_spec.storage import (
    MANIFEST,
    StorageError,
    TokenizerIdentity,
    check_build_target,
    verify_file_records,
)

PLAN = "plan.json"
PARTIAL = ".partial"
LOCK = ".lock"
SHARD_FILES = {TOKENS, SUFFIX_ARRAY, MANIFEST}


def resumable_dir(out_dir: Path) -> Path:
    """Where a sharded build of ``out_dir`` works (kept when killed, for the next build)."""
    return out_dir.parent / f".{out_dir.name}.resumable"


def build_sharded_datastore(tokenizer_dir: str | Path, inputs: Sequence[InputSpec], out_dir: Path, *,
                            shard_tokens: int, workers: int = 1, progress: bool = True,
                            extra_build_info: dict[str, Any] | None = None,
                            ray_address: str | None = None) -> BuildReport:
    """A sharded datastore of ``inputs`` at ``out_dir`` (see the module), resuming a killed build
    of the same plan; shards sorted by ``workers`` local processes or on Ray (``ray_address``:
    ``"local"`` or a cluster's address; see :func:`~.builder.finish_shards`)."""
    _check_request(out_dir, shard_tokens, workers)
    tokenizer = load_tokenizer(tokenizer_dir)
    identity = TokenizerIdentity.of(tokenizer, name=Path(tokenizer_dir).name)
    plan = build_info(tokenizer_dir, inputs, extra_build_info) | {"tokenizer": asdict(identity),
                                                                   "shard_tokens": shard_tokens}
    start, started_at = time.perf_counter(), time.time()
    work = resumable_dir(out_dir)
    with _locked(work, out_dir):
        tokenized = _read_plan(work, plan)
        if tokenized is None:
            _clear(work)
            stream = DocumentStream(inputs, chat_renderer(tokenizer))
            files = ShardFiles(work, shard_tokens)
            write_tokens(tokenizer, stream, files, token_dtype_for(identity.vocab_size), progress)
            tokenized = {"shards": [[s.num_tokens, s.num_documents] for s in files.written],
                         "files_read": stream.files_read, "files_skipped_binary": stream.files_skipped}
            _write_json(work / PLAN, plan | {"tokenized": tokenized})
        tokenize_seconds = time.perf_counter() - start
        written = [ShardWritten(work / shard_name(i), tokens, documents)
                   for i, (tokens, documents) in enumerate(tokenized["shards"])]
        kept = {shard.directory.name: built for shard in written if (built := _already_built(shard)) is not None}
        if kept and progress:
            print(f"resuming the build in {work}: {len(kept)} of {len(written)} shards already sorted", flush=True)
        build = {k: v for k, v in plan.items() if k != "tokenizer"} | {
            "files_read": tokenized["files_read"], "files_skipped_binary": tokenized["files_skipped_binary"],
            "workers": workers}
        todo = [shard for shard in written if shard.directory.name not in kept]
        sorted_now = dict(zip([s.directory.name for s in todo],
                              finish_shards(todo, identity, build, started_at, workers, progress, ray_address)))
        shards = [kept.get(s.directory.name) or sorted_now[s.directory.name] for s in written]
        order = _merged_order(work, [s.directory.name for s in written], workers, progress)
        replace(_store_manifest(written, identity, build, started_at), merged_order=order).write(work)
        (work / PLAN).unlink()
        (work / LOCK).unlink()
        os.replace(work, out_dir)
    return BuildReport(out_dir, sum(s.num_tokens for s in shards), sum(s.num_documents for s in shards),
                       time.perf_counter() - start, tokenize_seconds, sum(s.sort_seconds for s in shards),
                       sum(s.bytes_on_disk for s in shards), tokenized["files_read"],
                       tokenized["files_skipped_binary"], shards_kept=len(kept))


def _merged_order(work: Path, names: list[str], workers: int, progress: bool) -> MergedOrderRecord | None:
    """The sorted shards' merged order, written in ``work`` (an earlier run's, killed, removed)."""
    for entry in work.iterdir():
        if is_order_file(entry):
            entry.unlink()
    shards = [TokenDatastore.open(work / name) for name in names]
    return write_merged_order(work, shards, names, workers=workers, progress=progress)


def _check_request(out_dir: Path, shard_tokens: int, workers: int) -> None:
    if not 1 <= shard_tokens <= MAX_SHARD_TOKENS:
        raise ValueError(f"--shard-tokens must lie in [1, {MAX_SHARD_TOKENS:,}] (int32 suffix arrays), "
                         f"not {shard_tokens:,}")
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, not {workers}")
    if out_dir.exists() or out_dir.is_symlink():
        raise FileExistsError(f"{out_dir} already exists and sharded builds do not replace stores: remove it "
                              "yourself or choose another output directory")
    check_build_target(out_dir, replace=False)


@contextlib.contextmanager
def _locked(work: Path, out_dir: Path) -> Iterator[None]:
    """Hold ``work``'s lock (created when missing) while building; another build of the same
    target fails at once."""
    work.mkdir(parents=True, exist_ok=True)
    with open(work / LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as error:
            raise FileExistsError(f"another build of {out_dir} is running (it holds {work / LOCK}); wait for it "
                                  "or choose another output directory") from error
        yield


def _read_plan(work: Path, plan: dict[str, Any]) -> dict[str, Any] | None:
    """What tokenizing produced, when ``work`` holds a finished tokenization of this plan."""
    try:
        saved = json.loads((work / PLAN).read_text())
    except (OSError, ValueError):
        return None
    tokenized = saved.pop("tokenized", None) if isinstance(saved, dict) else None
    if saved != plan or not isinstance(tokenized, dict):
        return None
    shards = tokenized.get("shards")
    valid = isinstance(shards, list) and shards and all(
        isinstance(s, list) and len(s) == 2 and all(isinstance(v, int) and v >= 0 for v in s) for s in shards)
    if not valid or not all((work / shard_name(i) / TOKENS).is_file() for i in range(len(shards))):
        return None
    return tokenized


def _clear(work: Path) -> None:
    """Empty ``work`` of an earlier build's files (a lock, a plan, a manifest, shard directories
    of shard files); anything else in it is refused, not deleted."""
    foreign = [entry.name for entry in work.iterdir() if not _written_by_a_build(entry)]
    if foreign:
        raise FileExistsError(f"{work} holds {', '.join(map(repr, sorted(foreign)[:5]))}, which no build wrote; move "
                              f"it out or remove {work} yourself")
    for entry in work.iterdir():
        if entry.name == LOCK:
            continue
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def _written_by_a_build(entry: Path) -> bool:
    if entry.is_symlink():
        return False
    if entry.name in (LOCK, PLAN, PLAN + PARTIAL, MANIFEST):
        return entry.is_file()
    return is_shard_directory(entry) or is_order_file(entry)


def is_shard_directory(entry: Path) -> bool:
    """Whether ``entry`` is a ``shard-NNNNN`` directory holding only files a build writes there."""
    return (entry.is_dir() and not entry.is_symlink() and SHARD_NAME.fullmatch(entry.name) is not None
            and all(f.name in SHARD_FILES and f.is_file() and not f.is_symlink() for f in entry.iterdir()))


def _already_built(shard: ShardWritten) -> ShardBuilt | None:
    """The shard as an earlier run sorted it: its manifest reads back, agrees with the plan and
    its files match their checksums (else None: it is sorted again)."""
    try:
        manifest = Manifest.read(shard.directory)
        verify_file_records(shard.directory, manifest.files, DATASTORE)
    except (StorageError, OSError):
        return None
    if (manifest.num_tokens, manifest.num_documents) != (shard.num_tokens, shard.num_documents):
        return None
    return ShardBuilt(manifest.num_tokens, manifest.num_documents, 0.0,
                      sum(f["bytes"] for f in manifest.files.values()))


def _store_manifest(written: list[ShardWritten], identity: TokenizerIdentity, build: dict[str, Any],
                    started_at: float) -> ShardedManifest:
    token_dtype = token_dtype_for(identity.vocab_size)
    return ShardedManifest(
        format_version=FORMAT_VERSION, shards=[shard.directory.name for shard in written],
        num_tokens=sum(s.num_tokens for s in written), num_documents=sum(s.num_documents for s in written),
        token_dtype=token_dtype.name, separator=separator_for(token_dtype), tokenizer=identity,
        build={**build, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "seconds": round(time.time() - started_at, 2)},
    )


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """Write ``value`` next to ``path`` and rename it into place (a reader sees all or nothing)."""
    partial = path.with_name(path.name + PARTIAL)
    partial.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(partial, path)
