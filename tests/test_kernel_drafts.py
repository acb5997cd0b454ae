"""Kernel results implement the Drafts protocol; the C++ draft merge equals its reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from vllm_retrieval_spec.drafts import Drafts
from vllm_retrieval_spec.kernels import context_ngram
from vllm_retrieval_spec.kernels.draft_merge import conditional_probs, merge_drafts
from vllm_retrieval_spec.kernels.draft_merge_reference import merge_drafts_reference
from vllm_retrieval_spec.kernels.rest import RestParams, rest_retrieve
from vllm_retrieval_spec.ngrams.drafts import MixedStrategy, NgramDrafts, mixed_drafts

from conftest import small_ngram_table


@st.composite
def draft_blocks(draw) -> tuple[np.ndarray, np.ndarray]:
    """Drafts [rows, k, w] over a tiny vocabulary (-1 included: bigram padding) and lengths."""
    rows, k, w = draw(st.integers(0, 6)), draw(st.integers(1, 6)), draw(st.integers(1, 6))
    tokens = draw(arrays(np.int32, (rows, k, w), elements=st.integers(-1, 3)))
    lengths = draw(arrays(np.int32, (rows, k), elements=st.integers(0, w)))
    return tokens, lengths


@settings(max_examples=300, deadline=None)
@given(block=draft_blocks(), num_threads=st.integers(0, 3), weighted=st.booleans())
def test_merge_matches_reference(block, num_threads, weighted):
    weights = np.random.default_rng(len(block[1])).random(block[1].shape).astype(np.float32) if weighted else None
    got = merge_drafts(*block, weights, num_threads=num_threads)
    expected = merge_drafts_reference(*block, weights)
    for name, a, b in zip(("tree_tokens", "tree_parents", "tree_size", "tree_weight"), got, expected):
        assert a.dtype == b.dtype and np.array_equal(a, b), name


def test_merge_shares_prefixes_in_draft_order():
    drafts = np.array([[[1, 2, 3], [1, 2, 4], [5, 6, -1]]], dtype=np.int32)
    lengths = np.array([[3, 3, 2]], dtype=np.int32)
    tokens, parents, size, weight = merge_drafts(drafts, lengths, np.array([[0.5, 0.25, 0.25]], np.float32))
    assert size.tolist() == [6]
    assert tokens[0].tolist() == [1, 2, 3, 4, 5, 6, -1, -1, -1]
    assert parents[0].tolist() == [-1, 0, 1, 1, -1, 4, -1, -1, -1]
    assert weight[0, :6].tolist() == [0.75, 0.75, 0.5, 0.25, 0.25, 0.25]
    q = conditional_probs(parents, weight, lengths, np.array([[0.5, 0.25, 0.25]], np.float32))
    assert q[0, :6].tolist() == pytest.approx([0.75, 1.0, 2 / 3, 1 / 3, 0.25, 1.0]) and q[0, 6:].tolist() == [0] * 3


@pytest.mark.parametrize("length", [-1, 4])
def test_merge_rejects_lengths_outside_the_draft_width(length):
    with pytest.raises(IndexError, match=r"lengths\[0, 1\]"):
        merge_drafts(np.zeros((1, 2, 3), np.int32), np.array([[1, length]], np.int32))


# ---- the Drafts protocol ----------------------------------------------------------------------


def assert_chains(drafts, expected: list[list[int]]) -> None:
    assert isinstance(drafts, Drafts)
    for array in (drafts.chain_tokens, drafts.chain_size):
        assert isinstance(array, np.ndarray) and array.dtype == np.int32
    assert [drafts.chain(i) for i in range(len(expected))] == expected


def contexts() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tokens = np.array([[5, 7, 8, 5, 9, 5], [1, 2, 0, 0, 0, 0]], dtype=np.int32)
    return tokens, np.array([6, 2], np.int32), np.arange(2, dtype=np.int32)


def test_rest_drafts_have_trees_only_with_top_k():
    tokens, lengths, rows = contexts()
    with_trees = rest_retrieve(None, tokens, lengths, rows, RestParams(top_k=4, chain_len=3, min_ratio=0.0))
    assert_chains(with_trees, [[7, 8, 5], []])
    assert with_trees.tree(0) == ([7, 8, 9, 5], [-1, 0, -1, 2])  # depth-first: the main path 7, 8 first
    chains = rest_retrieve(None, tokens, lengths, rows, RestParams(top_k=0, chain_len=3, min_ratio=0.0))
    assert_chains(chains, [[7, 8, 5], []])
    assert chains.tree_tokens is None and chains.tree_parents is None and chains.tree_size is None
    with pytest.raises(ValueError, match="no trees"):
        chains.tree(0)


def test_context_ngram_drafts_chain_is_slot_zero():
    tokens, lengths, rows = contexts()
    drafts = context_ngram(tokens, lengths, rows, num_drafts=2, draft_len=2, q_min=1, q_max=1)
    assert_chains(drafts, [[9, 5], []])
    assert drafts.draft(0, 1) == [7, 8]
    assert drafts.tree_tokens is None


def test_ngram_drafts_build_trees_only_when_asked():
    tokens, lengths, rows = contexts()
    strategy = MixedStrategy(num_drafts=3, draft_len=2, context_len=1, mixing="context-first")
    drafts = mixed_drafts(small_ngram_table(), tokens, lengths, rows, strategy)
    assert_chains(drafts, [[9, 5], [3, 4]])
    assert drafts.tree_tokens is None
    trees = mixed_drafts(small_ngram_table(), tokens, lengths, rows, strategy, with_trees=True)
    expected = merge_drafts_reference(trees.tokens, trees.lengths, trees.weights)
    assert all(np.array_equal(a, b) for a, b in zip((trees.tree_tokens, trees.tree_parents, trees.tree_size),
                                                     expected))
    assert trees.tree_prob[0, :6].tolist() == pytest.approx([1 / 3, 1, 1 / 3, 1, 1 / 3, 1])
    assert drafts.tree(0) == trees.tree(0) == ([9, 5, 7, 8, 6, 7], [-1, 0, -1, 2, -1, 4])


def test_ngram_drafts_made_directly_build_their_trees_on_first_use():
    drafts = NgramDrafts(
        tokens=np.array([[[1, 2], [1, 3]]], dtype=np.int32),
        lengths=np.array([[2, 2]], dtype=np.int32),
        from_context=np.array([2], dtype=np.int32),
    )
    assert drafts.tree(0) == ([1, 2, 3], [-1, 0, 0])
    assert drafts.tree_size.tolist() == [3]
