"""N-Grammys: model-derived tables (real model), the mixed strategy, trees, bad tables."""

from __future__ import annotations

import dataclasses
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_retrieval_spec.ngrams.drafts import NgramDrafts, mixed_drafts
from vllm_retrieval_spec.ngrams.table import (
    ModelIdentity,
    NgramTable,
    NgramTableError,
    bigram_top_k,
    extend_bigram,
)


def test_extended_bigram_follows_the_greedy_bigram():
    top = np.array([[1, 2], [2, 0], [0, 1]], dtype=np.int32)  # token -> its top-2 next tokens
    extended = extend_bigram(top, 3)
    assert extended[0].tolist() == [[1, 2, 0], [2, 0, 1]]
    assert extended[2].tolist() == [[0, 1, 2], [1, 2, 0]]


def small_table(k=3, w=4) -> SimpleNamespace:
    top = np.array([[(t + i + 1) % 10 for i in range(k)] for t in range(10)], dtype=np.int32)
    return SimpleNamespace(k=k, w=w, extended=extend_bigram(top, w))


def as_rows(contexts):
    width = max(len(c) for c in contexts)
    tokens = np.zeros((len(contexts), width), dtype=np.int32)
    for row, context in enumerate(contexts):
        tokens[row, : len(context)] = context
    return tokens, np.array([len(c) for c in contexts], np.int32), np.arange(len(contexts), dtype=np.int32)


def test_context_first_then_bigram():
    tokens, lengths, rows = as_rows([[5, 7, 8, 5, 9, 5], [1, 2]])
    drafts = mixed_drafts(small_table(), tokens, lengths, rows, k=3, w=2, q=1, mixing="context-first")
    assert drafts.from_context.tolist() == [2, 0]
    # row 0: context drafts after "5" (the most recent first on equal counts), then the bigram of 5
    assert drafts.tokens[0].tolist() == [[9, 5], [7, 8], [6, 7]]
    assert drafts.lengths[0].tolist() == [2, 2, 2]
    assert drafts.tokens[1].tolist() == [[3, 4], [4, 5], [5, 6]]
    assert drafts.chain(0) == [9, 5] and drafts.chain(1) == [3, 4]


def test_mixing_policies():
    tokens, lengths, rows = as_rows([[5, 7, 5]])
    table = small_table()
    only_context = mixed_drafts(table, tokens, lengths, rows, k=3, w=2, q=1, mixing="context-only")
    assert only_context.lengths[0].tolist() == [2, 0, 0]
    only_bigram = mixed_drafts(table, tokens, lengths, rows, k=3, w=2, q=1, mixing="bigram-only")
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
    assert table.bigram_tokens.shape == (49152, 10) and table.extended.shape == (49152, 10, 8)
    assert table.unigram_ranking is not None and sorted(table.unigram_ranking[:5].tolist()) != []
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prefix = table.manifest["prefix"]
    assert prefix == [0]  # SmolLM2's <|endoftext|>: where a document starts
    again_tokens, again_probs = bigram_top_k(model, range(1024), 10, batch_size=1024, prefix=prefix)
    assert np.array_equal(again_tokens, table.bigram_tokens[:1024])
    assert np.array_equal(again_probs, table.bigram_probs[:1024])
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prefix + [1604]])).logits[0, -1]
    assert int(logits.argmax()) == int(table.bigram_tokens[1604, 0])
    assert len(np.unique(table.bigram_tokens[:, 0])) > 100  # not one attractor token for all
    assert np.all(np.diff(table.bigram_probs[:1024], axis=1) <= 0)


def test_table_of_another_model_is_refused_at_engine_start(model_dir, ngram_table_dir, tmp_path):
    from vllm_retrieval_spec.proposers.ngrammys import NGramProposer

    other = tmp_path / "other-model"
    shutil.copytree(model_dir, other, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6  # a different model of the same architecture and vocabulary
    (other / "config.json").write_text(json.dumps(config))
    vllm_config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=4),
        model_config=SimpleNamespace(max_model_len=64, model=str(other)),
        additional_config={"retrieval_spec": {"ngram_table": str(ngram_table_dir)}},
    )
    with pytest.raises(NgramTableError, match=r"built from model 'SmolLM2.*served model is 'other-model'"):
        NGramProposer(vllm_config)


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

    with pytest.raises(OptionsError, match=r"retrieval_spec\.mixing must be one of 'context-first'"):
        RetrievalSpecOptions.from_dict({"mixing": "random"})
    assert dataclasses.replace(RetrievalSpecOptions(), k=3).k == 3
