"""Fuzzing of everything read from disk: hypothesis corrupts a tiny artifact of every kind (REST
datastore, single-array and sharded, dense datastore per index type, n-gram table, output index snapshot) by truncating,
extending, flipping, reordering, retyping or overwriting with extreme values any of its files,
manifest included (and the manifest's values by JSON-aware edits: wrong types, huge numbers,
missing or extra keys). Opening and drafting must then end in a clear refusal (the artifact's
own error, naming a file of it) or in well-formed drafts, and a changed data file of an
artifact verified in the background must be refused at open or by that check. Never a crash,
hang or out-of-bounds read: ``scripts/sanitize.sh`` runs this file with the extension built
under ASan/UBSan. ``VRS_FUZZ_EXAMPLES`` sets the examples per artifact kind (default 100)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vllm_retrieval_spec.datastores import TokenDatastore
from vllm_retrieval_spec.datastores.dense import DenseDatastore
from vllm_retrieval_spec.datastores.dense_format import DenseDatastoreError
from vllm_retrieval_spec.datastores.format import DatastoreError
from vllm_retrieval_spec.datastores.output_index import OutputIndex
from vllm_retrieval_spec.datastores.output_snapshot import (
    CALIBRATION,
    TOKEN_FACTORS,
    OutputSnapshotError,
    read_counts,
    read_snapshot,
)
from vllm_retrieval_spec.datastores.sharded import ShardedDatastore, open_datastore
from vllm_retrieval_spec.goodput.calibration import AcceptanceCalibration
from vllm_retrieval_spec.goodput.token_factor import TokenFactor
from vllm_retrieval_spec.kernels.rest import RestParams, rest_retrieve
from vllm_retrieval_spec.ngrams import table as ngram_table
from vllm_retrieval_spec.ngrams.drafts import MixedStrategy, mixed_drafts
from vllm_retrieval_spec.ngrams.table import NgramTable, NgramTableError
from vllm_retrieval_spec.storage import MANIFEST, StorageError

from vrs_artifacts import (
    CALIBRATION_COUNTS,
    TINY_TOKENIZER,
    TOKEN_FACTOR_COUNTS,
    VOCAB,
    repetitive_documents,
    write_dense_store,
    write_ngram_table,
    write_output_snapshot,
    write_sharded_store,
    write_token_store,
)

EXAMPLES = int(os.environ.get("VRS_FUZZ_EXAMPLES", "100"))
OPAQUE = np.dtype(np.uint8)  # files read by others (FAISS): any width may be damaged
EXTREMES = [0, 1, -1, 2**15, 2**16 - 1, 2**31 - 1, -2**31, 2**32 - 1, 2**53, 2**63 - 1, -2**63, 2**64, 10**30]
# Damaged transforms (huge finite floats) overflow in the key arithmetic; NumPy warns, nothing breaks.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def pack_contexts(contexts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Contexts as the kernels take them: tokens ``[rows, width]`` (0-padded), lengths, rows."""
    tokens = np.zeros((len(contexts), max(map(len, contexts))), dtype=np.int32)
    for row, context in enumerate(contexts):
        tokens[row, :len(context)] = context
    return tokens, np.array([len(c) for c in contexts], np.int32), np.arange(len(contexts), dtype=np.int32)


# Drafted from: the openings of the pristine store's documents, and random ids.
CONTEXT_TOKENS, CONTEXT_LENGTHS, ROWS = pack_contexts(
    [*(document[:12] for document in repetitive_documents(seed=0)[:3]), np.random.default_rng(1).integers(0, VOCAB, 20)]
)
DENSE_K = 64  # neighbours searched per state
REST_PARAMS = RestParams(n_max=6, max_matches=16, cont_len=5, top_k=12, chain_len=5)


def assert_drafted_ids(tokens: np.ndarray, sizes: np.ndarray, vocab_size: int) -> None:
    """Every drafted id (the first ``sizes[r]`` of row r) lies in ``[0, vocab_size)``."""
    for row, size in zip(tokens, sizes):
        assert 0 <= size <= len(row)
        assert ((row[:size] >= 0) & (row[:size] < vocab_size)).all(), row[:size]


def draft_rest(store: TokenDatastore | ShardedDatastore) -> None:
    drafts = rest_retrieve(store, CONTEXT_TOKENS, CONTEXT_LENGTHS, ROWS, REST_PARAMS)
    vocab = store.manifest.tokenizer.vocab_size
    assert_drafted_ids(drafts.chain_tokens, drafts.chain_size, vocab)
    assert_drafted_ids(drafts.tree_tokens, drafts.tree_size, vocab)
    if not store.usable:
        assert (drafts.match_info[:, 0] == 0).all()


def draft_dense(store: DenseDatastore) -> None:
    store.set_nprobe(DENSE_K)  # every list (so that every stored label can come back)
    states = np.random.default_rng(0).normal(size=(4, store.hidden_size)).astype(np.float32)
    scores, values = store.search(states, k=DENSE_K)
    assert values.shape == (4, DENSE_K, store.value_tokens) and scores.shape == (4, DENSE_K)
    missing = (values == -1).all(axis=2)
    assert (scores[missing] == -np.inf).all() and (store.usable or missing.all())
    assert ((values[~missing] >= 0) & (values[~missing] < store.manifest.model.vocab_size)).all()


def draft_ngrams(table: NgramTable) -> None:
    drafts = mixed_drafts(table, CONTEXT_TOKENS, CONTEXT_LENGTHS, ROWS, MixedStrategy(3, 4, 2, "context-first"),
                          with_trees=True)
    vocab = table.model.vocab_size
    assert_drafted_ids(drafts.tokens.reshape(-1, drafts.tokens.shape[2]), drafts.lengths.reshape(-1), vocab)
    assert_drafted_ids(drafts.tree_tokens, drafts.tree_size, vocab)


def open_output_snapshot(directory: Path) -> list[np.ndarray]:
    sequences = read_snapshot(directory.parent, TINY_TOKENIZER)  # the newest snapshot: the only one
    assert sequences is not None
    for name, shape, learned in (("calibration", CALIBRATION_COUNTS, AcceptanceCalibration()),
                                 ("token_factors", TOKEN_FACTOR_COUNTS, TokenFactor(vocab_size=VOCAB))):
        counts = read_counts(directory.parent, name, shape)  # None: a manifest that lists none
        if counts is not None:
            learned.restore_counts(counts)
    return sequences


def draft_output_index(sequences: list[np.ndarray]) -> None:
    index = OutputIndex(4096, background=False)
    for sequence in sequences:
        index.add(sequence)
    drafts = rest_retrieve(None, CONTEXT_TOKENS, CONTEXT_LENGTHS, ROWS, REST_PARAMS, output_index=index.native)
    assert_drafted_ids(drafts.chain_tokens, drafts.chain_size, VOCAB)
    assert_drafted_ids(drafts.tree_tokens, drafts.tree_size, VOCAB)


@dataclass(frozen=True)
class ArtifactKind:
    """How to write a pristine artifact, open it and draft from it; whether the server verifies
    its checksums in the background (``verify_in_background``, then ``usable``)."""

    write: Callable[[Path], Path]
    open: Callable[[Path], Any]
    draft: Callable[[Any], None]
    error: type[StorageError]
    files: dict[str, np.dtype]  # data file -> element type
    verified_in_background: bool


_DENSE_FILES = {"values.bin": np.dtype(np.int32), "mean.bin": np.dtype(np.float32), "std.bin": np.dtype(np.float32),
                "components.bin": np.dtype(np.float32), "index.faiss": OPAQUE}
KINDS = {
    "rest": ArtifactKind(functools.partial(write_token_store, documents=repetitive_documents(seed=0)),
                         TokenDatastore.open, draft_rest, DatastoreError,
                         {"tokens.bin": np.dtype(np.uint16), "suffix_array.bin": np.dtype(np.int32)}, True),
    "rest-sharded": ArtifactKind(
        functools.partial(write_sharded_store, shards=[repetitive_documents(seed=3), repetitive_documents(seed=4)]),
        open_datastore, draft_rest, DatastoreError,
        {f"shard-0000{i}/{name}": dtype for i in range(2)
         for name, dtype in (("tokens.bin", np.dtype(np.uint16)), ("suffix_array.bin", np.dtype(np.int32)))}, True),
    **{f"dense-{index_type}": ArtifactKind(functools.partial(write_dense_store, index_type=index_type),
                                           DenseDatastore.open, draft_dense, DenseDatastoreError, _DENSE_FILES, True)
       for index_type in ("flat", "ivf_flat", "ivf_pq")},
    "ngram-table": ArtifactKind(write_ngram_table, NgramTable.open, draft_ngrams, NgramTableError,
                                {name: np.dtype(np.float32 if name == ngram_table.BIGRAM_PROBS else np.int32)
                                 for name in (ngram_table.BIGRAM_TOKENS, ngram_table.BIGRAM_PROBS,
                                              ngram_table.EXTENDED, ngram_table.UNIGRAM_RANKING)},
                                False),
    "output-snapshot": ArtifactKind(write_output_snapshot, open_output_snapshot, draft_output_index,
                                    OutputSnapshotError,
                                    {"tokens.bin": np.dtype(np.uint32), CALIBRATION: OPAQUE, TOKEN_FACTORS: OPAQUE},
                                    False),
}


# ---- Corruptions: each changes one file in place ----

def json_values() -> st.SearchStrategy[Any]:
    """Values a manifest should never hold where it holds something else: wrong types, extremes."""
    scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(EXTREMES), st.integers(-3, 300),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                        st.sampled_from(["uint16", "int64", "float32", "flat", "ivf_pq", "0" * 64]))
    return st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=4), scalars, max_size=2))


def json_paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into a parsed JSON value (the root excluded)."""
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return [p for key, child in children for p in ((*path, key), *json_paths(child, (*path, key)))]


def edit_manifest(data: st.DataObject, path: Path) -> None:
    """Replace, drop or add one value anywhere in the manifest."""
    manifest = json.loads(path.read_text())
    where = data.draw(st.sampled_from(json_paths(manifest)), label="manifest path")
    parent = functools.reduce(lambda node, key: node[key], where[:-1], manifest)
    action = data.draw(st.sampled_from(["replace", "drop", "add"]), label="manifest edit")
    if action == "drop" and isinstance(parent, dict):
        del parent[where[-1]]
    elif action == "add" and isinstance(parent, dict):
        parent[data.draw(st.text(min_size=1, max_size=6), label="new key")] = data.draw(json_values())
    else:
        parent[where[-1]] = data.draw(json_values(), label="new value")
    path.write_text(json.dumps(manifest))


def extreme_values(dtype: np.dtype) -> list[Any]:
    """:data:`EXTREMES` as ``dtype`` holds them: integers wrapped (two's complement), floats
    converted, plus NaN and infinities."""
    if dtype.kind == "f":
        return [dtype.type(float(v)) for v in EXTREMES] + [dtype.type(v) for v in (np.nan, np.inf, -np.inf)]
    unsigned = np.dtype(f"u{dtype.itemsize}")
    return [np.array(v % 2 ** (8 * dtype.itemsize), dtype=unsigned).view(dtype)[()] for v in EXTREMES]


def damage_values(data: st.DataObject, values: np.ndarray, op: str) -> np.ndarray:
    """``values`` reordered (a few neighbours permuted), retyped, or with a few extreme values."""
    if op == "reorder":
        order = list(data.draw(st.permutations(range(min(len(values), 8))), label="order"))
        start = data.draw(st.integers(0, len(values) - len(order)), label="start")
        values[start:start + len(order)] = values[start:start + len(order)][order]
        return values
    if op == "retype":
        return values.astype(data.draw(st.sampled_from([np.int16, np.int64, np.float32, np.float64]), label="as"))
    extremes = extreme_values(values.dtype)
    for _ in range(data.draw(st.integers(1, 4), label="count")):
        values[data.draw(st.integers(0, len(values) - 1), label="at")] = data.draw(st.sampled_from(extremes))
    return values


def damage_bytes(data: st.DataObject, path: Path, dtype: np.dtype) -> None:
    """Truncate, extend, flip bits, or damage the elements (of ``dtype``; of a drawn width in an
    opaque file): reorder, retype, extreme values."""
    raw = path.read_bytes()
    op = data.draw(st.sampled_from(["truncate", "extend", "flip", "reorder", "retype", "extreme"]), label="op")
    if op == "truncate" or not raw:
        path.write_bytes(raw[:data.draw(st.integers(0, max(len(raw) - 1, 0)), label="keep")])
    elif op == "extend":
        path.write_bytes(raw + data.draw(st.binary(min_size=1, max_size=64), label="tail"))
    elif op == "flip":
        flipped = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            flipped[data.draw(st.integers(0, len(raw) - 1), label="at")] ^= data.draw(st.integers(1, 255), label="mask")
        path.write_bytes(flipped)
    else:
        width = dtype if dtype != OPAQUE else data.draw(st.sampled_from([np.dtype(np.int32), np.dtype(np.int64)]))
        whole = len(raw) // width.itemsize * width.itemsize
        if whole:
            values = damage_values(data, np.frombuffer(raw[:whole], dtype=width).copy(), op)
            path.write_bytes(values.tobytes() + raw[whole:])


def corrupt(data: st.DataObject, directory: Path, kind: ArtifactKind) -> bool:
    """Damage one file of the artifact in ``directory``; whether a data file's bytes changed."""
    name = data.draw(st.sampled_from([MANIFEST, *kind.files]), label="file")
    path = directory / name
    before = path.read_bytes()
    if name == MANIFEST and data.draw(st.booleans(), label="json edit"):
        edit_manifest(data, path)
    else:
        damage_bytes(data, path, kind.files.get(name, OPAQUE))
    return name != MANIFEST and path.read_bytes() != before


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pristine")
    return {name: kind.write(root / name) for name, kind in KINDS.items()}


def refused_in_background(artifact: Any, kind: ArtifactKind) -> bool:
    """The server's background check; drafting goes on after a refusal (without the artifact)."""
    artifact.verify_in_background().join()
    kind.draft(artifact)
    return not artifact.usable


@pytest.mark.parametrize("name", list(KINDS))
def test_pristine_artifacts_open_draft_and_pass_their_checksums(pristine, name):
    kind = KINDS[name]
    artifact = kind.open(pristine[name])
    kind.draft(artifact)
    assert not kind.verified_in_background or not refused_in_background(artifact, kind)


@pytest.mark.parametrize("name", list(KINDS))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.data_too_large])
@given(data=st.data())
def test_a_corrupt_artifact_is_refused_naming_a_file_or_drafts_well(pristine, name, data):
    kind = KINDS[name]
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(shutil.copytree(pristine[name], Path(scratch) / name / pristine[name].name))
        data_changed = corrupt(data, directory, kind)
        try:
            artifact = kind.open(directory)
        except StorageError as refusal:
            assert isinstance(refusal, kind.error), refusal
            assert f"{directory}/" in str(refusal), refusal
            event("refused at open")
            return
        kind.draft(artifact)
        if data_changed and kind.verified_in_background:
            assert refused_in_background(artifact, kind), "a changed data file passed the open and the checksum"
            event("refused by the background checksum")
        else:
            event("drafted (data changed)" if data_changed else "drafted")
