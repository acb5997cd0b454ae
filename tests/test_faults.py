"""Faults the server survives and bad input it answers exactly as without speculation.

Real OpenAI server subprocesses: the session's servers without speculation (the reference,
recorded first) and with REST chains (conftest), and this file's failing-proposer and tree-mode
servers. Requests go through raw HTTP, so that status codes and error messages are compared as
well as token ids, texts and finish reasons.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from vllm_retrieval_spec.evaluation.client import openai_client, run_prompts
from vllm_retrieval_spec.evaluation.engine import EngineSpec, drafter_of
from vllm_retrieval_spec.evaluation.metrics import GenerationRecord
from vllm_retrieval_spec.evaluation.prompts import humaneval_prompts
from vllm_retrieval_spec.evaluation.server import VllmServer, wait_until
from vllm_retrieval_spec.options import SPECULATE_ARG
from vllm_retrieval_spec.verification.admission import CHAIN_ONLY_FEATURES

from conftest import running_engine
from scale import at_scale

MAX_MODEL_LEN = 2048  # the shared no-speculation server's (VllmServer's default)
MAX_TOKENS = 24
CONCURRENT = 32
PROMPTS = humaneval_prompts(CONCURRENT)
DISCONNECTING_CLIENTS = at_scale(ci=48, full=100)  # CONCURRENT at once, the rest as the first hang up
CHUNKS_BEFORE_HANG_UP = 3
LOGPROB_TOLERANCE = 1e-4  # verification scores K + 1 positions in one pass: float32 rounding differs
DRAFTING_FAILED = "failed to draft"  # the proposer base's one-time log line
TESTS_DIR = str(Path(__file__).resolve().parent)

# One request per feature that tree verification refuses (admission.py), valid otherwise.
# vLLM drops min_p from greedy requests, so that one samples: top_k 1 keeps it deterministic.
TOP_1 = {"temperature": 1.0, "top_k": 1}
CHAIN_ONLY_REQUESTS: dict[str, dict[str, Any]] = {
    "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "repetition_penalty": {"repetition_penalty": 1.2},
    "min_p": {"min_p": 0.1, **TOP_1},
    "min_tokens": {"min_tokens": 4},
    "bad_words": {"bad_words": ["return"]},
    "logit_bias": {"logit_bias": {"1351": 5.0}},
    "allowed_token_ids": {"allowed_token_ids": list(range(20, 2000))},
    "structured_outputs": {"structured_outputs": {"choice": ["yes", "no"]}},
    "thinking_token_budget": {"thinking_token_budget": 8},
}
# vLLM itself refuses these with any speculative method (``SamplingParams``' speculative check,
# before our tree-mode admission sees them); without speculation they are served.
REFUSED_BY_VLLM = ("min_p", "logit_bias")
VLLM_REFUSAL = "The min_p and logit_bias sampling parameters are not yet supported with speculative decoding."
# A thinking budget needs a reasoning parser, which these servers do not have: vLLM refuses it
# first, with or without speculation (our refusal is asserted in tests/test_proposer_base.py).
NO_REASONING_REFUSAL = "thinking_token_budget is set but reasoning_config is not configured."
SWITCH_REFUSAL = f'{SPECULATE_ARG} must be "on" or "off" (also true/false, 1/0), not '
TREE_REFUSAL = ("{} cannot be used while the server verifies draft trees (retrieval_spec.tree); drop them, turn "
                f"speculation off for this request (vllm_xargs {SPECULATE_ARG}: off) or serve without tree mode")


# --- Requests and replies ---------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """One completion choice, merged over its stream chunks; logprob values apart (compared
    with a tolerance), everything else compared exactly."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: str | int | None
    logprob_tokens: tuple[tuple[str, ...], ...] = ()  # per position: the token, then its top tokens
    logprob_values: tuple[float, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class Reply:
    """A ``/v1/completions`` answer: its status and either the error message or the choices."""

    status: int
    error: str | None = None
    choices: tuple[Choice, ...] = ()


def completion_body(request: Mapping[str, Any]) -> dict[str, Any]:
    """Greedy, short and with token ids unless ``request`` says otherwise."""
    return {"model": "smol", "temperature": 0.0, "max_tokens": 24, "return_token_ids": True, **request}


@contextlib.contextmanager
def completion_response(server: VllmServer, request: Mapping[str, Any]) -> Iterator[httpx.Response]:
    """The open HTTP response to one completion request (closing it hangs up)."""
    with httpx.Client(base_url=server.base_url, timeout=600) as client, \
            client.stream("POST", "/v1/completions", json=completion_body(request)) as response:
        yield response


def send(server: VllmServer, request: Mapping[str, Any]) -> Reply:
    """One completion request (streamed when it asks to be), merged into a :class:`Reply`."""
    with completion_response(server, request) as response:
        if response.status_code != 200:
            response.read()
            return Reply(response.status_code, response.json()["error"]["message"])
        chunks = list(stream_events(response.iter_lines())) if request.get("stream") else [json.loads(response.read())]
    return Reply(200, choices=merged_choices(chunks))


def send_all(server: VllmServer, requests: Mapping[str, Mapping[str, Any]]) -> dict[str, Reply]:
    """Every request of ``requests`` (by name) at once, as a server's clients send them; the replies by name."""
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        replies = {name: pool.submit(send, server, request) for name, request in requests.items()}
        return {name: reply.result() for name, reply in replies.items()}


def stream_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON events of a server-sent event stream, up to ``[DONE]``."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        yield json.loads(line.removeprefix("data: "))


def merged_choices(chunks: Iterable[Mapping[str, Any]]) -> tuple[Choice, ...]:
    """Choices by index, each the concatenation of its chunks (one chunk without streaming)."""
    merged: dict[int, Choice] = {}
    for chunk in chunks:
        for part in chunk["choices"]:
            before = merged.get(part["index"], Choice("", (), None, None))
            tokens, values = logprob_parts(part.get("logprobs"))
            merged[part["index"]] = Choice(
                before.text + (part.get("text") or ""),
                before.token_ids + tuple(part.get("token_ids") or ()),
                part.get("finish_reason") or before.finish_reason,
                part.get("stop_reason") or before.stop_reason,
                before.logprob_tokens + tokens,
                before.logprob_values + values,
            )
    return tuple(merged[index] for index in sorted(merged))


def logprob_parts(logprobs: Mapping[str, Any] | None) -> tuple[tuple[tuple[str, ...], ...], tuple[float, ...]]:
    """Per position the sampled token and its top tokens in rank order; all logprob values."""
    if not logprobs:
        return (), ()
    tops = logprobs.get("top_logprobs") or [{}] * len(logprobs["tokens"])
    tokens = tuple((token, *top) for token, top in zip(logprobs["tokens"], tops))
    values = tuple(v for value, top in zip(logprobs["token_logprobs"], tops) for v in (value, *top.values()))
    return tokens, values


def assert_same_reply(want: Reply, got: Reply, case: str) -> None:
    """Status, error message, texts, token ids, finish and stop reasons, logprob tokens exactly;
    logprob values within float32 rounding."""
    assert (got.status, got.error) == (want.status, want.error), case
    assert got.choices == want.choices, case
    for want_choice, got_choice in zip(want.choices, got.choices):
        assert got_choice.logprob_values == pytest.approx(want_choice.logprob_values, abs=LOGPROB_TOLERANCE), case


def assert_same_outputs(want: Sequence[GenerationRecord], got: Sequence[GenerationRecord]) -> None:
    assert [r.prompt_ids for r in got] == [r.prompt_ids for r in want]
    for index, (w, g) in enumerate(zip(want, got)):
        assert g.output_ids == w.output_ids, f"prompt {index}: token ids differ from no speculation"


def generate(server: VllmServer, prompts: Sequence[str], concurrency: int) -> list[GenerationRecord]:
    """Greedy streamed completions of ``MAX_TOKENS`` tokens (the shared client helpers)."""
    client = openai_client(server.base_url)
    return run_prompts(client, server.served_model_name, prompts, MAX_TOKENS, concurrency).records


def cases(near_limit_ids: list[int]) -> dict[str, dict[str, Any]]:
    """Requests at and past the model's limits, with stop strings, ``n > 1``, logprobs and
    streaming, and the features tree mode refuses; each answered as without speculation."""
    prompt, code = PROMPTS[2], PROMPTS[4]
    return {
        "up to max_model_len": {"prompt": near_limit_ids, "max_tokens": MAX_MODEL_LEN},
        "one token below max_model_len": {"prompt": near_limit_ids + [near_limit_ids[-1]] * 23, "max_tokens": 8},
        "prompt of max_model_len": {"prompt": near_limit_ids + [near_limit_ids[-1]] * 24},
        "prompt longer than max_model_len": {"prompt": code * 40},
        "max_tokens above max_model_len": {"prompt": prompt, "max_tokens": MAX_MODEL_LEN + 1},
        "empty prompt": {"prompt": ""},
        "empty token prompt": {"prompt": []},
        "one token": {"prompt": prompt, "max_tokens": 1},
        "stop strings": {"prompt": code, "max_tokens": 64, "stop": ["return", "\n\n\n"]},
        "stop string kept": {"prompt": code, "max_tokens": 64, "stop": ["return"], "include_stop_str_in_output": True},
        "n > 1 greedy (refused by vLLM)": {"prompt": prompt, "n": 2},
        # top_k = 1 makes every sample the argmax, so the n choices equal greedy with or without
        # speculation; at top_k > 1 a seeded request's text differs with speculation (each drafted
        # token costs a random draw; docs/design.md, Sampling), only its distribution is the same. (A top-k
        # request used to kill the CPU engine at its first step without drafts: vllm_patches.py.)
        "n > 1 top_k 1": {"prompt": prompt, "n": 3, "seed": 3, **TOP_1},
        "logprobs": {"prompt": code, "logprobs": 3},
        "stream": {"prompt": code, "max_tokens": 48, "stream": True},
        "stream, stop strings, logprobs": {"prompt": code, "max_tokens": 48, "stream": True, "stop": ["return"],
                                           "logprobs": 2},
        **{name: {"prompt": prompt, **extra} for name, extra in CHAIN_ONLY_REQUESTS.items()},
        "speculation turned off by the request": {"prompt": code, "max_tokens": 48,
                                                  "vllm_xargs": {SPECULATE_ARG: "off"}},
    }


def assert_meaningful_cases(replies: Mapping[str, Reply]) -> None:
    """The cases test what they are named after (in the no-speculation replies)."""
    refused = {name for name, reply in replies.items() if reply.status != 200}
    assert refused == {"prompt of max_model_len", "prompt longer than max_model_len", "max_tokens above max_model_len",
                       "empty prompt", "empty token prompt", "n > 1 greedy (refused by vLLM)",
                       "thinking_token_budget"}
    up_to_limit = replies["up to max_model_len"].choices[0]
    assert (len(up_to_limit.token_ids), up_to_limit.finish_reason) == (24, "length")
    assert len(replies["one token below max_model_len"].choices[0].token_ids) == 1
    assert all(replies[name].choices[0].stop_reason == "return" for name in ("stop strings", "stop string kept"))
    assert len(set(replies["n > 1 top_k 1"].choices)) == 1 and len(replies["n > 1 top_k 1"].choices) == 3


def expected_with_speculation(name: str, reference: Reply) -> Reply:
    """The no-speculation reply, except for what vLLM refuses with any speculative method."""
    return Reply(400, VLLM_REFUSAL) if name in REFUSED_BY_VLLM else reference


def near_limit_prompt(model_dir: Path) -> list[int]:
    """A repetitive prompt 24 tokens short of ``MAX_MODEL_LEN``: drafts are long right up to the
    limit, where the proposer must cut them."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(PROMPTS[0]).input_ids
    return (ids * (MAX_MODEL_LEN // len(ids) + 1))[: MAX_MODEL_LEN - 24]


# --- Servers ----------------------------------------------------------------------------------


def server_for(model_dir: Path, proposer: str, k: int = 8, options: Mapping[str, Any] | None = None) -> VllmServer:
    """A server at ``MAX_MODEL_LEN`` speculating with ``proposer``, ``tests/`` on its path (for
    test-only proposers)."""
    return VllmServer(model_dir, speculative_config={"model": proposer, "num_speculative_tokens": k},
                      max_model_len=MAX_MODEL_LEN,
                      additional_config={"retrieval_spec": dict(options)} if options else None,
                      env={"PYTHONPATH": TESTS_DIR})


@dataclass(frozen=True)
class Reference:
    """What the no-speculation server answered."""

    records: list[GenerationRecord]  # PROMPTS at CONCURRENT in flight
    replies: dict[str, Reply]  # cases() by name


@pytest.fixture(scope="module")
def near_limit_ids(model_dir) -> list[int]:
    return near_limit_prompt(model_dir)


@pytest.fixture(scope="module")
def reference(plain_server, near_limit_ids) -> Reference:
    return Reference(generate(plain_server, PROMPTS, CONCURRENT), send_all(plain_server, cases(near_limit_ids)))


@pytest.fixture(scope="module")
def store_copy(code_store, tmp_path_factory) -> Path:
    """A private copy of the test datastore (a test deletes it while it is served)."""
    return Path(shutil.copytree(code_store, tmp_path_factory.mktemp("store-copy") / "store"))


# --- 1. A failing proposer --------------------------------------------------------------------


@pytest.mark.server
def test_failing_proposer_keeps_serving_exactly(model_dir, reference):
    """The proposer raises on every third step under CONCURRENT requests: outputs stay exact, the
    base's ``stats.failures`` counts every failure (on ``/metrics``) and logs the first."""
    # budget "fixed": "auto" may skip every search at this load, and then nothing is drafted to fail.
    server = server_for(model_dir, "vrs_test_proposers.FailingEveryThirdStepProposer", k=4,
                        options={"budget": "fixed"})
    with server:
        before = server.spec_decode_counters()
        records = generate(server, PROMPTS, CONCURRENT)
        counters = server.spec_decode_counters() - before
        failures = server.metric("vllm_retrieval_spec:drafting_failures_total")
        log = server.log_text()
    assert_same_outputs(reference.records, records)
    assert counters.accepted_tokens > 0  # the steps that did not fail drafted
    assert failures > 1  # the counter rose past the first failure
    assert log.count(f"FailingEveryThirdStepProposer {DRAFTING_FAILED}") == 1  # logged once
    assert "RuntimeError: injected drafting failure" in log


# --- 2 and 4. Disconnecting clients and bad input, chain mode ---------------------------------


def hang_up_after_chunks(server: VllmServer, prompt: str) -> int:
    """Stream a long completion and close the connection after a few chunks; the chunks read."""
    read = 0
    with completion_response(server, {"prompt": prompt, "max_tokens": MAX_MODEL_LEN // 2, "stream": True}) as response:
        for _ in stream_events(response.iter_lines()):
            read += 1
            if read == CHUNKS_BEFORE_HANG_UP:
                break
    return read


@pytest.mark.server
class TestChainMode:
    def test_clients_that_hang_up_mid_stream_leave_the_server_serving(self, rest_server, reference):
        """DISCONNECTING_CLIENTS streams cut after a few chunks: the engine drops every request
        (running and waiting gauges and KV cache usage back to 0) and then answers exactly.
        That the runner's per-request state goes with them is checked in the engine below."""
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(DISCONNECTING_CLIENTS)]
        with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
            read = list(pool.map(lambda prompt: hang_up_after_chunks(rest_server, prompt), prompts))
        assert read == [CHUNKS_BEFORE_HANG_UP] * DISCONNECTING_CLIENTS
        idle = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        assert wait_until(lambda: all(rest_server.metric(f"vllm:{name}") == 0 for name in idle)), {
            name: rest_server.metric(f"vllm:{name}") for name in idle}
        assert_same_outputs(reference.records[:4], generate(rest_server, PROMPTS[:4], 4))
        assert DRAFTING_FAILED not in rest_server.log_text()

    def test_a_speculation_switch_the_server_cannot_read_gets_400_naming_it(self, rest_server):
        for value in ("maybe", 2, [0]):
            reply = send(rest_server, {"prompt": PROMPTS[2], "vllm_xargs": {SPECULATE_ARG: value}})
            assert reply.status == 400 and reply.error.startswith(SWITCH_REFUSAL), (value, reply)

    def test_bad_and_edge_requests_are_answered_as_without_speculation(self, rest_server, reference, near_limit_ids):
        assert_meaningful_cases(reference.replies)
        before = rest_server.spec_decode_counters()
        for name, reply in send_all(rest_server, cases(near_limit_ids)).items():
            assert_same_reply(expected_with_speculation(name, reference.replies[name]), reply, name)
        assert (rest_server.spec_decode_counters() - before).accepted_tokens > 0
        assert DRAFTING_FAILED not in rest_server.log_text()


# --- 3 and tree-mode refusals -----------------------------------------------------------------


@pytest.fixture(scope="class")
def tree_server(model_dir, store_copy) -> Iterator[VllmServer]:
    options = {"datastore": str(store_copy), "tree": True}
    with server_for(model_dir, "vllm_retrieval_spec.RestProposer", k=16, options=options) as server:
        yield server


@pytest.mark.server
class TestTreeMode:
    def test_features_tree_mode_cannot_serve_get_400_with_the_reason(self, tree_server, reference):
        assert set(CHAIN_ONLY_REQUESTS) == set(CHAIN_ONLY_FEATURES)
        for name, extra in CHAIN_ONLY_REQUESTS.items():
            refusal = (VLLM_REFUSAL if name in REFUSED_BY_VLLM else NO_REASONING_REFUSAL
                       if name == "thinking_token_budget" else TREE_REFUSAL.format(name))
            reply = send(tree_server, {"prompt": PROMPTS[2], **extra})
            assert reply.status == 400 and reply.error.startswith(refusal), (name, reply)
        reply = send(tree_server, {"prompt": PROMPTS[2], "vllm_xargs": {SPECULATE_ARG: "maybe"}})
        assert reply.status == 400 and reply.error.startswith(SWITCH_REFUSAL), reply
        assert_same_outputs(reference.records[:1], generate(tree_server, PROMPTS[:1], 1))

    def test_requests_that_turn_speculation_off_may_use_those_features(self, tree_server, reference):
        """Served undrafted, beside requests whose trees branch, exactly as without speculation."""
        served = [name for name in CHAIN_ONLY_REQUESTS if name not in REFUSED_BY_VLLM]
        requests = {name: {"prompt": PROMPTS[2], **CHAIN_ONLY_REQUESTS[name], "vllm_xargs": {SPECULATE_ARG: "off"}}
                    for name in served}
        with ThreadPoolExecutor(max_workers=1) as pool:
            speculating = pool.submit(generate, tree_server, PROMPTS[:8], 8)
            replies = send_all(tree_server, requests)
            assert_same_outputs(reference.records[:8], speculating.result())
        for name in served:
            assert_same_reply(reference.replies[name], replies[name], name)

    def test_deleting_the_datastore_while_serving_keeps_outputs_exact(self, tree_server, store_copy, reference):
        """The store's files are memory-mapped: deleted mid-run, their pages stay valid."""
        with ThreadPoolExecutor(max_workers=1) as pool:
            during = pool.submit(generate, tree_server, PROMPTS[:8], 8)
            assert wait_until(lambda: tree_server.metric("vllm:num_requests_running") > 0)
            assert not during.done()
            shutil.rmtree(store_copy)
            records = during.result()
        records += generate(tree_server, PROMPTS[8:16], 8)
        assert not store_copy.exists()
        assert_same_outputs(reference.records[:16], records)
        assert DRAFTING_FAILED not in tree_server.log_text()


# --- 2. Aborted requests' state, in the engine ------------------------------------------------


@pytest.mark.engine
def test_aborted_requests_leave_no_state_behind(model_dir, code_store):
    """Requests aborted mid-generation (what a client hanging up does) release the session's
    per-request state, and give their tokens to the output index."""
    from vllm import SamplingParams

    spec = EngineSpec(model_dir, speculative_config={"model": "vllm_retrieval_spec.RestProposer",
                                                     "num_speculative_tokens": 16},
                      # a fixed budget: trees that branch (the session keeps no state for chains)
                      additional_config={"retrieval_spec": {"datastore": str(code_store), "tree": True,
                                                            "budget": "fixed"}},
                      max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    with running_engine(spec) as llm:
        engine, session = llm.llm_engine, drafter_of(llm).session
        ids = [f"abort-{index}" for index in range(8)]
        params = SamplingParams(max_tokens=MAX_MODEL_LEN // 2, temperature=0.0, ignore_eos=True)
        for req_id, prompt in zip(ids, PROMPTS):
            engine.add_request(req_id, prompt, params)
        steps = 0
        while not session.requests and steps < 64:  # until some request holds a tree
            engine.step()
            steps += 1
        assert session.requests
        engine.abort_request(ids[:6])
        engine.step()
        assert len(session.requests) <= 2
        engine.abort_request(ids[6:])
        engine.step()
        assert session.requests == {}
        assert session.output_index.stats.sequences_added == 8
