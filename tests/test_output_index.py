"""The cross-request output index: eviction, bounded memory, background rebuilds, and
searches against a brute-force scan (the REST kernel's property test covers the merge)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_retrieval_spec.datastores.output_index import BYTES_PER_INDEXED_TOKEN, SEPARATOR, OutputIndex
from vllm_retrieval_spec.kernels.rest import RestParams, rest_retrieve
from vllm_retrieval_spec.kernels.rest_reference import rest_retrieve_reference


def test_memory_stays_under_its_bound_over_ten_thousand_requests():
    capacity = 20_000
    index = OutputIndex(capacity, background=False)
    rng = np.random.default_rng(0)
    peak = 0
    for _ in range(10_000):
        index.add(rng.integers(0, 50_000, size=int(rng.integers(1, 300))))
        peak = max(peak, index.memory_bytes())
    assert index.stats.sequences_added == 10_000 and index.stats.sequences_evicted > 9_000
    assert index.stats.indexed_tokens <= capacity
    assert peak <= capacity * (BYTES_PER_INDEXED_TOKEN + 4)
    # Rebuilds are amortised: each one waits for a tenth of the index to be new.
    assert index.stats.builds < 10_000 / 5


def test_the_newest_requests_are_kept_and_a_long_one_keeps_its_end():
    index = OutputIndex(16, background=False)
    index.add(np.arange(5))
    index.add(np.arange(100, 108))
    index.add(np.arange(200, 240))  # longer than the capacity
    assert index.tokens.tolist() == [*range(225, 240), SEPARATOR]


def test_background_builds_become_searchable():
    index = OutputIndex(1_000_000)
    assert index.native is None
    for start in range(0, 5_000, 50):
        index.add(np.arange(start, start + 50) % 997)
    index.wait()
    index.add(np.array([7, 8, 9]))  # pending tokens trigger the next build
    index.wait()
    assert index.stats.builds >= 2 and index.native is not None
    tokens = np.array([[1, 2, 3, 4, 5]], np.int32)
    params = RestParams(n_min=1, n_max=4, use_datastore=False, use_context=False, top_k=8, chain_len=4,
                        min_ratio=0.0)
    # use_context and use_datastore both false is allowed for the kernel: the output index alone.
    got = rest_retrieve(None, tokens, np.array([5], np.int32), np.array([0], np.int32), params,
                        output_index=index.native)
    (expected,) = rest_retrieve_reference(None, 0, [[1, 2, 3, 4, 5]], params, index.tokens, int(SEPARATOR))
    assert got.chain(0) == expected["chain"] == [6, 7, 8, 9]
    assert got.match_info[0].tolist() == expected["match_info"]


def test_capacity_must_hold_a_token():
    with pytest.raises(ValueError, match="capacity of at least 2 tokens"):
        OutputIndex(1)
