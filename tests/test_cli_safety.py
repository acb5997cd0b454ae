"""Found when tried as a new user would: one-line errors with exit status 2, ``--replace`` that
deletes only our own directories, temporary directories of killed builds, binary inputs,
``serve`` checking the datastore or table before any engine starts, out-of-vocabulary tables."""

from __future__ import annotations

import gzip
import json
import os
import py_compile
import subprocess
import sys

import numpy as np
import pytest
from test_ngrams import TINY_VOCAB, write_tiny_table

from vllm_retrieval_spec.cli import _check_artifacts_early
from vllm_retrieval_spec.datastores import DatastoreError, TokenDatastore
from vllm_retrieval_spec.datastores.builder import build_datastore
from vllm_retrieval_spec.datastores.format import DATASTORE
from vllm_retrieval_spec.datastores.sources import InputSpec, looks_binary
from vllm_retrieval_spec.ngrams.table import BIGRAM_TOKENS, EXTENDED, NgramTable, NgramTableError
from vllm_retrieval_spec.options import OptionsError, RetrievalSpecOptions
from vllm_retrieval_spec.storage import atomic_directory, build_dir_prefix

CLI = [sys.executable, "-m", "vllm_retrieval_spec.cli"]
REST = json.dumps({"model": "vllm_retrieval_spec.RestProposer", "num_speculative_tokens": 4})
NGRAMMYS = json.dumps({"model": "vllm_retrieval_spec.NGrammysProposer", "num_speculative_tokens": 4})


def run_cli(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def error_line(result: subprocess.CompletedProcess, *named: object) -> str:
    """The one error line of a failed command (after any progress output), naming ``named``."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("vllm-retrieval-spec: error: "), result.stderr
    for name in named:
        assert str(name) in line
    return line


# --replace and existing outputs


def test_replace_never_deletes_a_directory_that_is_not_ours(model_dir, source_tree, tmp_path):
    for name, files in (("mine", {"keep.txt": "my notes"}), ("webapp", {"manifest.json": '{"name": "app"}'})):
        directory = tmp_path / name
        directory.mkdir()
        for file, text in files.items():
            (directory / file).write_text(text)
        with pytest.raises(FileExistsError, match=rf"{directory} is not a datastore .* remove it yourself"):
            build_datastore(model_dir, [InputSpec(source_tree)], directory, replace=True, progress=False)
        result = run_cli("datastore", "build", "--tokenizer", model_dir, "--input", source_tree,
                         "--out", directory, "--replace")
        error_line(result, directory, "not a datastore")
        assert sorted(p.name for p in directory.iterdir()) == sorted(files)
    result = run_cli("ngram-table", "build", "--model", model_dir, "--out", tmp_path / "mine", "--replace")
    error_line(result, tmp_path / "mine", "not an n-gram table")
    assert (tmp_path / "mine" / "keep.txt").read_text() == "my notes"


def test_replace_rebuilds_our_store_or_an_empty_directory(model_dir, source_tree, store, tmp_path):
    (tmp_path / "empty").mkdir()
    for target in (store, tmp_path / "empty"):
        build_datastore(model_dir, [InputSpec(source_tree)], target, replace=True, progress=False)
        assert TokenDatastore.open(target).manifest.num_documents == 1


def test_an_existing_output_fails_naming_it_and_replace(model_dir, source_tree, store, tmp_path):
    result = run_cli("datastore", "build", "--tokenizer", model_dir, "--input", source_tree, "--out", store)
    error_line(result, f"{store} already exists; pass --replace")
    table = write_tiny_table(tmp_path / "table")
    result = run_cli("ngram-table", "build", "--model", model_dir, "--out", table)
    error_line(result, f"{table} already exists; pass --replace")


# temporary directories of killed builds


def test_temporary_directories_record_the_building_process(tmp_path):
    with atomic_directory(tmp_path / "store", kind=DATASTORE) as tmp:
        assert tmp.name.startswith(f".store.tmp-{os.getpid()}@")
        assert tmp.name.startswith(build_dir_prefix(tmp_path / "store"))


def test_a_killed_builds_directory_is_removed_by_the_next_build(model_dir, source_tree, tmp_path):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
    dead_pid = int(finished.stdout)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) as running:
        try:
            out = tmp_path / "store"
            abandoned = [tmp_path / f"{build_dir_prefix(out, role, dead_pid)}ab12cd34" for role in ("tmp", "old")]
            other_store = tmp_path / f"{build_dir_prefix(tmp_path / 'other', 'tmp', dead_pid)}zz99yy88"
            in_progress = tmp_path / f"{build_dir_prefix(out, 'tmp', running.pid)}ef56gh78"
            not_ours = [tmp_path / ".store.tmp-abcdefgh", tmp_path / f".store.tmp-{dead_pid}-abcdefgh"]
            for directory in (*abandoned, other_store, in_progress, *not_ours):
                directory.mkdir()
                (directory / "tokens.bin").write_bytes(b"\0" * 8)
            build_datastore(model_dir, [InputSpec(source_tree)], out, progress=False)
            assert not any(d.exists() for d in (*abandoned, other_store))
            assert in_progress.exists() and all(d.exists() for d in not_ours)
        finally:
            running.kill()


# binary inputs and inputs with nothing to read


def test_binary_files_are_skipped_and_counted(model_dir, source_tree, tmp_path):
    py_compile.compile(str(source_tree / "add.py"), cfile=str(source_tree / "__pycache__" / "add.cpython.pyc"))
    (source_tree / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)))
    report = build_datastore(model_dir, [InputSpec(source_tree)], tmp_path / "store", progress=False)
    assert (report.num_documents, report.files_read, report.files_skipped) == (1, 1, 2)
    build_info = TokenDatastore.open(tmp_path / "store").manifest.build
    assert (build_info["files_read"], build_info["files_skipped_binary"]) == (1, 2)
    result = run_cli("datastore", "build", "--tokenizer", model_dir, "--input", source_tree, "--out", tmp_path / "cli")
    assert result.returncode == 0 and "1 documents from 1 file(s) (2 binary skipped)" in result.stdout


def test_text_or_binary_is_judged_by_nul_bytes_and_utf8():
    assert not looks_binary(b"def f():\n    pass\n")
    assert not looks_binary("naïve café".encode()[:-1])  # a character cut by the sniff window
    assert looks_binary(b"abc\0def")
    assert looks_binary("café au lait".encode("latin-1"))


def test_an_input_with_nothing_to_read_is_an_error(model_dir, source_tree, tmp_path):
    (source_tree / "add.py").unlink()
    (source_tree / "data.bin").write_bytes(bytes(range(256)))
    with pytest.raises(DatastoreError, match=rf"input {source_tree} has nothing to read: its 1 selected file"):
        build_datastore(model_dir, [InputSpec(source_tree)], tmp_path / "store", progress=False)
    with pytest.raises(DatastoreError, match="no file matches its --include/--exclude globs"):
        build_datastore(model_dir, [InputSpec(source_tree, include=("*.py",))], tmp_path / "store", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no store, no temporary directory
    result = run_cli("datastore", "build", "--tokenizer", model_dir, "--input", source_tree, "--out", tmp_path / "s")
    error_line(result, f"input {source_tree} has nothing to read")


# bad input files name the file (and line) and the fix


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [("bad.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n',
      r"bad\.jsonl:2 is not valid UTF-8 .*re-encode the file as UTF-8"),
     ("cut.jsonl.gz", gzip.compress("".join(f'{{"text": "line {i}"}}\n' for i in range(999)).encode())[:999],
      r"cut\.jsonl\.gz is not a valid gzip file or is truncated"),
     ("plain.jsonl.gz", b'{"text": "not gzipped"}\n', r"plain\.jsonl\.gz is not a valid gzip file"),
     ("src.zip", b"PK\x03\x04 not really a zip", r"src\.zip is not a valid zip archive or is truncated"),
     ("chat.jsonl", json.dumps({"messages": [{"role": "user"}]}).encode() + b"\n",
      r"chat\.jsonl:1: the tokenizer's chat template cannot render its 'messages' \(UndefinedError")],
)
def test_bad_input_files_are_named(model_dir, tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DatastoreError, match=message):
        build_datastore(model_dir, [InputSpec(tmp_path / name)], tmp_path / "store", progress=False)


def test_errors_are_one_line_unless_debugging(store):
    manifest = json.loads((store / "manifest.json").read_text())
    (store / "manifest.json").write_text(json.dumps({**manifest, "token_dtype": "int8"}))
    result = run_cli("datastore", "inspect", store)
    line = error_line(result, store / "manifest.json", "'token_dtype' is 'int8'", "rebuild the datastore")
    assert result.stderr == line + "\n"
    for debugging in (run_cli("--debug", "datastore", "inspect", store),
                      run_cli("datastore", "inspect", store, env={"VLLM_RETRIEVAL_SPEC_DEBUG": "1"})):
        assert debugging.returncode != 0 and "Traceback" in debugging.stderr and "DatastoreError" in debugging.stderr
    error_line(run_cli("datastore", "build", "--tokenizer", "x", "--out", store), "give either --recipe")


@pytest.mark.parametrize(
    ("config", "message"),
    [("[1]", "additional_config must be a JSON object"),
     ("{bad", "--additional-config is not valid JSON"),
     ('{"retrieval_spec": {"n_maxx": 3}}', "unknown option(s) 'n_maxx'")],
)
def test_serve_refuses_bad_additional_config_in_one_line(model_dir, config, message):
    error_line(run_cli("serve", model_dir, "--additional-config", config), message)


def test_additional_config_must_be_an_object():
    with pytest.raises(OptionsError, match=r"additional_config must be a JSON object .*got \[1\]"):
        RetrievalSpecOptions.from_additional_config([1])


# serve opens the datastore or table before any engine starts


def test_serve_refuses_a_missing_or_corrupt_datastore_before_starting(model_dir, store, tmp_path):
    missing = tmp_path / "missing-store"
    (store / "tokens.bin").write_bytes((store / "tokens.bin").read_bytes()[:-2])
    for store_dir, named in ((missing, f"{missing} does not exist"), (store, store / "tokens.bin")):
        config = json.dumps({"retrieval_spec": {"datastore": str(store_dir)}})
        result = run_cli("serve", model_dir, "--speculative-config", REST, "--additional-config", config)
        error_line(result, named, "build")


def test_serve_refuses_a_missing_ngram_table_before_starting(model_dir, tmp_path):
    config = json.dumps({"retrieval_spec": {"ngram_table": str(tmp_path / "no-table")}})
    result = run_cli("serve", model_dir, "--speculative-config", NGRAMMYS, f"--additional-config={config}")
    error_line(result, f"no n-gram table at {tmp_path / 'no-table'}", "ngram-table build")


def test_serve_checks_the_store_against_the_served_tokenizer(model_dir, store):
    args = [str(model_dir), "--speculative-config", REST]
    _check_artifacts_early(args, RetrievalSpecOptions(datastore=str(store)))  # the real store and model: fine
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_sha256"] = "0" * 64
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatastoreError, match="was built for tokenizer"):
        _check_artifacts_early(args, RetrievalSpecOptions(datastore=str(store)))


# token ids outside the vocabulary


@pytest.mark.parametrize(("name", "value"), [(EXTENDED, TINY_VOCAB), (BIGRAM_TOKENS, -1)])
def test_a_table_with_out_of_vocabulary_ids_is_refused_naming_the_file(tmp_path, name, value):
    table_dir = write_tiny_table(tmp_path / "table")
    ids = np.fromfile(table_dir / name, dtype=np.int32)
    ids[3] = value
    ids.tofile(table_dir / name)
    with pytest.raises(NgramTableError, match=rf"{name} holds token ids outside the vocabulary \[0, {TINY_VOCAB}\)"):
        NgramTable.open(table_dir)


def test_a_store_with_ids_beyond_its_recorded_vocabulary_is_refused(store):
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_size"] = 10
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatastoreError, match=r"tokens\.bin holds token ids >= the vocabulary size 10"):
        TokenDatastore.open(store)
