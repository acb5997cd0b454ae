"""End to end in an in-process vLLM engine on the real model: speculation is lossless."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_retrieval_spec.evaluation.engine import EngineSpec, drafter_of, generate, model_runner_of
from vllm_retrieval_spec.evaluation.metrics import summarize
from vllm_retrieval_spec.kernels.skinny_gemm import pays_on_this_cpu

from conftest import (
    BATCH1_PROMPTS,
    CONCURRENT,
    E2E_MAX_TOKENS,
    assert_same_token_ids,
    generate_both_ways,
    running_engine,
)
from scale import at_scale

pytestmark = pytest.mark.engine

K = 4
TREE_NODES = 16
DEEP_K = 32  # the README's recommended num_speculative_tokens
DEEP_PROMPTS = at_scale(ci=6, full=8)


def flush_finished_requests(llm) -> None:
    """One more engine step: the scheduler tells the runner about the requests that finished
    in the last step (a server's engine loop does this by itself)."""
    llm.llm_engine.step()


def speculative(model_dir, proposer: str, options: dict | None = None, k: int = K) -> EngineSpec:
    return EngineSpec(
        model_dir,
        speculative_config={"model": proposer, "num_speculative_tokens": k},
        additional_config={"retrieval_spec": options} if options else None,
        max_num_seqs=CONCURRENT,
    )


def test_prompt_lookup_is_lossless_and_accepts_tokens(model_dir, e2e_prompts, baseline_runs):
    with running_engine(speculative(model_dir, "vllm_retrieval_spec.PromptLookupProposer")) as llm:
        runs = generate_both_ways(llm, e2e_prompts)
        stats = drafter_of(llm).stats
    for mode, run in runs.items():
        assert_same_token_ids(baseline_runs[mode], run)
        assert run.counters.accepted_tokens > 0, mode
        assert run.counters.drafts > 0, mode
        summary = summarize(run.records, run.counters)
        assert summary.honest_tokens_per_step > 1.0, mode
        assert summary.decode_steps < summarize(baseline_runs[mode].records, baseline_runs[mode].counters).decode_steps
    assert stats.failures == 0
    assert stats.draft_tokens >= sum(run.counters.draft_tokens for run in runs.values())


def linear_kinds(llm) -> set[str]:
    """The types of the model's CPU GEMMs (vLLM's oneDNN lambdas, or our SkinnyLinear)."""
    return {type(module.cpu_linear).__name__ for module in model_runner_of(llm).model.modules()
            if hasattr(module, "cpu_linear")}


def norm_kinds(llm) -> set[str]:
    """The types of the model's RMSNorm forwards (vLLM's bound methods, or our FusedRMSNorm)."""
    return {type(module._forward_method).__name__ for module in model_runner_of(llm).model.modules()
            if type(module).__name__ == "RMSNorm"}


def decoder_layer_kinds(llm) -> set[str]:
    """The types of the model's Llama decoder layers' forwards (vLLM's bound methods, or our LeanLlamaLayer)."""
    return {type(module.forward).__name__ for module in model_runner_of(llm).model.modules()
            if type(module).__name__ == "LlamaDecoderLayer"}


def test_rest_is_lossless_and_accepts_tokens(model_dir, code_store, e2e_prompts, baseline_runs):
    """With the default options, so every layer of the float32 model runs the skinny GEMM on
    steps of up to cpu_gemm_max_rows rows (x86 with AVX2), greedy steps run the screened head and
    every decoder layer runs as one function (cpu_lean_layers)."""
    import vllm.model_executor.layers.utils as layer_utils

    vllm_dispatch = layer_utils.dispatch_cpu_unquantized_gemm
    options = {"datastore": str(code_store)}
    with running_engine(speculative(model_dir, "vllm_retrieval_spec.RestProposer", options)) as llm:
        if pays_on_this_cpu():
            assert linear_kinds(llm) == {"SkinnyLinear", "ScreenedHead"}
            assert decoder_layer_kinds(llm) == {"LeanLlamaLayer"}
        assert layer_utils.dispatch_cpu_unquantized_gemm is vllm_dispatch  # other engines keep vLLM's
        runs = generate_both_ways(llm, e2e_prompts)
        drafter = drafter_of(llm)
        head = model_runner_of(llm).vrs_screened_head
    if pays_on_this_cpu():
        assert head.screened_calls > 0
    for mode, run in runs.items():
        assert_same_token_ids(baseline_runs[mode], run)
        assert run.counters.accepted_tokens > 0, mode
    assert drafter.stats.failures == 0
    assert drafter.datastore is not None and drafter.last_drafts is not None
    budget, output_index = drafter.session.budget, drafter.session.output_index
    assert budget.stats.chosen_nodes > 0 and budget.stats.observed_nodes > 0  # budget "auto" by default
    assert budget.stats.chosen_nodes < budget.stats.candidate_nodes
    assert output_index.stats.sequences_added > 0 and output_index.stats.builds > 0


def test_requests_that_turn_speculation_off_are_served_exactly_without_drafts(model_dir, code_store, e2e_prompts,
                                                                              baseline_runs):
    """``extra_args`` (the API's ``vllm_xargs``) ``{"retrieval_spec_speculate": "off"}`` on every
    other request: those take one token a step beside requests that speculate, all exact."""
    from vllm_retrieval_spec.options import SPECULATE_ARG

    switches = [{SPECULATE_ARG: "off"} if index % 2 else None for index in range(len(e2e_prompts))]
    options = {"datastore": str(code_store)}
    with running_engine(speculative(model_dir, "vllm_retrieval_spec.RestProposer", options)) as llm:
        mixed = generate(llm, e2e_prompts, E2E_MAX_TOKENS, concurrency=CONCURRENT, extra_args=switches)
        all_off = generate(llm, e2e_prompts[:BATCH1_PROMPTS], E2E_MAX_TOKENS, concurrency=1,
                           extra_args=[{SPECULATE_ARG: 0}] * BATCH1_PROMPTS)
        flush_finished_requests(llm)
        drafter = drafter_of(llm)
    assert_same_token_ids(baseline_runs["concurrent"], mixed)
    assert_same_token_ids(baseline_runs["batch1"], all_off)
    off = [record for record, switch in zip(mixed.records, switches) if switch] + all_off.records
    assert all(record.decode_steps == len(record.output_ids) - 1 for record in off)
    speculating = [record for record, switch in zip(mixed.records, switches) if not switch]
    assert sum(record.decode_steps for record in speculating) < sum(len(r.output_ids) - 1 for r in speculating)
    assert all_off.counters.draft_tokens == 0 and mixed.counters.accepted_tokens > 0
    assert drafter.stats.failures == 0 and not drafter.session.unspeculated  # forgotten as they finished


def test_ngrammys_is_lossless_and_accepts_tokens(model_dir, ngram_table_dir, e2e_prompts, baseline_runs):
    """With a fixed budget: at batch 1 on these prompts the goodput budget rightly verifies almost
    none of N-Grammys' drafts (~1.4 ms a draft token on this CPU for a ~15% chance), and this
    test is about verifying them."""
    options = {"ngram_table": str(ngram_table_dir), "budget": "fixed"}
    with running_engine(speculative(model_dir, "vllm_retrieval_spec.NGrammysProposer", options)) as llm:
        runs = generate_both_ways(llm, e2e_prompts)
        drafter = drafter_of(llm)
    for mode, run in runs.items():
        assert_same_token_ids(baseline_runs[mode], run)
        assert run.counters.accepted_tokens > 0, mode
    assert drafter.stats.failures == 0


def record_screened_tree_steps(llm) -> list[bool]:
    """A list that gets, at each call of the engine's screened head on a tree step whose rows the
    screen takes (up to 256 with the bfloat16 dot product, 4 on 8-lane blocks), whether the call
    was screened (empty where the engine has no screened head)."""
    runner, calls = model_runner_of(llm), []
    head = runner.vrs_screened_head
    if head is None:
        return calls
    layer = next(module for module in runner.model.modules() if getattr(module, "cpu_linear", None) is head)
    session = drafter_of(llm).session

    def recording(x, weight, bias):
        before = head.screened_calls
        out = head(x, weight, bias)
        if session.plan is not None and x.shape[0] <= head.screen_rows:
            calls.append(head.screened_calls > before)
        return out

    layer.cpu_linear = recording
    return calls


@pytest.mark.parametrize("proposer", ["RestProposer", "NGrammysProposer"])
def test_tree_verification_is_lossless(proposer, model_dir, code_store, ngram_table_dir, e2e_prompts, baseline_runs):
    """Branching draft trees verified in one step (tree mask, depth positions, KV compaction)
    give exactly the greedy token ids of no speculation, at batch 1 and 8 in flight (with a
    fixed budget: on this CPU the goodput budget rarely lets a tree branch)."""
    source = {"datastore": str(code_store)} if proposer == "RestProposer" else {"ngram_table": str(ngram_table_dir)}
    options = {**source, "tree": True, "budget": "fixed"}
    spec = speculative(model_dir, f"vllm_retrieval_spec.{proposer}", options, k=TREE_NODES)
    with running_engine(spec) as llm:
        screened_tree_steps = record_screened_tree_steps(llm)
        runs = generate_both_ways(llm, e2e_prompts)
        flush_finished_requests(llm)
        drafter = drafter_of(llm)
    for mode, run in runs.items():
        assert_same_token_ids(baseline_runs[mode], run)
        assert run.counters.accepted_tokens > 0, mode
    assert drafter.stats.failures == 0
    if pays_on_this_cpu() and screened_tree_steps:
        assert any(screened_tree_steps), "no tree step the screen could take took the screened head"
    stats = drafter.session.stats
    assert stats.tree_steps > 0, "no step verified a branching tree"
    assert drafter.session.step_attention.tree_layer_calls > 0, "the tree rows were left to the fix-up"
    assert stats.compacted_slots > 0, "no accepted path needed KV compaction"
    assert drafter.session.requests == {}, "finished requests left state behind"


def test_engines_in_one_process_each_own_their_session(model_dir, code_store, e2e_prompts, baseline_runs):
    """Tree mode (fixed budget), then chain mode, then tree mode again (both with the goodput
    budget) in one process: every engine stays exact and counts (and checks its KV layout) in
    its own session, and no finished request leaves state behind."""
    prompts, expected = e2e_prompts[:6], baseline_runs["concurrent"]
    sessions = []
    for tree, budget, step_attention in ((True, "fixed", True), (False, "auto", True), (True, "auto", False)):
        # the chain engine on vLLM's GEMM throughout, the tree engines on the skinny one; the first two
        # compute their steps' attention with the plugin's kernel (cpu_step_attention) and their norms with
        # vLLM's fused kernels (cpu_fused_norms), the last both with vLLM's own
        options = {"datastore": str(code_store), "tree": tree, "budget": budget, "cpu_step_attention": step_attention,
                   "cpu_fused_norms": step_attention, **({} if tree else {"cpu_gemm_max_rows": 0})}
        with running_engine(speculative(model_dir, "vllm_retrieval_spec.RestProposer", options, k=TREE_NODES)) as llm:
            run = generate(llm, prompts, E2E_MAX_TOKENS, concurrency=CONCURRENT)
            flush_finished_requests(llm)
            sessions.append(drafter_of(llm).session)
            assert ("SkinnyLinear" in linear_kinds(llm)) == (tree and pays_on_this_cpu())
            kernel = drafter_of(llm).session.step_attention
            assert (kernel is not None and kernel.enabled and kernel.layer_calls > 0) == step_attention
            if step_attention and not tree:  # chain steps: the whole eager layer in one kernel call
                assert kernel.whole_layer_calls > 0
            assert norm_kinds(llm) == ({"FusedRMSNorm"} if step_attention else {"method"})
            lean = tree and step_attention and pays_on_this_cpu()  # needs the skinny GEMM and the fused norms
            assert decoder_layer_kinds(llm) == ({"LeanLlamaLayer"} if lean else {"method"})
        assert [r.output_ids for r in run.records] == [r.output_ids for r in expected.records[:6]], f"tree={tree}"
    first, chain, last = sessions
    assert first is not last and first.tree_mode and last.tree_mode and not chain.tree_mode
    assert first.layout_checked and not chain.layout_checked
    assert first.stats.tree_steps > 0 and chain.stats.tree_steps == 0
    assert first.budget is None and chain.budget is not last.budget
    assert chain.budget.stats.chosen_nodes > 0 and last.budget.stats.steps > 0
    assert all(session.requests == {} for session in sessions)


def test_tree_verification_samples_at_temperature(model_dir, code_store, e2e_prompts):
    from vllm.exceptions import VLLMValidationError

    options = {"datastore": str(code_store), "tree": True, "budget": "fixed"}
    with running_engine(speculative(model_dir, "vllm_retrieval_spec.RestProposer", options, k=TREE_NODES)) as llm:
        run = generate(llm, e2e_prompts[:8], E2E_MAX_TOKENS, concurrency=CONCURRENT, temperature=0.8, seed=7,
                       ignore_eos=True)
        with pytest.raises(VLLMValidationError, match=r"presence_penalty cannot be used .*\(retrieval_spec\.tree\)"):
            generate(llm, e2e_prompts[:1], 8, presence_penalty=0.5)
    assert run.counters.accepted_tokens > 0
    assert all(len(record.output_ids) == E2E_MAX_TOKENS for record in run.records)


def test_tree_steps_serve_sequence_features_of_requests_that_turned_speculation_off(model_dir, code_store,
                                                                                   e2e_prompts):
    """Tree mode admits penalties, bad words and allowed token ids in requests that turned
    speculation off; in steps where the others' trees branch they get what vLLM gives them alone."""
    from vllm import SamplingParams

    from vllm_retrieval_spec.options import SPECULATE_ARG

    features = [{"bad_words": ["return", " if"]}, {"repetition_penalty": 1.3}, {"frequency_penalty": 0.8},
                {"allowed_token_ids": list(range(20, 2000))}]
    prompts = e2e_prompts[:2 * len(features)]
    plain = SamplingParams(temperature=0.0, max_tokens=E2E_MAX_TOKENS)
    featured = [SamplingParams(temperature=0.0, max_tokens=E2E_MAX_TOKENS, extra_args={SPECULATE_ARG: "off"},
                               **extra) for extra in features]
    params = [plain if index % 2 else featured[index // 2] for index in range(len(prompts))]

    def outputs(llm, request_params) -> list:
        return [out.outputs[0] for out in llm.generate(prompts, request_params, use_tqdm=False)]

    def token_ids(llm, request_params) -> list[list[int]]:
        return [list(output.token_ids) for output in outputs(llm, request_params)]

    with running_engine(EngineSpec(model_dir, max_num_seqs=CONCURRENT)) as llm:
        expected, greedy = token_ids(llm, params), token_ids(llm, [plain] * len(prompts))
    options = {"datastore": str(code_store), "tree": True, "budget": "fixed"}
    spec = dataclasses.replace(speculative(model_dir, "vllm_retrieval_spec.RestProposer", options, k=TREE_NODES),
                               per_request_spec_decode_metrics="summary")
    with running_engine(spec) as llm:
        served = outputs(llm, params)
        drafter = drafter_of(llm)
    assert [list(output.token_ids) for output in served] == expected
    assert all(expected[i] != greedy[i] for i in range(0, len(prompts), 2))  # each feature changed its output
    assert drafter.session.stats.tree_steps > 0 and drafter.stats.unspeculated_rows > 0
    drafted = [output.spec_decode_metrics.num_draft_tokens for output in served]  # vLLM's per-request metrics
    assert drafted[0::2] == [0] * len(features) and all(drafted[1::2])


def test_failing_proposer_keeps_the_engine_alive_and_exact(model_dir, e2e_prompts, baseline_runs):
    spec = speculative(model_dir, "vrs_test_proposers.FailingEveryThirdStepProposer")
    with running_engine(spec) as llm:
        runs = generate_both_ways(llm, e2e_prompts)
        stats = drafter_of(llm).stats
    for mode, run in runs.items():
        assert_same_token_ids(baseline_runs[mode], run)
        assert run.counters.accepted_tokens > 0
    assert stats.failures > 0


def test_no_speculation_baseline_takes_one_token_per_step(baseline_runs):
    for run in baseline_runs.values():
        summary = summarize(run.records, run.counters)
        assert summary.honest_tokens_per_step == 1.0
        assert summary.drafts == 0


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_deep_drafts_are_lossless(mode, model_dir, code_store, e2e_prompts, baseline_runs):
    """REST at num_speculative_tokens 32 (continuations as long): chains with the goodput budget
    (the kernel ranks candidates by its calibrated chances) and 32-node trees with a fixed budget
    give exactly the greedy token ids of no speculation at batch 1 and 8 in flight."""
    options = {"datastore": str(code_store), **({"tree": True, "budget": "fixed"} if mode == "tree" else {})}
    prompts = {"batch1": e2e_prompts[:min(BATCH1_PROMPTS, DEEP_PROMPTS)], "concurrent": e2e_prompts[:DEEP_PROMPTS]}
    with running_engine(speculative(model_dir, "vllm_retrieval_spec.RestProposer", options, k=DEEP_K)) as llm:
        runs = {"batch1": generate(llm, prompts["batch1"], E2E_MAX_TOKENS, concurrency=1),
                "concurrent": generate(llm, prompts["concurrent"], E2E_MAX_TOKENS, concurrency=CONCURRENT)}
        drafter = drafter_of(llm)
    for name, run in runs.items():
        expected = baseline_runs[name]
        assert_same_token_ids(dataclasses.replace(expected, records=expected.records[:len(prompts[name])]), run)
        assert run.counters.accepted_tokens > 0, name
    assert drafter.stats.failures == 0
    assert drafter.params.continuation_len == DEEP_K
    if mode == "chain":
        assert drafter.session.budget.stats.chosen_nodes > 0


@pytest.mark.skipif(not pays_on_this_cpu(), reason="the skinny GEMM (and so the screened head) runs on x86 with AVX2")
def test_the_screened_head_serves_only_steps_that_take_an_argmax(model_dir, code_store, e2e_prompts):
    """Greedy steps run on the screened head; steps of requests asking for logprobs, or sampling,
    and prefills asking for prompt logprobs get the full head's logits: the same tokens and
    logprobs as an engine without it."""
    from vllm import SamplingParams

    prompts = e2e_prompts[:2]
    asks = {"logprobs": SamplingParams(temperature=0.0, max_tokens=8, logprobs=3),
            "sampling": SamplingParams(temperature=0.8, seed=7, max_tokens=8, logprobs=1),
            "prompt logprobs": SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=2),
            "greedy": SamplingParams(temperature=0.0, max_tokens=8)}

    def served(options: dict) -> tuple[dict, dict]:
        spec = speculative(model_dir, "vllm_retrieval_spec.RestProposer", {"datastore": str(code_store), **options})
        outputs, screened = {}, {}
        with running_engine(spec) as llm:
            head = model_runner_of(llm).vrs_screened_head
            for name, params in asks.items():
                before = 0 if head is None else head.screened_calls
                outputs[name] = llm.generate(prompts, params, use_tqdm=False)
                screened[name] = (0 if head is None else head.screened_calls) - before
        return outputs, screened

    with_screen, screened = served({})
    without, _ = served({"cpu_screened_head": False})
    assert screened["logprobs"] == screened["sampling"] == 0 < screened["greedy"]
    for name in asks:
        for got, want in zip(with_screen[name], without[name]):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids, name
            assert got.outputs[0].logprobs == want.outputs[0].logprobs, name
            assert got.prompt_logprobs == want.prompt_logprobs, name
