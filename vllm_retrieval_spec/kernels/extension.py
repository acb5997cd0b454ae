"""Loading of the compiled extension ``vllm_retrieval_spec._C`` and the CPU/CUDA dispatch shared
by the kernel front ends."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np


def load_extension() -> ModuleType:
    """Import ``_C`` or explain how to build it."""
    try:
        from vllm_retrieval_spec import _C
    except ImportError as error:
        raise ImportError(
            "vllm_retrieval_spec._C (the C++ extension) is not built; install the package with "
            "`pip install -e .` (or `pip install .`) from the repository root so that CMake "
            f"compiles csrc/: {error}"
        ) from error
    return _C


def extension_backends() -> list[str]:
    """Backends the extension was compiled with, e.g. ``['cpu', 'cuda']``."""
    return list(load_extension().backends())


def is_cuda_tensor(array: Any) -> bool:
    """Whether ``array`` is a torch tensor on a CUDA device (such inputs run the CUDA kernels)."""
    return not isinstance(array, np.ndarray) and bool(getattr(array, "is_cuda", False))


def cuda_torch() -> ModuleType:
    """``torch``, once the extension is known to have its CUDA backend."""
    import torch

    if "cuda" not in extension_backends():
        raise RuntimeError(
            "got CUDA tensors, but vllm_retrieval_spec._C was built without CUDA (nvcc was not "
            "found at build time); reinstall with nvcc on PATH or pass CPU arrays"
        )
    return torch
