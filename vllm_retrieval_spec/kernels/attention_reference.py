"""Plain torch reference of tree attention (:mod:`vllm_retrieval_spec.kernels.attention`): per
node, gather the keys and values of its context and ancestors out of the paged cache (the last
``window`` of them with a sliding window) and run a dense softmax attention in float64, with
the soft-cap and the attention sinks applied to the scores."""

from __future__ import annotations

import torch

from vllm_retrieval_spec.kernels.attention import KVLayout, LayerAttention, NewKV, TreeNodes, kv_views


def node_positions(context: int, index: int, ancestor_row: torch.Tensor, window: int = 0) -> list[int]:
    """Cache positions node ``index`` attends to: the context, then its ancestors and itself
    (the node's path, in order), the last ``window`` of them when ``window > 0``."""
    words = [int(word) & (2**64 - 1) for word in ancestor_row.tolist()]
    ancestors = [a for a in range(index + 1) if (words[a // 64] >> (a % 64)) & 1]
    path = list(range(context)) + [context + a for a in ancestors]
    return path[-window:] if window > 0 else path


def attention_scores(query: torch.Tensor, keys: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """Scaled dot products ``[heads, keys]``, soft-capped when ``softcap > 0``."""
    scores = torch.einsum("hd,nhd->hn", query, keys) * scale
    return softcap * torch.tanh(scores / softcap) if softcap > 0 else scores


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the keys of each head, a sink (a key without a value) per head adding
    ``exp(sink)`` to the denominator."""
    if sinks is None:
        return scores.softmax(-1)
    return torch.cat([scores, sinks.double()[:, None]], dim=1).softmax(-1)[:, :-1]


def tree_attention_reference(query: torch.Tensor, kv_cache: torch.Tensor, nodes: TreeNodes, layout: KVLayout,
                             attention: LayerAttention) -> torch.Tensor:
    """What :func:`~vllm_retrieval_spec.kernels.attention.tree_attention` writes into rows
    ``nodes.rows`` of its output, node by node, as ``[nodes, heads, head_size]`` (host tensors)."""
    heads = attention.heads
    kv_heads, block_size, head_size = kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[3] // 2
    keys, values = kv_views(kv_cache, head_size, layout)
    queries = query.reshape(query.shape[0], heads, head_size)[nodes.rows]
    kv_head = torch.arange(heads) // (heads // kv_heads)
    out = torch.empty_like(queries)
    for m in range(len(nodes.rows)):
        positions = torch.tensor(node_positions(int(nodes.context[m]), int(nodes.index[m]), nodes.ancestors[m].cpu(),
                                                attention.window))
        table = nodes.block_table[int(nodes.request[m])].cpu().long()
        blocks, offsets = table[positions // block_size], positions % block_size
        k = keys[blocks, :, offsets].double()  # [keys, kv_heads, head_size]
        v = values[blocks, :, offsets].double()
        scores = attention_scores(queries[m].double(), k[:, kv_head], attention.scale, attention.softcap)
        weights = softmax_with_sinks(scores, attention.sinks)
        out[m] = torch.einsum("hn,nhd->hd", weights, v[:, kv_head]).to(out.dtype)
    return out


def write_kv_reference(kv_cache: torch.Tensor, new_kv: NewKV, head_size: int, layout: KVLayout) -> None:
    """Store ``new_kv``'s keys and values at their slots of ``kv_cache`` (slots < 0 skipped),
    through :func:`~vllm_retrieval_spec.kernels.attention.kv_views`."""
    keys, values = kv_views(kv_cache, head_size, layout)
    block_size = kv_cache.shape[2]
    slots = torch.as_tensor(new_kv.slots)
    stored = torch.nonzero(slots >= 0).flatten()
    blocks, offsets = slots[stored] // block_size, slots[stored] % block_size
    kv_heads = kv_cache.shape[1]
    keys[blocks, :, offsets] = torch.as_tensor(new_kv.keys)[stored].reshape(-1, kv_heads, head_size)
    values[blocks, :, offsets] = torch.as_tensor(new_kv.values)[stored].reshape(-1, kv_heads, head_size)
