"""Step attention: the plugin's kernel computes causal decode and verification steps exactly as
vLLM's CPU attention does, on caches vLLM's own kernel wrote, and steps outside its range go
back to vLLM's kernel. The engine-level identity (token ids with and without speculation)
runs with it on in test_e2e_engine.py (a tree and a chain engine)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_retrieval_spec.compat import configure_vllm_environment
from vllm_retrieval_spec.kernels.attention import KVLayout, LayerAttention
from vllm_retrieval_spec.verification.step_attention import MAX_QUERY_TOKENS, StepAttention, chain_nodes
from vllm_retrieval_spec.verification.tree_attention import TreeLayer

configure_vllm_environment()
ops = pytest.importorskip("vllm._custom_ops")

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 6, 2, 64, 32  # the "vec" ISA: block_size a multiple of 32


def causal_step(rng: np.random.Generator, query_lens: list[int], contexts: list[int], window: int = 0):
    """A cache holding every request's context and step tokens, written by vLLM's own
    reshape-and-cache, the step's metadata, a query and vLLM's attention output."""
    seq_lens = np.array(contexts) + np.array(query_lens)
    width = int(seq_lens.max() + BLOCK_SIZE - 1) // BLOCK_SIZE
    blocks = rng.permutation(len(query_lens) * width + 3)[: len(query_lens) * width].reshape(-1, width)
    cache = torch.zeros(blocks.max() + 1, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    key_cache, value_cache = cache.view(cache.shape[0], KV_HEADS, 2 * BLOCK_SIZE, HEAD_SIZE).chunk(2, dim=2)
    slots = np.concatenate([blocks[r, np.arange(n) // BLOCK_SIZE] * BLOCK_SIZE + np.arange(n) % BLOCK_SIZE
                            for r, n in enumerate(seq_lens)])
    keys, values = (torch.from_numpy(rng.standard_normal((len(slots), KV_HEADS, HEAD_SIZE), dtype=np.float32))
                    for _ in range(2))
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, torch.from_numpy(slots), "vec")
    ends = np.cumsum(seq_lens)
    step_rows = np.concatenate([np.arange(end - q, end) for end, q in zip(ends, query_lens, strict=True)])
    query_start_loc = torch.from_numpy(np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32))
    metadata = SimpleNamespace(
        num_actual_tokens=int(query_start_loc[-1]), causal=True,
        dynamic_causal=None, query_start_loc=query_start_loc,
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)), block_table=torch.from_numpy(blocks.astype(np.int32)),
        slot_mapping=torch.from_numpy(slots[step_rows]))
    query = torch.from_numpy(rng.standard_normal((metadata.num_actual_tokens, HEADS, HEAD_SIZE), dtype=np.float32))
    expected = torch.empty_like(query)
    scheduler = ops.cpu_attn_get_scheduler_metadata(len(query_lens), HEADS, KV_HEADS, HEAD_SIZE, metadata.seq_lens,
                                                    torch.float32, query_start_loc, True, window or -1, "vec", True)
    ops.cpu_attention_with_kv_cache(query, key_cache, value_cache, expected, query_start_loc, metadata.seq_lens,
                                    HEAD_SIZE ** -0.5, True, None, window or -1, metadata.block_table, 0.0,
                                    scheduler, None)
    rows = torch.from_numpy(step_rows)
    return cache, metadata, query, keys[rows], values[rows], expected


def layer(window: int = 0) -> TreeLayer:
    return TreeLayer(LayerAttention(HEADS, HEAD_SIZE ** -0.5, window=window), KVLayout.CPU_VEC)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [0, 48])
def test_step_attention_equals_vllms_cpu_attention(seed, window):
    rng = np.random.default_rng(seed)
    requests = int(rng.integers(1, 9))
    query_lens = [int(q) for q in rng.integers(2, 34, requests)]
    contexts = [int(c) for c in rng.integers(1, 300, requests)]
    cache, metadata, query, keys, values, expected = causal_step(rng, query_lens, contexts, window)
    output = torch.full_like(query, float("nan"))
    vllm_layer = SimpleNamespace(isa="vec")
    assert StepAttention().forward(vllm_layer, layer(window), query, keys, values, cache, metadata, output)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_chain_nodes_are_each_requests_tokens_in_order():
    nodes = chain_nodes(np.array([0, 3, 4], dtype=np.int32), np.array([10, 6], dtype=np.int32),
                        np.zeros((2, 1), dtype=np.int32))
    assert nodes.request.tolist() == [0, 0, 0, 1]
    assert nodes.index.tolist() == [0, 1, 2, 0]
    assert nodes.context.tolist() == [7, 7, 7, 5]
    assert nodes.ancestors[:, 0].tolist() == [0b1, 0b11, 0b111, 0b1]


def test_prefills_and_long_steps_are_left_to_vllm():
    table = np.zeros((1, 4), dtype=np.int32)
    assert chain_nodes(np.array([0, 5], dtype=np.int32), np.array([5], dtype=np.int32), table) is None
    long = MAX_QUERY_TOKENS + 1
    assert chain_nodes(np.array([0, long], dtype=np.int32), np.array([long + 9], dtype=np.int32), table) is None
    last = chain_nodes(np.array([0, MAX_QUERY_TOKENS], dtype=np.int32), np.array([MAX_QUERY_TOKENS + 1], np.int32),
                       table).ancestors[-1, 0]
    assert last == np.uint64(2**64 - 1)


def test_one_token_decode_steps_keep_vllms_kernel():
    rng = np.random.default_rng(0)
    cache, metadata, query, keys, values, _ = causal_step(rng, [1, 1, 2], [40, 50, 60])
    output = torch.zeros_like(query)
    assert not StepAttention().forward(SimpleNamespace(isa="vec"), layer(), query, keys, values, cache, metadata,
                                       output)
    assert not output.any()


def test_a_cache_in_another_layout_turns_step_attention_off(caplog):
    rng = np.random.default_rng(1)
    cache, metadata, query, keys, values, _ = causal_step(rng, [3, 4], [40, 50])
    step_attention = StepAttention()
    wrong_keys = keys + 1.0
    output = torch.zeros_like(query)
    assert not step_attention.forward(SimpleNamespace(isa="vec"), layer(), query, wrong_keys, values, cache,
                                      metadata, output)
    assert not step_attention.enabled and not output.any()
    assert "vLLM's attention computes every step" in caplog.text
