"""Test-only proposers (importable in the in-process engine, which shares sys.path, and in a
server started with ``tests/`` on ``PYTHONPATH``)."""

from __future__ import annotations

from vllm_retrieval_spec.drafts import ChainDrafts
from vllm_retrieval_spec.proposers.base import DraftBatch, DraftProposer
from vllm_retrieval_spec.proposers.prompt_lookup import PromptLookupProposer


class FailingEveryThirdStepProposer(PromptLookupProposer):
    """Prompt lookup that raises on every third call: the server must keep going."""

    def draft(self, batch: DraftBatch):
        if self.stats.steps % 3 == 0:
            raise RuntimeError("injected drafting failure")
        return super().draft(batch)


class OverlongProposer(DraftProposer):
    """Always drafts far more than K tokens of a fixed token: must be cut to the budget."""

    def draft(self, batch: DraftBatch):
        return ChainDrafts.from_lists([[1] * (3 * self.num_speculative_tokens)] * len(batch))


class NoDraftProposer(DraftProposer):
    """Never drafts: every step of a speculative engine verifies nothing."""

    def draft(self, batch: DraftBatch):
        return ChainDrafts.from_lists([[] for _ in range(len(batch))])
