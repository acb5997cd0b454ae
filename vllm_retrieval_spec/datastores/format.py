"""The on-disk format of a token datastore (format version 1).

A datastore directory holds:

- ``tokens.bin``: every document's token ids, each document followed by ``separator`` (the
  dtype's maximum, never a token id), as raw little-endian ``uint16`` when the vocabulary
  leaves room for the separator, ``uint32`` otherwise;
- ``suffix_array.bin``: the suffix array of ``tokens.bin`` from pydivsufsort, raw ``int32``
  below 2^31 tokens, ``int64`` above;
- ``manifest.json``: format version, counts, dtypes, build parameters, file sizes and
  sha256s, and the tokenizer's identity (name, vocab size, hash of the vocabulary).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_retrieval_spec.storage import (
    MAX_VOCAB_SIZE,
    ArtifactKind,
    StorageError,
    TokenizerIdentity,
    check_manifest_ints,
    manifest_record,
    read_manifest,
    write_manifest,
)

if TYPE_CHECKING:
    pass

FORMAT_VERSION = 1
TOKENS = "tokens.bin"
SUFFIX_ARRAY = "suffix_array.bin"
TOKEN_DTYPES = ("uint16", "uint32")
SUFFIX_ARRAY_DTYPES = ("int32", "int64")


class DatastoreError(StorageError):
    """A datastore is missing, corrupt, truncated, or belongs to another tokenizer."""


DATASTORE = ArtifactKind(
    noun="datastore",
    article="a",
    format_version=FORMAT_VERSION,
    error=DatastoreError,
    build_command="`vllm-retrieval-spec datastore build --tokenizer MODEL_DIR --input ... --out DIR`",
    required={"num_tokens": int, "num_documents": int, "separator": int, "tokenizer": dict, "files": dict,
              "build": dict},
    dtypes={"token_dtype": TOKEN_DTYPES, "suffix_array_dtype": SUFFIX_ARRAY_DTYPES},
    data_files=(TOKENS, SUFFIX_ARRAY),
)


def token_dtype_for(vocab_size: int) -> np.dtype:
    """uint16 when every id and the separator fit, else uint32 (with an error beyond that)."""
    if vocab_size < np.iinfo(np.uint16).max:
        return np.dtype(np.uint16)
    if vocab_size < np.iinfo(np.uint32).max:
        return np.dtype(np.uint32)
    raise DatastoreError(f"a vocabulary of {vocab_size} tokens does not fit uint32 token storage")


def suffix_array_dtype_for(num_tokens: int) -> np.dtype:
    return np.dtype(np.int32) if num_tokens < 2**31 else np.dtype(np.int64)


def separator_for(token_dtype: np.dtype) -> int:
    return int(np.iinfo(token_dtype).max)


@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json``."""

    format_version: int
    num_tokens: int
    num_documents: int
    token_dtype: str
    suffix_array_dtype: str
    separator: int
    tokenizer: TokenizerIdentity
    files: dict[str, dict[str, Any]]
    build: dict[str, Any]

    def write(self, directory: Path) -> None:
        write_manifest(directory, asdict(self))

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        """The validated manifest of the datastore in ``directory``."""
        raw = read_manifest(directory, DATASTORE)
        tokenizer = manifest_record(directory, TokenizerIdentity, raw["tokenizer"], DATASTORE, "tokenizer")
        manifest = manifest_record(directory, cls, raw | {"tokenizer": tokenizer}, DATASTORE)
        manifest.check(Path(directory))
        return manifest

    def check(self, directory: Path) -> None:
        """Values the reader relies on: counts >= 0, the token dtype's separator, and a vocabulary
        whose ids lie below it."""
        separator = separator_for(np.dtype(self.token_dtype))
        check_manifest_ints(directory, DATASTORE, {
            "num_tokens": (self.num_tokens, 0, None),
            "num_documents": (self.num_documents, 0, self.num_tokens),
            "separator": (self.separator, separator, separator),
            "tokenizer.vocab_size": (self.tokenizer.vocab_size, 1, min(separator, MAX_VOCAB_SIZE)),
        })
