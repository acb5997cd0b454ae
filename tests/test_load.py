"""The load tester: report helpers, the asynchronous runner against a tiny fake server, and
against a real server (with --compare-to itself), and vLLM's ``bench serve`` through our CLI."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from vllm_retrieval_spec.datastores.sharded_edit import add_documents, remove_documents
from vllm_retrieval_spec.evaluation import load
from vllm_retrieval_spec.evaluation.load import (
    LoadRequest,
    LoadRun,
    LoadSettings,
    MemoryWatch,
    RequestResult,
    arrival_times,
    count_differences,
    error_kind,
    format_table,
    humaneval_requests,
    jsonl_requests,
    mixed_requests,
    percentiles,
    run_load,
    summarize_run,
    synthetic_requests,
)
from vllm_retrieval_spec.evaluation.server import VllmServer, free_port, wait_until
from vllm_retrieval_spec.options import SPECULATE_ARG

from conftest import PLAIN_SERVER_SEQUENCES, build_stdlib_store, stdlib_inputs
from scale import at_scale

LOAD_TEST = Path(__file__).resolve().parents[1] / "benchmarks" / "load_test.py"


# --- Report helpers ---------------------------------------------------------------------------


def test_percentiles_interpolate_and_are_none_without_values():
    assert percentiles([float(v) for v in range(1, 102)]) == {"p50": 51.0, "p90": 91.0, "p99": 100.0}
    assert percentiles([2.0]) == {"p50": 2.0, "p90": 2.0, "p99": 2.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


def test_tpot_excludes_the_first_token_and_needs_streaming():
    assert RequestResult(0, ttft=0.1, latency=1.1, output_tokens=11).tpot == pytest.approx(0.1)
    assert RequestResult(0, ttft=None, latency=1.1, output_tokens=11).tpot is None
    assert RequestResult(0, ttft=0.1, latency=0.1, output_tokens=1).tpot is None


def test_summary_counts_errors_by_kind_and_only_successes_in_figures():
    results = [
        RequestResult(0, ttft=0.1, latency=1.1, output_tokens=11, prompt_tokens=5),
        RequestResult(1, ttft=0.3, latency=2.3, output_tokens=21, prompt_tokens=7),
        RequestResult(2, error="HTTP 400", latency=0.01),
        RequestResult(3, error="timeout", latency=9.0),
        RequestResult(4, error="HTTP 400", latency=0.01),
    ]
    summary = summarize_run(LoadRun(LoadSettings("m", concurrency=4), results, seconds=2.0))
    assert summary["requests"] == 5 and summary["completed"] == 2
    assert summary["errors"] == {"HTTP 400": 2, "timeout": 1}
    assert summary["output_tokens"] == 32 and summary["prompt_tokens"] == 12
    assert summary["output_tokens_per_second"] == 16.0 and summary["requests_per_second"] == 1.0
    assert summary["latency_s"]["p50"] == pytest.approx(1.7)  # the failures' latencies are not counted
    assert summary["tpot_s"]["p50"] == pytest.approx(0.1)
    assert summary["request_rate"] is None and summary["concurrency"] == 4


def test_differences_use_token_ids_when_both_have_them_else_text():
    reference = [RequestResult(0, token_ids=[1, 2], text="a"), RequestResult(1, text="b"),
                 RequestResult(2, token_ids=[5], text="c"), RequestResult(3, error="timeout")]
    results = [RequestResult(0, token_ids=[1, 3], text="a"), RequestResult(1, token_ids=[9], text="b"),
               RequestResult(2, error="HTTP 500"), RequestResult(3, token_ids=[7], text="d")]
    assert count_differences(results, reference) == {
        "compared": 2, "compared_by_token_ids": 1, "differing": 1, "differing_requests": [0]}


def test_arrival_times_are_poisson_or_all_at_once():
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    times = arrival_times(2000, 4.0, seed=1)
    assert times == arrival_times(2000, 4.0, seed=1)
    assert all(b >= a for a, b in itertools.pairwise(times)) and times[0] > 0
    assert 2000 / times[-1] == pytest.approx(4.0, rel=0.1)  # the mean rate (seeded, deterministic)
    with pytest.raises(ValueError, match="positive"):
        arrival_times(1, 0.0)


def test_error_kinds():
    request = httpx.Request("POST", "http://127.0.0.1/v1/completions")
    status = openai.BadRequestError("bad", response=httpx.Response(400, request=request), body=None)
    assert error_kind(status) == "HTTP 400"
    assert error_kind(openai.APITimeoutError(request=request)) == "timeout"
    assert error_kind(openai.APIConnectionError(request=request)) == "connection"
    assert error_kind(ValueError("x")) == "ValueError"


def test_synthetic_requests_have_the_chosen_lengths():
    requests = synthetic_requests(3, input_len=50, output_len=7, seed=2)
    assert requests == synthetic_requests(3, input_len=50, output_len=7, seed=2)
    assert len({r.prompt for r in requests}) == 3
    assert all(len(str(r.prompt).split()) == 50 and r.max_tokens == 7 and r.ignore_eos for r in requests)


def test_jsonl_requests_take_messages_or_prompts_and_cycle(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n\n"
                    + json.dumps({"prompt": "def f(", "max_tokens": 5}) + "\n")
    requests = jsonl_requests(path, 3, max_tokens=9)
    assert [r.messages is not None for r in requests] == [True, False, True]
    assert [r.max_tokens for r in requests] == [9, 5, 9]
    path.write_text(json.dumps({"text": "no"}) + "\n")
    with pytest.raises(ValueError, match=r"requests.jsonl:1: a record needs 'messages' or 'prompt'"):
        jsonl_requests(path, None, max_tokens=9)


@pytest.mark.parametrize(("lines", "message"), [
    (['{"prompt": "a"}', "{not json"], r"requests.jsonl:2: not a JSON record \(Expecting property name"),
    (['["prompt"]'], r"requests.jsonl:1: a record needs 'messages' or 'prompt'"),
])
def test_a_bad_jsonl_line_is_named(tmp_path, lines, message):
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message):
        jsonl_requests(path, None, max_tokens=9)


@pytest.mark.parametrize(("arguments", "message"), [
    (["--url", "http://127.0.0.1:9"], "load_test.py: error: --url http://127.0.0.1:9: no OpenAI-compatible server "
     "answers /v1/models"),
    (["--serve", "no_such_config"], "load_test.py: error: unknown config 'no_such_config'; choose from none, "),
    (["--serve", "none", "--dataset", "missing.jsonl"], "load_test.py: error: --dataset missing.jsonl: "),
    (["--serve", "none", "--concurrency", "8", "0"], "load_test.py: error: --concurrency[1] must be an integer >= 1"),
    (["--serve", "none", "--request-rate", "0"], "load_test.py: error: --request-rate must be > 0"),
])
def test_load_test_refuses_bad_targets_and_values_in_one_line_before_any_server_starts(tmp_path, arguments, message):
    done = subprocess.run([sys.executable, str(LOAD_TEST), *arguments, "--num-requests", "2"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(message), done.stderr


def test_humaneval_requests_raw_or_chat_messages_cycle():
    raw = humaneval_requests(166, "raw", max_tokens=8)
    assert len(raw) == 166 and raw[164] == raw[0] and isinstance(raw[0].prompt, str)
    chat = humaneval_requests(2, "chat", max_tokens=8)
    assert chat[0].prompt is None and chat[0].messages[0]["role"] == "user"


def test_table_shows_each_run_differences_and_errors():
    results = [RequestResult(0, ttft=0.1, latency=1.0, output_tokens=3), RequestResult(1, error="HTTP 400")]
    row = {"server": "rest", **summarize_run(LoadRun(LoadSettings("m", 8), results, 1.0)),
           "compare": {"differing": 0, "compared": 1}}
    table = format_table([row])
    assert re.search(r"^rest\s+8\s+inf\s+1\s+1\s+3\.0\s+1\.00\s+100/100\s.*\s0/1$", table, flags=re.M)
    assert "errors, rest at concurrency 8: HTTP 400 ×1" in table


# --- The runner against a fake OpenAI server ----------------------------------------------------


def _completion(body: dict[str, Any], words: Sequence[str], ids: Sequence[int], usage: bool) -> dict[str, Any]:
    choices = [{"index": 0, "text": "".join(f"{w} " for w in words), "token_ids": list(ids), "finish_reason": None}]
    answer: dict[str, Any] = {"id": "c", "object": "text_completion", "created": 0, "model": body["model"],
                              "choices": choices if words else []}
    if usage:
        answer["usage"] = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": len(ids),
                           "total_tokens": len(body["prompt"].split()) + len(ids)}
    return answer


async def _fake_completions(request: Any, state: dict[str, int]) -> Any:
    """Replies with the prompt's first ``max_tokens`` words, one word per token and chunk."""
    from aiohttp import web

    body = await request.json()
    if body["prompt"] == "fail":
        return web.json_response({"error": {"message": "no", "type": "BadRequestError"}}, status=400)
    if body["prompt"].startswith("drop") and state["drops"] < int(body["prompt"].split()[1]):
        state["drops"] += 1  # a keep-alive timer closing the connection under the request
        request.transport.close()
        return web.Response()  # never sent: the transport is closed
    state["in_flight"] += 1
    state["peak"] = max(state["peak"], state["in_flight"])
    try:
        words = body["prompt"].split()[: body["max_tokens"]]
        if not body.get("stream"):
            return web.json_response(_completion(body, words, range(len(words)), usage=True))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index, word in enumerate(words):
            await asyncio.sleep(0.001)
            await response.write(f"data: {json.dumps(_completion(body, [word], [index], usage=False))}\n\n".encode())
        done = _completion(body, [], range(len(words)), usage=True)
        await response.write(f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode())
        return response
    finally:
        state["in_flight"] -= 1


async def _run_against_fake(requests: list[LoadRequest], settings: LoadSettings) -> tuple[LoadRun, dict[str, int]]:
    from aiohttp import web

    state = {"in_flight": 0, "peak": 0, "drops": 0}
    app = web.Application()

    async def completions(request: Any) -> Any:
        return await _fake_completions(request, state)

    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        run = await run_load(f"http://127.0.0.1:{port}", requests, settings, progress=False)
    finally:
        await runner.cleanup()
    return run, state


@pytest.mark.parametrize("stream", [True, False])
def test_runner_keeps_concurrency_and_reports_each_request(stream):
    requests = [LoadRequest(prompt=" ".join(f"w{i}" for i in range(n)), max_tokens=6) for n in range(3, 14)]
    requests.insert(4, LoadRequest(prompt="fail"))
    run, state = asyncio.run(_run_against_fake(requests, LoadSettings("fake", concurrency=3, stream=stream)))
    assert state["peak"] <= 3 and state["in_flight"] == 0
    assert [r.index for r in run.results] == list(range(len(requests)))
    failed = run.results[4]
    assert failed.error == "HTTP 400"
    for result, request in zip(run.results, requests):
        if result is failed:
            continue
        expected = str(request.prompt).split()[:6]
        assert result.ok and result.text.split() == expected
        assert result.token_ids == list(range(len(expected))) and result.output_tokens == len(expected)
        assert result.prompt_tokens == len(str(request.prompt).split())
        assert (result.ttft is not None) == stream and (result.tpot is not None) == stream
    assert summarize_run(run)["errors"] == {"HTTP 400": 1}


@pytest.mark.parametrize("stream", [True, False])
def test_a_connection_dropped_unanswered_is_sent_again_once_and_counted(stream):
    settings = LoadSettings("fake", concurrency=1, stream=stream)
    run, state = asyncio.run(_run_against_fake([LoadRequest(prompt="drop 1 a b", max_tokens=4)], settings))
    [result] = run.results
    assert result.ok and result.text.split() == ["drop", "1", "a", "b"] and result.reconnects == 1
    assert state["drops"] == 1 and summarize_run(run)["reconnects"] == 1
    run, state = asyncio.run(_run_against_fake([LoadRequest(prompt="drop 9 a", max_tokens=4)], settings))
    [result] = run.results
    assert result.error == "connection" and state["drops"] == 2  # sent twice, then an error
    summary = summarize_run(run)
    assert summary["failed_requests"] == [{"index": 0, "error": "connection", "detail": result.detail,
                                           "after_s": result.latency}]
    assert result.detail.startswith("APIConnectionError: Connection error. <- ")
    table = format_table([{"server": "fake", **summary}])
    assert f"errors, fake at concurrency 1: connection ×1\n  request 0 after {result.latency:.2f} s: " in table


# --- A real server ------------------------------------------------------------------------------




STORE_PACKAGES = ("json", "email", "asyncio", "collections", "importlib", "unittest")
RELOADED = "REST now drafts from the datastore"


@pytest.fixture(scope="module")
def sharded_code_store(model_dir, tmp_path_factory) -> Path:
    """The test code datastore, sharded (a test grows and shrinks it while it is served)."""
    out = tmp_path_factory.mktemp("sharded") / "stdlib-subset"
    return build_stdlib_store(model_dir, out, STORE_PACKAGES, shard_tokens=250_000)


@pytest.fixture(scope="module")
def rest_server(model_dir, sharded_code_store):
    spec = {"model": "vllm_retrieval_spec.RestProposer", "num_speculative_tokens": 4}
    options = {"datastore": str(sharded_code_store), "datastore_reload_seconds": 0.5}
    with VllmServer(model_dir, speculative_config=spec, extra_args=["--max-num-seqs", str(PLAIN_SERVER_SEQUENCES)],
                    additional_config={"retrieval_spec": options}) as server:
        yield server


@pytest.mark.server
def test_load_test_against_a_real_server_compared_with_itself(rest_server, tmp_path):
    out = tmp_path / "load.json"
    url = rest_server.base_url
    subprocess.run([sys.executable, str(LOAD_TEST), "--url", url, "--compare-to", url, "--concurrency", "4",
                    "--num-requests", "16", "--max-tokens", "24", "--out", str(out)], check=True, timeout=600)
    [row] = json.loads(out.read_text())["results"]
    assert row["completed"] == 16 and row["errors"] == {}
    assert row["compare"] == {"compared": 16, "compared_by_token_ids": 16, "differing": 0, "differing_requests": []}
    assert row["output_tokens"] > 16 and row["tpot_s"]["p99"] is not None and row["ttft_s"]["p50"] is not None
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.server
def test_vllm_bench_serve_runs_through_our_cli(rest_server, model_dir):
    command = [sys.executable, "-m", "vllm_retrieval_spec.cli", "vllm", "bench", "serve", "--backend", "openai",
               "--base-url", rest_server.base_url, "--model", rest_server.served_model_name,
               "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", "32",
               "--random-output-len", "8", "--num-prompts", "4", "--max-concurrency", "2", "--temperature", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^Successful requests:\s+4\s*$", done.stdout, flags=re.M), done.stdout[-3000:]
    assert re.search(r"^Failed requests:\s+0\s*$", done.stdout, flags=re.M)


CLIENTS_REQUESTS = at_scale(ci=64, full=200)  # ci: one request per client; ~35 s of serving here


def last_reload(server: VllmServer) -> str:
    """What the server logged of the last store it swapped in (empty before any)."""
    log = server.log_text()
    return log.rsplit(RELOADED, 1)[1].split("\n", 1)[0] if RELOADED in log else ""


@pytest.mark.server
def test_64_clients_get_what_a_server_without_speculation_returns_while_the_store_changes(
        rest_server, plain_server, sharded_code_store, model_dir, tmp_path):
    """64 clients of mixed traffic (greedy and sampled, completions and chat) while `datastore add`
    and `remove` change the served store (the edits take ~1 s): the server swaps the new store in
    between two steps, with no error and no greedy output differing from a server without
    speculation."""
    out = tmp_path / "load64.json"
    command = [sys.executable, str(LOAD_TEST), "--url", rest_server.base_url, "--compare-to",
               plain_server.base_url, "--concurrency", "64", "--num-requests", str(CLIENTS_REQUESTS),
               "--max-tokens", "16", "--dataset", "mixed", "--out", str(out)]
    with subprocess.Popen(command) as clients:
        assert wait_until(lambda: rest_server.metric("vllm:num_requests_running") > 0)
        added = add_documents(sharded_code_store, model_dir, stdlib_inputs(("logging", "http")), progress=False)
        removed = remove_documents(sharded_code_store, range(0, 40), progress=False)
        assert wait_until(lambda: f"{removed.num_documents:,} documents" in last_reload(rest_server))
        assert rest_server.metric("vllm:num_requests_running") > 0  # swapped while the clients were served
        assert clients.wait(timeout=1800) == 0
    [row] = json.loads(out.read_text())["results"]
    assert row["completed"] == CLIENTS_REQUESTS and row["errors"] == {}, (row["failed_requests"],
                                                                          rest_server.log_tail())
    greedy = sum(request.is_greedy(0.0) for request in mixed_requests(CLIENTS_REQUESTS, 16))
    assert row["compare"]["compared"] == greedy and row["compare"]["differing"] == 0
    assert removed.num_documents == added.num_documents - 40
    assert "cannot be opened" not in rest_server.log_text()


def test_the_mixed_load_is_what_a_shared_server_sees():
    requests = mixed_requests(400, 64, seed=3)
    assert requests == mixed_requests(400, 64, seed=3)
    sampling = [r.sampling for r in requests]
    assert 0.3 < sum(r.is_greedy(0.0) for r in requests) / 400 < 0.5
    temperatures = [s["temperature"] for s in sampling if s["temperature"] > 0]
    assert min(temperatures) >= 0.3 and max(temperatures) <= 1.2
    for key in ("top_p", "top_k", "seed", "n", "stop", "repetition_penalty"):
        assert any(key in s for s in sampling), key
    switched_off = sum(s.get("vllm_xargs") == {SPECULATE_ARG: "off"} for s in sampling)
    assert 0.05 < switched_off / 400 < 0.15
    switched = next(r for r in requests if "vllm_xargs" in r.sampling)
    arguments = load._create_arguments(switched, LoadSettings("m", temperature=0.0))
    assert arguments["extra_body"]["vllm_xargs"] == {SPECULATE_ARG: "off"}
    assert any(r.messages for r in requests) and any(r.prompt for r in requests)
    lengths = [len(r.prompt) for r in requests if r.prompt]
    assert max(lengths) > 3 * min(lengths)  # short and long prompts
    assert {r.max_tokens for r in requests} == {16, 32, 64}


def test_per_request_sampling_goes_where_the_openai_client_and_vllm_take_it():
    request = LoadRequest(prompt="x", sampling={"temperature": 0.7, "top_k": 20, "seed": 5, "n": 2,
                                                "repetition_penalty": 1.1, "stop": ["\n"]})
    arguments = load._create_arguments(request, LoadSettings("m", temperature=0.0))
    assert arguments["temperature"] == 0.7 and arguments["seed"] == 5 and arguments["n"] == 2
    assert arguments["stop"] == ["\n"]
    assert arguments["extra_body"] == {"top_k": 20, "repetition_penalty": 1.1, "return_token_ids": True}
    assert not request.is_greedy(0.0) and LoadRequest(prompt="x").is_greedy(0.0)
    assert not LoadRequest(prompt="x", sampling={"temperature": 0.0, "n": 2}).is_greedy(0.0)


def test_only_comparable_requests_are_compared():
    reference = [RequestResult(0, token_ids=[1]), RequestResult(1, token_ids=[2])]
    results = [RequestResult(0, token_ids=[1]), RequestResult(1, token_ids=[3])]
    assert count_differences(results, reference, [True, False])["differing"] == 0
    assert count_differences(results, reference)["differing"] == 1


def test_memory_watch_samples_every_n_requests_and_reports_growth(monkeypatch):
    rss = iter([100, 200, 210, 220, 231])
    monkeypatch.setattr(load, "engine_memory_bytes", lambda: (next(rss) << 20, 50 << 20))
    watch = MemoryWatch(every=100)
    for finished in range(1, 501):
        watch(finished)
    report = watch.report(after=200)
    assert report["rss_mib"] == [[100, 100.0], [200, 200.0], [300, 210.0], [400, 220.0], [500, 231.0]]
    assert report["anon_mib"] == [[n, 50.0] for n in range(100, 501, 100)]
    assert report["growth"] == pytest.approx(231 / 200 - 1) and report["anon_growth"] == 0.0
