"""Tree attention and KV compaction on both paged KV layouts equal a dense reference.

The caches are filled by hand in each backend's layout (not through the module's own views),
so a wrong view fails here; the CPU layout is also proven end to end in test_e2e_engine.py. The
kernel itself is compared with its torch reference on random trees, shapes and dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_retrieval_spec.drafts import DraftTree
from vllm_retrieval_spec.kernels.attention import KVLayout, LayerAttention, TreeNodes, tree_attention
from vllm_retrieval_spec.kernels.attention_reference import node_positions, tree_attention_reference
from vllm_retrieval_spec.kernels.extension import load_extension
from vllm_retrieval_spec.kernels.tree import pack_tree_masks
from vllm_retrieval_spec.verification.tree_attention import (
    TreeAttentionError,
    TreeKVGroup,
    TreeLayer,
    apply_tree_attention,
    check_layout,
    compact_kv,
    layer_attention,
    read_slots,
    require_supported_attention,
    tree_nodes,
)
from vllm_retrieval_spec.verification.trees import TreeStepPlan

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 8, 4, 40
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=NO_CUDA)]


def write_slot(cache: torch.Tensor, layout: KVLayout, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store ``k, v [kv_heads, head_size]`` at ``slot`` exactly as the backend does."""
    block, offset = divmod(slot, BLOCK_SIZE)
    if layout is KVLayout.SPLIT_LAST_DIM:
        cache[block, :, offset, :HEAD_SIZE] = k
        cache[block, :, offset, HEAD_SIZE:] = v
        return
    flat = cache[block].reshape(KV_HEADS, -1)  # per head: keys [head_size, block_size], then values
    for d in range(HEAD_SIZE):
        flat[:, d * BLOCK_SIZE + offset] = k[:, d]
    flat[:, BLOCK_SIZE * HEAD_SIZE + offset * HEAD_SIZE : BLOCK_SIZE * HEAD_SIZE + (offset + 1) * HEAD_SIZE] = v


def ancestors_or_self(tree: DraftTree, node: int) -> list[int]:
    seen = []
    while node >= 0:
        seen.append(node)
        node = tree.parents[node]
    return sorted(seen)


class Batch:
    """Two requests with branching trees and different context lengths, on shuffled blocks."""

    def __init__(self, layout: KVLayout, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        gen = torch.Generator().manual_seed(seed)
        trees = [DraftTree((5, 6, 7, 8, 9), (-1, -1, 0, 0, 2)), DraftTree((1, 2, 3), (-1, 0, -1))]
        contexts = [9, 14]  # tokens before the draft nodes, the root included
        self.blocks = torch.from_numpy(rng.permutation(NUM_BLOCKS)[:16].reshape(2, 8).astype(np.int32))
        self.cache = torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
        self.context_kv = []
        for row, context in enumerate(contexts):
            k = torch.randn(context, KV_HEADS, HEAD_SIZE, generator=gen)
            v = torch.randn(context, KV_HEADS, HEAD_SIZE, generator=gen)
            for position in range(context):
                write_slot(self.cache, layout, self.slot(row, position), k[position], v[position])
            self.context_kv.append((k, v))
        # Flat batch: request 0's root and nodes, then request 1's (the roots are context).
        starts = [0, 1 + len(trees[0].tokens)]
        self.num_tokens = starts[1] + 1 + len(trees[1].tokens)
        self.query = torch.randn(self.num_tokens, HEADS * HEAD_SIZE, generator=gen)
        self.key = torch.randn(self.num_tokens, KV_HEADS * HEAD_SIZE, generator=gen)
        self.value = torch.randn(self.num_tokens, KV_HEADS * HEAD_SIZE, generator=gen)
        self.trees, self.starts = trees, starts
        for row, (tree, start, context) in enumerate(zip(trees, starts, contexts)):
            for node in range(len(tree.tokens)):  # the backend stores the nodes' K/V first
                flat = start + 1 + node
                write_slot(self.cache, layout, self.slot(row, context + node),
                           self.key[flat].view(KV_HEADS, HEAD_SIZE), self.value[flat].view(KV_HEADS, HEAD_SIZE))
        self.plan = TreeStepPlan.build(trees, np.array(starts))
        self.context_lens = np.array(contexts)
        self.impl = SimpleNamespace(num_heads=HEADS, head_size=HEAD_SIZE, scale=HEAD_SIZE**-0.5)

    def attend(self, output: torch.Tensor, layout: KVLayout, device: str = "cpu", **impl: object) -> None:
        """The tree-attention fix-up of one layer whose implementation adds ``impl``."""
        nodes = tree_nodes(self.plan, self.context_lens, self.blocks.to(device))
        tree_layer = TreeLayer.of(SimpleNamespace(**vars(self.impl), **impl), layout)
        apply_tree_attention(self.query.to(device), self.cache.to(device), output, nodes, tree_layer)

    def slot(self, row: int, position: int) -> int:
        return int(self.blocks[row, position // BLOCK_SIZE]) * BLOCK_SIZE + position % BLOCK_SIZE

    def reference_rows(self, window: int = 0) -> dict[int, torch.Tensor]:
        """Dense attention of every draft node the kernel recomputes over its context, ancestors
        and itself (the last ``window`` of those keys with a sliding window): not the tree's
        leading chain, whose causal rows already see exactly their ancestors."""
        expected = {}
        for tree, start, (ctx_k, ctx_v) in zip(self.trees, self.starts, self.context_kv):
            for node in range(len(tree.tokens)):
                flat = start + 1 + node
                if ancestors_or_self(tree, node) == list(range(node + 1)):
                    continue  # the backend's causal row is this node's tree row
                seen = [start + 1 + j for j in ancestors_or_self(tree, node)]
                k = torch.cat([ctx_k, self.key[seen].view(-1, KV_HEADS, HEAD_SIZE)])[-window:]
                v = torch.cat([ctx_v, self.value[seen].view(-1, KV_HEADS, HEAD_SIZE)])[-window:]
                q = self.query[flat].view(HEADS, HEAD_SIZE)
                kv_head = torch.arange(HEADS) // (HEADS // KV_HEADS)
                weights = torch.einsum("hd,nhd->hn", q, k[:, kv_head]) * self.impl.scale
                expected[flat] = torch.einsum("hn,nhd->hd", weights.softmax(-1), v[:, kv_head]).reshape(-1)
        return expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(KVLayout))
def test_tree_rows_match_dense_attention(layout, device):
    batch = Batch(layout)
    output = torch.full((batch.num_tokens, HEADS * HEAD_SIZE), 7.0, device=device)
    batch.attend(output, layout, device)
    output, expected = output.cpu(), batch.reference_rows()
    assert len(expected) == 5  # 8 nodes, 3 of them on their tree's leading chain
    for flat in range(batch.num_tokens):
        if flat in expected:
            torch.testing.assert_close(output[flat], expected[flat], rtol=1e-5, atol=1e-5)
        else:  # roots and leading chains keep what the backend computed
            assert torch.equal(output[flat], torch.full((HEADS * HEAD_SIZE,), 7.0))


@pytest.mark.parametrize("window", [1, 3, 11])
@pytest.mark.parametrize("layout", list(KVLayout))
def test_sliding_window_rows_match_dense_attention_over_the_last_keys_of_each_path(layout, window):
    """A node at depth d sits at position base + d: its window holds the last keys of its path
    (context, ancestors, itself), however its tree branches (the variant a CPU_ATTN layer with
    vLLM's sliding window W passes)."""
    batch = Batch(layout)
    output = torch.zeros(batch.num_tokens, HEADS * HEAD_SIZE)
    batch.attend(output, layout, sliding_window=window, logits_soft_cap=0, sinks=None)
    for flat, expected in batch.reference_rows(window).items():
        torch.testing.assert_close(output[flat], expected, rtol=1e-5, atol=1e-5)


def test_kv_groups_compact_their_own_slots_in_a_shared_cache():
    """vLLM's hybrid KV cache manager: a full-attention and a sliding-window group give the same
    nodes different slots, their layers share one cache tensor; each group moves only its own."""
    batch = Batch(KVLayout.CPU_VEC)
    rows = batch.plan.node_rows()
    groups = []
    for first_block in (20, 30):  # each group's blocks, one pool: never the same block ids
        table = torch.arange(first_block, first_block + 8, dtype=torch.int32).repeat(2, 1)
        slot_mapping = torch.arange(batch.num_tokens) + first_block * BLOCK_SIZE
        metadata = SimpleNamespace(slot_mapping=slot_mapping, block_table=table)
        group = TreeKVGroup.build(batch.plan, batch.context_lens, metadata)
        assert torch.equal(group.slots, slot_mapping[torch.from_numpy(rows)])
        group.add_cache(batch.cache)
        group.add_cache(batch.cache.view_as(batch.cache))  # another layer on the same tensor
        groups.append(group)
    assert len(groups[0].caches) == 1
    batch.cache.view(-1)[:] = torch.arange(batch.cache.numel(), dtype=batch.cache.dtype)
    before = batch.cache.clone()
    moves = torch.tensor([[3, 1]])  # node 3 of request 0 moves to the slot of node 1
    groups[0].compact(HEAD_SIZE, KVLayout.CPU_VEC, moves)
    source, destination = groups[0].slots[3], groups[0].slots[1]
    after_k, _ = read_slots(batch.cache, HEAD_SIZE, KVLayout.CPU_VEC, torch.stack([source, destination]))
    assert torch.equal(after_k[1], after_k[0])
    changed = (batch.cache != before).nonzero()[:, 0].unique()
    assert changed.tolist() == [int(destination) // BLOCK_SIZE]  # one block of group 0, none of group 1


@pytest.mark.parametrize(("impl", "expected"), [
    ({"sliding_window": 512, "logits_soft_cap": 0}, (512, 0.0)),  # CPU_ATTN: vLLM's window W
    ({"sliding_window": -1, "logits_soft_cap": 0}, (0, 0.0)),
    ({"sliding_window": (511, 0), "logits_soft_cap": 50.0}, (512, 50.0)),  # FLASH_ATTN / TRITON_ATTN: (W - 1, 0)
    ({"sliding_window": (-1, -1), "logits_soft_cap": None}, (0, 0.0)),
])
def test_layer_attention_of_each_backend(impl, expected):
    sinks = torch.tensor([0.5, -1.0], dtype=torch.bfloat16)
    attention = layer_attention(SimpleNamespace(num_heads=2, scale=0.125, **impl, sinks=sinks))
    assert (attention.heads, attention.scale, attention.window, attention.softcap) == (2, 0.125, *expected)
    assert attention.sinks.dtype == torch.float32 and torch.equal(attention.sinks, sinks.float())
    assert layer_attention(SimpleNamespace(num_heads=2, scale=0.125, **impl)).sinks is None


@pytest.mark.parametrize(("impl", "message"), [
    ({"alibi_slopes": torch.ones(4)}, "ALiBi"),
    ({"kv_cache_dtype": "fp8_e4m3"}, r"quantized KV cache \(kv_cache_dtype 'fp8_e4m3'\)"),
    ({"sliding_window": (63, 63)}, "bidirectional"),
])
def test_unsupported_attention_is_refused_in_one_line(impl, message):
    with pytest.raises(TreeAttentionError, match=message + r".*run without retrieval_spec\.tree") as refused:
        require_supported_attention(SimpleNamespace(**impl))
    assert "\n" not in str(refused.value)


def test_gemma_gpt_oss_and_mistral_attention_is_supported():
    for impl in ({"sliding_window": 512, "logits_soft_cap": 50.0, "kv_cache_dtype": "auto"},
                 {"sliding_window": (127, 0), "sinks": torch.zeros(8), "kv_cache_dtype": "bfloat16"},
                 {"sliding_window": (4095, 0), "alibi_slopes": None}):
        require_supported_attention(SimpleNamespace(**impl))


@pytest.mark.parametrize("layout", list(KVLayout))
def test_compaction_moves_keys_and_values(layout):
    batch = Batch(layout)
    slots = torch.tensor([batch.slot(1, p) for p in (13, 3, 7)])
    before_k, before_v = read_slots(batch.cache, HEAD_SIZE, layout, slots)
    destinations = torch.tensor([batch.slot(0, p) for p in (20, 21, 30)])
    compact_kv([batch.cache], HEAD_SIZE, layout, torch.stack([slots, destinations], dim=1))
    after_k, after_v = read_slots(batch.cache, HEAD_SIZE, layout, destinations)
    assert torch.equal(after_k, before_k) and torch.equal(after_v, before_v)
    assert torch.equal(after_k[0], batch.context_kv[1][0][13])


@pytest.mark.parametrize("layout", list(KVLayout))
def test_layout_check_accepts_its_own_layout_and_refuses_the_other(layout):
    batch = Batch(layout)
    slots = torch.tensor([batch.slot(0, p) for p in range(9)])
    keys, values = batch.context_kv[0]
    check_layout(batch.cache, layout, slots, keys.reshape(9, -1), values.reshape(9, -1))
    other = next(other for other in KVLayout if other is not layout)
    with pytest.raises(TreeAttentionError, match="layout tree verification reads"):
        check_layout(batch.cache, other, slots, keys.reshape(9, -1), values.reshape(9, -1))


@dataclass(frozen=True)
class KernelCase:
    """The kernel's inputs but the output and the layer's variant."""

    query: torch.Tensor
    kv_cache: torch.Tensor
    nodes: TreeNodes
    heads: int
    scale: float

    def run(self, out: torch.Tensor, layout: KVLayout, **variant: object) -> None:
        tree_attention(self.query, self.kv_cache, out, self.nodes, layout,
                       LayerAttention(self.heads, self.scale, **variant))

    def run_into_zeros(self, layout: KVLayout, **variant: object) -> torch.Tensor:
        """The kernel's output in a fresh zeroed tensor (rows it does not compute stay 0)."""
        out = torch.zeros(self.query.shape, dtype=self.query.dtype, device=self.query.device)
        self.run(out, layout, **variant)
        return out

    def reference(self, layout: KVLayout, **variant: object) -> torch.Tensor:
        """The torch reference's rows, on the host."""
        def host(value):
            return value.cpu() if isinstance(value, torch.Tensor) else value

        nodes = TreeNodes(*(host(array) for array in vars(self.nodes).values()))
        attention = LayerAttention(self.heads, self.scale, **{k: host(v) for k, v in variant.items()})
        return tree_attention_reference(self.query.cpu(), self.kv_cache.cpu(), nodes, layout, attention)


def random_tree_batch(rng: np.random.Generator, layout: KVLayout, dtype: torch.dtype, device: str,
                      **shape: int) -> KernelCase:
    """A random cache, random trees and a strided query for the kernel; ``shape`` fixes some of
    ``group, kv_heads, head_size, requests, min_context, max_context``."""
    group = shape.get("group") or int(rng.choice([1, 3, 4]))
    kv_heads = shape.get("kv_heads") or int(rng.integers(1, 3))
    head_size = shape.get("head_size") or int(rng.choice([8, 37, 64]))
    block_size = int(rng.choice([5, 16, 32]))
    requests = shape.get("requests") or int(rng.integers(1, 5))
    contexts = rng.integers(shape.get("min_context", 1), shape.get("max_context", 60), requests)
    sizes = rng.integers(2, 40, requests)
    width = int((contexts + sizes).max()) // block_size + 1
    parents = [np.array([int(rng.integers(-1, j)) for j in range(size)], dtype=np.int32) for size in sizes]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    masks = pack_tree_masks(np.concatenate(parents), offsets, int(sizes.max()))
    num_blocks = requests * width + 3
    table = rng.permutation(num_blocks)[: requests * width].reshape(requests, width).astype(np.int32)
    nodes = np.sort(rng.permutation(int(offsets[-1]))[: int(rng.integers(1, offsets[-1] + 1))])
    request = (np.searchsorted(offsets, nodes, side="right") - 1).astype(np.int32)
    tokens = len(nodes) + 5
    node_row = rng.permutation(tokens)[: len(nodes)].astype(np.int64)
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    heads = group * kv_heads
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype)
    arrays = (node_row, table, request, contexts[request].astype(np.int32), (nodes - offsets[request]).astype(np.int32),
              np.ascontiguousarray(masks.ancestor_mask[nodes]))
    cache = torch.randn(num_blocks, kv_heads, block_size, 2 * head_size, generator=gen)
    query = fused.to(device)[:, : heads * head_size]  # a strided view, as vLLM's is
    return KernelCase(query, cache.to(dtype).to(device), TreeNodes(*(torch.from_numpy(a).to(device) for a in arrays)),
                      heads, head_size**-0.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(KVLayout))
def test_kernel_matches_reference_on_random_trees(layout, dtype, device):
    rng = np.random.default_rng(7)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for _ in range(25):
        case = random_tree_batch(rng, layout, dtype, device)
        out = torch.full(case.query.shape, 7.0, dtype=dtype, device=device)
        case.run(out, layout)
        expected = case.reference(layout)
        rows = case.nodes.rows.cpu()
        got = out.cpu().float().view(len(out), case.heads, -1)
        torch.testing.assert_close(got[rows], expected.float(), rtol=tolerance, atol=tolerance)
        untouched = torch.ones(len(out), dtype=torch.bool)
        untouched[rows] = False
        assert bool((got[untouched] == 7.0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(KVLayout))
def test_avx512_path_gives_the_avx2_paths_rows_bit_for_bit(layout, dtype, both_lane_widths):
    rng = np.random.default_rng(5)
    for _ in range(15):
        case = random_tree_batch(rng, layout, dtype, "cpu")
        options = attention_options(rng, case.heads, "cpu")
        assert torch.equal(*both_lane_widths(partial(case.run_into_zeros, layout, **options)))


def attention_options(rng: np.random.Generator, heads: int, device: str) -> dict:
    """A random sliding window (often narrower than the context, sometimes a single key), a
    soft-cap and attention sinks, each present about half of the time."""
    window = int(rng.choice([0, 1, 2, int(rng.integers(3, 80))]))
    softcap = float(rng.choice([0.0, 0.5, 30.0]))
    sinks = torch.from_numpy(rng.normal(0.0, 2.0, heads).astype(np.float32)).to(device) if rng.random() < 0.5 else None
    return {"window": window, "softcap": softcap, "sinks": sinks}


def assert_matches_reference(case: KernelCase, options: dict, layout: KVLayout, dtype: torch.dtype, device: str,
                             tolerance: float) -> None:
    """The kernel's rows equal the reference's on the same inputs and options, to ``tolerance``."""
    out = torch.full(case.query.shape, 7.0, dtype=dtype, device=device)
    case.run(out, layout, **options)
    expected = case.reference(layout, **options)
    got = out.cpu().float().view(len(out), case.heads, -1)[case.nodes.rows.cpu()]
    torch.testing.assert_close(got, expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(KVLayout))
def test_kernel_matches_reference_with_window_softcap_and_sinks(layout, dtype, device):
    """Gemma 2/3, Mistral and gpt-oss attention: each node keeps the last ``window`` keys of its
    path (context, ancestors, itself), scores are soft-capped, sinks join each softmax."""
    rng = np.random.default_rng(11)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for _ in range(30):
        case = random_tree_batch(rng, layout, dtype, device)
        options = attention_options(rng, case.heads, device)
        assert_matches_reference(case, options, layout, dtype, device, tolerance)


@NO_CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize(("group", "kv_heads", "requests"), [(1, 2, 2), (4, 2, 3), (1, 32, 24)])
def test_cuda_kernel_matches_reference_on_long_contexts(layout, dtype, group, kv_heads, requests):
    """Contexts of thousands of keys (many tiles, split over blocks when the batch is small;
    32 kv heads of 24 requests fill the GPU unsplit), head size 128, windows, soft-caps, sinks."""
    rng = np.random.default_rng(13)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for _ in range(3):
        case = random_tree_batch(rng, layout, dtype, "cuda", group=group, kv_heads=kv_heads, head_size=128,
                                 requests=requests, min_context=2900, max_context=3100)
        options = attention_options(rng, case.heads, "cuda")
        options["window"] = int(rng.choice([0, 700, 2990]))
        assert_matches_reference(case, options, layout, dtype, "cuda", tolerance)


def reference_pieces(request: np.ndarray, context: np.ndarray, index: np.ndarray, tile: int) -> np.ndarray:
    """tree_tiles.h's partition: chunks start at a run's first node or at a node whose index is a
    multiple of ``tile``; the block whose range of ``tile`` nodes holds a chunk's start serves it,
    in pieces of at most ``tile`` nodes."""
    starts = np.ones(len(request), bool)
    starts[1:] = (request[1:] != request[:-1]) | (context[1:] != context[:-1]) | (index[1:] % tile == 0)
    chunk_starts = np.flatnonzero(starts)
    pieces = [(start // tile, begin, min(begin + tile, end))
              for start, end in zip(chunk_starts, [*chunk_starts[1:], len(request)])
              for begin in range(start, end, tile)]
    return np.array(sorted(pieces, key=lambda piece: piece[0]), np.int64).reshape(-1, 3)


@st.composite
def node_runs(draw):
    """Runs of one request and context: indices counting up from a tree's leading chain, or any."""
    request, context, index = [], [], []
    for run in range(draw(st.integers(1, 12))):
        size = draw(st.integers(1, 40))
        first = draw(st.integers(0, 20))
        counting = draw(st.booleans())
        indices = range(first, first + size) if counting else draw(st.lists(st.integers(-3, 70), min_size=size,
                                                                            max_size=size))
        request += [draw(st.integers(0, 3)) if run else 0] * size
        context += [draw(st.integers(0, 2))] * size
        index += list(indices)
    return tuple(np.array(a, np.int32) for a in (request, context, index))


@settings(max_examples=300, deadline=None)
@given(runs=node_runs(), tile=st.sampled_from([1, 2, 4, 8, 16]))
def test_cuda_blocks_share_nodes_out_as_the_reference(runs, tile):
    """Every node in exactly one piece of one run, served by the block holding its chunk's start."""
    pieces = load_extension().tree_attention_pieces(*runs, tile)
    np.testing.assert_array_equal(pieces, reference_pieces(*runs, tile))
    covered = np.concatenate([np.arange(begin, end) for _, begin, end in pieces])
    np.testing.assert_array_equal(np.sort(covered), np.arange(len(runs[0])))


def test_a_tree_of_a_tile_is_one_piece_without_its_leading_chain():
    """64 trees of 16 nodes, the first (the leading chain) left out: one piece, one context read,
    a tree (fixed tiles of 16 nodes each straddled two trees)."""
    trees, tile = 64, 16
    request = np.repeat(np.arange(trees, dtype=np.int32), 15)
    index = np.tile(np.arange(1, 16, dtype=np.int32), trees)
    pieces = load_extension().tree_attention_pieces(request, np.full_like(request, 900), index, tile)
    assert len(pieces) == trees
    assert (pieces[:, 2] - pieces[:, 1] == 15).all()


def test_pieces_refuse_a_tile_below_one_and_ragged_arrays():
    one = np.zeros(3, np.int32)
    with pytest.raises(ValueError, match="tile_nodes"):
        load_extension().tree_attention_pieces(one, one, one, 0)
    with pytest.raises(ValueError, match="differ in length"):
        load_extension().tree_attention_pieces(one, one[:2], one, 4)


def test_window_wider_than_every_path_changes_nothing():
    case = random_tree_batch(np.random.default_rng(5), KVLayout.CPU_VEC, torch.float32, "cpu")
    plain, windowed = (torch.zeros(case.query.shape) for _ in range(2))
    case.run(plain, KVLayout.CPU_VEC)
    case.run(windowed, KVLayout.CPU_VEC, window=1000)
    assert torch.equal(plain, windowed)


def test_reference_window_keeps_the_last_keys_of_the_path():
    """Node 4 of the tree 0 <- 2 <- 4 (and the siblings 1, 3) after 5 context tokens: its path is
    the context, then 0, 2 and 4 at cache positions 5, 7 and 9."""
    row = torch.from_numpy(pack_tree_masks(np.array([-1, -1, 0, 1, 2], np.int32), np.array([0, 5], np.int32),
                                           5).ancestor_mask[4])
    assert node_positions(5, 4, row) == [0, 1, 2, 3, 4, 5, 7, 9]
    assert node_positions(5, 4, row, window=4) == [4, 5, 7, 9]
    assert node_positions(5, 4, row, window=2) == [7, 9]


@pytest.mark.parametrize("layout", list(KVLayout))
def test_kernel_refuses_blocks_and_positions_outside_the_cache(layout):
    case = random_tree_batch(np.random.default_rng(3), layout, torch.float32, "cpu")
    out = torch.zeros(case.query.shape)
    table, request, cache = case.nodes.block_table, case.nodes.request, case.kv_cache

    def run(query: torch.Tensor = case.query, **changed) -> None:
        replace(case, query=query, nodes=replace(case.nodes, **changed)).run(out, layout)

    bad = table.clone()
    bad[int(request[0]), 0] = cache.shape[0]  # one block past the cache
    with pytest.raises(IndexError, match="outside the cache"):
        run(block_table=bad)
    bad[int(request[0]), 0] = -1
    with pytest.raises(IndexError, match="outside the cache"):
        run(block_table=bad)
    with pytest.raises(IndexError, match="past the block table"):
        run(context=torch.full_like(case.nodes.context, table.shape[1] * cache.shape[2]))
    with pytest.raises(IndexError, match="out of range"):
        run(request=request + table.shape[0])
    with pytest.raises(IndexError, match="out of range"):
        run(rows=case.nodes.rows + len(out))
    with pytest.raises(ValueError, match="contiguous rows"):
        run(query=case.query.t())


def test_only_nodes_after_the_leading_chain_are_recomputed():
    """A node whose earlier tree nodes are all its ancestors sees exactly them under the causal
    mask; every node from the first one off that chain on is recomputed."""
    trees = [DraftTree((1, 2, 3, 4, 5), (-1, 0, 1, 0, 3)), DraftTree((), ()), DraftTree((6, 7), (-1, -1)),
             DraftTree((8, 9), (-1, 0))]
    plan = TreeStepPlan.build(trees, np.array([0, 6, 7, 10]))
    assert plan.off_chain.tolist() == [False, False, False, True, True, False, True, False, False]
    assert plan.branching.tolist() == [True, False, True, False]
