"""CuTe DSL sparse attention backward: what it serves, preprocessing, launch.

    backward(a, out, lse, dout) -> dq [T, H, D] (q.dtype), dkv [N, G, D] (kv.dtype),
                                   dsink [H] fp32 or None

on the canonical packed layout of :class:`dsa._args.SparseAttnArgs`.  The
kernel is ``sparse_attention_bwd_sm90.SparseAttnBwdSm90``; what it can serve
is its ``can_implement``.  log2 of the softmax denominator (sink included)
and dsink's parts come from the Triton backward's preprocess
(``dsa.triton.sparse_attention.preprocess``).  Delta = dO . out comes from
the kernel itself (``kernel_delta``: it reads a tile's rows of out into its
stage, where the preprocess would read all of out and dO once more); the
deterministic mode, whose grids need Delta before the kernel runs, takes it
from the preprocess.

``deterministic`` makes dkv bitwise reproducible with the same atomics:
each value is rounded, before its add, to a power-of-two grid of its kv row
fine enough that no partial sum of the row rounds, so the adds are exact and
their order cannot matter.  The grids come from a bound on each row's sum of
|contributions| known before the first add: two weighted head sums of P a
slot, from the deterministic cute forward's bounds output where the call has
it (``dsa.triton.dkv_quanta.forward_bounds``), else from ``slot_bound_sm90``
(S = Q K^T again, the backward's first product); ``dsa.triton.dkv_quanta``
turns them into the rows' grids.  The rounding's
error grows with the adds a row receives, so the tokens' adds go to
``dkv_copies`` copies of the accumulator (a range of tokens each, each
copy with its own grids), summed in a fixed order at the end.

Compiled kernels are cached per (config, device); every launch runs under
the tensors' device and its current stream.  ``run_backward`` (all of this
but the launch; the SM100 backward's deterministic mode stores per-slot rows
summed by ``segment_sum`` instead) and ``natural_columns`` serve the SM100
backward too (``dsa.cute.sm100.sparse_attention``).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch

from dsa._args import SparseAttnArgs
from dsa._rules import LOG2E
from dsa.cute.host import (HEADS_PER_CTA, address, alignment_reason, compile_kernel, cutlass_dtype, dsl_reason,
                           head_blocks, int32_reason, sm90_reason, stream_handle, zero_row)

SERVED_DV = 512

# Build options of the kernel (``BwdSm90Config``): evict_last, dkv kept in
# L2; c0_chunks, the dkv chunks warpgroup 0 adds (0-3 within 1% at V3.2 on an
# H200, bench/RESULTS.md C46-C47); l2_hints 3, Q and dO loaded and dq stored
# evict-first, so that the once-read tiles leave L2 to kv and dkv (V4-flash,
# whose 16384 kv rows and dkv fill the L2, 3.2% faster; the model shapes
# within 1% else; the gathered rows evict-last, measured as bit 4, did not
# help and is gone, C98); kernel_delta, Delta computed in the kernel, not
# by the preprocess's pass over out and dO (0-4% faster at the model shapes
# in three runs, never slower; C158, C159, C164); dq_early, each warpgroup's
# dq stored ahead of the last block's dkv chunks rather than behind the
# tile's last adds (4.2% faster at H64 K128, within the runs' noise at the
# long-row shapes; C188, C189); dq_tma, dq staged in shared memory and
# written by TMA stores rather than from registers (5.4% faster at H64 K128,
# 1-3% at the long-row shapes, C195, C196). tma_rows, the Q / dO / out tiles
# loaded by TMA, stays off: 0.7% slower at H64 K128 (C195).
BUILD = dict(evict_last=True, c0_chunks=2, l2_hints=3, kernel_delta=True, dq_early=True, dq_tma=True)

# (BwdSm90Config, device index) -> compiled kernel: a compiled kernel's
# module is loaded in the context of the device it was compiled on.
_COMPILED: Dict[tuple, object] = {}


def shape_reason(a: SparseAttnArgs) -> Optional[str]:
    """None when dtypes and sizes are ones the kernel is built for (no device
    check; the CuTe DSL must import)."""
    if a.kv.dtype != a.q.dtype:
        return f"kv dtype {a.kv.dtype} differs from q dtype {a.q.dtype}"
    from dsa.cute.sparse_attention_bwd_sm90 import SparseAttnBwdSm90

    why = SparseAttnBwdSm90.can_implement(cutlass_dtype(a.q.dtype) or a.q.dtype, a.D, a.d_v, a.H, a.G)
    if why:
        return why
    why = int32_reason(a)
    if why:
        return why
    return None


def supports_backward(a: SparseAttnArgs) -> Optional[str]:
    """None when the SM90 backward kernel can serve ``a``, else the reason."""
    why = sm90_reason(a.q.device, "the cute sparse attention backward")
    if why:
        return why
    why = dsl_reason() or shape_reason(a) or a.kernel_dtype_reason()
    if why:
        return why
    return alignment_reason(a, ("q", "kv"))


def kernel_config(a: SparseAttnArgs, build: Optional[dict] = None):
    """The ``BwdSm90Config`` that serves ``a`` (``BUILD``, updated by ``build``)."""
    from dsa.cute.sparse_attention_bwd_sm90 import BwdSm90Config

    return BwdSm90Config(cutlass_dtype(a.q.dtype), a.D, a.d_v, a.H, a.G, a.topk_length is not None,
                         bool(a.deterministic), **_options(bool(a.deterministic), build))


def _options(deterministic: bool, build: Optional[dict]) -> dict:
    """``BUILD`` updated by ``build``, less kernel_delta in the deterministic
    mode (the exact adds' grids are made from Delta before the kernel runs)."""
    options = dict(BUILD, **(build or {}))
    if deterministic:
        options["kernel_delta"] = False
    return options


def _ptr_types(dt):
    """(cutlass element type, assumed alignment) of each backward kernel
    pointer every arch's takes, in order: q, kv, indices, topk_length, dout,
    lg2den, delta, dq, dkv, zero row."""
    import cutlass

    I32, F32 = cutlass.Int32, cutlass.Float32
    return ((dt, 16), (dt, 16), (I32, 4), (I32, 4), (dt, 16), (F32, 4), (F32, 4), (dt, 16), (F32, 16),
            (dt, 16))


def _sm90_ptr_types(dt):
    """The SM90 kernel's pointers: ``_ptr_types``, then the deterministic
    build's grids (magic) and the forward's out (read by kernel_delta)."""
    import cutlass

    return _ptr_types(dt) + ((cutlass.Float32, 4), (dt, 16))


def scalar_types() -> Tuple:
    """The types of the kernel's scalars: tc, t0, N, K, sm_scale * log2(e),
    sm_scale, tokens per dkv copy."""
    import cutlass

    I32, F32 = cutlass.Int32, cutlass.Float32
    return I32, I32, I32, I32, F32, F32, I32


def _compiled(a: SparseAttnArgs, cfg=None):
    """The compiled kernel for ``a`` (its ``kernel_config``, or ``cfg`` when
    the caller has it) on a's device (compiled on first use, under that
    device)."""
    cfg = cfg or kernel_config(a)
    key = (cfg, a.q.device.index)
    fn = _COMPILED.get(key)
    if fn is None:
        from dsa.cute.sparse_attention_bwd_sm90 import SparseAttnBwdSm90

        fn = _COMPILED[key] = compile_kernel(SparseAttnBwdSm90.from_config(cfg), _sm90_ptr_types(cfg.dtype),
                                             scalar_types())
    return fn


def _launch(a: SparseAttnArgs, dout, lg2den, delta, dq, dkv_buf, t0: int, tc: int,
            magic: Optional[torch.Tensor] = None, tpc: int = 1, out: Optional[torch.Tensor] = None,
            cfg=None) -> None:
    """The kernel over the tokens [t0, t0 + tc), under a's device; the
    deterministic build also takes the rows' grids and the tokens per dkv
    copy (``dkv_copies``); the kernel_delta build takes the forward's out
    (contiguous) and writes delta.  cfg: a's ``kernel_config`` when the
    caller has it (a few microseconds of host time each)."""
    cfg = cfg or kernel_config(a)
    if cfg.kernel_delta and out is None:
        raise ValueError("the kernel_delta build of the backward computes Delta from the forward's out: pass out")
    length = a.topk_length if a.topk_length is not None else a.indices  # never read when absent
    with torch.cuda.device(a.q.device):
        tensors = (a.q, a.kv, a.indices, length, dout, lg2den, delta, dq, dkv_buf,
                   zero_row(a.q.device, a.q.dtype, a.D), magic if magic is not None else dkv_buf,
                   out if out is not None else dout)
        _compiled(a, cfg)(*(address(x) for x in tensors), tc, t0, a.N, a.K, float(a.sm_scale * LOG2E),
                     float(a.sm_scale), tpc, stream_handle(a.q.device))


def natural_columns(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dkv rows [..., D] fp32 as the kernel wrote them, in column order and
    ``dtype``, in one pass.  The kernel writes each 16-column group in
    fragment order: position 4 q + 2 h + e holds column 8 h + 2 q + e."""
    *lead, D = buf.shape
    out = torch.empty(buf.shape, dtype=dtype, device=buf.device)
    out.view(*lead, D // 16, 2, 4, 2).copy_(buf.view(*lead, D // 16, 4, 2, 2).transpose(-3, -2))
    return out


def backward(a: SparseAttnArgs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
             bounds: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """dq [T, H, D] (q.dtype), dkv [N, G, D] (kv.dtype, accumulated in fp32),
    dsink [H] fp32 (None without a sink).  out [T, H, d_v], lse [T, H] fp32
    (+inf on empty rows) and dout [T, H, d_v] as the forward's; bounds the
    deterministic cute forward's third output (``dsa.cute.sparse_attention.
    forward``), or None."""
    why = supports_backward(a)
    if why:
        raise ValueError(why)
    cfg = kernel_config(a)
    if not cfg.kernel_delta:
        return run_backward(a, out, lse, dout, _launch, exact_dkv=_exact_dkv, bounds=bounds)
    out = out.contiguous()

    def launch(a, dout, lg2den, delta, dq, dkv_buf, t0, tc):
        _launch(a, dout, lg2den, delta, dq, dkv_buf, t0, tc, out=out, cfg=cfg)

    return run_backward(a, out, lse, dout, launch, kernel_delta=True)


# the op's dispatch passes the forward's bounds output to a backward that says it takes it
backward.takes_bounds = True


# launch(a, dout, lg2den, delta, dq, dkv buffer, t0, tc): an arch's kernel over
# the tokens [t0, t0 + tc), under a's device (``_launch`` is SM90's)
Launch = Callable[[SparseAttnArgs, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int],
                  None]


# exact_dkv(a, dout, stats, lg2den, delta, dq, bounds) -> dkv [N, G, D] in kv's
# dtype and column order: a deterministic backward whose adds are exact
# (``_exact_dkv``; stats: the preprocess's max|dO| and ||dO|| bound a row, fp32
# [T, H, 2]; bounds: the forward's, or None)
ExactDkv = Callable[[SparseAttnArgs, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                     Optional[torch.Tensor]], torch.Tensor]


def run_backward(a: SparseAttnArgs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                 launch: Launch, heads_per_part: int = HEADS_PER_CTA, exact_dkv: Optional[ExactDkv] = None,
                 bounds: Optional[torch.Tensor] = None,
                 kernel_delta: bool = False) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``backward``'s host side, shared by every arch's cute backward: the
    per-row terms and dsink's parts from the Triton preprocess (which folds
    the sink), dq, the fp32 dkv accumulator zeroed on the launch stream (the
    current stream of a's device, from its caching allocator: no device
    allocation on a warm call), the kernel launches (``launch``), dkv put
    back in column order and dsink summed.  heads_per_part: the query heads
    whose sum one deterministic per-slot row holds (the kernel's heads per
    dkv accumulator).  exact_dkv: the arch's deterministic dkv by exact adds;
    without it the deterministic mode stores per-slot rows.  bounds: the
    forward's, passed to exact_dkv.  kernel_delta: the launch computes Delta
    (and writes it), so the preprocess reads neither out nor dO (the
    config's kernel_delta, never set in the deterministic mode)."""
    # Under a's device: the torch work, the Triton reduction and the kernel
    # launches are that device's, whatever device is current.
    from dsa.triton.sparse_attention import preprocess

    with torch.cuda.device(a.q.device):
        dout = dout.contiguous()
        exact = a.deterministic and exact_dkv is not None
        # the exact adds' bounds take max|dO| and ||dO|| of each row from the same pass
        stats = torch.empty((a.T, a.H, 2), dtype=torch.float32, device=a.q.device) if exact else None
        delta, lg2den, dsink_part = preprocess(a, out.contiguous(), lse.contiguous(), dout, stats,
                                               delta=not kernel_delta)
        dq = torch.empty_like(a.q)
        if exact:
            dkv = exact_dkv(a, dout, stats, lg2den, delta, dq, bounds)
        else:
            acc = torch.zeros((a.N, a.G, a.D), dtype=torch.float32, device=a.q.device)
            if not a.deterministic:
                launch(a, dout, lg2den, delta, dq, acc, 0, a.T)
            else:
                _deterministic_dkv(a, dout, lg2den, delta, dq, acc, launch, heads_per_part)
            dkv = natural_columns(acc, a.kv.dtype)
        if dsink_part is not None and kernel_delta:  # the preprocess wrote -p_sink alone
            dsink_part = dsink_part.mul_(delta)
        dsink = dsink_part.sum(0) if dsink_part is not None else None
        return dq, dkv, dsink


# The deterministic backward's dkv copies: a (copy, kv row)'s rounding error
# grows with the adds it receives, about 2^-24 times the adds times the
# bound's looseness (bench/notes_cute.md), so the copies are chosen for
# about ADDS_PER_COPY adds a row on average, within COPY_BUDGET bytes.
ADDS_PER_COPY = 256
COPY_BUDGET = 1 << 30


def dkv_copies(a: SparseAttnArgs) -> Tuple[int, int]:
    """(copies of the fp32 dkv accumulator, tokens a copy) of a deterministic
    SM90 backward: token t adds to copy t // tokens a copy."""
    parts = head_blocks(a.H // a.G)
    adds = a.T * a.K * parts / max(a.N, 1)  # a kv row's adds, on average
    cap = max(1, COPY_BUDGET // max(1, a.N * a.G * a.D * 4))
    copies = max(1, min(math.ceil(adds / ADDS_PER_COPY), cap, a.T))
    tpc = max(1, -(-a.T // copies))
    return max(1, -(-a.T // tpc)), tpc


def slot_bounds(a: SparseAttnArgs, lg2den: torch.Tensor, stats: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """X and Y of every computed slot (``slot_bound_sm90``): fp32 [parts, T,
    G, K, 2] (slots past a row's last block holding a valid slot are left
    unwritten).  lg2den and delta [T, H] fp32, stats [T, H, 2] fp32 (max|dO|
    and a bound of ||dO|| a row): the preprocess's."""
    from dsa.cute.slot_bound_sm90 import SlotBoundSm90, SlotBoundSm90Config

    cfg = SlotBoundSm90Config(cutlass_dtype(a.q.dtype), a.D, a.H, a.G, a.topk_length is not None)
    key = (cfg, a.q.device.index)
    fn = _COMPILED.get(key)
    kernel = SlotBoundSm90.from_config(cfg)
    if fn is None:
        fn = _COMPILED[key] = compile_kernel(kernel, _bound_ptr_types(cfg.dtype), _bound_scalar_types())
    xy = torch.empty((kernel.parts * kernel.consumers, a.T, a.G, a.K, 2), dtype=torch.float32, device=a.q.device)
    length = a.topk_length if a.topk_length is not None else a.indices  # never read when absent
    tensors = (a.q, a.kv, a.indices, length, lg2den, stats, delta, xy, zero_row(a.q.device, a.q.dtype, a.D))
    with torch.cuda.device(a.q.device):
        fn(*(address(x) for x in tensors), a.T, a.N, a.K, float(a.sm_scale * LOG2E), abs(float(a.sm_scale)),
           stream_handle(a.q.device))
    return xy


def _bound_ptr_types(dt):
    """The bound kernel's pointers: q, kv, indices, topk_length, lg2den,
    stats, delta, xy, zero row."""
    import cutlass

    I32, F32 = cutlass.Int32, cutlass.Float32
    return ((dt, 16), (dt, 16), (I32, 4), (I32, 4), (F32, 4), (F32, 8), (F32, 4), (F32, 8), (dt, 16))


def _bound_scalar_types() -> Tuple:
    """The bound kernel's scalars: T, N, K, sm_scale * log2(e), |sm_scale|."""
    import cutlass

    return cutlass.Int32, cutlass.Int32, cutlass.Int32, cutlass.Float32, cutlass.Float32


def _exact_dkv(a: SparseAttnArgs, dout, stats, lg2den, delta, dq, bounds=None) -> torch.Tensor:
    """dq, and dkv [N, G, D] (kv's dtype) by exact adds: the rows' grids
    from the slots' bounds (the forward's ``bounds`` where given, else the
    bound kernel's), the kernel adding into ``dkv_copies`` copies, the copies
    summed in order (and put in column order) in one pass."""
    from dsa.triton.dkv_quanta import copies_sum, dkv_quanta, forward_bounds, value_norms

    if bounds is not None:
        from dsa.cute.sparse_attention import bound_views

        hs, levels = bound_views(a, bounds)
        xy = forward_bounds(hs, levels, a.q, stats, delta, lg2den, a.topk_length, a.K, a.sm_scale)
    else:
        xy = slot_bounds(a, lg2den, stats, delta)
    copies, tpc = dkv_copies(a)
    magic = dkv_quanta(xy, a.indices, a.topk_length, value_norms(a.kv, a.d_v), a.N, copies, tpc)
    buf = torch.zeros((copies, a.N, a.G, a.D), dtype=torch.float32, device=a.q.device)
    _launch(a, dout, lg2den, delta, dq, buf, 0, a.T, magic, tpc)
    return copies_sum(buf, a.kv.dtype)


def _deterministic_dkv(a: SparseAttnArgs, dout, lg2den, delta, dq, dkv, launch: Launch,
                       heads_per_part: int = HEADS_PER_CTA) -> None:
    """dq, and dkv [N, G, D] fp32 summed in a fixed order: the kernel stores
    per-slot fp32 rows [HB, Tc, G, K, D] for chunks of Tc tokens,
    each chunk's rows summed into their kv rows by ``segment_sum``.  A chunk
    shorter than T holds whole waves of the kernel's CTAs (HB G a token)
    where it can."""
    from dsa.triton.segment_sum import chunk_rows, segment_sum
    from dsa.triton.sparse_attention import slot_keys

    T, N, G, D = a.T, a.N, a.G, a.D
    HB = head_blocks(a.H // G, heads_per_part)  # a padded tile (16 or 32 heads) is one part
    per_token = HB * G * a.K * D * 4
    dev = a.q.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    Tc = chunk_rows(T, per_token, sms // math.gcd(sms, HB * G), dev)
    slots = torch.empty(HB * Tc * G * a.K, D, dtype=torch.float32, device=a.q.device)
    for t0 in range(0, T, Tc):
        tc = min(Tc, T - t0)
        launch(a, dout, lg2den, delta, dq, slots, t0, tc)
        segment_sum(slots, slot_keys(a, t0, tc), dkv.view(N * G, D), parts=HB)


def compile_offline_bound(dtype: torch.dtype, D: int, H: int, G: int, has_len: bool, options: str = "--keep-ptx"):
    """Compile the slot-bound kernel without a GPU (``CUTE_DSL_ARCH=sm_90a``)."""
    from dsa.cute.slot_bound_sm90 import SlotBoundSm90

    dt = cutlass_dtype(dtype)
    return compile_kernel(SlotBoundSm90(dt, D, H, G, has_len), _bound_ptr_types(dt), _bound_scalar_types(), options)


def compile_offline_backward(dtype: torch.dtype, D: int, H: int, G: int, has_len: bool,
                             deterministic: bool = False, build: Optional[dict] = None,
                             options: str = "--keep-ptx"):
    """Compile the backward without a GPU (``CUTE_DSL_ARCH=sm_90a``), for CI
    and inspection; returns the compiled object (options: ``cute.compile``'s,
    the PTX kept by default)."""
    from dsa.cute.sparse_attention_bwd_sm90 import BwdSm90Config, SparseAttnBwdSm90

    dt = cutlass_dtype(dtype)
    cfg = BwdSm90Config(dt, D, SERVED_DV, H, G, has_len, deterministic, **_options(deterministic, build))
    return compile_kernel(SparseAttnBwdSm90.from_config(cfg), _sm90_ptr_types(dt), scalar_types(), options)
