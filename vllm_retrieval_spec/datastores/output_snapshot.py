"""Snapshots of the output index on disk (option ``output_index_path``), so that a restarted
server starts with what the one it replaced learned.

``PATH`` (one per engine, see :func:`engine_snapshot_path`) holds numbered snapshots
``snapshot-NNNNNNNN/``, each a directory built next to its final name and renamed into place
(:func:`~vllm_retrieval_spec.storage.atomic_directory`), holding:

- ``tokens.bin``: the kept sequences, oldest first, each followed by ``SEPARATOR``, as raw
  little-endian ``uint32`` (memory-mapped read-only on load);
- ``calibration.npy`` and ``token_factors.npy`` (when the server's goodput budget has them):
  its decaying acceptance counts and its tokens' predicted and accepted sums, so that a
  restarted server ranks and cuts drafts as surely as the one it replaced instead of relearning
  them (a snapshot without them, or with counts of another layout, loads the tokens alone);
- ``manifest.json``: format version, token and sequence counts, the tokenizer's identity (as
  datastores record it), the size and sha256 of each file, and when it was saved.

A save writes the next number and then deletes the older snapshots (a directory named like one
that holds anything else is a user's, and kept), so a save killed at any point leaves the
previous snapshot whole (its temporary directory is removed by the next save). A load reads the
newest snapshot only and checks everything (manifest types and bounds, file size, checksum,
separators, token ids, tokenizer); a refused snapshot is replaced by the next save.
:class:`OutputIndexSnapshots` loads at start and saves periodically and at close.
"""

from __future__ import annotations

import abc
import atexit
import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from vllm_retrieval_spec.datastores.format import TokenizerIdentity
from vllm_retrieval_spec.datastores.output_index import SEPARATOR
from vllm_retrieval_spec.storage import (
    MAX_VOCAB_SIZE,
    ArtifactKind,
    StorageError,
    atomic_directory,
    check_manifest_ints,
    check_writable,
    file_records,
    manifest_record,
    map_array,
    read_manifest,
    remove_own_artifact,
    verify_file_records,
    write_manifest,
)

if TYPE_CHECKING:
    from vllm_retrieval_spec.datastores.output_index import OutputIndex

FORMAT_VERSION = 1
TOKENS = "tokens.bin"
CALIBRATION = "calibration.npy"
TOKEN_FACTORS = "token_factors.npy"
COUNTS_FILES = {"calibration": CALIBRATION, "token_factors": TOKEN_FACTORS}  # learned counts, by name
TOKEN_DTYPE = np.dtype("<u4")
COUNTS_DTYPE = np.dtype("<f8")
MAX_SNAPSHOT_TOKENS = 2**31 - 2  # the largest output_index_tokens
_SNAPSHOT = re.compile(r"snapshot-(\d{8})")
_FIRST_SNAPSHOT = "snapshot-00000000"

logger = logging.getLogger(__name__)


class OutputSnapshotError(StorageError):
    """An output index snapshot is corrupt, truncated, of another format or another tokenizer."""


OUTPUT_SNAPSHOT = ArtifactKind(
    noun="output index snapshot",
    article="an",
    format_version=FORMAT_VERSION,
    error=OutputSnapshotError,
    build_command="a server with the option output_index_path (it saves one every output_index_save_seconds "
                  "and at shutdown)",
    required={"num_tokens": int, "num_sequences": int, "separator": int, "tokenizer": dict, "files": dict,
              "saved": dict},
    dtypes={"token_dtype": ("uint32",)},
    data_files=(TOKENS, *COUNTS_FILES.values()),
)


class SavedCounts(Protocol):
    """Learned counts a snapshot keeps beside the index (the budget's acceptance calibration and
    tokens' factors, named as in ``COUNTS_FILES``)."""

    def counts(self) -> np.ndarray:
        """A copy of the counts, as one float64 array."""

    def restore_counts(self, counts: np.ndarray) -> None:
        """Start from saved ``counts``; ``ValueError`` when their layout is not this version's."""


@dataclass(frozen=True)
class SnapshotManifest:
    """The parsed ``manifest.json`` of one snapshot."""

    format_version: int
    num_tokens: int
    num_sequences: int
    token_dtype: str
    separator: int
    tokenizer: TokenizerIdentity
    files: dict[str, dict[str, Any]]
    saved: dict[str, Any]

    def write(self, directory: Path) -> None:
        write_manifest(directory, asdict(self))

    @classmethod
    def read(cls, directory: Path) -> SnapshotManifest:
        """The validated manifest of the snapshot in ``directory``."""
        raw = read_manifest(directory, OUTPUT_SNAPSHOT)
        tokenizer = manifest_record(directory, TokenizerIdentity, raw["tokenizer"], OUTPUT_SNAPSHOT, "tokenizer")
        manifest = manifest_record(directory, cls, raw | {"tokenizer": tokenizer}, OUTPUT_SNAPSHOT)
        manifest.check(directory)
        return manifest

    def check(self, directory: Path) -> None:
        """Counts in range, our separator, a vocabulary below it, and a checksum of ``tokens.bin``."""
        check_manifest_ints(directory, OUTPUT_SNAPSHOT, {
            "num_tokens": (self.num_tokens, 0, MAX_SNAPSHOT_TOKENS),
            "num_sequences": (self.num_sequences, 0, self.num_tokens),
            "separator": (self.separator, int(SEPARATOR), int(SEPARATOR)),
            "tokenizer.vocab_size": (self.tokenizer.vocab_size, 1, MAX_VOCAB_SIZE),
        })
        if TOKENS not in self.files:
            raise OUTPUT_SNAPSHOT.corrupt(directory, f"'files' lists {sorted(self.files)}, without {TOKENS!r}")


def engine_snapshot_path(path: str | Path, engine_index: int) -> Path:
    """Where data-parallel engine ``engine_index`` keeps its snapshots: ``path`` itself for the
    first engine (the only one of most servers), ``PATH.dp<i>`` for the others."""
    path = Path(path).expanduser()
    return path if engine_index == 0 else path.with_name(f"{path.name}.dp{engine_index}")


def check_snapshot_path(path: str | Path, option: str) -> None:
    """Refuse (``OSError`` naming ``option``) a snapshot ``path`` no save could write: a file,
    under a file, or in a directory without write permission."""
    try:
        check_writable(Path(path).expanduser() / _FIRST_SNAPSHOT)
    except OSError as error:
        raise OSError(f"{option}: {error}") from None


def snapshot_dirs(path: Path) -> list[Path]:
    """The snapshots under ``path``, oldest first (none when it does not exist)."""
    if not path.is_dir():
        return []
    found = [(int(match[1]), entry) for entry in path.iterdir() if (match := _SNAPSHOT.fullmatch(entry.name))]
    return [entry for _, entry in sorted(found)]


@contextmanager
def next_snapshot(path: Path, kind: ArtifactKind) -> Iterator[Path]:
    """Yield the directory the next numbered snapshot under ``path`` is built in (atomically, see
    :func:`~vllm_retrieval_spec.storage.atomic_directory`); once it is in place the older ones
    are deleted, so a save killed at any point leaves the previous snapshot whole. A directory
    named like a snapshot that holds anything but ``kind``'s own files is kept (a user's)."""
    older = snapshot_dirs(path)
    number = int(_SNAPSHOT.fullmatch(older[-1].name)[1]) + 1 if older else 0
    with atomic_directory(path / f"snapshot-{number:08d}", kind=kind) as building:
        yield building
    for directory in older:
        remove_own_artifact(directory, kind)


def write_snapshot(path: Path, sequences: Sequence[np.ndarray], tokenizer: TokenizerIdentity,
                   capacity_tokens: int, counts: Mapping[str, np.ndarray] | None = None) -> Path:
    """Save ``sequences`` (oldest first), and learned ``counts`` by name (see ``COUNTS_FILES``)
    when given, as the next snapshot under ``path`` and delete the older ones once it is in
    place; returns its directory."""
    with next_snapshot(path, OUTPUT_SNAPSHOT) as building:
        num_tokens = _write_tokens(building / TOKENS, sequences)
        names = [TOKENS]
        for name, array in (counts or {}).items():
            _write_counts(building / COUNTS_FILES[name], array)
            names.append(COUNTS_FILES[name])
        SnapshotManifest(
            format_version=FORMAT_VERSION, num_tokens=num_tokens, num_sequences=len(sequences),
            token_dtype="uint32", separator=int(SEPARATOR), tokenizer=tokenizer,
            files=file_records(building, names),
            saved={"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "capacity_tokens": capacity_tokens},
        ).write(building)
        _sync(building / "manifest.json")
    return snapshot_dirs(path)[-1]


def _write_tokens(file: Path, sequences: Sequence[np.ndarray]) -> int:
    """Write every sequence followed by a separator, synced to disk; returns the tokens written."""
    separator = np.array([SEPARATOR], TOKEN_DTYPE)
    with open(file, "wb") as handle:
        for sequence in sequences:
            handle.write(np.ascontiguousarray(sequence, dtype=TOKEN_DTYPE))
            handle.write(separator)
        handle.flush()
        os.fsync(handle.fileno())
    return sum(len(sequence) + 1 for sequence in sequences)


def _write_counts(file: Path, counts: np.ndarray) -> None:
    with open(file, "wb") as handle:
        np.save(handle, np.ascontiguousarray(counts, dtype=COUNTS_DTYPE), allow_pickle=False)
        handle.flush()
        os.fsync(handle.fileno())


def _sync(file: Path) -> None:
    with open(file, "rb") as handle:
        os.fsync(handle.fileno())


def read_snapshot(path: Path, tokenizer: TokenizerIdentity) -> list[np.ndarray] | None:
    """The sequences (read-only views of the memory-mapped tokens, oldest first) of the newest
    snapshot under ``path``; None when there is none. ``OutputSnapshotError`` naming the file
    when it is corrupt, truncated, of another format or saved with another tokenizer."""
    saved = snapshot_dirs(path)
    if not saved:
        return None
    directory = saved[-1]
    manifest = SnapshotManifest.read(directory)
    _refuse_another_tokenizer(directory, manifest.tokenizer, tokenizer)
    tokens = map_array(directory / TOKENS, TOKEN_DTYPE, (manifest.num_tokens,), OUTPUT_SNAPSHOT)
    verify_file_records(directory, {TOKENS: manifest.files[TOKENS]}, OUTPUT_SNAPSHOT)  # counts: their own
    return _split(directory / TOKENS, tokens, manifest)


def read_counts(path: Path, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """The learned counts ``name`` (see ``COUNTS_FILES``) of the newest snapshot under ``path``
    (None when it has none): checked against their checksum, a float64 ``.npy`` of ``shape``
    without objects, finite and non-negative. ``OutputSnapshotError`` naming the file otherwise."""
    saved = snapshot_dirs(path)
    if not saved:
        return None
    directory = saved[-1]
    manifest = SnapshotManifest.read(directory)
    file_name = COUNTS_FILES[name]
    if file_name not in manifest.files:
        return None
    verify_file_records(directory, {file_name: manifest.files[file_name]}, OUTPUT_SNAPSHOT)
    file = directory / file_name
    try:
        counts = np.load(file, allow_pickle=False)
    except (OSError, ValueError) as error:
        raise OUTPUT_SNAPSHOT.fail(f"{file} is corrupt ({error})") from error
    if counts.dtype != COUNTS_DTYPE:
        raise OUTPUT_SNAPSHOT.fail(f"{file} is corrupt: counts of dtype {counts.dtype}, not float64")
    if counts.shape != tuple(shape):
        raise OUTPUT_SNAPSHOT.fail(f"{file} holds counts of shape {counts.shape}, this server keeps {shape}")
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise OUTPUT_SNAPSHOT.fail(f"{file} is corrupt: negative or non-finite counts")
    return counts


def _refuse_another_tokenizer(directory: Path, saved: TokenizerIdentity, served: TokenizerIdentity) -> None:
    if not saved.matches(served):
        raise OUTPUT_SNAPSHOT.fail(
            f"{directory / 'manifest.json'} was saved by a server with tokenizer {saved.name!r} (vocab "
            f"{saved.vocab_size}, hash {saved.vocab_sha256[:12]}), but this one serves tokenizer {served.name!r} "
            f"(vocab {served.vocab_size}, hash {served.vocab_sha256[:12]})"
        )


def _split(file: Path, tokens: np.ndarray, manifest: SnapshotManifest) -> list[np.ndarray]:
    """The sequences between separators, after checking that there are ``num_sequences`` of
    them, none empty, the last one closed, and every token id in the tokenizer's vocabulary."""
    ends = np.flatnonzero(tokens == SEPARATOR)
    starts = np.concatenate([[0], ends + 1])[:-1]
    if len(ends) != manifest.num_sequences:
        raise OUTPUT_SNAPSHOT.fail(f"{file} is corrupt: {len(ends)} separators for {manifest.num_sequences} "
                                   "sequences")
    if len(tokens) and (not len(ends) or ends[-1] != len(tokens) - 1):
        raise OUTPUT_SNAPSHOT.fail(f"{file} is corrupt: it does not end with a separator")
    if np.any(ends == starts):
        raise OUTPUT_SNAPSHOT.fail(f"{file} is corrupt: it holds an empty sequence")
    outside = np.flatnonzero((tokens >= manifest.tokenizer.vocab_size) & (tokens != SEPARATOR))
    if len(outside):
        raise OUTPUT_SNAPSHOT.fail(f"{file} is corrupt: token {int(tokens[outside[0]])} at {int(outside[0])} is "
                                   f"not below the vocabulary size {manifest.tokenizer.vocab_size}")
    return [tokens[start:end] for start, end in zip(starts.tolist(), ends.tolist())]


class PeriodicSaves(abc.ABC):
    """Something kept on disk under ``path``: when ``writes``, :meth:`start_saving` calls
    :meth:`save_if_changed` from a daemon thread every ``interval_seconds``; :meth:`close` (also
    run at interpreter exit) stops the thread and saves a last time."""

    noun = "snapshot"  # what is saved, for the log

    def __init__(self, path: Path, interval_seconds: float, writes: bool) -> None:
        self.path = Path(path)
        self.interval_seconds = interval_seconds
        self.writes = writes
        self.saves = 0
        self._saved_changes = 0
        self._save_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    @abc.abstractmethod
    def changes(self) -> int:
        """A count that moves whenever there is something new to save."""

    @abc.abstractmethod
    def save(self) -> None:
        """Write the next snapshot under ``path``."""

    def save_if_changed(self) -> bool:
        """Save when :meth:`changes` moved since the last save; True when a snapshot was written.
        Never raises: a failed save is logged (serving goes on) and tried again next time."""
        with self._save_lock:
            changes = self.changes()
            if changes == self._saved_changes:
                return False
            try:
                self.save()
            except Exception as error:  # disk full, permissions, something in the way: serving goes on
                logger.error("vllm_retrieval_spec: saving the %s to %s failed (%s); serving goes on and "
                             "the next save tries again", self.noun, self.path, error)
                return False
            self._saved_changes = changes
            self.saves += 1
            return True

    def start_saving(self) -> None:
        if self.writes:
            self._thread = threading.Thread(target=self._save_periodically, daemon=True,
                                            name=f"vrs-snapshot-{self.path.name}")
            self._thread.start()
            atexit.register(self.close)

    def close(self) -> None:
        """Stop the periodic saves and save a last time (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            atexit.unregister(self.close)
        if self.writes:
            self.save_if_changed()

    def _save_periodically(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            self.save_if_changed()


class OutputIndexSnapshots(PeriodicSaves):
    """An output index kept on disk, with the ``learned`` counts by name when given: :meth:`start`
    loads its snapshot (a refused one is logged and the index starts empty; refused counts are
    logged and relearned) and, when ``writes``, saves it from a daemon thread every
    ``interval_seconds`` when requests finished since the last save; :meth:`close` (also run at
    interpreter exit) stops the thread and saves a last time. Saving never raises: a failed
    save is logged and tried again at the next interval."""

    noun = "output index"

    def __init__(self, index: OutputIndex, path: Path, tokenizer: TokenizerIdentity, interval_seconds: float,
                 *, writes: bool = True, learned: Mapping[str, SavedCounts] | None = None) -> None:
        super().__init__(path, interval_seconds, writes)
        self.index = index
        self.learned = dict(learned or {})
        self.tokenizer = tokenizer

    def start(self) -> bool:
        """Load the snapshot and start saving; True when a snapshot was loaded."""
        loaded = self.index.load(self.path, self.tokenizer)
        if loaded:
            for name, learned in self.learned.items():
                self._restore_counts(name, learned)
        self._saved_changes = self.changes()
        self.start_saving()
        return loaded

    def changes(self) -> int:
        return self.index.stats.sequences_added

    def save(self) -> None:
        self.index.save(self.path, self.tokenizer, {name: learned.counts() for name, learned in self.learned.items()})

    def _restore_counts(self, name: str, learned: SavedCounts) -> None:
        """Start ``learned`` from the snapshot's counts ``name``; whatever is wrong with them is
        logged and the budget relearns them from its prior (the tokens serve on)."""
        try:
            counts = read_counts(self.path, name, learned.counts().shape)
            if counts is not None:
                learned.restore_counts(counts)
        except Exception as error:
            logger.error("vllm_retrieval_spec: the %s counts saved under %s were refused (%s); the budget "
                         "relearns them and the next save replaces them", name, self.path, error)
            return
        if counts is not None:
            logger.info("vllm_retrieval_spec: goodput %s restored from %s", name, self.path)
