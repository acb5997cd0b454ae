"""End to end through a real vLLM OpenAI server subprocess and the `openai` client, and our
Prometheus metrics on its ``/metrics`` next to vLLM's."""

from __future__ import annotations

import re

import pytest
from test_metrics import scraped, total

from vllm_retrieval_spec.evaluation.client import openai_client, run_prompts
from vllm_retrieval_spec.evaluation.engine import EngineSpec, GenerationRun, generate
from vllm_retrieval_spec.evaluation.metrics import GenerationRecord
from vllm_retrieval_spec.evaluation.server import ServerError, VllmServer
from vllm_retrieval_spec.integration.metrics import PREFIX

from conftest import BATCH1_PROMPTS, CONCURRENT, E2E_MAX_TOKENS, assert_same_token_ids, running_engine

pytestmark = pytest.mark.server


@pytest.mark.parametrize("mode, concurrency", [("batch1", 1), ("concurrent", CONCURRENT)])
def test_server_outputs_equal_no_speculation(rest_server, e2e_prompts, baseline_runs, mode, concurrency):
    server = rest_server
    client = openai_client(server.base_url)
    before = server.spec_decode_counters()
    prompts = e2e_prompts[:BATCH1_PROMPTS] if mode == "batch1" else e2e_prompts
    run = run_prompts(client, server.served_model_name, prompts, E2E_MAX_TOKENS, concurrency)
    counters = server.spec_decode_counters() - before
    assert_same_token_ids(baseline_runs[mode], GenerationRun(run.records, counters, run.seconds))
    assert counters.accepted_tokens > 0


CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_MAX_TOKENS = 16


@pytest.fixture(scope="module")
def chat_baseline(model_dir) -> GenerationRecord:
    """The chat prompt (rendered with the model's template) generated without speculation."""
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True)
    with running_engine(EngineSpec(model_dir, max_num_seqs=1)) as llm:
        return generate(llm, [prompt], CHAT_MAX_TOKENS).records[0]


def test_models_endpoint_and_chat_reply_equal_no_speculation(rest_server, chat_baseline):
    client = openai_client(rest_server.base_url)
    assert [m.id for m in client.models.list().data] == ["smol"]
    reply = client.chat.completions.create(
        model="smol", messages=CHAT, max_tokens=CHAT_MAX_TOKENS, temperature=0.0,
        extra_body={"return_token_ids": True},
    )
    choice = reply.choices[0]
    assert reply.model_extra["prompt_token_ids"] == chat_baseline.prompt_ids  # the same chat template
    assert choice.model_extra["token_ids"] == chat_baseline.output_ids  # speculation is lossless
    assert reply.usage.completion_tokens == len(chat_baseline.output_ids)
    assert choice.finish_reason == ("length" if len(chat_baseline.output_ids) == CHAT_MAX_TOKENS else "stop")


METRICS_CHAT = [{"role": "user", "content": "Write a Python function that returns the sum of a list of numbers."}]


def test_server_metrics_show_ours_next_to_vllms(rest_server):
    """Totals since the server started (it served the tests above too)."""
    client = openai_client(rest_server.base_url)
    for _ in range(3):
        client.chat.completions.create(model=rest_server.served_model_name, messages=METRICS_CHAT, max_tokens=48,
                                       temperature=0.0)
    samples = scraped(rest_server.metrics_text())
    vllm = rest_server.spec_decode_counters()
    ours = {"model_name": "smol", "engine": "0", "proposer": "RestProposer"}
    draft_tokens = total(samples, "draft_tokens_total", ours)
    assert draft_tokens >= vllm.draft_tokens > 0  # ours also counts drafts of steps never verified
    assert total(samples, "drafted_requests_total", ours) >= vllm.drafts > 0
    assert total(samples, "drafting_seconds_count", ours) > 0
    assert total(samples, "budget_steps_total", ours) > 0
    assert total(samples, "drafting_failures_total", ours) == 0
    assert {labels["source"] for name, labels, _ in samples if name == PREFIX + "draft_tokens_total"}


@pytest.mark.parametrize(
    ("options", "message"),
    [({"context_ngram_mx": 3}, r"unknown option\(s\) 'context_ngram_mx' in additional_config\['retrieval_spec'\]"),
     ({"ngrammys_drafts": 0}, r"retrieval_spec\.ngrammys_drafts must be an integer in \[1, ")],
)
def test_bad_options_stop_the_server_with_the_option_named(model_dir, options, message):
    spec = {"model": "vllm_retrieval_spec.PromptLookupProposer", "num_speculative_tokens": 4}
    server = VllmServer(model_dir, speculative_config=spec, additional_config={"retrieval_spec": options})
    try:
        with pytest.raises(ServerError, match=r"the server exited with code 2\n") as failure:
            server.start(timeout_s=240)
    finally:
        server.stop()
    assert re.search(rf"vllm-retrieval-spec: error: {message}", str(failure.value))
