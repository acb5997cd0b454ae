"""The running engine's step-cost curve, learned online from real steps.

One target step (drafting excluded) takes ``t(B, N, T) = a + b·B + c·(N − B) + d·T``
seconds for ``B`` requests, ``N`` scheduled tokens (``N − B``: drafts to verify and prefill
beyond one token per request) and ``T`` requests whose draft tree branches (tree attention
and KV compaction cost extra per such request). The fit is least squares over decaying
sums, pulled towards a start-up prior by a ridge worth ``prior_steps`` steps, so that the
per-token cost ``c`` stays sensible while steps do not yet vary in their token counts. Steps
far slower than predicted (an idle engine waiting for requests) are not learned from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Start-up priors (seconds): base, per request, per extra token, per branching tree. The CPU
# one is SmolLM2-135M fp32 on 2 cores; the data replaces either within tens of steps.
PRIORS = {
    "cpu": (0.040, 0.002, 0.0015, 0.02),
    "cuda": (0.010, 0.0002, 0.00005, 0.001),
}
FEATURES = 4
OUTLIER_FACTOR = 3.0
WARM_UP_STEPS = 8


@dataclass
class StepCostModel:
    """Ridge-regularised, exponentially forgetting least squares of step time."""

    prior: tuple[float, ...] = PRIORS["cpu"]
    forgetting: float = 0.99
    prior_steps: float = 16.0
    steps: int = 0
    rejected: int = 0
    _xx: np.ndarray = field(default_factory=lambda: np.zeros((FEATURES, FEATURES)), repr=False)
    _xy: np.ndarray = field(default_factory=lambda: np.zeros(FEATURES), repr=False)
    _theta: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def for_device(cls, device_type: str) -> StepCostModel:
        return cls(prior=PRIORS.get(device_type, PRIORS["cuda"]))

    @property
    def coefficients(self) -> np.ndarray:
        """``(a, b, c, d)`` in seconds, each at least zero."""
        if self._theta is None:
            self._theta = self._solve()
        return self._theta

    @property
    def per_token(self) -> float:
        return float(self.coefficients[2])

    @property
    def per_branching_tree(self) -> float:
        return float(self.coefficients[3])

    def predict(self, num_reqs: float, num_tokens: np.ndarray | float, branching: np.ndarray | float = 0) -> np.ndarray:
        """Seconds of one step with ``num_reqs`` requests, ``num_tokens`` tokens and
        ``branching`` branching trees."""
        a, b, c, d = self.coefficients
        return a + b * num_reqs + c * (np.asarray(num_tokens, np.float64) - num_reqs) + d * np.asarray(branching)

    def observe(self, seconds: float, num_reqs: int, num_tokens: int, branching: int = 0) -> bool:
        """Learn from one step; False when it was rejected as an outlier."""
        if num_reqs <= 0 or seconds <= 0:
            return False
        predicted = float(self.predict(num_reqs, num_tokens, branching))
        if self.steps >= WARM_UP_STEPS and seconds > OUTLIER_FACTOR * predicted:
            self.rejected += 1
            return False
        x = np.array([1.0, num_reqs, max(num_tokens - num_reqs, 0), branching])
        self._xx = self.forgetting * self._xx + np.outer(x, x)
        self._xy = self.forgetting * self._xy + x * seconds
        self.steps += 1
        self._theta = None
        return True

    def curve(self, num_reqs: int, max_extra_tokens: int = 64) -> list[dict]:
        """The learned curve at ``num_reqs`` requests, for logs and benchmarks."""
        extra = np.arange(max_extra_tokens + 1)
        seconds = self.predict(num_reqs, num_reqs + extra)
        return [{"extra_tokens": int(e), "seconds": float(s)} for e, s in zip(extra, seconds)]

    def _solve(self) -> np.ndarray:
        prior = np.asarray(self.prior, np.float64)
        # The ridge weighs the prior like prior_steps typical steps would.
        scale = np.array([1.0, 8.0, 8.0, 1.0]) ** 2 * self.prior_steps
        ridge = np.diag(scale)
        theta = np.linalg.solve(self._xx + ridge, self._xy + ridge @ prior)
        return np.maximum(theta, 0.0)
