"""The chain kernels (``csrc/chain_choice.h``) against the NumPy path they replace for chains:
calibration buckets and chances (with and without tokens' factors), path products and the
chooser, and the outcomes read back from the sampled tokens, exactly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_retrieval_spec.drafts import NUM_SOURCE_CODES, DraftNodes
from vllm_retrieval_spec.goodput import AcceptanceCalibration, NodeCandidates, StepCostModel, choose_nodes
from vllm_retrieval_spec.goodput.budget import _outcomes, _padded
from vllm_retrieval_spec.goodput.calibration import MAX_CHANCE, SHAPE
from vllm_retrieval_spec.goodput.paths import node_depths, path_products
from vllm_retrieval_spec.kernels.chain_choice import chain_outcomes, choose_chain_nodes


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
    with pytest.raises(ValueError, match="factor must have prob's shape"):
        choose_chain_nodes(nodes, np.array([2]), None, 1, calibration, StepCostModel().chain_terms(), 0.0, 0.05,
                           np.ones((1, 3)))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_outcomes_equal_the_numpy_path(rows, width, seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 3, (rows, width)).astype(np.int32)
    keep = np.arange(width)[None, :] < rng.integers(0, width + 1, rows)[:, None]  # kept nodes: a prefix
    sampled = [rng.integers(0, 3, int(rng.integers(0, width + 3))).tolist() for _ in range(rows)]
    chain = np.broadcast_to(np.arange(-1, width - 1, dtype=np.int32), (rows, width))
    want = _outcomes(tokens, chain, node_depths(chain), keep, _padded(sampled, width + 1))
    got = chain_outcomes(tokens, keep, sampled)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
