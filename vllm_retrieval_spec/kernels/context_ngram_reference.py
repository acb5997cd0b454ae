"""Plain-Python reference of the context n-gram kernel
(:mod:`vllm_retrieval_spec.kernels.context_ngram`), which the tests compare against exactly."""

from __future__ import annotations

from collections.abc import Sequence


def context_ngram_reference(
    contexts: Sequence[Sequence[int]], *, num_drafts: int, draft_len: int, q_min: int, q_max: int,
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
                results.append((q, _rank_continuations(ctx, positions, q, draft_len, num_drafts)))
                break
        else:
            results.append((0, []))
    return results


def _rank_continuations(ctx, positions, q, draft_len, num_drafts):
    counts: dict[tuple[int, ...], int] = {}
    newest: dict[tuple[int, ...], int] = {}
    for p in positions:  # newest first
        continuation = tuple(ctx[p + q:p + q + draft_len])
        counts[continuation] = counts.get(continuation, 0) + 1
        newest.setdefault(continuation, p)
    ranked = sorted(counts, key=lambda c: (-counts[c], -newest[c]))
    return [(list(c), counts[c]) for c in ranked[:num_drafts]]
