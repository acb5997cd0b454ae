"""The C++ tree packing and acceptance kernels equal their NumPy references, exactly."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_retrieval_spec.kernels import extension_backends
from vllm_retrieval_spec.kernels.tree import (
    AcceptRule,
    accept_trees,
    pack_tree_masks,
    tree_depths,
    tree_row_offsets,
)
from vllm_retrieval_spec.kernels.tree_reference import (
    accept_trees_reference,
    canonical_sample,
    canonical_total,
    pack_tree_masks_reference,
    uniform,
)

SHAPES = ("random", "chain", "star", "bushy", "empty")


def tree_parents(rng: np.random.Generator, size: int, shape: str) -> list[int]:
    """Local parents of a parents-first tree of the given shape."""
    if shape == "empty":
        return []
    if shape == "chain":
        return list(range(-1, size - 1))
    if shape == "star":
        return [-1] * size
    if shape == "bushy":  # few parents, many siblings
        return [int(rng.integers(-1, min(i, 3))) for i in range(size)]
    return [int(rng.integers(-1, i)) for i in range(size)]


def flat_trees(trees: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    parents = np.array([p for tree in trees for p in tree], dtype=np.int32)
    offsets = np.cumsum([0] + [len(t) for t in trees]).astype(np.int32)
    return parents, offsets


def probability_row(rng: np.random.Generator, vocab: int) -> np.ndarray:
    """A peaked distribution with zeros (as after top-k), unnormalised."""
    row = rng.dirichlet(np.full(vocab, 0.3)) * rng.uniform(0.5, 2.0)
    row[rng.random(vocab) < 0.3] = 0.0
    row[rng.integers(vocab)] += 0.5
    return row.astype(np.float32)


def random_trees(rng: np.random.Generator, batch: int, max_size: int) -> list[list[int]]:
    return [tree_parents(rng, int(rng.integers(1, max_size + 1)), str(rng.choice(SHAPES)))
            for _ in range(batch)]


def random_batch(rng: np.random.Generator, vocab: int, trees: list[list[int]],
                 rules: list[int] | None = None) -> dict:
    """Rows and tokens for the trees such that walks often go deep: tokens mostly follow the
    parent's row (its argmax for greedy, a draw from p or q otherwise), some are arbitrary;
    draft rows are q = p exactly, a blend or unrelated."""
    parents, offsets = flat_trees(trees)
    rules = [int(rng.integers(0, 4)) for _ in trees] if rules is None else rules
    rows = len(parents) + len(trees)
    scores = np.empty((rows, vocab), dtype=np.float32)
    draft = np.empty((rows, vocab), dtype=np.float32)
    tokens = np.empty(len(parents), dtype=np.int32)
    for b, rule in enumerate(rules):
        first_row = int(offsets[b]) + b
        for r in range(first_row, first_row + len(trees[b]) + 1):
            p = probability_row(rng, vocab)
            scores[r] = rng.integers(-3, 3, vocab) if rule == AcceptRule.GREEDY else p
            mix = rng.choice([0.0, 0.5, 1.0])
            draft[r] = mix * p / p.sum() + (1 - mix) * probability_row(rng, vocab)
            if mix == 1.0:
                draft[r] = p
        for local, parent in enumerate(trees[b]):
            row = (draft if rule >= AcceptRule.MCSS else scores)[first_row + parent + 1]
            if rng.random() < 0.15:
                token = rng.integers(vocab)  # possibly impossible under p or q
            elif rule == AcceptRule.GREEDY:
                token = np.argmax(row)
            else:
                token = rng.choice(vocab, p=row / row.sum())
            tokens[offsets[b] + local] = token
    seeds = rng.integers(0, 2**63, len(trees), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    return dict(scores=scores, tokens=tokens, parents=parents, offsets=offsets,
                rules=np.array(rules, dtype=np.int32), seeds=seeds, draft_probs=draft)


def assert_same_acceptance(got, expected) -> None:
    for name in ("out_tokens", "path_nodes", "num_accepted"):
        assert np.array_equal(getattr(got, name), getattr(expected, name)), name


# ---- uniforms and canonical sums ------------------------------------------------------------


def test_uniform_is_splitmix64_of_the_mixed_counter():
    # seed 1, counter 0: splitmix64(1 ^ 1) = splitmix64(0), whose value is well known
    assert uniform(1, 0) == (0xE220A8397B1DCDAF >> 11) * 2.0**-53
    values = [uniform(7, c) for c in range(1000)]
    assert all(0.0 <= v < 1.0 for v in values) and len(set(values)) == 1000
    assert 0.45 < np.mean(values) < 0.55


@pytest.mark.parametrize("vocab", [1, 7, 1024, 1025, 5000])
def test_canonical_sum_and_sample_are_a_cdf_inversion(vocab):
    rng = np.random.default_rng(vocab)
    values = rng.random(vocab) * (rng.random(vocab) < 0.7)
    values[0] = 0.5
    assert canonical_total(values) == pytest.approx(values.sum(), rel=1e-12)
    cdf = np.cumsum(values)
    for u in rng.random(50):
        index, target = canonical_sample(values, u), u * cdf[-1]
        assert values[index] > 0  # and index inverts the cdf, but for rounding:
        assert cdf[index] - values[index] <= target * (1 + 1e-12) <= cdf[index] * (1 + 2e-12)
    assert canonical_sample(np.zeros(vocab), 0.5) == -1


# ---- packing --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_pack_matches_reference(seed):
    rng = np.random.default_rng(seed)
    max_nodes = int(rng.choice([1, 7, 64, 65, 130]))
    trees = [tree_parents(rng, int(rng.integers(0, max_nodes + 1)), str(rng.choice(SHAPES)))
             for _ in range(int(rng.integers(0, 9)))]
    parents, offsets = flat_trees(trees)
    expected = pack_tree_masks_reference(parents, offsets, max_nodes)
    for threads in (1, 3):
        got = pack_tree_masks(parents, offsets, max_nodes, num_threads=threads)
        assert np.array_equal(got.depth, expected.depth)
        assert np.array_equal(got.ancestor_mask, expected.ancestor_mask)
    assert np.array_equal(tree_depths(parents, offsets), expected.depth)


def test_pack_known_answer():
    parents, offsets = flat_trees([[-1, 0, 0, 1], [], [-1, -1, 1]])
    masks = pack_tree_masks(parents, offsets, 4)
    assert masks.depth.tolist() == [1, 2, 2, 3, 1, 1, 2]
    assert masks.ancestor_mask[:, 0].tolist() == [0b1, 0b11, 0b101, 0b1011, 0b1, 0b10, 0b110]
    assert tree_row_offsets(offsets).tolist() == [0, 5, 6]


def test_pack_uses_later_words_for_deep_nodes():
    parents, offsets = flat_trees([list(range(-1, 99))])
    mask = pack_tree_masks(parents, offsets, 100).ancestor_mask
    assert mask.shape == (100, 2)
    assert int(mask[99, 0]) == 2**64 - 1 and int(mask[99, 1]) == 2**36 - 1


# ---- acceptance ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_accept_matches_reference_on_random_batches(seed):
    rng = np.random.default_rng(1000 + seed)
    vocab = int(rng.choice([7, 50, 1000]))
    trees = random_trees(rng, int(rng.integers(1, 9)), int(rng.choice([4, 16, 40])))
    batch = random_batch(rng, vocab, trees)
    expected = accept_trees_reference(**batch)
    for threads in (1, 4):
        assert_same_acceptance(accept_trees(**batch, num_threads=threads), expected)


@pytest.mark.parametrize("rule", list(AcceptRule))
@pytest.mark.parametrize("shape", ["chain", "star", "bushy"])
def test_accept_matches_reference_per_rule_on_extreme_shapes(rule, shape):
    rng = np.random.default_rng(100 * int(rule) + len(shape))
    trees = [tree_parents(rng, 64, shape) for _ in range(6)] + [[]]
    batch = random_batch(rng, 50, trees, rules=[int(rule)] * len(trees))
    expected = accept_trees_reference(**batch)
    assert_same_acceptance(accept_trees(**batch), expected)
    assert expected.num_accepted[-1] == 0 and expected.out_tokens[-1, 0] >= 0  # empty tree


@pytest.mark.parametrize("rule", [AcceptRule.CANDIDATES, AcceptRule.MCSS,
                                  AcceptRule.MCSS_NO_REPLACEMENT])
def test_duplicate_siblings_and_q_equal_p(rule):
    vocab = 7
    rng = np.random.default_rng(int(rule))
    trees = [[-1, -1, -1, 0, 0, 0]] * 30
    batch = random_batch(rng, vocab, trees, rules=[int(rule)] * len(trees))
    batch["tokens"] = np.tile(np.array([2, 2, 5, 1, 1, 1], np.int32), len(trees))
    batch["draft_probs"][::3] = batch["scores"][::3]
    assert_same_acceptance(accept_trees(**batch), accept_trees_reference(**batch))


def test_out_width_cuts_trees():
    rng = np.random.default_rng(5)
    trees = [list(range(-1, 69))] * 4
    batch = random_batch(rng, 50, trees, rules=[0, 1, 2, 3])
    assert accept_trees(**batch).out_tokens.shape == (4, 71)  # default: deepest tree + 1
    for width in (1, 2, 5, 80):
        got = accept_trees(**batch, out_width=width)
        assert got.out_tokens.shape == (4, width) and got.path_nodes.shape == (4, width - 1)
        assert (got.num_accepted <= width - 1).all()
        assert_same_acceptance(got, accept_trees_reference(**batch, out_width=width))


def test_empty_batch():
    got = accept_trees(np.zeros((0, 5), np.float32), [], [], [0], [], np.zeros(0, np.uint64))
    assert got.out_tokens.shape == (0, 1) and got.num_accepted.shape == (0,)


def test_greedy_known_answer():
    # root -> 4 (0) -> 2 (1), root -> 3 (2); argmax: root 4, after node 0: 1 (not 2)
    scores = np.zeros((4, 6), np.float32)
    scores[0, [3, 4]] = [1, 2]
    scores[1, [1, 2]] = [5, 5]  # tie between 1 and 2 goes to 1
    got = accept_trees(scores, [4, 2, 3], [-1, 0, -1], [0, 3], [0], [0])
    assert got.tokens(0) == [4, 1] and got.path_nodes.tolist() == [[0, -1]]
    scores[1, 1] = 0
    got = accept_trees(scores, [4, 2, 3], [-1, 0, -1], [0, 3], [0], [0])
    assert got.tokens(0) == [4, 2, 0] and got.path_nodes.tolist() == [[0, 1]]


def test_sampled_rules_accept_certain_candidates():
    # p puts all mass on token 3: a candidate 3 is always accepted, else 3 is emitted
    p = np.zeros((3, 5), np.float32)
    p[:, 3] = 1.0
    for rule in (1, 2, 3):
        got = accept_trees(p, [3, 3], [-1, 0], [0, 2], [rule], [rule], draft_probs=p)
        assert got.tokens(0) == [3, 3, 3]
        got = accept_trees(p, [1, 3], [-1, 0], [0, 2], [rule], [rule], draft_probs=p)
        assert got.tokens(0) == [3]


def test_all_zero_probabilities_emit_minus_one():
    scores = np.zeros((2, 4), np.float32)
    got = accept_trees(scores, [1], [-1], [0, 1], [1], [0])
    assert got.tokens(0) == [-1]
    assert accept_trees_reference(scores, [1], [-1], [0, 1], [1], [0]).tokens(0) == [-1]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(parents=[-1, 1, 0]), "parents\\[1\\] = 1 must be -1 or a local index below"),
        (dict(parents=[-1, -2, 0]), "parents\\[1\\] = -2"),
        (dict(offsets=[0, 2, 1, 3]), "offsets must not decrease"),
        (dict(offsets=[1, 3]), "offsets\\[0\\] must be 0"),
        (dict(offsets=[0, 2]), "must equal the number of nodes 3"),
        (dict(tokens=[0, 9, 1]), "tokens\\[1\\] = 9 is outside the vocabulary"),
        (dict(rules=[4]), "rules\\[0\\] = 4 is not an AcceptRule"),
        (dict(rules=[2]), "draft_probs is required"),
        (dict(scores=np.ones((3, 5), np.float32)), "scores must be \\[N \\+ B, V\\]"),
        (dict(seeds=[1, 2]), "rules and seeds must have one entry per request"),
        (dict(out_width=0), "out_width must be >= 1"),
    ],
)
def test_bad_inputs_are_rejected(change, message):
    args = dict(scores=np.ones((4, 5), np.float32), tokens=[0, 1, 2], parents=[-1, 0, 0],
                offsets=[0, 3], rules=[0], seeds=[0]) | change
    with pytest.raises(ValueError, match=message):
        accept_trees(**args)


def test_bad_trees_are_rejected_by_packing():
    with pytest.raises(ValueError, match="below the largest tree"):
        pack_tree_masks([-1, 0, 1], [0, 3], 2)
    with pytest.raises(ValueError, match="parents\\[2\\] = 2"):
        pack_tree_masks([-1, 0, 2], [0, 3], 4)


def test_extension_checks_shapes():
    from vllm_retrieval_spec.kernels.extension import load_extension

    ext = load_extension()
    with pytest.raises(ValueError, match="scores must have N \\+ B = 2 rows"):
        ext.accept_trees(np.ones((3, 4), np.float32), None, np.zeros(1, np.int32),
                         np.full(1, -1, np.int32), np.array([0, 1], np.int32),
                         np.zeros(1, np.int32), np.zeros(1, np.uint64),
                         np.empty((1, 2), np.int32), np.empty((1, 1), np.int32),
                         np.empty(1, np.int32))
    with pytest.raises(ValueError, match="offsets must start at 0"):
        ext.pack_tree_masks(np.full(2, -1, np.int32), np.array([0, 5], np.int32),
                            np.empty(2, np.int32), None)


# ---- CUDA ------------------------------------------------------------------------------------


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return "cuda" in extension_backends() and torch.cuda.is_available()


@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA build of _C and a GPU")
@pytest.mark.parametrize("seed", range(20))
def test_cuda_kernels_match_cpu(seed):
    import torch

    rng = np.random.default_rng(2000 + seed)
    vocab = int(rng.choice([7, 50, 1000, 40000]))
    trees = random_trees(rng, int(rng.integers(1, 12)), int(rng.choice([4, 16, 64])))
    batch = random_batch(rng, vocab, trees)
    expected = accept_trees(**batch)
    on_gpu = {k: torch.from_numpy(np.asarray(v)).cuda() for k, v in batch.items()}
    got = accept_trees(**on_gpu)
    for name in ("out_tokens", "path_nodes", "num_accepted"):
        assert np.array_equal(getattr(got, name).cpu().numpy(), getattr(expected, name)), name
    masks = pack_tree_masks(on_gpu["parents"], on_gpu["offsets"], 64)
    cpu_masks = pack_tree_masks(batch["parents"], batch["offsets"], 64)
    assert np.array_equal(masks.depth.cpu().numpy(), cpu_masks.depth)
    assert np.array_equal(masks.ancestor_mask.cpu().numpy(), cpu_masks.ancestor_mask)
