"""Fast, exact tuning of drafting rules by greedy replay (algorithms.md §8).

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

from vllm_retrieval_spec.evaluation.engine import configure_vllm_environment

configure_vllm_environment(in_process=True)

from vllm_retrieval_spec.datastores.resolve import open_datastore_for_model  # noqa: E402
from vllm_retrieval_spec.evaluation.prompts import humaneval_prompts  # noqa: E402
from vllm_retrieval_spec.evaluation.replay import (  # noqa: E402
    GreedyTrace,
    chain_as_tree,
    load_traces,
    replay,
    save_traces,
)
from vllm_retrieval_spec.kernels import context_ngram  # noqa: E402
from vllm_retrieval_spec.kernels.rest import RestParams, rest_retrieve  # noqa: E402
from vllm_retrieval_spec.models import ensure_smollm2_checkpoint  # noqa: E402
from vllm_retrieval_spec.ngrams.drafts import mixed_drafts  # noqa: E402
from vllm_retrieval_spec.ngrams.table import ModelIdentity, NgramTable, default_table_dir  # noqa: E402
from vllm_retrieval_spec.options import RetrievalSpecOptions  # noqa: E402
from vllm_retrieval_spec.paths import cache_root  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def greedy_traces(model: Path, form: str, prompts: int, max_tokens: int) -> list[GreedyTrace]:
    path = cache_root() / "traces" / f"humaneval_{form}_n{prompts}_t{max_tokens}.json"
    if path.is_file():
        return load_traces(path)
    from transformers import AutoTokenizer

    from vllm_retrieval_spec.evaluation.engine import EngineSpec, build_llm, generate, shutdown_llm

    print(f"generating greedy traces ({form}, {prompts} prompts) once; cached at {path}", flush=True)
    texts = humaneval_prompts(prompts, form, AutoTokenizer.from_pretrained(model) if form == "chat" else None)
    llm = build_llm(EngineSpec(model, max_num_seqs=16))
    try:
        run = generate(llm, texts, max_tokens, concurrency=16)
    finally:
        shutdown_llm(llm)
    traces = [GreedyTrace(r.prompt_ids, r.output_ids) for r in run.records]
    save_traces(traces, path)
    return traces


def rest_drafter(store, params: RestParams, tree: bool):
    def draft(matrix, lengths):
        import numpy as np

        out = rest_retrieve(store, matrix, lengths, np.arange(len(lengths)), params)
        if tree:
            return [out.tree(i) for i in range(len(lengths))]
        return [chain_as_tree(out.chain(i)) for i in range(len(lengths))]

    return draft


def prompt_lookup_drafter(k: int, q_max: int):
    def draft(matrix, lengths):
        import numpy as np

        out = context_ngram(matrix, lengths, np.arange(len(lengths)), k=1, w=k, q_min=1, q_max=q_max)
        return [chain_as_tree(out.draft(i)) for i in range(len(lengths))]

    return draft


def ngrammys_drafter(table, k: int, w: int, q: int, tree: bool, nodes: int = 0):
    """N-Grammys drafts; trees cut to ``nodes`` (0: uncut) as the engine's node budget does."""

    def draft(matrix, lengths):
        import numpy as np

        drafts = mixed_drafts(table, matrix, lengths, np.arange(len(lengths), dtype=np.int32),
                              k=k, w=w, q=q, mixing="context-first")
        if tree:
            cut = nodes or None
            return [tuple(part[:cut] for part in drafts.tree(i)) for i in range(len(lengths))]
        return [chain_as_tree(drafts.chain(i)) for i in range(len(lengths))]

    return draft


def parse_grid(items: list[str]) -> list[dict]:
    axes = []
    for item in items:
        key, values = item.split("=", 1)
        field_type = {f.name: f.type for f in dataclasses.fields(RestParams)}[key]
        cast = {"int": int, "float": float, "bool": lambda v: v.lower() == "true"}[str(field_type)]
        axes.append([(key, cast(v)) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)] if axes else [{}]


def main() -> None:
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
    args = parser.parse_args()

    model = ensure_smollm2_checkpoint()
    store, _ = open_datastore_for_model(args.datastore, model)
    base = RestParams.from_options(RetrievalSpecOptions(), chain_len=args.k)
    variants = {f"prompt_lookup_k{args.k}": prompt_lookup_drafter(args.k, 4)}
    for overrides in parse_grid(args.grid):
        label = ",".join(f"{k}={v}" for k, v in overrides.items())
        params = dataclasses.replace(base, **overrides)
        sources = {"both": {}, "datastore": {"use_context": False}, "context": {"use_datastore": False}}
        for name in args.sources:
            p = dataclasses.replace(params, **sources[name])
            suffix = f" [{label}]" if label else ""
            if "chain" in args.shapes:
                variants[f"rest_{name}_chain{suffix}"] = rest_drafter(store, p, tree=False)
            for nodes in args.tree_nodes if "tree" in args.shapes else ():
                variants[f"rest_{name}_tree{nodes}{suffix}"] = rest_drafter(
                    store, dataclasses.replace(p, top_k=nodes), tree=True)

    if args.ngrammys:
        identity = ModelIdentity.of(model)
        table = NgramTable.open(default_table_dir(identity), expected_model=identity)
        options = RetrievalSpecOptions()
        if "chain" in args.shapes:
            variants["ngrammys_chain"] = ngrammys_drafter(table, options.k, args.k, options.q, tree=False)
        for nodes in args.tree_nodes if "tree" in args.shapes else ():
            w = min(options.w, nodes)
            variants[f"ngrammys_tree{nodes}_k{options.k}_w{w}"] = ngrammys_drafter(
                table, options.k, w, options.q, tree=True, nodes=nodes)

    RESULTS.mkdir(parents=True, exist_ok=True)
    for form in (["raw", "chat"] if args.form == "both" else [args.form]):
        traces = greedy_traces(model, form, args.prompts, args.max_tokens)
        rows = []
        for name, drafter in variants.items():
            start = time.perf_counter()
            result = replay(traces, drafter)
            rows.append({"variant": name, "honest_tokens_per_step": result.honest_tokens_per_step,
                         "draft_tokens_per_step": result.draft_tokens_per_step,
                         "decode_steps": result.decode_steps, "seconds": time.perf_counter() - start})
        print(f"\n{form}: {len(traces)} prompts, {args.max_tokens} tokens, store {store.path.name} "
              f"({store.manifest.num_tokens / 1e6:.1f}M tokens)")
        print(f"{'variant':58s} {'honest':>7s} {'drafted/step':>13s}")
        for row in rows:
            print(f"{row['variant']:58s} {row['honest_tokens_per_step']:7.3f} {row['draft_tokens_per_step']:13.2f}")
        out = RESULTS / f"replay_{form}_n{len(traces)}_t{args.max_tokens}{'_' + args.tag if args.tag else ''}.json"
        out.write_text(json.dumps({"form": form, "prompts": len(traces), "max_tokens": args.max_tokens,
                                   "k": args.k, "datastore": str(store.path),
                                   "datastore_tokens": store.manifest.num_tokens,
                                   "base_params": dataclasses.asdict(base), "results": rows}, indent=2) + "\n")
        print(f"written: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
