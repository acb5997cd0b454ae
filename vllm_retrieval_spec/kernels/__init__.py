"""Python front ends of the csrc kernels, each next to its plain NumPy/Python reference."""

from vllm_retrieval_spec.kernels.context_ngram import (
    ContextNgramDrafts,
    context_ngram,
    context_ngram_reference,
)
from vllm_retrieval_spec.kernels.extension import extension_backends

__all__ = [
    "ContextNgramDrafts",
    "context_ngram",
    "context_ngram_reference",
    "extension_backends",
]
