"""Context n-gram drafts (prompt lookup; N-Grammys' context source): the front end of the C++/CUDA kernel.

For each requested row, the longest ``q`` in ``[q_min, q_max]`` whose last-``q``-token query
occurs earlier in the row's context; over the most recent ``max_matches`` earlier occurrences,
the distinct continuations of up to ``draft_len`` tokens (truncated at the end of the context) ranked by
count, ties to the most recent occurrence, the first ``num_drafts`` of them. The plain-Python reference is
:mod:`vllm_retrieval_spec.kernels.context_ngram_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_retrieval_spec.drafts import SOURCE_CONTEXT, DraftArrays
from vllm_retrieval_spec.kernels.draft_merge import merged_trees
from vllm_retrieval_spec.kernels.extension import cuda_torch, is_cuda_tensor, load_extension


@dataclass
class ContextNgramDrafts(DraftArrays):
    """Up to ``num_drafts`` drafts per requested row; the chain is draft 0; trees (the drafts merged,
    each node's ``tree_prob`` its share of its parent's counts) only after :meth:`build_trees`.

    ``tokens`` is ``[rows, num_drafts, draft_len]`` padded with -1, ``lengths`` and ``counts`` are
    ``[rows, num_drafts]`` (0 for empty slots) and ``match_len`` is the ``q`` that matched per row
    (0: no match). Arrays are NumPy on the CPU, torch tensors for CUDA inputs.
    """

    tokens: Any
    lengths: Any
    counts: Any
    match_len: Any
    tree_tokens: Any = None
    tree_parents: Any = None
    tree_size: Any = None
    tree_prob: Any = None

    def build_trees(self, num_threads: int = 0) -> ContextNgramDrafts:
        """Merge every row's drafts into one tree weighted by their counts; returns self."""
        self.tree_tokens, self.tree_parents, self.tree_size, self.tree_prob = merged_trees(
            self.tokens, self.lengths, self.counts, num_threads=num_threads
        )
        return self

    def row_match_len(self) -> dict[int, Any]:
        return {SOURCE_CONTEXT: self.match_len}

    @property
    def chain_tokens(self) -> Any:
        """Draft 0 of every row, ``[rows, draft_len]``."""
        return self.tokens[:, 0]

    @property
    def chain_size(self) -> Any:
        return self.lengths[:, 0]

    def draft(self, index: int, slot: int = 0) -> list[int]:
        """Draft ``slot`` of requested row ``index`` as a list of token ids."""
        length = int(self.lengths[index, slot])
        return [int(t) for t in self.tokens[index, slot, :length]]


def context_ngram(
    tokens: Any,
    lengths: Any,
    rows: Any,
    *,
    num_drafts: int,
    draft_len: int,
    q_min: int,
    q_max: int,
    max_matches: int = 64,
    num_threads: int = 0,
) -> ContextNgramDrafts:
    """Draft from each row's own context with the C++ kernel (CUDA for CUDA tensors).

    ``tokens`` is ``[num_rows, max_len]`` int32 (e.g. vLLM's ``token_ids_cpu``, used
    without a copy), ``lengths`` ``[num_rows]`` int32, ``rows`` the row indices to draft for.
    ``num_threads`` caps the CPU threads (0: one per core); small batches run on one.
    """
    if is_cuda_tensor(tokens):
        return _context_ngram_cuda(tokens, lengths, rows, num_drafts, draft_len, q_min, q_max, max_matches)
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    out = ContextNgramDrafts(
        tokens=np.empty((len(rows), num_drafts, draft_len), dtype=np.int32),
        lengths=np.empty((len(rows), num_drafts), dtype=np.int32),
        counts=np.empty((len(rows), num_drafts), dtype=np.int32),
        match_len=np.empty(len(rows), dtype=np.int32),
    )
    load_extension().context_ngram(
        np.ascontiguousarray(tokens, dtype=np.int32), np.ascontiguousarray(lengths, dtype=np.int32),
        rows, out.tokens, out.lengths, out.counts, out.match_len, q_min, q_max, max_matches,
        num_threads,
    )
    return out


def _context_ngram_cuda(tokens, lengths, rows, num_drafts, draft_len, q_min, q_max, max_matches):
    torch = cuda_torch()
    device = tokens.device
    rows = torch.as_tensor(rows, dtype=torch.int32, device=device).contiguous()
    out = ContextNgramDrafts(
        tokens=torch.empty((len(rows), num_drafts, draft_len), dtype=torch.int32, device=device),
        lengths=torch.empty((len(rows), num_drafts), dtype=torch.int32, device=device),
        counts=torch.empty((len(rows), num_drafts), dtype=torch.int32, device=device),
        match_len=torch.empty(len(rows), dtype=torch.int32, device=device),
    )
    load_extension().context_ngram(
        tokens.to(torch.int32).contiguous(), lengths.to(torch.int32).contiguous(), rows,
        out.tokens, out.lengths, out.counts, out.match_len,
        q_min, q_max, max_matches, torch.cuda.current_stream(device).cuda_stream,
    )
    return out
