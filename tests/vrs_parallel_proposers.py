"""A proposer for tests/test_parallel.py, loaded by real servers from ``tests/`` (PYTHONPATH):
RestProposer that writes what it drafts at every step to one file per tensor-parallel rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from vllm_retrieval_spec.proposers.rest import RestProposer

DRAFT_LOG_DIR = "VRS_TEST_DRAFT_LOG_DIR"  # where each rank writes rank<N>.jsonl


class DraftRecordingRestProposer(RestProposer):
    """Each step, one JSON line: every row's drafts and, in tree mode, the trees it published."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: object = None, **kwargs: object) -> list[list[int]]:
        drafts = super().propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings, **kwargs)
        session = self.session
        trees = {req_id: [state.tree.tokens, state.tree.parents] for req_id, state in session.requests.items()
                 if state.tree is not None and state.tree_step == session.step}
        self._log().write(json.dumps({"drafts": drafts, "trees": trees}) + "\n")
        return drafts

    def _log(self):
        log = getattr(self, "_log_file", None)
        if log is None:
            from vllm.distributed import get_tensor_model_parallel_rank

            path = Path(os.environ[DRAFT_LOG_DIR]) / f"rank{get_tensor_model_parallel_rank()}.jsonl"
            log = self._log_file = open(path, "a", buffering=1)  # noqa: SIM115 (open while the engine runs)
        return log
