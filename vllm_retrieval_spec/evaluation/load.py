"""Load generation against OpenAI-compatible servers (ours, vLLM without speculation, vLLM
``suffix``, ...): request sets, an asynchronous runner with fixed concurrency or Poisson
arrivals, per-request timings, percentiles, run summaries and the comparison of greedy outputs
with a reference server's."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_retrieval_spec.evaluation.client import async_openai_client, openai_client
from vllm_retrieval_spec.evaluation.prompts import PromptForm, humaneval_messages, humaneval_prompts
from vllm_retrieval_spec.options import SPECULATE_ARG

if TYPE_CHECKING:
    from openai import AsyncOpenAI
    from transformers import PreTrainedTokenizerBase

PERCENTILES = (50, 90, 99)
# A request whose connection drops before any response is sent again this many times: a server's
# keep-alive timer may close an idle connection as the client reuses it (uvicorn under uvloop runs
# due timers before reading a request that arrived during a stall), which every HTTP client
# retries; the retries are counted in the summary, and a drop after the response began is an error.
RECONNECTS = 1
# Common English words, one token each for the usual BPE vocabularies (with the leading space).
SYNTHETIC_WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "they", "you", "were", "her", "she", "there", "been", "one", "all", "we", "their", "has",
    "would", "when", "if", "so", "no", "will", "more", "can", "out", "up", "said", "about", "what",
    "its", "into", "than", "them", "only", "other", "new", "some", "could", "time", "these", "two",
    "may", "first", "then",
)


# --- Requests ---------------------------------------------------------------------------------


# Sampling parameters the OpenAI client takes as arguments; others (top_k, repetition_penalty,
# min_p, ...) are vLLM's and travel in the request body's extra fields.
OPENAI_SAMPLING_ARGUMENTS = frozenset(
    {"temperature", "top_p", "seed", "stop", "n", "presence_penalty", "frequency_penalty"})


@dataclass(frozen=True)
class LoadRequest:
    """One request: a completion ``prompt`` (text or token ids) or chat ``messages``, and its
    own ``sampling`` parameters (over the run's temperature)."""

    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int = 128
    ignore_eos: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a request needs either a prompt or chat messages")

    def is_greedy(self, run_temperature: float) -> bool:
        """Whether the output depends on nothing but the request (so servers must agree)."""
        return self.sampling.get("temperature", run_temperature) == 0 and self.sampling.get("n", 1) == 1


def _cycle(items: Sequence[LoadRequest], count: int | None) -> list[LoadRequest]:
    """``count`` requests taken from ``items`` in order, starting over when they run out."""
    if not items:
        raise ValueError("no requests to send")
    return list(itertools.islice(itertools.cycle(items), count if count is not None else len(items)))


def humaneval_requests(
    count: int | None, form: PromptForm, max_tokens: int, tokenizer: PreTrainedTokenizerBase | None = None
) -> list[LoadRequest]:
    """HumanEval requests (cycling over the 164 problems): raw completion prompts, or chat prompts
    rendered with ``tokenizer``'s template, or without a tokenizer chat ``messages`` that the
    server renders."""
    if form == "chat" and tokenizer is None:
        items = [LoadRequest(messages=messages, max_tokens=max_tokens) for messages in humaneval_messages()]
    else:
        prompts = humaneval_prompts(None, form, tokenizer)
        items = [LoadRequest(prompt=prompt, max_tokens=max_tokens) for prompt in prompts]
    return _cycle(items, count)


def jsonl_requests(path: str | Path, count: int | None, max_tokens: int) -> list[LoadRequest]:
    """Requests from a JSONL file of records with chat ``messages`` or a ``prompt`` (a record's own
    ``max_tokens`` wins over ``max_tokens``), cycled up to ``count``."""
    items = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not a JSON record ({error.msg})") from error
        if not isinstance(record, dict) or ("messages" not in record and "prompt" not in record):
            raise ValueError(f"{path}:{number}: a record needs 'messages' or 'prompt'")
        items.append(LoadRequest(prompt=record.get("prompt"), messages=record.get("messages"),
                                 max_tokens=int(record.get("max_tokens", max_tokens))))
    return _cycle(items, count)


def synthetic_requests(
    count: int, input_len: int, output_len: int, seed: int = 0, tokenizer: PreTrainedTokenizerBase | None = None
) -> list[LoadRequest]:
    """``count`` prompts of ``input_len`` random common words (about one token each; exactly
    ``input_len`` token ids with ``tokenizer``), each generating exactly ``output_len`` tokens
    (``ignore_eos``)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        text = " ".join(rng.choices(SYNTHETIC_WORDS, k=input_len))
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"][:input_len] if tokenizer else text
        requests.append(LoadRequest(prompt=prompt, max_tokens=output_len, ignore_eos=True))
    return requests


def mixed_requests(count: int, max_tokens: int, seed: int = 0) -> list[LoadRequest]:
    """``count`` requests as a shared server sees them (seeded): chat and completion prompts,
    short and long (several HumanEval problems in one), greedy and sampled (temperature
    0.3–1.2, top-p, top-k, seeds, ``n`` = 2), some with penalties or stop strings, a tenth turning
    speculation off for themselves (servers without our plugin ignore it), up to ``max_tokens``
    new tokens each."""
    rng, switches = random.Random(seed), random.Random(f"speculation-switch-{seed}")
    chats, raws = humaneval_messages(), humaneval_prompts(None, "raw")
    requests = []
    for _ in range(count):
        shape = rng.random()
        tokens = rng.choice((max(1, max_tokens // 4), max(1, max_tokens // 2), max_tokens))
        sampling = _mixed_sampling(rng)
        if switches.random() < 0.1:
            sampling["vllm_xargs"] = {SPECULATE_ARG: "off"}
        if shape < 0.55:
            requests.append(LoadRequest(messages=rng.choice(chats), max_tokens=tokens, sampling=sampling))
        else:
            parts = rng.randint(3, 6) if shape > 0.85 else 1
            prompt = "\n".join(rng.sample(raws, parts))
            requests.append(LoadRequest(prompt=prompt, max_tokens=tokens, sampling=sampling))
    return requests


def _mixed_sampling(rng: random.Random) -> dict[str, Any]:
    """One request's sampling parameters: greedy 40% of the time."""
    sampling: dict[str, Any] = {"temperature": 0.0}
    if rng.random() >= 0.4:
        sampling = {"temperature": round(rng.uniform(0.3, 1.2), 2), "top_p": rng.choice((1.0, 0.95, 0.9, 0.8))}
        sampling.update(rng.choice(({}, {"top_k": 20}, {"top_k": 50})))
        if rng.random() < 0.5:
            sampling["seed"] = rng.randrange(2**31)
        if rng.random() < 0.15:
            sampling["n"] = 2
    extra = rng.random()
    if extra < 0.1:
        sampling["repetition_penalty"] = 1.1
    elif extra < 0.2:
        sampling[rng.choice(("presence_penalty", "frequency_penalty"))] = 0.4
    elif extra < 0.35:
        sampling["stop"] = [rng.choice(("\n\n", "```", "return"))]
    return sampling


# --- Running ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadSettings:
    """How a run sends its requests."""

    model: str
    concurrency: int = 1
    request_rate: float = math.inf  # requests per second, Poisson arrivals; inf: all at once
    stream: bool = True
    temperature: float = 0.0
    token_ids: bool = True  # ask vLLM for the token ids (``return_token_ids``)
    seed: int = 0  # of the arrival times
    timeout_s: float = 600.0


@dataclass(frozen=True)
class RequestResult:
    """What one request got back; times in seconds from its sending."""

    index: int
    error: str | None = None  # the kind of failure; None when it succeeded
    detail: str = ""  # the failure's message, with its causes
    reconnects: int = 0  # times the request was sent again after its connection dropped unanswered
    ttft: float | None = None  # streaming only
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    token_ids: list[int] | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (streaming only)."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class LoadRun:
    """One run's settings, its results in request order and its wall time."""

    settings: LoadSettings
    results: list[RequestResult]
    seconds: float


def arrival_times(count: int, rate: float, seed: int = 0) -> list[float]:
    """When each request may be sent (seconds from the start): Poisson arrivals at ``rate`` per
    second, or all at once when the rate is infinite."""
    if math.isinf(rate):
        return [0.0] * count
    if rate <= 0:
        raise ValueError(f"the request rate must be positive, got {rate}")
    rng = random.Random(seed)
    return list(itertools.accumulate(rng.expovariate(rate) for _ in range(count)))


def error_kind(error: BaseException) -> str:
    """A short name for a failure: ``HTTP 400``, ``timeout``, ``connection`` or the exception's type."""
    import openai

    if isinstance(error, openai.APIStatusError):
        return f"HTTP {error.status_code}"
    if isinstance(error, openai.APITimeoutError):
        return "timeout"
    if isinstance(error, openai.APIConnectionError):
        return "connection"
    return type(error).__name__


def error_detail(error: BaseException) -> str:
    """The failure's message followed by its causes' (what httpx saw under openai's wrapper)."""
    messages: list[str] = []
    cause: BaseException | None = error
    while cause is not None and len(messages) < 4:
        message = f"{type(cause).__name__}: {cause}".strip()
        if message not in messages:
            messages.append(message)
        cause = cause.__cause__ or cause.__context__
    return " <- ".join(messages)[:500]


def _create_arguments(request: LoadRequest, settings: LoadSettings) -> dict[str, Any]:
    extra: dict[str, Any] = {key: value for key, value in request.sampling.items()
                             if key not in OPENAI_SAMPLING_ARGUMENTS}
    if settings.token_ids:
        extra["return_token_ids"] = True
    if request.ignore_eos:
        extra["ignore_eos"] = True
    arguments: dict[str, Any] = {
        "model": settings.model, "max_tokens": request.max_tokens, "temperature": settings.temperature,
        "stream": settings.stream, "extra_body": extra,
        **{key: value for key, value in request.sampling.items() if key in OPENAI_SAMPLING_ARGUMENTS},
    }
    if settings.stream:
        arguments["stream_options"] = {"include_usage": True}
    if request.messages is not None:
        arguments["messages"] = request.messages
    else:
        arguments["prompt"] = request.prompt
    return arguments


def _choice_text(choice: Any) -> str:
    """The text of a completion choice, a chat choice or a streamed chat delta."""
    if hasattr(choice, "text"):
        return choice.text or ""
    message = getattr(choice, "delta", None) or getattr(choice, "message", None)
    return (message.content if message is not None else None) or ""


def _result(index: int, ttft: float | None, latency: float, ids: list[int], text: str,
            usage: Any, pieces: int, reconnects: int) -> RequestResult:
    """Output tokens from the usage, else the token ids, else the pieces of text received."""
    output_tokens = usage.completion_tokens if usage is not None else (len(ids) or pieces)
    return RequestResult(index, ttft=ttft, latency=latency, output_tokens=output_tokens,
                         prompt_tokens=usage.prompt_tokens if usage is not None else None,
                         token_ids=ids or None, text=text, reconnects=reconnects)


async def _create(client: AsyncOpenAI, request: LoadRequest, settings: LoadSettings) -> tuple[Any, int]:
    """The endpoint's response (a stream when streaming) and how many times the request was sent
    again after its connection dropped before any response (at most ``RECONNECTS``)."""
    import openai

    endpoint: Any = client.chat.completions if request.messages is not None else client.completions
    reconnects = 0
    while True:
        try:
            return await endpoint.create(**_create_arguments(request, settings)), reconnects
        except openai.APITimeoutError:
            raise
        except openai.APIConnectionError:
            if reconnects == RECONNECTS:
                raise
            reconnects += 1


async def _send_streamed(client: AsyncOpenAI, index: int, request: LoadRequest, settings: LoadSettings,
                         sent: float) -> RequestResult:
    stream, reconnects = await _create(client, request, settings)
    ttft, ids, text, pieces, usage = None, [], [], 0, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            piece, new_ids = _choice_text(choice), (choice.model_extra or {}).get("token_ids") or []
            if piece or new_ids:
                ttft = time.perf_counter() - sent if ttft is None else ttft
                pieces += 1
            ids.extend(new_ids)
            text.append(piece)
    return _result(index, ttft, time.perf_counter() - sent, ids, "".join(text), usage, pieces, reconnects)


async def _send_whole(client: AsyncOpenAI, index: int, request: LoadRequest, settings: LoadSettings,
                      sent: float) -> RequestResult:
    response, reconnects = await _create(client, request, settings)
    choice = response.choices[0]
    ids = list((choice.model_extra or {}).get("token_ids") or [])
    text = _choice_text(choice)
    return _result(index, None, time.perf_counter() - sent, ids, text, response.usage, int(bool(text)), reconnects)


async def send_request(client: AsyncOpenAI, index: int, request: LoadRequest, settings: LoadSettings) -> RequestResult:
    """Send one request; a failure becomes a result with its kind, never an exception."""
    sent = time.perf_counter()
    send = _send_streamed if settings.stream else _send_whole
    try:
        return await send(client, index, request, settings, sent)
    except Exception as error:
        return RequestResult(index, error=error_kind(error), detail=error_detail(error),
                             latency=time.perf_counter() - sent)


async def run_load(base_url: str, requests: Sequence[LoadRequest], settings: LoadSettings,
                   label: str = "", progress: bool = True,
                   on_finished: Callable[[int], None] | None = None) -> LoadRun:
    """Send every request, at most ``settings.concurrency`` in flight, each no earlier than its
    arrival time; a tqdm bar counts finished requests (``on_finished`` gets their count)."""
    from tqdm.auto import tqdm

    client = async_openai_client(base_url, settings.timeout_s)
    gate = asyncio.Semaphore(settings.concurrency)
    bar = tqdm(total=len(requests), desc=label or base_url, unit="req", disable=not progress)
    start = time.perf_counter()

    async def one(index: int, request: LoadRequest, arrival: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        async with gate:
            result = await send_request(client, index, request, settings)
        bar.update()
        if on_finished is not None:
            on_finished(bar.n)
        return result

    arrivals = arrival_times(len(requests), settings.request_rate, settings.seed)
    try:
        results = await asyncio.gather(*(one(i, r, t) for i, (r, t) in enumerate(zip(requests, arrivals))))
    finally:
        bar.close()
        await client.close()
    return LoadRun(settings, list(results), time.perf_counter() - start)


def run_load_sync(base_url: str, requests: Sequence[LoadRequest], settings: LoadSettings,
                  label: str = "", progress: bool = True,
                  on_finished: Callable[[int], None] | None = None) -> LoadRun:
    """:func:`run_load` in a fresh event loop."""
    return asyncio.run(run_load(base_url, requests, settings, label, progress, on_finished))


# --- Engine memory ----------------------------------------------------------------------------


ENGINE_PROCESS_TITLES = ("EngineCore", "VLLM::Worker")  # the engine core and its executor's workers (the model)


def engine_memory_bytes() -> tuple[int, int]:
    """Resident memory of this machine's vLLM engine processes — the engine cores and their
    workers, which hold the model runner and our drafting state (titled ``VLLM::EngineCore``,
    ``VLLM::Worker``) — and the anonymous part of it (resident less shared: not the pages of
    memory-mapped files such as datastores, which the page cache holds once for every process)."""
    import psutil

    resident = anonymous = 0
    for process in psutil.process_iter(["cmdline", "memory_info"]):
        command = " ".join(process.info["cmdline"] or ())
        memory = process.info["memory_info"]
        if any(title in command for title in ENGINE_PROCESS_TITLES) and memory is not None:
            resident += memory.rss
            anonymous += memory.rss - getattr(memory, "shared", 0)
    return resident, anonymous


@dataclass
class MemoryWatch:
    """Engine memory (resident, anonymous) sampled every ``every`` finished requests of a run (a
    leak shows as growth)."""

    every: int
    samples: list[tuple[int, int, int]] = field(default_factory=list)

    def __call__(self, finished: int) -> None:
        if finished % self.every == 0:
            self.samples.append((finished, *engine_memory_bytes()))

    def report(self, after: int = 200) -> dict[str, Any]:
        """Samples in MiB and each measure's growth from the first sample at or after ``after``
        requests."""
        def growth(column: int) -> float | None:
            later = [sample[column] for sample in self.samples if sample[0] >= after]
            return later[-1] / later[0] - 1.0 if len(later) >= 2 and later[0] else None

        def mib(column: int) -> list[list[float]]:
            return [[sample[0], round(sample[column] / 2**20, 1)] for sample in self.samples]

        return {"every": self.every, "after": after, "growth": growth(1), "anon_growth": growth(2),
                "rss_mib": mib(1), "anon_mib": mib(2)}


def served_model(base_url: str) -> str:
    """The first model the server lists (``/v1/models``)."""
    return openai_client(base_url).models.list().data[0].id


# --- Reports ----------------------------------------------------------------------------------


def percentiles(values: Sequence[float], points: Sequence[int] = PERCENTILES) -> dict[str, float | None]:
    """``{"p50": ..., "p90": ..., "p99": ...}`` with linear interpolation; None without values."""
    if not values:
        return {f"p{p}": None for p in points}
    found = np.percentile(np.asarray(values, dtype=float), list(points))
    return {f"p{p}": float(v) for p, v in zip(points, found)}


def summarize_run(run: LoadRun) -> dict[str, Any]:
    """Throughput, errors by kind, and TTFT, TPOT and latency percentiles (seconds) of one run."""
    ok = [r for r in run.results if r.ok]
    output = sum(r.output_tokens for r in ok)
    rate = run.settings.request_rate
    return {
        "concurrency": run.settings.concurrency,
        "request_rate": None if math.isinf(rate) else rate,
        "stream": run.settings.stream,
        "requests": len(run.results),
        "completed": len(ok),
        "errors": dict(Counter(r.error for r in run.results if r.error is not None)),
        "reconnects": sum(r.reconnects for r in run.results),
        "failed_requests": [{"index": r.index, "error": r.error, "detail": r.detail, "after_s": r.latency}
                            for r in run.results if r.error is not None][:32],
        "seconds": run.seconds,
        "output_tokens": output,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "output_tokens_per_second": output / run.seconds if run.seconds > 0 else None,
        "requests_per_second": len(ok) / run.seconds if run.seconds > 0 else None,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": percentiles([t for t in (r.tpot for r in ok) if t is not None]),
        "latency_s": percentiles([r.latency for r in ok]),
    }


def same_output(a: RequestResult, b: RequestResult) -> bool:
    """Token ids when both results have them, else text."""
    if a.token_ids is not None and b.token_ids is not None:
        return a.token_ids == b.token_ids
    return a.text == b.text


def count_differences(results: Sequence[RequestResult], reference: Sequence[RequestResult],
                      comparable: Sequence[bool] | None = None) -> dict[str, Any]:
    """How many requests that succeeded in both runs (and are ``comparable``, by index: greedy)
    got outputs other than the reference's."""
    by_index = {r.index: r for r in reference if r.ok and (comparable is None or comparable[r.index])}
    pairs = [(r, by_index[r.index]) for r in results if r.ok and r.index in by_index]
    differing = [r.index for r, ref in pairs if not same_output(r, ref)]
    by_ids = sum(r.token_ids is not None and ref.token_ids is not None for r, ref in pairs)
    return {"compared": len(pairs), "compared_by_token_ids": by_ids, "differing": len(differing),
            "differing_requests": differing[:32]}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per run (a summary with ``server`` and optionally ``compare``): TTFT and TPOT in
    ms, latency in s, p50/p90/p99."""
    header = (f"{'server':18s} {'conc':>5s} {'rate':>6s} {'ok':>5s} {'errors':>8s} {'tok/s':>8s} {'req/s':>6s} "
              f"{'TTFT p50/p99 ms':>16s} {'TPOT p50/p90/p99 ms':>20s} {'E2E p50/p90/p99 s':>19s} {'differ':>7s}")
    lines = [header]
    for row in rows:
        ttft, tpot, e2e = row["ttft_s"], row["tpot_s"], row["latency_s"]
        rate = "inf" if row["request_rate"] is None else f"{row['request_rate']:g}"
        errors = sum(row["errors"].values())
        tokens = row["output_tokens_per_second"]
        requests = row["requests_per_second"]
        latency = "/".join("-" if e2e[k] is None else f"{e2e[k]:.2f}" for k in ("p50", "p90", "p99"))
        differ = f"{row['compare']['differing']}/{row['compare']['compared']}" if "compare" in row else "-"
        lines.append(
            f"{row['server'][:18]:18s} {row['concurrency']:5d} {rate:>6s} {row['completed']:5d} {errors:8d} "
            f"{'-' if tokens is None else f'{tokens:.1f}':>8s} {'-' if requests is None else f'{requests:.2f}':>6s} "
            f"{_ms(ttft['p50']) + '/' + _ms(ttft['p99']):>16s} "
            f"{'/'.join(_ms(tpot[k]) for k in ('p50', 'p90', 'p99')):>20s} {latency:>19s} {differ:>7s}"
        )
    lines += [f"errors, {row['server']} at concurrency {row['concurrency']}: "
              + ", ".join(f"{kind} ×{count}" for kind, count in row["errors"].items())
              + "".join(f"\n  request {failed['index']} after {failed['after_s']:.2f} s: {failed['detail']}"
                        for failed in row.get("failed_requests", [])[:4])
              for row in rows if row["errors"]]
    lines += [f"reconnects, {row['server']} at concurrency {row['concurrency']}: {row['reconnects']} request(s) "
              "sent again after their connection dropped unanswered" for row in rows if row.get("reconnects")]
    return "\n".join(lines)
