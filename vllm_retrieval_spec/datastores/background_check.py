"""Checksums of an open artifact, verified in a daemon thread after it opened: the quick checks
at open catch broken structure, this catches any changed byte, without delaying the start."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import ClassVar

logger = logging.getLogger(__name__)


class VerifiedInBackground:
    """For an artifact with a ``path`` and a ``check_fully()`` (checksums of every file): verify
    them in a daemon thread; a failure logs one error naming the file and clears ``usable``,
    which the drafting code reads to draft without the artifact from then on. Nothing escapes
    the thread."""

    noun: ClassVar[str]  # "datastore", in the error logged
    drafter: ClassVar[str]  # "REST", the proposer that stops using it
    path: Path
    usable: bool = True

    def check_fully(self) -> None:
        raise NotImplementedError

    def verify_in_background(self) -> threading.Thread:
        """:meth:`check_fully` in a started daemon thread (see the class); returns the thread."""
        thread = threading.Thread(target=self._verify, name=f"vrs-verify-{self.path.name}", daemon=True)
        thread.start()
        return thread

    def _verify(self) -> None:
        try:
            self.check_fully()
        except Exception as error:  # any failure means the artifact cannot be vouched for
            self.usable = False
            logger.error("%s %s failed its checksum check (%s); %s no longer drafts from it (it keeps serving)",
                         self.noun, self.path, error, self.drafter)
