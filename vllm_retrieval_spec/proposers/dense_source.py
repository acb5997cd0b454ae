"""The dense (DReSD) source shared by ``DReSDProposer`` and ``HybridProposer``: the dense
datastore opened for the target model, searched with the hidden state that produced each row's
last sampled token, its neighbours' continuations handed to REST's trie."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from vllm.logger import init_logger

from vllm_retrieval_spec.datastores.dense import DenseDatastore, open_dense_datastore_for_model
from vllm_retrieval_spec.datastores.learned_dense import LearnedDenseIndex
from vllm_retrieval_spec.drafts import SOURCE_DENSE, SOURCE_LEARNED
from vllm_retrieval_spec.kernels.rest import RestDrafts

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_retrieval_spec.options import RetrievalSpecOptions
    from vllm_retrieval_spec.proposers.base import DraftBatch, DraftSession

logger = init_logger(__name__)

LEARNED_PENDING_KEYS = 65_536  # keys of running requests' tokens the learned index keeps waiting at most


Given = tuple[np.ndarray, np.ndarray, np.ndarray]  # continuations [rows, k, N - 1], lengths [rows, k], agreeing [rows]


@dataclass(frozen=True)
class DenseFound:
    """What :meth:`DenseSource.continuations` found: ``rest_retrieve``'s ``dense`` (the store's
    neighbours) and ``learned`` (the learned index's, None when it is not drafted from)
    arguments, calibrated as two sources."""

    store: Given
    learned: Given | None = None


@dataclass
class DenseDrafts(RestDrafts):
    """REST's trie output plus, per row, how many of the store's and of the learned index's
    neighbours agreed with the sampled token (each dense source's evidence, in place of a match
    length)."""

    agreeing: np.ndarray | None = None
    learned_agreeing: np.ndarray | None = None

    def row_match_len(self) -> dict[int, np.ndarray]:
        lengths = super().row_match_len()
        for flag, agreeing in ((SOURCE_DENSE, self.agreeing), (SOURCE_LEARNED, self.learned_agreeing)):
            if agreeing is not None:
                lengths[flag] = agreeing
        return lengths

    @classmethod
    def of(cls, drafts: RestDrafts, found: DenseFound) -> DenseDrafts:
        """``drafts`` with the agreeing counts of what :meth:`DenseSource.continuations` ``found``."""
        return cls(**vars(drafts), agreeing=found.store[2],
                   learned_agreeing=None if found.learned is None else found.learned[2])


class DenseSource:
    """The dense datastore of ``options.dense_datastore``, opened for the target model (on the
    runner's GPU when faiss-gpu is installed), warmed up and checked in the background."""

    def __init__(self, options: RetrievalSpecOptions, vllm_config: VllmConfig, owner: str) -> None:
        self.neighbours = options.dense_neighbours
        self.learned_neighbours = options.dense_learned_neighbours
        self.learned_positions = options.dense_learned_positions
        self.store: DenseDatastore = open_dense_datastore_for_model(
            options.dense_datastore, vllm_config.model_config.model, nprobe=options.dense_nprobe or None)
        self._place_index(vllm_config, owner)
        self.store.warm_up(self.neighbours)
        self.store.verify_in_background()  # a changed file stops searching it, logged

    def learned_index(self) -> LearnedDenseIndex | None:
        """A new index learned from served traffic in this store's keys (the session owns it),
        or None when ``dense_learned_positions`` is 0."""
        if not self.learned_positions:
            return None
        return LearnedDenseIndex(self.store.manifest.dim, self.store.value_tokens, self.learned_positions,
                                 pending_capacity=min(self.learned_positions, LEARNED_PENDING_KEYS),
                                 key_store=self.store)

    def _place_index(self, vllm_config: VllmConfig, owner: str) -> None:
        """The FAISS index on the runner's GPU when faiss-gpu is installed (CPU otherwise)."""
        device = vllm_config.device_config.device
        if getattr(device, "type", str(device)) != "cuda":
            return
        index = device.index if getattr(device, "index", None) is not None else 0
        where = f"GPU {index}" if self.store.use_gpu(index) else "the CPU (install faiss-gpu for GPU search)"
        logger.info("%s: searching %s on %s", owner, self.store.path, where)

    def continuations(self, batch: DraftBatch, session: DraftSession) -> DenseFound:
        """The neighbours of the store and of the session's learned index (when it drafts), each
        as the continuations after the sampled token (``[rows, k, N - 1]``), their lengths
        (``N - 1`` where the neighbour predicted the sampled token, else 0) and, as the source's
        match length, how many neighbours did (``[rows]``)."""
        keys = self.store.keys_of(session.step_hidden_states[batch.rows].float().cpu().numpy())
        last = batch.token_ids[batch.rows, batch.num_tokens[batch.rows] - 1]
        store = _given(self.store.search_by_keys(keys, self.neighbours)[1], last)
        learned = session.learned_dense
        if learned is None or not self.learned_neighbours:
            return DenseFound(store)
        return DenseFound(store, _given(learned.search(keys, self.learned_neighbours)[1], last))


def _given(values: np.ndarray, last: np.ndarray) -> Given:
    """Neighbours' ``values`` ``[rows, k, N]`` as continuations after each row's ``last`` sampled
    token: ``(values[:, :, 1:], N - 1 where value 0 is last else 0, how many are)``."""
    agree = values[:, :, 0] == last[:, None]
    return (values[:, :, 1:], np.where(agree, values.shape[2] - 1, 0).astype(np.int32),
            np.count_nonzero(agree, axis=1).astype(np.int32))


class UsesDenseSource:
    """Mixed into a proposer that drafts from a :class:`DenseSource` (``self.dense``, set in its
    ``__init__``): the runner's session keeps the target's hidden states for it, and the index
    learned from served traffic when ``dense_learned_positions`` asks for one."""

    dense: DenseSource

    def needs_hidden_states(self) -> bool:
        return True

    def learned_dense_index(self) -> LearnedDenseIndex | None:
        return self.dense.learned_index()
