"""Opening and searching a dense (DReSD) datastore: the transform and the value rows
memory-mapped read-only, the FAISS index memory-mapped where FAISS allows it."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from vllm_retrieval_spec.datastores.background_check import VerifiedInBackground
from vllm_retrieval_spec.datastores.dense_format import (
    COMPONENTS,
    DENSE_DATASTORE,
    INDEX,
    MEAN,
    STD,
    VALUES,
    DenseDatastoreError,
    DenseManifest,
    dense_recipe_store_dir,
)
from vllm_retrieval_spec.datastores.resolve import as_directory
from vllm_retrieval_spec.storage import ModelIdentity, map_array, refuse_another_identity, verify_file_records

NORM_EPSILON = 1e-12  # the L2 normalisation divides by max(norm, NORM_EPSILON)
VALUE_CHECK_ROWS = 1 << 20  # rows of values.bin checked per chunk at open
MISSING_SCORE = -np.inf  # score of a neighbour slot FAISS left empty (its value row is all -1)
_FAISS_CLASSES = {"flat": "IndexFlatIP", "ivf_flat": "IndexIVFFlat", "ivf_pq": "IndexIVFPQ"}


@dataclass(frozen=True)
class DenseTransform:
    """DReSD's key of a hidden state ``h``: ``L2norm(((h - mean) / std) @ components)``."""

    mean: np.ndarray  # [H]
    std: np.ndarray  # [H]
    components: np.ndarray  # [H, dim]

    @cached_property
    def _affine(self) -> tuple[np.ndarray, np.ndarray]:
        """The z-normalisation folded into the projection: ``h @ matrix - offset``."""
        mean, std, components = (np.asarray(a, dtype=np.float64) for a in (self.mean, self.std, self.components))
        matrix = components / std[:, None]
        return matrix.astype(np.float32), ((mean / std) @ components).astype(np.float32)

    def apply(self, states: np.ndarray) -> np.ndarray:
        """Keys ``[B, dim]`` float32 (unit vectors) of hidden states ``[B, H]``. The product runs
        on torch's threads, the model's own: NumPy's BLAS threads, started between serving steps,
        would spin against the model's (8 in flight on 2 cores: 25% slower steps)."""
        import torch

        matrix, offset = self._affine
        keys = (torch.as_tensor(np.ascontiguousarray(states, dtype=np.float32)) @ torch.from_numpy(matrix)).numpy()
        keys -= offset
        keys /= np.maximum(np.linalg.norm(keys, axis=1, keepdims=True), NORM_EPSILON)
        return keys


@dataclass
class DenseDatastore(VerifiedInBackground):
    """Keys in a FAISS inner-product index, next-token values ``[positions, N]`` memory-mapped;
    ``usable`` until a checksum verified in the background fails (searches then find nothing)."""

    noun = "dense datastore"
    drafter = "DReSD"

    path: Path
    manifest: DenseManifest
    transform: DenseTransform
    values: np.ndarray
    index: Any  # faiss.Index
    num_threads: int | None  # None: the process's OpenMP setting (the one torch uses)
    gpu_resources: Any = None  # faiss.StandardGpuResources once the index lives on a GPU

    @classmethod
    def open(cls, path: str | Path, model_identity: ModelIdentity | None = None, *, nprobe: int | None = None,
             num_threads: int | None = None) -> DenseDatastore:
        """Open ``path``; fail naming the file and the fix when anything is missing, truncated or
        inconsistent (shapes, dtypes, token ids >= the vocabulary, index size), and naming both
        models when it was built for another model or tokenizer than ``model_identity``.
        ``nprobe`` overrides the manifest's (IVF); ``num_threads``: FAISS threads during a search
        (default: the process's OpenMP setting, which torch shares)."""
        path = Path(path)
        manifest = DenseManifest.read(path)
        if model_identity is not None:
            refuse_another_identity(DENSE_DATASTORE, path, manifest.model, model_identity)
        hidden, dim = manifest.hidden_size, manifest.dim
        transform = DenseTransform(
            mean=map_array(path / MEAN, np.float32, (hidden,), DENSE_DATASTORE),
            std=map_array(path / STD, np.float32, (hidden,), DENSE_DATASTORE),
            components=map_array(path / COMPONENTS, np.float32, (hidden, dim), DENSE_DATASTORE),
        )
        store = cls(
            path=path,
            manifest=manifest,
            transform=transform,
            values=map_array(path / VALUES, np.int32, (manifest.num_positions, manifest.value_tokens),
                             DENSE_DATASTORE),
            index=_read_index(path / INDEX, manifest),
            num_threads=num_threads,
        )
        store.check_transform()
        store.check_values()
        if nprobe is not None:
            store.set_nprobe(nprobe)
        return store

    @property
    def value_tokens(self) -> int:
        return self.manifest.value_tokens

    @property
    def num_positions(self) -> int:
        return self.manifest.num_positions

    @property
    def hidden_size(self) -> int:
        return self.manifest.hidden_size

    def set_nprobe(self, nprobe: int) -> None:
        """Inverted lists probed per query (IVF indexes; ignored by a flat one)."""
        if hasattr(self.index, "nprobe"):
            self.index.nprobe = max(1, min(int(nprobe), self.manifest.index.nlist or 1))

    def use_gpu(self, device: int) -> bool:
        """Copy the index to GPU ``device`` (faiss-gpu); False, keeping the CPU index, when this
        FAISS build has no GPU support or sees no such device."""
        import faiss

        if self.gpu_resources is not None:
            return True
        if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() <= device:
            return False
        self.gpu_resources = faiss.StandardGpuResources()
        self.index = faiss.index_cpu_to_gpu(self.gpu_resources, device, self.index)
        return True

    def warm_up(self, k: int) -> None:
        """One search, so that the first real one does not pay for paging the index in."""
        self.search(np.asarray(self.transform.mean)[None, :] + 1.0, k)

    def search(self, hidden_states: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` nearest stored positions of each hidden state ``[B, H]`` (cosine of the keys),
        in one FAISS call: scores ``[B, k]`` float32 (best first) and value rows ``[B, k, N]``
        int32. Slots without a neighbour (an IVF probe found fewer than ``k``, or the store is
        no longer ``usable``) score :data:`MISSING_SCORE` with values -1."""
        return self.search_by_keys(self.keys_of(hidden_states), k)

    def keys_of(self, hidden_states: np.ndarray) -> np.ndarray:
        """The keys ``[B, dim]`` of hidden states ``[B, H]`` (this store's transform)."""
        states = np.asarray(hidden_states)
        if states.ndim != 2 or states.shape[1] != self.hidden_size:
            raise ValueError(f"hidden states must be [batch, {self.hidden_size}], got {list(states.shape)}")
        return self.transform.apply(states)

    def search_by_keys(self, keys: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search` for keys already transformed (:meth:`keys_of`)."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if not self.usable:
            return self._nothing_found(len(keys), k)
        scores, labels = self.search_keys(keys, k)
        found = (labels >= 0) & (labels < self.num_positions)  # a damaged index may hold any label
        values = np.asarray(self.values[np.where(found, labels, 0)])
        if not found.all():
            values[~found] = -1
            scores[~found] = MISSING_SCORE
        return scores, values

    def _nothing_found(self, batch: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        return np.full((batch, k), MISSING_SCORE, np.float32), np.full((batch, k, self.value_tokens), -1, np.int32)

    def search_keys(self, keys: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """FAISS's search with ``num_threads`` OpenMP threads, the caller's setting restored after
        (it is the calling thread's, and torch's forward passes share it)."""
        import faiss

        if self.num_threads is None:
            return self.index.search(keys, k)
        before = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(self.num_threads)
        try:
            return self.index.search(keys, k)
        finally:
            faiss.omp_set_num_threads(before)

    def check_transform(self) -> None:
        """Fail naming the file when a transform array holds NaN/inf, or a ``std`` is not positive."""
        t = self.transform
        for name, array in ((MEAN, t.mean), (STD, t.std), (COMPONENTS, t.components)):
            if not np.isfinite(array).all():
                raise DENSE_DATASTORE.fail(f"{self.path / name} holds NaN or infinite values")
        if (t.std <= 0).any():
            raise DENSE_DATASTORE.fail(f"{self.path / STD} holds a standard deviation <= 0")

    def check_values(self) -> None:
        """Fail naming ``values.bin`` when a token id lies outside ``[0, vocab)`` (reads it once)."""
        vocab = self.manifest.model.vocab_size
        for start in range(0, self.num_positions, VALUE_CHECK_ROWS):
            chunk = np.asarray(self.values[start:start + VALUE_CHECK_ROWS])
            low, high = int(chunk.min()), int(chunk.max())
            if low < 0 or high >= vocab:
                raise DENSE_DATASTORE.fail(
                    f"{self.path / VALUES} holds token ids outside the vocabulary [0, {vocab}) of model "
                    f"{self.manifest.model.name!r} (min {low}, max {high})"
                )

    def check_model(self, expected: ModelIdentity) -> None:
        """Fail naming both models when the store was built for another one than ``expected``."""
        refuse_another_identity(DENSE_DATASTORE, self.path, self.manifest.model, expected)

    def check_fully(self) -> None:
        """Checksums of every file against the manifest (reads everything once)."""
        verify_file_records(self.path, self.manifest.files, DENSE_DATASTORE)

    def describe(self) -> str:
        m = self.manifest
        return "\n".join([
            f"dense datastore {self.path}",
            f"  format version {m.format_version}; {m.num_positions:,} positions x {m.value_tokens} value tokens, "
            f"hidden size {m.hidden_size} -> {m.dim} dimensions",
            f"  model {m.model.name!r}: config {m.model.config_sha256[:12]}, tokenizer {m.model.vocab_sha256[:12]}",
            f"  index {m.index.describe()}; {m.bytes_per_position:.1f} bytes/position",
            f"  built {m.build.get('created', '?')} in {m.build.get('seconds', '?')} s",
        ])


def _read_index(path: Path, manifest: DenseManifest) -> Any:
    """The index, memory-mapped and shared between processes, checked against the manifest.
    ``IO_FLAG_MMAP_IFC`` maps flat codes and IVF lists in place (searches as fast as in memory);
    older FAISS builds fall back to ``IO_FLAG_MMAP`` (IVF: ~9x slower searches) or a copy."""
    import faiss

    if not path.is_file():
        raise DENSE_DATASTORE.fail(f"{path} is missing")
    _verify_index_checksum(path, manifest)
    in_place = getattr(faiss, "IO_FLAG_MMAP_IFC", None)
    flags = in_place if in_place is not None else (0 if manifest.index.type == "flat" else faiss.IO_FLAG_MMAP)
    try:
        index = faiss.read_index(str(path), flags)
    except (RuntimeError, MemoryError) as error:
        reason = " ".join(str(error).split()) or type(error).__name__
        raise DENSE_DATASTORE.fail(f"{path} cannot be read by FAISS ({reason})") from error
    _check_index(path, index, manifest)
    if manifest.index.nprobe is not None:
        index.nprobe = manifest.index.nprobe
    return index


def _verify_index_checksum(path: Path, manifest: DenseManifest) -> None:
    """FAISS trusts the file it parses (a damaged size can make it allocate without bound), so
    the index's sha256 is checked against the manifest first (~0.3 s for 500 MB)."""
    record = manifest.files.get(INDEX)
    if record is None:
        raise DENSE_DATASTORE.fail(f"{path.parent / 'manifest.json'} is corrupt (it records no checksum of {INDEX}, "
                                   "which is read only once verified)")
    verify_file_records(path.parent, {INDEX: record}, DENSE_DATASTORE)


def _check_index(path: Path, index: Any, manifest: DenseManifest) -> None:
    import faiss

    spec, expected_class = manifest.index, _FAISS_CLASSES[manifest.index.type]
    problems = []
    if type(index).__name__ != expected_class:
        problems.append(f"it is a {type(index).__name__}, the manifest says {expected_class}")
    if index.d != manifest.dim:
        problems.append(f"{index.d} dimensions, the manifest says {manifest.dim}")
    if index.ntotal != manifest.num_positions:
        problems.append(f"{index.ntotal} vectors, the manifest says {manifest.num_positions} positions")
    if index.metric_type != faiss.METRIC_INNER_PRODUCT:
        problems.append("its metric is not inner product")
    if spec.nlist is not None and getattr(index, "nlist", None) != spec.nlist:
        problems.append(f"{getattr(index, 'nlist', None)} lists, the manifest says {spec.nlist}")
    if problems:
        raise DENSE_DATASTORE.fail(f"{path} does not match the manifest ({'; '.join(problems)})")


def resolve_dense_datastore_dir(option: str, model: ModelIdentity) -> Path:
    """A directory path is used as given; a recipe name maps to its cached build for ``model``."""
    from vllm_retrieval_spec.datastores.recipes import available_recipes

    path = as_directory(option)
    if path is not None:
        return path
    if option not in available_recipes():
        raise DenseDatastoreError(f"dense datastore {option!r} is neither a directory nor a recipe "
                                  f"({', '.join(available_recipes())})")
    store_dir = dense_recipe_store_dir(option, model)
    if not store_dir.exists():
        raise DenseDatastoreError(
            f"the {option!r} dense datastore for model {model.name!r} is not built yet (expected at {store_dir}); "
            f"build it with `vllm-retrieval-spec datastore build-dense --recipe {option} --model MODEL_DIR`"
        )
    return store_dir


def open_dense_datastore_for_model(option: str, model_dir: str | Path, **open_options: Any) -> DenseDatastore:
    """Open the store ``option`` names (a directory or a dense recipe's cached build) and check it
    against the model in ``model_dir``. A store given by path is opened before the model's
    tokenizer loads, so a missing or corrupt one fails at once."""
    path = as_directory(option)
    if path is None:
        identity = ModelIdentity.of(model_dir)
        return DenseDatastore.open(resolve_dense_datastore_dir(option, identity), identity, **open_options)
    store = DenseDatastore.open(path, **open_options)
    store.check_model(ModelIdentity.of(model_dir))
    return store
