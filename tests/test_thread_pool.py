"""The kernels' persistent thread pool: work thresholds, thread caps, errors raised in workers,
concurrent Python callers and forks; threaded kernel runs equal single-threaded ones exactly."""

from __future__ import annotations

import multiprocessing
import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from pydivsufsort import divsufsort

from vllm_retrieval_spec.kernels import context_ngram
from vllm_retrieval_spec.kernels.draft_merge import merge_drafts
from vllm_retrieval_spec.kernels.extension import load_extension
from vllm_retrieval_spec.kernels.rest import RestParams, rest_retrieve

_C = load_extension()
# The machine's cores, not this process's: a test worker kept to one core (tests/workers.py) still
# runs two threads, taking turns.
MULTI_CORE = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")


def calling_thread() -> int:
    """The probe's id of the current thread (one thread allowed: always the caller)."""
    return _C.thread_pool_probe(1, num_threads=1)[0]


def test_work_below_two_grains_runs_on_the_calling_thread():
    assert set(_C.thread_pool_probe(64, num_threads=0, grain=40, busy_ns=10_000)) == {calling_thread()}


def test_one_thread_allowed_runs_on_the_calling_thread():
    assert set(_C.thread_pool_probe(64, num_threads=1, busy_ns=10_000)) == {calling_thread()}


@MULTI_CORE
def test_large_work_is_shared_with_pool_workers_up_to_the_cap():
    # A worker the scheduler wakes too late is left out, so a loaded machine may need retries.
    threads_used = [len(set(_C.thread_pool_probe(64, num_threads=2, busy_ns=500_000))) for _ in range(5)]
    assert max(threads_used) == 2


def test_an_error_in_any_item_reaches_the_caller_and_the_pool_survives():
    for fail_at in (0, 37, 63):
        with pytest.raises(RuntimeError, match=f"item {fail_at}$"):
            _C.thread_pool_probe(64, num_threads=0, fail_at=fail_at, busy_ns=1_000)
    assert len(_C.thread_pool_probe(64, num_threads=0, busy_ns=1_000)) == 64


def test_concurrent_python_threads_all_complete():
    results: list[int] = []

    def call() -> None:
        for _ in range(50):
            results.append(len(_C.thread_pool_probe(32, num_threads=0, busy_ns=2_000)))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == [32] * 200


def _probe_in_child(queue) -> None:
    queue.put(len(_C.thread_pool_probe(64, num_threads=2, busy_ns=1_000)))


def test_a_forked_child_gets_a_working_pool():
    _C.thread_pool_probe(64, num_threads=2, busy_ns=1_000)  # the parent's pool exists
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_probe_in_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0 and queue.get(timeout=1) == 64


def _team_probe_in_child(torch_threads: int, queue) -> None:
    import torch

    torch.set_num_threads(torch_threads)
    torch.ones(64, 64) @ torch.ones(64, 64)  # torch's OpenMP team exists
    ran_on = _C.thread_pool_probe(64, num_threads=0, busy_ns=500_000, on_team=True)
    queue.put((len(set(ran_on)), ran_on[0] == calling_thread()))


def team_probe(torch_threads: int) -> tuple[int, bool]:
    """(threads used, whether the caller was one) by a probe on torch's team in a fresh process."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_team_probe_in_child, args=(torch_threads, queue))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0
    return queue.get(timeout=1)


@MULTI_CORE
def test_a_one_thread_torch_team_keeps_team_kernels_on_the_calling_thread():
    assert team_probe(1) == (1, True)


@MULTI_CORE
def test_team_kernels_use_up_to_torchs_threads():
    # A team member the scheduler wakes too late still takes items: the team waits for all.
    threads, _ = team_probe(2)
    assert threads == 2


# ---- kernels: every thread count gives the single-threaded result ----------------------------


def repetitive_contexts(rows: int, length: int, vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (rows, length)).astype(np.int32)
    lengths = rng.integers(length // 2, length + 1, rows).astype(np.int32)
    return tokens, lengths


def assert_same_arrays(got, expected, names) -> None:
    for name in names:
        assert np.array_equal(getattr(got, name), getattr(expected, name)), name


@pytest.mark.parametrize("num_threads", [0, 2, 3])
def test_threaded_context_ngram_equals_single_threaded(num_threads):
    tokens, lengths = repetitive_contexts(256, 600, 6)  # ~115k tokens: several grains
    rows = np.arange(256, dtype=np.int32)[::-1].copy()

    def run(threads: int):
        return context_ngram(tokens, lengths, rows, num_drafts=4, draft_len=6, q_min=1, q_max=4, num_threads=threads)

    assert_same_arrays(run(num_threads), run(1), ("tokens", "lengths", "counts", "match_len"))


@pytest.mark.parametrize("num_threads", [0, 2, 3])
def test_threaded_rest_equals_single_threaded(num_threads):
    store_tokens = np.random.default_rng(1).integers(0, 5, 20_000).astype(np.uint16)
    store_tokens[::97] = np.iinfo(np.uint16).max  # document separators
    store = SimpleNamespace(tokens=store_tokens, suffix_array=divsufsort(store_tokens),
                            separator=int(np.iinfo(np.uint16).max))
    store.shards = (store,)
    tokens, lengths = repetitive_contexts(64, 200, 5, seed=2)
    params = RestParams(n_max=8, top_k=16, chain_len=6)

    def run(threads: int):
        return rest_retrieve(store, tokens, lengths, np.arange(64), params, num_threads=threads)

    names = ("tree_tokens", "tree_parents", "tree_size", "chain_tokens", "chain_size", "match_info")
    assert_same_arrays(run(num_threads), run(1), names)


@pytest.mark.parametrize("num_threads", [0, 2, 3])
def test_threaded_merge_equals_single_threaded(num_threads):
    rng = np.random.default_rng(3)
    drafts = rng.integers(0, 3, (2048, 8, 8)).astype(np.int32)  # 131k tokens: several grains
    lengths = rng.integers(0, 9, (2048, 8)).astype(np.int32)
    got = merge_drafts(drafts, lengths, num_threads=num_threads)
    expected = merge_drafts(drafts, lengths, num_threads=1)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))


def test_concurrent_kernel_calls_give_the_single_threaded_result():
    tokens, lengths = repetitive_contexts(256, 600, 6, seed=4)
    rows = np.arange(256, dtype=np.int32)
    expected = context_ngram(tokens, lengths, rows, num_drafts=2, draft_len=4, q_min=1, q_max=3, num_threads=1)
    mismatches: list[int] = []

    def call() -> None:
        for _ in range(10):
            got = context_ngram(tokens, lengths, rows, num_drafts=2, draft_len=4, q_min=1, q_max=3)
            mismatches.append(int((got.tokens != expected.tokens).sum()))

    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert mismatches == [0] * 30
