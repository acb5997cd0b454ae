"""Checksums of an open artifact, verified in a daemon thread after it opened: the quick checks
at open catch broken structure, this catches any changed byte, without delaying the start."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

logger = logging.getLogger(__name__)


def check_in_background(check: Callable[[], None], on_failure: Callable[[Exception], None],
                        name: str) -> threading.Thread:
    """Run ``check`` (e.g. an artifact's ``check_fully``) in a daemon thread named ``name``;
    when it raises, call ``on_failure`` with the error (in that thread). Nothing escapes the
    thread: a failing ``on_failure`` is logged. Returns the started thread."""

    def run() -> None:
        try:
            check()
        except Exception as error:  # any failure means the artifact cannot be vouched for
            try:
                on_failure(error)
            except Exception:
                logger.exception("%s: handling the failed check raised", name)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


class VerifiedInBackground:
    """For an artifact with a ``path`` and a ``check_fully()`` (checksums of every file): verify
    them in the background; a failure logs one error naming the file and clears ``usable``,
    which the drafting code reads to draft without the artifact from then on."""

    noun: ClassVar[str]  # "datastore", in the error logged
    drafter: ClassVar[str]  # "REST", the proposer that stops using it
    path: Path
    usable: bool = True

    def check_fully(self) -> None:
        raise NotImplementedError

    def verify_in_background(self) -> threading.Thread:
        """:meth:`check_fully` in a daemon thread (see the class); returns the thread."""
        return check_in_background(self.check_fully, self._stop_drafting, f"vrs-verify-{self.path.name}")

    def _stop_drafting(self, error: Exception) -> None:
        self.usable = False
        logger.error("%s %s failed its checksum check (%s); %s no longer drafts from it (it keeps serving)",
                     self.noun, self.path, error, self.drafter)
