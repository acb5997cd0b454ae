"""What the tree-mode hooks in :mod:`~vllm_retrieval_spec.integration.vllm_patches` do
inside vLLM's model runner (one target step):

1. ``_prepare_inputs`` → :func:`plan_tree_step`: look up each request's draft tree, set the
   draft nodes' rotary positions to ``base + depth`` and publish the step's plan;
2. attention → :func:`tree_attention`: draft rows of branching trees see only their
   ancestors (and the context);
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

from vllm_retrieval_spec.verification import cpu_attention
from vllm_retrieval_spec.verification.trees import REGISTRY, DraftTree, TreeStepPlan



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

    if runner.device.type != "cpu":
        raise TreeModeError(
            "retrieval_spec.tree (tree verification) runs on vLLM's CPU build in this release; "
            f"on {runner.device.type} use chain mode (leave retrieval_spec.tree false)"
        )
    if len(runner.input_batch.block_table.block_tables) != 1:
        raise TreeModeError("tree verification supports models with one KV cache group (full attention)")
    runner.rejection_sampler = TreeRejectionSampler(
        runner.sampler, current_plan=lambda: ACTIVE_PLAN, compact=lambda plan, path, accepted: compact(runner, plan, path, accepted)
    )


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
    slot_mapping = batch.block_table.block_tables[0].slot_mapping.gpu
    plan.draft_slots = []
    for request in plan.requests:
        first = request.query_start + 1
        draft = slice(first, first + request.num_nodes)
        if request.num_nodes:
            runner.positions[draft] = runner.positions[request.query_start] + torch.from_numpy(request.depth).to(runner.positions.dtype)
        plan.draft_slots.append(slot_mapping[draft].clone().long())
    STATS.tree_steps += 1
    STATS.tree_requests += sum(1 for request in plan.requests if request.num_nodes)
    ACTIVE_PLAN = plan


def tree_attention(impl: Any, layer: Any, query, key, value, kv_cache, metadata, output, plan: TreeStepPlan) -> None:
    """Recompute the draft rows of branching trees with the tree mask (CPU backend)."""
    global _layout_checked
    if not _layout_checked:
        cpu_attention.require_plain_attention(impl)
        n = metadata.num_actual_tokens
        cpu_attention.check_layout(kv_cache, metadata.slot_mapping[:n].long(), key[:n], value[:n], layer.isa)
        _layout_checked = True
    if plan.tree_rows is None:
        plan.tree_rows = cpu_attention.TreeRows.build(plan.requests, metadata.seq_lens, metadata.block_table, kv_cache.shape[2])
    cpu_attention.apply_tree_attention(impl, query, key, value, kv_cache, output, plan.tree_rows)


def compact(runner: Any, plan: TreeStepPlan, path_nodes: np.ndarray, num_accepted: np.ndarray) -> None:
    """Move each accepted node's K/V into the draft slot of its depth, then retire the plan."""
    global ACTIVE_PLAN
    moves = []
    for request, slots, path, accepted in zip(plan.requests, plan.draft_slots, path_nodes, num_accepted):
        for depth_index in range(int(accepted)):
            node = int(path[depth_index])
            if node != depth_index:
                moves.append((int(slots[node]), int(slots[depth_index])))
    STATS.compacted_slots += len(moves)
    if moves:
        head_size = runner.model_config.get_head_size()
        cpu_attention.compact_kv(runner.kv_caches, head_size, torch.tensor(moves, dtype=torch.long))
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
