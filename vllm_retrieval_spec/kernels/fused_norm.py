"""RMSNorm of CPU steps on vLLM's own fused kernels.

vLLM 0.32's CPU build runs every ``RMSNorm`` through its PyTorch-native implementation: about
seven operators a call (square, mean, add, reciprocal root, two products, and the residual's add),
75-170 us a call on a 2-core VM however few rows a step has, so two norms a layer cost a 30-layer
model ~6 ms a decode or verification step. The same build ships fused C++ kernels for both forms
(``torch.ops._C.rms_norm`` and ``fused_add_rms_norm``, 6-30 us a call) that its IR dispatch does not
pick on CPUs. Both compute each row alone, in the same order whatever the rows beside it, so a
token's result does not depend on the drafts of its step (as with the skinny GEMM and the step
attention); they differ from the native operators by float32 rounding only (~1e-6).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# The kernels' vector width in float32 lanes (AVX-512): the hidden size must be a multiple of it.
_LANES = 16


def fused_kernels_available() -> bool:
    """Whether the running vLLM build registers both fused CPU kernels."""
    return hasattr(torch.ops._C, "rms_norm") and hasattr(torch.ops._C, "fused_add_rms_norm")


class FusedRMSNorm:
    """A float32 ``RMSNorm`` layer's forward (``x`` or ``x, residual``) on the fused kernels; any call
    they cannot take (another dtype, a strided view) goes to ``fallback``, the layer's own forward."""

    def __init__(self, layer: torch.nn.Module, fallback: Callable) -> None:
        if not self.accepts(layer):
            raise ValueError(f"FusedRMSNorm: {type(layer).__name__} needs a float32 CPU weight of a size divisible by "
                             f"{_LANES} and no variance size override")
        self.weight = layer.weight.data
        self.epsilon = float(layer.variance_epsilon)
        self.fallback = fallback
        self._norm = torch.ops._C.rms_norm
        self._add_and_norm = torch.ops._C.fused_add_rms_norm

    @staticmethod
    def accepts(layer: torch.nn.Module) -> bool:
        """Whether the kernels compute ``layer`` (an ``RMSNorm``) as its own forward does."""
        weight = layer.weight
        return (layer.has_weight and layer.variance_size_override is None and weight.dim() == 1
                and weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.shape[0] % _LANES == 0)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self._takes(x, residual):
            return self.fallback(x, residual)
        if residual is None:
            out = torch.empty_like(x)
            self._norm(out, x, self.weight, self.epsilon)
            return out
        self._add_and_norm(x, residual, self.weight, self.epsilon)  # residual += x; x = norm(residual)
        return x, residual

    def _takes(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        fits = (x.dtype == torch.float32 and x.is_cpu and x.is_contiguous() and x.numel() > 0
                and x.shape[-1] == self.weight.shape[0])
        if residual is None:
            return fits
        return fits and residual.dtype == torch.float32 and residual.is_contiguous() and residual.shape == x.shape
