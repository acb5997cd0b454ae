"""The shared reader of artifact directories: manifests, memory maps, checksums."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vllm_retrieval_spec.storage import (
    ArtifactKind,
    StorageError,
    TokenizerIdentity,
    _fast_tokenizer,
    file_records,
    map_array,
    read_manifest,
    verify_file_records,
    write_manifest,
)


class ThingError(StorageError):
    """Errors of the test artifact."""


THING = ArtifactKind(noun="thing", article="a", format_version=3, error=ThingError,
                     build_command="`make thing`", required={"count": int}, dtypes={"dtype": ("int32",)})


def test_a_valid_manifest_round_trips(tmp_path):
    write_manifest(tmp_path, {"format_version": 3, "count": 2, "dtype": "int32"})
    assert read_manifest(tmp_path, THING) == {"format_version": 3, "count": 2, "dtype": "int32"}
    assert (tmp_path / "manifest.json").read_text().endswith("}\n")


@pytest.mark.parametrize(
    ("text", "message"),
    [(None, r"manifest\.json not found: .* is not a thing; build one with `make thing`"),
     ("[1]", r"manifest\.json is corrupt \(not a JSON object\); rebuild the thing"),
     ('{"format_version": 3, "dtype": "int32"}', r"manifest\.json is corrupt \(missing key\(s\) 'count'\)"),
     ('{"format_version": 3, "count": 1, "dtype": "int8"}',
      r"manifest\.json: 'dtype' is 'int8', not one of the dtypes int32; rebuild the thing")],
)
def test_bad_manifests_name_the_file_and_the_fix(tmp_path, text, message):
    if text is not None:
        (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(ThingError, match=message):
        read_manifest(tmp_path, THING)


def test_arrays_are_mapped_read_only_with_their_shape(tmp_path):
    np.arange(6, dtype=np.int32).tofile(tmp_path / "a.bin")
    array = map_array(tmp_path / "a.bin", "int32", (2, 3), THING)
    assert array.tolist() == [[0, 1, 2], [3, 4, 5]] and not array.flags.writeable
    empty = map_array(_empty_file(tmp_path / "e.bin"), np.int32, (0,), THING)
    assert empty.shape == (0,) and not empty.flags.writeable


def test_a_truncated_file_is_named_with_both_sizes(tmp_path):
    np.arange(5, dtype=np.int32).tofile(tmp_path / "a.bin")
    with pytest.raises(ThingError, match=r"a\.bin is truncated or corrupt: 20 bytes, the manifest says "
                                         r"2 x 3 x int32 = 24 bytes; rebuild the thing"):
        map_array(tmp_path / "a.bin", np.int32, (2, 3), THING)


def test_checksums_are_recorded_and_verified(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"abc")
    records = file_records(tmp_path, ["a.bin"])
    assert records["a.bin"]["bytes"] == 3
    assert records["a.bin"]["sha256"].startswith("ba7816bf")  # sha256("abc")
    verify_file_records(tmp_path, records, THING)
    (tmp_path / "a.bin").write_bytes(b"abd")
    with pytest.raises(ThingError, match=r"a\.bin is corrupt: sha256 .*, manifest says ba7816bf"):
        verify_file_records(tmp_path, records, THING)
    (tmp_path / "a.bin").unlink()
    with pytest.raises(ThingError, match=r"a\.bin is missing; rebuild the thing"):
        verify_file_records(tmp_path, records, THING)


def _empty_file(path: Path) -> Path:
    path.write_bytes(b"")
    return path


@pytest.mark.parametrize("model", ["model_dir", "gemma_dir"])
def test_a_tokenizer_directory_has_the_identity_of_its_transformers_tokenizer(model, request, tmp_path):
    """Read from tokenizer.json without transformers, and through transformers when the
    configuration declares a token the file lacks (transformers adds it)."""
    import json
    import shutil

    from transformers import AutoTokenizer

    directory = request.getfixturevalue(model)
    assert TokenizerIdentity.of_directory(directory) == TokenizerIdentity.of(
        AutoTokenizer.from_pretrained(str(directory)), name=directory.name)
    extended = Path(shutil.copytree(directory, tmp_path / directory.name,
                                    ignore=shutil.ignore_patterns("*.safetensors")))
    config = json.loads((extended / "tokenizer_config.json").read_text())
    (extended / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "<|not-in-the-file|>"}))
    assert _fast_tokenizer(extended) is None
    widened = TokenizerIdentity.of_directory(extended)
    assert widened == TokenizerIdentity.of(AutoTokenizer.from_pretrained(str(extended)), name=extended.name)
    assert widened.vocab_sha256 != TokenizerIdentity.of_directory(directory).vocab_sha256
