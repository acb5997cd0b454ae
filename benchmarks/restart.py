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

With ``--interleave`` the four measured servers (none, warm, restarted, cold) are up at once and
serve the measured requests in groups of twice ``--concurrency``, each group by every server in
turn (balanced orders, as ``acceptance.py --interleave``), so that the machine's drift falls on
all alike; each ratio then has a 95% interval over the groups, and no ``none_again`` is needed.

    python benchmarks/restart.py --dataset benchmarks/data/humaneval_chat.jsonl --learn 100 --measure 100 \\
        --concurrency 8 [--interleave]   (one command line)

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
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from acceptance import CONFIGS, interleaved_turns, paired_ratio_interval  # benchmarks/ is this script's directory

from vllm_retrieval_spec.datastores.output_snapshot import engine_snapshot_path, snapshot_dirs
from vllm_retrieval_spec.evaluation.load import (
    LoadRequest,
    LoadSettings,
    RequestResult,
    count_differences,
    jsonl_requests,
    run_load_sync,
)
from vllm_retrieval_spec.evaluation.metrics import SpecDecodeCounters
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
    parser.add_argument("--interleave", action="store_true",
                        help="the measured servers up at once, serving the measured requests in groups in turn "
                        "(paired 95%% intervals; the machine's drift falls on every server alike)")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    if args.learn < 2 or args.measure < 1 or args.concurrency < 1 or args.max_tokens < 1:
        parser.error("--learn needs at least 2 requests, --measure, --concurrency and --max-tokens at least 1")
    if not args.dataset.is_file():
        parser.error(f"--dataset {args.dataset}: no such file (benchmarks/workloads.py writes the workloads)")
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


@dataclass(frozen=True)
class Served:
    """Requests one server served: their results in request order, the wall time and vLLM's
    acceptance counters over them."""

    results: list[RequestResult]
    seconds: float
    counters: SpecDecodeCounters

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.results if r.ok)


def serve(label: str, running: VllmServer, requests: list[LoadRequest], concurrency: int, first: int = 0) -> Served:
    """Serve ``requests`` on ``running`` (``concurrency`` in flight), the ``first`` measured
    request among them (their results indexed from it)."""
    before = running.spec_decode_counters()
    run = run_load_sync(running.base_url, requests, LoadSettings(running.served_model_name, concurrency, stream=False),
                        label=label)
    results = [replace(r, index=first + r.index) for r in run.results]
    return Served(results, run.seconds, running.spec_decode_counters() - before)


def learn(running: VllmServer, requests: list[LoadRequest], args: argparse.Namespace, label: str) -> None:
    """The learning requests, unmeasured."""
    serve(f"{label}: learning", running, requests, args.concurrency)


def measured_row(label: str, groups: list[Served]) -> dict[str, Any]:
    """One server's row over its measured ``groups`` (in request order): output tokens/s,
    vLLM's acceptance counters, and each group's tokens and seconds (for the paired intervals)."""
    counters = sum((g.counters for g in groups), SpecDecodeCounters())
    output, seconds = sum(g.output_tokens for g in groups), sum(g.seconds for g in groups)
    return {"server": label, "requests": sum(len(g.results) for g in groups),
            "errors": sum(not r.ok for g in groups for r in g.results), "seconds": seconds,
            "output_tokens": output, "tokens_per_second": output / seconds,
            "mean_acceptance_length": counters.mean_acceptance_length, "acceptance_rate": counters.acceptance_rate,
            "group_output_tokens": [g.output_tokens for g in groups], "group_seconds": [g.seconds for g in groups]}


def snapshot_saved(snapshot_dir: Path) -> None:
    """Stop the run unless the learning server left an output index under ``snapshot_dir``."""
    if not snapshot_dirs(engine_snapshot_path(snapshot_dir, 0)):
        raise SystemExit(f"the learning server saved no output index under {snapshot_dir}")


def run_servers(args: argparse.Namespace, snapshot_dir: Path) -> dict[str, list[Served]]:
    """Every server in turn, the measured requests at once on each (the module's order)."""
    learning, measured = split_requests(args)
    served = {}

    def measure(label: str, running: VllmServer) -> None:
        served[label] = [serve(label, running, measured, args.concurrency)]

    with server("none", args.prefix_caching) as running:
        measure("none", running)
    with server(args.config, args.prefix_caching, None, "warm") as running:
        learn(running, learning, args, "warm")
        measure("warm", running)
    with server(args.config, args.prefix_caching, snapshot_dir, "learner") as running:
        learn(running, learning, args, "learner")
    snapshot_saved(snapshot_dir)
    with server(args.config, args.prefix_caching, snapshot_dir, "restarted") as running:
        measure("restarted", running)
    with server(args.config, args.prefix_caching, None, "cold") as running:
        measure("cold", running)
    with server("none", args.prefix_caching, None, "none_again") as running:
        measure("none_again", running)
    return served


def run_servers_interleaved(args: argparse.Namespace, snapshot_dir: Path) -> dict[str, list[Served]]:
    """The warm and learning servers learn; then none, warm, restarted and cold, up at once,
    serve the measured requests in groups in turn."""
    learning, measured = split_requests(args)
    with ExitStack() as servers:
        warm = servers.enter_context(server(args.config, args.prefix_caching, None, "warm"))
        learn(warm, learning, args, "warm")
        with server(args.config, args.prefix_caching, snapshot_dir, "learner") as learner:
            learn(learner, learning, args, "learner")
        snapshot_saved(snapshot_dir)
        running = {"none": servers.enter_context(server("none", args.prefix_caching)), "warm": warm,
                   "restarted": servers.enter_context(server(args.config, args.prefix_caching, snapshot_dir,
                                                             "restarted")),
                   "cold": servers.enter_context(server(args.config, args.prefix_caching, None, "cold"))}
        served: dict[str, list[Served]] = {label: [] for label in running}
        size = 2 * args.concurrency
        for start, label in interleaved_turns(list(running), len(measured), size):
            served[label].append(serve(f"{label} {start}", running[label], measured[start:start + size],
                                       args.concurrency, start))
    return served


def rows_of(served: dict[str, list[Served]]) -> list[dict[str, Any]]:
    """Each server's row, its outputs compared with no speculation's and its tokens/s with no
    speculation (the mean of first and last where both ran) and the warm server (with a paired
    95% interval where the servers were interleaved: None for one group and for the warm server)."""
    rows = [measured_row(label, groups) for label, groups in served.items()]
    reference = [r for g in served["none"] for r in g.results]
    speed = {row["server"]: row["tokens_per_second"] for row in rows}
    baseline = (speed["none"] + speed.get("none_again", speed["none"])) / 2
    warm = next(row for row in rows if row["server"] == "warm")
    for row, groups in zip(rows, served.values()):
        row["differing"] = count_differences([r for g in groups for r in g.results], reference)["differing"]
        row["x_none"] = row["tokens_per_second"] / baseline
        row["x_warm"] = row["tokens_per_second"] / speed["warm"]
        row["x_warm_ci95"] = None if row is warm else paired_ratio_interval(row, [warm], "group_output_tokens",
                                                                            "group_seconds")
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = ["| server | tok/s | × none | × warm (95% CI) | vLLM MAL | accept | errors | differ |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for row in rows:
        mal = f"{row['mean_acceptance_length']:.2f}" if row["mean_acceptance_length"] else "–"
        accept = f"{row['acceptance_rate']:.1%}" if row["acceptance_rate"] else "–"
        interval = row["x_warm_ci95"]
        x_warm = f"{row['x_warm']:.2f}" + (f" ({interval[0]:.2f}–{interval[1]:.2f})" if interval else "")
        lines.append(f"| {row['server']} | {row['tokens_per_second']:.1f} | {row['x_none']:.2f} | "
                     f"{x_warm} | {mal} | {accept} | {row['errors']} | {row['differing']} |")
    return "\n".join(lines)


def rounded(value: Any) -> Any:
    """``value`` with its floats (alone or in a list) rounded for the report."""
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return round(value, ROUNDING) if isinstance(value, float) else value


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="vrs-restart-") as snapshot_dir:
        run = run_servers_interleaved if args.interleave else run_servers
        rows = rows_of(run(args, Path(snapshot_dir)))
    caching = "" if args.prefix_caching else "_no_prefix_caching"  # two runs differing in it keep both files
    tag = ("_interleaved" if args.interleave else "") + (f"_{args.tag}" if args.tag else "")
    path = RESULTS / f"restart_{args.dataset.stem}_n{args.measure}_c{args.concurrency}{caching}{tag}.json"
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "machine": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
              "rows": [{k: rounded(v) for k, v in row.items()} for row in rows]}
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(format_rows(rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
