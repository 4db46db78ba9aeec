"""CuTe DSL sparse attention backward: what it serves, preprocessing, launch.

    backward(a, out, lse, dout) -> dq [T, H, D] (q.dtype), dkv [N, G, D] (kv.dtype),
                                   dsink [H] fp32 or None

on the canonical packed layout of :class:`dsa._args.SparseAttnArgs`.  The
kernel is ``sparse_attention_bwd_sm90.SparseAttnBwdSm90``; the per-row terms
it reads (Delta = dO . out and log2 of the softmax denominator, sink
included) and dsink are O(T H d_v) torch work here.  ``deterministic`` runs
the kernel storing one fp32 dkv row per (head block, token, slot) for a
chunk of tokens, then the Triton ``segment_sum`` (a stable sort by kv row,
each row summed in that fixed order), so dkv is bitwise reproducible.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from dsa._args import SparseAttnArgs
from dsa._rules import slot_validity

HEADS_PER_CTA = 64
SERVED_D = (512, 576)
SERVED_DV = 512
LOG2E = 1.4426950408889634
# Bytes of per-slot fp32 dkv rows held at once by the deterministic backward.
DETERMINISTIC_SLOT_BYTES = 1 << 30

# Build options of the kernel (SparseAttnBwdSm90): pipelined, two dkv
# accumulators on the consumer scattering most (its next chunk's wgmma under
# the current chunk's atomics); v4, 16-byte atomics over 64 contiguous bytes a
# quad; c0_chunks, the dkv chunks consumer 0 scatters.
BUILD = dict(pipelined=True, v4=True, c0_chunks=2)

_COMPILED: Dict[tuple, object] = {}
_ZEROS: Dict[tuple, torch.Tensor] = {}


def dsl_reason() -> Optional[str]:
    """Why the CuTe DSL cannot be used in this process (None if it can)."""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"CuTe DSL (nvidia-cutlass-dsl) is not importable: {type(e).__name__}: {e}"
    return None


def shape_reason(a: SparseAttnArgs) -> Optional[str]:
    """None when dtypes and sizes are ones the kernel is built for (no device check)."""
    if a.q.dtype not in (torch.bfloat16, torch.float16):
        return f"q dtype {a.q.dtype} is not bf16 or fp16"
    if a.kv.dtype != a.q.dtype:
        return f"kv dtype {a.kv.dtype} differs from q dtype {a.q.dtype}"
    if a.D not in SERVED_D or a.d_v != SERVED_DV:
        return f"D={a.D}, d_v={a.d_v}: the cute backward serves D in {SERVED_D} with d_v = {SERVED_DV}"
    hg = a.H // a.G
    if hg % HEADS_PER_CTA:
        return f"{hg} query heads per kv head: the cute backward needs a multiple of {HEADS_PER_CTA}"
    if a.T * a.H // HEADS_PER_CTA >= 2**31 or a.N * a.G >= 2**31 or a.K >= 2**31:
        return "T * H / 64 (the grid), N * H_kv and K must fit in int32"
    return None


def supports_backward(a: SparseAttnArgs) -> Optional[str]:
    """None when the SM90 backward kernel can serve ``a``, else the reason."""
    if a.q.device.type != "cuda":
        return f"tensors are on '{a.q.device.type}'; the cute kernels need a CUDA GPU"
    cap = torch.cuda.get_device_capability(a.q.device)
    if cap != (9, 0):
        return f"the cute sparse attention backward is written for SM90 (Hopper); this GPU is SM{cap[0]}{cap[1]}"
    why = shape_reason(a) or a.kernel_dtype_reason()
    if why:
        return why
    for name in ("q", "kv"):
        if getattr(a, name).data_ptr() % 16:
            return f"{name} is not 16-byte aligned"
    return dsl_reason()


def row_terms(a: SparseAttnArgs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor):
    """delta [T, H] = dO . out, lg2den [T, H] = log2 of the softmax
    denominator (sink included; +inf where every p is 0: empty rows, a sink of
    +inf or one whose exp overflows) and dsink [H] (None without a sink), fp32."""
    delta = (dout.float() * out.float()).sum(-1)
    log_den = torch.where(torch.isposinf(lse), float("-inf"), lse.float())  # log(0) of empty rows
    dsink = None
    if a.sink is not None:
        sink = a.sink.float()[None, :]
        log_den = torch.logaddexp(log_den, sink)
        p_sink = torch.exp(sink - log_den)
        p_sink = torch.where(torch.isposinf(sink), 1.0, p_sink)
        p_sink = torch.where(torch.isneginf(sink), 0.0, p_sink)
        dsink = -(p_sink * delta).sum(0)
    lg2den = torch.where(torch.isneginf(log_den), float("inf"), log_den * LOG2E)
    return delta.contiguous(), lg2den.contiguous(), dsink


def _zeros(a: SparseAttnArgs) -> torch.Tensor:
    # The source row of every invalid slot.
    key = (a.q.device, a.q.dtype, a.D)
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = torch.zeros(a.D, dtype=a.q.dtype, device=a.q.device)
    return z


def _cutlass_dtype(dt: torch.dtype):
    import cutlass

    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dt]


def _ptr(t: torch.Tensor, dtype, align: int):
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def _kernel(dtype: torch.dtype, D: int, H: int, G: int, has_len: bool, deterministic: bool, build: dict):
    from dsa.cute.sparse_attention_bwd_sm90 import SparseAttnBwdSm90

    return SparseAttnBwdSm90(_cutlass_dtype(dtype), D, SERVED_DV, H, G, has_len, deterministic, **build)


def _ptr_types(dt):
    """(cutlass element type, assumed alignment) of each kernel pointer, in order:
    q, kv, indices, topk_length, dout, lg2den, delta, dq, dkv, zero row."""
    import cutlass

    I32, F32 = cutlass.Int32, cutlass.Float32
    return ((dt, 16), (dt, 16), (I32, 4), (I32, 4), (dt, 16), (F32, 4), (F32, 4), (dt, 16), (F32, 16),
            (dt, 16))


def _launch(a: SparseAttnArgs, dout, lg2den, delta, dq, dkv_buf, t0: int, tc: int) -> None:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    dt = _cutlass_dtype(a.q.dtype)
    length = a.topk_length if a.topk_length is not None else a.indices  # never read when absent
    tensors = (a.q, a.kv, a.indices, length, dout, lg2den, delta, dq, dkv_buf, _zeros(a))
    ptrs = tuple(_ptr(x, ty, al) for x, (ty, al) in zip(tensors, _ptr_types(dt)))
    scalars = (cutlass.Int32(tc), cutlass.Int32(t0), cutlass.Int32(a.N), cutlass.Int32(a.K),
               cutlass.Float32(a.sm_scale * LOG2E), cutlass.Float32(a.sm_scale))
    stream = cuda.CUstream(torch.cuda.current_stream(a.q.device).cuda_stream)
    key = (a.q.dtype, a.D, a.H, a.G, a.topk_length is not None, a.deterministic, tuple(sorted(BUILD.items())))
    fn = _COMPILED.get(key)
    if fn is None:
        kernel = _kernel(a.q.dtype, a.D, a.H, a.G, key[4], key[5], dict(BUILD))
        fn = _COMPILED[key] = cute.compile(kernel, *ptrs, *scalars, stream)
    with torch.cuda.device(a.q.device):
        fn(*ptrs, *scalars, stream)


def slot_keys(a: SparseAttnArgs, t0: int, tc: int) -> torch.Tensor:
    """The kv row n * G + g of every slot ((t - t0) * G + g) * K + j of the
    tokens [t0, t0 + tc), flat int64; N * G (never summed) for an invalid slot."""
    length = None if a.topk_length is None else a.topk_length[t0:t0 + tc]
    valid, safe = slot_validity(a.indices[t0:t0 + tc], length, a.N)
    g = torch.arange(a.G, device=a.q.device)[None, :, None]
    return torch.where(valid, safe * a.G + g, a.N * a.G).flatten()


def backward(a: SparseAttnArgs, out: torch.Tensor, lse: torch.Tensor,
             dout: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """dq [T, H, D] (q.dtype), dkv [N, G, D] (kv.dtype, accumulated in fp32),
    dsink [H] fp32 (None without a sink).  out [T, H, d_v], lse [T, H] fp32
    (+inf on empty rows) and dout [T, H, d_v] as the forward's."""
    why = supports_backward(a)
    if why:
        raise ValueError(why)
    T, N, G, D = a.T, a.N, a.G, a.D
    dout = dout.contiguous()
    delta, lg2den, dsink = row_terms(a, out, lse, dout)
    dq = torch.empty_like(a.q)
    dkv = torch.zeros((N, G, D), dtype=torch.float32, device=a.q.device)
    if not a.deterministic:
        _launch(a, dout, lg2den, delta, dq, dkv, 0, T)
    else:
        from dsa.triton.segment_sum import segment_sum

        # per-slot rows [HB, Tc, G, K, D], summed per kv row in a fixed order
        HB = a.H // G // HEADS_PER_CTA
        per_token = HB * G * a.K * D * 4
        Tc = max(1, min(T, DETERMINISTIC_SLOT_BYTES // per_token))
        slots = torch.empty(HB * Tc * G * a.K, D, dtype=torch.float32, device=a.q.device)
        for t0 in range(0, T, Tc):
            tc = min(Tc, T - t0)
            _launch(a, dout, lg2den, delta, dq, slots, t0, tc)
            segment_sum(slots, slot_keys(a, t0, tc), dkv.view(N * G, D), parts=HB)
    return dq, dkv.to(a.kv.dtype), dsink


def compile_offline_backward(dtype: torch.dtype, D: int, H: int, G: int, has_len: bool,
                             deterministic: bool = False, keep_ptx: bool = True, build: Optional[dict] = None):
    """Compile the backward without a GPU (``CUTE_DSL_ARCH=sm_90a``), for CI
    and inspection; returns the compiled object (its PTX kept when asked)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    dt = _cutlass_dtype(dtype)
    ptrs = tuple(make_ptr(ty, al * 64, cute.AddressSpace.gmem, assumed_align=al) for ty, al in _ptr_types(dt))
    scalars = (cutlass.Int32(1), cutlass.Int32(0), cutlass.Int32(1), cutlass.Int32(1),
               cutlass.Float32(math.log2(math.e)), cutlass.Float32(1.0))
    kernel = _kernel(dtype, D, H, G, has_len, deterministic, dict(BUILD, **(build or {})))
    return cute.compile(kernel, *ptrs, *scalars, cuda.CUstream(0),
                        options="--keep-ptx" if keep_ptx else "")
