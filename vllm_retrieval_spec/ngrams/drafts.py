"""N-Grammys' mixed strategy (paper §4.3): fill ``num_drafts`` drafts of ``draft_len`` tokens
(the paper's k and w) with the request's context n-grams first, then with the model's extended
bigram; merge them into a tree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vllm_retrieval_spec.drafts import SOURCE_CONTEXT, SOURCE_MODEL, DraftArrays
from vllm_retrieval_spec.kernels import context_ngram
from vllm_retrieval_spec.kernels.draft_merge import merged_trees
from vllm_retrieval_spec.ngrams.table import NgramTable

if TYPE_CHECKING:
    from vllm_retrieval_spec.options import RetrievalSpecOptions


@dataclass(frozen=True)
class MixedStrategy:
    """How :func:`mixed_drafts` fills each row: ``num_drafts`` drafts of up to ``draft_len``
    tokens (the paper's k and w; the table's own caps apply too), the context ones matching the
    last ``context_len`` tokens; ``mixing`` is one of ``options.MIXING_POLICIES``."""

    num_drafts: int
    draft_len: int
    context_len: int
    mixing: str

    @classmethod
    def from_options(cls, options: RetrievalSpecOptions, draft_len: int) -> MixedStrategy:
        """The ``ngrammys_*`` options' strategy, with drafts of up to ``draft_len`` tokens."""
        return cls(options.ngrammys_drafts, draft_len, options.ngrammys_context_len, options.ngrammys_mixing)


@dataclass
class NgramDrafts(DraftArrays):
    """``tokens`` ``[rows, num_drafts, draft_len]`` (-1 padded), ``lengths`` ``[rows, num_drafts]``,
    ``from_context`` ``[rows]`` (how many leading drafts came from the context) and ``weights``
    ``[rows, num_drafts]``
    (each draft's probability of its first token: a context n-gram's share of the counts, a
    bigram draft's bigram probability; None: equal). Draft 0 is the chain: the most frequent
    context n-gram, else the bigram's top-1 greedy continuation. The trees (the drafts
    merged, shared prefixes once, nodes in draft order so that a node budget that cuts the list
    keeps the best drafts whole; ``tree_prob``: a node's weight over its parent's, the
    drafter's q) are None until :meth:`build_trees`."""

    tokens: np.ndarray
    lengths: np.ndarray
    from_context: np.ndarray
    weights: np.ndarray | None = None
    tree_tokens: np.ndarray | None = None
    tree_parents: np.ndarray | None = None
    tree_size: np.ndarray | None = None
    tree_prob: np.ndarray | None = None

    @property
    def chain_tokens(self) -> np.ndarray:
        """Draft 0 of every row, ``[rows, draft_len]``."""
        return self.tokens[:, 0]

    @property
    def chain_size(self) -> np.ndarray:
        return self.lengths[:, 0]

    def build_trees(self, num_threads: int = 0) -> NgramDrafts:
        """Fill the tree arrays, every row's drafts merged in one kernel call; returns self."""
        self.tree_tokens, self.tree_parents, self.tree_size, self.tree_prob = merged_trees(
            self.tokens, self.lengths, self.weights, num_threads=num_threads
        )
        return self

    def row_sources(self) -> np.ndarray:
        """Context when the row's first draft came from its context, else the model's bigram."""
        return np.where(self.from_context > 0, SOURCE_CONTEXT, SOURCE_MODEL).astype(np.int8)

    def tree(self, index: int) -> tuple[list[int], list[int]]:
        """Row ``index``'s tree (built for all rows first when it was not)."""
        if self.tree_tokens is None:
            self.build_trees()
        return super().tree(index)


def mixed_drafts(table: NgramTable, token_ids: np.ndarray, num_tokens: np.ndarray, rows: np.ndarray,
                 strategy: MixedStrategy, *, num_threads: int = 0, with_trees: bool = False) -> NgramDrafts:
    """The drafts of every requested row, filled by ``strategy``; ``with_trees`` also merges them
    into trees."""
    num_drafts, draft_len = min(strategy.num_drafts, table.max_drafts), min(strategy.draft_len, table.max_draft_len)
    tokens = np.full((len(rows), num_drafts, draft_len), -1, dtype=np.int32)
    lengths = np.zeros((len(rows), num_drafts), dtype=np.int32)
    weights = np.zeros((len(rows), num_drafts), dtype=np.float32)
    from_context = np.zeros(len(rows), dtype=np.int32)
    if strategy.mixing != "bigram-only":
        found = context_ngram(token_ids, num_tokens, rows, num_drafts=num_drafts, draft_len=draft_len,
                              q_min=strategy.context_len, q_max=strategy.context_len, num_threads=num_threads)
        tokens[:], lengths[:] = found.tokens, found.lengths
        from_context = (found.lengths > 0).sum(axis=1).astype(np.int32)
        counts = found.counts.astype(np.float32)
        total = counts.sum(axis=1, keepdims=True)
        weights = np.divide(counts, total, out=weights, where=total > 0)
    if strategy.mixing != "context-only":
        last = token_ids[rows, num_tokens[rows] - 1]
        tabulated = last < table.tokens  # a partial table has no row for the others
        row = np.where(tabulated, last, 0)
        bigram = table.extended[row][:, :num_drafts, :draft_len]  # [rows, num_drafts, draft_len]
        slot = np.arange(num_drafts)[None, :]
        fill = (slot >= from_context[:, None]) & tabulated[:, None]  # the slots the context left empty
        source = np.clip(slot - from_context[:, None], 0, num_drafts - 1)
        filled = np.take_along_axis(bigram, source[:, :, None], axis=1)
        kept = np.logical_and.accumulate(filled >= 0, axis=2)  # up to a continuation's end (-1)
        tokens = np.where(fill[:, :, None], np.where(kept, filled, -1), tokens).astype(np.int32, copy=False)
        lengths = np.where(fill, kept.sum(axis=2), lengths).astype(np.int32)
        probs = np.take_along_axis(np.asarray(table.bigram_probs[row][:, :num_drafts]), source, axis=1)
        weights = np.where(fill, probs, weights).astype(np.float32)
    drafts = NgramDrafts(tokens, lengths, from_context, weights)
    return drafts.build_trees(num_threads) if with_trees else drafts
