"""Admission control: in tree mode, sampling features that treat drafts as a sequence are
refused when a request arrives (HTTP 400 on the server) instead of silently changing the
output of a tree step, unless the request turned speculation off; in chain mode, seeded requests
with features the keyed sampler does not apply at every position (their tokens would not
repeat). In both, a request's own switch for speculation (:data:`SPECULATE_ARG`) is read here,
and a value it cannot mean is refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

from vllm_retrieval_spec.options import SPECULATE_ARG

CHAIN_ONLY_FEATURES: dict[str, Callable[[SamplingParams], bool]] = {
    "presence_penalty": lambda p: p.presence_penalty != 0.0,
    "frequency_penalty": lambda p: p.frequency_penalty != 0.0,
    "repetition_penalty": lambda p: p.repetition_penalty != 1.0,
    "min_p": lambda p: p.min_p != 0.0,
    "min_tokens": lambda p: p.min_tokens > 0,
    "bad_words": lambda p: bool(p.bad_words),
    "logit_bias": lambda p: bool(p.logit_bias),
    "allowed_token_ids": lambda p: bool(p.allowed_token_ids),
    "structured_outputs": lambda p: p.structured_outputs is not None,
    "thinking_token_budget": lambda p: p.thinking_token_budget is not None,
}


def refuse_chain_only_features(params: object) -> None:
    """Reject (HTTP 400 on the server) sampling features tree verification does not apply to
    draft nodes, instead of silently changing the output; a request that turned speculation off
    gets no drafts, so it may use them."""
    if not isinstance(params, SamplingParams) or turned_speculation_off(params):  # pooling requests; undrafted
        return
    used = [name for name, in_use in CHAIN_ONLY_FEATURES.items() if in_use(params)]
    if used:
        raise VLLMValidationError(
            f"{', '.join(used)} cannot be used while the server verifies draft trees "
            f"(retrieval_spec.tree); drop them, turn speculation off for this request (vllm_xargs "
            f"{SPECULATE_ARG}: off) or serve without tree mode",
            parameter=used[0],
        )


# Features a seeded request cannot use in chain mode: vLLM applies them at its bonus rows only.
UNREPEATABLE_WITH_SEED = ("min_p", "logit_bias")
_SAMPLING_EPS = 1e-5  # vLLM: below this temperature a request is greedy


def refuse_unrepeatable_seeds(params: object) -> None:
    """Reject (HTTP 400 on the server) a seeded sampling request using min_p or logit_bias,
    which speculative verification applies at some positions only: its tokens would not
    repeat as ``seed`` promises."""
    if not isinstance(params, SamplingParams) or params.seed is None or params.temperature < _SAMPLING_EPS:
        return
    used = [name for name in UNREPEATABLE_WITH_SEED if CHAIN_ONLY_FEATURES[name](params)]
    if used:
        raise VLLMValidationError(
            f"{', '.join(used)} cannot be combined with seed while the server speculates: seeded "
            "tokens repeat exactly with temperature, top_k, top_p, penalties, bad_words, "
            "allowed_token_ids, min_tokens and structured outputs; drop them or the seed",
            parameter=used[0],
        )


_SPECULATE_VALUES: dict[Any, bool] = {"on": True, "off": False, "true": True, "false": False, "1": True, "0": False,
                                      True: True, False: False}  # 1 and 0 (and 1.0, 0.0) hash as True and False
_UNREADABLE = object()


def _speculation_switch(params: object) -> object:
    """The request's :data:`SPECULATE_ARG` as True / False, None when it gives none, else
    ``_UNREADABLE``."""
    extra = getattr(params, "extra_args", None)
    if not extra or SPECULATE_ARG not in extra:
        return None
    value = extra[SPECULATE_ARG]
    try:
        return _SPECULATE_VALUES[value.lower() if isinstance(value, str) else value]
    except (KeyError, TypeError):
        return _UNREADABLE


def refuse_unreadable_speculation_switch(params: object) -> None:
    """Reject (HTTP 400 on the server) a :data:`SPECULATE_ARG` that is not on/off, true/false or 1/0."""
    if _speculation_switch(params) is _UNREADABLE:
        raise VLLMValidationError(
            f"{SPECULATE_ARG} must be \"on\" or \"off\" (also true/false, 1/0), not "
            f"{params.extra_args[SPECULATE_ARG]!r}: set it in vllm_xargs (SamplingParams.extra_args) to serve this "
            "request with or without speculation",
            parameter=SPECULATE_ARG,
        )


def turned_speculation_off(params: object) -> bool:
    """Whether the request's own switch says not to draft for it (admission refused any other value)."""
    return _speculation_switch(params) is False
