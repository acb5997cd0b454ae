"""Which draft nodes of one step to verify: the ones that maximise the whole batch's
expected tokens per second.

With ``B`` requests in the step and nodes sorted by their chance of being accepted per second
of verification (a node's chance is below its parent's and a row's nodes cost alike, so any
prefix of that order is a forest of whole paths), verifying the best ``b`` yields ``B + S_b``
tokens in ``t(B, B + b) + drafting`` seconds. The
chooser takes the ``b`` with the highest rate, and none unless it beats not speculating
(``B / t(B, B)``) by ``margin``. In tree mode, branching costs extra (tree attention and KV
compaction): the best selection restricted to each row's main path competes with the best
unrestricted one, which pays the learned cost of each branching row. A node of a request that
samples (temperature > 0) also pays the learned extra cost of a sampled draft token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_retrieval_spec.goodput.cost_model import StepCostModel


@dataclass(frozen=True)
class Choice:
    """The nodes kept (``[rows, N]``) and what the chooser expects of them."""

    keep: np.ndarray
    expected_tokens: float  # B + the kept nodes' chances
    expected_seconds: float
    threshold: float  # the chance below which a node did not pay this step


def choose_nodes(path_chance: np.ndarray, budgets: np.ndarray, num_reqs: int, cost: StepCostModel,
                 draft_seconds: float, margin: float, main_path: np.ndarray | None = None,
                 samples: np.ndarray | None = None) -> Choice:
    """``path_chance`` ``[rows, N]`` (0 for no node), at most ``budgets[i]`` nodes for row ``i``;
    ``samples[i]``: row ``i``'s request samples (its nodes cost more to verify).

    With ``main_path`` (tree mode: each row's chain through first children), the best
    selection of main-path nodes only competes with the best of all nodes, which pays the
    cost model's price of every row whose kept nodes branch off its main path.
    """
    samples = np.zeros(len(path_chance), bool) if samples is None else np.asarray(samples, bool)
    best = _best_prefix(path_chance, budgets, num_reqs, cost, draft_seconds, samples)
    if main_path is not None and best.keep.any():
        branching = int((best.keep & ~main_path).any(axis=1).sum())
        if branching:
            seconds = best.expected_seconds + branching * cost.per_branching_tree
            tree = Choice(best.keep, best.expected_tokens, seconds, 0.0)
            chain = _best_prefix(np.where(main_path, path_chance, 0.0), budgets, num_reqs, cost, draft_seconds,
                                 samples)
            best = tree if _rate(tree) > _rate(chain) else chain
    baseline = num_reqs / max(float(cost.predict(num_reqs, num_reqs)), 1e-9)
    if _rate(best) < (1.0 + margin) * baseline:
        best = Choice(np.zeros_like(best.keep), float(num_reqs), float(cost.predict(num_reqs, num_reqs)), 0.0)
    return Choice(best.keep, best.expected_tokens, best.expected_seconds, cost.per_token * _rate(best))


def main_paths(parents: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Per row, the chain from the root through each node's first child (``[rows, N]`` mask)."""
    rows, width = parents.shape
    row = np.arange(rows)
    on_path = np.zeros((rows, width), bool)
    claimed = np.zeros((rows, width + 1), bool)  # [row, parent + 1]: its first child was seen
    for column in range(width):
        parent = parents[:, column]
        valid = column < size
        parent_on_path = np.where(parent >= 0, on_path[row, np.maximum(parent, 0)], True)
        on_path[:, column] = valid & parent_on_path & ~claimed[row, parent + 1]
        claimed[row, parent + 1] |= valid
    return on_path


def _rate(choice: Choice) -> float:
    return choice.expected_tokens / max(choice.expected_seconds, 1e-9)


def _best_prefix(path_chance: np.ndarray, budgets: np.ndarray, num_reqs: int, cost: StepCostModel,
                 draft_seconds: float, samples: np.ndarray) -> Choice:
    """The ``b`` nodes (within row budgets) of the highest chance per verification cost, for the
    ``b`` of the highest rate."""
    rows, width = path_chance.shape
    order = np.argsort(-path_chance, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(width)[None, :], axis=1)
    eligible = (path_chance > 0) & (rank < np.asarray(budgets)[:, None])
    flat = np.flatnonzero(eligible)
    chances = path_chance.reshape(-1)[flat]
    node_cost = cost.per_token + cost.per_sampled_token * samples[flat // width]
    by_chance = np.argsort(-chances / np.maximum(node_cost, 1e-12), kind="stable")
    gained = np.concatenate(([0.0], np.cumsum(chances[by_chance])))
    sampled = np.concatenate(([0], np.cumsum(samples[flat[by_chance] // width])))
    counts = np.arange(len(gained))
    seconds = cost.predict(num_reqs, num_reqs + counts, sampled=sampled) + np.where(counts > 0, draft_seconds, 0.0)
    rate = (num_reqs + gained) / np.maximum(seconds, 1e-9)
    best = int(np.argmax(rate))
    keep = np.zeros(rows * width, bool)
    keep[flat[by_chance[:best]]] = True
    return Choice(keep.reshape(rows, width), float(num_reqs + gained[best]), float(seconds[best]), 0.0)
