"""What drafters return: per requested row a chain and, in tree mode, a tree.

Kernels fill fixed-width arrays (``-1`` padded); the proposers' base reads them with one
slice per step, never per-row Python objects. :class:`DraftArrays` gives any such result
the :class:`Drafts` methods, and :meth:`DraftArrays.nodes` the candidate nodes with what the
drafter knows of each (source, match length, raw acceptance guess) for the goodput budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

# Where a draft node came from (bit flags; REST's kernel writes the first two).
SOURCE_DATASTORE = 1
SOURCE_CONTEXT = 2
SOURCE_MODEL = 4  # the model's own n-gram tables (N-Grammys' bigram)
SOURCE_OUTPUT = 8  # the cross-request output index (REST)
SOURCE_DENSE = 16  # dense neighbours of the target's hidden state (DReSD)
SOURCE_LIVE = 32  # the live index of requests still in flight (REST)
SOURCE_LEARNED = 64  # the dense index learned from served traffic (DReSD, Hybrid)
NUM_SOURCE_CODES = 128
SOURCE_NAMES = ((SOURCE_DATASTORE, "datastore"), (SOURCE_CONTEXT, "context"), (SOURCE_MODEL, "model_ngram"),
                (SOURCE_OUTPUT, "output_index"), (SOURCE_DENSE, "dense"), (SOURCE_LIVE, "live"),
                (SOURCE_LEARNED, "learned_dense"))


def source_label(code: int) -> str:
    """A node's ``SOURCE_*`` flags as one name: ``datastore+context``, ``none`` without flags."""
    return "+".join(name for flag, name in SOURCE_NAMES if code & flag) or "none"


SOURCE_LABELS = tuple(source_label(code) for code in range(NUM_SOURCE_CODES))


def count_sources(counts: dict[str, int], sources: np.ndarray) -> None:
    """Add one to ``counts[label]`` per node of ``sources`` (``SOURCE_*`` flags; one bincount,
    no per-node Python)."""
    add_code_counts(counts, np.bincount(np.asarray(sources, np.int64).ravel() % NUM_SOURCE_CODES,
                                        minlength=NUM_SOURCE_CODES))


def add_code_counts(counts: dict[str, int], per_code: np.ndarray) -> None:
    """Add ``per_code[code]`` nodes (``[NUM_SOURCE_CODES]``) to ``counts`` by each code's label."""
    for code in np.flatnonzero(per_code).tolist():
        label = SOURCE_LABELS[code]
        counts[label] = counts.get(label, 0) + int(per_code[code])


@dataclass
class DraftNodes:
    """One step's candidate draft nodes, ``[rows, N]`` arrays (parents first, parent -1 =
    the root, -1 padded after ``size[i]``): ``prob`` is the drafter's raw guess that a node
    is accepted given its parent is, ``source`` its ``SOURCE_*`` flags and ``match_len`` the
    length of the match that retrieved it."""

    tokens: np.ndarray
    parents: np.ndarray
    size: np.ndarray
    prob: np.ndarray
    source: np.ndarray
    match_len: np.ndarray

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def subset(self, rows: np.ndarray) -> DraftNodes:
        """The nodes of ``rows`` only."""
        return DraftNodes(*(np.asarray(getattr(self, f.name))[rows] for f in dataclasses.fields(self)))

    def kept(self, keep: np.ndarray, prefixes: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The nodes where ``keep`` (closed under parents) moved to the front of each row, in
        their order (parents still first), parents renumbered: tokens, parents, sizes, sources.
        ``prefixes``: each row keeps its first nodes (chains), which stay where they are."""
        if prefixes:
            return self.tokens, self.parents, keep.sum(axis=1), np.asarray(self.source)
        order = np.argsort(~keep, axis=1, kind="stable")
        position = np.cumsum(keep, axis=1) - 1
        parents = np.take_along_axis(np.asarray(self.parents), order, axis=1)
        renumbered = np.where(parents >= 0, np.take_along_axis(position, np.maximum(parents, 0), axis=1), -1)
        return (np.take_along_axis(self.tokens, order, axis=1), renumbered, keep.sum(axis=1),
                np.take_along_axis(np.asarray(self.source), order, axis=1))


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

    def nodes(self, trees: bool) -> DraftNodes: ...


class DraftArrays:
    """``chain(i)`` / ``tree(i)`` / ``nodes(trees)`` for a class with the :class:`Drafts` array
    attributes. Optional attributes refine :meth:`nodes`: ``chain_prob`` / ``tree_prob`` and
    ``chain_source`` / ``tree_source`` (``[rows, N]``), else every node gets probability 1 and
    the row's :meth:`row_sources`; :meth:`row_match_len` gives each source's match length."""

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

    def nodes(self, trees: bool) -> DraftNodes:
        """The trees (when ``trees`` and built) or the chains as candidate nodes."""
        kind = "tree" if trees and self.tree_tokens is not None else "chain"
        tokens = np.asarray(getattr(self, f"{kind}_tokens"))
        size = np.asarray(getattr(self, f"{kind}_size"))
        rows, width = tokens.shape
        if kind == "tree":
            parents = np.asarray(self.tree_parents)
        else:
            parents = np.broadcast_to(np.arange(-1, width - 1, dtype=np.int32), (rows, width))
        prob = getattr(self, f"{kind}_prob", None)
        prob = np.ones((rows, width), np.float32) if prob is None else np.asarray(prob)
        source = getattr(self, f"{kind}_source", None)
        if source is None:
            source = np.broadcast_to(self.row_sources()[:, None], (rows, width))
        source = np.asarray(source, dtype=np.int8)
        match_len = np.zeros((rows, width), np.int32)
        for flag, lengths in self.row_match_len().items():
            match_len = np.where(source & flag, np.maximum(match_len, np.asarray(lengths)[:, None]), match_len)
        return DraftNodes(tokens, parents, size, prob, source, match_len)

    def row_sources(self) -> np.ndarray:
        """Each row's ``SOURCE_*`` flags when the drafter has no per-node sources."""
        return np.full(len(self.chain_size), SOURCE_CONTEXT, np.int8)

    def row_match_len(self) -> dict[int, np.ndarray]:
        """Per ``SOURCE_*`` flag, each row's match length in that source (none known: empty);
        a node takes the longest of its sources'."""
        return {}


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
