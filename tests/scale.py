"""How much work the heavy tests do: ``VRS_TEST_SCALE=ci`` (the default: the sizes that keep the
whole suite inside CI's time on a 2-core machine) or ``full`` (the sizes the issues asked for:
more requests in the distribution checks, more prompts in the identity checks, more servers)."""

from __future__ import annotations

import os
from typing import TypeVar

import pytest

T = TypeVar("T")
SCALES = ("ci", "full")
SCALE = os.environ.get("VRS_TEST_SCALE", "ci")
if SCALE not in SCALES:
    raise pytest.UsageError(f"VRS_TEST_SCALE={SCALE!r}: use one of {', '.join(SCALES)}")
FULL = SCALE == "full"


def at_scale(ci: T, full: T) -> T:
    """``full`` under ``VRS_TEST_SCALE=full``, else ``ci``."""
    return full if FULL else ci


full_scale_only = pytest.mark.skipif(not FULL, reason="runs at VRS_TEST_SCALE=full only (see tests/scale.py)")
