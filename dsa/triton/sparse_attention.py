"""Triton sparse attention (DeepSeek Sparse Attention, MLA in MQA/GQA form).

Entry points of the Triton backend for the op, on the canonical packed layout
of :class:`dsa._args.SparseAttnArgs`:

    forward(a)                      -> out [T, H, d_v] (q.dtype), lse [T, H] fp32
    backward(a, out, lse, dout)     -> dq [T, H, D], dkv [N, G, D], dsink [H] | None

The kernels are in ``sparse_attention_fwd`` / ``sparse_attention_bwd``; this
module checks what they serve, picks tiles and launches them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch
import triton
from triton.runtime.errors import OutOfResources

from dsa._args import SparseAttnArgs
from dsa.triton.sparse_attention_bwd import (
    bwd_preprocess_kernel, dkv_reduce_kernel, sparse_attn_bwd_kernel,
)
from dsa.triton.sparse_attention_common import ColumnChunks
from dsa.triton.sparse_attention_fwd import LOG2E, sparse_attn_fwd_kernel

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_D = 576
# Shared memory per block on sm_90.
_SMEM_LIMIT = 227 * 1024
# Bytes of per-slot dkv rows held at once by the deterministic backward.
_DETERMINISTIC_SLOT_BYTES = 1 << 30


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration of the forward or backward kernel.

    BH: query heads per program (the gathered kv tile is shared by them);
    BN: slots per loop step; CW: widest column chunk; skew and prefetch:
    forward only, see sparse_attention_fwd; num_warps / num_stages as in
    Triton."""

    BH: int
    BN: int
    CW: int
    num_warps: int
    num_stages: int
    skew: bool = False
    prefetch: bool = True  # forward only: indices one block ahead (see sparse_attention_fwd)


# ----------------------------------------------------------------------------
# What the kernels serve


def supports(a: SparseAttnArgs) -> Optional[str]:
    """None when the Triton kernels can serve ``a``, else the reason."""
    if a.q.dtype not in _DTYPES:
        return f"q dtype {a.q.dtype} is not fp16, bf16 or fp32"
    if a.kv.dtype != a.q.dtype:
        return f"kv dtype {a.kv.dtype} differs from q dtype {a.q.dtype}"
    if a.q.dim() != 3 or a.kv.dim() != 3 or a.indices.dim() != 3:
        return "expected the canonical layout q [T,H,D], kv [N,G,D], indices [T,G,K]"
    if a.D % 16 or a.d_v % 16:
        return f"D={a.D} and d_v={a.d_v} must be multiples of 16"
    if a.D > MAX_D:
        return f"D={a.D} exceeds {MAX_D}"
    if not 0 < a.d_v <= a.D:
        return f"d_v={a.d_v} must be in (0, D={a.D}]"
    if a.kv.shape[2] != a.D or a.H % a.G:
        return f"H={a.H} is not a multiple of G={a.G}, or kv's D differs from q's"
    why = a.kernel_dtype_reason()
    if why:
        return why
    if a.q.device.type == "cpu" and a.q.dtype == torch.bfloat16:
        return "the Triton interpreter does not compute bf16 correctly on CPU"
    return None


# ----------------------------------------------------------------------------
# Tile selection


def _interpreting(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _heads_per_program(hg: int) -> int:
    # 64 heads share one gathered kv tile; wgmma needs M = 64 per warpgroup
    # and a [64, 512] fp32 accumulator already fills 8 warps' registers.
    return max(16, min(64, triton.next_power_of_2(hg)))


def _smem_bytes(a: SparseAttnArgs, cfg: TileConfig, bwd: bool) -> int:
    """Shared memory of a launch: the q-side tiles (q, and dO in the backward),
    the kv tile of each pipeline stage and, in the backward, the [CW, BN] fp32
    tile that feeds the atomics.  Within 1% of what the compiler allocated for
    the DESIGN.md shapes (e.g. 221440 B for the V3.2 forward, 229376 B for
    the V4-pro backward at BN = 64)."""
    es = a.q.element_size()
    b = es * a.D * ((2 if bwd else 1) * cfg.BH + max(cfg.num_stages, 1) * cfg.BN) + 1024
    if bwd:
        b += cfg.CW * cfg.BN * 4 + (cfg.num_stages - 1) * 9 * 1024
    return b


def _fit(a: SparseAttnArgs, cfg: TileConfig, bwd: bool) -> TileConfig:
    """Drop the second pipeline stage, then halve BN, then BH, until the tiles
    fit in shared memory."""
    while _smem_bytes(a, cfg, bwd) > _SMEM_LIMIT:
        if cfg.num_stages > 1:
            cfg = replace(cfg, num_stages=1)
        elif cfg.BN > 16:
            cfg = replace(cfg, BN=cfg.BN // 2)
        elif cfg.BH > 16:
            cfg = replace(cfg, BH=cfg.BH // 2)
        else:
            break
    return cfg


# Tiles that compiled, by launch signature: _smem_bytes is an estimate, and
# where the compiler still finds too little shared memory the launch retries
# with fewer stages / slots (never fewer heads, which the deterministic
# backward's buffers are laid out by) and remembers the fit.
_FITTED: dict = {}


def _launch_fitting(key: tuple, cfg: TileConfig, launch) -> None:
    cfg = _FITTED.get((key, cfg), cfg)
    first = cfg
    while True:
        try:
            launch(cfg)
        except OutOfResources:
            if cfg.num_stages > 1:
                cfg = replace(cfg, num_stages=1)
            elif cfg.BN > 16:
                cfg = replace(cfg, BN=cfg.BN // 2)
            else:
                raise
            continue
        _FITTED[(key, first)] = cfg
        return


def _warps(BH: int, acc_cols: int) -> int:
    # 8 warps once the fp32 accumulator (O: d_v columns, dq: D columns)
    # passes 64 registers a thread at 4 warps.
    return 8 if BH * acc_cols >= 64 * 256 else 4


# Tile choices, measured on an H200 (bench/notes_sparse_attention.md):
# forward  BH=64 BN=64 CW=128 2 stages, indices one block ahead: 280-294
#          TFLOP/s at V3.2 / V4-pro (without the prefetch 277-282; BN=32:
#          191-194; BN=64 with CW=256: 264-274; one stage: 249-254; d_v split
#          over two programs: 137-217);
# backward BH=64 BN=64 1 stage where it fits (D=512: 188-190 TFLOP/s at
#          V4-pro), else BN=32 (D=576: 116-119 at V3.2); BN=32 with 2 stages:
#          131 at V4-pro, BN=16: 73-83; for BH=16 (H=16) 8 warps and BN=64:
#          79 against 68 with 4 warps and BN=32.


def fwd_config(a: SparseAttnArgs) -> TileConfig:
    BH = _heads_per_program(a.H // a.G)
    if _interpreting(a.q):
        return TileConfig(BH, 16, 256, 4, 1)
    if a.q.dtype == torch.float32:
        return _fit(a, TileConfig(16, 16, 64, 4, 1), False)
    return _fit(a, TileConfig(BH, 64, 128, _warps(BH, a.d_v), 2), False)


def bwd_config(a: SparseAttnArgs) -> TileConfig:
    BH = _heads_per_program(a.H // a.G)
    if _interpreting(a.q):
        return TileConfig(BH, 16, 256, 4, 1)
    if a.q.dtype == torch.float32:
        return _fit(a, TileConfig(16, 16, 64, 4, 1), True)
    if BH < 64:
        return _fit(a, TileConfig(BH, 64, 128, 8, 1), True)
    return _fit(a, TileConfig(BH, 64, 128, _warps(BH, a.D), 1), True)


def _prec(a: SparseAttnArgs) -> str:
    # fp32 is computed in full fp32 (the interpreter tests are tight); 16-bit
    # inputs ignore the setting.
    return "ieee" if a.q.dtype == torch.float32 else "tf32"


# ----------------------------------------------------------------------------
# Forward


def forward(a: SparseAttnArgs, config: Optional[TileConfig] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """out [T, H, d_v] in q.dtype and lse [T, H] fp32 (sink excluded, +inf on empty rows)."""
    cfg = config or fwd_config(a)
    T, H, G, K = a.T, a.H, a.G, a.K
    out = torch.empty((T, H, a.d_v), dtype=a.q.dtype, device=a.q.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=a.q.device)
    grid = (T * G, triton.cdiv(H // G, cfg.BH))
    flags = dict(HAS_LEN=a.topk_length is not None, HAS_SINK=a.sink is not None, PREC=_prec(a))

    def launch(c: TileConfig) -> None:
        sparse_attn_fwd_kernel[grid](
            a.q, a.kv, a.indices, a.topk_length, a.sink, out, lse,
            a.N, K, a.sm_scale * LOG2E,
            H=H, G=G, D=a.D, D_V=a.d_v, **ColumnChunks.of(a.D, a.d_v, c.CW).kernel_args(),
            BH=c.BH, BN=c.BN, SKEW=c.skew, PREFETCH=c.prefetch, **flags,
            num_warps=c.num_warps, num_stages=c.num_stages,
        )

    _launch_fitting(("fwd", a.q.dtype, H // G, a.D, a.d_v, tuple(flags.items())), cfg, launch)
    return out, lse


# ----------------------------------------------------------------------------
# Backward


def _preprocess(a: SparseAttnArgs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor):
    """Delta = dO . out, log2(den) and the per-row dsink terms, all [T, H] fp32."""
    T, H = a.T, a.H
    f32 = dict(dtype=torch.float32, device=a.q.device)
    delta = torch.empty((T, H), **f32)
    lg2den = torch.empty((T, H), **f32)
    dsink_part = torch.empty((T, H), **f32) if a.sink is not None else None
    BR = 16
    BV = min(128, triton.next_power_of_2(a.d_v))
    bwd_preprocess_kernel[(triton.cdiv(T * H, BR),)](
        out, dout, lse, a.sink, delta, lg2den, dsink_part,
        T * H, H=H, D_V=a.d_v, BR=BR, BV=BV, HAS_SINK=a.sink is not None,
        num_warps=4,
    )
    return delta, lg2den, dsink_part


def _launch_bwd(a, cfg, dout, lg2den, delta, dq, dkv_buf, t0, tc, store_slots):
    grid = (tc * a.G, triton.cdiv(a.H // a.G, cfg.BH))
    flags = dict(HAS_LEN=a.topk_length is not None, STORE_SLOTS=store_slots, PREC=_prec(a))

    def launch(c: TileConfig) -> None:
        sparse_attn_bwd_kernel[grid](
            a.q, a.kv, a.indices, a.topk_length, dout, lg2den, delta, dq, dkv_buf,
            t0, a.N, a.K, a.sm_scale * LOG2E, a.sm_scale,
            H=a.H, G=a.G, D=a.D, D_V=a.d_v, **ColumnChunks.of(a.D, a.d_v, c.CW).kernel_args(),
            BH=c.BH, BN=c.BN, **flags,
            num_warps=c.num_warps, num_stages=c.num_stages,
        )

    _launch_fitting(("bwd", a.q.dtype, a.H // a.G, a.D, a.d_v, tuple(flags.items())), cfg, launch)


def _inverted_index(a: SparseAttnArgs, t0: int, tc: int):
    """For the tokens [t0, t0 + tc): the flat slot ids (t - t0, g, j) of every
    valid slot grouped by kv row (n, g), in ascending slot order (stable sort),
    and the [N * G + 1] row pointers into that list."""
    N, G, K = a.N, a.G, a.K
    dev = a.q.device
    idx = a.indices[t0:t0 + tc].to(torch.int64)  # [tc, G, K]
    valid = (idx >= 0) & (idx < N)
    if a.topk_length is not None:
        L = a.topk_length[t0:t0 + tc].clamp(0, K)
        valid &= torch.arange(K, device=dev)[None, None, :] < L[:, None, None]
    key = torch.where(valid, idx * G + torch.arange(G, device=dev)[None, :, None], N * G)
    sorted_key, order = torch.sort(key.flatten(), stable=True)
    rowptr = torch.searchsorted(sorted_key, torch.arange(N * G + 1, device=dev))
    return order.to(torch.int32), rowptr.to(torch.int32)


def backward(a: SparseAttnArgs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
             config: Optional[TileConfig] = None):
    """dq [T, H, D] (q.dtype), dkv [N, G, D] (kv.dtype, accumulated in fp32),
    dsink [H] fp32 (None without a sink).  ``dout`` is [T, H, d_v] contiguous."""
    cfg = config or bwd_config(a)
    T, N, G, K, D = a.T, a.N, a.G, a.K, a.D
    dout = dout.contiguous()
    delta, lg2den, dsink_part = _preprocess(a, out.contiguous(), lse.contiguous(), dout)
    dq = torch.empty_like(a.q)
    dkv = torch.zeros((N, G, D), dtype=torch.float32, device=a.q.device)
    if not a.deterministic:
        _launch_bwd(a, cfg, dout, lg2den, delta, dq, dkv, 0, T, store_slots=False)
    else:
        HB = triton.cdiv(a.H // G, cfg.BH)
        per_token = HB * G * K * D * 4
        Tc = max(1, min(T, _DETERMINISTIC_SLOT_BYTES // per_token))
        slots = torch.empty(HB * Tc * G * K * D, dtype=torch.float32, device=a.q.device)
        BD = min(64, triton.next_power_of_2(D))
        for t0 in range(0, T, Tc):
            tc = min(Tc, T - t0)
            _launch_bwd(a, cfg, dout, lg2den, delta, dq, slots, t0, tc, store_slots=True)
            order, rowptr = _inverted_index(a, t0, tc)
            dkv_reduce_kernel[(N * G, triton.cdiv(D, BD))](
                slots, order, rowptr, dkv, tc * G * K,
                D=D, HB=HB, BR=16, BD=BD, num_warps=2,
            )
    if a.kv.dtype != torch.float32:
        dkv = dkv.to(a.kv.dtype)
    dsink = dsink_part.sum(0) if dsink_part is not None else None
    return dq, dkv, dsink
