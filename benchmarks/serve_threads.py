"""How many cores the engine should get on this machine: `vllm-retrieval-spec serve` with
``VLLM_CPU_NUM_OF_RESERVED_CPU`` = each of ``--reserved`` (vLLM's CPU build keeps one core per
worker away from the engine for its front end: on 2 cores the model runs on 1) and, optionally,
``OMP_NUM_THREADS`` = each of ``--threads`` (vLLM's default in server mode is 1 torch thread),
for each config, under the same load (HumanEval raw, greedy, ``--concurrency`` in flight).

    python benchmarks/serve_threads.py --reserved 1 0 --configs none rest_k8 --concurrency 1 8

Writes benchmarks/results/serve_threads.json and prints tokens/s per setting and concurrency.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from acceptance import CONFIGS  # benchmarks/ is this script's directory

from vllm_retrieval_spec.evaluation.load import LoadSettings, humaneval_requests, run_load_sync, summarize_run
from vllm_retrieval_spec.evaluation.server import VllmServer
from vllm_retrieval_spec.models.smollm2 import ensure_smollm2_checkpoint

RESULTS = Path(__file__).resolve().parent / "results"


def measure(model: Path, config: str, reserved: int, threads: int | None, concurrencies: list[int],
            requests: int, max_tokens: int) -> list[dict]:
    """One server with ``reserved`` cores kept from the engine and ``OMP_NUM_THREADS=threads``
    (vLLM's choice when None); one load run per concurrency (after a warm-up)."""
    spec = CONFIGS[config]
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved), **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    server = VllmServer(model, speculative_config=spec.get("speculative_config"),
                        additional_config=spec.get("additional_config"), env=env)
    rows = []
    with server:
        load = humaneval_requests(requests, "raw", max_tokens)
        run_load_sync(server.base_url, load[:4], LoadSettings(server.served_model_name, concurrency=4), progress=False)
        for concurrency in concurrencies:
            run = run_load_sync(server.base_url, load, LoadSettings(server.served_model_name, concurrency=concurrency),
                                label=f"{config} reserved={reserved} threads={threads} c={concurrency}")
            rows.append({"config": config, "reserved_cores": reserved, "threads": threads, **summarize_run(run)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reserved", type=int, nargs="+", default=[1, 0], help="cores kept from the engine")
    parser.add_argument("--threads", type=int, nargs="+", default=[0], help="OMP_NUM_THREADS (0: vLLM's choice)")
    parser.add_argument("--configs", nargs="+", default=["none", "rest_k8"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    model = ensure_smollm2_checkpoint()
    rows = [row for config in args.configs for reserved in args.reserved for threads in args.threads
            for row in measure(model, config, reserved, threads or None, args.concurrency, args.requests,
                               args.max_tokens)]
    print(f"{'config':<12} {'reserved':>8} {'threads':>7} {'conc.':>5} {'tok/s':>8} {'errors':>6}")
    for row in rows:
        print(f"{row['config']:<12} {row['reserved_cores']:>8} {row['threads'] or '-':>7} {row['concurrency']:>5} "
              f"{row['output_tokens_per_second']:>8.1f} {sum(row['errors'].values()):>6}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "serve_threads.json"
    out.write_text(json.dumps({"cores": len(os.sched_getaffinity(0)), "rows": rows}, indent=2))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
