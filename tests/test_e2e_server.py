"""End to end through a real vLLM OpenAI server subprocess and the `openai` client."""

from __future__ import annotations

import pytest

from conftest import CONCURRENT, E2E_MAX_TOKENS, assert_same_token_ids
from vllm_retrieval_spec.evaluation.client import openai_client, run_prompts
from vllm_retrieval_spec.evaluation.engine import GenerationRun
from vllm_retrieval_spec.evaluation.server import VllmServer

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def rest_server(model_dir, code_store):
    spec = {"model": "vllm_retrieval_spec.RestProposer", "num_speculative_tokens": 4}
    with VllmServer(model_dir, speculative_config=spec,
                    additional_config={"retrieval_spec": {"datastore": str(code_store)}}) as server:
        yield server


@pytest.mark.parametrize("mode, concurrency", [("batch1", 1), ("concurrent", CONCURRENT)])
def test_server_outputs_equal_no_speculation(rest_server, e2e_prompts, baseline_runs, mode, concurrency):
    server = rest_server
    client = openai_client(server.base_url)
    before = server.spec_decode_counters()
    run = run_prompts(client, server.served_model_name, e2e_prompts, E2E_MAX_TOKENS, concurrency)
    counters = server.spec_decode_counters() - before
    assert_same_token_ids(baseline_runs[mode], GenerationRun(run.records, counters, run.seconds))
    assert counters.accepted_tokens > 0


def test_models_endpoint_and_chat_work(rest_server):
    client = openai_client(rest_server.base_url)
    assert [m.id for m in client.models.list().data] == ["smol"]
    reply = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0.0,
    )
    assert "Paris" in reply.choices[0].message.content


def test_bad_options_stop_the_server_with_the_option_named(model_dir):
    spec = {"model": "vllm_retrieval_spec.PromptLookupProposer", "num_speculative_tokens": 4}
    server = VllmServer(model_dir, speculative_config=spec,
                        additional_config={"retrieval_spec": {"context_ngram_mx": 3}})
    with pytest.raises(Exception, match="context_ngram_mx"):
        server.start(timeout_s=240)
    server.stop()
