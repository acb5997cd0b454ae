"""Sampled candidates: draft trees drawn from the drafter's own distribution ``q``.

With ``candidates: "sampled"`` a request that samples (temperature > 0) does not get the
drafter's best nodes but candidates *drawn* from the drafter's distribution over each node's
children, verified with multi-candidate speculative sampling (MCSS) using that same ``q``
(``csrc/tree_accept.h``, rules 2 and 3). ``q`` at a node is the drafter's weight of each child
(:attr:`~vllm_retrieval_spec.drafts.DraftNodes.prob`, e.g. REST's trie weight over its
parent's), raised to ``1 / draft_temperature`` and normalised over the node's children in the
candidate tree.

MCSS is lossless for any ``q`` as long as every candidate it verifies was drawn from the ``q``
it is verified with and no candidate is dropped because of its own value. So the shape is
decided before the draws it governs: a row's node budget comes from the deterministic candidate
tree (the goodput budget's choice), each node gets ``min(k, its children)`` candidates (``k``
with replacement), nodes are drawn breadth-first and the budget cuts the breadth-first order,
which depends only on earlier draws. Everything is vectorised over rows (no per-row Python).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_retrieval_spec.drafts import DraftNodes

GUMBEL_FLOOR = 1e-30


@dataclass
class CandidateChildren:
    """The children of every node of a batch of candidate trees, ``[rows, N + 1, M]``: slot
    0 is the root, slot ``j + 1`` candidate node ``j``; ``index`` holds child node indices
    (-1 padded, in node order) and ``q`` their normalised draft probabilities."""

    index: np.ndarray
    q: np.ndarray

    @classmethod
    def of(cls, nodes: DraftNodes, draft_temperature: float = 1.0) -> CandidateChildren:
        rows, width = nodes.tokens.shape
        valid = np.arange(width)[None, :] < nodes.size[:, None]
        row, child = np.nonzero(valid)
        slot = np.asarray(nodes.parents)[row, child].astype(np.int64) + 1
        group = row * (width + 1) + slot  # nonzero() walks rows then nodes: siblings stay in node order
        order = np.argsort(group, kind="stable")
        group, row, child, slot = group[order], row[order], child[order], slot[order]
        starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]]) if len(group) else np.zeros(0, np.int64)
        rank = np.arange(len(group)) - np.repeat(starts, np.diff(np.r_[starts, len(group)]))
        most = int(rank.max(initial=-1)) + 1
        index = np.full((rows, width + 1, max(most, 1)), -1, np.int32)
        weight = np.zeros((rows, width + 1, max(most, 1)), np.float64)
        index[row, slot, rank] = child
        prob = np.maximum(np.asarray(nodes.prob, np.float64)[row, child], 0.0)
        weight[row, slot, rank] = prob ** (1.0 / draft_temperature)
        total = weight.sum(axis=2, keepdims=True)
        empty = (total == 0) & (index >= 0).any(axis=2, keepdims=True)
        weight = np.where(empty & (index >= 0), 1.0, weight)  # no weights known: uniform
        total = weight.sum(axis=2, keepdims=True)
        q = np.divide(weight, total, out=np.zeros_like(weight), where=total > 0)
        return cls(index, q)

    def counts(self) -> np.ndarray:
        """``[rows, N + 1]`` children per node."""
        return (self.index >= 0).sum(axis=2)


@dataclass(frozen=True)
class DraftQ:
    """One request's draft distributions: ``tokens`` / ``probs`` ``[n + 1, M]``, row 0 the
    distribution the root's candidates were drawn from, row ``j + 1`` node ``j``'s (-1 / 0
    padded)."""

    tokens: np.ndarray
    probs: np.ndarray

    def truncated(self, nodes: int) -> DraftQ:
        """The distributions of the root and the first ``nodes`` nodes."""
        return DraftQ(self.tokens[: nodes + 1], self.probs[: nodes + 1])


@dataclass
class SampledTrees:
    """Drawn trees ``[rows, W]`` (parents first, -1 padded, parent -1 = the root) and, per
    row, the distribution each node's candidates were drawn from: ``q_tokens`` / ``q_probs``
    ``[rows, W + 1, M]`` (slot 0: the root's children, slot ``j + 1``: node ``j``'s; -1 / 0
    padded; the whole support of ``q``, drawn or not). ``source`` ``[rows, W]``: the
    candidate node each drawn node is."""

    tokens: np.ndarray
    parents: np.ndarray
    size: np.ndarray
    source: np.ndarray
    q_tokens: np.ndarray
    q_probs: np.ndarray

    def row_q(self, index: int) -> DraftQ:
        """Row ``index``'s draft distributions, for its ``size`` nodes."""
        return DraftQ(self.q_tokens[index], self.q_probs[index]).truncated(int(self.size[index]))


def sample_candidate_trees(nodes: DraftNodes, budgets: np.ndarray, rng: np.random.Generator, *,
                           per_node: int = 1, replacement: bool = False,
                           draft_temperature: float = 1.0) -> SampledTrees:
    """Draw up to ``budgets[i]`` nodes for row ``i`` from its candidate tree: breadth first,
    ``per_node`` candidates under each drawn node (a chain when 1), with or without
    replacement among its children, each from the children's ``q``."""
    children = CandidateChildren.of(nodes, draft_temperature)
    rows = nodes.tokens.shape[0]
    budgets = np.minimum(np.asarray(budgets, np.int64), nodes.size)
    width = max(int(budgets.max(initial=0)), 1)
    out = _Growing(rows, width)
    # The frontier: (row, drawn node index or -1 for the root, candidate slot) per entry.
    f_row = np.arange(rows)
    f_node = np.full(rows, -1, np.int64)
    f_slot = np.zeros(rows, np.int64)
    used = np.zeros(rows, np.int64)
    counts = children.counts()
    while len(f_row):
        available = counts[f_row, f_slot]
        wanted = np.minimum(per_node, available) if not replacement else np.where(available > 0, per_node, 0)
        # Breadth-first order: each entry's candidates take the row's next free places.
        before = _exclusive_row_cumsum(f_row, wanted)
        take = np.clip(budgets[f_row] - used[f_row] - before, 0, wanted)
        drawn = _draw(children.q[f_row, f_slot], per_node, replacement, rng)  # [F, per_node] ranks
        entry, column = np.nonzero(np.arange(per_node)[None, :] < take[:, None])
        if not len(entry):
            break
        row = f_row[entry]
        candidate = children.index[row, f_slot[entry], drawn[entry, column]].astype(np.int64)
        position = used[row] + before[entry] + column
        out.add(row, position, nodes.tokens[row, candidate], f_node[entry], candidate)
        np.add.at(used, f_row, take)
        f_row, f_node, f_slot = row, position, candidate + 1
        keep_growing = used[f_row] < budgets[f_row]
        f_row, f_node, f_slot = f_row[keep_growing], f_node[keep_growing], f_slot[keep_growing]
    return out.finish(used, nodes.tokens, children)


def _draw(q: np.ndarray, per_node: int, replacement: bool, rng: np.random.Generator) -> np.ndarray:
    """``[F, per_node]`` child ranks: i.i.d. from each row of ``q`` (with replacement), else the
    sequential draw without replacement (Gumbel top-k: the order of the draws; ranks past a
    row's children are meaningless and never taken)."""
    if replacement:
        cdf = np.cumsum(q, axis=1)
        u = rng.random((len(q), per_node)) * cdf[:, -1:]
        ranks = (u[:, :, None] >= cdf[:, None, :]).sum(axis=2)
        return np.minimum(ranks, q.shape[1] - 1)
    keys = np.log(np.maximum(q, GUMBEL_FLOOR)) - np.log(-np.log(rng.random(q.shape)))
    keys = np.where(q > 0, keys, -np.inf)
    ranks = np.argsort(-keys, axis=1, kind="stable")[:, :per_node]
    return np.pad(ranks, ((0, 0), (0, per_node - ranks.shape[1])))


def _exclusive_row_cumsum(row: np.ndarray, values: np.ndarray) -> np.ndarray:
    """For entries grouped by ``row`` (rows ascending, as the frontier keeps them), the sum of
    ``values`` over the earlier entries of the same row."""
    total = np.cumsum(values) - values
    starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]]) if len(row) else np.zeros(0, np.int64)
    first = np.repeat(total[starts], np.diff(np.r_[starts, len(row)]))
    return total - first


class _Growing:
    """The drawn trees being filled breadth first."""

    def __init__(self, rows: int, width: int) -> None:
        self.tokens = np.full((rows, width), -1, np.int32)
        self.parents = np.full((rows, width), -1, np.int32)
        self.source = np.full((rows, width), -1, np.int32)

    def add(self, row: np.ndarray, position: np.ndarray, tokens: np.ndarray, parents: np.ndarray,
            source: np.ndarray) -> None:
        self.tokens[row, position] = tokens
        self.parents[row, position] = parents
        self.source[row, position] = source

    def finish(self, size: np.ndarray, candidate_tokens: np.ndarray, children: CandidateChildren) -> SampledTrees:
        rows = self.tokens.shape[0]
        slots = np.concatenate([np.zeros((rows, 1), np.int64), self.source.astype(np.int64) + 1], axis=1)
        slots = np.where(np.concatenate([np.ones((rows, 1), bool), self.source >= 0], axis=1), slots, -1)
        row = np.arange(rows)[:, None]
        index = np.where(slots[:, :, None] >= 0, children.index[row, np.maximum(slots, 0)], -1)
        q = np.where(index >= 0, children.q[row, np.maximum(slots, 0)], 0.0)
        flat_rows = np.broadcast_to(np.arange(rows)[:, None, None], index.shape)
        tokens = np.where(index >= 0, candidate_tokens[flat_rows, np.maximum(index, 0)], -1)
        return SampledTrees(self.tokens, self.parents, size.astype(np.int32), self.source,
                            tokens.astype(np.int32), q.astype(np.float32))
