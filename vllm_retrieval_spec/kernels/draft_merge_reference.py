"""Plain-Python reference of the draft merge (:mod:`vllm_retrieval_spec.kernels.draft_merge`),
which the tests compare against exactly."""

from __future__ import annotations

from typing import Any

import numpy as np


def merge_drafts_reference(tokens: Any, lengths: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`~vllm_retrieval_spec.kernels.draft_merge.merge_drafts`, one row at a time."""
    tokens = np.asarray(tokens, dtype=np.int32)
    rows, k, w = tokens.shape
    tree_tokens = np.full((rows, k * w), -1, dtype=np.int32)
    tree_parents = np.full((rows, k * w), -1, dtype=np.int32)
    tree_size = np.zeros(rows, dtype=np.int32)
    for row in range(rows):
        drafts = [tokens[row, slot, : int(lengths[row][slot])].tolist() for slot in range(k)]
        nodes, parents = merge_row(drafts)
        tree_tokens[row, : len(nodes)] = nodes
        tree_parents[row, : len(parents)] = parents
        tree_size[row] = len(nodes)
    return tree_tokens, tree_parents, tree_size


def merge_row(drafts: list[list[int]]) -> tuple[list[int], list[int]]:
    """One row's drafts as ``(tokens, parents)``, nodes in the order first met."""
    children: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    for draft in drafts:
        parent = -1
        for token in draft:
            key = (parent, token)
            if key not in children:
                children[key] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = children[key]
    return tokens, parents
