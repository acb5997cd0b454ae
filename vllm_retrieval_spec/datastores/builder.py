"""Streaming datastore builder: tokenise in batches, write tokens as they come, then sort
the suffixes with pydivsufsort; written to a temporary directory and renamed into place. The
pieces are shared with sharded builds (``sharded_builder.py``): :class:`ShardFiles` splits the
token stream into shards, :func:`finish_shards` sorts them in worker processes."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from vllm_retrieval_spec.datastores.sharded import shard_name
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
    shards_kept: int = 0  # shards a killed sharded build had sorted, kept by this one

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
    shard_tokens: int | None = None,
    workers: int = 1,
    ray_address: str | None = None,
) -> BuildReport:
    """Build a datastore from ``inputs`` with the tokenizer in ``tokenizer_dir``; with
    ``shard_tokens``, a sharded one of shards of at most that many tokens, sorted by
    ``workers`` processes or on Ray (``ray_address``; ``sharded_builder.py``: resumable, never
    replacing a store)."""
    out_dir = Path(out_dir)
    if shard_tokens is not None:
        from vllm_retrieval_spec.datastores.sharded_builder import build_sharded_datastore

        return build_sharded_datastore(tokenizer_dir, inputs, out_dir, shard_tokens=shard_tokens, workers=workers,
                                       progress=progress, extra_build_info=extra_build_info, ray_address=ray_address)
    if ray_address is not None:
        raise ValueError("--ray builds sharded stores: give --shard-tokens too")
    check_build_target(out_dir, replace, DATASTORE)
    tokenizer = load_tokenizer(tokenizer_dir)
    identity = TokenizerIdentity.of(tokenizer, name=Path(tokenizer_dir).name)
    stream = DocumentStream(inputs, chat_renderer(tokenizer))
    build = build_info(tokenizer_dir, inputs, extra_build_info)
    start, started_at = time.perf_counter(), time.time()
    with atomic_directory(out_dir, replace=replace, kind=DATASTORE) as tmp:
        files = ShardFiles(tmp, None)
        write_tokens(tokenizer, stream, files, token_dtype_for(identity.vocab_size), progress)
        tokenize_seconds = time.perf_counter() - start
        build |= {"files_read": stream.files_read, "files_skipped_binary": stream.files_skipped}
        (built,) = finish_shards(files.written, identity, build, started_at, workers=1, progress=False)
    return BuildReport(out_dir, built.num_tokens, built.num_documents, time.perf_counter() - start,
                       tokenize_seconds, built.sort_seconds, built.bytes_on_disk, stream.files_read,
                       stream.files_skipped)


def build_info(tokenizer_dir: str | Path, inputs: Sequence[InputSpec],
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a manifest records of how its store was asked for: inputs, tokenizer, version."""
    return {
        "inputs": [{"path": str(s.path), "include": list(s.include), "exclude": list(s.exclude),
                    "text_field": s.text_field} for s in inputs],
        "tokenizer_dir": str(tokenizer_dir),
        "package_version": __version__,
        **(extra or {}),
    }


@dataclass
class ShardWritten:
    """One shard's token file as tokenizing left it (the whole store's when not sharded)."""

    directory: Path
    num_tokens: int = 0
    num_documents: int = 0


class ShardFiles:
    """Where tokenized documents go: ``tokens.bin`` of the store, or with ``shard_tokens`` of
    ``shard-NNNNN/`` directories, a new one started when the next document would overflow the
    current one (there is always one, empty when there are no documents)."""

    def __init__(self, directory: Path, shard_tokens: int | None) -> None:
        self.directory = directory
        self.shard_tokens = shard_tokens
        self.written: list[ShardWritten] = []
        self._next_shard()

    def write(self, documents: list[np.ndarray]) -> None:
        """Append ``documents`` (each ending with its separator)."""
        if self.shard_tokens is None:
            self._append(documents)
            return
        start = pending = 0  # documents[start:i] wait to be written, holding pending tokens
        for i, document in enumerate(documents):
            filled = self.written[-1].num_tokens + pending
            if filled and filled + len(document) > self.shard_tokens:
                self._append(documents[start:i])
                self._next_shard()
                start, pending = i, 0
            pending += len(document)
        self._append(documents[start:])

    def _append(self, documents: list[np.ndarray]) -> None:
        if not documents:
            return
        shard = self.written[-1]
        chunk = np.concatenate(documents)
        with open(shard.directory / TOKENS, "ab") as handle:
            handle.write(chunk.tobytes())
        shard.num_tokens += len(chunk)
        shard.num_documents += len(documents)

    def _next_shard(self) -> None:
        directory = self.directory if self.shard_tokens is None else self.directory / shard_name(len(self.written))
        directory.mkdir(exist_ok=True)
        (directory / TOKENS).write_bytes(b"")
        self.written.append(ShardWritten(directory))


@dataclass(frozen=True)
class ShardBuilt:
    num_tokens: int
    num_documents: int
    sort_seconds: float
    bytes_on_disk: int


def finish_shards(written: list[ShardWritten], identity: TokenizerIdentity, build: dict[str, Any],
                  started_at: float, workers: int, progress: bool, ray_address: str | None = None) -> list[ShardBuilt]:
    """Sort every shard's suffixes and write its manifest (the build started at ``started_at``,
    a ``time.time()``): ``workers`` shards at a time in spawned processes, or as tasks of a Ray
    cluster with ``ray_address`` (``"local"``: one started here with ``workers`` CPUs)."""
    jobs = [(shard, identity, build, started_at) for shard in written]
    bar = tqdm(total=len(jobs), desc="sorting shards", unit="shard", disable=not progress)
    with bar:
        if ray_address is not None:
            return _finish_shards_on_ray(jobs, ray_address, workers, bar)
        if workers == 1 or len(jobs) <= 1:
            return [_counted(finish_shard(*job), bar) for job in jobs]
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # Spawned, not forked: a fork of this process (the tokenizer's and tqdm's threads) can deadlock.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=context) as pool:
            return [_counted(built, bar) for built in pool.map(finish_shard, *zip(*jobs))]


def _counted(built: ShardBuilt, bar: tqdm) -> ShardBuilt:
    bar.update(1)
    return built


def _finish_shards_on_ray(jobs: list[tuple], address: str, workers: int, bar: tqdm) -> list[ShardBuilt]:
    """:func:`finish_shard` of every job as a Ray task (one CPU each), results in job order. The
    shards' directory must be one every node sees (a shared file system) on a remote cluster."""
    try:
        import ray
    except ImportError as error:
        raise ValueError("--ray needs Ray: pip install 'vllm-retrieval-spec[scale]'") from error
    started_here = not ray.is_initialized()
    if started_here:
        local = address == "local"
        ray.init(address=None if local else address, num_cpus=workers if local else None,
                 include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        sort = ray.remote(num_cpus=1)(finish_shard)
        pending = [sort.remote(*job) for job in jobs]
        order = {ref: i for i, ref in enumerate(pending)}
        results: list[ShardBuilt | None] = [None] * len(jobs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            results[order[done[0]]] = _counted(ray.get(done[0]), bar)
        return results
    finally:
        if started_here:
            ray.shutdown()


def finish_shard(shard: ShardWritten, identity: TokenizerIdentity, build: dict[str, Any],
                 started_at: float) -> ShardBuilt:
    """Sort one shard's suffixes and write its manifest (a datastore of its own)."""
    token_dtype = token_dtype_for(identity.vocab_size)
    sort_seconds = _write_suffix_array(shard.directory, shard.num_tokens, token_dtype)
    manifest = Manifest(
        format_version=FORMAT_VERSION, num_tokens=shard.num_tokens, num_documents=shard.num_documents,
        token_dtype=token_dtype.name, suffix_array_dtype=suffix_array_dtype_for(shard.num_tokens).name,
        separator=separator_for(token_dtype), tokenizer=identity,
        files=file_records(shard.directory, (TOKENS, SUFFIX_ARRAY)),
        build={**build, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "seconds": round(time.time() - started_at, 2)},
    )
    manifest.write(shard.directory)
    return ShardBuilt(shard.num_tokens, shard.num_documents, sort_seconds,
                      sum(f["bytes"] for f in manifest.files.values()))


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


def write_tokens(tokenizer: PreTrainedTokenizerFast, stream: DocumentStream, files: ShardFiles, dtype: np.dtype,
                  progress: bool) -> None:
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
            documents = [np.concatenate([np.asarray(encoding.ids, dtype=dtype), separator]) for encoding in encodings]
            files.write(documents)
            num_tokens += sum(len(document) for document in documents)
            num_documents += len(batch)
            bar.update(stream.files_seen - bar.n if total_files is not None else len(batch))
            rate = num_tokens / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix(docs=num_documents, tokens=f"{num_tokens / 1e6:.1f}M", tok_s=f"{rate / 1e6:.2f}M")


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
