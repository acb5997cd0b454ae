"""Tree verification: per-request draft trees verified in one target step (tree mask,
positions, multi-candidate acceptance, KV compaction). The vLLM hooks that drive it live in
:mod:`vllm_retrieval_spec.integration.vllm_patches`."""
