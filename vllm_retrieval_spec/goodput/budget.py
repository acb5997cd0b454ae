"""One runner's goodput budget: closes the loop between drafting and verification.

Each step, in the proposers' base (through the session):

1. :meth:`GoodputBudget.observe` reads, from the tokens each request just sampled, which of
   the nodes drafted for it last step were accepted (a node is accepted when its parent is
   and its token is the one sampled at its depth), and feeds calibration (for chains in one
   kernel call, with the first candidate node of each greedy chain row that kept none);
2. :meth:`GoodputBudget.worth_searching` drops rows whose best possible node would not pay
   for its verification (their search is skipped);
3. :meth:`GoodputBudget.choose` turns the drafter's candidate nodes into calibrated chances,
   keeps the best for the whole batch (:func:`choose_nodes`) and remembers them for step 1.

The session feeds the cost model with each step's duration and scheduled tokens. On
tensor-parallel engines (:meth:`GoodputBudget.for_engine`) both durations the budget reads,
step and drafting time, are the first rank's, so that every rank chooses the same nodes.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm_retrieval_spec.drafts import DraftNodes, add_code_counts, count_sources
from vllm_retrieval_spec.goodput.calibration import MAX_CHANCE, AcceptanceCalibration
from vllm_retrieval_spec.goodput.chooser import NodeCandidates, choose_nodes, main_paths
from vllm_retrieval_spec.goodput.cost_model import StepCostModel
from vllm_retrieval_spec.goodput.paths import first_children, fold_paths, node_depths, parent_values, path_products
from vllm_retrieval_spec.goodput.ranks import SharedClock, tensor_parallel_clock
from vllm_retrieval_spec.goodput.search_gate import StepWay
from vllm_retrieval_spec.goodput.token_factor import INITIAL_VOCAB, TokenFactor
from vllm_retrieval_spec.kernels.chain_choice import choose_chain_nodes, count_chain_outcomes
from vllm_retrieval_spec.kernels.rest import ChanceTable

logger = logging.getLogger(__name__)

LOG_EVERY_STEPS = 2048
SEARCH_TIME_SMOOTHING = 0.1
BRANCH_PRIOR = 4.0  # pseudo-chance behind the branch factor, at the calibration's own estimate
BRANCH_DECAY = 0.998  # per tree step: a factor no longer observed drifts back to 1
BRANCH_FACTOR_RANGE = (1.0 / 64, 2.0)
# Drafted steps in a row past the skinny GEMM's rows (from requests that alone fit in them)
# between two steps whose nodes are dropped to measure the step without drafts.
PROBE_EVERY = 16
# Tree steps in a row whose choice kept no branch before tree mode drafts chains, and how often
# it then drafts trees again to see whether branches pay once more.
TREE_PATIENCE = 8
TREE_RETRY_EVERY = 16


@dataclass
class Periodic:
    """True at every ``period``-th :meth:`tick` since the last :meth:`reset` or True."""

    period: int
    ticks: int = 0

    def tick(self) -> bool:
        self.ticks += 1
        if self.ticks < self.period:
            return False
        self.ticks = 0
        return True

    def reset(self) -> None:
        self.ticks = 0


@dataclass
class BudgetStats:
    """Counters of one runner's budget (for tests, benchmarks and operators)."""

    steps: int = 0  # steps that chose among candidates
    drafted_steps: int = 0  # of which kept at least one node
    skipped_steps: int = 0  # steps where every row's search was skipped
    candidate_nodes: int = 0
    chosen_nodes: int = 0
    skipped_rows: int = 0  # rows whose search was skipped
    probe_steps: int = 0  # steps whose nodes were dropped to measure the step without drafts
    tree_steps: int = 0  # steps that chose among tree nodes (tree mode)
    branched_steps: int = 0  # of which kept a branch
    observed_nodes: int = 0
    accepted_nodes: int = 0
    unsent_observed_nodes: int = 0  # first nodes of rows that kept none, learned from the sampled token
    unsent_accepted_nodes: int = 0
    observed_by_source: dict[str, int] = field(default_factory=dict)  # by ``drafts.source_label``
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    drafting_seconds: float = 0.0  # searching and drafting, summed over the steps that chose


@dataclass
class BranchFactor:
    """How the outcomes of branch roots (nodes that are not their parent's first child) compare
    with their calibrated chances. A sibling shares its bucket with first children of the same
    raw probability but is accepted only when every earlier sibling is not: at batch 1 on
    code_edit, branch roots predicted at 0.18 were accepted 8.5% of the time while first
    children were under-predicted (0.75 against 0.81). Branch roots stay out of the bucket counts
    and their chances are scaled by this factor, learned from sums that decay every tree step
    (so that branches no longer drafted are tried again)."""

    predicted: float = 0.0
    accepted: float = 0.0

    @property
    def factor(self) -> float:
        return float(np.clip((self.accepted + BRANCH_PRIOR) / (self.predicted + BRANCH_PRIOR), *BRANCH_FACTOR_RANGE))

    def record(self, predicted: float, accepted: float) -> None:
        self.predicted += predicted
        self.accepted += accepted

    def tick(self) -> None:
        self.predicted *= BRANCH_DECAY
        self.accepted *= BRANCH_DECAY


@dataclass
class PendingNodes:
    """The nodes drafted at one step, waiting for the next step's sampled tokens."""

    req_ids: list[str]
    tokens: np.ndarray
    parents: np.ndarray
    depth: np.ndarray
    bucket: np.ndarray
    chance: np.ndarray
    keep: np.ndarray
    source: np.ndarray
    branch: np.ndarray  # [rows, N] the branch roots, whose chances the branch factor scaled
    branch_factor: float
    chains: bool  # each row a chain (read back by the chain kernel)
    unsent_first: np.ndarray | None = None  # [rows] chains: the row kept no node, its first is learned from


@dataclass
class GoodputBudget:
    """Calibration, cost model and the chooser of one runner. Nodes are weighed by their
    calibrated chances and their tokens' factors (:class:`TokenFactor`): a per-request factor
    (each request's recent accepted-over-predicted ratio, up to 4x) cost 1-8% tokens/s in every
    interleaved A/B (results README, 2026-11-26 evening): selecting on a noisy factor kept nodes
    whose chances it had inflated."""

    margin: float = 0.05
    cost: StepCostModel = field(default_factory=StepCostModel)
    calibration: AcceptanceCalibration = field(default_factory=AcceptanceCalibration)
    branches: BranchFactor = field(default_factory=BranchFactor)
    tokens: TokenFactor = field(default_factory=TokenFactor)
    stats: BudgetStats = field(default_factory=BudgetStats)
    search_seconds_per_row: float = 0.0  # drafting time per searched row (moving average)
    clock: SharedClock | None = field(default=None, repr=False)  # None: this process's drafting times
    _pending: PendingNodes | None = None
    _probes: Periodic = field(default_factory=lambda: Periodic(PROBE_EVERY))  # over drafted steps past the rows
    _tree_steps_without_branch: int = 0  # tree steps in a row whose choice kept no branch
    _tree_retries: Periodic = field(default_factory=lambda: Periodic(TREE_RETRY_EVERY))  # over chain steps

    @classmethod
    def for_engine(cls, margin: float, device_type: str, tensor_parallel_size: int = 1,
                   kernel_rows: int = 0, token_factors: bool = True,
                   vocab_size: int = INITIAL_VOCAB) -> GoodputBudget:
        """One runner's budget: the device's cost prior, the most tokens a step runs the CPU's
        skinny GEMM on (0: none), whether tokens' factors scale the chances (a table of the
        model's ``vocab_size``) and, with more than one tensor-parallel rank, the first rank's
        clock for step and drafting times."""
        clock = tensor_parallel_clock(tensor_parallel_size)
        return cls(margin=margin, cost=StepCostModel.for_device(device_type, clock, kernel_rows), clock=clock,
                   tokens=TokenFactor(enabled=token_factors, vocab_size=vocab_size))

    def learned_counts(self) -> dict[str, AcceptanceCalibration | TokenFactor]:
        """What a restarted server should start from, by name: the calibration's counts and,
        when on, the tokens' factors (an output index snapshot saves them beside the index)."""
        return {"calibration": self.calibration, **({"token_factors": self.tokens} if self.tokens.enabled else {})}

    def observe(self, req_ids: Sequence[str], sampled_token_ids: Sequence[Sequence[int]]) -> None:
        """Learn from the acceptance of last step's nodes (``req_ids`` are this step's rows)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        row_of = dict(zip(req_ids, range(len(req_ids))))
        rows = np.fromiter(map(row_of.get, pending.req_ids, itertools.repeat(-1)), np.int64, len(pending.req_ids))
        if pending.chains:
            self._observe_chains(pending, rows, sampled_token_ids)
            return
        present = rows >= 0
        if not present.any():
            return
        sampled = [sampled_token_ids[row] for row in rows[present]]
        accepted, observed = _outcomes(pending.tokens[present], pending.parents[present], pending.depth[present],
                                       pending.keep[present], _padded(sampled, pending.tokens.shape[1] + 1))
        chance, bucket = pending.chance[present], pending.bucket[present]
        roots = observed & pending.branch[present]
        counted = observed & ~roots
        self.calibration.observe(bucket[counted], chance[counted], accepted[counted])
        self.tokens.record(pending.tokens[present][observed], chance[observed], accepted[observed])
        if roots.any():
            self.branches.record(float(chance[roots].sum()) / pending.branch_factor, float(accepted[roots].sum()))
        self.stats.observed_nodes += int(observed.sum())
        self.stats.accepted_nodes += int(accepted.sum())
        source = pending.source[present]
        count_sources(self.stats.observed_by_source, source[observed])
        count_sources(self.stats.accepted_by_source, source[accepted])

    def _observe_chains(self, pending: PendingNodes, rows: np.ndarray,
                        sampled_token_ids: Sequence[Sequence[int]]) -> None:
        """Chains: the read-back in one kernel call (``kernels/chain_choice.py``), which also
        calibrates on the first candidate node of each greedy chain row that kept none, as if it
        had been verified: the one token the target sampled for the row is what greedy
        verification would have accepted there. Calibration otherwise learns only from nodes the
        budget sends, so a few early rejections could hold a match length's first nodes below
        what pays, unsent and unlearned, for the rest of a run (in the budget replay at 8 in
        flight on multi_turn, three rejected first nodes of 9-16-token matches left REST at 1.25
        honest tokens a step against 3.0). Only first nodes: learning the node after every kept
        prefix too drafted 1.2 more tokens a step at 1 in flight on multi_turn for the same
        accepted ones."""
        tokens = self.tokens
        if tokens.enabled:
            tokens.reserve(pending.tokens)
        calibration = self.calibration
        tally = count_chain_outcomes(
            pending.tokens, pending.keep, pending.bucket, pending.chance, pending.source, pending.unsent_first, rows,
            sampled_token_ids, calibration.count_arrays(),
            (tokens.predicted, tokens.accepted) if tokens.enabled else None)
        calibration.counts_changed()
        stats = self.stats
        stats.observed_nodes += tally.observed
        stats.accepted_nodes += tally.accepted
        stats.unsent_observed_nodes += tally.unsent_observed
        stats.unsent_accepted_nodes += tally.unsent_accepted
        add_code_counts(stats.observed_by_source, tally.by_code[0])
        add_code_counts(stats.accepted_by_source, tally.by_code[1])

    def seconds_per_token(self, num_reqs: int) -> float:
        """What one token is worth at this engine's rate without drafts, for ``num_reqs`` requests."""
        return self.cost.idle_seconds(num_reqs) / max(num_reqs, 1)

    def worth_searching(self, num_rows: int, num_reqs: int, samples: np.ndarray | None = None) -> np.ndarray:
        """Which of ``num_rows`` rows' best possible first node could pay: its optimistic chance
        (the best root-child bucket) is at least what verifying it (more for a request that
        ``samples``) and searching for it cost, in tokens, at the rate of a step of ``num_reqs``
        requests without drafts (fresh every step, and the search time decays on steps where
        every search is skipped, so that no decision freezes)."""
        if not num_rows:
            return np.ones(0, bool)
        verify = self.cost.per_token
        if samples is not None and samples.any():
            verify = verify + self.cost.per_sampled_token * samples
        threshold = (verify + self.search_seconds_per_row) / max(self.seconds_per_token(num_reqs), 1e-12)
        worth = np.broadcast_to(self.calibration.best_first_chance() >= threshold, (num_rows,)).copy()
        self.stats.skipped_rows += int((~worth).sum())
        if not worth.any():
            # Nothing searched, nothing timed: let the search-time estimate drift down so that
            # one slow search (a cold index) cannot skip every later step.
            self.stats.skipped_steps += 1
            self.search_seconds_per_row *= 1.0 - SEARCH_TIME_SMOOTHING
        return worth

    def wants_trees(self) -> bool:
        """Whether tree mode drafts trees this step: while the choice keeps branches (one of the
        last ``TREE_PATIENCE`` tree steps did), else one step in ``TREE_RETRY_EVERY``. A tree step
        whose choice keeps no branch verifies what a chain step would and costs more to draft,
        choose and plan (at 1 in flight on chat HumanEval 1.8 ms a step against the chain
        kernel's choice, where the choice kept branches in 4-9 steps of ~290)."""
        return self._tree_steps_without_branch < TREE_PATIENCE or self._tree_retries.tick()

    def choose(self, req_ids: Sequence[str], nodes: DraftNodes, budgets: np.ndarray, num_reqs: int,
               draft_seconds: float, trees: bool = False, samples: np.ndarray | None = None,
               context_tokens: np.ndarray | None = None) -> np.ndarray:
        """The candidate nodes to verify (``[rows, N]`` mask, closed under parents); ``trees``:
        the nodes form trees that may branch (branch roots' chances scaled by the branch factor),
        else each row is a chain (chosen in one kernel call); ``samples``: the rows whose
        requests sample; ``context_tokens``: each row's tokens so far (what tree attention reads
        per node)."""
        if self.clock is not None:  # the first rank's drafting time, before anything reads it
            draft_seconds = self.clock.shared(draft_seconds)
        per_row = draft_seconds / max(len(req_ids), 1)
        self.search_seconds_per_row += SEARCH_TIME_SMOOTHING * (per_row - self.search_seconds_per_row)
        if trees:
            pending = self._choose_in_trees(req_ids, nodes, budgets, num_reqs, draft_seconds, samples, context_tokens)
        else:
            pending = self._choose_in_chains(req_ids, nodes, budgets, num_reqs, draft_seconds, samples)
        if self._probes_below_rows(pending.keep, num_reqs):
            pending.keep = np.zeros_like(pending.keep)
            self.stats.probe_steps += 1
        if pending.chains:
            pending.unsent_first = _unsent_first_nodes(pending.tokens, pending.keep, samples)
        self.calibration.tick()
        self.tokens.tick()
        self.stats.steps += 1
        self.stats.drafting_seconds += draft_seconds
        self.stats.candidate_nodes += int(np.minimum(nodes.size, nodes.width).sum())
        kept = int(pending.keep.sum())
        self.stats.chosen_nodes += kept
        self.stats.drafted_steps += kept > 0
        if self.stats.steps % LOG_EVERY_STEPS == 0:
            self.log_summary()
        if kept or (pending.unsent_first is not None and pending.unsent_first.any()):
            self._pending = pending
        return pending.keep

    def what_if(self, nodes: DraftNodes, budgets: np.ndarray, num_reqs: int, draft_seconds: float,
                samples: np.ndarray | None = None) -> StepWay:
        """Chain candidates ``nodes`` as :meth:`choose` would keep them, without remembering
        anything: the kept tokens (-1 past each row's kept nodes), the seconds the step would
        take (its predicted verification plus ``draft_seconds``) and the nodes' buckets, chances
        and sources."""
        pending = self._choose_in_chains([], nodes, budgets, num_reqs, draft_seconds, samples)
        keep = pending.keep
        sampled = 0 if samples is None else int(keep[samples].sum())
        seconds = float(self.cost.predict(num_reqs, num_reqs + int(keep.sum()), sampled=sampled)) + draft_seconds
        return StepWay(np.where(keep, nodes.tokens, -1), seconds, pending.bucket, pending.chance, nodes.source)

    def _probes_below_rows(self, keep: np.ndarray, num_reqs: int) -> bool:
        """Whether this step goes without drafts to measure the step below the skinny GEMM's
        rows: its requests fill at least half of them and its chosen nodes take it past them,
        for the ``PROBE_EVERY``-th step in a row. When every drafted step crosses them the cost
        model cannot split a step's time between its requests and its drafts (at 32 in flight on
        doc_qa, where any draft crosses 32 rows, it learned 1.8 ms a draft token without probes
        and 2.7 with them, and drafted at 0.94x no speculation against 0.97x); with fewer
        requests steps below them come on their own."""
        rows = self.cost.kernel_rows
        if rows <= 0 or not rows <= 2 * num_reqs <= 2 * rows or num_reqs + int(keep.sum()) <= rows:
            self._probes.reset()
            return False
        return self._probes.tick()

    def _choose_in_chains(self, req_ids: Sequence[str], nodes: DraftNodes, budgets: np.ndarray, num_reqs: int,
                          draft_seconds: float, samples: np.ndarray | None) -> PendingNodes:
        """Chains: buckets, chances and the choice in one kernel call (``kernels/chain_choice.py``,
        the arithmetic of :meth:`_choose_in_trees` without branches)."""
        bucket, chance, keep = choose_chain_nodes(nodes, budgets, samples, num_reqs,
                                                  self.calibration.chain_calibration(), self.cost.chain_terms(),
                                                  draft_seconds, self.margin, self.tokens.factors(nodes.tokens))
        depth = np.broadcast_to(np.arange(nodes.width, dtype=np.int32), keep.shape)
        return PendingNodes(list(req_ids), nodes.tokens, nodes.parents, depth, bucket, chance, keep, nodes.source,
                            np.zeros(keep.shape, bool), 1.0, chains=True)

    def _choose_in_trees(self, req_ids: Sequence[str], nodes: DraftNodes, budgets: np.ndarray, num_reqs: int,
                         draft_seconds: float, samples: np.ndarray | None,
                         context_tokens: np.ndarray | None) -> PendingNodes:
        """Trees: branch roots' chances scaled by the branch factor, every node's by its token's,
        and chains through first children competing with the whole trees (:func:`choose_nodes`)."""
        valid = np.arange(nodes.width)[None, :] < nodes.size[:, None]
        depth = node_depths(nodes.parents)
        bucket = self.calibration.buckets(nodes, depth)
        first_child = first_children(nodes.parents, nodes.size)
        branch = valid & ~first_child
        branch_factor = self.branches.factor
        self.branches.tick()
        chance = self.calibration.estimate(bucket, nodes.prob)
        chance = np.where(valid, np.minimum(np.where(branch, chance * branch_factor, chance), MAX_CHANCE), 0.0)
        scaled = np.minimum(chance * self.tokens.factors(nodes.tokens), MAX_CHANCE)
        candidates = NodeCandidates(path_products(scaled, nodes.parents), budgets, num_reqs,
                                    main_paths(nodes.parents, first_child), samples, context_tokens)
        choice = choose_nodes(candidates, self.cost, draft_seconds, self.margin)
        branched = bool((choice.keep & branch).any())
        self._tree_steps_without_branch = 0 if branched else self._tree_steps_without_branch + 1
        self.stats.tree_steps += 1
        self.stats.branched_steps += branched
        return PendingNodes(list(req_ids), nodes.tokens, nodes.parents, depth, bucket, chance, choice.keep,
                            nodes.source, branch, branch_factor, chains=False)

    def log_summary(self) -> None:
        """The learned step cost and what the budget kept and saw accepted (logged periodically)."""
        a, b, c, d, e, f, g, h = (1000 * x for x in self.cost.coefficients)
        stats = self.stats
        logger.info(
            "goodput budget: step %.1f ms + %.2f ms/request + %.3f ms/draft token + %.3f ms/thousand tree-attention "
            "node-context pairs + %.3f ms/sampled draft token + %.1f ms/tree step + %.3f ms/prefill token + "
            "%.1f ms/step past the skinny GEMM's rows; kept %d of %d candidate nodes over %d steps (%d drafted, "
            "%d probes without drafts), %d of %d observed nodes accepted, %d searches skipped; branch roots' "
            "chances x %.2f; recent steps predicted within %.1f%% (bias %+.1f%%)",
            a, b, c, d, e, f, g, h, stats.chosen_nodes, stats.candidate_nodes, stats.steps, stats.drafted_steps,
            stats.probe_steps, stats.accepted_nodes, stats.observed_nodes, stats.skipped_rows, self.branches.factor,
            100 * self.cost.error.mean_absolute, 100 * self.cost.error.bias,
        )

    def chance_table(self) -> ChanceTable:
        """The calibration's chance of every bucket, for a drafter to rank its candidates by."""
        return self.calibration.chance_table()



def _unsent_first_nodes(tokens: np.ndarray, keep: np.ndarray, samples: np.ndarray | None) -> np.ndarray:
    """``[rows]``: the chain rows that kept no node but have a first one, of requests that do not
    sample (a sampled token is not what verification would accept)."""
    unsent = ~keep.any(axis=1) & (tokens[:, 0] >= 0)
    return unsent if samples is None else unsent & ~np.asarray(samples, bool)


def _padded(lists: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """Token lists as a ``[len(lists), width]`` matrix padded (and cut) with -1."""
    lengths = np.fromiter(map(len, lists), np.int64, len(lists))
    flat = np.fromiter(itertools.chain.from_iterable(lists), np.int64, int(lengths.sum()))
    rows = np.repeat(np.arange(len(lists)), lengths)
    columns = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    out = np.full((len(lists), width), -1, np.int64)
    inside = columns < width
    out[rows[inside], columns[inside]] = flat[inside]
    return out


def _outcomes(tokens: np.ndarray, parents: np.ndarray, depth: np.ndarray, keep: np.ndarray,
              sampled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per verified node: accepted (its parent was and the target sampled its token at its
    depth) and observed (its parent was accepted and the step sampled past its depth); a node
    matching the last sampled token was cut by the scheduler: unknown."""
    emitted = (sampled >= 0).sum(axis=1)[:, None]
    matched = tokens == np.take_along_axis(sampled, depth, axis=1)
    accepted = fold_paths(keep & matched & (depth < emitted - 1), parents, np.logical_and)
    observed = keep & parent_values(accepted, parents, True) & (depth < emitted) & ~(matched & (depth == emitted - 1))
    return accepted, observed
