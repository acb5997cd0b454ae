"""Draft trees between the proposer and the verifying target step.

The proposer (``propose``) and the runner (next step) live in the same worker process, but
vLLM passes only flat token lists between them. :class:`DraftTreeRegistry` keeps each
request's parents for the step that verifies them; :class:`TreeStepPlan` is what that step
needs: which rows of the batch carry trees, their depths (for positions), ancestor masks
(for attention) and KV slots (for compaction).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_retrieval_spec.kernels.tree import pack_tree_masks


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


class DraftTreeRegistry:
    """This process's drafts of the last ``propose`` call, by request id."""

    def __init__(self) -> None:
        self._trees: dict[str, DraftTree] = {}

    def publish(self, trees: Mapping[str, DraftTree]) -> None:
        """Replace the registry with this step's drafts (older ones are never verified)."""
        self._trees = dict(trees)

    def tree_for(self, req_id: str, scheduled_tokens: Sequence[int]) -> DraftTree:
        """The tree behind the tokens the scheduler sent back (it may keep only a prefix);
        a chain when the tokens are not ours (then a chain is what they are)."""
        tree = self._trees.get(req_id)
        n = len(scheduled_tokens)
        if tree is None or len(tree.tokens) < n or list(tree.tokens[:n]) != list(scheduled_tokens):
            return DraftTree.chain(scheduled_tokens)
        return tree.truncated(n)


REGISTRY = DraftTreeRegistry()


@dataclass
class TreeRequest:
    """One batch row verified as a tree in this step."""

    row: int  # index in the input batch
    query_start: int  # first scheduled token (the root) in the flat batch
    tree: DraftTree
    depth: np.ndarray  # [n] depth of each node (1 = child of the root)
    visible: torch.Tensor  # [n, n] bool: node i sees node j (ancestor or itself)

    @property
    def num_nodes(self) -> int:
        return len(self.tree.tokens)


@dataclass
class TreeStepPlan:
    """The trees of one target step, in input-batch row order."""

    requests: list[TreeRequest]
    draft_slots: list[np.ndarray] | None = None  # per request: KV slot of each node
    tree_rows: Any = None  # the attention's padded index tensors, built by its first layer
    kv_layout: Any = None  # the KV cache layout the attention layers read and compaction writes

    @classmethod
    def build(cls, rows_and_trees: Sequence[tuple[int, int, DraftTree]]) -> TreeStepPlan:
        """``rows_and_trees``: (batch row, query start, tree) of every row with drafts."""
        trees = [tree for _, _, tree in rows_and_trees]
        parents, offsets = flatten_parents(trees)
        max_nodes = max((len(t.tokens) for t in trees), default=1)
        packed = pack_tree_masks(parents, offsets, max(max_nodes, 1))
        depth, masks = packed.depth, packed.ancestor_mask
        requests = []
        for (row, start, tree), lo, hi in zip(rows_and_trees, offsets[:-1], offsets[1:]):
            requests.append(TreeRequest(row, start, tree, depth[lo:hi], unpack_mask(masks[lo:hi], hi - lo)))
        return cls(requests)

    def is_branching(self) -> bool:
        """False when every tree is a chain (then vLLM's own path is already exact)."""
        return any(tree_branches(r.tree) for r in self.requests)


def tree_branches(tree: DraftTree) -> bool:
    return any(parent != index - 1 for index, parent in enumerate(tree.parents))


def flatten_parents(trees: Sequence[DraftTree]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged parents as the kernels take them: flat ``parents`` and ``offsets`` [B+1]."""
    sizes = np.fromiter((len(t.parents) for t in trees), dtype=np.int32, count=len(trees))
    offsets = np.zeros(len(trees) + 1, dtype=np.int32)
    np.cumsum(sizes, out=offsets[1:])
    parents = np.fromiter((p for t in trees for p in t.parents), dtype=np.int32, count=int(offsets[-1]))
    return parents, offsets


def unpack_mask(words: np.ndarray, n: int) -> torch.Tensor:
    """Bit-packed ancestor rows ``[n, words]`` (uint64) → bool ``[n, n]``."""
    if n == 0:
        return torch.zeros((0, 0), dtype=torch.bool)
    as_bytes = np.ascontiguousarray(words).view(np.uint8).reshape(n, -1)
    bits = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :n]
    return torch.from_numpy(bits.astype(bool))
