"""``datastore from-server``: prompts answered by a server (retries, resuming), transcripts, and
the stores built from them, against a scripted OpenAI-compatible server and the real one."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from vllm_retrieval_spec.datastores import TokenDatastore, from_server
from vllm_retrieval_spec.datastores.builder import load_tokenizer
from vllm_retrieval_spec.datastores.dense import DenseDatastore
from vllm_retrieval_spec.datastores.from_server import AskSettings, answered, collect_transcripts, read_prompt_file
from vllm_retrieval_spec.evaluation import capture
from vllm_retrieval_spec.evaluation.server import free_port
from vllm_retrieval_spec.paths import CACHE_ENV

PROMPTS = [{"prompt": "def add(a, b):\n"}, {"messages": [{"role": "user", "content": "Say hi."}]},
           {"prompt": "def sub(a, b):\n"}]


class ScriptedServer:
    """/v1/completions and /v1/chat/completions answering ``ANSWER:<prompt>``; ``failures``
    maps a prompt's text to the HTTP statuses its next requests get before an answer."""

    def __init__(self, failures: dict[str, list[int]] | None = None) -> None:
        self.failures = {text: list(statuses) for text, statuses in (failures or {}).items()}
        self.requests: Counter[str] = Counter()

    async def _answer(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = body["prompt"] if "prompt" in body else body["messages"][-1]["content"]
        self.requests[text] += 1
        if self.failures.get(text):
            return web.json_response({"error": {"message": "scripted"}}, status=self.failures[text].pop(0))
        usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
        if "prompt" in body:
            choice = {"index": 0, "text": f"ANSWER:{text}", "finish_reason": "stop", "logprobs": None}
            return web.json_response({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                                      "choices": [choice], "usage": usage})
        message = {"role": "assistant", "content": f"ANSWER:{text}"}
        return web.json_response({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                                  "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                                  "usage": usage})

    async def run(self, work):
        """Serve while ``work(url)`` runs; its result."""
        app = web.Application()
        app.router.add_post("/v1/completions", self._answer)
        app.router.add_post("/v1/chat/completions", self._answer)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            return await work(f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()


@pytest.fixture()
def prompt_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    monkeypatch.setattr(from_server, "RETRY_BASE_SECONDS", 0.0)


def collect(server: ScriptedServer, prompt_file: Path, transcripts: Path, retries: int = 3):
    records = read_prompt_file(prompt_file)
    settings = AskSettings(model="m", max_tokens=8, concurrency=2, retries=retries)
    return asyncio.run(server.run(lambda url: collect_transcripts(url, records, transcripts, settings,
                                                                  progress=False)))


def test_transcripts_hold_the_conversation_or_the_text_with_the_answer(prompt_file, tmp_path):
    transcripts = tmp_path / "t.jsonl"
    report = collect(ScriptedServer(), prompt_file, transcripts)
    assert (report.answered, report.failed, report.output_tokens) == (3, 0, 6)
    lines = sorted((json.loads(line) for line in transcripts.read_text().splitlines()), key=lambda r: r["index"])
    assert lines[0]["text"] == "def add(a, b):\nANSWER:def add(a, b):\n"
    assert lines[1]["messages"] == [{"role": "user", "content": "Say hi."},
                                    {"role": "assistant", "content": "ANSWER:Say hi."}]


def test_server_errors_are_retried_and_client_errors_are_not(prompt_file, tmp_path):
    server = ScriptedServer({"def add(a, b):\n": [500, 503], "def sub(a, b):\n": [400]})
    report = collect(server, prompt_file, tmp_path / "t.jsonl")
    assert server.requests["def add(a, b):\n"] == 3 and server.requests["def sub(a, b):\n"] == 1
    assert (report.answered, report.failed) == (2, 1) and "BadRequestError" in report.first_error


def test_a_rerun_asks_only_what_is_missing(prompt_file, tmp_path):
    transcripts = tmp_path / "t.jsonl"
    collect(ScriptedServer({"Say hi.": [500] * 5}), prompt_file, transcripts, retries=1)
    with transcripts.open("a") as out:
        out.write('{"index": 2, "key": "torn')  # a run killed while writing
    server = ScriptedServer()
    report = collect(server, prompt_file, transcripts)
    assert (report.already, report.answered) == (2, 1) and set(server.requests) == {"Say hi."}
    assert len(answered(transcripts)) == 3


def test_a_changed_prompt_is_asked_again(prompt_file, tmp_path):
    transcripts = tmp_path / "t.jsonl"
    collect(ScriptedServer(), prompt_file, transcripts)
    prompt_file.write_text(prompt_file.read_text().replace("def sub", "def mul"))
    server = ScriptedServer()
    assert collect(server, prompt_file, transcripts).answered == 1 and set(server.requests) == {"def mul(a, b):\n"}


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", r"prompts.jsonl:2 is not valid JSON"),
    ('{"text": "x"}', r"prompts.jsonl:2 is neither form; give a JSON object with \"messages\""),
])
def test_a_bad_prompt_line_is_named(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(PROMPTS[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        read_prompt_file(path)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_retrieval_spec.cli", "datastore", "from-server", *args],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


def test_an_unreachable_server_is_one_line_naming_the_url(model_dir, prompt_file, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    done = cli("--url", url, "--prompts", str(prompt_file), "--out", str(tmp_path / "s"), "--model", str(model_dir))
    assert done.returncode == 2 and f"--url {url}: no OpenAI-compatible server answers" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "s").exists()


@pytest.mark.parametrize("theirs", ["a user's document", "the prompt file", "a directory"])
def test_transcripts_that_are_not_this_commands_are_refused_untouched(model_dir, prompt_file, tmp_path, theirs):
    """Answers are appended to ``--transcripts``: a file with other lines (even JSON ones), or a
    directory, is refused before any server is asked, and left as it was."""
    transcripts = {"a user's document": tmp_path / "thesis.tex", "the prompt file": prompt_file,
                   "a directory": tmp_path / "notes"}[theirs]
    if theirs == "a user's document":
        transcripts.write_text("\\chapter{Five years of work}\n")
    elif theirs == "a directory":
        transcripts.mkdir()
    before = transcripts.read_bytes() if transcripts.is_file() else None
    done = cli("--url", f"http://127.0.0.1:{free_port()}", "--prompts", str(prompt_file), "--out",
               str(tmp_path / "s"), "--model", str(model_dir), "--transcripts", str(transcripts))
    line = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert line.startswith(f"vllm-retrieval-spec: error: --transcripts {transcripts}")
    assert ("is not a file" if theirs == "a directory" else "line 1 is not a transcript of this command") in line
    assert (transcripts.read_bytes() if before is not None else None) == before


def test_a_line_torn_by_a_killed_run_is_no_reason_to_refuse(prompt_file, tmp_path):
    transcripts = tmp_path / "t.jsonl"
    collect(ScriptedServer(), prompt_file, transcripts)
    lines = transcripts.read_text().splitlines()
    transcripts.write_text(lines[0] + "\n" + lines[1][:9] + "\n" + lines[2] + "\n" + lines[1][:20])
    from_server.check_transcripts_file(transcripts)


def test_stores_from_the_real_servers_answers(model_dir, plain_server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in [
        {"prompt": "def is_even(n):\n    \"\"\"Return True when n is even.\"\"\"\n"},
        {"prompt": "def reverse(s):\n    \"\"\"Return s reversed.\"\"\"\n"},
        {"messages": [{"role": "user", "content": "Write a Python function that squares a number."}]},
        {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    ]))
    out = tmp_path / "store"
    done = cli("--url", plain_server.base_url, "--prompts", str(prompts), "--out", str(out), "--model", str(model_dir),
               "--max-tokens", "24", "--dense", "--concurrency", "4")
    assert done.returncode == 0, done.stderr
    transcripts = [json.loads(line) for line in (tmp_path / "store.transcripts.jsonl").read_text().splitlines()]
    assert len(transcripts) == 4
    store = TokenDatastore.open(out)
    answer = next(t["text"] for t in transcripts if "text" in t)
    ids = np.asarray(load_tokenizer(model_dir)(answer, add_special_tokens=False).input_ids[:12])
    tokens = np.asarray(store.tokens)
    assert any((tokens[i:i + len(ids)] == ids).all() for i in np.flatnonzero(tokens == ids[0]))
    dense = DenseDatastore.open(tmp_path / "store-dense")
    assert dense.num_positions > 64 and "built" in done.stdout


CAPTURE_TOKENS = 24  # new tokens a prompt: at least 24 - value_tokens positions each


def test_without_a_url_the_dense_store_holds_the_states_captured_while_answering(model_dir, dense_store, tmp_path):
    """A server started here answers with DReSD and captures the key of every generated token:
    the dense store (in ``--dense-keys``' key space) holds the answers' positions with the tokens
    that followed them, and a rerun with everything answered starts no server."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in (
        "def is_even(n):\n    \"\"\"Return True when n is even.\"\"\"\n",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "class Stack:\n    \"\"\"A stack with push, pop and peek.\"\"\"\n")))
    out = tmp_path / "store"
    args = ("--prompts", str(prompts), "--out", str(out), "--model", str(model_dir),
            "--max-tokens", str(CAPTURE_TOKENS), "--dense", "--dense-keys", str(dense_store), "--concurrency", "3")
    done = cli(*args)
    assert done.returncode == 0, done.stderr
    assert "captured while answering" in done.stdout
    captured, keys = DenseDatastore.open(tmp_path / "store-dense"), DenseDatastore.open(dense_store)
    assert captured.num_positions >= 3 * (CAPTURE_TOKENS - captured.value_tokens)
    assert np.array_equal(captured.transform.components, keys.transform.components)
    answers = [json.loads(line)["text"] for line in (tmp_path / "store.transcripts.jsonl").read_text().splitlines()]
    tokenizer = load_tokenizer(model_dir)
    answer_ids = [tokenizer(text, add_special_tokens=False).input_ids for text in answers]
    found = [any(_holds(ids, row) for ids in answer_ids) for row in np.asarray(captured.values).tolist()]
    assert np.mean(found) > 0.9  # re-tokenizing the text may split a boundary token differently
    again = cli(*args, "--replace")
    assert again.returncode == 0, again.stderr
    assert "starting" not in again.stdout and "3 before" in again.stdout


def _holds(ids: list[int], row: list[int]) -> bool:
    return any(ids[i:i + len(row)] == row for i in range(len(ids) - len(row) + 1))


def test_a_capture_that_could_lose_positions_is_refused_before_any_server_starts(model_dir, prompt_file, tmp_path):
    done = cli("--prompts", str(prompt_file), "--out", str(tmp_path / "s"), "--model", str(model_dir), "--dense",
               "--concurrency", "256", "--max-tokens", "512")
    assert done.returncode == 2 and "--concurrency 256 x --max-tokens" in done.stderr
    assert "Traceback" not in done.stderr and "starting" not in done.stdout and not (tmp_path / "s").exists()


@pytest.mark.parametrize(("keys", "message"), [
    ("python-code-dense", "the 'python-code-dense' dense datastore for model 'SmolLM2-135M-Instruct-f32-"),
    ("./no-such-dense-store", "--dense-keys ./no-such-dense-store: no dense datastore there"),
])
def test_capture_keys_that_are_not_there_are_named_before_any_server_starts(model_dir, prompt_file, tmp_path, keys,
                                                                            message):
    """A capture whose ``--dense-keys`` store is not built (the default recipe on a fresh cache) or
    not a directory fails with one line naming it (and the build command), and starts no server."""
    done = cli("--prompts", str(prompt_file), "--out", str(tmp_path / "s"), "--model", str(model_dir), "--dense",
               "--dense-keys", keys, env={CACHE_ENV: str(tmp_path / "cache")})
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "starting" not in done.stdout and not (tmp_path / "s").exists()
    if keys == "python-code-dense":
        assert "`vllm-retrieval-spec datastore build-dense --recipe python-code-dense --model MODEL_DIR`" in done.stderr


def test_a_server_that_refuses_to_start_is_reported_by_its_refusal_line():
    """The reason a started server exited is its own one-line refusal, not the exit code."""
    tail = ("the server exited with code 2\nINFO loading\n"
            "vllm-retrieval-spec: error: the 'x' dense datastore is not built yet\nValueError: later")
    assert capture._first_error_line(tail) == "vllm-retrieval-spec: error: the 'x' dense datastore is not built yet"
    assert capture._first_error_line("exited\nRuntimeError: boom") == "RuntimeError: boom"
    assert capture._first_error_line("the server exited with code 1\n") == "the server exited with code 1"
