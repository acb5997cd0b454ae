"""Snapshots of the dense index learned from served traffic (option ``dense_learned_path``), so
that a restarted server starts with what the one it replaced learned.

``PATH`` holds numbered snapshots ``snapshot-NNNNNNNN/`` built and replaced as the output index's
are (:func:`~vllm_retrieval_spec.datastores.output_snapshot.next_snapshot`: a save killed at any
point leaves the previous one whole). Each is a complete dense datastore with an exact (flat)
index, in the key space of the serving dense store whose transform it copies: it can also be
served as a ``dense_datastore`` of its own (DReSD's in-distribution store, built from real
traffic without a forward pass). A load opens the newest with every check of a dense datastore
(manifest, shapes, token ids, checksums, the model) and refuses one whose transform is not the
serving store's; a refused snapshot is logged, serving goes on without it, and the next save
replaces it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from vllm_retrieval_spec.datastores.dense import DenseDatastore
from vllm_retrieval_spec.datastores.dense_builder import (
    KEYS_SCRATCH,
    DenseBuildOptions,
    finish_dense_store,
    write_index,
)
from vllm_retrieval_spec.datastores.dense_format import DENSE_DATASTORE, INDEX, VALUES, DenseManifest, IndexSpec
from vllm_retrieval_spec.datastores.learned_dense import LearnedDenseIndex
from vllm_retrieval_spec.datastores.output_snapshot import PeriodicSaves, next_snapshot, snapshot_dirs
from vllm_retrieval_spec.storage import atomic_directory

logger = logging.getLogger(__name__)


def save_learned(index: LearnedDenseIndex, path: Path, store: DenseDatastore) -> Path | None:
    """Save what ``index`` keeps as the next snapshot under ``path`` (None when it keeps nothing)."""
    import faiss

    keys, values = index.contents()
    if not len(values):
        return None
    with next_snapshot(path, DENSE_DATASTORE) as building:
        values.tofile(building / VALUES)
        flat = faiss.IndexFlatIP(index.dim)
        flat.add(keys)
        faiss.write_index(flat, str(building / INDEX))
        finish_dense_store(building, store.transform, IndexSpec("flat"), len(values), index.value_tokens,
                           store.manifest.model, {"learned_from": str(store.path)},
                           {"source": "served traffic", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return snapshot_dirs(path)[-1]


def load_learned(index: LearnedDenseIndex, path: Path, store: DenseDatastore) -> int:
    """Restore the newest snapshot under ``path`` into ``index``; the positions restored (0 when
    there is none). ``DenseDatastoreError`` naming the snapshot when it is corrupt, of another
    model, or in another key space than ``store``'s."""
    saved = snapshot_dirs(path)
    if not saved:
        return 0
    snapshot = DenseDatastore.open(saved[-1], store.manifest.model)
    snapshot.check_fully()
    if snapshot.manifest.index.type != "flat" or snapshot.value_tokens != index.value_tokens:
        raise DENSE_DATASTORE.fail(f"{saved[-1]} is no learned index snapshot of {index.value_tokens}-token values "
                                   f"(a flat index); delete it or point dense_learned_path elsewhere")
    ours, theirs = store.transform, snapshot.transform
    if not all(np.array_equal(a, b) for a, b in ((ours.mean, theirs.mean), (ours.std, theirs.std),
                                                  (ours.components, theirs.components))):
        raise DENSE_DATASTORE.fail(f"{saved[-1]} was learned in the key space of another dense datastore than "
                                   f"{store.path}; serve that one, or point dense_learned_path elsewhere")
    index.restore(snapshot.index.reconstruct_n(0, snapshot.num_positions), np.asarray(snapshot.values))
    return snapshot.num_positions


def snapshot_positions(path: Path) -> int:
    """The positions of the newest snapshot under ``path`` (0 when there is none)."""
    saved = snapshot_dirs(path)
    return DenseDatastore.open(saved[-1]).num_positions if saved else 0


def build_from_snapshot(path: Path, out_dir: Path, *, replace: bool = False,
                        extra_build_info: dict[str, Any] | None = None) -> DenseManifest:
    """A dense datastore at ``out_dir`` of every position of the newest snapshot under ``path``
    (keys captured while serving, no forward pass), indexed as ``datastore build-dense`` indexes
    its keys (an inverted-list index past ``FLAT_MAX_POSITIONS``); its manifest."""
    saved = snapshot_dirs(path)
    if not saved:
        raise DENSE_DATASTORE.fail(f"{path} holds no captured states (no snapshot-NNNNNNNN directory): answers "
                                   "collected elsewhere were not captured; build the dense store with a forward "
                                   "pass instead (datastore from-server --url, or datastore build-dense)")
    snapshot = DenseDatastore.open(saved[-1])
    snapshot.check_fully()
    options = DenseBuildOptions(value_tokens=snapshot.value_tokens, dim=snapshot.manifest.dim)
    with atomic_directory(out_dir, replace=replace, kind=DENSE_DATASTORE) as tmp:
        np.asarray(snapshot.values).tofile(tmp / VALUES)
        snapshot.index.reconstruct_n(0, snapshot.num_positions).tofile(tmp / KEYS_SCRATCH)
        spec = write_index(tmp, snapshot.num_positions, options)
        return finish_dense_store(tmp, snapshot.transform, spec, snapshot.num_positions, snapshot.value_tokens,
                                  snapshot.manifest.model, snapshot.manifest.transform,
                                  {**snapshot.manifest.build, "captured_states": str(saved[-1]),
                                   "options": asdict(options), **(extra_build_info or {})})


class LearnedDenseSnapshots(PeriodicSaves):
    """A learned dense index kept on disk: :meth:`start` restores its snapshot (a refused one
    is logged and the index starts empty) and, when ``writes``, saves it every
    ``interval_seconds`` when positions were learned since the last save, and at close."""

    noun = "learned dense index"

    def __init__(self, index: LearnedDenseIndex, path: Path, store: DenseDatastore, interval_seconds: float,
                 *, writes: bool = True) -> None:
        super().__init__(path, interval_seconds, writes)
        self.index = index
        self.store = store

    def start(self) -> int:
        """Restore the snapshot and start saving; the positions restored."""
        try:
            restored = load_learned(self.index, self.path, self.store)
        except Exception as error:
            logger.error("vllm_retrieval_spec: the learned dense index saved under %s was refused (%s); serving "
                         "goes on without it and the next save replaces it", self.path, error)
            restored = 0
        if restored:
            logger.info("vllm_retrieval_spec: learned dense index restored from %s (%d positions)", self.path,
                        restored)
        self._saved_changes = self.changes()
        self.start_saving()
        return restored

    def changes(self) -> int:
        return self.index.additions

    def save(self) -> None:
        save_learned(self.index, self.path, self.store)
