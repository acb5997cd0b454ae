"""Growing and shrinking a sharded datastore in place (``datastore add`` / ``datastore remove``).

``add`` tokenizes new documents into new shards (sorted like a build's, locally or on Ray);
``remove`` sorts the shards that hold the given documents again without them. Either works in a
hidden ``.edit-*`` directory inside the store, moves the finished shards in under fresh names,
and publishes them by renaming a new manifest over the old one: a reader (a serving engine,
``watch.py``) sees the store before or after the change, never between, and REST then drafts
exactly what a store built from the remaining documents would. Every edit merges the shards'
order again (``merged_order.py``; ``merge_order`` alone writes one for a store that has none)
and publishes it with the manifest. Document ids are given in order
as documents are added and never reused. One edit at a time per store (a lock); an edit killed
midway leaves the store as it was, and the next edit clears what it left (only directories of
the shape an edit writes: anything else is left alone).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from vllm_retrieval_spec.datastores.builder import (
    ShardFiles,
    ShardWritten,
    build_info,
    chat_renderer,
    finish_shards,
    load_tokenizer,
    write_tokens,
)
from vllm_retrieval_spec.datastores.format import TOKENS, DatastoreError, token_dtype_for
from vllm_retrieval_spec.datastores.merged_order import is_order_file, write_merged_order
from vllm_retrieval_spec.datastores.reader import TokenDatastore
from vllm_retrieval_spec.datastores.sharded import (
    MAX_SHARD_TOKENS,
    SHARD_NAME,
    ShardedDatastore,
    ShardedManifest,
    consecutive_id_runs,
    format_id_runs,
    id_runs,
    is_sharded_datastore,
    shard_name,
)
from vllm_retrieval_spec.datastores.sharded_builder import is_shard_directory
from vllm_retrieval_spec.datastores.sources import DocumentStream, InputSpec
from vllm_retrieval_spec.storage import TokenizerIdentity

logger = logging.getLogger(__name__)

EDIT_LOCK = ".edit.lock"
WORK_PREFIX = ".edit-"


@dataclass(frozen=True)
class EditReport:
    """What an edit changed."""

    path: Path
    action: str  # "added" or "removed"
    document_ids: list[list[int]]  # runs [first, stop) of the documents added or removed
    shards_written: list[str]
    shards_retired: list[str]
    num_tokens: int  # the store's, after the edit
    num_documents: int
    seconds: float

    def describe(self) -> str:
        count = sum(b - a for a, b in self.document_ids)
        written = f"; wrote {', '.join(self.shards_written)}" if self.shards_written else ""
        retired = f"; retired {', '.join(self.shards_retired)}" if self.shards_retired else ""
        return (f"{self.action} {count:,} document(s) (ids {format_id_runs(self.document_ids)}) in "
                f"{self.seconds:.1f} s{written}{retired}; "
                f"{self.path} now holds {self.num_tokens:,} tokens in {self.num_documents:,} documents")


def add_documents(store_dir: str | Path, tokenizer_dir: str | Path, inputs: Sequence[InputSpec], *,
                  workers: int = 1, progress: bool = True, ray_address: str | None = None) -> EditReport:
    """Append ``inputs``' documents to the sharded store at ``store_dir`` as new shards (of at
    most the store's ``shard_tokens``), their ids following the store's; the tokenizer must be
    the store's."""
    start, started_at = time.perf_counter(), time.time()
    store_dir = Path(store_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    identity = TokenizerIdentity.of(tokenizer, name=Path(tokenizer_dir).name)
    with _editing(store_dir) as (store, work):
        store.check_tokenizer(identity)
        files = ShardFiles(work, int(store.manifest.build.get("shard_tokens", MAX_SHARD_TOKENS)))
        write_tokens(tokenizer, DocumentStream(inputs, chat_renderer(tokenizer)), files,
                     token_dtype_for(identity.vocab_size), progress)
        build = build_info(tokenizer_dir, inputs) | {"added_to": store_dir.name}
        finish_shards(files.written, identity, build, started_at, workers, progress, ray_address)
        names = _move_in(store_dir, files.written)
        first = store.next_document_id
        added = consecutive_id_runs(first, [shard.num_documents for shard in files.written])
        stop = first + sum(shard.num_documents for shard in files.written)
        manifest = _publish(store, [*zip(store.manifest.shards, store.id_runs()), *zip(names, added)],
                            files.written, next_document_id=stop, workers=workers, progress=progress)
    return _report(store_dir, "added", [[first, stop]], names, [], manifest, start)


def remove_documents(store_dir: str | Path, document_ids: Sequence[int], *, progress: bool = True) -> EditReport:
    """Hide the documents ``document_ids`` of the sharded store at ``store_dir``: each shard
    holding any of them is sorted again without them (a shard left empty is dropped), and the
    replaced shards are deleted once the new manifest is in place. Unknown ids are an error
    that changes nothing."""
    start, started_at = time.perf_counter(), time.time()
    store_dir = Path(store_dir)
    wanted = np.unique(np.asarray(document_ids, dtype=np.int64))
    with _editing(store_dir) as (store, work):
        shard_ids = [_ids_of(runs) for runs in store.id_runs()]
        _refuse_unknown(store_dir, wanted, shard_ids)
        entries: list[tuple[str | ShardWritten, list[list[int]]]] = []
        written: list[ShardWritten] = []
        retired: list[str] = []
        for shard, ids in zip(store.shards, shard_ids):
            drop = np.isin(ids, wanted)
            if not drop.any():
                entries.append((shard.path.name, id_runs(ids)))
                continue
            retired.append(shard.path.name)
            if not drop.all() or (shard is store.shards[-1] and not entries):  # a store keeps one shard
                written.append(_without_documents(shard, drop, work / shard_name(len(written))))
                entries.append((written[-1], id_runs(ids[~drop])))
        finish_shards(written, store.manifest.tokenizer, {"removed_from": store_dir.name}, started_at,
                      workers=1, progress=progress)
        new_names = _move_in(store_dir, written)
        manifest = _publish(store, [(entry if isinstance(entry, str) else entry.directory.name, runs)
                                    for entry, runs in entries], written, next_document_id=store.next_document_id,
                            progress=progress)
        for name in retired:
            _delete_shard(store_dir / name)
    return _report(store_dir, "removed", id_runs(wanted), new_names, retired, manifest, start)


@contextlib.contextmanager
def _editing(store_dir: Path) -> Iterator[tuple[ShardedDatastore, Path]]:
    """Under the store's edit lock: the store as it is, and an empty work directory inside it
    (removed afterwards, whatever happens)."""
    if not is_sharded_datastore(store_dir):
        if (store_dir / "manifest.json").is_file():
            raise DatastoreError(f"{store_dir} is a single-array datastore, which cannot grow in place; rebuild it "
                                 "sharded (`vllm-retrieval-spec datastore build ... --shard-tokens N`) to add or "
                                 "remove documents")
        ShardedDatastore.open(store_dir)  # fails naming what is missing
    with open(store_dir / EDIT_LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as error:
            raise DatastoreError(f"another edit of {store_dir} is running (it holds {store_dir / EDIT_LOCK}); "
                                 "wait for it") from error
        store = ShardedDatastore.open(store_dir)
        _clear_abandoned(store_dir, store)
        work = Path(tempfile.mkdtemp(prefix=WORK_PREFIX, dir=store_dir))
        try:
            yield store, work
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _clear_abandoned(store_dir: Path, store: ShardedDatastore) -> None:
    """Delete what a killed edit left: work directories, shards and order files no manifest
    lists, when they hold only what an edit writes (anything else stays, with a warning)."""
    listed = set(store.manifest.shards)
    listed_order = store.manifest.merged_order.file if store.manifest.merged_order else None
    for entry in store_dir.iterdir():
        if entry.name.startswith(WORK_PREFIX) and entry.is_dir() and not entry.is_symlink():
            ours = all(is_shard_directory(child) for child in entry.iterdir())
        elif SHARD_NAME.fullmatch(entry.name) and entry.name not in listed:
            ours = is_shard_directory(entry)
        elif entry.name != listed_order and is_order_file(entry):
            entry.unlink()
            continue
        else:
            continue
        if ours:
            shutil.rmtree(entry)
        else:
            logger.warning("%s is not listed in %s and holds files no edit wrote; left alone", entry,
                           store_dir / "manifest.json")


def _move_in(store_dir: Path, written: list[ShardWritten]) -> list[str]:
    """Rename the finished shards into the store under names no shard there has had yet (not
    yet listed: invisible until the manifest is published)."""
    taken = [int(entry.name[len("shard-"):]) for entry in store_dir.iterdir() if SHARD_NAME.fullmatch(entry.name)]
    first = max(taken, default=-1) + 1
    names = [shard_name(first + i) for i in range(len(written))]
    for shard, name in zip(written, names):
        os.replace(shard.directory, store_dir / name)
        shard.directory = store_dir / name
    return names


def _publish(store: ShardedDatastore, entries: list[tuple[str, list[list[int]]]], written: list[ShardWritten],
             next_document_id: int, workers: int = 1, progress: bool = True) -> ShardedManifest:
    """Merge the shards' order and rename the store's new manifest into place (and return it):
    ``entries`` (shard name, its id runs) in document order. The order it replaces is deleted."""
    counts = {shard.path.name: (shard.manifest.num_tokens, shard.manifest.num_documents) for shard in store.shards}
    counts |= {shard.directory.name: (shard.num_tokens, shard.num_documents) for shard in written}
    names = [name for name, _ in entries]
    opened = {shard.path.name: shard for shard in store.shards}
    shards = [opened.get(name) or TokenDatastore.open(store.path / name) for name in names]
    manifest = replace(store.manifest, shards=names, num_tokens=sum(counts[name][0] for name in names),
                       num_documents=sum(counts[name][1] for name in names),
                       document_ids=[runs for _, runs in entries], next_document_id=next_document_id,
                       merged_order=write_merged_order(store.path, shards, names, workers=workers, progress=progress))
    manifest.write(store.path)
    if store.manifest.merged_order is not None:
        _delete_order(store.path / store.manifest.merged_order.file)
    return manifest


def merge_order(store_dir: str | Path, *, workers: int = 1, progress: bool = True) -> ShardedManifest:
    """Write the merged order of the sharded store at ``store_dir`` (a store built before stores
    had one; any it has is replaced) and publish it."""
    with _editing(Path(store_dir)) as (store, _):
        return _publish(store, list(zip(store.manifest.shards, store.id_runs())), [],
                        next_document_id=store.next_document_id, workers=workers, progress=progress)


def _ids_of(runs: list[list[int]]) -> np.ndarray:
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in runs]) if runs else np.zeros(0, np.int64)


def _refuse_unknown(store_dir: Path, wanted: np.ndarray, shard_ids: list[np.ndarray]) -> None:
    held = np.concatenate(shard_ids) if shard_ids else np.zeros(0, np.int64)
    unknown = wanted[~np.isin(wanted, held)]
    if len(unknown):
        shown = ", ".join(map(str, unknown[:8].tolist())) + (", ..." if len(unknown) > 8 else "")
        raise DatastoreError(f"{store_dir} holds no document with id {shown} (removed already, or never added: "
                             f"`vllm-retrieval-spec datastore inspect {store_dir}` lists each shard's ids); nothing "
                             "was changed")


def _without_documents(shard: TokenDatastore, drop: np.ndarray, directory: Path) -> ShardWritten:
    """Write ``shard``'s tokens without its documents where ``drop`` is set into ``directory``."""
    ends = np.flatnonzero(np.asarray(shard.tokens) == shard.separator) + 1
    starts = np.concatenate([[0], ends[:-1]])
    directory.mkdir()
    with open(directory / TOKENS, "wb") as handle:
        for first, last in id_runs(np.flatnonzero(~drop)):
            handle.write(np.asarray(shard.tokens[starts[first]:ends[last - 1]]).tobytes())
    kept = ~drop
    return ShardWritten(directory, int((ends - starts)[kept].sum()), int(kept.sum()))


def _delete_shard(directory: Path) -> None:
    """Delete a shard the new manifest no longer lists (an engine that still maps it keeps its
    pages until it moves to the new manifest)."""
    if is_shard_directory(directory):
        shutil.rmtree(directory)
    else:
        logger.warning("%s holds files no build wrote; left alone although no manifest lists it", directory)


def _delete_order(path: Path) -> None:
    """Delete an order file the new manifest no longer lists (an engine that still maps it keeps
    its pages until it moves to the new manifest)."""
    if is_order_file(path):
        path.unlink()


def _report(store_dir: Path, action: str, ids: list[list[int]], written: list[str], retired: list[str],
            manifest: ShardedManifest, start: float) -> EditReport:
    return EditReport(store_dir, action, ids, written, retired, manifest.num_tokens, manifest.num_documents,
                      time.perf_counter() - start)
