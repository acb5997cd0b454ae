"""DReSD: the hidden state that produced each row's last sampled token, in chain and tree mode."""

from __future__ import annotations

import numpy as np
import torch

from vllm_retrieval_spec.verification.session import SpecSession


def session_after_step(step: int = 5) -> SpecSession:
    session = SpecSession(tree_mode=True)
    session.step = step
    return session


def test_rows_without_drafts_take_their_only_row():
    session = session_after_step()
    hidden = torch.arange(3, dtype=torch.float32)[:, None] * torch.ones(1, 4)
    session.keep_hidden_states(hidden, None, [[7], [8], [9]])
    assert session.step_hidden_states[:, 0].tolist() == [0.0, 1.0, 2.0]


def test_chain_rows_take_the_row_of_the_last_accepted_token():
    session = session_after_step()
    # request 0: 3 drafts (rows 0-3), 2 accepted + bonus -> row 2; request 1: 1 draft (rows 4-5),
    # none accepted -> row 4; request 2: no drafts (row 6); request 3 sampled nothing.
    hidden = torch.arange(8, dtype=torch.float32)[:, None]
    session.keep_hidden_states(hidden, [3, 1, 0, 0], [[1, 2, 3], [4], [5], []])
    assert session.step_hidden_states[:3, 0].tolist() == [2.0, 4.0, 6.0]


def test_tree_rows_take_the_row_of_the_last_accepted_node():
    session = session_after_step(step=5)
    # The tree step just verified (recorded at step 4, before this drafting call's step 5):
    # request 0's path accepted nodes 0 then 3 (row 1 + 3 = 4), request 1 accepted nothing.
    session._accepted_paths = (4, np.array([[0, 3, -1], [-1, -1, -1]]), np.array([2, 0]))
    hidden = torch.arange(10, dtype=torch.float32)[:, None]
    session.keep_hidden_states(hidden, [5, 3], [[1, 2, 3], [4]])
    assert session.step_hidden_states[:, 0].tolist() == [4.0, 6.0]
