"""Merging each row's k drafts into one tree (N-Grammys' tree mode): the front end of the C++
kernel ``csrc/draft_merge.h``.

Per row, drafts are walked in slot order from the root; a (parent, token) step taken before
reuses its node, any other appends a new one. Nodes are numbered in the order first met: parents
come first, and a node budget that cuts the list keeps the first drafts whole. The plain-Python
reference is :mod:`vllm_retrieval_spec.kernels.draft_merge_reference`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_retrieval_spec.kernels.extension import load_extension


def merge_drafts(tokens: Any, lengths: Any, *, num_threads: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``tokens`` ``[rows, k, w]`` and ``lengths`` ``[rows, k]`` (each in ``[0, w]``) as trees:
    ``tree_tokens`` and ``tree_parents`` ``[rows, k * w]`` (-1 padded; parent -1 = the root)
    and ``tree_size`` ``[rows]``, all rows in one call (CPU threads above a work threshold)."""
    return load_extension().merge_drafts(
        np.ascontiguousarray(tokens, dtype=np.int32),
        np.ascontiguousarray(lengths, dtype=np.int32),
        num_threads=num_threads,
    )
