"""The tree sampler that replaces vLLM's ``runner.rejection_sampler`` in tree mode.

It keeps the rejection sampler's contract (``[batch, max_spec_len + 1]`` int32: accepted
tokens, then the emitted token, ``-1`` padding) so the rest of vLLM is untouched, walks each
request's tree with the acceptance kernel (greedy rule for greedy requests, the lossless
deterministic-candidate rule otherwise, MCSS when draft probabilities come with the trees)
and moves the accepted path's K/V into the first draft slots, because the scheduler keeps
the KV of a prefix of the draft slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.rejection_sampler import RejectionSampler

from vllm_retrieval_spec.kernels.tree import AcceptRule, accept_trees, to_host
from vllm_retrieval_spec.verification.session import SpecSession
from vllm_retrieval_spec.verification.trees import TreeStepPlan

GREEDY_TEMPERATURE = 0.0


class TreeRejectionSampler(RejectionSampler):
    """vLLM's rejection sampler, verifying this step's draft trees instead of chains."""

    def __init__(self, sampler: object, session: SpecSession,
                 kv_caches: Callable[[], Sequence[torch.Tensor]]) -> None:
        super().__init__(sampler)
        self._session = session
        self._kv_caches = kv_caches

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        plan = self._session.plan
        if plan is None:
            return super().forward(metadata, draft_probs, logits, sampling_metadata)
        scores = self._scores(logits, metadata, sampling_metadata)
        out_tokens, path_nodes, num_accepted = self._accept(plan, scores, metadata, sampling_metadata)
        self._session.finish_step(self._kv_caches(), path_nodes, num_accepted)
        output = torch.as_tensor(out_tokens).to(logits.device)
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._path_logprobs(plan, logits, scores, metadata, sampling_metadata, path_nodes, output)
        return SamplerOutput(sampled_token_ids=output, logprobs_tensors=logprobs)

    @staticmethod
    def _scores(logits: torch.Tensor, metadata, sampling_metadata) -> torch.Tensor:
        """Per row: raw logits for greedy requests, target probabilities for the others."""
        logits = logits.to(torch.float32)
        if sampling_metadata.all_greedy:
            return logits
        temperature = sampling_metadata.temperature
        greedy = temperature == GREEDY_TEMPERATURE
        scaled = logits / expand_rows(torch.where(greedy, 1.0, temperature), metadata).unsqueeze(-1)
        top_k, top_p = sampling_metadata.top_k, sampling_metadata.top_p
        processed = apply_top_k_top_p(
            scaled,
            None if top_k is None else expand_rows(top_k, metadata),
            None if top_p is None else expand_rows(top_p, metadata),
        )
        probs = processed.softmax(dim=-1)
        return torch.where(expand_rows(greedy, metadata).unsqueeze(-1), logits, probs)

    def _accept(self, plan: TreeStepPlan, scores: torch.Tensor, metadata, sampling_metadata):
        num_requests = len(plan.offsets) - 1
        greedy = request_is_greedy(sampling_metadata, num_requests)
        rules = np.where(greedy, AcceptRule.GREEDY, AcceptRule.CANDIDATES).astype(np.int32)
        seeds = request_seeds(sampling_metadata, num_requests, scores.device)
        result = accept_trees(  # the CUDA kernel when the logits live on a GPU
            scores if scores.is_cuda else scores.numpy(), plan.tokens, plan.parents, plan.offsets, rules,
            seeds if scores.is_cuda else seeds.numpy().view(np.uint64), out_width=metadata.max_spec_len + 1,
        )
        return result.out_tokens, to_host(result.path_nodes), to_host(result.num_accepted)

    def _path_logprobs(self, plan, logits, scores, metadata, sampling_metadata, path_nodes, output):
        """Logprobs of the emitted tokens, read at the rows of the accepted path."""
        starts = np.concatenate([[0], metadata.cu_num_sampled_tokens.cpu().numpy()[:-1]])
        width = output.shape[1]
        rows = np.zeros((len(plan.offsets) - 1, width), dtype=np.int64)
        rows[:, 1:] = np.where(path_nodes[:, : width - 1] >= 0, path_nodes[:, : width - 1] + 1, 0)
        rows += starts[:, None]
        source = scores if self.is_processed_logprobs_mode else logits.to(torch.float32)
        selected = source[torch.from_numpy(rows.reshape(-1))]
        logprobs = selected if self.is_logits_logprobs_mode else self.sampler.compute_logprobs(selected)
        tokens = output.flatten().clamp(min=0).to(torch.int64)
        return self.sampler.gather_logprobs(logprobs, sampling_metadata.max_num_logprobs, tokens)


def expand_rows(per_request: torch.Tensor, metadata) -> torch.Tensor:
    """A per-request value repeated over each request's ``n + 1`` logits rows."""
    counts = metadata.num_draft_tokens
    repeats = torch.as_tensor([n + 1 for n in counts], device=per_request.device)
    return per_request.repeat_interleave(repeats)


def request_is_greedy(sampling_metadata, num_requests: int) -> np.ndarray:
    if sampling_metadata.all_greedy:
        return np.ones(num_requests, dtype=bool)
    return (sampling_metadata.temperature[:num_requests] == GREEDY_TEMPERATURE).cpu().numpy()


def request_seeds(sampling_metadata, num_requests: int, device: torch.device) -> torch.Tensor:
    """One 63-bit seed per request (int64, on ``device``, no host sync): from the request's
    own generator when it has a seed (reproducible sampling), else from torch's global one."""
    seeds = torch.randint(0, 2**62, (num_requests,), dtype=torch.int64).to(device)
    seeded = [(row, generator) for row, generator in sampling_metadata.generators.items() if row < num_requests]
    if seeded:
        rows = torch.tensor([row for row, _ in seeded], device=device)
        draws = [torch.randint(0, 2**62, (1,), generator=g, device=g.device) for _, g in seeded]
        seeds[rows] = torch.cat(draws).to(device)
    return seeds
