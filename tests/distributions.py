"""Chi-squared tests for the distribution checks (no SciPy in the test environment), and the
seeded engine samples they compare."""

from __future__ import annotations

import math

import numpy as np


def chi2_sf(statistic: float, dof: int) -> float:
    """Upper tail of the chi-squared distribution (series of the regularised gamma P)."""
    a, x = dof / 2, statistic / 2
    if x > 500 and x > 4 * a:  # far in the tail; the series would overflow
        return 0.0
    term = total = 1.0 / a
    for n in range(1, 100000):
        term *= x / (a + n)
        total += term
        if term < total * 1e-17:
            break
    return 1.0 - math.exp(a * math.log(x) - x - math.lgamma(a)) * total if x > 0 else 1.0


def chi2_pvalue(samples: np.ndarray, weights: np.ndarray) -> float:
    """p-value of samples against the normalised weights; impossible tokens must not occur."""
    counts = np.bincount(samples, minlength=len(weights))
    assert len(counts) == len(weights) and (counts[weights == 0] == 0).all(), counts
    possible = weights > 0
    expected = len(samples) * weights[possible] / weights.sum()
    statistic = float(((counts[possible] - expected) ** 2 / expected).sum())
    return chi2_sf(statistic, int(possible.sum()) - 1)


def two_sample_chi2_pvalue(first: np.ndarray, second: np.ndarray, min_count: int = 10) -> float:
    """p-value that two samples of categories come from one distribution; categories seen
    fewer than ``min_count`` times in both samples together are pooled into one."""
    categories, inverse = np.unique(np.concatenate([first, second]), return_inverse=True)
    counts = np.zeros((2, len(categories)))
    np.add.at(counts[0], inverse[: len(first)], 1)
    np.add.at(counts[1], inverse[len(first):], 1)
    rare = counts.sum(axis=0) < min_count
    table = np.concatenate([counts[:, ~rare], counts[:, rare].sum(axis=1, keepdims=True)], axis=1)
    table = table[:, table.sum(axis=0) > 0]
    if table.shape[1] < 2:
        return 1.0
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    return chi2_sf(statistic, table.shape[1] - 1)


def engine_samples(llm, prompt: str, seeds: range, max_tokens: int, temperature: float,
                   **sampling) -> np.ndarray:
    """Token ids ``[len(seeds), max_tokens]`` (-1 after an early end) of one seeded request per
    seed, all on ``prompt``."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, **sampling)
              for seed in seeds]
    outputs = llm.generate([prompt] * len(seeds), params, use_tqdm=False)
    tokens = np.full((len(seeds), max_tokens), -1, dtype=np.int64)
    for row, output in enumerate(outputs):
        ids = output.outputs[0].token_ids
        tokens[row, : len(ids)] = ids
    return tokens
