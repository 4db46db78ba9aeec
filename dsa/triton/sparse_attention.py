"""Triton sparse attention (DeepSeek Sparse Attention, MLA in MQA/GQA form).

Entry points of the Triton backend for the op, on the canonical packed layout
of :class:`dsa._args.SparseAttnArgs`:

    forward(a)                      -> out [T, H, d_v] (q.dtype), lse [T, H] fp32
    backward(a, out, lse, dout)     -> dq [T, H, D], dkv [N, G, D], dsink [H] | None

The kernels are in ``sparse_attention_fwd`` / ``sparse_attention_bwd``; this
module checks what they serve, picks tiles that fit the device
(``dsa.triton.fit``) and launches them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

import torch
import triton

from dsa._args import SparseAttnArgs
from dsa._rules import LOG2E, slot_validity
from dsa.triton import fit
from dsa.triton.rules import input_precision
from dsa.triton.segment_sum import chunk_rows, segment_sum
from dsa.triton.sparse_attention_bwd import bwd_preprocess_kernel, sparse_attn_bwd_kernel
from dsa.triton.sparse_attention_common import ColumnChunks
from dsa.triton.sparse_attention_fwd import sparse_attn_fwd_kernel

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_D = 576


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration of the forward or backward kernel.

    BH: query heads per program (the gathered kv tile is shared by them);
    BN: slots per loop step; CW: widest column chunk; skew and prefetch:
    forward only, see sparse_attention_fwd; num_warps / num_stages as in
    Triton; keys_as_rows: the slots as the MMAs' rows (see
    sparse_attention_bwd; for 16 or 32 heads a program; the forward's then
    ignores skew and prefetch)."""

    BH: int
    BN: int
    CW: int
    num_warps: int
    num_stages: int
    skew: bool = False
    prefetch: bool = True  # forward only: indices one block ahead (see sparse_attention_fwd)
    # Left out of the repr, so the picks' printed form stays what the fit
    # tables record for the heads-as-rows tiles.
    keys_as_rows: bool = False


# ----------------------------------------------------------------------------
# What the kernels serve


def supports(a: SparseAttnArgs) -> Optional[str]:
    """None when the Triton kernels can serve ``a``, else the reason."""
    if a.kv.dtype != a.q.dtype:
        return f"kv dtype {a.kv.dtype} differs from q dtype {a.q.dtype}"
    if a.q.dim() != 3 or a.kv.dim() != 3 or a.indices.dim() != 3:
        return "expected the canonical layout q [T,H,D], kv [N,G,D], indices [T,G,K]"
    if not 0 < a.d_v <= a.D:
        return f"d_v={a.d_v} must be in (0, D={a.D}]"
    if a.kv.shape[2] != a.D or a.H % a.G:
        return f"H={a.H} is not a multiple of G={a.G}, or kv's D differs from q's"
    return shared_reason(a)


def shared_reason(a) -> Optional[str]:
    """What every sparse-attention kernel (forward, backward, decode) needs of
    ``a``'s dtypes and head dims: None, or the reason it does not hold."""
    if a.q.dtype not in _DTYPES:
        return f"q dtype {a.q.dtype} is not fp16, bf16 or fp32"
    if a.D % 16 or a.d_v % 16:
        return f"D={a.D} and d_v={a.d_v} must be multiples of 16"
    if a.D > MAX_D:
        return f"D={a.D} exceeds {MAX_D}"
    why = a.kernel_dtype_reason()
    if why:
        return why
    if a.q.device.type == "cpu" and a.q.dtype == torch.bfloat16:
        return "the Triton interpreter does not compute bf16 correctly on CPU"
    return None


# ----------------------------------------------------------------------------
# Tile selection


def heads_per_program(hg: int) -> int:
    # 64 heads share one gathered kv tile; wgmma needs M = 64 per warpgroup
    # and a [64, 512] fp32 accumulator already fills 8 warps' registers.
    return max(16, min(64, triton.next_power_of_2(hg)))


def _smem_bytes(a: SparseAttnArgs, cfg: TileConfig, bwd: bool) -> int:
    """Estimated shared memory of a launch on sm_90: the q-side tiles (q, and
    dO in the backward), the kv tile of each pipeline stage and, in the
    backward, the [CW, BN] fp32 tile that feeds the atomics.  Within 1% of
    what the compiler allocated for the model shapes (e.g. 221440 B for the
    V3.2 forward, 229376 B for the V4-pro backward at BN = 64)."""
    es = a.q.element_size()
    b = es * a.D * ((2 if bwd else 1) * cfg.BH + max(cfg.num_stages, 1) * cfg.BN) + 1024
    if bwd:
        b += cfg.CW * cfg.BN * 4 + (cfg.num_stages - 1) * 9 * 1024
    return b


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


# Tiles with the slots as the MMAs' rows (keys_as_rows, see
# sparse_attention_fwd / _bwd), by heads a program; an entry makes them the
# first candidates at that BH, ahead of the heads-as-rows tiles.  H200, bf16,
# T 4096, N 8192, D 576, K 2048, sink (bench/bwd_tp_shards.py, run C58):
# backward H16: BH16 BN64 CW64 4 warps 2 stages 7.93 ms (93.2 TFLOP/s)
#   against 9.27 heads-as-rows (79.7; BN64 CW128 4 warps 2 stages 9.79, BN128
#   CW64 8 warps 1 stage 9.51); H32: heads-as-rows stays (15.32 ms against
#   17.80 / 19.48: at 32 heads the two warpgroups duplicate work, and every
#   keys-as-rows tile spills);
# forward H32: BH32 BN64 CW128 4 warps 2 stages 2.98 ms (196.3 TFLOP/s)
#   against 3.59 (162.6); H16: heads-as-rows stays (1.71 against 2.55).
KEYS_AS_ROWS_BWD: Dict[int, TileConfig] = {16: TileConfig(16, 64, 64, 4, 2, keys_as_rows=True)}
KEYS_AS_ROWS_FWD: Dict[int, TileConfig] = {32: TileConfig(32, 64, 128, 4, 2, keys_as_rows=True)}


def _preferred(a: SparseAttnArgs, BH: int, bwd: bool) -> TileConfig:
    """The measured best tiles at BH heads per program (fp32: FMA dots, small tiles)."""
    if a.q.dtype == torch.float32:
        return TileConfig(16, 16, 64, 4, 1)
    if bwd:
        return TileConfig(BH, 64, 128, 8 if BH < 64 else _warps(BH, a.D), 1)
    return TileConfig(BH, 64, 128, _warps(BH, a.d_v), 2)


def _candidates(a: SparseAttnArgs, bwd: bool) -> Iterator[TileConfig]:
    """Fastest first: the preferred tiles, then one pipeline stage, then fewer
    slots a step, then (only then) fewer heads a program."""
    if a.q.device.type == "cpu":  # the interpreter: small tiles run fastest
        yield TileConfig(heads_per_program(a.H // a.G), 16, 256, 4, 1)
        return
    top = 16 if a.q.dtype == torch.float32 else heads_per_program(a.H // a.G)
    for BH in fit.halvings(top, 16):
        table = KEYS_AS_ROWS_BWD if bwd else KEYS_AS_ROWS_FWD
        if BH in table and a.q.dtype != torch.float32:
            yield from fit.shrinking(table[BH], (("num_stages", 1), ("BN", 16)))
        yield from fit.shrinking(_preferred(a, BH, bwd), (("num_stages", 1), ("BN", 16)))


def kernel_spec(a: SparseAttnArgs, c: TileConfig, bwd: bool, store_slots: bool = False) -> fit.KernelSpec:
    el = fit.ptr(a.q.dtype)
    shape = dict(H=a.H, G=a.G, D=a.D, D_V=a.d_v, **ColumnChunks.of(a.D, a.d_v, c.CW).kernel_args(),
                 BH=c.BH, BN=c.BN, HAS_LEN=a.topk_length is not None, PREC=input_precision(a.q.dtype))
    if bwd:
        types = dict(q_ptr=el, kv_ptr=el, idx_ptr="*i32", len_ptr="*i32", dout_ptr=el, lg2den_ptr="*fp32",
                     delta_ptr="*fp32", dq_ptr=el, dkv_ptr="*fp32", qk_scale="fp32", sm_scale="fp32")
        return fit.KernelSpec(sparse_attn_bwd_kernel, types,
                              dict(shape, STORE_SLOTS=store_slots, KEYS_AS_ROWS=c.keys_as_rows),
                              c.num_warps, c.num_stages)
    types = dict(q_ptr=el, kv_ptr=el, idx_ptr="*i32", len_ptr="*i32", sink_ptr="*fp32", out_ptr=el,
                 lse_ptr="*fp32", qk_scale="fp32")
    flags = dict(SKEW=c.skew, PREFETCH=c.prefetch, HAS_SINK=a.sink is not None, KEYS_AS_ROWS=c.keys_as_rows)
    return fit.KernelSpec(sparse_attn_fwd_kernel, types, dict(shape, **flags), c.num_warps, c.num_stages)


def pick(a: SparseAttnArgs, bwd: bool, target: Optional[fit.Target] = None) -> Tuple[Optional[TileConfig], str]:
    """(the forward's or backward's tiles that fit ``target`` (a's device when None), "") or (None, why)."""
    key = ("bwd" if bwd else "fwd", a.q.dtype, a.H, a.G, a.D, a.d_v, a.topk_length is not None, a.sink is not None)
    return fit.pick(lambda: _candidates(a, bwd), lambda c: kernel_spec(a, c, bwd), target or fit.device_target(a.q),
                    key, lambda c: _smem_bytes(a, c, bwd))


def _config(a: SparseAttnArgs, bwd: bool) -> TileConfig:
    cfg, why = pick(a, bwd)
    if cfg is None:
        raise ValueError(why)
    return cfg


def fwd_config(a: SparseAttnArgs) -> TileConfig:
    """The forward's tiles on a's device (ValueError when none fit)."""
    return _config(a, False)


def bwd_config(a: SparseAttnArgs) -> TileConfig:
    """The backward's tiles on a's device (ValueError when none fit)."""
    return _config(a, True)


def tiles_reason(fn_name: str, a: SparseAttnArgs) -> Optional[str]:
    """Why no tiles of ``fn_name`` ("forward" / "backward") fit a's device (None if some do)."""
    return pick(a, fn_name == "backward")[1] or None


# ----------------------------------------------------------------------------
# Forward


def forward(a: SparseAttnArgs, config: Optional[TileConfig] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """out [T, H, d_v] in q.dtype and lse [T, H] fp32 (sink excluded, +inf on empty rows).

    Without a ``config``, a call whose rows are too few to fill the GPU takes
    the split kernels of sparse decode (dsa.triton.decode)."""
    if config is None:
        from dsa.triton import decode  # imports this module

        routed = decode.attention_forward(a)
        if routed is not None:
            return routed
    cfg = config or fwd_config(a)
    T, H, G = a.T, a.H, a.G
    out = torch.empty((T, H, a.d_v), dtype=a.q.dtype, device=a.q.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=a.q.device)
    sparse_attn_fwd_kernel[(T * G, triton.cdiv(H // G, cfg.BH))](
        a.q, a.kv, a.indices, a.topk_length, a.sink, out, lse,
        a.N, a.K, a.sm_scale * LOG2E,
        **kernel_spec(a, cfg, bwd=False).launch_kwargs(),
    )
    return out, lse


# ----------------------------------------------------------------------------
# Backward


def preprocess(a: SparseAttnArgs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
               stats: Optional[torch.Tensor] = None, delta: bool = True):
    """Delta = dO . out, log2(den) (sink included; +inf where every p is 0:
    empty rows, a sink of +inf or one whose exp overflows) and the per-row
    dsink terms (None without a sink), all [T, H] fp32, in one pass over out
    and dO [T, H, d_v] (contiguous).  With ``stats`` (fp32 [T, H, 2]) the
    same pass also writes max|dO| and an upper bound of ||dO|| of each row
    there.  delta False (for a kernel that computes Delta itself): out and
    dO are not read, Delta is left unwritten and the dsink terms are
    -p_sink, to be multiplied by Delta.  Shared by the Triton and cute
    backwards."""
    T, H = a.T, a.H
    f32 = dict(dtype=torch.float32, device=a.q.device)
    lg2den = torch.empty((T, H), **f32)
    dsink_part = torch.empty((T, H), **f32) if a.sink is not None else None
    spec = preprocess_spec(a, stats is not None, delta)
    delta_ = torch.empty((T, H), **f32)
    bwd_preprocess_kernel[(triton.cdiv(T * H, spec.constexprs["BR"]),)](
        out, dout, lse, a.sink, delta_, lg2den, dsink_part, stats, T * H, **spec.launch_kwargs(),
    )
    return delta_, lg2den, dsink_part


def preprocess_spec(a: SparseAttnArgs, stats: bool = False, delta: bool = True) -> fit.KernelSpec:
    """The backward's preprocess: 16 rows x 128 columns of out and dO a step
    (a few KB of shared memory at most, on every target)."""
    el = fit.ptr(a.q.dtype)
    types = dict(out_ptr=el, dout_ptr=el, lse_ptr="*fp32", sink_ptr="*fp32", delta_ptr="*fp32",
                 lg2den_ptr="*fp32", dsink_part_ptr="*fp32", stats_ptr="*fp32")
    const = dict(H=a.H, D_V=a.d_v, BR=16, BV=min(128, triton.next_power_of_2(a.d_v)), HAS_SINK=a.sink is not None,
                 STATS=stats, DELTA=delta)
    return fit.KernelSpec(bwd_preprocess_kernel, types, const, 4, 3)


def _launch_bwd(a, cfg, dout, lg2den, delta, dq, dkv_buf, t0, tc, store_slots):
    sparse_attn_bwd_kernel[(tc * a.G, triton.cdiv(a.H // a.G, cfg.BH))](
        a.q, a.kv, a.indices, a.topk_length, dout, lg2den, delta, dq, dkv_buf,
        t0, a.N, a.K, a.sm_scale * LOG2E, a.sm_scale,
        **kernel_spec(a, cfg, bwd=True, store_slots=store_slots).launch_kwargs(),
    )


def slot_keys(a: SparseAttnArgs, t0: int, tc: int) -> torch.Tensor:
    """The kv row (n, g) as n * G + g of every slot (t - t0, g, j) of the
    tokens [t0, t0 + tc), flat; N * G (never summed) for an invalid slot."""
    length = None if a.topk_length is None else a.topk_length[t0:t0 + tc]
    valid, safe = slot_validity(a.indices[t0:t0 + tc], length, a.N)
    g = torch.arange(a.G, device=a.q.device)[None, :, None]
    return torch.where(valid, safe * a.G + g, a.N * a.G).flatten()


def backward(a: SparseAttnArgs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
             config: Optional[TileConfig] = None):
    """dq [T, H, D] (q.dtype), dkv [N, G, D] (kv.dtype, accumulated in fp32),
    dsink [H] fp32 (None without a sink).  ``dout`` is [T, H, d_v] contiguous."""
    cfg = config or bwd_config(a)
    T, N, G, K, D = a.T, a.N, a.G, a.K, a.D
    dout = dout.contiguous()
    delta, lg2den, dsink_part = preprocess(a, out.contiguous(), lse.contiguous(), dout)
    dq = torch.empty_like(a.q)
    dkv = torch.zeros((N, G, D), dtype=torch.float32, device=a.q.device)
    if not a.deterministic:
        _launch_bwd(a, cfg, dout, lg2den, delta, dq, dkv, 0, T, store_slots=False)
    else:
        # per-slot rows [HB, Tc, G, K, D], summed per kv row in a fixed order
        HB = triton.cdiv(a.H // G, cfg.BH)
        Tc = chunk_rows(T, HB * G * K * D * 4, device=a.q.device)
        slots = torch.empty(HB * Tc * G * K, D, dtype=torch.float32, device=a.q.device)
        for t0 in range(0, T, Tc):
            tc = min(Tc, T - t0)
            _launch_bwd(a, cfg, dout, lg2den, delta, dq, slots, t0, tc, store_slots=True)
            segment_sum(slots, slot_keys(a, t0, tc), dkv.view(N * G, D), parts=HB)
    if a.kv.dtype != torch.float32:
        dkv = dkv.to(a.kv.dtype)
    dsink = dsink_part.sum(0) if dsink_part is not None else None
    return dq, dkv, dsink
