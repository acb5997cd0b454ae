"""Hybrid: REST's sources and DReSD's dense neighbours in one trie."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from vllm_retrieval_spec.drafts import SOURCE_DENSE, SOURCE_LEARNED
from vllm_retrieval_spec.goodput.search_gate import SearchGate
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
    are accepted; with a budget the dense search itself runs only while the tokens accepted from
    the dense sources' nodes alone pay for it (:class:`~vllm_retrieval_spec.goodput.search_gate.SearchGate`),
    so that Hybrid costs no more than REST where the dense store adds nothing."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self.dense = DenseSource(self.options, vllm_config, type(self).__name__)
        self.gate = SearchGate(SOURCE_DENSE | SOURCE_LEARNED, type(self).__name__)
        self.last_drafts: DenseDrafts | None = None

    def draft(self, batch: DraftBatch) -> DenseDrafts:
        budget = None if self.session is None else self.session.budget
        if budget is not None and not self.gate.open(budget, len(batch)):
            self.last_drafts = DenseDrafts(**vars(self.retrieve(batch)))
            return self.last_drafts
        start = time.perf_counter()
        found = self.dense.continuations(batch, self.session)
        self.gate.searched(time.perf_counter() - start)
        self.last_drafts = DenseDrafts.of(self.retrieve(batch, dense=found.store, learned=found.learned), found)
        return self.last_drafts
