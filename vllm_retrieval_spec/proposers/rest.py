"""REST: exact-match retrieval from a suffix-array datastore and the request's own context."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_retrieval_spec.datastores.resolve import open_datastore_for_model
from vllm_retrieval_spec.kernels.rest import RestDrafts, RestParams, rest_retrieve
from vllm_retrieval_spec.proposers.base import DraftBatch, DraftProposer

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class RestProposer(DraftProposer):
    """Drafts the heaviest chain of a trie merging datastore, output-index (recently finished
    requests of this engine) and in-context continuations of the longest matching suffix
    (REST, extended with the context and output sources). With the ``tree``
    option it drafts the heaviest subtree instead (at most ``top_k`` and
    ``num_speculative_tokens`` nodes) for tree verification."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        options = self.options
        self.datastore = None
        if options.use_datastore:
            self.datastore, _ = open_datastore_for_model(
                options.datastore, vllm_config.model_config.tokenizer
            )
            self.datastore.prefetch()
            self.datastore.verify_in_background()  # a changed file stops drafting from it, logged
        self.params = RestParams.from_options(options, chain_len=self.num_speculative_tokens,
                                              top_k=self.candidate_tree_size())
        self.last_drafts: RestDrafts | None = None

    def uses_output_index(self) -> bool:
        return self.options.use_output_index

    def draft(self, batch: DraftBatch) -> RestDrafts:
        output_index = self.session.output_index if self.session is not None else None
        self.last_drafts = rest_retrieve(
            self.datastore, batch.token_ids, batch.num_tokens, batch.rows, self.params,
            output_index=None if output_index is None else output_index.native,
            num_threads=self.options.num_threads,
        )
        return self.last_drafts
