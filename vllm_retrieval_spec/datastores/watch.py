"""A datastore that a serving engine reopens when its manifest changes on disk.

``datastore add`` and ``datastore remove`` (``sharded_edit.py``) publish a change by renaming a
new manifest into place, and ``datastore build --replace`` renames a whole new store there. The
engine notices at most ``interval`` seconds later (one ``stat`` from the drafting step), opens
and checks the new store in a background thread, and swaps it in at the start of a step, so
every row of a step drafts from one store, before or after the change. A store that fails to
open is logged once and the engine keeps drafting from the one it has (one that changed again
while it was opened, e.g. a shard deleted by the next edit, is simply opened again).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_retrieval_spec.storage import MANIFEST

logger = logging.getLogger(__name__)

Signature = tuple[int, int, int]


def _signature(manifest: Path) -> Signature | None:
    """What changes when a manifest is replaced (None while there is none)."""
    try:
        stat = os.stat(manifest)
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def _warmed(store: Any) -> Any:
    """``store`` being read into the page cache, its checksums verified in the background (a
    changed file stops drafting from it, logged)."""
    store.prefetch()
    store.verify_in_background()
    return store


class ReloadingDatastore:
    """Owns the datastore REST drafts from (see the module): :meth:`current` once per step."""

    def __init__(self, store: Any, opener: Callable[[Path], Any], interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = _warmed(store)
        self._opener = opener
        self._interval = interval
        self._clock = clock
        self._manifest = Path(store.path) / MANIFEST
        self._seen = _signature(self._manifest)
        self._next_check = clock() + interval
        self._opened: Any = None
        self._loading: threading.Thread | None = None
        self._lock = threading.Lock()
        self.reloads = 0

    def current(self) -> Any:
        """The store this step drafts from: a newer one when one finished opening since the
        last step; checks the manifest when ``interval`` has passed (never with 0)."""
        with self._lock:
            opened, self._opened = self._opened, None
        if opened is not None:
            self._store = opened
            self.reloads += 1
            logger.info("REST now drafts from the datastore %s as changed on disk: %s", opened.path,
                        opened.describe().splitlines()[1].strip())
        now = self._clock()
        if self._interval and now >= self._next_check:
            self._next_check = now + self._interval
            self._look()
        return self._store

    def join(self, timeout: float | None = None) -> None:
        """Wait for a reopening in progress (tests; the swap itself happens in :meth:`current`)."""
        if self._loading is not None:
            self._loading.join(timeout)

    def _look(self) -> None:
        """Start opening the store again when its manifest changed (one opening at a time)."""
        if self._loading is not None and self._loading.is_alive():
            return
        signature = _signature(self._manifest)
        if signature is None or signature == self._seen:
            return
        self._seen = signature
        self._loading = threading.Thread(target=self._open, name="vrs-datastore-reload", daemon=True)
        self._loading.start()

    def _open(self) -> None:
        path = self._store.path
        try:
            store = _warmed(self._opener(path))
        except Exception as error:  # whatever is on disk now, serving goes on with the store it has
            if _signature(self._manifest) == self._seen:  # else it changed again while opening: the next look
                logger.error("datastore %s changed on disk but cannot be opened (%s); REST keeps drafting from "
                             "the store it had", path, error)
            return
        with self._lock:
            self._opened = store
