"""DReSD's transform fitted on sampled hidden states (z-normalisation, PCA, then L2 in
:class:`~vllm_retrieval_spec.datastores.dense.DenseTransform`), and the FAISS index chosen
by the store's size: exact flat, IVF-Flat, or IVF-PQ when the vectors exceed a memory budget."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_retrieval_spec.datastores.dense import DenseTransform
from vllm_retrieval_spec.datastores.dense_format import IndexSpec

Z_EPSILON = 1e-6  # std = sqrt(var + Z_EPSILON), as the paper's equation 1
FIT_CHUNK_ROWS = 16_384
FLAT_MAX_POSITIONS = 16_384  # exact search up to here (~0.16 ms per query on 2 cores at 64 dims; IVF-Flat
# with nprobe = nlist / 16 is 5-10x faster on 120k positions at recall@32 0.99: benchmarks/dense_search.py)
INDEX_MEMORY_BYTES = 4 << 30  # IVF-Flat while its vectors and ids fit; IVF-PQ beyond
MIN_POINTS_PER_LIST = 39  # FAISS's k-means wants at least this many training points per centroid
TRAIN_POINTS_PER_LIST = 64
PQ_TRAIN_MIN = 256 * MIN_POINTS_PER_LIST
ADD_CHUNK_ROWS = 1 << 20


def fit_transform(states: np.ndarray, dim: int, epsilon: float = Z_EPSILON) -> tuple[DenseTransform, dict[str, Any]]:
    """Fit DReSD's z-normalisation and ``dim``-component PCA on ``states`` ``[S, H]`` (float64
    accumulation in row chunks). Components are the top eigenvectors of the z-normalised
    covariance, largest first, each signed so that its largest entry is positive."""
    count, hidden = states.shape
    if not 1 <= dim <= min(hidden, count):
        raise ValueError(f"the PCA dimension ({dim}) must lie in [1, min(hidden size {hidden}, "
                         f"fit sample {count})]")
    mean, var = _moments(states)
    std = np.sqrt(var + epsilon)
    covariance = np.zeros((hidden, hidden))
    for chunk in _chunks(states):
        z = (chunk - mean) / std
        covariance += z.T @ z
    eigenvalues, eigenvectors = np.linalg.eigh(covariance / max(count - 1, 1))
    top = eigenvectors[:, ::-1][:, :dim]
    top *= np.sign(top[np.abs(top).argmax(axis=0), np.arange(dim)])
    explained = float(eigenvalues[::-1][:dim].sum() / max(eigenvalues.sum(), 1e-300))
    transform = DenseTransform(mean.astype(np.float32), std.astype(np.float32), top.astype(np.float32))
    return transform, {"fit_sample": count, "epsilon": epsilon, "explained_variance": round(explained, 4)}


def _moments(states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and (population) variance per dimension, in float64."""
    total = np.zeros(states.shape[1])
    for chunk in _chunks(states):
        total += chunk.sum(axis=0)
    mean = total / len(states)
    squares = np.zeros(states.shape[1])
    for chunk in _chunks(states):
        squares += ((chunk - mean) ** 2).sum(axis=0)
    return mean, squares / len(states)


def _chunks(states: np.ndarray):
    for start in range(0, len(states), FIT_CHUNK_ROWS):
        yield np.asarray(states[start:start + FIT_CHUNK_ROWS], dtype=np.float64)


@dataclass(frozen=True)
class IndexLimits:
    """When to leave exact search (``flat_max`` positions) and when to compress (``memory_bytes``
    of IVF vectors and ids); ``nlist``/``nprobe`` None: chosen by size."""

    flat_max: int = FLAT_MAX_POSITIONS
    memory_bytes: int = INDEX_MEMORY_BYTES
    nlist: int | None = None
    nprobe: int | None = None


def plan_index(num_positions: int, dim: int, limits: IndexLimits = IndexLimits()) -> IndexSpec:
    """Flat up to ``flat_max`` positions; else IVF-Flat while ``positions × (4·dim + 8)`` bytes
    fit ``memory_bytes``; else IVF-PQ (``dim / 4`` bytes per key, 8-bit codes)."""
    if num_positions <= limits.flat_max:
        return IndexSpec("flat")
    nlist = min(limits.nlist or auto_nlist(num_positions), max(1, num_positions // MIN_POINTS_PER_LIST))
    nprobe = min(limits.nprobe or auto_nprobe(nlist), nlist)
    train = min(num_positions, max(TRAIN_POINTS_PER_LIST * nlist, PQ_TRAIN_MIN))
    if num_positions * (4 * dim + 8) <= limits.memory_bytes:
        return IndexSpec("ivf_flat", nlist=nlist, nprobe=nprobe, train_size=train)
    bits = 8 if train >= PQ_TRAIN_MIN else max(1, int(math.log2(train / MIN_POINTS_PER_LIST)))
    return IndexSpec("ivf_pq", nlist=nlist, nprobe=nprobe, pq_m=pq_subquantizers(dim), pq_bits=bits,
                     train_size=train)


def auto_nlist(num_positions: int) -> int:
    """A power of two near ``4·sqrt(positions)`` (FAISS's guideline), at most ``positions / 39``."""
    target = max(1.0, 4 * math.sqrt(num_positions))
    nlist = 2 ** round(math.log2(target))
    while nlist > 1 and nlist * MIN_POINTS_PER_LIST > num_positions:
        nlist //= 2
    return nlist


def auto_nprobe(nlist: int) -> int:
    """Lists probed per query by default: 1/16 of them, between 1 and 64."""
    return max(1, min(64, nlist // 16))


def pq_subquantizers(dim: int) -> int:
    """PQ sub-quantizers: the largest divisor of ``dim`` up to ``dim / 4`` (4 dimensions per byte)."""
    return max(m for m in range(1, max(1, dim // 4) + 1) if dim % m == 0)


def build_index(spec: IndexSpec, keys: np.ndarray, seed: int = 0) -> Any:
    """The FAISS inner-product index of ``keys`` ``[positions, dim]`` (unit vectors) that
    ``spec`` describes: IVF trained on ``train_size`` keys sampled with ``seed``, keys added
    in chunks (``keys`` may be a memory map)."""
    import faiss

    count, dim = keys.shape
    if spec.type == "flat":
        index = faiss.IndexFlatIP(dim)
    else:
        index = _ivf_index(spec, dim)
        rows = np.sort(np.random.default_rng(seed).choice(count, spec.train_size or count, replace=False))
        index.train(np.ascontiguousarray(keys[rows], dtype=np.float32))
        index.nprobe = spec.nprobe
    for start in range(0, count, ADD_CHUNK_ROWS):
        index.add(np.ascontiguousarray(keys[start:start + ADD_CHUNK_ROWS], dtype=np.float32))
    return index


def _ivf_index(spec: IndexSpec, dim: int) -> Any:
    import faiss

    quantizer = faiss.IndexFlatIP(dim)
    if spec.type == "ivf_flat":
        return faiss.IndexIVFFlat(quantizer, dim, spec.nlist, faiss.METRIC_INNER_PRODUCT)
    return faiss.IndexIVFPQ(quantizer, dim, spec.nlist, spec.pq_m, spec.pq_bits, faiss.METRIC_INNER_PRODUCT)
