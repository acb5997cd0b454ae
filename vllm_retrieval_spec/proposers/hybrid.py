"""Hybrid: REST's sources and DReSD's dense neighbours in one trie."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_retrieval_spec.proposers.base import DraftBatch
from vllm_retrieval_spec.proposers.dense_source import DenseDrafts, DenseSource, UsesDenseSource
from vllm_retrieval_spec.proposers.rest import RestProposer

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class HybridProposer(UsesDenseSource, RestProposer):
    """``RestProposer`` (datastore, context, output index, live index) with the dense datastore's
    neighbours of the target's last hidden state (``DReSDProposer``'s source) merged into the same
    trie. The goodput budget calibrates every source on its own (a dense node's evidence is how
    many neighbours agreed with the sampled token), so dense continuations are drafted where they
    are accepted and cost only their search elsewhere."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self.dense = DenseSource(self.options, vllm_config, type(self).__name__)
        self.last_drafts: DenseDrafts | None = None

    def draft(self, batch: DraftBatch) -> DenseDrafts:
        found = self.dense.continuations(batch, self.session)
        self.last_drafts = DenseDrafts.of(self.retrieve(batch, dense=found.store, learned=found.learned), found)
        return self.last_drafts
