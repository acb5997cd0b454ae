"""The skinny GEMM of verification steps equals a float64 reference, SkinnyLinear hands every
call it cannot take to the layer's own GEMM."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_retrieval_spec import _C
from vllm_retrieval_spec.kernels.skinny_gemm import HugePageArena, ScreenedHead, SkinnyLinear, pack_weight, skinny_gemm


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 100), in_features=st.integers(1, 300), out_features=st.integers(1, 700),
       with_bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_kernel_equals_float64_reference(rows, in_features, out_features, with_bias, seed):
    """Every shape (partial panels, every split of the rows into blocks, one thread or the team)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    got = skinny_gemm(x, weight, bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    # float32 sums of `in_features` products of unit normals: rounding grows with sqrt(in_features)
    torch.testing.assert_close(got.double(), reference(x, weight, bias), rtol=0, atol=2e-6 * in_features**0.5 * 8)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(2, 100), out_features=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(rows, out_features, seed):
    """Bit for bit: every output is summed over k in order, however the rows are blocked."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 96, generator=generator)
    weight, bias = torch.randn(out_features, 96, generator=generator), torch.randn(out_features, generator=generator)
    together = skinny_gemm(x, weight, bias)
    for row in (0, rows // 2, rows - 1):
        assert torch.equal(skinny_gemm(x[row:row + 1].clone(), weight, bias)[0], together[row])


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 24, 32, 96])
def test_avx512_blocks_give_the_avx2_blocks_sums_bit_for_bit(rows, both_lane_widths):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=generator)
    weight, bias = torch.randn(301, 200, generator=generator), torch.randn(301, generator=generator)
    assert torch.equal(*both_lane_widths(lambda: skinny_gemm(x, weight, bias)))


def test_packed_layout_is_panels_of_output_columns():
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    packed = pack_weight(weight)
    panel = _C.SKINNY_GEMM_PANEL
    assert packed.shape == (-(-20 // panel), 3, panel) and packed.is_contiguous()
    for n in range(20):
        assert torch.equal(packed[n // panel, :, n % panel], weight[n])
    assert not packed[-1, :, 20 % panel:].any()  # the last panel's missing columns are zero


def test_weights_packed_in_one_arena_give_the_same_outputs():
    generator = torch.Generator().manual_seed(3)
    arena = HugePageArena(chunk_bytes=64 << 10)  # small chunks: layers share one, and a large one maps its own
    weights = [torch.randn(out_features, 96, generator=generator) for out_features in (20, 48, 200, 7)]
    linears = [SkinnyLinear(weight, torch.nn.functional.linear, 8, arena) for weight in weights]
    x = torch.randn(5, 96, generator=generator)
    for linear, weight in zip(linears, weights):
        assert torch.equal(linear.packed, pack_weight(weight))
        assert linear.packed.data_ptr() % HugePageArena.ALIGN == 0
        assert torch.equal(linear(x, weight, None), skinny_gemm(x, weight))
    del arena, weights
    assert torch.equal(linears[0](x, torch.empty(0), None), linears[0](x.clone(), torch.empty(0), None))


def test_kernel_runs_on_torchs_openmp_team():
    assert _C.skinny_gemm_threads() == torch.get_num_threads()


@pytest.mark.parametrize("case, message", [
    (lambda x, w, b: (x.double(), w, b), "x must be a contiguous float32"),
    (lambda x, w, b: (x.T, w.T.contiguous(), b), "x must be a contiguous float32"),
    (lambda x, w, b: (x, w[:, :5], b), "weight must be a contiguous float32"),
    (lambda x, w, b: (x[:, :4].contiguous(), w, b), "must share a non-empty `in`"),
    (lambda x, w, b: (x[:0], w, b), "must share a non-empty `in`"),
    (lambda x, w, b: (x, w, b[:3]), r"bias must have shape \(16,\)"),
])
def test_bad_operands_are_refused(case, message):
    x, weight, bias = torch.randn(3, 8), torch.randn(16, 8), torch.randn(16)
    with pytest.raises(ValueError, match=message):
        skinny_gemm(*case(x, weight, bias))


def test_skinny_linear_takes_few_rows_and_hands_the_rest_back():
    weight, bias = torch.randn(24, 10), torch.randn(24)
    calls = []

    def fallback(x, w, b):
        calls.append(x.shape)
        return x

    linear = SkinnyLinear(weight, fallback, max_rows=4)
    for x in (torch.randn(1, 10), torch.randn(4, 10)):
        torch.testing.assert_close(linear(x, torch.empty(0), bias), torch.nn.functional.linear(x, weight, bias))
    assert calls == []
    for x in (torch.randn(5, 10), torch.randn(2, 3, 10), torch.randn(10, 3).T, torch.randn(2, 10).double(),
              torch.randn(2, 9)):
        assert linear(x, torch.empty(0), None) is x
    x = torch.randn(2, 10)
    assert linear(x, torch.empty(0), bias[:5]) is x  # a bias the kernel would read past
    assert calls == [(5, 10), (2, 3, 10), (3, 10), (2, 10), (2, 9), (2, 10)]


def test_skinny_linear_refuses_weights_it_cannot_read():
    assert not SkinnyLinear.accepts(torch.randn(4, 4, dtype=torch.bfloat16))
    assert not SkinnyLinear.accepts(torch.randn(4, 4).T)
    assert not SkinnyLinear.accepts(torch.empty(4, 4, device="meta"))
    with pytest.raises(ValueError, match="contiguous 2-D float32"):
        SkinnyLinear(torch.randn(3, 4, 4), torch.nn.functional.linear, 4)


def screened(head: ScreenedHead, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    head.screen_next(True)
    return head(x, weight, None)


@st.composite
def heads(draw):
    """A head whose rows come in near-tied groups (copies, copies one rounding apart, copies within
    bfloat16's resolution) beside random ones, padding rows past ``valid`` that would win, and
    hidden states."""
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    out_features, in_features = draw(st.integers(2, 600)), draw(st.integers(1, 200))
    weight = torch.randn(out_features, in_features, generator=generator) * draw(st.sampled_from([0.01, 0.1, 1.0]))
    rows = torch.randint(0, out_features, (out_features // 3,), generator=generator)
    weight[rows] = weight[torch.randint(0, out_features, (len(rows),), generator=generator)]  # exact ties
    near = torch.randint(0, out_features, (out_features // 5,), generator=generator)
    weight[near] = torch.nextafter(weight[near.flip(0)], torch.tensor(float("inf")))  # one rounding apart
    close = torch.randint(0, out_features, (out_features // 4,), generator=generator)
    resolution = draw(st.sampled_from([2**-9, 2**-7, 2**-5]))  # below, at and above bfloat16's
    noise = torch.randn(len(close), in_features, generator=generator) * resolution
    weight[close] = weight[close.flip(0)] * (1 + noise)  # their order may differ from their bfloat16 copies'
    valid = draw(st.integers(1, out_features))
    weight[valid:] = weight[valid:].abs() * 10  # padding the argmax must never take
    count = draw(st.one_of(st.integers(1, 20), st.sampled_from([33, 100, 257])))  # and past the skinny GEMM's rows
    x = torch.randn(count, in_features, generator=generator) * draw(st.sampled_from([0.1, 3.0]))
    return weight.contiguous(), valid, x


@pytest.mark.parametrize("pairs", [False, pytest.param(True, marks=pytest.mark.skipif(
    not _C.screened_head_pairs(), reason="this CPU has no bfloat16 dot product (AVX512_BF16)"))])
@settings(max_examples=100, deadline=None)
@given(head_case=heads())
def test_screened_head_gives_the_full_heads_argmax_and_exact_logits(pairs, head_case):
    """The argmax (first index on ties) over the first ``valid`` logits is the full skinny GEMM's,
    and every logit it computes is the full one bit for bit; the rest are -inf; with the weights
    in bfloat16 k-pairs (the dot product, where the CPU has it) and without, within the head's
    ``max_rows`` and past them. Past the rows where the screen pays, the full logits."""
    weight, valid, x = head_case
    reference = SkinnyLinear(weight, None, 512)
    head = ScreenedHead(weight, reference, 16, valid, pairs=pairs)  # past 16 rows its full head is the fallback's
    full = reference(x, weight, None)
    got = screened(head, x, weight)
    if x.shape[0] > head.screen_rows:
        assert head.screened_calls == 0 and torch.equal(got, full)
        return
    assert head.screened_calls == 1 and got.shape == full.shape
    assert torch.equal(got[:, :valid].argmax(dim=1), full[:, :valid].argmax(dim=1))
    computed = torch.isfinite(got)
    assert torch.equal(got[computed], full[computed]) and (got[~computed] == float("-inf")).all()
    assert computed.any(dim=1).all()


@pytest.mark.parametrize("pairs", [False, pytest.param(True, marks=pytest.mark.skipif(
    not _C.screened_head_pairs(), reason="this CPU has no bfloat16 dot product (AVX512_BF16)"))])
def test_screened_head_keeps_the_argmax_where_bfloat16_reorders_close_rows(pairs):
    """Rows 2^-7 apart, which bfloat16 rounding reorders now and then (a bound of 0 misses the argmax
    in 3-4 of these 800 rows): the screen keeps every panel that may hold it."""
    for seed in range(200):
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(512, 64, generator=generator)
        close = torch.randint(0, 512, (128,), generator=generator)
        weight[close] = weight[close.flip(0)] * (1 + torch.randn(128, 64, generator=generator) * 2**-7)
        x = torch.randn(4, 64, generator=generator)
        full = SkinnyLinear(weight, None, 32)(x, weight, None)
        got = screened(ScreenedHead(weight, None, 32, 512, pairs=pairs), x, weight)
        assert torch.equal(got.argmax(dim=1), full.argmax(dim=1)), seed


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_screened_head_on_avx512_blocks_equals_avx2_blocks(rows, both_lane_widths):
    generator = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(301, 200, generator=generator), torch.randn(rows, 200, generator=generator)
    head = ScreenedHead(weight, None, 32, 301, pairs=False)
    assert torch.equal(*both_lane_widths(lambda: screened(head, x, weight)))


def test_screened_head_screens_only_the_call_it_was_armed_for():
    """One armed call is screened; unarmed calls, calls past the screen's rows, a bias and
    non-finite hidden states get the full logits. Past max_rows, the full head is the fallback's
    and an armed call is still screened."""
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(50, 8, generator=generator), torch.randn(3, 8, generator=generator)
    full = SkinnyLinear(weight, None, 4)(x, weight, None)

    def zeros(x, weight, bias):
        return torch.zeros(x.shape[0], 50)

    head = ScreenedHead(weight, zeros, 4, 50)
    assert torch.equal(head(x, weight, None), full)  # not armed
    assert torch.isinf(screened(head, x, weight)).any() and head.screened_calls == 1
    assert torch.equal(head(x, weight, None), full)  # armed once only
    past = head.screen_rows + 1
    assert torch.equal(screened(head, torch.randn(past, 8, generator=generator), weight), torch.zeros(past, 50))
    head.screen_next(True)
    assert torch.equal(head(x, weight, torch.zeros(50)), full)
    broken = x.clone()
    broken[1, 2] = float("nan")
    assert torch.isnan(screened(head, broken, weight)[1]).all() and head.screened_calls == 1
    narrow = ScreenedHead(weight, zeros, 2, 50)
    assert torch.equal(narrow(x, weight, None), torch.zeros(3, 50))
    got = screened(narrow, x, weight)
    assert narrow.screened_calls == 1 and torch.equal(got.argmax(dim=1), full.argmax(dim=1))
    assert torch.equal(got[torch.isfinite(got)], full[torch.isfinite(got)])
    with pytest.raises(ValueError, match="valid_features must be in"):
        ScreenedHead(weight, None, 4, 51)
