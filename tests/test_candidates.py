"""Sampled candidates: trees drawn from the drafter's own distribution q (for MCSS)."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from distributions import chi2_pvalue

from vllm_retrieval_spec.candidates import CandidateChildren, sample_candidate_trees
from vllm_retrieval_spec.drafts import DraftNodes

P_FLOOR = 1e-4
DRAWS = 4000


def candidate_nodes(tokens, parents, prob) -> DraftNodes:
    """One row per list; rows padded with -1 / 0."""
    width = max(map(len, tokens))

    def pad(rows, fill, dtype):
        return np.array([list(r) + [fill] * (width - len(r)) for r in rows], dtype)

    size = np.array([len(t) for t in tokens], np.int32)
    return DraftNodes(pad(tokens, -1, np.int32), pad(parents, -1, np.int32), size, pad(prob, 0.0, np.float32),
                      np.zeros((len(tokens), width), np.int8), np.zeros((len(tokens), width), np.int32))


# Root -> A (.6), B (.4); A -> C (.5), D (.5); B -> E (1).
TREE = candidate_nodes([[10, 11, 12, 13, 14]], [[-1, -1, 0, 0, 1]], [[0.6, 0.4, 0.5, 0.5, 1.0]])


def test_children_are_grouped_per_node_with_normalised_q():
    children = CandidateChildren.of(TREE)
    assert children.index[0, 0].tolist() == [0, 1] and children.q[0, 0].tolist() == pytest.approx([0.6, 0.4])
    assert children.index[0, 1].tolist() == [2, 3] and children.q[0, 1].tolist() == pytest.approx([0.5, 0.5])
    assert children.index[0, 2].tolist() == [4, -1] and children.q[0, 2].tolist() == pytest.approx([1.0, 0.0])
    assert (children.index[0, 3:] == -1).all()


def test_draft_temperature_sharpens_and_unknown_weights_are_uniform():
    sharp = CandidateChildren.of(TREE, draft_temperature=0.5).q[0, 0]
    assert sharp.tolist() == pytest.approx([0.36 / 0.52, 0.16 / 0.52])
    blank = candidate_nodes([[1, 2, 3]], [[-1, -1, -1]], [[0.0, 0.0, 0.0]])
    assert CandidateChildren.of(blank).q[0, 0].tolist() == pytest.approx([1 / 3] * 3)


def test_a_chain_is_a_path_drawn_from_q():
    rng = np.random.default_rng(0)
    paths = Counter()
    for _ in range(DRAWS):
        drawn = sample_candidate_trees(TREE, np.array([3]), rng)
        assert drawn.parents[0, : drawn.size[0]].tolist() == list(range(-1, drawn.size[0] - 1))
        paths[tuple(drawn.tokens[0, : drawn.size[0]].tolist())] += 1
    outcomes = [(10, 12), (10, 13), (11, 14)]
    assert set(paths) == set(outcomes)
    counts = np.repeat(np.arange(3), [paths[o] for o in outcomes])
    assert chi2_pvalue(counts, np.array([0.3, 0.3, 0.4])) > P_FLOOR


def test_without_replacement_the_candidates_come_in_draw_order():
    """P(x1 = a, x2 = b) = q(a) q(b) / (1 - q(a)): the sequential draw MCSS without replacement
    verifies."""
    nodes = candidate_nodes([[1, 2, 3]], [[-1, -1, -1]], [[0.5, 0.3, 0.2]])
    rng = np.random.default_rng(1)
    pairs = [tuple(sample_candidate_trees(nodes, np.array([2]), rng, per_node=2).tokens[0, :2].tolist())
             for _ in range(DRAWS)]
    q = {1: 0.5, 2: 0.3, 3: 0.2}
    outcomes = list(itertools.permutations(q, 2))
    expected = np.array([q[a] * q[b] / (1 - q[a]) for a, b in outcomes])
    counts = np.array([outcomes.index(pair) for pair in pairs])
    assert chi2_pvalue(counts, expected) > P_FLOOR


def test_with_replacement_the_candidates_are_independent():
    nodes = candidate_nodes([[1, 2]], [[-1, -1]], [[0.7, 0.3]])
    rng = np.random.default_rng(2)
    drawn = [sample_candidate_trees(nodes, np.array([2]), rng, per_node=2, replacement=True) for _ in range(DRAWS)]
    pairs = [tuple(d.tokens[0, :2].tolist()) for d in drawn]
    assert all(d.parents[0, :2].tolist() == [-1, -1] for d in drawn)
    outcomes = list(itertools.product((1, 2), repeat=2))
    expected = np.array([{1: 0.7, 2: 0.3}[a] * {1: 0.7, 2: 0.3}[b] for a, b in outcomes])
    assert chi2_pvalue(np.array([outcomes.index(p) for p in pairs]), expected) > P_FLOOR


def test_trees_stay_within_budget_parents_first_with_each_nodes_q():
    rng = np.random.default_rng(3)
    two = candidate_nodes([[10, 11, 12, 13, 14], [20, 21]], [[-1, -1, 0, 0, 1], [-1, 0]],
                          [[0.6, 0.4, 0.5, 0.5, 1.0], [1.0, 1.0]])
    children = CandidateChildren.of(two)
    for budget in range(6):
        drawn = sample_candidate_trees(two, np.array([budget, budget]), rng, per_node=2)
        assert drawn.size.tolist() == [min(budget, 5), min(budget, 2)]
        for row in range(2):
            n = int(drawn.size[row])
            parents = drawn.parents[row, :n]
            assert all(p < i for i, p in enumerate(parents)), "parents come first"
            siblings = [(p, t) for p, t in zip(parents.tolist(), drawn.tokens[row, :n].tolist())]
            assert len(set(siblings)) == n, "without replacement no node has a token twice"
            source = drawn.source[row, :n]
            assert (two.tokens[row, source] == drawn.tokens[row, :n]).all()
            q = drawn.row_q(row)
            assert q.tokens.shape[0] == n + 1
            for slot, node in enumerate([-1, *source.tolist()]):
                listed = children.index[row, node + 1]
                want = sorted(two.tokens[row, listed[listed >= 0]].tolist())
                assert sorted(q.tokens[slot][q.tokens[slot] >= 0].tolist()) == want


def test_draws_go_deep_where_q_is_sure_and_wide_where_it_is_not():
    """Root -> A (0.95) -> a chain; root -> B (0.05). Once A is drawn, continuing its chain is
    likelier to pay than a second root candidate: the budget goes down the chain."""
    tokens = [1, 2, 3, 4, 5, 6, 7]
    parents = [-1, -1, 0, 2, 3, 4, 5]
    nodes = candidate_nodes([tokens], [parents], [[0.95, 0.05, 1, 1, 1, 1, 1]])
    rng = np.random.default_rng(6)
    for _ in range(200):
        drawn = sample_candidate_trees(nodes, np.array([5]), rng, per_node=2)
        if drawn.tokens[0, 0] == 1:
            assert drawn.tokens[0, :5].tolist() == [1, 3, 4, 5, 6]
        else:  # B drawn first: A (0.95 of what is left) comes next at the root
            assert drawn.tokens[0, :2].tolist() == [2, 1] and drawn.parents[0, :2].tolist() == [-1, -1]


@pytest.mark.parametrize("replacement", [False, True])
def test_drawn_trees_verified_with_their_q_emit_the_target_distribution(replacement):
    """The drawn trees and their q, verified by the MCSS kernel against a fixed target p, emit
    tokens distributed as p at the first and second position: sampled candidates are lossless."""
    from vllm_retrieval_spec.kernels.tree import AcceptRule, SparseDraft, TreeBatch, accept_trees

    target = np.array([0.3, 0.25, 0.2, 0.15, 0.1, 0.0], np.float32)
    nodes = candidate_nodes([[0, 1, 4, 2, 0, 3]], [[-1, -1, -1, 0, 0, 1]], [[0.5, 0.3, 0.2, 0.7, 0.3, 1.0]])
    rule = AcceptRule.MCSS if replacement else AcceptRule.MCSS_NO_REPLACEMENT
    rng = np.random.default_rng(7)
    first, second = [], []
    for trial in range(DRAWS):
        drawn = sample_candidate_trees(nodes, np.array([4]), rng, per_node=2, replacement=replacement)
        n = int(drawn.size[0])
        q = drawn.row_q(0)
        batch = TreeBatch(drawn.tokens[0, :n], drawn.parents[0, :n], np.array([0, n]), np.array([rule]),
                          np.array([trial], np.uint64))
        result = accept_trees(np.tile(target, (n + 1, 1)), batch, draft=SparseDraft(q.tokens, q.probs))
        first.append(int(result.out_tokens[0, 0]))
        if result.out_tokens.shape[1] > 1 and result.out_tokens[0, 1] >= 0:
            second.append(int(result.out_tokens[0, 1]))
    assert chi2_pvalue(np.array(first), target.astype(np.float64)) > P_FLOOR
    assert chi2_pvalue(np.array(second), target.astype(np.float64)) > P_FLOOR


def test_draft_q_rows_follow_the_kernels_row_layout():
    from vllm_retrieval_spec.candidates import DraftQ
    from vllm_retrieval_spec.drafts import DraftTree
    from vllm_retrieval_spec.verification.sampler import chain_draft_probs
    from vllm_retrieval_spec.verification.trees import TreeStepPlan

    drawn = DraftQ(np.array([[5, 6], [7, -1]], np.int32), np.array([[0.25, 0.75], [1.0, 0.0]], np.float32))
    trees = [DraftTree.chain([9, 8]), DraftTree.chain([6]), DraftTree.chain([])]
    plan = TreeStepPlan.build(trees, np.array([0, 3, 5]), [None, drawn.truncated(1), None])
    q = plan.draft_q
    assert q.drawn.tolist() == [False, True, False]
    assert q.tokens.shape[0] == 3 + 3  # N + B rows
    dense = q.dense(10)
    assert dense[:3].sum() == 0 and dense[5].sum() == 0  # request 0's rows, request 2's root
    assert dense[3, [5, 6]].tolist() == [0.25, 0.75] and dense[4, 7] == 1.0  # request 1: root, then node 0
    # vLLM's draft_probs for chains: the drawn token's q, one-hot rows for deterministic candidates.
    probs = chain_draft_probs(plan, 10)
    assert probs.shape == (3, 10)
    assert probs[0].tolist() == np.eye(10)[9].tolist() and probs[1].tolist() == np.eye(10)[8].tolist()
    assert probs[2, [5, 6]].tolist() == [0.25, 0.75]


def test_placeholder_draft_slots_are_not_nodes():
    """vLLM pads a request whose prompt the prefix cache held whole with ``-1`` draft slots:
    the plan has no node for them, the sampler reads only the real rows' logits and vLLM's
    sampler gets a zero ``q`` row (it rejects the placeholder)."""
    from vllm_retrieval_spec.candidates import DraftQ
    from vllm_retrieval_spec.drafts import DraftTree
    from vllm_retrieval_spec.verification.sampler import chain_draft_probs
    from vllm_retrieval_spec.verification.session import without_placeholders
    from vllm_retrieval_spec.verification.trees import TreeStepPlan

    scheduled = [[4, 5], [-1, -1, -1], [7]]
    assert [list(without_placeholders(tokens)) for tokens in scheduled] == [[4, 5], [], [7]]
    assert without_placeholders([3, -1]) == [3]
    trees = [DraftTree.chain(without_placeholders(tokens)) for tokens in scheduled]
    drawn = DraftQ(np.array([[7, 8]], np.int32), np.array([[0.5, 0.5]], np.float32))
    plan = TreeStepPlan.build(trees, np.array([0, 3, 7]), [None, None, drawn], np.array([2, 3, 1]))
    # logits rows: request 0 (root, 4, 5) = 0-2, request 1 (root, 3 placeholders) = 3-6, request 2 (root, 7) = 7-8
    assert plan.logit_rows().tolist() == [0, 1, 2, 3, 7, 8]
    assert plan.draft_slot_rows().tolist() == [0, 1, 5]
    probs = chain_draft_probs(plan, 10)
    assert probs.shape == (6, 10)
    assert probs[2:5].sum() == 0  # placeholders
    assert probs[0, 4] == probs[1, 5] == 1.0 and probs[5, [7, 8]].tolist() == [0.5, 0.5]
    unpadded = TreeStepPlan.build(trees[:1], np.array([0]), [None], np.array([2]))
    assert unpadded.logit_rows() is None and unpadded.draft_slot_rows() is None
