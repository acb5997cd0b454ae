"""``vllm-retrieval-spec doctor`` on this installation: no problems, and the kernels' blocks the CPU runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_retrieval_spec import doctor
from vllm_retrieval_spec.kernels.extension import load_extension


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())


def test_the_extension_takes_its_wide_and_bfloat16_dot_paths_exactly_where_the_cpu_has_them():
    flags = cpu_flags()
    if not flags or "avx2" not in flags:
        pytest.skip("not an x86 CPU whose flags Linux lists")
    assert load_extension().cpu_has_wide_lanes() == ({"avx512f", "avx512vl"} <= flags)
    assert load_extension().screened_head_pairs() == ({"avx512f", "avx512vl", "avx512_bf16"} <= flags)


def test_doctor_finds_no_problem_and_names_the_blocks_this_cpu_runs(capsys):
    assert doctor.report() == []
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "OK"
    flags = cpu_flags()
    if "avx2" in flags:
        lanes = "AVX-512: 16-lane" if {"avx512f", "avx512vl"} <= flags else "AVX2: 8-lane"
        assert f"this CPU has {lanes} blocks" in out
        head = "the bfloat16 dot product" if {"avx512f", "avx512vl", "avx512_bf16"} <= flags else f"{lanes} blocks"
        assert f"the screened head on {head}" in out
