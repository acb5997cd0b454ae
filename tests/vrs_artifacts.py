"""Tiny artifacts in the on-disk formats, written without a model or a tokenizer (for the store
checks and the fuzz tests): a REST datastore, a dense (DReSD) datastore, an n-gram table, an
output index snapshot. Each manifest records every data file's checksum, as the builders write them."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
from pydivsufsort import divsufsort

from vllm_retrieval_spec.datastores.dense_format import (
    COMPONENTS,
    DENSE_FORMAT_VERSION,
    INDEX,
    MEAN,
    STD,
    VALUES,
    DenseManifest,
    IndexSpec,
)
from vllm_retrieval_spec.datastores.format import (
    FORMAT_VERSION,
    SUFFIX_ARRAY,
    TOKENS,
    Manifest,
    TokenizerIdentity,
    separator_for,
    suffix_array_dtype_for,
    token_dtype_for,
)
from vllm_retrieval_spec.goodput.calibration import SHAPE as CALIBRATION_BUCKETS
from vllm_retrieval_spec.ngrams import table as ngram_table
from vllm_retrieval_spec.ngrams.table import ModelIdentity, extend_bigram
from vllm_retrieval_spec.storage import file_records, sha256_of_file, write_manifest

VOCAB = 40
TINY_MODEL = ModelIdentity("tiny", VOCAB, "c" * 64, "v" * 64)
TINY_TOKENIZER = TokenizerIdentity("tiny", VOCAB, "v" * 64)
CALIBRATION_COUNTS = (2, *CALIBRATION_BUCKETS)  # accepted and observed, as the budget saves them
TOKEN_FACTOR_COUNTS = (2, VOCAB)  # accepted and predicted per token id, as the budget saves them


def repetitive_documents(seed: int, count: int = 6, length: int = 60, vocab: int = VOCAB) -> list[np.ndarray]:
    """Documents drawn from a few short phrases, so that suffixes repeat and REST finds matches."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, vocab, rng.integers(2, 6)) for _ in range(8)]
    documents = []
    for _ in range(count):
        parts, size = [], 0
        while size < length:
            parts.append(phrases[rng.integers(len(phrases))])
            size += len(parts[-1])
        documents.append(np.concatenate(parts)[:length])
    return documents


def write_token_store(directory: Path, documents: list[np.ndarray],
                      tokenizer: TokenizerIdentity = TINY_TOKENIZER) -> Path:
    """A REST datastore of ``documents`` (token ids in ``tokenizer``'s vocabulary), as the builder lays it out."""
    dtype = token_dtype_for(tokenizer.vocab_size)
    separator = separator_for(dtype)
    tokens = np.concatenate([part for document in documents
                             for part in (np.asarray(document, dtype), np.array([separator], dtype))])
    directory.mkdir(parents=True)
    tokens.tofile(directory / TOKENS)
    divsufsort(tokens).astype(suffix_array_dtype_for(len(tokens))).tofile(directory / SUFFIX_ARRAY)
    Manifest(
        format_version=FORMAT_VERSION, num_tokens=len(tokens), num_documents=len(documents),
        token_dtype=dtype.name, suffix_array_dtype=suffix_array_dtype_for(len(tokens)).name, separator=separator,
        tokenizer=tokenizer,
        files=file_records(directory, (TOKENS, SUFFIX_ARRAY)), build={},
    ).write(directory)
    return directory


def write_sharded_store(directory: Path, shards: list[list[np.ndarray]],
                        tokenizer: TokenizerIdentity = TINY_TOKENIZER) -> Path:
    """A sharded REST datastore: each of ``shards`` (a list of documents) a store of its own."""
    from vllm_retrieval_spec.datastores import sharded

    directory.mkdir(parents=True)
    names = [sharded.shard_name(i) for i in range(len(shards))]
    for name, documents in zip(names, shards):
        write_token_store(directory / name, documents, tokenizer)
    dtype = token_dtype_for(tokenizer.vocab_size)
    sharded.ShardedManifest(
        format_version=sharded.FORMAT_VERSION, shards=names,
        num_tokens=sum(len(document) + 1 for documents in shards for document in documents),
        num_documents=sum(len(documents) for documents in shards), token_dtype=dtype.name,
        separator=separator_for(dtype), tokenizer=tokenizer, build={},
    ).write(directory)
    return directory


def index_spec(index_type: str, positions: int) -> IndexSpec:
    """A small index of ``index_type``: 4 lists (2 probed), PQ of 2 x 4 bits."""
    if index_type == "flat":
        return IndexSpec("flat")
    pq = {"pq_m": 2, "pq_bits": 4} if index_type == "ivf_pq" else {}
    return IndexSpec(index_type, nlist=4, nprobe=2, train_size=positions, **pq)


def write_dense_store(directory: Path, index_type: str = "flat", *, positions: int = 256, hidden: int = 16,
                      dim: int = 8, value_tokens: int = 4, seed: int = 0) -> Path:
    """A dense datastore of random states and values for :data:`TINY_MODEL`."""
    import faiss

    from vllm_retrieval_spec.datastores.dense_index import build_index

    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    rng.integers(0, VOCAB, (positions, value_tokens), dtype=np.int32).tofile(directory / VALUES)
    rng.normal(size=hidden).astype(np.float32).tofile(directory / MEAN)
    rng.uniform(0.5, 2.0, hidden).astype(np.float32).tofile(directory / STD)
    rng.normal(size=(hidden, dim)).astype(np.float32).tofile(directory / COMPONENTS)
    keys = rng.normal(size=(positions, dim)).astype(np.float32)
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    spec = index_spec(index_type, positions)
    faiss.write_index(build_index(spec, keys, seed), str(directory / INDEX))
    files = file_records(directory, (VALUES, MEAN, STD, COMPONENTS, INDEX))
    DenseManifest(
        format_version=DENSE_FORMAT_VERSION, num_positions=positions, value_tokens=value_tokens,
        hidden_size=hidden, dim=dim, value_dtype="int32", transform_dtype="float32", model=TINY_MODEL,
        index=spec, transform={}, bytes_per_position=round(sum(f["bytes"] for f in files.values()) / positions, 2),
        files=files, build={},
    ).write(directory)
    return directory


def write_ngram_table(directory: Path, k: int = 3, w: int = 4) -> Path:
    """An n-gram table for :data:`TINY_MODEL`: token t's bigram is t+1, t+2, ... (mod the
    vocabulary) with probabilities 1/2, 1/4, ...; the unigram ranking is reversed ids."""
    top = (np.arange(VOCAB, dtype=np.int32)[:, None] + np.arange(1, k + 1, dtype=np.int32)) % VOCAB
    arrays = {
        ngram_table.BIGRAM_TOKENS: top,
        ngram_table.BIGRAM_PROBS: np.tile(0.5 ** np.arange(1, k + 1, dtype=np.float32), (VOCAB, 1)),
        ngram_table.EXTENDED: extend_bigram(top, w),
        ngram_table.UNIGRAM_RANKING: np.arange(VOCAB, dtype=np.int32)[::-1].copy(),
    }
    directory.mkdir(parents=True)
    for name, array in arrays.items():
        array.tofile(directory / name)
    write_manifest(directory, {
        "format_version": ngram_table.FORMAT_VERSION, "model": asdict(TINY_MODEL), "k": k, "w": w, "unigram": True,
        "prefix": [0], "files": {name: sha256_of_file(directory / name) for name in arrays}, "build": {},
    })
    return directory


def write_output_snapshot(path: Path) -> Path:
    """An output index snapshot under ``path`` of a few finished requests, as a server saves it;
    returns the snapshot's own directory (with calibration counts and tokens' factors of the kind
    the budget saves)."""
    from vllm_retrieval_spec.datastores.output_snapshot import write_snapshot

    counts = {name: np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
              for name, shape in (("calibration", CALIBRATION_COUNTS), ("token_factors", TOKEN_FACTOR_COUNTS))}
    return write_snapshot(path, repetitive_documents(seed=2), TINY_TOKENIZER, capacity_tokens=4096, counts=counts)
