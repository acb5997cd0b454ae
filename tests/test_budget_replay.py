"""``benchmarks/budget_replay.py`` drives REST's real drafting loop (kernel, goodput budget,
output and live indexes) through token streams to their end, with the calibration's prior
strength it is given, and ``suffix`` the same way where Arctic Inference is installed;
``benchmarks/copy_ceiling.py`` counts on the same streams what copying from the request could draft;
``benchmarks/cost_model_replay.py`` feeds engines' logged steps to step-cost models of other settings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from vllm_retrieval_spec.datastores.resolve import open_datastore_for_model
from vllm_retrieval_spec.evaluation.replay import GreedyTrace

from conftest import TINY_SOURCE, load_benchmark

COST = (0.04, 0.002, 0.002)  # seconds: step, request, draft token


@pytest.fixture(scope="module")
def replay():
    return load_benchmark("budget_replay")


@pytest.fixture()
def traces(model_dir: Path) -> list[GreedyTrace]:
    """Streams that copy the store's text (and their own prompt): REST has something to draft."""
    ids = AutoTokenizer.from_pretrained(model_dir)(TINY_SOURCE * 3)["input_ids"]
    return [GreedyTrace(prompt_ids=ids[:8], output_ids=ids[8:]), GreedyTrace(prompt_ids=ids[:5], output_ids=ids[5:])]


def assert_whole_streams(tally, traces: list[GreedyTrace]) -> None:
    assert tally.generated == sum(len(t.output_ids) - 1 for t in traces)
    assert 0 <= tally.accepted <= tally.drafted
    assert tally.request_steps >= tally.engine_steps > 0


@pytest.mark.parametrize("concurrency", [1, 2])
def test_rest_replay_decodes_every_stream_with_the_given_prior_strength(replay, model_dir, store, traces,
                                                                        concurrency):
    datastore, _ = open_datastore_for_model(str(store), model_dir)
    drafter = replay.RestDrafter(datastore, 8, concurrency, COST, prior_strength=8.0)
    assert drafter.budget.calibration.prior_strength == 8.0
    tally = replay.lock_step(traces, concurrency, COST, drafter)
    assert_whole_streams(tally, traces)
    assert tally.accepted > 0  # the streams repeat the store's text


def test_suffix_replay_decodes_every_stream(replay, traces):
    pytest.importorskip("arctic_inference", reason="vLLM's suffix method: scripts/install-comparators.sh")
    assert_whole_streams(replay.lock_step(traces, 2, COST, replay.SuffixDrafter()), traces)


def test_a_warmed_replay_tallies_only_the_timed_streams_and_learns_from_the_warm_up(replay, traces):
    """``--warm-up``: the drafter decodes the last streams first, untallied, and keeps what it learned:
    ``suffix`` then drafts the timed stream, which repeats a warm-up one, from its cache."""
    pytest.importorskip("arctic_inference", reason="vLLM's suffix method: scripts/install-comparators.sh")
    repeated = [traces[0], traces[0]]
    cold = replay.lock_step(repeated[:1], 1, COST, replay.SuffixDrafter())
    warm = replay.warmed_lock_step(repeated, 1, 1, COST, replay.SuffixDrafter())
    assert_whole_streams(warm, repeated[:1])
    assert warm.accepted > cold.accepted and warm.request_steps < cold.request_steps


def test_copy_ceiling_counts_continuations_of_earlier_occurrences_in_the_request():
    """``benchmarks/copy_ceiling.py``: prompt 1 2 3, output 1 2 4 1 2 3. After 1 the request
    had 2 before (twice a hit); after 2 it had 3, then 3 and 4 (the last 3 hits any occurrence,
    not the latest, which was 4); after 1 2 only the last 3 continues an earlier occurrence."""
    shares = load_benchmark("copy_ceiling").copy_shares([1, 2, 3, 1, 2, 4, 1, 2, 3], first_output=3)
    assert shares["any_k1"] == pytest.approx(3 / 6) and shares["latest_k1"] == pytest.approx(2 / 6)
    assert shares["any_k2"] == pytest.approx(1 / 6) and shares["latest_k2"] == 0
    assert shares["any_k4"] == 0


def test_copy_ceiling_chain_rules_choose_among_earlier_occurrences():
    """``copy_ceiling.py --dense``: prompt 1 2 3 4 2 5 6, output 9 2 3 4. After 9 2 the latest
    earlier 2 is followed by 5 (nothing accepted, so the chain takes 3 steps), the first 2, whose
    producing state is nearest the output's, by 3 4 (the rest of the output: 2 steps); the most
    frequent continuation ties 3 against 5 and takes the smaller token."""
    module = load_benchmark("copy_ceiling")
    tokens = np.array([1, 2, 3, 4, 2, 5, 6, 9, 2, 3, 4])
    states = np.tile([0.0, 1.0], (tokens.size, 1))
    states[[0, 7]] = [1.0, 0.0]  # the states producing the first 2 and the output's 2
    assert module.chain_steps(tokens, 7, states) == {
        "latest": 3, "most_frequent": 2, "nearest_state": 2, "latest_or_dense": 2, "best_of_longest": 2}


def test_cost_model_replay_predicts_a_linear_engine_with_every_setting(tmp_path):
    """``benchmarks/cost_model_replay.py``: an engine whose steps follow linear cost terms
    exactly is predicted within 2% by every model setting (the rest: the ridge towards the CPU
    prior), read from a report's step log."""
    module = load_benchmark("cost_model_replay")
    steps = [[0.03 + 0.002 * reqs + 0.0015 * drafts, reqs, reqs + drafts, 0.0, 0, 0]
             for reqs in range(1, 9) for drafts in range(0, 40, 3)] * 3
    report = tmp_path / "acceptance_x.json"
    report.write_text(json.dumps({"results": [{"config": "none", "budget": None}, {"config": "rest_k32", "budget": {
        "cost_kernel_rows": 0, "step_log": steps}}]}))
    [(config, kernel_rows, logged)] = module.logged_engines(report)
    assert config == "rest_k32" and logged == steps
    for settings in module.VARIANTS.values():
        row = module.replay(logged, kernel_rows, **settings)
        assert row["predicted_steps"] == len(steps) - module.SETTLING_STEPS
        assert row["mean_absolute_error"] < 0.02 and row["relative_draft_cost_spread"] < 0.1


def test_same_states_tally_takes_the_better_draft_of_each_step_for_the_best_of_both(replay):
    """``--same-states``: REST ahead on one step (3 against 1), ``suffix`` ahead on two (by 2 where
    REST's candidate chain went wrong, by 1 where REST drafted nothing): the better of the two
    accepts 3 + 2 + 1 tokens over the three steps."""
    tally = replay.SameStates()
    tally.add(kept=3, drafted=4, candidate=3, suffix=1, suffix_drafted=2)
    tally.add(kept=0, drafted=2, candidate=1, suffix=2, suffix_drafted=3)
    tally.add(kept=0, drafted=0, candidate=0, suffix=1, suffix_drafted=1)
    row = tally.row()
    assert (tally.rest_ahead_tokens, tally.behind_candidates, tally.behind_not_drafted) == (2, 2, 1)
    assert row["best_of_both"] == 6 and row["best_of_both_per_step"] == pytest.approx(2.0)
