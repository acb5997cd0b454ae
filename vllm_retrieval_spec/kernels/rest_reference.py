"""Brute-force plain-Python reference of REST retrieval (:mod:`vllm_retrieval_spec.kernels.rest`),
which the tests compare against exactly: matches found by scanning, no suffix array."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_retrieval_spec.kernels.rest import RestParams


@dataclass
class _Node:
    token: int
    parent: int
    depth: int
    datastore: int = 0
    context: int = 0


class _ReferenceTrie:
    def __init__(self, context_weight: float) -> None:
        self.context_weight = context_weight
        self.nodes = [_Node(-1, -1, 0)]
        self.children: dict[tuple[int, int], int] = {}

    def insert(self, sequence: Sequence[int], from_context: bool) -> None:
        if not sequence:
            return
        path = [0]
        for token in sequence:
            key = (path[-1], int(token))
            if key not in self.children:
                self.children[key] = len(self.nodes)
                self.nodes.append(_Node(int(token), path[-1], len(path)))
            path.append(self.children[key])
        for node in path:
            if from_context:
                self.nodes[node].context += 1
            else:
                self.nodes[node].datastore += 1

    def weight(self, node: int) -> float:
        return self.nodes[node].datastore + self.context_weight * self.nodes[node].context

    def rank(self, node: int) -> tuple:
        return (-self.weight(node), self.nodes[node].depth, self.nodes[node].token, node)

    def tree(self, top_k: int) -> tuple[list[int], list[int]]:
        chosen = sorted(range(1, len(self.nodes)), key=self.rank)[:top_k]
        chosen.sort(key=lambda n: (self.nodes[n].depth, self.rank(n)))
        position = {node: i for i, node in enumerate(chosen)}
        parents = [-1 if self.nodes[n].parent == 0 else position[self.nodes[n].parent] for n in chosen]
        return [self.nodes[n].token for n in chosen], parents

    def chain(self, chain_len: int, min_ratio: float) -> list[int]:
        chain, node = [], 0
        while len(chain) < chain_len:
            kids = [c for (p, _), c in self.children.items() if p == node]
            if not kids:
                break
            best = min(kids, key=self.rank)
            if self.weight(best) < min_ratio * self.weight(node):
                break
            chain.append(self.nodes[best].token)
            node = best
        return chain


def rest_retrieve_reference(
    store_tokens: np.ndarray | None, separator: int, contexts: Sequence[Sequence[int]], params: RestParams
) -> list[dict[str, Any]]:
    """Brute force (no suffix array): matches found by scanning, ordered as suffixes sort."""
    results = []
    for context in contexts:
        ctx = [int(t) for t in context]
        trie = _ReferenceTrie(params.context_weight)
        ds_len, found = 0, 0
        if params.use_datastore and store_tokens is not None and len(store_tokens):
            ds_len, continuations, found = _datastore_continuations(store_tokens, separator, ctx, params)
            for continuation in continuations:
                trie.insert(continuation, from_context=False)
        ctx_len = 0
        if params.use_context and params.context_weight > 0:
            ctx_len, continuations = _context_continuations(ctx, params)
            for continuation in continuations:
                trie.insert(continuation, from_context=True)
        tree_tokens, tree_parents = trie.tree(params.top_k)
        results.append({
            "tree": (tree_tokens, tree_parents),
            "chain": trie.chain(params.chain_len, params.min_ratio),
            "match_info": [ds_len, ctx_len, found],
        })
    return results


def _datastore_continuations(store_tokens, separator, ctx, params):
    store = [int(t) for t in store_tokens]
    for n in range(min(params.n_max, len(ctx)), max(params.n_min, 1) - 1, -1):
        query = ctx[len(ctx) - n:]
        positions = [p for p in range(len(store) - n + 1) if store[p:p + n] == query]
        if not positions:
            continue
        positions.sort(key=lambda p: store[p:])
        found = len(positions)
        take = min(found, params.max_matches)
        continuations = []
        for j in range(take):
            start = positions[j * found // take] + n
            continuation = []
            for token in store[start:start + params.cont_len]:
                if token == separator:
                    break
                continuation.append(token)
            continuations.append(continuation)
        return n, continuations, found
    return 0, [], 0


def _context_continuations(ctx, params):
    n = len(ctx)
    for q in range(min(params.n_max, n - 1), max(params.n_min, 1) - 1, -1):
        query = ctx[n - q:]
        positions = [p for p in range(n - q - 1, -1, -1) if ctx[p:p + q] == query]
        positions = positions[: params.context_max_matches]
        if positions:
            return q, [ctx[p + q:p + q + params.cont_len] for p in positions]
    return 0, []
