"""The cross-request output index: the tokens of recently finished requests (prompt and
output), shared by every request of one model runner, searched by REST as a third source.

Finished sequences are kept, newest last, until their tokens exceed ``capacity_tokens`` (the
oldest are evicted). A suffix array over the kept sequences (pydivsufsort) is rebuilt in a
background thread once the tokens added since the last build reach ``rebuild_fraction`` of
the indexed ones (at least one sequence), so the index follows the traffic at an amortised
cost of a few sorted tokens per generated token; searches use the last complete build.
Memory stays under two builds of ``capacity_tokens`` (8 bytes per token each) plus the kept
sequences themselves. :meth:`OutputIndex.save` and :meth:`OutputIndex.load` keep the sequences
on disk across restarts (``datastores/output_snapshot.py``).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from vllm_retrieval_spec.kernels.extension import load_extension

if TYPE_CHECKING:
    from vllm_retrieval_spec.datastores.format import TokenizerIdentity

SEPARATOR = np.iinfo(np.uint32).max
BYTES_PER_INDEXED_TOKEN = 8  # uint32 token + int32 suffix-array entry

logger = logging.getLogger(__name__)


@dataclass
class OutputIndexStats:
    """Counters of one output index (for tests, benchmarks and operators)."""

    sequences_added: int = 0
    sequences_evicted: int = 0
    sequences_loaded: int = 0  # from the snapshot read at start
    builds: int = 0
    indexed_tokens: int = 0  # in the build searches use now


class OutputIndex:
    """Finished requests' tokens, searchable by the REST kernel (see the module docstring)."""

    def __init__(self, capacity_tokens: int, *, rebuild_fraction: float = 0.1, background: bool = True) -> None:
        if capacity_tokens < 2:
            raise ValueError(f"the output index needs a capacity of at least 2 tokens, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self.rebuild_fraction = rebuild_fraction
        self.background = background
        self.stats = OutputIndexStats()
        self._sequences: deque[np.ndarray] = deque()
        self._kept_tokens = 0  # with one separator per sequence
        self._pending_tokens = 0
        self._current: object | None = None  # the extension's SuffixStore
        self._current_tokens = np.zeros(0, np.uint32)
        self._lock = threading.Lock()
        self._building: threading.Thread | None = None

    def add(self, tokens: np.ndarray) -> None:
        """Index a finished request's tokens (a sequence longer than the capacity keeps its end)."""
        sequence = np.asarray(tokens, dtype=np.uint32)[-(self.capacity_tokens - 1):]
        if len(sequence) == 0:
            return
        with self._lock:
            self._keep(sequence)
            self._pending_tokens += len(sequence) + 1
            self.stats.sequences_added += 1
        self._maybe_rebuild()

    def kept_sequences(self) -> list[np.ndarray]:
        """The kept sequences, oldest first (what a snapshot saves)."""
        with self._lock:
            return list(self._sequences)

    def restore(self, sequences: Iterable[np.ndarray]) -> None:
        """Start over from ``sequences`` (oldest first; the newest that fit are kept, a long one
        keeps its end) and build the index at once, so that the first request can use it."""
        self.wait()
        with self._lock:
            self._sequences.clear()
            self._kept_tokens = self._pending_tokens = 0
            for sequence in sequences:
                self._keep(np.asarray(sequence, dtype=np.uint32)[-(self.capacity_tokens - 1):])
            kept = list(self._sequences)
            self.stats.sequences_loaded = len(kept)
        if kept:
            self._build(kept)

    def save(self, path: str | Path, tokenizer: TokenizerIdentity,
             counts: Mapping[str, np.ndarray] | None = None) -> Path:
        """Save the kept sequences (and the budget's learned ``counts`` by name when given) as a
        new snapshot under ``path`` (atomically, at most ``capacity_tokens`` uint32 tokens);
        returns the snapshot's directory."""
        from vllm_retrieval_spec.datastores.output_snapshot import write_snapshot

        return write_snapshot(Path(path), self.kept_sequences(), tokenizer, self.capacity_tokens, counts)

    def load(self, path: str | Path, tokenizer: TokenizerIdentity) -> bool:
        """Restore the newest snapshot under ``path``; True when one was loaded. None there yet
        leaves the index as it is; a snapshot that is corrupt, truncated, of another format or
        of another tokenizer logs one error naming the file and the fix and leaves it as it is
        too (never raises: serving goes on without it)."""
        from vllm_retrieval_spec.datastores.output_snapshot import read_snapshot

        try:
            sequences = read_snapshot(Path(path), tokenizer)
        except Exception as error:  # whatever is wrong with the file, the engine must still start
            logger.error("vllm_retrieval_spec: output index snapshot under %s refused: %s (the server does so "
                         "itself: it serves on with an empty output index and the next save replaces the snapshot; "
                         "move %s away first to keep it)", path, error, path)
            return False
        if sequences is None:
            logger.info("vllm_retrieval_spec: no output index snapshot in %s yet; starting empty", path)
            return False
        self.restore(sequences)
        logger.info("vllm_retrieval_spec: output index loaded from %s: %d requests, %d tokens", path,
                    self.stats.sequences_loaded, self.stats.indexed_tokens)
        return True

    @property
    def native(self) -> object | None:
        """The last complete build as the extension's ``SuffixStore`` (None before the first)."""
        return self._current

    @property
    def tokens(self) -> np.ndarray:
        """The tokens of the last complete build (sequences, each followed by ``SEPARATOR``)."""
        return self._current_tokens

    def wait(self) -> None:
        """Block until a running background build has finished (tests, shutdown)."""
        building = self._building
        if building is not None:
            building.join()

    def memory_bytes(self) -> int:
        """Bytes held: the kept sequences and the current build."""
        kept = sum(s.nbytes for s in self._sequences)
        return kept + self.stats.indexed_tokens * BYTES_PER_INDEXED_TOKEN

    def _keep(self, sequence: np.ndarray) -> None:
        """Append ``sequence`` and evict the oldest over the capacity (under the lock)."""
        self._sequences.append(sequence)
        self._kept_tokens += len(sequence) + 1
        while self._kept_tokens > self.capacity_tokens:
            self._kept_tokens -= len(self._sequences.popleft()) + 1
            self.stats.sequences_evicted += 1

    def _maybe_rebuild(self) -> None:
        with self._lock:
            due = self._pending_tokens >= max(1.0, self.rebuild_fraction * self.stats.indexed_tokens)
            if not due or (self._building is not None and self._building.is_alive()):
                return
            snapshot = list(self._sequences)
            self._pending_tokens = 0
            if self.background:
                self._building = threading.Thread(target=self._build, args=(snapshot,), daemon=True,
                                                  name="vrs-output-index")
                self._building.start()
                return
        self._build(snapshot)

    def _build(self, sequences: list[np.ndarray]) -> None:
        from pydivsufsort import divsufsort

        separator = np.array([SEPARATOR], np.uint32)
        tokens = np.concatenate([part for sequence in sequences for part in (sequence, separator)])
        suffix_array = divsufsort(tokens).astype(np.int32, copy=False)
        store = load_extension().SuffixStore(tokens, suffix_array, int(SEPARATOR), None)
        with self._lock:
            self._current, self._current_tokens = store, tokens
            self.stats.builds += 1
            self.stats.indexed_tokens = len(tokens)
