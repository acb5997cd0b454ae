"""Tree speculative verification: packing (tree attention masks) and acceptance.

A batch of ragged draft trees is flat (int32): request ``b`` owns nodes
``offsets[b]:offsets[b + 1]``; ``parents[i]`` is node ``i``'s parent as a local index within its
own tree (-1: a child of the root, i.e. of the context's last token), parents before children;
``tokens[i]`` is the node's draft token. Score rows are per request, ``N + B`` in all: request
``b``'s rows start at ``tree_row_offsets(offsets)[b] = offsets[b] + b``, its row 0 being the
target after the context and row ``j + 1`` the target after local node ``j``.

Each kernel runs in C++ (NumPy arrays, CPU threads) or CUDA (torch CUDA tensors) and has a plain
NumPy reference in :mod:`vllm_retrieval_spec.kernels.tree_reference` that it matches exactly: the
acceptance rules, the draw order, the counter-based uniforms and the canonical sums are specified
in ``csrc/tree_accept.h`` and ``csrc/rng.h`` and mirrored there.

Seeded requests use :attr:`AcceptRule.KEYED`: the token at absolute position ``t`` is the
inverse-CDF sample of the target row with the uniform ``keyed_uniform(seed, t)``, and a draft is
accepted iff it is that token, so the emitted tokens do not depend on what was drafted.

Sampled requests can hand the kernel raw logits with their :class:`RowSampling` parameters: it
then computes the target distribution (temperature, top-k, top-p) only for the rows its walk
visits, without sorting the vocabulary (:func:`target_distributions` gives the same rows for
any logits). Draft distributions of the MCSS rules can be sparse (:class:`SparseDraft`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_retrieval_spec.kernels.extension import cuda_torch, is_cuda_tensor, load_extension


class AcceptRule(enum.IntEnum):
    """How a request's tree is verified (``rules[b]``); see ``csrc/tree_accept.h``."""

    GREEDY = 0  # scores are logits; follow the argmax
    CANDIDATES = 1  # deterministic candidates (retrieval drafts), scores are probabilities
    MCSS = 2  # multi-candidate speculative sampling, candidates drawn with replacement from q
    MCSS_NO_REPLACEMENT = 3  # ... drawn without replacement
    KEYED = 4  # seeded sampling: the token at each position from a uniform keyed by (seed, position)


@dataclass(frozen=True)
class RowSampling:
    """Per-request sampling parameters, for :func:`accept_trees` given raw logits.

    ``temperature`` ``[B]`` float32 (> 0 for the sampled rules 1-3; greedy requests ignore it),
    ``top_k`` ``[B]`` int32 (``<= 0`` or ``>= V``: off), ``top_p`` ``[B]`` float32 (> 0;
    ``>= 1``: off). NumPy arrays (or anything array-like) on the CPU, tensors for CUDA.
    """

    temperature: Any
    top_k: Any
    top_p: Any


@dataclass(frozen=True)
class SparseDraft:
    """Draft distributions of the MCSS rules as sparse rows, lined up with the score rows.

    ``tokens`` ``[N + B, M]`` int32, ``-1`` padded, distinct within a row; ``probs`` ``[N + B, M]``
    float32 (>= 0, unnormalised is fine) the draft probability of each listed token. Row ``r``'s
    ``q`` is zero outside its listed tokens, which may include tokens that are not children of
    the node (they still enter the residual ``max(p - q, 0)``). Cost per visited row is
    ``O(M^2)`` and memory ``O(M)``, independent of ``V``.
    """

    tokens: Any
    probs: Any


@dataclass(frozen=True)
class TreeBatch:
    """The draft trees :func:`accept_trees` verifies and how: ``tokens`` and ``parents`` ``[N]``
    and ``offsets`` ``[B + 1]`` int32 (the flat layout of this module), ``rules`` ``[B]`` int32
    (:class:`AcceptRule`), ``seeds`` ``[B]`` uint64 (each request draws from
    ``uniform(seed, 0), uniform(seed, 1), ...``) and ``positions`` ``[B]`` int64, needed by
    :attr:`AcceptRule.KEYED` only: the absolute position of the token each request's row 0
    samples (prompt plus output length). A keyed request's ``seeds[b]`` is its own seed; the node
    at depth ``d`` samples with ``keyed_uniform(seeds[b], positions[b] + d)`` (``csrc/rng.h``).
    NumPy arrays (or anything array-like) on the CPU, tensors for CUDA."""

    tokens: Any
    parents: Any
    offsets: Any
    rules: Any
    seeds: Any
    positions: Any = None

    def on_host(self) -> TreeBatch:
        """Contiguous NumPy copies in the kernels' dtypes (a device sync for CUDA tensors)."""
        tokens, parents, offsets, rules = (np.ascontiguousarray(to_host(a), dtype=np.int32)
                                           for a in (self.tokens, self.parents, self.offsets, self.rules))
        positions = None if self.positions is None else np.ascontiguousarray(to_host(self.positions),
                                                                             dtype=np.int64)
        return TreeBatch(tokens, parents, offsets, rules,
                         np.ascontiguousarray(to_host(self.seeds), dtype=np.uint64), positions)

    def on_device(self, device: Any) -> TreeBatch:
        """Contiguous CUDA tensors in the kernels' dtypes on ``device``."""
        torch = cuda_torch()
        tokens, parents, offsets, rules = (torch.as_tensor(a, dtype=torch.int32, device=device).contiguous()
                                           for a in (self.tokens, self.parents, self.offsets, self.rules))
        positions = None if self.positions is None else torch.as_tensor(
            self.positions, dtype=torch.int64, device=device).contiguous()
        return TreeBatch(tokens, parents, offsets, rules, _cuda_seeds(self.seeds, device), positions)

    def arrays(self) -> tuple:
        """The arguments of the extension's ``accept_trees`` that follow the draft rows."""
        return self.tokens, self.parents, self.offsets, self.rules, self.seeds


@dataclass
class TreeMasks:
    """``depth`` ``[N]`` int32 (1 for children of the root) and ``ancestor_mask``
    ``[N, words]`` uint64: bit ``j`` of row ``i`` (word ``j // 64``, bit ``j % 64``) is set iff
    local node ``j`` is node ``i`` or one of its ancestors."""

    depth: Any
    ancestor_mask: Any


@dataclass
class TreeAcceptance:
    """Per request: ``out_tokens`` ``[B, width]`` (the accepted path's tokens, then the emitted
    token, -1 padded), ``path_nodes`` ``[B, width - 1]`` (local indices of the accepted nodes,
    -1 padded) and ``num_accepted`` ``[B]``. NumPy on the CPU, torch tensors for CUDA inputs."""

    out_tokens: Any
    path_nodes: Any
    num_accepted: Any

    def tokens(self, index: int) -> list[int]:
        """Accepted tokens plus the emitted one for request ``index``."""
        return [int(t) for t in self.out_tokens[index, : int(self.num_accepted[index]) + 1]]


def mask_words(max_nodes: int) -> int:
    """uint64 words per ancestor-mask row for trees of up to ``max_nodes`` nodes."""
    return max(1, -(-max_nodes // 64))


def tree_row_offsets(offsets: Any) -> Any:
    """First score row of each request: ``offsets[b] + b``."""
    if is_cuda_tensor(offsets):
        import torch

        return offsets[:-1] + torch.arange(len(offsets) - 1, device=offsets.device, dtype=offsets.dtype)
    offsets = np.asarray(offsets, dtype=np.int32)
    return offsets[:-1] + np.arange(len(offsets) - 1, dtype=np.int32)


# ---------------------------------------------------------------------------------------------
# Kernels


def pack_tree_masks(
    parents: Any, offsets: Any, max_nodes: int, *, validate: bool = True, num_threads: int = 0
) -> TreeMasks:
    """Depth and ancestor mask of every node (CUDA kernel for CUDA tensors, else CPU threads).

    ``max_nodes`` (at least the largest tree) sets the mask width, ``mask_words(max_nodes)``.
    ``validate`` checks the trees first (on the host: a device sync for CUDA tensors).
    """
    if validate:
        _check_trees(to_host(parents), to_host(offsets), max_nodes)
    return _pack(parents, offsets, mask_words(max_nodes), num_threads)


def tree_depths(parents: Any, offsets: Any, *, validate: bool = True, num_threads: int = 0) -> Any:
    """Depth of every node (1 for children of the root), as in :func:`pack_tree_masks`."""
    if validate:
        _check_trees(to_host(parents), to_host(offsets))
    return _pack(parents, offsets, None, num_threads).depth


def accept_trees(
    scores: Any,
    batch: TreeBatch,
    *,
    draft_probs: Any = None,
    draft: SparseDraft | None = None,
    sampling: RowSampling | None = None,
    out_width: int | None = None,
    validate: bool = True,
    num_threads: int = 0,
) -> TreeAcceptance:
    """Verify a batch of draft trees (:class:`TreeBatch`; CUDA kernel when ``scores`` is a CUDA
    tensor).

    ``scores`` ``[N + B, V]`` float32: logits for greedy requests (no NaN), probabilities
    (after temperature/top-k/top-p, unnormalised is fine) for sampled ones; an all-zero row
    emits -1. ``draft_probs`` ``[N + B, V]`` float32 (row of the node the candidates were drawn
    from) is needed by the MCSS rules. ``out_width``
    defaults to the deepest tree + 1; smaller widths cut the trees at depth ``out_width - 1``
    (still lossless). For CUDA, ``validate`` and the default width cost a device sync; CUDA
    workspaces are ``[B, V]`` float64 (rules 1-3) and float32 (rule 3).

    ``sampling`` (:class:`RowSampling`): ``scores`` are then raw logits for every request, and
    for rules 1-3 the kernel turns only the rows its walk visits into the target distribution,
    ``softmax(apply_top_k_top_p(logits / T, k, p))`` as vLLM defines it, computed in float64
    without sorting (``csrc/tree_accept.h`` specifies it; :func:`target_distributions`
    computes it for whole rows). The top-p boundary can differ from vLLM's only by the float32
    rounding of vLLM's cumulative sum. With CUDA it takes a ``[B, V]`` float64 workspace more.

    ``draft`` (:class:`SparseDraft`): the MCSS rules' draft rows as sparse lists instead of
    ``draft_probs`` (not both); the result is exactly that of the equivalent dense rows.
    """
    if is_cuda_tensor(scores):
        return _accept_cuda(scores, batch, draft_probs, draft, sampling, out_width, validate)
    scores = np.ascontiguousarray(scores, dtype=np.float32)
    dense = None if draft_probs is None else np.ascontiguousarray(draft_probs, dtype=np.float32)
    batch = batch.on_host()
    sampling = None if sampling is None else _host_sampling(sampling)
    draft = None if draft is None else SparseDraft(np.ascontiguousarray(draft.tokens, dtype=np.int32),
                                                   np.ascontiguousarray(draft.probs, dtype=np.float32))
    if validate:
        _check_accept(scores.shape, batch, None if dense is None else dense.shape, out_width, sampling, draft)
    width = out_width if out_width is not None else _max_depth(batch.parents, batch.offsets, num_threads) + 1
    requests = len(batch.offsets) - 1
    out = TreeAcceptance(
        out_tokens=np.empty((requests, width), dtype=np.int32),
        path_nodes=np.empty((requests, width - 1), dtype=np.int32),
        num_accepted=np.empty(requests, dtype=np.int32),
    )
    load_extension().accept_trees(scores, dense, *batch.arrays(),
                                  out.out_tokens, out.path_nodes, out.num_accepted, num_threads,
                                  **_sampling_kwargs(sampling), **_draft_kwargs(draft), positions=batch.positions)
    return out


def target_distributions(logits: Any, sampling: RowSampling, *, validate: bool = True,
                         num_threads: int = 0) -> Any:
    """The target distribution :func:`accept_trees` verifies a sampled row against, for every
    row of ``logits`` ``[R, V]`` float32, with ``sampling``'s parameters given per row (``[R]``
    each): ``[R, V]`` float64, unnormalised (divide by the row sum), zero outside the kept
    tokens; an all ``-inf`` row is all zero. Equals vLLM's
    ``apply_top_k_top_p(logits / T, k, p).softmax(-1)`` but for float32 rounding (at the top-p
    boundary, of vLLM's cumulative sum). CUDA kernel for a CUDA tensor, else CPU threads."""
    ext = load_extension()
    if is_cuda_tensor(logits):
        torch = cuda_torch()
        device = logits.device
        logits = logits.to(torch.float32).contiguous()
        sampling = _device_sampling(sampling, device)
        if validate:
            _check_sampling(_host_sampling(sampling), len(logits), None)
        out = torch.empty(logits.shape, dtype=torch.float64, device=device)
        ext.target_rows(logits, *_fields(sampling), out, torch.cuda.current_stream(device).cuda_stream)
        return out
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    sampling = _host_sampling(sampling)
    if validate:
        if logits.ndim != 2 or logits.shape[1] < 1:
            raise ValueError(f"logits must be [R, V >= 1], got {list(logits.shape)}")
        _check_sampling(sampling, len(logits), None)
    out = np.empty(logits.shape, dtype=np.float64)
    ext.target_rows(logits, *_fields(sampling), out, num_threads)
    return out


def _fields(sampling: RowSampling) -> tuple:
    return sampling.temperature, sampling.top_k, sampling.top_p


def _device_sampling(sampling: RowSampling, device: Any) -> RowSampling:
    torch = cuda_torch()
    return RowSampling(*(torch.as_tensor(a, dtype=dtype, device=device).contiguous()
                         for a, dtype in zip(_fields(sampling), (torch.float32, torch.int32, torch.float32))))


def _host_sampling(sampling: RowSampling) -> RowSampling:
    return RowSampling(*(np.ascontiguousarray(to_host(a), dtype=dtype)
                         for a, dtype in zip(_fields(sampling), (np.float32, np.int32, np.float32))))


def _sampling_kwargs(sampling: RowSampling | None) -> dict:
    if sampling is None:
        return {}
    return dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)


def _draft_kwargs(draft: SparseDraft | None) -> dict:
    return {} if draft is None else dict(draft_tokens=draft.tokens, draft_values=draft.probs)


def _pack(parents: Any, offsets: Any, words: int | None, num_threads: int) -> TreeMasks:
    ext = load_extension()
    if is_cuda_tensor(parents):
        torch = cuda_torch()
        device = parents.device
        parents, offsets = (torch.as_tensor(a, dtype=torch.int32, device=device).contiguous()
                            for a in (parents, offsets))
        depth = torch.empty(len(parents), dtype=torch.int32, device=device)
        mask = None if words is None else torch.empty((len(parents), words), dtype=torch.uint64,
                                                      device=device)
        ext.pack_tree_masks(parents, offsets, depth, mask, torch.cuda.current_stream(device).cuda_stream)
        return TreeMasks(depth, mask)
    parents, offsets = (np.ascontiguousarray(a, dtype=np.int32) for a in (parents, offsets))
    depth = np.empty(len(parents), dtype=np.int32)
    mask = None if words is None else np.empty((len(parents), words), dtype=np.uint64)
    ext.pack_tree_masks(parents, offsets, depth, mask, num_threads)
    return TreeMasks(depth, mask)


def _max_depth(parents: Any, offsets: Any, num_threads: int = 0) -> int:
    depth = _pack(parents, offsets, None, num_threads).depth
    return int(depth.max()) if len(depth) else 0


def _accept_cuda(scores: Any, batch: TreeBatch, draft_probs: Any, sparse: SparseDraft | None,
                 sampling: RowSampling | None, out_width: int | None, validate: bool) -> TreeAcceptance:
    ext = load_extension()
    torch = cuda_torch()
    device = scores.device
    # Rules known on the host size the workspaces; without them assume every rule occurs.
    host_rules = to_host(batch.rules) if validate or not is_cuda_tensor(batch.rules) else None
    scores = scores.to(torch.float32).contiguous()
    draft = None if draft_probs is None else draft_probs.to(device, torch.float32).contiguous()
    batch = batch.on_device(device)
    if sampling is not None:
        sampling = _device_sampling(sampling, device)
    if sparse is not None:
        sparse = SparseDraft(torch.as_tensor(sparse.tokens, dtype=torch.int32, device=device).contiguous(),
                             torch.as_tensor(sparse.probs, dtype=torch.float32, device=device).contiguous())
    if validate:
        _check_accept(tuple(scores.shape), batch.on_host(), None if draft is None else tuple(draft.shape),
                      out_width,
                      None if sampling is None else _host_sampling(sampling),
                      None if sparse is None else SparseDraft(to_host(sparse.tokens), to_host(sparse.probs)))
    width = out_width if out_width is not None else _max_depth(batch.parents, batch.offsets) + 1
    requests, vocab = len(batch.offsets) - 1, scores.shape[1]
    needs_p = host_rules is None or bool(np.isin(host_rules, _RESIDUAL_RULES).any())
    mcss = host_rules is None or bool(np.isin(host_rules, _MCSS_RULES).any())
    needs_q = draft is not None and (host_rules is None or
                                     bool((host_rules == AcceptRule.MCSS_NO_REPLACEMENT).any()))
    sampled = host_rules is None or bool((host_rules != AcceptRule.GREEDY).any())
    needs_row = (sampled and sampling is not None) or (needs_p and sparse is not None and mcss)
    sparse_width = 0 if sparse is None else max(1, sparse.tokens.shape[1])
    out = TreeAcceptance(
        out_tokens=torch.empty((requests, width), dtype=torch.int32, device=device),
        path_nodes=torch.empty((requests, width - 1), dtype=torch.int32, device=device),
        num_accepted=torch.empty(requests, dtype=torch.int32, device=device),
    )

    def workspace(needed: bool, columns: int, dtype) -> Any:
        return torch.empty((requests, columns), dtype=dtype, device=device) if needed else None

    p_work = workspace(needs_p, vocab, torch.float64)
    q_work = workspace(needs_q, vocab, torch.float32)
    row_work = workspace(needs_row, vocab, torch.float64)
    needs_sparse = sparse is not None and mcss
    ext.accept_trees(scores, draft, *batch.arrays(), out.out_tokens,
                     out.path_nodes, out.num_accepted, p_work, q_work,
                     torch.cuda.current_stream(device).cuda_stream,
                     **_sampling_kwargs(sampling), **_draft_kwargs(sparse),
                     row_workspace=row_work,
                     sparse_token_workspace=workspace(needs_sparse, sparse_width, torch.int32),
                     sparse_value_workspace=workspace(needs_sparse, sparse_width, torch.float32),
                     positions=batch.positions)
    return out


_MCSS_RULES = (AcceptRule.MCSS, AcceptRule.MCSS_NO_REPLACEMENT)
_RESIDUAL_RULES = (AcceptRule.CANDIDATES, *_MCSS_RULES)  # they keep a [V] float64 residual row each


def _cuda_seeds(seeds: Any, device: Any) -> Any:
    import torch

    if isinstance(seeds, torch.Tensor) and seeds.dtype in (torch.int64, torch.uint64):
        return seeds.to(device).view(torch.uint64).contiguous()
    return torch.as_tensor(np.asarray(seeds, dtype=np.uint64)).to(device)


def to_host(array: Any) -> np.ndarray:
    """A NumPy copy of a host or device array."""
    if hasattr(array, "detach"):
        return array.detach().cpu().numpy()
    return np.asarray(array)


# ---------------------------------------------------------------------------------------------
# Validation (host arrays)


def _check_trees(parents: np.ndarray, offsets: np.ndarray, max_nodes: int | None = None) -> None:
    if parents.ndim != 1 or offsets.ndim != 1 or len(offsets) < 1:
        raise ValueError("parents must be 1-D [N] and offsets 1-D [B + 1]")
    if offsets[0] != 0:
        raise ValueError(f"offsets[0] must be 0, got {offsets[0]}")
    sizes = np.diff(offsets.astype(np.int64))
    if (sizes < 0).any():
        b = int(np.argmax(sizes < 0))
        raise ValueError(f"offsets must not decrease: offsets[{b + 1}] = {offsets[b + 1]} < "
                         f"offsets[{b}] = {offsets[b]}")
    if offsets[-1] != len(parents):
        raise ValueError(f"offsets[-1] = {offsets[-1]} must equal the number of nodes {len(parents)}")
    local = np.arange(len(parents)) - np.repeat(offsets[:-1].astype(np.int64), sizes)
    bad = np.flatnonzero((parents < -1) | (parents >= local))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"parents[{i}] = {parents[i]} must be -1 or a local index below the "
                         f"node's own ({local[i]}): trees are parents-first")
    if max_nodes is not None and max_nodes < int(sizes.max(initial=0)):
        raise ValueError(f"max_nodes = {max_nodes} is below the largest tree ({sizes.max()} nodes)")


def _check_accept(scores_shape: tuple, batch: TreeBatch, draft_shape: tuple | None, out_width: int | None,
                  sampling: RowSampling | None = None, sparse: SparseDraft | None = None) -> None:
    tokens, parents, offsets, rules, seeds = batch.arrays()
    _check_trees(parents, offsets)
    requests = len(offsets) - 1
    if len(scores_shape) != 2 or scores_shape[0] != len(parents) + requests or scores_shape[1] < 1:
        raise ValueError(f"scores must be [N + B, V] = [{len(parents) + requests}, V >= 1], got "
                         f"{list(scores_shape)}")
    vocab = scores_shape[1]
    if tokens.shape != parents.shape:
        raise ValueError(f"tokens must have one entry per node ({len(parents)}), got {tokens.shape}")
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab))
    if bad.size:
        raise ValueError(f"tokens[{bad[0]}] = {tokens[bad[0]]} is outside the vocabulary [0, {vocab})")
    if rules.shape != (requests,) or seeds.shape != (requests,):
        raise ValueError(f"rules and seeds must have one entry per request ({requests})")
    bad = np.flatnonzero((rules < 0) | (rules > max(AcceptRule)))
    if bad.size:
        raise ValueError(f"rules[{bad[0]}] = {rules[bad[0]]} is not an AcceptRule (0-{max(AcceptRule)})")
    _check_positions(batch.positions, rules)
    if draft_shape is None and sparse is None and np.isin(rules, _MCSS_RULES).any():
        raise ValueError("draft_probs is required by the MCSS rules (2 and 3): pass draft_probs "
                         "[N + B, V] or draft=SparseDraft(tokens, probs)")
    if draft_shape is not None and sparse is not None:
        raise ValueError("pass either draft_probs (dense rows) or draft=SparseDraft(...) (sparse "
                         "rows), not both")
    if draft_shape is not None and tuple(draft_shape) != tuple(scores_shape):
        raise ValueError(f"draft_probs must have the shape of scores {list(scores_shape)}, got "
                         f"{list(draft_shape)}")
    if out_width is not None and out_width < 1:
        raise ValueError(f"out_width must be >= 1, got {out_width}")
    if sampling is not None:
        _check_sampling(sampling, requests, rules)
    if sparse is not None:
        _check_sparse_draft(sparse, scores_shape)


def _check_positions(positions: np.ndarray | None, rules: np.ndarray) -> None:
    if positions is None:
        if (rules == AcceptRule.KEYED).any():
            raise ValueError("positions [B] (each request's root position) is required by "
                             "AcceptRule.KEYED: pass positions=")
        return
    if positions.shape != rules.shape:
        raise ValueError(f"positions must have one entry per request ({len(rules)}), got shape "
                         f"{list(positions.shape)}")
    bad = np.flatnonzero(positions < 0)
    if bad.size:
        raise ValueError(f"positions[{bad[0]}] = {positions[bad[0]]} must be >= 0")


def _check_sampling(sampling: RowSampling, rows: int, rules: np.ndarray | None) -> None:
    """Shapes and values of ``sampling`` (host arrays); ``rules`` None: every row is sampled."""
    for name in ("temperature", "top_k", "top_p"):
        if getattr(sampling, name).shape != (rows,):
            raise ValueError(f"sampling.{name} must have one entry per request ({rows}), got "
                             f"shape {list(getattr(sampling, name).shape)}")
    sampled = np.ones(rows, bool) if rules is None else rules != AcceptRule.GREEDY
    bad = np.flatnonzero(sampled & ~(np.isfinite(sampling.temperature) & (sampling.temperature > 0)))
    if bad.size:
        raise ValueError(f"sampling.temperature[{bad[0]}] = {sampling.temperature[bad[0]]} must be a "
                         "finite value > 0 for a sampled rule (use AcceptRule.GREEDY for "
                         "temperature 0)")
    bad = np.flatnonzero(sampled & ~(sampling.top_p > 0))
    if bad.size:
        raise ValueError(f"sampling.top_p[{bad[0]}] = {sampling.top_p[bad[0]]} must be > 0 (1 turns "
                         "top-p off)")


def _check_sparse_draft(sparse: SparseDraft, scores_shape: tuple) -> None:
    tokens, probs = sparse.tokens, sparse.probs
    rows, vocab = scores_shape
    if tokens.ndim != 2 or tokens.shape[0] != rows or probs.shape != tokens.shape:
        raise ValueError(f"draft.tokens and draft.probs must both be [N + B, M] = [{rows}, M], got "
                         f"{list(tokens.shape)} and {list(probs.shape)}")
    bad = np.argwhere((tokens < -1) | (tokens >= vocab))
    if bad.size:
        r, j = bad[0]
        raise ValueError(f"draft.tokens[{r}, {j}] = {tokens[r, j]} must be a token in [0, {vocab}) "
                         "or -1 (padding)")
    listed = tokens >= 0
    bad = np.argwhere(listed & ~(np.isfinite(probs) & (probs >= 0)))
    if bad.size:
        r, j = bad[0]
        raise ValueError(f"draft.probs[{r}, {j}] = {probs[r, j]} must be finite and >= 0")
    ordered = np.sort(np.where(listed, tokens, -1 - np.arange(tokens.shape[1])), axis=1)
    bad = np.argwhere((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0))
    if bad.size:
        r, j = bad[0]
        raise ValueError(f"draft.tokens[{r}] lists token {ordered[r, j]} twice: merge duplicate "
                         "entries (add their probabilities)")
