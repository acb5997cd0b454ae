"""The chain kernels (``csrc/chain_choice.h``) against the NumPy path they replace for chains:
calibration buckets and chances (with and without tokens' factors), path products and the
chooser, and the outcomes read back from the sampled tokens, exactly; the calibration's chance
table against its NumPy reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_retrieval_spec.drafts import NUM_SOURCE_CODES, DraftNodes, count_sources
from vllm_retrieval_spec.goodput import (
    AcceptanceCalibration,
    GoodputBudget,
    NodeCandidates,
    StepCostModel,
    choose_nodes,
)
from vllm_retrieval_spec.goodput.budget import PendingNodes, _outcomes, _padded
from vllm_retrieval_spec.goodput.calibration import (
    MAX_CHANCE,
    MIN_CHANCE,
    NUM_PRIOR_POOLS,
    PRIOR_POOL,
    RAW_PRIOR_SCALE,
    SHAPE,
)
from vllm_retrieval_spec.goodput.paths import node_depths, path_products
from vllm_retrieval_spec.goodput.token_factor import TokenFactor
from vllm_retrieval_spec.kernels.chain_choice import choose_chain_nodes, count_chain_outcomes
from vllm_retrieval_spec.kernels.chance_table_reference import chance_table as reference_chance_table


def numpy_chain_choice(calibration: AcceptanceCalibration, cost: StepCostModel, nodes: DraftNodes,
                       budgets: np.ndarray, samples: np.ndarray | None, num_reqs: int, draft_seconds: float,
                       margin: float, factor: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Buckets, chances given the parent and the kept nodes as the NumPy path computes them."""
    depth = node_depths(nodes.parents)
    bucket = calibration.buckets(nodes, depth)
    valid = np.arange(nodes.width)[None, :] < nodes.size[:, None]
    chance = np.where(valid, np.minimum(calibration.estimate(bucket, nodes.prob), MAX_CHANCE), 0.0)
    scaled = chance if factor is None else np.minimum(chance * factor, MAX_CHANCE)
    candidates = NodeCandidates(path_products(scaled, nodes.parents), budgets, num_reqs, None, samples)
    return bucket, chance, choose_nodes(candidates, cost, draft_seconds, margin).keep


def trained_calibration(seed: int, observations: int) -> AcceptanceCalibration:
    """A calibration that has seen ``observations`` random outcomes in a few sources' buckets."""
    rng = np.random.default_rng(seed)
    calibration = AcceptanceCalibration()
    sources = rng.integers(0, NUM_SOURCE_CODES, 4)
    bucket = np.ravel_multi_index((rng.choice(sources, observations), rng.integers(0, SHAPE[1], observations),
                                   rng.integers(0, SHAPE[2], observations), rng.integers(0, SHAPE[3], observations)),
                                  SHAPE)
    calibration.observe(bucket, rng.random(observations), rng.random(observations) < 0.6)
    return calibration


@st.composite
def chain_steps(draw):
    rows, width = draw(st.integers(1, 6)), draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    prob = rng.choice([0.0, 0.05, 0.5, 0.95, 1.0, *rng.random(4)], (rows, width)).astype(np.float32)
    nodes = DraftNodes(
        tokens=rng.integers(0, 100, (rows, width), dtype=np.int32),
        parents=np.broadcast_to(np.arange(-1, width - 1, dtype=np.int32), (rows, width)),
        size=rng.integers(0, width + 1, rows).astype(np.int32),
        prob=prob,
        source=rng.choice([1, 2, 3, 8, 10, 32, 127], (rows, width)).astype(np.int8),
        match_len=rng.integers(0, 40, (rows, width)).astype(np.int32),
    )
    budgets = np.where(rng.random(rows) < 0.5, width, rng.integers(0, width + 1, rows)).astype(np.int32)
    samples = None if draw(st.booleans()) else rng.random(rows) < 0.5
    factor = None if draw(st.booleans()) else rng.choice([1 / 8, 0.5, 1.0, 1.7, 2.0], (rows, width))
    cost = StepCostModel(prior=(0.02 * rng.random(), 0.002 * rng.random(), 0.002 * rng.random(), 0.001, 0.001 *
                                rng.random(), 0.005, 0.0008, 0.02 * rng.random()),
                         kernel_rows=int(rng.choice([0, *rng.integers(1, rows + width + 2, 3)])))
    return (nodes, budgets, samples, rows + int(rng.integers(0, 3)), cost,
            trained_calibration(seed, int(rng.integers(0, 3000))), float(0.002 * rng.random()),
            float(rng.choice([0.0, 0.05, 0.5])), factor)


@settings(max_examples=200, deadline=None)
@given(chain_steps())
def test_kernel_equals_the_numpy_path(step):
    nodes, budgets, samples, num_reqs, cost, calibration, draft_seconds, margin, factor = step
    bucket, chance, keep = choose_chain_nodes(nodes, budgets, samples, num_reqs, calibration.chain_calibration(),
                                              cost.chain_terms(), draft_seconds, margin, factor)
    want_bucket, want_chance, want_keep = numpy_chain_choice(calibration, cost, nodes, budgets, samples, num_reqs,
                                                             draft_seconds, margin, factor)
    valid = np.arange(nodes.width)[None, :] < nodes.size[:, None]
    assert np.array_equal(keep, want_keep)
    assert np.array_equal(chance, want_chance)
    assert np.array_equal(bucket[valid], want_bucket[valid])


def test_the_kernel_drafts_a_likely_chain_and_skips_a_worthless_one():
    calibration = trained_calibration(0, 0)
    width = 8
    nodes = DraftNodes(np.zeros((2, width), np.int32), np.broadcast_to(np.arange(-1, width - 1, dtype=np.int32),
                                                                         (2, width)),
                       np.array([width, width], np.int32), np.array([[1.0] * width, [0.01] * width], np.float32),
                       np.full((2, width), 2, np.int8), np.array([[20] * width, [1] * width], np.int32))
    cost = StepCostModel(prior=(0.02, 0.001, 0.0005, 0.0, 0.0, 0.0, 0.0, 0.0))
    _, _, keep = choose_chain_nodes(nodes, np.full(2, width, np.int32), None, 2, calibration.chain_calibration(),
                                    cost.chain_terms(), 0.0, 0.05)
    assert keep[0, :3].all() and not keep[1].any()


@pytest.mark.parametrize(("past_kernel_rows", "kept"), [(0.0, 8), (0.0005, 8), (0.005, 3)])
def test_a_step_past_the_skinny_gemms_rows_pays_its_jump(past_kernel_rows, kept):
    """One request, a chain of 8 nodes that each pay for their own cost and a skinny GEMM of 4
    rows: a jump past it that the last 5 nodes pay for is paid, a dearer one keeps the step within
    the kernel's rows (3 drafts)."""
    width = 8
    nodes = DraftNodes(np.zeros((1, width), np.int32), np.arange(-1, width - 1, dtype=np.int32)[None, :],
                       np.array([width], np.int32), np.ones((1, width), np.float32), np.full((1, width), 2, np.int8),
                       np.full((1, width), 20, np.int32))
    calibration = AcceptanceCalibration()  # untrained: chances 0.5 at depth 0, 0.475 below
    cost = StepCostModel(prior=(0.02, 0.001, 1e-6, 0.0, 0.0, 0.0, 0.0, past_kernel_rows), prior_steps=1e9,
                         kernel_rows=4)
    _, chance, keep = choose_chain_nodes(nodes, np.array([width], np.int32), None, 1,
                                         calibration.chain_calibration(), cost.chain_terms(), 0.0, 0.05)
    assert keep[0].sum() == kept and keep[0, :kept].all(), chance


def test_a_lookup_outside_the_table_or_a_factor_of_another_shape_is_refused():
    calibration = AcceptanceCalibration().chain_calibration()
    broken = dataclasses.replace(calibration, depth_bucket=np.full(4, SHAPE[2], np.int32))
    nodes = DraftNodes(np.zeros((1, 2), np.int32), np.array([[-1, 0]], np.int32), np.array([2], np.int32),
                       np.ones((1, 2), np.float32), np.full((1, 2), 2, np.int8), np.ones((1, 2), np.int32))
    with pytest.raises(ValueError, match="depth_bucket entries must lie in"):
        choose_chain_nodes(nodes, np.array([2]), None, 1, broken, StepCostModel().chain_terms(), 0.0, 0.05)
    for pool, refusal in ((np.full(NUM_SOURCE_CODES, NUM_PRIOR_POOLS, np.int32), "pool holds a pool outside"),
                          (np.zeros(3, np.int32), "one entry per source code")):
        with pytest.raises(ValueError, match=refusal):
            choose_chain_nodes(nodes, np.array([2]), None, 1, dataclasses.replace(calibration, pool=pool),
                               StepCostModel().chain_terms(), 0.0, 0.05)
    with pytest.raises(ValueError, match="factor must have prob's shape"):
        choose_chain_nodes(nodes, np.array([2]), None, 1, calibration, StepCostModel().chain_terms(), 0.0, 0.05,
                           np.ones((1, 3)))


def numpy_chain_read_back(budget: GoodputBudget, pending: PendingNodes, step_rows: np.ndarray,
                          sampled_token_ids: list[list[int]]) -> None:
    """The read-back of a chain step as NumPy computes it: the tree path's outcomes over chain
    parents, then the first node of each greedy row that kept none learned from the sampled token."""
    present = step_rows >= 0
    sampled = [sampled_token_ids[row] for row in step_rows[present]]
    tokens, keep = pending.tokens[present], pending.keep[present]
    chance, bucket, source = pending.chance[present], pending.bucket[present], pending.source[present]
    chain = np.broadcast_to(np.arange(-1, tokens.shape[1] - 1, dtype=np.int32), tokens.shape)
    accepted, observed = _outcomes(tokens, chain, node_depths(chain), keep, _padded(sampled, tokens.shape[1] + 1))
    budget.calibration.observe(bucket[observed], chance[observed], accepted[observed])
    budget.tokens.record(tokens[observed], chance[observed], accepted[observed])
    stats = budget.stats
    stats.observed_nodes += int(observed.sum())
    stats.accepted_nodes += int(accepted.sum())
    count_sources(stats.observed_by_source, source[observed])
    count_sources(stats.accepted_by_source, source[accepted])
    target = _padded(sampled, 1)[:, 0]
    seen = pending.unsent_first[present] & (target >= 0) & (chance[:, 0] > 0)
    hits = tokens[:, 0][seen] == target[seen]
    budget.calibration.observe(bucket[:, 0][seen], chance[:, 0][seen], hits)
    budget.tokens.record(tokens[:, 0][seen], chance[:, 0][seen], hits)
    stats.unsent_observed_nodes += int(seen.sum())
    stats.unsent_accepted_nodes += int(hits.sum())


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(0, 2**31 - 1), st.booleans())
def test_the_read_back_of_chains_equals_the_numpy_path(rows, width, seed, token_factors):
    """Outcomes, calibration counts, tokens' sums and counters after one chain step read back by
    the kernel equal NumPy's, exactly; requests that left the batch are not read."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 3, (rows, width)).astype(np.int32)
    tokens[rng.random((rows, width)) < 0.1] = -1
    keep = np.arange(width)[None, :] < rng.integers(0, width + 1, rows)[:, None]  # kept nodes: a prefix
    unsent_first = ~keep.any(axis=1) & (tokens[:, 0] >= 0) & (rng.random(rows) < 0.8)
    chance = rng.choice([0.0, 0.3, *rng.random(3)], (rows, width))
    pending = PendingNodes([f"r{i}" for i in range(rows)], tokens, np.zeros_like(tokens),
                           np.zeros_like(tokens), rng.integers(0, int(np.prod(SHAPE)), (rows, width)), chance, keep,
                           rng.choice([1, 2, 3, 8, 10, 32, 127], (rows, width)).astype(np.int8),
                           np.zeros((rows, width), bool), 1.0, chains=True, unsent_first=unsent_first)
    step_rows = rng.permutation(rows + 2)[:rows] - 1  # -1: the request left the batch
    sampled = [rng.integers(0, 3, int(rng.integers(0, width + 3))).tolist() for _ in range(rows + 1)]
    budgets = [GoodputBudget(tokens=TokenFactor(enabled=token_factors, vocab_size=2)) for _ in range(2)]
    for budget in budgets:
        budget.observe(["x"], [[1]])  # the calibration's table built before, as in a running budget
        budget.calibration.observe(np.array([5, 5]), np.array([0.4, 0.7]), np.array([True, False]))
    numpy_chain_read_back(budgets[0], pending, step_rows, sampled)
    req_ids = [f"new{i}" for i in range(rows + 1)]  # this step's rows: the pending ones still there, new ones
    for row, step_row in enumerate(step_rows.tolist()):
        if step_row >= 0:
            req_ids[step_row] = f"r{row}"
    budgets[1]._pending = pending
    budgets[1].observe(req_ids, sampled)
    want, got = budgets
    for expected, actual in zip(want.calibration.count_arrays(), got.calibration.count_arrays()):
        assert np.array_equal(expected, actual)
    for kind in ("predicted", "accepted"):
        expected, actual = getattr(want.tokens, kind), getattr(got.tokens, kind)
        assert np.array_equal(expected, actual[: len(expected)]) and not actual[len(expected):].any()  # grown ahead
    assert want.stats == got.stats


def test_the_read_back_refuses_buckets_tokens_and_rows_outside_its_tables():
    tokens, keep = np.array([[4, 5]], np.int32), np.array([[True, False]])
    bucket, chance, source = np.zeros((1, 2), np.int64), np.full((1, 2), 0.5), np.full((1, 2), 2, np.int8)
    counts = AcceptanceCalibration().count_arrays()
    sums = (np.zeros(5), np.zeros(5))

    def read_back(**changed):
        arguments = dict(tokens=tokens, keep=keep, bucket=bucket, chance=chance, source=source, unsent_first=None,
                         step_rows=np.array([0]), sampled=[[4, 9]], counts=counts, token_sums=sums) | changed
        return count_chain_outcomes(**arguments)

    assert read_back(token_sums=(np.zeros(6), np.zeros(6))).observed == 1
    with pytest.raises(ValueError, match="outside the token factors' table"):
        read_back()
    with pytest.raises(ValueError, match="outside the calibration's buckets"):
        read_back(bucket=np.full((1, 2), int(np.prod(SHAPE))), token_sums=None)
    with pytest.raises(ValueError, match="step_rows must index sampled"):
        read_back(step_rows=np.array([1]), token_sums=None)
    with pytest.raises(ValueError, match="share one 4-d shape"):
        read_back(counts=(*counts[:4], np.zeros((2, 2, 2, 2))), token_sums=None)


@pytest.mark.parametrize("observations", [0, 1, 40, 3000])
def test_the_chance_table_equals_its_numpy_reference(observations):
    calibration = trained_calibration(observations, observations)
    for _ in range(observations % 7):
        calibration.tick()
    calibration.accepted *= 0.5 ** (observations % 3)  # decayed counts
    table = calibration.chance_table()
    want, first_accepted, first_observed, best = reference_chance_table(
        calibration.accepted, calibration.observed, calibration.prior_strength, RAW_PRIOR_SCALE, MIN_CHANCE,
        MAX_CHANCE, PRIOR_POOL, NUM_PRIOR_POOLS)
    np.testing.assert_allclose(calibration.chain_calibration().chances, want, rtol=1e-12, atol=0)
    np.testing.assert_allclose(table.chance, want.astype(np.float32), rtol=1e-6, atol=0)
    chain = calibration.chain_calibration()
    assert np.array_equal(chain.first_accepted, first_accepted) and np.array_equal(chain.first_observed,
                                                                                    first_observed)
    assert calibration.best_first_chance() == best
