"""Plain torch reference of tree attention (:mod:`vllm_retrieval_spec.kernels.attention`): per
node, gather the keys and values of its context and ancestors out of the paged cache and run a
dense softmax attention in float64."""

from __future__ import annotations

import torch

from vllm_retrieval_spec.kernels.attention import KVLayout, kv_views


def node_positions(context: int, index: int, ancestor_row: torch.Tensor) -> list[int]:
    """Cache positions node ``index`` attends to: the context, then its ancestors and itself."""
    words = [int(word) & (2**64 - 1) for word in ancestor_row.tolist()]
    ancestors = [a for a in range(index + 1) if (words[a // 64] >> (a % 64)) & 1]
    return list(range(context)) + [context + a for a in ancestors]


def tree_attention_reference(
    query: torch.Tensor, kv_cache: torch.Tensor, layout: KVLayout, block_table: torch.Tensor,
    node_request: torch.Tensor, node_context: torch.Tensor, node_index: torch.Tensor,
    ancestors: torch.Tensor, scale: float,
) -> torch.Tensor:
    """What :func:`~vllm_retrieval_spec.kernels.attention.tree_attention` computes, node by node."""
    heads, head_size = query.shape[1], query.shape[2]
    keys, values = kv_views(kv_cache, head_size, layout)
    block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[1]
    out = torch.empty_like(query)
    for m in range(query.shape[0]):
        positions = torch.tensor(node_positions(int(node_context[m]), int(node_index[m]), ancestors[m].cpu()))
        table = block_table[int(node_request[m])].cpu().long()
        blocks, offsets = table[positions // block_size], positions % block_size
        k = keys[blocks, :, offsets].double()  # [keys, kv_heads, head_size]
        v = values[blocks, :, offsets].double()
        kv_head = torch.arange(heads) // (heads // kv_heads)
        weights = torch.einsum("hd,nhd->hn", query[m].double(), k[:, kv_head]) * scale
        out[m] = torch.einsum("hn,nhd->hd", weights.softmax(-1), v[:, kv_head]).to(out.dtype)
    return out
