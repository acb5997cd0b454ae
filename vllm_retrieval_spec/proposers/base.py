"""The vLLM ``custom_class`` plumbing shared by every proposer of this package.

vLLM builds the proposer with ``cls(vllm_config)``, calls ``load_model(target_model)`` once
and ``propose(...)`` after every target step (vllm-integration.md §2). This base class turns
that call into a :class:`DraftBatch` of the rows that need drafts, with a per-row token
budget that respects ``num_speculative_tokens`` and ``max_model_len``, and turns a failure
of the subclass into "no drafts this step" (logged once, counted) instead of a dead server.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.logger import init_logger

from vllm_retrieval_spec.integration.vllm_patches import require_supported_vllm
from vllm_retrieval_spec.options import RetrievalSpecOptions
from vllm_retrieval_spec.verification.trees import REGISTRY, DraftTree

logger = init_logger(__name__)


@dataclass
class DraftBatch:
    """The rows of one step that need drafts.

    ``token_ids`` and ``num_tokens`` are vLLM's own buffers (``token_ids_cpu`` and
    ``num_tokens_no_spec``): row ``i``'s context is ``token_ids[i, :num_tokens[i]]``. Only
    ``rows`` are to be drafted for, each with at most ``budgets[j]`` tokens.
    """

    token_ids: np.ndarray
    num_tokens: np.ndarray
    rows: np.ndarray
    budgets: np.ndarray

    def context(self, index: int) -> np.ndarray:
        """The full context of requested row ``index`` (a view, not a copy)."""
        row = int(self.rows[index])
        return self.token_ids[row, : int(self.num_tokens[row])]

    def __len__(self) -> int:
        return len(self.rows)


@dataclass
class ProposerStats:
    """Counters a proposer keeps for tests, benchmarks and operators."""

    steps: int = 0
    rows: int = 0
    drafted_rows: int = 0
    draft_tokens: int = 0
    failures: int = 0
    last_error: str | None = field(default=None, repr=False)


class DraftProposer(abc.ABC):
    """Base of every ``vllm_retrieval_spec.<Name>Proposer`` (vLLM's ``custom_class``)."""

    def __init__(self, vllm_config: Any) -> None:
        require_supported_vllm()
        speculative_config = vllm_config.speculative_config
        self.num_speculative_tokens = int(speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.options = RetrievalSpecOptions.from_additional_config(vllm_config.additional_config)
        self.stats = ProposerStats()
        # Request ids of the input-batch rows, set by the runner hook before each ``propose``
        # (tree mode keys its trees by request id).
        self.step_req_ids: list[str] | None = None

    def load_model(self, target_model: Any) -> None:
        """Called once with the loaded target model; retrieval proposers need nothing from it."""

    @abc.abstractmethod
    def draft(self, batch: DraftBatch) -> Sequence[Sequence[int]]:
        """One draft chain per requested row (longer chains are cut to the row's budget)."""

    def draft_trees(self, batch: DraftBatch) -> Sequence[DraftTree]:
        """One draft tree per requested row, parents first (tree mode); chains by default."""
        return [DraftTree.chain(chain) for chain in self.draft(batch)]

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
        **_: Any,
    ) -> list[list[int]]:
        """vLLM's entry point: one list of draft token ids per input-batch row."""
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        batch = self._rows_needing_drafts(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        self.stats.steps += 1
        self.stats.rows += len(batch)
        if len(batch) == 0:
            return drafts
        try:
            proposed = self.draft_trees(batch) if self.options.tree else [
                DraftTree.chain(chain) for chain in self.draft(batch)]
        except Exception as error:  # a drafting bug must never take the server down
            self._record_failure(error)
            REGISTRY.publish({})
            return drafts
        trees = {}
        for row, budget, tree in zip(batch.rows.tolist(), batch.budgets.tolist(), proposed):
            tree = tree.truncated(budget)
            drafts[row] = [int(token) for token in tree.tokens]
            if drafts[row]:
                self.stats.drafted_rows += 1
                self.stats.draft_tokens += len(drafts[row])
                if self.step_req_ids is not None:
                    trees[self.step_req_ids[row]] = tree
        if self.options.tree:
            REGISTRY.publish(trees)
        return drafts

    def _rows_needing_drafts(
        self, sampled_token_ids: list[list[int]], num_tokens: np.ndarray, token_ids: np.ndarray
    ) -> DraftBatch:
        rows, budgets = [], []
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled:  # prefill chunk or discarded row
                continue
            budget = min(self.num_speculative_tokens, self.max_model_len - int(num_tokens[row]) - 1)
            if budget > 0:
                rows.append(row)
                budgets.append(budget)
        return DraftBatch(
            token_ids=token_ids,
            num_tokens=num_tokens,
            rows=np.asarray(rows, dtype=np.int32),
            budgets=np.asarray(budgets, dtype=np.int32),
        )

    def _record_failure(self, error: Exception) -> None:
        self.stats.failures += 1
        self.stats.last_error = f"{type(error).__name__}: {error}"
        if self.stats.failures == 1:
            logger.exception(
                "%s failed to draft; this and later failing steps get no drafts (output stays "
                "exact); see stats.failures for the count",
                type(self).__name__,
            )
