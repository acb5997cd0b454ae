"""A sharded datastore's merged order (``csrc/merged_order.h``): its shards' suffixes in one
sequence sorted by their first ``depth`` tokens, one entry per token (the suffix's position in
the shards' concatenated tokens; uint32 below 2^32 tokens, else uint64).

With it REST samples a match's continuations with one read each, where without it every sampled
rank is selected across the shards by comparing tokens (``csrc/sharded_store.h``); the drafts
are the same either way. It is written when a store of several shards is built and again at
every ``datastore add`` / ``remove`` (``order-NNNNN.bin`` under a fresh name, published with
the manifest that lists it: an engine still mapping the old one keeps reading it until it moves
to the new manifest). The manifest records which shards it was merged from; one recorded for
other shards is refused as corrupt.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from vllm_retrieval_spec.kernels.extension import load_extension
from vllm_retrieval_spec.kernels.rest import native_suffix_store
from vllm_retrieval_spec.storage import ArtifactKind, file_records, map_array

# Tokens the order is sorted to: REST's longest match (n_max, default 16) and its continuation
# (num_speculative_tokens, 32 recommended) fit; a deeper one is selected across the shards.
MERGED_ORDER_DEPTH = 64
ORDER_FILE = re.compile(r"order-\d{5}\.bin")
PARTS_PER_WORKER = 16  # merged independently, a few at a time (a progress bar's steps)
MIN_PART_TOKENS = 1 << 16


@dataclass(frozen=True)
class MergedOrderRecord:
    """The manifest's ``merged_order``: the file, the shards it merges (in store order), the
    depth its suffixes are sorted to, its dtype, size and checksum."""

    file: str
    shards: list[str]
    depth: int
    dtype: str
    bytes: int
    sha256: str


def order_dtype(num_tokens: int) -> np.dtype:
    """uint32 entries while every position fits, else uint64."""
    return np.dtype(np.uint32 if num_tokens <= 2**32 else np.uint64)


def next_order_name(directory: Path) -> str:
    """``order-NNNNN.bin`` numbered after every order file in ``directory``."""
    taken = [int(entry.name[len("order-"):-len(".bin")]) for entry in directory.iterdir()
             if ORDER_FILE.fullmatch(entry.name)]
    return f"order-{max(taken, default=-1) + 1:05d}.bin"


def merge_shard_orders(shards: Sequence[object], out: np.ndarray, *, depth: int = MERGED_ORDER_DEPTH,
                       workers: int = 1, parts: int | None = None, progress: bool = False) -> np.ndarray:
    """Fill ``out`` (uint32 or uint64, one entry per token of ``shards``: datastores in store
    order) with their merged order, in ``parts`` (default: by size) merged ``workers`` at a time
    on the extension's thread pool; returns ``out``."""
    ext = load_extension()
    native = [native_suffix_store(shard) for shard in shards]
    total = len(out)
    workers = max(workers, 1)
    parts = parts or int(np.clip(total // MIN_PART_TOKENS, 1, workers * PARTS_PER_WORKER))
    cuts = ext.merged_order_cuts(native, parts, depth)
    starts = cuts.sum(axis=1)
    with tqdm(total=total, unit="suffix", unit_scale=True, desc="merging the shards' order",
              disable=not progress) as bar:
        for first in range(0, parts, workers):
            last = min(first + workers, parts)
            ext.merge_shard_parts(native, cuts, first, last, depth, out[starts[first]:starts[last]],
                                  num_threads=workers)
            bar.update(int(starts[last] - starts[first]))
    return out


def write_merged_order(directory: Path, shards: Sequence[object], names: Sequence[str], *,
                       depth: int = MERGED_ORDER_DEPTH, workers: int = 1,
                       progress: bool = True) -> MergedOrderRecord | None:
    """Merge ``shards`` (opened datastores, store order; ``names`` their directory names) into a
    new order file in ``directory``: written under a hidden partial name, flushed and renamed
    (never half-written under its name). Returns its manifest record (None for one shard, which
    needs none)."""
    if len(shards) < 2:
        return None
    total = sum(len(shard.tokens) for shard in shards)
    dtype = order_dtype(total)
    name = next_order_name(directory)
    partial = directory / f".{name}.partial"
    if total:
        entries = np.memmap(partial, dtype=dtype, mode="w+", shape=(total,))
        merge_shard_orders(shards, entries, depth=depth, workers=workers, progress=progress)
        entries.flush()
        del entries
    with open(partial, "ab") as handle:
        os.fsync(handle.fileno())
    os.replace(partial, directory / name)
    record = file_records(directory, [name])[name]
    return MergedOrderRecord(name, list(names), depth, dtype.name, record["bytes"], record["sha256"])


def is_order_file(entry: Path) -> bool:
    """Whether ``entry`` is an order file, or one being written (a regular file of those names)."""
    name = entry.name
    if name.startswith(".") and name.endswith(".partial"):
        name = name[1:-len(".partial")]
    return ORDER_FILE.fullmatch(name) is not None and entry.is_file() and not entry.is_symlink()


def open_merged_order(directory: Path, record: MergedOrderRecord, names: Sequence[str], sizes: Sequence[int],
                      kind: ArtifactKind) -> tuple[np.ndarray, object]:
    """The memory-mapped order file of the store at ``directory`` whose shards are ``names`` of
    ``sizes`` tokens (its size checked here, its checksum with the store's) and the extension's
    ``MergedOrder`` over it; a record of other shards, or of another shape, is corrupt."""
    if list(record.shards) != list(names):
        raise kind.corrupt(directory, f"'merged_order' merges {record.shards[:4]!r}, not the store's shards "
                                      f"{list(names)[:4]!r}")
    if not ORDER_FILE.fullmatch(record.file) or record.dtype not in ("uint32", "uint64") or record.depth < 1:
        raise kind.corrupt(directory, f"'merged_order' must name an order-NNNNN.bin file of uint32 or uint64 "
                                      f"entries with a depth >= 1, not {record.file!r}, {record.dtype!r}, "
                                      f"{record.depth!r}")
    entries = map_array(directory / record.file, record.dtype, (sum(sizes),), kind)
    return entries, load_extension().MergedOrder(entries, list(sizes), record.depth)
