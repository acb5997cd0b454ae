"""RMSNorm on vLLM's fused CPU kernels: the native forward's result within float32 rounding, each
row bit for bit the same whatever rows its step holds, and every call the kernels cannot take
handed back to the layer's own forward. The engine-level identity (token ids with and without
speculation) runs with it on in test_e2e_engine.py and test_seeded_sampling.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_retrieval_spec.compat import configure_vllm_environment
from vllm_retrieval_spec.kernels.fused_norm import FusedRMSNorm, fused_kernels_available

configure_vllm_environment()
pytest.importorskip("vllm._custom_ops")
if not fused_kernels_available():
    pytest.skip("this vLLM build has no fused CPU RMSNorm kernels", allow_module_level=True)


def vllm_norm(hidden: int, seed: int, **kwargs) -> torch.nn.Module:
    """vLLM's own RMSNorm layer with a random weight (its native forward is what the CPU build runs)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    with set_current_vllm_config(VllmConfig()):
        norm = RMSNorm(hidden, eps=1e-5, **kwargs)
    norm.weight.data.normal_(generator=torch.Generator().manual_seed(seed))
    return norm


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 48), hidden=st.sampled_from([64, 576, 960]), seed=st.integers(0, 2**31 - 1))
def test_fused_norm_equals_the_native_forward(rows, hidden, seed):
    norm = vllm_norm(hidden, seed)
    fused = FusedRMSNorm(norm, norm.forward_native)
    generator = torch.Generator().manual_seed(seed)
    x, residual = torch.randn(rows, hidden, generator=generator), torch.randn(rows, hidden, generator=generator)
    torch.testing.assert_close(fused(x), norm.forward_native(x), rtol=1e-5, atol=1e-5)
    expected_out, expected_residual = norm.forward_native(x.clone(), residual.clone())
    out, summed = fused(x.clone(), residual.clone())
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(summed, expected_residual)  # the residual's sum is one float32 add either way


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(2, 48), seed=st.integers(0, 2**31 - 1))
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(rows, seed):
    norm = vllm_norm(576, seed)
    fused = FusedRMSNorm(norm, norm.forward_native)
    generator = torch.Generator().manual_seed(seed)
    x, residual = torch.randn(rows, 576, generator=generator), torch.randn(rows, 576, generator=generator)
    together = fused(x)
    out, summed = fused(x.clone(), residual.clone())
    for row in (0, rows // 2, rows - 1):
        assert torch.equal(fused(x[row:row + 1].clone())[0], together[row])
        alone, alone_summed = fused(x[row:row + 1].clone(), residual[row:row + 1].clone())
        assert torch.equal(alone[0], out[row]) and torch.equal(alone_summed[0], summed[row])


def test_calls_the_kernels_cannot_take_go_to_the_layers_forward():
    norm = vllm_norm(64, 0)
    calls = []

    def fallback(x, residual=None):
        calls.append((tuple(x.shape), residual is not None))
        return x if residual is None else (x, residual)

    fused = FusedRMSNorm(norm, fallback)
    x = torch.randn(6, 64)
    for strange in (torch.randn(64, 6).T, x.double(), torch.randn(6, 32), x[:0]):
        assert fused(strange) is strange
    assert fused(x, torch.randn(64, 6).T)[0] is x
    assert fused(x, torch.randn(3, 64))[0] is x
    assert calls == [((6, 64), False), ((6, 64), False), ((6, 32), False), ((0, 64), False), ((6, 64), True),
                     ((6, 64), True)]


def test_norms_the_kernels_cannot_compute_are_refused():
    assert FusedRMSNorm.accepts(vllm_norm(576, 0))
    assert not FusedRMSNorm.accepts(vllm_norm(72, 0))  # not a whole number of the kernels' vectors
    assert not FusedRMSNorm.accepts(vllm_norm(64, 0, has_weight=False))
    assert not FusedRMSNorm.accepts(vllm_norm(128, 0, var_hidden_size=64))
    with pytest.raises(ValueError, match="float32 CPU weight"):
        FusedRMSNorm(vllm_norm(64, 0, dtype=torch.bfloat16), None)
