"""REST retrieval (exact-match retrieval, REST paper Algorithms 1 and 2): the front end of the C++ kernel.

Per requested row: the longest suffix of the context (``n_max`` down to ``n_min`` tokens) found
in the datastore, up to ``max_matches`` of its continuations (``cont_len`` tokens, stopping at
document separators, evenly strided over the suffix-array range), the same from the
cross-request output index (up to ``output_max_matches``, each weighing ``output_weight``), the
dense continuations given by the caller (DReSD's neighbours, each weighing ``dense_weight``),
plus the continuations of the longest suffix found earlier in the row's own context (each
weighing ``context_weight``), merged into one trie. Output: the ``top_k`` heaviest nodes as a
subtree, breadth-first (parents before children), and the heaviest chain, which stops when a
child keeps less than ``min_ratio`` of its parent's weight. Ties: heavier, shallower, smaller
token, earlier-created node. The brute-force reference is
:mod:`vllm_retrieval_spec.kernels.rest_reference`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_retrieval_spec.drafts import SOURCE_CONTEXT, SOURCE_DATASTORE, SOURCE_OUTPUT, DraftArrays
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
    cont_len: int = 10
    top_k: int = 64
    chain_len: int = 8
    min_ratio: float = 0.1
    use_datastore: bool = True
    use_context: bool = True
    context_weight: float = 256.0
    context_max_matches: int = 64
    output_weight: float = 4.0
    output_max_matches: int = 64
    dense_weight: float = 1.0

    @classmethod
    def from_options(cls, options: Any, chain_len: int, **overrides: Any) -> RestParams:
        """The REST settings of a ``RetrievalSpecOptions`` for chains of ``chain_len``; trees
        (``top_k`` nodes) only when ``options.tree`` is set."""
        values = {f: getattr(options, f) for f in cls.__dataclass_fields__ if hasattr(options, f)}
        values["top_k"] = options.top_k if options.tree else 0
        return cls(**{**values, "chain_len": chain_len, **overrides})


@dataclass
class RestDrafts(DraftArrays):
    """Trees ``[rows, top_k]`` (-1 padded; parent -1 = the root; all None when ``top_k`` is
    0), chains ``[rows, chain_len]``, each node's ``*_prob`` (its trie weight over its
    parent's) and ``*_source`` (``SOURCE_*`` flags of the sources that continued it), ``match_info``
    ``[rows, 5]`` (datastore match length, context match length, datastore matches found,
    output-index match length, output-index matches found) and,
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
        return {SOURCE_DATASTORE: info[:, 0], SOURCE_CONTEXT: info[:, 1], SOURCE_OUTPUT: info[:, 3]}


def rest_retrieve(
    store: Any,
    tokens: np.ndarray,
    lengths: np.ndarray,
    rows: np.ndarray,
    params: RestParams,
    *,
    output_index: Any = None,
    dense: tuple[np.ndarray, np.ndarray] | None = None,
    num_threads: int = 0,
    profile: bool = False,
) -> RestDrafts:
    """Draft for ``tokens[rows]`` (vLLM's ``token_ids_cpu`` layout) from ``store`` (a
    :class:`~vllm_retrieval_spec.datastores.TokenDatastore`, or None for context only; one no
    longer ``usable`` counts as None),
    ``output_index`` (the ``native`` build of an
    :class:`~vllm_retrieval_spec.datastores.output_index.OutputIndex`, or None) and ``dense``
    continuations found elsewhere (DReSD): ``(tokens [rows, k, len], lengths [rows, k])``, one
    row per requested row, each weighing ``dense_weight``.
    ``num_threads`` caps the threads (0: one per core); small batches run on one."""
    ext = load_extension()
    arrays = ext.rest_retrieve(
        _drafting_store(store),
        output_index,
        np.ascontiguousarray(tokens, dtype=np.int32),
        np.ascontiguousarray(lengths, dtype=np.int32),
        np.ascontiguousarray(rows, dtype=np.int32),
        _native_params(params),
        dense_tokens=None if dense is None else np.ascontiguousarray(dense[0], dtype=np.int32),
        dense_lengths=None if dense is None else np.ascontiguousarray(dense[1], dtype=np.int32),
        profile=profile,
        num_threads=num_threads,
    )
    return RestDrafts(**arrays)


def native_suffix_store(store: Any) -> Any:
    """The extension's ``SuffixStore`` over ``store``'s tokens, suffix array, separator and
    first-token offsets (when it has them)."""
    return load_extension().SuffixStore(store.tokens, store.suffix_array, store.separator,
                                        getattr(store, "first_token_offsets", None))


def _drafting_store(store: Any) -> Any:
    """``store`` as the kernel drafts from it: None for no store, or for a
    :class:`~vllm_retrieval_spec.datastores.TokenDatastore` that is no longer ``usable`` (its
    background checksum failed)."""
    return None if store is None or not getattr(store, "usable", True) else native_suffix_store(store)


@functools.lru_cache(maxsize=64)
def _native_params(params: RestParams) -> Any:
    """``params`` as the extension's ``RestParams`` (every field copied)."""
    native = load_extension().RestParams()
    for field in dataclasses.fields(params):
        setattr(native, field.name, getattr(params, field.name))
    return native
