"""The vLLM ``custom_class`` plumbing shared by every proposer of this package.

vLLM builds the proposer with ``cls(vllm_config)``, calls ``load_model(target_model)`` once
and ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)`` after every
target step, expecting one list of at most ``num_speculative_tokens`` draft tokens per
input-batch row. This base class turns that call into a :class:`DraftBatch` of the rows
that need drafts, each with a token budget that respects ``num_speculative_tokens`` and
``max_model_len``; the subclass returns :class:`~vllm_retrieval_spec.drafts.Drafts`, read
back with one slice per step. With ``budget: auto`` (the default) the runner's goodput
budget first skips rows not worth searching, then keeps only the drafted nodes that raise
the batch's expected tokens per second. A failure of the subclass becomes "no drafts this step"
(logged once, counted) instead of a dead server. In tree mode the trees go to the runner's
:class:`~vllm_retrieval_spec.verification.session.SpecSession`, bound by the integration.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
from vllm.logger import init_logger

from vllm_retrieval_spec.candidates import DraftQ, sample_candidate_trees
from vllm_retrieval_spec.compat import require_supported_vllm
from vllm_retrieval_spec.datastores.live_index import LiveMatches
from vllm_retrieval_spec.datastores.output_index import OutputIndex
from vllm_retrieval_spec.drafts import Drafts, DraftTree, count_sources
from vllm_retrieval_spec.goodput import GoodputBudget
from vllm_retrieval_spec.goodput.paths import shallowest
from vllm_retrieval_spec.options import RetrievalSpecOptions

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

    from vllm_retrieval_spec.datastores.context_states import ContextStates
    from vllm_retrieval_spec.datastores.learned_dense import LearnedDenseIndex
    from vllm_retrieval_spec.goodput.search_gate import SearchGate

logger = init_logger(__name__)

CANDIDATE_SEED = 0x5EED  # drafting's own random stream: the same on every tensor-parallel rank
FAILING_STEPS_WARNING = 100  # consecutive failed steps between two warnings


class DraftSession(Protocol):
    """What a proposer needs of the runner's session (``verification.session.SpecSession``)."""

    step_req_ids: list[str]  # the request id of every input-batch row this step
    budget: GoodputBudget | None  # the goodput budget (``budget: auto``), else None
    output_index: OutputIndex | None  # the cross-request output index, when uses_output_index()
    learned_dense: LearnedDenseIndex | None  # the dense index learned from served traffic, when we gave one
    context_states: ContextStates | None  # the requests' hidden states by position, when keeps_context_states()
    step_hidden_states: torch.Tensor | None  # [rows, hidden] this step, when needs_hidden_states()
    step_samples: np.ndarray | None  # [rows] bool this step: the row's request samples (temperature > 0)
    step_speculates: np.ndarray | None  # [rows] bool this step: the row's request lets us draft (None: all do)

    def publish(self, trees: Mapping[int, DraftTree], draft_q: Mapping[int, DraftQ] | None = None) -> None:
        """This step's trees by input-batch row, and the draft distributions of the rows whose
        candidates were drawn from them."""

    def live_matches(self, token_ids: np.ndarray, num_tokens: np.ndarray, rows: np.ndarray, max_matches: int,
                     cont_len: int, num_threads: int = 0) -> LiveMatches | None:
        """Continuations for ``rows`` from the other requests in flight, when uses_live_index()."""

    def follow_live_index(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> None:
        """Bring the live index (when there is one) up to this step's rows' tokens."""


@dataclass
class DraftBatch:
    """The rows of one step that need drafts.

    ``token_ids`` and ``num_tokens`` are vLLM's own buffers (``token_ids_cpu`` and
    ``num_tokens_no_spec``): row ``i``'s context is ``token_ids[i, :num_tokens[i]]``. Only
    ``rows`` are to be drafted for, each with at most ``budgets[j]`` tokens; ``trees`` asks
    for draft trees as well as chains.
    """

    token_ids: np.ndarray
    num_tokens: np.ndarray
    rows: np.ndarray
    budgets: np.ndarray
    trees: bool = False

    def __len__(self) -> int:
        return len(self.rows)

    def subset(self, keep: np.ndarray) -> DraftBatch:
        """The rows where ``keep`` is true."""
        return DraftBatch(self.token_ids, self.num_tokens, self.rows[keep], self.budgets[keep], self.trees)


@dataclass
class ChosenDrafts:
    """What one step sends to vLLM: per drafted row its tokens (``[rows, N]``, the first
    ``sizes[i]`` are sent) and their parents; ``sources``: the ``SOURCE_*`` flags of every
    token sent; ``draft_q``: by position in ``rows``, the distribution the candidates of a
    row drawn with ``candidates: "sampled"`` came from."""

    rows: np.ndarray
    tokens: np.ndarray
    parents: np.ndarray
    sizes: np.ndarray
    sources: np.ndarray
    draft_q: dict[int, DraftQ] = field(default_factory=dict)

    def branching(self) -> np.ndarray:
        """``[rows]``: whether a row's nodes sent branch (are not the chain ``parents[j] = j - 1``)."""
        columns = np.arange(self.parents.shape[1])
        return ((self.parents != columns - 1) & (columns < self.sizes[:, None])).any(axis=1)


@dataclass
class ProposerStats:
    """Counters a proposer keeps for tests, benchmarks and operators."""

    steps: int = 0
    rows: int = 0
    unspeculated_rows: int = 0  # request-steps not drafted for: the request turned speculation off
    drafted_rows: int = 0
    draft_tokens: int = 0
    draft_tokens_by_source: dict[str, int] = field(default_factory=dict)  # by ``drafts.source_label``
    failures: int = 0
    consecutive_failures: int = 0  # steps failed since the last one that drafted without error
    last_error: str | None = field(default=None, repr=False)


class DraftProposer(abc.ABC):
    """Base of every ``vllm_retrieval_spec.<Name>Proposer`` (vLLM's ``custom_class``)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        require_supported_vllm()
        speculative_config = vllm_config.speculative_config
        self.num_speculative_tokens = int(speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.options = RetrievalSpecOptions.from_additional_config(vllm_config.additional_config)
        self.options.check_engine(self.num_speculative_tokens, vllm_config.cache_config.cache_dtype)
        self.stats = ProposerStats()
        self.session: DraftSession | None = None
        self.aside_seconds = 0.0  # of this step's draft(): spent on what it does not send (not drafting time)
        self._rng = np.random.default_rng(CANDIDATE_SEED)

    def bind_session(self, session: DraftSession) -> None:
        """The runner's session (request ids, per-request state, tree verification)."""
        self.session = session

    def features_needing_session(self) -> list[str]:
        """The configured features that work only through the runner's session (as options)."""
        options = self.options
        features = {
            "tree: true": options.tree,
            'budget: "auto"': options.budget == "auto",
            'candidates: "sampled"': options.candidates == "sampled",
            "the output index (use_output_index)": self.uses_output_index(),
            "the live index (use_live_index)": self.uses_live_index(),
            f"the target's hidden states ({type(self).__name__})": self.needs_hidden_states(),
            "the context's hidden states (context_state_votes)": self.keeps_context_states(),
        }
        return [feature for feature, wanted in features.items() if wanted]

    def uses_output_index(self) -> bool:
        """Whether the runner's session should keep a cross-request output index for us."""
        return False

    def uses_live_index(self) -> bool:
        """Whether the runner's session should keep a live index of the requests in flight for us."""
        return False

    def needs_hidden_states(self) -> bool:
        """Whether the runner's session should keep the target's last hidden state of every
        row for us (``session.step_hidden_states``)."""
        return False

    def keeps_context_states(self) -> bool:
        """Whether the runner's session should keep the hidden state that produced every token
        of each running request for us (``session.context_states``)."""
        return False

    def learned_dense_index(self) -> LearnedDenseIndex | None:
        """A new dense index for the runner's session to learn from served traffic (dense
        proposers with ``dense_learned_positions``), else None."""
        return None

    def search_gate(self) -> SearchGate | None:
        """The gate of an optional search this proposer runs only while it pays (Hybrid's dense
        search), for the metrics; else None."""
        return None

    def candidate_tree_size(self) -> int:
        """Nodes of the candidate trees the drafter builds: ``top_k`` to draw sampled candidates
        from or for a goodput budget to choose among, at most the node budget for deterministic
        trees cut to it (``budget: fixed``), 0 for chains only."""
        if self.options.candidates == "sampled" or (self.options.tree and self.options.budget == "auto"):
            return self.options.top_k  # a budget chooses the best of them
        return min(self.options.top_k, self.num_speculative_tokens) if self.options.tree else 0

    def load_model(self, target_model: torch.nn.Module) -> None:  # noqa: B027 (an optional hook)
        """Called once with the loaded target model; retrieval proposers need nothing from it."""

    @abc.abstractmethod
    def draft(self, batch: DraftBatch) -> Drafts:
        """Drafts for every requested row (longer ones are cut to the row's budget), with
        trees when ``batch.trees``."""

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: object = None,
        **_: object,
    ) -> list[list[int]]:
        """vLLM's entry point: one list of draft token ids per input-batch row."""
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        try:
            chosen = self._chosen_drafts(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        except Exception as error:  # a drafting bug must never take the server down
            self._record_failure(error)
            return drafts
        self.stats.consecutive_failures = 0
        if chosen is None:
            return drafts
        rows, sizes = chosen.rows.tolist(), chosen.sizes.tolist()
        for row, row_tokens, size in zip(rows, chosen.tokens.tolist(), sizes):
            drafts[row] = row_tokens[:size]
        self.stats.drafted_rows += int(np.count_nonzero(chosen.sizes))
        self.stats.draft_tokens += int(chosen.sizes.sum())
        count_sources(self.stats.draft_tokens_by_source,
                      chosen.sources[np.arange(chosen.sources.shape[1])[None, :] < chosen.sizes[:, None]])
        if self.session is not None and (self.options.tree or chosen.draft_q):
            self._publish_trees(drafts, chosen)
        return drafts

    def _chosen_drafts(self, sampled_token_ids: list[list[int]], num_tokens: np.ndarray,
                       token_ids: np.ndarray) -> ChosenDrafts | None:
        """Draft for the rows that need (and, with a goodput budget, deserve) drafts, then keep
        what the budget chooses (or cut each row to its token budget); with sampled
        candidates, the rows that sample then draw that many nodes from the drafter's ``q``."""
        if self.session is not None:  # every step, searched or not: a skipped step leaves no backlog
            self.session.follow_live_index(token_ids, num_tokens)
        start = time.perf_counter()  # the search time the budget weighs
        batch = self._rows_needing_drafts(sampled_token_ids, num_tokens, token_ids)
        budget = self.session.budget if self.session is not None else None
        if budget is not None:
            req_ids = self.session.step_req_ids
            budget.observe(req_ids, sampled_token_ids)
            batch = batch.subset(budget.worth_searching(len(batch), len(sampled_token_ids),
                                                        self._row_samples(batch.rows)))
            if batch.trees and self.options.candidates == "deterministic":  # sampled ones draw from trees
                batch.trees = budget.wants_trees()
        self.stats.steps += 1
        self.stats.rows += len(batch)
        if len(batch) == 0:
            return None
        self.aside_seconds = 0.0
        found = self.draft(batch)
        trees = batch.trees and self.options.tree and found.tree_tokens is not None  # some draft chains only
        nodes = found.nodes(trees)
        if budget is None:
            chosen = ChosenDrafts(batch.rows, *nodes.kept(shallowest(nodes.parents, nodes.size, batch.budgets),
                                                          prefixes=not trees))
        else:
            keep = budget.choose([req_ids[row] for row in batch.rows.tolist()], nodes, batch.budgets,
                                 len(sampled_token_ids), time.perf_counter() - start - self.aside_seconds, trees=trees,
                                 samples=self._row_samples(batch.rows), context_tokens=batch.num_tokens[batch.rows])
            chosen = ChosenDrafts(batch.rows, *nodes.kept(keep, prefixes=not trees))
        return self._draw_candidates(chosen, found) if self._samples_candidates() else chosen

    def _row_samples(self, rows: np.ndarray) -> np.ndarray | None:
        """Which of ``rows`` belong to requests that sample (None when not known)."""
        samples = None if self.session is None else self.session.step_samples
        return None if samples is None else samples[rows]

    def _samples_candidates(self) -> bool:
        return (self.options.candidates == "sampled" and self.session is not None
                and self.session.step_samples is not None)

    def _draw_candidates(self, chosen: ChosenDrafts, found: Drafts) -> ChosenDrafts:
        """Replace the nodes of the rows whose request samples by as many nodes drawn from the
        drafter's candidate tree (its ``q``), and keep each row's ``q`` for verification."""
        draw = np.flatnonzero(self.session.step_samples[chosen.rows] & (chosen.sizes > 0))
        if not len(draw):
            return chosen
        options = self.options
        candidates = found.nodes(found.tree_tokens is not None).subset(draw)
        drawn = sample_candidate_trees(
            candidates, chosen.sizes[draw], self._rng, per_node=options.candidates_per_node if options.tree else 1,
            replacement=options.candidate_replacement, draft_temperature=options.draft_temperature,
        )
        width = max(chosen.tokens.shape[1], drawn.tokens.shape[1])
        tokens, parents, sources = (_widened(a, width) for a in (chosen.tokens, chosen.parents, chosen.sources))
        used = drawn.tokens.shape[1]
        tokens[draw, :used], parents[draw, :used] = drawn.tokens, drawn.parents
        sources[draw, :used] = np.take_along_axis(candidates.source, np.maximum(drawn.source, 0), axis=1)
        sizes = chosen.sizes.copy()
        sizes[draw] = drawn.size
        draft_q = {int(i): drawn.row_q(j) for j, i in enumerate(draw.tolist())}
        return ChosenDrafts(chosen.rows, tokens, parents, sizes, sources, draft_q)

    def _publish_trees(self, drafts: list[list[int]], chosen: ChosenDrafts) -> None:
        """Hand this step's trees that branch and the rows drawn from ``q`` (tokens already cut to
        each row's size) with their draft distributions to the session; it verifies any other
        row's drafts as the chain they are."""
        publish = sorted(set(np.flatnonzero(chosen.branching()).tolist()) | chosen.draft_q.keys())
        rows, sizes = chosen.rows.tolist(), chosen.sizes.tolist()
        parents = chosen.parents.tolist()
        self.session.publish(
            {rows[i]: DraftTree(tuple(drafts[rows[i]]), tuple(parents[i][: sizes[i]])) for i in publish if sizes[i]},
            {rows[i]: q for i, q in chosen.draft_q.items()},
        )

    def _rows_needing_drafts(
        self, sampled_token_ids: list[list[int]], num_tokens: np.ndarray, token_ids: np.ndarray
    ) -> DraftBatch:
        """Rows that sampled tokens this step (not prefill chunks or discarded rows), have room
        before ``max_model_len`` and whose request did not turn speculation off."""
        sampled = np.fromiter(map(len, sampled_token_ids), dtype=np.int64, count=len(sampled_token_ids))
        room = self.max_model_len - num_tokens[: len(sampled)].astype(np.int64) - 1
        budgets = np.minimum(self.num_speculative_tokens, room)
        wanted = (sampled > 0) & (budgets > 0)
        speculates = None if self.session is None else self.session.step_speculates
        if speculates is not None:
            speculates = speculates[: len(sampled)]
            self.stats.unspeculated_rows += int(np.count_nonzero(wanted & ~speculates))
            wanted &= speculates
        rows = np.flatnonzero(wanted).astype(np.int32)
        return DraftBatch(token_ids=token_ids, num_tokens=num_tokens, rows=rows,
                          budgets=budgets[rows].astype(np.int32),
                          trees=self.candidate_tree_size() > 0 and self.session is not None)

    def guarded(self, step: Callable[[], None]) -> None:
        """Run ``step``, work done for later drafts outside :meth:`propose` (the runner hook
        recording the step's hidden states); its failure counts as a failed drafting step
        instead of stopping the engine."""
        try:
            step()
        except Exception as error:  # a drafting bug must never take the server down
            self._record_failure(error)

    def _record_failure(self, error: Exception) -> None:
        """Count a failed step; log the first with its traceback and warn every
        ``FAILING_STEPS_WARNING`` consecutive ones (speculation is then lost, not the server)."""
        stats = self.stats
        stats.failures += 1
        stats.consecutive_failures += 1
        stats.last_error = f"{type(error).__name__}: {error}"
        if stats.failures == 1:
            logger.exception(
                "%s failed to draft; this and later failing steps get no drafts (output stays "
                "exact); the metric vllm_retrieval_spec:drafting_failures counts them",
                type(self).__name__,
            )
        if stats.consecutive_failures % FAILING_STEPS_WARNING == 0:
            logger.warning(
                "%s: the last %d steps all failed to draft, so the server runs without speculation "
                "(last error: %s); check its datastore, table and options", type(self).__name__,
                stats.consecutive_failures, stats.last_error,
            )


def _widened(array: np.ndarray, width: int) -> np.ndarray:
    """A writable copy of ``[rows, N]`` padded with -1 to ``width`` columns."""
    out = np.full((array.shape[0], width), -1, dtype=array.dtype)
    out[:, : array.shape[1]] = array
    return out
