"""Tree attention and KV compaction on vLLM's CPU attention backend (``CPU_ATTN``).

The backend's C++ kernel only knows causal masks. A tree step runs it unchanged, which is
already exact for every non-draft row and for the root row of a tree (it sees the context
only); the draft rows of branching trees are then recomputed here with the tree mask: each
node sees the whole context and its ancestors and itself. Chains need no fix-up (causal is
their tree mask).

KV layout of the ``vec`` ISA (float32/bfloat16 without AMX), per layer
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``: per (block, head) the keys are
stored transposed (``[head_size, block_size]``) and followed by the values
(``[block_size, head_size]``). :func:`check_layout` verifies this against the keys and
values the backend has just written, once per process, so another layout fails loudly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_retrieval_spec.verification.trees import TreeRequest, tree_branches

SUPPORTED_ISAS = ("vec",)


class TreeAttentionError(RuntimeError):
    """Tree verification cannot run with this attention configuration."""


def split_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``keys [blocks, kv_heads, head_size, block_size]`` and ``values [blocks,
    kv_heads, block_size, head_size]`` of one layer's cache."""
    blocks, kv_heads, block_size, _ = kv_cache.shape
    halves = kv_cache.view(blocks, kv_heads, 2, block_size * head_size)
    keys = halves[:, :, 0].view(blocks, kv_heads, head_size, block_size)
    values = halves[:, :, 1].view(blocks, kv_heads, block_size, head_size)
    return keys, values


def read_slots(kv_cache: torch.Tensor, head_size: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[len(slots), kv_heads, head_size]`` stored at ``slots``."""
    keys, values = split_cache(kv_cache, head_size)
    block_size = kv_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    return keys[blocks, :, :, offsets], values[blocks, :, offsets]


def check_layout(kv_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, isa: str) -> None:
    """Fail clearly unless the cache holds ``key``/``value`` at ``slots`` in the layout above."""
    if isa not in SUPPORTED_ISAS:
        raise TreeAttentionError(
            f"tree verification on the CPU build supports the attention ISA(s) {SUPPORTED_ISAS}, "
            f"this machine uses {isa!r}; run without retrieval_spec.tree (chain mode)"
        )
    n, kv_heads = slots.shape[0], kv_cache.shape[1]
    stored_k, stored_v = read_slots(kv_cache, kv_cache.shape[-1] // 2, slots)
    if not (torch.equal(stored_k, key.reshape(n, kv_heads, -1)) and torch.equal(stored_v, value.reshape(n, kv_heads, -1))):
        raise TreeAttentionError(
            "the CPU attention KV cache layout is not the one tree verification reads (vLLM "
            "version or ISA changed); run without retrieval_spec.tree (chain mode)"
        )


@dataclass
class TreeRows:
    """Index tensors of one step's branching trees, padded to ``[R, nodes]`` (built once per
    step, shared by every layer)."""

    rows: torch.Tensor  # [R, N] flat token index of each draft node (padding: 0)
    valid: torch.Tensor  # [R, N] bool
    blocks: torch.Tensor  # [R, context blocks] block ids of each request's context
    mask: torch.Tensor  # [R, N, C + N] bool: what each node may attend to
    context_len: int  # C, the longest context

    @classmethod
    def build(cls, requests: Sequence[TreeRequest], seq_lens: torch.Tensor, block_table: torch.Tensor,
              block_size: int) -> TreeRows:
        branching = [r for r in requests if tree_branches(r.tree)]
        nodes = max(r.num_nodes for r in branching)
        contexts = [int(seq_lens[r.row]) - r.num_nodes for r in branching]
        context_len = max(contexts)
        num_blocks = (context_len + block_size - 1) // block_size
        rows = torch.zeros(len(branching), nodes, dtype=torch.long)
        valid = torch.zeros(len(branching), nodes, dtype=torch.bool)
        mask = torch.zeros(len(branching), nodes, context_len + nodes, dtype=torch.bool)
        mask[:, :, 0] = True  # padded rows attend somewhere (their output is discarded)
        for i, (request, context) in enumerate(zip(branching, contexts)):
            n, first = request.num_nodes, request.query_start + 1
            rows[i, :n] = torch.arange(first, first + n)
            valid[i, :n] = True
            mask[i, :n, :context] = True
            mask[i, :n, context_len : context_len + n] = request.visible
        blocks = block_table[[r.row for r in branching], :num_blocks].long()
        return cls(rows, valid, blocks, mask, context_len)


def gather_context(kv_cache: torch.Tensor, head_size: int, tree_rows: TreeRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of every request's context, ``[R, kv_heads, C, head_size]``."""
    keys, values = split_cache(kv_cache, head_size)
    r, kv_heads, c = tree_rows.blocks.shape[0], kv_cache.shape[1], tree_rows.context_len
    k = keys[tree_rows.blocks].permute(0, 2, 1, 4, 3).reshape(r, kv_heads, -1, head_size)[:, :, :c]
    v = values[tree_rows.blocks].permute(0, 2, 1, 3, 4).reshape(r, kv_heads, -1, head_size)[:, :, :c]
    return k, v


def apply_tree_attention(
    impl: object, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    kv_cache: torch.Tensor, output: torch.Tensor, tree_rows: TreeRows,
) -> None:
    """Overwrite the draft rows of branching trees in ``output`` with tree attention."""
    heads, head_size = impl.num_heads, impl.head_size
    kv_heads = kv_cache.shape[1]
    r, n = tree_rows.rows.shape
    ctx_k, ctx_v = gather_context(kv_cache, head_size, tree_rows)
    flat = tree_rows.rows.reshape(-1)
    node_k = key.reshape(-1, kv_heads, head_size)[flat].view(r, n, kv_heads, head_size).transpose(1, 2)
    node_v = value.reshape(-1, kv_heads, head_size)[flat].view(r, n, kv_heads, head_size).transpose(1, 2)
    q = query.reshape(-1, heads, head_size)[flat].view(r, n, heads, head_size).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat([ctx_k, node_k], dim=2), torch.cat([ctx_v, node_v], dim=2),
        attn_mask=tree_rows.mask.unsqueeze(1), scale=impl.scale, enable_gqa=heads != kv_heads,
    )
    rows_out = output.view(output.shape[0], heads, head_size)
    valid = tree_rows.valid
    rows_out[tree_rows.rows[valid]] = out.transpose(1, 2)[valid].to(output.dtype)


def require_plain_attention(impl: object) -> None:
    """Tree rows are recomputed without sliding windows, soft-caps, ALiBi or sinks."""
    if (impl.sliding_window not in (-1, None) or impl.logits_soft_cap or impl.alibi_slopes is not None
            or getattr(impl, "sinks", None) is not None):
        raise TreeAttentionError(
            "tree verification supports plain causal attention only (no sliding window, "
            "soft-cap, ALiBi or attention sinks); run without retrieval_spec.tree"
        )


def compact_kv(kv_caches: Sequence[torch.Tensor], head_size: int, moves: torch.Tensor) -> None:
    """Copy the K/V of slots ``moves[:, 0]`` into ``moves[:, 1]`` in every layer, in order
    (a source is never an earlier destination: the accepted path only moves forward)."""
    if moves.numel() == 0:
        return
    src, dst = moves[:, 0], moves[:, 1]
    for kv_cache in kv_caches:
        keys, values = split_cache(kv_cache, head_size)
        block_size = kv_cache.shape[2]
        sb, so, db, do = src // block_size, src % block_size, dst // block_size, dst % block_size
        keys[db, :, :, do] = keys[sb, :, :, so]
        values[db, :, do] = values[sb, :, so]
