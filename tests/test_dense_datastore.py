"""Dense (DReSD) datastores: windows, the transform, index choice, building on the real model,
searching its own states, and every refusal on open."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import faiss
import numpy as np
import pytest
import torch

from vllm_retrieval_spec.datastores import dense_builder
from vllm_retrieval_spec.datastores.builder import build_datastore, load_tokenizer
from vllm_retrieval_spec.datastores.dense import DenseDatastore, open_dense_datastore_for_model
from vllm_retrieval_spec.datastores.dense_builder import (
    Corpus,
    DenseBuildOptions,
    build_dense_datastore,
    last_hidden_states,
    load_target_model,
    plan_windows,
    tokenize_corpus,
)
from vllm_retrieval_spec.datastores.dense_cli import recipe_dense_section
from vllm_retrieval_spec.datastores.dense_format import DenseDatastoreError
from vllm_retrieval_spec.datastores.dense_index import IndexLimits, fit_transform, plan_index
from vllm_retrieval_spec.datastores.recipes import load_recipe
from vllm_retrieval_spec.datastores.sources import DocumentStream, InputSpec
from vllm_retrieval_spec.ngrams.table import ModelIdentity
from vllm_retrieval_spec.options import RetrievalSpecOptions
from vllm_retrieval_spec.proposers.dense_source import DenseSource
from vllm_retrieval_spec.storage import file_records

STDLIB = Path(sysconfig.get_paths()["stdlib"])
N = 10  # value tokens


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """Two real source files, about 2,500 positions."""
    root = tmp_path_factory.mktemp("dense-corpus")
    (root / "textwrap_head.py").write_text((STDLIB / "textwrap.py").read_text()[:6000])
    (root / "bisect.py").write_text((STDLIB / "bisect.py").read_text())
    return root


@pytest.fixture(scope="module")
def short_input(tmp_path_factory) -> list[InputSpec]:
    """About 500 tokens, for the builds that test something else than search."""
    path = tmp_path_factory.mktemp("dense-short") / "short.py"
    path.write_text((STDLIB / "bisect.py").read_text()[:2000])
    return [InputSpec(path)]


@pytest.fixture(scope="module")
def store_dir(model_dir, corpus_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dense-stores") / "flat"
    build_dense_datastore(model_dir, [InputSpec(corpus_dir)], out, DenseBuildOptions(value_tokens=N), progress=False)
    return out


@pytest.fixture(scope="module")
def model(model_dir):
    return load_target_model(model_dir)


@pytest.fixture(scope="module")
def corpus(model_dir, corpus_dir) -> Corpus:
    return tokenize_corpus(load_tokenizer(model_dir), DocumentStream([InputSpec(corpus_dir)]))


def own_states(model, corpus: Corpus, document: int, positions: np.ndarray) -> np.ndarray:
    """Hidden states of ``positions`` of a document, with the document's start as context (as its first window)."""
    ids = corpus.tokens[corpus.starts[document]:corpus.starts[document] + int(positions.max()) + 1]
    with torch.inference_mode():
        return last_hidden_states(model, torch.from_numpy(ids.astype(np.int64))[None])[0, positions].numpy()


def expected_values(corpus: Corpus, document: int, positions: np.ndarray) -> np.ndarray:
    start = corpus.starts[document]
    return corpus.tokens[start + positions[:, None] + np.arange(1, N + 1)]


def test_own_states_find_their_own_next_tokens_first(store_dir, model, corpus, model_dir):
    store = open_dense_datastore_for_model(str(store_dir), model_dir)
    assert store.index.ntotal == store.num_positions and type(store.index).__name__ == "IndexFlatIP"
    for document in range(corpus.num_documents):
        length = int(corpus.starts[document + 1] - corpus.starts[document])
        # from position 8: both documents start with the same tokens, so their first states are equal
        positions = np.linspace(8, min(length - N, 512) - 1, 12).astype(np.int64)
        scores, values = store.search(own_states(model, corpus, document, positions), k=4)
        assert scores.shape == (12, 4) and values.shape == (12, 4, N) and values.dtype == np.int32
        np.testing.assert_array_equal(values[:, 0], expected_values(corpus, document, positions))
        assert (scores[:, 0] > 0.999).all() and (np.diff(scores, axis=1) <= 1e-6).all()
    assert isinstance(store.values, np.memmap) and not store.values.flags.writeable


def test_store_holds_every_position_with_n_following_tokens(store_dir, corpus):
    store = DenseDatastore.open(store_dir)
    lengths = np.diff(corpus.starts)
    assert store.num_positions == int(np.maximum(lengths - N, 0).sum())
    manifest = json.loads((store_dir / "manifest.json").read_text())
    assert set(manifest["files"]) == {"values.bin", "mean.bin", "std.bin", "components.bin", "index.faiss"}
    assert not (store_dir / "keys.scratch").exists()
    size = sum(record["bytes"] for record in manifest["files"].values())
    assert manifest["bytes_per_position"] == pytest.approx(size / store.num_positions, abs=0.01)
    assert manifest["index"] == {"type": "flat", "metric": "inner_product", "nlist": None, "nprobe": None,
                                 "pq_m": None, "pq_bits": None, "train_size": None}
    assert manifest["model"]["name"] == Path(manifest["build"]["model_dir"]).name
    store.check_fully()


def test_the_transform_is_z_normalisation_then_pca_then_l2(store_dir, model, corpus):
    store = DenseDatastore.open(store_dir)
    t = store.transform
    assert t.mean.shape == t.std.shape == (576,) and t.components.shape == (576, 64)
    np.testing.assert_allclose(t.components.T @ t.components, np.eye(64), atol=1e-5)
    states = own_states(model, corpus, 0, np.arange(0, 400, 7))
    reference = ((states.astype(np.float64) - t.mean) / t.std) @ t.components
    reference /= np.linalg.norm(reference, axis=1, keepdims=True)
    keys = t.apply(states)
    assert keys.shape == (len(states), 64) and keys.dtype == np.float32
    np.testing.assert_allclose(keys, reference, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(keys, axis=1), 1.0, atol=1e-6)


def test_fit_is_the_papers_z_norm_and_pca():
    rng = np.random.default_rng(0)
    states = (rng.standard_normal((3000, 12)) @ rng.standard_normal((12, 12)) * 5 + 3).astype(np.float32)
    transform, info = fit_transform(states, dim=4, epsilon=1e-6)
    x = states.astype(np.float64)
    np.testing.assert_allclose(transform.mean, x.mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(transform.std, np.sqrt(x.var(axis=0) + 1e-6), rtol=1e-5)
    eigenvalues, eigenvectors = np.linalg.eigh(np.cov((x - x.mean(axis=0)) / np.sqrt(x.var(axis=0) + 1e-6),
                                                      rowvar=False))
    top = eigenvectors[:, ::-1][:, :4]
    np.testing.assert_allclose(np.abs(transform.components.T @ top), np.eye(4), atol=1e-4)
    assert info["fit_sample"] == 3000 and info["explained_variance"] == pytest.approx(
        eigenvalues[::-1][:4].sum() / eigenvalues.sum(), abs=1e-4)
    with pytest.raises(ValueError, match="PCA dimension"):
        fit_transform(states[:3], dim=4)


def test_windows_keep_each_position_once_with_context():
    corpus = Corpus(np.arange(2600, dtype=np.int32), np.array([0, 1500, 1508, 2600]))
    windows = plan_windows(corpus, DenseBuildOptions(value_tokens=N, window=512, overlap=128, stride=3))
    # document 1 has fewer than N + 1 tokens; the others keep every 3rd position followed by N tokens
    expected = [s + t for s, e in ((0, 1500), (1508, 2600)) for t in range(0, e - s - N, 3)]
    assert windows.positions().tolist() == expected and windows.num_positions == len(expected)
    document = np.searchsorted(corpus.starts, windows.begin, side="right") - 1
    at_start = windows.begin == corpus.starts[document]
    assert (windows.length <= 512).all() and (windows.first[~at_start] >= 128).all()
    assert (windows.begin + windows.length <= corpus.starts[document + 1] - N).all()


def test_index_type_follows_size_and_memory():
    assert plan_index(1000, 64).type == "flat"
    ivf = plan_index(1_000_000, 64)
    assert (ivf.type, ivf.nlist, ivf.nprobe) == ("ivf_flat", 4096, 64)
    pq = plan_index(1_000_000, 64, IndexLimits(memory_bytes=100 << 20))
    assert (pq.type, pq.pq_m, pq.pq_bits) == ("ivf_pq", 16, 8)
    small = plan_index(2000, 64, IndexLimits(flat_max=100))
    assert small.type == "ivf_flat" and small.nlist * 39 <= 2000


def test_ivf_is_chosen_above_the_flat_threshold(model_dir, model, short_input, tmp_path):
    out, inputs = tmp_path / "ivf", short_input
    report = build_dense_datastore(model_dir, inputs, out, DenseBuildOptions(value_tokens=N, flat_max=100),
                                   progress=False)
    corpus = tokenize_corpus(load_tokenizer(model_dir), DocumentStream(inputs))
    assert report.manifest.index.type == "ivf_flat" and report.manifest.index.nlist >= 2
    store = DenseDatastore.open(out, nprobe=10_000)  # every list: exact
    assert type(store.index).__name__ == "IndexIVFFlat" and store.index.nprobe == store.index.nlist
    positions = np.arange(8, 400, 23)
    _, values = store.search(own_states(model, corpus, 0, positions), k=2)
    np.testing.assert_array_equal(values[:, 0], expected_values(corpus, 0, positions))
    if hasattr(faiss, "IO_FLAG_MMAP_IFC"):  # the lists are mapped in place, shared between processes
        maps = Path("/proc/self/maps").read_text().splitlines()
        assert any(line.split()[1].endswith("s") and line.endswith(str(out / "index.faiss")) for line in maps)
    config = SimpleNamespace(model_config=SimpleNamespace(model=str(model_dir)),
                             device_config=SimpleNamespace(device="cpu"))
    for nprobe, probed in ((0, report.manifest.index.nprobe), (1, 1)):  # the option: 0 keeps the store's
        options = RetrievalSpecOptions(dense_datastore=str(out), dense_nprobe=nprobe)
        assert DenseSource(options, config, "test").store.index.nprobe == probed


def copy_model_files(model_dir: Path, target: Path) -> Path:
    target.mkdir()
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, target / path.name)
    return target


def test_another_tokenizer_or_model_is_refused_naming_both(store_dir, model_dir, tmp_path):
    other_tokenizer = copy_model_files(model_dir, tmp_path / "other-tokenizer")
    tokenizer = json.loads((other_tokenizer / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": 49152, "content": "<|dense-test|>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
    (other_tokenizer / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(DenseDatastoreError, match=r"built for model 'SmolLM2.*served with model 'other-tokenizer'.*"
                                                  r"rebuild it with"):
        DenseDatastore.open(store_dir, ModelIdentity.of(other_tokenizer))
    other_model = copy_model_files(model_dir, tmp_path / "other-model")
    config = json.loads((other_model / "config.json").read_text())
    (other_model / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-6}))
    with pytest.raises(DenseDatastoreError, match=r"served with model 'other-model' \(config "):
        open_dense_datastore_for_model(str(store_dir), other_model)
    DenseDatastore.open(store_dir, ModelIdentity.of(model_dir))


@pytest.fixture()
def store_copy(store_dir, tmp_path) -> Path:
    return Path(shutil.copytree(store_dir, tmp_path / "copy"))


def test_token_ids_beyond_the_vocabulary_are_refused(store_copy):
    values = np.fromfile(store_copy / "values.bin", dtype=np.int32)
    values[17] = 49152
    values.tofile(store_copy / "values.bin")
    with pytest.raises(DenseDatastoreError, match=r"values\.bin holds token ids outside the vocabulary \[0, 49152\) "
                                                  r".*max 49152\); rebuild the dense datastore"):
        DenseDatastore.open(store_copy)


def replace_index(store: Path, content: bytes) -> None:
    """Write another ``index.faiss`` and record it in the manifest (past its checksum, to FAISS)."""
    (store / "index.faiss").write_bytes(content)
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["files"]["index.faiss"] = file_records(store, ["index.faiss"])["index.faiss"]
    (store / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("damage", "message"),
    [(lambda d: (d / "values.bin").write_bytes((d / "values.bin").read_bytes()[:-4]),
      r"values\.bin is truncated or corrupt"),
     (lambda d: (d / "components.bin").unlink(), r"components\.bin is missing"),
     (lambda d: (d / "index.faiss").write_bytes(b"not an index"), r"index\.faiss is corrupt: sha256"),
     (lambda d: replace_index(d, b"not an index"), r"index\.faiss cannot be read by FAISS"),
     (lambda d: replace_index(d, faiss.serialize_index(faiss.IndexFlatIP(64)).tobytes()),
      r"index\.faiss does not match the manifest \(0 vectors, the manifest says \d+ positions\)"),
     (lambda d: np.full(576, np.nan, dtype=np.float32).tofile(d / "std.bin"), r"std\.bin holds NaN")],
)
def test_damaged_files_are_named(store_copy, damage, message):
    damage(store_copy)
    with pytest.raises(DenseDatastoreError, match=message + r".*; rebuild the dense datastore"):
        DenseDatastore.open(store_copy)


def test_a_failing_build_leaves_nothing_and_keeps_the_old_store(model_dir, short_input, store_copy, tmp_path,
                                                                monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("interrupted while indexing")

    monkeypatch.setattr(dense_builder, "build_index", fail)
    inputs = short_input
    with pytest.raises(RuntimeError, match="interrupted"):
        build_dense_datastore(model_dir, inputs, tmp_path / "new", DenseBuildOptions(dim=8), progress=False)
    assert not (tmp_path / "new").exists()
    before = (store_copy / "manifest.json").read_text()
    monkeypatch.setattr(dense_builder, "compute_keys", fail)  # earlier, without another forward pass
    with pytest.raises(RuntimeError, match="interrupted"):
        build_dense_datastore(model_dir, inputs, store_copy, DenseBuildOptions(dim=8), replace=True, progress=False)
    assert (store_copy / "manifest.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]  # no temporary directory left


def test_existing_targets_follow_the_replace_rules(model_dir, short_input, store_copy, tmp_path):
    inputs = short_input
    with pytest.raises(FileExistsError, match="already exists; pass --replace"):
        build_dense_datastore(model_dir, inputs, store_copy, progress=False)
    rest_store = tmp_path / "rest"
    build_datastore(model_dir, inputs, rest_store, progress=False)
    with pytest.raises(FileExistsError, match="is not a dense datastore"):
        build_dense_datastore(model_dir, inputs, rest_store, replace=True, progress=False)


def test_bad_options_and_tiny_inputs_say_what_to_do(model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"--overlap \(512\) must be below --window \(512\)"):
        DenseBuildOptions(overlap=512).check()
    with pytest.raises(ValueError, match="unknown dense build option"):
        DenseBuildOptions.from_mapping({"strides": 2}, "recipe 'x'")
    (tmp_path / "tiny.txt").write_text("x = 1\n")
    with pytest.raises(ValueError, match="fewer than --dim 64; give more text"):
        build_dense_datastore(model_dir, [InputSpec(tmp_path / "tiny.txt")], tmp_path / "store", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.txt"]


def test_unbuilt_recipe_says_how_to_build_it(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_RETRIEVAL_SPEC_CACHE", str(tmp_path))
    with pytest.raises(DenseDatastoreError, match="datastore build-dense --recipe python-code-dense --model"):
        open_dense_datastore_for_model("python-code-dense", model_dir)
    for name in ("python-code-dense", "python-code-dense-long", "code-large-dense"):
        DenseBuildOptions.from_mapping(recipe_dense_section(name), name).check()
        assert load_recipe(name).inputs


def test_the_hidden_state_is_what_the_lm_head_reads(model):
    ids = torch.tensor([[1604, 275, 24, 104, 727, 28, 198]])
    with torch.inference_mode():
        states = last_hidden_states(model, ids)
        full = model(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(states, full.hidden_states[-1])
        torch.testing.assert_close(model.lm_head(states), full.logits)


def test_command_line_build_dense(model_dir, short_input, tmp_path):
    out = tmp_path / "cli-dense"
    command = [sys.executable, "-m", "vllm_retrieval_spec.cli", "datastore", "build-dense", "--model", str(model_dir),
               "--input", str(short_input[0].path), "--out", str(out), "--dim", "16", "--value-tokens", "6"]
    build = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    assert "positions/s" in build.stdout and "bytes/position" in build.stdout and "index flat" in build.stdout
    store = DenseDatastore.open(out)
    assert (store.manifest.dim, store.value_tokens) == (16, 6)
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and f"{out} already exists; pass --replace" in again.stderr
    both = subprocess.run([*command, "--recipe", "python-code-dense"], capture_output=True, text=True, timeout=300)
    assert both.returncode == 2 and "give either --recipe NAME or --input PATH" in both.stderr
    inspect = subprocess.run([sys.executable, "-m", "vllm_retrieval_spec.cli", "datastore", "inspect", str(out),
                              "--full"], capture_output=True, text=True, timeout=120)
    assert inspect.returncode == 0, inspect.stderr
    assert "dense datastore" in inspect.stdout and "index flat" in inspect.stdout and "checksums: ok" in inspect.stdout


def test_the_index_stays_on_the_cpu_without_faiss_gpu(store_dir, model_dir):
    import faiss

    store = open_dense_datastore_for_model(str(store_dir), model_dir)
    if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
        assert store.use_gpu(0) and "Gpu" in type(store.index).__name__
    else:
        assert not store.use_gpu(0) and type(store.index).__name__ == "IndexFlatIP" and store.gpu_resources is None


def test_a_search_leaves_the_callers_openmp_threads_alone(store_dir, model_dir):
    """torch's forward passes share the calling thread's OpenMP setting with FAISS."""
    store = open_dense_datastore_for_model(str(store_dir), model_dir, num_threads=2)
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        store.search(np.zeros((3, store.hidden_size), np.float32), 4)
        assert faiss.omp_get_max_threads() == 1
    finally:
        faiss.omp_set_num_threads(before)
