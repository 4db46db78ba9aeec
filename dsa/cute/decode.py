"""CuTe DSL sparse decode (SM90): what it serves, its split plan and placement, compilation cache, launch.

    decode(a)                -> out [T, H, d_v] (q.dtype), lse [T, H] fp32 (natural log, +inf on empty rows)
    forward(a, splits=None)  -> the same, the split count forced when given (benchmark sweeps)

on the canonical :class:`dsa._args.SparseDecodeArgs`.  The kernel is
``decode_sm90.SparseDecodeSm90`` (the SM90 forward over a paged cache, split
over the slots); with several splits its parts are merged, and the sink
folded in, by its ``merge_kernel``, which the same compiled host function
launches right after it: a call is one launch from Python either way.

Splits: ``split_plan`` is the Triton decode's rule (``dsa.triton.decode.
split_plan``) at 64-slot blocks, a split at least a pair of them: S =
min(SMs // tiles, K / 128), about one wave.  It depends on the shapes and the device only, so the workspace
(``[T, H, S]`` lse then ``[T, H, S, d_v]`` parts, fp32, one allocation) is
sized by shapes alone and nothing is read back: a call captures in a CUDA
graph.

Host time: everything but the tensors' addresses is built once per shape
key (``plan``): the compile key, the split count, the scalars; ``prepare``
(the protocol of :mod:`dsa.ops.decode`, which ``dsa.sparse_decode_plan``
uses) binds the rest once more, and a call reads its tensors' addresses,
looks their pointer arguments up and launches.

Placement under ``backend="auto"``: ``PLACEMENT`` lists, per GPU name, the
(cache format, H, batch range) where bench/decode_peers.py measured the
cute decode ahead of Triton; elsewhere auto declines with the reason (no
measurement on this GPU, none covering the shape) and ``backend="cute"``
runs the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from dsa._args import SparseDecodeArgs
from dsa._kept import kept
from dsa._rules import LOG2E
from dsa.cute.host import (alignment_reason, compile_kernel, cutlass_dtype, device_name, dsl_reason, sm90_reason,
                           stream_handle, zero_row)
from dsa.kv_cache import FORMATS, NATIVE
from dsa.ops.decode import run_fresh

HEADS_PER_CTA = 64
BLOCK = 64  # slots a block: a split is a whole number of them
SERVED_FORMATS = (NATIVE, "fp8_v32", "fp8_model1")

# Measured placement: (GPU name, cache format, H, (first B, last B)) -> the
# faster backend, filled from bench/decode_peers.py (its cute rows against
# its Triton rows, under CUDA graphs, one query row a sequence, K 2048) on
# that GPU.  H200 (bench/RESULTS.md C61, C63), us cute / Triton: native bf16
# paged H128 B1 18.9 / 29.0, B32 54.9 / 115.8, B128 139.8 / 395.0; H64 B1
# 20.9 / 28.4, B32 47.0 / 72.1, B128 97.3 / 204.4; fp8_v32 H128 B1 23.5 /
# 34.0, B32 84.4 / 199.8, B128 250.6 / 676.4; fp8_v32 H64 (C64, C65) B1 22.0 /
# 34.0, B32 63.5 / 113.6, B128 136.1 / 344.2; fp8_v32 since the lockstep build
# (C171, cute alone) H128 20.4 / 74.2 / 216.6, H64 20.7 / 50.6 / 124.0; with
# direct stores (C215) H128 20.1 / 73.1 / 213.5, H64 19.9 / 50.0 / 118.9.
# fp8_model1 is not measured: auto keeps Triton there.
PLACEMENT: Dict[Tuple[str, str, int, Tuple[int, int]], str] = {
    ("NVIDIA H200", NATIVE, 128, (1, 128)): "cute",
    ("NVIDIA H200", NATIVE, 64, (1, 128)): "cute",
    ("NVIDIA H200", "fp8_v32", 128, (1, 128)): "cute",
    ("NVIDIA H200", "fp8_v32", 64, (1, 128)): "cute",
}
NOT_MEASURED = "no measurement of the cute decode on this GPU yet"


# ----------------------------------------------------------------------------
# What the kernel serves


def supports(a: SparseDecodeArgs) -> Optional[str]:
    """None when the SM90 decode kernel can serve ``a``, else the reason."""
    why = sm90_reason(a.q.device, "the cute sparse decode kernel")
    return why or dsl_reason() or call_reason(a)


def call_reason(a: SparseDecodeArgs) -> Optional[str]:
    """``supports`` without the device and DSL checks: the dtypes, the
    kernel's shapes, the cache's layout and alignment, int32 sizes."""
    from dsa.cute.decode_sm90 import decode_reason

    if a.cache_format not in SERVED_FORMATS:
        return f"cache_format {a.cache_format!r}: the cute decode reads {SERVED_FORMATS}"
    dt = cutlass_dtype(a.q.dtype)
    if dt is None:
        return f"q dtype {a.q.dtype} is not bf16 or fp16"
    if a.cache_format == NATIVE and a.kv.dtype != a.q.dtype:
        return f"kv_cache dtype {a.kv.dtype} differs from q dtype {a.q.dtype}"
    why = decode_reason(dt, a.D, a.d_v, a.H, a.G, a.cache_format, a.page_size, a.block_table is not None,
                        a.seq_lens is not None)
    if why:
        return why
    why = a.kernel_dtype_reason()
    if why:
        return why
    return layout_reason(a) or size_reason(a)


def layout_reason(a: SparseDecodeArgs) -> Optional[str]:
    """Why the cache's layout or an address does not suit the 16-byte gathers (None if it does)."""
    kv = a.kv
    if a.cache_format == NATIVE:
        want = (a.G * a.D, a.D, 1)  # [P, page_size, G, D]: every page's tokens contiguous
        got = tuple(kv.stride()[1:]) if kv.dim() == 4 else None
    else:
        want = (FORMATS[a.cache_format].bytes_per_token, 1)
        got = (kv.stride(1), kv.stride(-1)) if kv.dim() in (3, 4) else None
    if got != want:
        return f"kv_cache strides {tuple(kv.stride())}: the cute decode needs each page's tokens contiguous"
    if (kv.stride(0) * kv.element_size()) % 16:
        return f"kv_cache page stride of {kv.stride(0) * kv.element_size()} bytes is not a multiple of 16"
    return alignment_reason(a, ("q", "kv"))


def size_reason(a: SparseDecodeArgs) -> Optional[str]:
    """Why a size passes the kernel's int32 arithmetic (None if none does)."""
    pages = a.block_table.shape[1] if a.block_table is not None else a.num_pages
    if pages * a.page_size >= 2**31 or a.num_pages * a.page_size >= 2**31:
        return "the slots a cache or a block table addresses (pages * page_size) must fit in int32"
    if a.K >= 2**31 or a.T * a.H // HEADS_PER_CTA * a.K // BLOCK >= 2**31:
        return "K and the tiles of a call (T * H / 64 * K / 64) must fit in int32"
    if a.T * a.H * (a.d_v // 4) >= 2**31:
        return "the merge's units (T * H * d_v / 4) must fit in int32"
    return None


def placement_reason(a: SparseDecodeArgs) -> Optional[str]:
    """Why auto leaves ``a`` to another backend (None where ``PLACEMENT``
    names cute): no measurement on this GPU, none covering the shape, or a
    faster backend measured there."""
    name = device_name(a.q.device)
    rows = {k[1:]: v for k, v in PLACEMENT.items() if k[0] == name}
    if not rows:
        return NOT_MEASURED
    B = a.T // a.rows_per_seq
    for (fmt, H, (lo, hi)), backend in rows.items():
        if fmt == a.cache_format and H == a.H and lo <= B <= hi:
            if backend == "cute":
                return None
            return f"measured on this GPU ({fmt}, H={H}, B in [{lo}, {hi}]): {backend} is faster"
    return f"no measurement of the cute decode on this GPU covers {a.cache_format}, H={a.H}, B={B}"


def placed_note(a: SparseDecodeArgs) -> str:
    """The sentence explain() prints for a call auto sends to cute."""
    return f"measured faster on this GPU for {a.cache_format}, H={a.H}, B={a.T // a.rows_per_seq}"


# ----------------------------------------------------------------------------
# Splits


# The fewest slots a split gets by the rule: a pair of blocks, one for each
# consumer warpgroup. H200 (bench/RESULTS.md C61, bf16 cache, K 2048, CUDA
# graphs): B1 at 32 splits of one block 25.2 us (H128) / 24.1 us (H64), at 16
# splits of a pair 21.4 / 20.9 us.
MIN_SPLIT_SLOTS = 2 * BLOCK


def split_plan(a: SparseDecodeArgs, sms: int, splits: Optional[int] = None) -> Tuple[int, int]:
    """(S, chunk): the split count and slots a split (whole 64-slot blocks).
    The Triton decode's rule over this kernel's tiles (rows x kv heads x
    64-head blocks): S = min(SMs // tiles, K / 128), one wave without a
    partial second and at least a pair of blocks a split; ``splits`` forces
    S (clamped to [1, K / 64])."""
    from dsa.triton.decode import split_plan as plan_splits

    tiles = a.T * a.G * (a.H // a.G // HEADS_PER_CTA)
    return plan_splits(tiles, a.K, BLOCK, sms, splits, MIN_SPLIT_SLOTS)


# ----------------------------------------------------------------------------
# Compilation and launch


def kernel_config(a: SparseDecodeArgs, split: bool):
    """The ``DecodeSm90Config`` that serves ``a`` (its build flags ``build_flags``' defaults)."""
    from dsa.cute.decode_sm90 import DecodeSm90Config

    return DecodeSm90Config(cutlass_dtype(a.q.dtype), a.D, a.d_v, a.H, a.G, a.topk_length is not None,
                            a.sink is not None, a.cache_format, a.page_size, a.block_table is not None,
                            a.seq_lens is not None, split, *build_flags(a.cache_format, a.H // a.G))


def build_flags(cache: str, heads: int, lockstep: Optional[bool] = None, dual: Optional[bool] = None,
                crossover: Optional[bool] = None) -> Tuple[bool, bool, bool]:
    """(lockstep, dual, crossover) of a decode build on ``cache`` with
    ``heads`` query heads a kv head, each as given or, when None, its
    default: lockstep on the caches of ``decode_sm90.LOCKSTEP_CACHES``, two
    producers on a lockstep build of ``DUAL_CACHES``, crossover on a dual
    build of ``CROSSOVER_CACHES`` with a whole number of 128-head pairs."""
    from dsa.cute.decode_sm90 import CROSSOVER_CACHES, DUAL_CACHES, LOCKSTEP_CACHES

    if lockstep is None:
        lockstep = cache in LOCKSTEP_CACHES
    if dual is None:
        dual = lockstep and cache in DUAL_CACHES
    if crossover is None:
        crossover = dual and cache in CROSSOVER_CACHES and heads % (2 * HEADS_PER_CTA) == 0
    return lockstep, dual, crossover


@dataclass(frozen=True, eq=False)
class _Plan:
    """What a call of one shape key launches, built once (no tensor kept)."""

    config: Any       # DecodeSm90Config
    device: int
    splits: int
    scalars: Tuple    # the kernel's scalar arguments, in its order


_PLANS: Dict[Tuple, _Plan] = {}
_COMPILED: Dict[Tuple, Any] = {}  # (DecodeSm90Config, device index) -> compiled kernel


def _sm_count(device: torch.device) -> int:
    from dsa.triton.decode import sm_count

    return sm_count(device)


def plan(a: SparseDecodeArgs, splits: Optional[int] = None) -> _Plan:
    """The launch of ``a``, built once per shape key (and forced split count)."""
    # shape_key leaves out the sizes and scalars the kernel takes besides: the
    # cache's pages and page stride, the block table's width, the rows a
    # sequence, the topk_length grouping and sm_scale
    bt_w = a.block_table.shape[1] if a.block_table is not None else 0
    key = (a.shape_key, a.num_pages, a.kv.stride(0), bt_w, a.rows_per_seq, a.len_div, a.sm_scale, splits)
    return kept(_PLANS, key, lambda: _build(a, splits))


def _build(a: SparseDecodeArgs, splits: Optional[int]) -> _Plan:
    sms = _sm_count(a.q.device)
    S, chunk = split_plan(a, sms, splits)
    bt_w = a.block_table.shape[1] if a.block_table is not None else 0
    scalars = (a.T, a.K, a.num_pages, a.kv.stride(0) * a.kv.element_size(), bt_w, chunk, S, a.len_div,
               a.rows_per_seq, float(a.sm_scale * LOG2E), sms)
    return _Plan(kernel_config(a, S > 1), a.q.device.index, S, scalars)


def scalar_types() -> Tuple:
    """The types of the kernel's scalars (``_Plan.scalars``): T, K, pages, page
    stride (bytes), block-table width, chunk, splits, len_div, rows_per_seq,
    sm_scale * log2(e), CTAs."""
    import cutlass

    I32 = cutlass.Int32
    return I32, I32, I32, cutlass.Int64, I32, I32, I32, I32, I32, cutlass.Float32, I32


def pointer_types(config) -> Tuple:
    """(element type, alignment) of the kernel's pointers, in order: q, kv,
    indices, topk_length, block table, seq_lens, sink, the (parts') out, the
    (parts') lse, the zero row, the merge's out and lse (split builds)."""
    import cutlass

    dt = config.dtype
    kv_t = dt if config.cache == NATIVE else cutlass.Uint8
    part_t = cutlass.Float32 if config.split else dt
    I32, F32 = (cutlass.Int32, 4), (cutlass.Float32, 4)
    return (dt, 16), (kv_t, 16), I32, I32, I32, I32, F32, (part_t, 16), F32, (kv_t, 16), (dt, 8), F32


def _compiled(p: _Plan):
    """The compiled kernel of p's configuration on its device (compiled on first use)."""
    key = (p.config, p.device)
    fn = _COMPILED.get(key)
    if fn is None:
        from dsa.cute.decode_sm90 import SparseDecodeSm90

        fn = _COMPILED[key] = compile_kernel(SparseDecodeSm90.from_config(p.config), pointer_types(p.config),
                                             scalar_types())
    return fn


class Prepared:
    """The launches of every call with ``a``'s metadata, all but the tensors
    bound once: the plan (compile key, split count, scalars), the compiled
    kernel (with splits, the decode and its merge), the zero row and
    (``reuse_workspace``) the split workspace, which its calls then share
    (ordered on one stream).
    ``run(q, kv, indices, topk_length, block_table, seq_lens, sink, out,
    lse)`` takes the canonical tensors (any shape of their elements) and
    writes out and lse: the protocol of ``prepare`` in :mod:`dsa.ops.decode`.
    A call runs with a's device current (the op layer's guarantee)."""

    def __init__(self, a: SparseDecodeArgs, reuse_workspace: bool = False, splits: Optional[int] = None):
        p = self.plan = plan(a, splits)
        native = a.cache_format == NATIVE
        self._device = a.q.device
        self._zero = zero_row(a.q.device, a.q.dtype if native else torch.uint8, zero_row_size(a)).data_ptr()
        self._n_lse = a.T * a.H * p.splits  # the parts' lse [T, H, S], then their outputs [T, H, S, d_v]
        self._n_work = self._n_lse * (a.d_v + 1)
        self._work = self._workspace() if reuse_workspace and p.splits > 1 else None
        self._work_ptrs = None if self._work is None else tuple(w.data_ptr() for w in self._work)
        # compiled now (once per configuration and device), not at a first call that a CUDA graph may capture
        self._fn = _compiled(p)

    def _workspace(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(the parts' lse, their outputs) in one allocation."""
        work = torch.empty(self._n_work, dtype=torch.float32, device=self._device)
        return work[: self._n_lse], work[self._n_lse:]

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, topk_length: Optional[torch.Tensor],
                 block_table: Optional[torch.Tensor], seq_lens: Optional[torch.Tensor], sink: Optional[torch.Tensor],
                 out: torch.Tensor, lse: torch.Tensor) -> None:
        p = self.plan
        S = p.splits
        # each address read once; absent optional inputs are never read, any valid address stands in
        a_q, a_kv, a_idx = q.data_ptr(), kv.data_ptr(), indices.data_ptr()
        if S == 1:
            a_pout, a_plse = out.data_ptr(), lse.data_ptr()
        elif self._work_ptrs is not None:
            a_plse, a_pout = self._work_ptrs
        else:
            work = self._workspace()  # held until the launches are queued
            a_plse, a_pout = work[0].data_ptr(), work[1].data_ptr()
        if (a_q | a_kv | a_pout) & 15:
            raise ValueError("the cute decode gathers by 16-byte copies: q, kv_cache and out must be 16-byte aligned")
        a_sink = a_plse if sink is None else sink.data_ptr()
        a_out, a_lse = (a_pout, a_plse) if S == 1 else (out.data_ptr(), lse.data_ptr())
        if a_out & 7:
            raise ValueError("the cute decode's merge stores 8-byte units: out must be 8-byte aligned")
        self._fn(a_q, a_kv, a_idx, a_idx if topk_length is None else topk_length.data_ptr(),
                 a_idx if block_table is None else block_table.data_ptr(),
                 a_idx if seq_lens is None else seq_lens.data_ptr(), a_sink, a_pout, a_plse, self._zero, a_out,
                 a_lse, *p.scalars, stream_handle(self._device))


def prepare(a: SparseDecodeArgs, reuse_workspace: bool = False) -> Prepared:
    """The launches of every call with ``a``'s metadata (see :class:`Prepared`)."""
    return Prepared(a, reuse_workspace)


def forward(a: SparseDecodeArgs, splits: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """out [T, H, d_v] in q.dtype and lse [T, H] fp32 (sink excluded, +inf on empty rows)."""
    dev = a.q.device
    if dev.index != torch.cuda.current_device():  # kernels launch on the current device
        with torch.cuda.device(dev):
            return forward(a, splits)
    return run_fresh(Prepared(a, splits=splits), a)


def decode(a: SparseDecodeArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    """The op's entry point (the selector calls it with ``a`` alone)."""
    return forward(a)


decode.prepare = prepare  # the optional protocol of dsa.ops.decode


def zero_row_size(a: SparseDecodeArgs) -> int:
    """Elements (native) or bytes (FP8) of the row an invalid slot reads: a
    row, and for per-page scales (fp8_model1) up to the end of token 0's
    scale record, where the kernel reads an invalid slot's scales."""
    if a.cache_format == NATIVE:
        return a.D
    f = FORMATS[a.cache_format]
    return f.scale_base(a.page_size) + f.scale_record if f.per_page else f.token_bytes


# ----------------------------------------------------------------------------
# Offline compilation (CI, inspection)


def compile_offline(dtype: torch.dtype, H: int, cache: str = NATIVE, page_size: int = 64, has_len: bool = True,
                    has_sink: bool = True, has_bt: bool = True, has_seqlen: bool = True, split: bool = True,
                    lockstep: Optional[bool] = None, dual: Optional[bool] = None,
                    crossover: Optional[bool] = None, D: int = 576, G: int = 1, options: str = "--keep-ptx"):
    """Compile the decode kernel without a GPU (``CUTE_DSL_ARCH=sm_90a``)
    for CI and inspection; returns the compiled object.  lockstep / dual /
    crossover: None for the default (``build_flags``)."""
    from dsa.cute.decode_sm90 import DecodeSm90Config, SparseDecodeSm90

    flags = build_flags(cache, H // G, lockstep, dual, crossover)
    cfg = DecodeSm90Config(cutlass_dtype(dtype) or dtype, D, 512, H, G, has_len, has_sink, cache, page_size, has_bt,
                           has_seqlen, split, *flags)
    return compile_kernel(SparseDecodeSm90.from_config(cfg), pointer_types(cfg), scalar_types(), options)
