"""End to end in an in-process vLLM engine on the real model: speculation is lossless."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import CONCURRENT, E2E_MAX_TOKENS, assert_same_token_ids, generate_both_ways, running_engine
from vllm_retrieval_spec.evaluation.engine import EngineSpec, drafter_of, generate
from vllm_retrieval_spec.evaluation.metrics import summarize

pytestmark = pytest.mark.engine

K = 4
TREE_NODES = 16


def speculative(model_dir, proposer: str, options: dict | None = None, k: int = K) -> EngineSpec:
    return EngineSpec(
        model_dir,
        speculative_config={"model": proposer, "num_speculative_tokens": k},
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
    options = {"datastore": str(code_store)}
    with running_engine(speculative(model_dir, "vllm_retrieval_spec.RestProposer", options)) as llm:
        runs = generate_both_ways(llm, e2e_prompts)
        drafter = drafter_of(llm)
    for mode, run in runs.items():
        assert_same_token_ids(baseline_runs[mode], run)
        assert run.counters.accepted_tokens > 0, mode
    assert drafter.stats.failures == 0
    assert drafter.datastore is not None and drafter.last_drafts is not None


def test_ngrammys_is_lossless_and_accepts_tokens(model_dir, ngram_table_dir, e2e_prompts, baseline_runs):
    options = {"ngram_table": str(ngram_table_dir)}
    with running_engine(speculative(model_dir, "vllm_retrieval_spec.NGramProposer", options)) as llm:
        runs = generate_both_ways(llm, e2e_prompts)
        drafter = drafter_of(llm)
    for mode, run in runs.items():
        assert_same_token_ids(baseline_runs[mode], run)
        assert run.counters.accepted_tokens > 0, mode
    assert drafter.stats.failures == 0


@pytest.mark.parametrize("proposer", ["RestProposer", "NGramProposer"])
def test_tree_verification_is_lossless(proposer, model_dir, code_store, ngram_table_dir, e2e_prompts, baseline_runs):
    """Branching draft trees verified in one step (tree mask, depth positions, KV compaction)
    give exactly the greedy token ids of no speculation, at batch 1 and 8 in flight."""
    from vllm_retrieval_spec.verification.runner_hooks import STATS

    source = {"datastore": str(code_store)} if proposer == "RestProposer" else {"ngram_table": str(ngram_table_dir)}
    before = dataclasses.replace(STATS)
    spec = speculative(model_dir, f"vllm_retrieval_spec.{proposer}", {**source, "tree": True}, k=TREE_NODES)
    with running_engine(spec) as llm:
        runs = generate_both_ways(llm, e2e_prompts)
        drafter = drafter_of(llm)
    for mode, run in runs.items():
        assert_same_token_ids(baseline_runs[mode], run)
        assert run.counters.accepted_tokens > 0, mode
    assert drafter.stats.failures == 0
    assert STATS.tree_steps > before.tree_steps, "no step verified a branching tree"
    assert STATS.compacted_slots > before.compacted_slots, "no accepted path needed KV compaction"


def test_tree_verification_samples_at_temperature(model_dir, code_store, e2e_prompts):
    from vllm.exceptions import VLLMValidationError

    options = {"datastore": str(code_store), "tree": True}
    with running_engine(speculative(model_dir, "vllm_retrieval_spec.RestProposer", options, k=TREE_NODES)) as llm:
        run = generate(llm, e2e_prompts[:8], E2E_MAX_TOKENS, concurrency=CONCURRENT, temperature=0.8, seed=7, ignore_eos=True)
        with pytest.raises(VLLMValidationError, match="retrieval_spec.tree"):
            generate(llm, e2e_prompts[:1], 8, presence_penalty=0.5)
    assert run.counters.accepted_tokens > 0
    assert all(len(record.output_ids) == E2E_MAX_TOKENS for record in run.records)


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
