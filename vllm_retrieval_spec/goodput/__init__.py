"""Goodput-driven draft budgets: calibrated acceptance chances per draft node, the engine's
step-cost curve learned online, and the chooser that keeps the nodes worth verifying.

Owned by the runner's :class:`~vllm_retrieval_spec.verification.session.SpecSession`
(one :class:`GoodputBudget` per runner); the proposers' base calls it through that session.
"""

from vllm_retrieval_spec.goodput.budget import BudgetStats, GoodputBudget
from vllm_retrieval_spec.goodput.calibration import AcceptanceCalibration
from vllm_retrieval_spec.goodput.chooser import Choice, NodeCandidates, choose_nodes
from vllm_retrieval_spec.goodput.cost_model import StepCostModel

__all__ = [
    "AcceptanceCalibration",
    "BudgetStats",
    "Choice",
    "GoodputBudget",
    "NodeCandidates",
    "StepCostModel",
    "choose_nodes",
]
