"""On-disk artifacts (checkpoints, datastores, n-gram tables): atomic directory builds, and
the one reader of a directory's ``manifest.json`` and of its memory-mapped binary files."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import tempfile
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, Union, get_args, get_origin, get_type_hints

import numpy as np

from vllm_retrieval_spec.validation import IntBounds, has_type, int_in, require_ints

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MANIFEST = "manifest.json"
# The largest vocabulary a manifest may record: token ids are int32 throughout the package, and
# readers allocate per-token arrays (the largest real vocabularies hold about 2^18 tokens).
MAX_VOCAB_SIZE = 2**24
MODEL_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
T = TypeVar("T")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_NAMES_SHOWN = 5  # files named in a refusal of --replace, then "and N more"
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
    each manifest key that names a numpy dtype to the dtype names this package reads;
    ``data_files`` names the files a build writes next to the manifest (its ``files`` may list
    only these, and ``--replace`` deletes nothing else), each listed as ``{"bytes", "sha256"}``
    (``sized_files``) or as a bare sha256.
    """

    noun: str
    article: str
    format_version: int
    error: type[StorageError]
    build_command: str
    required: Mapping[str, type | tuple[type, ...]] = field(default_factory=dict)
    dtypes: Mapping[str, Sequence[str]] = field(default_factory=dict)
    data_files: Sequence[str] = ()
    sized_files: bool = True

    def fail(self, problem: str) -> StorageError:
        """The error to raise for ``problem`` (which names the file), with the fix appended."""
        return self.error(f"{problem}; rebuild the {self.noun}")

    def corrupt(self, directory: Path, detail: str) -> StorageError:
        """The error for a bad value in ``directory``'s manifest: ``MANIFEST is corrupt (detail)``."""
        return self.fail(f"{Path(directory) / MANIFEST} is corrupt ({detail})")


def local_model_dir(path: str | Path, flag: str, needs: Sequence[str] = MODEL_FILES) -> Path:
    """``path`` as a local model (or tokenizer) directory holding one of ``needs``; fail naming
    ``flag`` otherwise. Models are read from local directories only, never looked up online."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        state = "is not a directory" if directory.exists() else "does not exist"
        if not directory.exists() and "/" not in str(path):
            state += " (a name is not looked up on the Hugging Face Hub: models are read from local directories)"
        raise FileNotFoundError(f"{flag} {path} {state}; give a model directory, e.g. the one "
                                "`vllm-retrieval-spec prepare-model` prints")
    if not any((directory / name).is_file() for name in needs):
        raise FileNotFoundError(f"{flag} {path} holds no {' or '.join(needs)}, so it is not a model directory; give "
                                "one, e.g. the one `vllm-retrieval-spec prepare-model` prints")
    return directory


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
    if "files" in kind.required:
        _check_file_entries(path, manifest["files"], kind)
    return manifest


def _check_keys(path: Path, manifest: Mapping[str, Any], kind: ArtifactKind) -> None:
    missing = [key for key in (*kind.required, *kind.dtypes) if key not in manifest]
    if missing:
        raise kind.fail(f"{path} is corrupt (missing key(s) {', '.join(map(repr, missing))})")
    for key, expected in kind.required.items():
        if not has_type(manifest[key], expected):
            raise kind.fail(f"{path} is corrupt ({key!r} is {manifest[key]!r})")
    for key, names in kind.dtypes.items():
        if manifest[key] not in names:
            raise kind.fail(f"{path}: {key!r} is {manifest[key]!r}, not one of the dtypes {', '.join(names)}")


def _check_file_entries(path: Path, files: Mapping[str, Any], kind: ArtifactKind) -> None:
    """Each entry of ``files`` names one of ``kind``'s data files and records its sha256 (and size)."""
    form = '{"bytes": SIZE, "sha256": HEX}' if kind.sized_files else "a sha256 in hex"
    for name, entry in files.items():
        if kind.data_files and name not in kind.data_files:
            raise kind.fail(f"{path} is corrupt ('files' lists {name!r}, not one of {', '.join(kind.data_files)})")
        if not _is_file_entry(entry, kind.sized_files):
            raise kind.fail(f"{path} is corrupt ('files' entry {name!r} is {entry!r}, not {form})")


def _is_file_entry(entry: Any, sized: bool) -> bool:
    if not sized:
        return isinstance(entry, str) and _SHA256.fullmatch(entry) is not None
    return (isinstance(entry, dict) and int_in(entry.get("bytes"), 0) and isinstance(entry.get("sha256"), str)
            and _SHA256.fullmatch(entry["sha256"]) is not None)


def manifest_record(directory: Path, record_type: Callable[..., T], values: Any, kind: ArtifactKind,
                    key: str = "") -> T:
    """``record_type(**values)`` for a record (a dataclass) of a manifest, at manifest key
    ``key`` when nested; missing, unexpected or mistyped keys fail naming the manifest."""
    if not isinstance(values, Mapping):
        raise kind.corrupt(directory, f"{key!r} is {values!r}, not a JSON object")
    try:
        record = record_type(**values)
    except TypeError as error:
        raise kind.corrupt(directory, str(error)) from error
    for name, hint in get_type_hints(record_type).items():
        value = getattr(record, name)
        if not _has_hinted_type(value, hint):
            label = f"{key}.{name}" if key else name
            raise kind.corrupt(directory, f"{label!r} is {value!r}, not {getattr(hint, '__name__', hint)}")
    return record


def _has_hinted_type(value: Any, hint: Any) -> bool:
    """Whether ``value`` has the annotated type ``hint`` (containers checked by their own type only)."""
    if hint is Any:
        return True
    if get_origin(hint) in (Union, types.UnionType):
        return any(_has_hinted_type(value, arg) for arg in get_args(hint))
    if hint is type(None):
        return value is None
    return has_type(value, (int, float) if hint is float else get_origin(hint) or hint)


def check_manifest_ints(directory: Path, kind: ArtifactKind, bounds: IntBounds) -> None:
    """Fail naming the manifest and the key when a value of ``bounds`` (``key: (value, low,
    high)``) is not an integer in its range."""
    require_ints({repr(key): bound for key, bound in bounds.items()},
                 lambda problem: kind.corrupt(directory, problem))


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


def _artifact_manifest(directory: Path, kind: ArtifactKind) -> dict[str, Any] | None:
    """``directory``'s manifest when it is one of ``kind`` (any format version; values unchecked)."""
    try:
        manifest = json.loads((Path(directory) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    keys = ("format_version", *kind.required, *kind.dtypes)
    return manifest if isinstance(manifest, dict) and all(key in manifest for key in keys) else None


def check_build_target(final_dir: Path, replace: bool, kind: ArtifactKind | None = None) -> None:
    """Before any work: refuse to build into an existing ``final_dir`` unless ``replace`` (with
    ``kind``, only into an empty directory or ``kind``'s artifact holding nothing but its own
    files, see :func:`replaceable_files`), and into a place that cannot be written."""
    final_dir = Path(final_dir)
    if final_dir.exists() or final_dir.is_symlink():
        if not replace:
            raise FileExistsError(f"{final_dir} already exists; pass --replace to rebuild it")
        if kind is not None:
            replaceable_files(final_dir, kind)
    check_writable(final_dir)


def replaceable_files(directory: Path, kind: ArtifactKind) -> list[Path]:
    """What ``--replace`` deletes from ``directory``: its manifest (first), then the data files
    that manifest lists; nothing when it is empty. ``FileExistsError`` naming what is in the way
    when it is no directory of ``kind``'s, or holds anything else."""
    if directory.is_symlink() or not directory.is_dir():
        what = "a symbolic link" if directory.is_symlink() else "not a directory"
        raise FileExistsError(f"{directory} is {what}, so --replace will not replace it; choose another output "
                              "directory")
    entries = sorted(directory.iterdir())
    if not entries:
        return []
    manifest = _artifact_manifest(directory, kind)
    if manifest is None:
        raise FileExistsError(
            f"{directory} is not {kind.article} {kind.noun} (no {kind.noun} {MANIFEST}) and not empty, so "
            f"--replace will not delete it; choose another output directory or remove it yourself"
        )
    listed = manifest["files"] if isinstance(manifest.get("files"), dict) else {}
    ours = {MANIFEST, *(name for name in listed if name in kind.data_files)}
    foreign = [entry.name for entry in entries if entry.name not in ours or entry.is_symlink() or not entry.is_file()]
    if foreign:
        raise FileExistsError(
            f"{directory} holds {_some_names(foreign)}, which its {kind.noun} {MANIFEST} does not list, so --replace "
            f"will not delete it (it deletes only what a build wrote); move {'it' if len(foreign) == 1 else 'them'} "
            "out or choose another output directory"
        )
    return sorted(entries, key=lambda entry: entry.name != MANIFEST)


def remove_own_artifact(directory: Path, kind: ArtifactKind) -> bool:
    """Delete ``directory`` when it is ``kind``'s artifact holding nothing but its own files
    (:func:`replaceable_files`; the manifest last, so a removal killed midway leaves one that still
    claims the rest); otherwise keep it whole and log why. Whether it was deleted."""
    try:
        files = replaceable_files(directory, kind)
        for path in reversed(files):
            path.unlink(missing_ok=True)
        directory.rmdir()
    except OSError as error:  # FileExistsError: not ours alone; others: something appeared, or permissions
        reason = (f"not {kind.article} {kind.noun} holding only its own files" if isinstance(error, FileExistsError)
                  else str(error))
        logger.warning("%s is kept (%s): the plugin deletes only what it wrote; remove it yourself if it is not "
                       "needed", directory, reason)
        return False
    return True


def _some_names(names: Sequence[str]) -> str:
    shown = ", ".join(map(repr, names[:_NAMES_SHOWN]))
    return shown if len(names) <= _NAMES_SHOWN else f"{shown} and {len(names) - _NAMES_SHOWN} more"


def check_writable(final_dir: Path) -> None:
    """Fail naming the directory in the way when ``final_dir`` could not be created there (or,
    existing, have its files replaced)."""
    nearest = next((parent for parent in final_dir.parents if parent.exists()), Path("."))
    for place in (nearest, final_dir) if final_dir.is_dir() and not final_dir.is_symlink() else (nearest,):
        if not place.is_dir():
            raise _unwritable(final_dir, f"{place} is not a directory")
        if not os.access(place, os.W_OK | os.X_OK):
            raise _unwritable(final_dir, f"{place} is not writable")


def _unwritable(final_dir: Path, problem: str) -> OSError:
    return OSError(f"cannot write {final_dir}: {problem}; choose another output directory or fix its permissions")


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
    an error unless ``replace`` is set (and, with ``kind``, it is empty or ``kind``'s artifact
    holding only its own files, see :func:`replaceable_files`, checked again at the end); then
    only once the new one is done are those files deleted and the emptied directory replaced.
    Without ``kind`` the caller vouches that an existing ``final_dir`` is all its own. Temporary
    directories of killed builds into the same parent are removed first.
    """
    final_dir = Path(final_dir)
    check_build_target(final_dir, replace, kind)
    tmp_dir = _make_build_dir(final_dir)
    try:
        yield tmp_dir
        for path in tmp_dir.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        tmp_dir.chmod(0o755)
        _swap_into_place(tmp_dir, final_dir, replace, kind)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def _make_build_dir(final_dir: Path) -> Path:
    """The hidden temporary directory of a build of ``final_dir``, next to it."""
    try:
        final_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned_build_dirs(final_dir.parent)
        return Path(tempfile.mkdtemp(prefix=build_dir_prefix(final_dir), dir=final_dir.parent))
    except OSError as error:
        raise _unwritable(final_dir, f"{final_dir.parent}: {error.strerror or error}") from error


def _swap_into_place(new_dir: Path, final_dir: Path, replace: bool, kind: ArtifactKind | None) -> None:
    """Rename ``new_dir`` to ``final_dir``; an existing one is checked again (something may have
    appeared during the build), emptied of its own files (moved aside whole without ``kind``),
    and replaced."""
    set_aside = None
    if final_dir.exists() or final_dir.is_symlink():
        check_build_target(final_dir, replace, kind)
        if kind is None:
            set_aside = Path(tempfile.mkdtemp(prefix=build_dir_prefix(final_dir, "old"), dir=final_dir.parent))
            os.replace(final_dir, set_aside / final_dir.name)
        else:
            for path in replaceable_files(final_dir, kind):
                path.unlink()
    try:
        os.replace(new_dir, final_dir)
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise FileExistsError(f"{final_dir}: {_some_names(sorted(p.name for p in final_dir.iterdir()))} appeared "
                              "in it during the build, so the new one was not put in place; move them out and "
                              "build again") from error
    if set_aside is not None:
        shutil.rmtree(set_aside, ignore_errors=True)


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


# --- What an artifact was built for -------------------------------------------------------


@dataclass(frozen=True)
class TokenizerIdentity:
    """What makes two tokenizers interchangeable for a store of token ids."""

    name: str
    vocab_size: int
    vocab_sha256: str

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, name: str | None = None) -> TokenizerIdentity:
        """Identity of a transformers tokenizer (hash over the sorted token -> id map)."""
        return cls.of_vocab(tokenizer.get_vocab(), len(tokenizer),
                            name or str(getattr(tokenizer, "name_or_path", "") or "unknown"))

    @classmethod
    def of_vocab(cls, vocab: Mapping[str, int], size: int, name: str) -> TokenizerIdentity:
        """Identity of a token -> id map of ``size`` tokens (hash over the map sorted by id)."""
        payload = json.dumps(sorted(vocab.items(), key=lambda item: item[1]), ensure_ascii=False)
        return cls(name=name, vocab_size=max(size, max(vocab.values()) + 1),
                   vocab_sha256=hashlib.sha256(payload.encode()).hexdigest())

    @classmethod
    def of_directory(cls, tokenizer_dir: str | Path, name: str | None = None) -> TokenizerIdentity:
        """Identity of the tokenizer saved in ``tokenizer_dir``, equal to :meth:`of` its transformers
        tokenizer: read from its ``tokenizer.json`` by the ``tokenizers`` library (what that fast
        tokenizer loads, without importing transformers: ~7 s on a 2-core machine) unless its
        configuration declares tokens the file lacks (transformers would add them), else loaded
        by transformers."""
        directory = Path(tokenizer_dir)
        name = name or directory.name
        fast = _fast_tokenizer(directory)
        if fast is None:
            from transformers import AutoTokenizer

            return cls.of(AutoTokenizer.from_pretrained(str(directory)), name=name)
        return cls.of_vocab(fast.get_vocab(with_added_tokens=True), fast.get_vocab_size(with_added_tokens=True), name)

    def matches(self, other: TokenizerIdentity) -> bool:
        return self.vocab_size == other.vocab_size and self.vocab_sha256 == other.vocab_sha256

    def describe(self) -> str:
        return f"tokenizer {self.name!r} (vocab {self.vocab_size}, hash {self.vocab_sha256[:12]})"


def _fast_tokenizer(directory: Path) -> Any:
    """The ``tokenizers`` tokenizer of ``directory``'s ``tokenizer.json``, when it holds every
    token the directory's configuration declares (special, additional and added tokens); else
    None (also without the file, or with a configuration that does not parse)."""
    if not (directory / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        declared = set().union(*(_declared_tokens(directory / name)
                                 for name in ("tokenizer_config.json", "special_tokens_map.json")))
    except Exception:  # any unreadable file: transformers loads it, or names what is wrong
        return None
    return tokenizer if declared <= tokenizer.get_vocab(with_added_tokens=True).keys() else None


def _declared_tokens(config_path: Path) -> set[str]:
    """The tokens a tokenizer configuration file names: ``*_token`` values, additional special
    tokens and ``added_tokens_decoder`` entries (strings or ``{"content": ...}``)."""
    if not config_path.is_file():
        return set()
    config = json.loads(config_path.read_text())
    values = [value for key, value in config.items() if key.endswith("_token") or key == "additional_special_tokens"]
    values += list((config.get("added_tokens_decoder") or {}).values())
    items = [item for value in values for item in (value if isinstance(value, list) else [value])]
    contents = [item.get("content") if isinstance(item, dict) else item for item in items]
    return {content for content in contents if isinstance(content, str)}


@dataclass(frozen=True)
class ModelIdentity:
    """What ties an artifact to a model: its config and its tokenizer's vocabulary."""

    name: str
    vocab_size: int
    config_sha256: str
    vocab_sha256: str

    @classmethod
    def of(cls, model_dir: str | Path, flag: str = "--model") -> ModelIdentity:
        """The identity of the model in ``model_dir`` (a local directory; ``flag`` names it in errors)."""
        model_dir = local_model_dir(model_dir, flag)
        config = json.loads((model_dir / "config.json").read_text())
        canonical = json.dumps(config, sort_keys=True).encode()
        tokenizer = TokenizerIdentity.of_directory(model_dir)
        return cls(model_dir.name, int(config["vocab_size"]), hashlib.sha256(canonical).hexdigest(),
                   tokenizer.vocab_sha256)

    def matches(self, other: ModelIdentity) -> bool:
        return (self.config_sha256, self.vocab_sha256) == (other.config_sha256, other.vocab_sha256)

    def describe(self) -> str:
        return (f"model {self.name!r} (config {self.config_sha256[:12]}, vocab {self.vocab_size}, "
                f"tokenizer {self.vocab_sha256[:12]})")


def refuse_another_identity(kind: ArtifactKind, path: Path, built: TokenizerIdentity | ModelIdentity,
                            served: TokenizerIdentity | ModelIdentity) -> None:
    """Fail naming both when the artifact at ``path`` was built for another tokenizer or model
    than the one served."""
    if not built.matches(served):
        raise kind.error(
            f"{kind.noun} {path} was built for {built.describe()}, but the model is served with "
            f"{served.describe()}; rebuild it with {kind.build_command}"
        )
