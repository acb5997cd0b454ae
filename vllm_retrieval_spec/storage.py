"""Atomic directory builds shared by every on-disk artifact (checkpoints, datastores, tables)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(final_dir: Path, replace: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to ``final_dir``; rename it into place on success.

    Readers never see a half-written directory: on any exception the temporary
    directory is removed and ``final_dir`` is left as it was. An existing ``final_dir`` is
    an error unless ``replace`` is set; then it is swapped out only once the new one is done.
    """
    final_dir = Path(final_dir)
    if final_dir.exists() and not replace:
        raise FileExistsError(f"{final_dir} already exists; remove it or ask to replace it")
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.tmp-", dir=final_dir.parent))
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
    old_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.old-", dir=final_dir.parent))
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
