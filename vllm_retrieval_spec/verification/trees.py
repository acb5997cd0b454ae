"""The plan of the target step that verifies draft trees.

:class:`TreeStepPlan` holds one
step's trees as flat arrays in input-batch row order — node depths (for positions), ancestor
masks (for attention), the flat-batch index of every node (for positions, attention and KV
compaction) — built with vectorised NumPy, never per node in Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_retrieval_spec.candidates import DraftQ
from vllm_retrieval_spec.drafts import DraftTree
from vllm_retrieval_spec.kernels.tree import pack_tree_masks


@dataclass
class TreeStepPlan:
    """The draft trees of one target step, one per input-batch row (empty for rows without
    drafts), as flat arrays."""

    tokens: np.ndarray  # [N] int32, every row's nodes
    parents: np.ndarray  # [N] int32, within the row's tree (-1 = root)
    offsets: np.ndarray  # [B + 1] int32, row i's nodes are [offsets[i], offsets[i + 1])
    query_starts: np.ndarray  # [B] int64, flat-batch index of each row's root
    depth: np.ndarray  # [N] int32, 1 = child of the root
    ancestors: np.ndarray  # [N, words] uint64, bit j: node j of the same tree is an ancestor or itself
    branching: np.ndarray  # [B] bool, the rows whose tree is not a chain
    off_chain: np.ndarray  # [N] bool, nodes after their tree's leading chain (the causal mask is wrong for them)
    draft_q: DraftQRows | None = None  # the draft distributions of rows with drawn candidates
    scheduled: np.ndarray | None = None  # [B] draft slots per row, when some hold placeholders, not nodes
    positions: np.ndarray | None = None  # [B] int64: the absolute position of each row's root token

    @classmethod
    def build(cls, trees: Sequence[DraftTree], query_starts: np.ndarray,
              draft_q: Sequence[DraftQ | None] = (), scheduled: np.ndarray | None = None) -> TreeStepPlan:
        """``draft_q[i]``: the distributions row ``i``'s candidates were drawn from (None:
        deterministic candidates); ``scheduled[i]``: the draft slots the scheduler gave row
        ``i`` when some hold placeholders rather than nodes (the step's logits have a row for
        each)."""
        parents, offsets = flatten_parents(trees)
        tokens = np.fromiter((t for tree in trees for t in tree.tokens), dtype=np.int32, count=len(parents))
        sizes = np.diff(offsets)
        packed = pack_tree_masks(parents, offsets, max(int(sizes.max(initial=0)), 1))
        off_chain = leading_chain_ends(parents, offsets)
        branching = _counts_within(off_chain, offsets) > 0
        rows_q = DraftQRows.build(draft_q, offsets) if any(q is not None for q in draft_q) else None
        return cls(tokens, parents, offsets, np.asarray(query_starts, dtype=np.int64), packed.depth,
                   packed.ancestor_mask, branching, off_chain, rows_q,
                   scheduled=None if scheduled is None or np.array_equal(sizes, scheduled) else scheduled)

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def logit_rows(self) -> np.ndarray | None:
        """The step's logits rows (a root row, then one per scheduled draft slot, per row) of
        every root and node, when some slots hold placeholders (None: the logits are ours)."""
        return None if self.scheduled is None else _first_of_groups(self.scheduled + 1, self.sizes + 1)

    def draft_slot_rows(self) -> np.ndarray | None:
        """The scheduled draft slot of every node, when some slots hold placeholders."""
        return None if self.scheduled is None else _first_of_groups(self.scheduled, self.sizes)

    def off_chain_counts(self) -> np.ndarray:
        """``[B]``: each row's nodes after its tree's leading chain (what tree attention recomputes)."""
        return _counts_within(self.off_chain, self.offsets)

    def is_branching(self) -> bool:
        """False when every tree is a chain (then vLLM's own path is already exact)."""
        return bool(self.branching.any())

    def node_rows(self) -> np.ndarray:
        """``[N]`` flat-batch index of every node (the root's index + 1 + the node's index)."""
        sizes = self.sizes
        first = np.repeat(self.query_starts + 1 - self.offsets[:-1], sizes)
        return first + np.arange(len(self.tokens), dtype=np.int64)

    def accepted_moves(self, path_nodes: np.ndarray, num_accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Flat node indices ``(sources, destinations)``: each accepted node off the chain
        moves to the slot of its depth (the prefix of draft slots the scheduler keeps)."""
        width = path_nodes.shape[1]
        depth = np.arange(width)[None, :]
        moved = (depth < num_accepted[:, None]) & (path_nodes != depth)
        request, index = np.nonzero(moved)
        base = self.offsets[request].astype(np.int64)
        return base + path_nodes[request, index], base + index


@dataclass
class DraftQRows:
    """The draft distributions of one step in the acceptance kernels' row layout: request
    ``b``'s rows are ``offsets[b] + b`` (its root) to ``offsets[b + 1] + b`` (its last node);
    ``tokens`` / ``probs`` ``[N + B, M]`` sparse (-1 / 0 padded); ``drawn`` ``[B]``: the
    requests whose candidates were drawn from them (the others have empty rows)."""

    tokens: np.ndarray
    probs: np.ndarray
    drawn: np.ndarray

    @classmethod
    def build(cls, draft_q: Sequence[DraftQ | None], offsets: np.ndarray) -> DraftQRows:
        width = max(q.tokens.shape[1] for q in draft_q if q is not None)
        rows = int(offsets[-1]) + len(offsets) - 1
        tokens = np.full((rows, width), -1, np.int32)
        probs = np.zeros((rows, width), np.float32)
        drawn = np.zeros(len(offsets) - 1, bool)
        for b, q in enumerate(draft_q):
            if q is not None:
                first, n = int(offsets[b]) + b, len(q.tokens)
                tokens[first:first + n, : q.tokens.shape[1]] = q.tokens
                probs[first:first + n, : q.probs.shape[1]] = q.probs
                drawn[b] = True
        return cls(tokens, probs, drawn)

    def dense(self, vocab: int) -> np.ndarray:
        """``[N + B, vocab]`` float32 (a row without ``q`` is all zero)."""
        out = np.zeros((len(self.tokens), vocab), np.float32)
        row, column = np.nonzero(self.tokens >= 0)
        out[row, self.tokens[row, column]] = self.probs[row, column]
        return out


def _first_of_groups(groups: np.ndarray, taken: np.ndarray) -> np.ndarray:
    """Flat indices of the first ``taken[i]`` elements of each of consecutive groups of
    ``groups[i]`` elements."""
    starts = np.concatenate([[0], np.cumsum(np.asarray(groups, np.int64))[:-1]])
    return np.repeat(starts, taken) + _ranks_within(taken)


def _counts_within(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """How many of ``flags`` are set in each of the segments ``[offsets[i], offsets[i + 1])``."""
    counted = np.concatenate([[0], np.cumsum(flags, dtype=np.int64)])
    return counted[offsets[1:]] - counted[offsets[:-1]]


def _ranks_within(counts: np.ndarray) -> np.ndarray:
    """0, 1, …, counts[0] − 1, 0, 1, …: each element's index within its group."""
    counts = np.asarray(counts, np.int64)
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def leading_chain_ends(parents: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``[N]`` bool: the nodes at or after the first node of their tree whose parent is not the
    node before it. The others form the tree's leading chain: a causal mask shows each of them
    exactly its ancestors."""
    sizes = np.diff(offsets)
    local = np.arange(len(parents), dtype=np.int32) - np.repeat(offsets[:-1], sizes)
    breaks = np.zeros(len(parents) + 1, dtype=np.int64)
    np.cumsum(parents != local - 1, out=breaks[1:])
    return breaks[1:] > np.repeat(breaks[offsets[:-1]], sizes)


def flatten_parents(trees: Sequence[DraftTree]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged parents as the kernels take them: flat ``parents`` and ``offsets`` [B+1]."""
    sizes = np.fromiter((len(t.parents) for t in trees), dtype=np.int32, count=len(trees))
    offsets = np.zeros(len(trees) + 1, dtype=np.int32)
    np.cumsum(sizes, out=offsets[1:])
    parents = np.fromiter((p for t in trees for p in t.parents), dtype=np.int32, count=int(offsets[-1]))
    return parents, offsets


def unpack_masks(words: np.ndarray, width: int) -> np.ndarray:
    """Bit-packed ancestor rows ``[n, words]`` (uint64) → bool ``[n, width]``."""
    as_bytes = np.ascontiguousarray(words).view(np.uint8).reshape(len(words), -1)
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :width].astype(bool)
