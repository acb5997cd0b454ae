"""Step attention: the plugin's kernel computes causal steps (decodes, verification steps, short
prefills) as vLLM's CPU attention does, on caches vLLM's own kernel wrote, a token's result bit
for bit the same whatever its step brought; requests of long prefills go to vLLM's kernel. The
engine-level identity (token ids with and without speculation) runs with it on in
test_e2e_engine.py (a tree and a chain engine) and in test_seeded_sampling.py."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_retrieval_spec.compat import configure_vllm_environment
from vllm_retrieval_spec.kernels.attention import KVLayout, LayerAttention, NewKV, TreeNodes, kv_views, tree_attention
from vllm_retrieval_spec.kernels.attention_reference import write_kv_reference
from vllm_retrieval_spec.verification.step_attention import MAX_QUERY_TOKENS, StepAttention, chain_nodes
from vllm_retrieval_spec.verification.tree_attention import TreeLayer, apply_tree_attention

configure_vllm_environment()
ops = pytest.importorskip("vllm._custom_ops")

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 6, 2, 64, 32  # the "vec" ISA: block_size a multiple of 32


def step_metadata(query_lens: list[int], seq_lens: np.ndarray, blocks: np.ndarray, slots: np.ndarray):
    """The attention metadata of a causal step: each request's last ``query_lens`` tokens of
    ``seq_lens``, at cache ``slots`` (every token's, in order)."""
    ends = np.cumsum(seq_lens)
    step_rows = np.concatenate([np.arange(end - q, end) for end, q in zip(ends, query_lens, strict=True)])
    query_start_loc = torch.from_numpy(np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32))
    return SimpleNamespace(
        num_actual_tokens=int(query_start_loc[-1]), causal=True, dynamic_causal=None,
        query_start_loc=query_start_loc, seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        block_table=torch.from_numpy(blocks.astype(np.int32)), slot_mapping=torch.from_numpy(slots[step_rows]),
        step_rows=step_rows)


def causal_step(rng: np.random.Generator, query_lens: list[int], contexts: list[int], window: int = 0):
    """A cache holding every request's context and step tokens, written by vLLM's own
    reshape-and-cache, the step's metadata, a query, the step tokens' keys and values, the
    tokens' keys and values, and vLLM's attention as a function writing into an output."""
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
    metadata = step_metadata(query_lens, seq_lens, blocks, slots)
    query = torch.from_numpy(rng.standard_normal((metadata.num_actual_tokens, HEADS, HEAD_SIZE), dtype=np.float32))
    scheduler = ops.cpu_attn_get_scheduler_metadata(len(query_lens), HEADS, KV_HEADS, HEAD_SIZE, metadata.seq_lens,
                                                    torch.float32, metadata.query_start_loc, True, window or -1,
                                                    "vec", True)

    def vllm_attention(output: torch.Tensor) -> torch.Tensor:
        ops.cpu_attention_with_kv_cache(query, key_cache, value_cache, output, metadata.query_start_loc,
                                        metadata.seq_lens, HEAD_SIZE ** -0.5, True, None, window or -1,
                                        metadata.block_table, 0.0, scheduler, None)
        return output

    rows = torch.from_numpy(metadata.step_rows)
    return cache, metadata, query, keys[rows], values[rows], vllm_attention


def layer(window: int = 0) -> TreeLayer:
    return TreeLayer(LayerAttention(HEADS, HEAD_SIZE ** -0.5, window=window), KVLayout.CPU_VEC)


VLLM_LAYER = SimpleNamespace(isa="vec")


def run_step(step_attention: StepAttention, step, window: int = 0) -> tuple[torch.Tensor, int]:
    """The step's attention through ``step_attention`` and how many times vLLM's kernel ran."""
    cache, metadata, query, keys, values, vllm_attention = step
    output = torch.full_like(query, float("nan"))
    vllm_calls = []

    def count_vllm() -> torch.Tensor:
        vllm_calls.append(1)
        return vllm_attention(output)

    assert step_attention.forward(VLLM_LAYER, layer(window), query, keys, values, cache, metadata, output,
                                  count_vllm) is output
    return output, len(vllm_calls)


def step_output(step, window: int = 0) -> torch.Tensor:
    """The step's attention through a fresh :class:`StepAttention`."""
    return run_step(StepAttention(), step, window)[0]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [0, 48])
def test_step_attention_equals_vllms_cpu_attention(seed, window):
    rng = np.random.default_rng(seed)
    requests = int(rng.integers(1, 9))
    query_lens = [int(q) for q in rng.integers(1, 34, requests)]
    contexts = [int(c) for c in rng.integers(0, 300, requests)]
    if seed % 2:
        contexts[0] = 0  # a short prefill
    long_prefill = seed % 3 == 0
    if long_prefill:  # vLLM's kernel computes its rows
        query_lens.append(MAX_QUERY_TOKENS + 6)
        contexts.append(0)
    step = causal_step(rng, query_lens, contexts, window)
    output, vllm_calls = run_step(StepAttention(), step, window)
    torch.testing.assert_close(output, step[-1](torch.empty_like(output)), rtol=1e-5, atol=1e-5)
    assert vllm_calls == int(long_prefill)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("window", [0, 48])
def test_a_tokens_attention_does_not_depend_on_what_its_step_brought(seed, window):
    """Token j of a step of q tokens, the same token as a one-token decode step, and as the
    first of a step bringing it and a different number of tokens after it: bit for bit equal."""
    rng = np.random.default_rng(seed)
    context, tokens = (0 if seed == 0 else int(rng.integers(1, 200))), int(rng.integers(2, 40))
    cache, metadata, query, keys, values, _ = step = causal_step(rng, [tokens], [context], window)
    output, _ = run_step(StepAttention(), step, window)
    slots = np.concatenate([np.zeros(context, np.int64), metadata.slot_mapping.numpy()])
    blocks = metadata.block_table.numpy()
    for j in range(tokens):
        for brought in {1, int(rng.integers(1, tokens - j + 1))}:
            shorter = step_metadata([brought], np.array([context + j + brought]), blocks, slots)
            rows = slice(j, j + brought)
            alone = torch.full_like(query[rows], float("nan"))
            assert StepAttention().forward(VLLM_LAYER, layer(window), query[rows], keys[rows], values[rows], cache,
                                           shorter, alone, pytest.fail) is alone
            assert torch.equal(alone[0], output[j])


@pytest.mark.parametrize("window", [0, 48])
def test_avx512_path_gives_the_avx2_paths_steps_bit_for_bit(window, both_lane_widths):
    """Causal steps of 1-33 tokens a request over 0-300 tokens of context, blocks of 32 keys."""
    rng = np.random.default_rng(window)
    for _ in range(4):
        requests = int(rng.integers(1, 6))
        step = causal_step(rng, [int(q) for q in rng.integers(1, 34, requests)],
                           [int(c) for c in rng.integers(0, 300, requests)], window)
        assert torch.equal(*both_lane_widths(partial(step_output, step, window)))


def fix_up_nodes(metadata, request: int, rows: list[int], parents: list[int]) -> TreeNodes:
    """The tree fix-up's nodes (:func:`~vllm_retrieval_spec.verification.tree_attention.tree_nodes`)
    for draft ``rows`` of ``request``'s tree whose draft nodes have ``parents`` (-1: the root):
    the root counted in the context, draft nodes indexed from 0, ancestor-or-self bits."""
    ancestors = []
    for node, parent in enumerate(parents):
        ancestors.append((1 << node) | (0 if parent < 0 else ancestors[parent]))
    start = int(metadata.query_start_loc[request])
    context = int(metadata.seq_lens[request]) - (int(metadata.query_start_loc[request + 1]) - start) + 1
    index = [row - start - 1 for row in rows]
    return TreeNodes(torch.tensor(rows, dtype=torch.int64), metadata.block_table.to(torch.int32),
                     torch.full((len(rows),), request, dtype=torch.int32),
                     torch.full((len(rows),), context, dtype=torch.int32), torch.tensor(index, dtype=torch.int32),
                     torch.tensor([[ancestors[i]] for i in index], dtype=torch.uint64))


@pytest.mark.parametrize("window", [0, 20])
def test_a_tree_step_computes_the_tree_rows_in_the_same_call(window):
    """Request 0 brings a root and a tree of 5 draft nodes whose leading chain is nodes 0-1:
    one call computes the other rows as the tree fix-up would, bit for bit, and the leading
    chain's rows as a causal step computes them, bit for bit."""
    step = causal_step(np.random.default_rng(2), [6, 3], [40, 50], window)
    tree = fix_up_nodes(step[1], 0, [3, 4, 5], [-1, 0, -1, 2, 0])
    step_attention = StepAttention(lambda metadata: tree)
    output, vllm_calls = run_step(step_attention, step, window)
    assert vllm_calls == 0 and step_attention.take_computed_tree_rows() and step_attention.tree_layer_calls == 1
    assert not step_attention.take_computed_tree_rows()  # taken
    cache, _, query, *_ = step
    fixed_up = torch.full_like(query, float("nan"))
    apply_tree_attention(query, cache, fixed_up, tree, layer(window))
    assert torch.equal(output[3:6], fixed_up[3:6])
    chain, _ = run_step(StepAttention(), step, window)
    assert torch.equal(output[[0, 1, 2, 6, 7, 8]], chain[[0, 1, 2, 6, 7, 8]])


def test_the_tree_rows_of_a_request_the_kernel_does_not_serve_are_left_to_the_fix_up():
    long = MAX_QUERY_TOKENS + 2
    step = causal_step(np.random.default_rng(4), [3, long], [40, 10])
    tree = fix_up_nodes(step[1], 1, [3 + 5], [-1] * 5)  # a draft row of the long request
    step_attention = StepAttention(lambda metadata: tree)
    output, vllm_calls = run_step(step_attention, step)
    assert vllm_calls == 1 and not step_attention.take_computed_tree_rows()
    assert output[:3].isfinite().all()


def test_chain_nodes_are_each_requests_tokens_in_order():
    step = chain_nodes(np.array([0, 3, 4], dtype=np.int32), np.array([10, 6], dtype=np.int32),
                       np.zeros((2, 1), dtype=np.int32))
    assert step.whole_step
    assert step.nodes.rows.tolist() == [0, 1, 2, 3]
    assert step.nodes.request.tolist() == [0, 0, 0, 1]
    assert step.nodes.index.tolist() == [0, 1, 2, 0]
    assert step.nodes.context.tolist() == [7, 7, 7, 5]
    assert step.nodes.ancestors[:, 0].tolist() == [0b1, 0b11, 0b111, 0b1]


def test_long_prefills_are_left_to_vllm_and_short_ones_are_not():
    table = np.zeros((2, 4), dtype=np.int32)
    assert chain_nodes(np.array([0, 5], dtype=np.int32), np.array([5], dtype=np.int32), table).whole_step
    long = MAX_QUERY_TOKENS + 1
    assert chain_nodes(np.array([0, long], dtype=np.int32), np.array([long + 9], dtype=np.int32), table) is None
    mixed = chain_nodes(np.array([0, 2, 2 + long], dtype=np.int32), np.array([30, long], np.int32), table)
    assert not mixed.whole_step
    assert mixed.nodes.rows.tolist() == [0, 1] and mixed.nodes.context.tolist() == [28, 28]
    last = chain_nodes(np.array([0, MAX_QUERY_TOKENS], dtype=np.int32), np.array([MAX_QUERY_TOKENS + 1], np.int32),
                       table).nodes.ancestors[-1, 0]
    assert last == np.uint64(2**64 - 1)


def test_a_cache_in_another_layout_turns_step_attention_off(caplog):
    rng = np.random.default_rng(1)
    cache, metadata, query, keys, values, _ = causal_step(rng, [3, 4], [40, 50])
    step_attention = StepAttention()
    output = torch.zeros_like(query)
    assert step_attention.forward(VLLM_LAYER, layer(), query, keys + 1.0, values, cache, metadata, output,
                                  lambda: "vllm") == "vllm"
    assert not step_attention.enabled and not output.any()
    assert "vLLM's attention computes every step" in caplog.text


def test_a_step_the_kernel_refuses_goes_to_vllm_and_turns_it_off(caplog):
    cache, metadata, query, keys, values, _ = causal_step(np.random.default_rng(3), [3, 4], [40, 50])
    metadata.block_table = metadata.block_table[:, :1]  # too narrow for the requests' positions
    output = torch.full_like(query, float("nan"))
    step_attention = StepAttention()
    assert step_attention.forward(VLLM_LAYER, layer(), query, keys, values, cache, metadata, output,
                                  lambda: "vllm") == "vllm"
    assert not step_attention.enabled and output.isnan().all()
    assert "past the block table" in caplog.text


def without_step_tokens(cache: torch.Tensor, metadata) -> torch.Tensor:
    """A copy of ``cache`` whose step tokens' keys and values are zero (as before the step)."""
    cleared = cache.clone()
    keys, values = kv_views(cleared, HEAD_SIZE, KVLayout.CPU_VEC)
    slots = metadata.slot_mapping.long()
    keys[slots // BLOCK_SIZE, :, slots % BLOCK_SIZE] = 0.0
    values[slots // BLOCK_SIZE, :, slots % BLOCK_SIZE] = 0.0
    return cleared


def fused_rows(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys`` and ``values`` ``[tokens, kv_heads * head_size]`` as strided views of one fused
    tensor, as vLLM's layers hand them over."""
    fused = torch.cat([keys.flatten(1), values.flatten(1)], dim=1)
    return fused[:, : KV_HEADS * HEAD_SIZE], fused[:, KV_HEADS * HEAD_SIZE:]


@pytest.mark.parametrize("seed", range(4))
def test_the_kernel_stores_a_steps_keys_and_values_as_vllms_reshape_and_cache(seed):
    rng = np.random.default_rng(seed)
    cache, metadata, query, keys, values, _ = causal_step(rng, [int(q) for q in rng.integers(1, 9, 3)], [5, 40, 77])
    step = StepAttention().nodes_for(metadata)
    slots = metadata.slot_mapping.long().clone()
    slots[0] = -1  # a padding slot: not stored
    expected = without_step_tokens(cache, metadata)
    write_kv_reference(expected, NewKV(*fused_rows(keys, values), slots), HEAD_SIZE, KVLayout.CPU_VEC)
    stored = without_step_tokens(cache, metadata)
    output = torch.zeros(query.shape[0], HEADS * HEAD_SIZE)
    tree_attention(query.flatten(1), stored, output, step.nodes, KVLayout.CPU_VEC, layer().attention,
                   new_kv=NewKV(*fused_rows(keys, values), slots))
    assert torch.equal(stored, expected)
    slots[0] = metadata.slot_mapping[0]
    write_kv_reference(expected, NewKV(*fused_rows(keys, values), slots), HEAD_SIZE, KVLayout.CPU_VEC)
    assert torch.equal(expected, cache), "the reference stores what vLLM's reshape-and-cache stored"


def test_a_slot_past_the_cache_stores_nothing():
    cache, metadata, query, keys, values, _ = causal_step(np.random.default_rng(5), [3, 2], [10, 20])
    step = StepAttention().nodes_for(metadata)
    before = without_step_tokens(cache, metadata)
    stored = before.clone()
    slots = metadata.slot_mapping.long().clone()
    slots[-1] = cache.shape[0] * BLOCK_SIZE
    with pytest.raises(IndexError, match="past the cache"):
        tree_attention(query.flatten(1), stored, torch.zeros(query.shape[0], HEADS * HEAD_SIZE), step.nodes,
                       KVLayout.CPU_VEC, layer().attention, new_kv=NewKV(*fused_rows(keys, values), slots))
    assert torch.equal(stored, before)
    with pytest.raises(ValueError, match="new_keys and new_values"):
        tree_attention(query.flatten(1), stored, torch.zeros(query.shape[0], HEADS * HEAD_SIZE), step.nodes,
                       KVLayout.CPU_VEC, layer().attention, new_kv=NewKV(keys.flatten(1)[:, 1:], values.flatten(1),
                                                                        metadata.slot_mapping.long()))


class WholeLayer:
    """An ``Attention`` layer's forward through :meth:`StepAttention.layer_forward` on a step
    whose forward context holds ``metadata`` and whose cache does not yet hold the step's keys."""

    def __init__(self, monkeypatch, step_attention: StepAttention, step) -> None:
        cache, metadata, query, keys, values, vllm_attention = step
        self.step_attention, self.metadata, self.expected_cache = step_attention, metadata, cache
        self.layer = SimpleNamespace(layer_name="layers.0.attn", kv_cache=without_step_tokens(cache, metadata))
        self.query, (self.keys, self.values) = query.flatten(1), fused_rows(keys, values)
        self.vllm_output = vllm_attention(torch.empty_like(query)).flatten(1)
        context = SimpleNamespace(attn_metadata={"layers.0.attn": metadata},
                                  slot_mapping={"layers.0.attn": metadata.slot_mapping.long()})
        monkeypatch.setattr("vllm.forward_context.get_forward_context", lambda: context)
        self.vllm_calls = 0

    def forward(self) -> torch.Tensor | str:
        def vllm_forward() -> str:
            self.vllm_calls += 1
            return "vllm"

        return self.step_attention.layer_forward(self.layer, layer(), self.query, self.keys, self.values,
                                                 vllm_forward)


def checked_step_attention(seed: int) -> StepAttention:
    """A :class:`StepAttention` past its first step's layout check."""
    step_attention = StepAttention()
    run_step(step_attention, causal_step(np.random.default_rng(seed), [2], [30]))
    return step_attention


@pytest.mark.parametrize("seed", range(4))
def test_a_whole_layer_stores_its_keys_and_attends_in_one_call(monkeypatch, seed):
    rng = np.random.default_rng(seed)
    step = causal_step(rng, [int(q) for q in rng.integers(1, 12, 4)], [int(c) for c in rng.integers(0, 200, 4)])
    whole = WholeLayer(monkeypatch, checked_step_attention(seed), step)
    output = whole.forward()
    assert whole.vllm_calls == 0 and whole.step_attention.whole_layer_calls == 1
    assert torch.equal(whole.layer.kv_cache, whole.expected_cache)
    torch.testing.assert_close(output, whole.vllm_output, rtol=1e-5, atol=1e-5)


def test_a_whole_layer_leaves_to_vllm_what_the_kernel_does_not_compute_alone(monkeypatch):
    prefill = causal_step(np.random.default_rng(1), [3, MAX_QUERY_TOKENS + 2], [40, 0])
    assert WholeLayer(monkeypatch, checked_step_attention(1), prefill).forward() == "vllm"
    unchecked = WholeLayer(monkeypatch, StepAttention(), causal_step(np.random.default_rng(2), [3], [40]))
    assert unchecked.forward() == "vllm", "the first step checks the layout through vLLM's own cache update"
    tree = StepAttention(tree_rows=lambda metadata: fix_up_nodes(metadata, 0, [1, 2], [-1, 0]))
    run_step(tree, causal_step(np.random.default_rng(3), [3], [30]))
    assert WholeLayer(monkeypatch, tree, causal_step(np.random.default_rng(4), [3], [40])).forward() == "vllm"
