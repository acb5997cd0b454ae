"""Loading of the compiled extension ``vllm_retrieval_spec._C`` with a clear error."""

from __future__ import annotations

from types import ModuleType


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
