"""Prompt lookup on the C++ context n-gram matcher: the baseline and plumbing proof."""

from __future__ import annotations

from vllm_retrieval_spec.kernels.context_ngram import ContextNgramDrafts, context_ngram
from vllm_retrieval_spec.proposers.base import DraftBatch, DraftProposer

CANDIDATE_CONTINUATIONS = 8  # continuations merged into the tree sampled candidates are drawn from


class PromptLookupProposer(DraftProposer):
    """Drafts, per request, the most frequent continuation (ties: the most recent) of the
    longest suffix of its own context (``context_ngram_max`` down to ``context_ngram_min``
    tokens) that occurred earlier in that context. For sampled candidates, the most frequent
    continuations merged into a tree weighted by their counts (the drafter's q)."""

    def draft(self, batch: DraftBatch) -> ContextNgramDrafts:
        options = self.options
        found = context_ngram(
            batch.token_ids,
            batch.num_tokens,
            batch.rows,
            num_drafts=CANDIDATE_CONTINUATIONS if batch.trees else 1,
            draft_len=self.num_speculative_tokens,
            q_min=options.context_ngram_min,
            q_max=options.context_ngram_max,
            max_matches=options.context_max_matches,
            num_threads=options.num_threads,
        )
        return found.build_trees(options.num_threads) if batch.trees else found
