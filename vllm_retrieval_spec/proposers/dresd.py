"""DReSD: dense retrieval over the target's own last hidden state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from vllm.logger import init_logger

from vllm_retrieval_spec.datastores.dense import open_dense_datastore_for_model
from vllm_retrieval_spec.drafts import SOURCE_DENSE
from vllm_retrieval_spec.kernels.rest import RestDrafts, RestParams, rest_retrieve
from vllm_retrieval_spec.proposers.base import DraftBatch, DraftProposer

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


@dataclass
class DenseDrafts(RestDrafts):
    """REST's trie output plus, per row, how many neighbours agreed with the sampled token (the
    dense source's evidence, in place of a match length)."""

    agreeing: np.ndarray | None = None

    def row_match_len(self) -> dict[int, np.ndarray]:
        lengths = super().row_match_len()
        if self.agreeing is not None:
            lengths[SOURCE_DENSE] = self.agreeing
        return lengths


class DReSDProposer(DraftProposer):
    """Per step and request: the hidden state that produced the last sampled token, z-normalised,
    PCA-reduced and L2-normalised, searched in the dense datastore's FAISS index (one batched
    call); the neighbours whose stored continuation starts with the token just sampled give
    the rest of it as drafts, merged with the request's own context matches (``use_context``)
    into REST's weighted trie: the heaviest chain, or subtree in tree mode."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        options = self.options
        self.store = open_dense_datastore_for_model(options.dense_datastore, vllm_config.model_config.model)
        self.params = RestParams.from_options(options, chain_len=self.num_speculative_tokens,
                                              top_k=self.candidate_tree_size(), use_datastore=False,
                                              cont_len=max(1, self.store.value_tokens - 1))
        self.last_drafts: DenseDrafts | None = None
        self.place_index(vllm_config)
        self.store.warm_up(options.dense_neighbours)
        self.store.verify_in_background()  # a changed file stops searching it, logged

    def place_index(self, vllm_config: VllmConfig) -> None:
        """The FAISS index on the runner's GPU when faiss-gpu is installed (CPU otherwise)."""
        device = vllm_config.device_config.device
        if getattr(device, "type", str(device)) != "cuda":
            return
        index = device.index if getattr(device, "index", None) is not None else 0
        where = f"GPU {index}" if self.store.use_gpu(index) else "the CPU (install faiss-gpu for GPU search)"
        logger.info("DReSD: searching %s on %s", self.store.path, where)

    def needs_hidden_states(self) -> bool:
        return True

    def draft(self, batch: DraftBatch) -> DenseDrafts:
        continuations, lengths = self.neighbour_continuations(batch)
        drafts = rest_retrieve(None, batch.token_ids, batch.num_tokens, batch.rows, self.params,
                               dense=(continuations, lengths), num_threads=self.options.num_threads)
        self.last_drafts = DenseDrafts(**vars(drafts), agreeing=np.count_nonzero(lengths, axis=1))
        return self.last_drafts

    def neighbour_continuations(self, batch: DraftBatch) -> tuple[np.ndarray, np.ndarray]:
        """The stored continuations after the sampled token (``[rows, k, N - 1]``) and their
        lengths (``N - 1`` where the neighbour predicted the sampled token, else 0)."""
        hidden = self.session.step_hidden_states[batch.rows].float().cpu().numpy()
        _, values = self.store.search(hidden, self.options.dense_neighbours)
        last = batch.token_ids[batch.rows, batch.num_tokens[batch.rows] - 1]
        agree = values[:, :, 0] == last[:, None]
        return values[:, :, 1:], np.where(agree, values.shape[2] - 1, 0).astype(np.int32)
