"""Tree attention and KV compaction on vLLM's paged attention backends.

The backends' kernels only know causal masks. A tree step runs the backend unchanged, which
is already exact for every non-draft row and for the root row of a tree (it sees the context
only); the draft rows of branching trees are then recomputed with the tree mask by the
``tree_attention`` kernel (:mod:`vllm_retrieval_spec.kernels.attention`), which reads each
node's context and ancestors in place from the paged cache: each node sees the whole context,
its ancestors and itself. Chains need no fix-up (causal is their tree mask).

:func:`check_layout` verifies the cache layout the kernel reads against the keys and values
the backend has just written, once per runner, so another layout (or a quantized cache) fails
loudly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_retrieval_spec.kernels.attention import KVLayout, kv_views, tree_attention
from vllm_retrieval_spec.verification.trees import TreeStepPlan

SUPPORTED_CPU_ISAS = ("vec",)


class TreeAttentionError(RuntimeError):
    """Tree verification cannot run with this attention configuration."""


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
class TreeNodes:
    """The draft nodes of one step's branching trees, as the ``tree_attention`` kernel takes
    them (built once per step on the host with NumPy, moved to the cache's device once, shared
    by every layer)."""

    rows: torch.Tensor  # [M] flat token index of each node
    request: torch.Tensor  # [M] int32 input-batch row (of the block table)
    context: torch.Tensor  # [M] int32 tokens before the request's first node (root included)
    index: torch.Tensor  # [M] int32 local index in its tree
    ancestors: torch.Tensor  # [M, words] uint64 ancestor-or-self bits
    block_table: torch.Tensor  # [rows, width] int32

    @classmethod
    def build(cls, plan: TreeStepPlan, context_lens: np.ndarray, block_table: torch.Tensor) -> TreeNodes:
        """``context_lens`` ``[B]``: tokens before each row's first draft node (root included)."""
        sizes = plan.sizes
        branching = np.repeat(plan.branching, sizes)
        request = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)[branching]
        index = (np.arange(len(plan.tokens)) - np.repeat(plan.offsets[:-1], sizes))[branching]
        device = block_table.device
        arrays = (plan.node_rows()[branching], request, context_lens[request].astype(np.int32),
                  index.astype(np.int32), np.ascontiguousarray(plan.ancestors[branching]))
        rows, request_t, context, index_t, ancestors = (torch.from_numpy(a).to(device) for a in arrays)
        table = block_table.to(torch.int32).contiguous()
        return cls(rows, request_t, context, index_t, ancestors, table)


def apply_tree_attention(impl: object, query: torch.Tensor, kv_cache: torch.Tensor, layout: KVLayout,
                         output: torch.Tensor, nodes: TreeNodes) -> None:
    """Overwrite the draft rows of branching trees in ``output`` with tree attention (their keys
    and values are already in ``kv_cache``)."""
    rows = query.shape[0]
    tree_attention(query.reshape(rows, -1), kv_cache, layout, nodes.rows, nodes.block_table, nodes.request,
                   nodes.context, nodes.index, nodes.ancestors, impl.num_heads, impl.scale,
                   output.view(output.shape[0], -1))


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
