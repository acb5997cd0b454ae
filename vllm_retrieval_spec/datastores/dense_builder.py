"""Dense (DReSD) datastore builder: tokenise the inputs (``sources.py``, as the REST builder),
run the target model over fixed-length windows of each document, fit the transform on a
sample of hidden states, index the keys with FAISS and store the next tokens of every kept
position; written to a temporary directory and renamed into place."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from vllm_retrieval_spec import __version__
from vllm_retrieval_spec.datastores.builder import chat_renderer, document_batches, load_tokenizer
from vllm_retrieval_spec.datastores.dense import DenseTransform
from vllm_retrieval_spec.datastores.dense_format import (
    COMPONENTS,
    DENSE_DATASTORE,
    DENSE_FORMAT_VERSION,
    INDEX,
    MEAN,
    STD,
    VALUES,
    DenseManifest,
    IndexSpec,
)
from vllm_retrieval_spec.datastores.dense_index import (
    FLAT_MAX_POSITIONS,
    INDEX_MEMORY_BYTES,
    IndexLimits,
    build_index,
    fit_transform,
    plan_index,
)
from vllm_retrieval_spec.datastores.sources import DocumentStream, InputSpec
from vllm_retrieval_spec.storage import ModelIdentity, atomic_directory, check_build_target, file_records
from vllm_retrieval_spec.validation import require_ints

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

KEYS_SCRATCH = "keys.scratch"  # the keys before indexing; deleted before the store is renamed into place
PAD_TOKEN = 0  # right padding: with causal attention no real position ever sees it


@dataclass(frozen=True)
class DenseBuildOptions:
    """What a dense build keeps and how it runs (CLI flags ``--value-tokens`` etc.)."""

    value_tokens: int = 10  # N: tokens stored after each kept position
    stride: int = 1  # keep every stride-th position of a document
    dim: int = 64  # PCA dimensions (the paper: 64, more gained nothing)
    fit_sample: int = 100_000  # hidden states the transform is fitted on
    window: int = 512  # tokens per forward window
    overlap: int = 128  # context tokens a window repeats from the one before (positions kept once)
    batch_tokens: int = 4096  # tokens per forward batch
    document_stride: int = 1  # take every n-th document of the inputs
    flat_max: int = FLAT_MAX_POSITIONS
    index_memory: int = INDEX_MEMORY_BYTES
    nlist: int | None = None
    nprobe: int | None = None
    seed: int = 0

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str) -> DenseBuildOptions:
        """Options from a mapping (a recipe's ``dense`` section); unknown keys fail naming ``where``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{where}: unknown dense build option(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**values)

    def check(self) -> None:
        """Fail with the flag's name on a value that cannot work."""
        minimum = {"value_tokens": 1, "stride": 1, "dim": 1, "fit_sample": 1, "window": 2, "overlap": 0,
                   "batch_tokens": 1, "document_stride": 1, "flat_max": 0, "index_memory": 1}
        minimum.update({name: 1 for name in ("nlist", "nprobe") if getattr(self, name) is not None})  # None: auto
        require_ints({f"--{name.replace('_', '-')}": (getattr(self, name), low, None) for name, low in minimum.items()})
        if self.overlap >= self.window:
            raise ValueError(f"--overlap ({self.overlap}) must be below --window ({self.window})")
        if self.dim > self.fit_sample:
            raise ValueError(f"--dim ({self.dim}) cannot exceed --fit-sample ({self.fit_sample})")

    @property
    def limits(self) -> IndexLimits:
        return IndexLimits(self.flat_max, self.index_memory, self.nlist, self.nprobe)


@dataclass(frozen=True)
class DenseBuildReport:
    """What a dense build produced and how fast."""

    path: Path
    manifest: DenseManifest
    num_tokens: int
    num_documents: int
    seconds: float
    forward_seconds: float
    bytes_on_disk: int
    files_read: int
    files_skipped: int

    @property
    def num_positions(self) -> int:
        return self.manifest.num_positions

    @property
    def positions_per_second(self) -> float:
        return self.num_positions / self.forward_seconds if self.forward_seconds else 0.0

    @property
    def bytes_per_position(self) -> float:
        return self.manifest.bytes_per_position


@dataclass(frozen=True)
class Corpus:
    """The inputs' token ids, documents back to back: document d is ``tokens[starts[d]:starts[d + 1]]``."""

    tokens: np.ndarray  # int32
    starts: np.ndarray  # int64 [documents + 1]

    @property
    def num_documents(self) -> int:
        return len(self.starts) - 1


@dataclass(frozen=True)
class Windows:
    """The forward windows: window w feeds ``tokens[begin[w]:begin[w] + length[w]]`` and keeps
    (as store rows ``rows[w]:rows[w + 1]``) the in-window offsets ``first[w]::stride``."""

    begin: np.ndarray  # int64
    length: np.ndarray  # int64
    first: np.ndarray  # int64
    rows: np.ndarray  # int64 [windows + 1]
    stride: int

    def __len__(self) -> int:
        return len(self.begin)

    @property
    def num_positions(self) -> int:
        return int(self.rows[-1])

    def kept_offsets(self, w: int) -> np.ndarray:
        return np.arange(self.first[w], self.length[w], self.stride)

    def positions(self) -> np.ndarray:
        """Absolute token index of every kept position, in row order."""
        if not len(self):
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self.begin[w] + self.kept_offsets(w) for w in range(len(self))])


def build_dense_datastore(
    model_dir: str | Path,
    inputs: Sequence[InputSpec],
    out_dir: str | Path,
    options: DenseBuildOptions = DenseBuildOptions(),
    *,
    replace: bool = False,
    progress: bool = True,
    extra_build_info: dict[str, Any] | None = None,
) -> DenseBuildReport:
    """Build a dense datastore of ``inputs`` for the model in ``model_dir``."""
    out_dir = Path(out_dir)
    options.check()
    check_build_target(out_dir, replace, DENSE_DATASTORE)  # before minutes of work
    start = time.perf_counter()
    tokenizer = load_tokenizer(model_dir, "--model")
    identity = ModelIdentity.of(model_dir)
    stream = DocumentStream(inputs, chat_renderer(tokenizer))
    corpus = tokenize_corpus(tokenizer, stream, options.document_stride, progress)
    windows = plan_windows(corpus, options)
    if windows.num_positions < options.dim:
        raise ValueError(f"the inputs give {windows.num_positions} position(s) with {options.value_tokens} "
                         f"following tokens in their document, fewer than --dim {options.dim}; give more text")
    model = load_target_model(model_dir)
    if options.dim > model.config.hidden_size:
        raise ValueError(f"--dim ({options.dim}) cannot exceed the model's hidden size ({model.config.hidden_size})")
    with atomic_directory(out_dir, replace=replace, kind=DENSE_DATASTORE) as tmp:
        write_values(corpus, windows, options.value_tokens, tmp / VALUES)
        forward_start = time.perf_counter()
        transform, fit_info = compute_keys(model, corpus, windows, options, tmp / KEYS_SCRATCH, progress)
        forward_seconds = time.perf_counter() - forward_start
        spec = write_index(tmp, windows.num_positions, options)
        manifest = finish_dense_store(
            tmp, transform, spec, windows.num_positions, options.value_tokens, identity, fit_info,
            _build_info(model_dir, inputs, options, corpus, stream, start, forward_seconds, windows, extra_build_info),
        )
    return DenseBuildReport(out_dir, manifest, len(corpus.tokens), corpus.num_documents,
                            time.perf_counter() - start, forward_seconds,
                            sum(record["bytes"] for record in manifest.files.values()), stream.files_read,
                            stream.files_skipped)


def finish_dense_store(directory: Path, transform: DenseTransform, spec: IndexSpec, num_positions: int,
                       value_tokens: int, model: ModelIdentity, fit_info: dict[str, Any],
                       build: dict[str, Any]) -> DenseManifest:
    """Write the transform and the manifest of the dense datastore whose values and FAISS index
    already lie in ``directory``; its manifest."""
    for name, array in ((MEAN, transform.mean), (STD, transform.std), (COMPONENTS, transform.components)):
        np.ascontiguousarray(array, dtype=np.float32).tofile(directory / name)
    files = file_records(directory, (VALUES, MEAN, STD, COMPONENTS, INDEX))
    manifest = DenseManifest(
        format_version=DENSE_FORMAT_VERSION,
        num_positions=num_positions,
        value_tokens=value_tokens,
        hidden_size=int(transform.mean.shape[0]),
        dim=int(transform.components.shape[1]),
        value_dtype="int32",
        transform_dtype="float32",
        model=model,
        index=spec,
        transform=fit_info,
        bytes_per_position=round(sum(record["bytes"] for record in files.values()) / num_positions, 2),
        files=files,
        build=build,
    )
    manifest.write(directory)
    return manifest


def write_index(directory: Path, num_positions: int, options: DenseBuildOptions) -> Any:
    """Index the scratch keys, write ``index.faiss`` and delete the scratch file; the index spec."""
    import faiss

    spec = plan_index(num_positions, options.dim, options.limits)
    keys = np.memmap(directory / KEYS_SCRATCH, dtype=np.float32, mode="r", shape=(num_positions, options.dim))
    print(f"indexing {num_positions:,} keys ({spec.describe()}) ...", flush=True)
    index = build_index(spec, keys, options.seed)
    faiss.write_index(index, str(directory / INDEX))
    del keys, index
    (directory / KEYS_SCRATCH).unlink()
    return spec


def _build_info(model_dir: str | Path, inputs: Sequence[InputSpec], options: DenseBuildOptions, corpus: Corpus,
                stream: DocumentStream, start: float, forward_seconds: float, windows: Windows,
                extra: dict[str, Any] | None) -> dict[str, Any]:
    import faiss
    import torch
    import transformers

    return {
        "inputs": [{"path": str(s.path), "include": list(s.include), "exclude": list(s.exclude),
                    "text_field": s.text_field} for s in inputs],
        "model_dir": str(model_dir),
        "options": asdict(options),
        "num_tokens": len(corpus.tokens),
        "num_documents": corpus.num_documents,
        "num_windows": len(windows),
        "forwarded_tokens": int(windows.length.sum()),
        "files_read": stream.files_read,
        "files_skipped_binary": stream.files_skipped,
        "forward_seconds": round(forward_seconds, 2),
        "positions_per_second": round(windows.num_positions / max(forward_seconds, 1e-9), 1),
        "seconds": round(time.perf_counter() - start, 2),
        "versions": {"package": __version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "faiss": faiss.__version__},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **(extra or {}),
    }


def tokenize_corpus(tokenizer: PreTrainedTokenizerFast, documents: Iterable[str], document_stride: int = 1,
                    progress: bool = False) -> Corpus:
    """Token ids of every ``document_stride``-th document (no special tokens added, as the REST builder)."""
    backend = tokenizer.backend_tokenizer
    pieces, lengths = [], []
    taken = (doc for i, doc in enumerate(documents) if i % document_stride == 0)
    with tqdm(desc="tokenizing", unit="doc", disable=not progress, dynamic_ncols=True) as bar:
        for batch in document_batches(taken):
            for encoding in backend.encode_batch_fast(batch, add_special_tokens=False):
                pieces.append(np.asarray(encoding.ids, dtype=np.int32))
                lengths.append(len(encoding.ids))
            bar.update(len(batch))
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    return Corpus(tokens, starts)


def plan_windows(corpus: Corpus, options: DenseBuildOptions) -> Windows:
    """Cut each document into windows of at most ``window`` tokens: the first keeps its own
    positions, each later one repeats ``overlap`` tokens of context before the positions it
    keeps. Kept: document positions ``t ≡ 0 (mod stride)`` followed by ``value_tokens`` tokens
    of the same document."""
    begin, length, first, counts = [], [], [], []
    step, stride = options.window - options.overlap, options.stride
    for d in range(corpus.num_documents):
        start, end = int(corpus.starts[d]), int(corpus.starts[d + 1])
        kept_end = end - start - options.value_tokens  # positions [0, kept_end) have N tokens after them
        keep_start = 0
        while keep_start < kept_end:
            keep_stop = min(keep_start + (options.window if keep_start == 0 else step), kept_end)
            first_kept = math.ceil(keep_start / stride) * stride
            if first_kept < keep_stop:
                last_kept = first_kept + (keep_stop - 1 - first_kept) // stride * stride
                input_start = max(0, keep_start - options.overlap)
                begin.append(start + input_start)
                length.append(last_kept + 1 - input_start)
                first.append(first_kept - input_start)
                counts.append((last_kept - first_kept) // stride + 1)
            keep_start = keep_stop
    rows = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=rows[1:])
    begin_, length_, first_ = (np.asarray(values, dtype=np.int64) for values in (begin, length, first))
    return Windows(begin_, length_, first_, rows, stride)


def write_values(corpus: Corpus, windows: Windows, value_tokens: int, path: Path, chunk: int = 1 << 20) -> None:
    """``values.bin``: the ``value_tokens`` ids after each kept position, int32 ``[positions, N]``."""
    positions = windows.positions()
    offsets = np.arange(1, value_tokens + 1)
    with open(path, "wb") as handle:
        for start in range(0, len(positions), chunk):
            rows = corpus.tokens[positions[start:start + chunk, None] + offsets]
            handle.write(np.ascontiguousarray(rows, dtype=np.int32).tobytes())


def load_target_model(model_dir: str | Path) -> PreTrainedModel:
    """The causal LM of ``model_dir`` in float32 on the CPU, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def last_hidden_states(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, tokens, H]``: the last hidden state after the final norm — the tensor the LM
    head consumes and vLLM's runner holds as ``hidden_states``.

    Verified in transformers 5.19 (``models/llama/modeling_llama.py``): ``LlamaModel.forward``
    ends with ``hidden_states = self.norm(hidden_states)`` and returns it as
    ``last_hidden_state``; ``LlamaForCausalLM`` applies ``lm_head`` to exactly that; and with
    ``output_hidden_states=True`` its ``hidden_states[-1]`` is that same tensor
    (``utils/output_capturing.py``: ``capture_outputs(tie_last_hidden_states=True)`` replaces
    the last layer's output by ``last_hidden_state``). Running the base model directly skips
    the LM head (a fifth of SmolLM2-135M's FLOPs). tests/test_dense_datastore.py checks it."""
    return model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state


def compute_keys(model: PreTrainedModel, corpus: Corpus, windows: Windows, options: DenseBuildOptions,
                 keys_path: Path, progress: bool = True) -> tuple[DenseTransform, dict[str, Any]]:
    """Forward every window once: first a random set of windows holding ``fit_sample`` states,
    on which the transform is fitted, then the rest. Keys go to ``keys_path`` (float32
    ``[positions, dim]``, row order); returns the transform and its fit record."""
    keys = np.memmap(keys_path, dtype=np.float32, mode="w+", shape=(windows.num_positions, options.dim))
    fit_ids, rest_ids = _split_fit_windows(windows, options.fit_sample, options.seed)
    counts = np.diff(windows.rows)
    with tqdm(total=windows.num_positions, desc="hidden states", unit="pos", unit_scale=True,
              disable=not progress, dynamic_ncols=True, smoothing=0.1) as bar:
        offsets = np.concatenate([[0], np.cumsum(counts[fit_ids])])
        sample = np.empty((int(offsets[-1]), model.config.hidden_size), dtype=np.float32)
        slot = {int(w): i for i, w in enumerate(fit_ids)}
        for w, states in forward_windows(model, corpus, windows, fit_ids, options.batch_tokens, bar):
            sample[offsets[slot[w]]:offsets[slot[w] + 1]] = states
        transform, fit_info = fit_transform(sample, options.dim)
        for i, w in enumerate(fit_ids):
            keys[windows.rows[w]:windows.rows[w + 1]] = transform.apply(sample[offsets[i]:offsets[i + 1]])
        del sample
        for w, states in forward_windows(model, corpus, windows, rest_ids, options.batch_tokens, bar):
            keys[windows.rows[w]:windows.rows[w + 1]] = transform.apply(states)
    keys.flush()
    return transform, fit_info


def _split_fit_windows(windows: Windows, fit_sample: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows in a seeded random order: the shortest prefix holding ``fit_sample`` kept
    positions (all windows when the store is smaller), and the others in order."""
    order = np.random.default_rng(seed).permutation(len(windows))
    covered = np.cumsum(np.diff(windows.rows)[order])
    take = int(np.searchsorted(covered, fit_sample)) + 1
    return np.sort(order[:take]), np.sort(order[take:])


def forward_windows(model: PreTrainedModel, corpus: Corpus, windows: Windows, ids: np.ndarray,
                    batch_tokens: int, bar: tqdm | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """``(window, kept states [count, H] float32)`` for each window of ``ids``, run in batches of
    similar length (right-padded, at most ``batch_tokens`` tokens each)."""
    import torch

    for batch in _length_batches(windows, ids, batch_tokens):
        width = int(windows.length[batch].max())
        input_ids = np.full((len(batch), width), PAD_TOKEN, dtype=np.int64)
        for row, w in enumerate(batch):
            input_ids[row, :windows.length[w]] = corpus.tokens[windows.begin[w]:windows.begin[w] + windows.length[w]]
        with torch.inference_mode():
            hidden = last_hidden_states(model, torch.from_numpy(input_ids)).float().numpy()
        for row, w in enumerate(batch):
            states = hidden[row, windows.kept_offsets(w)]
            if bar is not None:
                bar.update(len(states))
            yield int(w), states


def _length_batches(windows: Windows, ids: np.ndarray, batch_tokens: int) -> Iterator[np.ndarray]:
    """``ids`` longest first, grouped so that a batch's rows × longest row stays within ``batch_tokens``."""
    ordered = ids[np.argsort(-windows.length[ids], kind="stable")]
    start = 0
    while start < len(ordered):
        width = int(windows.length[ordered[start]])
        size = max(1, batch_tokens // width)
        yield ordered[start:start + size]
        start += size
