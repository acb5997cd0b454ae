"""Tree attention on vLLM's paged KV cache (``csrc/tree_attention.h``).

Draft node ``m`` of a branching tree — request row ``node_request[m]`` of the block table,
local index ``node_index[m]``, ``node_context[m]`` context tokens (the root included) — attends
to the cache positions ``0 .. C-1`` of its request and to ``C + a`` for every ancestor-or-self
``a`` (bit ``a`` of ``ancestors[m]``), reading keys and values where the backend stored them:
nothing is copied out of the cache. In order those keys are the node's path, logical positions
``0 .. C - 1 + d`` for a node at depth ``d``: a sliding ``window`` of ``W`` keeps the last ``W``
(vLLM counts the window from the query's own position, the query included), ``softcap`` ``s``
maps each scaled score ``x`` to ``s * tanh(x / s)`` and ``sinks`` (one logit per query head)
add ``exp(sink)`` to each softmax's denominator, as gpt-oss's attention sinks do. CPU threads
(float32, bfloat16) or CUDA (float32, float16, bfloat16), matching the torch reference in
:mod:`vllm_retrieval_spec.kernels.attention_reference` to float32 rounding.

Per layer the cache is ``[num_blocks, kv_heads, block_size, 2 * head_size]`` in both layouts:

- :attr:`KVLayout.CPU_VEC` (``CPU_ATTN``, ``vec`` ISA: float32/bfloat16 without AMX): per
  (block, head) the keys are stored transposed (``[head_size, block_size]``) and followed by
  the values (``[block_size, head_size]``);
- :attr:`KVLayout.SPLIT_LAST_DIM` (``FLASH_ATTN``, ``TRITON_ATTN`` on GPUs): keys and values
  side by side on the last dimension.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from vllm_retrieval_spec.kernels.extension import cuda_torch, is_cuda_tensor, load_extension


class KVLayout(enum.Enum):
    """How one layer's paged KV cache stores keys and values (module docstring)."""

    CPU_VEC = "cpu_vec"
    SPLIT_LAST_DIM = "split_last_dim"

    @property
    def code(self) -> int:
        """The layout's number in ``csrc/tree_attention.h``."""
        return 0 if self is KVLayout.CPU_VEC else 1


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


@dataclass(frozen=True)
class TreeNodes:
    """The draft nodes tree attention recomputes in one step and KV cache group, on the cache's
    device, shared by every layer of the group (indices as the module docstring says)."""

    rows: Any  # [M] int64: each node's row of query and out
    block_table: Any  # [rows, width] int32
    request: Any  # [M] int32: each node's row of the block table
    context: Any  # [M] int32: tokens before the request's first node (the root included)
    index: Any  # [M] int32: each node's index in its tree
    ancestors: Any  # [M, words] uint64: ancestor-or-self bits (kernels.tree.pack_tree_masks' rows)


@dataclass(frozen=True)
class NewKV:
    """A step's keys and values that tree attention stores into the cache before it attends (CPU,
    :attr:`KVLayout.CPU_VEC`, as vLLM's ``cpu_attn_reshape_and_cache``): ``keys`` and ``values``
    ``[tokens, kv_heads * head_size]`` in the cache's dtype (rows may be strided), ``slots``
    ``[tokens]`` int64 (``block * block_size + offset``; < 0: not stored)."""

    keys: Any
    values: Any
    slots: Any


@dataclass(frozen=True)
class LayerAttention:
    """One attention layer as tree attention computes it: query heads, score scale and what the
    layer adds to the causal mask (``window`` and ``softcap`` 0: none; ``sinks`` ``[heads]``
    float32 on the cache's device, or None)."""

    heads: int
    scale: float
    window: int = 0
    softcap: float = 0.0
    sinks: Any = None


def host_view(array: Any) -> Any:
    """A NumPy view of a CPU torch tensor NumPy can hold (the extension takes it ~4x faster than
    through DLPack: ~1 µs against ~4 µs an array, 9 arrays a layer); anything else as it is."""
    if isinstance(array, torch.Tensor) and array.dtype != torch.bfloat16:
        return array.numpy()
    return array


def tree_attention(query: Any, kv_cache: Any, out: Any, nodes: TreeNodes, layout: KVLayout,
                   attention: LayerAttention, *, num_threads: int = 0, new_kv: NewKV | None = None) -> None:
    """Overwrite rows ``nodes.rows`` of ``out`` with the attention of those rows' queries over
    their paged context and ancestors (module docstring), after storing ``new_kv`` in the cache
    (CPU only).

    ``query`` and ``out`` ``[tokens, heads * head_size]`` (rows may be strided), ``kv_cache``
    ``[blocks, kv_heads, block_size, 2 * head_size]``, all on one device, the node arrays
    contiguous.
    """
    arrays = (query, kv_cache, out, nodes.rows, nodes.block_table, nodes.request, nodes.context, nodes.index,
              nodes.ancestors)
    on_cuda = is_cuda_tensor(kv_cache)
    if on_cuda:
        args, sinks = arrays, attention.sinks
    else:
        args, sinks = tuple(map(host_view, arrays)), host_view(attention.sinks)
    args += (attention.heads, layout.code, attention.scale)
    options = {"window": attention.window, "softcap": attention.softcap, "sinks": sinks}
    if on_cuda:
        if new_kv is not None:
            raise ValueError("tree attention stores new keys and values on the CPU only")
        stream = cuda_torch().cuda.current_stream(kv_cache.device).cuda_stream
        load_extension().tree_attention(*args, stream, **options)
    else:
        if new_kv is not None:
            options.update(new_keys=host_view(new_kv.keys), new_values=host_view(new_kv.values),
                           new_slots=host_view(new_kv.slots))
        load_extension().tree_attention(*args, num_threads, **options)
