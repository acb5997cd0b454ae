"""The C++ context n-gram matcher equals its Python reference, exactly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_retrieval_spec.kernels import context_ngram, extension_backends
from vllm_retrieval_spec.kernels.context_ngram_reference import context_ngram_reference


def pack(contexts: list[list[int]], width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    width = max([len(c) for c in contexts] + [1]) if width is None else width
    tokens = np.full((len(contexts), width), 7777, dtype=np.int32)  # junk past each length
    for row, context in enumerate(contexts):
        tokens[row, : len(context)] = context
    return tokens, np.array([len(c) for c in contexts], dtype=np.int32)


def kernel_as_reference(contexts, rows=None, **params):
    tokens, lengths = pack(contexts)
    rows = np.arange(len(contexts), dtype=np.int32) if rows is None else np.asarray(rows, np.int32)
    out = context_ngram(tokens, lengths, rows, **params)
    results = []
    for index in range(len(rows)):
        drafts = [
            (out.draft(index, slot), int(out.counts[index, slot]))
            for slot in range(params["num_drafts"])
            if out.lengths[index, slot] > 0
        ]
        results.append((int(out.match_len[index]), drafts))
        empty_slots = out.lengths[index] == 0
        assert (out.tokens[index][empty_slots] == -1).all()
        assert (out.counts[index][empty_slots] == 0).all()
    return results


contexts_strategy = st.lists(
    st.lists(st.integers(0, 4), max_size=80), min_size=1, max_size=12
)


@settings(max_examples=300, deadline=None)
@given(
    contexts=contexts_strategy,
    num_drafts=st.integers(1, 6),
    draft_len=st.integers(1, 8),
    q_min=st.integers(1, 3),
    q_span=st.integers(0, 3),
    max_matches=st.integers(1, 20),
    num_threads=st.integers(0, 3),
)
def test_kernel_matches_reference(contexts, num_drafts, draft_len, q_min, q_span, max_matches, num_threads):
    params = dict(num_drafts=num_drafts, draft_len=draft_len, q_min=q_min, q_max=q_min + q_span,
                  max_matches=max_matches)
    expected = context_ngram_reference(contexts, **params)
    assert kernel_as_reference(contexts, num_threads=num_threads, **params) == expected


def test_known_answer_prefers_longest_match_and_most_frequent():
    context = [5, 1, 2, 9, 1, 2, 3, 1, 2, 3, 1, 2]
    (match_len, drafts), = kernel_as_reference([context], num_drafts=3, draft_len=2, q_min=1, q_max=3)
    # the 3-token suffix (3, 1, 2) occurred once before, followed by (3, 1)
    assert match_len == 3
    assert drafts == [([3, 1], 1)]
    (match_len, drafts), = kernel_as_reference([context], num_drafts=3, draft_len=2, q_min=1, q_max=2)
    assert match_len == 2
    assert drafts == [([3, 1], 2), ([9, 1], 1)]  # the most frequent continuation first


def test_ties_go_to_the_most_recent_occurrence():
    context = [1, 4, 1, 5, 1, 6, 1]
    (match_len, drafts), = kernel_as_reference([context], num_drafts=3, draft_len=1, q_min=1, q_max=1)
    assert match_len == 1
    assert drafts == [([6], 1), ([5], 1), ([4], 1)]


def test_continuations_are_cut_at_the_end_of_the_context():
    (match_len, drafts), = kernel_as_reference([[1, 2, 3, 1]], num_drafts=2, draft_len=5, q_min=1, q_max=1)
    assert (match_len, drafts) == (1, [([2, 3, 1], 1)])


@pytest.mark.parametrize("context", [[], [3], [1, 2, 3, 4]])
def test_no_match_gives_no_drafts(context):
    assert kernel_as_reference([context], num_drafts=2, draft_len=3, q_min=1, q_max=4) == [(0, [])]


def test_rows_select_a_subset_in_the_given_order():
    contexts = [[1, 2, 1], [3, 4, 3], [5, 6, 5]]
    got = kernel_as_reference(contexts, rows=[2, 0], num_drafts=1, draft_len=2, q_min=1, q_max=2)
    assert got == [(1, [([6, 5], 1)]), (1, [([2, 1], 1)])]


def test_token_ids_at_int32_limits():
    big = np.iinfo(np.int32).max
    contexts = [[big, 0, big, 0, big]]
    params = dict(num_drafts=2, draft_len=3, q_min=1, q_max=3)
    assert kernel_as_reference(contexts, **params) == context_ngram_reference(contexts, **params)


def test_reads_vllm_style_buffers_without_copying_rows_beyond_their_length():
    tokens = np.zeros((4, 64), dtype=np.int32)
    tokens[1, :6] = [8, 9, 8, 9, 8, 9]
    lengths = np.array([0, 6, 0, 0], dtype=np.int32)
    out = context_ngram(tokens, lengths, np.array([1], np.int32), num_drafts=1, draft_len=4, q_min=1, q_max=3)
    assert out.draft(0) == [8, 9]


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(q_min=2, q_max=1), "q_min <= q_max"),
        (dict(q_min=0, q_max=1), "q_min <= q_max"),
        (dict(max_matches=0), "max_matches must be in"),
        (dict(max_matches=1000), "max_matches must be in"),
    ],
)
def test_bad_parameters_are_rejected(params, message):
    tokens, lengths = pack([[1, 2, 1]])
    kwargs = dict(num_drafts=1, draft_len=2, q_min=1, q_max=2, max_matches=8) | params
    with pytest.raises(ValueError, match=message):
        context_ngram(tokens, lengths, np.array([0], np.int32), **kwargs)


def test_bad_rows_are_rejected():
    tokens, lengths = pack([[1, 2, 1]])
    with pytest.raises(IndexError, match="rows\\[0\\] = 5"):
        context_ngram(tokens, lengths, np.array([5], np.int32), num_drafts=1, draft_len=2, q_min=1, q_max=2)
    with pytest.raises(IndexError, match="lengths\\[0\\] = 9"):
        context_ngram(tokens, np.array([9], np.int32), np.array([0], np.int32), num_drafts=1, draft_len=2,
                      q_min=1, q_max=2)


def test_extension_reports_its_backends():
    backends = extension_backends()
    assert backends[0] == "cpu"
    assert set(backends) <= {"cpu", "cuda"}


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return "cuda" in extension_backends() and torch.cuda.is_available()


@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA build of _C and a GPU")
@settings(max_examples=50, deadline=None)
@given(contexts=contexts_strategy, num_drafts=st.integers(1, 4), draft_len=st.integers(1, 8), q_max=st.integers(1, 4))
def test_cuda_kernel_matches_cpu_kernel(contexts, num_drafts, draft_len, q_max):
    import torch

    tokens, lengths = pack(contexts)
    rows = np.arange(len(contexts), dtype=np.int32)
    params = dict(num_drafts=num_drafts, draft_len=draft_len, q_min=1, q_max=q_max, max_matches=32)
    cpu = context_ngram(tokens, lengths, rows, **params)
    gpu = context_ngram(torch.from_numpy(tokens).cuda(), torch.from_numpy(lengths).cuda(), rows, **params)
    torch.cuda.synchronize()
    for name in ("tokens", "lengths", "counts", "match_len"):
        assert np.array_equal(getattr(gpu, name).cpu().numpy(), getattr(cpu, name)), name
