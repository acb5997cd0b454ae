"""The skinny float32 GEMM of verification steps on CPUs (``csrc/skinny_gemm.h``).

A decode or verification step multiplies a few rows (one per request, plus its drafts) by every
weight matrix of the model. vLLM's CPU build runs its linear layers through oneDNN with packed
weights, whose cost jumps once a step has more than one row and which reaches ~40% of this 2-core
VM's multiply-add rate at 24-32 rows. The kernel keeps each weight packed in panels of 16 output
columns (:func:`pack_weight`, once when the model loads) and computes blocks of up to 6 rows × 16
columns in registers, on the OpenMP team torch runs on: in an engine ~1.25x oneDNN at 1-3 rows
(both stream the weights), ~1.3x from 5 to 24, level at 32-40 (``benchmarks/skinny_gemm.py``).
:class:`SkinnyLinear` hands larger calls (prefills) back to oneDNN. A model's packed weights share a
:class:`HugePageArena`: on Linux they sit on 2 MiB pages, where the kernel ran 1.00-1.13x as fast
as on the 4 KiB pages torch's allocator gets under transparent huge pages' usual ``madvise`` mode
(alone; ~1.02x in an in-process engine, ``benchmarks/skinny_gemm.py``).
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable

import torch

from vllm_retrieval_spec.kernels.extension import load_extension

LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def pays_on_this_cpu() -> bool:
    """Whether this CPU runs the kernel's fused multiply-add build (x86 with AVX2 or AVX-512); on
    others oneDNN's GEMM is the faster one."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` by the kernel: float32 CPU tensors, ``x`` ``[rows, in]`` and ``weight``
    ``[out, in]`` contiguous, ``bias`` ``[out]`` (``weight`` is packed for the call; a layer packs once)."""
    _require_operands(x, weight, bias)
    return _run(load_extension().skinny_gemm, x, pack_weight(weight), weight.shape[0], bias)


def pack_weight(weight: torch.Tensor, arena: HugePageArena | None = None) -> torch.Tensor:
    """``weight`` ``[out, in]`` in the kernel's layout: panels of ``SKINNY_GEMM_PANEL`` output columns,
    ``[ceil(out / panel), in, panel]``, the last panel's missing columns zero; in ``arena`` if given."""
    panel = load_extension().SKINNY_GEMM_PANEL
    out_features, in_features = weight.shape
    padded = torch.nn.functional.pad(weight, (0, 0, 0, -out_features % panel))
    panels = padded.view(-1, panel, in_features).transpose(1, 2)
    return panels.contiguous() if arena is None else arena.empty(tuple(panels.shape)).copy_(panels)


class HugePageArena:
    """Float32 tensors bump-allocated from anonymous mappings of at least ``chunk_bytes``, advised
    to be backed by 2 MiB pages (``MADV_HUGEPAGE``: Linux, transparent huge pages not ``never``), so
    that streaming a model's packed weights misses the TLB once per 2 MiB and not once per 4 KiB.
    Each tensor keeps its chunk mapped; where the advice does not exist, plain tensors."""

    PAGE = 2 << 20
    ALIGN = 64  # bytes: a cache line

    def __init__(self, chunk_bytes: int = 64 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # bytes of the current chunk not handed out yet

    def empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        nbytes = 4 * int(torch.Size(shape).numel())
        if not hasattr(mmap, "MADV_HUGEPAGE"):
            return torch.empty(shape, dtype=torch.float32)
        if self._chunk is None or self._chunk.numel() < nbytes:
            self._chunk = self._map(max(nbytes, self.chunk_bytes))
        tensor = self._chunk[:nbytes].view(torch.float32).view(shape)
        self._chunk = self._chunk[min(-(-nbytes // self.ALIGN) * self.ALIGN, self._chunk.numel()):]
        return tensor

    def _map(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` from a fresh mapping advised to huge pages, starting on a 2 MiB boundary."""
        region = mmap.mmap(-1, nbytes + self.PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(OSError):  # a kernel built without transparent huge pages: 4 KiB pages
            region.madvise(mmap.MADV_HUGEPAGE)
        raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping while any view of it lives
        start = -raw.data_ptr() % self.PAGE
        return raw[start:start + nbytes]


def _run(kernel: Callable, x: torch.Tensor, packed: torch.Tensor, out_features: int,
         bias: torch.Tensor | None) -> torch.Tensor:
    """``kernel`` (the extension's ``skinny_gemm``) on operands already packed and checked."""
    out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
    kernel(x.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0],
           x.shape[1], out_features)
    return out


def _require_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Shapes, dtypes, devices and layouts the kernel reads by address (anything else is refused)."""
    tensors = {"x": x, "weight": weight} if bias is None else {"x": x, "weight": weight, "bias": bias}
    for name, tensor in tensors.items():
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"skinny_gemm: {name} must be a contiguous float32 CPU tensor, got "
                             f"{tensor.dtype} on {tensor.device} (contiguous: {tensor.is_contiguous()})")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or 0 in (*x.shape, *weight.shape):
        raise ValueError(f"skinny_gemm: x [rows, in] and weight [out, in] must share a non-empty `in`, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"skinny_gemm: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


class SkinnyLinear:
    """A layer's ``cpu_linear`` (vLLM's CPU GEMM dispatch): calls of at most ``max_rows`` contiguous
    2-D float32 rows run the kernel on ``weight`` (the layer's float32 weight, packed once into
    :attr:`packed` beside oneDNN's own copy, in ``arena`` if given); anything else goes to
    ``fallback``, the layer's own ``cpu_linear``."""

    def __init__(self, weight: torch.Tensor, fallback: LinearFn, max_rows: int,
                 arena: HugePageArena | None = None) -> None:
        if not self.accepts(weight):
            raise ValueError(f"SkinnyLinear: the weight must be a contiguous 2-D float32 CPU tensor, got "
                             f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
        self.packed = pack_weight(weight, arena)
        self.fallback = fallback
        self.max_rows = max_rows
        self.out_features, self.in_features = weight.shape
        self._kernel = load_extension().skinny_gemm  # looked up once: ~120 calls a model step

    @property
    def nbytes(self) -> int:
        """The bytes of weights this layer keeps beside oneDNN's."""
        return self.packed.nbytes

    @staticmethod
    def accepts(weight: torch.Tensor) -> bool:
        """Whether the kernel can read ``weight`` (a linear layer's, before vLLM packs it)."""
        return (weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"
                and weight.is_contiguous() and weight.numel() > 0)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._takes(x, bias, self.max_rows):
            return _run(self._kernel, x, self.packed, self.out_features, bias)
        return self.fallback(x, weight, bias)

    def _takes(self, x: torch.Tensor, bias: torch.Tensor | None, max_rows: int) -> bool:
        """Whether the kernel can read ``x`` and ``bias`` by address (what :func:`skinny_gemm` checks, as
        cheaply as a layer's call allows) and ``x`` has at most ``max_rows`` rows."""
        return (x.dim() == 2 and 0 < x.shape[0] <= max_rows and x.shape[1] == self.in_features
                and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()
                and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu"
                                      and bias.is_contiguous() and bias.numel() == self.out_features)))


class ScreenedHead(SkinnyLinear):
    """A language-model head's ``cpu_linear``: a :class:`SkinnyLinear` whose next call after
    :meth:`screen_next` (a step that only takes each row's argmax) returns the exact logits (the skinny GEMM's,
    bit for bit) of the panels of 16 tokens that may hold the row's largest among the first
    ``valid_features``, ``-inf`` elsewhere, screened by a bfloat16 copy of the weight
    (``csrc/skinny_gemm.h``, ``screened_head_cpu``): the same argmax from half the weight bytes. The
    copy is in k-pairs for the bfloat16 dot product where the CPU runs it (``pairs`` None), or as
    ``pairs`` says (tests; pairs on a CPU without it: every call gets the full logits). A call is
    screened up to :attr:`screen_rows` rows (the kernel's ``screened_head_max_rows``), which on the dot
    product lie past ``max_rows``: there the full head is ``fallback``'s (oneDNN's), and slower."""

    def __init__(self, weight: torch.Tensor, fallback: LinearFn, max_rows: int, valid_features: int,
                 arena: HugePageArena | None = None, pairs: bool | None = None) -> None:
        super().__init__(weight, fallback, max_rows, arena)
        if not 1 <= valid_features <= self.out_features:
            raise ValueError(f"ScreenedHead: valid_features must be in [1, {self.out_features}], got {valid_features}")
        self.pairs = load_extension().screened_head_pairs() if pairs is None else pairs
        self.packed_bf16 = _in_k_pairs(self.packed) if self.pairs else self.packed.to(torch.bfloat16)
        norms = weight.to(torch.float64).norm(dim=1).to(torch.float32)
        self.norms = torch.nextafter(norms, torch.tensor(float("inf")))  # rounded up: a bound, never below
        panel = load_extension().SKINNY_GEMM_PANEL
        self.panel_norms = torch.nn.functional.pad(self.norms, (0, -self.out_features % panel)).view(-1, panel).amax(1)
        self.valid_features = valid_features
        self.screen_rows = load_extension().screened_head_max_rows(self.pairs)
        self.armed = False
        self.screened_calls = 0
        self._screen = load_extension().screened_head

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.packed_bf16.nbytes

    def screen_next(self, wanted: bool) -> None:
        """Whether the next call only feeds an argmax per row, and is screened (once)."""
        self.armed = wanted

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        armed, self.armed = self.armed, False
        if armed and bias is None and self._takes(x, None, self.screen_rows):
            out = torch.empty((x.shape[0], self.out_features), dtype=torch.float32)
            if self._screen(x.data_ptr(), self.packed_bf16.data_ptr(), self.packed.data_ptr(), self.norms.data_ptr(),
                            self.panel_norms.data_ptr(), out.data_ptr(), x.shape[0], self.in_features,
                            self.out_features, self.valid_features, self.pairs):
                self.screened_calls += 1
                return out
        return super().__call__(x, weight, bias)


def _in_k_pairs(packed: torch.Tensor) -> torch.Tensor:
    """Packed weights ``[panels, in, 16]`` in bfloat16 k-pairs, ``[panels, ceil(in / 2), 16, 2]`` (an odd
    ``in``'s last pair padded with 0): the layout of the bfloat16 dot product, two k a lane."""
    panels, in_features, panel = packed.shape
    even = torch.nn.functional.pad(packed, (0, 0, 0, in_features % 2))
    return even.view(panels, -1, 2, panel).transpose(2, 3).contiguous().to(torch.bfloat16)
