"""Datastores: building (streaming, atomic, deterministic), opening, and every bad input."""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from vllm_retrieval_spec.datastores import DatastoreError, TokenDatastore, TokenizerIdentity
from vllm_retrieval_spec.datastores.builder import build_datastore, load_tokenizer
from vllm_retrieval_spec.datastores.format import token_dtype_for
from vllm_retrieval_spec.datastores.resolve import resolve_datastore_dir, tokenizer_identity
from vllm_retrieval_spec.datastores.sources import InputSpec, split_long_document
from vllm_retrieval_spec.options import OptionsError

from conftest import fake_vllm_config

DOCS = {
    "a.py": "def add(a, b):\n    return a + b\n",
    "pkg/b.py": "def sub(a, b):\n    return a - b\n",
    "pkg/tests/test_b.py": "assert sub(2, 1) == 1\n",
    "notes.txt": "not python\n",
}


@pytest.fixture()
def source_tree(tmp_path) -> Path:
    root = tmp_path / "src"
    for name, text in DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def read_documents(store: TokenDatastore, tokenizer) -> list[str]:
    tokens = np.asarray(store.tokens).tolist()
    documents, current = [], []
    for token in tokens:
        if token == store.separator:
            documents.append(tokenizer.decode(current))
            current = []
        else:
            current.append(token)
    return documents


def test_directory_with_globs_builds_a_valid_store(model_dir, source_tree, tmp_path):
    spec = InputSpec(source_tree, include=("*.py",), exclude=("*/tests/*",))
    report = build_datastore(model_dir, [spec], tmp_path / "store", progress=False)
    store = TokenDatastore.open(tmp_path / "store", expected_tokenizer=tokenizer_identity(model_dir))
    assert report.num_documents == 2 and store.manifest.num_documents == 2
    assert store.tokens.dtype == np.uint16 and store.suffix_array.dtype == np.int32
    assert read_documents(store, load_tokenizer(model_dir)) == [DOCS["a.py"], DOCS["pkg/b.py"]]
    ordered = [np.asarray(store.tokens[p:]).tolist() for p in store.suffix_array]
    assert ordered == sorted(ordered)
    assert isinstance(store.tokens, np.memmap) and not store.tokens.flags.writeable
    store.check_fully()


def test_jsonl_text_and_chat_messages_zip_and_gzip(model_dir, tmp_path):
    records = [
        {"text": "plain text record"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    ]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    with gzip.open(tmp_path / "more.jsonl.gz", "wt") as handle:
        handle.write(json.dumps({"body": "gzipped"}) + "\n")
    with zipfile.ZipFile(tmp_path / "src.zip", "w") as archive:
        archive.writestr("x/Main.java", "class Main {}\n")
        archive.writestr("x/readme.md", "skip me\n")
    inputs = [
        InputSpec(tmp_path / "data.jsonl"),
        InputSpec(tmp_path / "more.jsonl.gz", text_field="body"),
        InputSpec(tmp_path / "src.zip", include=("*.java",)),
    ]
    build_datastore(model_dir, inputs, tmp_path / "store", progress=False)
    store = TokenDatastore.open(tmp_path / "store")
    tokenizer = load_tokenizer(model_dir)
    documents = read_documents(store, tokenizer)
    assert documents[0] == "plain text record"
    assert documents[1] == tokenizer.apply_chat_template(records[1]["messages"], tokenize=False)
    assert documents[2:] == ["gzipped", "class Main {}\n"]


def test_bad_jsonl_names_the_file_and_line(model_dir, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"title": "no text"}\n')
    with pytest.raises(DatastoreError, match=r"bad\.jsonl:2 has neither a string field 'text'"):
        build_datastore(model_dir, [InputSpec(tmp_path / "bad.jsonl")], tmp_path / "store", progress=False)
    assert not (tmp_path / "store").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]  # no temporary directory left


def test_builds_are_deterministic_and_existing_stores_are_kept(model_dir, source_tree, tmp_path):
    spec = [InputSpec(source_tree, include=("*.py",))]
    build_datastore(model_dir, spec, tmp_path / "one", progress=False)
    build_datastore(model_dir, spec, tmp_path / "two", progress=False)
    one, two = TokenDatastore.open(tmp_path / "one"), TokenDatastore.open(tmp_path / "two")
    assert one.manifest.files == two.manifest.files
    with pytest.raises(FileExistsError, match="already exists"):
        build_datastore(model_dir, spec, tmp_path / "one", progress=False)
    build_datastore(model_dir, spec, tmp_path / "one", replace=True, progress=False)


@pytest.fixture()
def built_store(model_dir, source_tree, tmp_path) -> Path:
    build_datastore(model_dir, [InputSpec(source_tree, include=("*.py",))], tmp_path / "store", progress=False)
    return tmp_path / "store"


def test_truncated_token_file_is_named(built_store):
    path = built_store / "tokens.bin"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(DatastoreError, match=r"tokens\.bin is truncated or corrupt"):
        TokenDatastore.open(built_store)


def test_missing_suffix_array_is_named(built_store):
    (built_store / "suffix_array.bin").unlink()
    with pytest.raises(DatastoreError, match=r"suffix_array\.bin is missing"):
        TokenDatastore.open(built_store)


def test_scrambled_suffix_array_is_detected(built_store):
    path = built_store / "suffix_array.bin"
    values = np.fromfile(path, dtype=np.int32)
    values[::-1].tofile(path)
    with pytest.raises(DatastoreError, match=r"suffix_array\.bin \(or tokens\.bin\) is corrupt"):
        TokenDatastore.open(built_store)


def test_corrupt_manifest_is_named(built_store):
    (built_store / "manifest.json").write_text("{ not json")
    with pytest.raises(DatastoreError, match=r"manifest\.json is corrupt"):
        TokenDatastore.open(built_store)


def rewrite_manifest(store_dir: Path, drop: tuple[str, ...] = (), **changes: object) -> None:
    """Change or ``drop`` keys of a store's manifest."""
    manifest = json.loads((store_dir / "manifest.json").read_text())
    manifest.update(changes)
    for key in drop:
        del manifest[key]
    (store_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"token_dtype": "float32"},
      r"manifest\.json: 'token_dtype' is 'float32', not one of the dtypes uint16, uint32; rebuild the datastore"),
     ({"suffix_array_dtype": "uint8"},
      r"manifest\.json: 'suffix_array_dtype' is 'uint8', not one of the dtypes int32, int64; rebuild the datastore"),
     ({"num_tokens": "12"}, r"manifest\.json is corrupt \('num_tokens' is '12'\); rebuild the datastore"),
     ({"format_version": 99}, r"manifest\.json has format version 99, this package reads version 1; rebuild"),
     ({"extra": 1}, r"manifest\.json is corrupt \(.*unexpected keyword argument 'extra'\)")],
)
def test_bad_manifest_values_name_the_manifest_and_key(built_store, changes, message):
    rewrite_manifest(built_store, **changes)
    with pytest.raises(DatastoreError, match=message):
        TokenDatastore.open(built_store)


def test_a_missing_manifest_key_is_named(built_store):
    rewrite_manifest(built_store, drop=("token_dtype",))
    with pytest.raises(DatastoreError, match=r"manifest\.json is corrupt \(missing key\(s\) 'token_dtype'\)"):
        TokenDatastore.open(built_store)


def test_a_suffix_array_of_the_wrong_length_names_the_file_and_sizes(built_store):
    manifest = json.loads((built_store / "manifest.json").read_text())
    path = built_store / "suffix_array.bin"
    path.write_bytes(path.read_bytes() + b"\0" * 4)
    expected = 4 * manifest["num_tokens"]
    with pytest.raises(DatastoreError, match=rf"suffix_array\.bin is truncated or corrupt: {expected + 4} bytes, the "
                                             rf"manifest says {manifest['num_tokens']} x int32 = {expected} bytes"):
        TokenDatastore.open(built_store)


def test_content_differing_from_the_manifest_fails_the_full_check(built_store):
    files = json.loads((built_store / "manifest.json").read_text())["files"]
    files["tokens.bin"]["sha256"] = "0" * 64
    rewrite_manifest(built_store, files=files)
    store = TokenDatastore.open(built_store)
    with pytest.raises(DatastoreError, match=r"tokens\.bin is corrupt: sha256"):
        store.check_fully()


def test_not_a_datastore(tmp_path):
    with pytest.raises(DatastoreError, match="is not a datastore; build one with"):
        TokenDatastore.open(tmp_path)


@pytest.fixture(scope="module")
def other_tokenizer_dir(tmp_path_factory) -> Path:
    """A real, different tokenizer: byte-level BPE trained on the standard library's sources."""
    import sysconfig

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:40]]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel()
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2000, show_progress=False))
    out = tmp_path_factory.mktemp("other-tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(out)
    return out


def test_wrong_tokenizer_names_both_tokenizers(model_dir, source_tree, other_tokenizer_dir, tmp_path):
    build_datastore(other_tokenizer_dir, [InputSpec(source_tree)], tmp_path / "store", progress=False)
    with pytest.raises(DatastoreError, match=r"built for tokenizer 'other-tokenizer.*served with tokenizer 'SmolLM2"):
        TokenDatastore.open(tmp_path / "store", expected_tokenizer=tokenizer_identity(model_dir))


def test_rest_proposer_refuses_a_store_of_another_tokenizer_at_engine_start(
    model_dir, source_tree, other_tokenizer_dir, tmp_path
):
    from vllm_retrieval_spec.proposers.rest import RestProposer

    build_datastore(other_tokenizer_dir, [InputSpec(source_tree)], tmp_path / "store", progress=False)
    config = fake_vllm_config(max_model_len=64, options={"datastore": str(tmp_path / "store")},
                              tokenizer=str(model_dir))
    with pytest.raises(DatastoreError, match="rebuild it with `vllm-retrieval-spec datastore build"):
        RestProposer(config)


def test_vocabulary_too_large_for_token_storage():
    assert token_dtype_for(49152) == np.uint16
    assert token_dtype_for(65535) == np.uint32  # 65535 is the uint16 separator
    with pytest.raises(DatastoreError, match="does not fit uint32"):
        token_dtype_for(2**32)


def test_unbuilt_recipe_and_unknown_name_say_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_RETRIEVAL_SPEC_CACHE", str(tmp_path))
    identity = TokenizerIdentity("tok", 10, "ab" * 32)
    with pytest.raises(DatastoreError, match="datastore build --recipe python-code"):
        resolve_datastore_dir("python-code", identity)
    with pytest.raises(DatastoreError, match="neither a directory nor a recipe"):
        resolve_datastore_dir("no-such-store", identity)


def test_rest_options_are_validated():
    from vllm_retrieval_spec.options import RetrievalSpecOptions

    with pytest.raises(OptionsError, match="both false"):
        RetrievalSpecOptions.from_dict({"use_datastore": False, "use_context": False})
    with pytest.raises(OptionsError, match=r"retrieval_spec\.use_context must be true or false"):
        RetrievalSpecOptions.from_dict({"use_context": "yes"})
    with pytest.raises(OptionsError, match=r"retrieval_spec\.min_ratio must be a number in \[0\.0, 1\.0\]"):
        RetrievalSpecOptions.from_dict({"min_ratio": 2})


def test_long_documents_are_split_at_newlines():
    text = "ab\n" * 10
    pieces = list(split_long_document(text, limit=7))
    assert "".join(pieces) == text and all(len(p) <= 7 for p in pieces)
    assert all(p.endswith("\n") for p in pieces)


def test_command_line_build_and_inspect(model_dir, source_tree, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "cli-store"
    cli = [sys.executable, "-m", "vllm_retrieval_spec.cli", "datastore"]
    build = subprocess.run(
        [*cli, "build", "--tokenizer", str(model_dir), "--input", str(source_tree),
         "--include", "*.py", "--exclude", "*/tests/*", "--out", str(out)],
        capture_output=True, text=True, check=True,
    )
    assert "2 documents" in build.stdout and "bytes/token" in build.stdout
    inspect = subprocess.run([*cli, "inspect", str(out), "--full"], capture_output=True, text=True, check=True)
    assert "format version 1" in inspect.stdout and "checksums: ok" in inspect.stdout
    again = subprocess.run([*cli, "build", "--tokenizer", str(model_dir), "--input", str(source_tree),
                            "--out", str(out)], capture_output=True, text=True)
    assert again.returncode == 2 and f"{out} already exists; pass --replace" in again.stderr


def test_token_ids_beyond_the_vocabulary_are_refused():
    from vllm_retrieval_spec.datastores.reader import first_token_offsets

    tokens = np.array([1, 2, 65535, 9, 65535], dtype=np.uint16)
    assert first_token_offsets(tokens, 65535, 10).tolist() == [0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 3]
    with pytest.raises(DatastoreError, match="token ids >= the vocabulary size 5"):
        first_token_offsets(tokens, 65535, 5, "tokens.bin")
