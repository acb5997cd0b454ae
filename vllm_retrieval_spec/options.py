"""Typed options, read from ``--additional-config '{"retrieval_spec": {...}}'``.

One frozen object for every proposer; unknown keys and bad values are rejected with a
message that names the key and what it accepts.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_retrieval_spec.validation import has_type, require_ints

OPTIONS_KEY = "retrieval_spec"
# A request's own switch (``SamplingParams.extra_args``; the OpenAI API's ``vllm_xargs``): "off"
# serves it without drafts (verification/admission.py reads it); on by default.
SPECULATE_ARG = "retrieval_spec_speculate"
MIXING_POLICIES = ("context-first", "context-only", "bigram-only")
MAX_SPEC_LEN = 128  # vLLM's rejection sampler asserts at most this many drafts a request (vllm.v1.sample)
BUDGET_POLICIES = ("auto", "fixed")
LEARNED_POSITIONS_MAX = 2**26  # dense_learned_positions at most
CANDIDATE_RULES = ("deterministic", "sampled")


class OptionsError(ValueError):
    """An option under ``additional_config['retrieval_spec']`` is unknown or invalid."""


Validator = Callable[[str, Any], Any]


def _int_in(low: int, high: int) -> Validator:
    def validate(key: str, value: Any) -> int:
        require_ints({f"{OPTIONS_KEY}.{key}": (value, low, high)}, OptionsError)
        return value

    return validate


def _float_in(low: float, high: float) -> Validator:
    def validate(key: str, value: Any) -> float:
        if not has_type(value, (int, float)) or not low <= value <= high:
            raise OptionsError(f"{OPTIONS_KEY}.{key} must be a number in [{low}, {high}], got {value!r}")
        return float(value)

    return validate


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise OptionsError(f"{OPTIONS_KEY}.{key} must be true or false, got {value!r}")
    return value


def _non_empty_string(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise OptionsError(
            f"{OPTIONS_KEY}.{key} must be a datastore directory or a recipe name, got {value!r}"
        )
    return value


def _one_of(*choices: str) -> Validator:
    def validate(key: str, value: Any) -> str:
        if value not in choices:
            raise OptionsError(f"{OPTIONS_KEY}.{key} must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value

    return validate


def _string(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise OptionsError(f"{OPTIONS_KEY}.{key} must be a string (a directory), got {value!r}")
    return value


def _check_keys(raw: Mapping[str, Any], known: Collection[str]) -> None:
    """Reject unknown keys, listing the known ones."""
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise OptionsError(
            f"unknown option(s) {', '.join(map(repr, unknown))} in "
            f"additional_config['{OPTIONS_KEY}']; known options: {', '.join(sorted(known))}"
        )


def _option(default: Any, validator: Validator, help: str) -> Any:
    return field(default=default, metadata={"validate": validator, "help": help})


@dataclass(frozen=True)
class RetrievalSpecOptions:
    """Options shared by all proposers of this package (defaults are the tuned ones)."""

    context_ngram_min: int = _option(
        1, _int_in(1, 64), "shortest suffix of the request's context that may match"
    )
    context_ngram_max: int = _option(
        4, _int_in(1, 64), "longest suffix of the request's context tried first"
    )
    context_max_matches: int = _option(
        64, _int_in(1, 256), "most recent context occurrences counted per step"
    )
    num_threads: int = _option(
        0, _int_in(0, 1024), "most threads for the C++ drafting kernels (0: one per available core); small batches "
        "run on the calling thread"
    )
    datastore: str = _option(
        "python-code", _non_empty_string,
        "REST: a datastore directory, or the name of a recipe in datastores/ built into the cache",
    )
    use_datastore: bool = _option(True, _bool, "REST: retrieve from the datastore")
    datastore_reload_seconds: float = _option(
        2.0, _float_in(0.0, 86_400.0),
        "REST: how often the datastore's manifest is checked for a change on disk (datastore add / remove, build "
        "--replace); a changed store is opened in the background and swapped in between two steps (0: never)",
    )
    use_context: bool = _option(True, _bool, "REST: retrieve from the request's own context")
    context_weight: float = _option(
        256.0, _float_in(0.0, 1e6), "REST: weight of one context continuation (a datastore one weighs 1)"
    )
    context_loops: bool = _option(
        True, _bool,
        "REST: a context continuation that reaches the end of the context goes on repeating with that period "
        "when the match spans a whole period (the output loops, as small models' greedy outputs do); false: it "
        "stops at the end of the context",
    )
    context_state_votes: int = _option(
        0, _int_in(0, 1024),
        "REST: times the context occurrence whose last token was produced by the hidden state nearest the one "
        "that produced the context's last token counts (0 or 1: off, every occurrence counts once); keeps each "
        "running request's hidden states (hidden size x 4 bytes a token) until it finishes",
    )
    n_min: int = _option(1, _int_in(1, 64), "REST: shortest context suffix that may match")
    n_max: int = _option(16, _int_in(1, 64), "REST: longest context suffix tried first")
    max_matches: int = _option(
        128, _int_in(1, 100_000), "REST: datastore continuations per request (evenly sampled)"
    )
    cont_len: int = _option(
        0, _int_in(0, MAX_SPEC_LEN),
        "REST: tokens per retrieved continuation (0: num_speculative_tokens, as deep as a row can draft)",
    )
    top_k: int = _option(
        64, _int_in(1, 1024),
        "REST: nodes of the candidate tree (budget auto: the budget verifies the best num_speculative_tokens of "
        "them, the whole chain among them; fixed: at most num_speculative_tokens)",
    )
    use_output_index: bool = _option(
        True, _bool,
        "REST: also retrieve from the tokens (prompt and output) of this engine's recently finished requests",
    )
    output_index_tokens: int = _option(
        10_000_000, _int_in(1024, 2**31 - 2),
        "REST: tokens the output index keeps (oldest requests evicted first; about 8 bytes per token, twice "
        "while it is rebuilt)",
    )
    output_index_path: str = _option(
        "", _string,
        "REST: directory where the output index and the budget's calibration and tokens' factors are saved (every "
        "output_index_save_seconds and at shutdown: vllm-retrieval-spec serve adds --shutdown-timeout 30, plain "
        "vllm serve needs one > 0) and loaded from at start, so a restarted server keeps what it learned; "
        "data-parallel engine i > 0 uses "
        "PATH.dp<i>; a place no save could write is refused at start (empty: not saved)",
    )
    output_index_save_seconds: int = _option(
        300, _int_in(1, 86_400), "REST: seconds between two saves of the output index (only when it changed)"
    )
    output_weight: float = _option(
        4.0, _float_in(0.0, 1e6), "REST: weight of one output-index continuation (a datastore one weighs 1)"
    )
    output_max_matches: int = _option(
        64, _int_in(1, 100_000), "REST: output-index continuations per request (evenly sampled)"
    )
    use_live_index: bool = _option(
        True, _bool,
        "REST with num_speculative_tokens > 1: also retrieve from the tokens (prompt and output so far) of the "
        "other requests still in flight, so parallel requests with shared structure draft from each other",
    )
    live_index_tokens: int = _option(
        131_072, _int_in(1024, 2**28),
        "REST: tokens the live index of requests in flight keeps (oldest evicted first; about 150 bytes per "
        "token, allocated at start)",
    )
    live_max_matches: int = _option(
        2, _int_in(1, 4096),
        "REST: continuations per request from requests still in flight (newest first; more of them mostly add "
        "weak nodes)",
    )
    live_weight: float = _option(
        4.0, _float_in(0.0, 1e6), "REST: weight of each continuation from requests still in flight"
    )
    dense_datastore: str = _option(
        "python-code-dense", _non_empty_string,
        "DReSD, Hybrid: a dense datastore directory, or the name of a dense recipe in datastores/ built into the cache",
    )
    dense_neighbours: int = _option(
        32, _int_in(1, 1024), "DReSD, Hybrid: nearest neighbours of the hidden state searched per request and step"
    )
    dense_nprobe: int = _option(
        0, _int_in(0, 1 << 20),
        "DReSD, Hybrid: IVF lists the dense datastore's search probes (0: the store's own, set when it was built; "
        "fewer: a faster search that finds fewer of the true nearest neighbours; no effect on a flat index)",
    )
    dense_weight: float = _option(
        1.0, _float_in(0.0, 1e6),
        "DReSD, Hybrid: weight of one neighbour's continuation in the trie (a context one weighs context_weight)",
    )
    dense_learned_positions: int = _option(
        0, _int_in(0, LEARNED_POSITIONS_MAX),
        "DReSD, Hybrid: also learn a dense index from served traffic (the key of each generated position and "
        "the tokens that followed it, once its request finishes), keeping at most this many positions in memory "
        "(oldest evicted first; dim x 4 + value_tokens x 4 bytes each); 0: off",
    )
    dense_learned_path: str = _option(
        "", _string,
        "DReSD, Hybrid: directory where the learned dense index is saved (every output_index_save_seconds when it "
        "learned something, and at shutdown) and restored from at start; each snapshot is a dense datastore in the "
        "serving store's key space; data-parallel engine i > 0 uses PATH.dp<i>; a place no save could write is "
        "refused at start (empty: not saved)",
    )
    dense_learned_neighbours: int = _option(
        8, _int_in(0, 1024),
        "DReSD, Hybrid: nearest neighbours searched per request and step in the learned index, drafted under their own "
        "source (learned_dense) beside the store's (0: learn without drafting from it, e.g. to capture a store with "
        "datastore from-server)",
    )
    tree: bool = _option(
        False, _bool,
        "REST, N-Grammys: draft trees of up to num_speculative_tokens nodes, verified as trees "
        "in one target step (CPU build); with budget auto, chains while the budget keeps no branch",
    )
    min_ratio: float = _option(
        0.1, _float_in(0.0, 1.0),
        "REST: the chain stops when a child keeps less of its parent's weight (with budget auto: when its "
        "calibrated chance given its parent is lower)",
    )

    candidates: str = _option(
        "deterministic", _one_of(*CANDIDATE_RULES),
        "requests at temperature > 0: deterministic: verify the drafter's best nodes with the lossless "
        "deterministic-candidate rule; sampled: draw each node's candidates from the drafter's own distribution q "
        "and verify them with multi-candidate speculative sampling (MCSS) using that q",
    )
    candidates_per_node: int = _option(
        2, _int_in(1, 16), "candidates sampled, tree mode: candidates drawn under each node (chains draw one)"
    )
    candidate_replacement: bool = _option(
        False, _bool, "candidates sampled: draw a node's candidates with replacement (MCSS) instead of without"
    )
    draft_temperature: float = _option(
        1.0, _float_in(0.05, 100.0),
        "candidates sampled: q is the drafter's weight of each child to the power 1 / draft_temperature, normalised "
        "over the node's children (below 1 sharpens q)",
    )

    budget: str = _option(
        "auto", _one_of(*BUDGET_POLICIES),
        "auto: each step, keep the drafted nodes that raise the batch's expected tokens per second "
        "(calibrated acceptance over the engine's measured step cost), possibly none; fixed: "
        "always draft up to num_speculative_tokens",
    )
    budget_margin: float = _option(
        0.05, _float_in(0.0, 10.0),
        "budget auto: keep a draft node only when its chance of acceptance pays for what it adds to the step "
        "(verification and its share of drafting time) with this fraction to spare",
    )
    budget_token_factors: bool = _option(
        True, _bool,
        "budget auto: scale each draft node's calibrated chance by what its token id's recent nodes were accepted "
        "over what was predicted for them (within 1/8-2x), so that a copy stops at the tokens where the target "
        "tends to depart from it (+1-6% simulated tokens/s at 8 in flight in the budget replay of four workloads, "
        "-1% to +4% at 1). false: chances from the calibration's buckets alone",
    )

    cpu_gemm_max_rows: int = _option(
        32, _int_in(0, 256),
        "CPU build, float32 models on x86: linear layers computing at most this many rows (a decode or verification "
        "step) run the plugin's skinny GEMM (1.05-1.5x oneDNN's speed up to 24 rows on the 2-core x86 VMs measured) "
        "instead of oneDNN's; keeps a packed float32 copy of the linear weights beside oneDNN's. More rows let the "
        "budget draft more at 8 in flight; not a steady gain where measured (96 rows: Gemma-3-270m 0.92-1.09x the "
        "default at 8 in flight in three runs, 0.95x at 1; SmolLM2 0.99-1.05x on four workloads at 1, 8 and 32 in "
        "flight). 0: vLLM's GEMM everywhere",
    )

    cpu_screened_head: bool = _option(
        True, _bool,
        "CPU build, float32 models on x86, with cpu_gemm_max_rows: steps whose requests are all greedy with "
        "nothing processing their logits (no logprobs, penalties, biases, structured outputs) compute the "
        "language-model head on a bfloat16 copy of its weight (half the bytes) that bounds every logit, then "
        "exactly (the skinny GEMM's float32 sums) only the panels of 16 tokens that may hold the largest; the "
        "tokens are those of the full head, 0.50-0.73x its time from 1 to 32 rows on a 2-core AMD EPYC with "
        "AVX512_BF16, and up to 256 rows there (0.66-0.85x oneDNN's head past cpu_gemm_max_rows). false: the "
        "full head on every step",
    )

    cpu_step_attention: bool = _option(
        True, _bool,
        "CPU build, float32 models: attention of decode and verification steps (and of prefills of up to 64 "
        "tokens) runs the plugin's kernel, which reads a request's keys and values once for all its tokens where "
        "vLLM's reads them once per token (+1-10% tokens/s at 8 in flight on a 2-core VM, -5% to +2% at 1), and "
        "on eager models stores the step's keys and values in the same call (~7% more); a token's result is bit "
        "for bit the same whatever its step brought. false: vLLM's attention everywhere",
    )

    cpu_fused_norms: bool = _option(
        True, _bool,
        "CPU build, float32 models: RMSNorm layers run vLLM's own fused C++ kernels (_C.rms_norm and "
        "_C.fused_add_rms_norm), which vLLM 0.32's CPU build leaves unused for ~7 PyTorch operators a call "
        "(+9-10% tokens/s at 1 and 8 in flight on a 2-core VM); a token's result stays independent of its step's "
        "drafts. false: vLLM's RMSNorm",
    )

    cpu_lean_layers: bool = _option(
        True, _bool,
        "CPU build, eager float32 Llama models, with cpu_fused_norms and cpu_gemm_max_rows: each decoder layer's "
        "forward calls its norms', linear layers', rotary embedding's, attention's and activation's kernels "
        "directly, in vLLM's order and with vLLM's tensors (the same outputs), without a dozen nn.Module and "
        "linear-layer dispatches a layer (~1.2 ms of a ~35 ms step of SmolLM2-135M on a 2-core VM). false: "
        "vLLM's decoder layers",
    )

    ngram_table: str = _option(
        "", _string, "N-Grammys: the model's n-gram table directory (empty: the cache default)"
    )
    ngrammys_drafts: int = _option(
        10, _int_in(1, 256), "N-Grammys: drafts per request (context n-grams, then bigram)"
    )
    ngrammys_draft_len: int = _option(
        8, _int_in(1, 128), "N-Grammys: tokens per draft (at most num_speculative_tokens)"
    )
    ngrammys_context_len: int = _option(
        1, _int_in(1, 8), "N-Grammys: context tokens matched to find context n-grams"
    )
    ngrammys_mixing: str = _option(
        "context-first", _one_of(*MIXING_POLICIES),
        "N-Grammys: how the ngrammys_drafts drafts are filled",
    )

    def __post_init__(self) -> None:
        for low, high in (("context_ngram_min", "context_ngram_max"), ("n_min", "n_max")):
            if getattr(self, low) > getattr(self, high):
                raise OptionsError(
                    f"{OPTIONS_KEY}.{low} ({getattr(self, low)}) must not exceed "
                    f"{OPTIONS_KEY}.{high} ({getattr(self, high)})"
                )
        if self.dense_learned_positions == 1:
            raise OptionsError(f"{OPTIONS_KEY}.dense_learned_positions must be 0 (off) or at least 2, got 1")
        if not (self.use_datastore or self.use_context):
            raise OptionsError(
                f"{OPTIONS_KEY}.use_datastore and {OPTIONS_KEY}.use_context are both false: "
                "REST needs at least one source"
            )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> RetrievalSpecOptions:
        """Validate a user-supplied mapping; missing keys take their defaults."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise OptionsError(
                f"additional_config['{OPTIONS_KEY}'] must be a JSON object, got {raw!r}"
            )
        fields = {f.name: f for f in dataclasses.fields(cls)}
        _check_keys(raw, fields)
        values = {key: fields[key].metadata["validate"](key, value) for key, value in raw.items()}
        return cls(**values)

    @classmethod
    def from_additional_config(cls, additional_config: Mapping[str, Any] | None) -> RetrievalSpecOptions:
        """Read our section of vLLM's ``additional_config``."""
        if additional_config is not None and not isinstance(additional_config, Mapping):
            raise OptionsError(
                f"additional_config must be a JSON object such as '{{\"{OPTIONS_KEY}\": {{...}}}}', "
                f"got {additional_config!r}"
            )
        config = dict(additional_config or {})
        if "vllm_retrieval_spec" in config and OPTIONS_KEY not in config:
            raise OptionsError(
                "found additional_config['vllm_retrieval_spec']; the options live under "
                f"additional_config['{OPTIONS_KEY}']"
            )
        return cls.from_dict(config.get(OPTIONS_KEY))

    def check_engine(self, num_speculative_tokens: int, kv_cache_dtype: str = "auto") -> None:
        """Refuse, before any engine serves, what these options cannot serve with the engine's
        ``num_speculative_tokens`` and KV cache type (a request would otherwise kill it)."""
        if not 1 <= num_speculative_tokens <= MAX_SPEC_LEN:
            raise OptionsError(
                f"num_speculative_tokens must be in [1, {MAX_SPEC_LEN}] (vLLM verifies at most {MAX_SPEC_LEN} "
                f"draft tokens per request), got {num_speculative_tokens}; set it in --speculative-config"
            )
        if self.tree and str(kv_cache_dtype).startswith("fp8"):
            raise OptionsError(
                f"{OPTIONS_KEY}.tree (tree verification) reads keys and values in the model's dtype and does not "
                f"support --kv-cache-dtype {kv_cache_dtype}; use --kv-cache-dtype auto or chain mode (tree: false)"
            )

    @classmethod
    def describe(cls) -> str:
        """One line per option: name, default and meaning (for ``--help`` texts)."""
        return "\n".join(
            f"{f.name} (default {f.default!r}): {f.metadata['help']}" for f in dataclasses.fields(cls)
        )

    @classmethod
    def markdown_table(cls) -> str:
        """The README's options table: name, default (as JSON) and meaning of every option."""
        rows = [f"| `{f.name}` | `{json.dumps(f.default)}` | {f.metadata['help']} |" for f in dataclasses.fields(cls)]
        return "\n".join(["| option | default | meaning |", "|---|---|---|", *rows])
