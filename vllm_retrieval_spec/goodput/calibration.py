"""Acceptance chances of draft nodes, calibrated online against what verification accepted.

A node's chance of being accepted given that its parent is comes from decaying,
Laplace-smoothed counts keyed by (source, match-length bucket, depth, raw-probability
bucket). Sparse buckets borrow from their (source, depth) total, which borrows from the
drafter's own guess (its raw probability, halved: drafters are over-confident). Counts are
halved every ``decay_every`` steps so that the estimates follow the traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_retrieval_spec.drafts import NUM_SOURCE_CODES, DraftNodes

# Match-length buckets: 0 | 1 | 2 | 3-4 | 5-8 | 9-16 | 17+ tokens.
MATCH_LENGTH_EDGES = np.array([1, 2, 3, 5, 9, 17])
MAX_DEPTH = 16  # deeper nodes share the last depth bucket
PROB_BUCKETS = 10  # raw probability in tenths
SHAPE = (NUM_SOURCE_CODES, len(MATCH_LENGTH_EDGES) + 1, MAX_DEPTH, PROB_BUCKETS)
RAW_PRIOR_SCALE = 0.5
MAX_CHANCE = 0.99
MIN_CHANCE = 1e-4


def node_depths(parents: np.ndarray) -> np.ndarray:
    """Depth (0 = a child of the root) of every node of ``[rows, N]`` parents-first trees."""
    depth = np.zeros(parents.shape, np.int32)
    rows = np.arange(parents.shape[0])
    for column in range(1, parents.shape[1]):
        parent = parents[:, column]
        depth[:, column] = np.where(parent >= 0, depth[rows, np.maximum(parent, 0)] + 1, 0)
    return depth


def path_products(chance: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """The chance that each node is accepted: the product of conditional chances along its path."""
    path = chance.astype(np.float64, copy=True)
    rows = np.arange(parents.shape[0])
    for column in range(1, parents.shape[1]):
        parent = parents[:, column]
        path[:, column] *= np.where(parent >= 0, path[rows, np.maximum(parent, 0)], 1.0)
    return path


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
    # The same decaying counts summed per (source, depth): the prior of sparse buckets.
    accepted_coarse: np.ndarray = field(default_factory=lambda: np.zeros((SHAPE[0], SHAPE[2])))
    observed_coarse: np.ndarray = field(default_factory=lambda: np.zeros((SHAPE[0], SHAPE[2])))
    steps: int = 0

    @staticmethod
    def buckets(nodes: DraftNodes, depth: np.ndarray) -> np.ndarray:
        """The flat bucket index of every node, ``[rows, N]``."""
        length = np.searchsorted(MATCH_LENGTH_EDGES, nodes.match_len, side="right")
        prob = np.clip((nodes.prob * PROB_BUCKETS).astype(np.int64), 0, PROB_BUCKETS - 1)
        source = np.asarray(nodes.source, np.int64) % NUM_SOURCE_CODES
        return np.ravel_multi_index((source, length, np.minimum(depth, MAX_DEPTH - 1), prob), SHAPE)

    def estimate(self, bucket: np.ndarray, raw_prob: np.ndarray) -> np.ndarray:
        """Calibrated chance per node that it is accepted given its parent is."""
        strength = self.prior_strength
        coarse = _coarse_index(bucket)
        guess = RAW_PRIOR_SCALE * np.asarray(raw_prob, np.float64)
        coarse_chance = (self.accepted_coarse.reshape(-1)[coarse] + strength * guess) / (
            self.observed_coarse.reshape(-1)[coarse] + strength)
        flat_accepted, flat_observed = self.accepted.reshape(-1), self.observed.reshape(-1)
        chance = (flat_accepted[bucket] + strength * coarse_chance) / (flat_observed[bucket] + strength)
        return np.clip(chance, MIN_CHANCE, MAX_CHANCE)

    def best_first_chance(self) -> float:
        """The best calibrated chance of a root child in any bucket this drafter's nodes have
        been seen in (the prior guess for a raw probability of 1 before any): the optimistic
        bound behind skipping searches. Decay lets a skipped drafter's buckets drift back."""
        strength = self.prior_strength
        observed = self.observed[:, :, 0]
        if not (observed > 0).any():
            return RAW_PRIOR_SCALE
        depth0 = (self.accepted[:, :, 0] + strength * RAW_PRIOR_SCALE) / (observed + strength)
        return float(min(depth0[observed > 0].max(), MAX_CHANCE))

    def observe(self, bucket: np.ndarray, predicted: np.ndarray, accepted: np.ndarray) -> None:
        """Record the outcome of every node whose parent was accepted (one step's worth)."""
        hits = accepted.astype(np.float64)
        coarse = _coarse_index(bucket)
        for counts, index, values in ((self.accepted, bucket, hits), (self.observed, bucket, 1.0),
                                      (self.accepted_coarse, coarse, hits), (self.observed_coarse, coarse, 1.0),
                                      (self.accepted_total, bucket, hits), (self.observed_total, bucket, 1.0),
                                      (self.predicted_total, bucket, predicted)):
            np.add.at(counts.reshape(-1), index, values)

    def tick(self) -> None:
        """One budget step passed. Counts halve every ``decay_every`` steps, drafted or not, so a
        bucket that stopped being drafted drifts back to its prior and gets tried again."""
        self.steps += 1
        if self.steps % self.decay_every == 0:
            for counts in (self.accepted, self.observed, self.accepted_coarse, self.observed_coarse):
                counts *= 0.5

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


def _coarse_index(bucket: np.ndarray) -> np.ndarray:
    """The flat (source, depth) index of flat bucket indices."""
    source, _, depth, _ = np.unravel_index(bucket, SHAPE)
    return source * SHAPE[2] + depth
