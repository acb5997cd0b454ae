"""REST with its goodput budget against vLLM ``suffix``, replayed offline on the target's greedy outputs.

With greedy verification a draft's accepted length is fixed by the output the model produces
anyway, so the whole drafting loop can be replayed without the model: the target's greedy
outputs of a workload are generated once (in-process vLLM, fp32; cached), then requests are
decoded in lock step, ``--concurrency`` at a time (a finished request's slot takes the next):
REST through the real kernel, goodput budget (calibration, cost model, chooser), output
index and live index, exactly as the proposer drives them, and Arctic Inference's
``SuffixDecodingCache`` as vLLM's ``suffix`` method drives it. A step's time is simulated with a
fixed linear cost (``COSTS``: a step, a request and a draft token's seconds at 1 and at 8 in
flight; the budget's cost model knows it exactly) plus the measured drafting time, so the figures isolate
what the drafts and the budget's choices are worth; acceptance.py measures the real thing.
Minutes instead of an hour per comparison: how the calibration traps and the whole-batch margin
were found. It leaves out the engine's own dynamics (a learned step cost, prefills, arrivals):
confirm a change on the engine (a first-token-only request factor won here and lost there).

    python benchmarks/budget_replay.py --workloads code_edit humaneval_chat --concurrency 1 8
    python benchmarks/budget_replay.py --prior-strengths 2 8 --tag strength   # REST once per prior strength
    python benchmarks/budget_replay.py --same-states   # REST's drafts against suffix's from the same states
    python benchmarks/budget_replay.py --concurrency 1 --datastore STORE_DIR   # REST on another datastore
    python benchmarks/budget_replay.py --workloads multi_turn --concurrency 8 --first-draft-ms 0.5 50
        # REST once per drafting time its budget sees at the first step (whether the first step drafts)
    python benchmarks/budget_replay.py --token-factors on off   # REST with and without tokens' factors
    python benchmarks/budget_replay.py --context-state-votes 0 4   # REST's context occurrences by hidden state
    python benchmarks/budget_replay.py --workloads doc_qa --concurrency 1 --prompts 24 --warm-up 96
        # both drafters after 96 earlier requests of the workload (a server that has served a while)

Writes results/budget_replay_c<concurrency>[_<tag>].json (``--same-states``:
results/budget_replay_same_states[_<tag>].json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_retrieval_spec.compat import configure_vllm_environment

configure_vllm_environment(in_process=True)

import numpy as np  # noqa: E402

from vllm_retrieval_spec.datastores.context_states import ContextStates  # noqa: E402
from vllm_retrieval_spec.datastores.dense_builder import last_hidden_states, load_target_model  # noqa: E402
from vllm_retrieval_spec.datastores.format import DatastoreError  # noqa: E402
from vllm_retrieval_spec.datastores.live_index import LiveIndex  # noqa: E402
from vllm_retrieval_spec.datastores.output_index import OutputIndex  # noqa: E402
from vllm_retrieval_spec.datastores.resolve import open_datastore_for_model  # noqa: E402
from vllm_retrieval_spec.drafts import DraftNodes  # noqa: E402
from vllm_retrieval_spec.evaluation.replay import GreedyTrace  # noqa: E402
from vllm_retrieval_spec.evaluation.traces import cached_traces  # noqa: E402
from vllm_retrieval_spec.goodput import GoodputBudget, StepCostModel  # noqa: E402
from vllm_retrieval_spec.goodput.calibration import AcceptanceCalibration  # noqa: E402
from vllm_retrieval_spec.goodput.cost_model import PRIORS  # noqa: E402
from vllm_retrieval_spec.goodput.token_factor import TokenFactor  # noqa: E402
from vllm_retrieval_spec.kernels.rest import RestParams, rest_retrieve  # noqa: E402
from vllm_retrieval_spec.models import ensure_smollm2_checkpoint  # noqa: E402
from vllm_retrieval_spec.options import RetrievalSpecOptions  # noqa: E402
from vllm_retrieval_spec.paths import cache_root  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DATA = Path(__file__).resolve().parent / "data"
SUFFIX_DEPTH = 24  # vLLM's suffix_decoding_max_tree_depth (and its num_speculative_tokens)
# Seconds (step, per request, per draft token) fitted to acceptance.py runs on the 2-core CPU.
COSTS = {1: (0.042, 0.0, 0.0022), 8: (0.034, 0.007, 0.0032)}


@dataclass
class Tally:
    """What one replay drafted, accepted and spent."""

    request_steps: int = 0
    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0
    drafting_seconds: float = 0.0
    engine_steps: int = 0

    def row(self, name: str) -> dict:
        steps = max(self.request_steps, 1)
        return {"config": name, "honest_tokens_per_step": self.generated / steps,
                "drafted_per_request_step": self.drafted / steps, "accepted_per_request_step": self.accepted / steps,
                "acceptance_rate": self.accepted / max(self.drafted, 1),
                "drafting_ms_per_step": 1000 * self.drafting_seconds / max(self.engine_steps, 1),
                "simulated_tokens_per_second": self.generated / max(self.seconds, 1e-9)}


def accepted_prefix(draft: list[int], expected: list[int]) -> int:
    """How many of ``draft``'s tokens greedy verification accepts against the ``expected`` output."""
    return next((i for i, (a, b) in enumerate(zip(draft, expected)) if a != b), min(len(draft), len(expected)))


@dataclass
class Slot:
    """A request in flight: its trace, how far it got and what it sampled last step."""

    index: int
    trace: GreedyTrace
    position: int = 1
    sampled: list[int] = field(default_factory=list)
    tokens: np.ndarray = field(init=False, repr=False)  # prompt and whole output, int32

    def __post_init__(self) -> None:
        self.tokens = np.array(self.trace.prompt_ids + self.trace.output_ids, np.int32)

    @property
    def context_length(self) -> int:
        return len(self.trace.prompt_ids) + self.position

    def advance(self, draft: list[int]) -> int:
        """Verify ``draft`` against the greedy output; returns the accepted count."""
        expected = self.trace.output_ids[self.position:]
        accepted = accepted_prefix(draft, expected)
        self.sampled = expected[: accepted + 1]
        self.position += len(self.sampled)
        return accepted

    @property
    def done(self) -> bool:
        return self.position >= len(self.trace.output_ids)


def lock_step(traces: list[GreedyTrace], concurrency: int, cost: tuple[float, float, float], drafter,
              first_index: int = 0) -> Tally:
    """Decode every trace, ``concurrency`` at a time, with ``drafter(slots) -> drafts`` per step
    (its ``seconds``: drafting time so far, the replay's own bookkeeping excluded;
    ``drafter.finish(slot)`` when a request ends); requests are numbered from ``first_index``."""
    tally, pending, active = Tally(), list(enumerate(traces, first_index))[::-1], []
    step_seconds, request_seconds, token_seconds = cost
    while pending or active:
        while pending and len(active) < concurrency:
            index, trace = pending.pop()
            active.append(Slot(index, trace, sampled=trace.output_ids[:1]))
        before = drafter.seconds
        drafts = drafter(active)
        drafting = drafter.seconds - before
        drafted = sum(map(len, drafts))
        tally.accepted += sum(slot.advance(draft) for slot, draft in zip(active, drafts))
        tally.drafted += drafted
        tally.request_steps += len(active)
        tally.engine_steps += 1
        tally.drafting_seconds += drafting
        tally.seconds += step_seconds + request_seconds * len(active) + token_seconds * drafted + drafting
        for slot in [s for s in active if s.done]:
            active.remove(slot)
            tally.generated += len(slot.trace.output_ids) - 1
            drafter.finish(slot)
    return tally


class SuffixDrafter:
    """vLLM's ``suffix`` method: Arctic Inference's cache with vLLM's default settings."""

    def __init__(self) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=SUFFIX_DEPTH, max_cached_requests=10_000)
        self.seconds = 0.0

    def __call__(self, slots: list[Slot]) -> list[list[int]]:
        return [self.draft(slot) for slot in slots]

    def draft(self, slot: Slot) -> list[int]:
        """One request's draft, after adding what it sampled last step to its cache."""
        context = slot.tokens[max(slot.context_length - SUFFIX_DEPTH, 0): slot.context_length]
        start = time.perf_counter()
        if slot.index not in self.cache.active_requests:
            self.cache.start_request(slot.index, np.array(slot.trace.prompt_ids, np.int32))
        self.cache.add_active_response(slot.index, slot.sampled)
        draft = self.cache.speculate(slot.index, context, max_spec_tokens=SUFFIX_DEPTH,
                                     max_spec_factor=1.0, min_token_prob=0.1)
        self.seconds += time.perf_counter() - start
        return list(draft.token_ids)

    def finish(self, slot: Slot) -> None:
        self.cache.stop_request(slot.index)


class RestDrafter:
    """``RestProposer``'s step with budget ``auto``: observe, skip, search, choose."""

    def __init__(self, store, k: int, concurrency: int, cost: tuple[float, float, float],
                 prior_strength: float = AcceptanceCalibration.prior_strength,
                 first_draft_seconds: float | None = None, token_factors: bool = True,
                 states: TraceStates | None = None, context_state_votes: int = 0) -> None:
        options = RetrievalSpecOptions(context_state_votes=context_state_votes)
        self.store, self.params = store, RestParams.from_options(options, chain_len=k)
        prior = (*cost, *PRIORS["cpu"][3:])
        self.budget = GoodputBudget(margin=options.budget_margin, cost=StepCostModel(prior=prior),
                                    calibration=AcceptanceCalibration(prior_strength=prior_strength),
                                    tokens=TokenFactor(enabled=token_factors))
        self.output_index = OutputIndex(options.output_index_tokens, background=False)
        self.live = LiveIndex.from_options(options) if concurrency > 1 else None
        self.live_max_matches = options.live_max_matches
        self.seconds = 0.0
        self.first_draft_seconds = first_draft_seconds  # the first step's drafting time as the budget sees it
        self.last_search: tuple[np.ndarray, DraftNodes] | None = None  # searched rows and their candidates
        self.states = states  # the traces' hidden states, for REST's context ranking
        self.context_states = None if states is None or context_state_votes <= 1 else ContextStates(
            states.dim, concurrency, states.max_positions)

    def __call__(self, slots: list[Slot]) -> list[list[int]]:
        req_ids = [str(slot.index) for slot in slots]
        tokens = np.zeros((len(slots), max(len(slot.tokens) for slot in slots)), np.int32)
        for row, slot in enumerate(slots):
            tokens[row, : len(slot.tokens)] = slot.tokens
        lengths = np.array([slot.context_length for slot in slots], np.int32)
        if self.context_states is not None:
            self._write_new_states(slots, req_ids)
        start = time.perf_counter()
        drafts = self._draft(req_ids, tokens, lengths, [slot.sampled for slot in slots])
        self.seconds += time.perf_counter() - start
        return drafts

    def _draft(self, req_ids: list[str], tokens: np.ndarray, lengths: np.ndarray,
               sampled: list[list[int]]) -> list[list[int]]:
        if self.live is not None:
            self.live.update(req_ids, tokens, lengths)
        start = time.perf_counter()  # the search time the budget weighs, as the proposer's
        self.budget.observe(req_ids, sampled)
        rows = np.flatnonzero(self.budget.worth_searching(len(req_ids), len(req_ids))).astype(np.int32)
        drafts = [[] for _ in req_ids]
        self.last_search = None
        if not len(rows):
            return drafts
        live = None if self.live is None else self.live.lookup(
            req_ids, tokens, lengths, rows, self.live_max_matches, self.params.continuation_len).as_given()
        states = None if self.context_states is None else (
            self.context_states.native, self.context_states.slots_of([req_ids[r] for r in rows]))
        found = rest_retrieve(self.store, tokens, lengths, rows, self.params, output_index=self.output_index.native,
                              live=live, chances=self.budget.chance_table(), context_states=states)
        nodes = found.nodes(False)
        self.last_search = rows, nodes
        seconds = time.perf_counter() - start
        if self.first_draft_seconds is not None and not self.budget.stats.steps:
            seconds = self.first_draft_seconds
        keep = self.budget.choose([req_ids[r] for r in rows], nodes, np.full(len(rows), self.params.chain_len),
                                  len(req_ids), seconds)
        kept, _, sizes, _ = nodes.kept(keep)
        for j, row in enumerate(rows.tolist()):
            drafts[row] = kept[j, : sizes[j]].tolist()
        return drafts

    def _write_new_states(self, slots: list[Slot], req_ids: list[str]) -> None:
        """The states of the requests starting this step, at once: each state that produced a
        token of the trace (the replay reads only those that produced its context so far)."""
        for row, slot in enumerate(slots):
            if slot.position == 1:
                produced = self.states.of(slot.trace)
                positions = np.arange(1, len(produced) + 1)
                self.context_states.write(req_ids, np.full(len(positions), row), positions, produced)

    def finish(self, slot: Slot) -> None:
        self.budget.observe([str(slot.index)], [slot.sampled])
        if self.live is not None:
            self.live.remove([str(slot.index)])
        if self.context_states is not None:
            self.context_states.release([str(slot.index)])
        self.output_index.add(slot.tokens)


class TraceStates:
    """The target's last hidden states over each trace's tokens (one float32 transformers forward
    per trace, on first use): ``of(trace)[i]`` produced the trace's token ``i + 1``."""

    def __init__(self, model_path: Path, traces: list[GreedyTrace]) -> None:
        import torch

        self._torch = torch
        self._model = load_target_model(model_path)
        self.dim = int(self._model.config.hidden_size)
        self.max_positions = max(len(trace.prompt_ids) + len(trace.output_ids) for trace in traces)
        self._states: dict[int, np.ndarray] = {}

    def of(self, trace: GreedyTrace) -> np.ndarray:
        key = id(trace)
        if key not in self._states:
            tokens = self._torch.tensor([list(trace.prompt_ids) + list(trace.output_ids)])
            with self._torch.inference_mode():
                self._states[key] = last_hidden_states(self._model, tokens)[0, :-1].numpy()
        return self._states[key]


@dataclass
class SameStates:
    """REST against ``suffix`` at the same decoding states (REST's): tokens each would have
    accepted per step, REST's both as its budget kept them and as its whole candidate chain, and
    the tokens ``suffix`` is ahead by on the steps it is, by why REST fell short."""

    steps: int = 0
    rest_kept: int = 0
    rest_candidates: int = 0
    suffix: int = 0
    rest_drafted: int = 0
    suffix_drafted: int = 0
    rest_ahead_steps: int = 0
    rest_ahead_tokens: int = 0
    suffix_ahead_steps: int = 0
    behind_not_drafted: int = 0  # tokens: REST drafted nothing
    behind_cut: int = 0  # its candidate chain held them, the budget cut it
    behind_candidates: int = 0  # its candidate chain went wrong earlier

    def add(self, kept: int, drafted: int, candidate: int, suffix: int, suffix_drafted: int) -> None:
        """One step: tokens accepted from REST's kept draft (of ``drafted``), from its whole
        candidate chain, and from ``suffix``'s draft (of ``suffix_drafted``)."""
        self.steps += 1
        self.rest_kept += kept
        self.rest_candidates += candidate
        self.suffix += suffix
        self.rest_drafted += drafted
        self.suffix_drafted += suffix_drafted
        if kept > suffix:
            self.rest_ahead_steps += 1
            self.rest_ahead_tokens += kept - suffix
        elif suffix > kept:
            self.suffix_ahead_steps += 1
            if not drafted:
                self.behind_not_drafted += suffix - kept
            elif candidate >= suffix:
                self.behind_cut += suffix - kept
            else:
                self.behind_candidates += suffix - kept

    @property
    def best_of_both(self) -> int:
        """Tokens accepted by whichever of REST's kept draft and ``suffix``'s accepts more at each step."""
        return self.rest_kept + self.behind_not_drafted + self.behind_cut + self.behind_candidates

    def row(self) -> dict:
        per_step = {name: getattr(self, name) / max(self.steps, 1)
                    for name in ("rest_kept", "rest_candidates", "suffix", "best_of_both", "rest_drafted",
                                 "suffix_drafted")}
        return {**vars(self), "best_of_both": self.best_of_both,
                **{f"{name}_per_step": value for name, value in per_step.items()}}


def candidate_chain(drafter: RestDrafter, row: int) -> list[int]:
    """The whole candidate chain REST's last search found for ``row`` (before the budget's cut)."""
    if drafter.last_search is None:
        return []
    rows, nodes = drafter.last_search
    found = np.flatnonzero(rows == row)
    return nodes.tokens[found[0], : nodes.size[found[0]]].tolist() if len(found) else []


def same_states(traces: list[GreedyTrace], store, k: int, cost: tuple[float, float, float]) -> SameStates:
    """Decode every trace alone with REST (budget ``auto``), asking ``suffix`` at each of REST's
    steps what it would draft from the same state."""
    rest, suffix, tally = RestDrafter(store, k, 1, cost), SuffixDrafter(), SameStates()
    for index, trace in enumerate(traces):
        slot = Slot(index, trace, sampled=trace.output_ids[:1])
        while not slot.done:
            kept = rest([slot])[0]
            other = suffix.draft(slot)
            expected = trace.output_ids[slot.position:]
            tally.add(accepted_prefix(kept, expected), len(kept),
                      accepted_prefix(candidate_chain(rest, 0), expected), accepted_prefix(other, expected),
                      len(other))
            slot.advance(kept)
        rest.finish(slot)
        suffix.finish(slot)
    return tally


def print_same_states(workload: str, tally: SameStates) -> None:
    """One workload's row of the ``--same-states`` table."""
    row = tally.row()
    print(f"{workload:15s} {row['rest_kept_per_step']:10.2f} {row['rest_candidates_per_step']:11.2f} "
          f"{row['suffix_per_step']:8.2f} {row['best_of_both_per_step']:9.2f} {row['rest_drafted_per_step']:9.2f} "
          f"{row['suffix_drafted_per_step']:9.2f} "
          f"{tally.rest_ahead_steps:5d}/{tally.rest_ahead_tokens:<5d} {tally.suffix_ahead_steps:5d}/"
          f"{tally.behind_not_drafted + tally.behind_cut + tally.behind_candidates:<5d} "
          f"{tally.behind_not_drafted:9d} {tally.behind_cut:5d} {tally.behind_candidates:6d}")


def warmed_lock_step(traces: list[GreedyTrace], warm_up: int, concurrency: int, cost: tuple[float, float, float],
                     drafter) -> Tally:
    """:func:`lock_step` over the first ``len(traces) - warm_up`` traces, after the drafter has decoded
    the last ``warm_up`` (untallied): what it learns from a server's earlier requests, as a server
    that has served a while knows them (REST's output index and calibration, ``suffix``'s cache)."""
    timed = traces[: len(traces) - warm_up]
    if warm_up:
        lock_step(traces[len(timed):], concurrency, cost, drafter, first_index=len(traces))
    return lock_step(timed, concurrency, cost, drafter)


def workload_traces(model: Path, workload: str, prompts: int, max_tokens: int) -> list[GreedyTrace]:
    """The greedy outputs of a workload's first ``prompts`` prompts, generated once and cached."""

    def texts() -> list[str]:
        from acceptance import dataset_prompts
        from transformers import AutoTokenizer

        return dataset_prompts(DATA / f"{workload}.jsonl", prompts, AutoTokenizer.from_pretrained(model))

    path = cache_root() / "traces" / f"{workload}_n{prompts}_t{max_tokens}.json"
    return cached_traces(model, path, max_tokens, texts, workload)


def rest_variants(args: argparse.Namespace) -> list[tuple[str, float, float | None, bool, int]]:
    """REST's replays: a name, a prior strength, the first step's drafting seconds (None: as
    measured), whether tokens' factors scale the chances and the votes of the context occurrence
    nearest by hidden state, for each combination asked."""
    firsts = [None] if args.first_draft_ms is None else [ms / 1000 for ms in args.first_draft_ms]
    return [(f"rest_k{args.k}" + (f"_s{strength:g}" if len(args.prior_strengths) > 1 else "")
             + ("" if first is None else f"_first{first * 1000:g}ms")
             + ("" if factors == "on" else "_no_token_factors") + (f"_votes{votes}" if votes > 1 else ""),
             strength, first, factors == "on", votes)
            for strength in args.prior_strengths for first in firsts for factors in args.token_factors
            for votes in args.context_state_votes]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["code_edit", "multi_turn", "doc_qa", "humaneval_chat"])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], choices=sorted(COSTS))
    parser.add_argument("--k", type=int, default=32, help="REST's num_speculative_tokens")
    parser.add_argument("--prior-strengths", type=float, nargs="+", default=[AcceptanceCalibration.prior_strength],
                        help="REST once per calibration prior strength (pseudo-observations a sparse bucket "
                             "borrows from its prior)")
    parser.add_argument("--first-draft-ms", type=float, nargs="+", default=None,
                        help="REST once per drafting time (ms) its budget sees at the first step (default: as "
                             "measured), which decides whether the first step drafts")
    parser.add_argument("--token-factors", nargs="+", choices=("on", "off"), default=["on"],
                        help="REST once with each: tokens' factors scaling the budget's chances (option "
                             "budget_token_factors) or not")
    parser.add_argument("--context-state-votes", type=int, nargs="+", default=[0],
                        help="REST once with each option context_state_votes: the times the context occurrence "
                             "nearest by the target's hidden state counts (one transformers forward per trace; "
                             "0 or 1: off)")
    parser.add_argument("--same-states", action="store_true",
                        help="instead: REST against suffix at the same decoding states, one request at a time")
    parser.add_argument("--datastore", default=RetrievalSpecOptions().datastore,
                        help="REST's datastore: recipe name or directory (default: the serving default)")
    parser.add_argument("--warm-up", type=int, default=0, metavar="N",
                        help="each drafter first decodes the workload's N prompts after --prompts, untallied: "
                             "REST and suffix as on a server that has served such requests")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    if args.same_states and args.warm_up:
        parser.error("--warm-up applies to the lock-step replay, not to --same-states")
    return args


def workload_tokens(workload: str) -> int:
    """New tokens per request in the replay of ``workload``."""
    return 128 if workload in ("code_edit", "multi_turn") else 64


def run_fields(args: argparse.Namespace) -> dict:
    """What every report of this script records of its run."""
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "datastore": args.datastore, "prompts": args.prompts,
            "k": args.k, "warm_up": args.warm_up}


def report_same_states(model: Path, store, args: argparse.Namespace) -> None:
    """``--same-states``: the table and ``results/budget_replay_same_states[_<tag>].json``."""
    print("REST (budget auto) against suffix at REST's decoding states, 1 in flight: accepted tokens per step")
    print(f"{'workload':15s} {'REST kept':>10s} {'REST chain':>11s} {'suffix':>8s} {'best of 2':>9s} {'REST drft':>9s} "
          f"{'sfx drft':>9s} "
          f"{'ahead':>11s} {'behind':>11s} {'undrafted':>9s} {'cut':>5s} {'wrong':>6s}")
    report = []
    for workload in args.workloads:
        traces = workload_traces(model, workload, args.prompts, workload_tokens(workload))
        tally = same_states(traces, store, args.k, COSTS[1])
        print_same_states(workload, tally)
        report.append({"workload": workload, **tally.row()})
    out = RESULTS / f"budget_replay_same_states{'_' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps({**run_fields(args), "results": report}, indent=2) + "\n")
    print(f"written: {out}", file=sys.stderr)


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    model = ensure_smollm2_checkpoint()
    try:
        store, _ = open_datastore_for_model(args.datastore, model)
    except DatastoreError as error:
        sys.exit(f"--datastore: {error}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.same_states:
        report_same_states(model, store, args)
        return
    for concurrency in args.concurrency:
        cost, report = COSTS[concurrency], []
        print(f"\n{concurrency} in flight (simulated step: {cost[0] * 1000:.0f} ms + {cost[1] * 1000:.0f} ms/request "
              f"+ {cost[2] * 1000:.1f} ms/draft token + drafting)")
        print(f"{'workload':15s} {'config':20s} {'honest':>7s} {'drafted':>8s} {'accepted':>9s} {'accept':>7s} "
              f"{'draft ms':>9s} {'tok/s':>7s} {'x suffix':>9s}")
        for workload in args.workloads:
            traces = workload_traces(model, workload, args.prompts + args.warm_up, workload_tokens(workload))
            suffix = warmed_lock_step(traces, args.warm_up, concurrency, cost, SuffixDrafter()).row("suffix")
            trace_states = TraceStates(model, traces) if max(args.context_state_votes) > 1 else None
            rests = [warmed_lock_step(traces, args.warm_up, concurrency, cost,
                                      RestDrafter(store, args.k, concurrency, cost, strength, first, factors,
                                                  trace_states, votes)).row(name)
                     for name, strength, first, factors, votes in rest_variants(args)]
            for row in (suffix, *rests):
                row.update(workload=workload, speedup_vs_suffix=row["simulated_tokens_per_second"]
                           / suffix["simulated_tokens_per_second"])
                report.append(row)
                print(f"{workload:15s} {row['config']:20s} {row['honest_tokens_per_step']:7.2f} "
                      f"{row['drafted_per_request_step']:8.2f} {row['accepted_per_request_step']:9.2f} "
                      f"{row['acceptance_rate']:7.1%} {row['drafting_ms_per_step']:9.2f} "
                      f"{row['simulated_tokens_per_second']:7.1f} {row['speedup_vs_suffix']:8.2f}x")
        out = RESULTS / f"budget_replay_c{concurrency}{'_' + args.tag if args.tag else ''}.json"
        out.write_text(json.dumps({**run_fields(args), "concurrency": concurrency, "cost_seconds": cost,
                                   "prior_strengths": args.prior_strengths,
                                   "first_draft_ms": args.first_draft_ms, "token_factors": args.token_factors,
                                   "context_state_votes": args.context_state_votes,
                                   "results": report},
                                  indent=2) + "\n")
        print(f"written: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
