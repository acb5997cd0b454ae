"""The vLLM ``custom_class`` plumbing shared by every proposer of this package.

vLLM builds the proposer with ``cls(vllm_config)``, calls ``load_model(target_model)`` once
and ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)`` after every
target step, expecting one list of at most ``num_speculative_tokens`` draft tokens per
input-batch row. This base class turns that call into a :class:`DraftBatch` of the rows
that need drafts, each with a token budget that respects ``num_speculative_tokens`` and
``max_model_len``; the subclass returns :class:`~vllm_retrieval_spec.drafts.Drafts`, read
back with one slice per step. A failure of the subclass becomes "no drafts this step"
(logged once, counted) instead of a dead server. In tree mode the trees go to the runner's
:class:`~vllm_retrieval_spec.verification.session.SpecSession`, bound by the integration.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
from vllm.logger import init_logger

from vllm_retrieval_spec.compat import require_supported_vllm
from vllm_retrieval_spec.drafts import Drafts, DraftTree
from vllm_retrieval_spec.options import RetrievalSpecOptions

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

logger = init_logger(__name__)


class DraftSession(Protocol):
    """What a proposer needs of the runner's session (``verification.session.SpecSession``)."""

    def publish(self, trees: Mapping[int, DraftTree]) -> None:
        """This step's trees by input-batch row."""


@dataclass
class DraftBatch:
    """The rows of one step that need drafts.

    ``token_ids`` and ``num_tokens`` are vLLM's own buffers (``token_ids_cpu`` and
    ``num_tokens_no_spec``): row ``i``'s context is ``token_ids[i, :num_tokens[i]]``. Only
    ``rows`` are to be drafted for, each with at most ``budgets[j]`` tokens; ``trees`` asks
    for draft trees as well as chains.
    """

    token_ids: np.ndarray
    num_tokens: np.ndarray
    rows: np.ndarray
    budgets: np.ndarray
    trees: bool = False

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

    def __init__(self, vllm_config: VllmConfig) -> None:
        require_supported_vllm()
        speculative_config = vllm_config.speculative_config
        self.num_speculative_tokens = int(speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.options = RetrievalSpecOptions.from_additional_config(vllm_config.additional_config)
        self.stats = ProposerStats()
        self.session: DraftSession | None = None

    def bind_session(self, session: DraftSession) -> None:
        """The runner's session (request ids, per-request state, tree verification)."""
        self.session = session

    def load_model(self, target_model: torch.nn.Module) -> None:  # noqa: B027 (an optional hook)
        """Called once with the loaded target model; retrieval proposers need nothing from it."""

    @abc.abstractmethod
    def draft(self, batch: DraftBatch) -> Drafts:
        """Drafts for every requested row (longer ones are cut to the row's budget), with
        trees when ``batch.trees``."""

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: object = None,
        **_: object,
    ) -> list[list[int]]:
        """vLLM's entry point: one list of draft token ids per input-batch row."""
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        batch = self._rows_needing_drafts(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        self.stats.steps += 1
        self.stats.rows += len(batch)
        if len(batch) == 0:
            return drafts
        try:
            found = self.draft(batch)
        except Exception as error:  # a drafting bug must never take the server down
            self._record_failure(error)
            return drafts
        trees = batch.trees and found.tree_tokens is not None  # some drafters only draft chains
        tokens, sizes = (found.tree_tokens, found.tree_size) if trees else (found.chain_tokens, found.chain_size)
        sizes = np.minimum(sizes, batch.budgets)
        rows, sizes_list = batch.rows.tolist(), sizes.tolist()
        for row, row_tokens, size in zip(rows, tokens.tolist(), sizes_list):
            drafts[row] = row_tokens[:size]
        self.stats.drafted_rows += int(np.count_nonzero(sizes))
        self.stats.draft_tokens += int(sizes.sum())
        if trees:
            self._publish_trees(drafts, rows, found.tree_parents.tolist(), sizes_list)
        return drafts

    def _publish_trees(self, drafts: list[list[int]], rows: list[int], parents: list[list[int]],
                       sizes: list[int]) -> None:
        """Hand this step's trees (tokens already cut to each row's budget) to the session."""
        self.session.publish({
            row: DraftTree(tuple(drafts[row]), tuple(row_parents[:size]))
            for row, row_parents, size in zip(rows, parents, sizes) if size
        })

    def _rows_needing_drafts(
        self, sampled_token_ids: list[list[int]], num_tokens: np.ndarray, token_ids: np.ndarray
    ) -> DraftBatch:
        """Rows that sampled tokens this step (not prefill chunks or discarded rows) and
        have room before ``max_model_len``."""
        sampled = np.fromiter(map(len, sampled_token_ids), dtype=np.int64, count=len(sampled_token_ids))
        room = self.max_model_len - num_tokens[: len(sampled)].astype(np.int64) - 1
        budgets = np.minimum(self.num_speculative_tokens, room)
        rows = np.flatnonzero((sampled > 0) & (budgets > 0)).astype(np.int32)
        return DraftBatch(token_ids=token_ids, num_tokens=num_tokens, rows=rows,
                          budgets=budgets[rows].astype(np.int32),
                          trees=self.options.tree and self.session is not None)

    def _record_failure(self, error: Exception) -> None:
        self.stats.failures += 1
        self.stats.last_error = f"{type(error).__name__}: {error}"
        if self.stats.failures == 1:
            logger.exception(
                "%s failed to draft; this and later failing steps get no drafts (output stays "
                "exact); see stats.failures for the count",
                type(self).__name__,
            )
