"""The target's greedy HumanEval outputs, generated once in-process and cached (for replay)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from vllm_retrieval_spec.evaluation.prompts import PromptForm, humaneval_prompts
from vllm_retrieval_spec.evaluation.replay import GreedyTrace, load_traces, save_traces
from vllm_retrieval_spec.paths import cache_root


def traces_path(form: PromptForm, prompts: int, max_tokens: int) -> Path:
    """Where the traces of ``prompts`` HumanEval prompts in ``form`` are cached."""
    return cache_root() / "traces" / f"humaneval_{form}_n{prompts}_t{max_tokens}.json"


def greedy_traces(model: Path, form: PromptForm, prompts: int, max_tokens: int) -> list[GreedyTrace]:
    """Greedy traces of the first ``prompts`` HumanEval prompts, from the cache when present.

    Generating them builds an in-process vLLM engine, so call
    :func:`vllm_retrieval_spec.compat.configure_vllm_environment` first.
    """

    def texts() -> list[str]:
        from transformers import AutoTokenizer

        return humaneval_prompts(prompts, form, AutoTokenizer.from_pretrained(model) if form == "chat" else None)

    return cached_traces(model, traces_path(form, prompts, max_tokens), max_tokens, texts,
                         f"HumanEval ({form}, {prompts} prompts)")


def cached_traces(model: Path, path: Path, max_tokens: int, texts: Callable[[], Sequence[str]],
                  what: str) -> list[GreedyTrace]:
    """The target's greedy outputs of ``texts()``: read from ``path`` when it exists, else
    generated once (an in-process vLLM engine, 16 at a time, saying so and naming ``what``) and
    saved there."""
    if path.is_file():
        return load_traces(path)
    from vllm_retrieval_spec.evaluation.engine import EngineSpec, build_llm, generate, shutdown_llm

    print(f"generating greedy outputs of {what} once; cached at {path}", flush=True)
    llm = build_llm(EngineSpec(model, max_num_seqs=16))
    try:
        run = generate(llm, texts(), max_tokens, concurrency=16)
    finally:
        shutdown_llm(llm)
    traces = [GreedyTrace(r.prompt_ids, r.output_ids) for r in run.records]
    save_traces(traces, path)
    return traces
