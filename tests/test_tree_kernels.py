"""The C++ tree packing and acceptance kernels (and their lazy target rows) equal their NumPy
references, exactly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from vllm_retrieval_spec.kernels import extension_backends
from vllm_retrieval_spec.kernels.tree import (
    AcceptRule,
    RowSampling,
    SparseDraft,
    TreeBatch,
    accept_trees,
    pack_tree_masks,
    target_distributions,
    tree_depths,
    tree_row_offsets,
)
from vllm_retrieval_spec.kernels.tree_reference import (
    accept_trees_reference,
    canonical_sample,
    canonical_total,
    exp_neg,
    keyed_uniform,
    pack_tree_masks_reference,
    sparse_to_dense,
    target_distributions_reference,
    target_row_reference,
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
    positions = rng.integers(0, 2**40, len(trees), dtype=np.int64)  # read by the keyed rule only
    return dict(scores=scores, tokens=tokens, parents=parents, offsets=offsets,
                rules=np.array(rules, dtype=np.int32), seeds=seeds, draft_probs=draft, positions=positions)


def assert_same_acceptance(got, expected) -> None:
    for name in ("out_tokens", "path_nodes", "num_accepted"):
        assert np.array_equal(getattr(got, name), getattr(expected, name)), name


TREE_FIELDS = ("tokens", "parents", "offsets", "rules", "seeds", "positions")


def verify(kernel, batch: dict, **changes):
    """``kernel`` (:func:`accept_trees` or its reference) on a flat test batch with ``changes``:
    the tree fields make its :class:`TreeBatch`, the others stay keywords."""
    args = batch | changes
    trees = TreeBatch(**{name: args.pop(name) for name in TREE_FIELDS if name in args})
    return kernel(args.pop("scores"), trees, **args)


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
    expected = verify(accept_trees_reference, batch)
    for threads in (1, 4):
        assert_same_acceptance(verify(accept_trees, batch, num_threads=threads), expected)


@pytest.mark.parametrize("rule", list(AcceptRule))
@pytest.mark.parametrize("shape", ["chain", "star", "bushy"])
def test_accept_matches_reference_per_rule_on_extreme_shapes(rule, shape):
    rng = np.random.default_rng(100 * int(rule) + len(shape))
    trees = [tree_parents(rng, 64, shape) for _ in range(6)] + [[]]
    batch = random_batch(rng, 50, trees, rules=[int(rule)] * len(trees))
    expected = verify(accept_trees_reference, batch)
    assert_same_acceptance(verify(accept_trees, batch), expected)
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
    assert_same_acceptance(verify(accept_trees, batch), verify(accept_trees_reference, batch))


def test_out_width_cuts_trees():
    rng = np.random.default_rng(5)
    trees = [list(range(-1, 69))] * 4
    batch = random_batch(rng, 50, trees, rules=[0, 1, 2, 3])
    assert verify(accept_trees, batch).out_tokens.shape == (4, 71)  # default: deepest tree + 1
    for width in (1, 2, 5, 80):
        got = verify(accept_trees, batch, out_width=width)
        assert got.out_tokens.shape == (4, width) and got.path_nodes.shape == (4, width - 1)
        assert (got.num_accepted <= width - 1).all()
        assert_same_acceptance(got, verify(accept_trees_reference, batch, out_width=width))


def test_empty_batch():
    got = accept_trees(np.zeros((0, 5), np.float32), TreeBatch([], [], [0], [], np.zeros(0, np.uint64)))
    assert got.out_tokens.shape == (0, 1) and got.num_accepted.shape == (0,)


def test_greedy_known_answer():
    # root -> 4 (0) -> 2 (1), root -> 3 (2); argmax: root 4, after node 0: 1 (not 2)
    scores = np.zeros((4, 6), np.float32)
    scores[0, [3, 4]] = [1, 2]
    scores[1, [1, 2]] = [5, 5]  # tie between 1 and 2 goes to 1
    got = accept_trees(scores, TreeBatch([4, 2, 3], [-1, 0, -1], [0, 3], [0], [0]))
    assert got.tokens(0) == [4, 1] and got.path_nodes.tolist() == [[0, -1]]
    scores[1, 1] = 0
    got = accept_trees(scores, TreeBatch([4, 2, 3], [-1, 0, -1], [0, 3], [0], [0]))
    assert got.tokens(0) == [4, 2, 0] and got.path_nodes.tolist() == [[0, 1]]


def test_sampled_rules_accept_certain_candidates():
    # p puts all mass on token 3: a candidate 3 is always accepted, else 3 is emitted
    p = np.zeros((3, 5), np.float32)
    p[:, 3] = 1.0
    for rule in (1, 2, 3):
        got = accept_trees(p, TreeBatch([3, 3], [-1, 0], [0, 2], [rule], [rule]), draft_probs=p)
        assert got.tokens(0) == [3, 3, 3]
        got = accept_trees(p, TreeBatch([1, 3], [-1, 0], [0, 2], [rule], [rule]), draft_probs=p)
        assert got.tokens(0) == [3]


def test_all_zero_probabilities_emit_minus_one():
    scores = np.zeros((2, 4), np.float32)
    got = accept_trees(scores, TreeBatch([1], [-1], [0, 1], [1], [0]))
    assert got.tokens(0) == [-1]
    assert accept_trees_reference(scores, TreeBatch([1], [-1], [0, 1], [1], [0])).tokens(0) == [-1]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(parents=[-1, 1, 0]), "parents\\[1\\] = 1 must be -1 or a local index below"),
        (dict(parents=[-1, -2, 0]), "parents\\[1\\] = -2"),
        (dict(offsets=[0, 2, 1, 3]), "offsets must not decrease"),
        (dict(offsets=[1, 3]), "offsets\\[0\\] must be 0"),
        (dict(offsets=[0, 2]), "must equal the number of nodes 3"),
        (dict(tokens=[0, 9, 1]), "tokens\\[1\\] = 9 is outside the vocabulary"),
        (dict(rules=[5]), "rules\\[0\\] = 5 is not an AcceptRule \\(0-4\\)"),
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
        verify(accept_trees, args)


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
    expected = verify(accept_trees, batch)
    on_gpu = {k: torch.from_numpy(np.asarray(v)).cuda() for k, v in batch.items()}
    got = verify(accept_trees, on_gpu)
    for name in ("out_tokens", "path_nodes", "num_accepted"):
        assert np.array_equal(getattr(got, name).cpu().numpy(), getattr(expected, name)), name
    masks = pack_tree_masks(on_gpu["parents"], on_gpu["offsets"], 64)
    cpu_masks = pack_tree_masks(batch["parents"], batch["offsets"], 64)
    assert np.array_equal(masks.depth.cpu().numpy(), cpu_masks.depth)
    assert np.array_equal(masks.ancestor_mask.cpu().numpy(), cpu_masks.ancestor_mask)


# ---- lazy target rows and sparse draft rows --------------------------------------------------


def logit_row(rng: np.random.Generator, vocab: int, kind: str) -> np.ndarray:
    """Raw logits with the awkward cases: ties, -inf entries, one finite token, NaN."""
    if kind == "ties":
        row = rng.integers(-3, 3, vocab).astype(np.float32)
    elif kind == "masked":
        row = rng.normal(0, 3, vocab).astype(np.float32)
        row[rng.random(vocab) < 0.5] = -np.inf
    elif kind == "single":
        row = np.full(vocab, -np.inf, np.float32)
        row[rng.integers(vocab)] = rng.normal()
    elif kind == "flat":
        row = np.where(rng.random(vocab) < 0.5, np.float32(0.0), np.float32(-0.0))
    elif kind == "nan":
        row = rng.normal(0, 2, vocab).astype(np.float32)
        row[rng.integers(vocab)] = np.nan
    else:
        row = (rng.normal(0, 1, vocab) * rng.choice([0.5, 3.0, 30.0])).astype(np.float32)
    return row


LOGIT_KINDS = ("normal", "normal", "ties", "masked", "single", "flat", "nan")


def random_sampling(rng: np.random.Generator, batch: int, vocab: int) -> RowSampling:
    return RowSampling(
        temperature=rng.choice([0.05, 0.7, 1.0, 2.5], batch).astype(np.float32),
        top_k=rng.choice([0, -1, 1, 2, 5, max(1, vocab // 2), vocab, vocab + 7], batch).astype(np.int32),
        top_p=rng.choice([1e-7, 0.3, 0.9, 0.99, 1.0, 1.5], batch).astype(np.float32),
    )


def sparse_rows(rng: np.random.Generator, targets: np.ndarray, width: int) -> SparseDraft:
    """Draft rows of up to `width` tokens each, -1 padded anywhere: the target's likeliest
    tokens (so candidates get accepted) and others, with probabilities near the target's or not."""
    rows, vocab = targets.shape
    tokens = np.full((rows, width), -1, np.int32)
    probs = rng.random((rows, width)).astype(np.float32)  # padding carries junk on purpose
    for r in range(rows):
        size = int(rng.integers(0, min(width, vocab) + 1))
        likely = np.argsort(-targets[r], kind="stable")[: size // 2]
        others = rng.permutation(np.setdiff1d(np.arange(vocab), likely))[: size - len(likely)]
        chosen = np.concatenate([likely, others]).astype(np.int32)
        slots = rng.permutation(width)[:size]
        tokens[r, slots] = chosen
        total = targets[r].sum()
        near = targets[r, chosen] / total if total > 0 else 0.0
        probs[r, slots] = np.where(rng.random(size) < 0.5, near, rng.random(size)) * rng.uniform(0.5, 2)
        probs[r, slots[rng.random(size) < 0.1]] = 0.0
    return SparseDraft(tokens, probs)


def lazy_batch(seed: int, vocab: int, sparse: bool, max_size: int = 12) -> dict:
    """Logits, sampling parameters and draft rows (dense or sparse) for random trees whose
    tokens mostly follow the parent's target (rules 1, and 0 now and then) or draft row."""
    rng = np.random.default_rng(seed)
    trees = random_trees(rng, int(rng.integers(1, 6)), max_size)
    parents, offsets = flat_trees(trees)
    rules = rng.choice([0, 1, 1, 2, 2, 3, 3], len(trees)).astype(np.int32)
    sampling = random_sampling(rng, len(trees), vocab)
    rows = len(parents) + len(trees)
    row_request = np.repeat(np.arange(len(trees)), np.diff(offsets) + 1)
    kinds = [str(rng.choice(LOGIT_KINDS[:-1] if rules[b] == AcceptRule.GREEDY else LOGIT_KINDS))
             for b in row_request]  # greedy logits hold no NaN
    scores = np.stack([logit_row(rng, vocab, kind) for kind in kinds])
    targets = target_distributions_reference(
        scores, RowSampling(*(a[row_request] for a in (sampling.temperature, sampling.top_k,
                                                        sampling.top_p))))
    if sparse:
        draft = sparse_rows(rng, targets, int(rng.choice([1, 3, 8])))
        dense = sparse_to_dense(draft, vocab)
    else:
        draft = None
        dense = np.stack([probability_row(rng, vocab) for _ in range(rows)])
        blend = rng.random(rows) < 0.5
        dense[blend] = (targets[blend] / np.maximum(targets[blend].sum(1, keepdims=True), 1e-300)
                        + dense[blend]).astype(np.float32)
    tokens = np.empty(len(parents), np.int32)
    for b, tree in enumerate(trees):
        first_row = int(offsets[b]) + b
        for local, parent in enumerate(tree):
            row = (dense if rules[b] >= AcceptRule.MCSS else targets)[first_row + parent + 1]
            follow = row.sum() > 0 and rng.random() < 0.85
            tokens[offsets[b] + local] = (rng.choice(vocab, p=row / row.sum()) if follow
                                          else rng.integers(vocab))
    seeds = rng.integers(0, 2**63, len(trees), dtype=np.uint64)
    batch = dict(scores=scores, tokens=tokens, parents=parents, offsets=offsets, rules=rules,
                 seeds=seeds, sampling=sampling)
    return batch | (dict(draft=draft) if sparse else dict(draft_probs=dense))


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([1, 2, 7, 50, 300, 1100]),
       sparse=st.booleans())
def test_lazy_rows_match_reference(seed, vocab, sparse):
    batch = lazy_batch(seed, vocab, sparse)
    expected = verify(accept_trees_reference, batch)
    for threads in (1, 3):
        assert_same_acceptance(verify(accept_trees, batch, num_threads=threads), expected)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([7, 50, 1100]))
def test_sparse_draft_rows_equal_their_dense_rows(seed, vocab):
    batch = lazy_batch(seed, vocab, sparse=True)
    dense = sparse_to_dense(batch["draft"], vocab)
    for sampling in (batch["sampling"], None):
        if sampling is None:  # probabilities instead of logits
            batch["scores"] = np.stack([probability_row(np.random.default_rng(seed + r), vocab)
                                        for r in range(len(batch["scores"]))])
        args = batch | dict(sampling=sampling)
        sparse_result = verify(accept_trees, args)
        dense_result = verify(accept_trees, args, draft=None, draft_probs=dense)
        assert_same_acceptance(sparse_result, dense_result)
        assert_same_acceptance(sparse_result, verify(accept_trees_reference, args))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([7, 50, 1100]),
       sparse=st.booleans())
def test_lazy_rows_are_the_old_path_on_the_target_rows(seed, vocab, sparse):
    """Verifying logits with sampling = verifying the rows' target distributions (float64, the
    reference's rows; greedy rows keep their logits) without sampling."""
    batch = lazy_batch(seed, vocab, sparse)
    counts = np.diff(batch["offsets"]) + 1
    per_row = RowSampling(*(np.repeat(a, counts) for a in (batch["sampling"].temperature,
                                                            batch["sampling"].top_k,
                                                            batch["sampling"].top_p)))
    greedy_rows = np.repeat(batch["rules"] == AcceptRule.GREEDY, counts)
    targets = target_distributions_reference(batch["scores"], per_row)
    rows = np.where(greedy_rows[:, None], batch["scores"].astype(np.float64), targets)
    old_path = verify(accept_trees_reference, batch, scores=rows, sampling=None)
    assert_same_acceptance(verify(accept_trees, batch), old_path)


def test_lazy_rows_are_the_old_kernel_on_exact_target_rows():
    """Where the target rows are exactly float32 (logits 0 or -inf give e in {0, 1}), the
    kernel fed logits and the kernel fed the rows agree token for token."""
    rng = np.random.default_rng(11)
    trees = [tree_parents(rng, 12, shape) for shape in ("chain", "bushy", "random")] * 20
    parents, offsets = flat_trees(trees)
    vocab, rows = 40, len(parents) + len(trees)
    scores = np.where(rng.random((rows, vocab)) < 0.4, np.float32(0.0), np.float32(-np.inf))
    scores[:, 0] = 0.0
    sampling = RowSampling(np.full(len(trees), 0.8, np.float32),
                           rng.choice([0, 3, 10], len(trees)).astype(np.int32),
                           rng.choice([0.2, 0.6, 1.0], len(trees)).astype(np.float32))
    counts = np.diff(offsets) + 1
    targets = target_distributions(scores, RowSampling(*(np.repeat(a, counts) for a in (
        sampling.temperature, sampling.top_k, sampling.top_p))))
    assert set(np.unique(targets)) <= {0.0, 1.0}
    tokens = np.array([rng.choice(np.flatnonzero(targets[o + b + p + 1]))
                       for b, tree in enumerate(trees) for o in [offsets[b]] for p in tree], np.int32)
    batch = TreeBatch(tokens, parents, offsets, np.ones(len(trees), np.int32),
                      np.arange(len(trees), dtype=np.uint64))
    lazy = accept_trees(scores, batch, sampling=sampling)
    assert_same_acceptance(lazy, accept_trees(targets.astype(np.float32), batch))
    assert lazy.num_accepted.max() >= 2  # walks go past the root


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([1, 2, 5, 33, 1000, 3000]),
       kind=st.sampled_from(LOGIT_KINDS))
def test_target_rows_match_reference(seed, vocab, kind):
    rng = np.random.default_rng(seed)
    logits = np.stack([logit_row(rng, vocab, kind) for _ in range(4)])
    sampling = random_sampling(rng, 4, vocab)
    expected = target_distributions_reference(logits, sampling)
    assert np.array_equal(target_distributions(logits, sampling), expected)
    assert np.array_equal(target_distributions(logits, sampling, num_threads=2), expected)


def test_target_rows_known_answers():
    logits = np.array([[1.0, 3.0, 2.0, 3.0, -np.inf, np.nan]] * 4, np.float32)
    sampling = RowSampling(np.array([1.0, 1.0, 2.0, 1.0], np.float32),
                           np.array([0, 1, 3, 0], np.int32), np.array([1.0, 1.0, 1.0, 1e-9], np.float32))
    rows = target_distributions(logits, sampling)
    e = np.exp([-2.0, 0.0, -1.0, 0.0])
    assert np.allclose(rows[0], [*e, 0, 0], rtol=1e-15)
    assert np.array_equal(rows[1] > 0, [False, True, False, True, False, False])  # ties kept
    assert np.allclose(rows[2], [0, 1, np.exp(-0.5), 1, 0, 0], rtol=1e-15)
    assert rows[3].tolist() == [0, 0, 0, 1, 0, 0]  # at least one token: the last of the ties
    assert canonical_total(rows[0]) == pytest.approx(e.sum(), rel=1e-15)


def test_exp_neg_is_accurate():
    y = -np.linspace(0, 700, 200001)
    assert np.allclose(exp_neg(y), np.exp(y), rtol=4e-16, atol=0)
    assert exp_neg(np.array([-700.5, -np.inf, 0.0])).tolist() == [0.0, 0.0, 1.0]


def _vllm_rows(logits: np.ndarray, sampling: RowSampling) -> np.ndarray:
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    vocab = logits.shape[1]
    k = np.where((sampling.top_k > 0) & (sampling.top_k < vocab), sampling.top_k, vocab)
    scaled = torch.from_numpy(logits) / torch.from_numpy(sampling.temperature)[:, None]
    processed = apply_top_k_top_p(scaled, torch.from_numpy(k).long(),
                                  torch.from_numpy(np.minimum(sampling.top_p, 1.0)))
    return processed.softmax(dim=-1).numpy()


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([2, 10, 500, 5000]))
def test_target_rows_are_vllms(seed, vocab):
    """softmax(apply_top_k_top_p(logits / T, k, p)), to float32 tolerance, on rows without
    boundary ties: distinct logits and a top-p cut clear of float32 rounding."""
    pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    rng = np.random.default_rng(seed)
    rows = 3
    logits = (rng.permutation(vocab)[None, :] * 0.013 + rng.normal(0, 3, (rows, 1))).astype(np.float32)
    logits = np.stack([rng.permutation(row) * float(rng.choice([0.3, 1.0, 4.0]))
                       for row in logits]).astype(np.float32)
    sampling = random_sampling(rng, rows, vocab)
    ours = target_distributions(logits, sampling)
    for r in range(rows):
        e = target_row_reference(logits[r], sampling.temperature[r], sampling.top_k[r], 1.0)
        ascending = np.sort(e[e > 0])
        margin = np.abs(np.cumsum(ascending) / ascending.sum() - (1 - float(sampling.top_p[r])))
        assume(sampling.top_p[r] >= 1 or margin.min() > 1e-5)
    expected = _vllm_rows(logits, sampling)
    got = ours / ours.sum(axis=1, keepdims=True)
    assert (expected[got == 0] == 0).all()  # the same kept tokens, but where float32 underflows
    assert (expected[got > 1e-37] > 0).all()
    # vLLM rounds x = logits / T to float32: relative errors of a few ulp(max |x|) in exp
    x_max = np.abs(logits / sampling.temperature[:, None]).max(axis=1, keepdims=True)
    assert (np.abs(got - expected) <= (1e-5 + 4 * x_max * 2.0**-24) * got + 1e-7).all()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(sampling=RowSampling([0.0], [0], [1.0])), "sampling.temperature\\[0\\] = 0.0 must be"),
        (dict(sampling=RowSampling([1.0], [0], [0.0])), "sampling.top_p\\[0\\] = 0.0 must be > 0"),
        (dict(sampling=RowSampling([1.0, 1.0], [0, 0], [1.0, 1.0])),
         "sampling.temperature must have one entry per request"),
        (dict(rules=[2], draft=SparseDraft(np.zeros((4, 2)), np.ones((4, 2))),
              draft_probs=np.ones((4, 5))), "not both"),
        (dict(rules=[2], draft=SparseDraft(np.zeros((3, 2)), np.ones((3, 2)))),
         "draft.tokens and draft.probs must both be \\[N \\+ B, M\\]"),
        (dict(rules=[3], draft=SparseDraft([[1, 1]] * 4, np.ones((4, 2)))),
         "draft.tokens\\[0\\] lists token 1 twice"),
        (dict(rules=[3], draft=SparseDraft([[1, -2]] * 4, np.ones((4, 2)))),
         "draft.tokens\\[0, 1\\] = -2 must be a token in \\[0, 5\\) or -1"),
        (dict(rules=[3], draft=SparseDraft([[1, -1]] * 4, [[-1.0, -1.0]] * 4)),
         "draft.probs\\[0, 0\\] = -1.0 must be finite and >= 0"),
    ],
)
def test_bad_sampling_and_sparse_drafts_are_rejected(change, message):
    args = dict(scores=np.ones((4, 5), np.float32), tokens=[0, 1, 2], parents=[-1, 0, 0],
                offsets=[0, 3], rules=[1], seeds=[0]) | change
    with pytest.raises(ValueError, match=message):
        verify(accept_trees, args)


def test_greedy_requests_ignore_sampling():
    rng = np.random.default_rng(3)
    batch = random_batch(rng, 50, [list(range(-1, 9))] * 5, rules=[0] * 5)
    sampling = RowSampling(np.zeros(5, np.float32), np.ones(5, np.int32), np.full(5, 0.1, np.float32))
    assert_same_acceptance(verify(accept_trees, batch, sampling=sampling), verify(accept_trees, batch))


def test_extension_checks_sampling_and_sparse_shapes():
    from vllm_retrieval_spec.kernels.extension import load_extension

    ext = load_extension()
    args = (np.ones((2, 4), np.float32), None, np.zeros(1, np.int32), np.full(1, -1, np.int32),
            np.array([0, 1], np.int32), np.ones(1, np.int32), np.zeros(1, np.uint64),
            np.empty((1, 2), np.int32), np.empty((1, 1), np.int32), np.empty(1, np.int32))
    with pytest.raises(ValueError, match="must be given together"):
        ext.accept_trees(*args, temperature=np.ones(1, np.float32))
    with pytest.raises(ValueError, match="draft_tokens and draft_values must both be"):
        ext.accept_trees(*args, draft_tokens=np.zeros((1, 3), np.int32),
                         draft_values=np.zeros((1, 3), np.float32))


def on_cuda(value):
    """A batch value (array, RowSampling or SparseDraft of arrays) as CUDA tensors."""
    import torch

    if isinstance(value, (RowSampling, SparseDraft)):
        return type(value)(*(torch.from_numpy(np.asarray(v)).cuda() for v in vars(value).values()))
    return torch.from_numpy(np.asarray(value)).cuda()


VOCABS = [7, 50, 1100, 40000]  # vocabularies from tiny to Llama-sized


def assert_cuda_walks_like_cpu(batch: dict) -> None:
    """``accept_trees`` on CUDA copies of ``batch`` walks exactly as on the CPU."""
    expected = verify(accept_trees, batch)
    got = verify(accept_trees, {k: on_cuda(v) for k, v in batch.items()})
    for name in ("out_tokens", "path_nodes", "num_accepted"):
        assert np.array_equal(getattr(got, name).cpu().numpy(), getattr(expected, name)), name


@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA build of _C and a GPU")
@pytest.mark.parametrize("seed", range(20))
def test_cuda_lazy_and_sparse_rows_match_cpu(seed):
    batch = lazy_batch(3000 + seed, VOCABS[seed % 4], sparse=seed % 2 == 1)
    assert_cuda_walks_like_cpu(batch)
    logits = batch["scores"][: len(batch["rules"])]
    sampling = RowSampling(*(np.asarray(v) for v in vars(batch["sampling"]).values()))
    rows = target_distributions(on_cuda(logits), on_cuda(sampling))
    assert np.array_equal(rows.cpu().numpy(), target_distributions(logits, sampling))


# ---- the keyed rule (seeded sampling) --------------------------------------------------------


def keyed_batch(seed: int, vocab: int, lazy: bool) -> dict:
    """A batch mixing keyed requests (about half) with the other rules, on probabilities or
    (lazy) on logits with sampling parameters, and each request's root position."""
    rng = np.random.default_rng(seed)
    if lazy:
        batch = lazy_batch(seed, vocab, sparse=False)
    else:
        trees = random_trees(rng, int(rng.integers(1, 8)), int(rng.choice([4, 16])))
        batch = random_batch(rng, vocab, trees, [int(r) for r in rng.choice([0, 1, 2, 3], len(trees))])
    rules = batch["rules"]
    batch["rules"] = np.where(rng.random(len(rules)) < 0.5, AcceptRule.KEYED, rules).astype(np.int32)
    batch["positions"] = rng.integers(0, 2**40, len(rules), dtype=np.int64)
    return batch


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([1, 7, 50, 1100]), lazy=st.booleans())
def test_keyed_rule_matches_reference(seed, vocab, lazy):
    batch = keyed_batch(seed, vocab, lazy)
    expected = verify(accept_trees_reference, batch)
    for threads in (1, 3):
        assert_same_acceptance(verify(accept_trees, batch, num_threads=threads), expected)


def test_keyed_rule_emits_the_no_draft_tokens_whatever_was_drafted():
    """Position t's token is the keyed sample of its row, drafted or not: a tree accepts the
    child carrying it (wherever it sits among its siblings) and emits the next one."""
    rng = np.random.default_rng(11)
    vocab, seed, position = 300, 4242, 77
    root, child = probability_row(rng, vocab), probability_row(rng, vocab)
    first = canonical_sample(root.astype(np.float64), keyed_uniform(seed, position))
    second = canonical_sample(child.astype(np.float64), keyed_uniform(seed, position + 1))
    others = [t for t in range(vocab) if t != first][:3]

    def run(tokens: list[int], parents: list[int]):
        rows = np.stack([root] + [child if t == first else probability_row(rng, vocab) for t in tokens])
        batch = TreeBatch(np.array(tokens, np.int32), np.array(parents, np.int32),
                          np.array([0, len(tokens)], np.int32), [AcceptRule.KEYED], [seed], positions=[position])
        return accept_trees(rows, batch, out_width=3)

    assert run([], []).tokens(0) == [first]
    assert run(others, [-1, -1, -1]).tokens(0) == [first]
    for place in range(4):
        siblings = [*others[:place], first, *others[place:]]
        out = run(siblings, [-1] * 4)
        assert out.tokens(0) == [first, second] and out.path_nodes[0, 0] == place


def test_keyed_rule_needs_positions():
    batch = keyed_batch(5, 50, lazy=False)
    batch["rules"][0] = AcceptRule.KEYED
    with pytest.raises(ValueError, match=r"positions .* is required by AcceptRule\.KEYED"):
        verify(accept_trees, batch, positions=None)
    with pytest.raises(ValueError, match="positions must have one entry per request"):
        verify(accept_trees, batch, positions=np.zeros(len(batch["rules"]) + 1, np.int64))
    with pytest.raises(ValueError, match=r"positions\[0\] = -1 must be >= 0"):
        verify(accept_trees, batch, positions=np.full(len(batch["rules"]), -1, np.int64))


@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA build of _C and a GPU")
@pytest.mark.parametrize("seed", range(12))
def test_cuda_keyed_rule_matches_cpu(seed):
    batch = keyed_batch(4000 + seed, VOCABS[seed % 4], lazy=seed % 2 == 1)
    assert_cuda_walks_like_cpu(batch)
