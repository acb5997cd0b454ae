"""What the tree-mode hooks in :mod:`~vllm_retrieval_spec.integration.vllm_patches` do
inside vLLM's model runner (one target step):

1. ``_prepare_inputs`` → :func:`plan_tree_step`: look up each request's draft tree, set the
   draft nodes' rotary positions to ``base + depth`` and publish the step's plan;
2. attention → :func:`tree_attention`: draft rows of branching trees see only their
   ancestors (and the context); ``CPU_ATTN`` on the CPU build, ``FLASH_ATTN`` or
   ``TRITON_ATTN`` on CUDA GPUs (full CUDA graphs are turned into piecewise ones there, so
   attention runs eagerly);
3. ``rejection_sampler`` → :class:`TreeRejectionSampler`: walk the trees, emit the accepted
   path plus one token, then :func:`compact` the accepted path's K/V into the slots the
   scheduler keeps.

Steps whose drafts are all chains (or absent) publish no plan: vLLM's own chain path is
exact for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger

from vllm_retrieval_spec.verification import tree_attention as tree_attention_ops
from vllm_retrieval_spec.verification.tree_attention import KVLayout
from vllm_retrieval_spec.verification.trees import REGISTRY, DraftTree, TreeStepPlan

logger = init_logger(__name__)


@dataclass
class TreeVerificationStats:
    """Process-wide counters of tree verification (for tests, benchmarks and operators)."""

    tree_steps: int = 0  # target steps that verified at least one branching tree
    tree_requests: int = 0  # request-steps verified as trees
    compacted_slots: int = 0  # K/V slots moved after acceptance


STATS = TreeVerificationStats()
ACTIVE_PLAN: TreeStepPlan | None = None
_layout_checked = False


class TreeModeError(RuntimeError):
    """Tree verification cannot run in this configuration."""


def install(runner: Any) -> None:
    """Called at the end of the runner's ``__init__`` when tree mode is on."""
    from vllm_retrieval_spec.verification.sampler import TreeRejectionSampler

    if runner.device.type not in ("cpu", "cuda"):
        raise TreeModeError(
            f"retrieval_spec.tree (tree verification) runs on CPUs and CUDA GPUs, not on "
            f"{runner.device.type}; use chain mode (leave retrieval_spec.tree false)"
        )
    if len(runner.input_batch.block_table.block_tables) != 1:
        raise TreeModeError("tree verification supports models with one KV cache group (full attention)")
    if runner.device.type == "cuda":
        keep_attention_eager(runner.compilation_config)
    runner.rejection_sampler = TreeRejectionSampler(
        runner.sampler, current_plan=lambda: ACTIVE_PLAN, compact=lambda plan, path, accepted: compact(runner, plan, path, accepted)
    )


def keep_attention_eager(compilation_config: Any) -> None:
    """Full CUDA graphs would replay attention without the tree fix-up: keep piecewise graphs
    (attention runs eagerly between them), as ``--compilation-config '{"cudagraph_mode":
    "PIECEWISE"}'`` would."""
    from vllm.config import CUDAGraphMode

    mode = compilation_config.cudagraph_mode
    if mode is not None and mode.has_full_cudagraphs():
        logger.info("retrieval_spec.tree: cudagraph_mode %s -> PIECEWISE (tree attention runs eagerly)", mode.name)
        compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE


def plan_tree_step(runner: Any, scheduler_output: Any) -> None:
    """Build this step's plan (or none) and move draft positions to ``base + depth``."""
    global ACTIVE_PLAN
    ACTIVE_PLAN = None
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    if not spec_tokens:
        return
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    starts = runner.query_start_loc.np[: num_reqs + 1]
    rows = []
    for row, req_id in enumerate(batch.req_ids[:num_reqs]):
        scheduled = spec_tokens.get(req_id, ())
        tree = REGISTRY.tree_for(req_id, scheduled) if scheduled else DraftTree((), ())
        rows.append((row, int(starts[row]), tree))
    plan = TreeStepPlan.build(rows)
    if not plan.is_branching():
        return
    end = plan.requests[-1].query_start + 1 + plan.requests[-1].num_nodes
    slots = batch.block_table.block_tables[0].slot_mapping.gpu[:end].cpu().numpy().astype(np.int64)
    plan.draft_slots = []
    for request in plan.requests:
        first = request.query_start + 1
        draft = slice(first, first + request.num_nodes)
        if request.num_nodes:
            depth = torch.from_numpy(request.depth).to(runner.positions.device, runner.positions.dtype)
            runner.positions[draft] = runner.positions[request.query_start] + depth
        plan.draft_slots.append(slots[draft])
    STATS.tree_steps += 1
    STATS.tree_requests += sum(1 for request in plan.requests if request.num_nodes)
    ACTIVE_PLAN = plan


def tree_attention(impl: Any, layer: Any, query, key, value, kv_cache, metadata, output, plan: TreeStepPlan,
                   layout: KVLayout) -> None:
    """Recompute the draft rows of branching trees with the tree mask."""
    global _layout_checked
    if not _layout_checked:
        tree_attention_ops.require_plain_attention(impl)
        if layout is KVLayout.CPU_VEC:
            tree_attention_ops.require_cpu_isa(layer.isa)
        n = metadata.num_actual_tokens
        tree_attention_ops.check_layout(kv_cache, layout, metadata.slot_mapping[:n].long(), key[:n], value[:n])
        _layout_checked = True
    if plan.tree_rows is None:
        plan.tree_rows = tree_attention_ops.TreeRows.build(plan.requests, metadata.seq_lens, metadata.block_table,
                                                           kv_cache.shape[2])
        plan.kv_layout = layout
    tree_attention_ops.apply_tree_attention(impl, query, key, value, kv_cache, layout, output, plan.tree_rows)


def compact(runner: Any, plan: TreeStepPlan, path_nodes: np.ndarray, num_accepted: np.ndarray) -> None:
    """Move each accepted node's K/V into the draft slot of its depth, then retire the plan."""
    global ACTIVE_PLAN
    if plan.kv_layout is None:
        raise TreeModeError(
            "this step verified draft trees but no attention layer applied the tree mask: the "
            "attention backend is not one tree verification supports (CPU_ATTN on the CPU build, "
            "FLASH_ATTN or TRITON_ATTN on GPUs; pick one with --attention-backend) or use chain mode"
        )
    moves = []
    for request, slots, path, accepted in zip(plan.requests, plan.draft_slots, path_nodes, num_accepted):
        for depth_index in range(int(accepted)):
            node = int(path[depth_index])
            if node != depth_index:
                moves.append((int(slots[node]), int(slots[depth_index])))
    STATS.compacted_slots += len(moves)
    if moves:
        head_size = runner.model_config.get_head_size()
        tree_attention_ops.compact_kv(runner.kv_caches, head_size, plan.kv_layout, torch.tensor(moves, dtype=torch.long))
    ACTIVE_PLAN = None


CHAIN_ONLY_FEATURES = {
    "presence_penalty": lambda p: p.presence_penalty != 0.0,
    "frequency_penalty": lambda p: p.frequency_penalty != 0.0,
    "repetition_penalty": lambda p: p.repetition_penalty != 1.0,
    "min_p": lambda p: p.min_p != 0.0,
    "min_tokens": lambda p: p.min_tokens > 0,
    "bad_words": lambda p: bool(p.bad_words),
    "logit_bias": lambda p: bool(p.logit_bias),
    "allowed_token_ids": lambda p: bool(p.allowed_token_ids),
    "structured_outputs": lambda p: p.structured_outputs is not None,
}


def refuse_chain_only_features(params: Any) -> None:
    """Reject (HTTP 400 on the server) sampling features tree verification does not apply to
    draft nodes, instead of silently changing the output."""
    from vllm.exceptions import VLLMValidationError

    if not hasattr(params, "temperature"):  # pooling requests
        return
    used = [name for name, in_use in CHAIN_ONLY_FEATURES.items() if in_use(params)]
    if used:
        raise VLLMValidationError(
            f"{', '.join(used)} cannot be used while the server verifies draft trees "
            "(retrieval_spec.tree); drop them or serve without tree mode",
            parameter=used[0],
        )
