"""DReSD's in-distribution store learned from served traffic (issue 25): while a request runs,
the key of the hidden state that produced each token it generated (the dense datastore's
transform of the target's own state, which the verifying step computed anyway) waits with its
position; when the request finishes, every such key whose next ``value_tokens`` tokens the
request generated joins an in-memory FAISS index with those tokens as its value. No extra forward pass.

Memory is bounded: keys wait in a ring of ``pending_capacity`` (an older key of a long request is
overwritten), and the index holds at most ``capacity`` positions in two generations of half
that, the older dropped whole when the newer fills (oldest evicted first). A finished or aborted
request leaves nothing behind.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vllm_retrieval_spec.datastores.dense import MISSING_SCORE

if TYPE_CHECKING:
    from vllm_retrieval_spec.datastores.dense import DenseDatastore


@dataclass
class _Generation:
    """One FAISS inner-product index and the value rows of its positions (label = row)."""

    index: object  # faiss.IndexFlatIP
    values: np.ndarray  # [capacity, value_tokens] int32
    size: int = 0

    @classmethod
    def empty(cls, dim: int, capacity: int, value_tokens: int) -> _Generation:
        import faiss

        return cls(faiss.IndexFlatIP(dim), np.full((capacity, value_tokens), -1, np.int32))

    @property
    def room(self) -> int:
        return len(self.values) - self.size

    def add(self, keys: np.ndarray, values: np.ndarray) -> None:
        self.index.add(np.ascontiguousarray(keys, dtype=np.float32))
        self.values[self.size: self.size + len(values)] = values
        self.size += len(values)

    def search(self, keys: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Scores ``[B, k]`` and value rows ``[B, k, N]`` (missing: MISSING_SCORE and -1)."""
        scores, labels = self.index.search(np.ascontiguousarray(keys, dtype=np.float32), k)
        found = (labels >= 0) & (labels < self.size)
        values = self.values[np.where(found, labels, 0)]
        values[~found] = -1
        return np.where(found, scores, MISSING_SCORE).astype(np.float32), values


class LearnedDenseIndex:
    """Keys of served positions and the tokens that followed them; see the module docstring."""

    def __init__(self, dim: int, value_tokens: int, capacity: int, pending_capacity: int,
                 key_store: DenseDatastore | None = None) -> None:
        if dim < 1 or value_tokens < 1 or capacity < 2 or pending_capacity < 1:
            raise ValueError("dim and value_tokens must be >= 1, capacity >= 2 and pending_capacity >= 1")
        self.dim, self.value_tokens = dim, value_tokens
        self.key_store = key_store  # the dense datastore whose transform makes the keys (snapshots copy it)
        self.additions = 0  # positions ever added (a snapshot is due when it moved)
        self._lock = threading.Lock()  # adding against a snapshot's copy from another thread
        self._half = capacity // 2
        self._older = _Generation.empty(dim, 0, value_tokens)
        self._newer = _Generation.empty(dim, self._half, value_tokens)
        self._pending_keys = np.zeros((pending_capacity, dim), np.float32)
        self._pending_positions = np.zeros(pending_capacity, np.int64)
        self._pending_owner = np.full(pending_capacity, None, dtype=object)
        self._cursor = 0

    @property
    def num_positions(self) -> int:
        """Positions searchable now."""
        return self._older.size + self._newer.size

    @property
    def num_pending(self) -> int:
        """Keys waiting for their request to finish."""
        return int(np.count_nonzero(self._pending_owner != None))  # noqa: E711 (elementwise on objects)

    def record(self, owners: Sequence[str] | np.ndarray, positions: np.ndarray, keys: np.ndarray) -> None:
        """Row ``i``'s key ``keys[i]`` (``[B, dim]``) predicted the token at ``positions[i]`` of
        request ``owners[i]``; it waits until that request finishes."""
        keep = min(len(owners), len(self._pending_owner))  # more than the ring holds: the newest
        if keep == 0:
            return
        slots = (self._cursor + np.arange(keep)) % len(self._pending_owner)
        self._pending_keys[slots] = keys[-keep:]
        self._pending_positions[slots] = positions[-keep:]
        self._pending_owner[slots] = list(owners[-keep:])
        self._cursor = int(slots[-1] + 1) % len(self._pending_owner)

    def record_states(self, owners: Sequence[str] | np.ndarray, positions: np.ndarray, states: np.ndarray) -> None:
        """:meth:`record` the keys of the target's hidden states ``states`` (``[B, hidden]``) in
        the key space of ``key_store``."""
        if self.key_store is None:
            raise ValueError("recording hidden states needs the dense datastore whose transform makes the keys")
        self.record(owners, positions, self.key_store.keys_of(states))

    def finish(self, finished: Mapping[str, np.ndarray]) -> None:
        """Requests that finished, with their tokens (prompt and output): their waiting keys whose
        next ``value_tokens`` tokens are known join the index."""
        for owner, tokens in finished.items():
            slots = self._take_pending(owner)
            positions = self._pending_positions[slots]
            complete = positions + self.value_tokens <= len(tokens)
            if np.any(complete):
                values = np.asarray(tokens)[positions[complete, None] + np.arange(self.value_tokens)]
                self._add(self._pending_keys[slots[complete]], values.astype(np.int32))

    def forget(self, owners: Iterable[str]) -> None:
        """Drop the waiting keys of requests that ended without tokens to learn from (aborted)."""
        for owner in owners:
            self._take_pending(owner)

    def _take_pending(self, owner: str) -> np.ndarray:
        """The ring slots of ``owner``'s waiting keys in the order they were recorded, released."""
        slots = np.flatnonzero(self._pending_owner == owner)
        self._pending_owner[slots] = None
        return slots[np.argsort((slots - self._cursor) % len(self._pending_owner), kind="stable")]

    def _add(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Into the newer generation; when it is full, it becomes the older (the older dropped)."""
        with self._lock:
            start = 0
            while start < len(values):
                if self._newer.room == 0:
                    self._older, self._newer = self._newer, _Generation.empty(self.dim, self._half,
                                                                              self.value_tokens)
                stop = start + min(self._newer.room, len(values) - start)
                self._newer.add(keys[start:stop], values[start:stop])
                start = stop
            self.additions += len(values)

    def contents(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of every kept position's key ``[n, dim]`` and value ``[n, N]``, oldest first."""
        with self._lock:
            kept = [g for g in (self._older, self._newer) if g.size]
            keys = [g.index.reconstruct_n(0, g.size) for g in kept]
            values = [g.values[: g.size].copy() for g in kept]
        if not kept:
            return np.zeros((0, self.dim), np.float32), np.zeros((0, self.value_tokens), np.int32)
        return np.concatenate(keys), np.concatenate(values)

    def restore(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Add saved positions (oldest first; beyond the capacity the oldest are dropped) without
        counting them as new."""
        self._add(np.asarray(keys, np.float32), np.asarray(values, np.int32))
        self.additions -= len(values)

    def search(self, keys: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` best-scoring positions of each key ``[B, dim]`` over both generations:
        scores ``[B, k]`` (best first) and value rows ``[B, k, N]``; empty slots score
        MISSING_SCORE with values -1 (the dense datastore's contract)."""
        found = [generation.search(keys, k) for generation in (self._newer, self._older) if generation.size]
        if not found:
            return (np.full((len(keys), k), MISSING_SCORE, np.float32),
                    np.full((len(keys), k, self.value_tokens), -1, np.int32))
        scores = np.concatenate([s for s, _ in found], axis=1)
        values = np.concatenate([v for _, v in found], axis=1)
        best = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(scores, best, axis=1), np.take_along_axis(values, best[:, :, None], axis=1)
