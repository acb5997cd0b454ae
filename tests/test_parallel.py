"""More than one engine process: tensor-parallel ranks draft the same, data-parallel engines
and several API servers serve exactly and export our metrics.

The unit tests run one drafting loop per rank in two processes joined by a gloo group, each
rank on its own fake clock: the goodput budget's decisions follow wall-clock time, so
without the first rank's clock the ranks draft differently (the control), with it they draft
exactly what the first rank alone would. The server tests compare greedy chat token ids with
a server without speculation (with the same tensor-parallel size), and on tensor-parallel
servers every rank logs what it drafts (``vrs_parallel_proposers``): the logs must be equal.
The server tests run at ``VRS_TEST_SCALE=full`` (five servers of two to four engine processes:
~10 minutes on a 2-core machine).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from test_faults import DRAFTING_FAILED, TESTS_DIR
from test_metrics import scraped, total
from test_proposer_base import fake_vllm_config, vllm_buffers
from vrs_parallel_proposers import DRAFT_LOG_DIR

from vllm_retrieval_spec.evaluation.client import openai_client
from vllm_retrieval_spec.evaluation.prompts import humaneval_messages
from vllm_retrieval_spec.evaluation.server import VllmServer
from vllm_retrieval_spec.goodput import GoodputBudget, StepCostModel
from vllm_retrieval_spec.goodput.ranks import RankZeroClock, SharedClock, tensor_parallel_clock
from vllm_retrieval_spec.integration.metrics import PREFIX
from vllm_retrieval_spec.proposers.rest import RestProposer
from vllm_retrieval_spec.verification.session import SpecSession

from scale import full_scale_only

# --- Ranks on different clocks ----------------------------------------------------------------

RANKS = 2
ROWS = 4
STEPS = 40
K = 8
MAX_MODEL_LEN = 256
PROMPT_TOKENS = 48
ALPHABET = 3  # few distinct tokens: many in-context matches, branching trees, some rejected
# (seconds per clock reading, seconds per target step): on rank 1 drafting looks 500 times
# dearer, so alone it skips its searches at first, and it learns another step cost.
CLOCKS = ((0.0002, 0.030), (0.1, 0.090))
# The CPU prior but cheap tree attention: trees branch.
PRIOR = (0.04, 0.002, 0.0015, 0.0001, 0.0002, 0.0005, 0.0008, 0.0)


class FakeClock:
    """``time.perf_counter`` for one rank: ``tick`` seconds pass at every reading."""

    def __init__(self, tick: float) -> None:
        self.now = 0.0
        self.tick = tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


@dataclass
class Trace:
    """What one rank drafted and learned over a run."""

    drafts: list[list[list[int]]] = field(default_factory=list)  # per step, per row
    trees: list[dict[str, tuple[tuple[int, ...], tuple[int, ...]]]] = field(default_factory=list)
    budget: dict[str, Any] = field(default_factory=dict)
    cost: list[float] = field(default_factory=list)


def truth(row: int) -> np.ndarray:
    """The tokens request ``row`` emits (its prompt first)."""
    return np.random.default_rng(row).integers(1, ALPHABET + 1, MAX_MODEL_LEN).astype(np.int32)


def drafting_run(tree: bool, rank: int, clock: SharedClock | None) -> Trace:
    """STEPS drafting steps of RestProposer (context retrieval) as a runner drives them, on
    ``rank``'s fake clock; the budget takes its times from ``clock`` when given."""
    options = {"use_datastore": False, "use_output_index": False, "tree": tree, "min_ratio": 0.0}
    config = fake_vllm_config(k=K, max_model_len=MAX_MODEL_LEN, options=options)
    config.model_config.tokenizer = None
    proposer = RestProposer(config)
    budget = GoodputBudget(cost=StepCostModel(prior=PRIOR, clock=clock), clock=clock)
    session = SpecSession(tree_mode=tree, budget=budget)
    proposer.bind_session(session)
    tick, step_seconds = CLOCKS[rank]
    perf_counter = FakeClock(tick)
    req_ids = [f"req-{row}" for row in range(ROWS)]
    sequences = [truth(row) for row in range(ROWS)]
    lengths = [PROMPT_TOKENS] * ROWS
    trace = Trace()
    drafted = 0
    with mock.patch("time.perf_counter", perf_counter):
        for step in range(STEPS):
            emitted = [1 + (step + row) % 3 for row in range(ROWS)]
            sampled = [sequences[row][lengths[row]: lengths[row] + emitted[row]].tolist() for row in range(ROWS)]
            lengths = [length + count for length, count in zip(lengths, emitted)]
            num_tokens, token_ids = vllm_buffers([s[:n].tolist() for s, n in zip(sequences, lengths)], MAX_MODEL_LEN)
            perf_counter.now += step_seconds  # the target step
            session.begin_step(req_ids, ROWS + drafted, num_draft_tokens=drafted)
            drafts = proposer.propose(sampled, num_tokens, token_ids)
            session.end_step()
            drafted = sum(map(len, drafts))
            trace.drafts.append(drafts)
            trace.trees.append({req: (state.tree.tokens, state.tree.parents) for req, state in session.requests.items()
                                if state.tree_step == session.step})
    trace.budget = asdict(budget.stats) | {"search_seconds_per_row": budget.search_seconds_per_row}
    trace.cost = budget.cost.coefficients.tolist()
    return trace


def run_rank(rank: int, init_file: str, tree: bool, results: multiprocessing.Queue) -> None:
    """One tensor-parallel rank: the drafting run on this rank's clock, the budget on the
    first rank's (broadcast over a gloo group, as over vLLM's tensor-parallel CPU group)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS,
                            timeout=timedelta(seconds=120))
    try:
        results.put((rank, drafting_run(tree, rank, RankZeroClock(dist.group.WORLD, 0))))
    finally:
        dist.destroy_process_group()


def ranks_sharing_the_first_clock(tree: bool, tmp_path: Path) -> list[Trace]:
    """Every rank's trace, each rank in its own process."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=run_rank, args=(rank, str(tmp_path / "rendezvous"), tree, results))
                 for rank in range(RANKS)]
    for process in processes:
        process.start()
    try:
        traces = dict(results.get(timeout=300) for _ in processes)
    finally:
        for process in processes:
            process.join(timeout=60)
    assert [process.exitcode for process in processes] == [0] * RANKS
    return [traces[rank] for rank in range(RANKS)]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_ranks_on_different_clocks_draft_what_the_first_rank_drafts(tree, tmp_path):
    alone = [drafting_run(tree, rank, None) for rank in range(RANKS)]
    assert alone[0].drafts != alone[1].drafts  # the clocks matter: the control
    assert alone[0].budget["chosen_nodes"] > 0 and alone[0].budget["accepted_nodes"] > 0
    if tree:
        assert any(len(set(parents)) < len(parents) for step in alone[0].trees for _, parents in step.values())
    shared = ranks_sharing_the_first_clock(tree, tmp_path)
    for trace in shared:
        assert trace == alone[0]  # drafts, trees, budget counters and learned step cost


def test_one_rank_shares_no_clock():
    budget = GoodputBudget.for_engine(0.05, "cpu", tensor_parallel_size=1)
    assert tensor_parallel_clock(1) is None and budget.clock is None and budget.cost.clock is None


# --- Servers ----------------------------------------------------------------------------------

CHAT_PROMPTS = 12
CHAT_MAX_TOKENS = 32
CONCURRENCY = 4
# SmolLM2-135M has 9 attention heads and 3 KV heads: 3 ranks divide them, 2 do not.
TENSOR_PARALLEL = 3
# vLLM binds each CPU worker to a NUMA node of its own (this machine has one): let the workers
# share the cores, one OpenMP thread each.
TENSOR_PARALLEL_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
REST = "vllm_retrieval_spec.RestProposer"


def chat_token_ids(server: VllmServer, messages: Sequence[list[dict[str, str]]]) -> list[list[int]]:
    """Greedy chat completions with CONCURRENCY in flight: the output token ids of each."""
    client = openai_client(server.base_url)

    def ask(conversation: list[dict[str, str]]) -> list[int]:
        reply = client.chat.completions.create(model=server.served_model_name, messages=conversation,
                                               max_tokens=CHAT_MAX_TOKENS, temperature=0.0,
                                               extra_body={"return_token_ids": True})
        return list(reply.choices[0].model_extra["token_ids"])

    with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
        return list(pool.map(ask, messages))


def server(model_dir: Path, proposer: str | None = None, k: int = 8, options: dict | None = None,
           extra_args: Sequence[str] = (), env: dict[str, str] | None = None) -> VllmServer:
    spec = {"model": proposer, "num_speculative_tokens": k} if proposer else None
    return VllmServer(model_dir, speculative_config=spec, extra_args=extra_args, env=env,
                      additional_config={"retrieval_spec": options} if options else None)


def assert_same_token_ids(want: list[list[int]], got: list[list[int]]) -> None:
    assert len(got) == len(want)
    for index, (w, g) in enumerate(zip(want, got)):
        assert g == w, f"prompt {index}: token ids differ from no speculation"


@pytest.fixture(scope="module")
def messages() -> list[list[dict[str, str]]]:
    return humaneval_messages(CHAT_PROMPTS)


@pytest.fixture(scope="module")
def reference(model_dir, messages) -> list[list[int]]:
    with server(model_dir) as plain:
        return chat_token_ids(plain, messages)


@pytest.mark.server
@full_scale_only
def test_data_parallel_engines_behind_two_api_servers_are_exact_and_export_our_metrics(
        model_dir, code_store, messages, reference):
    """``--data-parallel-size 2`` (two engine cores, two API servers): exact outputs, and both
    engines' counters on the one ``/metrics``."""
    args = ("--data-parallel-size", "2")
    with server(model_dir, REST, options={"datastore": str(code_store)}, extra_args=args) as dp:
        outputs = chat_token_ids(dp, messages)
        samples = scraped(dp.metrics_text())
        assert DRAFTING_FAILED not in dp.log_text()
    assert_same_token_ids(reference, outputs)
    ours = {"model_name": "smol", "proposer": "RestProposer"}
    engines = {labels["engine"] for name, labels, value in samples
               if name == PREFIX + "draft_tokens_total" and value > 0}
    assert engines == {"0", "1"}
    assert total(samples, "drafting_failures_total", ours) == 0
    assert total(samples, "budget_steps_total", ours) > 0


@pytest.fixture(scope="module")
def tensor_parallel_reference(model_dir, messages) -> list[list[int]]:
    args = ("--tensor-parallel-size", str(TENSOR_PARALLEL))
    with server(model_dir, extra_args=args, env=TENSOR_PARALLEL_ENV) as plain:
        return chat_token_ids(plain, messages[:CHAT_PROMPTS // 2])


def rank_logs(directory: Path) -> list[list[str]]:
    """Each tensor-parallel rank's drafting log (vrs_parallel_proposers), one line per step."""
    return [(directory / f"rank{rank}.jsonl").read_text().splitlines() for rank in range(TENSOR_PARALLEL)]


@pytest.mark.server
@full_scale_only
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_tensor_parallel_ranks_draft_alike_and_stay_exact(model_dir, code_store, messages,
                                                         tensor_parallel_reference, tree, tmp_path):
    """Every rank logs what it drafts (the same RestProposer, recording): the logs are
    identical, and the outputs exact (a rank verifying other trees would change them)."""
    options = {"datastore": str(code_store), "tree": tree}
    args = ("--tensor-parallel-size", str(TENSOR_PARALLEL))
    env = {**TENSOR_PARALLEL_ENV, "PYTHONPATH": TESTS_DIR, DRAFT_LOG_DIR: str(tmp_path)}
    with server(model_dir, "vrs_parallel_proposers.DraftRecordingRestProposer", k=16 if tree else 8,
                options=options, extra_args=args, env=env) as tp:
        outputs = chat_token_ids(tp, messages[:CHAT_PROMPTS // 2])
        samples = scraped(tp.metrics_text())
        assert DRAFTING_FAILED not in tp.log_text()
    assert_same_token_ids(tensor_parallel_reference, outputs)
    first, *others = rank_logs(tmp_path)
    assert first and all(log == first for log in others)
    ours = {"model_name": "smol", "proposer": "DraftRecordingRestProposer"}
    assert total(samples, "draft_tokens_total", ours) > 0
    if tree:
        assert total(samples, "branching_trees_total", ours) > 0


def test_metrics_carry_the_data_parallel_engine_vllm_labels_its_own_with():
    from types import SimpleNamespace

    from vllm_retrieval_spec.integration.metrics import engine_label

    independent = SimpleNamespace(data_parallel_rank=0, data_parallel_index=1)  # a dense model's second engine
    assert engine_label(SimpleNamespace(parallel_config=independent)) == "1"
    assert engine_label(SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_rank=2))) == "2"
