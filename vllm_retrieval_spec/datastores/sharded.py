"""Sharded datastores (format version 1): documents split over shards that REST searches as one.

A sharded datastore directory holds:

- ``shard-NNNNN/``: each a datastore of its own (``format.py``: tokens, suffix array, manifest),
  over a run of consecutive documents, at most ``2^31`` tokens;
- ``manifest.json``: format version, the shard directory names in document order, the total
  token and document counts, the token dtype and separator every shard shares, the tokenizer's
  identity, how it was built, and each shard's document ids (runs of ``[first, stop)``; ids are
  given in order as documents are built or added, never reused; stores that do not list them
  number their documents consecutively), and the ``merged_order`` of a store of several shards;
- ``order-NNNNN.bin``: that merged order (``merged_order.py``), which REST samples continuations
  through.

``sharded_edit.py`` grows and shrinks a store in place; every change ends by renaming a new
manifest over the old one, so a reader sees the store before or after it, never between.

REST's kernel searches the shards of a step in one call and drafts exactly what one suffix
array over the shards' concatenated tokens would (``csrc/sharded_store.h``); each shard is
memory-mapped read-only once per process, like a single-array store.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vllm_retrieval_spec.datastores.background_check import VerifiedInBackground
from vllm_retrieval_spec.datastores.format import DATASTORE, TOKEN_DTYPES, DatastoreError
from vllm_retrieval_spec.datastores.merged_order import MergedOrderRecord, open_merged_order
from vllm_retrieval_spec.datastores.reader import TokenDatastore, prefetch_arrays
from vllm_retrieval_spec.kernels.extension import load_extension
from vllm_retrieval_spec.storage import (
    MANIFEST,
    ArtifactKind,
    TokenizerIdentity,
    check_manifest_ints,
    manifest_record,
    read_manifest,
    refuse_another_identity,
    verify_file_records,
)

FORMAT_VERSION = 1
SHARD_NAME = re.compile(r"shard-\d{5}")
MAX_SHARD_TOKENS = 2**31 - 1  # int32 suffix arrays
SELECTION_CACHE_SLOTS = 4096  # queries whose selected continuations are kept (~2 KB each at most)

SHARDED_DATASTORE = ArtifactKind(
    noun="sharded datastore",
    article="a",
    format_version=FORMAT_VERSION,
    error=DatastoreError,
    build_command="`vllm-retrieval-spec datastore build --tokenizer MODEL_DIR --input ... --out DIR --shard-tokens N`",
    required={"shards": list, "num_tokens": int, "num_documents": int, "separator": int, "tokenizer": dict,
              "build": dict},
    dtypes={"token_dtype": TOKEN_DTYPES},
)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def is_sharded_datastore(path: str | Path) -> bool:
    """Whether ``path``'s manifest lists shards (anything unreadable: not ours to judge here)."""
    try:
        return "shards" in json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError, TypeError):
        return False


@dataclass(frozen=True)
class ShardedManifest:
    """The parsed ``manifest.json`` of a sharded datastore."""

    format_version: int
    shards: list[str]
    num_tokens: int
    num_documents: int
    token_dtype: str
    separator: int
    tokenizer: TokenizerIdentity
    build: dict[str, Any]
    document_ids: list[Any] | None = None  # per shard, runs [first, stop) of its documents' ids
    next_document_id: int | None = None  # the id the next added document gets
    merged_order: MergedOrderRecord | None = None  # of several shards (merged_order.py)

    def write(self, directory: Path) -> None:
        """Write the manifest next to its place and rename it there (a reader sees all or nothing)."""
        partial = directory / f".{MANIFEST}.partial"
        partial.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(partial, directory / MANIFEST)

    @classmethod
    def read(cls, directory: Path) -> ShardedManifest:
        """The validated manifest: counts in range and at least one shard, each named
        ``shard-NNNNN`` (a directory inside this one: nothing a manifest says reaches outside)."""
        raw = read_manifest(directory, SHARDED_DATASTORE)
        nested = {"tokenizer": manifest_record(directory, TokenizerIdentity, raw["tokenizer"], SHARDED_DATASTORE,
                                               "tokenizer")}
        if raw.get("merged_order") is not None:
            nested["merged_order"] = manifest_record(directory, MergedOrderRecord, raw["merged_order"],
                                                     SHARDED_DATASTORE, "merged_order")
        manifest = manifest_record(directory, cls, raw | nested, SHARDED_DATASTORE)
        check_manifest_ints(directory, SHARDED_DATASTORE, {
            "num_tokens": (manifest.num_tokens, 0, None),
            "num_documents": (manifest.num_documents, 0, manifest.num_tokens),
        })
        bad = [name for name in manifest.shards if not isinstance(name, str) or not SHARD_NAME.fullmatch(name)]
        if bad or not manifest.shards or len(set(manifest.shards)) != len(manifest.shards):
            raise SHARDED_DATASTORE.corrupt(directory, f"'shards' must list distinct shard-NNNNN names, not "
                                                       f"{manifest.shards[:4]!r}")
        _check_document_ids(directory, manifest)
        return manifest


def _check_document_ids(directory: Path, manifest: ShardedManifest) -> None:
    """``document_ids`` (when listed) holds one list per shard of increasing, disjoint
    ``[first, stop)`` runs, all below ``next_document_id``."""
    runs, next_id = manifest.document_ids, manifest.next_document_id
    if runs is None and next_id is None:
        return
    if runs is None or type(next_id) is not int or len(runs) != len(manifest.shards):
        raise SHARDED_DATASTORE.corrupt(directory, "'document_ids' and 'next_document_id' must be given together, "
                                                   "one list of runs per shard")
    previous = 0
    for run in [run for shard_runs in runs for run in (shard_runs if isinstance(shard_runs, list) else [shard_runs])]:
        if not (isinstance(run, list) and len(run) == 2 and all(type(v) is int for v in run)
                and previous <= run[0] < run[1] <= next_id):
            raise SHARDED_DATASTORE.corrupt(directory, f"'document_ids' must hold increasing, disjoint [first, stop) "
                                                       f"runs below 'next_document_id' ({next_id}), not {run!r}")
        previous = run[1]


def consecutive_id_runs(first: int, counts: list[int]) -> list[list[list[int]]]:
    """The id runs of shards of ``counts`` documents numbered consecutively from ``first``."""
    stops = np.cumsum([first, *counts]).tolist()
    return [[[a, b]] if b > a else [] for a, b in itertools.pairwise(stops)]


def format_id_runs(runs: list[list[int]], most: int = 4) -> str:
    """``runs`` as people read them: ``0-4, 7, 9-12`` (the first ``most`` runs, then a count)."""
    shown = ", ".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in runs[:most])
    more = f" and {len(runs) - most} more runs" if len(runs) > most else ""
    return (shown + more) or "none"


def id_runs(ids: np.ndarray) -> list[list[int]]:
    """Increasing ``ids`` as runs of consecutive ones, ``[[first, stop), ...]``."""
    if len(ids) == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    firsts = ids[np.concatenate([[0], breaks])]
    lasts = ids[np.concatenate([breaks - 1, [len(ids) - 1]])]
    return [[int(first), int(last) + 1] for first, last in zip(firsts, lasts)]


@dataclass
class ShardedDatastore(VerifiedInBackground):
    """Shards opened as datastores (memory-mapped, quick checks at open), which REST searches as
    one suffix array, sampling continuations through their ``merged_order`` (the extension's,
    when the manifest lists one) or else remembering in ``selection_cache`` the continuations it
    selected for frequent queries; ``usable`` until a checksum of any file fails in the
    background."""

    noun = "datastore"
    drafter = "REST"

    path: Path
    manifest: ShardedManifest
    shards: tuple[TokenDatastore, ...]
    merged_order: Any = None
    order_entries: np.ndarray | None = None  # what merged_order reads (memory-mapped)
    selection_cache: Any = field(default_factory=lambda: load_extension().SelectionCache(SELECTION_CACHE_SLOTS))

    @classmethod
    def open(cls, path: str | Path, expected_tokenizer: TokenizerIdentity | None = None) -> ShardedDatastore:
        """Open every shard; fail naming the shard when one is missing, corrupt or disagrees with
        the manifest (tokenizer, dtype, separator, totals)."""
        path = Path(path)
        manifest = ShardedManifest.read(path)
        if expected_tokenizer is not None:
            refuse_another_identity(SHARDED_DATASTORE, path, manifest.tokenizer, expected_tokenizer)
        shards = tuple(TokenDatastore.open(path / name, expected_tokenizer=manifest.tokenizer)
                       for name in manifest.shards)
        for shard in shards:
            _check_shard(path, manifest, shard)
        listed = manifest.document_ids or [None] * len(shards)
        for shard, runs in zip(shards, listed):
            if runs is not None and sum(stop - first for first, stop in runs) != shard.manifest.num_documents:
                raise SHARDED_DATASTORE.corrupt(path, f"'document_ids' lists {sum(b - a for a, b in runs)} ids for "
                                                      f"{shard.path.name}, which holds {shard.manifest.num_documents}")
        totals = {"num_tokens": sum(s.manifest.num_tokens for s in shards),
                  "num_documents": sum(s.manifest.num_documents for s in shards)}
        for key, total in totals.items():
            if getattr(manifest, key) != total:
                raise SHARDED_DATASTORE.corrupt(path, f"{key!r} is {getattr(manifest, key)}, its shards hold {total}")
        entries, order = None, None
        if manifest.merged_order is not None:
            entries, order = open_merged_order(path, manifest.merged_order, manifest.shards,
                                               [s.manifest.num_tokens for s in shards], SHARDED_DATASTORE)
        return cls(path=path, manifest=manifest, shards=shards, merged_order=order, order_entries=entries)

    def check_tokenizer(self, expected: TokenizerIdentity) -> None:
        refuse_another_identity(SHARDED_DATASTORE, self.path, self.manifest.tokenizer, expected)

    def prefetch(self, wait: bool = False) -> None:
        for shard in self.shards:
            shard.prefetch(wait)
        if self.order_entries is not None:
            prefetch_arrays([self.order_entries], wait)

    @property
    def separator(self) -> int:
        return self.manifest.separator

    def id_runs(self) -> list[list[list[int]]]:
        """Each shard's document ids as runs ``[first, stop)`` (consecutive from 0 when the
        manifest lists none: a store as built)."""
        if self.manifest.document_ids is not None:
            return self.manifest.document_ids
        return consecutive_id_runs(0, [shard.manifest.num_documents for shard in self.shards])

    @property
    def next_document_id(self) -> int:
        listed = self.manifest.next_document_id
        return self.manifest.num_documents if listed is None else listed

    def check_fully(self) -> None:
        """Every shard's checksums, and the merged order's."""
        for shard in self.shards:
            shard.check_fully()
        if (order := self.manifest.merged_order) is not None:
            verify_file_records(self.path, {order.file: {"sha256": order.sha256}}, SHARDED_DATASTORE)

    def describe(self) -> str:
        m = self.manifest
        size = sum(f["bytes"] for shard in self.shards for f in shard.manifest.files.values())
        size += m.merged_order.bytes if m.merged_order else 0
        lines = [
            f"sharded datastore {self.path}",
            f"  format version {m.format_version}; {m.num_tokens:,} tokens ({m.token_dtype}), {m.num_documents:,} "
            f"documents in {len(self.shards)} shards",
            f"  tokenizer {m.tokenizer.name!r}: vocab {m.tokenizer.vocab_size}, hash {m.tokenizer.vocab_sha256[:16]}",
            f"  {size / 1e6:.1f} MB on disk, {size / max(m.num_tokens, 1):.2f} bytes/token",
            f"  built {m.build.get('created', '?')} in {m.build.get('seconds', '?')} s",
        ]
        if (order := m.merged_order) is not None:
            lines.append(f"  merged order {order.file}: {order.dtype} entries sorted to {order.depth} tokens, "
                         f"{order.bytes / 1e6:.1f} MB")
        for shard, runs in zip(self.shards, self.id_runs()):
            bytes_on_disk = sum(f["bytes"] for f in shard.manifest.files.values())
            lines.append(f"  {shard.path.name}: {shard.manifest.num_tokens:,} tokens, "
                         f"{shard.manifest.num_documents:,} documents (ids {format_id_runs(runs)}), "
                         f"{bytes_on_disk / 1e6:.1f} MB")
        return "\n".join(lines)


def _check_shard(path: Path, manifest: ShardedManifest, shard: TokenDatastore) -> None:
    """A shard agrees with the store's manifest: its dtype and separator, and int32 positions."""
    if shard.manifest.token_dtype != manifest.token_dtype or shard.separator != manifest.separator:
        raise DATASTORE.fail(f"{shard.path / MANIFEST} holds {shard.manifest.token_dtype} tokens with separator "
                             f"{shard.separator}, but {path / MANIFEST} says {manifest.token_dtype} with "
                             f"{manifest.separator}")
    if shard.manifest.num_tokens > MAX_SHARD_TOKENS:
        raise DATASTORE.fail(f"{shard.path / MANIFEST} holds {shard.manifest.num_tokens:,} tokens, more than a "
                             f"shard's {MAX_SHARD_TOKENS:,}")


def open_datastore(path: str | Path,
                   expected_tokenizer: TokenizerIdentity | None = None) -> TokenDatastore | ShardedDatastore:
    """The datastore at ``path``, single-array or sharded (by its manifest)."""
    if is_sharded_datastore(path):
        return ShardedDatastore.open(path, expected_tokenizer)
    return TokenDatastore.open(path, expected_tokenizer)
