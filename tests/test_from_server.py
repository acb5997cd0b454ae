"""``datastore from-server`` beyond ``test_datastore_from_server.py``: connection drops and 429
retried with exponential backoff (other 4xx not), the served model taken from ``/v1/models``, a
failed run that builds nothing and says so in one line, a rerun that asks only what is missing
and builds the stores from the current prompts' transcripts only, and the standard-library prompt
generator (HumanEval-shaped, disjoint from HumanEval, deterministic). All against an
OpenAI-compatible server faked in a thread; no model runs."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import threading
from collections import Counter
from pathlib import Path
from types import ModuleType

import numpy as np
import openai
import pytest
from aiohttp import web

from vllm_retrieval_spec.cli import main
from vllm_retrieval_spec.datastores import TokenDatastore, from_server
from vllm_retrieval_spec.datastores.builder import load_tokenizer
from vllm_retrieval_spec.datastores.from_server import AskSettings, PromptRecord, ask
from vllm_retrieval_spec.evaluation import prompts

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SERVED = "fake-model"
ADD, HI, SUB = "def add(a, b):\n", "Say hi.", "def sub(a, b):\n"
PROMPTS = [{"prompt": ADD}, {"messages": [{"role": "user", "content": HI}]}, {"prompt": SUB}]


class FakeServer:
    """An OpenAI-compatible server in a background thread: ``/v1/models`` lists ``fake-model``,
    completions answer ``ANSWER:<prompt>``; ``faults`` maps a prompt to what its next requests get
    before an answer: an HTTP status, or ``"drop"`` (the connection closed, nothing answered)."""

    def __init__(self, faults: dict[str, list[int | str]] | None = None) -> None:
        self.faults = {text: list(items) for text, items in (faults or {}).items()}
        self.requests: Counter[str] = Counter()
        self.models: set[str] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.url = ""

    def __enter__(self) -> FakeServer:
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()
        return self

    def __exit__(self, *exc_info: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/models", self._list_models)
        app.router.add_post("/v1/completions", self._answer)
        app.router.add_post("/v1/chat/completions", self._answer)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self._runner, sock).start()
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def _list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": SERVED, "object": "model", "created": 0,
                                                              "owned_by": "test"}]})

    async def _answer(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = body["prompt"] if "prompt" in body else body["messages"][-1]["content"]
        self.requests[text] += 1
        self.models.add(body["model"])
        fault = self.faults[text].pop(0) if self.faults.get(text) else None
        if fault == "drop":
            request.transport.close()
            return web.Response()
        if fault is not None:
            return web.json_response({"error": {"message": "scripted"}}, status=int(fault))
        usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
        head = {"id": "c", "created": 0, "model": body["model"], "usage": usage}
        if "prompt" in body:
            return web.json_response(head | {"object": "text_completion", "choices": [
                {"index": 0, "text": f"ANSWER:{text}", "finish_reason": "stop", "logprobs": None}]})
        message = {"role": "assistant", "content": f"ANSWER:{text}"}
        return web.json_response(head | {"object": "chat.completion", "choices": [
            {"index": 0, "message": message, "finish_reason": "stop"}]})


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(from_server, "RETRY_BASE_SECONDS", 0.0)


@pytest.fixture()
def prompt_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def ask_once(server: FakeServer, retries: int) -> tuple[tuple[str, int] | BaseException, list[float]]:
    """:func:`ask` for one raw prompt ``ADD`` at the real backoff; its answer (or error) and waits."""
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    async def run() -> tuple[str, int] | BaseException:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        try:
            return await ask(client, PromptRecord(0, "k", prompt=ADD), AskSettings(SERVED, retries=retries), sleep)
        except openai.APIError as error:
            return error
        finally:
            await client.close()

    return asyncio.run(run()), waits


def test_connection_drops_and_429_are_retried_with_exponential_backoff(monkeypatch):
    monkeypatch.setattr(from_server, "RETRY_BASE_SECONDS", 0.5)  # only recorded, never slept
    with FakeServer({ADD: ["drop", 429, 503]}) as server:
        result, waits = ask_once(server, retries=3)
    assert result == (f"ANSWER:{ADD}", 2) and server.requests[ADD] == 4 and waits == [0.5, 1.0, 2.0]


@pytest.mark.parametrize(("faults", "retries", "requests", "error"), [
    ([404], 3, 1, openai.NotFoundError),
    ([422], 3, 1, openai.UnprocessableEntityError),
    (["drop"] * 5, 2, 3, openai.APIConnectionError),
    ([500] * 5, 1, 2, openai.InternalServerError),
])
def test_client_errors_are_not_retried_and_retries_end(faults, retries, requests, error):
    with FakeServer({ADD: faults}) as server:
        result, waits = ask_once(server, retries)
    assert isinstance(result, error) and server.requests[ADD] == requests and len(waits) == requests - 1


def from_server_cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """``vllm-retrieval-spec datastore from-server ARGS`` in this process: exit status, stdout, stderr."""
    try:
        main(["datastore", "from-server", *map(str, args)])
        status = 0
    except SystemExit as exit_:
        status = int(exit_.code or 0)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def answered(prompt: str) -> dict:
    """The transcript of ``prompt`` (chat for ``HI``, raw for the others) as the fake server answers."""
    if prompt == HI:
        return {"messages": [{"role": "user", "content": HI}, {"role": "assistant", "content": f"ANSWER:{HI}"}]}
    return {"text": f"{prompt}ANSWER:{prompt}"}


def assert_store_holds(store_dir: Path, model_dir: Path, transcripts: list[dict]) -> None:
    """The REST store holds exactly ``transcripts``: each rendered (chat template) and tokenized, in order."""
    tokenizer = load_tokenizer(model_dir)
    store = TokenDatastore.open(store_dir)
    expected = []
    for record in transcripts:
        text = record.get("text") or tokenizer.apply_chat_template(record["messages"], tokenize=False)
        expected += [*tokenizer(text, add_special_tokens=False).input_ids, store.separator]
    assert np.asarray(store.tokens).tolist() == expected


def test_a_failed_run_builds_nothing_and_the_rerun_asks_only_the_rest(model_dir, prompt_file, tmp_path, capsys):
    out = tmp_path / "store"
    transcripts = tmp_path / "store.transcripts.jsonl"
    args = ("--prompts", prompt_file, "--out", out, "--model", model_dir, "--retries", "1")
    with FakeServer({SUB: [500, 500]}) as server:
        status, _, err = from_server_cli(capsys, "--url", server.url, *args)
    errors = [line for line in err.splitlines() if line.startswith("vllm-retrieval-spec: error:")]
    assert status == 2 and len(errors) == 1 and "Traceback" not in err
    assert "1 prompt(s) got no answer (prompt 2: InternalServerError" in errors[0] and "rerun" in errors[0]
    assert server.models == {SERVED} and server.requests[SUB] == 2 and not out.exists()
    assert len(transcripts.read_text().splitlines()) == 2

    with FakeServer() as server:
        status, stdout, err = from_server_cli(capsys, "--url", server.url, *args)
    assert status == 0, err
    assert server.requests == Counter({SUB: 1}) and "1 answered now, 2 before, 0 failed of 3" in stdout
    assert_store_holds(out, model_dir, [answered(ADD), answered(HI), answered(SUB)])


def test_the_stores_hold_each_current_prompts_transcript_once(model_dir, prompt_file, tmp_path, capsys):
    """A changed prompt's old answer, a torn line of a killed run and a repeated answer stay in the
    transcripts file (resuming needs it) but out of the stores."""
    out = tmp_path / "store"
    transcripts = tmp_path / "answers.jsonl"
    args = ("--prompts", prompt_file, "--out", out, "--model", model_dir, "--transcripts", transcripts,
            "--model-name", "given-name")
    with FakeServer() as server:
        assert from_server_cli(capsys, "--url", server.url, *args)[0] == 0
    first = transcripts.read_text().splitlines()
    prompt_file.write_text(prompt_file.read_text().replace("def sub", "def mul"))
    with transcripts.open("a") as handle:
        handle.write(first[0] + "\n" + '{"index": 1, "key": "torn')
    with FakeServer() as server:
        status, _, err = from_server_cli(capsys, "--url", server.url, *args, "--replace")
    assert status == 0, err
    assert server.requests == Counter({"def mul(a, b):\n": 1}) and server.models == {"given-name"}
    assert_store_holds(out, model_dir, [answered(ADD), answered(HI), answered("def mul(a, b):\n")])


# --- benchmarks/stdlib_prompts.py --------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_prompts() -> ModuleType:
    spec = importlib.util.spec_from_file_location("stdlib_prompts", BENCHMARKS / "stdlib_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LONG_DOC = "Return the items of a that are not in b, keeping their order."


def test_only_public_functions_of_public_modules_with_a_docstring_are_taken(stdlib_prompts, tmp_path):
    public = f'def visible(a: list[int], *, b=2) -> list[int]:\n    """{LONG_DOC}\n\n    More.\n    """\n    return a\n'
    others = f'def _hidden(a):\n    """{LONG_DOC}"""\n\n\ndef terse(a):\n    """Short."""\n\n\ndef bare(a):\n    pass\n'
    for name in ("good.py", "pkg/__init__.py", "test/t.py", "idlelib/i.py", "site-packages/s.py", "_private.py",
                 "pkg/_impl.py", "_pkg/mod.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(public.replace("visible", Path(name).stem.strip("_") or "x") + others)
    assert list(stdlib_prompts.stdlib_functions(tmp_path)) == [
        ("good", f'def good(a: list[int], *, b=2) -> list[int]:\n    """{LONG_DOC}\n\n    More.\n    """\n'),
        ("init", f'def init(a: list[int], *, b=2) -> list[int]:\n    """{LONG_DOC}\n\n    More.\n    """\n'),
    ]


def test_prompts_are_humaneval_shaped_disjoint_from_humaneval_and_seeded(stdlib_prompts, monkeypatch, capsys):
    import ast

    entry_points = {problem["entry_point"] for problem in prompts.humaneval_problems()}
    records = stdlib_prompts.prompt_records(10**6, "raw", seed=0)  # every function
    assert "named like a HumanEval entry point left out" in capsys.readouterr().out and len(records) > 500
    for record in records:
        (function,) = ast.parse(record["prompt"]).body
        assert function.name not in entry_points and len(ast.get_docstring(function)) >= 40
        assert len(function.body) == 1 and record["prompt"].endswith('"""\n')
    both = stdlib_prompts.prompt_records(5, "both", seed=1)
    assert both == stdlib_prompts.prompt_records(5, "both", seed=1) != stdlib_prompts.prompt_records(5, "both", 2)
    for raw, chat in zip(both[::2], both[1::2], strict=True):
        monkeypatch.setattr(prompts, "humaneval_problems", lambda raw=raw: [{"prompt": raw["prompt"]}])
        assert chat == {"messages": prompts.humaneval_messages(1)[0]}
