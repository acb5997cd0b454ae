"""Typed options, read from ``--additional-config '{"retrieval_spec": {...}}'``.

One frozen object for every proposer; unknown keys and bad values are rejected with a
message that names the key and what it accepts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

OPTIONS_KEY = "retrieval_spec"


class OptionsError(ValueError):
    """An option under ``additional_config['retrieval_spec']`` is unknown or invalid."""


Validator = Callable[[str, Any], Any]


def _int_in(low: int, high: int) -> Validator:
    def validate(key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise OptionsError(
                f"{OPTIONS_KEY}.{key} must be an integer in [{low}, {high}], got {value!r}"
            )
        return value

    return validate


def _option(default: Any, validator: Validator, help: str) -> Any:
    return field(default=default, metadata={"validate": validator, "help": help})


@dataclass(frozen=True)
class RetrievalSpecOptions:
    """Options shared by all proposers of this package (defaults are the tuned ones)."""

    context_ngram_min: int = _option(
        1, _int_in(1, 64), "shortest suffix of the request's context that may match"
    )
    context_ngram_max: int = _option(
        4, _int_in(1, 64), "longest suffix of the request's context tried first"
    )
    context_max_matches: int = _option(
        64, _int_in(1, 256), "most recent context occurrences counted per step"
    )
    num_threads: int = _option(
        0, _int_in(0, 1024), "threads for the C++ drafting kernels (0: one per core)"
    )

    def __post_init__(self) -> None:
        if self.context_ngram_min > self.context_ngram_max:
            raise OptionsError(
                f"{OPTIONS_KEY}.context_ngram_min ({self.context_ngram_min}) must not exceed "
                f"{OPTIONS_KEY}.context_ngram_max ({self.context_ngram_max})"
            )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> RetrievalSpecOptions:
        """Validate a user-supplied mapping; missing keys take their defaults."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise OptionsError(
                f"additional_config['{OPTIONS_KEY}'] must be a JSON object, got {raw!r}"
            )
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise OptionsError(
                f"unknown option(s) {', '.join(map(repr, unknown))} in "
                f"additional_config['{OPTIONS_KEY}']; known options: {', '.join(sorted(fields))}"
            )
        values = {key: fields[key].metadata["validate"](key, value) for key, value in raw.items()}
        return cls(**values)

    @classmethod
    def from_additional_config(cls, additional_config: Mapping[str, Any] | None) -> RetrievalSpecOptions:
        """Read our section of vLLM's ``additional_config``."""
        config = dict(additional_config or {})
        if "vllm_retrieval_spec" in config and OPTIONS_KEY not in config:
            raise OptionsError(
                "found additional_config['vllm_retrieval_spec']; the options live under "
                f"additional_config['{OPTIONS_KEY}']"
            )
        return cls.from_dict(config.get(OPTIONS_KEY))

    @classmethod
    def describe(cls) -> str:
        """One line per option: name, default and meaning (for ``--help`` texts)."""
        return "\n".join(
            f"{f.name} (default {f.default!r}): {f.metadata['help']}" for f in dataclasses.fields(cls)
        )
