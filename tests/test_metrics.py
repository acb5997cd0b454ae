"""Our Prometheus metrics: published from a proposer and its session (on a real server's
``/metrics`` next to vLLM's: ``test_e2e_server.py``, on that file's server)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from test_goodput import feed
from test_proposer_base import fake_vllm_config, goodput_budget, vllm_buffers

from vllm_retrieval_spec.drafts import (
    SOURCE_CONTEXT,
    SOURCE_DATASTORE,
    SOURCE_DENSE,
    SOURCE_MODEL,
    SOURCE_OUTPUT,
    source_label,
)
from vllm_retrieval_spec.goodput.search_gate import MIN_PAIRED_STEPS, SearchGate
from vllm_retrieval_spec.integration import metrics
from vllm_retrieval_spec.integration.metrics import PREFIX, RunnerMetrics
from vllm_retrieval_spec.proposers.prompt_lookup import PromptLookupProposer
from vllm_retrieval_spec.verification.session import SpecSession

from vrs_test_proposers import FailingEveryThirdStepProposer

CONTEXT = [1, 2, 3, 1, 2, 3, 1, 2]  # prompt lookup drafts 3 1 2 after the last 2


def metered(proposer: PromptLookupProposer, budget: bool) -> tuple[SpecSession, dict[str, str]]:
    """A session (with a cheap-verification budget or none) and metrics under fresh labels."""
    session = SpecSession(tree_mode=False, budget=goodput_budget(1e-5) if budget else None)
    proposer.bind_session(session)
    labels = (f"test-{uuid.uuid4().hex[:8]}", "0", type(proposer).__name__)
    session.metrics = RunnerMetrics(labels, proposer, session)
    return session, dict(zip(("model_name", "engine", "proposer"), labels))


def step(session: SpecSession, proposer: PromptLookupProposer, sampled: list[list[int]]) -> list[list[int]]:
    """One drafting step as the runner hooks run it."""
    num_tokens, token_ids = vllm_buffers([CONTEXT])
    session.begin_step(["a"], 1)
    try:
        return proposer.propose(sampled, num_tokens, token_ids)
    finally:
        session.end_step()


def value(name: str, labels: dict[str, str], **extra: str) -> float | None:
    return REGISTRY.get_sample_value(PREFIX + name, {**labels, **extra})


def test_source_labels_name_every_flag():
    assert source_label(SOURCE_DATASTORE | SOURCE_CONTEXT) == "datastore+context"
    assert source_label(SOURCE_MODEL) == "model_ngram" and source_label(SOURCE_OUTPUT) == "output_index"
    assert source_label(0) == "none"


def test_steps_publish_draft_budget_and_acceptance_counts():
    proposer = PromptLookupProposer(fake_vllm_config())
    session, labels = metered(proposer, budget=True)
    assert value("drafting_failures_total", labels) == 0  # shown from the start
    drafts = step(session, proposer, [[2]])
    assert drafts == [[3, 1, 2]]
    step(session, proposer, [[3, 1, 9]])  # 3 and 1 accepted, 2 rejected
    assert value("draft_tokens_total", labels, source="context") == proposer.stats.draft_tokens == 6
    assert value("drafted_requests_total", labels) == value("searched_requests_total", labels) == 2
    assert value("drafting_seconds_count", labels) == 2
    assert value("budget_steps_total", labels, decision="drafted") == 2
    assert value("budget_chosen_nodes_total", labels) == 6
    assert value("observed_draft_tokens_total", labels, source="context") == 3
    assert value("accepted_draft_tokens_total", labels, source="context") == 2
    assert value("budget_step_cost_seconds", labels, term="draft_token") == pytest.approx(1e-5, rel=0.01)
    session.stats.compacted_slots += 5  # what a tree step's compaction adds
    session.stats.mcss_requests += 3  # what a step of drawn candidates adds
    session.budget.stats.tree_steps += 3  # what three tree-mode steps add, one of which kept a branch
    session.budget.stats.branched_steps += 1
    assert value("budget_step_cost_error", labels, measure="bias") == 0.0  # no step past the warm-up yet
    session.budget.cost.error.add(0.012, 0.010, forgetting=0.99)  # a step predicted 20% dearer than it ran
    step(session, proposer, [[]])  # a step without sampled tokens: nothing drafted
    assert value("budget_step_cost_error", labels, measure="bias") == pytest.approx(0.2)
    assert value("budget_step_cost_error", labels, measure="mean_absolute") == pytest.approx(0.2)
    assert value("compacted_kv_slots_total", labels) == 5 and value("mcss_requests_total", labels) == 3
    assert value("budget_tree_choices_total", labels, choice="branched") == 1
    assert value("budget_tree_choices_total", labels, choice="chain") == 2
    assert value("draft_tokens_total", labels, source="context") == 6 and value("drafting_seconds_count", labels) == 3


class GatedPromptLookup(PromptLookupProposer):
    """Prompt lookup with a search gate of its own, as Hybrid has (driven by hand here)."""

    def __init__(self, vllm_config) -> None:
        super().__init__(vllm_config)
        self.gate = SearchGate(SOURCE_DENSE)

    def search_gate(self) -> SearchGate:
        return self.gate


def test_a_search_gate_publishes_its_decisions_and_the_rates_behind_them():
    proposer = GatedPromptLookup(fake_vllm_config())
    session, labels = metered(proposer, budget=True)
    assert value("dense_search_paired_steps_total", labels) == 0  # shown from the start
    assert not proposer.gate.open()  # held until the search has shown it pays
    # Paired steps where the search's chain is accepted whole (4 tokens) and the other's for 2.
    feed(proposer.gate, [7, 8, 9, 10], [7, 8, 5], [7, 8, 9, 10, 11], MIN_PAIRED_STEPS)
    assert proposer.gate.open()
    step(session, proposer, [[2]])
    assert value("dense_search_steps_total", labels, decision="held") == 1
    assert value("dense_search_steps_total", labels, decision="searched") == 1
    assert value("dense_search_paired_steps_total", labels) == MIN_PAIRED_STEPS
    assert value("dense_search_tokens_per_second", labels, way="with_search") == pytest.approx(5 / 0.03)
    assert value("dense_search_tokens_per_second", labels, way="without") == pytest.approx(3 / 0.03)


def test_a_proposer_without_a_search_gate_publishes_no_gate_series():
    proposer = PromptLookupProposer(fake_vllm_config())
    session, labels = metered(proposer, budget=True)
    step(session, proposer, [[2]])
    assert value("dense_search_paired_steps_total", labels) is None
    assert value("dense_search_tokens_per_second", labels, way="without") is None


def test_requests_that_turned_speculation_off_are_counted():
    from types import SimpleNamespace

    from vllm import SamplingParams

    from vllm_retrieval_spec.options import SPECULATE_ARG

    proposer = PromptLookupProposer(fake_vllm_config())
    session, labels = metered(proposer, budget=True)
    assert step(session, proposer, [[2]]) == [[3, 1, 2]]
    assert value("unspeculated_requests_total", labels) == 0
    session.admit([SimpleNamespace(req_id="a", sampling_params=SamplingParams(extra_args={SPECULATE_ARG: "off"}))])
    assert step(session, proposer, [[3, 1, 2, 9]]) == [[]] and step(session, proposer, [[5]]) == [[]]
    assert value("unspeculated_requests_total", labels) == 2 and value("searched_requests_total", labels) == 1


def test_fixed_budget_publishes_no_budget_series_and_failures_count():
    proposer = FailingEveryThirdStepProposer(fake_vllm_config())
    session, labels = metered(proposer, budget=False)
    for _ in range(3):
        step(session, proposer, [[2]])
    assert value("drafting_failures_total", labels) == 1
    assert value("consecutive_drafting_failures", labels) == 1  # the last step failed
    step(session, proposer, [[2]])
    assert value("consecutive_drafting_failures", labels) == 0
    assert value("draft_tokens_total", labels, source="context") == 9
    assert value("budget_steps_total", labels, decision="drafted") is None
    assert value("accepted_draft_tokens_total", labels, source="context") is None


def test_metrics_never_stop_drafting(monkeypatch, caplog):
    proposer = PromptLookupProposer(fake_vllm_config())
    session, _ = metered(proposer, budget=False)

    def broken() -> None:
        raise RuntimeError("no metrics")

    monkeypatch.setattr(metrics, "families", broken)
    assert step(session, proposer, [[2]]) == step(session, proposer, [[2]]) == [[3, 1, 2]]
    assert caplog.text.count("publishing metrics failed") == 1


def test_a_server_shares_a_fresh_metrics_directory_removed_at_exit(tmp_path):
    script = ("import os; from vllm_retrieval_spec.compat import configure_vllm_environment as c; "
              "c(in_process=False); d = os.environ['PROMETHEUS_MULTIPROC_DIR']; c(in_process=False); "
              "assert os.environ['PROMETHEUS_MULTIPROC_DIR'] == d and os.path.isdir(d); print(d)")
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    made = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert not os.path.exists(made.stdout.strip())
    late = subprocess.run([sys.executable, "-c", "import prometheus_client; " + script], env=env,
                          capture_output=True, text=True)
    assert late.returncode != 0 and "KeyError" in late.stderr  # too late: vLLM's metrics stay in memory


def scraped(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a ``/metrics`` page."""
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: list[tuple[str, dict[str, str], float]], name: str, labels: dict[str, str]) -> float:
    """The sum of our samples named ``name`` that carry ``labels``."""
    found = [v for n, sample_labels, v in samples if n == PREFIX + name and labels.items() <= sample_labels.items()]
    assert found, f"{PREFIX}{name} with {labels} is not on /metrics"
    return sum(found)
