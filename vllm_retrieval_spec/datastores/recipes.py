"""Datastore recipes: JSON files in the repository's ``datastores/`` directory (installed into
the package as ``recipes/``) that name the inputs of a store built from offline sources."""

from __future__ import annotations

import json
import shutil
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_retrieval_spec.datastores.format import DatastoreError, TokenizerIdentity
from vllm_retrieval_spec.datastores.sources import InputSpec
from vllm_retrieval_spec.paths import cache_root

_PACKAGE_RECIPES = Path(__file__).resolve().parent.parent / "recipes"
_SOURCE_RECIPES = Path(__file__).resolve().parents[2] / "datastores"


@dataclass(frozen=True)
class Recipe:
    """A named list of inputs with placeholders resolved on the building machine."""

    name: str
    description: str
    inputs: list[dict[str, Any]]

    def input_specs(self) -> list[InputSpec]:
        return [self._resolve(raw) for raw in self.inputs]

    def _resolve(self, raw: dict[str, Any]) -> InputSpec:
        filters = {
            "include": tuple(raw.get("include", ("*",))),
            "exclude": tuple(raw.get("exclude", ())),
            "text_field": raw.get("text_field", "text"),
        }
        if "debian_package" in raw:
            root = unpack_debian_package(raw["debian_package"])
            return InputSpec(root / raw["path"], **filters)
        path = raw["path"].format(
            stdlib=sysconfig.get_paths()["stdlib"], purelib=sysconfig.get_paths()["purelib"]
        )
        return InputSpec(Path(path), **filters)


def recipe_directories() -> list[Path]:
    return [d for d in (_PACKAGE_RECIPES, _SOURCE_RECIPES) if d.is_dir()]


def available_recipes() -> list[str]:
    return sorted({p.stem for d in recipe_directories() for p in d.glob("*.json")})


def load_recipe(name: str) -> Recipe:
    for directory in recipe_directories():
        path = directory / f"{name}.json"
        if path.is_file():
            raw = json.loads(path.read_text())
            return Recipe(raw["name"], raw.get("description", ""), raw["inputs"])
    raise DatastoreError(f"no datastore recipe {name!r}; available: {', '.join(available_recipes()) or 'none'}")


def recipe_store_dir(name: str, tokenizer: TokenizerIdentity) -> Path:
    """Where the recipe's store for this tokenizer lives in the cache."""
    return cache_root() / "datastores" / f"{name}-{tokenizer.vocab_sha256[:12]}"


def unpack_debian_package(package: str) -> Path:
    """``apt-get download`` + ``dpkg-deb -x`` into the cache (no root install); cached."""
    target = cache_root() / "debian" / package
    if target.is_dir():
        return target
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise DatastoreError(f"recipe input {package!r} needs {tool} (a Debian-based machine)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as download_dir:
        download = subprocess.run(["apt-get", "download", package], cwd=download_dir,
                                  capture_output=True, text=True)
        if download.returncode != 0:
            raise DatastoreError(
                f"apt-get download {package} failed ({download.stderr.strip()}); "
                "run `apt-get update` once and retry"
            )
        (deb,) = Path(download_dir).glob("*.deb")
        staging = Path(tempfile.mkdtemp(prefix=f".{package}-", dir=target.parent))
        subprocess.run(["dpkg-deb", "-x", str(deb), str(staging)], check=True)
        staging.rename(target)
    return target
