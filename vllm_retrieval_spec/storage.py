"""On-disk artifacts (checkpoints, datastores, n-gram tables): atomic directory builds, and
the one reader of a directory's ``manifest.json`` and of its memory-mapped binary files."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

MANIFEST = "manifest.json"
T = TypeVar("T")
# ``.NAME.tmp-PID@HOST-XXXXXXXX`` (a build in progress) or ``.NAME.old-...`` (a replaced
# directory being deleted): what a killed build leaves next to its target.
_BUILD_DIR = re.compile(r"\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)@(?P<host>.+)-[a-z0-9_]{8}")

logger = logging.getLogger(__name__)


class StorageError(RuntimeError):
    """An on-disk artifact is missing, corrupt, truncated or of another format version."""


@dataclass(frozen=True)
class ArtifactKind:
    """One kind of artifact directory: its name in messages ("a datastore"), format version
    and error type, and how to build one.

    ``required`` maps each manifest key to the JSON type its value must have; ``dtypes`` maps
    each manifest key that names a numpy dtype to the dtype names this package reads.
    """

    noun: str
    article: str
    format_version: int
    error: type[StorageError]
    build_command: str
    required: Mapping[str, type | tuple[type, ...]] = field(default_factory=dict)
    dtypes: Mapping[str, Sequence[str]] = field(default_factory=dict)

    def fail(self, problem: str) -> StorageError:
        """The error to raise for ``problem`` (which names the file), with the fix appended."""
        return self.error(f"{problem}; rebuild the {self.noun}")


def write_manifest(directory: Path, manifest: Mapping[str, Any]) -> None:
    """Write ``manifest.json`` (indented, one trailing newline)."""
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def read_manifest(directory: Path, kind: ArtifactKind) -> dict[str, Any]:
    """Parse and validate ``directory/manifest.json``: a JSON object of ``kind``'s format
    version whose required keys have their types and whose dtype keys name readable dtypes."""
    path = Path(directory) / MANIFEST
    if not Path(directory).exists():
        raise kind.error(f"{directory} does not exist; build {kind.article} {kind.noun} there with "
                         f"{kind.build_command}")
    if not path.is_file():
        raise kind.error(f"{path} not found: {directory} is not {kind.article} {kind.noun}; "
                         f"build one with {kind.build_command}")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as error:
        raise kind.fail(f"{path} is corrupt ({error})") from error
    if not isinstance(manifest, dict):
        raise kind.fail(f"{path} is corrupt (not a JSON object)")
    if manifest.get("format_version") != kind.format_version:
        raise kind.fail(f"{path} has format version {manifest.get('format_version')!r}, "
                        f"this package reads version {kind.format_version}")
    _check_keys(path, manifest, kind)
    return manifest


def _check_keys(path: Path, manifest: Mapping[str, Any], kind: ArtifactKind) -> None:
    missing = [key for key in (*kind.required, *kind.dtypes) if key not in manifest]
    if missing:
        raise kind.fail(f"{path} is corrupt (missing key(s) {', '.join(map(repr, missing))})")
    for key, expected in kind.required.items():
        if not isinstance(manifest[key], expected):
            raise kind.fail(f"{path} is corrupt ({key!r} is {manifest[key]!r})")
    for key, names in kind.dtypes.items():
        if manifest[key] not in names:
            raise kind.fail(f"{path}: {key!r} is {manifest[key]!r}, not one of the dtypes {', '.join(names)}")


def manifest_record(directory: Path, record_type: Callable[..., T], values: Mapping[str, Any],
                    kind: ArtifactKind) -> T:
    """``record_type(**values)`` for a record of a manifest; missing or unexpected keys fail
    naming the manifest."""
    try:
        return record_type(**values)
    except TypeError as error:
        raise kind.fail(f"{Path(directory) / MANIFEST} is corrupt ({error})") from error


def map_array(path: Path, dtype: np.dtype | str | type, shape: tuple[int, ...], kind: ArtifactKind) -> np.ndarray:
    """Memory-map ``path`` read-only as a ``dtype`` array of ``shape``, after checking that its
    size is exactly what the manifest promises (so truncation fails here, naming the file)."""
    dtype = np.dtype(dtype)
    expected = math.prod(shape) * dtype.itemsize
    if not path.is_file():
        raise kind.fail(f"{path} is missing")
    actual = path.stat().st_size
    if actual != expected:
        raise kind.fail(f"{path} is truncated or corrupt: {actual} bytes, the manifest says "
                        f"{' x '.join(map(str, shape))} x {dtype.name} = {expected} bytes")
    if expected == 0:  # an empty file cannot be memory-mapped
        empty = np.zeros(shape, dtype=dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


def holds_artifact(directory: Path, kind: ArtifactKind) -> bool:
    """Whether ``directory`` has a manifest of ``kind`` (any format version; files unchecked)."""
    try:
        manifest = json.loads((Path(directory) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    keys = ("format_version", *kind.required, *kind.dtypes)
    return isinstance(manifest, dict) and all(key in manifest for key in keys)


def check_build_target(final_dir: Path, replace: bool, kind: ArtifactKind | None = None) -> None:
    """Refuse to build into an existing ``final_dir`` unless ``replace``; with ``kind``, replace
    only ``kind``'s own artifact or an empty directory, never anything else."""
    final_dir = Path(final_dir)
    if not final_dir.exists():
        return
    if not replace:
        raise FileExistsError(f"{final_dir} already exists; pass --replace to rebuild it")
    if kind is None or (final_dir.is_dir() and (holds_artifact(final_dir, kind) or not any(final_dir.iterdir()))):
        return
    raise FileExistsError(
        f"{final_dir} is not {kind.article} {kind.noun} (no {kind.noun} {MANIFEST}) and not empty, so "
        f"--replace will not delete it; choose another output directory or remove it yourself"
    )


def build_dir_prefix(final_dir: Path, role: str = "tmp", pid: int | None = None) -> str:
    """Name prefix of the hidden ``role`` directory a build next to ``final_dir`` makes: it
    records the building process and host, so a later build can tell when it was abandoned."""
    return f".{Path(final_dir).name}.{role}-{os.getpid() if pid is None else pid}@{socket.gethostname()}-"


def remove_abandoned_build_dirs(parent: Path) -> list[Path]:
    """Delete the temporary directories (ours by name, see :func:`build_dir_prefix`) that
    builds into ``parent`` on this host left when killed: those whose process is gone."""
    removed = []
    for path in Path(parent).iterdir():
        match = _BUILD_DIR.fullmatch(path.name)
        if (match is None or match["host"] != socket.gethostname() or _process_alive(int(match["pid"]))
                or path.is_symlink() or not path.is_dir()):
            continue
        logger.warning("removing %s, left by build process %s that no longer runs", path, match["pid"])
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process, or a pid we cannot signal: keep
        return True
    return True


@contextlib.contextmanager
def atomic_directory(final_dir: Path, replace: bool = False, kind: ArtifactKind | None = None) -> Iterator[Path]:
    """Yield a temporary directory next to ``final_dir``; rename it into place on success.

    Readers never see a half-written directory: on any exception the temporary
    directory is removed and ``final_dir`` is left as it was. An existing ``final_dir`` is
    an error unless ``replace`` is set (and, with ``kind``, it is ``kind``'s artifact or
    empty, see :func:`check_build_target`); then it is swapped out only once the new one is
    done. Temporary directories of killed builds into the same parent are removed first.
    """
    final_dir = Path(final_dir)
    check_build_target(final_dir, replace, kind)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_build_dirs(final_dir.parent)
    tmp_dir = Path(tempfile.mkdtemp(prefix=build_dir_prefix(final_dir), dir=final_dir.parent))
    try:
        yield tmp_dir
        for path in tmp_dir.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        tmp_dir.chmod(0o755)
        _swap_into_place(tmp_dir, final_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def _swap_into_place(new_dir: Path, final_dir: Path) -> None:
    if not final_dir.exists():
        os.replace(new_dir, final_dir)
        return
    old_dir = Path(tempfile.mkdtemp(prefix=build_dir_prefix(final_dir, "old"), dir=final_dir.parent))
    os.replace(final_dir, old_dir / final_dir.name)
    os.replace(new_dir, final_dir)
    shutil.rmtree(old_dir, ignore_errors=True)


def sha256_of_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def file_records(directory: Path, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": size, "sha256": hex}}`` of files in ``directory`` (for a manifest)."""
    return {name: {"bytes": (directory / name).stat().st_size, "sha256": sha256_of_file(directory / name)}
            for name in names}


def verify_file_records(directory: Path, records: Mapping[str, Mapping[str, Any]], kind: ArtifactKind) -> None:
    """Re-hash every file of ``records`` (as :func:`file_records` wrote them); the first
    mismatch fails naming the file."""
    for name, expected in records.items():
        if not (directory / name).is_file():
            raise kind.fail(f"{directory / name} is missing")
        actual = sha256_of_file(directory / name)
        if actual != expected["sha256"]:
            raise kind.fail(f"{directory / name} is corrupt: sha256 {actual[:16]}…, manifest says "
                            f"{expected['sha256'][:16]}…")
