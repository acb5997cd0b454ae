"""REST retrieval (exact-match retrieval, REST paper Algorithms 1 and 2): the front end of the C++ kernel.

Per requested row: the longest suffix of the context (``n_max`` down to ``n_min`` tokens) found in
the datastore, up to ``max_matches`` of its continuations (``cont_len`` tokens, stopping at
document separators, evenly strided over the suffix-array range), the same from the cross-request
output index (up to ``output_max_matches``, each weighing ``output_weight``), the continuations
given by the caller (DReSD's dense neighbours in the store and in the index learned from served
traffic, each weighing ``dense_weight`` under a flag of its own; the live index of requests in
flight, each weighing ``live_weight``), plus the continuations of the longest suffix found earlier
in the row's own context (each weighing ``context_weight``; with ``context_loops`` one that reaches
the end of the context repeats with that period when the match spans a whole period: the output is
looping), merged into one trie. Output: the ``top_k`` best nodes as a subtree, depth-first with
each node's children in rank order (parents before children, the main path first), and the best
chain (the best child at each step), which stops when a child keeps less than ``min_ratio`` of its
parent's weight (with a :class:`ChanceTable`: when its calibrated chance given its parent is below
``min_ratio``). With ``tree_holds_chain`` the tree's main path is that chain (up to ``top_k``
nodes) and its other nodes are the best of the rest, so that a budget choosing among the tree's
nodes (``budget: auto``) can draft the whole chain where branches do not pay.

Nodes rank by weight, or, given a :class:`ChanceTable` (the goodput calibration's), by calibrated
path chance: the product along the node's path of each node's chance given its parent, looked up
by (its source flags, the longest match length of its sources, its depth, its weight over its
parent's in ``probs`` buckets). Ties: higher path chance (with a table), heavier, shallower,
smaller token, earlier-created node. The brute-force reference is
:mod:`vllm_retrieval_spec.kernels.rest_reference`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_retrieval_spec.drafts import SOURCE_CONTEXT, SOURCE_DATASTORE, SOURCE_LIVE, SOURCE_OUTPUT, DraftArrays
from vllm_retrieval_spec.kernels.extension import load_extension

TIMING_PHASES = ("search", "gather", "trie", "select")


@dataclass(frozen=True)
class RestParams:
    """Retrieval and selection settings (see the module docstring). The defaults are the
    served ones of :class:`~vllm_retrieval_spec.options.RetrievalSpecOptions`;
    :meth:`from_options` reads any options object."""

    n_min: int = 1
    n_max: int = 16
    max_matches: int = 128
    cont_len: int = 0  # 0: chain_len (a row drafts no deeper than its chain)
    top_k: int = 64
    chain_len: int = 8
    min_ratio: float = 0.1
    tree_holds_chain: bool = False
    use_datastore: bool = True
    use_context: bool = True
    context_weight: float = 256.0
    context_max_matches: int = 64
    context_loops: bool = True
    context_state_votes: int = 0
    output_weight: float = 4.0
    output_max_matches: int = 64
    dense_weight: float = 1.0
    live_weight: float = 4.0

    @property
    def continuation_len(self) -> int:
        """Tokens per continuation: ``cont_len``, or ``chain_len`` (at least 1) when it is 0."""
        return self.cont_len or max(self.chain_len, 1)

    def for_trees(self, trees: bool) -> RestParams:
        """These settings for a step that drafts trees, or chains only (no ``top_k`` tree to build)."""
        return self if trees or not self.top_k else self._chains_only

    @functools.cached_property
    def _chains_only(self) -> RestParams:
        return dataclasses.replace(self, top_k=0)

    @classmethod
    def from_options(cls, options: Any, chain_len: int, **overrides: Any) -> RestParams:
        """The REST settings of a ``RetrievalSpecOptions`` for chains of ``chain_len``; trees
        (``top_k`` nodes) only when ``options.tree`` is set, holding the chain when a goodput
        budget chooses among their nodes (deterministic candidates)."""
        values = {f: getattr(options, f) for f in cls.__dataclass_fields__ if hasattr(options, f)}
        values["top_k"] = options.top_k if options.tree else 0
        values["tree_holds_chain"] = options.tree and options.budget == "auto" and options.candidates == "deterministic"
        return cls(**{**values, "chain_len": chain_len, **overrides})


@dataclass
class RestDrafts(DraftArrays):
    """Trees ``[rows, top_k]`` (-1 padded; parent -1 = the root; all None when ``top_k`` is
    0), chains ``[rows, chain_len]``, each node's ``*_prob`` (its trie weight over its
    parent's) and ``*_source`` (``SOURCE_*`` flags of the sources that continued it), ``match_info``
    ``[rows, 6]`` (datastore match length, context match length, datastore matches found,
    output-index match length, output-index matches found, live match length as given) and,
    when profiled, ``timings_ns`` ``[rows, 4]`` (TIMING_PHASES)."""

    tree_tokens: np.ndarray | None
    tree_parents: np.ndarray | None
    tree_size: np.ndarray | None
    tree_prob: np.ndarray | None
    tree_source: np.ndarray | None
    chain_tokens: np.ndarray
    chain_size: np.ndarray
    chain_prob: np.ndarray
    chain_source: np.ndarray
    match_info: np.ndarray
    timings_ns: np.ndarray | None = None

    def row_match_len(self) -> dict[int, np.ndarray]:
        info = self.match_info
        return {SOURCE_DATASTORE: info[:, 0], SOURCE_CONTEXT: info[:, 1], SOURCE_OUTPUT: info[:, 3],
                SOURCE_LIVE: info[:, 5]}


@dataclass(frozen=True)
class ChanceTable:
    """Calibrated chances that a node is accepted given its parent is, ``chance`` ``[sources,
    match-length buckets, depth buckets, probs]`` float32 (C order, values in [0, 1]), with the
    bucket of each match length (``length_bucket[m]``, int32) and depth (``depth_bucket[d]``, 0 = a
    child of the root); longer or deeper ones take the last entry's. The raw-probability bucket of
    a node is ``int(float32(ratio) * probs)`` clipped to ``[0, probs)``."""

    chance: np.ndarray
    length_bucket: np.ndarray
    depth_bucket: np.ndarray


def rest_retrieve(
    store: Any,
    tokens: np.ndarray,
    lengths: np.ndarray,
    rows: np.ndarray,
    params: RestParams,
    *,
    output_index: Any = None,
    dense: tuple[np.ndarray, ...] | None = None,
    learned: tuple[np.ndarray, ...] | None = None,
    live: tuple[np.ndarray, ...] | None = None,
    chances: ChanceTable | None = None,
    context_states: tuple[Any, np.ndarray] | None = None,
    num_threads: int = 0,
    profile: bool = False,
) -> RestDrafts:
    """Draft for ``tokens[rows]`` (vLLM's ``token_ids_cpu`` layout) from ``store`` (a
    :class:`~vllm_retrieval_spec.datastores.TokenDatastore` or ``ShardedDatastore``, or None for
    context only; one no longer ``usable`` counts as None),
    ``output_index`` (the ``native`` build of an
    :class:`~vllm_retrieval_spec.datastores.output_index.OutputIndex`, or None) and ``dense``
    continuations found elsewhere (DReSD): ``(tokens [rows, k, len], lengths [rows, k])`` or
    ``(tokens, lengths, match_len [rows])``, one row per requested row, each weighing
    ``dense_weight``; ``learned`` the same from the dense index learned from served traffic (its
    own source flag, ``SOURCE_LEARNED``); ``live`` the same from the requests in flight, each
    weighing ``live_weight``. With ``chances`` nodes rank by calibrated path chance, else by weight. A
    sharded store's continuations are sampled through its ``merged_order`` when it has one, else
    selected across its shards and kept in its ``selection_cache`` across calls. With
    ``context_states`` (the ``native`` of a
    :class:`~vllm_retrieval_spec.datastores.context_states.ContextStates` and each requested row's
    slot in it, -1: none) the context occurrence whose last token's producing state is nearest the
    context's last token's counts ``params.context_state_votes`` times. ``num_threads`` caps the threads
    (0: one per core); small batches run on one."""
    ext = load_extension()
    shards = _drafting_store(store)
    arrays = ext.rest_retrieve(
        shards,
        output_index,
        np.ascontiguousarray(tokens, dtype=np.int32),
        np.ascontiguousarray(lengths, dtype=np.int32),
        np.ascontiguousarray(rows, dtype=np.int32),
        _native_params(params),
        **_given_arrays("dense", dense),
        **_given_arrays("learned", learned),
        **_given_arrays("live", live),
        **_table_arrays(chances),
        profile=profile,
        num_threads=num_threads,
        store_cache=getattr(store, "selection_cache", None) if shards else None,
        store_order=getattr(store, "merged_order", None) if shards else None,
        **_states_arrays(context_states),
    )
    return RestDrafts(**arrays)


def _given_arrays(name: str, given: tuple[np.ndarray, ...] | None) -> dict[str, np.ndarray]:
    """The extension's ``<name>_tokens``, ``<name>_lengths`` (and ``<name>_match_len``) arguments."""
    if given is None:
        return {}
    keys = ("tokens", "lengths", "match_len")[: len(given)]
    return {f"{name}_{key}": np.ascontiguousarray(array, dtype=np.int32) for key, array in zip(keys, given)}


def _states_arrays(context_states: tuple[Any, np.ndarray] | None) -> dict[str, Any]:
    """The extension's ``context_states`` and ``state_slots`` arguments."""
    if context_states is None:
        return {}
    states, slots = context_states
    return {"context_states": states, "state_slots": np.ascontiguousarray(slots, dtype=np.int32)}


def _table_arrays(chances: ChanceTable | None) -> dict[str, np.ndarray]:
    """The extension's chance-table arguments (no copy when the arrays are already float32 and
    int32, contiguous)."""
    if chances is None:
        return {}
    return {"chance_table": np.ascontiguousarray(chances.chance, dtype=np.float32),
            "length_bucket": np.ascontiguousarray(chances.length_bucket, dtype=np.int32),
            "depth_bucket": np.ascontiguousarray(chances.depth_bucket, dtype=np.int32)}


def native_suffix_store(store: Any) -> Any:
    """The extension's ``SuffixStore`` over ``store``'s tokens, suffix array, separator and
    first-token offsets (when it has them)."""
    return load_extension().SuffixStore(store.tokens, store.suffix_array, store.separator,
                                        getattr(store, "first_token_offsets", None))


def _drafting_store(store: Any) -> list[Any] | None:
    """``store`` as the kernel drafts from it: the ``SuffixStore`` of each of its ``shards`` (one
    for a single-array store); None for no store, or for one that is no longer ``usable`` (its
    background checksum failed)."""
    if store is None or not getattr(store, "usable", True):
        return None
    return [native_suffix_store(shard) for shard in store.shards]


@functools.lru_cache(maxsize=64)
def _native_params(params: RestParams) -> Any:
    """``params`` as the extension's ``RestParams`` (every field copied, ``cont_len`` resolved)."""
    native = load_extension().RestParams()
    for field in dataclasses.fields(params):
        setattr(native, field.name, getattr(params, field.name))
    native.cont_len = params.continuation_len
    return native
