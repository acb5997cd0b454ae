"""Every vLLM symbol the plugin wraps, replaces or reads, declared once with what it must look
like. The running vLLM is checked when the plugin loads (:func:`require_patch_surface`) and when
a runner of ours is built (:func:`require_instance_attributes`); CI checks the source of every
supported release (``scripts/check_patch_surface.py``, :mod:`.patch_surface_source`). Importing
this module imports nothing of vLLM."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vllm_retrieval_spec.compat import SUPPORTED_VLLM_MINORS, UnsupportedVllmError

CALLABLE, CLASS, FIELD, INSTANCE, MODULE = "callable", "class", "field", "instance", "module"
RUNNER = "vllm.v1.worker.gpu_model_runner"
REJECTION = "vllm.v1.sample.rejection_sampler"
INPUT_BATCH = "vllm.v1.worker.gpu_input_batch"


@dataclass(frozen=True)
class VllmSymbol:
    """``name`` (dotted inside ``module``) is a ``kind``: a callable whose leading positional
    parameters (``self`` left out) are ``params``, a class, a class field (dataclass field,
    annotation or property), an attribute every instance sets (checked on the object), or a
    module. ``platform`` ("cpu", "cuda"): needed only there."""

    module: str
    name: str
    kind: str = CALLABLE
    params: tuple[str, ...] = ()
    platform: str = ""

    @property
    def qualified(self) -> str:
        return f"{self.module}:{self.name}"

    @property
    def owner(self) -> str:
        """The class holding a field or instance attribute (its name inside the module)."""
        return self.name.rpartition(".")[0]

    @property
    def attribute(self) -> str:
        return self.name.rpartition(".")[2]


def _many(module: str, owner: str, kind: str, names: str, platform: str = "") -> tuple[VllmSymbol, ...]:
    return tuple(VllmSymbol(module, f"{owner}.{name}", kind, platform=platform) for name in names.split())


_ATTENTION_FORWARD = ("layer", "query", "key", "value", "kv_cache", "attn_metadata", "output")
_ATTENTION_BACKENDS = (
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl", "CPUAttentionMetadata", "cpu"),
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl", "FlashAttentionMetadata", "cuda"),
    ("vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl", "TritonAttentionMetadata", "cuda"),
)

PATCH_SURFACE: tuple[VllmSymbol, ...] = (
    # wrapped constructors (integration/vllm_patches.py)
    VllmSymbol(RUNNER, "GPUModelRunner.__init__", params=("vllm_config", "device")),
    VllmSymbol("vllm.v1.engine.input_processor", "InputProcessor.__init__", params=("vllm_config",)),
    VllmSymbol("vllm.v1.engine.input_processor", "InputProcessor._validate_params", params=("params",)),
    # runner methods hooked per instance
    VllmSymbol(RUNNER, "GPUModelRunner._update_states", params=("scheduler_output",)),
    VllmSymbol(RUNNER, "GPUModelRunner.propose_draft_token_ids", params=(
        "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states", "sample_hidden_states",
        "aux_hidden_states", "spec_decode_metadata")),
    VllmSymbol(RUNNER, "GPUModelRunner._prepare_inputs", params=("scheduler_output",)),
    VllmSymbol(RUNNER, "GPUModelRunner.load_model"),
    VllmSymbol(RUNNER, "GPUModelRunner.get_model"),
    VllmSymbol(RUNNER, "GPUModelRunner._sample"),
    VllmSymbol(RUNNER, "GPUModelRunner._bookkeeping_sync"),
    # the runner's and its input batch's state, read every step
    *_many(RUNNER, "GPUModelRunner", INSTANCE, "drafter input_batch rejection_sampler sampler positions "
           "query_start_loc discard_request_mask device vllm_config model_config parallel_config "
           "compilation_config num_prompt_logprobs scheduler_config max_model_len"),
    *_many(INPUT_BATCH, "InputBatch", INSTANCE, "req_ids num_reqs temperature_cpu token_ids_cpu "
           "num_tokens_no_spec req_id_to_index generators num_computed_tokens_cpu"),
    # serve's --shutdown-timeout (cli.py: time for the workers to save the output index)
    VllmSymbol("vllm.engine.arg_utils", "EngineArgs.shutdown_timeout", FIELD),
    *_many("vllm.v1.core.sched.output", "SchedulerOutput", FIELD,
           "finished_req_ids total_num_scheduled_tokens num_scheduled_tokens scheduled_spec_decode_tokens "
           "scheduled_new_reqs"),
    # a request's own speculation switch (options.SPECULATE_ARG), read as the runner starts it
    *_many("vllm.v1.core.sched.output", "NewRequestData", FIELD, "req_id sampling_params"),
    VllmSymbol("vllm.sampling_params", "SamplingParams.extra_args", FIELD),
    *_many("vllm.v1.spec_decode.metadata", "SpecDecodeMetadata", FIELD,
           "draft_token_ids num_draft_tokens target_logits_indices bonus_logits_indices cu_num_sampled_tokens"),
    VllmSymbol("vllm.v1.spec_decode.metadata", "SpecDecodeMetadata.max_spec_len", INSTANCE),
    *_many("vllm.v1.sample.metadata", "SamplingMetadata", FIELD,
           "temperature top_p top_k all_greedy generators max_num_logprobs no_penalties logitsprocs "
           "bad_words_token_ids allowed_token_ids_mask"),
    VllmSymbol("vllm.v1.sample.logits_processor.builtin", "MinTokensLogitsProcessor", CLASS),
    VllmSymbol("vllm.v1.sample.logits_processor.builtin", "MinTokensLogitsProcessor.min_toks", INSTANCE),
    # what lets a greedy chain step on the CPU take one argmax (verification/sampler.py)
    VllmSymbol("vllm.v1.sample.metadata", "SamplingMetadata.logprob_token_ids", FIELD, platform="cpu"),
    VllmSymbol("vllm.v1.sample.logits_processor.builtin", "LogitBiasLogitsProcessor", CLASS, platform="cpu"),
    VllmSymbol("vllm.v1.sample.logits_processor.builtin", "LogitBiasLogitsProcessor.biases", INSTANCE,
               platform="cpu"),
    # the rejection sampler: subclassed (verification/sampler.py), and fixed on the CPU build
    VllmSymbol(REJECTION, "RejectionSampler", CLASS),
    VllmSymbol(REJECTION, "RejectionSampler.__init__", params=("sampler",)),
    VllmSymbol(REJECTION, "RejectionSampler.forward", params=("metadata", "draft_probs", "logits",
                                                             "sampling_metadata")),
    VllmSymbol(REJECTION, "apply_sampling_constraints", params=("logits",), platform="cpu"),
    VllmSymbol(REJECTION, "expand_batch_to_tokens", params=("x", "cu_num_tokens", "num_tokens", "replace_from",
                                                           "replace_to"), platform="cpu"),
    VllmSymbol("vllm.triton_utils.dispatcher", "", MODULE, platform="cpu"),
    # the skinny GEMM of verification steps: vLLM's CPU GEMM dispatch, wrapped while our runner loads
    VllmSymbol("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm", params=("layer", "remove_weight"),
               platform="cpu"),
    # the screened head (cpu_screened_head): the head layer the dispatch meets, the model's logits
    # processor (monotone: no soft cap, a positive scale), requests with structured outputs
    VllmSymbol("vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead", CLASS, platform="cpu"),
    *_many("vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead", INSTANCE,
           "org_vocab_size tp_size", "cpu"),
    *_many("vllm.model_executor.layers.logits_processor", "LogitsProcessor", INSTANCE, "soft_cap scale", "cpu"),
    VllmSymbol("vllm.sampling_params", "SamplingParams.structured_outputs", FIELD),
    # fused norms (kernels/fused_norm.py): each float32 RMSNorm's dispatched forward, replaced per instance
    VllmSymbol("vllm.model_executor.layers.layernorm", "RMSNorm", CLASS, platform="cpu"),
    *_many("vllm.model_executor.layers.layernorm", "RMSNorm", INSTANCE,
           "_forward_method weight variance_epsilon variance_size_override has_weight", "cpu"),
    # lean Llama layers (kernels/lean_layer.py): each eager LlamaDecoderLayer's forward, replaced per
    # instance by one that calls what its parts' forwards end in
    *(VllmSymbol("vllm.model_executor.models.llama", name, CLASS, platform="cpu")
      for name in ("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP")),
    VllmSymbol("vllm.model_executor.models.llama", "LlamaDecoderLayer.forward",
               params=("positions", "hidden_states", "residual"), platform="cpu"),
    *_many("vllm.model_executor.models.llama", "LlamaDecoderLayer", INSTANCE,
           "self_attn mlp input_layernorm post_attention_layernorm", "cpu"),
    *_many("vllm.model_executor.models.llama", "LlamaAttention", INSTANCE,
           "qkv_proj o_proj rotary_emb attn q_size kv_size", "cpu"),
    *_many("vllm.model_executor.models.llama", "LlamaMLP", INSTANCE, "gate_up_proj down_proj act_fn", "cpu"),
    VllmSymbol("vllm.model_executor.custom_op", "CustomOp", CLASS, platform="cpu"),
    VllmSymbol("vllm.model_executor.custom_op", "CustomOp.forward", platform="cpu"),
    VllmSymbol("vllm.model_executor.layers.linear", "UnquantizedLinearMethod", CLASS, platform="cpu"),
    VllmSymbol("vllm.model_executor.layers.fusion.quant_activation", "get_input_quant_key", params=("layer",),
               platform="cpu"),
    # tree attention: every layer's backend forward, its KV cache metadata, the layer types
    *(VllmSymbol(module, f"{impl}.forward", params=_ATTENTION_FORWARD, platform=platform)
      for module, impl, _, platform in _ATTENTION_BACKENDS),
    *(symbol for module, _, metadata, platform in _ATTENTION_BACKENDS
      for symbol in _many(module, metadata, FIELD, "slot_mapping block_table num_actual_tokens", platform)),
    # step attention (verification/step_attention.py): the CPU backend's step metadata and layer type
    *_many("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadata", FIELD,
           "query_start_loc seq_lens causal dynamic_causal", "cpu"),
    VllmSymbol("vllm.v1.attention.backend", "AttentionType", CLASS),
    VllmSymbol("vllm.config", "get_layers_from_vllm_config", params=("vllm_config", "layer_type")),
    VllmSymbol("vllm.config", "CUDAGraphMode", CLASS),
    VllmSymbol("vllm.model_executor.layers.attention.attention", "Attention", CLASS),
    # the step attention's whole eager layer: Attention.forward per instance, the forward context
    VllmSymbol("vllm.model_executor.layers.attention.attention", "Attention.forward",
               params=("query", "key", "value", "output_shape", "output_dtype"), platform="cpu"),
    *_many("vllm.model_executor.layers.attention.attention", "Attention", INSTANCE,
           "layer_name kv_cache query_quant kv_sharing_target_layer_name attn_backend head_size head_size_v", "cpu"),
    VllmSymbol("vllm.forward_context", "get_forward_context", platform="cpu"),
    *_many("vllm.forward_context", "ForwardContext", FIELD, "attn_metadata slot_mapping", "cpu"),
    VllmSymbol("vllm.config", "CompilationMode", CLASS, platform="cpu"),
    VllmSymbol("vllm.model_executor.layers.mamba.abstract", "MambaBase", CLASS),
    # metrics, admission and the platform
    VllmSymbol("vllm.distributed", "get_tensor_model_parallel_rank"),
    VllmSymbol("vllm.exceptions", "VLLMValidationError", CLASS),
    VllmSymbol("vllm.sampling_params", "SamplingParams", CLASS),
    VllmSymbol("vllm.platforms", "current_platform", FIELD),
)


class PatchSurfaceError(UnsupportedVllmError):
    """The running vLLM lacks a symbol the plugin hooks, or has it with another signature."""


def supported_versions() -> str:
    return " or ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_VLLM_MINORS)


def surface_error(version: str, problems: Iterable[str]) -> PatchSurfaceError:
    """One line naming every problem and the releases this package was checked against."""
    return PatchSurfaceError(
        f"vllm_retrieval_spec cannot hook vLLM {version}: {'; '.join(problems)}; it supports the "
        f"released vLLM {supported_versions()} (pip install 'vllm-retrieval-spec[cpu]' or '[gpu]')"
    )


def signature_problem(symbol: VllmSymbol, params: list[str]) -> str | None:
    """The mismatch between a callable's positional parameters (``self`` left out) and ours."""
    if tuple(params[: len(symbol.params)]) == symbol.params:
        return None
    return f"{symbol.qualified} takes ({', '.join(params)}), expected ({', '.join(symbol.params)}, ...)"


def runtime_problems(platform: str, surface: Iterable[VllmSymbol] = PATCH_SURFACE) -> list[str]:
    """What of ``surface`` (instance attributes aside) the imported vLLM lacks on ``platform``."""
    problems = []
    for symbol in surface:
        if symbol.kind != INSTANCE and symbol.platform in ("", platform):
            problem = _runtime_problem(symbol)
            if problem:
                problems.append(problem)
    return problems


def require_patch_surface(version: str, platform: str) -> None:
    """Raise :class:`PatchSurfaceError` when the running vLLM lacks part of the patch surface."""
    problems = runtime_problems(platform)
    if problems:
        raise surface_error(version, problems)


def require_instance_attributes(version: str, objects: Mapping[str, object],
                                surface: Iterable[VllmSymbol] = PATCH_SURFACE) -> None:
    """Raise when an object (by its class name: ``{"GPUModelRunner": runner, ...}``) lacks an
    instance attribute of the surface."""
    missing = [f"{symbol.qualified} is missing" for symbol in surface
               if symbol.kind == INSTANCE and symbol.owner in objects
               and not hasattr(objects[symbol.owner], symbol.attribute)]
    if missing:
        raise surface_error(version, missing)


def _runtime_problem(symbol: VllmSymbol) -> str | None:
    try:
        module = importlib.import_module(symbol.module)
        if symbol.kind == MODULE:
            return None
        if symbol.kind == FIELD:
            return None if _has_field(_attribute(module, symbol.owner), symbol.attribute) else \
                f"{symbol.qualified} is missing"
        value = _attribute(module, symbol.name)
    except (ImportError, AttributeError):
        return f"{symbol.qualified} is missing"
    if symbol.kind == CLASS:
        return None if inspect.isclass(value) else f"{symbol.qualified} is no class"
    if not callable(value):
        return f"{symbol.qualified} is not callable"
    names = [name for name in inspect.signature(value).parameters if name != "self"]
    return signature_problem(symbol, names)


def _attribute(owner: object, dotted: str) -> object:
    for part in dotted.split(".") if dotted else ():
        owner = getattr(owner, part)
    return owner


def _has_field(owner: object, name: str) -> bool:
    """A dataclass field, an annotated attribute (of the class or a base) or a class attribute."""
    if dataclasses.is_dataclass(owner) and name in {field.name for field in dataclasses.fields(owner)}:
        return True
    classes = owner.__mro__ if inspect.isclass(owner) else ()
    return any(name in vars(cls).get("__annotations__", {}) for cls in classes) or hasattr(owner, name)
