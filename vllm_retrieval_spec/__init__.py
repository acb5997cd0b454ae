"""vllm-retrieval-spec: training-free speculative decoding proposers for vLLM.

Importing this package is cheap: vLLM and the proposers load lazily, so the
``vllm.general_plugins`` entry point (:func:`register`) costs nothing in processes that
never draft. Proposers are addressed in ``--speculative-config`` as
``vllm_retrieval_spec.<Name>Proposer``.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

from vllm_retrieval_spec.proposers.registry import PROPOSERS

if TYPE_CHECKING:
    from vllm_retrieval_spec.proposers.base import DraftProposer

__version__ = "0.1.0"

__all__ = ["__version__", "register", *PROPOSERS]


def register() -> None:
    """vLLM general-plugin hook: checks the vLLM version and applies our patches once; what the
    package logs goes where vLLM's own log goes."""
    from vllm_retrieval_spec.integration.vllm_patches import apply_patches

    _log_where_vllm_logs()
    apply_patches()


def _log_where_vllm_logs() -> None:
    """Give the package's loggers vLLM's handlers and level (a server's log then shows what we
    log at INFO: a datastore swapped in, the budget's summary), unless the application configured
    logging itself (handlers on the root logger, which ours reach anyway) or ours."""
    ours, vllm_logger = logging.getLogger(__name__), logging.getLogger("vllm")
    if logging.getLogger().handlers or ours.handlers or ours.level != logging.NOTSET or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllm_logger.level)


def __getattr__(name: str) -> type[DraftProposer]:
    proposer = PROPOSERS.get(name)
    if proposer is None:
        raise AttributeError(f"module 'vllm_retrieval_spec' has no attribute {name!r}")
    return getattr(importlib.import_module(proposer.module), name)
