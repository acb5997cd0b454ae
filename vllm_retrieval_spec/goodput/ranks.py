"""Tensor-parallel engines: every rank's goodput budget runs on the first rank's clock.

vLLM runs the drafter on every tensor-parallel rank, sends only the first rank's drafts to
the scheduler, and each rank then verifies with its own side state (tree parents). Drafting
is deterministic given the batch, but the budget's choices also follow wall-clock time (step
durations, drafting time), which each rank measures differently. With a
:class:`RankZeroClock` each of those measurements is replaced by the first rank's (one
broadcast of one float over vLLM's CPU group, at the points every rank reaches in the same
order), so every rank's cost model, search-time estimate, calibration and choices stay the
first rank's. With one rank no clock is made and nothing is exchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class SharedClock(Protocol):
    """Where a budget's time measurements come from when ranks must agree on them."""

    def shared(self, seconds: float) -> float:
        """The first rank's value of a duration every rank measured at this point."""


@dataclass(frozen=True)
class RankZeroClock:
    """The first rank's measurements, broadcast over a CPU (gloo) process group."""

    group: ProcessGroup
    source: int  # the global rank of the group's first rank

    def shared(self, seconds: float) -> float:
        import torch
        import torch.distributed as dist

        value = torch.tensor([seconds], dtype=torch.float64)
        dist.broadcast(value, src=self.source, group=self.group)
        return float(value.item())


def tensor_parallel_clock(tensor_parallel_size: int) -> RankZeroClock | None:
    """The first rank's clock over vLLM's tensor-parallel CPU group; None with one rank."""
    if tensor_parallel_size <= 1:
        return None
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    return RankZeroClock(group.cpu_group, group.ranks[0])
