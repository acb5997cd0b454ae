"""The committed workloads of ``benchmarks/workloads.py`` (``benchmarks/data/*.jsonl``): present,
small, loadable, reproducible from the seed, disjoint from HumanEval (but the chat-wrapped
HumanEval one) and within 2,048 SmolLM2 tokens; ``acceptance.py --dataset`` renders them."""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import Counter
from itertools import pairwise
from types import ModuleType

import pytest

from vllm_retrieval_spec.evaluation.load import jsonl_requests
from vllm_retrieval_spec.evaluation.prompts import chat_prompts, humaneval_problems

from conftest import BENCHMARKS, load_benchmark

DATA = BENCHMARKS / "data"
WORKLOADS = ("code_edit", "multi_turn", "doc_qa", "humaneval_chat")
MAX_PROMPT_TOKENS = 2_048


@pytest.fixture(scope="module")
def workloads() -> ModuleType:
    return load_benchmark("workloads")


def records(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("name", WORKLOADS)
def test_files_are_present_small_and_load_as_chat_requests(name):
    path = DATA / f"{name}.jsonl"
    assert path.is_file() and path.stat().st_size < 2_000_000
    found = records(name)
    assert len(found) >= 100 and {r["workload"] for r in found} == {name}
    for record in found:
        roles = [m["role"] for m in record["messages"]]
        assert roles[-1] == "user" and set(roles) <= {"user", "assistant"}
        assert all(isinstance(m["content"], str) and m["content"] for m in record["messages"])
    assert [r.messages for r in jsonl_requests(path, None, 64)] == [r["messages"] for r in found]


def test_files_are_reproducible_from_the_seed(workloads, tmp_path):
    if sys.version_info[:2] != workloads.GENERATED_WITH:
        pytest.skip(f"the files come from Python {workloads.GENERATED_WITH}'s standard library")
    for path in workloads.write_workloads(tmp_path, seed=0):
        assert path.read_bytes() == (DATA / path.name).read_bytes(), f"{path.name} differs from its regeneration"


def test_standard_library_workloads_hold_no_humaneval_text():
    texts = []
    for problem in humaneval_problems():
        texts.append(problem["prompt"].strip())
        for node in ast.walk(ast.parse(problem["prompt"])):
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            texts += [doc.strip()] if doc and len(doc.strip()) >= 40 else []
    for name in WORKLOADS[:3]:
        contents = "\n".join(m["content"] for r in records(name) for m in r["messages"])
        found = [text[:60] for text in texts if text in contents]
        assert not found, f"{name} holds HumanEval text: {found[:3]}"
    assert sum(text in records("humaneval_chat")[0]["messages"][0]["content"] for text in texts) >= 1


def test_prompts_fit_2048_tokens_and_acceptance_renders_them(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    acceptance = load_benchmark("acceptance")
    for name in WORKLOADS:
        prompts = acceptance.dataset_prompts(DATA / f"{name}.jsonl", None, tokenizer)
        assert prompts == chat_prompts([r["messages"] for r in records(name)], tokenizer)
        longest = max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
        assert longest <= MAX_PROMPT_TOKENS, f"{name}: a prompt of {longest} tokens"
    assert len(acceptance.dataset_prompts(DATA / "doc_qa.jsonl", 5, tokenizer)) == 5


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_interleaved_configs_run_at_each_place_and_after_each_other_equally_often(count):
    acceptance = load_benchmark("acceptance")
    orders = acceptance.balanced_orders(count)
    assert all(sorted(order) == list(range(count)) for order in orders)
    places = Counter((place, config) for order in orders for place, config in enumerate(order))
    assert len(set(places.values())) == 1 and len(places) == count * count
    follows = Counter(pair for order in orders for pair in pairwise(order))
    assert len(follows) == count * (count - 1) and len(set(follows.values())) <= 1
    names = [f"c{i}" for i in range(count)]
    turns = list(acceptance.interleaved_turns(names, 7, 2))
    assert [start for start, _ in turns] == [start for start in range(0, 7, 2) for _ in names]


def test_paired_ratio_intervals_hold_the_ratio_and_need_their_units_in_every_report():
    acceptance = load_benchmark("acceptance")

    def interval(ours, references, less_one=False):
        return acceptance.paired_ratio_interval(ours, references, "tokens", "seconds", less_one=less_one)

    suffix = {"tokens": [100, 200, 300], "seconds": [2.0, 4.0, 5.0]}
    twice = {"tokens": [100, 200, 300], "seconds": [1.0, 2.0, 2.5]}
    assert interval(twice, [suffix]) == pytest.approx([2.0, 2.0])
    mixed = {**twice, "seconds": [1.0, 4.0, 5.0]}  # one unit twice as fast, two alike
    low, high = interval(mixed, [suffix])
    assert 1.0 <= low < 600 / 10 / (600 / 11) < high <= 2.0
    assert interval({"tokens": [3, 5], "seconds": [1, 2]}, [{"tokens": [2, 3], "seconds": [1, 2]}],
                    less_one=True) == pytest.approx([2.0, 2.0])  # (2 + 4) / 3 over (1 + 2) / 3
    assert interval({**twice, "seconds": None}, [suffix]) is None  # not interleaved
    assert interval(twice, []) is None
    assert interval({"tokens": [1], "seconds": [1.0]}, [{"tokens": [1], "seconds": [1.0]}]) is None


def test_report_names_the_model_unless_it_is_smollm2():
    acceptance = load_benchmark("acceptance")
    args = argparse.Namespace(tag="t", temperature=0.7, top_p=1.0, seed=None, max_tokens=64, concurrency=8,
                              model="smollm2")
    report = {"prompts": 20}
    assert acceptance.report_path("raw", report, args).name == "acceptance_raw_n20_t64_c8_T0.7_t.json"
    args.model = "gemma3"
    assert acceptance.report_path("raw", report, args).name == "acceptance_raw_n20_t64_c8_T0.7_gemma3_t.json"
    assert set(acceptance.MODELS) == {"smollm2", "gemma3"}


def test_the_default_datastore_is_built_only_for_configs_that_draft_from_it(monkeypatch, tmp_path):
    acceptance = load_benchmark("acceptance")
    built = []
    monkeypatch.setattr(acceptance, "ensure_recipe_store", lambda name, model: built.append((name, model)))
    args = argparse.Namespace(option=[], concurrency=1)
    acceptance.ensure_recipe_datastores(tmp_path, ["none", "suffix", "dresd_k32", "ngrammys_k8"], args)
    assert built == []
    acceptance.ensure_recipe_datastores(tmp_path, ["none", "rest_k32", "rest_k8"], args)
    assert built == [("python-code", tmp_path)]
    args.option = [("datastore", str(tmp_path / "store"))]
    acceptance.ensure_recipe_datastores(tmp_path, ["rest_k32"], args)
    assert len(built) == 1


def test_stolen_cpu_time_is_read_and_named_where_it_is_notable(capsys):
    from vllm_retrieval_spec.evaluation.engine import stolen_cpu_seconds

    acceptance = load_benchmark("acceptance")
    first = stolen_cpu_seconds()
    assert 0.0 <= first <= stolen_cpu_seconds()
    calm = {"config": "none", "seconds": 10.0, "stolen_cpu_seconds": 0.1,
            "group_seconds": [5.0, 5.0], "group_stolen_cpu_seconds": [0.1, 0.0]}
    stalled = {"config": "rest_k32", "seconds": 10.0, "stolen_cpu_seconds": 3.0,
               "group_seconds": [4.0, 6.0], "group_stolen_cpu_seconds": [0.2, 2.8]}
    acceptance.print_stolen_time({"processor_count": 2, "results": [calm, stalled]})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rest_k32")
    assert "15.0% of the CPU time" in lines[0] and "group 2 (23% of its 6.0 s)" in lines[0]
