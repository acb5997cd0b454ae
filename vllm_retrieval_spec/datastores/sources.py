"""Documents for a datastore: text files, directories of source files, zip archives and JSONL
(a text field, or OpenAI-style chat ``messages`` rendered with the tokenizer's chat template).
Binary files (see :func:`looks_binary`) are counted and skipped; an input without any
document is an error."""

from __future__ import annotations

import argparse
import codecs
import contextlib
import fnmatch
import gzip
import json
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_retrieval_spec.datastores.format import DatastoreError

MAX_DOCUMENT_CHARS = 1_000_000  # longer documents are split at line boundaries
SNIFF_BYTES = 8192  # a file is judged text or binary by its first bytes
ChatRenderer = Callable[[list[dict[str, Any]]], str]


@dataclass(frozen=True)
class InputSpec:
    """One builder input with its filters (globs match paths relative to the input)."""

    path: Path
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    text_field: str = "text"

    def selects(self, relative: str) -> bool:
        name = relative.rsplit("/", 1)[-1]
        included = any(_match(relative, name, g) for g in self.include)
        return included and not any(_match(relative, name, g) for g in self.exclude)


def add_input_arguments(parser: argparse.ArgumentParser, recipe_example: str) -> None:
    """The flags that say what a store is built from (``datastore build`` and ``build-dense``)."""
    add_document_arguments(parser, required=False)
    parser.add_argument("--recipe", help=f"build a recipe from datastores/ instead (e.g. {recipe_example})")
    parser.add_argument("--out", help="store directory (default for recipes: the cache)")


def add_document_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    """The flags that say which documents to read (these and a recipe build stores; these alone
    are what ``datastore add`` adds)."""
    parser.add_argument("--input", nargs="+", required=required,
                        help="text files, directories, .zip archives, .jsonl(.gz) files")
    parser.add_argument("--include", action="append", help="glob of files to take (repeatable; default *)")
    parser.add_argument("--exclude", action="append", help="glob of files to skip (repeatable)")
    parser.add_argument("--text-field", default="text", help="JSONL field with the text (default text; "
                        "records with 'messages' are rendered with the chat template)")


def input_specs_of(args: argparse.Namespace) -> list[InputSpec]:
    """The ``--input`` paths with the ``--include``, ``--exclude`` and ``--text-field`` flags of
    :func:`add_input_arguments`."""
    include = tuple(args.include or ["*"])
    return [InputSpec(Path(path), include, tuple(args.exclude or ()), args.text_field) for path in args.input]


def _match(relative: str, name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(relative, pattern) or ("/" not in pattern and fnmatch.fnmatchcase(name, pattern))


@dataclass
class DocumentStream:
    """Iterates the documents of several inputs in a deterministic order."""

    inputs: Sequence[InputSpec]
    render_chat: ChatRenderer | None = None
    files_seen: int = field(default=0, init=False)
    files_skipped: int = field(default=0, init=False)  # binary

    @property
    def files_read(self) -> int:
        return self.files_seen - self.files_skipped

    def count_files(self) -> int | None:
        """Files to read (for the progress bar), or None when JSONL records are the unit."""
        total = 0
        for spec in self.inputs:
            if spec.path.is_dir():
                total += sum(1 for _ in self._directory_files(spec))
            else:
                return None
        return total

    def __iter__(self) -> Iterator[str]:
        for spec in self.inputs:
            if not spec.path.exists():
                raise DatastoreError(f"input {spec.path} does not exist")
            yield from self._documents_of_input(spec)

    def _documents_of_input(self, spec: InputSpec) -> Iterator[str]:
        seen, skipped, found = self.files_seen, self.files_skipped, False
        for document in self._documents_of(spec):
            found = True
            yield document
        if not found:
            raise DatastoreError(_nothing_to_read(spec, self.files_seen - seen, self.files_skipped - skipped))

    def _documents_of(self, spec: InputSpec) -> Iterator[str]:
        path = spec.path
        if path.is_dir():
            for file in self._directory_files(spec):
                yield from self._file_documents(file, spec)
        elif path.suffix == ".zip":
            yield from self._zip_documents(spec)
        else:
            yield from self._file_documents(path, spec)

    @staticmethod
    def _directory_files(spec: InputSpec) -> Iterator[Path]:
        for file in sorted(spec.path.rglob("*")):
            if file.is_file() and spec.selects(file.relative_to(spec.path).as_posix()):
                yield file

    def _file_documents(self, file: Path, spec: InputSpec) -> Iterator[str]:
        self.files_seen += 1
        if file.name.endswith((".jsonl", ".jsonl.gz")):
            yield from self._jsonl_documents(file, spec)
            return
        opener = gzip.open if file.suffix == ".gz" else open
        with _named_errors(file, "gzip file"), opener(file, "rb") as handle:
            data = handle.read()
        yield from self._text_documents(data)

    def _zip_documents(self, spec: InputSpec) -> Iterator[str]:
        with _named_errors(spec.path, "zip archive"), zipfile.ZipFile(spec.path) as archive:
            for member in sorted(archive.namelist()):
                if member.endswith("/") or not spec.selects(member):
                    continue
                self.files_seen += 1
                yield from self._text_documents(archive.read(member))

    def _text_documents(self, data: bytes) -> Iterator[str]:
        """A text file's documents; a binary file is counted in ``files_skipped`` instead."""
        if looks_binary(data[:SNIFF_BYTES]):
            self.files_skipped += 1
            return
        yield from split_long_document(data.decode("utf-8", errors="replace"))

    def _jsonl_documents(self, file: Path, spec: InputSpec) -> Iterator[str]:
        opener = gzip.open if file.suffix == ".gz" else open
        with _named_errors(file, "gzip file"), opener(file, "rb") as handle:
            for line_number, raw in enumerate(handle, 1):
                line = _decode_line(file, line_number, raw)
                if line.strip():
                    yield from split_long_document(self._record_text(file, line_number, line, spec))

    def _record_text(self, file: Path, line_number: int, line: str, spec: InputSpec) -> str:
        where = f"{file}:{line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DatastoreError(f"{where} is not valid JSON: {error}") from error
        if isinstance(record, dict) and isinstance(record.get("messages"), list):
            if self.render_chat is None:
                raise DatastoreError(f"{where} has chat messages but the tokenizer has no chat template")
            return _render(self.render_chat, record["messages"], where)
        if isinstance(record, dict) and isinstance(record.get(spec.text_field), str):
            return record[spec.text_field]
        raise DatastoreError(
            f"{where} has neither a string field {spec.text_field!r} nor a 'messages' list; "
            "pass --text-field NAME for another field"
        )


def _render(render_chat: ChatRenderer, messages: list[Any], where: str) -> str:
    try:
        return render_chat(messages)
    except Exception as error:  # templates fail with jinja2, TypeError or ValueError alike
        raise DatastoreError(
            f"{where}: the tokenizer's chat template cannot render its 'messages' ({type(error).__name__}: "
            f"{error}); make them a non-empty list of {{'role': str, 'content': str}} objects"
        ) from error


def _decode_line(file: Path, line_number: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DatastoreError(
            f"{file}:{line_number} is not valid UTF-8 ({error.reason} at byte {error.start} of the line); "
            "re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
        ) from error


@contextlib.contextmanager
def _named_errors(path: Path, what: str) -> Iterator[None]:
    """Corrupt or truncated compressed data fails naming the file."""
    try:
        yield
    except (EOFError, zlib.error, gzip.BadGzipFile, zipfile.BadZipFile) as error:
        raise DatastoreError(
            f"{path} is not a valid {what} or is truncated ({error}); re-create it, or leave it out of "
            "the inputs (--exclude)"
        ) from error


def _nothing_to_read(spec: InputSpec, files: int, skipped: int) -> str:
    if files:
        problem = f"its {files} selected file(s) hold no text ({skipped} binary, skipped); give text inputs"
    elif not _holds_files(spec.path):
        kind = "archive" if spec.path.suffix == ".zip" else "directory"
        problem = f"the {kind} is empty (it holds no files); give a {kind} with text files"
    else:
        globs = " ".join([*(f"--include {g!r}" for g in spec.include), *(f"--exclude {g!r}" for g in spec.exclude)])
        problem = f"no file matches its --include/--exclude globs ({globs}); change the globs"
    return f"input {spec.path} has nothing to read: {problem}"


def _holds_files(path: Path) -> bool:
    """Whether a directory or zip archive holds any file (other inputs are files themselves)."""
    if path.is_dir():
        return any(p.is_file() for p in path.rglob("*"))
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as archive:
            return any(not name.endswith("/") for name in archive.namelist())
    return True


def looks_binary(head: bytes) -> bool:
    """Whether a file starting with ``head`` (its first ``SNIFF_BYTES``) is binary: a NUL byte
    there (git's rule), or bytes that are not UTF-8 (a character cut at the end is fine)."""
    if b"\0" in head:
        return True
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return True
    return False


def split_long_document(text: str, limit: int = MAX_DOCUMENT_CHARS) -> Iterator[str]:
    """Yield the text in pieces of at most ``limit`` characters, cut after a newline."""
    start = 0
    while len(text) - start > limit:
        cut = text.rfind("\n", start, start + limit) + 1 or start + limit
        yield text[start:cut]
        start = cut
    if start < len(text):
        yield text[start:]
