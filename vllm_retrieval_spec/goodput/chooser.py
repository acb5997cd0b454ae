"""Which draft nodes of one step to verify: the ones that maximise the whole batch's
expected tokens per second.

With ``B`` requests in the step and nodes sorted by their chance of being accepted per second
of verification (a node's chance is below its parent's and costs never fall along a path, so any
prefix of that order is a forest of whole paths), verifying the best ``b`` yields ``B + S_b``
tokens in ``t(B, B + b) + drafting`` seconds. The chooser takes the ``b`` with the highest rate
with what drafting adds to the step (``t(B, B + b) − t(B, B)`` and the drafting time) counted
``1 + margin`` times, and none unless that rate beats not speculating (``B / t(B, B)``): every
kept node must pay for its cost with ``margin`` to spare. (A margin on the whole batch's rate
instead would skip every step of 8 or 32 requests whose few good nodes add less than the margin
to the batch, and learn nothing from them.) In tree mode a node
off its row's main path (the chain through first children, which trees lay out first) also pays
tree attention over its request's context, and a step with any such node pays the learned cost
of a tree step once: the best selection of main-path nodes only competes with the best of all
nodes. A node of a request that samples (temperature > 0) also pays the learned extra cost of a
sampled draft token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from vllm_retrieval_spec.goodput.cost_model import StepCostModel, tree_work
from vllm_retrieval_spec.goodput.paths import fold_paths


@dataclass(frozen=True)
class Choice:
    """The nodes kept (``[rows, N]``) and what the chooser expects of them."""

    keep: np.ndarray
    expected_tokens: float  # B + the kept nodes' chances
    expected_seconds: float
    threshold: float  # the chance below which a node did not pay this step
    margin_seconds: float = 0.0  # the margin the kept nodes had to pay on top of expected_seconds


@dataclass(frozen=True)
class NodeCandidates:
    """One step's candidate nodes, as the chooser weighs them."""

    path_chance: np.ndarray  # [rows, N]: each node's chance of being accepted (0: no node)
    budgets: np.ndarray  # [rows]: at most this many nodes per row
    num_reqs: int  # requests in the step (rows without candidates included)
    main_path: np.ndarray | None = None  # [rows, N] (tree mode): each row's chain through first children
    samples: np.ndarray | None = None  # [rows] bool: the row's request samples
    context_tokens: np.ndarray | None = None  # [rows]: the tokens tree attention reads per off-path node

    def restricted_to_main_paths(self) -> NodeCandidates:
        return replace(self, path_chance=np.where(self.main_path, self.path_chance, 0.0))

    def tree_work(self) -> np.ndarray:
        """``[rows, N]``: thousands of node-context pairs tree attention recomputes per node."""
        if self.main_path is None or self.context_tokens is None:
            return np.zeros(self.path_chance.shape)
        return tree_work(~self.main_path, np.asarray(self.context_tokens)[:, None])

    def sampled(self) -> np.ndarray:
        return np.zeros(len(self.path_chance), bool) if self.samples is None else np.asarray(self.samples, bool)


def choose_nodes(candidates: NodeCandidates, cost: StepCostModel, draft_seconds: float, margin: float) -> Choice:
    """The nodes (at most ``budgets[i]`` for row ``i``) of the best expected rate with their
    cost counted ``1 + margin`` times, or none when that rate does not beat not speculating."""
    num_reqs = candidates.num_reqs
    idle = cost.idle_seconds(num_reqs)
    best = _best_prefix(candidates, cost, idle, draft_seconds, margin)
    if candidates.main_path is not None and (candidates.path_chance[~candidates.main_path] > 0).any():
        # Also when the best prefix kept no branch: it stops where the first branch in its order
        # does not pay, before main-path nodes ranked after that branch.
        chain = _best_prefix(candidates.restricted_to_main_paths(), cost, idle, draft_seconds, margin)
        best = best if _rate(best) > _rate(chain) else chain
    if _rate(best) <= num_reqs / max(idle, 1e-9):
        return Choice(np.zeros_like(best.keep), float(num_reqs), idle, 0.0)
    return Choice(best.keep, best.expected_tokens, best.expected_seconds,
                  (1.0 + margin) * cost.per_token * _rate(best))


def main_paths(parents: np.ndarray, first_child: np.ndarray) -> np.ndarray:
    """Per row, the chain from the root through each node's first child (``[rows, N]`` mask;
    ``first_child``: :func:`~vllm_retrieval_spec.goodput.paths.first_children`)."""
    return fold_paths(first_child, parents, np.logical_and)


def _rate(choice: Choice) -> float:
    """Expected tokens per second, with the margin on what drafting adds."""
    return choice.expected_tokens / max(choice.expected_seconds + choice.margin_seconds, 1e-9)


def _best_prefix(candidates: NodeCandidates, cost: StepCostModel, idle: float, draft_seconds: float,
                 margin: float) -> Choice:
    """The ``b`` nodes (within row budgets) of the highest chance per verification cost, for the
    ``b`` of the highest rate (what they add to a step of ``idle`` seconds counted ``1 + margin``
    times)."""
    path_chance, num_reqs = candidates.path_chance, candidates.num_reqs
    rows, width = path_chance.shape
    flat = np.flatnonzero(_within_budgets(path_chance, np.asarray(candidates.budgets)))
    chances = path_chance.reshape(-1)[flat]
    sampled = candidates.sampled()[flat // width]
    work = candidates.tree_work().reshape(-1)[flat]
    node_cost = cost.per_token + cost.per_sampled_token * sampled + cost.per_tree_kilopair * work
    by_chance = np.argsort(-chances / np.maximum(node_cost, 1e-12), kind="stable")
    gained, sampled, work = (np.concatenate(([0.0], np.cumsum(values[by_chance])))
                             for values in (chances, sampled, work))
    counts = np.arange(len(gained))
    added = cost.predict(num_reqs, num_reqs + counts, tree_work=work, sampled=sampled) - idle
    added = added + np.where(counts > 0, draft_seconds, 0.0)
    best = int(np.argmax((num_reqs + gained) / np.maximum(idle + (1.0 + margin) * added, 1e-9)))
    keep = np.zeros(rows * width, bool)
    keep[flat[by_chance[:best]]] = True
    return Choice(keep.reshape(rows, width), float(num_reqs + gained[best]), idle + float(added[best]), 0.0,
                  margin_seconds=margin * float(added[best]))


def _within_budgets(path_chance: np.ndarray, budgets: np.ndarray) -> np.ndarray:
    """``[rows, N]``: the nodes with a chance among the ``budgets[i]`` best of row ``i`` (every
    node with a chance when the budgets cover the rows' widths, as they mostly do)."""
    has_chance = path_chance > 0
    width = path_chance.shape[1]
    if (budgets >= width).all():
        return has_chance
    order = np.argsort(-path_chance, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(width)[None, :], axis=1)
    return has_chance & (rank < budgets[:, None])
