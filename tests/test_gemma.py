"""A second architecture end to end: Gemma-3-270m in an in-process vLLM engine.

Gemma 3 has sliding-window layers (512 keys; vLLM's hybrid KV cache manager gives them KV cache
groups of their own, with their own block tables and slots), one KV head of size 256 and a
262,144-token vocabulary (uint32 datastore tokens). Half of the prompts are longer than the
window, so that the window binds at every decode step. The model comes from a PyPI package
under the Gemma Terms of Use, installed at test time (``scripts/setup.sh``), never shipped: the
tests skip when it is absent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_retrieval_spec.evaluation.engine import EngineSpec, GenerationRun, drafter_of, generate
from vllm_retrieval_spec.evaluation.prompts import humaneval_prompts

from conftest import assert_same_token_ids, build_stdlib_store, running_engine
from scale import at_scale

pytestmark = pytest.mark.engine

PROMPTS = 8
BATCH1_PROMPTS = at_scale(ci=2, full=8)  # the first ones also run one at a time: one short, one long
MAX_TOKENS = at_scale(ci=24, full=48)
IN_FLIGHT = 8
WINDOW = 512
TREE_NODES = 16
STORE_PACKAGES = ("json", "collections", "unittest")


@pytest.fixture(scope="module")
def gemma_prompts(gemma_dir: Path) -> list[str]:
    """HumanEval prompts; every other one follows as many later problems as it takes to pass
    the window (the window then binds at every step of its generation)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    problems = humaneval_prompts()
    extra = iter(problems[PROMPTS:])
    prompts = []
    for i, prompt in enumerate(problems[:PROMPTS]):
        while i % 2 and len(tokenizer(prompt).input_ids) <= WINDOW:
            prompt = next(extra) + prompt
        prompts.append(prompt)
    return prompts


@pytest.fixture(scope="module")
def gemma_store(gemma_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small code datastore in Gemma's tokens (uint32: the vocabulary exceeds 65,535)."""
    return build_stdlib_store(gemma_dir, tmp_path_factory.mktemp("gemma") / "stdlib-subset", STORE_PACKAGES)


def run_both_ways(spec: EngineSpec, prompts: list[str]) -> tuple[dict[str, GenerationRun], object]:
    """Greedy generations at batch 1 (the first BATCH1_PROMPTS) and with IN_FLIGHT requests in
    flight (all), and the drafter."""
    with running_engine(spec) as llm:
        runs = {1: generate(llm, prompts[:BATCH1_PROMPTS], MAX_TOKENS, concurrency=1),
                IN_FLIGHT: generate(llm, prompts, MAX_TOKENS, concurrency=IN_FLIGHT)}
        llm.llm_engine.step()  # the runner hears of the requests that finished last
        return runs, drafter_of(llm)


@pytest.fixture(scope="module")
def gemma_baseline(gemma_dir: Path, gemma_prompts: list[str]) -> dict[int, GenerationRun]:
    runs, _ = run_both_ways(EngineSpec(gemma_dir, max_num_seqs=IN_FLIGHT), gemma_prompts)
    return runs


def rest_spec(model: Path, store: Path, tree: bool) -> EngineSpec:
    options = {"datastore": str(store), "tree": tree, "budget": "fixed"}
    return EngineSpec(model, speculative_config={"model": "vllm_retrieval_spec.RestProposer",
                                                 "num_speculative_tokens": TREE_NODES if tree else 4},
                      additional_config={"retrieval_spec": options}, max_num_seqs=IN_FLIGHT)


def test_gemma_datastore_stores_uint32_tokens(gemma_store):
    from vllm_retrieval_spec.datastores import TokenDatastore

    store = TokenDatastore.open(gemma_store)
    assert store.tokens.dtype.name == "uint32"
    tokens = store.tokens[store.tokens != store.separator]
    assert 1 << 16 <= int(tokens.max()) < 262144  # ids a uint16 store could not hold


def test_half_of_the_prompts_are_longer_than_the_window(gemma_baseline):
    lengths = [len(record.prompt_ids) for record in gemma_baseline[IN_FLIGHT].records]
    assert sum(length > WINDOW for length in lengths) == PROMPTS // 2, lengths


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_rest_on_gemma_is_lossless(tree, gemma_dir, gemma_store, gemma_prompts, gemma_baseline):
    """REST chains (vLLM verifies them) and branching trees (tree attention with the sliding
    window on the window layers, KV compaction in every KV cache group) give the greedy token
    ids of no speculation at batch 1 and 8 in flight."""
    runs, drafter = run_both_ways(rest_spec(gemma_dir, gemma_store, tree), gemma_prompts)
    for concurrency, run in runs.items():
        assert_same_token_ids(gemma_baseline[concurrency], run)
        assert run.counters.accepted_tokens > 0, concurrency
    assert drafter.stats.failures == 0
    stats = drafter.session.stats
    if tree:
        assert stats.branching_requests > 0, "no step verified a branching tree"
        assert stats.compacted_slots > 0, "no accepted path needed KV compaction"
    else:
        assert stats.tree_steps == 0
    assert drafter.session.requests == {}, "finished requests left state behind"
