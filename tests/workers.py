"""The suite on several pytest-xdist workers (``scripts/test.sh`` runs two, ``--dist loadfile``):
each worker keeps to its own share of the cores, and the files that start OpenAI servers run on
one worker, one after another, as if they were one file (with the files too memory-heavy to run
beside them).

On a 2-core machine much of the suite's time is single-threaded (importing vLLM in each server
process, building stores, tokenizing): two workers of one core each overlap it with the other's
model steps. A worker's engines, its servers (whose processes inherit the affinity) and their
OpenMP teams all stay on its cores, so the two never spin against each other. The server files
share session servers (``plain_server``, ``rest_server``), which then start once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from xdist.scheduler import LoadFileScheduling

SERVER_FILES = ("test_e2e_server.py", "test_faults.py", "test_load.py", "test_seeded_sampling.py",
                "test_datastore_from_server.py", "test_parallel.py")
# Files whose engines take too much memory to overlap the servers (Gemma-3-270m's: ~7.2 GB at
# peak; the two together were killed by the kernel's OOM killer on a 24 GB VM): they run in the
# servers' unit, after them.
MEMORY_HEAVY_FILES = ("test_gemma.py",)
SERVER_UNIT = SERVER_FILES + MEMORY_HEAVY_FILES
SERVER_GROUP = "tests/<files starting servers, then the memory-heavy ones>"
SERVER_FIXTURES = frozenset({"plain_server", "rest_server"})


def keep_worker_to_its_cores() -> None:
    """Restrict this xdist worker (and every process it starts) to its contiguous share of the
    cores, with as many OpenMP threads; call before anything imports torch. Does nothing outside
    several workers or with fewer cores than workers."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if worker is None or count < 2 or len(cores) < count:
        return
    index = int(worker.removeprefix("gw")) % count  # a crashed worker's replacement takes its number past count
    share = cores[index * len(cores) // count:(index + 1) * len(cores) // count]
    os.sched_setaffinity(0, share)
    os.environ["OMP_NUM_THREADS"] = str(len(share))


def starts_servers(item: pytest.Item) -> bool:
    return item.get_closest_marker("server") is not None or bool(SERVER_FIXTURES & set(item.fixturenames))


def order_for_workers(items: list[pytest.Item]) -> None:
    """The server files first (the longest unit of work, in collection order: their tests share
    servers, and some count what a server served before them), then ``MEMORY_HEAVY_FILES``, then
    the files that run engines, then the rest; a test starting a server outside ``SERVER_FILES``
    is a usage error (it would start its own on another worker)."""
    strays = sorted({item.path.name for item in items if starts_servers(item) and item.path.name not in SERVER_FILES})
    if strays:
        raise pytest.UsageError(f"{', '.join(strays)} start(s) servers: add to SERVER_FILES in tests/workers.py")
    engine_files = {item.path for item in items if item.get_closest_marker("engine")}
    items.sort(key=lambda item: (0, item.path.name not in SERVER_FILES) if item.path.name in SERVER_UNIT
               else (1, item.path not in engine_files))


class ServerFilesTogether(LoadFileScheduling):
    """``--dist loadfile``, with the server files and the memory-heavy ones as one unit."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return SERVER_GROUP if Path(path).name in SERVER_UNIT else path
