"""Plain NumPy references of the tree kernels (:mod:`vllm_retrieval_spec.kernels.tree`), which the
tests compare against exactly: the acceptance rules, the draw order, the counter-based uniforms
and the canonical sums of ``csrc/tree_accept.h`` and ``csrc/rng.h``, mirrored."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_retrieval_spec.kernels.tree import AcceptRule, TreeAcceptance, TreeMasks, mask_words

TILE_WIDTH = 32  # canonical sums: tiles of 32 values ...
SEGMENTS = 32  # ... in 32 contiguous segments per row
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def uniform(seed: int, counter: int) -> float:
    """The counter-based uniform of ``csrc/rng.h``: a multiple of 2^-53 in [0, 1)."""
    x = (seed ^ ((counter * _GOLDEN + 1) & _MASK64)) & _MASK64
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((x ^ (x >> 31)) >> 11) * 2.0**-53


def _tiles(values: np.ndarray) -> np.ndarray:
    """``values`` zero-padded to ``[SEGMENTS, tiles, TILE_WIDTH]``."""
    length = TILE_WIDTH * -(-len(values) // (TILE_WIDTH * SEGMENTS))
    padded = np.zeros(SEGMENTS * length)
    padded[: len(values)] = values
    return padded.reshape(SEGMENTS, length // TILE_WIDTH, TILE_WIDTH)


def _hillis_steele(x: np.ndarray) -> np.ndarray:
    """Inclusive scan over the last axis (32 wide) in Hillis-Steele order."""
    for d in (1, 2, 4, 8, 16):
        y = x.copy()
        y[..., d:] = x[..., d:] + x[..., :-d]
        x = y
    return x


def _segment_runs(tile_sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per segment: running sum before each tile (left to right from 0) and the segment sum."""
    before = np.empty_like(tile_sums)
    run = np.zeros(SEGMENTS)
    for k in range(tile_sums.shape[1]):
        before[:, k] = run
        run = run + tile_sums[:, k]
    return before, run


def _segment_starts(segment_sums: np.ndarray) -> tuple[np.ndarray, float]:
    scan = _hillis_steele(segment_sums)
    starts = np.concatenate([[0.0], scan[:-1]])
    return starts, starts[-1] + segment_sums[-1]


def canonical_total(values: np.ndarray) -> float:
    """The kernels' sum of a row (float64): pairwise tiles, sequential segments, scanned."""
    x = _tiles(values)
    for _ in range(5):  # pairwise tree over the 32 values of each tile
        x = x[..., 0::2] + x[..., 1::2]
    _, segment_sums = _segment_runs(x[..., 0])
    return _segment_starts(segment_sums)[1]


def canonical_sample(values: np.ndarray, u: float) -> int:
    """Smallest ``i`` with ``cdf[i] > u * total`` (canonical cdf), else the last positive
    value's index, else -1."""
    x = _hillis_steele(_tiles(values))
    before, segment_sums = _segment_runs(x[..., -1])
    starts, total = _segment_starts(segment_sums)
    cdf = (starts[:, None, None] + (before[:, :, None] + x)).reshape(-1)[: len(values)]
    hits = np.flatnonzero(cdf > u * total)
    if hits.size:
        return int(hits[0])
    positive = np.flatnonzero(values > 0)
    return int(positive[-1]) if positive.size else -1


def pack_tree_masks_reference(parents: Any, offsets: Any, max_nodes: int) -> TreeMasks:
    """Plain NumPy :func:`pack_tree_masks`."""
    parents = np.asarray(parents, dtype=np.int32)
    offsets = np.asarray(offsets, dtype=np.int32)
    depth = np.zeros(len(parents), dtype=np.int32)
    mask = np.zeros((len(parents), mask_words(max_nodes)), dtype=np.uint64)
    for b in range(len(offsets) - 1):
        begin = int(offsets[b])
        for i in range(begin, int(offsets[b + 1])):
            local, parent = i - begin, int(parents[i])
            if parent >= 0:
                depth[i] = depth[begin + parent] + 1
                mask[i] = mask[begin + parent]
            else:
                depth[i] = 1
            mask[i, local // 64] |= np.uint64(1 << (local % 64))
    return TreeMasks(depth, mask)


def accept_trees_reference(
    scores: Any,
    tokens: Any,
    parents: Any,
    offsets: Any,
    rules: Any,
    seeds: Any,
    draft_probs: Any = None,
    *,
    out_width: int | None = None,
) -> TreeAcceptance:
    """Plain NumPy (float64) :func:`accept_trees`: same rules, draws and sums."""
    scores = np.asarray(scores, dtype=np.float32)
    tokens, parents, offsets, rules = (np.asarray(a, dtype=np.int32)
                                       for a in (tokens, parents, offsets, rules))
    batch = len(offsets) - 1
    if out_width is None:
        largest = int(np.diff(offsets).max(initial=0))
        out_width = int(pack_tree_masks_reference(parents, offsets, largest).depth.max(initial=0)) + 1
    out = TreeAcceptance(
        out_tokens=np.full((batch, out_width), -1, dtype=np.int32),
        path_nodes=np.full((batch, out_width - 1), -1, dtype=np.int32),
        num_accepted=np.zeros(batch, dtype=np.int32),
    )
    for b in range(batch):
        begin, end = int(offsets[b]), int(offsets[b + 1])
        tree = _RefTree(parents[begin:end].tolist(), tokens[begin:end].tolist(),
                        int(begin) + b, out_width - 1)
        path, emitted = _walk_reference(tree, scores, draft_probs, int(rules[b]), int(seeds[b]))
        out.path_nodes[b, : len(path)] = path
        out.out_tokens[b, : len(path)] = [tree.tokens[j] for j in path]
        out.out_tokens[b, len(path)] = emitted
        out.num_accepted[b] = len(path)
    return out


@dataclass
class _RefTree:
    parents: list[int]
    tokens: list[int]
    first_row: int
    max_depth: int

    def children(self, node: int, depth: int) -> list[int]:
        if depth >= self.max_depth:
            return []
        return [j for j in range(node + 1, len(self.parents)) if self.parents[j] == node]


def _walk_reference(tree: _RefTree, scores: np.ndarray, draft_probs: Any, rule: int,
                    seed: int) -> tuple[list[int], int]:
    counter = iter(range(1 << 62))

    def draw() -> float:
        return uniform(seed, next(counter))

    path: list[int] = []
    node = -1
    while True:
        row = tree.first_row + node + 1
        p = scores[row].astype(np.float64)
        children = tree.children(node, len(path))
        candidates = [tree.tokens[c] for c in children]
        if rule == AcceptRule.GREEDY:
            emitted = int(np.argmax(scores[row]))
            chosen = candidates.index(emitted) if emitted in candidates else None
        elif not children:
            chosen, emitted = None, canonical_sample(p, draw())
        elif rule == AcceptRule.CANDIDATES:
            chosen, emitted = _candidates_reference(p, candidates, draw)
        else:
            q = np.asarray(draft_probs[row], dtype=np.float32).astype(np.float64)
            chosen, emitted = _mcss_reference(p, q, candidates,
                                              rule == AcceptRule.MCSS_NO_REPLACEMENT, draw)
        if chosen is None:
            return path, emitted
        node = children[chosen]
        path.append(node)


def _accept(u: float, num: float, den: float) -> bool:
    return num > 0 and (num >= den or u < num / den)


def _candidates_reference(p: np.ndarray, candidates: Sequence[int],
                          draw: Callable[[], float]) -> tuple[int | None, int]:
    rest = canonical_total(p)
    zeroed: list[int] = []
    for i, x in enumerate(candidates):
        mass = 0.0 if x in zeroed else p[x]
        if _accept(draw(), mass, rest):
            return i, -1
        rest = rest - mass
        zeroed.append(x)
    residual = p.copy()
    residual[zeroed] = 0.0
    u = draw()
    return None, canonical_sample(residual if canonical_total(residual) > 0 else p, u)


def _normalized(values: np.ndarray, total: float) -> np.ndarray:
    return values / total if total > 0 else np.zeros_like(values)


def _mcss_reference(p: np.ndarray, q: np.ndarray, candidates: Sequence[int],
                    without_replacement: bool, draw: Callable[[], float]) -> tuple[int | None, int]:
    p_total, q_total = canonical_total(p), canonical_total(q)
    for i, x in enumerate(candidates):
        pn = p[x] / p_total if p_total > 0 else 0.0
        qn = q[x] / q_total if q_total > 0 else 0.0
        if _accept(draw(), pn, qn):
            return i, -1
        diff = _normalized(p, p_total) - _normalized(q, q_total)
        residual = np.where(diff > 0, diff, 0.0)
        residual_total = canonical_total(residual)
        if residual_total > 0:
            p, p_total = residual, residual_total
        if without_replacement:
            q = q.copy()
            q[x] = 0.0
            q_total = canonical_total(q)
    return None, canonical_sample(p, draw())
