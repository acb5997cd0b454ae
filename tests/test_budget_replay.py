"""``benchmarks/budget_replay.py`` drives REST's real drafting loop (kernel, goodput budget,
output and live indexes) through token streams to their end, with the calibration's prior
strength it is given, and ``suffix`` the same way where Arctic Inference is installed."""

from __future__ import annotations

from pathlib import Path

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
