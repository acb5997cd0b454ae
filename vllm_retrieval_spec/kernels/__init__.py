"""Python front ends of the csrc kernels; each kernel family's plain NumPy/Python reference, which
the tests compare against exactly, lives beside it in a ``*_reference`` module."""

from vllm_retrieval_spec.kernels.context_ngram import ContextNgramDrafts, context_ngram
from vllm_retrieval_spec.kernels.extension import extension_backends

__all__ = [
    "ContextNgramDrafts",
    "context_ngram",
    "extension_backends",
]
