"""The custom_class plumbing of DraftProposer, without an engine."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from vllm_retrieval_spec.options import OptionsError
from vllm_retrieval_spec.proposers.prompt_lookup import PromptLookupProposer

from conftest import fake_vllm_config
from vrs_test_proposers import FailingEveryThirdStepProposer, OverlongProposer


def vllm_buffers(contexts: list[list[int]], max_model_len: int = 32):
    token_ids = np.zeros((len(contexts) + 2, max_model_len), dtype=np.int32)
    num_tokens = np.zeros(len(contexts) + 2, dtype=np.int32)
    for row, context in enumerate(contexts):
        token_ids[row, : len(context)] = context
        num_tokens[row] = len(context)
    return num_tokens, token_ids


def test_rows_without_sampled_tokens_get_no_draft():
    proposer = PromptLookupProposer(fake_vllm_config())
    num_tokens, token_ids = vllm_buffers([[1, 2, 3, 1, 2], [1, 2, 3, 1, 2]])
    drafts = proposer.propose([[2], []], num_tokens, token_ids)
    assert drafts == [[3, 1, 2], []]
    assert proposer.stats.rows == 1 and proposer.stats.drafted_rows == 1


def test_never_more_than_k_tokens():
    proposer = OverlongProposer(fake_vllm_config(k=3))
    num_tokens, token_ids = vllm_buffers([[5, 6], [7]])
    assert proposer.propose([[6], [7]], num_tokens, token_ids) == [[1, 1, 1], [1, 1, 1]]


def test_drafts_stop_before_max_model_len():
    proposer = OverlongProposer(fake_vllm_config(k=4, max_model_len=10))
    num_tokens, token_ids = vllm_buffers([[1] * 7, [1] * 9, [1] * 10], max_model_len=10)
    assert proposer.propose([[1], [1], [1]], num_tokens, token_ids) == [[1, 1], [], []]


def test_a_failing_step_gets_no_drafts_is_counted_and_logged_once(caplog):
    proposer = FailingEveryThirdStepProposer(fake_vllm_config())
    num_tokens, token_ids = vllm_buffers([[1, 2, 3, 1, 2]])
    with caplog.at_level(logging.ERROR):
        results = [proposer.propose([[2]], num_tokens, token_ids) for _ in range(7)]
    assert results[2] == [[]] and results[5] == [[]]  # steps 3 and 6 failed
    assert results[0] == results[1] == results[6] == [[3, 1, 2]]
    assert proposer.stats.failures == 2
    assert proposer.stats.last_error == "RuntimeError: injected drafting failure"
    assert sum("failed to draft" in record.getMessage() for record in caplog.records) == 1


class AlwaysFailingProposer(PromptLookupProposer):
    def draft(self, batch):
        raise ValueError("the table says k = 0")


def test_a_proposer_failing_every_step_warns_with_the_last_error(caplog):
    from vllm_retrieval_spec.proposers.base import FAILING_STEPS_WARNING

    proposer = AlwaysFailingProposer(fake_vllm_config())
    num_tokens, token_ids = vllm_buffers([[1, 2, 3, 1, 2]])
    with caplog.at_level(logging.WARNING):
        for _ in range(2 * FAILING_STEPS_WARNING):
            assert proposer.propose([[2]], num_tokens, token_ids) == [[]]
    warnings = [r.getMessage() for r in caplog.records if "steps all failed to draft" in r.getMessage()]
    assert len(warnings) == 2 and "ValueError: the table says k = 0" in warnings[-1]
    assert proposer.stats.consecutive_failures == 2 * FAILING_STEPS_WARNING


def test_consecutive_failures_reset_when_a_step_drafts():
    proposer = FailingEveryThirdStepProposer(fake_vllm_config())
    num_tokens, token_ids = vllm_buffers([[1, 2, 3, 1, 2]])
    for _ in range(3):
        proposer.propose([[2]], num_tokens, token_ids)
    assert proposer.stats.consecutive_failures == 1
    proposer.propose([[2]], num_tokens, token_ids)
    assert proposer.stats.consecutive_failures == 0


@pytest.mark.parametrize(("k", "kv_cache_dtype", "options", "message"), [
    (129, "auto", {}, r"num_speculative_tokens must be in \[1, 128\].*got 129"),
    (100_000, "auto", {"tree": True}, r"num_speculative_tokens must be in \[1, 128\]"),
    (0, "auto", {}, r"num_speculative_tokens must be in \[1, 128\].*got 0"),
    (8, "fp8", {"tree": True}, r"tree.*does not support --kv-cache-dtype fp8"),
    (8, "fp8_e5m2", {"tree": True}, r"--kv-cache-dtype fp8_e5m2"),
])
def test_what_no_request_could_be_served_with_is_refused_at_construction(k, kv_cache_dtype, options, message):
    with pytest.raises(OptionsError, match=message):
        PromptLookupProposer(fake_vllm_config(k=k, kv_cache_dtype=kv_cache_dtype, options=options))


def test_chains_serve_an_fp8_kv_cache_and_the_longest_drafts_vllm_verifies():
    from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN

    from vllm_retrieval_spec.options import MAX_SPEC_LEN as OUR_MAX_SPEC_LEN

    assert OUR_MAX_SPEC_LEN == MAX_SPEC_LEN
    PromptLookupProposer(fake_vllm_config(k=MAX_SPEC_LEN, max_model_len=512, kv_cache_dtype="fp8"))


def test_options_are_validated_at_construction():
    with pytest.raises(OptionsError, match=r"unknown option\(s\) 'bogus' in additional_config\['retrieval_spec'\]"):
        PromptLookupProposer(fake_vllm_config(options={"bogus": 1}))
    proposer = PromptLookupProposer(fake_vllm_config(options={"context_ngram_max": 1}))
    num_tokens, token_ids = vllm_buffers([[1, 2, 3, 1, 2]])
    assert proposer.propose([[2]], num_tokens, token_ids) == [[3, 1, 2]]


class RecordingSession:
    """The session a proposer sees, with a goodput budget and no runner behind it."""

    def __init__(self, req_ids: list[str], budget, samples: list[bool] | None = None) -> None:
        self.step_req_ids = req_ids
        self.budget = budget
        self.output_index = None
        self.context_states = None
        self.step_samples = None if samples is None else np.array(samples)
        self.step_speculates = None
        self.trees = {}
        self.draft_q = {}

    def publish(self, trees, draft_q=None) -> None:
        self.trees = dict(trees)
        self.draft_q = dict(draft_q or {})

    def live_matches(self, *_) -> None:
        return None  # no live index of other requests in flight

    def follow_live_index(self, *_) -> None:
        pass  # no live index to follow


def goodput_budget(per_token_seconds: float):
    from vllm_retrieval_spec.goodput import GoodputBudget, StepCostModel

    cost = StepCostModel(prior=(0.05, 0.002, per_token_seconds, 0.0, 0.0, 0.0, 0.0, 0.0), prior_steps=1e6)
    return GoodputBudget(margin=0.05, cost=cost)


def test_budget_auto_drafts_when_verification_is_cheap_and_not_when_it_is_dear():
    num_tokens, token_ids = vllm_buffers([[1, 2, 3, 1, 2, 3, 1, 2]])
    cheap = PromptLookupProposer(fake_vllm_config())
    cheap.bind_session(RecordingSession(["a"], goodput_budget(1e-5)))
    assert cheap.propose([[2]], num_tokens, token_ids) == [[3, 1, 2]]
    dear = PromptLookupProposer(fake_vllm_config())
    dear.bind_session(RecordingSession(["a"], goodput_budget(1.0)))
    assert dear.propose([[2]], num_tokens, token_ids) == [[]]
    assert dear.session.budget.stats.skipped_rows == 1  # no node could pay: not even searched


def test_a_request_that_turned_speculation_off_gets_no_drafts():
    num_tokens, token_ids = vllm_buffers([[1, 2, 3, 1, 2], [1, 2, 3, 1, 2]])
    proposer = PromptLookupProposer(fake_vllm_config())
    session = RecordingSession(["off", "on"], goodput_budget(1e-5))
    session.step_speculates = np.array([False, True])
    proposer.bind_session(session)
    assert proposer.propose([[2], [2]], num_tokens, token_ids) == [[], [3, 1, 2]]
    assert proposer.stats.failures == 0 and proposer.stats.drafted_rows == 1
    assert proposer.stats.unspeculated_rows == 1


@pytest.mark.parametrize(("value", "wanted"), [("off", False), ("OFF", False), ("false", False), (0, False),
                                               (0.0, False), (False, False), ("0", False), ("on", True),
                                               ("True", True), (1, True), (True, True), ("1", True)])
def test_a_requests_speculation_switch_reads_on_and_off(value, wanted):
    from vllm import SamplingParams

    from vllm_retrieval_spec.options import SPECULATE_ARG
    from vllm_retrieval_spec.verification.admission import refuse_unreadable_speculation_switch, turned_speculation_off

    params = SamplingParams(extra_args={SPECULATE_ARG: value})
    refuse_unreadable_speculation_switch(params)
    assert turned_speculation_off(params) is not wanted
    assert not turned_speculation_off(SamplingParams()) and not turned_speculation_off(None)
    assert not turned_speculation_off(SamplingParams(extra_args={"other": 0}))


@pytest.mark.parametrize("value", ["maybe", "", 2, -1, 0.5, None, [0], {"on": 1}])
def test_a_speculation_switch_it_cannot_read_is_refused_naming_the_key(value):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from vllm_retrieval_spec.options import SPECULATE_ARG
    from vllm_retrieval_spec.verification.admission import refuse_unreadable_speculation_switch, turned_speculation_off

    params = SamplingParams(extra_args={SPECULATE_ARG: value})
    with pytest.raises(VLLMValidationError, match=rf'^{SPECULATE_ARG} must be "on" or "off" .*vllm_xargs'):
        refuse_unreadable_speculation_switch(params)
    assert not turned_speculation_off(params)  # never raises where the engine reads it


@pytest.mark.parametrize("feature", [{"presence_penalty": 0.5}, {"min_tokens": 4}, {"thinking_token_budget": 8}])
def test_tree_mode_admits_sequence_features_only_in_requests_that_turned_speculation_off(feature):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from vllm_retrieval_spec.options import SPECULATE_ARG
    from vllm_retrieval_spec.verification.admission import refuse_chain_only_features

    name = next(iter(feature))
    with pytest.raises(VLLMValidationError, match=rf"^{name} cannot be used .* {SPECULATE_ARG}: off\)"):
        refuse_chain_only_features(SamplingParams(**feature))
    refuse_chain_only_features(SamplingParams(**feature, extra_args={SPECULATE_ARG: "off"}))


def test_the_session_keeps_a_requests_switch_until_it_finishes():
    from types import SimpleNamespace

    from vllm import SamplingParams

    from vllm_retrieval_spec.options import SPECULATE_ARG
    from vllm_retrieval_spec.verification.session import SpecSession

    session = SpecSession(tree_mode=False)
    session.begin_step(["a"])
    assert session.step_speculates is None  # nobody turned it off: no per-row mask at all
    session.admit([SimpleNamespace(req_id="b", sampling_params=SamplingParams(extra_args={SPECULATE_ARG: "off"})),
                   SimpleNamespace(req_id="c", sampling_params=SamplingParams())])
    session.begin_step(["a", "b", "c"])
    assert session.step_speculates.tolist() == [True, False, True]
    session.release(["b"])
    session.begin_step(["a", "c"])
    assert session.step_speculates is None and not session.unspeculated


def test_budget_auto_learns_from_the_next_step_and_trees_keep_parents_first():
    from vllm_retrieval_spec.proposers.rest import RestProposer

    config = fake_vllm_config(k=8, options={"use_datastore": False, "tree": True, "min_ratio": 0.0})
    config.model_config.tokenizer = None
    proposer = RestProposer(config)
    session = RecordingSession(["a"], goodput_budget(1e-5))
    proposer.bind_session(session)
    num_tokens, token_ids = vllm_buffers([[1, 2, 3, 1, 2, 4, 1, 2]])
    drafts = proposer.propose([[2]], num_tokens, token_ids)
    tree = session.trees[0]
    assert list(tree.tokens) == drafts[0] and len(drafts[0]) > 0
    assert all(-1 <= parent < index for index, parent in enumerate(tree.parents))
    proposer.propose([[drafts[0][0], 7]], num_tokens, token_ids)  # the first node was accepted
    assert session.budget.stats.accepted_nodes == 1 and session.budget.stats.observed_nodes >= 2


def rest_proposer(k: int, **options):
    from vllm_retrieval_spec.proposers.rest import RestProposer

    config = fake_vllm_config(k=k, options={"use_datastore": False, "use_output_index": False, "budget": "fixed",
                                            **options})
    config.model_config.tokenizer = None
    return RestProposer(config)


def test_tree_mode_drafts_chains_while_its_choice_keeps_no_branch():
    """Where branches never pay (a tree step costs a second), tree mode soon drafts the chain it
    kept anyway without building trees, and publishes no tree for the session to verify."""
    from vllm_retrieval_spec.goodput import GoodputBudget, StepCostModel
    from vllm_retrieval_spec.goodput.budget import TREE_PATIENCE

    proposer = rest_proposer(8, tree=True, budget="auto", min_ratio=0.0)
    cost = StepCostModel(prior=(0.05, 0.002, 1e-5, 0.0, 0.0, 1.0, 0.0, 0.0), prior_steps=1e6)
    session = RecordingSession(["a"], GoodputBudget(cost=cost))
    proposer.bind_session(session)
    num_tokens, token_ids = vllm_buffers([[1, 2, 3, 1, 2, 4, 1, 2]])
    sampled = [2]
    for _ in range(TREE_PATIENCE):
        drafts = proposer.propose([sampled], num_tokens, token_ids)
        assert proposer.last_drafts.tree_tokens is not None and drafts[0] and not session.trees
        sampled = drafts[0] + [9]  # every node accepted
    assert proposer.propose([sampled], num_tokens, token_ids) == drafts
    assert proposer.last_drafts.tree_tokens is None and not session.trees
    assert session.budget.stats.tree_steps == TREE_PATIENCE and session.budget.stats.branched_steps == 0


@pytest.mark.parametrize("tree", [False, True])
def test_sampled_candidates_are_drawn_for_requests_that_sample_only(tree):
    """Greedy rows keep the deterministic candidates; rows that sample get candidates drawn from
    the trie's q, published with the distributions they were drawn from."""
    context = [7, 1, 2, 3, 7, 1, 2, 4, 7, 1, 2, 5, 7, 1, 2]
    num_tokens, token_ids = vllm_buffers([context, context])
    deterministic = rest_proposer(6, tree=tree, min_ratio=0.0)
    deterministic.bind_session(RecordingSession(["a", "b"], None, samples=[True, True]))
    expected = deterministic.propose([[2], [2]], num_tokens, token_ids)[1]
    proposer = rest_proposer(6, tree=tree, min_ratio=0.0, candidates="sampled", candidates_per_node=2)
    session = RecordingSession(["a", "b"], None, samples=[True, False])
    proposer.bind_session(session)
    seen = set()
    for _ in range(40):
        drafts = proposer.propose([[2], [2]], num_tokens, token_ids)
        assert drafts[1] == expected and 1 not in session.draft_q
        drawn, q = session.trees[0], session.draft_q[0]
        assert list(drawn.tokens) == drafts[0] and 0 < len(drafts[0]) <= 6
        assert q.tokens.shape[0] == len(drafts[0]) + 1
        for node, (token, parent) in enumerate(zip(drawn.tokens, drawn.parents)):
            support = q.tokens[parent + 1]
            assert token in support and q.probs[parent + 1][support == token][0] > 0
            assert tree or parent == node - 1
        seen.add(drafts[0][0])
    assert seen == {3, 4, 5}, "every continuation of the context is drawn sometimes"
