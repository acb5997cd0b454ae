"""N-Grammys: learning-free drafts from the request's context and the model's own bigram."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_retrieval_spec.ngrams.drafts import MixedStrategy, NgramDrafts, mixed_drafts
from vllm_retrieval_spec.ngrams.table import open_table_for_model
from vllm_retrieval_spec.proposers.base import DraftBatch, DraftProposer

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class NGrammysProposer(DraftProposer):
    """Fills ``ngrammys_drafts`` drafts of ``ngrammys_draft_len`` tokens by the paper's mixed
    strategy and drafts the best one as a chain (the most frequent context n-gram, else the
    bigram's top-1 continuation). With the ``tree`` option it drafts them merged into one tree
    (breadth-first, cut to ``num_speculative_tokens`` nodes) for tree verification."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self.table = open_table_for_model(self.options.ngram_table, vllm_config.model_config.model)
        self.strategy = MixedStrategy.from_options(
            self.options, min(self.options.ngrammys_draft_len, self.num_speculative_tokens))
        self.last_drafts: NgramDrafts | None = None

    def draft(self, batch: DraftBatch) -> NgramDrafts:
        self.last_drafts = mixed_drafts(self.table, batch.token_ids, batch.num_tokens, batch.rows, self.strategy,
                                        num_threads=self.options.num_threads, with_trees=batch.trees)
        return self.last_drafts

