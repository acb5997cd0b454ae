"""Plain NumPy references of the tree kernels (:mod:`vllm_retrieval_spec.kernels.tree`), which the
tests compare against exactly: the acceptance rules, the draw order, the counter-based uniforms,
the canonical sums and the lazy target rows of ``csrc/tree_accept.h`` and ``csrc/rng.h``,
mirrored (the target rows by sorting, where the kernels avoid it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_retrieval_spec.kernels.tree import (
    AcceptRule,
    RowSampling,
    SparseDraft,
    TreeAcceptance,
    TreeBatch,
    TreeMasks,
    mask_words,
)

TILE_WIDTH = 32  # canonical sums: tiles of 32 values ...
SEGMENTS = 32  # ... in 32 contiguous segments per row
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
# exp_neg of csrc/tree_accept.h: Cody-Waite reduction by ln 2, then 1/j! (j = 0..12) by Horner
_INV_LN2 = float.fromhex("0x1.71547652b82fep+0")
_LN2_HI = float.fromhex("0x1.62e42feep-1")
_LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
_EXP_COEFFICIENTS = [float.fromhex(h) for h in (
    "0x1p+0", "0x1p+0", "0x1p-1", "0x1.5555555555555p-3", "0x1.5555555555555p-5",
    "0x1.1111111111111p-7", "0x1.6c16c16c16c17p-10", "0x1.a01a01a01a01ap-13",
    "0x1.a01a01a01a01ap-16", "0x1.71de3a556c734p-19", "0x1.27e4fb7789f5cp-22",
    "0x1.ae64567f544e4p-26", "0x1.1eed8eff8d898p-29")]


def splitmix64(x: int) -> int:
    """SplitMix64's output function of ``csrc/rng.h`` (a bijection of 64-bit words)."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def counter_bits(seed: int, counter: int) -> int:
    """The 64-bit word behind ``uniform(seed, counter)``."""
    return splitmix64((seed ^ ((counter * _GOLDEN + 1) & _MASK64)) & _MASK64)


def uniform(seed: int, counter: int) -> float:
    """The counter-based uniform of ``csrc/rng.h``: a multiple of 2^-53 in [0, 1)."""
    return (counter_bits(seed, counter) >> 11) * 2.0**-53


def keyed_uniform(seed: int, position: int) -> float:
    """The uniform a seeded request samples its token at ``position`` with (``csrc/rng.h``)."""
    return uniform(splitmix64(seed & _MASK64), position)


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


def order_keys(logits: np.ndarray) -> np.ndarray:
    """uint32 keys ordered as the float32 values (NaN read as -inf, -0 as +0)."""
    values = canonical_logits(logits)
    bits = values.view(np.uint32)
    return np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000)).astype(np.uint32)


def canonical_logits(logits: np.ndarray) -> np.ndarray:
    values = np.asarray(logits, dtype=np.float32)
    return np.where(np.isnan(values) | (values == 0), np.where(np.isnan(values), -np.inf, 0.0),
                    values).astype(np.float32)


def exp_neg(y: np.ndarray) -> np.ndarray:
    """The kernels' exp for y <= 0 (float64; 0 below -700), bit for bit."""
    y = np.asarray(y, dtype=np.float64)
    inside = y >= -700.0
    y = np.where(inside, y, 0.0)
    n = np.rint(y * _INV_LN2)
    r = (y - n * _LN2_HI) - n * _LN2_LO
    p = np.full_like(r, _EXP_COEFFICIENTS[12])
    for c in _EXP_COEFFICIENTS[11::-1]:
        p = p * r + c
    return np.where(inside, np.ldexp(p, n.astype(np.int64)), 0.0)


def target_row_reference(logits: Any, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The lazy target row of ``csrc/tree_accept.h`` (float64, unnormalised), by sorting."""
    logits = np.asarray(logits, dtype=np.float32)
    vocab = len(logits)
    keys = order_keys(logits)
    x = canonical_logits(logits).astype(np.float64) / float(np.float32(temperature))
    kept = np.ones(vocab, dtype=bool)
    if 0 < int(top_k) < vocab:
        kept = keys >= np.sort(keys)[vocab - int(top_k)]
    peak = x.max()
    with np.errstate(invalid="ignore"):
        y = np.where(x == peak, 0.0, x - peak)
    e = np.where(~kept | (x == -np.inf), 0.0, np.where(x == peak, 1.0, exp_neg(np.nan_to_num(y, nan=0.0))))
    top_p = np.float32(top_p)
    total = canonical_total(e)
    if not top_p < 1 or not total > 0:
        return e
    threshold = (1.0 - float(top_p)) * total
    positions = keys.astype(np.uint64) * np.uint64(vocab) + np.arange(vocab, dtype=np.uint64)
    ascending = np.sort(positions)
    lo, hi = 0, vocab - 1  # the first rank whose prefix mass exceeds the threshold (else the last)
    while lo < hi:
        mid = (lo + hi) // 2
        if canonical_total(np.where(positions <= ascending[mid], e, 0.0)) > threshold:
            hi = mid
        else:
            lo = mid + 1
    return np.where(positions >= ascending[lo], e, 0.0)


def target_distributions_reference(logits: Any, sampling: RowSampling) -> np.ndarray:
    """:func:`target_row_reference` of every row, with the rows' parameters."""
    logits = np.asarray(logits, dtype=np.float32)
    rows = [target_row_reference(logits[r], float(np.float32(sampling.temperature[r])),
                                 int(sampling.top_k[r]), float(np.float32(sampling.top_p[r])))
            for r in range(len(logits))]
    return np.array(rows, dtype=np.float64).reshape(logits.shape)


def sparse_to_dense(draft: SparseDraft, vocab: int) -> np.ndarray:
    """The ``[rows, V]`` float32 draft rows a :class:`SparseDraft` stands for."""
    tokens = np.asarray(draft.tokens, dtype=np.int64)
    probs = np.asarray(draft.probs, dtype=np.float32)
    dense = np.zeros((len(tokens), vocab), dtype=np.float32)
    rows, cols = np.nonzero((tokens >= 0) & (tokens < vocab))
    dense[rows, tokens[rows, cols]] = probs[rows, cols]
    return dense


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
    batch: TreeBatch,
    *,
    draft_probs: Any = None,
    draft: SparseDraft | None = None,
    sampling: RowSampling | None = None,
    out_width: int | None = None,
) -> TreeAcceptance:
    """Plain NumPy (float64) :func:`accept_trees`: same rules, draws and sums.

    ``sampling``: ``scores`` are logits and the rows of rules 1-3 are their
    :func:`target_row_reference`; ``draft``: the MCSS rules' q rows are
    :func:`sparse_to_dense`. float64 ``scores`` are used as they are (the kernels round scores
    to float32): the exact rows the lazy path verifies against, for comparing with it."""
    scores = np.asarray(scores)
    if scores.dtype != np.float64:
        scores = scores.astype(np.float32)
    batch = batch.on_host()
    tokens, parents, offsets, rules, seeds = batch.arrays()
    if draft is not None:
        draft_probs = sparse_to_dense(draft, scores.shape[1])
    requests = len(offsets) - 1
    if out_width is None:
        largest = int(np.diff(offsets).max(initial=0))
        out_width = int(pack_tree_masks_reference(parents, offsets, largest).depth.max(initial=0)) + 1
    out = TreeAcceptance(
        out_tokens=np.full((requests, out_width), -1, dtype=np.int32),
        path_nodes=np.full((requests, out_width - 1), -1, dtype=np.int32),
        num_accepted=np.zeros(requests, dtype=np.int32),
    )
    for b in range(requests):
        begin, end = int(offsets[b]), int(offsets[b + 1])
        tree = _RefTree(parents[begin:end].tolist(), tokens[begin:end].tolist(),
                        int(begin) + b, out_width - 1)
        rows = scores
        if sampling is not None and rules[b] != AcceptRule.GREEDY:
            parameters = (float(np.float32(sampling.temperature[b])), int(sampling.top_k[b]),
                          float(np.float32(sampling.top_p[b])))
            rows = _LazyRows(scores, parameters)
        position = 0 if batch.positions is None else int(batch.positions[b])
        path, emitted = _walk_reference(tree, rows, draft_probs, int(rules[b]), int(seeds[b]), position)
        out.path_nodes[b, : len(path)] = path
        out.out_tokens[b, : len(path)] = [tree.tokens[j] for j in path]
        out.out_tokens[b, len(path)] = emitted
        out.num_accepted[b] = len(path)
    return out


class _LazyRows:
    """Score rows read as their target rows (``rows[r]`` as the walk reads them)."""

    def __init__(self, logits: np.ndarray, parameters: tuple[float, int, float]) -> None:
        self.logits, self.parameters = logits, parameters

    def __getitem__(self, row: int) -> np.ndarray:
        return target_row_reference(self.logits[row], *self.parameters)


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


def _walk_reference(tree: _RefTree, scores: Any, draft_probs: Any, rule: int,
                    seed: int, position: int) -> tuple[list[int], int]:
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
        if rule in (AcceptRule.GREEDY, AcceptRule.KEYED):
            emitted = (int(np.argmax(scores[row])) if rule == AcceptRule.GREEDY
                       else canonical_sample(p, keyed_uniform(seed, position + len(path))))
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
