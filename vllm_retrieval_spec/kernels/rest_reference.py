"""Brute-force plain-Python reference of REST retrieval (:mod:`vllm_retrieval_spec.kernels.rest`),
which the tests compare against exactly: matches found by scanning, no suffix array."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_retrieval_spec.drafts import SOURCE_CONTEXT, SOURCE_DATASTORE, SOURCE_DENSE, SOURCE_OUTPUT
from vllm_retrieval_spec.kernels.rest import RestParams


@dataclass
class _Node:
    token: int
    parent: int
    depth: int
    datastore: int = 0
    context: int = 0
    output: int = 0
    dense: int = 0


class _ReferenceTrie:
    def __init__(self, context_weight: float, output_weight: float, dense_weight: float) -> None:
        self.context_weight = context_weight
        self.output_weight = output_weight
        self.dense_weight = dense_weight
        self.nodes = [_Node(-1, -1, 0)]
        self.children: dict[tuple[int, int], int] = {}

    def insert(self, sequence: Sequence[int], source: str) -> None:
        """Count ``sequence`` for ``source`` ("datastore", "context", "output" or "dense")."""
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
            setattr(self.nodes[node], source, getattr(self.nodes[node], source) + 1)

    def weight(self, node: int) -> float:
        n = self.nodes[node]
        return (n.datastore + self.context_weight * n.context + self.output_weight * n.output
                + self.dense_weight * n.dense)

    def describe(self, nodes: Sequence[int]) -> tuple[list[float], list[int]]:
        """Each node's weight over its parent's (as float32) and its source flags."""
        probs = [float(np.float32(self.weight(n) / self.weight(self.nodes[n].parent))) for n in nodes]
        sources = [SOURCE_DATASTORE * (self.nodes[n].datastore > 0) + SOURCE_CONTEXT * (self.nodes[n].context > 0)
                   + SOURCE_OUTPUT * (self.nodes[n].output > 0) + SOURCE_DENSE * (self.nodes[n].dense > 0)
                   for n in nodes]
        return probs, sources

    def rank(self, node: int) -> tuple:
        return (-self.weight(node), self.nodes[node].depth, self.nodes[node].token, node)

    def tree(self, top_k: int) -> list[int]:
        """The top_k heaviest nodes, by depth then rank."""
        chosen = sorted(range(1, len(self.nodes)), key=self.rank)[:top_k]
        return sorted(chosen, key=lambda n: (self.nodes[n].depth, self.rank(n)))

    def parents(self, chosen: list[int]) -> list[int]:
        position = {node: i for i, node in enumerate(chosen)}
        return [-1 if self.nodes[n].parent == 0 else position[self.nodes[n].parent] for n in chosen]

    def chain(self, chain_len: int, min_ratio: float) -> list[int]:
        """The nodes of the heaviest chain."""
        chain, node = [], 0
        while len(chain) < chain_len:
            kids = [c for (p, _), c in self.children.items() if p == node]
            if not kids:
                break
            best = min(kids, key=self.rank)
            if self.weight(best) < min_ratio * self.weight(node):
                break
            chain.append(best)
            node = best
        return chain

    def tokens(self, nodes: list[int]) -> list[int]:
        return [self.nodes[n].token for n in nodes]


def rest_retrieve_reference(
    store_tokens: np.ndarray | None, separator: int, contexts: Sequence[Sequence[int]], params: RestParams,
    output_tokens: np.ndarray | None = None, output_separator: int = 0,
    dense: Sequence[Sequence[Sequence[int]]] | None = None,
) -> list[dict[str, Any]]:
    """Brute force (no suffix array): matches found by scanning, ordered as suffixes sort;
    ``dense[i]``: row i's given dense continuations."""
    results = []
    for row, context in enumerate(contexts):
        ctx = [int(t) for t in context]
        trie = _ReferenceTrie(params.context_weight, params.output_weight, params.dense_weight)
        ds_len, found = 0, 0
        if params.use_datastore and store_tokens is not None and len(store_tokens):
            ds_len, continuations, found = _store_continuations(store_tokens, separator, ctx, params,
                                                                params.max_matches)
            for continuation in continuations:
                trie.insert(continuation, "datastore")
        out_len, out_found = 0, 0
        if output_tokens is not None and len(output_tokens) and params.output_max_matches and params.output_weight:
            out_len, continuations, out_found = _store_continuations(output_tokens, output_separator, ctx, params,
                                                                     params.output_max_matches)
            for continuation in continuations:
                trie.insert(continuation, "output")
        if dense is not None and params.dense_weight > 0:
            for continuation in dense[row]:
                trie.insert(list(continuation)[: params.cont_len], "dense")
        ctx_len = 0
        if params.use_context and params.context_weight > 0:
            ctx_len, continuations = _context_continuations(ctx, params)
            for continuation in continuations:
                trie.insert(continuation, "context")
        tree, chain = trie.tree(params.top_k), trie.chain(params.chain_len, params.min_ratio)
        results.append({
            "tree": (trie.tokens(tree), trie.parents(tree)),
            "chain": trie.tokens(chain),
            "match_info": [ds_len, ctx_len, found, out_len, out_found],
            "tree_nodes": trie.describe(tree),
            "chain_nodes": trie.describe(chain),
        })
    return results


def _store_continuations(store_tokens, separator, ctx, params, max_matches):
    store = [int(t) for t in store_tokens]
    for n in range(min(params.n_max, len(ctx)), max(params.n_min, 1) - 1, -1):
        query = ctx[len(ctx) - n:]
        positions = [p for p in range(len(store) - n + 1) if store[p:p + n] == query]
        if not positions:
            continue
        positions.sort(key=lambda p: store[p:])
        found = len(positions)
        take = min(found, max_matches)
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
