"""How much of a workload's output a drafter that copies from the request itself could ever draft.

For each output token of the target's greedy outputs (generated once and cached, as
``budget_replay.py`` does), and each ``k``: did the ``k`` tokens before it occur earlier in the
request (prompt and output so far) followed by that token (*any* earlier occurrence: the
ceiling of any context drafter matching ``k`` tokens), and did the *latest* earlier occurrence
predict it (what prompt lookup drafts)? Retrieval from the request cannot draft a token neither
finds, so a workload whose share is low caps what context retrieval (REST's context source,
`suffix`'s prompt tree, prompt lookup) can accept per step; what is left needs other sources
(REST's datastore, its output and live indexes, `suffix`'s tree of earlier outputs).

    python benchmarks/copy_ceiling.py --workloads doc_qa multi_turn --prompts 24 --max-tokens 64 128

Writes results/copy_ceiling.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from budget_replay import RESULTS, workload_traces

from vllm_retrieval_spec.models import ensure_smollm2_checkpoint

ORDERS = (1, 2, 3, 4)


def copy_shares(tokens: list[int], first_output: int) -> dict[str, float]:
    """For ``tokens[first_output:]``: the share continuing any / the latest earlier occurrence of
    the ``k`` tokens before them, for each ``k`` in ``ORDERS``."""
    hits = {f"{kind}_k{k}": 0 for k in ORDERS for kind in ("any", "latest")}
    followers: dict[tuple[int, ...], set[int]] = defaultdict(set)
    latest: dict[tuple[int, ...], int] = {}
    for position in range(1, len(tokens)):
        for k in ORDERS:
            if position < k:
                continue
            key = tuple(tokens[position - k:position])
            if position >= first_output:
                hits[f"any_k{k}"] += tokens[position] in followers.get(key, ())
                hits[f"latest_k{k}"] += latest.get(key) == tokens[position]
            followers[key].add(tokens[position])
            latest[key] = tokens[position]
    outputs = max(len(tokens) - first_output, 1)
    return {name: count / outputs for name, count in hits.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["doc_qa", "multi_turn"])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[64, 128],
                        help="new tokens per workload (one value, or one per workload)")
    args = parser.parse_args()
    if len(args.max_tokens) not in (1, len(args.workloads)):
        parser.error("--max-tokens takes one value or one per workload")
    model = ensure_smollm2_checkpoint()
    rows = []
    for i, workload in enumerate(args.workloads):
        max_tokens = args.max_tokens[min(i, len(args.max_tokens) - 1)]
        traces = workload_traces(model, workload, args.prompts, max_tokens)
        shares = [copy_shares(list(t.prompt_ids) + list(t.output_ids), len(t.prompt_ids)) for t in traces]
        weights = [len(t.output_ids) for t in traces]
        mean = {name: sum(s[name] * w for s, w in zip(shares, weights)) / max(sum(weights), 1) for name in shares[0]}
        rows.append({"workload": workload, "prompts": len(traces), "max_tokens": max_tokens,
                     "output_tokens": sum(weights), **mean})
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "workloads": rows}
    (RESULTS / "copy_ceiling.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'workload':14s} {'outputs':>8s} " + " ".join(f"{'any/latest k' + str(k):>17s}" for k in ORDERS))
    for row in rows:
        cells = " ".join(f"{row[f'any_k{k}']:8.2f}/{row[f'latest_k{k}']:<8.2f}" for k in ORDERS)
        print(f"{row['workload']:14s} {row['output_tokens']:8d} {cells}")
    print(f"written: {RESULTS / 'copy_ceiling.json'}")


if __name__ == "__main__":
    main()
