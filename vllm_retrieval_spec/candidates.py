"""Sampled candidates: draft trees drawn from the drafter's own distribution ``q``.

With ``candidates: "sampled"`` a request that samples (temperature > 0) does not get the
drafter's best nodes but candidates *drawn* from the drafter's distribution over each node's
children, verified with multi-candidate speculative sampling (MCSS) using that same ``q``
(``csrc/tree_accept.h``, rules 2 and 3). ``q`` at a node is the drafter's weight of each child
(:attr:`~vllm_retrieval_spec.drafts.DraftNodes.prob`, e.g. REST's trie weight over its
parent's), raised to ``1 / draft_temperature`` and normalised over the node's children in the
candidate tree.

MCSS is lossless for any ``q`` as long as every candidate it verifies was drawn from the ``q``
it is verified with (without replacement: from ``q`` less its earlier siblings, in the order
they are verified) and no candidate is dropped because of its own value. So every decision is
taken before the draw it governs: a row's node budget comes from the deterministic candidate
tree (the goodput budget's choice), and each next draw goes where the earlier draws make it
most promising (best first: the path's ``q`` probability times the ``q`` mass the node's
drawn children leave), at most ``k`` candidates per node. Vectorised over rows: one NumPy pass
per drawn node, no per-row Python.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from vllm_retrieval_spec.drafts import DraftNodes


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

    @functools.cached_property
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
    """Draw up to ``budgets[i]`` nodes for row ``i`` from its candidate tree, one at a time,
    best first: each draw goes under the drawn node (or the root) whose next candidate is most
    likely to be accepted by ``q``'s own account, its path probability times the ``q`` mass its
    drawn children leave (at most ``per_node`` children each: a chain when 1), with or without
    replacement among its children. Nodes come in draw order (parents first, a node's
    candidates in the order MCSS verifies them)."""
    children = CandidateChildren.of(nodes, draft_temperature)
    rows, most = len(nodes.tokens), children.q.shape[2]
    budgets = np.minimum(np.asarray(budgets, np.int64), nodes.size)
    width = max(int(budgets.max(initial=0)), 1)
    growing = _Growing(rows, width, most)
    row = np.arange(rows)
    for used in range(width):
        score = growing.expansion_scores(children, per_node, replacement)
        slot = np.argmax(score, axis=1)
        active = np.flatnonzero((score[row, slot] > 0) & (used < budgets))
        if not len(active):
            break
        q = children.q[active, growing.candidate[active, slot[active]] + 1]
        if not replacement:
            q = np.where(growing.drawn[active, slot[active]], 0.0, q)
        rank = _draw(q, rng)
        growing.add(active, used, slot[active], rank, children, nodes.tokens)
    return growing.finish(nodes.tokens, children)


def _draw(q: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One rank per row of ``q`` (unnormalised), by the inverse of its cumulative sum."""
    cdf = np.cumsum(q, axis=1)
    u = rng.random(len(q)) * cdf[:, -1]
    return np.minimum((u[:, None] >= cdf).sum(axis=1), q.shape[1] - 1)


class _Growing:
    """The drawn trees, grown one node per row and step. Slot 0 of every per-node array is the
    root, slot ``j + 1`` drawn node ``j``."""

    def __init__(self, rows: int, width: int, most: int) -> None:
        self.tokens = np.full((rows, width), -1, np.int32)
        self.parents = np.full((rows, width), -1, np.int32)
        self.source = np.full((rows, width), -1, np.int32)
        self.size = np.zeros(rows, np.int32)
        self.candidate = np.full((rows, width + 1), -2, np.int64)  # candidate node per slot (-1: the root)
        self.candidate[:, 0] = -1
        self.path = np.zeros((rows, width + 1))  # q's probability of the path to the slot
        self.path[:, 0] = 1.0
        self.left = np.ones((rows, width + 1))  # q mass of the slot's children not drawn yet
        self.children = np.zeros((rows, width + 1), np.int64)
        self.drawn = np.zeros((rows, width + 1, most), bool)  # [row, slot, rank]: that child was drawn

    def expansion_scores(self, children: CandidateChildren, per_node: int, replacement: bool) -> np.ndarray:
        """How likely each slot's next candidate is to be accepted, by ``q``; 0 where no more
        candidate can be drawn there."""
        row = np.arange(len(self.candidate))[:, None]
        counts = children.counts[row, np.maximum(self.candidate + 1, 0)]
        room = (self.candidate >= -1) & (self.children < per_node) & (counts > 0)
        if not replacement:
            room &= self.children < counts
        return np.where(room, self.path * self.left, 0.0)

    def add(self, rows: np.ndarray, position: int, slot: np.ndarray, rank: np.ndarray,
            children: CandidateChildren, candidate_tokens: np.ndarray) -> None:
        parent_candidate = self.candidate[rows, slot] + 1
        candidate = children.index[rows, parent_candidate, rank].astype(np.int64)
        q = children.q[rows, parent_candidate, rank]
        self.tokens[rows, position] = candidate_tokens[rows, candidate]
        self.parents[rows, position] = slot - 1
        self.source[rows, position] = candidate
        self.size[rows] = position + 1
        self.candidate[rows, position + 1] = candidate
        self.path[rows, position + 1] = self.path[rows, slot] * q
        self.left[rows, slot] = np.maximum(self.left[rows, slot] - q, 0.0)
        self.children[rows, slot] += 1
        self.drawn[rows, slot, rank] = True

    def finish(self, candidate_tokens: np.ndarray, children: CandidateChildren) -> SampledTrees:
        rows = self.tokens.shape[0]
        slots = np.maximum(self.candidate + 1, 0)  # the root's slot for nodes not drawn (never read)
        index = children.index[np.arange(rows)[:, None], slots]
        q = np.where(index >= 0, children.q[np.arange(rows)[:, None], slots], 0.0)
        flat_rows = np.broadcast_to(np.arange(rows)[:, None, None], index.shape)
        tokens = np.where(index >= 0, candidate_tokens[flat_rows, np.maximum(index, 0)], -1)
        return SampledTrees(self.tokens, self.parents, self.size, self.source, tokens.astype(np.int32),
                            q.astype(np.float32))
