"""Acceptance and speed of speculative configs on the real model (in-process vLLM, fp32).

For every config, over the same HumanEval prompts in the same run: vLLM's mean acceptance
length (1 + accepted / drafts), the honest figure ((generated - requests) / decode steps,
counting steps without drafts), the acceptance rate, draft tokens per request-step, output
tokens/s, the speed-up against no speculation (run first and again last; the mean of both, so
that the machine's drift shows) and against vLLM ``suffix``, how many prompts' token ids differ
from no speculation (must be 0) and, for ``budget: auto``, the budget's counters, calibration
buckets and learned step-cost curve (plot them with ``plot_budget.py``).

    python benchmarks/acceptance.py --prompts 40 --max-tokens 128 --form raw
    python benchmarks/acceptance.py --configs none prompt_lookup_k8 ngram_k8 --form both
    python benchmarks/acceptance.py --temperature 0.7 --top-p 0.9 --repeats 3 --configs none suffix rest_k8
    python benchmarks/acceptance.py --form chat --temperature 0.7 --seed 1000 --concurrency 8 --configs rest_k8 suffix
    python benchmarks/acceptance.py --prompts 164 --max-tokens 64 --concurrency 8 --form both --tag budget
        --configs none suffix rest_k8 rest_k8_fixed rest_tree_k16 prompt_lookup_k8 ngrammys_k8 ngrammys_tree_k16
        (one command line)
    python benchmarks/acceptance.py --dataset benchmarks/data/code_edit.jsonl --prompts 40 --max-tokens 256
    python benchmarks/acceptance.py --interleave --concurrency 8 --prompts 64 --configs none suffix rest_k32
    python benchmarks/acceptance.py --model gemma3 --interleave --prompts 20 --configs none suffix rest_k32

``--interleave`` builds every config's engine at once (~1 GB each) and runs each group of
``--concurrency`` prompts on every engine in turn, in orders balanced from group to group (each
config at each place, and right after each other config, equally often): the
machine's drift, up to 25% within a run on a small VM, then falls on every config alike, and
ratios of 1–5% become measurable (within a group the requests in flight fall from
``--concurrency`` as they finish, the same for every config). Each config's ratio to ``suffix``
then gets a 95% bootstrap interval, the groups resampled together (tokens/s) and the requests
resampled together (the honest figure): ``speedup_vs_suffix_ci95``, ``honest_vs_suffix_ci95``.
Every run also records the CPU time the hypervisor took from the machine meanwhile (``steal`` in
``/proc/stat``; ``stolen_cpu_seconds``, per group ``group_stolen_cpu_seconds``), and the table
names each config that lost 1% or more of its CPU time that way, with its worst group: a shared
VM's stalls fall on whichever engines run then.

``--prefill`` also times each engine prefilling the prompts alone (``max_tokens`` 1, its prefix
cache emptied first; in the same interleaved groups), work every config does alike and no
drafter touches: the report then gives each config's tokens/s beyond that time and its ratio to
``suffix``'s: the part of a run speculation can speed up (prefill was a third to a half of the
workloads' runs at 8 in flight on the 2-core VM).

``--dataset`` takes the prompts from a JSONL file of chat ``messages`` records (rendered with the
model's chat template) or raw ``prompt`` records instead, e.g. the workloads of ``workloads.py``;
the file's name then stands for ``<form>`` in the report's name.

Greedy by default; with ``--temperature`` (and ``--top-p``) requests sample without per-request
seeds (vLLM's seeded path is slower on the CPU and would mix its cost into the ratios), outputs
are not compared, and ``--repeats`` runs the prompts several times: the honest figure gets a 95%
bootstrap interval over requests, tokens/s and the acceptance rate a 95% t interval over the
repeats. With ``--seed BASE`` request i samples with seed BASE + i and outputs are compared as
greedy ones, each with the same engine drafting nothing: ours with our sampler drafting nothing
(``rest_k8_never_drafts``, run second), vLLM's (``none``, its methods) with no speculation, whose
sampler draws differently. Ours must not differ (the seeded promise; vLLM's CPU matmuls at other
batch shapes may move a near-tie, about one request in 30).

Under the table each budget's cost model says how far it predicted its recent decode steps
(``cost_prediction_error``); ``--step-log`` also keeps every step it observed in the report
(``step_log``), which ``cost_model_replay.py`` replays through other cost models.

Writes results/acceptance_<form>_n<prompts>_t<tokens>_c<concurrency><rest>.json, ``<rest>`` being
[_T<temp>[_p<top-p>][_s<seed>]][_<model>][_<tag>] (``_<model>`` unless it is SmolLM2).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from vllm_retrieval_spec.compat import configure_vllm_environment

configure_vllm_environment(in_process=True)

from vllm_retrieval_spec.datastores.resolve import as_directory, ensure_recipe_store  # noqa: E402
from vllm_retrieval_spec.evaluation.engine import (  # noqa: E402
    EngineSpec,
    GenerationRun,
    build_llm,
    drafter_of,
    generate,
    shutdown_llm,
)
from vllm_retrieval_spec.evaluation.load import jsonl_requests  # noqa: E402
from vllm_retrieval_spec.evaluation.metrics import SpecDecodeCounters, summarize  # noqa: E402
from vllm_retrieval_spec.evaluation.prompts import chat_prompts, humaneval_prompts  # noqa: E402
from vllm_retrieval_spec.models import ensure_gemma3_checkpoint, ensure_smollm2_checkpoint  # noqa: E402
from vllm_retrieval_spec.models.gguf import ModelSourceError  # noqa: E402
from vllm_retrieval_spec.options import RetrievalSpecOptions  # noqa: E402
from vllm_retrieval_spec.paths import cache_root  # noqa: E402
from vllm_retrieval_spec.proposers.registry import registered_proposer  # noqa: E402
from vllm_retrieval_spec.validation import require_ints  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

RESULTS = Path(__file__).resolve().parent / "results"
# --model: the checkpoint (converted from its GGUF on first use) and the name the report gives it.
MODELS = {"smollm2": (ensure_smollm2_checkpoint, "SmolLM2-135M-Instruct (float32)"),
          "gemma3": (ensure_gemma3_checkpoint, "Gemma-3-270m (float32)")}
INDIST_STORE = cache_root() / "datastores" / "stdlib-answers"
LEARNED_DENSE_DIR = cache_root() / "learned-dense" / "acceptance"  # dresd_learned_saved_k32's snapshots
INDIST_DENSE_STORE = cache_root() / "dense-datastores" / "stdlib-answers-dense"


# Prompts answered for each store of the size curve: the first 320, 1,280 and 2,062 are the standard
# library's (stdlib_prompts.py --count 1031 --form both); the 5,400 after them installed packages'
# (--root site-packages --count 2700 --form both --max-prompt-chars 1500).
ANSWER_STORE_PROMPTS = (320, 1280, 2062, 7462)


def answers_store(prompts: int, dense: bool = False) -> Path:
    """The store-size curve's REST (or dense) store of the answers to the first ``prompts`` prompts."""
    if dense:
        return cache_root() / "dense-datastores" / f"stdlib-answers-{prompts}-dense"
    return cache_root() / "datastores" / f"stdlib-answers-{prompts}"


def _ours(proposer: str, k: int, **options) -> dict:
    return {
        "speculative_config": {"model": f"vllm_retrieval_spec.{proposer}", "num_speculative_tokens": k},
        "additional_config": {"retrieval_spec": options} if options else None,
    }


def _suffix(k: int) -> dict:
    """vLLM ``suffix`` drafting up to ``k`` tokens: its trees as deep (24 by default, which is also
    its default ``num_speculative_tokens``), so that ``k`` and not the tree caps its drafts."""
    return {"speculative_config": {"method": "suffix", "num_speculative_tokens": k,
                                   "suffix_decoding_max_tree_depth": max(k, 24)},
            "requires": "arctic_inference"}


def ngram_config(k: int) -> dict:
    """vLLM ``ngram`` drafting up to ``k`` tokens from 1- to 4-token matches of the context."""
    return {"speculative_config": {"method": "ngram", "num_speculative_tokens": k,
                                   "prompt_lookup_min": 1, "prompt_lookup_max": 4}}


# Our sampler drafting nothing, the reference of seeded runs (--seed) and our engine's steps without
# drafts: a chain goes on only where a node's calibrated chance reaches min_ratio, and the
# calibration's chances stop at 0.99. (budget_margin 10 alone still drafted 0.62 tokens a
# request-step, 80% accepted, on chat HumanEval at 1 in flight: copies whose nodes beat 0.7.)
NEVER_DRAFT = {"budget": "auto", "min_ratio": 1.0}
SEEDED_REFERENCE = "rest_k8_never_drafts"
CONFIGS: dict[str, dict] = {
    "none": {},
    SEEDED_REFERENCE: _ours("RestProposer", 8, **NEVER_DRAFT),
    "none_again": {},  # no speculation once more, last: how much the machine drifted during the run
    # Our proposers run with budget "auto" (the default); *_fixed always drafts up to K.
    "prompt_lookup_k8": _ours("PromptLookupProposer", 8),
    "prompt_lookup_k8_fixed": _ours("PromptLookupProposer", 8, budget="fixed"),
    "rest_k8": _ours("RestProposer", 8),
    "rest_k8_fixed": _ours("RestProposer", 8, budget="fixed"),
    "rest_tree_k16": _ours("RestProposer", 16, tree=True),
    "rest_tree_k16_fixed": _ours("RestProposer", 16, tree=True, budget="fixed"),
    "ngrammys_tree_k16": _ours("NGrammysProposer", 16, tree=True),
    # Temperature > 0: candidates drawn from the drafter's q and verified by MCSS (default: deterministic).
    "rest_k8_sampled": _ours("RestProposer", 8, candidates="sampled"),
    "rest_tree_k16_sampled": _ours("RestProposer", 16, tree=True, candidates="sampled"),
    "rest_tree_k16_sampled_replacement": _ours("RestProposer", 16, tree=True, candidates="sampled",
                                               candidate_replacement=True),
    "rest_datastore_k8": _ours("RestProposer", 8, use_context=False),
    "rest_context_k8": _ours("RestProposer", 8, use_datastore=False),
    "rest_context_k32": _ours("RestProposer", 32, use_datastore=False),
    # Without the indexes of served requests (finished and in flight): what they hold, e.g. in memory.
    "rest_k32_no_indexes": _ours("RestProposer", 32, use_output_index=False, use_live_index=False),
    # Each source of REST off in turn, and how many continuations of each it merges (defaults: datastore 128,
    # context 64, output index 64, requests in flight 2).
    "rest_k32_no_live": _ours("RestProposer", 32, use_live_index=False),
    "rest_k32_no_output": _ours("RestProposer", 32, use_output_index=False),
    **{f"rest_k32_live_m{m}": _ours("RestProposer", 32, live_max_matches=m) for m in (1, 4, 8, 16)},
    "rest_k32_live_m16_w025": _ours("RestProposer", 32, live_max_matches=16, live_weight=0.25),
    **{f"rest_k32_out_m{m}": _ours("RestProposer", 32, output_max_matches=m) for m in (8, 16)},
    **{f"rest_k32_ds_m{m}": _ours("RestProposer", 32, max_matches=m) for m in (16, 32)},
    "rest_k32_ctx_m8": _ours("RestProposer", 32, context_max_matches=8),
    # A chain stops where a node's calibrated chance given its parent falls below min_ratio (default 0.1).
    **{f"rest_k32_min_ratio_0{r}": _ours("RestProposer", 32, min_ratio=r / 10) for r in (2, 3, 5)},
    # The budget's margin on each kept node's cost (default 0.05).
    "rest_k32_margin0": _ours("RestProposer", 32, budget_margin=0.0),
    **{f"rest_k32_margin{m}": _ours("RestProposer", 32, budget_margin=m / 100) for m in (25, 50, 100)},
    # Chances from the calibration's buckets alone, without each token's factor (default on since 2026-11-30).
    "rest_k32_no_token_factors": _ours("RestProposer", 32, budget_token_factors=False),
    # Context continuations stop at the end of the context, also in a loop (context_loops, default on since
    # 2026-12-01).
    "rest_k32_no_context_loops": _ours("RestProposer", 32, context_loops=False),
    # its context occurrences ranked by the target's hidden states (the nearest counts v times)
    **{f"rest_k32_votes{v}": _ours("RestProposer", 32, context_state_votes=v) for v in (2, 4)},
    # The longest suffix of the context (and datastore query) tried (default 16).
    **{f"rest_k32_n_max{n}": _ours("RestProposer", 32, n_max=n) for n in (32, 64)},
    # vLLM's oneDNN GEMM on every step instead of the skinny GEMM (cpu_gemm_max_rows, default 32).
    "rest_k32_vllm_gemm": _ours("RestProposer", 32, cpu_gemm_max_rows=0),
    # The full language-model head on every step instead of the screened one (cpu_screened_head, default on).
    "rest_k32_full_head": _ours("RestProposer", 32, cpu_screened_head=False),
    # vLLM's own decoder-layer forwards instead of the lean ones (cpu_lean_layers, default on).
    "rest_k32_vllm_layers": _ours("RestProposer", 32, cpu_lean_layers=False),
    # ... and the skinny GEMM up to 32 rows named whatever the default, 48 or 96 (8 in flight drafting up to 3, 5
    # or 11 tokens each stay on it).
    **{f"rest_k32_gemm{rows}": _ours("RestProposer", 32, cpu_gemm_max_rows=rows) for rows in (32, 48, 96)},
    # vLLM's attention kernel on every step instead of the plugin's (cpu_step_attention, default true since
    # 2026-11-29, on every causal step; before, opt-in on verification steps: the files of that date and
    # before name it "rest_k32_step_attention", and "rest_k32_vllm_attention" the A/B partner with it off).
    "rest_k32_vllm_attention": _ours("RestProposer", 32, cpu_step_attention=False),
    "rest_k32_native_norms": _ours("RestProposer", 32, cpu_fused_norms=False),
    # ... all three off: REST's drafts verified on vLLM's own CPU path, as `none` and `suffix` run (how much of the
    # lead over them is the drafts and how much the plugin's kernels).
    "rest_k32_vllm_kernels": _ours("RestProposer", 32, cpu_gemm_max_rows=0, cpu_step_attention=False,
                                   cpu_fused_norms=False),
    "ngrammys_k8": _ours("NGrammysProposer", 8),
    # Tree verification: the node budget is num_speculative_tokens.
    **{f"rest_tree_k{k}": _ours("RestProposer", k, tree=True) for k in (8, 16, 32, 64)},
    **{f"ngrammys_tree_k{k}": _ours("NGrammysProposer", k, tree=True) for k in (8, 16, 32, 64)},
    # Chains at the tree node budgets (tokens/s of tree vs chain at the same budget).
    **{f"rest_k{k}": _ours("RestProposer", k) for k in (16, 32, 64)},
    # rest_k32 again under another name (--interleave builds one engine per name): the spread between two
    # engines of one run that draft the same, against which a ratio between two configs is read.
    "rest_k32_twin": _ours("RestProposer", 32),
    # Deep drafts (continuations as long as K by default) always drafted up to K.
    **{f"rest_k{k}_fixed": _ours("RestProposer", k, budget="fixed") for k in (2, 3, 4, 16, 32, 64)},
    **{f"rest_tree_k{k}_fixed": _ours("RestProposer", k, tree=True, budget="fixed") for k in (32, 64)},
    # DReSD: dense neighbours merged with the context (default) or alone (use_context false).
    "dresd_k8": _ours("DReSDProposer", 8),
    "dresd_alone_k8": _ours("DReSDProposer", 8, use_context=False),
    "dresd_tree_k16": _ours("DReSDProposer", 16, tree=True),
    # Hybrid: REST's sources and the dense neighbours in one trie, each source calibrated on its own.
    "hybrid_k32": _ours("HybridProposer", 32),
    "hybrid_tree_k32": _ours("HybridProposer", 32, tree=True),
    # ... and with the dense index learned from served traffic (DReSD's in-distribution store, grown while serving).
    "hybrid_learned_k32": _ours("HybridProposer", 32, dense_learned_positions=65_536),
    # ... probing 16 of the store's IVF lists instead of its 64 (a search ~6x cheaper at 8 in flight).
    "hybrid_learned_k32_np16": _ours("HybridProposer", 32, dense_learned_positions=65_536, dense_nprobe=16),
    "dresd_k32": _ours("DReSDProposer", 32),
    # The DReSD paper's draft shapes (neighbours x value tokens): its best sampling one 10 x 10, its
    # best greedy one 3 x 20 (python-code-dense-long: the default store's positions, 20-token values).
    "dresd_k32_10x10": _ours("DReSDProposer", 32, dense_neighbours=10),
    "dresd_k32_3x20": _ours("DReSDProposer", 32, dense_datastore="python-code-dense-long", dense_neighbours=3),
    "dresd_k32_32x20": _ours("DReSDProposer", 32, dense_datastore="python-code-dense-long"),
    "dresd_learned_k32": _ours("DReSDProposer", 32, dense_learned_positions=65_536),
    "dresd_learned_k32_np16": _ours("DReSDProposer", 32, dense_learned_positions=65_536, dense_nprobe=16),
    # ... kept on disk (LEARNED_DENSE_DIR): a run restores what the previous run of this config learned.
    "dresd_learned_saved_k32": _ours("DReSDProposer", 32, dense_learned_positions=65_536,
                                     dense_learned_path=str(LEARNED_DENSE_DIR)),
    # REST datastore-only on DReSD's default corpus (datastore build --recipe python-code-dense).
    "rest_datastore_same_k8": _ours("RestProposer", 8, use_context=False, datastore="python-code-dense"),
    # In-distribution stores: the model's own answers to standard-library prompts, built by the
    # `datastore from-server` command of docs/datastores.md into the cache (INDIST_STORE, INDIST_DENSE_STORE).
    "rest_indist_k8": _ours("RestProposer", 8, datastore=str(INDIST_STORE)),
    "rest_datastore_indist_k8": _ours("RestProposer", 8, use_context=False, datastore=str(INDIST_STORE)),
    "dresd_indist_k8": _ours("DReSDProposer", 8, dense_datastore=str(INDIST_DENSE_STORE)),
    "dresd_alone_indist_k8": _ours("DReSDProposer", 8, use_context=False, dense_datastore=str(INDIST_DENSE_STORE)),
    # The store-size curve (issue 25 item 2): `datastore from-server` without --url on the first N of
    # the standard-library prompts (both forms), REST's store from the transcripts and DReSD's from
    # the states captured while answering; each source alone (no context, output or live index).
    **{f"rest_store_only_answers{n}_k8": _ours("RestProposer", 8, use_context=False, use_output_index=False,
                                                use_live_index=False, datastore=str(answers_store(n)))
       for n in ANSWER_STORE_PROMPTS},
    **{f"dresd_alone_answers{n}_k8": _ours("DReSDProposer", 8, use_context=False,
                                            dense_datastore=str(answers_store(n, dense=True)))
       for n in ANSWER_STORE_PROMPTS},
    # Hybrid with a captured store as its dense source (REST's default datastore and sources): the
    # 2,062 prompts' (hybrid_answers_k32), or the first N's.
    "hybrid_answers_k32": _ours("HybridProposer", 32, dense_datastore=str(answers_store(2062, dense=True))),
    **{f"hybrid_answers{n}_k32": _ours("HybridProposer", 32, dense_datastore=str(answers_store(n, dense=True)))
       for n in ANSWER_STORE_PROMPTS},
    # ... with 8 neighbours of 16 probed lists: a cheaper search, fewer dense continuations in the trie.
    "hybrid_answers1280_k32_lean": _ours("HybridProposer", 32, dense_datastore=str(answers_store(1280, dense=True)),
                                         dense_neighbours=8, dense_nprobe=16),
    "ngram_k4": ngram_config(4),
    "ngram_k8": ngram_config(8),
    "suffix": {"speculative_config": {"method": "suffix"}, "requires": "arctic_inference"},
    # suffix at other caps (its default is 24): the best K of suffix for a row's comparison.
    **{f"suffix_k{k}": _suffix(k) for k in (8, 16, 32, 64)},
}
DEFAULT_CONFIGS = ["none", "rest_k8", "rest_datastore_k8", "rest_context_k8", "ngram_k4", "ngram_k8", "suffix"]


def is_ours(config: dict) -> bool:
    """Whether ``config`` runs one of our proposers (and so our sampler)."""
    return str((config.get("speculative_config") or {}).get("model", "")).startswith("vllm_retrieval_spec.")


def with_options(config: dict, options: dict) -> dict:
    """``config`` with ``options`` added to its ``retrieval_spec`` section (our proposers only)."""
    if not options or not is_ours(config):
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


def base_config(name: str) -> str:
    """The config a run label names: ``rest_k32@2`` is ``rest_k32`` run a second time."""
    return name.split("@", 1)[0]


def configured(model: Path, name: str, args: argparse.Namespace) -> tuple[dict, EngineSpec]:
    """A config with the run's ``--option``s, and the engine that runs it."""
    seeded_reference = NEVER_DRAFT if name == SEEDED_REFERENCE else {}
    config = with_options(CONFIGS[base_config(name)], {**dict(args.option), **seeded_reference})
    return config, EngineSpec(model, config.get("speculative_config"), config.get("additional_config"),
                              max_num_seqs=max(args.concurrency, 1))


def ensure_recipe_datastores(model: Path, names: list[str], args: argparse.Namespace) -> None:
    """Build once (into the cache), for ``model``'s tokenizer, every recipe datastore that a config's
    proposer opens at start (its ``datastore`` option naming a recipe, not a directory): the
    proposers refuse a recipe store that is not built yet."""
    recipes = []
    for name in names:
        config, _ = configured(model, name, args)
        proposer = registered_proposer((config.get("speculative_config") or {}).get("model"))
        options = RetrievalSpecOptions.from_additional_config(config.get("additional_config"))
        if (proposer and "datastore" in proposer.store_options and options.use_datastore
                and as_directory(options.datastore) is None):
            recipes.append(options.datastore)
    for recipe in dict.fromkeys(recipes):
        ensure_recipe_store(recipe, model)


def request_seeds(prompts: list[str], args: argparse.Namespace) -> list[int] | None:
    return None if args.seed is None else [args.seed + i for i in range(len(prompts))]


def sampling_of(args: argparse.Namespace) -> dict:
    return {"temperature": args.temperature, "top_p": args.top_p}


def warm_up(llm, prompts: list[str], args: argparse.Namespace) -> None:
    seeds = request_seeds(prompts, args)
    generate(llm, prompts[:1], 8, seeds=seeds and seeds[:1], **sampling_of(args))


def prefill_seconds(llm, prompts: list[str], args: argparse.Namespace) -> float:
    """Seconds ``llm`` takes to prefill ``prompts`` (one token each, ``--concurrency`` at a time)
    with its prefix cache emptied first."""
    llm.reset_prefix_cache()
    seeds = request_seeds(prompts, args)
    return generate(llm, prompts, 1, concurrency=args.concurrency, seeds=seeds, **sampling_of(args)).seconds


def run_config(model: Path, name: str, prompts: list[str], args: argparse.Namespace) -> dict:
    config, spec = configured(model, name, args)
    llm = build_llm(spec)
    try:
        keep_step_log(llm, args)
        warm_up(llm, prompts, args)
        runs = [generate(llm, prompts, args.max_tokens, concurrency=args.concurrency,
                         seeds=request_seeds(prompts, args), **sampling_of(args)) for _ in range(args.repeats)]
        budget = budget_report(llm, args.concurrency)
        prefill = prefill_seconds(llm, prompts, args) * args.repeats if args.prefill else None
    finally:
        shutdown_llm(llm)
    return config_result(name, config, runs, budget, prefill)


def run_interleaved(model: Path, names: list[str], prompts: list[str], args: argparse.Namespace) -> list[dict]:
    """Every config's engine at once, the prompts in groups of ``--concurrency`` run by every
    engine in turn (in balanced orders from group to group), so that the machine's drift falls
    on every config alike; each pass over the prompts (``--repeats``) counts as one run."""
    configs = {name: configured(model, name, args) for name in names}
    engines = {}
    try:
        for name in names:
            engines[name] = build_llm(configs[name][1])
            keep_step_log(engines[name], args)
            warm_up(engines[name], prompts, args)
        seeds = request_seeds(prompts, args)
        groups: dict[str, list[list[GenerationRun]]] = {name: [] for name in names}
        size = max(args.concurrency, 1)
        turns = list(interleaved_turns(names, len(prompts), size))
        with tqdm(total=len(turns) * args.repeats, desc="groups run by an engine", unit="group") as progress:
            for _ in range(args.repeats):
                for name in names:
                    groups[name].append([])
                for start, name in turns:
                    groups[name][-1].append(generate(
                        engines[name], prompts[start:start + size], args.max_tokens, concurrency=args.concurrency,
                        seeds=seeds and seeds[start:start + size], **sampling_of(args)))
                    progress.update()
        budgets = {name: budget_report(llm, args.concurrency) for name, llm in engines.items()}
        prefill = dict.fromkeys(names, None)
        if args.prefill:
            prefill = dict.fromkeys(names, 0.0)
            for start, name in interleaved_turns(names, len(prompts), size):
                prefill[name] += prefill_seconds(engines[name], prompts[start:start + size], args) * args.repeats
    finally:
        for llm in engines.values():
            shutdown_llm(llm)
    return [config_result(name, configs[name][0], [joined(runs) for runs in groups[name]], budgets[name],
                          prefill[name], [run for runs in groups[name] for run in runs]) for name in names]


def interleaved_turns(names: list[str], num_prompts: int, size: int) -> Iterator[tuple[int, str]]:
    """``(first prompt of a group, config)`` in the order ``--interleave`` runs them: groups of
    ``size`` prompts, each run by every config in turn, in the orders of :func:`balanced_orders`
    from group to group."""
    orders = balanced_orders(len(names))
    for index, start in enumerate(range(0, num_prompts, size)):
        for position in orders[index % len(orders)]:
            yield start, names[position]


def balanced_orders(count: int) -> list[list[int]]:
    """Orders of ``count`` configs in which each runs at each place once and right after each
    other config equally often (a Williams design; ``2 * count`` orders when ``count`` is odd). A
    rotation kept each config right after the same one in every group, so whatever a run leaves
    behind for the next fell on one config alone."""
    first, low, high = [0], 1, count - 1
    while low <= high:
        first.append(low)
        low += 1
        if low <= high:
            first.append(high)
            high -= 1
    orders = [[(place + shift) % count for place in first] for shift in range(count)]
    return orders if count % 2 == 0 else orders + [order[::-1] for order in orders]


def joined(runs: list[GenerationRun]) -> GenerationRun:
    """Consecutive runs over consecutive prompts as one run."""
    return GenerationRun([record for run in runs for record in run.records],
                         sum((run.counters for run in runs), SpecDecodeCounters()), sum(run.seconds for run in runs),
                         sum(run.stolen_seconds for run in runs))


def config_result(name: str, config: dict, runs: list[GenerationRun], budget: dict | None,
                  prefill: float | None = None, groups: list[GenerationRun] | None = None) -> dict:
    """What a report holds of one config's runs (``output_ids``: the first run's, to compare),
    given the seconds it took to ``prefill`` their prompts alone, its tokens/s beyond them, and
    the tokens and seconds of each of its interleaved ``groups`` of prompts."""
    records = [record for run in runs for record in run.records]
    counters = sum((run.counters for run in runs), SpecDecodeCounters())
    summary = summarize(records, counters)
    seconds = sum(run.seconds for run in runs)
    return {
        "config": name,
        "speculative_config": config.get("speculative_config"),
        "additional_config": config.get("additional_config"),
        **summary.as_dict(),
        "seconds": seconds,
        "tokens_per_second": summary.generated_tokens / seconds,
        "prefill_seconds": prefill,
        "tokens_per_second_beyond_prefill": None if prefill is None else
        summary.generated_tokens / max(seconds - prefill, 1e-9),
        "draft_tokens_per_request_step": summary.draft_tokens / max(summary.decode_steps, 1),
        "accepted_tokens_per_request_step": summary.accepted_tokens / max(summary.decode_steps, 1),
        "drafting_ms_per_step": drafting_ms_per_step(budget),
        **intervals(runs),
        "group_generated_tokens": None if groups is None else [run.generated_tokens for run in groups],
        "group_seconds": None if groups is None else [run.seconds for run in groups],
        "stolen_cpu_seconds": sum(run.stolen_seconds for run in runs),
        "group_stolen_cpu_seconds": None if groups is None else [run.stolen_seconds for run in groups],
        "request_generated_tokens": [len(r.output_ids) for r in records],
        "request_decode_steps": [r.decode_steps for r in records],
        "budget": budget,
        "output_ids": [r.output_ids for r in runs[0].records],
    }


T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # by degrees of freedom


def intervals(runs: list) -> dict:
    """95% intervals: the honest figure bootstrapped over requests (:func:`bootstrap_picks`);
    tokens/s and the acceptance rate over the repeats (t interval; None with one run); the
    honest figure of each repeat (does a learning drafter get better as the prompts cycle?)."""
    generated = np.array([len(r.output_ids) for run in runs for r in run.records], dtype=float)
    steps = np.array([r.decode_steps for run in runs for r in run.records], dtype=float)
    honest = resampled_ratios(generated - 1, steps, bootstrap_picks(len(steps)))
    per_run = {
        "tokens_per_second": [run.generated_tokens / run.seconds for run in runs],
        "acceptance_rate": [run.counters.accepted_tokens / run.counters.draft_tokens
                            for run in runs if run.counters.draft_tokens],
    }
    out = {"honest_ci95": np.quantile(honest, [0.025, 0.975]).tolist(),
           "honest_per_repeat": [sum(len(r.output_ids) - 1 for r in run.records)
                                 / max(sum(r.decode_steps for r in run.records), 1) for run in runs]}
    for key, values in per_run.items():
        out[f"{key}_ci95"] = t_interval(values)
    return out


def t_interval(values: list[float]) -> list[float] | None:
    """The 95% t interval of the mean (None below two values)."""
    if len(values) < 2:
        return None
    half = T_975.get(len(values) - 1, 1.96) * float(np.std(values, ddof=1)) / np.sqrt(len(values))
    return [float(np.mean(values) - half), float(np.mean(values) + half)]


def drafting_ms_per_step(budget: dict | None) -> float | None:
    """Our drafter's search and drafting time per step that drafted (budget auto only)."""
    if budget is None or not budget["stats"]["steps"]:
        return None
    return budget["stats"]["drafting_seconds"] / budget["stats"]["steps"] * 1e3


def budget_of(drafter):
    """``drafter``'s goodput budget (None: not our proposer, or budget fixed)."""
    return getattr(getattr(drafter, "session", None), "budget", None)


def keep_step_log(llm, args: argparse.Namespace) -> None:
    """With ``--step-log``: ``llm``'s cost model keeps the steps it observes, for the report."""
    budget = budget_of(drafter_of(llm))
    if args.step_log and budget is not None:
        budget.cost.keep_step_log()


def budget_report(llm, concurrency: int) -> dict | None:
    """The goodput budget's counters, calibration buckets and learned cost curve (budget auto),
    and the steps its cost model observed if it kept them (``--step-log``)."""
    drafter = drafter_of(llm)
    budget = budget_of(drafter)
    if budget is None:
        return None
    gate = getattr(drafter, "gate", None)  # Hybrid's search gate
    cost = budget.cost
    return {
        "stats": vars(budget.stats),
        "cost_coefficients_seconds": cost.coefficients.tolist(),
        "cost_prediction_error": cost.error.report(),
        "cost_curve": cost.curve(concurrency),
        "calibration": budget.calibration.report(),
        **({} if gate is None else {"search_gate": gate.report()}),
        **({} if cost.step_log is None else {"cost_kernel_rows": cost.kernel_rows,
                                             "step_log": [list(step) for step in cost.step_log]}),
    }


def benchmark_prompts(model: Path, form: str, args: argparse.Namespace) -> list[str]:
    """The first ``--prompts`` prompts of ``--dataset``, else of HumanEval in ``form``."""
    if args.dataset is None and form == "raw":
        return humaneval_prompts(args.prompts, "raw")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    if args.dataset is None:
        return humaneval_prompts(args.prompts, "chat", tokenizer)
    return dataset_prompts(args.dataset, args.prompts, tokenizer)


def dataset_prompts(path: Path, count: int | None, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The first ``count`` records of a JSONL file: chat ``messages`` rendered with ``tokenizer``'s
    chat template, raw ``prompt`` records as they are."""
    requests = jsonl_requests(path, None, 0)[:count]
    return [r.prompt if r.messages is None else chat_prompts([r.messages], tokenizer)[0] for r in requests]


def benchmark_form(model: Path, form: str, names: list[str], args: argparse.Namespace) -> dict:
    """Every config on the same prompts; the report is written after each config (a long run
    that stops keeps what it measured)."""
    prompts = benchmark_prompts(model, form, args)
    results, outputs = [], []
    report = {"form": form, "prompts": len(prompts), "max_tokens": args.max_tokens,
              "concurrency": args.concurrency, "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed,
              "repeats": args.repeats, "interleaved": args.interleave, "model": MODELS[args.model][1],
              "machine": platform.machine(), "processor_count": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "results": results}
    if args.interleave:
        print(f"[{form}] {', '.join(names)}, interleaved ...", flush=True)
        measured = run_interleaved(model, names, prompts, args)
    else:
        measured = (run_config(model, name, prompts, args) for name in names)
    for name, result in zip(names, measured):
        if not args.interleave:
            print(f"[{form}] {name} done", flush=True)
        outputs.append(result.pop("output_ids"))
        results.append(result)
        compare(results, outputs, repeatable=args.temperature == 0 or args.seed is not None)
        report_path(form, report, args).write_text(json.dumps(report, indent=2) + "\n")
    return report


def compare(results: list[dict], outputs: list[list[list[int]]], repeatable: bool = True) -> None:
    """Ratios to no speculation (the mean of its runs, first and, with --repeat-baseline, last)
    and to vLLM suffix (the mean of its runs), and (greedy or seeded) prompts differing from the same
    engine without drafts: for ours our sampler drafting nothing where it ran (seeded runs), else no
    speculation."""
    suffixes = [r for r in results if base_config(r["config"]) == "suffix"]
    suffix = [r["tokens_per_second"] for r in suffixes]
    beyond = [r["tokens_per_second_beyond_prefill"] for r in suffixes]
    baseline = [r["tokens_per_second"] for r in results if base_config(r["config"]) in ("none", "none_again")]
    names = [r["config"] for r in results]
    ours_reference = outputs[names.index(SEEDED_REFERENCE)] if SEEDED_REFERENCE in names else outputs[0]
    for result, output in zip(results, outputs):
        reference = ours_reference if is_ours(CONFIGS[base_config(result["config"])]) else outputs[0]
        result["speedup_vs_none"] = result["tokens_per_second"] / (sum(baseline) / len(baseline))
        result["speedup_vs_suffix"] = result["tokens_per_second"] / (sum(suffix) / len(suffix)) if suffix else None
        result["speedup_vs_suffix_beyond_prefill"] = (
            result["tokens_per_second_beyond_prefill"] / (sum(beyond) / len(beyond))
            if beyond and None not in beyond and result["tokens_per_second_beyond_prefill"] else None)
        result["prompts_differing_from_none"] = (sum(a != b for a, b in zip(reference, output))
                                                 if repeatable else None)
        result["speedup_vs_suffix_ci95"] = paired_ratio_interval(
            result, suffixes, "group_generated_tokens", "group_seconds")
        result["honest_vs_suffix_ci95"] = paired_ratio_interval(
            result, suffixes, "request_generated_tokens", "request_decode_steps", less_one=True)


def paired_ratio_interval(result: dict, references: list[dict], numerator: str, denominator: str,
                          less_one: bool = False, resamples: int = 1000) -> list[float] | None:
    """95% bootstrap interval of ``result``'s ratio of summed ``numerator`` to summed
    ``denominator`` (``less_one``: each numerator less one) over ``references``' (pooled), units
    resampled together (fixed seed): the interleaved groups of prompts every config ran (tokens
    over seconds: the prompts' spread and the machine's drift between groups, not what falls on
    every config of a group alike), or the requests (generated tokens less the first over decode
    steps: the honest figure). None without the units in every report (or with fewer than two)."""
    runs = [result, *references]
    if not references or any(r.get(denominator) is None for r in runs):
        return None
    shift = 1.0 if less_one else 0.0
    tops = [np.asarray(r[numerator], float) - shift for r in runs]
    bottoms = [np.asarray(r[denominator], float) for r in runs]
    units = len(bottoms[0])
    if units < 2 or any(len(b) != units for b in bottoms):
        return None
    picks = bootstrap_picks(units, resamples)
    ours = resampled_ratios(tops[0], bottoms[0], picks)
    return np.quantile(ours / resampled_ratios(sum(tops[1:]), sum(bottoms[1:]), picks), [0.025, 0.975]).tolist()


def bootstrap_picks(units: int, resamples: int = 1000) -> np.ndarray:
    """``[resamples, units]`` unit indices drawn with replacement (fixed seed)."""
    return np.random.default_rng(0).integers(0, units, (resamples, units))


def resampled_ratios(numerators: np.ndarray, denominators: np.ndarray, picks: np.ndarray) -> np.ndarray:
    """Summed numerators over summed denominators of each resample (row) of ``picks``."""
    return numerators[picks].sum(axis=1) / np.maximum(denominators[picks].sum(axis=1), 1e-9)


def model_tag(model: str) -> str:
    """A report file's name part for ``--model`` (none for SmolLM2, the project's model)."""
    return "" if model == "smollm2" else f"_{model}"


def report_path(form: str, report: dict, args: argparse.Namespace) -> Path:
    tag = model_tag(args.model) + (f"_{args.tag}" if args.tag else "")
    if args.temperature > 0:
        seed = "" if args.seed is None else f"_s{args.seed}"
        tag = f"_T{args.temperature:g}" + (f"_p{args.top_p:g}" if args.top_p < 1 else "") + seed + tag
    return RESULTS / f"acceptance_{form}_n{report['prompts']}_t{args.max_tokens}_c{args.concurrency}{tag}.json"


def print_table(report: dict) -> None:
    header = (f"{'config':22s} {'honest':>7s} {'95% CI':>13s} {'vLLM MAL':>9s} {'accept':>7s} {'drafts':>7s} "
              f"{'acc/st':>6s} {'draft ms':>8s} {'tok/s':>7s} {'95% CI':>13s} {'vs none':>8s} {'vs suffix':>9s} "
              f"{'differ':>7s}")
    print(f"\n{report['form']} prompts: {report['prompts']}, max tokens {report['max_tokens']}, "
          f"concurrency {report['concurrency']}, temperature {report['temperature']}, top-p {report['top_p']}, "
          f"seed {report['seed']}, repeats {report['repeats']}")
    print(header)
    for r in report["results"]:
        mal = f"{r['vllm_mean_acceptance_length']:.2f}" if r["vllm_mean_acceptance_length"] else "-"
        rate = f"{r['acceptance_rate']:.1%}" if r["acceptance_rate"] is not None else "-"
        vs_suffix = f"{r['speedup_vs_suffix']:.2f}x" if r["speedup_vs_suffix"] else "-"
        differ = "-" if r["prompts_differing_from_none"] is None else str(r["prompts_differing_from_none"])
        print(f"{r['config']:22s} {r['honest_tokens_per_step']:7.2f} {_interval(r['honest_ci95']):>13s} "
              f"{mal:>9s} {rate:>7s} {r['draft_tokens_per_request_step']:7.2f} "
              f"{r['accepted_tokens_per_request_step']:6.2f} {_number(r['drafting_ms_per_step'], 2):>8s} "
              f"{r['tokens_per_second']:7.1f} "
              f"{_interval(r['tokens_per_second_ci95'], 1):>13s} {r['speedup_vs_none']:7.2f}x {vs_suffix:>9s} "
              f"{differ:>7s}")
    for r in report["results"]:
        if r.get("speedup_vs_suffix_ci95") and base_config(r["config"]) not in ("none", "none_again", "suffix"):
            print(f"{r['config']:22s} {r['speedup_vs_suffix']:.2f}x suffix, 95% CI "
                  f"{_interval(r['speedup_vs_suffix_ci95'])} over {len(r['group_seconds'])} groups of prompts; "
                  f"honest ÷ suffix's 95% CI {_interval(r['honest_vs_suffix_ci95'])} over requests")
    for r in report["results"]:
        error = (r.get("budget") or {}).get("cost_prediction_error")
        if error and error["steps"]:
            print(f"{r['config']:22s} step cost learned: recent decode steps predicted within "
                  f"{error['mean_absolute']:.1%}, bias {error['bias']:+.1%} (over 0: priced dearer than they ran)")
    print_stolen_time(report)
    for r in report["results"]:
        if r.get("prefill_seconds") is not None:
            ratio = r["speedup_vs_suffix_beyond_prefill"]
            vs_suffix = f", {ratio:.2f}x suffix" if ratio else ""
            print(f"{r['config']:22s} prefill alone {r['prefill_seconds']:.1f} of {r['seconds']:.1f} s; beyond it "
                  f"{r['tokens_per_second_beyond_prefill']:.1f} tok/s{vs_suffix}")


def print_stolen_time(report: dict, notable: float = 0.01) -> None:
    """Each config whose runs lost at least ``notable`` of the machine's CPU time to the
    hypervisor (a shared VM's stalls fall on whichever engine runs then), with its worst group."""
    cores = report["processor_count"] or 1
    for r in report["results"]:
        share = r.get("stolen_cpu_seconds", 0.0) / (r["seconds"] * cores)
        if share < notable:
            continue
        worst = ""
        if r.get("group_stolen_cpu_seconds"):
            shares = [stolen / (seconds * cores)
                      for stolen, seconds in zip(r["group_stolen_cpu_seconds"], r["group_seconds"])]
            group = int(np.argmax(shares))
            worst = f"; most in group {group + 1} ({shares[group]:.0%} of its {r['group_seconds'][group]:.1f} s)"
        print(f"{r['config']:22s} the hypervisor took {share:.1%} of the CPU time of its runs{worst}")


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _interval(bounds: list[float] | None, digits: int = 2) -> str:
    return "-" if bounds is None else f"{bounds[0]:.{digits}f}-{bounds[1]:.{digits}f}"


def resolve_configs(requested: list[str], repeat_baseline: bool, seeded: bool = False) -> list[str]:
    """No speculation first (then, ``seeded``, our sampler drafting nothing), ``requested``, and
    with ``repeat_baseline`` no speculation again."""
    first = ["none", SEEDED_REFERENCE] if seeded else ["none"]
    names = first + [n for n in requested if n not in (*first, "none_again")]
    names += ["none_again"] if repeat_baseline else []
    available = []
    for name in names:
        if base_config(name) not in CONFIGS:
            sys.exit(f"unknown config {name!r}; choose from {', '.join(CONFIGS)} (NAME@2: NAME run again)")
        needed = CONFIGS[base_config(name)].get("requires")
        if needed and importlib.util.find_spec(needed) is None:
            print(f"skipping {name}: it needs `{needed}` (`bash scripts/install-comparators.sh` installs it; "
                  "without it the report has no ratio to suffix)", file=sys.stderr)
            continue
        available.append(name)
    return available


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=40, help="first N prompts (HumanEval: 164 = all)")
    parser.add_argument("--dataset", type=Path, help="JSONL of chat `messages` (or raw `prompt`) records to take "
                        "the prompts from instead of HumanEval, e.g. benchmarks/data/code_edit.jsonl (--form "
                        "is ignored)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight (1 = batch 1)")
    parser.add_argument("--form", choices=["raw", "chat", "both"], default="raw")
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2",
                        help="the target: SmolLM2-135M-Instruct, or Gemma-3-270m (a base model, raw prompts; its "
                             "GGUF package installed by scripts/setup.sh); not smollm2: in the report's name")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS,
                        help=f"from {', '.join(CONFIGS)}; NAME@2 runs NAME again (interleave repeats against "
                             "the machine's drift: speed-ups are against the mean of no speculation's and of "
                             "suffix's runs)")
    parser.add_argument("--option", type=parse_option, action="append", default=[], metavar="KEY=VALUE",
                        help="retrieval_spec option for every config of ours (repeatable), e.g. "
                             "datastore=DIR dense_datastore=DIR for in-distribution stores")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature)")
    parser.add_argument("--seed", type=int, metavar="BASE", help="request i samples with seed BASE + i (with "
                        "--temperature): outputs must then equal no speculation's, as greedy ones")
    parser.add_argument("--repeats", type=int, default=1, help="runs of the prompt set per config (intervals)")
    parser.add_argument("--interleave", action="store_true",
                        help="every config's engine at once, each group of --concurrency prompts run by every engine "
                             "in turn: drift falls on all alike (no NAME@2 repeats or last no-speculation run needed)")
    parser.add_argument("--prefill", action="store_true",
                        help="also time each engine prefilling the prompts alone and report tokens/s beyond that")
    parser.add_argument("--step-log", action="store_true",
                        help="each budget's report holds the steps its cost model observed (step_log), which "
                             "cost_model_replay.py replays through other cost models")
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument("--repeat-baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="run no speculation again at the end; speed-ups are against the mean of both runs")
    args = parser.parse_args()
    if args.seed is not None and args.temperature <= 0:
        parser.error("--seed needs --temperature above 0 (greedy requests ignore seeds)")
    try:
        require_ints({"--prompts": (args.prompts, 1, None), "--max-tokens": (args.max_tokens, 1, None),
                      "--concurrency": (args.concurrency, 1, None), "--repeats": (args.repeats, 1, None)})
    except ValueError as error:
        parser.error(str(error))
    if args.dataset is not None and not args.dataset.is_file():
        parser.error(f"--dataset {args.dataset}: no such file (benchmarks/workloads.py writes the workloads)")

    try:
        model = MODELS[args.model][0]()
    except ModelSourceError as error:  # its package not installed, or a corrupt GGUF: one line, not a traceback
        sys.exit(f"--model {args.model}: {error}")
    names = resolve_configs(args.configs, args.repeat_baseline and not args.interleave, seeded=args.seed is not None)
    if args.interleave:
        names = list(dict.fromkeys(base_config(name) for name in names))  # one engine per config
    ensure_recipe_datastores(model, names, args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    forms = ["raw", "chat"] if args.form == "both" else [args.form]
    for form in [args.dataset.stem] if args.dataset else forms:
        report = benchmark_form(model, form, names, args)
        print_table(report)
        print(f"written: {report_path(form, report, args)}")

if __name__ == "__main__":
    main()
