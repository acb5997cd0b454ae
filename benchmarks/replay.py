"""Fast, exact tuning of drafting rules by greedy replay (see :mod:`vllm_retrieval_spec.evaluation.replay`).

The target's greedy outputs are generated once (in-process vLLM, fp32; cached), then every
drafting variant is scored offline: honest tokens per decode step and draft tokens per step,
for chains (what vLLM verifies today) and trees. Confirm winners with acceptance.py.

    python benchmarks/replay.py --form both --prompts 164 --datastore python-code
    python benchmarks/replay.py --grid context_weight=1,2,4,8 min_ratio=0,0.1,0.2

Writes benchmarks/results/replay_<form>_n<prompts>_t<tokens>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

from vllm_retrieval_spec.compat import configure_vllm_environment

configure_vllm_environment(in_process=True)

import numpy as np  # noqa: E402

from vllm_retrieval_spec.datastores import TokenDatastore  # noqa: E402
from vllm_retrieval_spec.datastores.resolve import open_datastore_for_model  # noqa: E402
from vllm_retrieval_spec.evaluation.replay import GreedyTrace, TreeDrafter, chain_as_tree, replay  # noqa: E402
from vllm_retrieval_spec.evaluation.traces import greedy_traces  # noqa: E402
from vllm_retrieval_spec.kernels import context_ngram  # noqa: E402
from vllm_retrieval_spec.kernels.rest import RestParams, rest_retrieve  # noqa: E402
from vllm_retrieval_spec.models import ensure_smollm2_checkpoint  # noqa: E402
from vllm_retrieval_spec.ngrams.drafts import MixedStrategy, mixed_drafts  # noqa: E402
from vllm_retrieval_spec.ngrams.table import ModelIdentity, NgramTable, default_table_dir  # noqa: E402
from vllm_retrieval_spec.options import RetrievalSpecOptions  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def rest_drafter(store: TokenDatastore, params: RestParams, tree: bool) -> TreeDrafter:
    """REST drafts: the retrieved tree, or its heaviest chain."""

    def draft(matrix: np.ndarray, lengths: np.ndarray) -> list[tuple[list[int], list[int]]]:
        out = rest_retrieve(store, matrix, lengths, np.arange(len(lengths)), params)
        if tree:
            return [out.tree(i) for i in range(len(lengths))]
        return [chain_as_tree(out.chain(i)) for i in range(len(lengths))]

    return draft


def prompt_lookup_drafter(draft_len: int, q_max: int) -> TreeDrafter:
    """Prompt lookup chains of ``draft_len`` tokens, matching context suffixes of up to ``q_max`` tokens."""

    def draft(matrix: np.ndarray, lengths: np.ndarray) -> list[tuple[list[int], list[int]]]:
        out = context_ngram(matrix, lengths, np.arange(len(lengths)), num_drafts=1, draft_len=draft_len,
                            q_min=1, q_max=q_max)
        return [chain_as_tree(out.draft(i)) for i in range(len(lengths))]

    return draft


def ngrammys_drafter(table: NgramTable, options: RetrievalSpecOptions, draft_len: int, tree: bool,
                     nodes: int = 0) -> TreeDrafter:
    """N-Grammys drafts of ``draft_len`` tokens; trees cut to ``nodes`` (0: uncut) as the
    engine's node budget does."""
    strategy = MixedStrategy.from_options(options, draft_len)

    def draft(matrix: np.ndarray, lengths: np.ndarray) -> list[tuple[list[int], list[int]]]:
        drafts = mixed_drafts(table, matrix, lengths, np.arange(len(lengths), dtype=np.int32), strategy)
        if tree:
            cut = nodes or None
            return [tuple(part[:cut] for part in drafts.tree(i)) for i in range(len(lengths))]
        return [chain_as_tree(drafts.chain(i)) for i in range(len(lengths))]

    return draft


def parse_grid(items: list[str]) -> list[dict[str, int | float | bool]]:
    """``key=v1,v2`` axes over :class:`RestParams` fields -> every combination of overrides."""
    axes = []
    for item in items:
        key, values = item.split("=", 1)
        field_type = {f.name: f.type for f in dataclasses.fields(RestParams)}[key]
        cast = {"int": int, "float": float, "bool": lambda v: v.lower() == "true"}[str(field_type)]
        axes.append([(key, cast(v)) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)] if axes else [{}]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--form", choices=["raw", "chat", "both"], default="both")
    parser.add_argument("--prompts", type=int, default=164)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=8, help="chain length (num_speculative_tokens)")
    parser.add_argument("--tree-nodes", type=int, nargs="+", default=[64], help="node budgets of tree variants")
    parser.add_argument("--datastore", default="python-code", help="directory or recipe name")
    parser.add_argument("--grid", nargs="*", default=[], help="RestParams axes, e.g. context_weight=1,4")
    parser.add_argument("--sources", nargs="+", default=["both", "datastore", "context"],
                        choices=["both", "datastore", "context"], help="REST sources to score")
    parser.add_argument("--shapes", nargs="+", default=["chain", "tree"], choices=["chain", "tree"])
    parser.add_argument("--ngrammys", action="store_true", help="also score N-Grammys (needs its table)")
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    return parser.parse_args()


def tree_budgets(args: argparse.Namespace) -> list[int]:
    """The node budgets of the tree variants (none unless trees are scored)."""
    return args.tree_nodes if "tree" in args.shapes else []


def rest_variants(store: TokenDatastore, base: RestParams, args: argparse.Namespace) -> dict[str, TreeDrafter]:
    """REST per grid point, source and shape."""
    variants = {}
    sources = {"both": {}, "datastore": {"use_context": False}, "context": {"use_datastore": False}}
    for overrides in parse_grid(args.grid):
        label = ",".join(f"{k}={v}" for k, v in overrides.items())
        suffix = f" [{label}]" if label else ""
        params = dataclasses.replace(base, **overrides)
        for name in args.sources:
            p = dataclasses.replace(params, **sources[name])
            if "chain" in args.shapes:
                variants[f"rest_{name}_chain{suffix}"] = rest_drafter(store, p, tree=False)
            for nodes in tree_budgets(args):
                variants[f"rest_{name}_tree{nodes}{suffix}"] = rest_drafter(
                    store, dataclasses.replace(p, top_k=nodes), tree=True)
    return variants


def ngrammys_variants(model: Path, args: argparse.Namespace) -> dict[str, TreeDrafter]:
    """N-Grammys with the default options, per shape, on the model's cached table."""
    identity = ModelIdentity.of(model)
    table = NgramTable.open(default_table_dir(identity), expected_model=identity)
    options = RetrievalSpecOptions()
    variants = {}
    if "chain" in args.shapes:
        variants["ngrammys_chain"] = ngrammys_drafter(table, options, args.k, tree=False)
    for nodes in tree_budgets(args):
        draft_len = min(options.ngrammys_draft_len, nodes)
        variants[f"ngrammys_tree{nodes}_k{options.ngrammys_drafts}_w{draft_len}"] = ngrammys_drafter(
            table, options, draft_len, tree=True, nodes=nodes)
    return variants


def score(traces: list[GreedyTrace], variants: dict[str, TreeDrafter]) -> list[dict[str, float | int | str]]:
    """One result row per variant."""
    rows = []
    for name, drafter in variants.items():
        start = time.perf_counter()
        result = replay(traces, drafter)
        rows.append({"variant": name, "honest_tokens_per_step": result.honest_tokens_per_step,
                     "draft_tokens_per_step": result.draft_tokens_per_step,
                     "decode_steps": result.decode_steps, "seconds": time.perf_counter() - start})
    return rows


def print_rows(title: str, rows: list[dict[str, float | int | str]]) -> None:
    print(f"\n{title}")
    print(f"{'variant':58s} {'honest':>7s} {'drafted/step':>13s}")
    for row in rows:
        print(f"{row['variant']:58s} {row['honest_tokens_per_step']:7.3f} {row['draft_tokens_per_step']:13.2f}")


def main() -> None:
    args = parse_args()
    model = ensure_smollm2_checkpoint()
    store, _ = open_datastore_for_model(args.datastore, model)
    base = RestParams.from_options(RetrievalSpecOptions(), chain_len=args.k)
    variants = {f"prompt_lookup_k{args.k}": prompt_lookup_drafter(args.k, 4), **rest_variants(store, base, args)}
    if args.ngrammys:
        variants.update(ngrammys_variants(model, args))

    RESULTS.mkdir(parents=True, exist_ok=True)
    for form in (["raw", "chat"] if args.form == "both" else [args.form]):
        traces = greedy_traces(model, form, args.prompts, args.max_tokens)
        rows = score(traces, variants)
        print_rows(f"{form}: {len(traces)} prompts, {args.max_tokens} tokens, store {store.path.name} "
                   f"({store.manifest.num_tokens / 1e6:.1f}M tokens)", rows)
        out = RESULTS / f"replay_{form}_n{len(traces)}_t{args.max_tokens}{'_' + args.tag if args.tag else ''}.json"
        out.write_text(json.dumps({"form": form, "prompts": len(traces), "max_tokens": args.max_tokens,
                                   "k": args.k, "datastore": str(store.path),
                                   "datastore_tokens": store.manifest.num_tokens,
                                   "base_params": dataclasses.asdict(base), "results": rows}, indent=2) + "\n")
        print(f"written: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
