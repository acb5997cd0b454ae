"""OpenAI-client helpers: streamed completions with token ids and decode-step counts."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_retrieval_spec.evaluation.metrics import GenerationRecord

if TYPE_CHECKING:
    from openai import AsyncOpenAI, OpenAI


@dataclass(frozen=True)
class ClientRun:
    """Records in prompt order, generated texts, and the wall time of the whole run."""

    records: list[GenerationRecord]
    texts: list[str]
    seconds: float


def openai_client(base_url: str) -> OpenAI:
    from openai import OpenAI

    return OpenAI(base_url=f"{base_url}/v1", api_key="not-needed", timeout=600, max_retries=0)


def async_openai_client(base_url: str, timeout_s: float = 600.0) -> AsyncOpenAI:
    """The asynchronous client for the same server (no retries: a failure is a measurement)."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{base_url}/v1", api_key="not-needed", timeout=timeout_s, max_retries=0)


def stream_completion(client: OpenAI, model: str, prompt: str, max_tokens: int) -> tuple[GenerationRecord, str]:
    """One greedy streamed completion; every chunk that carries tokens is one engine step."""
    prompt_ids: list[int] = []
    output_ids: list[int] = []
    text: list[str] = []
    steps = 0
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        extra_body={"return_token_ids": True},
    )
    for chunk in stream:
        for choice in chunk.choices:
            extra = choice.model_extra or {}
            prompt_ids = extra.get("prompt_token_ids") or prompt_ids
            new_ids = extra.get("token_ids") or []
            if new_ids:
                output_ids.extend(new_ids)
                steps += 1
            text.append(choice.text or "")
    return GenerationRecord(prompt_ids, output_ids, max(steps - 1, 0)), "".join(text)


def run_prompts(client: OpenAI, model: str, prompts: Sequence[str], max_tokens: int, concurrency: int = 1) -> ClientRun:
    """Send every prompt with ``concurrency`` requests in flight."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda p: stream_completion(client, model, p, max_tokens), prompts))
    seconds = time.perf_counter() - start
    return ClientRun([r for r, _ in results], [t for _, t in results], seconds)
