"""Tree attention and KV compaction on vLLM's paged attention backends.

The backends' kernels only know causal masks. A tree step runs the backend unchanged, which
is already exact for every non-draft row and for the root row of a tree (it sees the context
only); the draft rows of branching trees are then recomputed with the tree mask by the
``tree_attention`` kernel (:mod:`vllm_retrieval_spec.kernels.attention`), which reads each
node's context and ancestors in place from the paged cache: each node sees the whole context,
its ancestors and itself. Chains need no fix-up (causal is their tree mask), nor does the
leading chain of a tree (its nodes before the first one whose parent is not the node before it:
the REST kernel writes trees depth-first, so that is the tree's main path).

A node at depth ``d`` sits at position ``base + d``: a sliding-window layer (Gemma 2/3,
Mistral, gpt-oss) keeps the keys of its path within the window counted from there, a soft-capped
layer (Gemma 2) caps its scores and attention sinks (gpt-oss) join its softmax, as the backend
does for every other row (:func:`layer_attention`). ALiBi and quantized (fp8) KV caches are
refused when the engine starts (:func:`require_supported_attention`).

vLLM's hybrid KV cache manager gives sliding-window and full-attention layers separate KV cache
groups (on the CPU build too), each with its own block table and its own slots for the same
tokens. Each group's layers read their nodes through their own block table and compaction moves
each group's accepted K/V between that group's slots (:class:`TreeKVGroup`): sliding-window
groups free only blocks wholly before the window of the step's first new token, and a node's
window never reaches further back, so every block a node reads or a move touches is allocated.

:func:`check_layout` verifies the cache layout the kernel reads against the keys and values
the backend has just written, once per runner, so another layout (or a quantized cache) fails
loudly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_retrieval_spec.kernels.attention import KVLayout, LayerAttention, TreeNodes, kv_views, tree_attention
from vllm_retrieval_spec.verification.trees import TreeStepPlan

SUPPORTED_CPU_ISAS = ("vec",)
PLAIN_KV_CACHE_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")


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


def layer_attention(impl: object) -> LayerAttention:
    """How tree attention computes a vLLM attention implementation's layer (``CPU_ATTN``,
    ``FLASH_ATTN``, ``TRITON_ATTN``): its heads, scale, sliding window, soft-cap and sinks."""
    sinks = getattr(impl, "sinks", None)
    return LayerAttention(impl.num_heads, impl.scale, sliding_window_of(impl),
                          float(getattr(impl, "logits_soft_cap", None) or 0.0),
                          None if sinks is None else sinks.detach().to(torch.float32).contiguous())


def sliding_window_of(impl: object) -> int:
    """The layer's causal sliding window in keys, the query included (0: none). ``CPU_ATTN``
    keeps vLLM's window ``W`` (keys ``p - W + 1 .. p``), the GPU backends ``(W - 1, 0)``."""
    window = getattr(impl, "sliding_window", None)
    if isinstance(window, (tuple, list)):
        return int(window[0]) + 1 if window[0] >= 0 else 0
    return int(window) if window is not None and window > 0 else 0


def unsupported_attention(impl: object) -> str | None:
    """What about a layer's attention the tree fix-up cannot reproduce, or None."""
    if getattr(impl, "alibi_slopes", None) is not None:
        return "ALiBi position biases"
    kv_cache_dtype = str(getattr(impl, "kv_cache_dtype", "auto"))
    if kv_cache_dtype not in PLAIN_KV_CACHE_DTYPES:
        return f"a quantized KV cache (kv_cache_dtype {kv_cache_dtype!r})"
    window = getattr(impl, "sliding_window", None)
    if isinstance(window, (tuple, list)) and window[1] > 0:
        return "bidirectional sliding windows"
    return None


def require_supported_attention(impl: object) -> None:
    """Refuse, when the engine starts, a layer whose attention the tree fix-up cannot
    reproduce (sliding windows, soft-caps and attention sinks are supported)."""
    problem = unsupported_attention(impl)
    if problem is not None:
        raise TreeAttentionError(
            f"tree verification does not support {problem} ({type(impl).__name__}); run without "
            "retrieval_spec.tree (chain mode)"
        )


def tree_nodes(plan: TreeStepPlan, context_lens: np.ndarray, block_table: torch.Tensor) -> TreeNodes:
    """The nodes tree attention recomputes in one step: those after their tree's leading chain
    (the chain's own rows are exact under the backend's causal mask). Built once per step on the
    host with NumPy, moved to the cache's device once, shared by every layer of a KV cache group.
    ``context_lens`` ``[B]``: tokens before each row's first draft node (root included)."""
    sizes, recomputed = plan.sizes, plan.off_chain
    request = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)[recomputed]
    index = (np.arange(len(plan.tokens)) - np.repeat(plan.offsets[:-1], sizes))[recomputed]
    device = block_table.device
    arrays = (plan.node_rows()[recomputed], request, context_lens[request].astype(np.int32),
              index.astype(np.int32), np.ascontiguousarray(plan.ancestors[recomputed]))
    rows, request_t, context, index_t, ancestors = (torch.from_numpy(a).to(device) for a in arrays)
    return TreeNodes(rows, block_table.to(torch.int32).contiguous(), request_t, context, index_t, ancestors)


@dataclass
class TreeKVGroup:
    """One KV cache group's part of a tree step: the node arrays its layers' tree attention
    reads (through the group's block table), every node's KV slot in its layers and the caches
    those layers wrote (by data pointer: layers of different groups may share one tensor)."""

    nodes: TreeNodes
    slots: torch.Tensor  # [N] KV slot of every node of the plan in this group's layers
    caches: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, plan: TreeStepPlan, context_lens: np.ndarray, metadata: object) -> TreeKVGroup:
        """From the attention metadata the group's layers share this step."""
        slot_mapping = metadata.slot_mapping
        rows = torch.from_numpy(plan.node_rows()).to(slot_mapping.device)
        return cls(tree_nodes(plan, context_lens, metadata.block_table), slot_mapping[rows].long())

    def add_cache(self, kv_cache: torch.Tensor) -> None:
        self.caches.setdefault(kv_cache.data_ptr(), kv_cache)

    def compact(self, head_size: int, layout: KVLayout, moves: torch.Tensor) -> None:
        """Move the K/V of nodes ``moves[:, 0]`` into the slots of nodes ``moves[:, 1]``."""
        compact_kv(list(self.caches.values()), head_size, layout, self.slots[moves.to(self.slots.device)])


@dataclass(frozen=True)
class TreeLayer:
    """One attention layer as tree attention reads and computes it (fixed when the runner starts)."""

    attention: LayerAttention
    layout: KVLayout

    @classmethod
    def of(cls, impl: object, layout: KVLayout) -> TreeLayer:
        return cls(layer_attention(impl), layout)


def apply_tree_attention(query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, nodes: TreeNodes,
                         tree_layer: TreeLayer) -> None:
    """Overwrite the recomputed draft rows in a layer's ``output`` with tree attention (their
    keys and values are already in ``kv_cache``)."""
    tree_attention(query.reshape(query.shape[0], -1), kv_cache, output.view(output.shape[0], -1), nodes,
                   tree_layer.layout, tree_layer.attention)


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
