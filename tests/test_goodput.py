"""The goodput budget without an engine: chooser on synthetic cost curves, calibration,
cost model, acceptance read back from sampled tokens, per-request state lifecycle."""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest

from vllm_retrieval_spec.drafts import SOURCE_CONTEXT, SOURCE_DATASTORE, SOURCE_DENSE, SOURCE_LEARNED, DraftNodes
from vllm_retrieval_spec.goodput import (
    AcceptanceCalibration,
    GoodputBudget,
    NodeCandidates,
    StepCostModel,
    choose_nodes,
)
from vllm_retrieval_spec.goodput.budget import PROBE_EVERY, TREE_PATIENCE, TREE_RETRY_EVERY
from vllm_retrieval_spec.goodput.calibration import SHAPE
from vllm_retrieval_spec.goodput.chooser import main_paths
from vllm_retrieval_spec.goodput.paths import first_children, node_depths, path_products
from vllm_retrieval_spec.goodput.search_gate import MAX_PENDING, MAX_WAIT_STEPS, MIN_PAIRED_STEPS, SearchGate, StepWay
from vllm_retrieval_spec.goodput.token_factor import TOKEN_FACTOR_RANGE, TokenFactor
from vllm_retrieval_spec.verification.session import SpecSession

CHAIN = np.broadcast_to(np.arange(-1, 7, dtype=np.int32), (4, 8))


def cost_model(base: float, per_request: float, per_token: float, steps: int = 200) -> StepCostModel:
    """A model that has learned an exact linear curve from varied steps."""
    model = StepCostModel(prior=(base, per_request, per_token, 0.0, 0.0, 0.0, 0.0, 0.0))
    rng = np.random.default_rng(0)
    for _ in range(steps):
        reqs, extra = int(rng.integers(1, 33)), int(rng.integers(0, 129))
        model.observe(base + per_request * reqs + per_token * extra, reqs, reqs + extra)
    return model


def chain_chances(conditional: float, rows: int = 4, width: int = 8) -> np.ndarray:
    return path_products(np.full((rows, width), conditional), CHAIN[:rows, :width])


def assert_closed_under_parents(keep: np.ndarray, parents: np.ndarray) -> None:
    rows, columns = np.nonzero(keep)
    parent = parents[rows, columns]
    assert keep[rows[parent >= 0], parent[parent >= 0]].all()


def test_worthless_drafts_are_not_drafted():
    cost = cost_model(0.05, 0.002, 0.0015)
    choice = choose_nodes(NodeCandidates(chain_chances(0.01), np.full(4, 8), 4), cost, 0.0, 0.05)
    assert not choice.keep.any()


def test_expensive_verification_drafts_nothing_even_for_likely_nodes():
    cost = cost_model(0.01, 0.001, 0.05)  # a verified token costs five base steps
    choice = choose_nodes(NodeCandidates(chain_chances(0.9), np.full(4, 8), 4), cost, 0.0, 0.05)
    assert not choice.keep.any()


def test_free_verification_fills_every_row_budget():
    cost = cost_model(0.02, 0.001, 0.0)
    budgets = np.array([8, 3, 0, 5])
    choice = choose_nodes(NodeCandidates(chain_chances(0.3), budgets, 4), cost, 0.0, 0.05)
    np.testing.assert_array_equal(choice.keep.sum(axis=1), budgets)
    assert_closed_under_parents(choice.keep, CHAIN)


def test_cost_of_drafting_counts():
    cost = cost_model(0.02, 0.001, 0.0)
    cheap = choose_nodes(NodeCandidates(chain_chances(0.2), np.full(4, 8), 4), cost, 0.0, 0.05)
    slow = choose_nodes(NodeCandidates(chain_chances(0.2), np.full(4, 8), 4), cost, 1.0, 0.05)
    assert cheap.keep.any() and not slow.keep.any()


def test_the_chooser_keeps_the_most_likely_nodes_across_rows_and_whole_paths():
    rng = np.random.default_rng(1)
    parents = np.array([[-1, -1, 0, 0, 1, 2, 2, 5]] * 6, np.int32)
    chance = path_products(rng.uniform(0.05, 0.95, parents.shape), parents)
    cost = cost_model(0.05, 0.002, 0.0015)
    choice = choose_nodes(NodeCandidates(chance, np.full(6, 8), 6), cost, 0.0, 0.0)
    assert 0 < choice.keep.sum() < choice.keep.size
    assert_closed_under_parents(choice.keep, parents)
    assert chance[choice.keep].min() >= chance[~choice.keep].max()
    # Each kept node's chance pays for its marginal cost at the chosen rate.
    assert chance[choice.keep].min() >= choice.threshold * 0.999


def test_cost_model_learns_the_jump_past_the_skinny_gemms_rows():
    """Steps of more than ``kernel_rows`` tokens pay once more; the step without drafts pays it
    when its requests alone are too many."""
    model = StepCostModel(prior=(0.05, 0.002, 0.0015, 0.0, 0.0, 0.0, 0.0, 0.0), kernel_rows=16)  # h unknown
    rng = np.random.default_rng(0)
    for _ in range(400):
        reqs, drafts = int(rng.integers(1, 17)), int(rng.integers(0, 12))
        model.observe(0.05 + 0.002 * reqs + 0.0015 * drafts + 0.01 * (reqs + drafts > 16), reqs, reqs + drafts)
    jump = model.coefficients[7]
    assert 0.006 < jump < 0.011  # learned; the ridge pulls it towards the prior's 0
    assert model.idle_seconds(17) - model.idle_seconds(16) == pytest.approx(model.coefficients[1] + jump)
    drafted = model.predict(8, np.array([16, 17]))
    assert drafted[1] - drafted[0] == pytest.approx(model.coefficients[2] + jump)
    assert StepCostModel().past_kernel_rows([1, 1000]).tolist() == [False, False]  # no bound: never past it


def test_steps_past_the_skinny_gemms_rows_are_interrupted_by_probes_without_drafts():
    """At 32 in flight every drafted step crosses the skinny GEMM's 32 rows: one step in
    PROBE_EVERY goes without drafts, so that the cost model sees the step below them."""
    budget = GoodputBudget(cost=StepCostModel(prior=(0.05, 0.002, 0.0001, 0.0, 0.0, 0.0, 0.0, 0.0), prior_steps=1e9,
                                              kernel_rows=32))
    nodes = nodes_of(np.ones((32, 2)), np.tile(np.array([-1, 0], np.int32), (32, 1)), SOURCE_CONTEXT, 16)
    req_ids = [str(i) for i in range(32)]
    kept = [int(budget.choose(req_ids, nodes, np.full(32, 2), 32, 0.0).sum()) for _ in range(2 * PROBE_EVERY)]
    assert kept.count(0) == 2 and kept[PROBE_EVERY - 1] == 0 and min(kept[:PROBE_EVERY - 1]) > 0
    assert budget.stats.probe_steps == 2
    few = nodes.subset(np.arange(15))  # 15 requests + 30 drafts cross the rows, but steps below them come alone
    assert all(budget.choose(req_ids[:15], few, np.full(15, 2), 15, 0.0).sum() == 30 for _ in range(2 * PROBE_EVERY))


def test_depths_and_path_products_of_a_tree():
    parents = np.array([[-1, -1, 0, 2, 1]], np.int32)
    np.testing.assert_array_equal(node_depths(parents), [[0, 0, 1, 2, 1]])
    chance = np.array([[0.5, 0.4, 0.5, 0.5, 0.25]])
    np.testing.assert_allclose(path_products(chance, parents), [[0.5, 0.4, 0.25, 0.125, 0.1]])


def test_cost_model_learns_a_linear_curve_and_ignores_idle_gaps():
    model = cost_model(0.05, 0.002, 0.0015)
    np.testing.assert_allclose(model.coefficients[:3], [0.05, 0.002, 0.0015], rtol=0.02, atol=2e-4)
    assert not model.observe(10.0, 8, 8)  # the engine sat idle
    np.testing.assert_allclose(model.coefficients[:3], [0.05, 0.002, 0.0015], rtol=0.02, atol=2e-4)


def test_the_scale_follows_a_slowdown_within_steps_and_the_error_records_the_miss():
    model = cost_model(0.05, 0.002, 0.0015)
    assert model.scale == pytest.approx(1.0) and model.error.mean_absolute < 0.01 and abs(model.error.bias) < 0.01
    learned = model.error.steps
    assert model.observe(0.15, 8, 2008, prefill_tokens=2000)  # a prompt chunk: learned from, not counted
    assert model.error.steps == learned
    slower = 1.25 * float(model.predict(8, 16))  # the engine slows down by a quarter
    for _ in range(20):
        model.observe(slower, 8, 16)
    assert float(model.predict(8, 16)) == pytest.approx(slower, rel=0.03)  # mostly the scale: 1.1-1.2
    assert 1.1 < model.scale < 1.25
    np.testing.assert_allclose(model.coefficients, model.scale * model.shape)
    assert model.error.bias < 0 and model.error.steps == learned + 20  # the first of them ran past the prediction
    assert model.error.report() == {"mean_absolute": model.error.mean_absolute, "bias": model.error.bias,
                                    "steps": model.error.steps}


def test_a_model_replayed_on_its_step_log_ends_where_it_did_and_without_a_scale_keeps_one():
    model, rng = StepCostModel(kernel_rows=16), np.random.default_rng(1)
    model.observe(0.04, 2, 4)  # before the log was asked for: not in it
    model.keep_step_log()
    for _ in range(300):
        reqs, drafts, prefill = int(rng.integers(1, 9)), int(rng.integers(0, 20)), int(rng.integers(0, 2)) * 500
        model.observe(float(rng.uniform(0.8, 1.2)) * (0.03 + 0.002 * reqs + 0.0015 * drafts + 0.0004 * prefill),
                      reqs, reqs + drafts + prefill, prefill_tokens=prefill)
    assert len(model.step_log) == 300 and model.scale != 1.0
    replayed, one_fit = StepCostModel(kernel_rows=16), StepCostModel(kernel_rows=16, scale_forgetting=0.0)
    replayed.observe(0.04, 2, 4)
    for step in model.step_log:
        replayed.observe(*step)
        one_fit.observe(*step)
    np.testing.assert_array_equal(replayed.coefficients, model.coefficients)
    assert one_fit.scale == 1.0 and np.array_equal(one_fit.coefficients, one_fit.shape)


def test_a_step_after_the_engine_waited_for_requests_is_not_learned_even_at_start(monkeypatch):
    """A readiness probe, then a minute without requests: the first steps of the next request
    come before the cost model could call that minute an outlier."""
    clock = iter([0.0, 0.001,  # drafting after a first step
                  0.003, 0.023,  # scheduled 2 ms later, the runner's step takes 20 ms
                  0.024,  # drafted in 1 ms
                  60.0, 60.02,  # a minute idle, then a 20 ms step
                  60.021])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    session = SpecSession(tree_mode=False, budget=GoodputBudget())
    session.begin_step(["a"], 1)
    session.end_step()
    session.runner_step_began()
    session.begin_step(["a"], 1)
    assert session.budget.cost.steps == 1  # 22 ms: scheduling and the runner's step
    session.end_step()
    session.runner_step_began()
    session.begin_step(["a"], 1)
    assert session.budget.cost.steps == 1 and session.budget.cost.rejected == 0


def test_prompt_tokens_do_not_pull_down_what_a_draft_token_costs():
    """Prefill chunks cost less per token than drafts (a CPU's matmuls gain efficiency with the
    token count); a few long prefills among short decode steps must not lower the draft cost."""
    model = StepCostModel()
    rng = np.random.default_rng(5)
    for step in range(300):
        drafts = int(rng.integers(0, 33))
        prefill = 500 if step % 50 == 0 else 0
        seconds = 0.042 + 0.0015 * drafts + 0.0008 * prefill
        model.observe(seconds, 1, 1 + drafts + prefill, prefill_tokens=prefill)
    assert model.per_token == pytest.approx(0.0015, rel=0.05)
    assert model.coefficients[6] == pytest.approx(0.0008, rel=0.05)
    assert float(model.predict(1, 17)) == pytest.approx(0.042 + 0.0015 * 16, rel=0.02)


def test_a_wave_of_long_prompts_does_not_overturn_what_decode_steps_cost():
    """32 requests of ~1,300-token prompts arrive after a warm-up request: chunks of 4,096 prompt
    tokens take 6-7 seconds each, growing with the requests they hold (attention over long
    prompts, which the linear prefill term does not model; times from doc_qa at 32 in flight);
    the per-request and per-token costs must stay near what decode steps cost."""
    model = StepCostModel()
    for drafts in (3, 3, 3, 4):
        model.observe(0.042 + 0.0015 * drafts, 1, 1 + drafts)
    for num_reqs, seconds in ((11, 6.03), (19, 6.28), (31, 6.99)):
        model.observe(seconds, num_reqs, 4096, prefill_tokens=4096 - num_reqs)
    assert model.per_token == pytest.approx(0.0015, rel=0.3)
    assert model.coefficients[1] == pytest.approx(0.002, rel=0.5)
    assert float(model.predict(32, 32)) == pytest.approx(0.04 + 0.002 * 32, rel=0.3)


def test_cost_model_keeps_its_prior_per_token_cost_while_steps_do_not_vary():
    model = StepCostModel(prior=(0.04, 0.002, 0.0015, 0.0, 0.0, 0.0, 0.0, 0.0))
    for _ in range(100):
        model.observe(0.08, 8, 8)  # never any drafts: the per-token cost is not observable
    assert model.coefficients[2] == pytest.approx(0.0015, rel=0.05)
    assert float(model.predict(8, 8)) == pytest.approx(0.08, rel=0.05)


def test_a_prior_base_far_from_the_engine_does_not_pull_down_what_a_draft_token_costs():
    """Steps of 8 requests fix ``a + 8b`` but not the split; the CPU prior's 40 ms base against the
    engine's 27 ms must not leave the per-token cost far below the truth."""
    model = StepCostModel()
    rng = np.random.default_rng(7)
    for _ in range(120):
        drafts = int(rng.integers(0, 41))
        model.observe(0.024 + 0.0004 * 8 + 0.0009 * drafts + rng.normal(0, 0.002), 8, 8 + drafts)
    assert model.per_token == pytest.approx(0.0009, rel=0.15)


def way(tokens: list[list[int]], seconds: float = 0.03, bucket: list[list[int]] | None = None,
        source: list[list[int]] | None = None) -> StepWay:
    """A way to draft a step whose nodes (``tokens``, -1 padded) sit in ``bucket`` (0 if not
    given), drafted by ``source`` (the context if not given)."""
    tokens = np.array(tokens)
    bucket = np.zeros(tokens.shape, np.int64) if bucket is None else np.array(bucket)
    source = np.full(tokens.shape, SOURCE_CONTEXT, np.int8) if source is None else np.array(source, np.int8)
    return StepWay(tokens, seconds, bucket, np.full(tokens.shape, 0.5), source)


def feed(gate: SearchGate, chain_with: list[int], chain_without: list[int], generated: list[int], steps: int,
         seconds: tuple[float, float] = (0.03, 0.03)) -> None:
    """``steps`` paired steps of one request whose chains with and without the search are
    ``chain_with`` / ``chain_without`` and whose target then generates ``generated``."""
    width = max(len(chain_with), len(chain_without))
    token_ids = np.zeros((1, 4096), np.int32)
    for step in range(steps):
        start = step * len(generated)
        ways = [way([chain + [-1] * (width - len(chain))], took)
                for chain, took in zip((chain_with, chain_without), seconds)]
        gate.record(["r"], np.array([start]), *ways, num_reqs=1)
        token_ids[0, start:start + len(generated)] = generated
        gate.follow(["r"], token_ids, np.array([start + len(generated)]))


def test_the_search_starts_once_its_steps_serve_faster_and_stops_when_they_no_longer_do():
    gate = SearchGate(SOURCE_DENSE)
    assert not gate.open()  # Hybrid drafts what REST drafts until the search has shown it pays
    feed(gate, [7, 8, 9, 10], [7, 8, 5], [7, 8, 9, 10, 11], MIN_PAIRED_STEPS - 1)
    assert not gate.searching  # not judged on fewer paired steps
    feed(gate, [7, 8, 9, 10], [7, 8, 5], [7, 8, 9, 10, 11], 1)
    assert gate.searching and gate.open()
    # The search's continuation now displaces the chain the target generates.
    feed(gate, [7, 1, 1, 1], [7, 8, 9, 10], [7, 8, 9, 10, 11], 40)
    assert not gate.searching and not gate.open()


def test_the_search_does_not_start_on_gains_within_the_paired_steps_noise():
    gate = SearchGate(SOURCE_DENSE)
    generated = [7, 8, 9, 10, 11]
    for _ in range(20):
        feed(gate, [7, 8, 9, 10], [7, 1], generated, 1)  # the search's way accepts 3 tokens more
        feed(gate, [7, 1], [7, 8, 9], generated, 1)  # and then 2 fewer
    report = gate.report()
    assert report["tokens_per_second_with_search"] > report["tokens_per_second_without"]
    assert not gate.searching  # half a token a step more, but well within the steps' spread
    feed(gate, [7, 8, 9, 10], [7, 8, 1], generated, 40)  # one token more, every step
    assert gate.searching


def test_dense_nodes_learned_leave_every_sparse_sources_chances_as_they_were():
    """The depth-0 prior pools by kind: what a dense source's nodes teach (their "match length"
    counts agreeing neighbours) moves no sparse bucket, seen or unseen, and an unseen dense
    combination starts from the dense nodes' prior, not REST's."""
    sparse = AcceptanceCalibration()
    context = np.ravel_multi_index((SOURCE_CONTEXT, 6, 0, 9), SHAPE)
    sparse.observe(np.full(40, context), np.full(40, 0.5), np.arange(40) < 30)
    mixed = copy.deepcopy(sparse)
    dense = [np.ravel_multi_index((SOURCE_DENSE, 6, depth, 9), SHAPE) for depth in (0, 1)]
    mixed.observe(np.repeat(dense, 50), np.full(100, 0.5), np.zeros(100, bool))
    is_sparse = (np.arange(SHAPE[0]) & (SOURCE_DENSE | SOURCE_LEARNED)) == 0
    sparse_table, mixed_table = (c.chance_table().chance.copy() for c in (sparse, mixed))
    assert np.array_equal(sparse_table[is_sparse], mixed_table[is_sparse])
    unseen_datastore = np.ravel_multi_index((SOURCE_DATASTORE, 6, 0, 9), SHAPE)
    unseen_mixed = np.ravel_multi_index((SOURCE_DATASTORE | SOURCE_DENSE, 6, 0, 9), SHAPE)
    estimates = mixed.estimate(np.array([unseen_datastore, unseen_mixed]), np.array([0.95, 0.95]))
    assert estimates[0] == sparse.estimate(np.array([unseen_datastore]), np.array([0.95]))[0] > 0.5
    assert estimates[1] < 0.05  # where the dense nodes stand


def test_the_search_pays_only_for_all_its_time():
    gate = SearchGate(SOURCE_DENSE)
    feed(gate, [7, 8, 9, 10], [7, 8, 5], [7, 8, 9, 10, 11], 20, seconds=(0.031, 0.03))
    assert gate.searching
    gate = SearchGate(SOURCE_DENSE)
    feed(gate, [7, 8, 9, 10], [7, 8, 5], [7, 8, 9, 10, 11], 20, seconds=(0.06, 0.03))
    assert not gate.searching


def test_a_paired_step_waits_for_the_tokens_its_chains_cover_and_drops_requests_that_left():
    gate = SearchGate(SOURCE_DENSE)
    token_ids = np.zeros((2, 64), np.int32)
    token_ids[0, :8] = [1, 2, 3, 4, 5, 6, 7, 8]
    gate.record(["a", "b"], np.array([4, 10]), way([[5, 6, 7], [9, -1, -1]]), way([[5, -1, -1], [9, 9, -1]]), 2)
    gate.follow(["a", "b"], token_ids, np.array([6, 11]))  # "a" has 2 of its 3 tokens: wait
    assert gate.judged == 0
    gate.follow(["a"], token_ids, np.array([8]))  # "b" left: judged on "a" alone
    assert gate.judged == 1
    assert gate._tokens.tolist() == [2 + 3, 2 + 1]  # one token a request, then the confirmed prefixes


def test_paired_steps_are_judged_after_a_bounded_wait_and_kept_in_bounded_number():
    gate = SearchGate(SOURCE_DENSE)
    token_ids = np.zeros((1, 64), np.int32)
    for _ in range(MAX_PENDING + 5):
        gate.record(["a"], np.array([0]), way([[1, 2]]), way([[1, 2]]), 1)
    assert len(gate._pending) == MAX_PENDING
    for _ in range(MAX_WAIT_STEPS):
        gate.follow(["a"], token_ids, np.array([1]))  # the request never advances
    assert not gate._pending and gate.judged == MAX_PENDING


def test_the_unsent_ways_dense_nodes_teach_the_calibration_as_greedy_verification_would():
    """The gate is closed, so the step sent the way without the search; of the way with it, the
    nodes the dense source drafted (alone or with another) are learned: accepted up to the first
    token the target did not generate, that one rejected, nothing past it, nothing of a request
    that samples, and nothing of the other sources (their calibration is what sent nodes teach)."""
    calibration = AcceptanceCalibration()
    gate = SearchGate(SOURCE_DENSE)
    dense_and_context = SOURCE_DENSE | SOURCE_CONTEXT
    flags = [[SOURCE_CONTEXT, dense_and_context, SOURCE_DENSE, SOURCE_DENSE, SOURCE_DENSE]] * 2
    searched = way([[7, 8, 9, 4, 4]] * 2, bucket=[[1, 2, 3, 4, 5]] * 2, source=flags)
    plain = way([[7, 5, -1, -1, -1]] * 2, bucket=[[1, 6, 0, 0, 0]] * 2)
    gate.record(["greedy", "samples"], np.array([0, 0]), searched, plain, 2, samples=np.array([False, True]))
    token_ids = np.array([[7, 8, 1, 1, 1, 1]] * 2, np.int32)
    gate.follow(["greedy", "samples"], token_ids, np.array([6, 6]), calibration)
    observed, accepted = calibration.observed_total.reshape(-1), calibration.accepted_total.reshape(-1)
    assert observed[[1, 2, 3, 4, 5, 6]].tolist() == [0, 1, 1, 0, 0, 0]
    assert accepted[[2, 3]].tolist() == [1, 0]


def test_the_budgets_what_if_keeps_what_it_would_choose_and_remembers_nothing():
    budget = GoodputBudget(margin=0.0, cost=cost_model(0.02, 0.001, 0.001))
    nodes = nodes_of(np.ones((2, 4)), CHAIN[:2, :4], SOURCE_CONTEXT, 16)
    budgets = np.array([4, 2])
    step = budget.what_if(nodes, budgets, 2, 0.002)
    assert budget.stats.steps == 0 and budget._pending is None
    chooser = copy.deepcopy(budget)
    keep = chooser.choose(["a", "b"], nodes, budgets, 2, 0.002)
    assert keep.any() and np.array_equal(step.tokens, np.where(keep, nodes.tokens, -1))
    assert np.array_equal(step.bucket, chooser._pending.bucket) and np.array_equal(step.chance, chooser._pending.chance)
    assert step.seconds == pytest.approx(0.02 + 2 * 0.001 + int(keep.sum()) * 0.001 + 0.002, rel=0.05)


def nodes_of(prob: np.ndarray, parents: np.ndarray, source: int, match_len: int) -> DraftNodes:
    rows, width = prob.shape
    return DraftNodes(np.zeros((rows, width), np.int32), parents, np.full(rows, width, np.int32),
                      prob.astype(np.float32), np.full((rows, width), source, np.int8),
                      np.full((rows, width), match_len, np.int32))


@pytest.mark.parametrize("true_rate", [0.1, 0.45, 0.8])
def test_calibration_converges_to_the_observed_rate(true_rate):
    rng = np.random.default_rng(2)
    calibration = AcceptanceCalibration()
    nodes = nodes_of(np.full((64, 1), 0.95), np.full((64, 1), -1, np.int32), SOURCE_DATASTORE, 4)
    bucket = calibration.buckets(nodes, np.zeros((64, 1), np.int32)).reshape(-1)
    for _ in range(50):
        predicted = calibration.estimate(bucket, nodes.prob.reshape(-1))
        calibration.observe(bucket, predicted, rng.random(64) < true_rate)
    assert calibration.estimate(bucket[:1], nodes.prob[0])[0] == pytest.approx(true_rate, abs=0.05)
    (row,) = calibration.report(min_observations=200)
    assert row["observations"] == 64 * 50 and row["observed"] == pytest.approx(true_rate, abs=0.03)


def test_calibration_keeps_sources_and_depths_apart():
    calibration = AcceptanceCalibration()
    parents = np.array([[-1, 0]], np.int32)
    context = nodes_of(np.ones((1, 2)), parents, SOURCE_CONTEXT, 8)
    datastore = nodes_of(np.ones((1, 2)), parents, SOURCE_DATASTORE, 8)
    depth = node_depths(parents)
    for _ in range(100):
        calibration.observe(calibration.buckets(context, depth).reshape(-1), np.ones(2), np.array([True, False]))
        calibration.observe(calibration.buckets(datastore, depth).reshape(-1), np.ones(2), np.array([False, True]))
    assert calibration.estimate(calibration.buckets(context, depth), context.prob)[0].tolist() == pytest.approx(
        [0.99, 0.0], abs=0.03)
    assert calibration.estimate(calibration.buckets(datastore, depth), datastore.prob)[0].tolist() == pytest.approx(
        [0.0, 0.99], abs=0.03)


def test_acceptance_is_read_back_from_the_sampled_tokens():
    """A chain and a tree: accepted nodes are the path the sampled tokens follow."""
    budget = GoodputBudget(margin=0.0, cost=cost_model(0.02, 0.001, 0.0))
    parents = np.array([[-1, 0, 1, 2], [-1, -1, 1, 0]], np.int32)
    tokens = np.array([[5, 6, 7, 8], [5, 9, 3, 4]], np.int32)
    nodes = DraftNodes(tokens, parents, np.array([4, 4], np.int32), np.ones((2, 4), np.float32),
                       np.full((2, 4), SOURCE_CONTEXT, np.int8), np.full((2, 4), 4, np.int32))
    keep = budget.choose(["a", "b"], nodes, np.array([4, 4]), 2, 0.0, trees=True)
    assert keep.all()
    # Rows come back reordered; "a" accepted 5 6 then the target said 1; "b" took 9 3 then 2.
    budget.observe(["b", "a"], [[9, 3, 2], [5, 6, 1]])
    assert budget.stats.accepted_nodes == 4
    assert budget.stats.accepted_by_source == {"context": 4}
    # a: 5, 6 accepted, 7 rejected (8 unobserved); b: 5 rejected, 9 and 3 accepted, 4 unobserved.
    assert budget.stats.observed_nodes == 3 + 3


def test_kept_nodes_move_to_the_front_with_parents_renumbered():
    parents = np.array([[-1, -1, 0, 1, 2]], np.int32)
    nodes = DraftNodes(np.array([[10, 11, 12, 13, 14]], np.int32), parents, np.array([5], np.int32),
                       np.ones((1, 5), np.float32), np.zeros((1, 5), np.int8), np.zeros((1, 5), np.int32))
    tokens, new_parents, sizes, _ = nodes.kept(np.array([[False, True, False, True, False]]))
    assert sizes.tolist() == [2]
    assert tokens[0, :2].tolist() == [11, 13] and new_parents[0, :2].tolist() == [-1, 0]


def test_tree_mode_keeps_chains_when_branching_costs_more_than_it_gains():
    """Two rows whose trees fork at the root: branches pay only where tree attention is cheap."""
    parents = np.array([[-1, -1, 0, 1]] * 2, np.int32)
    chance = path_products(np.array([[0.8, 0.6, 0.9, 0.9]] * 2), parents)
    main = main_paths(parents, first_children(parents, np.full(2, 4)))
    assert main.tolist() == [[True, False, True, False]] * 2
    candidates = NodeCandidates(chance, np.full(2, 4), 2, main, context_tokens=np.array([500, 500]))
    cheap = StepCostModel(prior=(0.02, 0.001, 0.0001, 0.0, 0.0, 0.0, 0.0, 0.0), prior_steps=1e9)
    dear_per_node = StepCostModel(prior=(0.02, 0.001, 0.0001, 0.05, 0.0, 0.0, 0.0, 0.0), prior_steps=1e9)
    dear_per_step = StepCostModel(prior=(0.02, 0.001, 0.0001, 0.0, 0.0, 0.05, 0.0, 0.0), prior_steps=1e9)
    assert choose_nodes(candidates, cheap, 0.0, 0.05).keep.all()
    for dear in (dear_per_node, dear_per_step):
        np.testing.assert_array_equal(choose_nodes(candidates, dear, 0.0, 0.05).keep, main)


def test_a_branch_that_does_not_pay_does_not_cut_the_main_path_behind_it():
    """A branch root ranked second whose tree step does not pay: the main path behind it is
    still kept whole (the best prefix of the joint order stopped at that branch)."""
    parents = np.array([[-1, 0, 1, 2, -1]], np.int32)
    chance = path_products(np.array([[0.9, 0.7, 0.9, 0.9, 0.8]]), parents)
    main = main_paths(parents, first_children(parents, np.full(1, 5)))
    assert main.tolist() == [[True, True, True, True, False]]
    dear_tree_step = StepCostModel(prior=(0.02, 0.001, 0.0001, 0.0, 0.0, 0.05, 0.0, 0.0), prior_steps=1e9)
    candidates = NodeCandidates(chance, np.full(1, 5), 1, main, context_tokens=np.array([500]))
    np.testing.assert_array_equal(choose_nodes(candidates, dear_tree_step, 0.0, 0.05).keep, main)


def test_tree_mode_drafts_chains_after_tree_steps_that_kept_no_branch():
    """``TREE_PATIENCE`` tree steps whose choice keeps no branch turn tree mode to chains, but for
    one step in ``TREE_RETRY_EVERY``; while the choice keeps branches every step drafts trees."""
    parents = np.array([[-1, -1, 0, 1]], np.int32)
    nodes = DraftNodes(np.array([[5, 6, 7, 8]], np.int32), parents, np.array([4], np.int32),
                       np.full((1, 4), 0.9, np.float32), np.full((1, 4), SOURCE_CONTEXT, np.int8),
                       np.full((1, 4), 8, np.int32))

    def steps(budget: GoodputBudget, count: int) -> list[bool]:
        asked = []
        for _ in range(count):
            asked.append(budget.wants_trees())
            if asked[-1]:
                budget.choose(["a"], nodes, np.array([4]), 1, 0.0, trees=True, context_tokens=np.array([500]))
        return asked

    def budget(per_tree_step: float) -> GoodputBudget:
        return GoodputBudget(cost=StepCostModel(prior=(0.02, 0.001, 0.0001, 0.0, 0.0, per_tree_step, 0.0, 0.0),
                                                prior_steps=1e9))

    dear = budget(0.5)
    assert steps(dear, TREE_PATIENCE + 2 * TREE_RETRY_EVERY) == (
        [True] * TREE_PATIENCE + ([False] * (TREE_RETRY_EVERY - 1) + [True]) * 2)
    assert dear.stats.tree_steps == TREE_PATIENCE + 2 and dear.stats.branched_steps == 0
    cheap = budget(0.0)
    assert all(steps(cheap, 3 * TREE_PATIENCE))
    assert cheap.stats.branched_steps == 3 * TREE_PATIENCE


def test_branches_over_long_contexts_cost_more():
    """Tree attention reads a node's whole context: the row with the long context keeps its
    main path only, the short one branches."""
    parents = np.array([[-1, -1, 0, 1]] * 2, np.int32)
    chance = path_products(np.array([[0.8, 0.6, 0.9, 0.9]] * 2), parents)
    main = main_paths(parents, first_children(parents, np.full(2, 4)))
    model = StepCostModel(prior=(0.02, 0.001, 0.0005, 0.004, 0.0, 0.0, 0.0, 0.0), prior_steps=1e9)
    keep = choose_nodes(NodeCandidates(chance, np.full(2, 4), 2, main, context_tokens=np.array([100, 8000])),
                        model, 0.0, 0.0).keep
    assert keep[0].all()
    np.testing.assert_array_equal(keep[1], main[1])


def test_cost_model_learns_the_price_of_tree_attention():
    model = StepCostModel(prior=(0.04, 0.002, 0.0015, 0.0, 0.0, 0.0, 0.0, 0.0))
    rng = np.random.default_rng(3)
    for _ in range(400):
        reqs, extra = int(rng.integers(1, 9)), int(rng.integers(0, 40))
        work = float(rng.integers(0, 3) * rng.uniform(0.0, 20.0))
        seconds = 0.04 + 0.002 * reqs + 0.0015 * extra + 0.001 * work + 0.004 * (work > 0)
        model.observe(seconds, reqs, reqs + extra, work)
    assert model.per_tree_kilopair == pytest.approx(0.001, rel=0.15)
    assert model.per_tree_step == pytest.approx(0.004, rel=0.35)  # the ridge pulls towards the prior (0)


def test_cost_model_learns_what_a_sampled_draft_token_adds():
    model = StepCostModel(prior=(0.04, 0.002, 0.0015, 0.0, 0.0, 0.0, 0.0, 0.0))
    rng = np.random.default_rng(4)
    for _ in range(300):
        reqs, extra = int(rng.integers(1, 9)), int(rng.integers(0, 40))
        sampled = int(rng.integers(0, extra + 1))
        model.observe(0.04 + 0.002 * reqs + 0.0015 * extra + 0.004 * sampled, reqs, reqs + extra, 0, sampled)
    assert model.per_sampled_token == pytest.approx(0.004, rel=0.2)  # the ridge pulls towards the prior
    assert model.per_token == pytest.approx(0.0015, rel=0.25)


def test_nodes_of_sampling_requests_pay_for_their_dearer_verification():
    """Same chances, but a sampled draft token costs five plain ones: the sampling rows keep
    fewer nodes than the greedy rows, and none once verification is dear enough."""
    chance = chain_chances(0.6)
    samples = np.array([True, True, False, False])
    dear = StepCostModel(prior=(0.02, 0.001, 0.001, 0.0, 0.005, 0.0, 0.0, 0.0), prior_steps=1e9)
    choice = choose_nodes(NodeCandidates(chance, np.full(4, 8), 4, samples=samples), dear, 0.0, 0.0)
    kept = choice.keep.sum(axis=1)
    assert kept[2] == kept[3] > kept[0] == kept[1]
    prohibitive = StepCostModel(prior=(0.02, 0.001, 0.001, 0.0, 0.5, 0.0, 0.0, 0.0), prior_steps=1e9)
    choice = choose_nodes(NodeCandidates(chance, np.full(4, 8), 4, samples=samples), prohibitive, 0.0, 0.0)
    assert not choice.keep[:2].any() and choice.keep[2:].any()


def test_a_bucket_no_longer_drafted_drifts_back_to_its_prior():
    calibration = AcceptanceCalibration(decay_every=10)
    nodes = nodes_of(np.ones((1, 1)), np.full((1, 1), -1, np.int32), SOURCE_CONTEXT, 4)
    bucket = calibration.buckets(nodes, np.zeros((1, 1), np.int32)).reshape(-1)
    for _ in range(200):
        calibration.observe(bucket, np.ones(1), np.zeros(1, bool))
    assert calibration.estimate(bucket, np.ones(1))[0] < 0.02
    for _ in range(100):  # nothing drafted for 100 steps: ten halvings
        calibration.tick()
    assert calibration.estimate(bucket, np.ones(1))[0] > 0.3


def test_searches_are_skipped_only_while_no_node_could_pay():
    budget = GoodputBudget(cost=StepCostModel(prior=(0.02, 0.001, 0.02, 0.0, 0.0, 0.0, 0.0, 0.0), prior_steps=1e9))
    # A verified token costs as much as a step's worth of tokens: no first node can pay.
    assert not budget.worth_searching(2, 2).any()
    budget.cost = StepCostModel(prior=(0.02, 0.001, 0.0001, 0.0, 0.0, 0.0, 0.0, 0.0), prior_steps=1e9)
    assert budget.worth_searching(2, 2).all()
    assert budget.stats.skipped_rows == 2


def test_a_drafter_whose_first_nodes_fail_stops_searching_until_decay():
    budget = GoodputBudget(cost=StepCostModel(prior=(0.05, 0.002, 0.002, 0.0, 0.0, 0.0, 0.0, 0.0), prior_steps=1e9),
                           calibration=AcceptanceCalibration(decay_every=50))
    nodes = nodes_of(np.ones((1, 1)), np.full((1, 1), -1, np.int32), SOURCE_CONTEXT, 1)
    bucket = budget.calibration.buckets(nodes, np.zeros((1, 1), np.int32)).reshape(-1)
    assert budget.worth_searching(1, 8).all()  # nothing known yet: the prior guess (0.5) may pay
    for _ in range(40):
        budget.calibration.observe(bucket, np.ones(1), np.zeros(1, bool))
        budget.calibration.tick()
    assert not budget.worth_searching(1, 8).any()
    for _ in range(400):
        budget.calibration.tick()
    assert budget.worth_searching(1, 8).all()


def test_a_slow_search_must_pay_for_itself():
    budget = GoodputBudget(cost=StepCostModel(prior=(0.05, 0.002, 0.0001, 0.0, 0.0, 0.0, 0.0, 0.0), prior_steps=1e9))
    assert budget.worth_searching(1, 1).all()  # 0.5 prior chance vs a cheap token
    budget.search_seconds_per_row = 0.05  # a search takes as long as a step
    assert not budget.worth_searching(1, 1).any()
    for _ in range(60):  # skipped steps measure nothing: the estimate drifts down and is tried again
        if budget.worth_searching(1, 1).any():
            break
    assert budget.worth_searching(1, 1).all() and budget.search_seconds_per_row < 0.05


def test_branch_roots_are_calibrated_apart_from_first_children():
    """A root's second child shares its bucket with the first but is accepted only when the
    first is not: its outcomes stay out of the bucket, whose estimate follows the first child
    alone, and the branch factor and the sibling's token factor learned from them keep it from
    being drafted."""
    rng = np.random.default_rng(0)
    budget = GoodputBudget(margin=0.05, cost=cost_model(0.02, 0.0, 0.006))
    tokens = np.array([[5, 9]], np.int32)
    nodes = DraftNodes(tokens, np.array([[-1, -1]], np.int32), np.array([2], np.int32), np.ones((1, 2), np.float32),
                       np.full((1, 2), SOURCE_CONTEXT, np.int8), np.full((1, 2), 4, np.int32))
    for _ in range(300):
        keep = budget.choose(["a"], nodes, np.array([2]), 1, 0.0, trees=True)
        assert keep[0, 0]
        budget.observe(["a"], [[5, 1] if rng.random() < 0.7 else [3]])
    assert not keep[0, 1]  # 0.7 x the branch factor no longer pays for its verification
    # learned from siblings never accepted, by the branch factor and the sibling's token factor
    assert budget.branches.factor * budget.tokens.factors(tokens[0, 1:])[0] < 0.7
    bucket = budget.calibration.buckets(nodes, node_depths(nodes.parents))
    assert budget.calibration.estimate(bucket, nodes.prob)[0, 0] == pytest.approx(0.7, abs=0.08)


def random_forests(rng: np.random.Generator, rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Parents-first trees (``parents[i] < i``, -1 = the root), -1 padded after each row's size."""
    size = rng.integers(0, width + 1, rows)
    parents = np.full((rows, width), -1, np.int32)
    for row in range(rows):
        for column in range(1, int(size[row])):
            parents[row, column] = rng.integers(-1, column)
    return parents, size


def brute_force_paths(parents: np.ndarray, size: np.ndarray, chance: np.ndarray):
    """Depths, path products and main paths by walking up from every node."""
    rows, width = parents.shape
    depth, product, main = np.zeros((rows, width), int), np.ones((rows, width)), np.zeros((rows, width), bool)
    for row in range(rows):
        for column in range(width):
            node, on_main = column, column < size[row]
            while node >= 0:
                product[row, column] *= chance[row, node]
                parent = parents[row, node]
                first = min(c for c in range(size[row]) if parents[row, c] == parent) if column < size[row] else -1
                on_main &= first == node
                depth[row, column] += parent >= 0
                node = parent
            main[row, column] = on_main
    return depth, product, main


def random_chains(rng: np.random.Generator, rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Chains (each node's parent the one before it), -1 padded after each row's size: the
    layout the walks take in one scan."""
    size = rng.integers(0, width + 1, rows)
    column = np.arange(width)[None, :]
    return np.where(column < size[:, None], column - 1, -1).astype(np.int32), size


@pytest.mark.parametrize("layout", [random_forests, random_chains])
@pytest.mark.parametrize("seed", range(5))
def test_walks_up_the_trees_equal_brute_force(seed, layout):
    rng = np.random.default_rng(seed)
    parents, size = layout(rng, 6, 40)
    chance = rng.uniform(0.1, 1.0, parents.shape)
    depth, product, main = brute_force_paths(parents, size, chance)
    np.testing.assert_array_equal(node_depths(parents), depth)
    np.testing.assert_allclose(path_products(chance, parents), product, rtol=1e-12)
    np.testing.assert_array_equal(main_paths(parents, first_children(parents, size)), main)


def trained_budget(source: int, match_len: int, raw_prob: float, rate: float) -> GoodputBudget:
    """A budget whose calibration saw chains of this source accepted at ``rate`` at every depth."""
    budget = GoodputBudget()
    nodes = long_chain(source, match_len, raw_prob)
    bucket = budget.calibration.buckets(nodes, node_depths(nodes.parents))
    rng = np.random.default_rng(0)
    for _ in range(40):
        budget.calibration.observe(bucket, np.full(bucket.shape, rate), rng.uniform(size=bucket.shape) < rate)
    return budget


def long_chain(source: int, match_len: int, raw_prob: float, width: int = 64) -> DraftNodes:
    return DraftNodes(np.arange(width, dtype=np.int32)[None], np.arange(-1, width - 1, dtype=np.int32)[None],
                      np.array([width]), np.full((1, width), raw_prob, np.float32),
                      np.full((1, width), source, np.int8), np.full((1, width), match_len, np.int32))


def test_a_long_context_copy_is_drafted_whole_and_a_weak_match_short():
    """With the CPU prior's step cost, a 40-token in-context copy the calibration trusts is kept
    whole at K = 64 in one step; a weak 1-token datastore match keeps one or two tokens."""
    copy = trained_budget(SOURCE_CONTEXT, 16, 1.0, 0.995)
    nodes = long_chain(SOURCE_CONTEXT, 16, 1.0)
    nodes.size[:] = 40
    keep = copy.choose(["copy"], nodes, np.array([64]), 1, draft_seconds=0.0005)
    assert keep.sum() == 40
    weak = trained_budget(SOURCE_DATASTORE, 1, 0.3, 0.3)
    keep = weak.choose(["weak"], long_chain(SOURCE_DATASTORE, 1, 0.3), np.array([64]), 1, draft_seconds=0.0005)
    assert 1 <= keep.sum() <= 2


def test_depth_buckets_stay_apart_up_to_the_spec_cap():
    """Depths 0-7 get a bucket each, deeper ones log-spaced buckets up to 128, none collapsed."""
    calibration = AcceptanceCalibration()
    nodes = long_chain(SOURCE_CONTEXT, 16, 1.0, width=128)
    buckets = np.unravel_index(calibration.buckets(nodes, node_depths(nodes.parents))[0], calibration.accepted.shape)[2]
    assert buckets[:8].tolist() == list(range(8))
    assert len(set(buckets.tolist())) == calibration.accepted.shape[2] and (np.diff(buckets) >= 0).all()


def test_the_chance_table_follows_observations_and_is_reused_between_refreshes():
    calibration = AcceptanceCalibration()
    nodes = long_chain(SOURCE_CONTEXT, 16, 1.0, width=8)
    bucket = calibration.buckets(nodes, node_depths(nodes.parents))
    table = calibration.chance_table()
    assert calibration.chance_table() is table  # nothing new: the same arrays
    assert table.chance.flags.c_contiguous  # the kernel reads it as it is: no copy every step
    before = table.chance.reshape(-1)[bucket]
    calibration.observe(bucket, np.full(bucket.shape, 0.5), np.ones(bucket.shape, bool))
    for _ in range(4):
        calibration.tick()
    fresh = calibration.chance_table()
    assert fresh is table and (fresh.chance.reshape(-1)[bucket] > before).all()  # refilled in place
    midpoint = np.full(bucket.shape, 0.95)  # raw probability 1.0: the last bucket, [0.9, 1.0)
    np.testing.assert_allclose(fresh.chance.reshape(-1)[bucket], calibration.estimate(bucket, midpoint), rtol=1e-6)


def test_a_depth_never_drafted_starts_where_the_depth_above_it_stands():
    """A copy accepted at every depth drafted so far (0-7) makes the never-drafted depths 8-63
    as likely as depth 7, not the drafter's halved guess, so the chooser drafts them and learns;
    once observed, a deep bucket follows its own counts, and a rejected depth pulls the depths
    below it down with it."""
    calibration = AcceptanceCalibration()
    nodes = long_chain(SOURCE_CONTEXT, 16, 1.0, width=64)
    depth = node_depths(nodes.parents)
    bucket = calibration.buckets(nodes, depth)[0]
    accepted = np.ones(8, bool)
    for _ in range(50):
        calibration.observe(bucket[:8], np.full(8, 0.5), accepted)
    chance = calibration.estimate(bucket, nodes.prob[0])
    assert chance[7] > 0.95
    np.testing.assert_allclose(chance[8:], chance[7], rtol=1e-9)
    for _ in range(50):
        calibration.observe(bucket[8:12], np.full(4, 0.5), np.zeros(4, bool))
    for _ in range(4):
        calibration.tick()
    chance = calibration.estimate(bucket, nodes.prob[0])
    assert chance[7] > 0.95 and chance[8] < 0.05 and chance[12:].max() < 0.5
    np.testing.assert_allclose(calibration.chance_table().chance.reshape(-1)[bucket],
                               calibration.estimate(bucket, np.full(64, 0.95)), rtol=1e-6)


def test_a_new_combination_of_sources_starts_where_its_match_length_stands():
    """Long context matches accepted, short ones rejected: a source combination never seen
    before starts high at a long match and low at a short one (before, it started at its own
    source's average, and at 8 in flight, where a node must beat ~30%, was never drafted)."""
    calibration = AcceptanceCalibration()
    long_copy, short_guess = long_chain(SOURCE_CONTEXT, 16, 1.0, width=1), long_chain(SOURCE_CONTEXT, 1, 1.0, width=1)
    depth = np.zeros((1, 1), np.int32)
    for _ in range(50):
        calibration.observe(calibration.buckets(long_copy, depth)[0], np.full(1, 0.5), np.ones(1, bool))
        calibration.observe(calibration.buckets(short_guess, depth)[0], np.full(1, 0.5), np.zeros(1, bool))
    both = SOURCE_CONTEXT | SOURCE_DATASTORE
    new_long, new_short = long_chain(both, 16, 1.0, width=1), long_chain(both, 1, 1.0, width=1)
    assert calibration.estimate(calibration.buckets(new_long, depth)[0], new_long.prob[0])[0] > 0.9
    assert calibration.estimate(calibration.buckets(new_short, depth)[0], new_short.prob[0])[0] < 0.1


def test_a_few_good_nodes_are_drafted_in_a_large_batch():
    """At 32 requests, one row's node that pays for itself with room to spare is kept even
    though it adds far less than the margin to the whole batch's rate."""
    cost = cost_model(0.02, 0.002, 0.0015)
    chance = np.zeros((32, 8))
    chance[0, :2] = [0.9, 0.8]
    choice = choose_nodes(NodeCandidates(path_products(chance, np.broadcast_to(CHAIN[0], (32, 8))), np.full(32, 8),
                                         32), cost, 0.0, 0.05)
    assert choice.keep[0, :2].all() and choice.keep.sum() == 2
    weak = np.where(chance > 0, 0.02, 0.0)  # 0.02 of a token for 1.5 ms at ~380 tokens/s does not pay
    assert not choose_nodes(NodeCandidates(weak, np.full(32, 8), 32), cost, 0.0, 0.05).keep.any()


def test_a_bucket_whose_first_nodes_failed_learns_from_the_nodes_it_no_longer_sends():
    """Twenty rejections hold a context bucket below what a node costs, so the budget stops
    sending its nodes; the target then keeps generating exactly what they proposed, and the
    calibration learns that from the sampled tokens until the bucket's nodes pay again."""
    budget = GoodputBudget(cost=StepCostModel(prior=(0.05, 0.002, 0.01, 0.0, 0.0, 0.0, 0.0, 0.0), prior_steps=1e9))
    nodes = DraftNodes(np.array([[42]], np.int32), np.array([[-1]], np.int32), np.array([1], np.int32),
                       np.full((1, 1), 0.9, np.float32), np.full((1, 1), SOURCE_CONTEXT, np.int8),
                       np.ones((1, 1), np.int32))
    bucket = budget.calibration.buckets(nodes, np.zeros((1, 1), np.int32)).reshape(-1)
    for _ in range(20):
        budget.calibration.observe(bucket, np.ones(1), np.zeros(1, bool))
    sent = []
    for _ in range(40):
        sent.append(bool(budget.choose(["r"], nodes, np.array([1]), 1, 0.0).any()))
        budget.observe(["r"], [[42, 7] if sent[-1] else [42]])  # the bonus token after an accepted node
    assert not sent[0] and sent[-1]
    assert budget.stats.unsent_observed_nodes == budget.stats.unsent_accepted_nodes == sent.index(True)
    assert budget.stats.observed_nodes == budget.stats.accepted_nodes == len(sent) - sent.index(True)


def test_only_greedy_rows_that_kept_no_node_teach_their_first_node():
    """Three chains the same: a greedy row that kept two nodes learns what verification showed,
    a sampling row that kept none nothing, and a greedy row that kept none its first node from the
    one token the target sampled."""
    budget = GoodputBudget(margin=0.0, cost=cost_model(0.02, 0.001, 0.0))
    tokens = np.broadcast_to(np.array([5, 6, 7, 8], np.int32), (3, 4)).copy()
    nodes = DraftNodes(tokens, CHAIN[:3, :4].copy(), np.full(3, 4, np.int32), np.ones((3, 4), np.float32),
                       np.full((3, 4), SOURCE_CONTEXT, np.int8), np.full((3, 4), 4, np.int32))
    keep = budget.choose(["kept", "sampling", "unsent"], nodes, np.array([2, 0, 0]), 3, 0.0,
                         samples=np.array([False, True, False]))
    np.testing.assert_array_equal(keep.sum(axis=1), [2, 0, 0])
    budget.observe(["kept", "sampling", "unsent"], [[5, 6, 7], [5], [5]])
    assert (budget.stats.unsent_observed_nodes, budget.stats.unsent_accepted_nodes) == (1, 1)
    assert (budget.stats.observed_nodes, budget.stats.accepted_nodes) == (2, 2)


def test_a_tokens_factor_follows_its_outcomes_within_bounds_and_decays_back():
    factor = TokenFactor(decay_every=4)
    tokens = np.array([3, 70_000])  # past the initial table: it grows
    for _ in range(200):
        factor.record(tokens, np.array([0.4, 0.5]), np.array([True, False]))
    low, high = TOKEN_FACTOR_RANGE
    np.testing.assert_allclose(factor.factors(np.array([[3, 70_000, 11, -1]])), [[high, low, 1.0, 1.0]])
    for _ in range(4 * 20):
        factor.tick()
    np.testing.assert_allclose(factor.factors(np.array([3, 70_000])), 1.0, atol=0.01)


@pytest.mark.parametrize("trees", [False, True])
def test_a_token_the_target_departs_at_stops_being_drafted_in_a_copy_that_otherwise_holds(trees):
    """Two chains from the same bucket: one through a token the target never takes there, one
    through tokens it always takes. The calibration's chance is the bucket's mix; the rejected
    token's factor falls until it is no longer drafted, while the other chain keeps every node."""
    budget = GoodputBudget(margin=0.05, cost=cost_model(0.02, 0.0, 0.004))
    tokens = np.array([[5, 6, 99, 8], [5, 6, 7, 8]], np.int32)
    nodes = DraftNodes(tokens, CHAIN[:2, :4].copy(), np.full(2, 4, np.int32), np.ones((2, 4), np.float32),
                       np.full((2, 4), SOURCE_CONTEXT, np.int8), np.full((2, 4), 9, np.int32))
    for _ in range(200):
        keep = budget.choose(["bad", "good"], nodes, np.array([4, 4]), 2, 0.0, trees=trees)
        budget.observe(["bad", "good"], [[5, 6, 1], [5, 6, 7, 8, 2]])
    np.testing.assert_array_equal(keep, [[True, True, False, False], [True, True, True, True]])
    assert budget.tokens.factors(np.array([99]))[0] < 1.0 < budget.tokens.factors(np.array([7]))[0]
