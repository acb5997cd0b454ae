"""A greedy step of chains verified with one argmax (``verification/sampler.py``) emits exactly
what vLLM's rejection sampler emits, and only steps that nothing else touches take that path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from vllm_retrieval_spec.verification.sampler import greedy_chain_step, greedy_without_processing

VOCAB = 64


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    """vLLM's C++ stand-ins for its Triton kernels, as its CPU worker registers them."""
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()


def spec_metadata(drafts: list[list[int]]) -> SpecDecodeMetadata:
    """vLLM's metadata of a step drafting ``drafts``: each request's draft rows, then its bonus row."""
    num = [len(d) for d in drafts]
    sampled = np.cumsum([n + 1 for n in num], dtype=np.int32)
    starts = sampled - np.asarray(num, np.int32) - 1
    target = np.concatenate([start + np.arange(n) for start, n in zip(starts, num)]).astype(np.int32)
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor([t for d in drafts for t in d], dtype=torch.int32), num_draft_tokens=num,
        cu_num_draft_tokens=torch.from_numpy(np.cumsum(num, dtype=np.int32)),
        cu_num_sampled_tokens=torch.from_numpy(sampled), target_logits_indices=torch.from_numpy(target),
        bonus_logits_indices=torch.from_numpy((starts + num).astype(np.int32)),
        logits_indices=torch.arange(int(sampled[-1]), dtype=torch.int32))


def greedy_metadata(requests: int, processors: list | None = None, **fields) -> SamplingMetadata:
    values = dict(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(requests), presence_penalties=torch.zeros(requests),
        repetition_penalties=torch.ones(requests), output_token_ids=[[] for _ in range(requests)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(processors))
    return SamplingMetadata(**{**values, **fields})


@st.composite
def steps(draw) -> tuple[list[list[int]], torch.Tensor]:
    """Drafts of 1-6 requests (0-9 tokens each, some -1 placeholders) and logits whose argmax
    often agrees with them (ties included: small integer logits)."""
    drafts = draw(st.lists(st.lists(st.integers(-1, VOCAB - 1), max_size=9), min_size=1, max_size=6))
    if not any(drafts):
        drafts[0].append(draw(st.integers(0, VOCAB - 1)))
    rows = sum(len(d) + 1 for d in drafts)
    seed = draw(st.integers(0, 2**32 - 1))
    logits = torch.from_numpy(np.random.default_rng(seed).integers(0, 4, (rows, VOCAB)).astype(np.float32))
    row = 0
    for draft in drafts:  # make most drafted tokens the argmax of their row
        for token in draft:
            if token >= 0 and draw(st.booleans()):
                logits[row, token] = 10.0
            row += 1
        row += 1
    return drafts, logits


@settings(max_examples=300, deadline=None)
@given(steps())
def test_one_argmax_emits_what_vllms_rejection_sampler_emits(step):
    drafts, logits = step
    metadata = spec_metadata(drafts)
    sampling = greedy_metadata(len(drafts))
    expected = RejectionSampler(Sampler(logprobs_mode="raw_logprobs"))(metadata, None, logits.clone(), sampling)
    got = greedy_chain_step(metadata, logits)
    assert got.dtype == torch.int32
    assert torch.equal(got, expected.sampled_token_ids)


@pytest.mark.parametrize("fields, processor, fast", [
    ({}, None, True),
    ({"max_num_logprobs": 0}, None, False),
    ({"logprob_token_ids": {0: [3]}}, None, False),
    ({"no_penalties": False}, None, False),
    ({"bad_words_token_ids": {0: [[5]]}}, None, False),
    ({"allowed_token_ids_mask": torch.zeros(2, VOCAB, dtype=torch.bool)}, None, False),
    ({"all_greedy": False, "temperature": torch.tensor([0.0, 0.7])}, None, False),
    ({}, "logit_bias_idle", True),
    ({}, "logit_bias", False),
    ({}, "min_tokens", False),
    ({}, "unknown", False),
])
def test_only_greedy_steps_that_nothing_processes_take_one_argmax(fields, processor, fast):
    processors = []
    if processor is not None and processor.startswith("logit_bias"):
        bias = LogitBiasLogitsProcessor.__new__(LogitBiasLogitsProcessor)
        bias.biases = {} if processor == "logit_bias_idle" else {0: {3: 1.0}}
        processors.append(bias)
    elif processor == "min_tokens":
        min_tokens = MinTokensLogitsProcessor.__new__(MinTokensLogitsProcessor)
        min_tokens.min_toks = {0: (4, [], {2}, False)}
        processors.append(min_tokens)
    elif processor == "unknown":
        class Custom:
            def is_argmax_invariant(self) -> bool:
                return False

        processors.append(Custom())
    assert greedy_without_processing(greedy_metadata(2, processors, **fields)) is fast
