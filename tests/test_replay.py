"""Greedy replay: accepted lengths on trees and chains, and step counting."""

from __future__ import annotations

from vllm_retrieval_spec.evaluation.replay import GreedyTrace, accepted_length, chain_as_tree, replay, save_traces
from vllm_retrieval_spec.evaluation.traces import greedy_traces, traces_path


def test_accepted_length_walks_the_matching_branch():
    #        root
    #       /    \
    #      5      7
    #     / \      \
    #    6   8      9
    tokens, parents = [5, 7, 6, 8, 9], [-1, -1, 0, 0, 1]
    assert accepted_length(tokens, parents, [5, 8, 1]) == 2
    assert accepted_length(tokens, parents, [7, 9, 9]) == 2
    assert accepted_length(tokens, parents, [6]) == 0
    assert accepted_length([], [], [1, 2]) == 0


def test_chain_as_tree_accepts_the_matching_prefix():
    assert accepted_length(*chain_as_tree([1, 2, 3]), [1, 2, 4]) == 2


def test_replay_counts_one_step_per_draft_round():
    trace = GreedyTrace(prompt_ids=[9, 9], output_ids=[1, 2, 3, 4, 5])

    def perfect(matrix, lengths):
        return [chain_as_tree(matrix[i, lengths[i]:lengths[i] + 2].tolist()) for i in range(len(lengths))]

    def nothing(matrix, lengths):
        return [([], []) for _ in lengths]

    assert replay([trace], nothing).decode_steps == 4
    perfect_run = replay([trace], perfect)
    assert perfect_run.decode_steps == 2  # 1 + (2 accepted + 1) + (2 accepted + 1) > 4 remaining
    assert perfect_run.honest_tokens_per_step == 2.0


def test_greedy_traces_come_from_the_cache_when_present(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_RETRIEVAL_SPEC_CACHE", str(tmp_path))
    cached = [GreedyTrace([1, 2], [3, 4]), GreedyTrace([5], [6])]
    path = traces_path("raw", 2, 16)
    assert path == tmp_path / "traces" / "humaneval_raw_n2_t16.json"
    save_traces(cached, path)
    assert greedy_traces(tmp_path / "no-model-needed", "raw", 2, 16) == cached
