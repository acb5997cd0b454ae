"""End to end in an in-process vLLM engine on the real model: speculation is lossless."""

from __future__ import annotations

import pytest

from conftest import CONCURRENT, assert_same_token_ids, generate_both_ways, running_engine
from vllm_retrieval_spec.evaluation.engine import EngineSpec, drafter_of
from vllm_retrieval_spec.evaluation.metrics import summarize

pytestmark = pytest.mark.engine

K = 4


def speculative(model_dir, proposer: str, options: dict | None = None) -> EngineSpec:
    return EngineSpec(
        model_dir,
        speculative_config={"model": proposer, "num_speculative_tokens": K},
        additional_config={"retrieval_spec": options} if options else None,
        max_num_seqs=CONCURRENT,
    )


def test_prompt_lookup_is_lossless_and_accepts_tokens(model_dir, e2e_prompts, baseline_runs):
    with running_engine(speculative(model_dir, "vllm_retrieval_spec.PromptLookupProposer")) as llm:
        runs = generate_both_ways(llm, e2e_prompts)
        stats = drafter_of(llm).stats
    for mode, run in runs.items():
        assert_same_token_ids(baseline_runs[mode], run)
        assert run.counters.accepted_tokens > 0, mode
        assert run.counters.drafts > 0, mode
        summary = summarize(run.records, run.counters)
        assert summary.honest_tokens_per_step > 1.0, mode
        assert summary.decode_steps < summarize(baseline_runs[mode].records, baseline_runs[mode].counters).decode_steps
    assert stats.failures == 0
    assert stats.draft_tokens >= sum(run.counters.draft_tokens for run in runs.values())


def test_rest_is_lossless_and_accepts_tokens(model_dir, code_store, e2e_prompts, baseline_runs):
    options = {"datastore": str(code_store), "tree": True}
    with running_engine(speculative(model_dir, "vllm_retrieval_spec.RestProposer", options)) as llm:
        runs = generate_both_ways(llm, e2e_prompts)
        drafter = drafter_of(llm)
    for mode, run in runs.items():
        assert_same_token_ids(baseline_runs[mode], run)
        assert run.counters.accepted_tokens > 0, mode
    assert drafter.stats.failures == 0
    assert drafter.datastore is not None and drafter.last_drafts is not None
    tree_tokens, tree_parents = drafter.last_drafts.tree(0)
    assert all(-1 <= parent < index for index, parent in enumerate(tree_parents))


def test_ngrammys_is_lossless_and_accepts_tokens(model_dir, ngram_table_dir, e2e_prompts, baseline_runs):
    options = {"ngram_table": str(ngram_table_dir), "tree": True}
    with running_engine(speculative(model_dir, "vllm_retrieval_spec.NGramProposer", options)) as llm:
        runs = generate_both_ways(llm, e2e_prompts)
        drafter = drafter_of(llm)
    for mode, run in runs.items():
        assert_same_token_ids(baseline_runs[mode], run)
        assert run.counters.accepted_tokens > 0, mode
    assert drafter.stats.failures == 0
    for tokens, parents in drafter.last_trees():
        assert all(-1 <= parent < index for index, parent in enumerate(parents))


def test_failing_proposer_keeps_the_engine_alive_and_exact(model_dir, e2e_prompts, baseline_runs):
    spec = speculative(model_dir, "vrs_test_proposers.FailingEveryThirdStepProposer")
    with running_engine(spec) as llm:
        runs = generate_both_ways(llm, e2e_prompts)
        stats = drafter_of(llm).stats
    for mode, run in runs.items():
        assert_same_token_ids(baseline_runs[mode], run)
        assert run.counters.accepted_tokens > 0
    assert stats.failures > 0


def test_no_speculation_baseline_takes_one_token_per_step(baseline_runs):
    for run in baseline_runs.values():
        summary = summarize(run.records, run.counters)
        assert summary.honest_tokens_per_step == 1.0
        assert summary.drafts == 0
