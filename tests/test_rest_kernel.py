"""The C++ REST retrieval equals its brute-force Python reference, exactly."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydivsufsort import divsufsort

from vllm_retrieval_spec.datastores.output_index import SEPARATOR, OutputIndex
from vllm_retrieval_spec.datastores.reader import first_token_offsets
from vllm_retrieval_spec.drafts import (
    NUM_SOURCE_CODES,
    SOURCE_CONTEXT,
    SOURCE_DATASTORE,
    SOURCE_DENSE,
    SOURCE_LEARNED,
    SOURCE_LIVE,
    SOURCE_OUTPUT,
    DraftNodes,
)
from vllm_retrieval_spec.goodput.calibration import AcceptanceCalibration
from vllm_retrieval_spec.kernels.rest import ChanceTable, RestParams, rest_retrieve
from vllm_retrieval_spec.kernels.rest_reference import rest_retrieve_reference
from vllm_retrieval_spec.options import RetrievalSpecOptions


def make_store(documents: list[list[int]], token_dtype=np.uint16, sa_dtype=np.int32, vocab_size=None):
    """A store as the builder makes it; with ``vocab_size``, also the first-token offsets."""
    separator = int(np.iinfo(token_dtype).max)
    flat: list[int] = []
    for document in documents:
        flat += [*document, separator]
    tokens = np.array(flat, dtype=token_dtype)
    suffix_array = divsufsort(tokens).astype(sa_dtype) if len(tokens) else np.zeros(0, sa_dtype)
    offsets = None if vocab_size is None else first_token_offsets(tokens, separator, vocab_size)
    store = SimpleNamespace(tokens=tokens, suffix_array=suffix_array, separator=separator,
                            first_token_offsets=offsets)
    store.shards = (store,)  # one suffix array
    return store


def pack(contexts):
    width = max([len(c) for c in contexts] + [1])
    tokens = np.full((len(contexts), width), 12345, dtype=np.int32)
    for row, context in enumerate(contexts):
        tokens[row, : len(context)] = context
    return tokens, np.array([len(c) for c in contexts], np.int32)


def pack_dense(dense):
    """Per-row lists of continuations as the kernel's ``(tokens [rows, k, len], lengths [rows, k])``."""
    if dense is None:
        return None
    k = max([len(row) for row in dense] + [1])
    width = max([len(c) for row in dense for c in row] + [1])
    tokens = np.full((len(dense), k, width), 777, dtype=np.int32)
    lengths = np.zeros((len(dense), k), dtype=np.int32)
    for r, row in enumerate(dense):
        for i, continuation in enumerate(row):
            tokens[r, i, : len(continuation)] = continuation
            lengths[r, i] = len(continuation)
    return tokens, lengths


def pack_given(given, match_len):
    """Per-row given continuations (and match lengths) as the kernel's ``dense`` or ``live`` argument."""
    packed = pack_dense(given)
    return packed if packed is None or match_len is None else (*packed, np.array(match_len, np.int32))


def kernel_results(store, contexts, params, num_threads=0, output=None, dense=None, live=None, live_match_len=None,
                   chances=None, dense_match_len=None, learned=None, learned_match_len=None):
    tokens, lengths = pack(contexts)
    out = rest_retrieve(store, tokens, lengths, np.arange(len(contexts)), params, num_threads=num_threads,
                        output_index=None if output is None else output.native,
                        dense=pack_given(dense, dense_match_len), learned=pack_given(learned, learned_match_len),
                        live=pack_given(live, live_match_len), chances=chances)
    results = []
    for i in range(len(contexts)):
        tree_size, chain_size = int(out.tree_size[i]), int(out.chain_size[i])
        results.append({
            "tree": out.tree(i), "chain": out.chain(i), "match_info": out.match_info[i].tolist(),
            "tree_nodes": (out.tree_prob[i, :tree_size].tolist(), out.tree_source[i, :tree_size].tolist()),
            "chain_nodes": (out.chain_prob[i, :chain_size].tolist(), out.chain_source[i, :chain_size].tolist()),
        })
    return results


def reference_results(store, contexts, params, output=None, dense=None, live=None, live_match_len=None,
                      chances=None, dense_match_len=None, learned=None, learned_match_len=None):
    return rest_retrieve_reference(
        None if store is None else store.tokens, 0 if store is None else store.separator, contexts, params,
        None if output is None else output.tokens, SEPARATOR, dense, live, live_match_len, chances, dense_match_len,
        learned, learned_match_len,
    )


def output_index_of(sequences):
    index = OutputIndex(capacity_tokens=10_000, background=False)
    for sequence in sequences:
        index.add(np.array(sequence))
    return index


def assert_tree_is_parents_first(tree_tokens, tree_parents):
    for index, parent in enumerate(tree_parents):
        assert -1 <= parent < index


params_strategy = st.builds(
    RestParams,
    n_min=st.integers(1, 3),
    n_max=st.integers(3, 6),
    max_matches=st.integers(1, 12),
    cont_len=st.integers(1, 5),
    top_k=st.integers(1, 12),
    chain_len=st.integers(1, 6),
    min_ratio=st.sampled_from([0.0, 0.2, 0.5]),
    tree_holds_chain=st.booleans(),
    use_datastore=st.booleans(),
    use_context=st.booleans(),
    context_loops=st.booleans(),
    context_weight=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    context_max_matches=st.integers(1, 8),
    output_weight=st.sampled_from([0.0, 1.0, 2.5]),
    output_max_matches=st.integers(0, 8),
    dense_weight=st.sampled_from([0.0, 1.0, 7.0]),
)
documents_strategy = st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=6)
# Context ids 0..4: id 4 is outside a vocabulary of 4 (no suffix can start with it).
contexts_strategy = st.lists(st.lists(st.integers(0, 4), max_size=25), min_size=1, max_size=5)


@settings(max_examples=400, deadline=None)
@given(documents=documents_strategy, contexts=contexts_strategy, params=params_strategy,
       wide=st.booleans(), vocab_size=st.sampled_from([None, 4, 6]), num_threads=st.integers(0, 3),
       outputs=st.lists(st.lists(st.integers(0, 4), max_size=20), max_size=4), data=st.data())
def test_kernel_matches_brute_force_reference(documents, contexts, params, wide, vocab_size, num_threads, outputs,
                                              data):
    store = make_store(documents, np.uint32 if wide else np.uint16, np.int64 if wide else np.int32, vocab_size)
    output = output_index_of(outputs)
    dense = data.draw(st.none() | st.lists(st.lists(st.lists(st.integers(0, 4), max_size=7), max_size=5),
                                           min_size=len(contexts), max_size=len(contexts)))
    got = kernel_results(store, contexts, params, num_threads, output, dense)
    assert got == reference_results(store, contexts, params, output, dense)
    for result in got:
        assert_tree_is_parents_first(*result["tree"])


@pytest.mark.parametrize("vocab_size", [None, 10])
def test_matches_stop_at_document_separators_and_the_end_of_the_store(vocab_size):
    store = make_store([[1, 2, 3], [1, 2, 4, 5, 6, 7], [9, 1, 2]], vocab_size=vocab_size)
    params = RestParams(n_min=1, n_max=4, cont_len=4, top_k=8, chain_len=4, min_ratio=0.0, use_context=False)
    (result,) = kernel_results(store, [[8, 1, 2]], params)
    assert result["match_info"] == [2, 0, 3, 0, 0, 0]  # "1 2" three times, one at the very end
    tree_tokens, _ = result["tree"]
    assert sorted(tree_tokens) == [3, 4, 5, 6, 7]
    assert result == reference_results(store, [[8, 1, 2]], params)[0]


def test_vocab_ids_at_the_dtype_limits():
    top16 = np.iinfo(np.uint16).max - 1  # the largest id a uint16 store can hold
    store = make_store([[top16, 0, top16, 1], [top16, 0, 2]])
    params = RestParams(n_min=1, n_max=3, top_k=6, chain_len=3, min_ratio=0.0)
    contexts = [[5, top16], [top16, 0]]
    assert kernel_results(store, contexts, params) == reference_results(store, contexts, params)
    top32 = np.iinfo(np.int32).max  # vLLM hands token ids over as int32
    wide = make_store([[top32, 7, top32, 8]], np.uint32, np.int64)
    assert kernel_results(wide, [[top32]], params) == reference_results(wide, [[top32]], params)


@pytest.mark.parametrize("context", [[], [42], [3, 3, 3]])
def test_empty_store_no_match_and_empty_context(context):
    params = RestParams(n_min=1, n_max=4, top_k=4, chain_len=4, use_context=False)
    store = make_store([[1, 2, 1, 2]])
    (result,) = kernel_results(store, [context] if context else [[]], params)
    assert result["tree"] == ([], []) and result["chain"] == []


def test_context_only_when_no_store():
    params = RestParams(n_min=1, n_max=4, top_k=4, chain_len=3, min_ratio=0.0)
    (result,) = kernel_results(None, [[1, 2, 3, 1, 2]], params)
    assert result["chain"] == [3, 1, 2]
    assert result["match_info"] == [0, 2, 0, 0, 0, 0]


def test_context_weight_tips_the_chain():
    store = make_store([[1, 2, 9], [1, 2, 9]])
    context = [1, 2, 7, 0, 1, 2]
    light = RestParams(n_min=1, n_max=2, chain_len=1, min_ratio=0.0, context_weight=1.0)
    heavy = RestParams(n_min=1, n_max=2, chain_len=1, min_ratio=0.0, context_weight=3.0)
    assert kernel_results(store, [context], light)[0]["chain"] == [9]
    assert kernel_results(store, [context], heavy)[0]["chain"] == [7]


def test_profile_reports_four_phases():
    store = make_store([[1, 2, 3, 4]] * 10)
    tokens, lengths = pack([[1, 2]])
    out = rest_retrieve(store, tokens, lengths, np.array([0]), RestParams(), profile=True)
    assert out.timings_ns.shape == (1, 4) and (out.timings_ns >= 0).all()


def test_bad_arguments_are_rejected():
    store = make_store([[1, 2]])
    tokens, lengths = pack([[1]])
    with pytest.raises(ValueError, match="n_min <= n_max"):
        rest_retrieve(store, tokens, lengths, np.array([0]), RestParams(n_min=3, n_max=2))
    with pytest.raises(IndexError, match="rows\\[0\\] = 4"):
        rest_retrieve(store, tokens, lengths, np.array([4]), RestParams())


def test_defaults_are_the_served_options():
    options = RetrievalSpecOptions()
    for field in dataclasses.fields(RestParams):
        if hasattr(options, field.name):
            assert getattr(RestParams(), field.name) == getattr(options, field.name), field.name


def test_a_tree_holding_the_chain_keeps_it_whole_and_fills_up_with_the_best_branches():
    """Context continuations 1 2 3 4 (twice), 1 2 3 5 and 1 9 6 (twice): by weight a 4-node tree
    takes the branch 9 before the chain's depth-4 node; holding the chain it keeps 1 2 3 4; with
    room to spare the best other nodes follow the main path."""
    context = np.array([8, 1, 2, 3, 4, 8, 1, 2, 3, 4, 8, 1, 2, 3, 5, 8, 1, 9, 6, 8, 1, 9, 6, 8], np.int32)
    base = RestParams(n_min=1, n_max=1, cont_len=4, top_k=4, chain_len=4, min_ratio=0.0, use_datastore=False,
                      context_weight=1.0)

    def tree(**changes):
        found = rest_retrieve(None, context[None, :], np.array([len(context)], np.int32), np.array([0], np.int32),
                              dataclasses.replace(base, **changes))
        assert found.chain(0) == [1, 2, 3, 4]
        return found.tree(0)

    assert tree() == ([1, 2, 3, 9], [-1, 0, 1, 0])
    assert tree(tree_holds_chain=True) == ([1, 2, 3, 4], [-1, 0, 1, 2])
    assert tree(tree_holds_chain=True, top_k=6) == ([1, 2, 3, 4, 9, 6], [-1, 0, 1, 2, 0, 4])


def test_large_trees_match_the_reference():
    rng = np.random.default_rng(0)
    store = make_store([rng.integers(0, 4, 40).tolist() for _ in range(30)])
    contexts = [rng.integers(0, 4, 30).tolist() for _ in range(4)]
    params = RestParams(n_max=3, max_matches=64, cont_len=8, top_k=200, chain_len=8, min_ratio=0.0,
                        context_weight=2.0)
    got = kernel_results(store, contexts, params)
    assert got == reference_results(store, contexts, params)
    assert max(len(result["tree"][0]) for result in got) > 100


@pytest.mark.parametrize("wide", [False, True])
def test_corrupt_suffix_arrays_and_offsets_are_never_read_out_of_bounds(wide):
    store = make_store([[1, 2, 3, 1, 2], [2, 1]], np.uint32 if wide else np.uint16,
                       np.int64 if wide else np.int32, vocab_size=4)
    size = len(store.tokens)
    store.suffix_array[::2] = -(2**31)  # entries outside [0, size), both signs
    store.suffix_array[1::3] = 2**31 - 1
    store.first_token_offsets[:] = [size * 4, -size, 2 * size, -1, size * 9][: len(store.first_token_offsets)]
    contexts = [[1, 2], [2, 1, 2], [3], [0, 1, 2, 3]]
    params = RestParams(n_max=4, max_matches=8, cont_len=4, top_k=8, chain_len=4)
    for result in kernel_results(store, contexts, params):  # anything, but no crash
        assert_tree_is_parents_first(*result["tree"])


def test_output_index_continuations_join_the_trie_with_their_own_weight():
    output = output_index_of([[1, 2, 9, 9], [1, 2, 9, 8]])
    params = RestParams(n_min=1, n_max=2, cont_len=2, top_k=4, chain_len=2, min_ratio=0.0, use_context=False,
                        output_weight=3.0)
    (result,) = kernel_results(None, [[5, 1, 2]], params, output=output)
    assert result["match_info"] == [0, 0, 0, 2, 2, 0]
    assert result["chain"] == [9, 8]  # a tie goes to the smaller token
    assert result["chain_nodes"] == ([1.0, 0.5], [SOURCE_OUTPUT, SOURCE_OUTPUT])
    assert result == reference_results(None, [[5, 1, 2]], params, output)[0]


def test_dense_continuations_join_the_trie_with_their_own_weight_and_flag():
    params = RestParams(cont_len=3, top_k=6, chain_len=3, min_ratio=0.0, use_datastore=False, dense_weight=2.0,
                        context_weight=5.0)
    dense = [[[7, 8, 9, 9], [7, 8, 6], [5]]]  # cut to cont_len
    (result,) = kernel_results(None, [[1, 2, 3]], params, dense=dense)
    assert result["chain"] == [7, 8, 6]  # a tie goes to the smaller token
    assert result["chain_nodes"] == ([pytest.approx(2 / 3), 1.0, 0.5], [SOURCE_DENSE] * 3)
    assert result == reference_results(None, [[1, 2, 3]], params, dense=dense)[0]
    with pytest.raises(ValueError, match="dense_lengths must lie"):
        tokens, lengths = pack([[1, 2, 3]])
        dense_tokens, dense_lengths = pack_dense(dense)
        rest_retrieve(None, tokens, lengths, np.array([0]), params, dense=(dense_tokens, dense_lengths + 5))


def test_learned_dense_continuations_weigh_as_dense_ones_under_their_own_flag_and_match_length():
    """The learned index's neighbours count with ``dense_weight`` but are calibrated as their own
    source: a node both continue carries both flags and the longer of the two match lengths."""
    params = RestParams(cont_len=3, top_k=6, chain_len=3, min_ratio=0.0, use_datastore=False, dense_weight=2.0,
                        context_weight=5.0)
    dense, learned = [[[7, 8], [5]]], [[[7, 6, 6]]]
    (result,) = kernel_results(None, [[1, 2, 3]], params, dense=dense, dense_match_len=[2], learned=learned,
                               learned_match_len=[9])
    assert result["chain"] == [7, 6, 6]  # 7: two of three continuations; 8 and 6 tie: the smaller token
    assert result["chain_nodes"] == ([pytest.approx(2 / 3), 0.5, 1.0],
                                     [SOURCE_DENSE | SOURCE_LEARNED, SOURCE_LEARNED, SOURCE_LEARNED])
    assert result == reference_results(None, [[1, 2, 3]], params, dense=dense, dense_match_len=[2], learned=learned,
                                       learned_match_len=[9])[0]
    one_each = DraftNodes(np.array([[7, 7]]), np.array([[-1, -1]]), np.array([2]), np.ones((1, 2), np.float32),
                          np.array([[SOURCE_DENSE, SOURCE_LEARNED]], np.int8), np.array([[9, 9]], np.int32))
    dense_bucket, learned_bucket = AcceptanceCalibration.buckets(one_each, np.zeros((1, 2), np.int64))[0]
    assert dense_bucket != learned_bucket  # calibrated apart
    with pytest.raises(ValueError, match="learned_lengths must lie"):
        tokens, lengths = pack([[1, 2, 3]])
        learned_tokens, learned_lengths = pack_dense(learned)
        rest_retrieve(None, tokens, lengths, np.array([0]), params, learned=(learned_tokens, learned_lengths + 5))


def random_chance_table(seed: int) -> ChanceTable:
    """A small table of few distinct chances (ties are common) with random bucket lookups."""
    rng = np.random.default_rng(seed)
    shape = (NUM_SOURCE_CODES, *rng.integers(1, 4, 3))
    return ChanceTable(rng.choice([0.0, 0.25, 0.5, 1.0], shape).astype(np.float32),
                       rng.integers(0, shape[1], rng.integers(1, 8)).astype(np.int32),
                       rng.integers(0, shape[2], rng.integers(1, 8)).astype(np.int32))


def learned_chance_table(seed: int) -> ChanceTable:
    """The goodput calibration's table after random observations."""
    rng = np.random.default_rng(seed)
    calibration = AcceptanceCalibration()
    buckets = rng.integers(0, calibration.accepted.size, 400)
    calibration.observe(buckets, rng.uniform(0, 1, 400), rng.uniform(0, 1, 400) < 0.6)
    return calibration.chance_table()


given_strategy = st.none() | st.lists(st.lists(st.integers(0, 4), max_size=25), max_size=4)


@settings(max_examples=300, deadline=None)
@given(documents=documents_strategy, contexts=contexts_strategy, params=params_strategy,
       cont_len=st.integers(0, 30), chain_len=st.integers(0, 30), top_k=st.integers(1, 40),
       live_weight=st.sampled_from([0.0, 1.0, 4.0]), table_seed=st.integers(0, 2**32 - 1), learned=st.booleans(),
       outputs=st.lists(st.lists(st.integers(0, 4), max_size=30), max_size=4), data=st.data())
def test_calibrated_selection_matches_the_reference(documents, contexts, params, cont_len, chain_len, top_k,
                                                    live_weight, table_seed, learned, outputs, data):
    """Selection by calibrated path chance, long continuations (0: chain_len) and live, dense and
    learned-dense continuations."""
    store = make_store(documents, vocab_size=4)
    output = output_index_of(outputs)
    params = dataclasses.replace(params, cont_len=cont_len, chain_len=chain_len, top_k=top_k, live_weight=live_weight)
    rows = len(contexts)
    live = data.draw(st.none() | st.lists(given_strategy.filter(lambda x: x is not None), min_size=rows, max_size=rows))
    live_match_len = data.draw(st.none() | st.lists(st.integers(0, 40), min_size=rows, max_size=rows))
    dense = data.draw(st.none() | st.lists(st.lists(st.lists(st.integers(0, 4), max_size=9), max_size=3),
                                           min_size=rows, max_size=rows))
    dense_match_len = data.draw(st.none() | st.lists(st.integers(0, 32), min_size=rows, max_size=rows))
    learned_dense = data.draw(st.none() | st.lists(st.lists(st.lists(st.integers(0, 4), max_size=9), max_size=3),
                                                   min_size=rows, max_size=rows))
    learned_match_len = data.draw(st.none() | st.lists(st.integers(0, 32), min_size=rows, max_size=rows))
    chances = (learned_chance_table if learned else random_chance_table)(table_seed)
    given = (dense, live, live_match_len, chances, dense_match_len, learned_dense, learned_match_len)
    got = kernel_results(store, contexts, params, 0, output, *given)
    assert got == reference_results(store, contexts, params, output, *given)
    for result in got:
        assert_tree_is_parents_first(*result["tree"])


@pytest.mark.parametrize("loops", [True, False])
def test_a_looping_context_is_drafted_around_its_loop(loops):
    """The output repeats "7 8 9": the most recent occurrence of the last tokens ends three
    tokens before the end, one period. With context loops its continuation goes on around the
    loop; without, it stops at the end of the context. A match shorter than its period (the
    last token alone, seen once two tokens back) does not loop."""
    params = RestParams(cont_len=8, chain_len=8, top_k=8, use_datastore=False, context_loops=loops, min_ratio=0.0)
    looping, = kernel_results(None, [[1, 2, 7, 8, 9, 7, 8, 9]], params)
    assert looping["chain"] == ([7, 8, 9, 7, 8, 9, 7, 8] if loops else [7, 8, 9])
    once, = kernel_results(None, [[1, 5, 6, 5]], params)
    assert once["chain"] == [6, 5]
    for contexts in ([[1, 2, 7, 8, 9, 7, 8, 9]], [[1, 5, 6, 5]]):
        assert kernel_results(None, contexts, params) == reference_results(None, contexts, params)


def test_a_long_context_match_outranks_a_frequent_short_datastore_continuation():
    """By weight, 100 datastore continuations of a 1-token match win; by calibrated chance, the
    40-token copy from the context is drafted whole."""
    copy = list(range(100, 160))
    context = [*copy, *copy[:20]]  # the copy's first 20 tokens again: the next 40 are in the context
    store = make_store([[copy[19], 7, 8, 9]] * 100)
    params = RestParams(cont_len=0, chain_len=40, top_k=40, context_weight=1.0, n_max=16)
    by_weight, = kernel_results(store, [context], params)
    assert by_weight["chain"][:3] == [7, 8, 9]
    calibration = AcceptanceCalibration()
    for source, length, accepted in ((SOURCE_CONTEXT, 16, True), (SOURCE_DATASTORE, 1, False)):
        nodes = DraftNodes(np.zeros((1, 40), np.int32), np.arange(-1, 39, dtype=np.int32)[None], np.array([40]),
                           np.ones((1, 40), np.float32), np.full((1, 40), source, np.int8),
                           np.full((1, 40), length, np.int32))
        bucket = calibration.buckets(nodes, np.arange(40)[None])
        for _ in range(20):
            calibration.observe(bucket, np.full(bucket.shape, 0.5), np.full(bucket.shape, accepted))
    by_chance, = kernel_results(store, [context], params, chances=calibration.chance_table())
    assert by_chance["chain"] == copy[20:60]
    assert by_chance["match_info"][:2] == [1, 16]
    assert by_chance == reference_results(store, [context], params, chances=calibration.chance_table())[0]


def test_live_continuations_join_the_trie_with_their_weight_flag_and_match_length():
    params = RestParams(cont_len=3, top_k=6, chain_len=3, min_ratio=0.0, use_datastore=False, live_weight=2.0,
                        dense_weight=1.0, context_weight=5.0)
    live = [[[7, 8, 9, 9], [7, 8, 6]]]  # cut to cont_len
    (result,) = kernel_results(None, [[1, 2, 3]], params, dense=[[[7]]], live=live, live_match_len=[12])
    assert result["chain"] == [7, 8, 6]
    live_only = SOURCE_LIVE
    assert result["chain_nodes"] == ([1.0, pytest.approx(0.8), 0.5], [SOURCE_DENSE | SOURCE_LIVE, live_only, live_only])
    assert result["match_info"] == [0, 0, 0, 0, 0, 12]
    assert result == reference_results(None, [[1, 2, 3]], params, dense=[[[7]]], live=live, live_match_len=[12])[0]
    tokens, lengths = pack([[1, 2, 3]])
    live_tokens, live_lengths = pack_dense(live)
    with pytest.raises(ValueError, match="live_lengths must lie"):
        rest_retrieve(None, tokens, lengths, np.array([0]), params, live=(live_tokens, live_lengths + 5))
    with pytest.raises(ValueError, match="live_match_len must be >= 0"):
        rest_retrieve(None, tokens, lengths, np.array([0]), params, live=(live_tokens, live_lengths, np.array([-1])))


def test_bad_chance_tables_are_rejected_and_values_out_of_range_read_clamped():
    tokens, lengths = pack([[1, 2, 1, 3, 1]])
    table = random_chance_table(0)
    params = RestParams(use_datastore=False, top_k=8)
    wild = table.chance * 3 - 1
    wild.reshape(-1)[::7] = np.nan
    expected = rest_retrieve(None, tokens, lengths, np.array([0]), params,
                             chances=dataclasses.replace(table, chance=np.clip(np.nan_to_num(wild), 0, 1)))
    found = rest_retrieve(None, tokens, lengths, np.array([0]), params, chances=dataclasses.replace(table, chance=wild))
    assert found.tree(0) == expected.tree(0) and found.chain(0) == expected.chain(0)
    for bad, message in ((dataclasses.replace(table, chance=table.chance[:64]), ">= 128 sources"),
                         (dataclasses.replace(table, depth_bucket=np.array([99], np.int32)), "depth_bucket entries")):
        with pytest.raises(ValueError, match=message):
            rest_retrieve(None, tokens, lengths, np.array([0]), RestParams(use_datastore=False), chances=bad)


def test_continuations_follow_the_chain_length_by_default():
    assert RestParams(chain_len=32).continuation_len == 32
    assert RestParams(chain_len=0).continuation_len == 1
    assert RestParams(chain_len=32, cont_len=10).continuation_len == 10
