"""Our Prometheus metrics, ``vllm_retrieval_spec:*``, next to vLLM's ``vllm:spec_decode_*``.

The counts live with their owners: the proposer's ``stats``, the goodput budget's ``stats``
and the session's tree counters. Once per step the runner's
:class:`~vllm_retrieval_spec.verification.session.SpecSession` calls
:meth:`RunnerMetrics.publish`, which adds what each count grew by to this process's metric
objects (created once per process; labels ``model_name`` and ``engine`` as vLLM's, plus
``proposer``) — a few increments per step, never per row. The engine core is another process
than the API server: the values reach ``/metrics`` through prometheus_client's multiprocess
mode, whose directory ``vllm-retrieval-spec serve`` sets before vLLM starts
(:func:`~vllm_retrieval_spec.compat.share_prometheus_metrics`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from vllm_retrieval_spec.compat import PROMETHEUS_DIR_VARIABLES
from vllm_retrieval_spec.goodput.cost_model import COST_TERMS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_retrieval_spec.goodput import BudgetStats
    from vllm_retrieval_spec.goodput.search_gate import SearchGate
    from vllm_retrieval_spec.proposers.base import DraftProposer, ProposerStats
    from vllm_retrieval_spec.verification.session import SpecSession, TreeVerificationStats

logger = logging.getLogger(__name__)

PREFIX = "vllm_retrieval_spec:"
LABELS = ("model_name", "engine", "proposer")
DRAFTING_SECONDS_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)

Total = int | Mapping[str, int]  # one count, or counts by the value of the counter's own label


@dataclass(frozen=True)
class Counts:
    """One runner's counters at one step (``budget`` None with ``budget: fixed``; ``gate`` None
    for a proposer without an optional search)."""

    proposer: ProposerStats
    tree: TreeVerificationStats
    budget: BudgetStats | None
    gate: SearchGate | None


@dataclass(frozen=True)
class CounterSpec:
    """One exported counter: where its running total is read (None: not kept here) and, for
    counts kept by source or decision, the name of that label."""

    name: str
    documentation: str
    total: Callable[[Counts], Total | None]
    label: str | None = None


def _budget(read: Callable[[BudgetStats], Total]) -> Callable[[Counts], Total | None]:
    return lambda counts: None if counts.budget is None else read(counts.budget)


def _gate(read: Callable[[SearchGate], Total]) -> Callable[[Counts], Total | None]:
    return lambda counts: None if counts.gate is None else read(counts.gate)


def _decisions(stats: BudgetStats) -> dict[str, int]:
    return {"drafted": stats.drafted_steps, "declined": stats.steps - stats.drafted_steps - stats.probe_steps,
            "skipped": stats.skipped_steps, "probed": stats.probe_steps}


COUNTERS = (
    CounterSpec("searched_requests", "Request-steps our drafter searched (after the budget skipped searches).",
                lambda c: c.proposer.rows),
    CounterSpec("unspeculated_requests", "Request-steps not drafted for because the request turned speculation off "
                "(vllm_xargs retrieval_spec_speculate).", lambda c: c.proposer.unspeculated_rows),
    CounterSpec("drafted_requests", "Request-steps sent at least one draft token.", lambda c: c.proposer.drafted_rows),
    CounterSpec("draft_tokens", "Draft tokens sent to verification, by the sources that proposed them.",
                lambda c: c.proposer.draft_tokens_by_source, "source"),
    CounterSpec("drafting_failures", "Steps whose drafting failed (they got no drafts; outputs stay exact).",
                lambda c: c.proposer.failures),
    CounterSpec("tree_steps", "Target steps that verified at least one branching draft tree.",
                lambda c: c.tree.tree_steps),
    CounterSpec("tree_requests", "Request-steps verified as trees in those steps.", lambda c: c.tree.tree_requests),
    CounterSpec("branching_trees", "Request-steps whose draft tree branched.", lambda c: c.tree.branching_requests),
    CounterSpec("compacted_kv_slots", "KV cache slots moved onto the accepted path after tree verification.",
                lambda c: c.tree.compacted_slots),
    CounterSpec("mcss_requests", "Request-steps whose candidates were drawn from the drafter's q and verified "
                "by multi-candidate speculative sampling (candidates: sampled).", lambda c: c.tree.mcss_requests),
    CounterSpec("budget_steps", "Goodput budget steps by decision: drafted, declined (nothing worth "
                "verifying), skipped (no row worth searching) or probed (drafts dropped to measure the step "
                "without them).", _budget(_decisions), "decision"),
    CounterSpec("budget_tree_choices", "Tree mode: goodput budget steps that chose among draft trees, by whether "
                "the choice kept a branch (branched) or main paths only (chain); the other steps drafted chains.",
                _budget(lambda b: {"branched": b.branched_steps, "chain": b.tree_steps - b.branched_steps}), "choice"),
    CounterSpec("budget_skipped_searches", "Request-steps whose search the goodput budget skipped.",
                _budget(lambda b: b.skipped_rows)),
    CounterSpec("budget_candidate_nodes", "Draft nodes offered to the goodput budget.",
                _budget(lambda b: b.candidate_nodes)),
    CounterSpec("budget_chosen_nodes", "Draft nodes the goodput budget kept.", _budget(lambda b: b.chosen_nodes)),
    CounterSpec("observed_draft_tokens", "Draft tokens whose outcome the goodput budget read back from the "
                "sampled tokens (parent accepted, depth sampled), by source.",
                _budget(lambda b: b.observed_by_source), "source"),
    CounterSpec("accepted_draft_tokens", "Of those, the accepted ones, by source.",
                _budget(lambda b: b.accepted_by_source), "source"),
    CounterSpec("dense_search_steps", "Hybrid with budget auto: steps by whether the dense search ran (searched) "
                "or its gate held it (held: steps drafted with it did not serve faster than the same steps drafted "
                "without it).", _gate(lambda g: {"searched": g.searches, "held": g.steps - g.searches}), "decision"),
    CounterSpec("dense_search_paired_steps", "Hybrid with budget auto: steps drafted both ways, with and without "
                "the dense search, that its gate has judged.", _gate(lambda g: g.judged)),
)
GATE_WAYS = ("with_search", "without")  # the ``way`` label of the gate's rates, in SearchGate.rates order


@dataclass(frozen=True)
class Families:
    """This process's metric objects."""

    counters: dict[str, Counter]
    drafting_seconds: Histogram
    step_cost_seconds: Gauge
    step_cost_error: Gauge
    failing_steps: Gauge
    gate_rates: Gauge


@functools.cache
def families() -> Families:
    """The metric objects, created (and registered in prometheus_client's default registry)
    once per process."""
    counters = {spec.name: Counter(PREFIX + spec.name, spec.documentation,
                                   [*LABELS, *([spec.label] if spec.label else [])]) for spec in COUNTERS}
    drafting = Histogram(PREFIX + "drafting_seconds", "Drafting time per step (the runner's propose call: "
                         "search, goodput budget, draft lists).", LABELS, buckets=DRAFTING_SECONDS_BUCKETS)
    cost = Gauge(PREFIX + "budget_step_cost_seconds", "The goodput budget's learned step cost: seconds per "
                 "step, per request, per draft token, per thousand tree-attention node-context pairs, per sampled "
                 "draft token and per tree step (label term).", [*LABELS, "term"],
                 multiprocess_mode="mostrecent")
    cost_error = Gauge(PREFIX + "budget_step_cost_error", "How far the learned step cost was from the recent decode "
                       "and verification steps, relative to their time: mean absolute error, and bias (above 0: "
                       "steps priced dearer than they ran) (label measure).", [*LABELS, "measure"],
                       multiprocess_mode="mostrecent")
    failing = Gauge(PREFIX + "consecutive_drafting_failures", "Steps in a row whose drafting failed (0 once a "
                    "step drafts again); above 0 for long, the server runs without speculation.", LABELS,
                    multiprocess_mode="mostrecent")
    gate_rates = Gauge(PREFIX + "dense_search_tokens_per_second", "Hybrid with budget auto: tokens per second of "
                       "the steps its gate drafted both ways, with the dense search and without (label way; decaying "
                       "over ~33 such steps): the search starts once the first leads clear of the paired steps' noise "
                       "and runs while it is at least the second.",
                       [*LABELS, "way"], multiprocess_mode="mostrecent")
    return Families(counters, drafting, cost, cost_error, failing, gate_rates)


class RunnerMetrics:
    """One runner's metrics: its label values and the totals it last published."""

    def __init__(self, labels: tuple[str, str, str], proposer: DraftProposer, session: SpecSession) -> None:
        self.labels = labels
        self.proposer = proposer
        self.session = session
        self._published: dict[tuple[str, ...], int] = {}
        self._children: dict[tuple[str, ...], Counter] = {}
        self._failed = False
        metrics = families()
        self._drafting_seconds = metrics.drafting_seconds.labels(*labels)
        self._step_cost = [metrics.step_cost_seconds.labels(*labels, term) for term in COST_TERMS]
        self._step_cost_error = {measure: metrics.step_cost_error.labels(*labels, measure)
                                 for measure in ("mean_absolute", "bias")}
        self._failing_steps = metrics.failing_steps.labels(*labels)
        gate = proposer.search_gate()
        self._gate_rates = [] if gate is None else [metrics.gate_rates.labels(*labels, way) for way in GATE_WAYS]
        counts = self.counts()
        for spec in COUNTERS:  # plain counters show from the start, at zero
            if spec.label is None and spec.total(counts) is not None:
                self._child((spec.name,))

    def counts(self) -> Counts:
        budget = self.session.budget
        return Counts(self.proposer.stats, self.session.stats, None if budget is None else budget.stats,
                      self.proposer.search_gate())

    def publish(self, draft_seconds: float) -> None:
        """One step drafted: observe its time and add what every counter grew by. Never raises
        (metrics must not stop the engine): a failure is logged and ends this runner's metrics."""
        if self._failed:
            return
        try:
            self._publish(draft_seconds)
        except Exception:
            self._failed = True
            logger.exception("vllm_retrieval_spec: publishing metrics failed; this runner publishes no more")

    def _publish(self, draft_seconds: float) -> None:
        self._drafting_seconds.observe(draft_seconds)
        self._failing_steps.set(self.proposer.stats.consecutive_failures)
        counts = self.counts()
        for spec in COUNTERS:
            total = spec.total(counts)
            if isinstance(total, int):
                self._grow(spec.name, (), total)
            elif total is not None:
                for value, count in total.items():
                    self._grow(spec.name, (value,), count)
        budget = self.session.budget
        if budget is not None:
            for gauge, seconds in zip(self._step_cost, budget.cost.coefficients.tolist()):
                gauge.set(seconds)
            error = budget.cost.error.report()
            for measure, gauge in self._step_cost_error.items():
                gauge.set(error[measure])
        if self._gate_rates:
            for gauge, rate in zip(self._gate_rates, counts.gate.rates().tolist()):
                gauge.set(rate)

    def _grow(self, name: str, label_values: tuple[str, ...], total: int) -> None:
        key = (name, *label_values)
        grown = total - self._published.get(key, 0)
        if grown:
            if grown > 0:  # a count that went back (stats replaced) is only re-based
                self._child(key).inc(grown)
            self._published[key] = total

    def _child(self, key: tuple[str, ...]) -> Counter:
        """The labelled series of ``key`` (counter name, then its own label's value if any)."""
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = families().counters[key[0]].labels(*self.labels, *key[1:])
        return child


def runner_labels(vllm_config: VllmConfig, drafter: DraftProposer) -> tuple[str, str, str]:
    """``model_name`` and ``engine`` as vLLM labels its own metrics, and the proposer's class."""
    return str(vllm_config.model_config.served_model_name), engine_label(vllm_config), type(drafter).__name__


def engine_label(vllm_config: VllmConfig) -> str:
    """The engine's data-parallel rank, vLLM's ``engine`` label. Dense models' data-parallel
    engines are independent: vLLM resets their ``data_parallel_rank`` to 0 and keeps the rank
    in ``data_parallel_index``."""
    parallel = vllm_config.parallel_config
    return str(getattr(parallel, "data_parallel_index", parallel.data_parallel_rank))


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 when no parallel state is set up)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except AssertionError:
        return 0


def attach_metrics(runner: GPUModelRunner, drafter: DraftProposer, session: SpecSession) -> None:
    """Publish this runner's counters, on the first tensor-parallel rank only (every rank
    drafts the same)."""
    if tensor_parallel_rank() == 0:
        session.metrics = RunnerMetrics(runner_labels(runner.vllm_config, drafter), drafter, session)
        _hint_when_not_shared()


def _hint_when_not_shared() -> None:
    """Say how to get our metrics onto ``/metrics`` when this engine process cannot share them
    (a plain ``vllm serve`` with one API server)."""
    in_engine_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"
    if in_engine_process and not any(name in os.environ for name in PROMETHEUS_DIR_VARIABLES):
        logger.info("vllm_retrieval_spec: our metrics stay in the engine process, off the server's /metrics: "
                    "serve with `vllm-retrieval-spec serve`, or set PROMETHEUS_MULTIPROC_DIR to an empty "
                    "directory before `vllm serve`")
