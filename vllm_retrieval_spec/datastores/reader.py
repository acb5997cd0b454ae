"""Opening a datastore: read-only memory maps shared by every vLLM worker process."""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_retrieval_spec.datastores.format import (
    DATASTORE,
    SUFFIX_ARRAY,
    TOKENS,
    DatastoreError,
    Manifest,
    TokenizerIdentity,
)
from vllm_retrieval_spec.storage import map_array, verify_file_records

SAMPLED_ORDER_CHECKS = 64
ORDER_CHECK_TOKENS = 32


@dataclass
class TokenDatastore:
    """A token array with document separators and its suffix array, memory-mapped read-only."""

    path: Path
    manifest: Manifest
    tokens: np.ndarray
    suffix_array: np.ndarray
    first_token_offsets: np.ndarray | None = None

    @classmethod
    def open(cls, path: str | Path, expected_tokenizer: TokenizerIdentity | None = None) -> TokenDatastore:
        """Open ``path``; fail with the file named when it is truncated or corrupt, and with
        both tokenizers named when it was built for another tokenizer."""
        path = Path(path)
        manifest = Manifest.read(path)
        if expected_tokenizer is not None:
            _refuse_another_tokenizer(path, manifest.tokenizer, expected_tokenizer)
        store = cls(
            path=path,
            manifest=manifest,
            tokens=map_array(path / TOKENS, manifest.token_dtype, (manifest.num_tokens,), DATASTORE),
            suffix_array=map_array(path / SUFFIX_ARRAY, manifest.suffix_array_dtype, (manifest.num_tokens,), DATASTORE),
        )
        store.check_quickly()
        store.first_token_offsets = first_token_offsets(
            store.tokens, store.separator, manifest.tokenizer.vocab_size, path / TOKENS
        )
        return store

    def check_tokenizer(self, expected: TokenizerIdentity) -> None:
        """Fail naming both tokenizers when the store was built for another one than ``expected``."""
        _refuse_another_tokenizer(self.path, self.manifest.tokenizer, expected)

    def prefetch(self, wait: bool = False) -> None:
        """Ask the kernel to read both files into the page cache (``madvise(WILLNEED)``, which
        returns at once); with ``wait`` also touch every page so that lookups never fault."""
        for array in (self.tokens, self.suffix_array):
            mapping = getattr(array, "_mmap", None)
            if mapping is not None and hasattr(mmap, "MADV_WILLNEED"):
                mapping.madvise(mmap.MADV_WILLNEED)
            if wait:
                step = 1 << 24
                for start in range(0, len(array), step):
                    int(np.asarray(array[start:start + step]).max())

    @property
    def separator(self) -> int:
        return self.manifest.separator

    def check_quickly(self) -> None:
        """Cheap structural checks run at every open (ends, sampled suffix order)."""
        n = self.manifest.num_tokens
        if n == 0:
            return
        if int(self.tokens[-1]) != self.separator:
            raise DATASTORE.fail(f"{self.path / TOKENS} does not end with a document separator")
        for index in np.linspace(0, n - 2, num=min(SAMPLED_ORDER_CHECKS, n - 1), dtype=np.int64):
            self._check_suffix_order(int(index))

    def check_fully(self) -> None:
        """Checksums of every file against the manifest (reads everything once)."""
        verify_file_records(self.path, self.manifest.files, DATASTORE)

    def _check_suffix_order(self, index: int) -> None:
        n = self.manifest.num_tokens
        a, b = int(self.suffix_array[index]), int(self.suffix_array[index + 1])
        if not (0 <= a < n and 0 <= b < n):
            raise DATASTORE.fail(f"{self.path / SUFFIX_ARRAY} is corrupt: entry {index} points outside the tokens")
        left = self.tokens[a : a + ORDER_CHECK_TOKENS].tolist()
        right = self.tokens[b : b + ORDER_CHECK_TOKENS].tolist()
        if left > right:
            raise DATASTORE.fail(
                f"{self.path / SUFFIX_ARRAY} (or {TOKENS}) is corrupt: suffixes {index} and "
                f"{index + 1} are out of order"
            )

    def describe(self) -> str:
        m = self.manifest
        size = sum(f["bytes"] for f in m.files.values())
        return "\n".join([
            f"datastore {self.path}",
            f"  format version {m.format_version}; {m.num_tokens:,} tokens ({m.token_dtype}), "
            f"{m.num_documents:,} documents, suffix array {m.suffix_array_dtype}",
            f"  tokenizer {m.tokenizer.name!r}: vocab {m.tokenizer.vocab_size}, hash {m.tokenizer.vocab_sha256[:16]}",
            f"  {size / 1e6:.1f} MB on disk, {size / max(m.num_tokens, 1):.2f} bytes/token",
            f"  built {m.build.get('created', '?')} in {m.build.get('seconds', '?')} s",
        ])


def _refuse_another_tokenizer(path: Path, built: TokenizerIdentity, expected: TokenizerIdentity) -> None:
    if not built.matches(expected):
        raise DatastoreError(
            f"datastore {path} was built with tokenizer {built.name!r} "
            f"(vocab {built.vocab_size}, hash {built.vocab_sha256[:12]}), "
            f"but the model is served with tokenizer {expected.name!r} "
            f"(vocab {expected.vocab_size}, hash {expected.vocab_sha256[:12]}); "
            "rebuild the datastore with `vllm-retrieval-spec datastore build --tokenizer MODEL_DIR ...`"
        )


def first_token_offsets(
    tokens: np.ndarray, separator: int, vocab_size: int, where: Path | str = "tokens"
) -> np.ndarray:
    """``offsets[t]`` = tokens below ``t`` (separators excluded, they sort last): the suffixes
    starting with ``t`` occupy ``suffix_array[offsets[t]:offsets[t + 1]]``. One pass over
    the tokens (which also warms their pages); lets every binary search start in its bucket."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    step = 1 << 24
    for start in range(0, len(tokens), step):
        chunk = np.asarray(tokens[start:start + step])
        chunk_counts = np.bincount(chunk[chunk != separator], minlength=vocab_size)
        if len(chunk_counts) > vocab_size:
            raise DATASTORE.fail(
                f"{where} holds token ids >= the vocabulary size {vocab_size}; the store is corrupt "
                "or was built with another tokenizer"
            )
        counts += chunk_counts
    offsets = np.zeros(vocab_size + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets

