"""Checks of values read from users and files (command-line options, manifests, JSON options):
types as JSON gives them (``true`` is no number) and integer ranges, with one wording for all
messages: ``NAME must be an integer in [LOW, HIGH], got VALUE``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# (value, lowest, highest or None for no upper bound) of each name to check.
IntBounds = Mapping[str, tuple[Any, int, "int | None"]]


def has_type(value: Any, expected: type | tuple[type, ...]) -> bool:
    """``isinstance``, except that a bool (JSON ``true``/``false``) is not an int or a float."""
    expected = expected if isinstance(expected, tuple) else (expected,)
    return isinstance(value, expected) and (not isinstance(value, bool) or bool in expected)


def int_in(value: Any, low: int, high: int | None = None) -> bool:
    """Whether ``value`` is an integer (not a bool) in ``[low, high]`` (``high`` None: no upper bound)."""
    return has_type(value, int) and value >= low and (high is None or value <= high)


def int_range(low: int, high: int | None = None) -> str:
    """``an integer >= LOW`` or ``an integer in [LOW, HIGH]``, for messages."""
    return f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"


def require_ints(bounds: IntBounds, error: Callable[[str], Exception] = ValueError) -> None:
    """Raise ``error("NAME must be an integer in [LOW, HIGH], got VALUE")`` for the first value
    of ``bounds`` outside its range."""
    for name, (value, low, high) in bounds.items():
        if not int_in(value, low, high):
            raise error(f"{name} must be {int_range(low, high)}, got {value!r}")
