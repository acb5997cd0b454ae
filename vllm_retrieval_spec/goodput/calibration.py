"""Acceptance chances of draft nodes, calibrated online against what verification accepted.

A node's chance of being accepted given that its parent is comes from decaying,
Laplace-smoothed counts keyed by (source, match-length bucket, depth bucket, raw-probability
bucket). Depth buckets are exact up to 8 and log-spaced beyond (two per doubling), so that deep
drafts (up to vLLM's 128 tokens) keep separate estimates without thinning the shallow ones.
A sparse bucket borrows from the same bucket one depth shallower: acceptance given the parent
rarely falls with depth (a copy that held for 8 tokens tends to hold for the 9th), and a bucket
too deep to have been drafted yet must start where its shallower neighbour stands, not at a
guess so low that the chooser never drafts it and never learns otherwise. A depth-0 bucket
borrows from the depth-0 nodes of its match length of every source of its prior pool (the
strongest predictor: a 16-token match is accepted far more often than a 1-token one, whichever
sources found it, so a new combination of sources starts where its match length stands), which
borrow from the drafter's own guess (its raw probability, halved: drafters are over-confident).
Two pools: a node a dense source drafted (``SOURCE_DENSE``, ``SOURCE_LEARNED``, alone or with
others) has for its "match length" the number of neighbours that agreed with the sampled token,
not matched tokens, and pools with the other dense ones; every other node with the sparse ones,
so that the dense nodes Hybrid's search gate learns from without sending them leave REST's own
sources' chances as REST alone would have them. Counts are halved every ``decay_every`` steps so
that the estimates follow the traffic.
:meth:`AcceptanceCalibration.chance_table` gives every bucket's chance to REST's kernel, which
ranks its candidates by it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_retrieval_spec.drafts import NUM_SOURCE_CODES, SOURCE_DENSE, SOURCE_LEARNED, DraftNodes
from vllm_retrieval_spec.kernels.chain_choice import ChainCalibration, fill_chance_table
from vllm_retrieval_spec.kernels.rest import ChanceTable
from vllm_retrieval_spec.options import MAX_SPEC_LEN

# Match-length buckets: 0 | 1 | 2 | 3-4 | 5-8 | 9-16 | 17+ tokens.
MATCH_LENGTH_EDGES = np.array([1, 2, 3, 5, 9, 17])
# Depth buckets (0 = a child of the root): 0 | 1 | ... | 7 | 8-11 | 12-15 | 16-23 | 24-31 | 32-47 |
# 48-63 | 64-95 | 96+.
DEPTH_EDGES = np.array([1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 96])
PROB_BUCKETS = 10  # raw probability in tenths
# Each source code's prior pool (module docstring): 1 with a dense flag, else 0.
PRIOR_POOL = ((np.arange(NUM_SOURCE_CODES) & (SOURCE_DENSE | SOURCE_LEARNED)) != 0).astype(np.int32)
NUM_PRIOR_POOLS = 2
SHAPE = (NUM_SOURCE_CODES, len(MATCH_LENGTH_EDGES) + 1, len(DEPTH_EDGES) + 1, PROB_BUCKETS)
# Bucket lookups (longer or deeper: the last entry's), shared with the kernel's ChanceTable.
LENGTH_BUCKET = np.searchsorted(MATCH_LENGTH_EDGES, np.arange(MATCH_LENGTH_EDGES[-1] + 1), "right").astype(np.int32)
DEPTH_BUCKET = np.searchsorted(DEPTH_EDGES, np.arange(MAX_SPEC_LEN), "right").astype(np.int32)
RAW_PRIOR_SCALE = 0.5
MAX_CHANCE = 0.99
MIN_CHANCE = 1e-4
TABLE_REFRESH_STEPS = 4  # the kernel's chance table follows the counts this many steps behind at most


def _smoothed(accepted: np.ndarray, observed: np.ndarray, prior: np.ndarray, strength: float) -> np.ndarray:
    """Laplace-smoothed chance: a bucket's counts shrunk towards ``prior`` (arrays that
    broadcast together)."""
    return np.clip((accepted + strength * prior) / (observed + strength), MIN_CHANCE, MAX_CHANCE)


def _first_prior(length_accepted: np.ndarray, length_observed: np.ndarray, raw_prob: np.ndarray,
                 strength: float) -> np.ndarray:
    """The prior of a depth-0 bucket: the depth-0 counts of its match length over the drafter's
    halved guess."""
    return (length_accepted + strength * RAW_PRIOR_SCALE * raw_prob) / (length_observed + strength)


@dataclass
class AcceptanceCalibration:
    """Decaying acceptance counts per bucket, and the totals behind the calibration plot."""

    decay_every: int = 1024
    prior_strength: float = 2.0
    accepted: np.ndarray = field(default_factory=lambda: np.zeros(SHAPE))
    observed: np.ndarray = field(default_factory=lambda: np.zeros(SHAPE))
    # Never decayed, for reports: per bucket, the chances predicted and the outcomes.
    predicted_total: np.ndarray = field(default_factory=lambda: np.zeros(SHAPE))
    accepted_total: np.ndarray = field(default_factory=lambda: np.zeros(SHAPE))
    observed_total: np.ndarray = field(default_factory=lambda: np.zeros(SHAPE))
    steps: int = 0
    _chances: np.ndarray | None = field(default=None, repr=False)  # what _table holds, in float64
    _best_first: float = field(default=RAW_PRIOR_SCALE, repr=False)  # best_first_chance() at the last refresh
    # Depth-0 accepted and observed counts per prior pool and match-length bucket, at the last refresh.
    _first: tuple[np.ndarray, np.ndarray] = field(default=(np.zeros(0), np.zeros(0)), repr=False)
    _table: ChanceTable | None = field(default=None, repr=False)
    _table_step: int = -TABLE_REFRESH_STEPS
    _table_stale: bool = True

    @staticmethod
    def buckets(nodes: DraftNodes, depth: np.ndarray) -> np.ndarray:
        """The flat bucket index of every node, ``[rows, N]``."""
        length = LENGTH_BUCKET[np.clip(nodes.match_len, 0, len(LENGTH_BUCKET) - 1)]
        deep = DEPTH_BUCKET[np.clip(depth, 0, len(DEPTH_BUCKET) - 1)]
        prob = np.clip((nodes.prob * PROB_BUCKETS).astype(np.int64), 0, PROB_BUCKETS - 1)
        source = np.asarray(nodes.source, np.int64) % NUM_SOURCE_CODES
        return np.ravel_multi_index((source, length, deep, prob), SHAPE)

    def estimate(self, bucket: np.ndarray, raw_prob: np.ndarray) -> np.ndarray:
        """Calibrated chance per node that it is accepted given its parent is (at depth 0 with
        the node's own raw guess in the prior, deeper as in :meth:`chance_table`)."""
        source, length, depth, _ = np.unravel_index(bucket, SHAPE)
        self.chance_table()  # past depth 0 the table's chances, and depth 0's prior as of its refresh
        accepted, observed = self._first
        first = _smoothed(self.accepted.reshape(-1)[bucket], self.observed.reshape(-1)[bucket],
                          _first_prior(accepted[PRIOR_POOL[source], length], observed[PRIOR_POOL[source], length],
                                       np.asarray(raw_prob, np.float64),
                                       self.prior_strength), self.prior_strength)
        return np.where(depth > 0, self._chances.reshape(-1)[bucket], first)

    def chance_table(self) -> ChanceTable:
        """Every bucket's chance (its raw-probability bucket's midpoint as the drafter's guess),
        for the kernel to rank candidates by and for :meth:`estimate` past depth 0; rebuilt at
        most every ``TABLE_REFRESH_STEPS`` steps and only after new observations (the same
        arrays otherwise: nothing copied)."""
        if self._table is None or (self._table_stale and self.steps - self._table_step >= TABLE_REFRESH_STEPS):
            if self._table is None:  # filled in place from now on: no 1.7 MB of new arrays per refresh
                self._chances = np.empty(SHAPE)
                self._table = ChanceTable(np.empty(SHAPE, np.float32), LENGTH_BUCKET, DEPTH_BUCKET)
                self._first = (np.empty((NUM_PRIOR_POOLS, SHAPE[1])), np.empty((NUM_PRIOR_POOLS, SHAPE[1])))
            self._best_first = fill_chance_table(self.accepted, self.observed, self.prior_strength, RAW_PRIOR_SCALE,
                                                 MIN_CHANCE, MAX_CHANCE, self._chances, self._table.chance,
                                                 *self._first, PRIOR_POOL)
            self._table_step, self._table_stale = self.steps, False
        return self._table

    def chain_calibration(self) -> ChainCalibration:
        """What the chain chooser's kernel reads to estimate chances as :meth:`estimate` does
        (views of the current counts and table: valid until the next step)."""
        self.chance_table()
        first_accepted, first_observed = self._first
        return ChainCalibration(self._chances, self.accepted, self.observed, first_accepted, first_observed,
                                PRIOR_POOL, LENGTH_BUCKET, DEPTH_BUCKET, self.prior_strength, RAW_PRIOR_SCALE,
                                MIN_CHANCE, MAX_CHANCE)

    def best_first_chance(self) -> float:
        """The best calibrated chance of a root child in any bucket this drafter's nodes have
        been seen in (the prior guess for a raw probability of 1 before any): the optimistic
        bound behind skipping searches, refreshed with :meth:`chance_table`. Decay lets a skipped
        drafter's buckets drift back."""
        self.chance_table()
        return self._best_first

    def counts(self) -> np.ndarray:
        """A copy of the decaying counts, ``[accepted, observed]`` (what an output index snapshot
        saves)."""
        return np.stack([self.accepted, self.observed])

    def restore_counts(self, counts: np.ndarray) -> None:
        """Start from saved :meth:`counts` (a copy taken mid-step may hold an acceptance whose
        observation it missed: accepted counts are capped by the observed ones)."""
        if counts.shape != (2, *SHAPE):
            raise ValueError(f"counts of shape {counts.shape}, not {(2, *SHAPE)}")
        self.observed = np.array(counts[1], np.float64)
        self.accepted = np.minimum(counts[0], self.observed)
        self._table = None

    def observe(self, bucket: np.ndarray, predicted: np.ndarray, accepted: np.ndarray) -> None:
        """Record the outcome of every node whose parent was accepted (one step's worth)."""
        hits = accepted.astype(np.float64)
        for counts, values in zip(self.count_arrays(), (hits, 1.0, hits, 1.0, predicted)):
            np.add.at(counts.reshape(-1), bucket, values)
        self.counts_changed()

    def count_arrays(self) -> tuple[np.ndarray, ...]:
        """The arrays a step's outcomes add to, in place: accepted, observed, accepted_total,
        observed_total, predicted_total (what ``kernels/chain_choice.py``'s read-back fills)."""
        return self.accepted, self.observed, self.accepted_total, self.observed_total, self.predicted_total

    def counts_changed(self) -> None:
        """New outcomes were added to :meth:`count_arrays`: the chance table refreshes on its turn."""
        self._table_stale = True

    def tick(self) -> None:
        """One budget step passed. Counts halve every ``decay_every`` steps, drafted or not, so a
        bucket that stopped being drafted drifts back to its prior and gets tried again."""
        self.steps += 1
        if self.steps % self.decay_every == 0:
            for counts in (self.accepted, self.observed):
                counts *= 0.5
            self._table_stale = True

    def report(self, min_observations: int = 1) -> list[dict]:
        """Per bucket with enough observations: its key, the mean predicted chance and the
        observed acceptance rate."""
        rows = []
        for index in np.flatnonzero(self.observed_total.reshape(-1) >= min_observations):
            source, length, depth, prob = (int(i) for i in np.unravel_index(index, SHAPE))
            count = float(self.observed_total.reshape(-1)[index])
            rows.append({
                "source": source, "match_length_bucket": length, "depth": depth, "raw_prob_bucket": prob,
                "observations": int(count),
                "predicted": float(self.predicted_total.reshape(-1)[index] / count),
                "observed": float(self.accepted_total.reshape(-1)[index] / count),
            })
        return rows

