"""``vllm-retrieval-spec serve`` refuses in the front end, before any engine starts, what a
first request would otherwise find out by killing the engine."""

from __future__ import annotations

import json

import pytest

from vllm_retrieval_spec.cli import CommandLineError, check_serve
from vllm_retrieval_spec.options import OptionsError


def serve_args(speculative: dict, *extra: str) -> list[str]:
    return ["/nonexistent-model", "--speculative-config", json.dumps(speculative), *extra]


@pytest.mark.parametrize(("speculative", "extra", "message"), [
    ({"model": "vllm_retrieval_spec.RestProposer", "num_speculative_tokens": 100_000}, (),
     r"num_speculative_tokens must be in \[1, 128\].*got 100000"),
    ({"model": "vllm_retrieval_spec.RestProposer", "num_speculative_tokens": 0}, (),
     r"num_speculative_tokens must be in \[1, 128\].*got 0"),
    ({"model": "vllm_retrieval_spec.RestProposer", "num_speculative_tokens": 8},
     ("--kv-cache-dtype", "fp8", "--additional-config", '{"retrieval_spec": {"tree": true}}'),
     r"does not support --kv-cache-dtype fp8"),
])
def test_serve_refuses_what_the_engine_cannot_serve(speculative, extra, message):
    with pytest.raises(OptionsError, match=message):
        check_serve(serve_args(speculative, *extra))


def test_serve_needs_an_integer_number_of_drafts():
    with pytest.raises(CommandLineError, match="integer num_speculative_tokens"):
        check_serve(serve_args({"model": "vllm_retrieval_spec.RestProposer", "num_speculative_tokens": "8"}))
