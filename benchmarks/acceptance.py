"""Acceptance and speed of speculative configs on the real model (in-process vLLM, fp32, greedy).

For every config, over the same HumanEval prompts in the same run: vLLM's mean acceptance
length (1 + accepted / drafts), the honest figure ((generated - requests) / decode steps,
counting steps without drafts), the acceptance rate, draft tokens per request-step, output
tokens/s, the speed-up against no speculation (run first and again last; the mean of both, so
that the machine's drift shows) and against vLLM ``suffix``, how many prompts' token ids differ
from no speculation (must be 0) and, for ``budget: auto``, the budget's counters, calibration
buckets and learned step-cost curve (plot them with ``plot_budget.py``).

    python benchmarks/acceptance.py --prompts 40 --max-tokens 128 --form raw
    python benchmarks/acceptance.py --configs none prompt_lookup_k8 ngram_k8 --form both
    python benchmarks/acceptance.py --prompts 164 --max-tokens 64 --concurrency 8 --form both --tag budget
        --configs none suffix rest_k8 rest_k8_fixed rest_tree_k16 prompt_lookup_k8 ngrammys_k8 ngrammys_tree_k16
        (one command line)

Writes benchmarks/results/acceptance_<form>_n<prompts>_t<tokens>_c<concurrency>[_<tag>].json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

from vllm_retrieval_spec.compat import configure_vllm_environment

configure_vllm_environment(in_process=True)

from vllm_retrieval_spec.evaluation.engine import (  # noqa: E402
    EngineSpec,
    build_llm,
    drafter_of,
    generate,
    shutdown_llm,
)
from vllm_retrieval_spec.evaluation.metrics import summarize  # noqa: E402
from vllm_retrieval_spec.evaluation.prompts import humaneval_prompts  # noqa: E402
from vllm_retrieval_spec.models import ensure_smollm2_checkpoint  # noqa: E402
from vllm_retrieval_spec.paths import cache_root  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
INDIST_STORE = cache_root() / "datastores" / "stdlib-answers"
INDIST_DENSE_STORE = cache_root() / "dense-datastores" / "stdlib-answers-dense"


def _ours(proposer: str, k: int, **options) -> dict:
    return {
        "speculative_config": {"model": f"vllm_retrieval_spec.{proposer}", "num_speculative_tokens": k},
        "additional_config": {"retrieval_spec": options} if options else None,
    }


def _ngram(k: int) -> dict:
    return {"speculative_config": {"method": "ngram", "num_speculative_tokens": k,
                                   "prompt_lookup_min": 1, "prompt_lookup_max": 4}}


CONFIGS: dict[str, dict] = {
    "none": {},
    "none_again": {},  # no speculation once more, last: how much the machine drifted during the run
    # Our proposers run with budget "auto" (the default); *_fixed always drafts up to K.
    "prompt_lookup_k8": _ours("PromptLookupProposer", 8),
    "prompt_lookup_k8_fixed": _ours("PromptLookupProposer", 8, budget="fixed"),
    "rest_k8": _ours("RestProposer", 8),
    "rest_k8_fixed": _ours("RestProposer", 8, budget="fixed"),
    "rest_tree_k16": _ours("RestProposer", 16, tree=True),
    "rest_tree_k16_fixed": _ours("RestProposer", 16, tree=True, budget="fixed"),
    "ngrammys_tree_k16": _ours("NGrammysProposer", 16, tree=True),
    "rest_datastore_k8": _ours("RestProposer", 8, use_context=False),
    "rest_context_k8": _ours("RestProposer", 8, use_datastore=False),
    "ngrammys_k8": _ours("NGrammysProposer", 8),
    # Tree verification: the node budget is num_speculative_tokens.
    **{f"rest_tree_k{k}": _ours("RestProposer", k, tree=True) for k in (8, 16, 32, 64)},
    **{f"ngrammys_tree_k{k}": _ours("NGrammysProposer", k, tree=True) for k in (8, 16, 32, 64)},
    # Chains at the tree node budgets (tokens/s of tree vs chain at the same budget).
    **{f"rest_k{k}": _ours("RestProposer", k) for k in (16, 32, 64)},
    # DReSD: dense neighbours merged with the context (default) or alone (use_context false).
    "dresd_k8": _ours("DReSDProposer", 8),
    "dresd_alone_k8": _ours("DReSDProposer", 8, use_context=False),
    "dresd_tree_k16": _ours("DReSDProposer", 16, tree=True),
    # REST datastore-only on DReSD's default corpus (datastore build --recipe python-code-dense).
    "rest_datastore_same_k8": _ours("RestProposer", 8, use_context=False, datastore="python-code-dense"),
    # In-distribution stores: the model's own answers to standard-library prompts, built by the
    # README's `datastore from-server` command into the cache (INDIST_STORE, INDIST_DENSE_STORE).
    "rest_indist_k8": _ours("RestProposer", 8, datastore=str(INDIST_STORE)),
    "rest_datastore_indist_k8": _ours("RestProposer", 8, use_context=False, datastore=str(INDIST_STORE)),
    "dresd_indist_k8": _ours("DReSDProposer", 8, dense_datastore=str(INDIST_DENSE_STORE)),
    "dresd_alone_indist_k8": _ours("DReSDProposer", 8, use_context=False, dense_datastore=str(INDIST_DENSE_STORE)),
    "ngram_k4": _ngram(4),
    "ngram_k8": _ngram(8),
    "suffix": {"speculative_config": {"method": "suffix"}, "requires": "arctic_inference"},
}
DEFAULT_CONFIGS = ["none", "rest_k8", "rest_datastore_k8", "rest_context_k8", "ngram_k4", "ngram_k8", "suffix"]


def with_options(config: dict, options: dict) -> dict:
    """``config`` with ``options`` added to its ``retrieval_spec`` section (our proposers only)."""
    speculative = config.get("speculative_config") or {}
    if not options or not str(speculative.get("model", "")).startswith("vllm_retrieval_spec."):
        return config
    section = (config.get("additional_config") or {}).get("retrieval_spec", {})
    return {**config, "additional_config": {"retrieval_spec": {**section, **options}}}


def parse_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE read as JSON where it parses (numbers, booleans), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option {text!r}: write KEY=VALUE, e.g. datastore=/path/to/store")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def run_config(model: Path, name: str, prompts: list[str], max_tokens: int, concurrency: int,
               options: dict | None = None) -> dict:
    config = with_options(CONFIGS[name], options or {})
    spec = EngineSpec(model, config.get("speculative_config"), config.get("additional_config"),
                      max_num_seqs=max(concurrency, 1))
    llm = build_llm(spec)
    try:
        generate(llm, prompts[:1], 8)  # warm-up
        run = generate(llm, prompts, max_tokens, concurrency=concurrency)
        budget = budget_report(llm, concurrency)
    finally:
        shutdown_llm(llm)
    summary = summarize(run.records, run.counters)
    return {
        "config": name,
        "speculative_config": config.get("speculative_config"),
        "additional_config": config.get("additional_config"),
        **summary.as_dict(),
        "seconds": run.seconds,
        "tokens_per_second": summary.generated_tokens / run.seconds,
        "draft_tokens_per_request_step": summary.draft_tokens / max(summary.decode_steps, 1),
        "budget": budget,
        "output_ids": [r.output_ids for r in run.records],
    }


def budget_report(llm, concurrency: int) -> dict | None:
    """The goodput budget's counters, calibration buckets and learned cost curve (budget auto)."""
    drafter = drafter_of(llm)
    budget = getattr(getattr(drafter, "session", None), "budget", None)
    if budget is None:
        return None
    return {
        "stats": vars(budget.stats),
        "cost_coefficients_seconds": budget.cost.coefficients.tolist(),
        "cost_curve": budget.cost.curve(concurrency),
        "calibration": budget.calibration.report(),
    }


def benchmark_form(model: Path, form: str, names: list[str], args: argparse.Namespace) -> dict:
    """Every config on the same prompts; the report is written after each config (a long run
    that stops keeps what it measured)."""
    tokenizer = None
    if form == "chat":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = humaneval_prompts(args.prompts, form, tokenizer)
    results, outputs = [], []
    report = {"form": form, "prompts": len(prompts), "max_tokens": args.max_tokens,
              "concurrency": args.concurrency, "model": "SmolLM2-135M-Instruct (float32)",
              "machine": platform.machine(), "processor_count": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "results": results}
    for name in names:
        print(f"[{form}] {name} ...", flush=True)
        result = run_config(model, name, prompts, args.max_tokens, args.concurrency, dict(args.option))
        outputs.append(result.pop("output_ids"))
        results.append(result)
        compare(results, outputs)
        report_path(form, report, args).write_text(json.dumps(report, indent=2) + "\n")
    return report


def compare(results: list[dict], outputs: list[list[list[int]]]) -> None:
    """Ratios to no speculation (the mean of its runs, first and, with --repeat-baseline, last)
    and to vLLM suffix, and differing prompts."""
    suffix = next((r for r in results if r["config"] == "suffix"), None)
    baseline = [r["tokens_per_second"] for r in results if r["config"] in ("none", "none_again")]
    for result, output in zip(results, outputs):
        result["speedup_vs_none"] = result["tokens_per_second"] / (sum(baseline) / len(baseline))
        result["speedup_vs_suffix"] = result["tokens_per_second"] / suffix["tokens_per_second"] if suffix else None
        result["prompts_differing_from_none"] = sum(a != b for a, b in zip(outputs[0], output))


def report_path(form: str, report: dict, args: argparse.Namespace) -> Path:
    tag = f"_{args.tag}" if args.tag else ""
    return RESULTS / f"acceptance_{form}_n{report['prompts']}_t{args.max_tokens}_c{args.concurrency}{tag}.json"


def print_table(report: dict) -> None:
    header = (f"{'config':22s} {'honest':>7s} {'vLLM MAL':>9s} {'accept':>7s} {'drafts':>7s} {'tok/s':>7s} "
              f"{'vs none':>8s} {'vs suffix':>9s} {'differ':>7s}")
    print(f"\n{report['form']} prompts: {report['prompts']}, max tokens {report['max_tokens']}, "
          f"concurrency {report['concurrency']}")
    print(header)
    for r in report["results"]:
        mal = f"{r['vllm_mean_acceptance_length']:.2f}" if r["vllm_mean_acceptance_length"] else "-"
        rate = f"{r['acceptance_rate']:.1%}" if r["acceptance_rate"] is not None else "-"
        vs_suffix = f"{r['speedup_vs_suffix']:.2f}x" if r["speedup_vs_suffix"] else "-"
        print(f"{r['config']:22s} {r['honest_tokens_per_step']:7.2f} {mal:>9s} {rate:>7s} "
              f"{r['draft_tokens_per_request_step']:7.2f} {r['tokens_per_second']:7.1f} "
              f"{r['speedup_vs_none']:7.2f}x {vs_suffix:>9s} {r['prompts_differing_from_none']:7d}")


def resolve_configs(requested: list[str], repeat_baseline: bool) -> list[str]:
    names = ["none"] + [n for n in requested if n not in ("none", "none_again")]
    names += ["none_again"] if repeat_baseline else []
    available = []
    for name in names:
        if name not in CONFIGS:
            sys.exit(f"unknown config {name!r}; choose from {', '.join(CONFIGS)}")
        needed = CONFIGS[name].get("requires")
        if needed and importlib.util.find_spec(needed) is None:
            print(f"skipping {name}: it needs `{needed}` (see README, 'Benchmarks')", file=sys.stderr)
            continue
        available.append(name)
    return available


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=40, help="first N HumanEval prompts (164 = all)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight (1 = batch 1)")
    parser.add_argument("--form", choices=["raw", "chat", "both"], default="raw")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help=f"from {', '.join(CONFIGS)}")
    parser.add_argument("--option", type=parse_option, action="append", default=[], metavar="KEY=VALUE",
                        help="retrieval_spec option for every config of ours (repeatable), e.g. "
                             "datastore=DIR dense_datastore=DIR for in-distribution stores")
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument("--repeat-baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="run no speculation again at the end; speed-ups are against the mean of both runs")
    args = parser.parse_args()

    model = ensure_smollm2_checkpoint()
    names = resolve_configs(args.configs, args.repeat_baseline)
    RESULTS.mkdir(parents=True, exist_ok=True)
    for form in (["raw", "chat"] if args.form == "both" else [args.form]):
        report = benchmark_form(model, form, names, args)
        print_table(report)
        print(f"written: {report_path(form, report, args)}")

if __name__ == "__main__":
    main()
