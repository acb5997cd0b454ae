"""Output index snapshots (``output_index_path``): round trip with identical searches, refusal
of foreign and corrupt snapshots (serving goes on empty), kill -9 during saves, the size bound,
periodic saves and the save at runner shutdown; the goodput calibration and tokens' factors
kept beside the index (round trip, refused counts relearned while the tokens serve on)."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_retrieval_spec.datastores.format import TokenizerIdentity
from vllm_retrieval_spec.datastores.output_index import SEPARATOR, OutputIndex
from vllm_retrieval_spec.datastores.output_snapshot import (
    CALIBRATION,
    TOKEN_FACTORS,
    TOKENS,
    OutputIndexSnapshots,
    OutputSnapshotError,
    read_counts,
    read_snapshot,
    snapshot_dirs,
)
from vllm_retrieval_spec.datastores.resolve import tokenizer_identity
from vllm_retrieval_spec.goodput.budget import GoodputBudget
from vllm_retrieval_spec.goodput.calibration import SHAPE, AcceptanceCalibration
from vllm_retrieval_spec.goodput.token_factor import TokenFactor
from vllm_retrieval_spec.kernels.rest import RestParams, rest_retrieve

VOCAB = 49_152  # SmolLM2's
OTHER_TOKENIZER = TokenizerIdentity("gpt2", 50_257, "ab" * 32)
PARAMS = RestParams(n_min=1, n_max=8, use_datastore=False, use_context=False, top_k=16, chain_len=8, min_ratio=0.0)


@pytest.fixture(scope="module")
def smollm2(model_dir: Path) -> TokenizerIdentity:
    return tokenizer_identity(model_dir)


def filled_index(capacity: int = 50_000, requests: int = 200, seed: int = 0) -> OutputIndex:
    """An index of ``requests`` sequences that repeat phrases (so searches find continuations),
    rebuilt after every request (its last build holds every kept sequence)."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, VOCAB, size=int(rng.integers(5, 40))) for _ in range(30)]
    index = OutputIndex(capacity, background=False, rebuild_fraction=0.0)
    for _ in range(requests):
        index.add(np.concatenate([phrases[i] for i in rng.integers(0, len(phrases), size=6)]))
    return index


def search(index: OutputIndex, queries: list[np.ndarray]) -> list[tuple[list[int], list[int]]]:
    """Each query's drafted chain and match info through the REST kernel (output index only)."""
    width = max(len(q) for q in queries)
    tokens = np.zeros((len(queries), width), np.int32)
    for row, query in enumerate(queries):
        tokens[row, : len(query)] = query
    lengths = np.array([len(q) for q in queries], np.int32)
    found = rest_retrieve(None, tokens, lengths, np.arange(len(queries), dtype=np.int32), PARAMS,
                          output_index=index.native)
    return [(found.chain(row), found.match_info[row].tolist()) for row in range(len(queries))]


def test_round_trip_keeps_tokens_and_searches(smollm2, tmp_path):
    index = filled_index()
    saved = index.save(tmp_path / "snap", smollm2)
    assert saved.parent == tmp_path / "snap" and (saved / TOKENS).stat().st_size == len(index.tokens) * 4

    restored = OutputIndex(50_000, background=False)
    assert restored.load(tmp_path / "snap", smollm2)
    assert np.array_equal(restored.tokens, index.tokens)
    assert [s.tolist() for s in restored.kept_sequences()] == [s.tolist() for s in index.kept_sequences()]
    assert not restored.kept_sequences()[0].flags.writeable  # read-only views of the memory map
    rng = np.random.default_rng(1)
    queries = [index.tokens[start: start + int(rng.integers(2, 12))] for start in rng.integers(0, 40_000, 32)]
    queries = [q[q != SEPARATOR] for q in queries]
    assert search(restored, queries) == search(index, queries)
    assert sum(len(chain) for chain, _ in search(index, queries)) > 0


def test_nothing_saved_yet_starts_empty(smollm2, tmp_path):
    index = OutputIndex(1024, background=False)
    assert not index.load(tmp_path / "never-saved", smollm2)
    assert index.native is None and read_snapshot(tmp_path / "never-saved", smollm2) is None


def test_a_snapshot_of_another_tokenizer_is_refused(smollm2, tmp_path, caplog):
    filled_index(requests=20).save(tmp_path / "snap", OTHER_TOKENIZER)
    with pytest.raises(OutputSnapshotError, match=r"by a server with tokenizer 'gpt2'.*serves tokenizer 'SmolLM2"):
        read_snapshot(tmp_path / "snap", smollm2)
    assert_refused_and_serving_goes_on(smollm2, tmp_path / "snap", caplog, "tokenizer 'gpt2'")


def _truncate(directory: Path) -> None:
    path = directory / TOKENS
    path.write_bytes(path.read_bytes()[:-6])


def _flip_a_byte(directory: Path) -> None:
    data = bytearray((directory / TOKENS).read_bytes())
    data[len(data) // 2] ^= 0x40
    (directory / TOKENS).write_bytes(bytes(data))


def _edit_manifest(**changes: object) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        manifest = json.loads((directory / "manifest.json").read_text())
        (directory / "manifest.json").write_text(json.dumps({**manifest, **changes}))

    return edit


def _forge_a_token(directory: Path) -> None:
    """A token id past the vocabulary, with the checksum updated to match (only the scan finds it)."""
    from vllm_retrieval_spec.storage import file_records

    tokens = np.fromfile(directory / TOKENS, dtype="<u4")
    tokens[3] = VOCAB + 5
    tokens.tofile(directory / TOKENS)
    _edit_manifest(files=file_records(directory, [TOKENS]))(directory)


CORRUPTIONS = {
    "truncated": (_truncate, "truncated or corrupt"),
    "flipped byte": (_flip_a_byte, "sha256"),
    "manifest not JSON": (lambda d: (d / "manifest.json").write_text('{"format_version": 1,'), "json is corrupt"),
    "manifest of another version": (_edit_manifest(format_version=99), "format version 99"),
    "count of the wrong type": (_edit_manifest(num_tokens="many"), "'num_tokens' is 'many'"),
    "count out of bounds": (_edit_manifest(num_sequences=-1), "num_sequences"),
    "separator changed": (_edit_manifest(separator=7), "separator"),
    "token past the vocabulary": (_forge_a_token, "not below the vocabulary size"),
    "missing tokens": (lambda d: (d / TOKENS).unlink(), "is missing"),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_corrupt_snapshot_is_refused(smollm2, tmp_path, caplog, corruption):
    damage, message = CORRUPTIONS[corruption]
    saved = filled_index(requests=20).save(tmp_path / "snap", smollm2)
    damage(saved)
    with pytest.raises(OutputSnapshotError, match=message):
        read_snapshot(tmp_path / "snap", smollm2)
    # Without a readable manifest nothing says the directory is ours: the next save keeps it.
    kept = 1 if corruption == "manifest not JSON" else 0
    assert_refused_and_serving_goes_on(smollm2, tmp_path / "snap", caplog, message, kept)


def assert_refused_and_serving_goes_on(tokenizer: TokenizerIdentity, path: Path, caplog, message: str,
                                       kept: int = 0) -> None:
    """Start-up logs one error naming the file, the index starts empty, takes requests, and
    the next save puts a snapshot that loads in place of the refused one (``kept``: 1 when the
    refused one is not provably the plugin's, and stays)."""
    index = OutputIndex(50_000, background=False)
    snapshots = OutputIndexSnapshots(index, path, tokenizer, 3600)
    with caplog.at_level(logging.ERROR):
        assert not snapshots.start()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and str(path) in errors[0] and message in errors[0], errors
    assert "serves on with an empty output index" in errors[0] and "next save replaces" in errors[0]
    assert index.native is None
    index.add(np.arange(100, 200))
    assert index.native is not None
    snapshots.close()
    again = OutputIndex(50_000, background=False)
    assert again.load(path, tokenizer) and again.tokens.tolist() == [*range(100, 200), SEPARATOR]
    assert len(snapshot_dirs(path)) == 1 + kept


def test_saves_delete_only_the_older_snapshots_that_hold_only_their_own_files(smollm2, tmp_path, caplog):
    """A user's directory named like a snapshot, and a snapshot a user put a file into, are kept
    whole with a warning naming them; the snapshot saved before, holding only its files, goes."""
    path, index = tmp_path / "snap", filled_index(requests=20)
    first = index.save(path, smollm2)
    users = path / "snapshot-00000001"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    second = index.save(path, smollm2)
    (second / "notes.txt").write_text("mine too")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        newest = index.save(path, smollm2)
    assert [d.name for d in snapshot_dirs(path)] == [users.name, second.name, newest.name] and not first.exists()
    assert (users / "notes.txt").read_text() == "mine" and (second / "notes.txt").read_text() == "mine too"
    assert {TOKENS, "manifest.json"} <= {p.name for p in second.iterdir()}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    kept = "is kept (not an output index snapshot holding only its own files): the plugin deletes only what it wrote"
    assert len(warned) == 2 and all(kept in w for w in warned)
    assert str(users) in warned[0] and str(second) in warned[1]
    assert [s.tolist() for s in read_snapshot(path, smollm2)] == [s.tolist() for s in index.kept_sequences()]


def test_size_is_bounded_by_the_capacity(smollm2, tmp_path):
    index = OutputIndex(10_000, background=False, rebuild_fraction=10.0)
    rng = np.random.default_rng(2)
    for _ in range(2_000):
        index.add(rng.integers(0, VOCAB, size=int(rng.integers(1, 400))))
    saved = index.save(tmp_path / "snap", smollm2)
    assert (saved / TOKENS).stat().st_size <= 10_000 * 4
    smaller = OutputIndex(3_000, background=False)  # a restart with a smaller output_index_tokens
    assert smaller.load(tmp_path / "snap", smollm2)
    kept = smaller.kept_sequences()
    assert sum(len(s) + 1 for s in kept) <= 3_000 and smaller.stats.indexed_tokens <= 3_000
    newest = index.kept_sequences()[-len(kept):]
    assert [s.tolist() for s in kept] == [s.tolist() for s in newest]  # the newest are kept
    assert smaller.memory_bytes() <= 3_000 * 12


def test_periodic_saves_only_when_changed_and_at_close(smollm2, tmp_path):
    index = OutputIndex(50_000, background=False)
    snapshots = OutputIndexSnapshots(index, tmp_path / "snap", smollm2, 0.05)
    assert not snapshots.start()
    time.sleep(0.2)
    assert snapshots.saves == 0  # nothing changed
    index.add(np.arange(10))
    wait_for(lambda: snapshots.saves == 1)
    time.sleep(0.2)
    assert snapshots.saves == 1
    index.add(np.arange(20, 30))
    snapshots.close()
    snapshots.close()  # once
    assert snapshots.saves in (2, 3)  # the thread may have saved just before close
    restarted = OutputIndex(50_000, background=False)
    assert restarted.load(tmp_path / "snap", smollm2)
    assert restarted.tokens.tolist() == [*range(10), SEPARATOR, *range(20, 30), SEPARATOR]
    assert len(snapshot_dirs(tmp_path / "snap")) == 1  # older snapshots are deleted


def wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_failed_save_is_logged_and_serving_goes_on(smollm2, tmp_path, caplog):
    (tmp_path / "file").write_text("in the way")
    index = OutputIndex(1024, background=False)
    snapshots = OutputIndexSnapshots(index, tmp_path / "file", smollm2, 3600)
    snapshots.start()
    index.add(np.arange(5))
    with caplog.at_level(logging.ERROR):
        assert not snapshots.save_if_changed()
    assert "saving the output index" in caplog.text and str(tmp_path / "file") in caplog.text
    snapshots.close()


KILLED_SAVER = """
import sys
from pathlib import Path
import numpy as np
from vllm_retrieval_spec.datastores.format import TokenizerIdentity
from vllm_retrieval_spec.datastores.output_index import OutputIndex

index = OutputIndex({capacity}, background=False, rebuild_fraction=1e9)
identity = TokenizerIdentity("t", {vocab}, "cd" * 32)
version = 0
while True:
    index.add((np.arange({length}) + version * 31) % {vocab})
    index.save(Path(sys.argv[1]), identity)
    print(version, flush=True)
    version += 1
"""
CAPACITY, LENGTH = 2_000_000, 50_000  # 8 MB snapshots of 39 sequences


def test_kill_9_during_saves_leaves_the_previous_snapshot_whole(tmp_path):
    """SIGKILL a process saving a big index in a loop at random points: the newest snapshot
    always loads and is the last one saved (or the one being saved, when it was in place)."""
    identity = TokenizerIdentity("t", VOCAB, "cd" * 32)
    script = KILLED_SAVER.format(capacity=CAPACITY, length=LENGTH, vocab=VOCAB)
    rng = random.Random(0)
    for _ in range(4):
        child = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "snap")], stdout=subprocess.PIPE,
                                 text=True)
        printed = [int(child.stdout.readline())]
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        printed += [int(line) for line in child.stdout.read().split()]
        sequences = read_snapshot(tmp_path / "snap", identity)
        version = int(sequences[-1][0]) // 31
        assert version in (printed[-1], printed[-1] + 1)
        kept = CAPACITY // (LENGTH + 1)
        expected = [(np.arange(LENGTH) + v * 31) % VOCAB for v in range(max(0, version - kept + 1), version + 1)]
        assert len(sequences) == len(expected) and all(np.array_equal(a, b) for a, b in zip(sequences, expected))
    OutputIndex(1024, background=False).save(tmp_path / "snap", identity)  # cleans up after the killed saves
    assert [p.name for p in (tmp_path / "snap").iterdir()] == [snapshot_dirs(tmp_path / "snap")[-1].name]


def test_the_runner_keeps_its_engine_snapshot_and_saves_at_shutdown(model_dir, smollm2, tmp_path):
    from vllm_retrieval_spec.integration.vllm_patches import keep_output_index
    from vllm_retrieval_spec.options import RetrievalSpecOptions

    options = RetrievalSpecOptions.from_dict({"output_index_path": str(tmp_path / "snap"),
                                              "output_index_save_seconds": 3600})
    calls = []
    runner = SimpleNamespace(
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=1, data_parallel_rank=0)),
        model_config=SimpleNamespace(tokenizer=str(model_dir)),
        shutdown=lambda: calls.append("shutdown"),
    )
    index, budget = OutputIndex(4096, background=False), learned_budget()
    snapshots = keep_output_index(runner, options, index, budget.learned_counts())
    assert snapshots is runner.vrs_output_snapshots and snapshots.path == tmp_path / "snap.dp1"
    index.add(np.arange(7))
    runner.shutdown()
    assert calls == ["shutdown"] and snapshots.saves == 1
    assert [s.tolist() for s in read_snapshot(tmp_path / "snap.dp1", smollm2)] == [list(range(7))]
    for name, learned in budget.learned_counts().items():
        assert np.array_equal(read_counts(tmp_path / "snap.dp1", name, learned.counts().shape), learned.counts())
    assert keep_output_index(runner, RetrievalSpecOptions(), index) is None  # no path: not kept
    (tmp_path / "taken").write_text("a file")
    taken = RetrievalSpecOptions.from_dict({"output_index_path": str(tmp_path / "taken" / "snap")})
    with pytest.raises(OSError, match=r"retrieval_spec.output_index_path: cannot write .*taken is not a directory"):
        keep_output_index(runner, taken, index)  # the engine does not start


def learned_calibration(seed: int = 0, nodes: int = 5_000) -> AcceptanceCalibration:
    """A calibration that observed ``nodes`` outcomes in random buckets (and decayed once)."""
    rng = np.random.default_rng(seed)
    calibration = AcceptanceCalibration(decay_every=3)
    for _ in range(4):
        bucket = rng.integers(0, np.prod(SHAPE), nodes // 4)
        calibration.observe(bucket, rng.random(len(bucket)), rng.random(len(bucket)) < 0.4)
        calibration.tick()
    return calibration


def learned_budget(seed: int = 0, nodes: int = 5_000) -> GoodputBudget:
    """A budget whose calibration and tokens' factors observed ``nodes`` outcomes."""
    rng = np.random.default_rng(seed)
    budget = GoodputBudget(calibration=learned_calibration(seed, nodes), tokens=TokenFactor(vocab_size=VOCAB))
    tokens = rng.integers(0, VOCAB // 8, nodes)
    budget.tokens.record(tokens, rng.random(nodes), rng.random(nodes) < (tokens % 3) / 2)
    return budget


def test_calibration_and_token_factors_round_trip_beside_the_index(smollm2, tmp_path):
    """A restarted server ranks drafts with the chances and tokens' factors the one it replaced learned."""
    index, budget = filled_index(requests=20), learned_budget()
    snapshots = OutputIndexSnapshots(index, tmp_path / "snap", smollm2, 3600, learned=budget.learned_counts())
    snapshots.start()
    index.add(np.arange(50))
    snapshots.close()

    restarted = GoodputBudget(tokens=TokenFactor(vocab_size=VOCAB))
    assert OutputIndexSnapshots(OutputIndex(50_000, background=False), tmp_path / "snap", smollm2, 3600,
                                writes=False, learned=restarted.learned_counts()).start()
    assert np.array_equal(restarted.calibration.counts(), budget.calibration.counts())
    assert np.array_equal(restarted.calibration.chance_table().chance, budget.calibration.chance_table().chance)
    assert restarted.calibration.chance_table().chance.std() > 0  # learned, not the prior
    tokens = np.arange(VOCAB)
    assert np.array_equal(restarted.tokens.factors(tokens), budget.tokens.factors(tokens))
    assert restarted.tokens.factors(tokens).std() > 0


def test_a_snapshot_without_calibration_loads_its_tokens(smollm2, tmp_path):
    """Snapshots saved without a budget (or by the previous version) leave the calibration at its prior."""
    filled_index(requests=20).save(tmp_path / "snap", smollm2)
    calibration = AcceptanceCalibration()
    index = OutputIndex(50_000, background=False)
    assert OutputIndexSnapshots(index, tmp_path / "snap", smollm2, 3600, writes=False,
                                learned={"calibration": calibration}).start()
    assert index.native is not None and not calibration.observed.any()


def _save_counts(counts: np.ndarray | bytes) -> Callable[[Path], None]:
    """Replace the saved counts (checksum updated, so that only the content checks find them)."""
    def save(directory: Path) -> None:
        from vllm_retrieval_spec.storage import file_records

        if isinstance(counts, bytes):
            (directory / CALIBRATION).write_bytes(counts)
        else:
            np.save(directory / CALIBRATION, counts)
        _edit_manifest(files=file_records(directory, [TOKENS, CALIBRATION]))(directory)

    return save


def _flip_a_calibration_byte(directory: Path) -> None:
    data = bytearray((directory / CALIBRATION).read_bytes())
    data[-8] ^= 0x40
    (directory / CALIBRATION).write_bytes(bytes(data))


BAD_COUNTS = {
    "flipped byte": (_flip_a_calibration_byte, "sha256"),
    "not an array": (_save_counts(b"garbage"), "is corrupt"),
    "pickled objects": (_save_counts(np.array([None, {"a": 1}], dtype=object)), "is corrupt"),
    "another layout": (_save_counts(np.zeros((2, 3))), "this server keeps"),
    "integers": (_save_counts(np.zeros((2, *SHAPE), np.int64)), "not float64"),
    "negative counts": (_save_counts(np.full((2, *SHAPE), -1.0)), "negative or non-finite"),
    "not finite": (_save_counts(np.full((2, *SHAPE), np.nan)), "negative or non-finite"),
    "missing": (lambda d: (d / CALIBRATION).unlink(), "is missing"),
}


@pytest.mark.parametrize("damage", BAD_COUNTS)
def test_refused_counts_are_relearned_and_the_tokens_serve_on(smollm2, tmp_path, caplog, damage):
    damage_counts, message = BAD_COUNTS[damage]
    saved = filled_index(requests=20).save(tmp_path / "snap", smollm2, {"calibration": learned_calibration().counts()})
    damage_counts(saved)
    index, calibration = OutputIndex(50_000, background=False), AcceptanceCalibration()
    snapshots = OutputIndexSnapshots(index, tmp_path / "snap", smollm2, 3600, writes=False,
                                     learned={"calibration": calibration})
    with caplog.at_level(logging.ERROR):
        assert snapshots.start() and index.native is not None
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and str(tmp_path / "snap") in errors[0] and message in errors[0], errors
    assert "the budget relearns them" in errors[0] and not calibration.observed.any()


def test_token_factors_of_another_layout_are_relearned_and_the_calibration_restored(smollm2, tmp_path, caplog):
    """Each learned array is checked on its own: one refused leaves the others restored."""
    budget = learned_budget()
    counts = {name: learned.counts() for name, learned in budget.learned_counts().items()}
    counts["token_factors"] = counts["token_factors"][:, :VOCAB // 2]  # as a table of another size saves them
    filled_index(requests=20).save(tmp_path / "snap", smollm2, counts)
    restarted = GoodputBudget(tokens=TokenFactor(vocab_size=VOCAB))
    snapshots = OutputIndexSnapshots(OutputIndex(50_000, background=False), tmp_path / "snap", smollm2, 3600,
                                     writes=False, learned=restarted.learned_counts())
    with caplog.at_level(logging.ERROR):
        assert snapshots.start()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and TOKEN_FACTORS in errors[0] and "this server keeps" in errors[0], errors
    assert np.array_equal(restarted.calibration.counts(), budget.calibration.counts())
    assert not restarted.tokens.predicted.any()


def test_a_budget_without_token_factors_saves_only_its_calibration():
    budget = GoodputBudget(tokens=TokenFactor(enabled=False))
    assert list(budget.learned_counts()) == ["calibration"]
