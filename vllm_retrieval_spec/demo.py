"""The README's main job: serve the real model through vLLM's OpenAI server without and
with one of our proposers (by default REST on the embedded Python-code datastore, built once
into the cache), send HumanEval requests through the OpenAI client, and show answers,
acceptance figures, speed and that the outputs are identical."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_retrieval_spec.datastores.resolve import ensure_recipe_store
from vllm_retrieval_spec.evaluation.client import ClientRun, openai_client, run_prompts
from vllm_retrieval_spec.evaluation.metrics import AcceptanceSummary, summarize
from vllm_retrieval_spec.evaluation.prompts import humaneval_prompts
from vllm_retrieval_spec.evaluation.server import VllmServer
from vllm_retrieval_spec.models import ensure_smollm2_checkpoint


@dataclass
class DemoResult:
    """One server configuration's answers and acceptance figures."""

    label: str
    run: ClientRun
    summary: AcceptanceSummary

    @property
    def tokens_per_second(self) -> float:
        return self.summary.generated_tokens / self.run.seconds


def _serve_and_ask(label: str, server: VllmServer, prompts: list[str], max_tokens: int) -> DemoResult:
    print(f"\n== starting vLLM ({label}) ...", flush=True)
    with server:
        client = openai_client(server.base_url)
        run_prompts(client, server.served_model_name, prompts[:1], 8)  # warm-up
        before = server.spec_decode_counters()
        run = run_prompts(client, server.served_model_name, prompts, max_tokens, concurrency=1)
        counters = server.spec_decode_counters() - before
    return DemoResult(label, run, summarize(run.records, counters))


def run_demo(prompts: int, max_tokens: int, proposer: str, num_speculative_tokens: int, show: int,
             datastore: str, check_serve_arguments: Callable[[Sequence[str]], object]) -> None:
    """Serve without and with ``proposer``, answer ``prompts`` HumanEval prompts through the
    OpenAI client and print answers, acceptance, speed-up and whether the outputs are identical.
    The speculative server's ``serve`` arguments go through ``check_serve_arguments`` before any
    server starts, so that a store or option it would refuse is refused at once."""
    from transformers import AutoTokenizer

    model = ensure_smollm2_checkpoint()
    print(f"model: SmolLM2-135M-Instruct (float32) at {model}")
    texts = humaneval_prompts(prompts, "chat", AutoTokenizer.from_pretrained(model))
    speculative_config = {
        "model": f"vllm_retrieval_spec.{proposer}",
        "num_speculative_tokens": num_speculative_tokens,
    }
    additional_config = None
    if proposer == "RestProposer":
        store = ensure_recipe_store(datastore, model) if "/" not in datastore else datastore
        additional_config = {"retrieval_spec": {"datastore": str(store)}}
        print(f"datastore: {store}")
    our_server = VllmServer(model, speculative_config=speculative_config, additional_config=additional_config)
    check_serve_arguments(our_server.serve_args)
    baseline = _serve_and_ask("no speculation", VllmServer(model), texts, max_tokens)
    ours = _serve_and_ask(proposer, our_server, texts, max_tokens)

    for index in range(min(show, len(texts))):
        print(f"\n--- answer {index + 1} ({proposer}) ---\n{ours.run.texts[index].strip()}")
    print(f"\nspeculative config: {json.dumps(speculative_config)}")
    if additional_config:
        print(f"additional config: {json.dumps(additional_config)}")
    print(f"{len(texts)} HumanEval prompts (chat-wrapped), {max_tokens} new tokens, greedy, batch 1")
    _print_comparison(baseline, ours)


def _print_comparison(baseline: DemoResult, ours: DemoResult) -> None:
    """The figures of both runs, and a failure unless their token ids are identical."""
    print(f"{'config':24s} {'tok/s':>7s} {'honest tok/step':>16s} {'vLLM MAL':>9s} {'accept':>7s} {'speed-up':>9s}")
    for result in (baseline, ours):
        s = result.summary
        mal = f"{s.vllm_mean_acceptance_length:.2f}" if s.vllm_mean_acceptance_length else "-"
        rate = f"{s.acceptance_rate:.1%}" if s.acceptance_rate is not None else "-"
        speedup = result.tokens_per_second / baseline.tokens_per_second
        print(f"{result.label:24s} {result.tokens_per_second:7.1f} {s.honest_tokens_per_step:16.2f} "
              f"{mal:>9s} {rate:>7s} {speedup:8.2f}x")
    identical = sum(a.output_ids == b.output_ids for a, b in zip(baseline.run.records, ours.run.records))
    total = len(baseline.run.records)
    print(f"identical token ids with and without speculation: {identical}/{total}")
    if identical != total:
        raise SystemExit("speculation changed the output: this is a bug")
