"""DReSD: the hidden state that produced each row's last sampled token (chain and tree mode), and
DReSDProposer and HybridProposer in the real engine: lossless, drafting from dense neighbours."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_retrieval_spec.datastores.dense_builder import (
    last_hidden_states,
    load_target_model,
)
from vllm_retrieval_spec.evaluation.engine import EngineSpec, drafter_of, generate
from vllm_retrieval_spec.proposers.base import DraftProposer
from vllm_retrieval_spec.verification.session import SpecSession

from conftest import assert_same_token_ids, generate_both_ways, running_engine


def session_after_step(step: int = 5) -> SpecSession:
    session = SpecSession(tree_mode=True)
    session.step = step
    return session


def test_rows_without_drafts_take_their_only_row():
    session = session_after_step()
    hidden = torch.arange(3, dtype=torch.float32)[:, None] * torch.ones(1, 4)
    session.keep_hidden_states(hidden, None, [[7], [8], [9]])
    assert session.step_hidden_states[:, 0].tolist() == [0.0, 1.0, 2.0]


def test_chain_rows_take_the_row_of_the_last_accepted_token():
    session = session_after_step()
    # request 0: 3 drafts (rows 0-3), 2 accepted + bonus -> row 2; request 1: 1 draft (rows 4-5),
    # none accepted -> row 4; request 2: no drafts (row 6); request 3 sampled nothing.
    hidden = torch.arange(8, dtype=torch.float32)[:, None]
    session.keep_hidden_states(hidden, [3, 1, 0, 0], [[1, 2, 3], [4], [5], []])
    assert session.step_hidden_states[:3, 0].tolist() == [2.0, 4.0, 6.0]


def test_tree_rows_take_the_row_of_the_last_accepted_node():
    session = session_after_step(step=5)
    # The tree step just verified (recorded at step 4, before this drafting call's step 5):
    # request 0's path accepted nodes 0 then 3 (row 1 + 3 = 4), request 1 accepted nothing.
    session._accepted_paths = (4, np.array([[0, 3, -1], [-1, -1, -1]]), np.array([2, 0]))
    hidden = torch.arange(10, dtype=torch.float32)[:, None]
    session.keep_hidden_states(hidden, [5, 3], [[1, 2, 3], [4]])
    assert session.step_hidden_states[:, 0].tolist() == [4.0, 6.0]


class RecordedStates:
    """Stands in for a learned dense index: what :meth:`record_states` was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], list[int], list[float]]] = []

    def record_states(self, owners, positions, states) -> None:
        self.calls.append((list(owners), positions.tolist(), states[:, 0].tolist()))


def test_the_learned_index_gets_the_state_of_every_sampled_token_at_its_position():
    """Chain mode: request 0 (3 drafts, rows 0-3) sampled 3 tokens, now at positions 7-9 of 10;
    request 1 (rows 4-5) sampled 1 at position 4; request 2 (row 6) sampled nothing."""
    session = session_after_step()
    session.learned_dense = RecordedStates()
    session.begin_step(["a", "b", "c"])
    hidden = torch.arange(7, dtype=torch.float32)[:, None]
    session.keep_hidden_states(hidden, [3, 1, 0], [[1, 2, 3], [4], []], np.array([10, 5, 3]))
    assert session.learned_dense.calls == [(["a", "a", "a", "b"], [7, 8, 9, 4], [0.0, 1.0, 2.0, 4.0])]


def test_in_tree_mode_the_learned_index_gets_the_states_of_the_accepted_path():
    session = session_after_step(step=5)
    session.learned_dense = RecordedStates()
    session.begin_step(["a", "b"])
    session._accepted_paths = (5, np.array([[0, 3, -1], [-1, -1, -1]]), np.array([2, 0]))
    hidden = torch.arange(10, dtype=torch.float32)[:, None]
    session.keep_hidden_states(hidden, [5, 3], [[1, 2, 3], [4]], np.array([20, 8]))
    assert session.learned_dense.calls == [(["a", "a", "a", "b"], [17, 18, 19, 7], [0.0, 1.0, 4.0, 6.0])]


def lossless_drafter(model_dir: Path, proposer: str, options: dict, tree: bool, prompts: list[str],
                     baseline_runs: dict) -> DraftProposer:
    """``proposer`` with ``options`` (chains of 8 or trees of 16, 8 in flight) gives the token ids of
    no speculation, accepting drafts without a failed step; its drafter."""
    spec = EngineSpec(model_dir, {"model": f"vllm_retrieval_spec.{proposer}", "num_speculative_tokens": 16 if tree
                                  else 8}, {"retrieval_spec": {**options, "tree": tree}}, max_num_seqs=8)
    with running_engine(spec) as llm:
        runs = generate_both_ways(llm, prompts)
        drafter = drafter_of(llm)
    for mode, run in runs.items():
        assert_same_token_ids(baseline_runs[mode], run)
        assert run.counters.accepted_tokens > 0, mode
    assert drafter.stats.failures == 0, drafter.stats.last_error
    return drafter


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_dresd_is_lossless_and_drafts_from_its_neighbours(tree, model_dir, dense_store, e2e_prompts, baseline_runs):
    drafter = lossless_drafter(model_dir, "DReSDProposer", {"dense_datastore": str(dense_store), "budget": "fixed"},
                               tree, e2e_prompts, baseline_runs)
    assert sum(count for source, count in drafter.stats.draft_tokens_by_source.items() if "dense" in source) > 0


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_hybrid_is_lossless_and_drafts_from_dense_and_exact_sources(tree, model_dir, dense_store, code_store,
                                                                     e2e_prompts, baseline_runs):
    """HybridProposer: REST's datastore and context with the dense neighbours in one trie, under
    the goodput budget (budget auto, which calibrates and ranks every source on its own)."""
    options = {"dense_datastore": str(dense_store), "datastore": str(code_store), "dense_learned_positions": 4096}
    drafter = lossless_drafter(model_dir, "HybridProposer", options, tree, e2e_prompts, baseline_runs)
    assert drafter.stats.rows > 0
    assert drafter.gate.judged > 0  # steps drafted with and without the dense search, judged on what followed
    learned = drafter.session.learned_dense
    assert learned.num_positions > 0  # the first run's requests taught it (vLLM reports the last ones a step later)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_hybrid_without_a_budget_sends_dense_nodes_losslessly(tree, model_dir, dense_store, code_store, e2e_prompts,
                                                               baseline_runs):
    """With ``budget: fixed`` there is no gate: every step searches and dense nodes are verified."""
    options = {"dense_datastore": str(dense_store), "datastore": str(code_store), "budget": "fixed"}
    drafter = lossless_drafter(model_dir, "HybridProposer", options, tree, e2e_prompts, baseline_runs)
    assert sum(count for source, count in drafter.stats.draft_tokens_by_source.items() if "dense" in source) > 0


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_the_proposer_and_the_learned_index_see_the_hidden_state_of_a_plain_forward(tree, model_dir, dense_store,
                                                                                     e2e_prompts):
    """At every drafting call, the state given for a row is the one a plain transformers forward
    of the row's tokens gives at the position that produced its last token; the learned index
    gets the state of every generated token (accepted drafts included) and keeps its key with
    the tokens the request went on to generate."""
    seen: list[tuple[np.ndarray, np.ndarray]] = []
    recorded: list[tuple[str, int, np.ndarray]] = []
    finished: dict[str, np.ndarray] = {}
    options = {"dense_datastore": str(dense_store), "budget": "fixed", "dense_learned_positions": 65_536,
               "tree": tree}
    spec = EngineSpec(model_dir, {"model": "vllm_retrieval_spec.DReSDProposer", "num_speculative_tokens": 8},
                      {"retrieval_spec": options}, max_num_seqs=4)
    with running_engine(spec) as llm:
        drafter = drafter_of(llm)
        search, learned = drafter.dense.continuations, drafter.session.learned_dense
        record, finish = learned.record, learned.finish

        def recording(batch, session):
            states = drafter.session.step_hidden_states[batch.rows].float().cpu().numpy()
            seen.extend((batch.token_ids[row, :batch.num_tokens[row]].copy(), state.copy())
                        for row, state in zip(batch.rows, states))
            return search(batch, session)

        def recording_keys(owners, positions, keys):
            recorded.extend(zip(owners, positions.tolist(), keys.copy()))
            record(owners, positions, keys)

        def finishing(tokens):
            finished.update({owner: ids.copy() for owner, ids in tokens.items()})
            finish(tokens)

        drafter.dense.continuations, learned.record, learned.finish = recording, recording_keys, finishing
        run = generate(llm, e2e_prompts[:4], 24, concurrency=4)
    assert len(seen) >= 16 and run.counters.accepted_tokens > 0
    prompt_lengths = {tuple(r.prompt_ids + r.output_ids): len(r.prompt_ids) for r in run.records}
    for owner, tokens in finished.items():  # the runner's tokens: past max_tokens when a last step accepted more
        prompt_length = next(n for ids, n in prompt_lengths.items() if tokens.tolist()[:len(ids)] == list(ids))
        assert sorted(p for o, p, _ in recorded if o == owner) == list(range(prompt_length, len(tokens)))
    model = load_target_model(model_dir)
    for ids, state in seen[::max(1, len(seen) // 24)]:
        with torch.inference_mode():
            expected = last_hidden_states(model, torch.tensor([ids.tolist()]))[0, len(ids) - 2]
        torch.testing.assert_close(torch.from_numpy(state), expected, rtol=1e-3, atol=2e-3)
    value_tokens = drafter.dense.store.value_tokens
    learnable = [(finished[owner], p, key) for owner, p, key in recorded
                 if owner in finished and p + value_tokens <= len(finished[owner])]
    assert learned.num_positions == len(learnable) > 0
    for ids, position, key in learnable[::max(1, len(learnable) // 12)]:
        with torch.inference_mode():
            state = last_hidden_states(model, torch.tensor([ids[:position + 1].tolist()]))[0, position - 1]
        np.testing.assert_allclose(key, drafter.dense.store.keys_of(state.numpy()[None])[0], rtol=1e-3, atol=2e-3)
        _, values = learned.search(key[None], 4)
        assert ids[position:position + value_tokens].tolist() in values[0].tolist()
