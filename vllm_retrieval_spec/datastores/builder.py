"""Streaming datastore builder: tokenise in batches, write tokens as they come, then sort
the suffixes with pydivsufsort; written to a temporary directory and renamed into place."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
from tqdm import tqdm

from vllm_retrieval_spec import __version__
from vllm_retrieval_spec.datastores.format import (
    DATASTORE,
    FORMAT_VERSION,
    SUFFIX_ARRAY,
    TOKENS,
    Manifest,
    TokenizerIdentity,
    separator_for,
    suffix_array_dtype_for,
    token_dtype_for,
)
from vllm_retrieval_spec.datastores.sources import ChatRenderer, DocumentStream, InputSpec
from vllm_retrieval_spec.storage import (
    TOKENIZER_FILES,
    atomic_directory,
    check_build_target,
    file_records,
    local_model_dir,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

BATCH_CHARS = 2_000_000


@dataclass(frozen=True)
class BuildReport:
    """What a build produced and how fast."""

    path: Path
    num_tokens: int
    num_documents: int
    seconds: float
    tokenize_seconds: float
    sort_seconds: float
    bytes_on_disk: int
    files_read: int
    files_skipped: int  # binary files (see ``sources.looks_binary``)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_on_disk / max(self.num_tokens, 1)

    def describe(self) -> str:
        """One line: what was built, from what, how fast and how big."""
        return (f"built {self.path}: {self.num_tokens:,} tokens, {self.num_documents:,} documents from "
                f"{self.files_read:,} file(s) ({self.files_skipped:,} binary skipped) in {self.seconds:.1f} s "
                f"({self.tokens_per_second / 1e6:.2f}M tokens/s; tokenize {self.tokenize_seconds:.1f} s, sort "
                f"{self.sort_seconds:.1f} s), {self.bytes_per_token:.2f} bytes/token")


def load_tokenizer(tokenizer_dir: str | Path, flag: str = "--tokenizer") -> PreTrainedTokenizerFast:
    """The fast tokenizer of a local model directory (``flag`` names it in errors)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(local_model_dir(tokenizer_dir, flag, TOKENIZER_FILES)))
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{tokenizer_dir}: datastores need a fast (Rust) tokenizer")
    return tokenizer


def build_datastore(
    tokenizer_dir: str | Path,
    inputs: Sequence[InputSpec],
    out_dir: str | Path,
    *,
    replace: bool = False,
    progress: bool = True,
    extra_build_info: dict[str, Any] | None = None,
) -> BuildReport:
    """Build a datastore from ``inputs`` with the tokenizer in ``tokenizer_dir``."""
    out_dir = Path(out_dir)
    check_build_target(out_dir, replace, DATASTORE)
    tokenizer = load_tokenizer(tokenizer_dir)
    identity = TokenizerIdentity.of(tokenizer, name=Path(tokenizer_dir).name)
    token_dtype = token_dtype_for(identity.vocab_size)
    render_chat = chat_renderer(tokenizer)
    stream = DocumentStream(inputs, render_chat)
    start = time.perf_counter()
    with atomic_directory(out_dir, replace=replace, kind=DATASTORE) as tmp:
        with open(tmp / TOKENS, "wb") as handle:
            num_tokens, num_documents = _write_tokens(tokenizer, stream, handle, token_dtype, progress)
        tokenize_seconds = time.perf_counter() - start
        sort_seconds = _write_suffix_array(tmp, num_tokens, token_dtype)
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            num_tokens=num_tokens,
            num_documents=num_documents,
            token_dtype=token_dtype.name,
            suffix_array_dtype=suffix_array_dtype_for(num_tokens).name,
            separator=separator_for(token_dtype),
            tokenizer=identity,
            files=file_records(tmp, (TOKENS, SUFFIX_ARRAY)),
            build={
                "inputs": [
                    {"path": str(s.path), "include": list(s.include), "exclude": list(s.exclude),
                     "text_field": s.text_field}
                    for s in inputs
                ],
                "tokenizer_dir": str(tokenizer_dir),
                "files_read": stream.files_read,
                "files_skipped_binary": stream.files_skipped,
                "package_version": __version__,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "seconds": round(time.perf_counter() - start, 2),
                **(extra_build_info or {}),
            },
        )
        manifest.write(tmp)
    seconds = time.perf_counter() - start
    size = sum(f["bytes"] for f in manifest.files.values())
    return BuildReport(out_dir, num_tokens, num_documents, seconds, tokenize_seconds, sort_seconds, size,
                       stream.files_read, stream.files_skipped)


def chat_renderer(tokenizer: PreTrainedTokenizerFast) -> ChatRenderer | None:
    """Renders chat messages with the tokenizer's chat template (None when it has none)."""
    if not getattr(tokenizer, "chat_template", None):
        return None

    def render(messages: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False)

    return render


def document_batches(documents: Iterable[str], batch_chars: int = BATCH_CHARS) -> Iterator[list[str]]:
    """The documents in lists of about ``batch_chars`` characters (tokenized together)."""
    batch: list[str] = []
    size = 0
    for document in documents:
        batch.append(document)
        size += len(document)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _write_tokens(tokenizer: PreTrainedTokenizerFast, stream: DocumentStream, handle: BinaryIO, dtype: np.dtype,
                  progress: bool) -> tuple[int, int]:
    backend = tokenizer.backend_tokenizer
    separator = np.array([separator_for(dtype)], dtype=dtype)
    num_tokens = num_documents = 0
    start = time.perf_counter()
    total_files = stream.count_files()
    bar = tqdm(total=total_files, unit="file" if total_files is not None else "doc",
               desc="tokenizing", disable=not progress, dynamic_ncols=True)
    with bar:
        for batch in document_batches(stream):
            encodings = backend.encode_batch_fast(batch, add_special_tokens=False)
            pieces = []
            for encoding in encodings:
                pieces.append(np.asarray(encoding.ids, dtype=dtype))
                pieces.append(separator)
            chunk = np.concatenate(pieces)
            handle.write(chunk.tobytes())
            num_tokens += len(chunk)
            num_documents += len(batch)
            bar.update(stream.files_seen - bar.n if total_files is not None else len(batch))
            rate = num_tokens / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix(docs=num_documents, tokens=f"{num_tokens / 1e6:.1f}M", tok_s=f"{rate / 1e6:.2f}M")
    return num_tokens, num_documents


def _write_suffix_array(directory: Path, num_tokens: int, token_dtype: np.dtype) -> float:
    from pydivsufsort import divsufsort

    start = time.perf_counter()
    logger.info("sorting the suffixes of %d tokens", num_tokens)
    print(f"sorting the suffixes of {num_tokens:,} tokens (pydivsufsort) ...", flush=True)
    tokens = np.fromfile(directory / TOKENS, dtype=token_dtype)
    suffix_array = divsufsort(tokens) if num_tokens else np.zeros(0, dtype=np.int32)
    del tokens
    suffix_array.astype(suffix_array_dtype_for(num_tokens), copy=False).tofile(directory / SUFFIX_ARRAY)
    return time.perf_counter() - start
