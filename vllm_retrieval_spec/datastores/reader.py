"""Opening a datastore: read-only memory maps shared by every vLLM worker process."""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_retrieval_spec.datastores.background_check import VerifiedInBackground
from vllm_retrieval_spec.datastores.format import (
    DATASTORE,
    SUFFIX_ARRAY,
    TOKENS,
    Manifest,
)
from vllm_retrieval_spec.kernels.extension import load_extension
from vllm_retrieval_spec.kernels.rest import native_suffix_store
from vllm_retrieval_spec.storage import TokenizerIdentity, map_array, refuse_another_identity, verify_file_records

ORDER_CHECK_SAMPLES = 1 << 20  # adjacent suffix pairs compared at open (every pair below this)
ORDER_CHECK_TOKENS = 32  # tokens compared per pair


@dataclass
class TokenDatastore(VerifiedInBackground):
    """A token array with document separators and its suffix array, memory-mapped read-only;
    ``usable`` until a checksum verified in the background fails (REST then drafts without it)."""

    noun = "datastore"
    drafter = "REST"

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
            refuse_another_identity(DATASTORE, path, manifest.tokenizer, expected_tokenizer)
        store = cls(
            path=path,
            manifest=manifest,
            tokens=map_array(path / TOKENS, manifest.token_dtype, (manifest.num_tokens,), DATASTORE),
            suffix_array=map_array(path / SUFFIX_ARRAY, manifest.suffix_array_dtype, (manifest.num_tokens,), DATASTORE),
        )
        store.first_token_offsets = first_token_offsets(
            store.tokens, store.separator, manifest.tokenizer.vocab_size, path / TOKENS
        )
        store.check_quickly()
        return store

    def check_tokenizer(self, expected: TokenizerIdentity) -> None:
        """Fail naming both tokenizers when the store was built for another one than ``expected``."""
        refuse_another_identity(DATASTORE, self.path, self.manifest.tokenizer, expected)

    def prefetch(self, wait: bool = False) -> None:
        """Ask the kernel to read both files into the page cache (``madvise(WILLNEED)``, which
        returns at once); with ``wait`` also touch every page so that lookups never fault."""
        prefetch_arrays((self.tokens, self.suffix_array), wait)

    @property
    def separator(self) -> int:
        return self.manifest.separator

    @property
    def shards(self) -> tuple[TokenDatastore]:
        """The suffix arrays REST searches as one: this store's own (see ``sharded.py``)."""
        return (self,)

    def check_quickly(self, seed: int | None = None) -> None:
        """Structural checks run at every open, under a second for 100M tokens: the tokens end
        with a separator; the suffix array (C++, ``csrc/store_check.h``) is a permutation
        (range, sum and sum of squares of every entry), each first-token bucket starts and ends
        with its token, and ``ORDER_CHECK_SAMPLES`` random adjacent suffixes (``seed``; every pair
        of a smaller store) are in order over ``ORDER_CHECK_TOKENS`` tokens."""
        if self.manifest.num_tokens == 0:
            return
        if int(self.tokens[-1]) != self.separator:
            raise DATASTORE.fail(f"{self.path / TOKENS} does not end with a document separator")
        seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed
        found = load_extension().check_suffix_store(native_suffix_store(self), ORDER_CHECK_SAMPLES,
                                                    ORDER_CHECK_TOKENS, seed)
        if found is not None:
            suffix_array_only, problem = found
            where = self.path / SUFFIX_ARRAY if suffix_array_only else f"{self.path / SUFFIX_ARRAY} (or {TOKENS})"
            raise DATASTORE.fail(f"{where} is corrupt: {problem}")

    def check_fully(self) -> None:
        """Checksums of every file against the manifest (reads everything once)."""
        verify_file_records(self.path, self.manifest.files, DATASTORE)

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


def prefetch_arrays(arrays: Sequence[np.ndarray], wait: bool) -> None:
    """``madvise(WILLNEED)`` on memory-mapped ``arrays``; with ``wait`` also touch every page."""
    for array in arrays:
        mapping = getattr(array, "_mmap", None)
        if mapping is not None and hasattr(mmap, "MADV_WILLNEED"):
            mapping.madvise(mmap.MADV_WILLNEED)
        if wait:
            step = 1 << 24
            for start in range(0, len(array), step):
                int(np.asarray(array[start:start + step]).max())


def first_token_offsets(
    tokens: np.ndarray, separator: int, vocab_size: int, where: Path | str = "tokens"
) -> np.ndarray:
    """``offsets[t]`` = tokens below ``t`` (separators excluded, they sort last): the suffixes
    starting with ``t`` occupy ``suffix_array[offsets[t]:offsets[t + 1]]``. One pass over
    the tokens in C++ (which also warms their pages); lets every binary search start in its bucket."""
    counts, bad = load_extension().token_counts(np.ascontiguousarray(tokens), separator, vocab_size)
    if bad >= 0:
        raise DATASTORE.fail(
            f"{where} holds token ids >= the vocabulary size {vocab_size} (token {int(tokens[bad])} at {bad}); "
            "the store is corrupt or was built with another tokenizer"
        )
    offsets = np.zeros(vocab_size + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets
