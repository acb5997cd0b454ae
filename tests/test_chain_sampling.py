"""Chain verification at temperature > 0 keeps the model's distribution, in the real engine.

On the CPU build of vLLM 0.32 the rejection sampler expanded each request's temperature,
top-k and top-p over its verified tokens into uninitialised memory, so every chain-mode
method (ours and vLLM's ``ngram``) sampled token salad after the first token and a seeded
request did not repeat itself. The plugin replaces that expansion
(``integration/vllm_patches.py``); these tests compare, over many seeded requests, the
tokens emitted at drafted positions with those of the same engine without speculation
(two-sample chi-squared; fixed seeds, so they never flake).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from distributions import engine_samples, two_sample_chi2_pvalue

from vllm_retrieval_spec.evaluation.engine import EngineSpec, spec_decode_counters

from conftest import running_engine
from scale import at_scale, full_scale_only

pytestmark = pytest.mark.engine

# Every earlier token recurs, so every proposer drafts at every step; the next colour is
# uncertain for the model.
PROMPT = "red, blue, green, red, blue, yellow, red, green, blue, red, yellow, green, blue,"
REQUESTS = at_scale(ci=200, full=300)
MAX_TOKENS = 4
DRAFTED_POSITIONS = (1, 2, 3)  # position 0 comes from the prefill step, before any draft
TEMPERATURE = 1.0
P_FLOOR = 1e-4
K = 4

# Our proposers draft at every step here (budget "fixed"): this tests verification, and at
# temperature 1.0 the goodput budget would rightly stop drafting on these prompts. REST without
# its output index: drafts from earlier requests would make seeded requests unrepeatable.
FIXED = {"budget": "fixed"}
CHAIN_CONFIGS = {
    "prompt-lookup": ({"model": "vllm_retrieval_spec.PromptLookupProposer"}, FIXED),
    "rest": ({"model": "vllm_retrieval_spec.RestProposer"},
             {"use_datastore": False, "use_output_index": False, **FIXED}),
    "ngrammys": ({"model": "vllm_retrieval_spec.NGrammysProposer"}, "ngram_table"),
    "vllm-ngram": ({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4}, None),
    "vllm-suffix": ({"method": "suffix"}, None),
}
# At full scale only: vLLM's own methods (prompt lookup checks the same patched sampler path in
# CI) and N-Grammys, whose chains reach the same verification as REST's and prompt lookup's (its
# drafts, greedy identity and trees are checked in CI by test_e2e_engine.py).
FULL_SCALE_ONLY = {"vllm-ngram", "vllm-suffix", "ngrammys"}
SUFFIX_MISSING = importlib.util.find_spec("arctic_inference") is None
# Suffix decoding drafts from the outputs of earlier requests too, so how many random draws a
# seeded request makes (one per drafted token) depends on what was served before it: its
# distribution is the model's, its text is not reproducible.
DRAFTS_DEPEND_ON_HISTORY = {"vllm-suffix"}


def test_expansion_repeats_each_request_value_over_its_tokens():
    import torch
    from vllm.plugins import load_general_plugins
    from vllm.v1.sample import rejection_sampler

    from vllm_retrieval_spec.integration.vllm_patches import expand_batch_to_tokens

    cu_num_tokens = torch.tensor([2, 5, 6], dtype=torch.int32)
    temperature = torch.tensor([0.7, 0.0, 1.3])
    expanded = expand_batch_to_tokens(temperature, cu_num_tokens, 6, replace_from=0, replace_to=1)
    assert expanded.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])
    top_k = expand_batch_to_tokens(torch.tensor([5, 7, 9], dtype=torch.int32), cu_num_tokens, 6)
    assert top_k.dtype == torch.int32 and top_k.tolist() == [5, 5, 7, 7, 7, 9]
    load_general_plugins()  # as every vLLM process does: our entry point applies the fix
    assert rejection_sampler.expand_batch_to_tokens is expand_batch_to_tokens


def sample_tokens(llm, seeds: range, max_tokens: int = MAX_TOKENS, **sampling) -> np.ndarray:
    """Token ids ``[len(seeds), max_tokens]`` (-1 after an early end), one seeded request each."""
    return engine_samples(llm, PROMPT, seeds, max_tokens, TEMPERATURE, **sampling)


@pytest.fixture(scope="module")
def reference_tokens(model_dir) -> np.ndarray:
    with running_engine(EngineSpec(model_dir, max_num_seqs=32)) as llm:
        return sample_tokens(llm, range(REQUESTS))


def test_the_prompt_leaves_the_model_uncertain(reference_tokens):
    """The test has power only where several tokens are likely at a drafted position (here
    the colour after each comma)."""
    likely = [(np.unique(reference_tokens[:, position], return_counts=True)[1] >= 0.05 * REQUESTS).sum()
              for position in DRAFTED_POSITIONS]
    assert max(likely) >= 3, likely


@pytest.mark.parametrize("name", [pytest.param(name, marks=full_scale_only) if name in FULL_SCALE_ONLY else name
                                  for name in CHAIN_CONFIGS])
def test_chain_speculation_samples_like_the_model(name, request, model_dir, reference_tokens):
    if name == "vllm-suffix" and SUFFIX_MISSING:
        pytest.skip("vLLM's suffix method needs arctic-inference (scripts/install-comparators.sh)")
    speculative, options = CHAIN_CONFIGS[name]
    if options == "ngram_table":
        options = {"ngram_table": str(request.getfixturevalue("ngram_table_dir")), **FIXED}
    spec = EngineSpec(model_dir, speculative_config={**speculative, "num_speculative_tokens": K},
                      additional_config={"retrieval_spec": options} if options else None, max_num_seqs=32)
    with running_engine(spec) as llm:
        before = spec_decode_counters(llm)
        tokens = sample_tokens(llm, range(REQUESTS))
        counters = spec_decode_counters(llm) - before
        first, second = (sample_tokens(llm, range(8), max_tokens=24, top_p=0.9) for _ in range(2))
    assert counters.drafts >= REQUESTS, "the proposer drafted at too few steps to test anything"
    assert counters.accepted_tokens > 0
    for position in DRAFTED_POSITIONS:
        p_value = two_sample_chi2_pvalue(reference_tokens[:, position], tokens[:, position])
        assert p_value > P_FLOOR, f"{name}: position {position} is not distributed as without speculation"
    if name not in DRAFTS_DEPEND_ON_HISTORY:
        np.testing.assert_array_equal(first, second, err_msg="a seeded request gave different tokens twice")
