"""Acceptance figures: the honest one and vLLM's."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import asdict, astuple, dataclass


@dataclass(frozen=True)
class GenerationRecord:
    """One request's outcome: token ids and the decode steps that produced them."""

    prompt_ids: list[int]
    output_ids: list[int]
    decode_steps: int


@dataclass(frozen=True)
class SpecDecodeCounters:
    """vLLM's speculative-decoding counters (only steps that had drafts are counted)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float | None:
        """vLLM's: 1 + accepted / drafts (drafted steps only); None without drafts."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens; None without drafts."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    def __sub__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        return self._combine(other, operator.sub)

    def __add__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        return self._combine(other, operator.add)

    def _combine(self, other: SpecDecodeCounters, op: Callable[[int, int], int]) -> SpecDecodeCounters:
        return SpecDecodeCounters(*(op(a, b) for a, b in zip(astuple(self), astuple(other))))


@dataclass(frozen=True)
class AcceptanceSummary:
    """What one configuration achieved over a prompt set."""

    requests: int
    generated_tokens: int
    decode_steps: int
    honest_tokens_per_step: float
    vllm_mean_acceptance_length: float | None
    acceptance_rate: float | None
    drafts: int
    draft_tokens: int
    accepted_tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(records: Sequence[GenerationRecord], counters: SpecDecodeCounters) -> AcceptanceSummary:
    """Honest tokens per decode step = (generated - requests) / decode steps, counting steps
    without drafts; vLLM's mean acceptance length = 1 + accepted / drafts (drafted steps only)."""
    generated = sum(len(r.output_ids) for r in records)
    steps = sum(r.decode_steps for r in records)
    return AcceptanceSummary(
        requests=len(records),
        generated_tokens=generated,
        decode_steps=steps,
        honest_tokens_per_step=(generated - len(records)) / steps if steps else 1.0,
        vllm_mean_acceptance_length=counters.mean_acceptance_length,
        acceptance_rate=counters.acceptance_rate,
        drafts=counters.drafts,
        draft_tokens=counters.draft_tokens,
        accepted_tokens=counters.accepted_tokens,
    )
