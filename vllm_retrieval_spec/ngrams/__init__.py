"""N-Grammys (learning-free batched drafts): model-derived n-gram tables and drafting."""

from vllm_retrieval_spec.ngrams.table import ModelIdentity, NgramTable, NgramTableError, build_ngram_table

__all__ = ["ModelIdentity", "NgramTable", "NgramTableError", "build_ngram_table"]
