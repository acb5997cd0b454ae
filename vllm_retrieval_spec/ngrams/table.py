"""Model-derived n-gram tables (the N-Grammys paper, §4.1).

One forward pass over every token of the vocabulary as a one-token input gives the bigram
``p(. | x)``; we keep its top-k tokens and probabilities. Each token is placed where a document
starts (after the tokenizer's document-start token, whose KV is computed once and shared):
alone at position 0, SmolLM2-135M predicts '-' after 49,093 of its 49,152 tokens (the first
position acts as an attention sink), and the bigram's top-1 covers 0.2% of its own greedy
HumanEval tokens instead of 11%. We also keep the *extended* bigram: each of
the top-k first tokens continued greedily through the bigram to ``w`` tokens. Optionally the
unigram ranking from the embeddings (paper §4.1: ``p(x) ∝ exp(-d(x))``, ``d`` the distance of
the output embedding from the mean under the input embeddings' Gram matrix).

A table may cover only the first ``tokens`` ids of the vocabulary (``--tokens``; BPE vocabularies
list their commonest merges first: SmolLM2's first 8,192 ids are 89% of HumanEval's tokens) at that
share of the build time: a request whose last token lies past them drafts nothing from the
bigram, and a greedy continuation that reaches one ends there (``-1`` after it).

Stored like a datastore: built in a temporary directory and renamed into place, with a
``manifest.json`` that names the model (config and tokenizer hashes), memory-mapped at serving.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from vllm_retrieval_spec import __version__
from vllm_retrieval_spec.paths import cache_root
from vllm_retrieval_spec.storage import (
    MAX_VOCAB_SIZE,
    ArtifactKind,
    ModelIdentity,
    StorageError,
    atomic_directory,
    check_build_target,
    check_manifest_ints,
    manifest_record,
    map_array,
    read_manifest,
    refuse_another_identity,
    sha256_of_file,
    write_manifest,
)
from vllm_retrieval_spec.validation import require_ints

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

FORMAT_VERSION = 1
BIGRAM_TOKENS = "bigram_tokens.bin"
BIGRAM_PROBS = "bigram_probs.bin"
EXTENDED = "extended_bigram.bin"
UNIGRAM_RANKING = "unigram_ranking.bin"


class NgramTableError(StorageError):
    """An n-gram table is missing, corrupt, or belongs to another model."""


NGRAM_TABLE = ArtifactKind(
    noun="n-gram table",
    article="an",
    format_version=FORMAT_VERSION,
    error=NgramTableError,
    build_command="`vllm-retrieval-spec ngram-table build --model MODEL_DIR --out DIR`",
    required={"model": dict, "k": int, "w": int, "unigram": bool, "prefix": list, "files": dict},
    data_files=(BIGRAM_TOKENS, BIGRAM_PROBS, EXTENDED, UNIGRAM_RANKING),
    sized_files=False,
)


def default_table_dir(identity: ModelIdentity) -> Path:
    """Where ``ngram-table build --model MODEL_DIR`` puts a model's table by default."""
    return cache_root() / "ngram-tables" / f"{identity.name}-{identity.config_sha256[:12]}"


@dataclass
class NgramTable:
    """Memory-mapped tables: ``bigram_tokens``/``bigram_probs`` ``[T, k]``, ``extended``
    ``[T, k, w]`` (``-1`` after a continuation's end) for the first ``T`` = :attr:`tokens` ids of
    the vocabulary (all of them unless built with ``--tokens``), and optionally
    ``unigram_ranking`` ``[V]`` (most likely first). The build's ``k`` and ``w`` (manifest keys,
    ``--k``/``--w``) cap what the options ``ngrammys_drafts`` and ``ngrammys_draft_len`` can use:
    :attr:`max_drafts`, :attr:`max_draft_len`."""

    path: Path
    manifest: dict[str, Any]
    bigram_tokens: np.ndarray
    bigram_probs: np.ndarray
    extended: np.ndarray
    unigram_ranking: np.ndarray | None

    @property
    def max_drafts(self) -> int:
        return int(self.manifest["k"])

    @property
    def max_draft_len(self) -> int:
        return int(self.manifest["w"])

    @property
    def tokens(self) -> int:
        """How many token ids (the first ones) have rows; tables before ``--tokens``: all."""
        return int(self.manifest.get("tokens", self.manifest["model"]["vocab_size"]))

    @property
    def model(self) -> ModelIdentity:
        return ModelIdentity(**self.manifest["model"])

    @classmethod
    def open(cls, path: str | Path, expected_model: ModelIdentity | None = None) -> NgramTable:
        """Open the table in ``path``; fail naming the file when it is missing, truncated or
        corrupt (token ids outside the vocabulary included), and naming both models when it
        was built from another model."""
        path = Path(path)
        manifest = read_manifest(path, NGRAM_TABLE)
        owner = manifest_record(path, ModelIdentity, manifest["model"], NGRAM_TABLE, "model")
        v, t, k, w = owner.vocab_size, manifest.get("tokens", owner.vocab_size), manifest["k"], manifest["w"]
        check_manifest_ints(path, NGRAM_TABLE, {"model.vocab_size": (v, 1, MAX_VOCAB_SIZE),
                                                **table_bounds(k, w, manifest["prefix"], v, t)})
        if expected_model is not None:
            refuse_another_identity(NGRAM_TABLE, path, owner, expected_model)
        unigram = map_array(path / UNIGRAM_RANKING, np.int32, (v,), NGRAM_TABLE) if manifest["unigram"] else None
        table = cls(
            path=path,
            manifest=manifest,
            bigram_tokens=map_array(path / BIGRAM_TOKENS, np.int32, (t, k), NGRAM_TABLE),
            bigram_probs=map_array(path / BIGRAM_PROBS, np.float32, (t, k), NGRAM_TABLE),
            extended=map_array(path / EXTENDED, np.int32, (t, k, w), NGRAM_TABLE),
            unigram_ranking=unigram,
        )
        table.check_token_ids()
        table.check_probabilities()
        return table

    def check_model(self, expected: ModelIdentity) -> None:
        """Fail naming both models when the table was built from another model than ``expected``."""
        refuse_another_identity(NGRAM_TABLE, self.path, self.model, expected)

    def check_token_ids(self) -> None:
        """Fail naming the file when a stored token id is outside the vocabulary; -1 (a
        continuation's end) only in the extended table of a partial one (reads the tables once)."""
        v = self.model.vocab_size
        ends = -1 if self.tokens < v else 0
        for name, ids, low_allowed in ((BIGRAM_TOKENS, self.bigram_tokens, 0), (EXTENDED, self.extended, ends),
                                       (UNIGRAM_RANKING, self.unigram_ranking, 0)):
            if ids is None or ids.size == 0:
                continue
            low, high = int(ids.min()), int(ids.max())
            if low < low_allowed or high >= v:
                raise NGRAM_TABLE.fail(f"{self.path / name} holds token ids outside the vocabulary [0, {v}) "
                                       f"(min {low}, max {high})")

    def check_probabilities(self) -> None:
        """Fail naming the file when a bigram probability is NaN or outside [0, 1] (reads it once)."""
        probs = np.asarray(self.bigram_probs)
        if probs.size and not (np.all(probs >= 0) and np.all(probs <= 1)):  # NaN fails both
            raise NGRAM_TABLE.fail(f"{self.path / BIGRAM_PROBS} holds values that are no probabilities (NaN or "
                                   "outside [0, 1])")


def open_table_for_model(option: str, model_dir: str | Path) -> NgramTable:
    """The table the ``ngram_table`` option names (empty: the cache default of the model),
    checked against the model. A table given by path is opened before the model is read, so
    a missing or corrupt one fails at once."""
    if not option:
        identity = ModelIdentity.of(model_dir)
        table_dir = default_table_dir(identity)
        _require_table_dir(table_dir, f"--model {model_dir}")
        return NgramTable.open(table_dir, expected_model=identity)
    table_dir = Path(option).expanduser()
    _require_table_dir(table_dir, f"--model {model_dir} --out {table_dir}")
    table = NgramTable.open(table_dir)
    table.check_model(ModelIdentity.of(model_dir))
    return table


def _require_table_dir(table_dir: Path, build_args: str) -> None:
    if not table_dir.exists():
        raise NgramTableError(
            f"no n-gram table at {table_dir}; build it with `vllm-retrieval-spec ngram-table build {build_args}`"
        )


def table_bounds(k: Any, w: Any, prefix: Sequence[Any], vocab_size: int,
                 tokens: Any) -> dict[str, tuple[Any, int, int | None]]:
    """The ranges of a table's parameters, as build options and as manifest values: ``k`` top
    tokens of the vocabulary, drafts of ``w >= 1`` tokens, ``prefix`` ids in the vocabulary,
    rows for the first ``tokens`` ids (1 to all)."""
    bounds = {"k": (k, 1, vocab_size), "w": (w, 1, None), "tokens": (tokens, 1, vocab_size)}
    bounds.update({f"prefix[{i}]": (token, 0, vocab_size - 1) for i, token in enumerate(prefix)})
    return bounds


def check_build_options(k: int, w: int, batch_size: int, prefix: Sequence[int], vocab_size: int,
                        tokens: int) -> None:
    """Fail naming the flag (``--k`` ...) when a build option is out of range, before any model runs."""
    bounds = {f"--{name}": bound for name, bound in table_bounds(k, w, prefix, vocab_size, tokens).items()}
    require_ints({**bounds, "--batch-size": (batch_size, 1, None)})


def document_start_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """What precedes a document's first token in training: the BOS the tokenizer adds, else
    its end-of-text token, else its EOS (empty when it has none)."""
    bos = tokenizer.bos_token_id
    if bos is not None and tokenizer("x").input_ids[:1] == [bos]:
        return [bos]
    end_of_text = tokenizer.get_vocab().get("<|endoftext|>")
    if end_of_text is not None:
        return [end_of_text]
    return [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]


def build_ngram_table(model_dir: str | Path, out_dir: str | Path, *, k: int = 25, w: int = 14,
                      unigram: bool = True, batch_size: int = 1024, replace: bool = False,
                      prefix: Sequence[int] | None = None, tokens: int | None = None,
                      progress: bool = True) -> Path:
    """Run the model over every token (the first ``tokens`` ids only, when given; after
    ``prefix``, by default the document start) and write the tables."""
    out_dir = Path(out_dir)
    check_build_target(out_dir, replace, NGRAM_TABLE)  # before minutes of work
    identity = ModelIdentity.of(model_dir)
    start = time.perf_counter()
    if prefix is None:
        from transformers import AutoTokenizer

        prefix = document_start_prefix(AutoTokenizer.from_pretrained(str(model_dir)))
    tokens = identity.vocab_size if tokens is None else tokens
    check_build_options(k, w, batch_size, prefix, identity.vocab_size, tokens)
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    top_tokens, top_probs = bigram_top_k(model, range(tokens), k, batch_size, progress, prefix)
    extended = extend_bigram(top_tokens, w)
    ranking = unigram_ranking(model) if unigram else None
    with atomic_directory(out_dir, replace=replace, kind=NGRAM_TABLE) as tmp:
        top_tokens.tofile(tmp / BIGRAM_TOKENS)
        top_probs.tofile(tmp / BIGRAM_PROBS)
        extended.tofile(tmp / EXTENDED)
        files = [BIGRAM_TOKENS, BIGRAM_PROBS, EXTENDED]
        if ranking is not None:
            ranking.tofile(tmp / UNIGRAM_RANKING)
            files.append(UNIGRAM_RANKING)
        manifest = {
            "format_version": FORMAT_VERSION,
            "model": asdict(identity),
            "k": k,
            "w": w,
            "unigram": ranking is not None,
            "prefix": list(prefix),
            "tokens": tokens,
            "files": {name: sha256_of_file(tmp / name) for name in files},
            "build": {"model_dir": str(model_dir), "batch_size": batch_size, "package_version": __version__,
                      "seconds": round(time.perf_counter() - start, 2),
                      "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        }
        write_manifest(tmp, manifest)
    return out_dir


def bigram_top_k(model: PreTrainedModel, token_ids: Sequence[int], k: int, batch_size: int = 1024,
                 progress: bool = False, prefix: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of ``p(. | prefix + [x])`` for each token ``x``: ``[len, k]`` ids and probabilities.
    The prefix's KV cache is computed once and repeated over each batch."""
    import copy

    import torch

    token_ids = list(token_ids)
    top_tokens = np.empty((len(token_ids), k), dtype=np.int32)
    top_probs = np.empty((len(token_ids), k), dtype=np.float32)
    batches = range(0, len(token_ids), batch_size)
    with torch.inference_mode():
        prefix_cache = (model(input_ids=torch.tensor([list(prefix)]), use_cache=True).past_key_values
                        if prefix else None)
        for first in tqdm(batches, desc="bigram", unit="batch", disable=not progress):
            ids = torch.tensor(token_ids[first:first + batch_size]).unsqueeze(1)
            cache = None
            if prefix_cache is not None:
                cache = copy.deepcopy(prefix_cache)
                cache.batch_repeat_interleave(len(ids))
            probs = torch.softmax(model(input_ids=ids, past_key_values=cache).logits[:, -1, :].float(), dim=-1)
            values, indices = torch.topk(probs, k, dim=-1, sorted=True)
            top_tokens[first:first + len(ids)] = indices.numpy()
            top_probs[first:first + len(ids)] = values.numpy()
    return top_tokens, top_probs


def extend_bigram(top_tokens: np.ndarray, w: int) -> np.ndarray:
    """``[T, k, w]``: each top-k first token continued greedily (bigram top-1) to ``w`` tokens;
    a continuation that reaches a token past the ``T`` tabulated ones ends there (-1 after it)."""
    tabulated, k = top_tokens.shape
    extended = np.empty((tabulated, k, w), dtype=np.int32)
    extended[:, :, 0] = top_tokens
    greedy_next = np.append(top_tokens[:, 0], np.int32(-1))  # the last entry: no continuation
    for step in range(1, w):
        previous = extended[:, :, step - 1]
        extended[:, :, step] = greedy_next[np.where((previous >= 0) & (previous < tabulated), previous, tabulated)]
    return extended


def unigram_ranking(model: PreTrainedModel) -> np.ndarray:
    """Tokens by increasing ``d(x) = ||u_x - mean(u)||_V`` (paper §4.1), most likely first."""
    import torch

    with torch.inference_mode():
        inputs = model.get_input_embeddings().weight.float()
        outputs = model.get_output_embeddings().weight.float()
        gram = inputs.T @ inputs
        centred = outputs - outputs.mean(dim=0, keepdim=True)
        distance = ((centred @ gram) * centred).sum(dim=-1)
        return torch.argsort(distance, stable=True).to(torch.int32).numpy()
