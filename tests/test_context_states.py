"""REST's context occurrences ranked by the target's hidden states (option context_state_votes):
the kernel follows the occurrence nearest by state, the states' lifecycle, the session recording
every token's producing state, and the real engine (lossless; states equal a plain forward's)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from vllm_retrieval_spec.datastores.context_states import ContextStates
from vllm_retrieval_spec.datastores.dense_builder import last_hidden_states, load_target_model
from vllm_retrieval_spec.evaluation.engine import EngineSpec, drafter_of, generate
from vllm_retrieval_spec.kernels.rest import RestParams, rest_retrieve
from vllm_retrieval_spec.verification.session import SpecSession

from conftest import assert_same_token_ids, generate_both_ways, running_engine

DIM = 4
# Token 5 occurs twice before the context's last token (also 5): continued by 8 9 at position 1
# and by 6 7 at position 4. Without states REST follows the latest (their weights tie; so do
# their first tokens' ranks but for the smaller token, 6).
CONTEXT = np.array([[1, 5, 8, 9, 5, 6, 7, 5]], np.int32)
FRESH_PROMPT = "Write a Python function that returns the n-th prime number, with a docstring.\n"
PARAMS = RestParams(use_datastore=False, chain_len=2, n_max=1, min_ratio=0.0)


def unit(index: int) -> np.ndarray:
    vector = np.full(DIM, 0.1, np.float32)
    vector[index] = 1.0
    return vector


def states_with_nearest(position: int) -> ContextStates:
    """Slot 0 holds the states that produced the three 5s; the one at ``position`` is the last's."""
    states = ContextStates(DIM, max_requests=2, max_positions=16)
    produced = {1: unit(0), 4: unit(1), 7: unit(0 if position == 1 else 1)}
    states.write(["r"], np.zeros(3, np.int64), np.array(list(produced)), np.stack(list(produced.values())))
    return states


def chain(states: ContextStates | None, votes: int, slot: int = 0) -> list[int]:
    params = dataclasses.replace(PARAMS, context_state_votes=votes)
    given = None if states is None else (states.native, np.array([slot], np.int32))
    found = rest_retrieve(None, CONTEXT, np.array([CONTEXT.shape[1]], np.int32), np.array([0], np.int32), params,
                          context_states=given)
    return found.chain_tokens[0, :found.chain_size[0]].tolist()


@pytest.mark.parametrize("nearest, expected", [(1, [8, 9]), (4, [6, 7])])
def test_the_chain_follows_the_occurrence_nearest_by_state(nearest, expected):
    assert chain(states_with_nearest(nearest), votes=4) == expected


def test_without_votes_or_known_states_the_chain_is_unchanged():
    latest = chain(None, votes=0)
    assert latest == [6, 7]
    assert chain(states_with_nearest(1), votes=0) == latest
    assert chain(states_with_nearest(1), votes=1) == latest
    assert chain(states_with_nearest(1), votes=4, slot=1) == latest  # slot 1 knows no state
    assert chain(states_with_nearest(1), votes=4, slot=-1) == latest


def test_bad_slots_and_votes_are_refused():
    states = states_with_nearest(1)
    with pytest.raises(ValueError, match="go together"):
        rest_retrieve(None, CONTEXT, np.array([8], np.int32), np.array([0], np.int32), PARAMS,
                      context_states=(None, np.array([0], np.int32)))
    with pytest.raises(IndexError, match="state_slots"):
        chain(states, votes=4, slot=2)
    with pytest.raises(ValueError, match="context_state_votes"):
        chain(states, votes=5000)
    with pytest.raises(IndexError, match="position"):
        states.native.write(np.zeros(1, np.int32), np.array([16]), unit(0)[None])
    with pytest.raises(ValueError, match="go together"):
        states.native.write(np.zeros(1, np.int32), np.zeros(1, np.int64), np.zeros((1, DIM + 1), np.float32))


def test_states_are_unit_vectors_freed_with_their_request_and_slots_reused():
    states = ContextStates(DIM, max_requests=2, max_positions=64)
    states.write(["a", "b", "c"], np.array([0, 1, 2, 2]), np.array([3, 3, 3, 4]), np.stack([unit(0)] * 4) * 7)
    assert states.requests == 2  # "c" found no free slot: it keeps none
    assert states.slots_of(["a", "b", "c"]).tolist() == [0, 1, -1]  # handed out lowest first
    assert states.native.known(0, 3) and not states.native.known(0, 2)
    assert states.memory_bytes > 0
    states.release(["a", "b", "unknown"])
    assert states.requests == 0 and states.memory_bytes == 0
    states.write(["c"], np.array([0]), np.array([5]), np.zeros((1, DIM), np.float32))  # a zero state stays unknown
    assert states.slots_of(["c"]).tolist() == [0] and not states.native.known(0, 5)
    states.write(["c"], np.array([0]), np.array([64]), unit(0)[None])  # past every context: dropped
    assert states.memory_bytes == 0


class RecordedWrites(ContextStates):
    """Context states that remember what each write stored, by request and position."""

    def __init__(self) -> None:
        super().__init__(1, max_requests=4, max_positions=64)
        self.stored: dict[tuple[str, int], float] = {}

    def write(self, req_ids, rows, positions, states) -> None:
        for row, position, state in zip(rows, positions.tolist(), states):
            self.stored[(req_ids[row], position)] = float(state[0])
        super().write(req_ids, rows, positions, states)


def test_the_session_records_the_state_that_produced_every_prompt_and_sampled_token():
    session = SpecSession(tree_mode=False, context_states=RecordedWrites())
    session.begin_step(["a", "b", "c"])
    # a: a prompt chunk of 3 tokens after 2 cached ones; b: 2 drafts, 1 accepted + bonus;
    # c: a decode step without drafts. Hidden rows: a 0-2, b 3-5, c 6.
    hidden = torch.arange(7, dtype=torch.float32)[:, None]
    sample_hidden = hidden[[2, 3, 4, 5, 6]]  # a prompt chunk's last row only
    session.keep_hidden_states(sample_hidden, [0, 2, 0], [[40], [41, 42], [43]], np.array([6, 12, 9]))
    session.keep_prompt_states(hidden, np.array([3, 3, 1]), np.array([2, 9, 8]), [0, 2, 0])
    assert session.context_states.stored == {("a", 3): 0.0, ("a", 4): 1.0, ("a", 5): 2.0,
                                             ("b", 10): 3.0, ("b", 11): 4.0, ("c", 8): 6.0}
    session.release(["a", "b", "c"])
    assert session.context_states.requests == 0


def failing_write(*_: object) -> None:
    raise RuntimeError("no room")


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_rest_with_context_states_is_lossless_and_keeps_a_plain_forwards_states(tree, model_dir, code_store,
                                                                               e2e_prompts, baseline_runs):
    """Greedy identity at batch 1 and 8 in flight; every state kept for a request is the one a plain
    transformers forward of its tokens gives at the position before, and it is freed once the
    request finishes; a recording that fails is a drafting failure, not the engine's."""
    options = {"datastore": str(code_store), "context_state_votes": 4, "tree": tree}
    spec = EngineSpec(model_dir, {"model": "vllm_retrieval_spec.RestProposer", "num_speculative_tokens": 16 if tree
                                  else 8}, {"retrieval_spec": options}, max_num_seqs=8)
    written: dict[str, dict[int, np.ndarray]] = {}
    with running_engine(spec) as llm:
        drafter = drafter_of(llm)
        states = drafter.session.context_states
        write = states.write

        def recording(req_ids, rows, positions, values):
            for row, position, value in zip(rows, positions.tolist(), values):
                written.setdefault(req_ids[row], {})[position] = value.copy()
            write(req_ids, rows, positions, values)

        states.write = recording
        runs = generate_both_ways(llm, e2e_prompts)
        written.clear()
        finished = generate(llm, [FRESH_PROMPT], 16, concurrency=1)  # nothing of it in the prefix cache
        (fresh,) = written
        generate(llm, ["print("], 2, concurrency=1)  # the runner hears of a finished request at its next step
        assert states.slots_of([fresh]).tolist() == [-1] and states.requests <= 1
        assert drafter.stats.failures == 0, drafter.stats.last_error
        states.write = failing_write
        broken = generate_both_ways(llm, e2e_prompts)  # recording fails every step: drafting's failure
        assert drafter.stats.failures > 0 and "RuntimeError: no room" in drafter.stats.last_error
    for mode, run in runs.items():
        assert_same_token_ids(baseline_runs[mode], run)
        assert_same_token_ids(baseline_runs[mode], broken[mode])
        assert run.counters.accepted_tokens > 0, mode
    record = finished.records[0]
    ids = record.prompt_ids + record.output_ids
    kept = written[fresh]
    with torch.inference_mode():
        expected = last_hidden_states(load_target_model(model_dir), torch.tensor([ids]))[0]
    # Every token's producer (the first token has none; a last step may accept past max_tokens).
    assert set(range(1, len(ids))) <= set(kept) and max(kept) < len(ids) + 16
    for position in list(range(1, len(ids)))[:: max(1, len(ids) // 24)]:
        torch.testing.assert_close(torch.from_numpy(kept[position]), expected[position - 1], rtol=1e-3, atol=2e-3)
