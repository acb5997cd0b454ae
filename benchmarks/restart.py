"""A restarted server with a saved output index against the warm server it replaced (issue 22,
item 4: within 5% of the warm server's tokens/s on its first requests).

Servers run one at a time (SmolLM2-135M-Instruct fp32, greedy, token ids compared):

    none        no speculation: the measured requests (first)
    warm        REST: the learning requests, then the measured ones
    (learner)   REST with ``output_index_path`` in a fresh directory: the learning requests;
                stopping it saves the index (what the warm server knew before it measured)
    restarted   REST started again on that directory: its first requests are the measured ones
    cold        REST without a snapshot: the measured ones (what the snapshot is worth)
    none_again  no speculation once more (how much the machine drifted during the run)

The learning requests are the dataset's first ``--learn``; the measured ones start halfway through
them (traffic that partly recurs: half seen before, half new).

    python benchmarks/restart.py --dataset benchmarks/data/humaneval_chat.jsonl --learn 100 --measure 100 \\
        --concurrency 8   (one command line)

Writes benchmarks/results/restart_<dataset>_n<measure>_c<concurrency>[_no_prefix_caching][_<tag>].json and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from acceptance import CONFIGS  # benchmarks/ is this script's directory

from vllm_retrieval_spec.datastores.output_snapshot import engine_snapshot_path, snapshot_dirs
from vllm_retrieval_spec.evaluation.load import (
    LoadRequest,
    LoadSettings,
    RequestResult,
    count_differences,
    jsonl_requests,
    run_load_sync,
)
from vllm_retrieval_spec.evaluation.server import VllmServer
from vllm_retrieval_spec.models import ensure_smollm2_checkpoint

RESULTS = Path(__file__).resolve().parent / "results"
ROUNDING = 3


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, default=Path("benchmarks/data/humaneval_chat.jsonl"),
                        help="JSONL of records with chat 'messages' or a 'prompt'")
    parser.add_argument("--config", default="rest_k32", choices=[n for n in CONFIGS if n.startswith("rest")],
                        help="the REST config of acceptance.py (default rest_k32: the README's)")
    parser.add_argument("--learn", type=int, default=100, help="requests the warm server serves first")
    parser.add_argument("--measure", type=int, default=100, help="requests measured on every server")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="vLLM's prefix caching on every server (the warm server's cache of recurring "
                        "prompts is not ours to keep: --no-prefix-caching shows what the snapshot restores)")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    if args.learn < 2 or args.measure < 1:
        parser.error("--learn needs at least 2 requests and --measure at least 1")
    return args


def split_requests(args: argparse.Namespace) -> tuple[list[LoadRequest], list[LoadRequest]]:
    """(learning, measured) requests; the measured ones start halfway through the learning ones."""
    start = args.learn // 2
    requests = jsonl_requests(args.dataset, max(args.learn, start + args.measure), args.max_tokens)
    return requests[: args.learn], requests[start: start + args.measure]


def server(config: str, prefix_caching: bool, output_index_path: Path | None = None,
           log_name: str = "") -> VllmServer:
    """A server of acceptance.py's ``config``, its output index saved to / loaded from
    ``output_index_path`` when given."""
    spec = CONFIGS[config]
    additional = dict(spec.get("additional_config") or {})
    if output_index_path is not None:
        options = dict(additional.get("retrieval_spec", {}), output_index_path=str(output_index_path))
        additional["retrieval_spec"] = options
    return VllmServer(ensure_smollm2_checkpoint(), speculative_config=spec.get("speculative_config"),
                      additional_config=additional or None,
                      extra_args=["--max-num-seqs", "64", *([] if prefix_caching else ["--no-enable-prefix-caching"])],
                      log_path=f"/tmp/vrs-restart-{log_name or config}.log")


def measured_row(label: str, running: VllmServer, requests: list[LoadRequest],
                 concurrency: int) -> tuple[dict[str, Any], list[RequestResult]]:
    """Serve ``requests`` on ``running``: output tokens/s and vLLM's acceptance counters of them."""
    before = running.spec_decode_counters()
    settings = LoadSettings(running.served_model_name, concurrency, stream=False)
    run = run_load_sync(running.base_url, requests, settings, label=label)
    counters = running.spec_decode_counters() - before
    errors = sum(not r.ok for r in run.results)
    output = sum(r.output_tokens for r in run.results if r.ok)
    row = {"server": label, "requests": len(requests), "errors": errors, "seconds": run.seconds,
           "output_tokens": output, "tokens_per_second": output / run.seconds,
           "mean_acceptance_length": counters.mean_acceptance_length, "acceptance_rate": counters.acceptance_rate}
    return row, run.results


def run_servers(args: argparse.Namespace, snapshot_dir: Path) -> list[dict[str, Any]]:
    learning, measured = split_requests(args)
    rows, outputs = [], []

    def measure(label: str, running: VllmServer) -> None:
        row, results = measured_row(label, running, measured, args.concurrency)
        rows.append(row)
        outputs.append(results)

    def learn(running: VllmServer, label: str) -> None:
        settings = LoadSettings(running.served_model_name, args.concurrency, stream=False)
        run_load_sync(running.base_url, learning, settings, label=f"{label}: learning")

    with server("none", args.prefix_caching) as running:
        measure("none", running)
    with server(args.config, args.prefix_caching, None, "warm") as running:
        learn(running, "warm")
        measure("warm", running)
    with server(args.config, args.prefix_caching, snapshot_dir, "learner") as running:
        learn(running, "learner")
    if not snapshot_dirs(engine_snapshot_path(snapshot_dir, 0)):
        raise SystemExit(f"the learning server saved no output index under {snapshot_dir}")
    with server(args.config, args.prefix_caching, snapshot_dir, "restarted") as running:
        measure("restarted", running)
    with server(args.config, args.prefix_caching, None, "cold") as running:
        measure("cold", running)
    with server("none", args.prefix_caching, None, "none_again") as running:
        measure("none_again", running)
    for row, results in zip(rows, outputs):
        row["differing"] = count_differences(results, outputs[0])["differing"]
    return with_ratios(rows)


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's tokens/s against no speculation (mean of first and last) and the warm server."""
    speed = {row["server"]: row["tokens_per_second"] for row in rows}
    baseline = (speed["none"] + speed["none_again"]) / 2
    return [{**row, "x_none": row["tokens_per_second"] / baseline, "x_warm": row["tokens_per_second"] / speed["warm"]}
            for row in rows]


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = ["| server | tok/s | × none | × warm | vLLM MAL | accept | errors | differ |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        mal = f"{row['mean_acceptance_length']:.2f}" if row["mean_acceptance_length"] else "–"
        accept = f"{row['acceptance_rate']:.1%}" if row["acceptance_rate"] else "–"
        lines.append(f"| {row['server']} | {row['tokens_per_second']:.1f} | {row['x_none']:.2f} | "
                     f"{row['x_warm']:.2f} | {mal} | {accept} | {row['errors']} | {row['differing']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="vrs-restart-") as snapshot_dir:
        rows = run_servers(args, Path(snapshot_dir))
    caching = "" if args.prefix_caching else "_no_prefix_caching"  # two runs differing in it keep both files
    tag = f"_{args.tag}" if args.tag else ""
    path = RESULTS / f"restart_{args.dataset.stem}_n{args.measure}_c{args.concurrency}{caching}{tag}.json"
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "machine": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
              "rows": [{k: round(v, ROUNDING) if isinstance(v, float) else v for k, v in row.items()} for row in rows]}
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(format_rows(rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
