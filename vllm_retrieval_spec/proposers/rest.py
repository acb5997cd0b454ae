"""REST: exact-match retrieval from a suffix-array datastore and the request's own context."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_retrieval_spec.datastores.resolve import open_datastore_for_model
from vllm_retrieval_spec.kernels.rest import RestDrafts, RestParams, rest_retrieve
from vllm_retrieval_spec.proposers.base import DraftBatch, DraftProposer


class RestProposer(DraftProposer):
    """Drafts the heaviest chain of a trie merging datastore and in-context continuations of
    the longest matching suffix (REST, extended with the context source). With the ``tree``
    option the top-``top_k`` draft trees of the last step stay in :attr:`last_drafts` for
    tree verification."""

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        options = self.options
        self.datastore = None
        if options.use_datastore:
            self.datastore, _ = open_datastore_for_model(
                options.datastore, vllm_config.model_config.tokenizer
            )
            self.datastore.prefetch()
        self.params = RestParams.from_options(options, chain_len=self.num_speculative_tokens)
        self.last_drafts: RestDrafts | None = None

    def draft(self, batch: DraftBatch) -> Sequence[Sequence[int]]:
        drafts = rest_retrieve(
            self.datastore, batch.token_ids, batch.num_tokens, batch.rows, self.params,
            num_threads=self.options.num_threads,
        )
        self.last_drafts = drafts
        return [drafts.chain(index) for index in range(len(batch))]
