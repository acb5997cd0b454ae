"""Plain-Python reference of the draft merge (:mod:`vllm_retrieval_spec.kernels.draft_merge`),
which the tests compare against exactly."""

from __future__ import annotations

from typing import Any

import numpy as np


def merge_drafts_reference(tokens: Any, lengths: Any,
                           weights: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`~vllm_retrieval_spec.kernels.draft_merge.merge_drafts`, one row at a time."""
    tokens = np.asarray(tokens, dtype=np.int32)
    rows, k, w = tokens.shape
    weights = np.ones((rows, k), np.float32) if weights is None else np.asarray(weights, np.float32)
    tree_tokens = np.full((rows, k * w), -1, dtype=np.int32)
    tree_parents = np.full((rows, k * w), -1, dtype=np.int32)
    tree_size = np.zeros(rows, dtype=np.int32)
    tree_weight = np.zeros((rows, k * w), dtype=np.float32)
    for row in range(rows):
        drafts = [tokens[row, slot, : int(lengths[row][slot])].tolist() for slot in range(k)]
        nodes, parents, node_weights = merge_row(drafts, weights[row].tolist())
        tree_tokens[row, : len(nodes)] = nodes
        tree_parents[row, : len(parents)] = parents
        tree_weight[row, : len(nodes)] = node_weights
        tree_size[row] = len(nodes)
    return tree_tokens, tree_parents, tree_size, tree_weight


def merge_row(drafts: list[list[int]], weights: list[float]) -> tuple[list[int], list[int], list[float]]:
    """One row's drafts as ``(tokens, parents, weights)``, nodes in the order first met; a node
    weighs what the drafts through it weigh (added in float32, in draft order)."""
    children: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    node_weights: list[np.float32] = []
    for draft, weight in zip(drafts, weights):
        parent = -1
        for token in draft:
            key = (parent, token)
            if key not in children:
                children[key] = len(tokens)
                tokens.append(token)
                parents.append(parent)
                node_weights.append(np.float32(0.0))
            parent = children[key]
            node_weights[parent] = np.float32(node_weights[parent] + np.float32(weight))
    return tokens, parents, [float(w) for w in node_weights]
