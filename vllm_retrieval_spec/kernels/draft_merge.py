"""Merging each row's k drafts into one tree (N-Grammys' tree mode): the front end of the C++
kernel ``csrc/draft_merge.h``.

Per row, drafts are walked in slot order from the root; a (parent, token) step taken before
reuses its node, any other appends a new one. Nodes are numbered in the order first met: parents
come first, and a node budget that cuts the list keeps the first drafts whole. The plain-Python
reference is :mod:`vllm_retrieval_spec.kernels.draft_merge_reference`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_retrieval_spec.kernels.extension import load_extension


def merge_drafts(tokens: Any, lengths: Any, weights: Any = None, *,
                 num_threads: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``tokens`` ``[rows, k, w]`` and ``lengths`` ``[rows, k]`` (each in ``[0, w]``) as trees:
    ``tree_tokens`` and ``tree_parents`` ``[rows, k * w]`` (-1 padded; parent -1 = the root),
    ``tree_size`` ``[rows]`` and ``tree_weight`` ``[rows, k * w]`` float32, the sum of the
    ``weights`` ``[rows, k]`` (default 1 each) of the drafts through each node; all rows in one
    call (CPU threads above a work threshold)."""
    return load_extension().merge_drafts(
        np.ascontiguousarray(tokens, dtype=np.int32),
        np.ascontiguousarray(lengths, dtype=np.int32),
        None if weights is None else np.ascontiguousarray(weights, dtype=np.float32),
        num_threads=num_threads,
    )


def conditional_probs(parents: np.ndarray, node_weights: np.ndarray, lengths: np.ndarray,
                      weights: np.ndarray | None = None) -> np.ndarray:
    """Each merged node's weight over its parent's, the root weighing all non-empty drafts
    together: the drafter's q of a child given its parent, ``[rows, N]`` float32 (0 past the
    tree). ``lengths`` and ``weights`` are the drafts' as given to :func:`merge_drafts`."""
    drafts = np.ones(lengths.shape, np.float32) if weights is None else np.asarray(weights, np.float32)
    root = np.where(lengths > 0, drafts, 0.0).sum(axis=1, keepdims=True)
    parent = np.where(parents >= 0, np.take_along_axis(node_weights, np.maximum(parents, 0), axis=1), root)
    return np.divide(node_weights, parent, out=np.zeros(node_weights.shape, np.float32), where=parent > 0)


def merged_trees(tokens: Any, lengths: Any, weights: Any = None, *,
                 num_threads: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`merge_drafts` with each node's conditional probability (:func:`conditional_probs`)
    in place of its weight: ``tree_tokens``, ``tree_parents``, ``tree_size``, ``tree_prob``."""
    tree_tokens, tree_parents, tree_size, node_weights = merge_drafts(tokens, lengths, weights,
                                                                      num_threads=num_threads)
    return tree_tokens, tree_parents, tree_size, conditional_probs(tree_parents, node_weights,
                                                                   np.asarray(lengths), weights)
