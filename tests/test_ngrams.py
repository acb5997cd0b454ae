"""N-Grammys: model-derived tables (real model), the mixed strategy, trees, bad tables."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from vllm_retrieval_spec.ngrams.drafts import MixedStrategy, NgramDrafts, mixed_drafts
from vllm_retrieval_spec.ngrams.table import (
    BIGRAM_PROBS,
    BIGRAM_TOKENS,
    EXTENDED,
    ModelIdentity,
    NgramTable,
    NgramTableError,
    bigram_top_k,
    extend_bigram,
)
from vllm_retrieval_spec.storage import write_manifest

from conftest import NGRAM_TABLE_TOKENS, fake_vllm_config, small_ngram_table


def test_extended_bigram_follows_the_greedy_bigram():
    top = np.array([[1, 2], [2, 0], [0, 1]], dtype=np.int32)  # token -> its top-2 next tokens
    extended = extend_bigram(top, 3)
    assert extended[0].tolist() == [[1, 2, 0], [2, 0, 1]]
    assert extended[2].tolist() == [[0, 1, 2], [1, 2, 0]]


def test_a_partial_tables_continuations_end_at_an_untabulated_token():
    top = np.array([[1, 3], [2, 0]], dtype=np.int32)  # rows for tokens 0 and 1 of a larger vocabulary
    extended = extend_bigram(top, 3)
    assert extended[0].tolist() == [[1, 2, -1], [3, -1, -1]]  # 2 and 3 have no row: nothing follows them
    assert extended[1].tolist() == [[2, -1, -1], [0, 1, 2]]


def test_a_partial_table_drafts_only_after_tabulated_tokens_and_up_to_a_continuations_end():
    from types import SimpleNamespace

    top = np.array([[1, 3], [2, 0]], dtype=np.int32)
    table = SimpleNamespace(max_drafts=2, max_draft_len=3, tokens=2, extended=extend_bigram(top, 3),
                            bigram_probs=np.array([[0.6, 0.3], [0.5, 0.4]], np.float32))
    tokens, lengths, rows = as_rows([[7, 0], [7, 1], [1, 5]])
    drafts = mixed_drafts(table, tokens, lengths, rows, MixedStrategy(2, 3, 1, "bigram-only"))
    assert drafts.tokens[0].tolist() == [[1, 2, -1], [3, -1, -1]] and drafts.lengths[0].tolist() == [2, 1]
    assert drafts.tokens[1].tolist() == [[2, -1, -1], [0, 1, 2]] and drafts.lengths[1].tolist() == [1, 3]
    assert drafts.lengths[2].tolist() == [0, 0] and drafts.chain(2) == []  # 5 has no row
    assert drafts.weights[0].tolist() == pytest.approx([0.6, 0.3]) and drafts.weights[2].tolist() == [0, 0]


def as_rows(contexts):
    width = max(len(c) for c in contexts)
    tokens = np.zeros((len(contexts), width), dtype=np.int32)
    for row, context in enumerate(contexts):
        tokens[row, : len(context)] = context
    return tokens, np.array([len(c) for c in contexts], np.int32), np.arange(len(contexts), dtype=np.int32)


def test_context_first_then_bigram():
    tokens, lengths, rows = as_rows([[5, 7, 8, 5, 9, 5], [1, 2]])
    drafts = mixed_drafts(small_ngram_table(), tokens, lengths, rows, MixedStrategy(3, 2, 1, "context-first"))
    assert drafts.from_context.tolist() == [2, 0]
    # row 0: context drafts after "5" (the most recent first on equal counts), then the bigram of 5
    assert drafts.tokens[0].tolist() == [[9, 5], [7, 8], [6, 7]]
    assert drafts.lengths[0].tolist() == [2, 2, 2]
    assert drafts.tokens[1].tolist() == [[3, 4], [4, 5], [5, 6]]
    assert drafts.chain(0) == [9, 5] and drafts.chain(1) == [3, 4]


def test_mixing_policies():
    tokens, lengths, rows = as_rows([[5, 7, 5]])
    table = small_ngram_table()
    only_context = mixed_drafts(table, tokens, lengths, rows, MixedStrategy(3, 2, 1, "context-only"))
    assert only_context.lengths[0].tolist() == [2, 0, 0]
    only_bigram = mixed_drafts(table, tokens, lengths, rows, MixedStrategy(3, 2, 1, "bigram-only"))
    assert only_bigram.tokens[0].tolist() == [[6, 7], [7, 8], [8, 9]]


def test_drafts_merge_into_a_parents_first_tree_in_draft_order():
    drafts = NgramDrafts(
        tokens=np.array([[[1, 2, 3], [1, 2, 4], [5, 6, -1]]], dtype=np.int32),
        lengths=np.array([[3, 3, 2]], dtype=np.int32),
        from_context=np.array([3], dtype=np.int32),
    )
    tokens, parents = drafts.tree(0)
    assert tokens == [1, 2, 3, 4, 5, 6]
    assert parents == [-1, 0, 1, 1, -1, 4]
    # a node budget keeps the best drafts whole: the first 3 nodes are draft 0
    assert (tokens[:3], parents[:3]) == ([1, 2, 3], [-1, 0, 1])


def test_table_rows_are_the_models_own_bigram_and_deterministic(model_dir, ngram_table_dir):
    import torch
    from transformers import AutoModelForCausalLM

    table = NgramTable.open(ngram_table_dir, expected_model=ModelIdentity.of(model_dir))
    assert table.tokens == (NGRAM_TABLE_TOKENS or 49152)
    assert table.bigram_tokens.shape == (table.tokens, 10) and table.extended.shape == (table.tokens, 10, 8)
    assert table.unigram_ranking is not None and sorted(table.unigram_ranking[:5].tolist()) != []
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prefix = table.manifest["prefix"]
    assert prefix == [0]  # SmolLM2's <|endoftext|>: where a document starts
    again_tokens, again_probs = bigram_top_k(model, range(1024), 10, batch_size=1024, prefix=prefix)
    assert np.array_equal(again_tokens, table.bigram_tokens[:1024])
    assert np.array_equal(again_probs, table.bigram_probs[:1024])
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([[*prefix, 1604]])).logits[0, -1]
    assert int(logits.argmax()) == int(table.bigram_tokens[1604, 0])
    assert len(np.unique(table.bigram_tokens[:, 0])) > 100  # not one attractor token for all
    assert np.all(np.diff(table.bigram_probs[:1024], axis=1) <= 0)


def test_table_of_another_model_is_refused_at_engine_start(model_dir, ngram_table_dir, tmp_path):
    from vllm_retrieval_spec.proposers.ngrammys import NGrammysProposer

    other = tmp_path / "other-model"
    shutil.copytree(model_dir, other, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6  # a different model of the same architecture and vocabulary
    (other / "config.json").write_text(json.dumps(config))
    vllm_config = fake_vllm_config(max_model_len=64, options={"ngram_table": str(ngram_table_dir)}, model=str(other))
    with pytest.raises(NgramTableError, match=r"built for model 'SmolLM2.*served with model 'other-model'"):
        NGrammysProposer(vllm_config)


def test_missing_or_truncated_tables_are_named(ngram_table_dir, tmp_path):
    with pytest.raises(NgramTableError, match="is not an n-gram table"):
        NgramTable.open(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(ngram_table_dir, broken)
    path = broken / "extended_bigram.bin"
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(NgramTableError, match=r"extended_bigram\.bin is truncated or corrupt"):
        NgramTable.open(broken)


def test_ngram_options_are_validated():
    from vllm_retrieval_spec.options import OptionsError, RetrievalSpecOptions

    with pytest.raises(OptionsError, match=r"retrieval_spec\.ngrammys_mixing must be one of 'context-first'"):
        RetrievalSpecOptions.from_dict({"ngrammys_mixing": "random"})
    assert dataclasses.replace(RetrievalSpecOptions(), ngrammys_drafts=3).ngrammys_drafts == 3


TINY_VOCAB, TINY_K, TINY_W = 10, 3, 4


def write_tiny_table(directory: Path, tokens: int = TINY_VOCAB, **manifest_changes: object) -> Path:
    """A table in the on-disk format without a model: token t's bigram is t+1, t+2, ... (rows
    for the first ``tokens`` ids, in the manifest when fewer than all)."""
    top = small_ngram_table(TINY_K, TINY_W).extended[:tokens, :, 0].copy()
    if tokens < TINY_VOCAB:
        manifest_changes = {"tokens": tokens, **manifest_changes}
    directory.mkdir(parents=True)
    top.tofile(directory / BIGRAM_TOKENS)
    np.full(top.shape, 1.0 / TINY_K, dtype=np.float32).tofile(directory / BIGRAM_PROBS)
    extend_bigram(top, TINY_W).tofile(directory / EXTENDED)
    identity = ModelIdentity("tiny", TINY_VOCAB, "c" * 64, "v" * 64)
    manifest = {"format_version": 1, "model": dataclasses.asdict(identity), "k": TINY_K, "w": TINY_W,
                "unigram": False, "prefix": [], "files": {}, "build": {}}
    write_manifest(directory, {**manifest, **manifest_changes})
    return directory


def test_a_table_is_memory_mapped_read_only(tmp_path):
    table = NgramTable.open(write_tiny_table(tmp_path / "table"))
    assert (table.max_drafts, table.max_draft_len) == (TINY_K, TINY_W) and table.unigram_ranking is None
    assert table.extended.shape == (TINY_VOCAB, TINY_K, TINY_W) and table.extended[2, 0].tolist() == [3, 4, 5, 6]
    assert isinstance(table.bigram_tokens, np.memmap) and not table.bigram_tokens.flags.writeable


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"format_version": 2}, r"has format version 2, this package reads version 1; rebuild the n-gram table"),
     ({"k": "3"}, r"manifest\.json is corrupt \('k' is '3'\); rebuild the n-gram table"),
     ({"model": {"name": "tiny"}}, r"manifest\.json is corrupt \(.*missing 3 required positional arguments"),
     ({"unigram": True}, r"unigram_ranking\.bin is missing; rebuild the n-gram table")],
)
def test_bad_table_manifests_are_named(tmp_path, changes, message):
    with pytest.raises(NgramTableError, match=message):
        NgramTable.open(write_tiny_table(tmp_path / "table", **changes))


def test_a_partial_table_opens_with_its_rows_and_a_bad_token_count_is_named(tmp_path):
    table = NgramTable.open(write_tiny_table(tmp_path / "table", tokens=6))
    assert table.tokens == 6 and table.extended.shape == (6, TINY_K, TINY_W)
    assert table.extended[5, 0].tolist() == [6, -1, -1, -1]  # 6 has no row
    manifest = json.loads((table.path / "manifest.json").read_text())
    write_manifest(table.path, {**manifest, "tokens": 11})
    with pytest.raises(NgramTableError, match=r"manifest\.json is corrupt \('tokens' must be an integer in \[1, 10\], "
                                              r"got 11\)"):
        NgramTable.open(table.path)


def test_a_missing_manifest_key_is_named(tmp_path):
    table_dir = write_tiny_table(tmp_path / "table")
    manifest = json.loads((table_dir / "manifest.json").read_text())
    del manifest["w"]
    write_manifest(table_dir, manifest)
    with pytest.raises(NgramTableError, match=r"manifest\.json is corrupt \(missing key\(s\) 'w'\)"):
        NgramTable.open(table_dir)


def test_a_table_file_of_the_wrong_size_is_named(tmp_path):
    table_dir = write_tiny_table(tmp_path / "table")
    with open(table_dir / BIGRAM_PROBS, "ab") as handle:
        handle.write(b"\0" * 4)
    with pytest.raises(NgramTableError, match=r"bigram_probs\.bin is truncated or corrupt: 124 bytes, the manifest "
                                              r"says 10 x 3 x float32 = 120 bytes; rebuild the n-gram table"):
        NgramTable.open(table_dir)
