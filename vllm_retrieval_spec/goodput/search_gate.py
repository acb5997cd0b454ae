"""Whether an optional source's search pays for itself (Hybrid's dense search).

``HybridProposer`` searches its dense store (and the index learned from served traffic) on top of
REST's sources. The budget calibrates every source combination on its own, so nodes only the
dense sources drafted are drafted where they are accepted; but the search itself costs its time
every step. :class:`SearchGate` weighs the two: the tokens accepted from nodes no other source
drafted (what REST's own sources would not have drafted), each worth the engine's time per token
without drafts, against the time the searches took beyond a first credit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vllm_retrieval_spec.goodput.budget import GoodputBudget

logger = logging.getLogger(__name__)

CREDIT_SEARCHES = 64  # searches a source gets before it must have paid for them
EXPLORE_EVERY = 16  # a closed gate still searches one step in this many


@dataclass
class SearchGate:
    """The gate of the source(s) ``flags`` (``SOURCE_*``): open while the tokens accepted from
    their nodes alone pay for their searches beyond the first ``CREDIT_SEARCHES``; closed, it
    still opens one step in ``EXPLORE_EVERY``, so that a source that starts to pay is searched
    again (logged when it closes and opens)."""

    flags: int
    owner: str = "proposer"
    searches: int = 0
    search_seconds: float = 0.0
    steps: int = 0
    closed: bool = False

    def open(self, budget: GoodputBudget, num_reqs: int) -> bool:
        """Whether to search this step, for ``num_reqs`` requests drafting."""
        self.steps += 1
        if self.searches <= CREDIT_SEARCHES:
            return True
        accepted = budget.accepted_only_from(self.flags)
        owed = self.search_seconds * (1.0 - CREDIT_SEARCHES / self.searches)
        pays = accepted * budget.seconds_per_token(num_reqs) >= owed
        if pays == self.closed:
            self.closed = not pays
            logger.info("%s: the dense search %s (%d tokens accepted from its nodes alone over %d searches of "
                        "%.2f ms)%s", self.owner, "stopped paying for itself" if self.closed else "pays again",
                        accepted, self.searches, 1000 * self.search_seconds / self.searches,
                        f"; searching one step in {EXPLORE_EVERY}" if self.closed else "")
        return pays or self.steps % EXPLORE_EVERY == 0

    def searched(self, seconds: float) -> None:
        """One search took ``seconds``."""
        self.searches += 1
        self.search_seconds += seconds
