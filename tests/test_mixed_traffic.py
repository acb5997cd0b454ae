"""Sampled, then greedy, then sampled traffic in one engine: nothing a request carries in
(temperature, a seed, a prompt the prefix cache holds whole, a prompt prefilled in chunks)
stops it, and greedy stays exact.

vLLM pads a new request whose prompt the prefix cache holds whole (all but the last token)
to the uniform decode shape, with ``-1`` placeholders in its draft slots. Those are not
drafts: our sampler, which verifies every step where a request samples (and every step in
tree mode), once took them for draft tokens and killed the engine. And vLLM rewinds a seeded
request's generator after a prefill chunk's discarded sample by its Philox offset, which CPU
generators lack: a seeded long prompt killed the engine.
"""

from __future__ import annotations

import dataclasses

import pytest

from vllm_retrieval_spec.evaluation.engine import EngineSpec, drafter_of, generate
from vllm_retrieval_spec.evaluation.prompts import humaneval_prompts

from conftest import assert_same_token_ids, running_engine

pytestmark = pytest.mark.engine

BLOCK_SIZE = 32  # the smallest CPU_ATTN takes
CONCURRENT = 8
MAX_TOKENS = 40
CACHED_WHOLE = 2  # prompts whose length is 1 + a multiple of the block: a later request hits every block
SAMPLING = {"temperature": 0.8, "top_p": 0.95}
CONFIGS = {
    "chain-with-output-index": {},
    "tree-without-output-index": {"tree": True, "use_output_index": False},
}


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[str]:
    """Eight HumanEval prompts, two of them cached whole when they come again."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pool = humaneval_prompts(164)
    lengths = [len(tokenizer(prompt).input_ids) for prompt in pool]
    whole = [p for p, n in zip(pool, lengths) if n % BLOCK_SIZE == 1][:CACHED_WHOLE]
    assert len(whole) == CACHED_WHOLE, "HumanEval has too few prompts of 1 + a multiple of the block size"
    return whole + [p for p in pool if p not in whole][: CONCURRENT - CACHED_WHOLE]


def engine(model_dir, code_store, options: dict | None) -> EngineSpec:
    speculative = None if options is None else {"model": "vllm_retrieval_spec.RestProposer",
                                                 "num_speculative_tokens": 8}
    extra = None if options is None else {"retrieval_spec": {"datastore": str(code_store), **options}}
    return EngineSpec(model_dir, speculative, extra, max_num_seqs=CONCURRENT, block_size=BLOCK_SIZE)


@pytest.fixture(scope="module")
def greedy_reference(model_dir, prompts):
    with running_engine(engine(model_dir, None, None)) as llm:
        generate(llm, prompts, MAX_TOKENS, concurrency=CONCURRENT)  # the same cache state as below
        return generate(llm, prompts, MAX_TOKENS, concurrency=CONCURRENT)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_sampled_greedy_sampled_traffic_is_served(config, model_dir, code_store, prompts, greedy_reference):
    with running_engine(engine(model_dir, code_store, CONFIGS[config])) as llm:
        first = generate(llm, prompts, MAX_TOKENS, concurrency=CONCURRENT, seed=1, **SAMPLING)
        greedy = generate(llm, prompts, MAX_TOKENS, concurrency=CONCURRENT)
        again = generate(llm, prompts, MAX_TOKENS, concurrency=CONCURRENT, seed=2, **SAMPLING)
        drafter = drafter_of(llm)
    assert_same_token_ids(greedy_reference, greedy)
    for run in (first, again):
        assert all(record.output_ids for record in run.records)
    assert greedy.counters.drafts + again.counters.drafts > 0
    assert drafter.stats.failures == 0


def test_seeded_long_prompts_prefilled_in_chunks_are_served(model_dir, code_store, prompts):
    long_prompt = "\n".join(humaneval_prompts(4))  # ~600 tokens: three chunks of 256
    spec = dataclasses.replace(engine(model_dir, code_store, {}), max_num_batched_tokens=256)
    with running_engine(spec) as llm:
        run = generate(llm, [long_prompt, *prompts[:3]], MAX_TOKENS // 2, concurrency=4, seed=7, **SAMPLING)
        drafter = drafter_of(llm)
    assert all(record.output_ids for record in run.records)
    assert drafter.stats.failures == 0
