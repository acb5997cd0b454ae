"""Running the real model in vLLM and measuring speculation: shared by tests and benchmarks."""
