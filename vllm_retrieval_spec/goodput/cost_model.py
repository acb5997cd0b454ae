"""The running engine's step-cost curve, learned online from real steps.

One target step (drafting excluded) takes ``t(B, N, W, S, P) = a + b·B + c·(N − B − P) + d·W + e·S +
f·[W > 0] + g·P + h·[N > R]`` seconds for ``B`` requests, ``N`` scheduled tokens (``N − B − P`` of
them drafts to verify), ``P`` prompt tokens beyond one per request (prefill chunks, far cheaper per
token on a CPU, whose matmuls gain efficiency with the token count: in one term with the drafts, a
few long prefills pulled the fitted draft cost to half its true value and the chooser drafted too
deep), ``W`` thousands of (tree node × context token) pairs that tree attention recomputes (the
nodes after each branching tree's leading chain, each over its request's context; ``f`` is what a
step with any such node pays once: the per-layer kernel calls and the KV compaction), ``S`` draft
tokens of requests that sample (temperature > 0: verifying them needs the target's distribution, not
only its argmax); ``h`` is what a step of more than ``R`` tokens pays once on a CPU whose skinny
GEMM takes steps of at most ``R`` rows (``cpu_gemm_max_rows``): it runs oneDNN's GEMM instead, ~10
ms more than the linear terms at the crossing at 8 in flight on the 2-core VM, which a step of 32
requests crosses with its first draft token. The fit is least squares over decaying sums, pulled
towards a start-up prior by a ridge worth ``prior_steps`` steps, so that the per-token cost ``c``
stays sensible while steps do not yet vary in their token counts. Only a few: where every step has
the same number of requests the data fix ``a + b·B`` but not the split, and a prior base far from
the engine's (the CPU prior's 40 ms against 24 ms measured at 8 in flight) pulled ``c`` a quarter
below what the logged steps of that run fit by least squares (0.68 against 0.89 ms with the ridge
worth 16 steps, 0.81 with 4), and the chooser drafted nodes that cost more than they gave. A step
counts by the share of its predicted time that is not prefill, squared: a wave of long prompts
arrives as chunks of thousands of prompt tokens taking seconds, whose squared errors, counted in
full, outweighed every decode step (at 32 in flight on long prompts the fit after three such chunks
put ``b`` at 23 ms and ``c`` at 0, and the chooser verified 528 draft tokens in one 4-second step).
Steps far slower than predicted (an idle engine waiting for requests) are not learned from. On tensor-parallel
engines the step times are the first rank's (``clock``, ``ranks.py``).

Two time scales: the curve's shape (the terms above, the fit ``forgetting`` at 0.99, ~100 steps) is
multiplied by a scale that follows the ratio of the last ~10 decode steps' times to what the shape
predicted for them (``scale_forgetting``). A CPU engine's steps speed up and slow down together by
tens of percent within a minute (contexts growing, the machine's other work, an engine resuming
after another ran), which the fit alone followed late and by bending its terms: replayed on the
logged steps of three engines at 8 in flight on multi_turn it predicted the next decode step within
12.9% on average, with the scale within 9.2%; on chat HumanEval 10.2% (priced +4.8% dearer than the
steps ran) against 7.6% (+0.7%), on code_edit at 8 in flight 12.7–15.0% against 9.0–9.5%
(``benchmarks/cost_model_replay.py``, results README of 2026-11-30 noon). The scale moves every term
together, never the level of one (a base the shape has not yet learned is not hidden by it), so
what the chooser trades, one term against another, is the fit's: in one run beside the model
before, it served as that did (1.00×, 0.97–1.03). A shape over ~500 steps (``forgetting`` 0.998)
kept its terms steadier in most logs but served no faster in three A/B runs than the engines' own
step times differed. How far each prediction was from the step it then learned from
(:class:`PredictionError`, steps without prompt tokens: the ones the chooser prices) shows whether
the curve the budget drafts by is the engine's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from vllm_retrieval_spec.goodput.ranks import SharedClock
from vllm_retrieval_spec.kernels.chain_choice import ChainStepCost

# Start-up priors (seconds): base, per request, per draft token, per thousand tree-attention
# node-context pairs, per sampled draft token, per step with tree attention, per prefill token,
# per step past the skinny GEMM's rows; the data replaces them within tens of steps. CPU:
# SmolLM2-135M fp32 on 2 cores (tree terms as learned at batch 1,
# results/acceptance_code_edit_n10_t128_c1_item5_grain.json; the jump past the skinny GEMM's
# rows as learned at 8 in flight, 7-12 ms, results/acceptance_*_c8_wide_attention.json). CUDA: a 7B-shaped bf16
# stack in CUDA graphs on an H100, fitted over steps of ≤ 1024 tokens (benchmarks/verify_cost.py,
# results/verify_cost_h100.json); tree attention ~1.4 ms per layer for 8 trees of 16 nodes over
# 4,000 tokens (results/tree_attention_cuda.json).
PRIORS = {
    "cpu": (0.040, 0.002, 0.0015, 0.0012, 0.0002, 0.005, 0.0008, 0.008),
    "cuda": (0.0057, 0.00011, 0.000018, 0.00009, 0.00001, 0.0005, 0.000018, 0.0),
}
COST_TERMS = ("step", "request", "draft_token", "tree_attention_kilopair", "sampled_draft_token", "tree_step",
              "prefill_token", "past_kernel_rows")
FEATURES = len(COST_TERMS)
RIDGE_SCALES = np.array([1.0, 8.0, 8.0, 8.0, 8.0, 1.0, 64.0, 1.0])  # a typical step's value of each feature
OUTLIER_FACTOR = 3.0


def tree_work(recomputed_nodes: np.ndarray | float, context_tokens: np.ndarray | float) -> np.ndarray:
    """The cost model's ``W``: thousands of (node, context token) pairs tree attention recomputes
    for ``recomputed_nodes`` nodes each reading ``context_tokens`` tokens."""
    return np.asarray(recomputed_nodes, np.float64) * np.asarray(context_tokens, np.float64) / 1000.0


WARM_UP_STEPS = 8
# The scale's forgetting: it follows the last ~10 decode steps' time over what the shape predicted.
SCALE_FORGETTING = 0.9
STEP_LOG_STEPS = 100_000  # the most steps a kept step log holds (keep_step_log)
# Past the warm-up the fit follows the sums this many steps behind at most: a solve every step
# cost ~0.08 ms of a 25 ms step on the CPU engine.
SOLVE_EVERY_STEPS = 4


@dataclass
class PredictionError:
    """The model's one-step-ahead error on the steps it learned from, relative to each step's time
    and decayed like the shape's fit: how far off the curve the chooser reads was, recently."""

    steps: int = 0
    _weight: float = field(default=0.0, repr=False)
    _absolute: float = field(default=0.0, repr=False)  # decayed sum of |predicted - measured| / measured
    _signed: float = field(default=0.0, repr=False)  # decayed sum of (predicted - measured) / measured

    def add(self, predicted: float, seconds: float, forgetting: float) -> None:
        relative = (predicted - seconds) / seconds
        self._weight = forgetting * self._weight + 1.0
        self._absolute = forgetting * self._absolute + abs(relative)
        self._signed = forgetting * self._signed + relative
        self.steps += 1

    @property
    def mean_absolute(self) -> float:
        """The recent steps' mean |predicted − measured| ÷ measured (0 before any)."""
        return self._absolute / self._weight if self._weight else 0.0

    @property
    def bias(self) -> float:
        """The recent steps' mean (predicted − measured) ÷ measured: above 0 the model prices
        steps dearer than they run."""
        return self._signed / self._weight if self._weight else 0.0

    def report(self) -> dict[str, float | int]:
        return {"mean_absolute": self.mean_absolute, "bias": self.bias, "steps": self.steps}


@dataclass
class StepCostModel:
    """Ridge-regularised, exponentially forgetting least squares of step time."""

    prior: tuple[float, ...] = PRIORS["cpu"]
    forgetting: float = 0.99  # the shape's
    scale_forgetting: float = SCALE_FORGETTING  # 0: no scale (one fit, the model before 2026-11-30)
    prior_steps: float = 4.0
    kernel_rows: int = 0  # R: the most tokens a step runs the CPU's skinny GEMM on (0: no such bound)
    steps: int = 0
    rejected: int = 0
    clock: SharedClock | None = field(default=None, repr=False)  # None: this process's step times
    error: PredictionError = field(default_factory=PredictionError)  # of the decode and verification steps
    step_log: deque | None = field(default=None, repr=False)  # the steps observed, once keep_step_log asked
    _xx: np.ndarray = field(default_factory=lambda: np.zeros((FEATURES, FEATURES)), repr=False)
    _xy: np.ndarray = field(default_factory=lambda: np.zeros(FEATURES), repr=False)
    _shape: np.ndarray | None = field(default=None, repr=False)
    _ratio_sum: float = field(default=0.0, repr=False)  # decayed sum of measured ÷ shape-predicted seconds
    _ratio_weight: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if len(self.prior) != FEATURES:
            raise ValueError(f"a step-cost prior has {FEATURES} terms {COST_TERMS}, got {len(self.prior)}")
        # The ridge weighs the prior like prior_steps typical steps would.
        self._ridge = np.diag(RIDGE_SCALES**2 * self.prior_steps)
        self._ridge_prior = self._ridge @ np.asarray(self.prior, np.float64)

    @classmethod
    def for_device(cls, device_type: str, clock: SharedClock | None = None, kernel_rows: int = 0) -> StepCostModel:
        return cls(prior=PRIORS.get(device_type, PRIORS["cuda"]), clock=clock, kernel_rows=kernel_rows)

    def keep_step_log(self, max_steps: int = STEP_LOG_STEPS) -> None:
        """Keep the steps observed from now on (what :meth:`observe` is given, the last
        ``max_steps``), for benchmarks that replay them through other cost models."""
        self.step_log = deque(maxlen=max_steps)

    @property
    def coefficients(self) -> np.ndarray:
        """``(a, b, c, d, e, f, g, h)`` in seconds, each at least zero (``COST_TERMS``): the
        shape's terms times the scale."""
        return self.scale * self.shape

    @property
    def shape(self) -> np.ndarray:
        """The terms as fitted (``forgetting``), before the scale."""
        if self._shape is None:
            self._shape = self._solve()
        return self._shape

    @property
    def scale(self) -> float:
        """How much slower (above 1) or faster the recent decode steps ran than the shape predicted."""
        return self._ratio_sum / self._ratio_weight if self._ratio_weight else 1.0

    @property
    def per_token(self) -> float:
        return float(self.coefficients[2])

    @property
    def per_tree_kilopair(self) -> float:
        """What tree attention costs per thousand (recomputed node × context token) pairs."""
        return float(self.coefficients[3])

    @property
    def per_sampled_token(self) -> float:
        """What a draft token of a sampling request costs on top of ``per_token``."""
        return float(self.coefficients[4])

    @property
    def per_tree_step(self) -> float:
        """What a step that runs tree attention at all pays once."""
        return float(self.coefficients[5])

    def idle_seconds(self, num_reqs: int) -> float:
        """Seconds of a step of ``num_reqs`` requests without drafts (``predict(num_reqs,
        num_reqs)``, in scalars)."""
        a, b, *_, h = self.coefficients.tolist()
        return a + b * num_reqs + h * bool(self.past_kernel_rows(num_reqs))

    def past_kernel_rows(self, num_tokens: np.ndarray | float) -> np.ndarray:
        """Whether a step of ``num_tokens`` tokens is too large for the skinny GEMM."""
        if self.kernel_rows <= 0:
            return np.zeros(np.shape(num_tokens), bool)
        return np.asarray(num_tokens) > self.kernel_rows

    def chain_terms(self) -> ChainStepCost:
        """The terms a step verifying chains reads (no tree attention, no prefill)."""
        a, b, c, _, e, _, _, h = self.coefficients.tolist()
        return ChainStepCost(a, b, c, e, self.kernel_rows, h)

    def predict(self, num_reqs: float, num_tokens: np.ndarray | float, tree_work: np.ndarray | float = 0,
                sampled: np.ndarray | float = 0, prefill_tokens: float = 0) -> np.ndarray:
        """Seconds of one step with ``num_reqs`` requests, ``num_tokens`` tokens (of which
        ``prefill_tokens`` prompt tokens beyond one per request, the rest beyond ``num_reqs``
        drafts), ``tree_work`` thousand tree-attention node-context pairs and ``sampled`` draft
        tokens of requests that sample."""
        a, b, c, d, e, f, g, h = self.coefficients
        drafts = np.asarray(num_tokens, np.float64) - num_reqs - prefill_tokens
        tree_work = np.asarray(tree_work, np.float64)
        return (a + b * num_reqs + c * drafts + d * tree_work + e * np.asarray(sampled) + f * (tree_work > 0)
                + g * prefill_tokens + h * self.past_kernel_rows(num_tokens))

    def observe(self, seconds: float, num_reqs: int, num_tokens: int, tree_work: float = 0.0,
                sampled: int = 0, prefill_tokens: int = 0) -> bool:
        """Learn from one step; False when it was rejected as an outlier."""
        if self.clock is not None:
            seconds = self.clock.shared(seconds)
        if self.step_log is not None:
            self.step_log.append((seconds, num_reqs, num_tokens, tree_work, sampled, prefill_tokens))
        if num_reqs <= 0 or seconds <= 0:
            return False
        prefill_tokens = min(max(prefill_tokens, 0), max(num_tokens - num_reqs, 0))
        drafts = max(num_tokens - num_reqs - prefill_tokens, 0)
        x = np.array([1.0, num_reqs, drafts, tree_work, sampled, float(tree_work > 0), prefill_tokens,
                      float(self.past_kernel_rows(num_tokens))])
        by_shape = float(self.shape @ x)
        predicted = self.scale * by_shape
        if self.steps >= WARM_UP_STEPS and seconds > OUTLIER_FACTOR * predicted:
            self.rejected += 1
            return False
        if self.steps >= WARM_UP_STEPS and prefill_tokens == 0 and by_shape > 0.0:
            self.error.add(predicted, seconds, self.forgetting)
            if self.scale_forgetting > 0.0:
                self._ratio_sum = self.scale_forgetting * self._ratio_sum + seconds / by_shape
                self._ratio_weight = self.scale_forgetting * self._ratio_weight + 1.0
        weight = self._weight(x, predicted)
        self._xx = self.forgetting * self._xx + weight * np.outer(x, x)
        self._xy = self.forgetting * self._xy + weight * x * seconds
        self.steps += 1
        if self.steps <= WARM_UP_STEPS or self.steps % SOLVE_EVERY_STEPS == 0:
            self._shape = None
        return True

    def _weight(self, x: np.ndarray, predicted: float) -> float:
        """How much a step of features ``x`` and ``predicted`` seconds counts: the share of that
        time that is not prefill, squared (1 for a step without prompt tokens beyond one per
        request)."""
        prefill = float(self.coefficients[6] * x[6])
        if prefill <= 0.0:
            return 1.0
        rest = predicted - prefill
        return (rest / predicted) ** 2 if rest > 0.0 else 0.0

    def curve(self, num_reqs: int, max_extra_tokens: int = 64) -> list[dict]:
        """The learned curve at ``num_reqs`` requests, for logs and benchmarks."""
        extra = np.arange(max_extra_tokens + 1)
        seconds = self.predict(num_reqs, num_reqs + extra)
        return [{"extra_tokens": int(e), "seconds": float(s)} for e, s in zip(extra, seconds)]

    def _solve(self) -> np.ndarray:
        return np.maximum(np.linalg.solve(self._xx + self._ridge, self._xy + self._ridge_prior), 0.0)
