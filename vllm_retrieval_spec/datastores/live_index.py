"""The live index: the tokens (prompt and output so far) of the requests still in flight,
shared by every request of one model runner and searched by REST, so that parallel requests
with shared structure (one template, an agent's fan-out, ``n > 1``) draft from each other.

Each step appends the tokens every running request accepted since the last one; a lookup finds,
for each drafting row, the longest suffix of its context (n-gram lengths ``n_max`` halving down
to ``n_min``) in the other live requests and the continuations that follow, newest first. A
request that finishes or is aborted is removed at once. Memory is fixed when the index is
created: a ring of ``capacity_tokens`` tokens, the oldest evicted first (the C++ structure and
its exact rules are in ``csrc/live_index.h``). Python holds only the lifecycle.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_retrieval_spec.kernels.extension import load_extension

MAX_WALK = 256  # occurrences of one n-gram examined per row and length (the newest)
REQUEST_SHARE = 4  # a request entering with many tokens keeps its last capacity / REQUEST_SHARE


def live_lengths(n_min: int, n_max: int) -> tuple[int, ...]:
    """The n-gram lengths indexed: ``n_max``, halving while above ``n_min``, then ``n_min``."""
    if not 1 <= n_min <= n_max:
        raise ValueError(f"live index n-gram lengths need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
    lengths = [n_max]
    while lengths[-1] // 2 > n_min:
        lengths.append(lengths[-1] // 2)
    if lengths[-1] != n_min:
        lengths.append(n_min)
    return tuple(lengths)


@dataclass
class LiveMatches:
    """One lookup: per row up to ``k`` continuations ``tokens [rows, k, cont_len]`` (-1
    padded) of ``lengths [rows, k]`` tokens, found with a match of ``match_len [rows]`` tokens
    (0: none)."""

    tokens: np.ndarray
    lengths: np.ndarray
    match_len: np.ndarray

    def as_given(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, lengths, match_len)``, as ``rest_retrieve(live=...)`` takes them."""
        return self.tokens, self.lengths, self.match_len


class LiveIndex:
    """The tokens of the requests in flight (see the module docstring)."""

    def __init__(self, capacity_tokens: int, lengths: Sequence[int], *, max_walk: int = MAX_WALK) -> None:
        self._native = load_extension().LiveIndex(
            int(capacity_tokens), [int(n) for n in lengths], max(1, int(capacity_tokens) // REQUEST_SHARE),
            int(max_walk))

    @classmethod
    def from_options(cls, options: Any) -> LiveIndex:
        """The live index a ``RetrievalSpecOptions`` asks for (``live_index_tokens``, REST's
        ``n_min`` and ``n_max``)."""
        return cls(options.live_index_tokens, live_lengths(options.n_min, options.n_max))

    def update(self, req_ids: Sequence[str | None], token_ids: np.ndarray, num_tokens: np.ndarray) -> None:
        """Index row ``i``'s request ``req_ids[i]`` up to ``token_ids[i, :num_tokens[i]]``
        (vLLM's ``token_ids_cpu`` and ``num_tokens_no_spec``; a None id skips the row)."""
        self._native.update(list(req_ids), _int32(token_ids), _int32(num_tokens))

    def lookup(self, req_ids: Sequence[str | None], token_ids: np.ndarray, num_tokens: np.ndarray, rows: np.ndarray,
               max_matches: int, cont_len: int, num_threads: int = 0) -> LiveMatches:
        """Continuations for ``rows`` from the live requests other than the row's own."""
        found = self._native.lookup(list(req_ids), _int32(token_ids), _int32(num_tokens), _int32(rows),
                                    int(max_matches), int(cont_len), num_threads=num_threads)
        return LiveMatches(*found)

    def remove(self, req_ids: Iterable[str]) -> None:
        """Forget finished or aborted requests at once."""
        self._native.remove(list(req_ids))

    @property
    def live_requests(self) -> int:
        return self._native.live_requests

    @property
    def live_tokens(self) -> int:
        """Tokens of live requests still indexed (scans the ring: tests and operators)."""
        return self._native.live_tokens

    @property
    def appended_tokens(self) -> int:
        return self._native.appended_tokens

    def memory_bytes(self) -> int:
        """Bytes held (fixed at creation, plus a few per live request)."""
        return self._native.memory_bytes


def _int32(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.int32)
