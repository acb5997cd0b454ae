"""Load test OpenAI-compatible servers: TTFT, TPOT and latency percentiles, output tokens/s,
requests/s and errors by kind, over a sweep of concurrencies (or Poisson request rates), and
with --compare-to how many greedy outputs differ from a reference server (token ids).

Targets are --url (any running server: ours, vLLM without speculation, vLLM ``suffix``) and
--serve (configs of ``acceptance.py``, started one at a time on the SmolLM2 checkpoint).

    python benchmarks/load_test.py --url http://127.0.0.1:8000 --concurrency 1 8 32 64 --num-requests 128
    python benchmarks/load_test.py --serve none rest_k8 --dataset humaneval --form chat --concurrency 1 8
        --compare-to none --tag chat   (one command line)
    python benchmarks/load_test.py --url URL --dataset synthetic --input-len 512 --output-len 128
        --request-rate 1 2 4 --concurrency 64   (one command line)
    python benchmarks/load_test.py --url URL --dataset prompts.jsonl   (records with "messages" or "prompt")
    python benchmarks/load_test.py --serve rest_k8 --dataset mixed --concurrency 64 --num-requests 1000
        --compare-to none   (greedy and sampled, per-request parameters; greedy outputs compared)

Writes benchmarks/results/load_<dataset>_n<requests>_t<max tokens>[_<tag>].json and a .png of
tokens/s and p99 TPOT against concurrency (or request rate), one line per server.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import platform
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from vllm_retrieval_spec.datastores.from_server import served_model_name
from vllm_retrieval_spec.evaluation.load import (
    LoadRequest,
    LoadSettings,
    MemoryWatch,
    RequestResult,
    count_differences,
    format_table,
    humaneval_requests,
    jsonl_requests,
    mixed_requests,
    run_load_sync,
    served_model,
    summarize_run,
    synthetic_requests,
)
from vllm_retrieval_spec.validation import require_ints

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", nargs="+", default=[], help="base URLs of running servers (http://host:port)")
    parser.add_argument("--serve", nargs="+", default=[], help="acceptance.py configs to start, one at a time")
    parser.add_argument("--label", nargs="+", default=[], help="names of the targets, --url ones first")
    parser.add_argument("--model", help="served model name (default: the first one of /v1/models)")
    parser.add_argument("--dataset", default="humaneval",
                        help="humaneval, synthetic, mixed (chat and completion, short and long, greedy and sampled "
                        "with per-request parameters; greedy ones compared), or a JSONL file")
    parser.add_argument("--form", choices=["raw", "chat"], default="raw", help="HumanEval prompts (default raw)")
    parser.add_argument("--tokenizer", help="render chat prompts / cut synthetic prompts to token ids with "
                        "it (without one chat prompts go to /v1/chat/completions as messages)")
    parser.add_argument("--input-len", type=int, default=256, help="synthetic: prompt words (≈ tokens)")
    parser.add_argument("--output-len", type=int, default=128, help="synthetic: new tokens (ignore_eos)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1], help="requests in flight; a sweep")
    parser.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                        help="Poisson arrivals per second (default inf: all at once); a sweep")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                        help="stream responses (TTFT and TPOT need it)")
    parser.add_argument("--token-ids", action=argparse.BooleanOptionalAction, default=True,
                        help="ask for token ids (vLLM's return_token_ids); --no-token-ids compares text")
    parser.add_argument("--compare-to", help="reference server (URL or --serve config) for greedy outputs")
    parser.add_argument("--watch-memory", type=int, default=0, metavar="N",
                        help="sample the engine processes' RSS every N finished requests (0: off)")
    parser.add_argument("--warmup", type=int, default=1, help="requests sent to each server before measuring")
    parser.add_argument("--seed", type=int, default=0, help="of synthetic prompts and arrival times")
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument("--out", type=Path, help="result JSON path (default: under benchmarks/results/)")
    args = parser.parse_args(argv)
    try:
        check_values(args)
    except ValueError as error:
        parser.error(str(error))
    if not args.url and not args.serve:
        parser.error("give at least one --url or --serve")
    if args.compare_to and args.temperature != 0 and args.dataset != "mixed":
        parser.error("--compare-to needs greedy requests (--temperature 0, or --dataset mixed)")
    if args.label and len(args.label) != len(args.url) + len(args.serve):
        parser.error("give one --label per target (--url ones first, then --serve ones)")
    return args


def check_values(args: argparse.Namespace) -> None:
    """Counts, lengths and rates in their ranges (ValueError naming the flag)."""
    require_ints({"--num-requests": (args.num_requests, 1, None), "--max-tokens": (args.max_tokens, 1, None),
                  "--input-len": (args.input_len, 1, None), "--output-len": (args.output_len, 1, None),
                  "--warmup": (args.warmup, 0, None), "--watch-memory": (args.watch_memory, 0, None),
                  **{f"--concurrency[{i}]": (c, 1, None) for i, c in enumerate(args.concurrency)}})
    for rate in args.request_rate:
        if not rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {rate:g}")
    if not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature:g}")


def check_targets(args: argparse.Namespace) -> None:
    """Stop with one line, before any request is sent or server started, on a --serve or
    --compare-to config that ``acceptance.py`` does not have or a --url where no server answers."""
    from acceptance import CONFIGS  # benchmarks/ is this script's directory

    configs = [*args.serve, *([args.compare_to] if args.compare_to and "://" not in args.compare_to else [])]
    for config in configs:
        if config not in CONFIGS:
            raise SystemExit(f"load_test.py: error: unknown config {config!r}; choose from {', '.join(CONFIGS)}")
    urls = [("--url", url) for url in args.url]
    if args.compare_to and "://" in args.compare_to:
        urls.append(("--compare-to", args.compare_to))
    for flag, url in urls:
        try:
            served_model_name(url, flag)
        except ValueError as error:
            raise SystemExit(f"load_test.py: error: {error}") from None


def dataset_name(args: argparse.Namespace) -> str:
    if args.dataset == "humaneval":
        return f"humaneval_{args.form}"
    if args.dataset == "synthetic":
        return f"synthetic_i{args.input_len}_o{args.output_len}"
    return "mixed" if args.dataset == "mixed" else Path(args.dataset).stem


def build_requests(args: argparse.Namespace) -> list[LoadRequest]:
    tokenizer = None
    if args.tokenizer and (args.dataset == "synthetic" or args.form == "chat"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    if args.dataset == "humaneval":
        return humaneval_requests(args.num_requests, args.form, args.max_tokens, tokenizer)
    if args.dataset == "synthetic":
        return synthetic_requests(args.num_requests, args.input_len, args.output_len, args.seed, tokenizer)
    if args.dataset == "mixed":
        return mixed_requests(args.num_requests, args.max_tokens, args.seed)
    return jsonl_requests(args.dataset, args.num_requests, args.max_tokens)


@contextlib.contextmanager
def open_target(target: str, max_num_seqs: int) -> Iterator[str]:
    """A server's base URL: the URL itself, or a server started from an ``acceptance.py`` config."""
    if "://" in target:
        yield target.rstrip("/")
        return
    from acceptance import CONFIGS  # benchmarks/ is this script's directory

    from vllm_retrieval_spec.evaluation.server import VllmServer
    from vllm_retrieval_spec.models import ensure_smollm2_checkpoint

    config = CONFIGS[target]  # a known one (check_targets)
    with VllmServer(ensure_smollm2_checkpoint(), speculative_config=config.get("speculative_config"),
                    additional_config=config.get("additional_config"),
                    extra_args=["--max-num-seqs", str(max_num_seqs)]) as server:
        yield server.base_url


def target_label(target: str) -> str:
    """``host:port`` of a URL, or the config's name."""
    return (urlparse(target).netloc or target) if "://" in target else target


def settings_for(args: argparse.Namespace, model: str, concurrency: int, rate: float = math.inf) -> LoadSettings:
    return LoadSettings(model=model, concurrency=concurrency, request_rate=rate, stream=args.stream,
                        temperature=args.temperature, token_ids=args.token_ids, seed=args.seed)


def reference_results(args: argparse.Namespace, requests: list[LoadRequest]) -> list[RequestResult]:
    """The reference server's outputs of the greedy requests, at the sweep's highest concurrency.
    Greedy outputs depend only on the request, so a request a cycled dataset repeats is sent once."""
    concurrency = max(args.concurrency)
    distinct: dict[str, int] = {}
    first_of = [distinct.setdefault(json.dumps(dataclasses.asdict(r), sort_keys=True), i)
                for i, r in enumerate(requests)]
    sent = sorted({first for first, request in zip(first_of, requests) if request.is_greedy(args.temperature)})
    with open_target(args.compare_to, concurrency) as url:
        settings = settings_for(args, args.model or served_model(url), concurrency)
        results = run_load_sync(url, [requests[i] for i in sent], settings, label="reference").results
    by_request = {sent[result.index]: result for result in results}  # index: position in what was sent
    return [dataclasses.replace(by_request[first], index=i) for i, first in enumerate(first_of) if first in by_request]


def benchmark_server(label: str, url: str, requests: list[LoadRequest], args: argparse.Namespace,
                     reference: list[RequestResult] | None) -> list[dict[str, Any]]:
    """Warm up, then one run per (concurrency, request rate); a summary row per run."""
    model = args.model or served_model(url)
    if args.warmup:
        run_load_sync(url, requests[: args.warmup], settings_for(args, model, 1), progress=False)
    rows = []
    for concurrency, rate in itertools.product(args.concurrency, args.request_rate):
        watch = MemoryWatch(args.watch_memory) if args.watch_memory else None
        run = run_load_sync(url, requests, settings_for(args, model, concurrency, rate),
                            label=f"{label} c={concurrency}" + ("" if math.isinf(rate) else f" r={rate:g}"),
                            on_finished=watch)
        row = {"server": label, "url": url, **summarize_run(run)}
        if watch is not None:
            row["engine_rss"] = memory = watch.report()
            print(f"{label} c={concurrency}: engine RSS (requests, MiB) {memory['rss_mib']}, of which "
                  f"anonymous {memory['anon_mib']}; growth from request {memory['after']}: {memory['growth']} "
                  f"(anonymous {memory['anon_growth']})")
        if reference is not None:
            row["compare"] = count_differences(run.results, reference,
                                               [request.is_greedy(args.temperature) for request in requests])
        rows.append(row)
    return rows


def report_path(args: argparse.Namespace) -> Path:
    tag = f"_{args.tag}" if args.tag else ""
    return args.out or RESULTS / f"load_{dataset_name(args)}_n{args.num_requests}_t{args.max_tokens}{tag}.json"


def plot(rows: list[dict[str, Any]], path: Path, x_key: str) -> None:
    """Output tokens/s and p99 TPOT against ``x_key``, one line per server (and other setting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    other = "request_rate" if x_key == "concurrency" else "concurrency"
    several = len({r[other] for r in rows}) > 1
    lines: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for row in rows:
        lines.setdefault((row["server"], row[other]), []).append(row)
    figure, (tokens, tpot) = plt.subplots(1, 2, figsize=(11, 4))
    for (server, fixed), line in lines.items():
        name = f"{server} ({other.replace('_', ' ')} {fixed})" if several else server
        xs = [r[x_key] for r in line]
        tokens.plot(xs, [r["output_tokens_per_second"] for r in line], marker="o", label=name)
        p99 = [None if r["tpot_s"]["p99"] is None else r["tpot_s"]["p99"] * 1000 for r in line]
        tpot.plot(xs, p99, marker="o", label=name)
    ticks = sorted({r[x_key] for r in rows if r[x_key] is not None})
    for axes, title in ((tokens, "output tokens/s"), (tpot, "p99 TPOT (ms)")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(ticks, [f"{t:g}" for t in ticks])
        axes.set_xlabel(x_key.replace("_", " "))
        axes.set_title(title)
        axes.grid(alpha=0.3)
    tokens.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# What a started server inherits that changes its memory or speed (recorded when set).
RECORDED_ENVIRONMENT = ("VLLM_CPU_KVCACHE_SPACE", "MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "OMP_NUM_THREADS",
                        "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def write_report(path: Path, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    arguments = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    arguments["request_rate"] = [None if math.isinf(r) else r for r in args.request_rate]
    report = {"dataset": dataset_name(args), "requests": args.num_requests, "max_tokens": args.max_tokens,
              "arguments": arguments, "machine": platform.machine(), "processor_count": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "results": rows,
              "environment": {key: os.environ[key] for key in RECORDED_ENVIRONMENT if key in os.environ}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        requests = build_requests(args)
    except (OSError, ValueError) as error:
        raise SystemExit(f"load_test.py: error: --dataset {args.dataset}: {error}") from None
    check_targets(args)
    reference = reference_results(args, requests) if args.compare_to else None
    targets = [*args.url, *args.serve]
    labels = args.label or [target_label(t) for t in targets]
    path, rows = report_path(args), []
    for label, target in zip(labels, targets):
        with open_target(target, max(args.concurrency)) as url:
            rows += benchmark_server(label, url, requests, args, reference)
        write_report(path, args, rows)  # after each server: a long sweep that stops keeps what it measured
    print(format_table(rows))
    plot(rows, path.with_suffix(".png"), "request_rate" if len(args.request_rate) > 1 else "concurrency")
    print(f"written: {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
