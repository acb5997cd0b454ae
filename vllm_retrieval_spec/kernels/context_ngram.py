"""Context n-gram drafts (algorithms.md §3): the C++/CUDA kernel and its Python reference.

Semantics shared by both: for each requested row, the longest ``q`` in ``[q_min, q_max]``
whose last-``q``-token query occurs earlier in the row's context; over the most recent
``max_matches`` earlier occurrences, the distinct continuations of up to ``w`` tokens
(truncated at the end of the context) ranked by count, ties to the most recent occurrence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_retrieval_spec.kernels.extension import load_extension


@dataclass
class ContextNgramDrafts:
    """Up to ``k`` drafts per requested row.

    ``tokens`` is ``[rows, k, w]`` padded with -1, ``lengths`` and ``counts`` are
    ``[rows, k]`` (0 for empty slots) and ``match_len`` is the ``q`` that matched per row
    (0: no match). Arrays are NumPy on the CPU, torch tensors for CUDA inputs.
    """

    tokens: Any
    lengths: Any
    counts: Any
    match_len: Any

    def draft(self, index: int, slot: int = 0) -> list[int]:
        """Draft ``slot`` of requested row ``index`` as a list of token ids."""
        length = int(self.lengths[index, slot])
        return [int(t) for t in self.tokens[index, slot, :length]]


def context_ngram(
    tokens: Any,
    lengths: Any,
    rows: Any,
    *,
    k: int,
    w: int,
    q_min: int,
    q_max: int,
    max_matches: int = 64,
    num_threads: int = 0,
) -> ContextNgramDrafts:
    """Draft from each row's own context with the C++ kernel (CUDA for CUDA tensors).

    ``tokens`` is ``[num_rows, max_len]`` int32 (e.g. vLLM's ``token_ids_cpu``, used
    without a copy), ``lengths`` ``[num_rows]`` int32, ``rows`` the row indices to draft for.
    """
    ext = load_extension()
    if _is_cuda_tensor(tokens):
        return _context_ngram_cuda(ext, tokens, lengths, rows, k, w, q_min, q_max, max_matches)
    tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    lengths = np.ascontiguousarray(lengths, dtype=np.int32)
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    out = ContextNgramDrafts(
        tokens=np.empty((len(rows), k, w), dtype=np.int32),
        lengths=np.empty((len(rows), k), dtype=np.int32),
        counts=np.empty((len(rows), k), dtype=np.int32),
        match_len=np.empty(len(rows), dtype=np.int32),
    )
    ext.context_ngram(
        tokens, lengths, rows, out.tokens, out.lengths, out.counts, out.match_len,
        q_min, q_max, max_matches, num_threads,
    )
    return out


def _is_cuda_tensor(array: Any) -> bool:
    return bool(getattr(array, "is_cuda", False))


def _context_ngram_cuda(ext, tokens, lengths, rows, k, w, q_min, q_max, max_matches):
    import torch

    if "cuda" not in ext.backends():
        raise RuntimeError(
            "got CUDA tensors, but vllm_retrieval_spec._C was built without CUDA (nvcc was not "
            "found at build time); reinstall with nvcc on PATH or pass CPU arrays"
        )
    device = tokens.device
    rows = torch.as_tensor(rows, dtype=torch.int32, device=device).contiguous()
    out = ContextNgramDrafts(
        tokens=torch.empty((len(rows), k, w), dtype=torch.int32, device=device),
        lengths=torch.empty((len(rows), k), dtype=torch.int32, device=device),
        counts=torch.empty((len(rows), k), dtype=torch.int32, device=device),
        match_len=torch.empty(len(rows), dtype=torch.int32, device=device),
    )
    ext.context_ngram(
        tokens.to(torch.int32).contiguous(), lengths.to(torch.int32).contiguous(), rows,
        out.tokens, out.lengths, out.counts, out.match_len,
        q_min, q_max, max_matches, torch.cuda.current_stream(device).cuda_stream,
    )
    return out


def context_ngram_reference(
    contexts: Sequence[Sequence[int]], *, k: int, w: int, q_min: int, q_max: int,
    max_matches: int = 64,
) -> list[tuple[int, list[tuple[list[int], int]]]]:
    """Plain-Python reference: per context, ``(match_len, [(draft, count), ...])``."""
    results = []
    for context in contexts:
        ctx = [int(t) for t in context]
        n = len(ctx)
        for q in range(min(q_max, n - 1), max(q_min, 1) - 1, -1):
            query = ctx[n - q:]
            positions = [p for p in range(n - q - 1, -1, -1) if ctx[p:p + q] == query]
            positions = positions[:max_matches]
            if positions:
                results.append((q, _rank_continuations(ctx, positions, q, w, k)))
                break
        else:
            results.append((0, []))
    return results


def _rank_continuations(ctx, positions, q, w, k):
    counts: dict[tuple[int, ...], int] = {}
    newest: dict[tuple[int, ...], int] = {}
    for p in positions:  # newest first
        continuation = tuple(ctx[p + q:p + q + w])
        counts[continuation] = counts.get(continuation, 0) + 1
        newest.setdefault(continuation, p)
    ranked = sorted(counts, key=lambda c: (-counts[c], -newest[c]))
    return [(list(c), counts[c]) for c in ranked[:k]]
