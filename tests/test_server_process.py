"""A server started by ``VllmServer`` ends with the process that started it (no real server needed:
the child runs the same ``end_with_parent`` that ``vllm-retrieval-spec serve`` runs first)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_retrieval_spec.evaluation.server import PARENT_PID_ENV, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")

SERVER_STAND_IN = (
    "import time\n"
    "from vllm_retrieval_spec.evaluation.server import end_with_parent\n"
    "end_with_parent()\n"
    "print('serving', flush=True)\n"
    "time.sleep(120)\n"
)
# Starts the stand-in as VllmServer.start does (its own session, the parent's pid in its
# environment), prints the stand-in's pid once it serves, then waits to be killed.
PARENT = (
    "import os, subprocess, sys, time\n"
    f"env = {{**os.environ, {PARENT_PID_ENV!r}: str(os.getpid())}}\n"
    "child = subprocess.Popen([sys.executable, '-c', sys.argv[1]], env=env, stdout=subprocess.PIPE,\n"
    "                         text=True, start_new_session=True)\n"
    "assert child.stdout.readline() == 'serving\\n'\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_the_server_ends_when_the_process_that_started_it_is_killed():
    with subprocess.Popen([sys.executable, "-c", PARENT, SERVER_STAND_IN], stdout=subprocess.PIPE, text=True) as parent:
        server_pid = int(parent.stdout.readline())
        assert _running(server_pid)
        parent.kill()  # SIGKILL: no clean-up of the parent's runs
        parent.wait()
    assert wait_until(lambda: not _running(server_pid), timeout_s=30), "the server outlived its parent"


def test_a_server_whose_parent_is_already_gone_exits_at_once():
    env = {**os.environ, PARENT_PID_ENV: str(os.getpid() + 1_000_000)}  # not this child's parent
    finished = subprocess.run([sys.executable, "-c", SERVER_STAND_IN], env=env, capture_output=True, text=True,
                              timeout=60)
    assert finished.returncode == 1
    assert "the process that started this server" in finished.stderr
    assert "serving" not in finished.stdout


def test_without_the_parents_pid_the_process_is_left_alone():
    env = {key: value for key, value in os.environ.items() if key != PARENT_PID_ENV}
    with subprocess.Popen([sys.executable, "-c", SERVER_STAND_IN], env=env, stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout.readline() == "serving\n"
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == -signal.SIGTERM
