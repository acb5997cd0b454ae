"""Safe by construction (issue 21): ``--replace`` deletes only the files a build wrote; every
value read from a manifest, and every build option, is checked (type and range) before it is
used, and a bad one gives one line naming the file or flag; ``serve`` refuses an unknown
proposer or draft count before any engine starts; empty inputs, unwritable outputs and
tokenizers that are no directory are named as such."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_cli_safety import NGRAMMYS, REST, error_line, run_cli
from test_ngrams import write_tiny_table

from vllm_retrieval_spec.cli import CommandLineError, _check_draft_count, _speculative_config, check_serve_arguments
from vllm_retrieval_spec.datastores import DatastoreError, TokenDatastore
from vllm_retrieval_spec.datastores.builder import build_datastore
from vllm_retrieval_spec.datastores.format import DATASTORE
from vllm_retrieval_spec.datastores.sources import InputSpec
from vllm_retrieval_spec.ngrams.table import BIGRAM_PROBS, BIGRAM_TOKENS, EXTENDED, NgramTable, NgramTableError
from vllm_retrieval_spec.ngrams.table import check_build_options as check_table_options
from vllm_retrieval_spec.storage import MANIFEST, atomic_directory, sha256_of_file

from vrs_artifacts import write_dense_store

DRESD = json.dumps({"model": "vllm_retrieval_spec.DReSDProposer", "num_speculative_tokens": 4})
HYBRID = json.dumps({"model": "vllm_retrieval_spec.HybridProposer", "num_speculative_tokens": 4})
USER_FILES = {"photo.jpg": b"\xff\xd8\xff my holiday", "thesis.tex": b"\\chapter{Five years of work}"}


def contents(directory: Path) -> dict[str, bytes]:
    """Every file of ``directory`` (recursively) and its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def edit_manifest(directory: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    manifest = json.loads((directory / MANIFEST).read_text())
    edit(manifest)
    (directory / MANIFEST).write_text(json.dumps(manifest))
    return directory


# --replace deletes only what a build wrote


def users_folder(path: Path, manifest_of: Path) -> Path:
    """A user's folder holding a copy of a store's manifest next to their own files."""
    path.mkdir()
    shutil.copy(manifest_of / MANIFEST, path / MANIFEST)
    for name, data in USER_FILES.items():
        (path / name).write_bytes(data)
    return path


@pytest.fixture()
def manifests(store, tmp_path) -> dict[str, Path]:
    """An artifact of each kind whose manifest a user may have copied."""
    return {"datastore": store, "n-gram table": write_tiny_table(tmp_path / "table"),
            "dense datastore": write_dense_store(tmp_path / "dense")}


@pytest.mark.parametrize(("kind", "command"), [
    ("datastore", ["datastore", "build", "--tokenizer", "{model}", "--input", "{src}"]),
    ("n-gram table", ["ngram-table", "build", "--model", "{model}"]),
    ("dense datastore", ["datastore", "build-dense", "--model", "{model}", "--input", "{src}"]),
    ("datastore", ["datastore", "from-server", "--url", "http://127.0.0.1:9", "--prompts", "{prompts}",
                   "--model", "{model}"]),
])
def test_replace_refuses_a_users_folder_holding_a_copied_manifest(model_dir, source_tree, manifests, tmp_path,
                                                                   kind, command):
    folder = users_folder(tmp_path / "my-folder", manifests[kind])
    before = contents(folder)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "def add("}\n')
    values = {"model": model_dir, "src": source_tree, "prompts": tmp_path / "prompts.jsonl"}
    result = run_cli(*(arg.format(**values) for arg in command), "--out", folder, "--replace")
    line = error_line(result, folder, "'photo.jpg', 'thesis.tex'", f"its {kind} manifest.json does not list")
    assert "--replace will not delete it" in line
    assert contents(folder) == before


def test_replace_refuses_a_store_holding_a_users_file_and_keeps_both(model_dir, source_tree, store):
    (store / "notes.txt").write_text("my notes")
    (store / "drafts").mkdir()
    (store / "drafts" / "draft.txt").write_text("a draft")
    before = contents(store)
    with pytest.raises(FileExistsError, match=rf"{store} holds 'drafts', 'notes\.txt', which its datastore "
                                              r"manifest\.json does not list"):
        build_datastore(model_dir, [InputSpec(source_tree)], store, replace=True, progress=False)
    assert contents(store) == before
    TokenDatastore.open(store).check_fully()


def test_replace_rebuilds_a_store_holding_only_its_files(model_dir, source_tree, store, tmp_path):
    (source_tree / "sub.py").write_text("def sub(a, b):\n    return a - b\n")
    result = run_cli("datastore", "build", "--tokenizer", model_dir, "--input", source_tree, "--out", store,
                     "--replace")
    assert result.returncode == 0, result.stderr
    rebuilt = TokenDatastore.open(store)
    rebuilt.check_fully()
    assert rebuilt.manifest.num_documents == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "store"]  # nothing set aside or left over


def test_a_manifest_listing_a_users_file_neither_opens_nor_lets_replace_delete_it(model_dir, source_tree, store):
    (store / "thesis.tex").write_bytes(USER_FILES["thesis.tex"])
    record = {"bytes": len(USER_FILES["thesis.tex"]), "sha256": sha256_of_file(store / "thesis.tex")}
    edit_manifest(store, lambda manifest: manifest["files"].update({"thesis.tex": record}))
    with pytest.raises(DatastoreError, match=r"'files' lists 'thesis\.tex', not one of tokens\.bin, suffix_array"):
        TokenDatastore.open(store)
    with pytest.raises(FileExistsError, match=r"holds 'thesis\.tex'"):
        build_datastore(model_dir, [InputSpec(source_tree)], store, replace=True, progress=False)
    assert (store / "thesis.tex").read_bytes() == USER_FILES["thesis.tex"]


def test_files_put_into_the_target_during_a_build_are_kept(store, tmp_path):
    with pytest.raises(FileExistsError, match=r"holds 'notes\.txt'"), \
            atomic_directory(store, replace=True, kind=DATASTORE) as tmp:
        (tmp / "tokens.bin").write_bytes(b"")
        (store / "notes.txt").write_text("written while the build ran")
    assert (store / "notes.txt").read_text() == "written while the build ran"
    TokenDatastore.open(store)
    target = tmp_path / "new"
    with pytest.raises(FileExistsError, match="already exists; pass --replace"), \
            atomic_directory(target, kind=DATASTORE):
        target.mkdir()
        (target / "notes.txt").write_text("made by someone else meanwhile")
    assert contents(target) == {"notes.txt": b"made by someone else meanwhile"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "src", "store"]


def test_replace_leaves_a_symbolic_link_and_its_target_alone(model_dir, source_tree, store, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(store)
    with pytest.raises(FileExistsError, match=rf"{link} is a symbolic link, so --replace will not replace it"):
        build_datastore(model_dir, [InputSpec(source_tree)], link, replace=True, progress=False)
    assert link.is_symlink() and TokenDatastore.open(store)


# values read from manifests: type and range, one line through every command


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m["tokenizer"].update(vocab_size="49152"), r"'tokenizer\.vocab_size' is '49152', not int"),
    (lambda m: m["tokenizer"].update(vocab_size=1e12), r"'tokenizer\.vocab_size' is 1000000000000\.0, not int"),
    (lambda m: m["tokenizer"].update(vocab_size=10**12),
     r"'tokenizer\.vocab_size' must be an integer in \[1, 65535\], got 1000000000000"),
    (lambda m: m["tokenizer"].update(vocab_size=True), r"'tokenizer\.vocab_size' is True, not int"),
    (lambda m: m.update(num_documents=-1), r"'num_documents' must be an integer in \[0, "),
    (lambda m: m["files"].update({"tokens.bin": "abc"}), r"'files' entry 'tokens\.bin' is 'abc', not \{\"bytes\""),
    (lambda m: m["files"]["tokens.bin"].pop("bytes"), r"'files' entry 'tokens\.bin' is \{'sha256'"),
    (lambda m: m["files"].update({"../photo.jpg": {"bytes": 1, "sha256": "0" * 64}}),
     r"'files' lists '\.\./photo\.jpg', not one of tokens\.bin, suffix_array\.bin"),
])
def test_a_bad_datastore_manifest_value_is_one_line_naming_the_key(store, edit, message):
    manifest = edit_manifest(store, edit) / MANIFEST
    with pytest.raises(DatastoreError, match=message):
        TokenDatastore.open(store)
    line = error_line(run_cli("datastore", "inspect", "--full", store), manifest, "rebuild the datastore")
    assert re.search(message, line)


@pytest.mark.parametrize("vocab_size", ["49152", 1e12])
def test_serve_refuses_a_bad_manifest_value_in_the_same_line(model_dir, store, vocab_size):
    edit_manifest(store, lambda m: m["tokenizer"].update(vocab_size=vocab_size))
    config = json.dumps({"retrieval_spec": {"datastore": str(store)}})
    result = run_cli("serve", model_dir, "--speculative-config", REST, "--additional-config", config)
    error_line(result, store / MANIFEST, "'tokenizer.vocab_size' is", "rebuild the datastore")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m["index"].update(nprobe=4), "index type 'flat' takes no 'index.nprobe', which is 4"),
    (lambda m: m["index"].update(type="ivf_flat"), "index type 'ivf_flat' needs 'index.nlist'"),
    (lambda m: m["model"].update(vocab_size="40"), "'model.vocab_size' is '40', not int"),
    (lambda m: m["files"].update({"values.bin": 5}), "'files' entry 'values.bin' is 5"),
])
def test_a_bad_dense_manifest_is_one_line_in_inspect_and_serve(model_dir, tmp_path, edit, message):
    dense = edit_manifest(write_dense_store(tmp_path / "dense"), edit)
    error_line(run_cli("datastore", "inspect", dense), dense / MANIFEST, message, "rebuild the dense datastore")
    config = json.dumps({"retrieval_spec": {"dense_datastore": str(dense)}})
    error_line(run_cli("serve", model_dir, "--speculative-config", DRESD, "--additional-config", config),
               dense / MANIFEST, message)


def test_hybrid_serve_checks_its_dense_store_after_its_datastore(model_dir, store, tmp_path):
    dense = edit_manifest(write_dense_store(tmp_path / "dense"), lambda m: m["index"].update(nprobe=4))
    config = json.dumps({"retrieval_spec": {"datastore": str(store), "dense_datastore": str(dense)}})
    error_line(run_cli("serve", model_dir, "--speculative-config", HYBRID, "--additional-config", config),
               dense / MANIFEST, "index type 'flat' takes no 'index.nprobe', which is 4")


@pytest.mark.parametrize("place", ["a file", "under a file"])
def test_serve_refuses_an_output_index_path_no_save_could_write(model_dir, store, tmp_path, place):
    """Where every save would fail (the index it learned lost at each restart), serve refuses at
    once; with the output index off the path is not used, and not checked."""
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    path = taken if place == "a file" else taken / "snapshots"
    options = {"datastore": str(store), "output_index_path": str(path)}
    config = json.dumps({"retrieval_spec": options})
    error_line(run_cli("serve", model_dir, "--speculative-config", REST, "--additional-config", config),
               "retrieval_spec.output_index_path: cannot write", path / "snapshot-00000000",
               f"{taken} is not a directory")
    off = json.dumps({"retrieval_spec": options | {"use_output_index": False}})
    check_serve_arguments([str(model_dir), "--speculative-config", REST, "--additional-config", off])
    assert taken.read_text() == "mine"


@pytest.mark.parametrize(("changes", "emptied", "message"), [
    ({"k": 0}, (BIGRAM_TOKENS, BIGRAM_PROBS, EXTENDED), r"'k' must be an integer in \[1, 10\], got 0"),
    ({"w": 0}, (EXTENDED,), r"'w' must be an integer >= 1, got 0"),
    ({"k": 11}, (), r"'k' must be an integer in \[1, 10\], got 11"),
    ({"prefix": [99999999]}, (), r"'prefix\[0\]' must be an integer in \[0, 9\], got 99999999"),
    ({"files": {BIGRAM_TOKENS: 7}}, (), r"'files' entry 'bigram_tokens\.bin' is 7, not a sha256 in hex"),
])
def test_an_ngram_table_that_would_never_draft_is_refused_at_open(model_dir, tmp_path, changes, emptied, message):
    table = write_tiny_table(tmp_path / "table", **changes)
    for name in emptied:  # files that agree with the manifest's k or w of 0, so nothing else fails
        (table / name).write_bytes(b"")
    with pytest.raises(NgramTableError, match=rf"{table / MANIFEST} is corrupt \({message}\); rebuild"):
        NgramTable.open(table)
    if changes.get("k") == 0:
        config = json.dumps({"retrieval_spec": {"ngram_table": str(table)}})
        result = run_cli("serve", model_dir, "--speculative-config", NGRAMMYS, "--additional-config", config)
        error_line(result, table / MANIFEST, "'k' must be an integer in [1, 10], got 0")


@pytest.mark.parametrize("value", [float("nan"), -0.5, 1.5])
def test_bigram_probabilities_must_be_probabilities(tmp_path, value):
    table = write_tiny_table(tmp_path / "table")
    probs = np.fromfile(table / BIGRAM_PROBS, dtype=np.float32)
    probs[4] = value
    probs.tofile(table / BIGRAM_PROBS)
    with pytest.raises(NgramTableError, match=r"bigram_probs\.bin holds values that are no probabilities"):
        NgramTable.open(table)


# build options, before the first forward pass


@pytest.mark.parametrize(("option", "message"), [
    (("--k", "60000"), "--k must be an integer in [1, 49152], got 60000"),
    (("--prefix", "99999999"), "--prefix[0] must be an integer in [0, 49151], got 99999999"),
    (("--w", "0"), "--w must be an integer >= 1, got 0"),
    (("--tokens", "0"), "--tokens must be an integer in [1, 49152], got 0"),
])
def test_bad_ngram_table_options_fail_before_the_model_runs(model_dir, tmp_path, option, message):
    result = run_cli("ngram-table", "build", "--model", model_dir, "--out", tmp_path / "table", *option)
    error_line(result, message)
    assert "bigram" not in result.stderr and not (tmp_path / "table").exists()  # no vocabulary pass ran


@pytest.mark.parametrize(("options", "message"), [
    ({"k": 0}, r"--k must be an integer in \[1, 100\], got 0"),
    ({"w": -2}, r"--w must be an integer >= 1, got -2"),
    ({"batch_size": 0}, r"--batch-size must be an integer >= 1, got 0"),
    ({"prefix": [-1]}, r"--prefix\[0\] must be an integer in \[0, 99\], got -1"),
    ({"tokens": 101}, r"--tokens must be an integer in \[1, 100\], got 101"),
])
def test_ngram_table_options_are_checked_with_their_flag(options, message):
    values = {"k": 3, "w": 4, "batch_size": 8, "prefix": [], "vocab_size": 100, "tokens": 100} | options
    with pytest.raises(ValueError, match=message):
        check_table_options(**values)


@pytest.mark.parametrize(("option", "message"), [
    (("--concurrency", "0"), "--concurrency must be an integer >= 1, got 0"),
    (("--retries", "-1"), "--retries must be an integer >= 0, got -1"),
    (("--temperature", "-0.5"), "--temperature must be >= 0, got -0.5"),
])
def test_bad_from_server_options_are_named(model_dir, tmp_path, option, message):
    result = run_cli("datastore", "from-server", "--url", "http://127.0.0.1:9", "--prompts", tmp_path / "p.jsonl",
                     "--out", tmp_path / "store", "--model", model_dir, *option)
    error_line(result, message)


@pytest.mark.parametrize(("command", "message"), [
    (("bogus",), "vllm-retrieval-spec: error: argument command: invalid choice: 'bogus'"),
    (("datastore", "remove", "/tmp"), "vllm-retrieval-spec datastore remove: error: the following arguments are "
                                      "required: --document (see vllm-retrieval-spec datastore remove --help)"),
    (("demo", "--prompts", "abc"), "vllm-retrieval-spec demo: error: argument --prompts: invalid int value: 'abc'"),
])
def test_a_usage_error_is_one_line_naming_the_commands_help(command, message):
    result = run_cli(*command)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [result.stderr.strip()] and result.stderr.startswith(message)
    assert result.stderr.rstrip().endswith("--help)")


# demo: refused before any server starts


@pytest.mark.parametrize(("option", "message"), [
    (("--prompts", "0"), "--prompts must be an integer in [1, 164], got 0"),
    (("--max-tokens", "5000"), "--max-tokens must be an integer in [1, 1024], got 5000"),
    (("--num-speculative-tokens", "129"), "--num-speculative-tokens must be an integer in [1, 128], got 129"),
    (("--show", "-1"), "--show must be an integer >= 0, got -1"),
])
def test_bad_demo_options_fail_before_any_server_starts(option, message):
    result = run_cli("demo", *option)
    error_line(result, message)
    assert "starting vLLM" not in result.stdout


def test_the_demo_refuses_a_missing_datastore_before_any_server_starts(model_dir, tmp_path):
    result = run_cli("demo", "--datastore", tmp_path / "missing")
    error_line(result, tmp_path / "missing")
    assert "starting vLLM" not in result.stdout


# serve: late engine failures refused before any engine starts


def speculative(config: object) -> list[str]:
    return ["/some/model", "--speculative-config", json.dumps(config)]


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "custom_class", "model": "vllm_retrieval_spec.NoSuchProposer"},
     r"'vllm_retrieval_spec\.NoSuchProposer' is no proposer of this package; use one of "
     r"vllm_retrieval_spec\.PromptLookupProposer, vllm_retrieval_spec\.RestProposer"),
    ({"model": "no_such_package.MyProposer", "num_speculative_tokens": 4},
     r"names module 'no_such_package', which is not installed"),
    ({"method": "custom_class", "num_speculative_tokens": 4}, r"method custom_class needs a 'model'"),
    ([1], r"--speculative-config must be a JSON object such as"),
])
def test_serve_refuses_an_unknown_proposer_class(config, message):
    with pytest.raises(CommandLineError, match=message):
        _speculative_config(speculative(config))


def test_serve_refuses_an_unknown_proposer_at_once(model_dir):
    config = json.dumps({"method": "custom_class", "model": "vllm_retrieval_spec.NoSuchProposer"})
    result = run_cli("serve", model_dir, "--speculative-config", config)
    error_line(result, "'vllm_retrieval_spec.NoSuchProposer' is no proposer of this package")
    assert "EngineCore" not in result.stdout + result.stderr  # refused before any engine started


def test_serve_refuses_zero_drafts_for_any_proposer(model_dir):
    config = {"method": "ngram", "num_speculative_tokens": 0, "prompt_lookup_max": 3}
    with pytest.raises(CommandLineError, match=r"num_speculative_tokens must be an integer >= 1, got 0"):
        _check_draft_count(_speculative_config(speculative(config)))
    _check_draft_count(_speculative_config(speculative({"method": "ngram", "num_speculative_tokens": 3})))
    error_line(run_cli("serve", model_dir, "--speculative-config", json.dumps(config)),
               "num_speculative_tokens must be an integer >= 1, got 0")


# messages that say what is wrong


def test_an_empty_input_directory_is_called_empty(model_dir, source_tree, tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_cli("datastore", "build", "--tokenizer", model_dir, "--input", tmp_path / "empty", "--out",
                     tmp_path / "store")
    error_line(result, f"input {tmp_path / 'empty'} has nothing to read: the directory is empty")
    with pytest.raises(DatastoreError, match=r"no file matches its --include/--exclude globs \(--include '\*\.md' "
                                             r"--exclude 'x\*'\); change the globs"):
        build_datastore(model_dir, [InputSpec(source_tree, ("*.md",), ("x*",))], tmp_path / "store", progress=False)


@pytest.mark.parametrize(("tokenizer", "message"), [
    ("{tmp}/no-such-model", "--tokenizer {tmp}/no-such-model does not exist; give a model directory"),
    ("SmolLM2-135M-Instruct", "--tokenizer SmolLM2-135M-Instruct does not exist (a name is not looked up on the "
                              "Hugging Face Hub"),
    ("{src}/add.py", "--tokenizer {src}/add.py is not a directory"),
    ("{src}", "--tokenizer {src} holds no tokenizer.json or tokenizer_config.json, so it is not a model directory"),
])
def test_a_tokenizer_that_is_no_model_directory_is_named_at_once(source_tree, tmp_path, tokenizer, message):
    values = {"tmp": tmp_path, "src": source_tree}
    result = run_cli("datastore", "build", "--tokenizer", tokenizer.format(**values), "--input", source_tree,
                     "--out", tmp_path / "store", env={"HF_HUB_OFFLINE": "0"})
    error_line(result, message.format(**values))
    assert "huggingface.co" not in result.stderr and "etrying" not in result.stderr  # no Hub lookups or retries


def test_a_model_name_is_not_a_model_directory(tmp_path):
    result = run_cli("ngram-table", "build", "--model", "SmolLM2-135M-Instruct", "--out", tmp_path / "table")
    error_line(result, "--model SmolLM2-135M-Instruct does not exist (a name is not looked up")


def test_an_output_under_a_file_is_named(model_dir, source_tree, tmp_path):
    (tmp_path / "notes.txt").write_text("a file")
    result = run_cli("datastore", "build", "--tokenizer", model_dir, "--input", source_tree, "--out",
                     tmp_path / "notes.txt" / "store")
    error_line(result, f"cannot write {tmp_path / 'notes.txt' / 'store'}: {tmp_path / 'notes.txt'} is not a directory")


def test_an_unwritable_output_directory_is_named_not_its_temporary_directory(model_dir, source_tree, tmp_path,
                                                                             monkeypatch):
    def refuse(*args: object, **kwargs: object) -> str:
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / ".store.tmp-1@host-abcdefgh"))

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(OSError, match=rf"^cannot write {tmp_path / 'store'}: {tmp_path}: Permission denied; choose "
                                      r"another output directory or fix its permissions$"):
        build_datastore(model_dir, [InputSpec(source_tree)], tmp_path / "store", progress=False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_output_directory_is_refused_before_any_work(model_dir, source_tree, tmp_path):
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    result = run_cli("datastore", "build", "--tokenizer", model_dir, "--input", source_tree, "--out",
                     read_only / "store")
    error_line(result, f"cannot write {read_only / 'store'}: {read_only} is not writable")

