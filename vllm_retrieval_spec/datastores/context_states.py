"""The target's hidden states of the requests in flight, by the position of the token each produced.

REST's context source finds every recent earlier occurrence of the context's longest repeated
suffix; which one to continue decides how many of its tokens are accepted. With these states
the kernel follows the occurrence whose last token was produced by the state nearest (cosine)
the one that produced the context's last token: the model was "in the same place" there
(option ``context_state_votes``; ``benchmarks/copy_ceiling.py --dense``: +4-9% tokens a step of
one chain over the latest occurrence, but none kept through the goodput budget on SmolLM2, see
``benchmarks/results/README.md``).

Each request holds a slot from its first recorded state until it finishes or is aborted; a
slot's states grow with the request (unit vectors of the model's hidden size, float32) and are
freed with it. The C++ structure is ``csrc/context_states.h``; Python holds only the lifecycle.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from vllm_retrieval_spec.kernels.extension import load_extension


class ContextStates:
    """Hidden states of up to ``max_requests`` requests in flight, of ``dim`` floats each, at
    positions below ``max_positions`` (see the module docstring)."""

    def __init__(self, dim: int, max_requests: int, max_positions: int) -> None:
        self._native = load_extension().ContextStates(int(dim), int(max_requests), int(max_positions))
        self._max_positions = int(max_positions)
        self._slots: dict[str, int] = {}
        self._free = list(range(int(max_requests)))  # a heap: the lowest free slot first

    @property
    def native(self) -> Any:
        """The extension's ``ContextStates`` (``rest_retrieve``'s ``context_states``)."""
        return self._native

    @property
    def memory_bytes(self) -> int:
        return int(self._native.memory_bytes)

    @property
    def requests(self) -> int:
        """Requests holding a slot."""
        return len(self._slots)

    def write(self, req_ids: Sequence[str], rows: np.ndarray, positions: np.ndarray, states: np.ndarray) -> None:
        """Store ``states[i]`` as request ``req_ids[rows[i]]``'s state that produced its token at
        ``positions[i]`` (requests past ``max_requests`` in flight keep none, positions past
        ``max_positions`` are dropped: no context reaches them)."""
        if not len(rows):
            return
        rows = np.asarray(rows, np.int64)
        row_slots = np.full(len(req_ids), -1, np.int32)
        for row in np.unique(rows).tolist():
            row_slots[row] = self._slot(req_ids[row])
        slots = row_slots[rows]
        positions = np.asarray(positions, np.int64)
        keep = (slots >= 0) & (positions >= 0) & (positions < self._max_positions)
        self._native.write(np.ascontiguousarray(slots[keep]), np.ascontiguousarray(positions[keep]),
                           np.ascontiguousarray(states[keep], np.float32))

    def slots_of(self, req_ids: Sequence[str]) -> np.ndarray:
        """``[len(req_ids)]`` int32: each request's slot (-1: none), ``rest_retrieve``'s ``state_slots``."""
        return np.fromiter((self._slots.get(req_id, -1) for req_id in req_ids), np.int32, len(req_ids))

    def release(self, req_ids: Iterable[str]) -> None:
        """Forget finished or aborted requests (unknown ids are ignored) and free their states."""
        for req_id in req_ids:
            slot = self._slots.pop(req_id, None)
            if slot is not None:
                self._native.release(slot)
                heapq.heappush(self._free, slot)

    def _slot(self, req_id: str) -> int:
        """``req_id``'s slot, taking a free one at its first state (-1: none is free)."""
        slot = self._slots.get(req_id)
        if slot is None and self._free:
            slot = self._slots[req_id] = heapq.heappop(self._free)
        return -1 if slot is None else slot
