"""Everything that touches vLLM internals lives here (one version-guarded patch module)."""
