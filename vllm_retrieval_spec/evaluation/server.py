"""A real vLLM OpenAI server subprocess on 127.0.0.1, started through our ``serve`` command."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_retrieval_spec.compat import CPU_ENVIRONMENT
from vllm_retrieval_spec.evaluation.metrics import SpecDecodeCounters

LOOPBACK = "127.0.0.1"
# Set by VllmServer for its server: the pid whose death ends the server (see end_with_parent).
PARENT_PID_ENV = "VLLM_RETRIEVAL_SPEC_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def wait_until(condition: Callable[[], bool], timeout_s: float = 120.0, poll_s: float = 0.2) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def end_with_parent() -> None:
    """In a server started by :class:`VllmServer`: ask the kernel for SIGTERM when the process
    (strictly: the thread) that started it dies, so a test run or benchmark killed without its
    clean-up leaves no server holding memory; exit at once if that process is already gone.
    The server's SIGTERM shuts its engine down as :meth:`VllmServer.stop` does. A no-op without
    ``PARENT_PID_ENV`` or off Linux."""
    parent = os.environ.pop(PARENT_PID_ENV, "")
    if not parent.isdigit() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return  # not allowed here: the server keeps running as before
    if os.getppid() != int(parent):  # the parent died before the request took effect
        sys.exit(f"the process that started this server ({parent}) is gone")


class ServerError(RuntimeError):
    """The server exited or never became healthy; the message ends with its log."""


class VllmServer:
    """Start ``vllm-retrieval-spec serve MODEL ...``, wait for ``/health``, stop on exit. The
    server also ends when the thread that started it dies (:func:`end_with_parent`)."""

    def __init__(
        self,
        model: str | Path,
        *,
        speculative_config: Mapping[str, Any] | None = None,
        additional_config: Mapping[str, Any] | None = None,
        served_model_name: str = "smol",
        max_model_len: int = 2048,
        extra_args: Sequence[str] = (),
        log_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.env = dict(env or {})  # on top of this process's environment
        self.served_model_name = served_model_name
        self.log_path = Path(log_path or f"/tmp/vllm-retrieval-spec-server-{self.port}.log")
        self.serve_args = [  # ``vllm-retrieval-spec serve``'s
            str(model), "--host", LOOPBACK, "--port", str(self.port),
            "--served-model-name", served_model_name,
            "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
            *(["--speculative-config", json.dumps(dict(speculative_config))] if speculative_config else []),
            *(["--additional-config", json.dumps(dict(additional_config))] if additional_config else []),
            *extra_args,
        ]
        self.command = [sys.executable, "-m", "vllm_retrieval_spec.cli", "serve", *self.serve_args]
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, timeout_s: float = 300.0) -> VllmServer:
        env = {**CPU_ENVIRONMENT, **os.environ, **self.env, PARENT_PID_ENV: str(os.getpid())}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"the server exited with code {self.process.returncode}\n{self.log_tail()}")
            if self._healthy():
                return self
            time.sleep(1.0)
        self.stop()
        raise ServerError(f"the server was not healthy after {timeout_s:.0f} s\n{self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self, graceful_s: float = 0.0) -> None:
        """SIGTERM to the server's process group (SIGKILL 30 s later). With ``graceful_s``, first
        SIGTERM to the API server alone, which shuts its engine and workers down in order (when
        they save their snapshots), for at most that many seconds: a signal to every process at
        once can end a worker before it saves."""
        if self.process is None or self.process.poll() is not None:
            return
        if graceful_s:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=graceful_s)
        with contextlib.suppress(ProcessLookupError):  # the whole group may be gone already
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def log_tail(self, lines: int = 40) -> str:
        """The log's error lines (root causes first), then its last ``lines`` lines."""
        try:
            log = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        errors = [line for line in log if re.search(r"\w+(Error|Exception): ", line)]
        return "\n".join([*errors[:10], "--- log tail ---", *log[-lines:]])

    def metrics_text(self) -> str:
        """The server's ``/metrics`` page (Prometheus text format; ours and vLLM's)."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as response:
            return response.read().decode()

    def metric(self, name: str, text: str | None = None) -> float:
        """The series ``name`` of ``/metrics`` (or of ``text``, a page read before), summed over its labels."""
        pattern = rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$"
        return sum(float(value) for value in re.findall(pattern, text or self.metrics_text(), flags=re.M))

    def spec_decode_counters(self) -> SpecDecodeCounters:
        """vLLM's counters from ``/metrics`` (zero when the server does not speculate)."""
        text = self.metrics_text()

        def total(name: str) -> int:
            return int(self.metric(f"vllm:{name}_total", text))

        return SpecDecodeCounters(
            drafts=total("spec_decode_num_drafts"),
            draft_tokens=total("spec_decode_num_draft_tokens"),
            accepted_tokens=total("spec_decode_num_accepted_tokens"),
        )

    def log_text(self) -> str:
        """Everything the server has logged so far."""
        return self.log_path.read_text(errors="replace")

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
