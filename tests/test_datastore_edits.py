"""Growing a sharded datastore in place (issue 26 item 3): ``datastore add`` / ``remove`` leave a
store whose documents equal a fresh build of what remains (so REST drafts what such a store
drafts), refuse what they cannot do without changing anything, survive a failure midway; and a
serving engine swaps the changed store in between two steps (``watch.py``)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vllm_retrieval_spec.datastores.builder import build_datastore
from vllm_retrieval_spec.datastores.format import DatastoreError
from vllm_retrieval_spec.datastores.sharded import ShardedDatastore, open_datastore
from vllm_retrieval_spec.datastores.sharded_edit import add_documents, remove_documents
from vllm_retrieval_spec.datastores.sources import InputSpec
from vllm_retrieval_spec.datastores.watch import ReloadingDatastore

SHARD_TOKENS = 1_000


@pytest.fixture()
def more_sources(tmp_path: Path) -> Path:
    """Ten more small modules, added to a store built from ``python_sources``."""
    root = tmp_path / "more"
    root.mkdir()
    for i in range(10):
        (root / f"extra_{i}.py").write_text(f"class Extra{i}:\n    size = {i * 3}\n\n    def grow(self):\n"
                                            f"        return self.size + {i}\n")
    return root


@pytest.fixture()
def sharded(model_dir: Path, python_sources: Path, tmp_path: Path) -> Path:
    out = tmp_path / "store"
    build_datastore(model_dir, [InputSpec(python_sources)], out, progress=False, shard_tokens=SHARD_TOKENS)
    return out


def joined_tokens(path: Path) -> np.ndarray:
    store = open_datastore(path)
    return np.concatenate([np.asarray(shard.tokens) for shard in store.shards])


def files_in_order(*directories: Path) -> list[Path]:
    """The documents of ``directories`` in the order (and so with the ids) a build gives them."""
    return [file for directory in directories for file in sorted(directory.rglob("*.py"))]


def test_added_and_removed_documents_leave_what_a_fresh_build_of_the_rest_holds(model_dir, python_sources,
                                                                                more_sources, sharded, tmp_path):
    before = ShardedDatastore.open(sharded)
    added = add_documents(sharded, model_dir, [InputSpec(more_sources)], progress=False)
    assert added.document_ids == [[40, 50]] and len(added.shards_written) == 1
    removed = remove_documents(sharded, [0, 1, 17, 41, 49], progress=False)
    assert removed.document_ids == [[0, 2], [17, 18], [41, 42], [49, 50]]
    documents = files_in_order(python_sources, more_sources)
    kept = [file for i, file in enumerate(documents) if i not in {0, 1, 17, 41, 49}]
    build_datastore(model_dir, [InputSpec(file) for file in kept], tmp_path / "fresh", progress=False)
    np.testing.assert_array_equal(joined_tokens(sharded), np.asarray(open_datastore(tmp_path / "fresh").tokens))
    store = ShardedDatastore.open(sharded)
    store.check_fully()
    assert store.manifest.num_documents == 45 and store.next_document_id == 50
    held = [i for runs in store.id_runs() for a, b in runs for i in range(a, b)]
    assert held == [i for i in range(50) if i not in {0, 1, 17, 41, 49}]
    untouched = {shard.path.name for shard in before.shards} - set(removed.shards_retired)
    assert untouched and untouched <= set(store.manifest.shards)  # shards without removed documents are kept
    assert not any((sharded / name).exists() for name in removed.shards_retired)
    assert store.manifest.merged_order.file == "order-00002.bin"  # merged again at each edit, the old deleted
    assert store.manifest.merged_order.shards == store.manifest.shards
    assert sorted(p.name for p in sharded.iterdir() if not p.name.startswith(".")) == sorted(
        [*store.manifest.shards, "manifest.json", store.manifest.merged_order.file])


def test_ids_are_never_reused_and_a_store_emptied_keeps_one_shard(model_dir, more_sources, sharded):
    remove_documents(sharded, range(40), progress=False)
    empty = ShardedDatastore.open(sharded)
    assert (empty.manifest.num_documents, len(empty.shards), empty.next_document_id) == (0, 1, 40)
    added = add_documents(sharded, model_dir, [InputSpec(more_sources)], progress=False)
    assert added.document_ids == [[40, 50]] and added.num_documents == 10


def test_edits_that_cannot_be_done_change_nothing(model_dir, more_sources, sharded, tmp_path):
    manifest = (sharded / "manifest.json").read_bytes()
    with pytest.raises(DatastoreError, match="no document with id 40, 99"):
        remove_documents(sharded, [3, 40, 99])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DatastoreError, match="has nothing to read"):
        add_documents(sharded, model_dir, [InputSpec(tmp_path / "empty.jsonl")], progress=False)
    assert (sharded / "manifest.json").read_bytes() == manifest
    single = tmp_path / "single"
    build_datastore(model_dir, [InputSpec(more_sources)], single, progress=False)
    with pytest.raises(DatastoreError, match="single-array datastore, which cannot grow in place; rebuild it sharded"):
        add_documents(single, model_dir, [InputSpec(more_sources)], progress=False)


def test_an_edit_killed_midway_leaves_the_store_and_the_next_edit_clears_its_files(model_dir, more_sources,
                                                                                   sharded, monkeypatch):
    from vllm_retrieval_spec.datastores import sharded_edit

    manifest = (sharded / "manifest.json").read_bytes()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(sharded_edit, "_publish", killed)  # after the new shards moved in, before the manifest
        with pytest.raises(KeyboardInterrupt):
            add_documents(sharded, model_dir, [InputSpec(more_sources)], progress=False)
    assert (sharded / "manifest.json").read_bytes() == manifest
    orphans = set(p.name for p in sharded.iterdir() if p.name.startswith("shard-")) - set(
        ShardedDatastore.open(sharded).manifest.shards)
    assert orphans  # moved in, never listed
    foreign = sharded / "shard-09999"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not ours")
    add_documents(sharded, model_dir, [InputSpec(more_sources)], progress=False)
    assert not any((sharded / name).exists() for name in orphans)
    assert (foreign / "notes.txt").read_text() == "not ours"  # never deleted
    assert ShardedDatastore.open(sharded).manifest.num_documents == 50


def test_the_command_line_adds_removes_and_refuses_in_one_line(model_dir, more_sources, sharded):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "vllm_retrieval_spec.cli", "datastore", *args],
                              capture_output=True, text=True, timeout=300)

    done = cli("add", str(sharded), "--tokenizer", str(model_dir), "--input", str(more_sources))
    assert done.returncode == 0 and "added 10 document(s) (ids 40-49)" in done.stdout, done.stderr
    done = cli("remove", str(sharded), "--document", "2", "5-7")
    assert done.returncode == 0 and "removed 4 document(s) (ids 2, 5-7)" in done.stdout, done.stderr
    for bad, message in [(["5"], "no document with id 5"), (["7-3"], "is not an id N or a range"),
                         (["x"], "is not an id N or a range")]:
        done = cli("remove", str(sharded), "--document", *bad)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    inspect = cli("inspect", str(sharded))
    assert "documents (ids 0-1, 3)" in inspect.stdout and "documents (ids 4, 8)" in inspect.stdout


# ---- A serving engine's view: the store swapped between steps ----


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_changed_store_is_opened_in_the_background_and_swapped_in_at_a_step(model_dir, more_sources, sharded,
                                                                               caplog):
    clock = Clock()
    watched = ReloadingDatastore(open_datastore(sharded), open_datastore, interval=2.0, clock=clock)
    first = watched.current()
    add_documents(sharded, model_dir, [InputSpec(more_sources)], progress=False)
    clock.now = 1.0
    assert watched.current() is first  # not checked before the interval
    clock.now = 2.0
    assert watched.current() is first  # the new store opens in the background ...
    watched.join(60)
    with caplog.at_level(logging.INFO):
        second = watched.current()  # ... and is swapped in at the next step
    assert second is not first and second.manifest.num_documents == 50 and watched.reloads == 1
    assert "REST now drafts from the datastore" in caplog.text
    clock.now = 10.0
    assert watched.current() is second  # unchanged manifest: nothing reopened
    watched.join(60)
    assert watched.current() is second and watched.reloads == 1


def test_a_store_that_fails_to_open_keeps_the_one_serving(sharded, caplog):
    clock = Clock()
    watched = ReloadingDatastore(open_datastore(sharded), open_datastore, interval=1.0, clock=clock)
    first = watched.current()
    (sharded / "manifest.json").write_text("{not json")
    clock.now = 1.0
    with caplog.at_level(logging.ERROR):
        watched.current()
        watched.join(60)
        assert watched.current() is first
    assert "changed on disk but cannot be opened" in caplog.text
    shutil.rmtree(sharded)  # a deleted store: nothing to reopen, the mapped one keeps serving
    clock.now = 5.0
    assert watched.current() is first and watched.reloads == 0


def test_an_interval_of_zero_never_reloads(model_dir, more_sources, sharded):
    clock = Clock()
    watched = ReloadingDatastore(open_datastore(sharded), open_datastore, interval=0.0, clock=clock)
    add_documents(sharded, model_dir, [InputSpec(more_sources)], progress=False)
    clock.now = 1e6
    first = watched.current()
    watched.join(60)
    assert watched.current() is first and watched.reloads == 0


def test_a_store_that_changed_again_while_opening_is_opened_again_quietly(sharded, caplog):
    clock = Clock()
    manifest = sharded / "manifest.json"
    attempts = []

    def opener(path: Path) -> ShardedDatastore:
        attempts.append(path)
        if len(attempts) == 1:  # the next edit lands while this one opens
            manifest.write_text(manifest.read_text() + " ")
            raise DatastoreError("a shard was deleted by the next edit")
        return open_datastore(path)

    watched = ReloadingDatastore(open_datastore(sharded), opener, interval=1.0, clock=clock)
    first = watched.current()
    manifest.write_text(manifest.read_text() + "\n")
    with caplog.at_level(logging.ERROR):
        for now in (1.0, 2.0):
            clock.now = now
            watched.current()
            watched.join(60)
    assert watched.current() is not first and len(attempts) == 2 and watched.reloads == 1
    assert "cannot be opened" not in caplog.text
