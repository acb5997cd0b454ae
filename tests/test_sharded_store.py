"""Sharded datastores (issue 26): REST drafts from shards exactly what one suffix array over the
shards' concatenated documents drafts (property test against the single-array store); the
sharded format opens, describes itself, and refuses a bad shard naming it."""

from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydivsufsort import divsufsort

from vllm_retrieval_spec.datastores.format import DatastoreError
from vllm_retrieval_spec.datastores.merged_order import merge_shard_orders
from vllm_retrieval_spec.datastores.reader import first_token_offsets
from vllm_retrieval_spec.datastores.sharded import ShardedDatastore, open_datastore
from vllm_retrieval_spec.kernels.extension import load_extension
from vllm_retrieval_spec.kernels.rest import RestParams, rest_retrieve

from vrs_artifacts import TINY_TOKENIZER, repetitive_documents, write_sharded_store, write_token_store

SEPARATOR = np.iinfo(np.uint16).max


@dataclass
class InMemoryStore:
    """A single-array store of documents, as REST's kernel reads one (with first-token offsets)."""

    tokens: np.ndarray
    suffix_array: np.ndarray
    separator: int = SEPARATOR
    first_token_offsets: np.ndarray | None = None

    @classmethod
    def of(cls, documents: list[list[int]], vocab: int, offsets: bool) -> InMemoryStore:
        tokens = np.array([t for document in documents for t in (*document, SEPARATOR)], np.uint16)
        store = cls(tokens, divsufsort(tokens).astype(np.int32))
        if offsets:
            store.first_token_offsets = first_token_offsets(tokens, SEPARATOR, vocab)
        return store

    @property
    def shards(self) -> tuple[InMemoryStore]:
        return (self,)


@dataclass
class InMemoryShards:
    shards: tuple[InMemoryStore, ...]
    selection_cache: object = None
    merged_order: object = None

    def cached(self, slots: int) -> InMemoryShards:
        """The same shards with a selection cache of ``slots`` slots."""
        return InMemoryShards(self.shards, load_extension().SelectionCache(slots))

    def merged_entries(self, depth: int, workers: int = 1, parts: int | None = None) -> np.ndarray:
        """The shards' merged order to ``depth`` tokens, as the extension merges it."""
        return merge_shard_orders(self.shards, np.empty(sum(len(s.tokens) for s in self.shards), np.uint32),
                                  depth=depth, workers=workers, parts=parts)

    def merged(self, depth: int, workers: int = 1, parts: int | None = None) -> InMemoryShards:
        """The same shards drafting through their merged order to ``depth`` tokens."""
        order = load_extension().MergedOrder(self.merged_entries(depth, workers, parts),
                                             [len(s.tokens) for s in self.shards], depth)
        return InMemoryShards(self.shards, None, order)


def reference_merged_order(shards: tuple[InMemoryStore, ...], depth: int) -> np.ndarray:
    """Every shard's suffixes (positions in the concatenated tokens) sorted by their first
    ``depth`` tokens, ties in shard order, then in the shard's own order."""
    keyed, base = [], 0
    for index, shard in enumerate(shards):
        tokens = shard.tokens.tolist()
        keyed += [(tokens[p:p + depth], index, rank, base + p) for rank, p in enumerate(shard.suffix_array.tolist())]
        base += len(tokens)
    return np.array([position for *_, position in sorted(keyed)], np.uint32)


def drafts(store: object, queries: list[list[int]], params: RestParams) -> dict[str, np.ndarray]:
    """Every output of REST's kernel for ``queries`` (datastore only)."""
    width = max(len(q) for q in queries)
    tokens = np.zeros((len(queries), width), np.int32)
    for row, query in enumerate(queries):
        tokens[row, : len(query)] = query
    found = rest_retrieve(store, tokens, np.array([len(q) for q in queries], np.int32),
                          np.arange(len(queries), dtype=np.int32), params)
    return {"chain": found.chain_tokens, "chain_size": found.chain_size, "chain_prob": found.chain_prob,
            "tree": found.tree_tokens, "parents": found.tree_parents, "tree_size": found.tree_size,
            "tree_prob": found.tree_prob, "match_info": found.match_info}


def assert_drafts_alike(single: object, store: object, documents: list[np.ndarray], seed: int) -> None:
    """REST drafts from ``store`` exactly what it drafts from ``single`` for queries cut from
    ``documents``."""
    rng = np.random.default_rng(seed)
    queries = [document[i:i + 6].tolist() for document, i in zip(documents, rng.integers(0, 50, 12))]
    params = RestParams(n_min=1, n_max=6, max_matches=4, cont_len=8, top_k=16, chain_len=8, use_context=False)
    expected, found = drafts(single, queries, params), drafts(store, queries, params)
    for key, value in expected.items():
        np.testing.assert_array_equal(found[key], value, err_msg=key)


@st.composite
def sharded_corpora(draw: st.DrawFn) -> tuple[list[list[int]], list[int], int]:
    """Documents over a small vocabulary (many repeated suffixes), and where the shards split them."""
    vocab = draw(st.integers(2, 6))
    documents = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40), min_size=2, max_size=12))
    cuts = sorted(draw(st.sets(st.integers(1, len(documents) - 1), min_size=1, max_size=len(documents) - 1)))
    return documents, cuts, vocab


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corpus=sharded_corpora(), data=st.data())
def test_shards_draft_what_one_suffix_array_over_their_documents_drafts(corpus, data):
    documents, cuts, vocab = corpus
    offsets = data.draw(st.booleans(), label="first-token offsets")
    single = InMemoryStore.of(documents, vocab, offsets)
    bounds = [0, *cuts, len(documents)]
    sharded = InMemoryShards(tuple(InMemoryStore.of(documents[a:b], vocab, offsets)
                                   for a, b in itertools.pairwise(bounds)))
    queries = data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=10), min_size=1,
                                 max_size=6), label="queries")
    n_min = data.draw(st.integers(1, 3), label="n_min")
    params = RestParams(n_min=n_min, n_max=data.draw(st.integers(n_min, 8), label="n_max"),
                        max_matches=data.draw(st.integers(1, 12), label="max_matches"),
                        cont_len=data.draw(st.integers(1, 12), label="cont_len"), top_k=16, chain_len=8,
                        use_context=False, min_ratio=0.0)
    expected = drafts(single, queries, params)
    cached = sharded.cached(data.draw(st.integers(1, 4), label="cache slots"))
    depth = data.draw(st.integers(1, 24), label="merged order depth")  # below match + continuation: selection
    workers, parts = data.draw(st.integers(1, 2), label="workers"), data.draw(st.integers(1, 9), label="parts")
    np.testing.assert_array_equal(sharded.merged_entries(depth, workers, parts),
                                  reference_merged_order(sharded.shards, depth))
    merged = sharded.merged(depth, workers, parts)
    for found in (drafts(sharded, queries, params), drafts(cached, queries, params), drafts(cached, queries, params),
                  drafts(merged, queries, params)):
        for key, value in expected.items():
            np.testing.assert_array_equal(found[key], value, err_msg=key)


def test_many_matches_are_sampled_alike_across_shards():
    """Short matches in a larger store (thousands of suffixes per match, a few sampled)."""
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 8, int(rng.integers(20, 200))).tolist() for _ in range(300)]
    single = InMemoryStore.of(documents, 8, True)
    sharded = InMemoryShards(tuple(InMemoryStore.of(documents[i:i + 37], 8, True) for i in range(0, 300, 37)))
    queries = [rng.integers(0, 8, 12).tolist() for _ in range(64)]
    params = RestParams(n_min=1, n_max=1, max_matches=64, cont_len=10, top_k=32, chain_len=10, use_context=False)
    expected = drafts(single, queries, params)
    assert (expected["match_info"][:, 2] > 1000).all()
    cached = sharded.cached(4096)
    for found in (drafts(sharded, queries, params), drafts(cached, queries, params), drafts(cached, queries, params),
                  drafts(sharded.merged(11, workers=2, parts=13), queries, params)):
        for key, value in expected.items():
            np.testing.assert_array_equal(found[key], value, err_msg=key)


def test_shards_of_different_dtypes_are_refused():
    one = InMemoryStore.of([[1, 2, 3]], 4, False)
    other = InMemoryStore(one.tokens.astype(np.uint32), one.suffix_array, SEPARATOR)
    with pytest.raises(ValueError, match="share their token and suffix-array dtypes"):
        drafts(InMemoryShards((one, other)), [[1, 2]], RestParams(use_context=False))


# ---- The format on disk ----


def test_a_sharded_store_opens_and_drafts_like_one_array(tmp_path):
    documents = repetitive_documents(seed=3, count=12)
    single = open_datastore(write_token_store(tmp_path / "single", documents))
    sharded = open_datastore(write_sharded_store(tmp_path / "sharded", [documents[:5], documents[5:9], documents[9:]]))
    assert isinstance(sharded, ShardedDatastore) and len(sharded.shards) == 3
    assert sharded.manifest.num_tokens == single.manifest.num_tokens
    sharded.check_fully()
    assert_drafts_alike(single, sharded, documents, seed=4)
    description = sharded.describe()
    assert "3 shards" in description and "shard-00002" in description


def _edit(path: Path, **changes: object) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, **changes}))


BAD_STORES = {
    "a shard missing": (lambda p: shutil.rmtree(p / "shard-00001"), "shard-00001 does not exist"),
    "a shard's suffix array truncated": (
        lambda p: (p / "shard-00000" / "suffix_array.bin").write_bytes(
            (p / "shard-00000" / "suffix_array.bin").read_bytes()[:-4]), "shard-00000/suffix_array.bin"),
    "a name outside the store": (lambda p: _edit(p, shards=["shard-00000", "../elsewhere"]), "shard-NNNNN"),
    "no shards": (lambda p: _edit(p, shards=[]), "shard-NNNNN"),
    "totals that disagree": (lambda p: _edit(p, num_tokens=500), "its shards hold"),
    "ids without a next id": (lambda p: _edit(p, document_ids=[[[0, 2]], [[2, 4]], [[4, 6]]]), "given together"),
    "overlapping ids": (lambda p: _edit(p, document_ids=[[[0, 2]], [[1, 3]], [[4, 6]]], next_document_id=6),
                        "increasing, disjoint"),
    "ids past the next id": (lambda p: _edit(p, document_ids=[[[0, 2]], [[2, 4]], [[4, 8]]], next_document_id=6),
                             "below 'next_document_id'"),
    "ids a shard does not hold": (lambda p: _edit(p, document_ids=[[[0, 2]], [[2, 3]], [[4, 6]]],
                                                  next_document_id=6), "ids for shard-00001, which holds 2"),
    "a shard of another tokenizer": (
        lambda p: _edit(p / "shard-00001", tokenizer={**json.loads((p / "manifest.json").read_text())["tokenizer"],
                                                      "name": "other", "vocab_sha256": "e" * 64}),
        "shard-00001"),
}


@pytest.mark.parametrize("damage", BAD_STORES)
def test_a_bad_sharded_store_is_refused_naming_the_shard(tmp_path, damage):
    documents = repetitive_documents(seed=5, count=6)
    path = write_sharded_store(tmp_path / "store", [documents[:2], documents[2:4], documents[4:]])
    change, message = BAD_STORES[damage]
    change(path)
    with pytest.raises(DatastoreError, match=message):
        open_datastore(path, TINY_TOKENIZER)


def _merged_store(tmp_path: Path) -> tuple[Path, list[np.ndarray]]:
    """A store of three shards given its merged order by ``merge_order`` (as for a store built
    before builds wrote one), and its documents."""
    from vllm_retrieval_spec.datastores.sharded_edit import merge_order

    documents = repetitive_documents(seed=8, count=12)
    path = write_sharded_store(tmp_path / "store", [documents[:5], documents[5:9], documents[9:]])
    merge_order(path, progress=False)
    return path, documents


def test_a_merged_order_is_published_and_drafts_like_one_array(tmp_path):
    path, documents = _merged_store(tmp_path)
    single = open_datastore(write_token_store(tmp_path / "single", documents))
    store = open_datastore(path, TINY_TOKENIZER)
    order = store.manifest.merged_order
    assert store.merged_order is not None and order.shards == store.manifest.shards and order.dtype == "uint32"
    assert sorted(p.name for p in path.iterdir() if not p.name.startswith(".")) == sorted(
        [*store.manifest.shards, "manifest.json", order.file])
    store.check_fully()
    assert f"merged order {order.file}" in store.describe()
    assert_drafts_alike(single, store, documents, seed=9)


def _edit_order(path: Path, **changes: object) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    _edit(path, merged_order={**manifest["merged_order"], **changes})


BAD_ORDERS = {
    "truncated": (lambda p: (p / "order-00000.bin").write_bytes((p / "order-00000.bin").read_bytes()[:-4]),
                  r"order-00000\.bin is truncated"),
    "merged from other shards": (lambda p: _edit_order(p, shards=["shard-00000", "shard-00001"]),
                                 "'merged_order' merges"),
    "a name outside the store": (lambda p: _edit_order(p, file="../order-00000.bin"), r"order-NNNNN\.bin"),
    "an unknown dtype": (lambda p: _edit_order(p, dtype="int8"), "uint32 or uint64"),
    "a mistyped depth": (lambda p: _edit_order(p, depth="64"), "merged_order.depth"),
}


@pytest.mark.parametrize("damage", BAD_ORDERS)
def test_a_bad_merged_order_is_refused_naming_it(tmp_path, damage):
    path, _ = _merged_store(tmp_path)
    change, message = BAD_ORDERS[damage]
    change(path)
    with pytest.raises(DatastoreError, match=message):
        open_datastore(path, TINY_TOKENIZER)


def test_a_merged_order_that_fails_its_checksum_is_found_by_the_full_check(tmp_path):
    """Entries are not trusted before: one outside the store continues with nothing."""
    path, documents = _merged_store(tmp_path)
    entries = np.fromfile(path / "order-00000.bin", np.uint32)
    entries[::2] = np.iinfo(np.uint32).max
    entries.tofile(path / "order-00000.bin")
    store = open_datastore(path, TINY_TOKENIZER)
    params = RestParams(n_min=1, n_max=2, max_matches=64, cont_len=8, top_k=16, chain_len=8, use_context=False)
    assert drafts(store, [document[:3].tolist() for document in documents], params)["match_info"][:, 2].min() > 0
    with pytest.raises(DatastoreError, match=r"order-00000\.bin is corrupt"):
        store.check_fully()


# ---- Building with the real tokenizer ----


@pytest.mark.parametrize("workers", [1, 2])
def test_a_sharded_build_splits_documents_and_drafts_like_one_array(model_dir, python_sources, tmp_path, workers):
    from vllm_retrieval_spec.datastores.builder import build_datastore
    from vllm_retrieval_spec.datastores.resolve import tokenizer_identity
    from vllm_retrieval_spec.datastores.sources import InputSpec

    single_report = build_datastore(model_dir, [InputSpec(python_sources)], tmp_path / "single", progress=False)
    report = build_datastore(model_dir, [InputSpec(python_sources)], tmp_path / "sharded", progress=False,
                             shard_tokens=1_000, workers=workers)
    identity = tokenizer_identity(model_dir)
    single, sharded = open_datastore(tmp_path / "single", identity), open_datastore(tmp_path / "sharded", identity)
    assert isinstance(sharded, ShardedDatastore) and len(sharded.shards) >= 4 and sharded.merged_order is not None
    assert (report.num_tokens, report.num_documents) == (single_report.num_tokens, single_report.num_documents)
    assert all(shard.manifest.num_tokens <= 1_000 for shard in sharded.shards)
    joined = np.concatenate([np.asarray(shard.tokens) for shard in sharded.shards])
    np.testing.assert_array_equal(joined, np.asarray(single.tokens))  # documents in order, none split
    sharded.check_fully()
    rng = np.random.default_rng(7)
    starts = rng.integers(0, len(joined) - 16, 48)
    queries = [[t for t in joined[s:s + int(rng.integers(2, 12))].tolist() if t != single.separator] or [0]
               for s in starts]
    params = RestParams(n_min=1, n_max=8, max_matches=8, cont_len=12, top_k=24, chain_len=12, use_context=False)
    expected, found = drafts(single, queries, params), drafts(sharded, queries, params)
    for key, value in expected.items():
        np.testing.assert_array_equal(found[key], value, err_msg=key)
    assert (expected["chain_size"] > 0).mean() > 0.5


def test_sharded_build_requests_are_checked_first(model_dir, python_sources, tmp_path):
    from vllm_retrieval_spec.datastores.builder import build_datastore
    from vllm_retrieval_spec.datastores.sources import InputSpec

    with pytest.raises(ValueError, match="--shard-tokens must lie in"):
        build_datastore(model_dir, [InputSpec(python_sources)], tmp_path / "a", shard_tokens=0)
    with pytest.raises(ValueError, match="--workers must be at least 1"):
        build_datastore(model_dir, [InputSpec(python_sources)], tmp_path / "a", shard_tokens=100, workers=0)
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="sharded builds do not replace stores"):
        build_datastore(model_dir, [InputSpec(python_sources)], tmp_path / "kept", shard_tokens=100, replace=True)
    assert (tmp_path / "kept" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "a").exists()


KILLED_BUILD = """
import sys
from pathlib import Path
from vllm_retrieval_spec.datastores.builder import build_datastore
from vllm_retrieval_spec.datastores.sources import InputSpec

report = build_datastore(sys.argv[1], [InputSpec(Path(sys.argv[2]))], Path(sys.argv[3]), progress=False,
                         shard_tokens=int(sys.argv[4]))
print("kept", report.shards_kept)
"""


def test_a_killed_sharded_build_leaves_no_store_and_the_next_one_resumes(model_dir, python_sources, tmp_path):
    """kill -9 at random points of a build: never a store at the target; the next build of the
    same plan keeps what was tokenized and sorted, and its store equals an uninterrupted build's."""
    import random
    import signal
    import subprocess
    import sys
    import time

    from vllm_retrieval_spec.datastores.builder import build_datastore
    from vllm_retrieval_spec.datastores.sharded_builder import resumable_dir
    from vllm_retrieval_spec.datastores.sources import InputSpec

    for i in range(80):  # more documents: a build of ~1 s past the tokenizer's load
        (python_sources / f"extra_{i:02d}.py").write_text((python_sources / f"module_{i % 40:02d}.py").read_text())
    reference = build_datastore(model_dir, [InputSpec(python_sources)], tmp_path / "reference", progress=False,
                                shard_tokens=300)
    target = tmp_path / "store"
    command = [sys.executable, "-c", KILLED_BUILD, str(model_dir), str(python_sources), str(target), "300"]
    rng = random.Random(0)
    for round_ in range(3):  # killed while tokenizing (or loading), then twice while sorting
        child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        if round_ == 0:
            time.sleep(rng.uniform(0.5, 2.0))
        else:
            for _ in range(rng.randint(1, 4)):  # a shard sorted per line
                assert child.stdout.readline().startswith("sorting the suffixes")
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert not target.exists()
    assert resumable_dir(target).exists()
    finished = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout
    kept = finished.splitlines()[-1]
    assert kept.startswith("kept ") and int(kept.split()[1]) >= 2 and not resumable_dir(target).exists()
    store, expected = open_datastore(target), open_datastore(tmp_path / "reference")
    assert [s.manifest.num_tokens for s in store.shards] == [s.manifest.num_tokens for s in expected.shards]
    for shard, twin in zip(store.shards, expected.shards):
        np.testing.assert_array_equal(np.asarray(shard.tokens), np.asarray(twin.tokens))
        np.testing.assert_array_equal(np.asarray(shard.suffix_array), np.asarray(twin.suffix_array))
    store.check_fully()
    order = store.manifest.merged_order
    assert order is not None and order.sha256 == expected.manifest.merged_order.sha256
    assert sorted(p.name for p in target.iterdir()) == ["manifest.json", order.file,
                                                        *(s.path.name for s in store.shards)]
    assert reference.num_tokens == store.manifest.num_tokens


def test_a_resumable_build_refuses_what_it_did_not_write(model_dir, python_sources, tmp_path):
    from vllm_retrieval_spec.datastores.builder import build_datastore
    from vllm_retrieval_spec.datastores.sharded_builder import resumable_dir
    from vllm_retrieval_spec.datastores.sources import InputSpec

    work = resumable_dir(tmp_path / "store")
    work.mkdir()
    (work / "precious.txt").write_text("not ours")
    with pytest.raises(FileExistsError, match=r"precious\.txt'.*which no build wrote"):
        build_datastore(model_dir, [InputSpec(python_sources)], tmp_path / "store", progress=False, shard_tokens=500)
    assert (work / "precious.txt").read_text() == "not ours" and not (tmp_path / "store").exists()


def test_shards_sorted_on_a_local_ray_cluster_equal_a_local_build(model_dir, python_sources, tmp_path):
    pytest.importorskip("ray", reason="the [scale] extra (Ray) is not installed")
    from vllm_retrieval_spec.datastores.builder import build_datastore
    from vllm_retrieval_spec.datastores.sources import InputSpec

    local = build_datastore(model_dir, [InputSpec(python_sources)], tmp_path / "local", progress=False,
                            shard_tokens=1_500)
    on_ray = build_datastore(model_dir, [InputSpec(python_sources)], tmp_path / "ray", progress=False,
                             shard_tokens=1_500, workers=2, ray_address="local")
    assert (on_ray.num_tokens, on_ray.num_documents) == (local.num_tokens, local.num_documents)
    expected, found = open_datastore(tmp_path / "local"), open_datastore(tmp_path / "ray")
    assert len(found.shards) == len(expected.shards) >= 3
    for shard, twin in zip(found.shards, expected.shards):
        np.testing.assert_array_equal(np.asarray(shard.suffix_array), np.asarray(twin.suffix_array))
    found.check_fully()
    with pytest.raises(ValueError, match="--ray builds sharded stores"):
        build_datastore(model_dir, [InputSpec(python_sources)], tmp_path / "single", ray_address="local")
