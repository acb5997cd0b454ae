"""Real models for tests, benchmarks and the README's main job."""

from vllm_retrieval_spec.models.gemma3 import GEMMA3_GGUF, ensure_gemma3_checkpoint, gemma3_available
from vllm_retrieval_spec.models.smollm2 import SMOLLM2_GGUF, ensure_smollm2_checkpoint

__all__ = ["GEMMA3_GGUF", "SMOLLM2_GGUF", "ensure_gemma3_checkpoint", "ensure_smollm2_checkpoint", "gemma3_available"]
