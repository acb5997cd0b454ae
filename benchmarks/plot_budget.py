"""Calibration and cost-curve plots of the goodput budget, from an acceptance.py report.

For every config that ran with ``budget: auto``: predicted vs observed acceptance per
calibration bucket (marker area ~ observations; buckets with at least --min-observations
are listed with their gap) and the learned step-cost curve at the run's concurrency.

    python benchmarks/plot_budget.py benchmarks/results/acceptance_chat_n164_t128_c8_budget.json

Writes <report>_calibration.png next to the report and prints the per-bucket table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SOURCE_NAMES = {1: "datastore", 2: "context", 3: "datastore+context", 4: "model", 6: "context+model",
                8: "output", 9: "datastore+output", 10: "context+output", 11: "all three"}


def bucket_label(row: dict) -> str:
    source = SOURCE_NAMES.get(row["source"], str(row["source"]))
    return f"{source} len{row['match_length_bucket']} d{row['depth']} p{row['raw_prob_bucket']}"


def print_calibration(config: str, rows: list[dict], min_observations: int) -> float | None:
    """The buckets with enough observations and their gaps; returns the largest gap (None
    without such buckets)."""
    big = sorted((r for r in rows if r["observations"] >= min_observations), key=lambda r: -r["observations"])
    print(f"\n{config}: {len(big)} buckets with >= {min_observations} observations")
    if not big:
        return None
    worst = 0.0
    for row in big:
        gap = row["predicted"] - row["observed"]
        worst = max(worst, abs(gap))
        print(f"  {bucket_label(row):40s} n={row['observations']:6d} predicted {row['predicted']:.3f} "
              f"observed {row['observed']:.3f} gap {gap:+.3f}")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path)
    parser.add_argument("--min-observations", type=int, default=200)
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(args.report.read_text())
    configs = [r for r in report["results"] if r.get("budget")]
    if not configs:
        raise SystemExit(f"{args.report}: no config ran with budget auto (nothing to plot)")
    figure, axes = plt.subplots(2, len(configs), figsize=(4.5 * len(configs), 8.5), squeeze=False)
    for column, result in enumerate(configs):
        budget = result["budget"]
        rows = budget["calibration"]
        worst = print_calibration(result["config"], rows, args.min_observations)
        top = axes[0][column]
        top.plot([0, 1], [0, 1], color="grey", linewidth=1)
        top.scatter([r["predicted"] for r in rows], [r["observed"] for r in rows],
                    s=[max(4.0, r["observations"] / 20) for r in rows], alpha=0.5)
        top.set(xlim=(0, 1), ylim=(0, 1), xlabel="predicted acceptance", ylabel="observed acceptance",
                title=f"{result['config']}\n" + (f"max gap {worst:.3f} (buckets >= {args.min_observations} obs)"
                                                  if worst is not None else
                                                  f"no bucket with >= {args.min_observations} obs"))
        curve = budget["cost_curve"]
        bottom = axes[1][column]
        bottom.plot([p["extra_tokens"] for p in curve], [1000 * p["seconds"] for p in curve])
        bottom.set(xlabel=f"draft tokens verified (batch of {report['concurrency']})", ylabel="step time (ms)",
                   title="learned step cost", ylim=(0, None))
    figure.suptitle(f"{report['form']} prompts: {report['prompts']}, concurrency {report['concurrency']}")
    figure.tight_layout()
    out = args.report.with_name(args.report.stem + "_calibration.png")
    figure.savefig(out, dpi=110)
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    main()
