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


def tree_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, layout: KVLayout, node_row: torch.Tensor,
    block_table: torch.Tensor, node_request: torch.Tensor, node_context: torch.Tensor,
    node_index: torch.Tensor, ancestors: torch.Tensor, heads: int, scale: float, out: torch.Tensor,
    *, window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None, num_threads: int = 0,
) -> None:
    """Overwrite rows ``node_row`` of ``out`` with the attention of those rows' queries over
    their paged context and ancestors (module docstring).

    ``query`` and ``out`` ``[tokens, heads * head_size]`` (rows may be strided), ``node_row``
    ``[nodes]`` int64, ``block_table`` ``[rows, width]``, ``node_*`` ``[nodes]`` int32,
    ``ancestors`` ``[nodes, words]`` uint64 (``kernels.tree.pack_tree_masks``' rows), all on
    the cache's device, the index arrays contiguous. ``window`` ``0`` and ``softcap`` ``0`` mean
    none; ``sinks`` ``[heads]`` float32 on the cache's device, or ``None``.
    """
    args = (query, kv_cache, out, node_row, block_table, node_request, node_context, node_index, ancestors,
            heads, layout.code, scale)
    options = {"window": window, "softcap": softcap, "sinks": sinks}
    if is_cuda_tensor(kv_cache):
        stream = cuda_torch().cuda.current_stream(kv_cache.device).cuda_stream
        load_extension().tree_attention(*args, stream, **options)
    else:
        load_extension().tree_attention(*args, num_threads, **options)
