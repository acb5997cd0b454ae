"""What drafters return: per requested row a chain and, in tree mode, a tree.

Kernels fill fixed-width arrays (``-1`` padded); the proposers' base reads them with one
slice per step, never per-row Python objects. :class:`DraftArrays` gives any such result
the :class:`Drafts` methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Drafts(Protocol):
    """One step's drafts; index ``i`` is the ``i``-th requested row.

    ``chain_tokens`` ``[rows, L]`` int32 and ``chain_size`` ``[rows]``; ``tree_tokens`` and
    ``tree_parents`` ``[rows, N]`` (parents first, parent ``-1`` = the root) and ``tree_size``
    ``[rows]``, or all three ``None`` when the drafter built no trees this step.
    """

    chain_tokens: np.ndarray
    chain_size: np.ndarray
    tree_tokens: np.ndarray | None
    tree_parents: np.ndarray | None
    tree_size: np.ndarray | None

    def chain(self, index: int) -> list[int]: ...

    def tree(self, index: int) -> tuple[list[int], list[int]]: ...


class DraftArrays:
    """``chain(i)`` / ``tree(i)`` for a class with the :class:`Drafts` array attributes."""

    chain_tokens: np.ndarray
    chain_size: np.ndarray
    tree_tokens: np.ndarray | None
    tree_parents: np.ndarray | None
    tree_size: np.ndarray | None

    def chain(self, index: int) -> list[int]:
        return self.chain_tokens[index, : int(self.chain_size[index])].tolist()

    def tree(self, index: int) -> tuple[list[int], list[int]]:
        if self.tree_tokens is None or self.tree_parents is None or self.tree_size is None:
            raise ValueError("these drafts have no trees (the drafter ran in chain mode)")
        size = int(self.tree_size[index])
        return self.tree_tokens[index, :size].tolist(), self.tree_parents[index, :size].tolist()


@dataclass
class ChainDrafts(DraftArrays):
    """Chains only (no trees), e.g. from a drafter that produces Python lists."""

    chain_tokens: np.ndarray
    chain_size: np.ndarray
    tree_tokens: None = None
    tree_parents: None = None
    tree_size: None = None

    @classmethod
    def from_lists(cls, chains: Sequence[Sequence[int]]) -> ChainDrafts:
        sizes = np.fromiter(map(len, chains), dtype=np.int32, count=len(chains))
        tokens = np.full((len(chains), int(sizes.max(initial=0))), -1, dtype=np.int32)
        for row, chain in enumerate(chains):
            tokens[row, : len(chain)] = chain
        return cls(tokens, sizes)


@dataclass(frozen=True)
class DraftTree:
    """One request's draft: tokens and parent indices, parents first (-1 = the root)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def truncated(self, budget: int) -> DraftTree:
        """The first ``budget`` nodes: still a tree because parents come first."""
        return DraftTree(self.tokens[:budget], self.parents[:budget])

    def matches(self, scheduled_tokens: Sequence[int]) -> bool:
        """True when the scheduler sent back a prefix of this tree's tokens."""
        n = len(scheduled_tokens)
        return len(self.tokens) >= n and list(self.tokens[:n]) == list(scheduled_tokens)
