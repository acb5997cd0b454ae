"""Whether an optional source's search pays for itself (Hybrid's dense search), on whole steps.

``HybridProposer`` searches its dense store (and the index learned from served traffic) on top of
REST's sources. What the search costs is not only its time: its continuations also displace REST's
own in the chains the budget keeps, and they change how many tokens a step verifies. Counting only
the tokens accepted from nodes no other source drafted, a gate kept searching on code_edit while
Hybrid served at 0.92-0.94x REST (results README, 2026-11-29, late night).

:class:`SearchGate` compares the two whole steps on the same states instead: one step in
``PAIR_EVERY_SEARCHING`` the proposer also drafts the other way (without the search while it
searches; with it, one step in ``PAIR_EVERY_CLOSED``, while it does not), the budget chooses each
way's chains as it would, and once the requests' next tokens are known, each way's step is worth the
tokens its chains would have had accepted (their prefixes that match what the target generated) plus
one a request, over the step's predicted time and its drafting time. The search starts stopped
(Hybrid drafts what REST drafts until the search has shown it pays), starts once its way's rate is
at least the other's with its extra accepted tokens ``START_Z`` standard errors clear of the paired
steps' spread, and runs while its rate is at least the other's, over decaying sums of those paired
steps (logged when that changes). Without that margin the gate started on noise: at 1 in flight on a
fast VM it searched 72 steps that cost Hybrid 3% of REST's tokens a step before it stopped again
(results README, 2026-12-04, evening). The nodes of the way not sent that the optional sources
drafted (alone or with others), in rows of greedy requests, feed the calibration as verified ones
would (greedy verification accepts exactly the prefix the target generates): the dense sources'
chances are learned before their nodes are ever sent, and the other sources' buckets stay what the
sent nodes teach (the depth-0 prior by match length pools the dense sources apart from the others:
``goodput/calibration.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from vllm_retrieval_spec.goodput.calibration import AcceptanceCalibration

logger = logging.getLogger(__name__)

# Steps between two that draft both ways: while the search runs (the other way is REST's search
# alone, ~1 ms at 1 in flight) and while it does not (the other way searches the dense store too).
PAIR_EVERY_SEARCHING = 4
PAIR_EVERY_CLOSED = 16
MIN_PAIRED_STEPS = 8  # paired steps judged before the search may start (it starts stopped)
PAIRED_DECAY = 0.97  # per judged paired step: the sums follow a changing workload
MAX_WAIT_STEPS = 48  # steps a paired step waits for its requests' tokens before it is judged as far as they go
MAX_PENDING = 64  # paired steps waiting at most (the oldest is dropped)
START_Z = 1.64  # standard errors (one-sided 95%) the search's extra tokens must clear for it to start


@dataclass(frozen=True)
class StepWay:
    """One way to draft a step: per drafted row the chain the budget keeps (``[rows, N]``, -1
    past its kept length), the seconds the step would take (predicted verification plus the
    drafting this way took), and each node's calibration bucket, chance and ``SOURCE_*`` flags
    (``[rows, N]``)."""

    tokens: np.ndarray
    seconds: float
    bucket: np.ndarray
    chance: np.ndarray
    source: np.ndarray


@dataclass
class PairedStep:
    """A step drafted both ways, waiting for its requests' next tokens."""

    req_ids: list[str]  # of the drafted rows
    starts: np.ndarray  # [rows] each row's tokens before the step: its chain's first token goes here
    ways: tuple[StepWay, StepWay]  # (with the search, without)
    num_reqs: int  # requests of the step (each gets one token either way)
    verified: int  # which way the step sent (index into ``ways``)
    greedy: np.ndarray  # [rows] the rows whose requests do not sample
    age: int = 0


@dataclass
class SearchGate:
    """Whether ``owner`` searches its optional sources (``flags``, ``SOURCE_*``) this step (see
    the module docstring)."""

    flags: int
    owner: str = "proposer"
    steps: int = 0
    searches: int = 0
    judged: int = 0  # paired steps judged
    searching: bool = False
    pairing_seconds: float = 0.0  # spent drafting paired steps the way not sent
    _tokens: np.ndarray = field(default_factory=lambda: np.zeros(2))  # decaying, (with, without)
    _seconds: np.ndarray = field(default_factory=lambda: np.zeros(2))
    # Decaying moments of the paired steps' token differences (with - without): sum of weights,
    # of weighted differences, of weighted squares, and of squared weights.
    _moments: np.ndarray = field(default_factory=lambda: np.zeros(4))
    _pending: list[PairedStep] = field(default_factory=list)

    def open(self) -> bool:
        """Whether to search this step (counted as a step)."""
        self.steps += 1
        self.searches += self.searching
        return self.searching

    def pairs(self) -> bool:
        """Whether this step also drafts the other way (one step in ``PAIR_EVERY_SEARCHING``
        while the search runs or the first paired steps are judged, in ``PAIR_EVERY_CLOSED``
        otherwise)."""
        often = self.searching or self.judged < MIN_PAIRED_STEPS
        return self.steps % (PAIR_EVERY_SEARCHING if often else PAIR_EVERY_CLOSED) == 0

    def record(self, req_ids: list[str], starts: np.ndarray, searched: StepWay, plain: StepWay,
               num_reqs: int, samples: np.ndarray | None = None) -> None:
        """A step drafted both ways: ``searched`` with the search, ``plain`` without, the step
        sending the one :meth:`open` chose; ``samples``: the rows whose requests sample."""
        if len(self._pending) >= MAX_PENDING:
            self._pending.pop(0)
        greedy = np.ones(len(req_ids), bool) if samples is None else ~np.asarray(samples, bool)
        self._pending.append(PairedStep(req_ids, np.asarray(starts, np.int64), (searched, plain), num_reqs,
                                        verified=0 if self.searching else 1, greedy=greedy))

    def follow(self, req_ids: list[str], token_ids: np.ndarray, num_tokens: np.ndarray,
               calibration: AcceptanceCalibration | None = None) -> None:
        """Judge the paired steps whose requests' tokens are known by now (``req_ids``: this
        step's input-batch rows, ``token_ids[row, :num_tokens[row]]`` their tokens); a request
        no longer in the batch leaves its rows out of both ways. The unsent way's nodes of the
        optional sources in greedy rows feed ``calibration``."""
        if not self._pending:
            return
        row_of = {req_id: row for row, req_id in enumerate(req_ids)}
        waiting = []
        for paired in self._pending:
            paired.age += 1
            rows = np.fromiter((row_of.get(r, -1) for r in paired.req_ids), np.int64, len(paired.req_ids))
            if paired.age < MAX_WAIT_STEPS and not _known(paired, rows, num_tokens):
                waiting.append(paired)
                continue
            self._judge(paired, rows, token_ids, num_tokens, calibration)
        self._pending = waiting

    def report(self) -> dict:
        """Counters and each way's rate over the paired steps (for benchmarks and operators)."""
        rates = self.rates().tolist()
        return {"steps": self.steps, "searches": self.searches, "paired_steps_judged": self.judged,
                "pairing_seconds": self.pairing_seconds, "searching": self.searching,
                "tokens_per_second_with_search": rates[0], "tokens_per_second_without": rates[1]}

    def _judge(self, paired: PairedStep, rows: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray,
               calibration: AcceptanceCalibration | None) -> None:
        present = rows >= 0
        starts, rows = paired.starts[present], rows[present]
        self._tokens *= PAIRED_DECAY
        self._seconds *= PAIRED_DECAY
        tokens = np.zeros(2)
        for i, way in enumerate(paired.ways):
            observed, accepted = _outcomes(way.tokens[present], rows, starts, token_ids, num_tokens)
            tokens[i] = paired.num_reqs + int(accepted.sum())
            self._seconds[i] += way.seconds
            if calibration is not None and i != paired.verified:
                new = observed & ((way.source[present] & self.flags) != 0) & paired.greedy[present][:, None]
                calibration.observe(way.bucket[present][new], way.chance[present][new], accepted[new])
        self._tokens += tokens
        difference = tokens[0] - tokens[1]
        self._moments *= (PAIRED_DECAY, PAIRED_DECAY, PAIRED_DECAY, PAIRED_DECAY**2)
        self._moments += (1.0, difference, difference**2, 1.0)
        self.judged += 1
        if self.judged >= MIN_PAIRED_STEPS:
            self._decide()

    def rates(self) -> np.ndarray:
        """Tokens per second of the paired steps, (with the search, without): decaying sums, 0
        before any was judged."""
        return self._tokens / np.maximum(self._seconds, 1e-12)

    def _difference_error(self) -> float:
        """Standard error of the decaying sum of the paired steps' token differences."""
        weight, total, squares, square_weights = self._moments
        variance = max(squares / weight - (total / weight) ** 2, 0.0)
        return float(np.sqrt(variance * square_weights))

    def _decide(self) -> None:
        with_search, without = self.rates()
        if not self.searching:  # to start, the search's extra tokens must clear their noise
            with_search -= START_Z * self._difference_error() / max(self._seconds[0], 1e-12)
        searching = bool(with_search >= without)
        if searching != self.searching:
            self.searching = searching
            logger.info("%s: the dense search %s (%.1f against %.1f tokens/s over the last ~%d paired steps)",
                        self.owner, "pays for itself" if searching else "stopped paying for itself",
                        with_search, without, round(1 / (1 - PAIRED_DECAY)))


def _known(paired: PairedStep, rows: np.ndarray, num_tokens: np.ndarray) -> bool:
    """Whether every row still in the batch has generated past both ways' chains."""
    present = rows >= 0
    longest = np.maximum(*((way.tokens[present] >= 0).sum(axis=1) for way in paired.ways))
    return bool((num_tokens[rows[present]] >= paired.starts[present] + longest).all())


def _outcomes(chains: np.ndarray, rows: np.ndarray, starts: np.ndarray, token_ids: np.ndarray,
              num_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per node of ``chains`` (``[rows, N]``, -1 padded) drafted at ``starts``: observed (its
    parent confirmed and its own position generated by now) and accepted (the target generated
    its token there, and its parent's), as greedy verification would have found them."""
    positions = starts[:, None] + np.arange(chains.shape[1])[None, :]
    known = (positions < num_tokens[rows][:, None]) & (chains >= 0)
    generated = token_ids[rows[:, None], np.minimum(positions, token_ids.shape[1] - 1)]
    accepted = np.cumprod(known & (chains == generated), axis=1).astype(bool)
    parent_accepted = np.pad(accepted, ((0, 0), (1, 0)), constant_values=True)[:, :-1]
    return known & parent_accepted, accepted
