"""Brute-force plain-Python reference of REST retrieval (:mod:`vllm_retrieval_spec.kernels.rest`),
which the tests compare against exactly: matches found by scanning, no suffix array, nodes ranked
by sorting the whole trie."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_retrieval_spec.drafts import (
    SOURCE_CONTEXT,
    SOURCE_DATASTORE,
    SOURCE_DENSE,
    SOURCE_LEARNED,
    SOURCE_LIVE,
    SOURCE_OUTPUT,
)
from vllm_retrieval_spec.kernels.rest import ChanceTable, RestParams

SOURCE_FLAGS = {"datastore": SOURCE_DATASTORE, "context": SOURCE_CONTEXT, "output": SOURCE_OUTPUT,
                "dense": SOURCE_DENSE, "live": SOURCE_LIVE, "learned": SOURCE_LEARNED}


@dataclass
class _Node:
    token: int
    parent: int
    depth: int
    datastore: int = 0
    context: int = 0
    output: int = 0
    dense: int = 0
    live: int = 0
    learned: int = 0


class _ReferenceTrie:
    def __init__(self, params: RestParams, chances: ChanceTable | None) -> None:
        self.weights = {"datastore": 1.0, "context": params.context_weight, "output": params.output_weight,
                        "dense": params.dense_weight, "live": params.live_weight, "learned": params.dense_weight}
        self.chances = chances
        self.path: dict[int, float] = {}
        self.conditional: dict[int, float] = {}
        self.nodes = [_Node(-1, -1, 0)]
        self.children: dict[tuple[int, int], int] = {}

    def insert(self, sequence: Sequence[int], source: str) -> None:
        """Count ``sequence`` for ``source`` (a key of ``SOURCE_FLAGS``)."""
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
        n, w = self.nodes[node], self.weights
        return (n.datastore + w["context"] * n.context + w["output"] * n.output  # the kernel's order of additions
                + w["dense"] * (n.dense + n.learned) + w["live"] * n.live)

    def ratio(self, node: int) -> np.float32:
        return np.float32(self.weight(node) / self.weight(self.nodes[node].parent))

    def flags(self, node: int) -> int:
        return sum(flag for source, flag in SOURCE_FLAGS.items() if getattr(self.nodes[node], source) > 0)

    def describe(self, nodes: Sequence[int]) -> tuple[list[float], list[int]]:
        """Each node's weight over its parent's (as float32) and its source flags."""
        return [float(self.ratio(n)) for n in nodes], [self.flags(n) for n in nodes]

    def score(self, match_lengths: dict[int, int]) -> None:
        """With a chance table: every node's calibrated path chance, given each source flag's
        match length (a node takes the longest of its sources')."""
        if self.chances is None:
            return
        table = self.chances
        self.path, self.conditional = {0: 1.0}, {0: 1.0}
        for node in range(1, len(self.nodes)):  # parents first
            flags = self.flags(node)
            length = max((m for flag, m in match_lengths.items() if flags & flag), default=0)
            probs = table.chance.shape[3]
            key = (flags % table.chance.shape[0],
                   table.length_bucket[min(length, len(table.length_bucket) - 1)],
                   table.depth_bucket[min(self.nodes[node].depth - 1, len(table.depth_bucket) - 1)],
                   min(max(int(self.ratio(node) * np.float32(probs)), 0), probs - 1))
            value = float(table.chance[key])
            self.conditional[node] = min(value, 1.0) if value >= 0.0 else 0.0  # NaN and negatives: 0
            self.path[node] = self.path[self.nodes[node].parent] * self.conditional[node]

    def rank(self, node: int) -> tuple:
        by_weight = (-self.weight(node), self.nodes[node].depth, self.nodes[node].token, node)
        return by_weight if self.chances is None else (-self.path[node], *by_weight)

    def tree(self, top_k: int, main_path: list[int]) -> list[int]:
        """``main_path`` (cut to top_k) and the best-ranked other nodes, top_k in all,
        depth-first (each node's children in rank order): sorted by the ranks along their paths
        from the root."""
        main = main_path[:top_k]
        others = sorted(set(range(1, len(self.nodes))) - set(main), key=self.rank)[: top_k - len(main)]
        return sorted([*main, *others], key=self.path_ranks)

    def path_ranks(self, node: int) -> list[tuple]:
        """The ranks of the node's ancestors and itself, from the root's child down."""
        ranks = []
        while node != 0:
            ranks.append(self.rank(node))
            node = self.nodes[node].parent
        return ranks[::-1]

    def parents(self, chosen: list[int]) -> list[int]:
        position = {node: i for i, node in enumerate(chosen)}
        return [-1 if self.nodes[n].parent == 0 else position[self.nodes[n].parent] for n in chosen]

    def chain(self, chain_len: int, min_ratio: float) -> list[int]:
        """The nodes of the best chain (the best-ranked child at each step)."""
        chain, node = [], 0
        while len(chain) < chain_len:
            kids = [c for (p, _), c in self.children.items() if p == node]
            if not kids:
                break
            best = min(kids, key=self.rank)
            if self.too_unlikely(best, node, min_ratio):
                break
            chain.append(best)
            node = best
        return chain

    def too_unlikely(self, child: int, parent: int, min_ratio: float) -> bool:
        """Whether the chain stops before ``child``: its calibrated chance (with a table), else
        its weight over its parent's, is below ``min_ratio``."""
        if self.chances is not None:
            return self.conditional[child] < min_ratio
        return self.weight(child) < min_ratio * self.weight(parent)

    def tokens(self, nodes: list[int]) -> list[int]:
        return [self.nodes[n].token for n in nodes]


def rest_retrieve_reference(
    store_tokens: np.ndarray | None, separator: int, contexts: Sequence[Sequence[int]], params: RestParams,
    output_tokens: np.ndarray | None = None, output_separator: int = 0,
    dense: Sequence[Sequence[Sequence[int]]] | None = None,
    live: Sequence[Sequence[Sequence[int]]] | None = None, live_match_len: Sequence[int] | None = None,
    chances: ChanceTable | None = None, dense_match_len: Sequence[int] | None = None,
    learned: Sequence[Sequence[Sequence[int]]] | None = None, learned_match_len: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """Brute force (no suffix array): matches found by scanning, ordered as suffixes sort;
    ``dense[i]`` / ``learned[i]`` / ``live[i]``: row i's given dense / learned-dense / live
    continuations (``dense_match_len[i]`` / ``learned_match_len[i]`` / ``live_match_len[i]`` their
    match length); ``chances``: rank by calibrated path chance."""
    results = []
    for row, context in enumerate(contexts):
        ctx = [int(t) for t in context]
        trie = _ReferenceTrie(params, chances)
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
        for name, given in (("dense", dense), ("learned", learned), ("live", live)):
            if given is not None and trie.weights[name] > 0:
                for continuation in given[row]:
                    trie.insert(list(continuation)[: params.continuation_len], name)
        ctx_len = 0
        if params.use_context and params.context_weight > 0:
            ctx_len, continuations = _context_continuations(ctx, params)
            for continuation in continuations:
                trie.insert(continuation, "context")
        live_len = _given_match_len(live, live_match_len, params.live_weight, row)
        trie.score({SOURCE_DATASTORE: ds_len, SOURCE_CONTEXT: ctx_len, SOURCE_OUTPUT: out_len, SOURCE_LIVE: live_len,
                    SOURCE_DENSE: _given_match_len(dense, dense_match_len, params.dense_weight, row),
                    SOURCE_LEARNED: _given_match_len(learned, learned_match_len, params.dense_weight, row)})
        chain = trie.chain(params.chain_len, params.min_ratio)
        tree = trie.tree(params.top_k, chain if params.tree_holds_chain else [])
        results.append({
            "tree": (trie.tokens(tree), trie.parents(tree)),
            "chain": trie.tokens(chain),
            "match_info": [ds_len, ctx_len, found, out_len, out_found, live_len],
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
            for token in store[start:start + params.continuation_len]:
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
            return q, [_context_continuation(ctx, p, q, params) for p in positions]
    return 0, []


def _context_continuation(ctx, p, q, params):
    """``ctx[p + q:]`` up to ``continuation_len`` tokens, repeating with its period (its distance to
    the end) when ``context_loops`` and the match spans a period."""
    start, period = p + q, len(ctx) - p - q
    count = params.continuation_len if params.context_loops and q >= period else min(period, params.continuation_len)
    return [ctx[start + i % period] for i in range(count)]


def _given_match_len(given: object, match_len: Sequence[int] | None, weight: float, row: int) -> int:
    """Row ``row``'s match length of a given source (0 when it is absent, unknown or weighs nothing)."""
    return int(match_len[row]) if given is not None and match_len is not None and weight > 0 else 0
