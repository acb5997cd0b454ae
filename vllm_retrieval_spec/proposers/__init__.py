"""Draft proposers: each says only how it drafts; :mod:`.base` holds the vLLM plumbing."""
