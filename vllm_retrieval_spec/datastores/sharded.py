"""Sharded datastores (format version 1): documents split over shards that REST searches as one.

A sharded datastore directory holds:

- ``shard-NNNNN/``: each a datastore of its own (``format.py``: tokens, suffix array, manifest),
  over a run of consecutive documents, at most ``2^31`` tokens;
- ``manifest.json``: format version, the shard directory names in document order, the total
  token and document counts, the token dtype and separator every shard shares, the tokenizer's
  identity, and how it was built.

REST's kernel searches the shards of a step in one call and drafts exactly what one suffix
array over the shards' concatenated tokens would (``csrc/sharded_store.h``); each shard is
memory-mapped read-only once per process, like a single-array store.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_retrieval_spec.datastores.background_check import VerifiedInBackground
from vllm_retrieval_spec.datastores.format import DATASTORE, TOKEN_DTYPES, DatastoreError
from vllm_retrieval_spec.datastores.reader import TokenDatastore
from vllm_retrieval_spec.storage import (
    MANIFEST,
    ArtifactKind,
    TokenizerIdentity,
    check_manifest_ints,
    manifest_record,
    read_manifest,
    refuse_another_identity,
    write_manifest,
)

FORMAT_VERSION = 1
SHARD_NAME = re.compile(r"shard-\d{5}")
MAX_SHARD_TOKENS = 2**31 - 1  # int32 suffix arrays

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

    def write(self, directory: Path) -> None:
        write_manifest(directory, asdict(self))

    @classmethod
    def read(cls, directory: Path) -> ShardedManifest:
        """The validated manifest: counts in range and at least one shard, each named
        ``shard-NNNNN`` (a directory inside this one: nothing a manifest says reaches outside)."""
        raw = read_manifest(directory, SHARDED_DATASTORE)
        tokenizer = manifest_record(directory, TokenizerIdentity, raw["tokenizer"], SHARDED_DATASTORE, "tokenizer")
        manifest = manifest_record(directory, cls, raw | {"tokenizer": tokenizer}, SHARDED_DATASTORE)
        check_manifest_ints(directory, SHARDED_DATASTORE, {
            "num_tokens": (manifest.num_tokens, 0, None),
            "num_documents": (manifest.num_documents, 0, manifest.num_tokens),
        })
        bad = [name for name in manifest.shards if not isinstance(name, str) or not SHARD_NAME.fullmatch(name)]
        if bad or not manifest.shards or len(set(manifest.shards)) != len(manifest.shards):
            raise SHARDED_DATASTORE.corrupt(directory, f"'shards' must list distinct shard-NNNNN names, not "
                                                       f"{manifest.shards[:4]!r}")
        return manifest


@dataclass
class ShardedDatastore(VerifiedInBackground):
    """Shards opened as datastores (memory-mapped, quick checks at open), which REST searches as
    one suffix array; ``usable`` until a checksum of any shard fails in the background."""

    noun = "datastore"
    drafter = "REST"

    path: Path
    manifest: ShardedManifest
    shards: tuple[TokenDatastore, ...]

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
        totals = {"num_tokens": sum(s.manifest.num_tokens for s in shards),
                  "num_documents": sum(s.manifest.num_documents for s in shards)}
        for key, total in totals.items():
            if getattr(manifest, key) != total:
                raise SHARDED_DATASTORE.corrupt(path, f"{key!r} is {getattr(manifest, key)}, its shards hold {total}")
        return cls(path=path, manifest=manifest, shards=shards)

    def check_tokenizer(self, expected: TokenizerIdentity) -> None:
        refuse_another_identity(SHARDED_DATASTORE, self.path, self.manifest.tokenizer, expected)

    def prefetch(self, wait: bool = False) -> None:
        for shard in self.shards:
            shard.prefetch(wait)

    @property
    def separator(self) -> int:
        return self.manifest.separator

    def check_fully(self) -> None:
        """Every shard's checksums."""
        for shard in self.shards:
            shard.check_fully()

    def describe(self) -> str:
        m = self.manifest
        size = sum(f["bytes"] for shard in self.shards for f in shard.manifest.files.values())
        lines = [
            f"sharded datastore {self.path}",
            f"  format version {m.format_version}; {m.num_tokens:,} tokens ({m.token_dtype}), {m.num_documents:,} "
            f"documents in {len(self.shards)} shards",
            f"  tokenizer {m.tokenizer.name!r}: vocab {m.tokenizer.vocab_size}, hash {m.tokenizer.vocab_sha256[:16]}",
            f"  {size / 1e6:.1f} MB on disk, {size / max(m.num_tokens, 1):.2f} bytes/token",
            f"  built {m.build.get('created', '?')} in {m.build.get('seconds', '?')} s",
        ]
        for shard in self.shards:
            bytes_on_disk = sum(f["bytes"] for f in shard.manifest.files.values())
            lines.append(f"  {shard.path.name}: {shard.manifest.num_tokens:,} tokens, "
                         f"{shard.manifest.num_documents:,} documents, {bytes_on_disk / 1e6:.1f} MB")
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
