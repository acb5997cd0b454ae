"""The dense index learned from served traffic: what it learns, search against brute force,
bounded memory, and no state left by finished or aborted requests."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_retrieval_spec.datastores.dense import MISSING_SCORE
from vllm_retrieval_spec.datastores.learned_dense import LearnedDenseIndex
from vllm_retrieval_spec.verification.session import SpecSession

DIM, N = 8, 4


def unit_keys(rng: np.random.Generator, count: int) -> np.ndarray:
    keys = rng.standard_normal((count, DIM)).astype(np.float32)
    return keys / np.linalg.norm(keys, axis=1, keepdims=True)


def test_a_finished_request_teaches_each_recorded_position_the_tokens_that_followed():
    index = LearnedDenseIndex(DIM, N, capacity=64, pending_capacity=16)
    keys = unit_keys(np.random.default_rng(0), 3)
    tokens = np.arange(100, 112)
    index.record(["a", "a", "a"], np.array([2, 5, 9]), keys)  # 9 + 4 > 12: its value is not complete
    assert index.num_positions == 0 and index.num_pending == 3
    index.finish({"a": tokens})
    assert index.num_positions == 2 and index.num_pending == 0
    scores, values = index.search(keys, 1)
    assert values[:2, 0].tolist() == [[102, 103, 104, 105], [105, 106, 107, 108]]
    assert scores[:2, 0] == pytest.approx([1.0, 1.0])


def test_aborted_and_unknown_requests_leave_nothing_behind():
    index = LearnedDenseIndex(DIM, N, capacity=64, pending_capacity=16)
    index.record(["a", "b"], np.array([1, 1]), unit_keys(np.random.default_rng(1), 2))
    index.forget(["a", "never-seen"])
    assert index.num_pending == 1
    index.finish({"b": np.arange(3)})  # too short for any value
    assert index.num_pending == 0 and index.num_positions == 0
    scores, values = index.search(unit_keys(np.random.default_rng(2), 2), 3)
    assert (scores == MISSING_SCORE).all() and (values == -1).all()


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 30), min_size=1, max_size=30), capacity=st.integers(2, 40),
       k=st.integers(1, 12), seed=st.integers(0, 2**32 - 1))
def test_search_matches_brute_force_over_the_newest_positions(lengths, capacity, k, seed):
    """Requests finish in order; the index answers as an exact inner-product search over what the
    two generations keep (the newest positions, at most ``capacity``), best first."""
    rng = np.random.default_rng(seed)
    index = LearnedDenseIndex(DIM, N, capacity=capacity, pending_capacity=64)
    learned_keys, learned_values = [], []
    for i, length in enumerate(lengths):
        tokens = rng.integers(0, 50, size=length + N)
        positions = np.arange(length)
        keys = unit_keys(rng, length)
        index.record([f"r{i}"] * length, positions, keys)
        index.finish({f"r{i}": tokens})
        learned_keys.extend(keys)
        learned_values.extend(tokens[p: p + N] for p in positions)
    total, half = len(learned_keys), capacity // 2
    newer = (total - 1) % half + 1 if total else 0  # filled before a new one is started
    dropped = total - half - newer if total > half else 0
    assert index.num_positions == total - dropped <= capacity
    queries = unit_keys(rng, 5)
    scores, values = index.search(queries, k)
    if index.num_positions == 0:
        assert (values == -1).all()
        return
    stored_keys, stored_values = np.array(learned_keys[dropped:]), np.array(learned_values[dropped:])
    expected = queries @ stored_keys.T
    for q in range(len(queries)):
        found = min(k, len(stored_keys))
        best = np.sort(expected[q])[::-1][:found]
        assert scores[q, :found] == pytest.approx(best, abs=1e-5)
        for slot in range(found):  # each value belongs to a key of that score
            matches = np.flatnonzero(np.isclose(expected[q], scores[q, slot], atol=1e-5))
            assert any((stored_values[m] == values[q, slot]).all() for m in matches)
        assert (values[q, found:] == -1).all()


def test_memory_stays_bounded_over_ten_thousand_requests():
    rng = np.random.default_rng(3)
    index = LearnedDenseIndex(DIM, N, capacity=1000, pending_capacity=200)
    for i in range(10_000):
        owners = [f"r{i}"] * 5
        index.record(owners, np.arange(5), unit_keys(rng, 5))
        if i % 3 == 0:
            index.forget([f"r{i}"])
        else:
            index.finish({f"r{i}": rng.integers(0, 50, size=12)})
    assert index.num_positions <= 1000 and index.num_pending == 0
    assert index._newer.values.shape[0] + index._older.values.shape[0] <= 1000


def test_the_session_teaches_the_index_what_finished_and_forgets_what_was_aborted():
    index = LearnedDenseIndex(DIM, N, capacity=64, pending_capacity=16)
    session = SpecSession(tree_mode=False, learned_dense=index)
    assert session.learns_from_finished_tokens()
    index.record(["done", "aborted"], np.array([0, 0]), unit_keys(np.random.default_rng(4), 2))
    session.release(["done", "aborted"], {"done": np.arange(10)})
    assert index.num_positions == 1 and index.num_pending == 0
