"""Attention of decode and verification steps on the CPU build, with the plugin's kernel.

vLLM's CPU attention (``CPU_ATTN``) reads a request's keys and values once per query token: a
verification step of ``k`` tokens a request costs ``k`` decode steps' attention (~1 ms a token
over SmolLM2-135M's 30 layers at 600 tokens of context on a 2-core VM, whatever ``k``). The
tree-attention kernel (:mod:`vllm_retrieval_spec.kernels.attention`) scores each block of a
request's context for all of its query rows at once, so a step whose requests bring several
tokens each reads every key and value once. A causal step is a chain: token ``j`` of a request
whose ``q`` tokens end at position ``L - 1`` has ``L - q`` tokens of context and the step's
tokens ``0 .. j`` as its ancestors-or-self (:func:`chain_nodes`). The kernel folds a chain's own
keys with the cache blocks they lie in, so a token's attention is bit for bit the same whatever
its step brought: with the row-invariant skinny GEMM, a position's logits do not depend on the
drafts.

:class:`StepAttention` (one per model runner, with ``cpu_step_attention``) therefore computes
every causal step of a float32 layer, one-token decodes and short prefills included: the rows
of requests bringing at most :data:`MAX_QUERY_TOKENS` tokens; a step with longer prefills runs
vLLM's kernel first and then overwrites the other requests' rows. In a tree step the draft
rows after each tree's leading chain join the step's nodes as the fix-up gives them
(:func:`with_tree_rows`), so that one call a layer computes the whole tree and the fix-up has
nothing left to do; the kernel tiles the leading chain apart from them, so its rows still fold
as a causal step's. The step's node arrays are built once, with NumPy, for every layer of its KV
cache group. Keys and values are read where the backend has already written them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from vllm_retrieval_spec.kernels.attention import KVLayout, NewKV, TreeNodes, tree_attention
from vllm_retrieval_spec.verification.tree_attention import (
    TreeAttentionError,
    TreeLayer,
    apply_tree_attention,
    check_layout,
    require_cpu_isa,
    unsupported_attention,
)

logger = logging.getLogger(__name__)

MAX_QUERY_TOKENS = 64  # a request's tokens in one step, so that one ancestor word holds them


@dataclass(frozen=True)
class StepNodes:
    """The rows of a step the kernel computes: every request's (``whole_step``), or, beside
    requests bringing more than :data:`MAX_QUERY_TOKENS` tokens, the others' (vLLM's kernel
    computes the step first). ``tree_rows``: they include the rows the tree fix-up would
    recompute, with their tree ancestors."""

    nodes: TreeNodes
    whole_step: bool
    tree_rows: bool = False
    alone: bool = False  # every row of the step, and no tree fix-up after it


def chain_nodes(query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray) -> StepNodes | None:
    """The tokens of a causal step as nodes of their requests' chains, for the requests bringing
    at most :data:`MAX_QUERY_TOKENS` tokens (None: no such request). ``query_start_loc``
    ``[B + 1]``, ``seq_lens`` ``[B]`` (context and the step's tokens), ``block_table``
    ``[B, width]``, all on the host."""
    query_lens = np.diff(query_start_loc)
    served = np.flatnonzero(query_lens <= MAX_QUERY_TOKENS)
    if served.size == 0:
        return None
    lens = query_lens[served]
    starts = np.repeat(query_start_loc[served], lens)
    index = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    ancestors = (np.uint64(2) << index.astype(np.uint64)) - np.uint64(1)  # bits 0..j (all 64 for j = 63)
    nodes = TreeNodes(
        rows=starts + index,
        block_table=np.ascontiguousarray(block_table, dtype=np.int32),
        request=np.repeat(served.astype(np.int32), lens),
        context=np.repeat(seq_lens[served] - lens, lens).astype(np.int32),
        index=index.astype(np.int32),
        ancestors=ancestors.reshape(-1, 1),
    )
    return StepNodes(nodes, whole_step=served.size == query_lens.size)


def step_attention_serves(impl: object) -> bool:
    """Whether the kernel can compute this attention layer: a decoder layer of vLLM's CPU
    backend whose mask and cache tree attention reproduces (no ALiBi, no quantized cache)."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    return (isinstance(impl, CPUAttentionBackendImpl) and impl.attn_type == AttentionType.DECODER
            and unsupported_attention(impl) is None)


def without_rows(nodes: TreeNodes, rows: np.ndarray) -> TreeNodes:
    """``nodes`` but those of the given rows (host arrays)."""
    keep = ~np.isin(nodes.rows, rows)
    return TreeNodes(nodes.rows[keep], nodes.block_table, nodes.request[keep], nodes.context[keep],
                     nodes.index[keep], nodes.ancestors[keep])


def with_tree_rows(step: TreeNodes, tree: TreeNodes) -> TreeNodes | None:
    """``step``'s chain nodes with the rows of ``tree`` (the tree fix-up's nodes:
    :func:`~vllm_retrieval_spec.verification.tree_attention.tree_nodes`) as the fix-up gives them,
    or None when a row of ``tree`` is not among them or its ancestors need a second word. The
    fix-up counts a tree's root in its context, so the kernel tiles its rows apart from the
    leading chain's (tiles hold one context), which fold as a causal step's."""
    rows = tree.rows.numpy()
    at = np.minimum(np.searchsorted(step.rows, rows), len(step.rows) - 1)
    tree_ancestors = tree.ancestors.numpy()
    if not np.array_equal(step.rows[at], rows) or tree_ancestors[:, 1:].any():
        return None
    context, index, ancestors = step.context.copy(), step.index.copy(), step.ancestors.copy()
    context[at], index[at], ancestors[at, 0] = tree.context.numpy(), tree.index.numpy(), tree_ancestors[:, 0]
    return TreeNodes(step.rows, step.block_table, step.request, context, index, ancestors)


class StepAttention:
    """One runner's attention on causal steps (module docstring): the node arrays of the step's
    KV cache groups, rebuilt when a group's attention metadata changes. The first step it
    computes checks that the cache holds the keys and values where the kernel reads them; if
    not (another ISA or vLLM version), or if the kernel refuses a step's arrays, vLLM's kernel
    computes that step and every later one (a warning says why) rather than the engine stopping."""

    def __init__(self, tree_rows: Callable[[object], TreeNodes | None] = lambda metadata: None) -> None:
        self._tree_rows = tree_rows  # the rows the tree fix-up recomputes (SpecSession's)
        self._computed_tree_rows = False  # the last layer computed them
        self._metadata: list[object] = []
        self._nodes: list[StepNodes | None] = []
        self.enabled = True
        self.layer_calls = 0  # layers it computed, over every step
        self.tree_layer_calls = 0  # of which with the rows of branching trees
        self.whole_layer_calls = 0  # of which with the layer's cache update (layer_forward)
        self._layout_checked = False

    def nodes_for(self, metadata: object) -> StepNodes | None:
        """The chain nodes of this step's group (None: vLLM's kernel computes the step)."""
        for i, known in enumerate(self._metadata):
            if known is metadata:
                return self._nodes[i]
        if len(self._metadata) > 4:  # a new step: forget the last one's groups
            self._metadata.clear()
            self._nodes.clear()
        nodes = self._build(metadata)
        self._metadata.append(metadata)
        self._nodes.append(nodes)
        return nodes

    def _build(self, metadata: object) -> StepNodes | None:
        if metadata.causal is not True or getattr(metadata, "dynamic_causal", None) is not None:
            return None
        batch = metadata.seq_lens.shape[0]
        step = chain_nodes(metadata.query_start_loc[: batch + 1].numpy(), metadata.seq_lens.numpy(),
                           metadata.block_table[:batch].numpy())
        if step is None:
            return None
        if (tree := self._tree_rows(metadata)) is None:
            return replace(step, alone=step.whole_step)
        merged = with_tree_rows(step.nodes, tree)
        if merged is None:  # a tree beyond MAX_QUERY_TOKENS: the fix-up computes its rows after vLLM's kernel
            return StepNodes(without_rows(step.nodes, tree.rows.numpy()), step.whole_step)
        return StepNodes(merged, step.whole_step, tree_rows=True)

    def take_computed_tree_rows(self) -> bool:
        """Whether the layer computed last holds the tree fix-up's rows (and forget it)."""
        computed, self._computed_tree_rows = self._computed_tree_rows, False
        return computed

    def forward(self, layer: object, tree_layer: TreeLayer, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, metadata: object, output: torch.Tensor,
                vllm_attention: Callable[[], Any]) -> Any:
        """The layer's attention into ``output``: by the kernel for the rows it serves, by
        ``vllm_attention`` (vLLM's kernel on the whole step) first where it does not serve them
        all; returns ``output``, or what ``vllm_attention`` returned when it alone computed."""
        nodes = self.nodes_for(metadata) if self.enabled and metadata is not None else None
        if nodes is None or not (self._layout_checked or self._check_layout(layer, key, value, kv_cache, metadata)):
            return vllm_attention()
        if not nodes.whole_step:
            vllm_attention()
        tokens = metadata.num_actual_tokens
        try:
            apply_tree_attention(query[:tokens], kv_cache, output[:tokens], nodes.nodes, tree_layer)
        except (IndexError, ValueError) as error:  # the kernel refused the step before computing
            self._turn_off(error)
            return vllm_attention()
        self.layer_calls += 1
        self.tree_layer_calls += nodes.tree_rows
        self._computed_tree_rows = nodes.tree_rows
        return output

    def layer_forward(self, layer: object, tree_layer: TreeLayer, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, vllm_forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """An ``Attention`` layer's whole forward in one kernel call on steps the kernel computes
        alone: it stores the step's keys and values in the cache and attends, where vLLM's layer
        calls its cache update and its backend through two custom ops (~100 µs a layer on the
        2-core VM); ``vllm_forward`` (the layer's own) on any other step."""
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        metadata, slots = context.attn_metadata, context.slot_mapping
        if not (self.enabled and self._layout_checked and isinstance(metadata, dict) and isinstance(slots, dict)):
            return vllm_forward()
        metadata, slots = metadata.get(layer.layer_name), slots.get(layer.layer_name)
        step = self.nodes_for(metadata) if metadata is not None and slots is not None else None
        tokens = query.shape[0]
        if (step is None or not step.alone or query.dim() != 2 or key.dim() != 2 or value.dim() != 2
                or tokens != metadata.num_actual_tokens or slots.shape[0] > tokens):
            return vllm_forward()
        output = torch.empty(tokens, query.shape[1], dtype=query.dtype)
        try:
            tree_attention(query, layer.kv_cache, output, step.nodes, tree_layer.layout, tree_layer.attention,
                           new_kv=NewKV(key, value, slots))
        except (IndexError, ValueError, TypeError) as error:  # refused before attending
            self._turn_off(error)
            return vllm_forward()
        self.layer_calls += 1
        self.whole_layer_calls += 1
        return output

    def _turn_off(self, error: Exception) -> None:
        logger.warning("retrieval_spec.cpu_step_attention: off, vLLM's attention computes every step (%s)", error)
        self.enabled = False

    def _check_layout(self, layer: object, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      metadata: object) -> bool:
        tokens = metadata.num_actual_tokens
        try:
            require_cpu_isa(getattr(layer, "isa", ""))
            check_layout(kv_cache, KVLayout.CPU_VEC, metadata.slot_mapping[:tokens].long(), key[:tokens],
                         value[:tokens])
        except TreeAttentionError as error:
            self._turn_off(error)
            return False
        self._layout_checked = True
        return True
