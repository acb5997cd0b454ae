"""How much of a workload's output a drafter that copies from the request itself could ever draft.

For each output token of the target's greedy outputs (generated once and cached, as
``budget_replay.py`` does), and each ``k``: did the ``k`` tokens before it occur earlier in the
request (prompt and output so far) followed by that token (*any* earlier occurrence: the
ceiling of any context drafter matching ``k`` tokens), and did the *latest* earlier occurrence
predict it (what prompt lookup drafts)? Retrieval from the request cannot draft a token neither
finds, so a workload whose share is low caps what context retrieval (REST's context source,
`suffix`'s prompt tree, prompt lookup) can accept per step; what is left needs other sources
(REST's datastore, its output and live indexes, `suffix`'s tree of earlier outputs).

``--dense`` asks what the target's hidden states could add to copying from the request (DReSD's
idea on the request's own prompt and output), where exact matching continues the wrong earlier
occurrence or answers paraphrase their context. It decodes each output with a chain that copies
from the request, ``DEPTH`` tokens deep, and counts the output tokens a step for each rule of
``CHAIN_RULES``: the latest of the longest earlier matches (prompt lookup's choice); the most
frequent continuation among them (a count-weighted trie's heaviest path); the one among them whose
producing state is nearest the current one (a ranking signal, still one chain); the better of the
latest and the nearest state's continuation among every earlier occurrence of the last token (an
oracle, what a two-branch tree would accept); and the best of the longest matches (an oracle, the
ceiling of any ranking of them). The states are the last hidden states of one float32
transformers forward over prompt and output.

    python benchmarks/copy_ceiling.py --workloads doc_qa multi_turn --prompts 24 --max-tokens 64 128
    python benchmarks/copy_ceiling.py --workloads doc_qa --prompts 24 --max-tokens 128 --dense

Writes results/copy_ceiling.json (``--dense``: results/copy_ceiling_dense.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from budget_replay import RESULTS, workload_traces

from vllm_retrieval_spec.models import ensure_smollm2_checkpoint

ORDERS = (1, 2, 3, 4)
DEPTH = 32  # a chain's draft tokens, REST's recommended num_speculative_tokens
LONGEST_MATCH = 64


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


def longest_matches(tokens: np.ndarray, last: int) -> np.ndarray:
    """The ends of the longest earlier occurrences of the tokens ending at ``last``, in order (the
    first token left out: no state produced it)."""
    ends = earlier_same_token(tokens, last)
    for length in range(1, LONGEST_MATCH):
        longer = ends[ends >= length]
        longer = longer[tokens[longer - length] == tokens[last - length]]
        if longer.size == 0:
            break
        ends = longer
    return ends


def earlier_same_token(tokens: np.ndarray, last: int) -> np.ndarray:
    """The positions after the first before ``last`` that hold ``tokens[last]``."""
    return np.nonzero(tokens[1:last] == tokens[last])[0] + 1


def nearest_state(ends: np.ndarray, states: np.ndarray, last: int) -> int:
    """Of the earlier positions ``ends``, the one whose producing state is nearest ``last``'s."""
    return int(ends[np.argmax(states[ends - 1] @ states[last - 1])])


def agreeing(draft: np.ndarray, tokens: np.ndarray, last: int) -> int:
    """How many of ``draft``'s tokens the tokens after ``last`` repeat."""
    truth = tokens[last + 1:last + 1 + DEPTH]
    size = min(draft.size, truth.size)
    differ = np.nonzero(draft[:size] != truth[:size])[0]
    return int(differ[0]) if differ.size else size


def continuation(tokens: np.ndarray, end: int) -> np.ndarray:
    """The ``DEPTH`` tokens after position ``end``: what copying from there drafts."""
    return tokens[end + 1:end + 1 + DEPTH]


def most_frequent_path(tokens: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The continuation a trie of ``ends``' continuations weighted by their counts drafts."""
    paths = [continuation(tokens, int(end)) for end in ends]
    draft: list[int] = []
    while paths := [path for path in paths if path.size > len(draft)]:
        values, counts = np.unique([path[len(draft)] for path in paths], return_counts=True)
        draft.append(int(values[np.argmax(counts)]))
        paths = [path for path in paths if path[len(draft) - 1] == draft[-1]]
    return np.asarray(draft, tokens.dtype)


def accepted_by(rule: str, tokens: np.ndarray, states: np.ndarray, last: int) -> int:
    """The draft tokens ``rule`` (one of ``CHAIN_RULES``) gets accepted after ``last``."""
    ends = longest_matches(tokens, last)
    if ends.size == 0:
        return 0
    if rule == "latest":
        return agreeing(continuation(tokens, int(ends[-1])), tokens, last)
    if rule == "most_frequent":
        return agreeing(most_frequent_path(tokens, ends), tokens, last)
    if rule == "nearest_state":
        return agreeing(continuation(tokens, nearest_state(ends, states, last)), tokens, last)
    if rule == "latest_or_dense":
        nearest = nearest_state(earlier_same_token(tokens, last), states, last)
        return max(agreeing(continuation(tokens, end), tokens, last) for end in (int(ends[-1]), nearest))
    return max(agreeing(continuation(tokens, int(end)), tokens, last) for end in ends)


CHAIN_RULES = ("latest", "most_frequent", "nearest_state", "latest_or_dense", "best_of_longest")


def chain_steps(tokens: np.ndarray, first_output: int, states: np.ndarray) -> dict[str, int]:
    """The steps a chain copying from the request takes over ``tokens[first_output:]`` with each
    rule of ``CHAIN_RULES`` (one accepted prefix and one token more a step)."""
    steps = dict.fromkeys(CHAIN_RULES, 0)
    for rule in CHAIN_RULES:
        last = first_output
        while last < tokens.size - 1:
            last += accepted_by(rule, tokens, states, last) + 1
            steps[rule] += 1
    return steps


def dense_ceiling(model_path: Path, traces: list) -> dict[str, float]:
    """Output tokens a step of each rule of ``chain_steps`` over all traces, on their normalised
    last hidden states."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    totals: dict[str, int] = defaultdict(int)
    for trace in tqdm(traces, desc="dense ceiling"):
        tokens = np.asarray(list(trace.prompt_ids) + list(trace.output_ids))
        with torch.no_grad():
            states = model(torch.from_numpy(tokens)[None], output_hidden_states=True).hidden_states[-1][0].numpy()
        states /= np.linalg.norm(states, axis=1, keepdims=True)
        for name, count in chain_steps(tokens, len(trace.prompt_ids), states).items():
            totals[name] += count
    outputs = sum(len(trace.output_ids) - 1 for trace in traces)
    return {f"chain_{rule}": outputs / max(totals[rule], 1) for rule in CHAIN_RULES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["doc_qa", "multi_turn"])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[64, 128],
                        help="new tokens per workload (one value, or one per workload)")
    parser.add_argument("--dense", action="store_true",
                        help="also the tokens a step of a copying chain by each rule of CHAIN_RULES, some on the "
                             "target's hidden states (one transformers forward per prompt)")
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
                     "output_tokens": sum(weights), **mean, **(dense_ceiling(model, traces) if args.dense else {})})
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "workloads": rows}
    name = "copy_ceiling_dense.json" if args.dense else "copy_ceiling.json"
    (RESULTS / name).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'workload':14s} {'outputs':>8s} " + " ".join(f"{'any/latest k' + str(k):>17s}" for k in ORDERS))
    for row in rows:
        cells = " ".join(f"{row[f'any_k{k}']:8.2f}/{row[f'latest_k{k}']:<8.2f}" for k in ORDERS)
        print(f"{row['workload']:14s} {row['output_tokens']:8d} {cells}")
        if args.dense:
            print(f"{'':14s} copying chain, tokens a step: " + ", ".join(
                f"{rule} {row[f'chain_{rule}']:.2f}" for rule in CHAIN_RULES))
    print(f"written: {RESULTS / name}")


if __name__ == "__main__":
    main()
