"""Real models for tests, benchmarks and the README's main job."""

from vllm_retrieval_spec.models.smollm2 import SMOLLM2_GGUF, ensure_smollm2_checkpoint

__all__ = ["SMOLLM2_GGUF", "ensure_smollm2_checkpoint"]
