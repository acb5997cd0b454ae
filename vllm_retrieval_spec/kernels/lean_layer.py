"""A Llama decoder layer's eager forward as one Python function, on the CPU build.

vLLM's ``LlamaDecoderLayer.forward`` reaches its kernels through about a dozen ``nn.Module`` calls
and, for each of its four linear layers, the linear layer's forward, its quantization method and
the CPU GEMM dispatch; on SmolLM2-135M's 30 layers that dispatch is ~1.2 ms of a ~35 ms decode or
verification step on a 2-core VM (the skinny GEMM, the norms' fused kernels and the step attention
being the rest). :class:`LeanLlamaLayer` calls what those calls end in, in the same order with the
same tensors — each norm's, the rotary embedding's and the activation's dispatched forward
(``CustomOp._forward_method``), each linear layer's ``cpu_linear(x, weight, None)`` (the skinny
GEMM, which hands prefills to vLLM's GEMM), the attention layer's own (hooked) forward — so its
outputs are vLLM's, bit for bit; it takes only layers whose parts are all of that kind
(:meth:`LeanLlamaLayer.accepts`; the caller checks the classes).
"""

from __future__ import annotations

import torch

from vllm_retrieval_spec.kernels.fused_norm import FusedRMSNorm
from vllm_retrieval_spec.kernels.skinny_gemm import SkinnyLinear


class LeanLlamaLayer:
    """``layer.forward(positions, hidden_states, residual)`` of a Llama decoder layer whose norms
    run :class:`FusedRMSNorm` and whose four linear layers run :class:`SkinnyLinear` unbiased on one
    tensor-parallel rank. Every part is looked up at each call, as vLLM's forward does, so what is
    hooked or replaced on them later still runs."""

    def __init__(self, layer: torch.nn.Module) -> None:
        if not self.accepts(layer):
            raise ValueError("LeanLlamaLayer: the layer's norms must run FusedRMSNorm and its linear layers "
                             "SkinnyLinear, unbiased, on one tensor-parallel rank, with no forward hooks")
        attention, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv, self.o = attention.qkv_proj, attention.o_proj
        self.gate_up, self.down = mlp.gate_up_proj, mlp.down_proj
        self.qkv_sizes = [attention.q_size, attention.kv_size, attention.kv_size]
        self.rotary, self.attention, self.activation = attention.rotary_emb, attention.attn, mlp.act_fn

    @staticmethod
    def accepts(layer: torch.nn.Module) -> bool:
        """Whether every part of ``layer`` (a ``LlamaDecoderLayer`` whose model has loaded) is one
        this forward calls as vLLM's would, and no module of it carries a forward hook."""
        attention, mlp = layer.self_attn, layer.mlp
        linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        return (all(isinstance(norm._forward_method, FusedRMSNorm) for norm in norms)
                and all(isinstance(getattr(linear, "cpu_linear", None), SkinnyLinear) and linear.bias is None
                        and linear.tp_size == 1 for linear in linears)
                and not any(module._forward_hooks or module._forward_pre_hooks for module in layer.modules()))

    def __call__(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_norm._forward_method(hidden_states)
        else:
            hidden_states, residual = self.input_norm._forward_method(hidden_states, residual)
        query, key, value = _linear(self.qkv, hidden_states).split(self.qkv_sizes, dim=-1)
        query, key = self.rotary._forward_method(positions, query, key)
        hidden_states = _linear(self.o, self.attention.forward(query, key, value))
        hidden_states, residual = self.post_norm._forward_method(hidden_states, residual)
        gate_up = self.activation._forward_method(_linear(self.gate_up, hidden_states))
        return _linear(self.down, gate_up), residual


def _linear(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What vLLM's CPU GEMM dispatch calls for an unbiased layer on one rank."""
    return linear.cpu_linear(x, linear.weight, None)
