"""The on-disk format of a dense (DReSD) datastore (format version 1).

A dense datastore directory holds:

- ``values.bin``: raw ``int32`` ``[positions, value_tokens]``: the next ``value_tokens`` token
  ids after each kept position (its first id is the token the position's hidden state predicts);
- ``mean.bin``, ``std.bin``: raw ``float32`` ``[hidden_size]``: the z-normalisation
  (``std`` is ``sqrt(var + epsilon)``);
- ``components.bin``: raw ``float32`` ``[hidden_size, dim]``: the PCA directions of the
  z-normalised states, largest variance first;
- ``index.faiss``: the FAISS inner-product index over the keys
  ``L2norm(((h - mean) / std) @ components)``, in row order of ``values.bin``. The keys are
  stored only there (exactly in a flat or IVF-Flat index, as PQ codes in IVF-PQ);
- ``manifest.json``: format version, shapes, dtypes, the index parameters, the model's
  identity (config and tokenizer hashes), bytes per position, file sizes and sha256s and the
  build parameters.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_retrieval_spec.datastores.format import DatastoreError
from vllm_retrieval_spec.paths import cache_root
from vllm_retrieval_spec.storage import (
    MAX_VOCAB_SIZE,
    ArtifactKind,
    ModelIdentity,
    check_manifest_ints,
    manifest_record,
    read_manifest,
    write_manifest,
)

DENSE_FORMAT_VERSION = 1
VALUES = "values.bin"
MEAN = "mean.bin"
STD = "std.bin"
COMPONENTS = "components.bin"
INDEX = "index.faiss"
_INDEX_PARAMETERS = {  # index type -> (the parameters it needs, those it may also record)
    "flat": ((), ()),
    "ivf_flat": (("nlist", "nprobe"), ("train_size",)),
    "ivf_pq": (("nlist", "nprobe", "pq_m", "pq_bits"), ("train_size",)),
}
INDEX_TYPES = tuple(_INDEX_PARAMETERS)
INDEX_METRIC = "inner_product"
MAX_PQ_BITS = 16
BUILD_DENSE = "`vllm-retrieval-spec datastore build-dense --model MODEL_DIR --input ... --out DIR`"


class DenseDatastoreError(DatastoreError):
    """A dense datastore is missing, corrupt, truncated, or belongs to another model."""


DENSE_DATASTORE = ArtifactKind(
    noun="dense datastore",
    article="a",
    format_version=DENSE_FORMAT_VERSION,
    error=DenseDatastoreError,
    build_command=BUILD_DENSE,
    required={"num_positions": int, "value_tokens": int, "hidden_size": int, "dim": int, "model": dict,
              "index": dict, "transform": dict, "bytes_per_position": (int, float), "files": dict,
              "build": dict},
    dtypes={"value_dtype": ("int32",), "transform_dtype": ("float32",)},
    data_files=(VALUES, MEAN, STD, COMPONENTS, INDEX),
)


@dataclass(frozen=True)
class IndexSpec:
    """The FAISS index of a store: ``type`` one of :data:`INDEX_TYPES`; ``nlist``/``nprobe``
    (IVF), ``pq_m``/``pq_bits`` (IVF-PQ) and the number of keys trained on, else None."""

    type: str
    metric: str = INDEX_METRIC
    nlist: int | None = None
    nprobe: int | None = None
    pq_m: int | None = None
    pq_bits: int | None = None
    train_size: int | None = None

    def describe(self) -> str:
        parts = [self.type]
        if self.nlist is not None:
            parts.append(f"nlist {self.nlist}, nprobe {self.nprobe}")
        if self.pq_m is not None:
            parts.append(f"PQ {self.pq_m}x{self.pq_bits} bits")
        return ", ".join(parts)

    def parameters(self) -> dict[str, int | None]:
        """The numeric parameters, by name."""
        return {"nlist": self.nlist, "nprobe": self.nprobe, "pq_m": self.pq_m, "pq_bits": self.pq_bits,
                "train_size": self.train_size}

    def problem(self) -> str | None:
        """Why this spec describes no index we read (None: it does): an unknown type or metric, or
        a parameter its type needs and lacks, or does not take."""
        if self.type not in INDEX_TYPES:
            return f"index type {self.type!r} is not one of {', '.join(INDEX_TYPES)}"
        if self.metric != INDEX_METRIC:
            return f"index metric {self.metric!r} is not {INDEX_METRIC!r}"
        needs, may = _INDEX_PARAMETERS[self.type]
        for name, value in self.parameters().items():
            if value is None and name in needs:
                return f"index type {self.type!r} needs 'index.{name}'"
            if value is not None and name not in (*needs, *may):
                return f"index type {self.type!r} takes no 'index.{name}', which is {value!r}"
        return None

    def bounds(self, dim: int) -> dict[str, tuple[int | None, int, int | None]]:
        """The ranges of the parameters this spec sets."""
        limits = {"nlist": (1, None), "nprobe": (1, self.nlist), "pq_m": (1, dim), "pq_bits": (1, MAX_PQ_BITS),
                  "train_size": (1, None)}
        return {f"index.{name}": (value, *limits[name]) for name, value in self.parameters().items()
                if value is not None}


@dataclass(frozen=True)
class DenseManifest:
    """The parsed ``manifest.json`` of a dense datastore."""

    format_version: int
    num_positions: int
    value_tokens: int
    hidden_size: int
    dim: int
    value_dtype: str
    transform_dtype: str
    model: ModelIdentity
    index: IndexSpec
    transform: dict[str, Any]
    bytes_per_position: float
    files: dict[str, dict[str, Any]]
    build: dict[str, Any]

    def write(self, directory: Path) -> None:
        write_manifest(directory, asdict(self))

    @classmethod
    def read(cls, directory: Path) -> DenseManifest:
        """The validated manifest of the dense datastore in ``directory``."""
        raw = read_manifest(directory, DENSE_DATASTORE)
        model = manifest_record(directory, ModelIdentity, raw["model"], DENSE_DATASTORE, "model")
        index = manifest_record(directory, IndexSpec, raw["index"], DENSE_DATASTORE, "index")
        manifest = manifest_record(directory, cls, raw | {"model": model, "index": index}, DENSE_DATASTORE)
        manifest.check(Path(directory))
        return manifest

    def check(self, directory: Path) -> None:
        """Values the reader relies on: positive sizes, dim <= hidden size, a vocabulary, and an
        index spec that fits its type."""
        check_manifest_ints(directory, DENSE_DATASTORE, {
            "num_positions": (self.num_positions, 1, None),
            "value_tokens": (self.value_tokens, 1, None),
            "hidden_size": (self.hidden_size, 1, None),
            "dim": (self.dim, 1, self.hidden_size),
            "model.vocab_size": (self.model.vocab_size, 1, MAX_VOCAB_SIZE),
        })
        problem = self.index.problem()
        if problem is not None:
            raise DENSE_DATASTORE.corrupt(directory, problem)
        check_manifest_ints(directory, DENSE_DATASTORE, self.index.bounds(self.dim))


def is_dense_datastore(directory: str | Path) -> bool:
    """Whether ``directory``'s manifest is a dense (DReSD) store's (it has a hidden size)."""
    try:
        raw = json.loads((Path(directory) / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and "hidden_size" in raw


def dense_recipe_store_dir(name: str, model: ModelIdentity) -> Path:
    """Where a recipe's dense store for this model (config and tokenizer) lives in the cache."""
    return cache_root() / "dense-datastores" / f"{name}-{model.config_sha256[:8]}-{model.vocab_sha256[:8]}"
