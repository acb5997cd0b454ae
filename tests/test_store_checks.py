"""A datastore's checks: the quick ones at open (suffix array a permutation, first-token
buckets, suffix order; C++) catch broken stores naming the file; the checksums verified in the
background stop drafting from a changed store without stopping the server."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from pydivsufsort import divsufsort

from vllm_retrieval_spec.datastores import DatastoreError, TokenDatastore
from vllm_retrieval_spec.datastores import reader as reader_module
from vllm_retrieval_spec.datastores.reader import first_token_offsets
from vllm_retrieval_spec.kernels.extension import load_extension
from vllm_retrieval_spec.kernels.rest import RestParams, rest_retrieve

from vrs_artifacts import repetitive_documents, write_token_store

SA_ONLY = r"suffix_array\.bin is corrupt: "
SA_OR_TOKENS = r"suffix_array\.bin \(or tokens\.bin\) is corrupt: "


@pytest.fixture()
def store_dir(tmp_path) -> Path:
    return write_token_store(tmp_path / "store", repetitive_documents(seed=1, count=20, length=200))


def rewrite(path: Path, dtype: str, change) -> None:
    """Apply ``change`` to the array in ``path`` and write it back."""
    values = np.fromfile(path, dtype=dtype)
    change(values)
    values.tofile(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [(lambda sa: sa.fill(7), SA_ONLY + r"its entries are not a permutation of \[0, \d+\)"),
     (lambda sa: sa.fill(-1), SA_ONLY + r"entry 0 is -1, outside \[0, \d+\)"),
     (lambda sa: sa.view(np.uint8).__setitem__(1001, sa.view(np.uint8)[1001] ^ 0x04),
      SA_ONLY + r"(its entries are not a permutation|entry \d+ is \d+, outside)"),
     (lambda sa: sa.__setitem__(slice(None), sa[::-1].copy()), SA_OR_TOKENS + r"entry 0 \(the suffix at \d+\) "
      r"starts with token 65535, but the token counts put it among the suffixes starting with \d+"),
     (lambda sa: sa.__setitem__([500, 501], sa[[501, 500]]), SA_OR_TOKENS + r"suffixes 500 and 501 \(at \d+ and "
      r"\d+\) are out of order")],
    ids=["one value", "all -1", "flipped bit", "reversed", "adjacent swap"],
)
def test_a_broken_suffix_array_is_refused_at_open_naming_the_file(store_dir, change, message):
    rewrite(store_dir / "suffix_array.bin", "int32", change)
    with pytest.raises(DatastoreError, match=message + r".*; rebuild the datastore"):
        TokenDatastore.open(store_dir)


def test_a_changed_token_is_refused_at_open(store_dir):
    rewrite(store_dir / "tokens.bin", "uint16", lambda tokens: tokens.__setitem__(100, (tokens[100] + 1) % 40))
    with pytest.raises(DatastoreError, match=SA_OR_TOKENS):
        TokenDatastore.open(store_dir)


def test_token_ids_beyond_the_vocabulary_name_the_first(store_dir):
    rewrite(store_dir / "tokens.bin", "uint16", lambda tokens: tokens.__setitem__(33, 41))
    message = r"tokens\.bin holds token ids >= the vocabulary size 40 \(token 41 at 33\)"
    with pytest.raises(DatastoreError, match=message):
        TokenDatastore.open(store_dir)


def shuffle_within_buckets(suffix_array: np.ndarray, offsets: np.ndarray) -> None:
    """Scramble the suffix order inside each first-token bucket, its ends kept (a permutation
    that passes the range, permutation and bucket checks)."""
    rng = np.random.default_rng(0)
    for lo, hi in itertools.pairwise(offsets):
        if hi - lo > 2:
            rng.shuffle(suffix_array[lo + 1:hi - 1])


def test_large_stores_sample_the_order_and_still_catch_a_scrambled_one(store_dir, monkeypatch):
    monkeypatch.setattr(reader_module, "ORDER_CHECK_SAMPLES", 64)
    offsets = TokenDatastore.open(store_dir).first_token_offsets
    rewrite(store_dir / "suffix_array.bin", "int32", lambda sa: shuffle_within_buckets(sa, offsets))
    message = SA_OR_TOKENS + r"suffixes \d+ and \d+ \(at \d+ and \d+\) are out of order"
    with pytest.raises(DatastoreError, match=message):
        TokenDatastore.open(store_dir)


def test_the_check_reads_nothing_outside_its_arrays():
    ext = load_extension()
    tokens = np.array([3, 1, 65535], dtype=np.uint16)
    garbage = ext.SuffixStore(tokens, np.array([2**31 - 1, -2**31, 1], np.int32), 65535,
                              np.array([5, -9, 2**40], np.int64))
    assert ext.check_suffix_store(garbage, 10, 32)[0] is True
    fine = ext.SuffixStore(tokens, np.array([1, 0, 2], np.int32), 65535, np.array([0, 0, 1, 1, 2], np.int64))
    assert ext.check_suffix_store(fine, 10, 32) is None
    assert ext.check_suffix_store(ext.SuffixStore(tokens, np.array([1, 0, 2], np.int32), 65535,
                                                  np.array([2**40, -3, 7], np.int64)), 10, 32)[0] is False


@pytest.mark.parametrize("token_dtype", [np.uint16, np.uint32])
@pytest.mark.parametrize("sa_dtype", [np.int32, np.int64])
def test_every_array_type_is_checked(token_dtype, sa_dtype):
    ext = load_extension()
    separator = np.iinfo(token_dtype).max
    tokens = np.array([*np.concatenate(repetitive_documents(seed=3)), separator], dtype=token_dtype)
    suffix_array = divsufsort(tokens).astype(sa_dtype)
    offsets = first_token_offsets(tokens, separator, 40)
    assert ext.check_suffix_store(ext.SuffixStore(tokens, suffix_array, separator, offsets), 1000, 32) is None
    suffix_array[[10, 11]] = suffix_array[[11, 10]]
    swapped = ext.check_suffix_store(ext.SuffixStore(tokens, suffix_array, separator, offsets), 1000, 32)
    assert swapped == (False, f"suffixes 10 and 11 (at {suffix_array[10]} and {suffix_array[11]}) are out of order")


def test_a_checksum_mismatch_found_in_the_background_stops_drafting_from_the_store(store_dir, caplog):
    manifest = json.loads((store_dir / "manifest.json").read_text())
    manifest["files"]["tokens.bin"]["sha256"] = "0" * 64
    (store_dir / "manifest.json").write_text(json.dumps(manifest))
    store = TokenDatastore.open(store_dir)
    context = np.asarray(store.tokens[:40], dtype=np.int32)[None]
    rows, lengths = np.array([0], np.int32), np.array([40], np.int32)
    before = rest_retrieve(store, context, lengths, rows, RestParams())
    assert before.match_info[0, 0] > 0 and before.chain_size[0] > 0
    with caplog.at_level(logging.ERROR):
        store.verify_in_background().join()
    assert not store.usable
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert f"{store_dir / 'tokens.bin'} is corrupt: sha256" in record.getMessage()
    assert "REST no longer drafts from it" in record.getMessage()
    after = rest_retrieve(store, context, lengths, rows, RestParams())
    assert after.match_info[0, 0] == 0 and after.chain_size[0] > 0  # the context still drafts


def test_an_intact_store_stays_usable(store_dir):
    store = TokenDatastore.open(store_dir)
    store.verify_in_background().join()
    assert store.usable
