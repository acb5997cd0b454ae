"""DReSD: dense retrieval over the target's own last hidden state."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_retrieval_spec.kernels.rest import RestParams, rest_retrieve
from vllm_retrieval_spec.proposers.base import DraftBatch, DraftProposer
from vllm_retrieval_spec.proposers.dense_source import DenseDrafts, DenseSource, UsesDenseSource

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class DReSDProposer(UsesDenseSource, DraftProposer):
    """Per step and request: the hidden state that produced the last sampled token, z-normalised,
    PCA-reduced and L2-normalised, searched in the dense datastore's FAISS index (one batched
    call); the neighbours whose stored continuation starts with the token just sampled give
    the rest of it as drafts, merged with the request's own context matches (``use_context``)
    into REST's weighted trie: the heaviest chain, or subtree in tree mode."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self.dense = DenseSource(self.options, vllm_config, type(self).__name__)
        self.params = RestParams.from_options(self.options, chain_len=self.num_speculative_tokens,
                                              top_k=self.candidate_tree_size(), use_datastore=False,
                                              cont_len=max(1, self.dense.store.value_tokens - 1))
        self.last_drafts: DenseDrafts | None = None

    def draft(self, batch: DraftBatch) -> DenseDrafts:
        found = self.dense.continuations(batch, self.session)
        drafts = rest_retrieve(None, batch.token_ids, batch.num_tokens, batch.rows, self.params.for_trees(batch.trees),
                               dense=found.store, learned=found.learned, num_threads=self.options.num_threads)
        self.last_drafts = DenseDrafts.of(drafts, found)
        return self.last_drafts
