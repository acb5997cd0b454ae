"""Tree attention and KV compaction on vLLM's paged attention backends.

The backends' kernels only know causal masks. A tree step runs the backend unchanged, which
is already exact for every non-draft row and for the root row of a tree (it sees the context
only); the draft rows of branching trees are then recomputed here with the tree mask, in one
batched SDPA per layer: each node sees the whole context and its ancestors and itself. Chains
need no fix-up (causal is their tree mask).

Per layer the cache is ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` in both
layouts this module reads:

- :attr:`KVLayout.CPU_VEC` (``CPU_ATTN``, ``vec`` ISA: float32/bfloat16 without AMX): per
  (block, head) the keys are stored transposed (``[head_size, block_size]``) and followed by
  the values (``[block_size, head_size]``);
- :attr:`KVLayout.SPLIT_LAST_DIM` (``FLASH_ATTN``, ``TRITON_ATTN`` on GPUs): keys and values
  side by side on the last dimension.

:func:`check_layout` verifies the layout against the keys and values the backend has just
written, once per process, so another layout (or a quantized cache) fails loudly.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_retrieval_spec.verification.trees import TreeStepPlan, unpack_masks

SUPPORTED_CPU_ISAS = ("vec",)


class TreeAttentionError(RuntimeError):
    """Tree verification cannot run with this attention configuration."""


class KVLayout(enum.Enum):
    """How one layer's paged KV cache stores keys and values (module docstring)."""

    CPU_VEC = "cpu_vec"
    SPLIT_LAST_DIM = "split_last_dim"


def kv_views(kv_cache: torch.Tensor, head_size: int, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``keys, values``, each ``[blocks, kv_heads, block_size, head_size]``, of one
    layer's cache (writes through them land in the cache)."""
    if layout is KVLayout.SPLIT_LAST_DIM:
        return kv_cache[..., :head_size], kv_cache[..., head_size:]
    blocks, kv_heads, block_size, _ = kv_cache.shape
    halves = kv_cache.view(blocks, kv_heads, 2, block_size * head_size)
    keys = halves[:, :, 0].view(blocks, kv_heads, head_size, block_size).transpose(2, 3)
    values = halves[:, :, 1].view(blocks, kv_heads, block_size, head_size)
    return keys, values


def read_slots(kv_cache: torch.Tensor, head_size: int, layout: KVLayout,
               slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[len(slots), kv_heads, head_size]`` stored at ``slots``."""
    keys, values = kv_views(kv_cache, head_size, layout)
    block_size = kv_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    return keys[blocks, :, offsets], values[blocks, :, offsets]


def check_layout(kv_cache: torch.Tensor, layout: KVLayout, slots: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor) -> None:
    """Fail clearly unless the cache holds ``key``/``value`` at ``slots`` in ``layout``."""
    n, kv_heads = slots.shape[0], kv_cache.shape[1]
    stored_k, stored_v = read_slots(kv_cache, kv_cache.shape[-1] // 2, layout, slots)
    same_keys = torch.equal(stored_k, key.reshape(n, kv_heads, -1))
    if not (same_keys and torch.equal(stored_v, value.reshape(n, kv_heads, -1))):
        raise TreeAttentionError(
            f"the attention KV cache does not hold keys and values in the {layout.value} layout "
            "tree verification reads (vLLM version, ISA or a quantized kv_cache_dtype); run "
            "without retrieval_spec.tree (chain mode)"
        )


def require_cpu_isa(isa: str) -> None:
    if isa not in SUPPORTED_CPU_ISAS:
        raise TreeAttentionError(
            f"tree verification on the CPU build supports the attention ISA(s) {SUPPORTED_CPU_ISAS}, "
            f"this machine uses {isa!r}; run without retrieval_spec.tree (chain mode)"
        )


@dataclass
class TreeRows:
    """Index tensors of one step's branching trees, padded to ``[R, nodes]`` (built once per
    step on the host with NumPy, moved to the cache's device once, shared by every layer)."""

    rows: torch.Tensor  # [R, N] flat token index of each draft node (padding: 0)
    valid: torch.Tensor  # [R, N] bool
    valid_rows: torch.Tensor  # rows[valid]
    blocks: torch.Tensor  # [R, context blocks] block ids of each request's context
    mask: torch.Tensor  # [R, N, C + N] bool: what each node may attend to
    context_len: int  # C, the longest context

    @classmethod
    def build(cls, plan: TreeStepPlan, context_lens: np.ndarray, block_table: torch.Tensor,
              block_size: int) -> TreeRows:
        """``context_lens`` ``[B]``: tokens before each row's first draft node (root included)."""
        branching = np.flatnonzero(plan.branching)
        sizes = plan.sizes[branching]
        nodes, contexts = int(sizes.max()), context_lens[branching].astype(np.int64)
        context_len = int(contexts.max())
        slot = np.arange(nodes)[None, :]
        valid = slot < sizes[:, None]
        starts = plan.offsets[branching][:, None] + np.minimum(slot, sizes[:, None] - 1)
        rows = np.where(valid, plan.node_rows()[starts], 0)
        visible = unpack_masks(plan.ancestors[starts.reshape(-1)], nodes).reshape(len(branching), nodes, nodes)
        mask = np.zeros((len(branching), nodes, context_len + nodes), dtype=bool)
        mask[:, :, :context_len] = np.arange(context_len)[None, None, :] < contexts[:, None, None]
        mask[:, :, context_len:] = visible & valid[:, None, :]
        mask &= valid[:, :, None]
        mask[:, :, 0] = True  # padded rows attend somewhere (their output is discarded)
        device = block_table.device
        num_blocks = (context_len + block_size - 1) // block_size
        blocks = block_table[torch.from_numpy(branching).to(device), :num_blocks].long()
        rows_t, valid_t, mask_t = (torch.from_numpy(array).to(device) for array in (rows, valid, mask))
        return cls(rows_t, valid_t, rows_t[valid_t], blocks, mask_t, context_len)


def gather_context(kv_cache: torch.Tensor, head_size: int, layout: KVLayout,
                   tree_rows: TreeRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of every request's context, ``[R, kv_heads, C, head_size]``."""
    keys, values = kv_views(kv_cache, head_size, layout)
    r, kv_heads, c = tree_rows.blocks.shape[0], kv_cache.shape[1], tree_rows.context_len

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # [R, blocks, kv_heads, block_size, hs] -> [R, kv_heads, blocks * block_size, hs]
        return cache[tree_rows.blocks].transpose(1, 2).reshape(r, kv_heads, -1, head_size)[:, :, :c]

    return gather(keys), gather(values)


def apply_tree_attention(
    impl: object, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    kv_cache: torch.Tensor, layout: KVLayout, output: torch.Tensor, tree_rows: TreeRows,
) -> None:
    """Overwrite the draft rows of branching trees in ``output`` with tree attention."""
    heads, head_size = impl.num_heads, impl.head_size
    kv_heads = kv_cache.shape[1]
    r, n = tree_rows.rows.shape
    ctx_k, ctx_v = gather_context(kv_cache, head_size, layout, tree_rows)
    flat = tree_rows.rows.reshape(-1)
    node_k = key.reshape(-1, kv_heads, head_size)[flat].view(r, n, kv_heads, head_size).transpose(1, 2)
    node_v = value.reshape(-1, kv_heads, head_size)[flat].view(r, n, kv_heads, head_size).transpose(1, 2)
    q = query.reshape(-1, heads, head_size)[flat].view(r, n, heads, head_size).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat([ctx_k, node_k], dim=2).to(q.dtype), torch.cat([ctx_v, node_v], dim=2).to(q.dtype),
        attn_mask=tree_rows.mask.unsqueeze(1), scale=impl.scale, enable_gqa=heads != kv_heads,
    )
    rows_out = output.view(output.shape[0], heads, head_size)
    rows_out[tree_rows.valid_rows] = out.transpose(1, 2)[tree_rows.valid].to(output.dtype)


def require_plain_attention(impl: object) -> None:
    """Tree rows are recomputed without sliding windows, soft-caps, ALiBi or sinks."""
    if (getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1)) or getattr(impl, "logits_soft_cap", None)
            or getattr(impl, "alibi_slopes", None) is not None or getattr(impl, "sinks", None) is not None):
        raise TreeAttentionError(
            "tree verification supports plain causal attention only (no sliding window, "
            "soft-cap, ALiBi or attention sinks); run without retrieval_spec.tree"
        )


def compact_kv(kv_caches: Sequence[torch.Tensor], head_size: int, layout: KVLayout, moves: torch.Tensor) -> None:
    """Copy the K/V of slots ``moves[:, 0]`` into ``moves[:, 1]`` in every layer (a source is
    never an earlier destination: the accepted path only moves forward)."""
    if moves.numel() == 0:
        return
    block_size = kv_caches[0].shape[2]
    src, dst = moves.to(kv_caches[0].device).unbind(1)
    sb, so, db, do = src // block_size, src % block_size, dst // block_size, dst % block_size
    for kv_cache in kv_caches:
        keys, values = kv_views(kv_cache, head_size, layout)
        keys[db, :, do] = keys[sb, :, so]
        values[db, :, do] = values[sb, :, so]
