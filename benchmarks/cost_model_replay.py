"""The goodput budget's step-cost model replayed on the steps real engines observed.

``acceptance.py --step-log`` keeps, in each budget's report, every step its cost model was given
(seconds, requests, tokens, tree work, sampled draft tokens, prompt tokens). This script feeds
those steps, in order, to cost models of other settings and reports for each how well it
predicted each next decode step before learning from it (mean |predicted − measured| ÷ measured,
and the mean signed error: above 0, steps priced dearer than they ran), and how steady the terms
the chooser trades against each other stayed: the 10th-to-90th-percentile spread of a draft
token's cost relative to a step of the log's median requests, over the steps after the first 50.
Seconds of replay per file instead of an engine run per setting; what the choices would have
been under another model is not replayed (the engine drafted what its own model chose).

    python benchmarks/acceptance.py --interleave --step-log --configs none rest_k32 ... --tag T
    python benchmarks/cost_model_replay.py benchmarks/results/acceptance_*_T.json

Writes results/cost_model_replay[_<tag>].json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from vllm_retrieval_spec.goodput.cost_model import StepCostModel

RESULTS = Path(__file__).resolve().parent / "results"
SETTLING_STEPS = 50  # steps before the first prediction counted
# name: StepCostModel settings ({}: the model the engines run).
VARIANTS: dict[str, dict] = {
    "one fit, forgetting 0.99 (before 2026-11-30)": {"scale_forgetting": 0.0},
    "one fit, forgetting 0.998": {"forgetting": 0.998, "scale_forgetting": 0.0},
    "shape 0.998, scale 0.9": {"forgetting": 0.998},
    "shape 0.99, scale 0.95": {"scale_forgetting": 0.95},
    "shape 0.99, scale 0.9 (default)": {},
}


def replay(steps: list[list[float]], kernel_rows: int, **settings) -> dict:
    """One cost model of ``settings`` fed ``steps`` in order: its one-step-ahead errors on decode
    steps (no prompt tokens) and the spread of its draft-token cost relative to a step."""
    model = StepCostModel(kernel_rows=kernel_rows, **settings)
    requests = float(np.median([step[1] for step in steps]))
    errors, relative_costs = [], []
    for index, step in enumerate(steps):
        seconds, num_reqs, num_tokens, tree_work, sampled, prefill_tokens = step
        if index >= SETTLING_STEPS and seconds > 0 and prefill_tokens == 0:
            predicted = float(model.predict(num_reqs, num_tokens, tree_work, sampled))
            errors.append((predicted - seconds) / seconds)
            relative_costs.append(model.per_token / model.idle_seconds(round(requests)))
        model.observe(seconds, int(num_reqs), int(num_tokens), tree_work, int(sampled), int(prefill_tokens))
    errors, relative_costs = np.array(errors), np.array(relative_costs)
    if not len(errors):
        return {"predicted_steps": 0}
    low, high = np.percentile(relative_costs, [10, 90])
    return {"predicted_steps": len(errors), "mean_absolute_error": float(np.abs(errors).mean()),
            "bias": float(errors.mean()), "relative_draft_cost_spread": float((high - low) / np.median(relative_costs))}


def logged_engines(path: Path) -> list[tuple[str, int, list]]:
    """The configs of an acceptance report whose budgets kept a step log: name, kernel rows, steps."""
    report = json.loads(path.read_text())
    return [(result["config"], result["budget"]["cost_kernel_rows"], result["budget"]["step_log"])
            for result in report["results"] if (result.get("budget") or {}).get("step_log")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path, help="acceptance.py reports run with --step-log")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    rows = []
    print(f"{'report':50s} {'config':16s} {'cost model':46s} {'steps':>6s} {'|error|':>8s} {'bias':>7s} "
          f"{'spread':>7s}")
    for path in args.reports:
        engines = logged_engines(path)
        if not engines:
            sys.exit(f"{path}: no budget kept a step log; run acceptance.py with --step-log")
        for config, kernel_rows, steps in engines:
            for variant, settings in VARIANTS.items():
                row = {"report": path.name, "config": config, "cost_model": variant, **settings,
                       **replay(steps, kernel_rows, **settings)}
                rows.append(row)
                if row["predicted_steps"]:
                    print(f"{path.name[:50]:50s} {config[:16]:16s} {variant:46s} {row['predicted_steps']:6d} "
                          f"{row['mean_absolute_error']:8.1%} {row['bias']:+7.1%} "
                          f"{row['relative_draft_cost_spread']:7.2f}")
    out = RESULTS / f"cost_model_replay{'_' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "settling_steps": SETTLING_STEPS,
                               "rows": rows}, indent=2) + "\n")
    print(f"written: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
