"""REST retrieval (algorithms.md §1): the C++ kernel and its plain-Python reference.

Per requested row: the longest suffix of the context (``n_max`` down to ``n_min`` tokens)
found in the datastore, up to ``max_matches`` of its continuations (``cont_len`` tokens,
stopping at document separators, evenly strided over the suffix-array range), plus the
continuations of the longest suffix found earlier in the row's own context (each weighing
``context_weight``), merged into one trie. Output: the ``top_k`` heaviest nodes as a subtree,
breadth-first (parents before children), and the heaviest chain, which stops when a child
keeps less than ``min_ratio`` of its parent's weight. Ties: heavier, shallower, smaller token,
earlier-created node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_retrieval_spec.kernels.extension import load_extension

TIMING_PHASES = ("search", "gather", "trie", "select")


@dataclass(frozen=True)
class RestParams:
    """Retrieval and selection settings (see the module docstring); the serving defaults
    come from :class:`~vllm_retrieval_spec.options.RetrievalSpecOptions` via :meth:`from_options`."""

    n_min: int = 1
    n_max: int = 16
    max_matches: int = 256
    cont_len: int = 10
    top_k: int = 64
    chain_len: int = 8
    min_ratio: float = 0.1
    use_datastore: bool = True
    use_context: bool = True
    context_weight: float = 1.0
    context_max_matches: int = 64

    @classmethod
    def from_options(cls, options: Any, chain_len: int, **overrides: Any) -> RestParams:
        """The REST settings of a ``RetrievalSpecOptions`` for chains of ``chain_len``; trees
        (``top_k`` nodes) only when ``options.tree`` is set."""
        values = {f: getattr(options, f) for f in cls.__dataclass_fields__ if hasattr(options, f)}
        values["top_k"] = options.top_k if options.tree else 0
        return cls(**{**values, "chain_len": chain_len, **overrides})


@dataclass
class RestDrafts:
    """Trees ``[rows, top_k]`` (-1 padded; parent -1 = the root), chains ``[rows, chain_len]``,
    ``match_info`` ``[rows, 3]`` (datastore match length, context match length, datastore
    matches found) and, when profiled, ``timings_ns`` ``[rows, 4]`` (TIMING_PHASES)."""

    tree_tokens: np.ndarray
    tree_parents: np.ndarray
    tree_size: np.ndarray
    chain_tokens: np.ndarray
    chain_size: np.ndarray
    match_info: np.ndarray
    timings_ns: np.ndarray | None = None

    def tree(self, index: int) -> tuple[list[int], list[int]]:
        size = int(self.tree_size[index])
        return self.tree_tokens[index, :size].tolist(), self.tree_parents[index, :size].tolist()

    def chain(self, index: int) -> list[int]:
        return self.chain_tokens[index, : int(self.chain_size[index])].tolist()


def rest_retrieve(
    store: Any,
    tokens: np.ndarray,
    lengths: np.ndarray,
    rows: np.ndarray,
    params: RestParams,
    *,
    num_threads: int = 0,
    profile: bool = False,
) -> RestDrafts:
    """Draft for ``tokens[rows]`` (vLLM's ``token_ids_cpu`` layout) from ``store`` (a
    :class:`~vllm_retrieval_spec.datastores.TokenDatastore`, or None for context only)."""
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    r = len(rows)
    out = RestDrafts(
        tree_tokens=np.empty((r, params.top_k), np.int32),
        tree_parents=np.empty((r, params.top_k), np.int32),
        tree_size=np.empty(r, np.int32),
        chain_tokens=np.empty((r, params.chain_len), np.int32),
        chain_size=np.empty(r, np.int32),
        match_info=np.empty((r, 3), np.int32),
        timings_ns=np.zeros((r, 4), np.int64) if profile else None,
    )
    load_extension().rest_retrieve(
        None if store is None else store.tokens,
        None if store is None else store.suffix_array,
        0 if store is None else store.separator,
        getattr(store, "first_token_offsets", None),
        np.ascontiguousarray(tokens, dtype=np.int32),
        np.ascontiguousarray(lengths, dtype=np.int32),
        rows,
        out.tree_tokens, out.tree_parents, out.tree_size, out.chain_tokens, out.chain_size,
        out.match_info, out.timings_ns,
        params.n_min, params.n_max, params.max_matches, params.cont_len, params.min_ratio,
        params.use_datastore and store is not None, params.use_context, params.context_weight,
        params.context_max_matches, num_threads,
    )
    return out


# ---------------------------------------------------------------- plain-Python reference


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
