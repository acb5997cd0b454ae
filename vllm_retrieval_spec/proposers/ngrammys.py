"""N-Grammys: learning-free drafts from the request's context and the model's own bigram."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_retrieval_spec.ngrams.drafts import NgramDrafts, mixed_drafts
from vllm_retrieval_spec.ngrams.table import ModelIdentity, NgramTable, NgramTableError, default_table_dir
from vllm_retrieval_spec.proposers.base import DraftBatch, DraftProposer
from vllm_retrieval_spec.verification.trees import DraftTree


class NGramProposer(DraftProposer):
    """Fills ``k`` drafts of length ``w`` by the paper's mixed strategy and drafts the best one
    as a chain (the most frequent context n-gram, else the bigram's top-1 continuation).
    With the ``tree`` option it drafts the k drafts merged into one tree (breadth-first, cut
    to ``num_speculative_tokens`` nodes) for tree verification."""

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        identity = ModelIdentity.of(vllm_config.model_config.model)
        table_dir = Path(self.options.ngram_table) if self.options.ngram_table else default_table_dir(identity)
        if not table_dir.exists():
            raise NgramTableError(
                f"no n-gram table at {table_dir}; build it with "
                f"`vllm-retrieval-spec ngram-table build --model {vllm_config.model_config.model}`"
            )
        self.table = NgramTable.open(table_dir, expected_model=identity)
        self.last_drafts: NgramDrafts | None = None

    def _mixed_drafts(self, batch: DraftBatch) -> NgramDrafts:
        options = self.options
        self.last_drafts = mixed_drafts(
            self.table, batch.token_ids, batch.num_tokens, batch.rows,
            k=options.k, w=min(options.w, self.num_speculative_tokens), q=options.q,
            mixing=options.mixing, num_threads=options.num_threads,
        )
        return self.last_drafts

    def draft(self, batch: DraftBatch) -> Sequence[Sequence[int]]:
        drafts = self._mixed_drafts(batch)
        return [drafts.chain(index) for index in range(len(batch))]

    def draft_trees(self, batch: DraftBatch) -> Sequence[DraftTree]:
        drafts = self._mixed_drafts(batch)
        return [DraftTree(*map(tuple, drafts.tree(index))) for index in range(len(batch))]
