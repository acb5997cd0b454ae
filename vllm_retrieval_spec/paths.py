"""Where the project caches what it builds (checkpoints, datastores, tables)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "VLLM_RETRIEVAL_SPEC_CACHE"


def cache_root() -> Path:
    """The cache directory: ``$VLLM_RETRIEVAL_SPEC_CACHE`` or ``~/.cache/vllm-retrieval-spec``."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vllm-retrieval-spec"
