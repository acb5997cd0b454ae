"""Whole-array walks up ``[rows, N]`` parents-first trees (parent -1 = the root): each node's
value folded with its ancestors' by pointer doubling, ``log2(depth)`` rounds of array operations
and no loop over the N columns, so that the per-step cost stays flat as drafts grow deeper
(chains, the common case, in one scan along the columns)."""

from __future__ import annotations

import numpy as np


def fold_paths(values: np.ndarray, parents: np.ndarray, combine: np.ufunc) -> np.ndarray:
    """Per node, ``combine`` (an associative ufunc) of its value and every ancestor's."""
    up = np.asarray(parents)
    chained = _chain_lengths(up)
    if chained is not None:  # chains (each node's parent the one before it, then padding): one scan
        column = np.arange(up.shape[1])[None, :]
        return np.where(column < chained[:, None], combine.accumulate(values, axis=1), values)
    folded = np.array(values, copy=True)
    rows = np.arange(up.shape[0])[:, None]
    while True:
        linked = up >= 0
        if not linked.any():
            return folded
        above = np.maximum(up, 0)
        folded = np.where(linked, combine(folded, folded[rows, above]), folded)
        up = np.where(linked, up[rows, above], -1)


def _chain_lengths(parents: np.ndarray) -> np.ndarray | None:
    """Per row, how many leading nodes form a chain from the root, when every row is such a
    chain followed only by roots (-1, the padding of a row's unused columns); else None."""
    if parents.ndim != 2 or parents.shape[1] == 0:
        return None
    in_chain = parents == np.arange(-1, parents.shape[1] - 1)[None, :]
    lengths = np.logical_and.accumulate(in_chain, axis=1).sum(axis=1)
    rest = np.arange(parents.shape[1])[None, :] >= lengths[:, None]
    return lengths if (parents[rest] == -1).all() else None


def node_depths(parents: np.ndarray) -> np.ndarray:
    """Depth (0 = a child of the root) of every node."""
    return (fold_paths(np.ones(np.shape(parents), np.int32), parents, np.add) - 1).astype(np.int32)


def shallowest(parents: np.ndarray, size: np.ndarray, budgets: np.ndarray) -> np.ndarray:
    """``[rows, N]`` mask of each row's ``budgets[i]`` shallowest nodes (the earlier first within
    a depth): a fixed budget's cut, closed under parents whatever order the tree is laid out in."""
    rows, width = np.shape(parents)
    column = np.arange(width)[None, :]
    key = np.where(column < np.asarray(size)[:, None], node_depths(parents) * width + column, rows * width * width)
    rank = np.argsort(np.argsort(key, axis=1, kind="stable"), axis=1, kind="stable")
    return (rank < np.asarray(budgets)[:, None]) & (column < np.asarray(size)[:, None])


def path_products(chance: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """The chance that each node is accepted: the product of conditional chances along its path."""
    return fold_paths(np.asarray(chance, np.float64), parents, np.multiply)


def parent_values(values: np.ndarray, parents: np.ndarray, root: bool | float) -> np.ndarray:
    """Each node's parent's value (``root`` for children of the root)."""
    return np.where(parents >= 0, np.take_along_axis(values, np.maximum(parents, 0), axis=1), root)


def first_children(parents: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Per row, the nodes (before ``size``) that are their parent's first child (``[rows, N]`` mask)."""
    rows, width = parents.shape
    valid = np.arange(width)[None, :] < np.asarray(size)[:, None]
    key = np.arange(rows)[:, None] * (width + 1) + (np.asarray(parents) + 1)
    flat = np.flatnonzero(valid)
    _, first = np.unique(key.reshape(-1)[flat], return_index=True)
    mask = np.zeros(rows * width, bool)
    mask[flat[first]] = True
    return mask.reshape(rows, width)
