"""REST: exact-match retrieval from a suffix-array datastore and the request's own context."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_retrieval_spec.datastores.resolve import open_datastore_for_model
from vllm_retrieval_spec.datastores.sharded import open_datastore
from vllm_retrieval_spec.datastores.watch import ReloadingDatastore
from vllm_retrieval_spec.kernels.rest import ChanceTable, RestDrafts, RestParams, rest_retrieve
from vllm_retrieval_spec.proposers.base import DraftBatch, DraftProposer

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class RestProposer(DraftProposer):
    """Drafts the heaviest chain of a trie merging datastore, output-index (recently finished
    requests of this engine) and in-context continuations of the longest matching suffix
    (REST, extended with the context and output sources). With a goodput budget, nodes rank by
    its calibrated path chance (a long in-context match outranks a frequent short datastore
    continuation), else by trie weight. With the ``tree`` option it drafts a subtree instead for
    tree verification: with a goodput budget the best ``num_speculative_tokens`` of ``top_k``
    candidates holding the whole chain (the budget keeps branches only where they pay), else the
    heaviest ``min(top_k, num_speculative_tokens)`` nodes."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        options = self.options
        self.datastore: ReloadingDatastore | None = None
        if options.use_datastore:
            store, identity = open_datastore_for_model(options.datastore, vllm_config.model_config.tokenizer)
            self.datastore = ReloadingDatastore(store, functools.partial(open_datastore, expected_tokenizer=identity),
                                                options.datastore_reload_seconds)
        self.params = RestParams.from_options(options, chain_len=self.num_speculative_tokens,
                                              top_k=self.candidate_tree_size())
        self.last_drafts: RestDrafts | None = None

    def uses_output_index(self) -> bool:
        return self.options.use_output_index

    def uses_live_index(self) -> bool:
        return self.options.use_live_index and self.num_speculative_tokens > 1

    def keeps_context_states(self) -> bool:
        return self.options.use_context and self.options.context_state_votes > 1

    def draft(self, batch: DraftBatch) -> RestDrafts:
        self.last_drafts = self.retrieve(batch)
        return self.last_drafts

    def retrieve(self, batch: DraftBatch, dense: tuple[np.ndarray, ...] | None = None,
                 learned: tuple[np.ndarray, ...] | None = None) -> RestDrafts:
        """The kernel's drafts for ``batch`` from every configured source, plus ``dense`` and
        ``learned`` continuations found elsewhere (``rest_retrieve``'s arguments)."""
        output_index = self.session.output_index if self.session is not None else None
        return rest_retrieve(
            None if self.datastore is None else self.datastore.current(), batch.token_ids, batch.num_tokens,
            batch.rows, self.params.for_trees(batch.trees),
            output_index=None if output_index is None else output_index.native,
            dense=dense,
            learned=learned,
            live=self._live_matches(batch),
            chances=self._chances(),
            context_states=self._context_states(batch),
            num_threads=self.options.num_threads,
        )

    def _chances(self) -> ChanceTable | None:
        """The goodput budget's calibrated chance table (None without a budget: rank by weight)."""
        budget = None if self.session is None else self.session.budget
        return None if budget is None else budget.chance_table()

    def _context_states(self, batch: DraftBatch) -> tuple[Any, np.ndarray] | None:
        """The session's context states and the slot of each of the batch's rows (None without)."""
        states = None if self.session is None else self.session.context_states
        if states is None:
            return None
        return states.native, states.slots_of([self.session.step_req_ids[row] for row in batch.rows.tolist()])

    def _live_matches(self, batch: DraftBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The rows' continuations from the other requests in flight (None without a live index)."""
        found = None if self.session is None else self.session.live_matches(
            batch.token_ids, batch.num_tokens, batch.rows, self.options.live_max_matches,
            self.params.continuation_len, self.options.num_threads)
        return None if found is None else found.as_given()
