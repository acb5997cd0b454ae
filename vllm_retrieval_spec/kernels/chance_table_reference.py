"""NumPy reference of ``fill_chance_table`` (``csrc/chain_choice.h``): the calibration's chance of
every bucket, each depth shrunk towards the one above it, in closed form over whole arrays (the
kernel runs the recurrence). Tests compare the kernel against it."""

from __future__ import annotations

import numpy as np


def _depth_chained(accepted: np.ndarray, observed: np.ndarray, first: np.ndarray, strength: float) -> np.ndarray:
    """``c[d] = (accepted[d] + strength·c[d − 1]) / (observed[d] + strength)`` along the depth
    axis (2) of ``[source, length, depth, prob]`` counts, with ``c[−1] = first`` (``[.., length,
    prob]``), in closed form: ``c[d] = B[d]·(first + Σ_{j ≤ d} a[j] / B[j])`` for
    ``a = accepted / (observed + strength)`` and ``B`` the running product of
    ``strength / (observed + strength)``."""
    total = observed + strength
    carried = np.cumprod(strength / total, axis=2)
    return carried * (first[..., None, :] + np.cumsum(accepted / total / carried, axis=2))


def chance_table(accepted: np.ndarray, observed: np.ndarray, strength: float, raw_prior_scale: float,
                 min_chance: float, max_chance: float, pool: np.ndarray,
                 pools: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Every bucket's chance (float64, the counts' shape), the depth-0 accepted and observed
    counts per prior pool (``pool``: each source code's, below ``pools``) and match-length
    bucket, and the best first chance, as the kernel computes them."""
    probs = accepted.shape[3]
    in_pool = np.arange(pools)[:, None] == np.asarray(pool)[None, :]  # [pools, sources]
    first_accepted = np.stack([accepted[members, :, 0].sum(axis=(0, 2)) for members in in_pool])
    first_observed = np.stack([observed[members, :, 0].sum(axis=(0, 2)) for members in in_pool])
    midpoint = (np.arange(probs) + 0.5) / probs
    first = ((first_accepted[:, :, None] + strength * raw_prior_scale * midpoint)
             / (first_observed[:, :, None] + strength))[pool]  # [source, length, prob]
    chances = np.empty(accepted.shape)
    chances[...] = first[:, :, None, :]  # unseen sources keep their pool's prior at every depth
    seen = np.flatnonzero(observed.any(axis=(1, 2, 3)))
    chances[seen] = _depth_chained(accepted[seen], observed[seen], first[seen], strength)
    observed0 = observed[:, :, 0]
    if (observed0 > 0).any():
        depth0 = (accepted[:, :, 0] + strength * raw_prior_scale) / (observed0 + strength)
        best = float(min(depth0[observed0 > 0].max(), max_chance))
    else:
        best = raw_prior_scale
    return np.clip(chances, min_chance, max_chance), first_accepted, first_observed, best
