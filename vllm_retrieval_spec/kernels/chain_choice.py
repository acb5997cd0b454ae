"""The goodput budget's choice among chain drafts in one C++ call a step, and what verification
made of them: the front end of ``csrc/chain_choice.h``.

Per node of each row's chain: its calibration bucket, its calibrated chance given its parent (the
table past depth 0; at depth 0 its bucket's counts over the depth-0 counts of its source's prior
pool and its match length, and its own halved raw guess) times its token's factor
(``goodput/token_factor.py``) and the product along the chain; then the nodes within their rows'
budgets ranked by chance per second of verification, and the best prefix of that order for the
highest expected rate, or none when it does not beat a step without drafts. The arithmetic is the
NumPy path's, in the same order (``goodput/calibration.py`` ``buckets`` and ``estimate``,
``goodput/paths.py`` ``path_products``, ``goodput/chooser.py`` ``choose_nodes``), which trees still
run and which the tests compare this kernel against; :func:`count_chain_outcomes` is
``goodput/budget.py``'s read-back of a step (its ``observe`` for trees) for chains.
:func:`fill_chance_table` is the calibration's table of every bucket's chance
(``kernels/chance_table_reference.py`` in NumPy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_retrieval_spec.drafts import DraftNodes
from vllm_retrieval_spec.kernels.extension import load_extension


@dataclass(frozen=True)
class ChainCalibration:
    """What the chooser reads of the calibration: every bucket's chance (``[sources, lengths,
    depths, probs]`` float64, read past depth 0), the decaying accepted and observed counts (same
    shape, read at depth 0), the depth-0 counts per prior pool and match-length bucket
    (``[pools, lengths]``), each source code's prior pool (``[sources]`` int32), the bucket
    lookups of match lengths and depths (int32), the prior strength, the scale of a drafter's raw
    guess in the depth-0 prior and the chances' bounds."""

    chances: np.ndarray
    accepted: np.ndarray
    observed: np.ndarray
    first_accepted: np.ndarray
    first_observed: np.ndarray
    pool: np.ndarray
    length_bucket: np.ndarray
    depth_bucket: np.ndarray
    strength: float
    raw_prior_scale: float
    min_chance: float
    max_chance: float


@dataclass(frozen=True)
class ChainStepCost:
    """The step-cost terms a chain step reads (seconds): a step, a request, a draft token, a
    sampling request's draft token beyond that, and a step of more than ``kernel_rows`` tokens
    once (0 rows: no such bound)."""

    base: float
    per_request: float
    per_token: float
    per_sampled_token: float
    kernel_rows: int = 0
    past_kernel_rows: float = 0.0


def choose_chain_nodes(nodes: DraftNodes, budgets: np.ndarray, samples: np.ndarray | None, num_reqs: int,
                       calibration: ChainCalibration, cost: ChainStepCost, draft_seconds: float, margin: float,
                       factor: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For chain candidates ``nodes`` (node ``j``'s parent is node ``j - 1``), at most
    ``budgets[i]`` nodes of row ``i``, ``samples`` the rows whose requests sample, ``factor``
    each node's token factor on its chance in the path products (``[rows, N]``; None: none):
    each node's bucket (int64), calibrated chance given its parent before the factor (float64,
    0 past the row's size) and whether it is kept (bool), ``[rows, N]`` each."""
    return load_extension().choose_chain_nodes(
        np.ascontiguousarray(nodes.prob, np.float32), np.ascontiguousarray(nodes.source, np.int8),
        np.ascontiguousarray(nodes.match_len, np.int32), np.ascontiguousarray(nodes.size, np.int32),
        np.ascontiguousarray(budgets, np.int32), None if samples is None else np.ascontiguousarray(samples, bool),
        num_reqs, calibration.chances, calibration.accepted, calibration.observed, calibration.first_accepted,
        calibration.first_observed, calibration.pool, calibration.length_bucket, calibration.depth_bucket,
        calibration.strength, calibration.raw_prior_scale, calibration.min_chance, calibration.max_chance, cost.base,
        cost.per_request, cost.per_token, cost.per_sampled_token, cost.kernel_rows, cost.past_kernel_rows,
        draft_seconds, margin,
        None if factor is None else np.ascontiguousarray(factor, np.float64),
    )


@dataclass(frozen=True)
class OutcomeTally:
    """What one step's read-back counted: verified nodes observed and accepted, first nodes of
    greedy rows that sent none learned from the sampled token, and of those the hits; and per
    source code the nodes observed and accepted (``[2, sources]`` int64)."""

    observed: int
    accepted: int
    unsent_observed: int
    unsent_accepted: int
    by_code: np.ndarray


def count_chain_outcomes(tokens: np.ndarray, keep: np.ndarray, bucket: np.ndarray, chance: np.ndarray,
                         source: np.ndarray, unsent_first: np.ndarray | None, step_rows: np.ndarray,
                         sampled: Sequence[Sequence[int]], counts: Sequence[np.ndarray],
                         token_sums: tuple[np.ndarray, np.ndarray] | None) -> OutcomeTally:
    """Read last step's chains (``[rows, N]``: tokens, the kept mask, each node's bucket, chance
    given its parent and source flags; ``unsent_first``: the rows that kept none whose first node
    is learned from) back from this step's ``sampled`` token lists (row ``r``'s is
    ``sampled[step_rows[r]]``, -1: the request left) and add the outcomes, in place, to the
    calibration's ``counts`` (accepted, observed, accepted_total, observed_total,
    predicted_total: float64 C-contiguous, one shape) and the tokens' ``token_sums`` (predicted,
    accepted; None: factors off; the table must hold every token id)."""
    tally, by_code = load_extension().count_chain_outcomes(
        np.ascontiguousarray(tokens, np.int32), np.ascontiguousarray(keep, bool),
        np.ascontiguousarray(bucket, np.int64), np.ascontiguousarray(chance, np.float64),
        np.ascontiguousarray(source, np.int8),
        None if unsent_first is None else np.ascontiguousarray(unsent_first, bool),
        np.ascontiguousarray(step_rows, np.int64), sampled, *counts,
        *(token_sums if token_sums is not None else (None, None)),
    )
    return OutcomeTally(*tally, by_code)


def fill_chance_table(accepted: np.ndarray, observed: np.ndarray, strength: float, raw_prior_scale: float,
                      min_chance: float, max_chance: float, chances: np.ndarray, table: np.ndarray,
                      first_accepted: np.ndarray, first_observed: np.ndarray, pool: np.ndarray) -> float:
    """Every bucket's chance from the decaying counts (``[sources, lengths, depths, probs]``
    float64) into ``chances`` (float64) and ``table`` (float32), the depth-0 counts per prior
    pool (``pool``: each source code's, int32) and match-length bucket into ``first_accepted``
    and ``first_observed`` (``[pools, lengths]``); returns the best first chance
    (``csrc/chain_choice.h``, ``fill_chance_table``)."""
    return load_extension().fill_chance_table(accepted, observed, strength, raw_prior_scale, min_chance, max_chance,
                                              chances, table, first_accepted, first_observed, pool)
