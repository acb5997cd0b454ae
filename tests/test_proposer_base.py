"""The custom_class plumbing of DraftProposer, without an engine."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_retrieval_spec.options import OptionsError
from vllm_retrieval_spec.proposers.prompt_lookup import PromptLookupProposer

from vrs_test_proposers import FailingEveryThirdStepProposer, OverlongProposer


def fake_vllm_config(k: int = 4, max_model_len: int = 32, options: dict | None = None):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        additional_config={"retrieval_spec": options} if options is not None else {},
    )


def vllm_buffers(contexts: list[list[int]], max_model_len: int = 32):
    token_ids = np.zeros((len(contexts) + 2, max_model_len), dtype=np.int32)
    num_tokens = np.zeros(len(contexts) + 2, dtype=np.int32)
    for row, context in enumerate(contexts):
        token_ids[row, : len(context)] = context
        num_tokens[row] = len(context)
    return num_tokens, token_ids


def test_rows_without_sampled_tokens_get_no_draft():
    proposer = PromptLookupProposer(fake_vllm_config())
    num_tokens, token_ids = vllm_buffers([[1, 2, 3, 1, 2], [1, 2, 3, 1, 2]])
    drafts = proposer.propose([[2], []], num_tokens, token_ids)
    assert drafts == [[3, 1, 2], []]
    assert proposer.stats.rows == 1 and proposer.stats.drafted_rows == 1


def test_never_more_than_k_tokens():
    proposer = OverlongProposer(fake_vllm_config(k=3))
    num_tokens, token_ids = vllm_buffers([[5, 6], [7]])
    assert proposer.propose([[6], [7]], num_tokens, token_ids) == [[1, 1, 1], [1, 1, 1]]


def test_drafts_stop_before_max_model_len():
    proposer = OverlongProposer(fake_vllm_config(k=4, max_model_len=10))
    num_tokens, token_ids = vllm_buffers([[1] * 7, [1] * 9, [1] * 10], max_model_len=10)
    assert proposer.propose([[1], [1], [1]], num_tokens, token_ids) == [[1, 1], [], []]


def test_a_failing_step_gets_no_drafts_is_counted_and_logged_once(caplog):
    proposer = FailingEveryThirdStepProposer(fake_vllm_config())
    num_tokens, token_ids = vllm_buffers([[1, 2, 3, 1, 2]])
    with caplog.at_level(logging.ERROR):
        results = [proposer.propose([[2]], num_tokens, token_ids) for _ in range(7)]
    assert results[2] == [[]] and results[5] == [[]]  # steps 3 and 6 failed
    assert results[0] == results[1] == results[6] == [[3, 1, 2]]
    assert proposer.stats.failures == 2
    assert proposer.stats.last_error == "RuntimeError: injected drafting failure"
    assert sum("failed to draft" in record.getMessage() for record in caplog.records) == 1


def test_options_are_validated_at_construction():
    with pytest.raises(OptionsError, match=r"unknown option\(s\) 'bogus' in additional_config\['retrieval_spec'\]"):
        PromptLookupProposer(fake_vllm_config(options={"bogus": 1}))
    proposer = PromptLookupProposer(fake_vllm_config(options={"context_ngram_max": 1}))
    num_tokens, token_ids = vllm_buffers([[1, 2, 3, 1, 2]])
    assert proposer.propose([[2]], num_tokens, token_ids) == [[3, 1, 2]]
