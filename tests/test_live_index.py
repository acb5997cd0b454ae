"""The live index of requests in flight: lookups against a brute-force search over random
in-flight token streams, self-exclusion, bounded memory, no state left by finished or aborted
requests, clear errors, and two concurrent requests of one prompt drafting from each other in
the real engine, exactly."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_retrieval_spec.datastores.live_index import REQUEST_SHARE, LiveIndex, live_lengths
from vllm_retrieval_spec.drafts import SOURCE_LIVE, source_label
from vllm_retrieval_spec.evaluation.engine import EngineSpec, drafter_of
from vllm_retrieval_spec.options import OptionsError, RetrievalSpecOptions
from vllm_retrieval_spec.verification.session import SpecSession

from conftest import running_engine

WIDTH = 128  # columns of the token_ids buffers below (vLLM's max_model_len)
LEAD_TOKENS = 16  # the second request of one prompt starts once the first has this many
FIRST_TOKENS, SECOND_TOKENS = 48, 32
SOURCE_LIVE_LABEL = source_label(SOURCE_LIVE)


# ------------------------------------------------------------------ brute force


@dataclass
class Incarnation:
    """One request as indexed from its (re)start: its tokens and their global append numbers."""

    start: int
    tokens: list[int] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)
    alive: bool = True

    @property
    def length(self) -> int:
        return self.start + len(self.tokens)


class BruteForceLiveIndex:
    """A plain search over everything ever appended, with the rules of csrc/live_index.h."""

    def __init__(self, capacity: int, lengths: tuple[int, ...], max_walk: int) -> None:
        self.capacity, self.lengths, self.max_walk = capacity, lengths, max_walk
        self.max_request_tokens = max(1, capacity // REQUEST_SHARE)
        self.appended = 0
        self.incarnations: list[Incarnation] = []
        self.live: dict[str, Incarnation] = {}

    def update(self, req_ids, token_ids, num_tokens) -> None:
        for row, req_id in enumerate(req_ids):
            if req_id is not None:
                self._sync(req_id, token_ids[row, : num_tokens[row]].tolist())

    def remove(self, req_ids) -> None:
        for req_id in req_ids:
            if req_id in self.live:
                self.live.pop(req_id).alive = False

    def _sync(self, req_id: str, context: list[int]) -> None:
        request = self.live.get(req_id)
        if request is not None:
            if len(context) >= request.length and (
                    not request.tokens or context[request.length - 1] == request.tokens[-1]):
                self._append(request, context[request.length:])
                return
            self.remove([req_id])
        request = self.live[req_id] = Incarnation(start=max(0, len(context) - self.max_request_tokens))
        self.incarnations.append(request)
        self._append(request, context[request.start:])

    def _append(self, request: Incarnation, tokens: list[int]) -> None:
        for token in tokens:
            request.tokens.append(token)
            request.numbers.append(self.appended)
            self.appended += 1

    def lookup(self, req_ids, token_ids, num_tokens, rows, max_matches: int, cont_len: int):
        tokens = np.full((len(rows), max_matches, cont_len), -1, np.int32)
        lengths = np.zeros((len(rows), max_matches), np.int32)
        match_len = np.zeros(len(rows), np.int32)
        for r, row in enumerate(rows):
            own = self.live.get(req_ids[row])
            context = token_ids[row, : num_tokens[row]].tolist()
            for n in self.lengths:
                found = self._matches(own, context[-n:], max_matches) if n <= len(context) else []
                for i, (request, end) in enumerate(found):
                    following = request.tokens[end + 1: end + 1 + cont_len]
                    tokens[r, i, : len(following)], lengths[r, i] = following, len(following)
                if found:
                    match_len[r] = n
                    break
        return tokens, lengths, match_len

    def _matches(self, own: Incarnation | None, query: list[int], max_matches: int) -> list[tuple[Incarnation, int]]:
        """(request, position of the match's last token): the newest max_walk occurrences still
        whole in the ring, of which those of other live requests with a token after them."""
        oldest = self.appended - self.capacity
        n = len(query)
        occurrences = sorted(
            ((request.numbers[end], request, end) for request in self.incarnations
             for end in range(n - 1, len(request.tokens))
             if request.tokens[end - n + 1: end + 1] == query and request.numbers[end - n + 1] >= oldest),
            key=lambda occurrence: -occurrence[0],
        )[: self.max_walk]
        return [(request, end) for _, request, end in occurrences
                if request.alive and request is not own and end + 1 < len(request.tokens)][:max_matches]


# ------------------------------------------------------------------ helpers


def batch_arrays(contexts: dict[str, list[int]]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """vLLM-like buffers for the requests in ``contexts``, one row each."""
    req_ids = list(contexts)
    token_ids = np.zeros((len(req_ids) + 1, WIDTH), np.int32)  # a spare row, as vLLM has
    num_tokens = np.zeros(len(req_ids) + 1, np.int32)
    for row, req_id in enumerate(req_ids):
        context = contexts[req_id][-WIDTH:]
        token_ids[row, : len(context)], num_tokens[row] = context, len(context)
    return req_ids, token_ids, num_tokens


def all_rows(req_ids: list[str]) -> np.ndarray:
    return np.arange(len(req_ids), dtype=np.int32)


def continuations(index: LiveIndex, contexts: dict[str, list[int]], req_id: str, k: int = 8, cont_len: int = 4):
    """The continuations request ``req_id`` finds (after indexing every context)."""
    req_ids, token_ids, num_tokens = batch_arrays(contexts)
    index.update(req_ids, token_ids, num_tokens)
    row = np.array([req_ids.index(req_id)], np.int32)
    found = index.lookup(req_ids, token_ids, num_tokens, row, k, cont_len)
    return [found.tokens[0, i, : found.lengths[0, i]].tolist() for i in range(k) if found.lengths[0, i]]


# ------------------------------------------------------------------ property test


step_strategy = st.fixed_dictionaries({
    "grow": st.lists(st.integers(0, 3), min_size=6, max_size=6),  # tokens each request gains
    "restart": st.integers(-1, 5),  # a request whose context is replaced (vLLM never does; the index copes)
    "finish": st.lists(st.integers(0, 5), max_size=2),
    "seed": st.integers(0, 2**31),
})


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(8, 80),
    n_range=st.tuples(st.integers(1, 3), st.integers(1, 6)),
    max_walk=st.integers(1, 12),
    max_matches=st.integers(1, 5),
    cont_len=st.integers(1, 5),
    vocabulary=st.integers(2, 4),
    steps=st.lists(step_strategy, min_size=1, max_size=10),
)
def test_lookups_equal_a_brute_force_search(capacity, n_range, max_walk, max_matches, cont_len, vocabulary, steps):
    lengths = live_lengths(min(n_range), max(n_range))
    index = LiveIndex(capacity, lengths, max_walk=max_walk)
    reference = BruteForceLiveIndex(capacity, lengths, max_walk)
    contexts: dict[str, list[int]] = {}
    next_id = 0
    for step in steps:
        rng = np.random.default_rng(step["seed"])
        finished = [req_id for i, req_id in enumerate(list(contexts)) if i in step["finish"]]
        for req_id in finished:
            del contexts[req_id]
        index.remove(finished)
        reference.remove(finished)
        while len(contexts) < 6:  # new requests, some with prompts longer than a quarter of the ring
            contexts[f"r{next_id}"] = rng.integers(0, vocabulary, int(rng.integers(0, 24))).tolist()
            next_id += 1
        for i, req_id in enumerate(list(contexts)):
            contexts[req_id] += rng.integers(0, vocabulary, step["grow"][i]).tolist()
            if i == step["restart"]:
                contexts[req_id] = rng.integers(0, vocabulary, int(rng.integers(0, 8))).tolist()
        order = [str(req_id) for req_id in rng.permutation(list(contexts))]  # rows move between steps
        req_ids, token_ids, num_tokens = batch_arrays({req_id: contexts[req_id] for req_id in order})
        index.update(req_ids, token_ids, num_tokens)
        reference.update(req_ids, token_ids, num_tokens)
        rows = all_rows(req_ids)
        got = index.lookup(req_ids, token_ids, num_tokens, rows, max_matches, cont_len)
        want = reference.lookup(req_ids, token_ids, num_tokens, rows, max_matches, cont_len)
        for name, got_array, want_array in zip(("tokens", "lengths", "match_len"), got.as_given(), want):
            np.testing.assert_array_equal(got_array, want_array, err_msg=name)
    assert index.live_requests == len(contexts)


# ------------------------------------------------------------------ behaviour


def test_a_request_never_retrieves_from_itself():
    index = LiveIndex(1024, live_lengths(1, 8))
    repeating = [1, 2, 3, 4] * 8
    assert continuations(index, {"alone": repeating}, "alone") == []
    contexts = {"alone": repeating, "twin": repeating[:-3]}
    # The twin is three tokens behind: its suffix recurs in "alone", which continues it; and
    # "alone" finds its own suffix only in the twin, newest (the twin's end) first.
    assert continuations(index, contexts, "twin")[:2] == [[2, 3, 4], [2, 3, 4, 1]]
    assert continuations(index, contexts, "alone")[:2] == [[1], [1, 2, 3, 4]]


def test_continuations_come_newest_first_with_the_longest_suffix():
    index = LiveIndex(1024, live_lengths(1, 4))
    contexts = {"old": [5, 6, 7, 1, 2, 3], "new": [9, 6, 7, 4, 4, 4], "asking": [0, 8, 6, 7]}
    assert continuations(index, contexts, "asking") == [[4, 4, 4], [1, 2, 3]]
    contexts["longer"] = [5, 0, 8, 6, 7, 9]
    assert continuations(index, contexts, "asking") == [[9]]  # four tokens matched beat two


def test_the_index_follows_each_step_incrementally():
    index = LiveIndex(1024, live_lengths(1, 16))
    contexts = {"a": [1, 2, 3], "b": [7, 1]}
    continuations(index, contexts, "b")
    contexts["a"] += [4, 5]  # accepted tokens of the next step
    contexts["b"] += [2]
    assert continuations(index, contexts, "b") == [[3, 4, 5]]
    assert index.appended_tokens == 8  # each token appended once


def test_a_long_prompt_keeps_its_end_and_the_ring_evicts_the_oldest_tokens():
    index = LiveIndex(16, live_lengths(1, 2))
    contexts = {"long": list(range(100, 120)), "asking": [117, 118]}
    assert continuations(index, contexts, "asking") == [[119]]
    assert index.live_tokens == index.appended_tokens == 16 // REQUEST_SHARE + 2  # the prompt's end only
    contexts["filler"] = []
    for start in range(200, 216, 4):
        contexts["filler"] += list(range(start, start + 4))
        continuations(index, contexts, "filler")
    assert index.live_tokens == 16 and index.appended_tokens == 22
    assert continuations(index, contexts, "asking") == []  # the oldest tokens left the ring


def test_memory_stays_bounded_over_ten_thousand_requests():
    capacity = 4096
    index = LiveIndex(capacity, live_lengths(1, 16))
    rng = np.random.default_rng(0)
    contexts: dict[str, list[int]] = {}
    sizes = []
    for request in range(10_000):
        contexts[f"req-{request}"] = rng.integers(0, 500, int(rng.integers(1, 40))).tolist()
        for context in contexts.values():
            context += rng.integers(0, 500, 3).tolist()
        index.update(*batch_arrays(contexts))
        if len(contexts) == 8:  # the oldest finishes: eight in flight at most
            finished = next(iter(contexts))
            del contexts[finished]
            index.remove([finished])
        sizes.append(index.memory_bytes())
    assert index.live_requests == len(contexts) == 7
    assert index.appended_tokens > 50 * capacity
    assert max(sizes) - sizes[0] < 4096  # only the few live requests' records ever grow
    assert max(sizes) < capacity * 200  # the ring, fixed at creation: about 150 bytes per token


def test_finished_and_aborted_requests_leave_no_state_mid_step():
    session = SpecSession(tree_mode=False, live_index=LiveIndex(1024, live_lengths(1, 8)))
    prompt = list(range(10, 30))
    contexts = {"a": [*prompt, 1, 2, 3], "b": [*prompt, 1, 2], "c": prompt}
    req_ids, token_ids, num_tokens = batch_arrays(contexts)
    session.begin_step(req_ids)
    session.follow_live_index(token_ids, num_tokens)
    found = session.live_matches(token_ids, num_tokens, all_rows(req_ids), 4, 4)
    assert found.lengths[2].tolist() == [2, 3, 0, 0]  # "c" drafts from "b", then "a"
    session.release(["b", "never-seen"])  # "b" finished (or was aborted) before the next step
    index = session.live_index
    assert index.live_requests == 2 and index.live_tokens == len(contexts["a"]) + len(contexts["c"])
    del contexts["b"]
    req_ids, token_ids, num_tokens = batch_arrays(contexts)
    session.begin_step(req_ids)
    session.follow_live_index(token_ids, num_tokens)
    found = session.live_matches(token_ids, num_tokens, all_rows(req_ids), 4, 4)
    assert found.lengths[1].tolist() == [3, 0, 0, 0] and found.tokens[1, 0, :3].tolist() == [1, 2, 3]
    session.release(req_ids)
    assert index.live_requests == 0 and index.live_tokens == 0
    req_ids, token_ids, num_tokens = batch_arrays({"d": prompt})
    assert index.lookup(req_ids, token_ids, num_tokens, all_rows(req_ids), 4, 4).match_len.tolist() == [0]


def test_a_session_without_a_live_index_finds_nothing():
    assert SpecSession(tree_mode=False).live_matches(np.zeros((1, 4), np.int32), np.ones(1, np.int32),
                                                     np.zeros(1, np.int32), 4, 4) is None


def test_live_lengths_halve_from_n_max_to_n_min():
    assert live_lengths(1, 16) == (16, 8, 4, 2, 1)
    assert live_lengths(2, 12) == (12, 6, 3, 2)
    assert live_lengths(5, 5) == (5,)
    with pytest.raises(ValueError, match="n_min <= n_max"):
        live_lengths(4, 2)


@pytest.mark.parametrize(("arguments", "message"), [
    ((1, (2, 1)), "capacity must be in"),
    ((64, (1, 2)), "must decrease strictly"),
    ((64, (65,)), "must decrease strictly"),
    ((64, ()), "1 to 8 n-gram lengths"),
])
def test_bad_parameters_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        LiveIndex(*arguments)


def test_bad_inputs_are_refused_with_the_argument_named():
    index = LiveIndex(64, live_lengths(1, 4))
    req_ids, token_ids, num_tokens = batch_arrays({"a": [1, 2, 3]})
    rows = all_rows(req_ids)
    with pytest.raises(IndexError, match=rf"num_tokens\[0\] = 999 is outside \[0, {WIDTH}\]"):
        index.update(req_ids, token_ids, np.array([999, 0], np.int32))
    with pytest.raises(ValueError, match="req_ids has 3 entries but token_ids only 2 rows"):
        index.update(["a", "b", "c"], token_ids, num_tokens)
    with pytest.raises(ValueError, match="token -4 at position 1 is negative"):
        index.update(req_ids, np.where(token_ids == 2, -4, token_ids), num_tokens)
    with pytest.raises(IndexError, match=r"rows\[0\] = 1 has no entry in req_ids"):
        index.lookup(req_ids, token_ids, num_tokens, np.array([1], np.int32), 4, 4)
    with pytest.raises(ValueError, match=r"max_matches must be in \[1, "):
        index.lookup(req_ids, token_ids, num_tokens, rows, 0, 4)
    with pytest.raises(ValueError, match=r"cont_len must be in \[1, "):
        index.lookup(req_ids, token_ids, num_tokens, rows, 4, 0)


def test_live_index_options_are_validated():
    options = RetrievalSpecOptions.from_dict({"use_live_index": False, "live_index_tokens": 4096,
                                              "live_max_matches": 8})
    assert (options.use_live_index, options.live_index_tokens, options.live_max_matches) == (False, 4096, 8)
    with pytest.raises(OptionsError, match=r"retrieval_spec\.live_index_tokens must be an integer in \[1024, "):
        RetrievalSpecOptions.from_dict({"live_index_tokens": 10})
    with pytest.raises(OptionsError, match=r"retrieval_spec\.use_live_index must be true or false"):
        RetrievalSpecOptions.from_dict({"use_live_index": "yes"})


# ------------------------------------------------------------------ in the engine


def staggered_generation(llm, prompt: str) -> dict[str, tuple[list[int], int]]:
    """Greedy output ids and decode steps of two requests of one prompt, the second started
    once the first has LEAD_TOKENS tokens (an agent's fan-out, or ``n > 1`` arriving apart)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    outputs: dict[str, list[int]] = {"first": [], "second": []}
    steps = dict.fromkeys(outputs, 0)
    unfinished = set(outputs)
    waiting = True  # the second request is not added yet

    def add(request_id: str, max_tokens: int) -> None:
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                              output_kind=RequestOutputKind.DELTA))

    add("first", FIRST_TOKENS)
    while unfinished:
        if waiting and len(outputs["first"]) >= LEAD_TOKENS:
            add("second", SECOND_TOKENS)
            waiting = False
            steps["second"] = -1  # its prefill step gives its first token, not a decode step
        for output in engine.step():
            new_tokens = list(output.outputs[0].token_ids)
            outputs[output.request_id] += new_tokens
            steps[output.request_id] += bool(new_tokens)
            if output.finished:
                unfinished.discard(output.request_id)
    engine.step()  # the runner hears of the last finished request
    return {request_id: (outputs[request_id], steps[request_id]) for request_id in outputs}


@pytest.mark.engine
def test_two_requests_of_one_prompt_draft_from_each_other_exactly(model_dir, e2e_prompts):
    prompt = e2e_prompts[0]

    def rest(live: bool) -> EngineSpec:
        options = {"use_datastore": False, "use_output_index": False, "budget": "fixed", "use_live_index": live}
        return EngineSpec(model_dir, speculative_config={"model": "vllm_retrieval_spec.RestProposer",
                                                         "num_speculative_tokens": 8},
                          additional_config={"retrieval_spec": options}, max_num_seqs=2)

    runs, drafters = {}, {}
    for name, spec in (("none", EngineSpec(model_dir, max_num_seqs=2)), ("off", rest(False)), ("on", rest(True))):
        with running_engine(spec) as llm:
            runs[name] = staggered_generation(llm, prompt)
            drafters[name] = drafter_of(llm)
    for name in ("off", "on"):
        for request_id, (output_ids, _) in runs[name].items():
            assert output_ids == runs["none"][request_id][0], f"{name}: {request_id} differs from no speculation"
        assert drafters[name].stats.failures == 0
    assert drafters["off"].session.live_index is None
    live_drafts = sum(count for label, count in drafters["on"].stats.draft_tokens_by_source.items()
                      if SOURCE_LIVE_LABEL in label.split("+"))
    assert live_drafts > 0, drafters["on"].stats.draft_tokens_by_source
    assert runs["on"]["second"][1] < runs["off"]["second"][1], "the second request did not draft from the first"
    index = drafters["on"].session.live_index
    assert index.live_requests == 0 and index.live_tokens == 0, "finished requests left state behind"
