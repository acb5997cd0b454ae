"""In-distribution datastores in one command: a prompt file answered by any running
OpenAI-compatible server (the asynchronous client, retries, a progress bar), the prompt + answer
transcripts appended to a JSONL file as they arrive (a rerun asks only what is missing), then a
REST store, and with ``--dense`` a DReSD store, built from the current prompts' transcripts (each
once, in prompt order: a changed prompt's old answer, a repeat and a killed run's torn line stay in
the file but out of the stores). Without ``--url`` the command starts this package's server
itself, and the dense store holds the hidden states it captured while answering (every generated
position, no forward pass; the prompts' positions are not in it)."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from openai import AsyncOpenAI

RETRY_BASE_SECONDS = 0.5  # waits 0.5, 1, 2, ... seconds between tries
CAPTURE_OVERSHOOT = 64  # positions a captured answer may hold past --max-tokens (a last step's accepted drafts)
ACCEPTED_FORMS = 'a JSON object with "messages" (a list of {"role": str, "content": str}) or "prompt" (a string)'


@dataclass(frozen=True)
class PromptRecord:
    """One line of the prompt file: chat ``messages`` or a raw ``prompt``; ``key`` hashes it."""

    index: int
    key: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None

    def transcript(self, answer: str) -> dict[str, Any]:
        """The record a datastore is built from: the conversation with the answer, or the text."""
        head = {"index": self.index, "key": self.key}
        if self.messages is not None:
            return head | {"messages": [*self.messages, {"role": "assistant", "content": answer}]}
        return head | {"text": f"{self.prompt}{answer}"}


def read_prompt_file(path: Path) -> list[PromptRecord]:
    """Every non-empty line of ``path``; a bad one fails naming ``path:line`` and the forms."""
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--prompts {path}: cannot be read ({error}); give a UTF-8 JSONL file") from error
    for number, line in enumerate(lines, 1):
        if line.strip():
            records.append(_prompt_record(path, number, line, len(records)))
    if not records:
        raise ValueError(f"--prompts {path} holds no prompts; give one {ACCEPTED_FORMS} per line")
    return records


def _prompt_record(path: Path, number: int, line: str, index: int) -> PromptRecord:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{number} is not valid JSON ({error}); give {ACCEPTED_FORMS} per line") from error
    key = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
    if isinstance(data, dict) and _are_chat_messages(data.get("messages")):
        return PromptRecord(index, key, messages=data["messages"])
    if isinstance(data, dict) and isinstance(data.get("prompt"), str):
        return PromptRecord(index, key, prompt=data["prompt"])
    raise ValueError(f"{path}:{number} is neither form; give {ACCEPTED_FORMS} per line")


def _are_chat_messages(messages: object) -> bool:
    """Whether ``messages`` is a non-empty list of ``{"role": str, "content": str}`` objects."""
    return isinstance(messages, list) and bool(messages) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)


def scan_transcripts(transcripts: Path) -> Iterator[tuple[int, tuple[int, str] | None]]:
    """``(byte offset, (index, key))`` of every non-empty line of ``transcripts``; ``None`` for a
    line that is no transcript (the torn last line of a run killed while writing)."""
    if not transcripts.is_file():
        return
    offset = 0
    with transcripts.open("rb") as handle:
        for line in handle:
            if line.strip():
                yield offset, _transcript_id(line)
            offset += len(line)


def check_transcripts_file(transcripts: Path) -> None:
    """Refuse, before any answer, a ``--transcripts`` that answers would be appended to although it
    is not this command's: no file, or a line that is neither a transcript nor one a killed run
    tore (a JSON object cut short)."""
    if transcripts.exists() and not transcripts.is_file():
        raise ValueError(f"--transcripts {transcripts} is not a file; give the JSONL file answers are appended to")
    if not transcripts.is_file():
        return
    with transcripts.open("rb") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip() and _transcript_id(line) is None and not _torn(line):
                raise ValueError(f"--transcripts {transcripts}: line {number} is not a transcript of this command, and "
                                 "answers are appended to the file; give a file of its transcripts or a new one")


def _torn(line: bytes) -> bool:
    """Whether ``line`` is the start of a JSON object cut short (what a run killed mid-write leaves)."""
    if not line.lstrip().startswith(b"{"):
        return False
    try:
        json.loads(line)
    except ValueError:
        return True
    return False


def _transcript_id(line: bytes) -> tuple[int, str] | None:
    try:
        record = json.loads(line)
    except ValueError:  # not JSON, or not UTF-8
        return None
    if not isinstance(record, dict) or not isinstance(record.get("key"), str) or type(record.get("index")) is not int:
        return None
    if isinstance(record.get("text"), str) or _are_chat_messages(record.get("messages")):
        return record["index"], record["key"]
    return None


def answered(transcripts: Path) -> set[tuple[int, str]]:
    """``(index, key)`` of the prompts already answered in ``transcripts`` (a torn line is asked again)."""
    return {found for _, found in scan_transcripts(transcripts) if found is not None}


@dataclass
class TranscriptSelection:
    """What of a transcripts file goes into the stores: the byte offset of each current prompt's
    first transcript, in prompt order; lines skipped as unreadable, and answers left out (of
    prompts no longer in the prompt file, or repeated)."""

    offsets: list[int]
    unreadable: int
    left_out: int

    @classmethod
    def of(cls, transcripts: Path, records: Sequence[PromptRecord]) -> TranscriptSelection:
        """The selection of ``transcripts`` for the prompts ``records``."""
        current = {(r.index, r.key) for r in records}
        first: dict[tuple[int, str], int] = {}
        unreadable = left_out = 0
        for offset, found in scan_transcripts(transcripts):
            if found is None:
                unreadable += 1
            elif found in current and found not in first:
                first[found] = offset
            else:
                left_out += 1
        return cls([first[found] for found in sorted(first)], unreadable, left_out)

    def write(self, transcripts: Path, out: Path) -> None:
        """The selected lines of ``transcripts``, one each, into ``out``."""
        with transcripts.open("rb") as source, out.open("wb") as sink:
            for offset in self.offsets:
                source.seek(offset)
                sink.write(source.readline().rstrip(b"\r\n") + b"\n")


@dataclass(frozen=True)
class AskSettings:
    """How prompts are sent: the served model, answer length, temperature, concurrency, retries."""

    model: str
    max_tokens: int = 256
    temperature: float = 0.0
    concurrency: int = 8
    retries: int = 3
    timeout_s: float = 600.0


@dataclass
class CollectReport:
    """What one run asked, got and failed (the first failure's reason kept)."""

    total: int
    already: int
    answered: int = 0
    failed: int = 0
    first_error: str | None = None
    output_tokens: int = 0


def is_retryable(error: BaseException) -> bool:
    """Connection problems, timeouts, 429 and 5xx are retried; other HTTP errors are not."""
    import openai

    if isinstance(error, (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError)):
        return True
    return isinstance(error, openai.APIStatusError) and error.status_code >= 500


async def ask(client: AsyncOpenAI, record: PromptRecord, settings: AskSettings,
              sleep: Callable[[float], Any] = asyncio.sleep) -> tuple[str, int]:
    """The answer to one prompt and its token count, retried ``settings.retries`` times."""
    for attempt in range(settings.retries + 1):
        try:
            return await _complete(client, record, settings)
        except Exception as error:
            if attempt == settings.retries or not is_retryable(error):
                raise
            await sleep(RETRY_BASE_SECONDS * 2**attempt)
    raise AssertionError("unreachable")


async def _complete(client: AsyncOpenAI, record: PromptRecord, settings: AskSettings) -> tuple[str, int]:
    common = {"model": settings.model, "max_tokens": settings.max_tokens, "temperature": settings.temperature}
    if record.messages is not None:
        reply = await client.chat.completions.create(messages=record.messages, **common)
        text = reply.choices[0].message.content or ""
    else:
        reply = await client.completions.create(prompt=record.prompt, **common)
        text = reply.choices[0].text
    return text, reply.usage.completion_tokens if reply.usage else 0


async def collect_transcripts(url: str, records: Sequence[PromptRecord], transcripts: Path, settings: AskSettings,
                              progress: bool = True) -> CollectReport:
    """Ask every prompt not yet in ``transcripts``, at most ``settings.concurrency`` at a time,
    appending each answer's transcript (flushed) as soon as it arrives."""
    from openai import AsyncOpenAI
    from tqdm.auto import tqdm

    done = answered(transcripts)
    pending = [r for r in records if (r.index, r.key) not in done]
    report = CollectReport(total=len(records), already=len(records) - len(pending))
    client = AsyncOpenAI(base_url=f"{url.rstrip('/')}/v1", api_key="not-needed", timeout=settings.timeout_s,
                         max_retries=0)
    gate = asyncio.Semaphore(settings.concurrency)
    bar = tqdm(total=len(pending), desc="answers", unit="answer", disable=not progress)
    transcripts.parent.mkdir(parents=True, exist_ok=True)
    with transcripts.open("a", encoding="utf-8") as out:
        if _ends_torn(transcripts):
            out.write("\n")  # the torn line of a killed run stays alone on its line

        async def one(record: PromptRecord) -> None:
            async with gate:
                try:
                    answer, tokens = await ask(client, record, settings)
                except Exception as error:
                    report.failed += 1
                    report.first_error = report.first_error or f"prompt {record.index}: {_reason(error)}"
                    return
            out.write(json.dumps(record.transcript(answer), ensure_ascii=False) + "\n")
            out.flush()
            report.answered += 1
            report.output_tokens += tokens
            bar.update()
            bar.set_postfix(tok_s=f"{report.output_tokens / max(bar.format_dict['elapsed'], 1e-9):.0f}")

        try:
            await asyncio.gather(*(one(r) for r in pending))
        finally:
            bar.close()
            await client.close()
    return report


def _ends_torn(path: Path) -> bool:
    """Whether ``path`` is non-empty and its last line has no newline."""
    with path.open("rb") as handle:
        if handle.seek(0, 2) == 0:
            return False
        handle.seek(-1, 2)
        return handle.read(1) != b"\n"


def _reason(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())[:300]


def served_model_name(url: str, flag: str = "--url") -> str:
    """The first model the server lists; a clear error (naming ``flag``) when the server cannot
    be reached."""
    import openai

    try:
        return openai.OpenAI(base_url=f"{url.rstrip('/')}/v1", api_key="not-needed", timeout=30,
                             max_retries=2).models.list().data[0].id
    except (openai.APIError, IndexError) as error:
        raise ValueError(f"{flag} {url}: no OpenAI-compatible server answers /v1/models ({_reason(error)}); "
                         "start one (vllm-retrieval-spec serve MODEL) or fix the URL") from error


# --- The command ------------------------------------------------------------------------------


@dataclass
class FromServerPlan:
    """Where the transcripts and the stores go; ``states``: where the server started here saves
    the hidden states it captures (``--dense`` without ``--url``)."""

    out: Path
    transcripts: Path
    dense_out: Path | None = None
    states: Path | None = None

    @classmethod
    def of(cls, args: argparse.Namespace) -> FromServerPlan:
        transcripts = args.transcripts or args.out.with_name(f"{args.out.name}.transcripts.jsonl")
        if not args.dense:
            return cls(args.out, transcripts)
        dense_out = args.dense_out or args.out.with_name(f"{args.out.name}-dense")
        return cls(args.out, transcripts, dense_out,
                   None if args.url else dense_out.with_name(f"{dense_out.name}.states"))


# A server started here for the plan, learning at most so many positions: a context manager
# yielding its base URL (``evaluation.capture.answering_server``).
ServerStarter = Callable[[FromServerPlan, int], AbstractContextManager[str]]


def add_from_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``datastore from-server``."""
    parser.add_argument("--url", help="base URL of a running OpenAI-compatible server (default: start "
                        "vllm-retrieval-spec serve MODEL here; with --dense it captures the hidden states as it "
                        "answers instead of a second forward pass over the transcripts)")
    parser.add_argument("--prompts", required=True, type=Path,
                        help='JSONL: one {"messages": [...]} or {"prompt": "..."} per line')
    parser.add_argument("--out", required=True, type=Path, help="REST datastore directory to build")
    parser.add_argument("--model", required=True, help="model directory (tokenizer, chat template; "
                        "with --dense the model whose hidden states are the keys)")
    parser.add_argument("--dense", action="store_true", help="also build a dense (DReSD) store")
    parser.add_argument("--dense-out", type=Path, help="dense store directory (default: OUT-dense)")
    parser.add_argument("--dense-keys", default="python-code-dense",
                        help="without --url: the dense datastore (directory or recipe) whose transform makes the "
                        "captured keys (default python-code-dense)")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="without --url: the started server's longest prompt + answer (default 2048)")
    parser.add_argument("--transcripts", type=Path,
                        help="answers JSONL, appended as they arrive; a rerun resumes; a file holding anything else is "
                             "refused (default: OUT.transcripts.jsonl)")
    parser.add_argument("--model-name", help="served model name (default: the server's first)")
    parser.add_argument("--max-tokens", type=int, default=256, help="answer length (default 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--retries", type=int, default=3, help="tries after a connection error, 429 or 5xx")
    parser.add_argument("--replace", action="store_true", help="rebuild existing stores (our stores only)")


def run_from_server(args: argparse.Namespace, start_server: ServerStarter | None = None) -> None:
    """Collect the answers (from ``--url``, or a server ``start_server`` starts), then build the
    store(s) from the transcripts (the dense one from the captured states when there are any)."""
    from vllm_retrieval_spec.datastores.dense_format import DENSE_DATASTORE
    from vllm_retrieval_spec.datastores.format import DATASTORE
    from vllm_retrieval_spec.storage import MODEL_FILES, TOKENIZER_FILES, check_build_target, local_model_dir
    from vllm_retrieval_spec.validation import require_ints

    require_ints({"--concurrency": (args.concurrency, 1, None), "--max-tokens": (args.max_tokens, 1, None),
                  "--retries": (args.retries, 0, None), "--max-model-len": (args.max_model_len, 2, None)})
    if not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.url is None and start_server is None:
        raise ValueError("--url: give the base URL of a running OpenAI-compatible server")
    local_model_dir(args.model, "--model", MODEL_FILES if args.dense else TOKENIZER_FILES)
    plan = FromServerPlan.of(args)
    records = read_prompt_file(args.prompts)
    check_build_target(plan.out, args.replace, DATASTORE)  # before minutes of answers
    check_transcripts_file(plan.transcripts)
    if plan.dense_out is not None:
        check_build_target(plan.dense_out, args.replace, DENSE_DATASTORE)
    captured_before = _captured_positions(plan)
    start = time.perf_counter()
    report = _collect(args, plan, records, start_server)
    answer_seconds = time.perf_counter() - start
    print(f"{plan.transcripts}: {report.answered} answered now, {report.already} before, {report.failed} failed "
          f"of {report.total} prompts")
    if report.failed:
        raise ValueError(f"{report.failed} prompt(s) got no answer ({report.first_error}); rerun the same command "
                         "to ask only those")
    selection = TranscriptSelection.of(plan.transcripts, records)
    if selection.unreadable or selection.left_out:
        print(f"{plan.transcripts}: {selection.unreadable} unreadable line(s) skipped (torn by a killed run), "
              f"{selection.left_out} answer(s) of changed prompts or repeated left out of the store(s)")
    with tempfile.TemporaryDirectory(prefix=".from-server-", dir=plan.transcripts.parent) as tmp:
        current = Path(tmp) / f"{plan.transcripts.stem}.current.jsonl"  # ends .jsonl: read as records
        selection.write(plan.transcripts, current)
        build_stores(args, plan, current, answer_seconds, captured_before)


def _captured_positions(plan: FromServerPlan) -> int:
    """The positions captured by earlier runs of the plan (0 without capture)."""
    if plan.states is None:
        return 0
    from vllm_retrieval_spec.datastores.learned_snapshot import snapshot_positions

    return snapshot_positions(plan.states)


def _collect(args: argparse.Namespace, plan: FromServerPlan, records: Sequence[PromptRecord],
             start_server: ServerStarter | None) -> CollectReport:
    """Ask what is missing from the transcripts: of ``--url``, or of a server started for the
    run (none when nothing is missing)."""
    if args.url:
        server: AbstractContextManager[str] = nullcontext(args.url)
    elif {(r.index, r.key) for r in records} <= answered(plan.transcripts):
        return CollectReport(total=len(records), already=len(records))
    else:
        server = start_server(plan, len(records) * (args.max_tokens + CAPTURE_OVERSHOOT))
    with server as url:
        settings = AskSettings(args.model_name or served_model_name(url), args.max_tokens, args.temperature,
                               args.concurrency, args.retries)
        return asyncio.run(collect_transcripts(url, records, plan.transcripts, settings))


def build_stores(args: argparse.Namespace, plan: FromServerPlan, current: Path, answer_seconds: float,
                 captured_before: int = 0) -> None:
    """The REST store, and the dense one, from ``current``: the current prompts' transcripts
    (the dense one from the captured states when the server was started here, of which
    ``captured_before`` positions came from earlier runs)."""
    from vllm_retrieval_spec.datastores.builder import build_datastore
    from vllm_retrieval_spec.datastores.sources import InputSpec

    inputs = [InputSpec(current)]
    extra = {"from_server": {"url": args.url or "started here", "prompts": str(args.prompts),
                             "transcripts": str(plan.transcripts), "max_tokens": args.max_tokens,
                             "temperature": args.temperature}}
    print(build_datastore(args.model, inputs, plan.out, replace=args.replace, extra_build_info=extra).describe())
    if plan.states is not None:
        from vllm_retrieval_spec.datastores.learned_snapshot import build_from_snapshot

        manifest = build_from_snapshot(plan.states, plan.dense_out, replace=args.replace, extra_build_info=extra)
        now = manifest.num_positions - captured_before
        print(f"{plan.dense_out}: {manifest.num_positions:,} positions captured while answering ({now:,} in "
              f"this run, {now / max(answer_seconds, 1e-9):,.0f} a second), {manifest.bytes_per_position} bytes a "
              f"position, {manifest.index.describe()}")
    elif plan.dense_out is not None:
        from vllm_retrieval_spec.datastores.dense_builder import build_dense_datastore
        from vllm_retrieval_spec.datastores.dense_cli import describe_build

        report = build_dense_datastore(args.model, inputs, plan.dense_out, replace=args.replace,
                                       extra_build_info=extra)
        print(describe_build(report))
