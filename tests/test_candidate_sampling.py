"""Candidate rules at temperature > 0 keep the model's distribution, in the real engine.

For every way our sampler verifies drafts — chains and trees, deterministic candidates and
candidates drawn from the drafter's own ``q`` (MCSS, with and without replacement), with and
without top-p — the tokens emitted at drafted positions over 300 seeded requests (2,000 at
``VRS_TEST_SCALE=full``) are compared with those of the engine without speculation (two-sample
chi-squared; fixed seeds, so they never flake). A deliberately wrong rule (accept every drawn
candidate the target allows) must fail the same check: the test has the power to see a lossy
rule.
"""

from __future__ import annotations

import numpy as np
import pytest
from distributions import engine_samples, two_sample_chi2_pvalue

from vllm_retrieval_spec.evaluation.engine import EngineSpec, drafter_of, spec_decode_counters

from conftest import running_engine
from scale import at_scale

pytestmark = pytest.mark.engine

# Every earlier colour recurs, so REST's context source drafts at every step with several
# candidates per node; the next colour is uncertain for the model. 65 tokens: two full KV blocks
# of 32 are shared by every request (prefix caching) and each prefills one token of its own.
COLOURS = "red, blue, green, red, blue, yellow, red, green, blue, red, yellow, green, blue, "
PROMPT = "- " + COLOURS * 2 + "red, blue, green, red, blue, yellow,"
BLOCK_SIZE = 32
REQUESTS = at_scale(ci=300, full=2000)
MAX_TOKENS = 4
DRAFTED_POSITIONS = (1, 2, 3)  # position 0 comes from the prefill step, before any draft
TEMPERATURE = 1.0
P_FLOOR = 1e-4
WRONG_RULE_P_CEILING = 1e-8
WRONG_RULE_REQUESTS = at_scale(ci=300, full=500)  # enough: the wrong rule is far off (p < 1e-8 already at 200)
K = 4
# Drafts at every step (budget fixed: at temperature 1.0 the goodput budget would rightly stop
# drafting here); context only, no output index: the drafts never depend on earlier requests.
REST = {"use_datastore": False, "use_output_index": False, "budget": "fixed"}
SAMPLED = {"candidates": "sampled"}
CONFIGS = {
    "chain-deterministic": ({}, {}),
    "chain-sampled": (SAMPLED, {}),
    "tree-deterministic": ({"tree": True}, {}),
    "tree-sampled": ({"tree": True, **SAMPLED}, {}),
    "tree-sampled-replacement": ({"tree": True, **SAMPLED, "candidate_replacement": True}, {}),
    "tree-sampled-top-p": ({"tree": True, **SAMPLED}, {"top_p": 0.9}),
}


def rest_engine(model_dir, options) -> EngineSpec:
    return EngineSpec(model_dir, speculative_config={"model": "vllm_retrieval_spec.RestProposer",
                                                     "num_speculative_tokens": K},
                      additional_config={"retrieval_spec": {**REST, **options}}, max_num_seqs=128,
                      block_size=BLOCK_SIZE)


def samples(llm, **sampling) -> np.ndarray:
    return engine_samples(llm, PROMPT, range(REQUESTS), MAX_TOKENS, TEMPERATURE, **sampling)


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[float, np.ndarray]:
    """Without speculation, by top-p."""
    with running_engine(EngineSpec(model_dir, max_num_seqs=128, block_size=BLOCK_SIZE)) as llm:
        return {1.0: samples(llm), 0.9: samples(llm, top_p=0.9)}


def drafted_positions_pvalues(reference: np.ndarray, tokens: np.ndarray) -> list[float]:
    return [two_sample_chi2_pvalue(reference[:, p], tokens[:, p]) for p in DRAFTED_POSITIONS]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_candidate_rule_samples_like_the_model(name, model_dir, reference):
    options, sampling = CONFIGS[name]
    with running_engine(rest_engine(model_dir, options)) as llm:
        before = spec_decode_counters(llm)
        tokens = samples(llm, **sampling)
        counters = spec_decode_counters(llm) - before
        session = drafter_of(llm).session
    assert counters.drafts >= REQUESTS and counters.accepted_tokens > 0, counters
    if options.get("candidates") == "sampled":
        assert session.stats.mcss_requests >= REQUESTS, "the drawn candidates were not verified with their q"
    if options.get("tree"):
        assert session.stats.branching_requests > 0, "no tree branched"
    p_values = drafted_positions_pvalues(reference[sampling.get("top_p", 1.0)], tokens)
    assert min(p_values) > P_FLOOR, f"{name}: drafted positions not distributed as without speculation: {p_values}"


def test_a_wrong_rule_is_caught(model_dir, reference, monkeypatch):
    """Drawn candidates verified with q = 0 are accepted whenever the target allows them: the
    output then follows the drafter's q, not the model, and the same check must see it."""
    from vllm_retrieval_spec.proposers import base

    def draw_with_zero_q(*args, **kwargs):
        drawn = sample_candidate_trees(*args, **kwargs)
        drawn.q_probs[:] = 0.0
        return drawn

    sample_candidate_trees = base.sample_candidate_trees
    monkeypatch.setattr(base, "sample_candidate_trees", draw_with_zero_q)
    with running_engine(rest_engine(model_dir, {"tree": True, **SAMPLED})) as llm:
        tokens = engine_samples(llm, PROMPT, range(WRONG_RULE_REQUESTS), MAX_TOKENS, TEMPERATURE)
    assert min(drafted_positions_pvalues(reference[1.0][:WRONG_RULE_REQUESTS], tokens)) < WRONG_RULE_P_CEILING


PENALTY_REQUESTS = at_scale(ci=300, full=600)


def test_penalties_keep_the_distribution_of_drawn_chains(model_dir):
    """Penalties apply to drafts as a sequence, which our kernel does not do: such chain steps go
    to vLLM's rejection sampler, given the drawn candidates' q as its draft probabilities, unless
    they hold a seeded request without drawn candidates (it must repeat exactly): then our kernel
    verifies every row on the logits vLLM's processors penalised along each chain (MCSS for the
    drawn rows). Either way the samples follow the penalised model."""
    penalty = {"repetition_penalty": 1.05}  # mild: a strong one steers away from every colour seen
    with running_engine(EngineSpec(model_dir, max_num_seqs=128, block_size=BLOCK_SIZE)) as llm:
        reference = engine_samples(llm, PROMPT, range(PENALTY_REQUESTS), MAX_TOKENS, TEMPERATURE, **penalty)
    with running_engine(rest_engine(model_dir, SAMPLED)) as llm:
        before = spec_decode_counters(llm)
        tokens = engine_samples(llm, PROMPT, range(PENALTY_REQUESTS), MAX_TOKENS, TEMPERATURE, **penalty)
        counters = spec_decode_counters(llm) - before
        session = drafter_of(llm).session
    assert counters.drafts >= PENALTY_REQUESTS // 2 and counters.accepted_tokens > 0, counters
    assert min(drafted_positions_pvalues(reference, tokens)) > P_FLOOR
    assert session.stats.mcss_requests > 0  # the steps with a seeded row: our kernel, penalised logits
