"""Documents for a datastore: text files, directories of source files, zip archives and JSONL
(a text field, or OpenAI-style chat ``messages`` rendered with the tokenizer's chat template)."""

from __future__ import annotations

import fnmatch
import gzip
import json
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_retrieval_spec.datastores.format import DatastoreError

MAX_DOCUMENT_CHARS = 1_000_000  # longer documents are split at line boundaries
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


def _match(relative: str, name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(relative, pattern) or ("/" not in pattern and fnmatch.fnmatchcase(name, pattern))


@dataclass
class DocumentStream:
    """Iterates the documents of several inputs in a deterministic order."""

    inputs: Sequence[InputSpec]
    render_chat: ChatRenderer | None = None
    files_seen: int = field(default=0, init=False)

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
            yield from self._documents_of(spec)

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
        with opener(file, "rt", encoding="utf-8", errors="replace") as handle:
            yield from split_long_document(handle.read())

    def _zip_documents(self, spec: InputSpec) -> Iterator[str]:
        with zipfile.ZipFile(spec.path) as archive:
            for member in sorted(archive.namelist()):
                if member.endswith("/") or not spec.selects(member):
                    continue
                self.files_seen += 1
                yield from split_long_document(archive.read(member).decode("utf-8", errors="replace"))

    def _jsonl_documents(self, file: Path, spec: InputSpec) -> Iterator[str]:
        opener = gzip.open if file.suffix == ".gz" else open
        with opener(file, "rt", encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, 1):
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
            return self.render_chat(record["messages"])
        if isinstance(record, dict) and isinstance(record.get(spec.text_field), str):
            return record[spec.text_field]
        raise DatastoreError(
            f"{where} has neither a string field {spec.text_field!r} nor a 'messages' list; "
            "pass --text-field NAME for another field"
        )


def split_long_document(text: str, limit: int = MAX_DOCUMENT_CHARS) -> Iterator[str]:
    """Yield the text in pieces of at most ``limit`` characters, cut after a newline."""
    start = 0
    while len(text) - start > limit:
        cut = text.rfind("\n", start, start + limit) + 1 or start + limit
        yield text[start:cut]
        start = cut
    if start < len(text):
        yield text[start:]
