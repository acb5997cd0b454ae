"""N-Grammys' mixed strategy (paper §4.3): fill k drafts of length w with the request's
context n-grams first, then with the model's extended bigram; merge them into a tree."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_retrieval_spec.kernels import context_ngram
from vllm_retrieval_spec.ngrams.table import NgramTable


@dataclass
class NgramDrafts:
    """``tokens`` ``[rows, k, w]`` (-1 padded), ``lengths`` ``[rows, k]`` and ``from_context``
    ``[rows]`` (how many leading drafts came from the context). Draft 0 is the chain: the
    most frequent context n-gram, else the bigram's top-1 greedy continuation."""

    tokens: np.ndarray
    lengths: np.ndarray
    from_context: np.ndarray

    def chain(self, row: int) -> list[int]:
        return self.tokens[row, 0, : self.lengths[row, 0]].tolist()

    def tree(self, row: int) -> tuple[list[int], list[int]]:
        """The k drafts as one tree (shared prefixes merged), parents first, in draft order:
        a node budget that cuts the list keeps the best drafts whole."""
        children: dict[tuple[int, int], int] = {}
        tokens: list[int] = []
        parents: list[int] = []
        for slot in range(self.tokens.shape[1]):
            parent = -1
            for token in self.tokens[row, slot, : self.lengths[row, slot]].tolist():
                key = (parent, token)
                if key not in children:
                    children[key] = len(tokens)
                    tokens.append(token)
                    parents.append(parent)
                parent = children[key]
        return tokens, parents


def mixed_drafts(table: NgramTable, token_ids: np.ndarray, num_tokens: np.ndarray, rows: np.ndarray,
                 *, k: int, w: int, q: int, mixing: str, num_threads: int = 0) -> NgramDrafts:
    """k drafts of up to w tokens per requested row; ``mixing`` is one of
    ``options.MIXING_POLICIES``."""
    k, w = min(k, table.k), min(w, table.w)
    tokens = np.full((len(rows), k, w), -1, dtype=np.int32)
    lengths = np.zeros((len(rows), k), dtype=np.int32)
    from_context = np.zeros(len(rows), dtype=np.int32)
    if mixing != "bigram-only":
        found = context_ngram(token_ids, num_tokens, rows, k=k, w=w, q_min=q, q_max=q,
                              num_threads=num_threads)
        tokens[:], lengths[:] = found.tokens, found.lengths
        from_context = (found.lengths > 0).sum(axis=1).astype(np.int32)
    if mixing != "context-only":
        last = token_ids[rows, num_tokens[rows] - 1]
        bigram = table.extended[last][:, :k, :w]  # [rows, k, w]
        slot = np.arange(k)[None, :]
        fill = slot >= from_context[:, None]  # the slots the context left empty
        source = np.clip(slot - from_context[:, None], 0, k - 1)
        filled = np.take_along_axis(bigram, source[:, :, None], axis=1)
        tokens = np.where(fill[:, :, None], filled, tokens)
        lengths = np.where(fill, w, lengths).astype(np.int32)
    return NgramDrafts(tokens, lengths, from_context)
