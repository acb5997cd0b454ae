"""Options under additional_config['retrieval_spec']: defaults, unknown keys, bad values."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_retrieval_spec.options import OptionsError, RetrievalSpecOptions


def test_defaults_when_absent():
    assert RetrievalSpecOptions.from_additional_config(None) == RetrievalSpecOptions()
    assert RetrievalSpecOptions.from_additional_config({"other_plugin": {}}) == RetrievalSpecOptions()


def test_values_are_read():
    options = RetrievalSpecOptions.from_additional_config(
        {"retrieval_spec": {"context_ngram_min": 2, "context_ngram_max": 5}}
    )
    assert (options.context_ngram_min, options.context_ngram_max) == (2, 5)


def test_unknown_key_names_the_key_and_the_known_ones():
    with pytest.raises(OptionsError, match=r"unknown option\(s\) 'n_maxx'.*known options: .*context_ngram_max"):
        RetrievalSpecOptions.from_dict({"n_maxx": 3})


@pytest.mark.parametrize("value", [0, 65, "3", 2.5, True, None])
def test_bad_value_names_the_key_and_the_allowed_range(value):
    with pytest.raises(OptionsError, match=r"retrieval_spec\.context_ngram_max must be an integer in \[1, 64\]"):
        RetrievalSpecOptions.from_dict({"context_ngram_max": value})


def test_inconsistent_values_are_rejected():
    message = r"retrieval_spec\.context_ngram_min \(5\) must not exceed retrieval_spec\.context_ngram_max \(2\)"
    with pytest.raises(OptionsError, match=message):
        RetrievalSpecOptions.from_dict({"context_ngram_min": 5, "context_ngram_max": 2})


def test_a_learned_dense_index_of_one_position_is_refused():
    with pytest.raises(OptionsError, match=r"dense_learned_positions must be 0 \(off\) or at least 2, got 1"):
        RetrievalSpecOptions.from_dict({"dense_learned_positions": 1})
    assert RetrievalSpecOptions.from_dict({"dense_learned_positions": 2}).dense_learned_positions == 2


def test_section_must_be_an_object():
    with pytest.raises(OptionsError, match="must be a JSON object"):
        RetrievalSpecOptions.from_additional_config({"retrieval_spec": [1, 2]})


def test_misnamed_section_is_pointed_out():
    with pytest.raises(OptionsError, match=r"live under additional_config\['retrieval_spec'\]"):
        RetrievalSpecOptions.from_additional_config({"vllm_retrieval_spec": {"context_ngram_max": 3}})


def test_every_option_is_described():
    lines = RetrievalSpecOptions.describe().splitlines()
    fields = dataclasses.fields(RetrievalSpecOptions)
    assert [line.split(" ", 1)[0] for line in lines] == [f.name for f in fields]
    assert lines[0] == f"context_ngram_min (default 1): {fields[0].metadata['help']}"


def test_ngrammys_options_are_read():
    options = RetrievalSpecOptions.from_dict(
        {"ngrammys_drafts": 4, "ngrammys_draft_len": 6, "ngrammys_context_len": 2, "ngrammys_mixing": "bigram-only"}
    )
    assert (options.ngrammys_drafts, options.ngrammys_draft_len, options.ngrammys_context_len) == (4, 6, 2)
    assert options.ngrammys_mixing == "bigram-only"


def test_budget_options_are_read_and_checked():
    assert RetrievalSpecOptions().budget == "auto" and RetrievalSpecOptions().use_output_index
    options = RetrievalSpecOptions.from_dict({"budget": "fixed", "budget_margin": 0.1, "output_index_tokens": 4096})
    assert (options.budget, options.budget_margin, options.output_index_tokens) == ("fixed", 0.1, 4096)
    with pytest.raises(OptionsError, match=r"retrieval_spec\.budget must be one of 'auto', 'fixed', got 'sometimes'"):
        RetrievalSpecOptions.from_dict({"budget": "sometimes"})
    with pytest.raises(OptionsError, match=r"retrieval_spec\.output_index_tokens must be an integer in \[1024, "):
        RetrievalSpecOptions.from_dict({"output_index_tokens": 10})


def test_candidate_options_are_read_and_checked():
    options = RetrievalSpecOptions.from_dict({"candidates": "sampled", "candidates_per_node": 3,
                                              "candidate_replacement": True, "draft_temperature": 0.5})
    assert (options.candidates, options.candidates_per_node, options.candidate_replacement,
            options.draft_temperature) == ("sampled", 3, True, 0.5)
    assert RetrievalSpecOptions().candidates == "deterministic"
    with pytest.raises(OptionsError, match=r"retrieval_spec\.candidates must be one of 'deterministic', 'sampled'"):
        RetrievalSpecOptions.from_dict({"candidates": "random"})
    with pytest.raises(OptionsError, match=r"retrieval_spec.draft_temperature must be a number in \[0.05"):
        RetrievalSpecOptions.from_dict({"draft_temperature": 0})


def test_the_readme_options_table_is_generated_from_the_options():
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "options_table.py"
    spec = importlib.util.spec_from_file_location("options_table", script)
    options_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(options_table)
    table = options_table.readme_table(options_table.README.read_text())
    assert table == RetrievalSpecOptions.markdown_table(), "README.md is outdated: run scripts/options_table.py"
