"""The dense index learned from served traffic: what it learns, search against brute force,
bounded memory, no state left by finished or aborted requests; its snapshots: round trip, refusal
of a foreign or corrupt one (serving goes on), saves only when it learned, kill -9 during saves."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_retrieval_spec.datastores.dense import MISSING_SCORE, DenseDatastore
from vllm_retrieval_spec.datastores.dense_format import VALUES, DenseDatastoreError
from vllm_retrieval_spec.datastores.learned_dense import LearnedDenseIndex
from vllm_retrieval_spec.datastores.learned_snapshot import (
    LearnedDenseSnapshots,
    build_from_snapshot,
    load_learned,
    save_learned,
)
from vllm_retrieval_spec.datastores.output_snapshot import snapshot_dirs
from vllm_retrieval_spec.verification.session import SpecSession

from vrs_artifacts import TINY_MODEL, VOCAB, write_dense_store

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


# ------------------------------------------------------------------ snapshots (dense_learned_path)

def learned_index_for(store: DenseDatastore, capacity: int = 64) -> LearnedDenseIndex:
    return LearnedDenseIndex(store.manifest.dim, store.value_tokens, capacity, 16, key_store=store)


def taught(index: LearnedDenseIndex, seed: int = 5, requests: int = 3) -> LearnedDenseIndex:
    rng = np.random.default_rng(seed)
    for i in range(requests):
        index.record([f"r{i}"] * 4, np.arange(4), unit_keys(rng, 4))
        index.finish({f"r{i}": rng.integers(0, VOCAB, size=10)})
    return index


@pytest.fixture()
def key_store(tmp_path) -> DenseDatastore:
    return DenseDatastore.open(write_dense_store(tmp_path / "serving", dim=DIM, value_tokens=N), TINY_MODEL)


def test_a_snapshot_round_trips_and_is_a_dense_datastore_of_its_own(key_store, tmp_path):
    index = taught(learned_index_for(key_store))
    saved = save_learned(index, tmp_path / "learned", key_store)
    restored = learned_index_for(key_store)
    assert load_learned(restored, tmp_path / "learned", key_store) == index.num_positions == 12
    for got, want in zip(restored.contents(), index.contents()):
        np.testing.assert_array_equal(got, want)
    assert restored.additions == 0  # nothing new to save
    served = DenseDatastore.open(saved, TINY_MODEL)  # usable as a dense_datastore
    served.check_fully()
    keys, values = index.contents()
    _, found = served.search_by_keys(keys[:1], 1)
    np.testing.assert_array_equal(found[0, 0], values[0])


def test_a_store_built_from_the_captured_states_holds_the_newest_snapshots_positions(key_store, tmp_path):
    """``datastore from-server`` without ``--url``: the newest snapshot becomes a dense store of
    its own (same positions, values and key space, indexed as a build indexes its keys)."""
    index = taught(learned_index_for(key_store))
    save_learned(index, tmp_path / "states", key_store)
    index.record(["late"], np.array([1]), unit_keys(np.random.default_rng(3), 1))
    index.finish({"late": np.arange(12) % VOCAB})
    save_learned(index, tmp_path / "states", key_store)
    manifest = build_from_snapshot(tmp_path / "states", tmp_path / "store")
    store = DenseDatastore.open(tmp_path / "store", TINY_MODEL)
    store.check_fully()
    keys, values = index.contents()
    assert manifest.num_positions == store.num_positions == len(values) == 13
    np.testing.assert_array_equal(np.asarray(store.values), values)
    np.testing.assert_array_equal(store.transform.components, key_store.transform.components)
    _, found = store.search_by_keys(keys[-1:], 1)
    np.testing.assert_array_equal(found[0, 0], values[-1])
    with pytest.raises(DenseDatastoreError, match="holds no captured states"):
        build_from_snapshot(tmp_path / "nothing", tmp_path / "other")


def test_a_save_deletes_the_older_snapshot_and_keeps_a_users_directory_named_like_one(key_store, tmp_path):
    index = taught(learned_index_for(key_store))
    first = save_learned(index, tmp_path / "learned", key_store)
    users = tmp_path / "learned" / "snapshot-00000001"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    newest = save_learned(index, tmp_path / "learned", key_store)
    assert snapshot_dirs(tmp_path / "learned") == [users, newest] and not first.exists()
    assert (users / "notes.txt").read_text() == "mine"
    assert load_learned(learned_index_for(key_store), tmp_path / "learned", key_store) == index.num_positions


def test_nothing_learned_saves_nothing_and_nothing_saved_restores_nothing(key_store, tmp_path):
    index = learned_index_for(key_store)
    assert save_learned(index, tmp_path / "learned", key_store) is None
    assert load_learned(index, tmp_path / "learned", key_store) == 0


def test_a_snapshot_of_another_key_space_is_refused_and_serving_goes_on(key_store, tmp_path, caplog):
    other = DenseDatastore.open(write_dense_store(tmp_path / "other", dim=DIM, value_tokens=N, seed=9), TINY_MODEL)
    save_learned(taught(learned_index_for(other)), tmp_path / "learned", other)
    with pytest.raises(DenseDatastoreError, match="key space of another dense datastore"):
        load_learned(learned_index_for(key_store), tmp_path / "learned", key_store)
    index = learned_index_for(key_store)
    snapshots = LearnedDenseSnapshots(index, tmp_path / "learned", key_store, 3600, writes=False)
    with caplog.at_level(logging.ERROR):
        assert snapshots.start() == 0
    assert "was refused" in caplog.text and index.num_positions == 0


@pytest.mark.parametrize("damage", ["values", "manifest"])
def test_a_corrupt_snapshot_is_refused(key_store, tmp_path, damage):
    saved = save_learned(taught(learned_index_for(key_store)), tmp_path / "learned", key_store)
    if damage == "values":
        data = bytearray((saved / VALUES).read_bytes())
        data[0] ^= 1
        (saved / VALUES).write_bytes(bytes(data))
    else:
        (saved / "manifest.json").write_text("{")
    with pytest.raises(DenseDatastoreError):
        load_learned(learned_index_for(key_store), tmp_path / "learned", key_store)


def test_saves_follow_what_was_learned_and_end_at_close(key_store, tmp_path):
    index = learned_index_for(key_store)
    snapshots = LearnedDenseSnapshots(index, tmp_path / "learned", key_store, 3600)
    snapshots.start()
    assert not snapshots.save_if_changed()  # nothing learned yet
    taught(index)
    assert snapshots.save_if_changed() and not snapshots.save_if_changed()
    taught(index, seed=6, requests=1)
    snapshots.close()
    assert snapshots.saves == 2 and len(snapshot_dirs(tmp_path / "learned")) == 1
    restored = learned_index_for(key_store)
    assert load_learned(restored, tmp_path / "learned", key_store) == index.num_positions


KILLED_LEARNER = """
import sys
from pathlib import Path
import numpy as np
from vllm_retrieval_spec.datastores.dense import DenseDatastore
from vllm_retrieval_spec.datastores.learned_dense import LearnedDenseIndex
from vllm_retrieval_spec.datastores.learned_snapshot import save_learned
from vllm_retrieval_spec.storage import ModelIdentity

store = DenseDatastore.open(sys.argv[2], ModelIdentity("tiny", 40, "c" * 64, "v" * 64))
index = LearnedDenseIndex({dim}, {n}, 2_000_000, 5_000, key_store=store)
rng = np.random.default_rng(0)
version = 0
while True:
    keys = rng.standard_normal((5_000, {dim})).astype(np.float32)
    index.record(["r"] * 5_000, np.arange(5_000), keys / np.linalg.norm(keys, axis=1, keepdims=True))
    index.finish({{"r": np.full(5_000 + {n}, version % 40)}})
    save_learned(index, Path(sys.argv[1]), store)
    print(version, flush=True)
    version += 1
"""


def test_kill_9_during_saves_leaves_the_previous_snapshot_whole(key_store, tmp_path):
    """SIGKILL a process saving a growing learned index in a loop: the newest snapshot always
    loads whole and is the last one saved (or the one being saved, when it was in place)."""
    script = KILLED_LEARNER.format(dim=DIM, n=N)
    rng = random.Random(0)
    for _ in range(3):
        child = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "learned"), str(key_store.path)],
                                 stdout=subprocess.PIPE, text=True)
        printed = [int(child.stdout.readline())]
        time.sleep(rng.uniform(0.0, 0.5))
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        printed += [int(line) for line in child.stdout.read().split()]
        restored = learned_index_for(key_store, capacity=4_000_000)
        positions = load_learned(restored, tmp_path / "learned", key_store)
        version = positions // 5_000 - 1
        assert version in (printed[-1], printed[-1] + 1)
        assert (restored.contents()[1][-1] == version % 40).all()


def test_the_runner_restores_its_engine_snapshot_and_saves_at_shutdown(key_store, tmp_path):
    from vllm_retrieval_spec.integration.vllm_patches import keep_learned_dense
    from vllm_retrieval_spec.options import RetrievalSpecOptions

    options = RetrievalSpecOptions.from_dict({"dense_learned_path": str(tmp_path / "learned"),
                                              "output_index_save_seconds": 3600})
    calls = []
    runner = SimpleNamespace(
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=1, data_parallel_rank=0)),
        shutdown=lambda: calls.append("shutdown"),
    )
    index = learned_index_for(key_store)
    snapshots = keep_learned_dense(runner, options, index)
    assert snapshots is runner.vrs_learned_snapshots and snapshots.path == tmp_path / "learned.dp1"
    taught(index)
    runner.shutdown()
    assert calls == ["shutdown"] and snapshots.saves == 1
    restarted = learned_index_for(key_store)
    assert keep_learned_dense(runner, options, restarted) is not None and restarted.num_positions == 12
    assert keep_learned_dense(runner, RetrievalSpecOptions(), index) is None  # no path: not kept
    (tmp_path / "taken").write_text("a file")
    taken = RetrievalSpecOptions.from_dict({"dense_learned_path": str(tmp_path / "taken" / "learned")})
    with pytest.raises(OSError, match=r"retrieval_spec.dense_learned_path: cannot write .*taken is not a directory"):
        keep_learned_dense(runner, taken, index)  # the engine does not start
