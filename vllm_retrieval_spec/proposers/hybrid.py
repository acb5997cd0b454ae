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

    from vllm_retrieval_spec.goodput import GoodputBudget


class HybridProposer(UsesDenseSource, RestProposer):
    """``RestProposer`` (datastore, context, output index, live index) with the dense datastore's
    neighbours of the target's last hidden state (``DReSDProposer``'s source) merged into the same
    trie. The goodput budget calibrates every source on its own (a dense node's evidence is how
    many neighbours agreed with the sampled token), so dense continuations are drafted where they
    are accepted; with a budget the dense search itself runs only once steps drafted with it
    serve faster than the same steps drafted without it
    (:class:`~vllm_retrieval_spec.goodput.search_gate.SearchGate`: some steps are drafted both
    ways, and the dense sources' chances are learned from them before their nodes are sent), so
    that Hybrid costs no more than REST where the dense store adds nothing."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self.dense = DenseSource(self.options, vllm_config, type(self).__name__)
        self.gate = SearchGate(SOURCE_DENSE | SOURCE_LEARNED, type(self).__name__)
        self.last_drafts: DenseDrafts | None = None

    def search_gate(self) -> SearchGate:
        return self.gate

    def draft(self, batch: DraftBatch) -> DenseDrafts:
        budget = None if self.session is None else self.session.budget
        if budget is None:
            self.last_drafts = self._drafts(batch, search=True)
            return self.last_drafts
        self.gate.follow(self.session.step_req_ids, batch.token_ids, batch.num_tokens, budget.calibration)
        search = self.gate.open()
        start = time.perf_counter()
        self.last_drafts = self._drafts(batch, search)
        if self.gate.pairs() and not batch.trees:
            self._pair(batch, budget, search, time.perf_counter() - start)
        return self.last_drafts

    def _drafts(self, batch: DraftBatch, search: bool) -> DenseDrafts:
        """REST's drafts, with the dense sources' continuations when ``search``."""
        if not search:
            return DenseDrafts(**vars(self.retrieve(batch)))
        found = self.dense.continuations(batch, self.session)
        return DenseDrafts.of(self.retrieve(batch, dense=found.store, learned=found.learned), found)

    def _pair(self, batch: DraftBatch, budget: GoodputBudget, searched: bool, seconds: float) -> None:
        """Draft this step the other way too and hand both, as the budget would keep them, to the
        gate (the other way's time is set aside from this step's drafting time)."""
        start = time.perf_counter()
        other = self._drafts(batch, not searched)
        other_seconds = time.perf_counter() - start
        num_reqs = len(self.session.step_req_ids)
        samples = self._row_samples(batch.rows)
        ways = [budget.what_if(drafts.nodes(False), batch.budgets, num_reqs, took, samples)
                for drafts, took in ((self.last_drafts, seconds), (other, other_seconds))]
        with_search, without = ways if searched else ways[::-1]
        req_ids = [self.session.step_req_ids[row] for row in batch.rows.tolist()]
        self.gate.record(req_ids, batch.num_tokens[batch.rows], with_search, without, num_reqs, samples)
        self.aside_seconds = time.perf_counter() - start
        self.gate.pairing_seconds += self.aside_seconds
