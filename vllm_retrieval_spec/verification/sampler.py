"""The sampler that replaces vLLM's ``runner.rejection_sampler`` for our proposers.

It keeps the rejection sampler's contract (``[batch, max_spec_len + 1]`` int32: accepted
tokens, then the emitted token, ``-1`` padding) so the rest of vLLM is untouched. Steps the
session planned (a tree branches, or a request that samples has drafts) are walked with the
acceptance kernel: the greedy rule for greedy requests, the lossless deterministic-candidate
rule for drafted candidates, MCSS with the drafter's ``q`` for candidates drawn from it; the
accepted path's K/V then move into the first draft slots, because the scheduler keeps the KV
of a prefix of the draft slots. Other steps, and chain steps whose requests use sampling
features applied to drafts as a sequence (penalties, bad words, ...), go to vLLM's own rejection
sampler, with the drawn candidates' ``q`` as its draft probabilities, except greedy chain steps
on the CPU that nothing else touches: one argmax over the step's logits gives what vLLM's
greedy rejection would (:func:`greedy_chain_step`).

Seeded requests (``seed`` at temperature > 0) repeat exactly: every step that holds one is ours,
drafted or not, and verifies it with the keyed rule (:attr:`AcceptRule.KEYED`): the token at
absolute position ``t`` is the inverse-CDF sample of the target distribution with the uniform
``keyed_uniform(seed, t)``, and a draft (or a tree's child) is accepted iff it is that token, so
the tokens are those of the no-draft path whatever was drafted, whatever ran beside or before.
In chain steps with sequence features their logits are first processed as vLLM's rejection
sampler processes them. MCSS stays off this path: a step whose candidates were drawn from the
drafter's ``q`` (``candidates: "sampled"``) is verified by MCSS, seeded or not, and keeps the
model's distribution without repeating (its outcome depends on ``q`` and on what was drafted).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.rejection_sampler import RejectionSampler

from vllm_retrieval_spec.kernels.tree import (
    AcceptRule,
    RowSampling,
    SparseDraft,
    TreeBatch,
    accept_trees,
    to_host,
)
from vllm_retrieval_spec.verification.session import PLACEHOLDER_TOKEN, SpecSession
from vllm_retrieval_spec.verification.trees import TreeStepPlan

GREEDY_TEMPERATURE = 0.0


class TreeRejectionSampler(RejectionSampler):
    """vLLM's rejection sampler, verifying this step's draft trees instead of chains."""

    def __init__(self, sampler: object, session: SpecSession, replacement: bool = False) -> None:
        super().__init__(sampler)
        self._session = session
        self._drawn_rule = AcceptRule.MCSS if replacement else AcceptRule.MCSS_NO_REPLACEMENT

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        plan = self._session.plan
        if plan is None:
            if not logits.is_cuda and greedy_without_processing(sampling_metadata):
                return SamplerOutput(sampled_token_ids=greedy_chain_step(metadata, logits), logprobs_tensors=None)
            return super().forward(metadata, draft_probs, logits, sampling_metadata)
        keyed = keyed_rows(sampling_metadata, len(plan.offsets) - 1) & ~drawn_rows(plan)
        scores = logits = logits.to(torch.float32)
        if processes_drafts_as_a_sequence(sampling_metadata):
            branching = plan.is_branching()
            if not (branching or keyed.any()):
                self._session.plan = None
                probs = None if plan.draft_q is None else torch.from_numpy(chain_draft_probs(plan, logits.shape[1]))
                return super().forward(metadata, None if probs is None else probs.to(logits.device), logits,
                                       sampling_metadata)
            # A step with branching trees holds such requests only undrafted (tree mode admits them
            # only with speculation turned off): their one row, the bonus row, is all they need processed.
            scores = self._processed_as_a_sequence(metadata, logits, sampling_metadata, at_drafts=not branching)
        rows = plan.logit_rows()
        node_scores = scores if rows is None else scores[torch.from_numpy(rows).to(logits.device)]
        out_tokens, path_nodes, num_accepted = self._accept(plan, node_scores, keyed, metadata, sampling_metadata)
        self._session.finish_step(path_nodes, num_accepted)
        output = torch.as_tensor(out_tokens).to(logits.device)
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._path_logprobs(plan, scores if self.is_processed_logprobs_mode else logits, metadata,
                                           sampling_metadata, path_nodes, output)
        return SamplerOutput(sampled_token_ids=output, logprobs_tensors=logprobs)

    def _processed_as_a_sequence(self, metadata, logits: torch.Tensor, sampling_metadata,
                                 at_drafts: bool = True) -> torch.Tensor:
        """The logits vLLM's rejection sampler samples from in a chain step: penalties, bad
        words, allowed token ids, min_tokens and thinking budgets applied along each chain by its
        own processors, at the draft rows (unless not ``at_drafts``) and, as its sampler does, at
        the bonus rows."""
        processed = logits.clone()
        target, bonus = metadata.target_logits_indices, metadata.bonus_logits_indices
        if at_drafts:
            processed[target] = self.apply_logits_processors(processed[target], sampling_metadata, metadata)
        processed[bonus] = self.sampler.apply_logits_processors(processed[bonus], sampling_metadata,
                                                                predict_bonus_token=True)
        return processed

    def _accept(self, plan: TreeStepPlan, logits: torch.Tensor, keyed: np.ndarray, metadata, sampling_metadata):
        """Walk every tree from the logits: the kernel computes the target distribution
        (temperature, top-k, top-p) only at the nodes its walk visits. Seeded requests (``keyed``)
        take the keyed rule; unseeded ones keep the per-step streams of the candidate rule,
        which promise no repetition and need none, and drawn candidates always take MCSS, whose
        acceptance depends on ``q``."""
        num_requests = len(plan.offsets) - 1
        greedy = request_is_greedy(sampling_metadata, num_requests)
        keyed = keyed & ~greedy
        drawn = drawn_rows(plan) & ~greedy
        rules = np.select([greedy, keyed, drawn], [AcceptRule.GREEDY, AcceptRule.KEYED, self._drawn_rule],
                          AcceptRule.CANDIDATES)
        self._session.stats.mcss_requests += int(drawn.sum())
        on_gpu = logits.is_cuda
        seeds = request_seeds(sampling_metadata, keyed)
        draft = None
        if drawn.any():
            draft = SparseDraft(*(torch.from_numpy(a).to(logits.device) if on_gpu else a
                                  for a in (plan.draft_q.tokens, plan.draft_q.probs)))
        result = accept_trees(  # the CUDA kernel when the logits live on a GPU
            logits if on_gpu else logits.numpy(), tree_batch(plan, rules, seeds, keyed.any()),
            out_width=metadata.max_spec_len + 1, draft=draft,
            sampling=None if greedy.all() else row_sampling(sampling_metadata, num_requests, on_gpu),
        )
        return result.out_tokens, to_host(result.path_nodes), to_host(result.num_accepted)

    def _path_logprobs(self, plan, logits, metadata, sampling_metadata, path_nodes, output):
        """Logprobs of the emitted tokens, read at the rows of the accepted path."""
        starts = np.concatenate([[0], metadata.cu_num_sampled_tokens.cpu().numpy()[:-1]])
        width = output.shape[1]
        rows = np.zeros((len(plan.offsets) - 1, width), dtype=np.int64)
        rows[:, 1:] = np.where(path_nodes[:, : width - 1] >= 0, path_nodes[:, : width - 1] + 1, 0)
        rows += starts[:, None]
        selected = logits[torch.from_numpy(rows.reshape(-1)).to(logits.device)]
        if self.is_processed_logprobs_mode:
            selected = processed_logits(selected, sampling_metadata, width)
        logprobs = selected if self.is_logits_logprobs_mode else self.sampler.compute_logprobs(selected)
        tokens = output.flatten().clamp(min=0).to(torch.int64)
        return self.sampler.gather_logprobs(logprobs, sampling_metadata.max_num_logprobs, tokens)


def greedy_without_processing(sampling_metadata) -> bool:
    """Whether every request is greedy, asks for no logprobs and nothing processes its logits
    (penalties, bad words, allowed token ids, min_tokens, logit bias, a thinking budget, a
    logits processor of vLLM's we do not know): then each emitted token is the argmax of its
    row's raw logits."""
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor

    def inactive(processor: object) -> bool:
        if isinstance(processor, LogitBiasLogitsProcessor):
            return not processor.biases
        return isinstance(processor, MinTokensLogitsProcessor) and not processor.min_toks

    return bool(sampling_metadata.all_greedy and sampling_metadata.max_num_logprobs is None
                and not sampling_metadata.logprob_token_ids
                and not processes_drafts_as_a_sequence(sampling_metadata)
                and all(map(inactive, sampling_metadata.logitsprocs.non_argmax_invariant)))


def greedy_chain_step(metadata, logits: torch.Tensor) -> torch.Tensor:
    """vLLM's greedy rejection of a step of chains (``[requests, max_spec_len + 1]`` int32) from one
    argmax over the step's logits (its own path gathers, copies and takes the argmax of the draft
    rows and the bonus rows apart, each a pass over the vocabulary)."""
    argmax = logits.argmax(dim=-1).numpy()
    tokens = greedy_chain_tokens(metadata.draft_token_ids.numpy(), argmax[metadata.target_logits_indices.numpy()],
                                 argmax[metadata.bonus_logits_indices.numpy()], metadata.num_draft_tokens,
                                 metadata.max_spec_len + 1)
    return torch.from_numpy(tokens)


def greedy_chain_tokens(draft: np.ndarray, target: np.ndarray, bonus: np.ndarray, num_draft: Sequence[int],
                        width: int) -> np.ndarray:
    """Each request's emitted tokens (``[requests, width]`` int32, -1 after them) as vLLM's greedy
    rejection emits them: the target's tokens at its draft positions (``draft`` and ``target``
    flat, ``num_draft`` a request) up to and including the first where the draft is not the
    target's, else all of them and the ``bonus`` token."""
    num_draft = np.asarray(num_draft, np.int64)
    out = np.full((len(num_draft), width), PLACEHOLDER_TOKEN, np.int32)
    starts = np.cumsum(num_draft) - num_draft
    request = np.repeat(np.arange(len(num_draft)), num_draft)
    wrong = np.asarray(draft) != np.asarray(target)
    wrong_before = np.concatenate(([0], np.cumsum(wrong)))  # [k]: wrong drafts among the first k
    emitted = wrong_before[:-1] == wrong_before[starts][request]  # no wrong draft earlier in the request
    out[request[emitted], (np.arange(len(wrong)) - starts[request])[emitted]] = np.asarray(target)[emitted]
    right = np.flatnonzero(wrong_before[starts + num_draft] == wrong_before[starts])
    out[right, num_draft[right]] = np.asarray(bonus)[right]
    return out


def tree_batch(plan: TreeStepPlan, rules: np.ndarray, seeds: np.ndarray, keyed: bool) -> TreeBatch:
    """The acceptance kernel's view of ``plan``'s trees with this step's rules and seeds; the
    roots' positions only when a request is ``keyed`` (the only rule that reads them)."""
    return TreeBatch(plan.tokens, plan.parents, plan.offsets, rules.astype(np.int32), seeds,
                     positions=plan.positions if keyed else None)


def row_sampling(sampling_metadata, num_requests: int, on_gpu: bool) -> RowSampling:
    """Each request's temperature, top-k (0: off) and top-p (1: off) for the kernel."""
    temperature = sampling_metadata.temperature[:num_requests].to(torch.float32)
    top_k, top_p = sampling_metadata.top_k, sampling_metadata.top_p
    top_k = torch.zeros(num_requests, dtype=torch.int32) if top_k is None else top_k[:num_requests].to(torch.int32)
    top_p = torch.ones(num_requests, dtype=torch.float32) if top_p is None else top_p[:num_requests].to(torch.float32)
    values = (temperature, top_k.to(temperature.device), top_p.to(temperature.device))
    return RowSampling(*(values if on_gpu else (v.cpu().numpy() for v in values)))


def processed_logits(rows: torch.Tensor, sampling_metadata, width: int) -> torch.Tensor:
    """``rows`` (``width`` per request) after each request's temperature, top-k and top-p,
    as vLLM's processed logprobs modes report them (greedy requests: unchanged)."""
    def per_row(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values[: len(rows) // width].repeat_interleave(width)

    if sampling_metadata.all_greedy:
        return rows
    temperature = per_row(sampling_metadata.temperature)
    greedy = temperature == GREEDY_TEMPERATURE
    scaled = rows / torch.where(greedy, 1.0, temperature).unsqueeze(-1)
    processed = apply_top_k_top_p(scaled, per_row(sampling_metadata.top_k), per_row(sampling_metadata.top_p))
    return torch.where(greedy.unsqueeze(-1), rows, processed)


def processes_drafts_as_a_sequence(sampling_metadata) -> bool:
    """Whether a request of the batch uses sampling features vLLM's rejection sampler applies
    to drafts as a sequence (penalties, bad words, allowed token ids, min_tokens, a thinking
    budget); tree mode admits them only in requests that turned speculation off."""
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    holder = getattr(sampling_metadata, "thinking_budget_state_holder", None)
    return bool(
        not sampling_metadata.no_penalties
        or sampling_metadata.bad_words_token_ids
        or sampling_metadata.allowed_token_ids_mask is not None
        or any(isinstance(p, MinTokensLogitsProcessor) and p.min_toks
               for p in sampling_metadata.logitsprocs.non_argmax_invariant)
        or (holder is not None and holder.has_tracked_requests())
    )


def chain_draft_probs(plan: TreeStepPlan, vocab: int) -> np.ndarray:
    """vLLM's ``draft_probs`` (``[drafted tokens, vocab]``, a row per scheduled draft slot)
    for a step of chains: each drawn token's ``q``, one-hot rows for deterministic candidates
    (which makes vLLM's rule the deterministic-candidate rule), zero rows for placeholders
    (vLLM rejects them)."""
    sizes = plan.sizes
    request = np.repeat(np.arange(len(sizes)), sizes)
    probs = plan.draft_q.dense(vocab)[np.arange(len(plan.tokens)) + request]
    deterministic = ~plan.draft_q.drawn[request]
    probs[deterministic] = 0.0
    probs[np.flatnonzero(deterministic), plan.tokens[deterministic]] = 1.0
    slot_rows = plan.draft_slot_rows()
    if slot_rows is None:
        return probs
    slots = np.zeros((int(plan.scheduled.sum()), vocab), np.float32)
    slots[slot_rows] = probs
    return slots


def request_is_greedy(sampling_metadata, num_requests: int) -> np.ndarray:
    if sampling_metadata.all_greedy:
        return np.ones(num_requests, dtype=bool)
    return (sampling_metadata.temperature[:num_requests] == GREEDY_TEMPERATURE).cpu().numpy()


def drawn_rows(plan: TreeStepPlan) -> np.ndarray:
    """``[B]`` bool: the requests whose candidates were drawn from the drafter's ``q``."""
    return np.zeros(len(plan.offsets) - 1, bool) if plan.draft_q is None else plan.draft_q.drawn


def keyed_rows(sampling_metadata, num_requests: int) -> np.ndarray:
    """``[B]`` bool: the requests that sample with a seed (vLLM gives exactly those a
    generator)."""
    keyed = np.zeros(num_requests, bool)
    keyed[[row for row in sampling_metadata.generators if row < num_requests]] = True
    return keyed


def request_seeds(sampling_metadata, keyed: np.ndarray) -> np.ndarray:
    """``[B]`` uint64: a keyed request's own seed (its generator's), for the others a fresh
    63-bit draw from torch's global generator."""
    seeds = torch.randint(0, 2**62, (len(keyed),), dtype=torch.int64).numpy().view(np.uint64)
    rows = np.flatnonzero(keyed)
    seeds[rows] = [sampling_metadata.generators[row].initial_seed() for row in rows]
    return seeds
