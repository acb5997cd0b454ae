"""The sampled acceptance rules are lossless: emitted tokens follow the target distribution
(given as probabilities, or as logits with sampling parameters and then processed lazily).

Each test verifies 20000 independent trials (one request each, its own seed) of a two-level
tree in one batched kernel call and applies a chi-squared test with fixed seeds and a p-value
floor of 1e-6, so the tests are deterministic and never flake.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from distributions import chi2_pvalue, chi2_sf

from vllm_retrieval_spec.kernels.tree import AcceptRule, RowSampling, SparseDraft, TreeBatch, accept_trees
from vllm_retrieval_spec.kernels.tree_reference import target_row_reference

TRIALS = 20000
# Unnormalised on purpose; token 8 is impossible under the target but not under the drafts.
P_ROOT = 3.7 * np.array([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02, 0.0])
P_CHILD = 0.5 * np.array([0.10, 0.40, 0.05, 0.05, 0.20, 0.10, 0.05, 0.05, 0.0])
Q_ROOT = 2.0 * np.array([0.05, 0.25, 0.10, 0.20, 0.05, 0.15, 0.10, 0.05, 0.05])
Q_CHILD = np.array([0.30, 0.10, 0.10, 0.10, 0.10, 0.10, 0.05, 0.05, 0.10])
# Per trial: root -> children 0, 1, 2; child 0 -> grandchildren 3, 4.
PARENTS = [-1, -1, -1, 0, 0]
FIXED_TOKENS = [1, 3, 8, 4, 1]  # rule 1: deterministic candidates (8 has no target mass)


def draft_tokens(rule: AcceptRule, rng: np.random.Generator) -> np.ndarray:
    """Candidate tokens of every trial: fixed (rule 1) or drawn from q with (rule 2, so
    duplicates occur) or without (rule 3, Gumbel top-k) replacement."""
    if rule == AcceptRule.CANDIDATES:
        return np.tile(np.array(FIXED_TOKENS, np.int32), TRIALS)
    draws = []
    for q, count in ((Q_ROOT, 3), (Q_CHILD, 2)):
        q = q / q.sum()
        if rule == AcceptRule.MCSS:
            draws.append(rng.choice(len(q), (TRIALS, count), p=q))
        else:
            keys = np.log(q) + rng.gumbel(size=(TRIALS, len(q)))
            draws.append(np.argsort(-keys, axis=1)[:, :count])
    return np.concatenate(draws, axis=1).astype(np.int32).reshape(-1)


def run_trials(rule: AcceptRule, seed: int, verify_as: AcceptRule | None = None):
    """Trials with rule's candidates, verified with rule (or verify_as)."""
    rng = np.random.default_rng(seed)
    rows = np.stack([P_ROOT, P_CHILD, P_CHILD, P_CHILD, P_ROOT, P_ROOT]).astype(np.float32)
    drafts = np.stack([Q_ROOT, Q_CHILD, Q_CHILD, Q_CHILD, Q_CHILD, Q_CHILD]).astype(np.float32)
    batch = trial_batch(draft_tokens(rule, rng), rule if verify_as is None else verify_as, rng)
    return accept_trees(np.tile(rows, (TRIALS, 1)), batch, draft_probs=np.tile(drafts, (TRIALS, 1)))


def trial_batch(tokens: np.ndarray, rule: AcceptRule, rng: np.random.Generator) -> TreeBatch:
    """TRIALS trees of PARENTS' shape carrying ``tokens``, verified with ``rule``, seeds from ``rng``."""
    size = len(PARENTS)
    return TreeBatch(
        tokens=tokens,
        parents=np.tile(np.array(PARENTS, np.int32), TRIALS),
        offsets=np.arange(0, size * TRIALS + 1, size, dtype=np.int32),
        rules=np.full(TRIALS, int(rule), np.int32),
        seeds=rng.integers(0, 2**63, TRIALS, dtype=np.uint64),
    )


SAMPLED_RULES = [AcceptRule.CANDIDATES, AcceptRule.MCSS, AcceptRule.MCSS_NO_REPLACEMENT]


def test_chi2_helper_matches_known_quantiles():
    assert chi2_sf(14.067, 7) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf(18.475, 7) == pytest.approx(0.01, abs=1e-4)
    assert chi2_sf(2.0, 2) == pytest.approx(math.exp(-1.0), rel=1e-9)


@pytest.mark.parametrize("rule", SAMPLED_RULES)
def test_first_token_follows_the_target(rule):
    out = run_trials(rule, seed=int(rule))
    assert (out.out_tokens[:, 0] >= 0).all()
    assert chi2_pvalue(out.out_tokens[:, 0], P_ROOT) > 1e-6
    assert 0.2 < (out.num_accepted > 0).mean() < 1.0  # both branches are exercised


@pytest.mark.parametrize("rule", SAMPLED_RULES)
def test_second_token_follows_the_child_row(rule):
    out = run_trials(rule, seed=10 + int(rule))
    second = out.out_tokens[out.num_accepted >= 1, 1]
    assert len(second) > TRIALS // 5
    assert chi2_pvalue(second, P_CHILD) > 1e-6
    assert (out.num_accepted == 2).any()  # grandchildren get accepted too


def test_power_the_wrong_rule_is_caught():
    """Verifying without-replacement drafts as if drawn with replacement is biased, and the
    chi-squared test sees it."""
    out = run_trials(AcceptRule.MCSS_NO_REPLACEMENT, seed=1, verify_as=AcceptRule.MCSS)
    assert chi2_pvalue(out.out_tokens[:, 0], P_ROOT) < 1e-9


# ---- lazy target rows: logits, temperature 0.7, top-k 9, top-p 0.9 ---------------------------
# Token 11 is never possible (-inf); top-k drops 10 and 7 (rank 9 is a tie of 2 and 8, both
# kept), then top-p drops 2, 8 and 5.
LOGITS_ROOT = np.array([2.0, 1.6, 0.2, 1.2, 0.9, 0.4, 1.5, -0.5, 0.2, 2.4, 0.0, -np.inf], np.float32)
LOGITS_CHILD = np.array([0.5, 2.2, -1.0, 1.0, 1.9, 0.3, 0.8, 1.1, 0.0, -0.3, 1.4, 0.6], np.float32)
LAZY = dict(temperature=0.7, top_k=9, top_p=0.9)
LAZY_FIXED_TOKENS = [9, 11, 6, 4, 1]  # rule 1: 11 has no target mass
# rule 3: sparse q rows (-1 padded) of the root and of child 0; they list tokens outside the
# target's support (11; 2 and 8 after top-p) and leave out some of its tokens
Q_ROOT_TOKENS = [-1, 0, 9, 3, 11, 6, -1, 2, 1, 8]
Q_ROOT_PROBS = [5.0, 0.1, 0.3, 0.1, 0.2, 0.1, 5.0, 0.1, 0.2, 0.05]
Q_CHILD_TOKENS = [1, 4, 10, 0, 7, -1, -1, -1, -1, -1]
Q_CHILD_PROBS = [0.3, 0.3, 0.2, 0.1, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0]


def lazy_target(logits: np.ndarray) -> np.ndarray:
    return target_row_reference(logits, LAZY["temperature"], LAZY["top_k"], LAZY["top_p"])


def sparse_draws(rng: np.random.Generator, tokens: list[int], probs: list[float], count: int) -> np.ndarray:
    """count tokens per trial drawn without replacement from a sparse q (Gumbel top-k)."""
    listed = np.array(tokens) >= 0
    support, q = np.array(tokens)[listed], np.array(probs)[listed]
    keys = np.log(q) + rng.gumbel(size=(TRIALS, len(q)))
    return support[np.argsort(-keys, axis=1)[:, :count]]


def run_lazy_trials(rule: AcceptRule, seed: int):
    rng = np.random.default_rng(seed)
    rows = np.stack([LOGITS_ROOT, LOGITS_CHILD, LOGITS_CHILD, LOGITS_CHILD, LOGITS_ROOT, LOGITS_ROOT])
    draft = None
    if rule == AcceptRule.CANDIDATES:
        tokens = np.tile(np.array(LAZY_FIXED_TOKENS, np.int32), TRIALS)
    else:
        tokens = np.concatenate([sparse_draws(rng, Q_ROOT_TOKENS, Q_ROOT_PROBS, 3),
                                 sparse_draws(rng, Q_CHILD_TOKENS, Q_CHILD_PROBS, 2)], axis=1)
        tokens = tokens.astype(np.int32).reshape(-1)
        padding = [-1] * len(Q_ROOT_TOKENS)
        q_tokens = np.array([Q_ROOT_TOKENS, Q_CHILD_TOKENS] + [padding] * 4, np.int32)
        q_probs = np.array([Q_ROOT_PROBS, Q_CHILD_PROBS] + [[1.0] * len(padding)] * 4, np.float32)
        draft = SparseDraft(np.tile(q_tokens, (TRIALS, 1)), np.tile(q_probs, (TRIALS, 1)))
    return accept_trees(
        np.tile(rows, (TRIALS, 1)),
        trial_batch(tokens, rule, rng),
        sampling=RowSampling(*(np.full(TRIALS, LAZY[name], dtype)
                               for name, dtype in (("temperature", np.float32), ("top_k", np.int32),
                                                   ("top_p", np.float32)))),
        draft=draft,
    )


def test_lazy_targets_are_cut_as_intended():
    root, child = lazy_target(LOGITS_ROOT), lazy_target(LOGITS_CHILD)
    assert (root > 0).tolist() == [1, 1, 0, 1, 1, 0, 1, 0, 0, 1, 0, 0]
    assert 5 <= (child > 0).sum() < 9


@pytest.mark.parametrize("rule", [AcceptRule.CANDIDATES, AcceptRule.MCSS_NO_REPLACEMENT])
def test_lazy_first_token_follows_the_processed_target(rule):
    out = run_lazy_trials(rule, seed=20 + int(rule))
    assert (out.out_tokens[:, 0] >= 0).all()
    assert chi2_pvalue(out.out_tokens[:, 0], lazy_target(LOGITS_ROOT)) > 1e-6
    assert 0.2 < (out.num_accepted > 0).mean() < 1.0  # both branches are exercised


@pytest.mark.parametrize("rule", [AcceptRule.CANDIDATES, AcceptRule.MCSS_NO_REPLACEMENT])
def test_lazy_second_token_follows_the_processed_child_row(rule):
    out = run_lazy_trials(rule, seed=30 + int(rule))
    second = out.out_tokens[out.num_accepted >= 1, 1]
    assert len(second) > TRIALS // 5
    assert chi2_pvalue(second, lazy_target(LOGITS_CHILD)) > 1e-6
