"""Triton backward of the indexer: sparse logits, the fused KL loss and dense ``indexer_scores``.

One program per query row t recomputes the dots s[h, j] = q[t, h] . k_j of its
slots (the forward never stores the [T, K, H_i] products) and, with g_j the
gradient of logit j,

    ds[h, j]   = g_j * sm_scale * weights[t, h] * [s[h, j] > 0]
    dq[t]      = ds @ K_slots                       [H_i, D_i]   (registers, one store)
    dweights[t, h] = sm_scale * sum_j g_j * relu(s[h, j])          (registers, one store)
    dk[idx_j] += (ds^T @ q[t])[j]                   [BK, D_i]    scattered, fp32

g_j comes from one of three sources (the ``MODE`` of the kernel):

* SPARSE: dlogits[t, j] of ``sparse_indexer_scores``;
* KL: (softmax_j * S - target_j) with the forward's per-row lse and S = sum of
  valid target (dsa/triton/training.py), recomputing the logit; the loss's
  1/R * dloss scale is applied to dq, dk and dweights after the MMAs, so the
  fp16 operand ds stays far from underflow (1/R alone is ~1e-4 at T = 4096);
* DENSE: dscores of ``indexer_scores``; slot j of row i is key
  cu_seqlens_k[b] + j, valid iff j < the row's visible limit.

dk accumulation. By default the [BK, D_i] tiles go to an fp32 buffer with
relaxed (vectorised) atomics: T*K*D_i adds (4.3 GB at the V3.2 step, T 4096,
K 2048, D_i 128) whose order the hardware picks, so dk differs in its last
bits from run to run. The buffer is 4 MB, so the adds resolve in L2: 1.11 ms
for the scatter alone on the H200, of a 2.61 ms KL step (backward alone
2.16; cuDNN's recompute + indexer_backward 2.31).

``deterministic=True`` has the main pass store each valid slot's fp32 dk
tile to a workspace instead (no recompute, no second pass over q and k), at
the slot's position in its key's segment, and sums each key's rows in that
fixed order (dsa/triton/segment_sum.py), chunk of query rows by chunk
(segment_sum.workspace_bytes: 4 GiB, all 4096 rows at V3.2), the chunks in
order: bitwise reproducible. One sort of all T*K keys a step (the
narrowest integer keys, by chunk then key, stable: ``slot_positions``)
gives every slot its position, so each sum streams contiguous rows (no
gather).

Cost at V3.2 on the H200 (bench/RESULTS.md, run C58): a 5.73 ms KL step,
2.2x the default. The rows cross HBM twice (4.3 GB written, 4.3 GB read
back: the workspace is far larger than L2), against the default's
L2-resident adds; the floor, piece by piece, is the default - 1.11 (the
atomics) + 1.01 (the sort) + 2.58 (rows stored and summed back, 3.3 TB/s),
~5.09 ms, and the step is 0.64 ms above it. Measured and dropped in the same run: a recompute pass writing
rows at (row, slot), gathered by key after an int64 sort of each chunk
(6.77 ms), and bf16 rows (6.40 ms: store + sum 3.06 ms against fp32's
2.58, for half the bytes; dk 1.96e-3 from float64 against 1.81e-3). Earlier,
int64 fixed-point atomics (the one-pass alternative) measured 7.37 ms: the
integer adds are scalar, and 4.3 GB of them alone took 4.69 ms against 1.11
for fp32 ones.

DENSE has no keyword; under ``torch.use_deterministic_algorithms(True)`` the
main pass computes dq and dweights alone (DK_NONE) and ``_dense_dk_kernel``
sums dk by key: one program per block of a sequence's keys runs over the
sequence's query rows in order, recomputing the dots (a second pass), with
no workspace: the [T_q, S_k] slots of a long context would not fit one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from dsa._args import IndexerArgs, SparseIndexerArgs
from dsa._rules import dense_rows
from dsa.triton import fit
from dsa.triton.rules import input_precision, row_length, slot_rows
from dsa.triton.segment_sum import chunk_rows, grouped_segment_sum, slot_positions
from dsa.triton.training import _pow2, indexer_reason

# the source of the logits' gradient (the kernel's MODE)
MODE_SPARSE, MODE_KL, MODE_DENSE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# where dk goes (DK_MODE): fp32 atomics, per-slot workspace rows at their grouped positions, or nowhere
# (the dense deterministic backward's dk is _dense_dk_kernel's)
DK_ATOMIC, DK_GROUPED, DK_NONE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _slot_grads(b_s, b_ws, valid, GIN, t, o_k, stride_g, lse, tsum, MODE: tl.constexpr, HEAD_AX: tl.constexpr):
    """(relu(s) masked, the logits' gradient g_j [1, BK] / [BK, 1], ds) of one slot block;
    lse and tsum: the row's KL stats (KL only)."""
    SLOT_AX: tl.constexpr = 1 - HEAD_AX
    m_s = tl.expand_dims(valid, HEAD_AX)
    b_wsx = tl.expand_dims(b_ws, SLOT_AX)
    b_relu = tl.where(m_s, tl.maximum(b_s, 0.0), 0.0)
    if MODE == MODE_KL:
        b_lg = tl.sum(b_relu * b_wsx, HEAD_AX)
        b_t = tl.load(GIN + t * stride_g + o_k, mask=valid, other=0.0)
        b_g = tl.exp(b_lg - lse) * tsum - b_t  # [BK], unscaled (see the module header)
    else:
        b_g = tl.load(GIN + t * stride_g + o_k, mask=valid, other=0.0)
    b_g = tl.expand_dims(tl.where(valid, b_g, 0.0), HEAD_AX)
    b_ds = tl.where((b_s > 0.0) & m_s, b_g * b_wsx, 0.0)
    return b_relu, b_g, b_ds


@triton.jit
def _dk_block(b_ds, b_q, DK, SCALE, POS, t, rows, valid, o_k, o_d, m_d, K, D: tl.constexpr, MODE: tl.constexpr,
              DK_MODE: tl.constexpr, PREC: tl.constexpr, KEYS_AS_ROWS: tl.constexpr):
    """The block's dk rows ds^T q [BK, BD]: fp32 atomics into DK, or stores of
    the per-slot workspace rows at POS[t, slot]."""
    if KEYS_AS_ROWS:
        b_dk = tl.dot(b_ds.to(b_q.dtype), b_q, input_precision=PREC)  # [BK, BD]
    else:
        b_dk = tl.dot(tl.trans(b_ds).to(b_q.dtype), b_q, input_precision=PREC)  # [BK, BD]
    if MODE == MODE_KL:
        b_dk = b_dk * tl.load(SCALE)
    m_kd = valid[:, None] & m_d[None, :]
    if DK_MODE == DK_GROUPED:
        b_pos = tl.load(POS + t * K + o_k, mask=valid, other=0).to(tl.int64)
        tl.store(DK + b_pos[:, None] * D + o_d[None, :], b_dk, mask=m_kd)
    else:
        tl.atomic_add(DK + rows[:, None] * D + o_d[None, :], b_dk, mask=m_kd, sem="relaxed")


@triton.jit
def _indexer_bwd_kernel(
    Q,  # [T, H, D]
    Kp,  # [N, D]
    W,  # [T, H]
    IDX,  # [T, K] int32 (SPARSE, KL)
    LEN,  # [T] int32: topk_length (HAS_LEN) or the visible limit (DENSE)
    BASE,  # [T] int32 first key row of the row's sequence (DENSE)
    GIN,  # [T, stride_g] fp32: dlogits (SPARSE), target (KL), dscores (DENSE)
    STATS,  # [T, 4] fp32 from the KL forward (loss_t, lse, sum of target, has a valid slot)
    SCALE,  # [] fp32: dloss / max(R, 1) (KL)
    POS,  # [T, K] int32: the slot's row in the chunk's workspace (DK_GROUPED)
    DQ,  # [T, H, D] q.dtype
    DK,  # [N, D] fp32 accumulator (DK_ATOMIC), the chunk's per-slot fp32 workspace [C * K, D] (DK_GROUPED)
    DW,  # [T, H] weights.dtype
    sm_scale, N, K, stride_g, t_start,
    H: tl.constexpr, BH: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr,
    HAS_LEN: tl.constexpr,
    MODE: tl.constexpr,  # MODE_SPARSE, MODE_KL or MODE_DENSE
    DK_MODE: tl.constexpr,  # DK_ATOMIC, DK_GROUPED or DK_NONE
    PREC: tl.constexpr,
    KEYS_AS_ROWS: tl.constexpr = False,  # s^T = K Q^T and dq^T = K^T ds^T: slots on the MMAs' rows
):
    # the [heads, slots] tiles (s, ds) and the dq accumulator are transposed
    # with KEYS_AS_ROWS; HEAD_AX is the axis that runs over heads
    HEAD_AX: tl.constexpr = 1 if KEYS_AS_ROWS else 0
    SLOT_AX: tl.constexpr = 1 - HEAD_AX
    t = t_start + tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BH)
    m_h = o_h < H
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_hd = m_h[:, None] & m_d[None, :]
    b_q = tl.load(Q + t * (H * D) + o_h[:, None] * D + o_d[None, :], mask=m_hd, other=0.0)  # [BH, BD]
    b_ws = tl.load(W + t * H + o_h, mask=m_h, other=0.0).to(tl.float32) * sm_scale  # [BH]
    length = row_length(LEN, t, K, HAS_LEN)
    base = t
    if MODE == MODE_DENSE:
        base = tl.load(BASE + t).to(tl.int64)
    lse = 0.0
    tsum = 0.0
    if MODE == MODE_KL:
        lse = tl.load(STATS + t * 4 + 1)
        tsum = tl.load(STATS + t * 4 + 2)
    if KEYS_AS_ROWS:
        b_dq = tl.zeros([BD, BH], tl.float32)
    else:
        b_dq = tl.zeros([BH, BD], tl.float32)
    b_dw = tl.zeros([BH], tl.float32)
    for k0 in range(0, length, BK):
        o_k, m_k, rows, valid = slot_rows(IDX, t, K, base, k0, length, N, BK, MODE == MODE_DENSE)
        b_k = tl.load(Kp + rows[:, None] * D + o_d[None, :], mask=valid[:, None] & m_d[None, :], other=0.0)
        if KEYS_AS_ROWS:
            b_s = tl.dot(b_k, tl.trans(b_q), input_precision=PREC)  # [BK, BH]
        else:
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)  # [BH, BK]
        b_relu, b_g, b_ds = _slot_grads(b_s, b_ws, valid, GIN, t, o_k, stride_g, lse, tsum, MODE, HEAD_AX)
        b_dw += tl.sum(b_relu * b_g, SLOT_AX)
        if KEYS_AS_ROWS:
            b_dq = tl.dot(tl.trans(b_k), b_ds.to(b_k.dtype), b_dq, input_precision=PREC)  # [BD, BH]
        else:
            b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, b_dq, input_precision=PREC)  # [BH, BD]
        if DK_MODE != DK_NONE:
            _dk_block(b_ds, b_q, DK, SCALE, POS, t, rows, valid, o_k, o_d, m_d, K, D, MODE, DK_MODE, PREC,
                      KEYS_AS_ROWS)
    if MODE == MODE_KL:
        scale = tl.load(SCALE)
        b_dq = b_dq * scale
        b_dw = b_dw * scale
    p_dq = DQ + t * (H * D) + tl.expand_dims(o_h * D, SLOT_AX) + tl.expand_dims(o_d, HEAD_AX)
    m_dq = tl.expand_dims(m_h, SLOT_AX) & tl.expand_dims(m_d, HEAD_AX)
    tl.store(p_dq, b_dq.to(DQ.dtype.element_ty), mask=m_dq)
    tl.store(DW + t * H + o_h, (b_dw * sm_scale).to(DW.dtype.element_ty), mask=m_h)


@triton.jit
def _dense_dk_kernel(
    Q,  # [T, H, D]
    Kp,  # [N, D]
    W,  # [T, H]
    GIN,  # [T, stride_g] fp32 dscores (local key columns)
    LIMIT,  # [T] int32: the row's visible keys
    CU_Q, CU_K,  # [B + 1] int32
    DK,  # [N, D] fp32
    sm_scale, stride_g,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr,
):
    """dk of ``indexer_scores`` with no atomics: program (b, block of BN keys of sequence b) sums ds^T q over
    the sequence's query rows in order, BM rows and then one head at a time, into registers, and stores
    once. A row's contribution to a key it does not see is never added: the rows of a block with a
    non-finite q (whose 0 * inf would reach every key of the product) are added apart, key by key."""
    b = tl.program_id(0)
    j0 = tl.program_id(1) * BN
    k_lo = tl.load(CU_K + b).to(tl.int64)
    s_k = tl.load(CU_K + b + 1).to(tl.int64) - k_lo
    if j0 < s_k:
        q_lo = tl.load(CU_Q + b).to(tl.int64)
        q_hi = tl.load(CU_Q + b + 1).to(tl.int64)
        o_j = j0 + tl.arange(0, BN)
        m_j = o_j < s_k
        o_d = tl.arange(0, BD)
        m_d = o_d < D
        o_m = tl.arange(0, BM)
        b_k = tl.load(Kp + (k_lo + o_j)[:, None] * D + o_d[None, :], mask=m_j[:, None] & m_d[None, :], other=0.0)
        b_dk = tl.zeros([BN, BD], tl.float32)
        for r0 in range(q_lo, q_hi, BM):
            o_r = r0 + o_m
            m_r = o_r < q_hi
            lim = tl.load(LIMIT + o_r, mask=m_r, other=0)
            vis = (o_j[None, :] < lim[:, None]) & m_r[:, None]  # [BM, BN]; lim <= s_k
            if tl.max(lim, 0) > j0:  # some row of the block sees a key of this one
                b_g = tl.load(GIN + o_r[:, None] * stride_g + o_j[None, :], mask=vis, other=0.0)
                for h in range(H):
                    b_q = tl.load(Q + o_r[:, None] * (H * D) + h * D + o_d[None, :], mask=m_r[:, None] & m_d[None, :],
                                  other=0.0)  # [BM, BD]
                    b_w = tl.load(W + o_r * H + h, mask=m_r, other=0.0).to(tl.float32) * sm_scale
                    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)  # [BM, BN]
                    b_ds = tl.where((b_s > 0.0) & vis, b_g * b_w[:, None], 0.0)
                    bad = tl.sum(tl.where((b_q == b_q) & (tl.abs(b_q) < float("inf")), 0, 1), 1) > 0  # [BM]
                    b_qf = tl.where(bad[:, None], 0.0, b_q).to(b_q.dtype)
                    b_dk = tl.dot(tl.trans(b_ds).to(b_q.dtype), b_qf, b_dk, input_precision=PREC)  # [BN, BD]
                    if tl.max(bad.to(tl.int32), 0) > 0:
                        for i in range(BM):
                            pick = o_m == i
                            if tl.max((pick & bad).to(tl.int32), 0) > 0:
                                q_i = tl.sum(tl.where(pick[:, None], b_q.to(tl.float32), 0.0), 0)  # [BD]
                                ds_i = tl.sum(tl.where(pick[:, None], b_ds.to(b_q.dtype).to(tl.float32), 0.0), 0)
                                vis_i = tl.max(tl.where(pick[:, None], vis.to(tl.int32), 0), 0) > 0  # [BN]
                                b_dk += tl.where(vis_i[:, None], ds_i[:, None] * q_i[None, :], 0.0)
        tl.store(DK + (k_lo + o_j)[:, None] * D + o_d[None, :], b_dk, mask=m_j[:, None] & m_d[None, :])


# --------------------------------------------------------------------------
# configs


@dataclass(frozen=True)
class IndexerBwdConfig:
    """Tiles of the indexer backward kernel (one program per query row, all its heads)."""

    BK: int
    num_warps: int
    num_stages: int
    keys_as_rows: bool = False  # slots on the MMAs' rows (see the kernel's KEYS_AS_ROWS)


# H_i = 64, D_i = 128: dq [64, 128] fp32 accumulates in registers across the row. H200 bf16,
# KL backward at T=4096, K=2048: (BK, warps, stages) = (32,4,2) 2.98 ms; (32,4,1) 2.93; (32,4,3) 3.06;
# (16,4,2) 3.24; (64,8,2) 4.52; (32,8,2) 6.01; (32,8,3) 6.17 (one warpgroup: 2 CTAs per SM).
# keys_as_rows (every product a wgmma with 64 slot rows; RESULTS.md C18): (64,4,1) 2.15 ms; (64,4,2) 2.27;
# (64,4,3) 2.32; (128,8,2) 2.81; (32,4,2) 3.05; (64,8,2) 3.65; heads as rows (32,4,1) 2.95 in the same run.
BWD_CONFIG = IndexerBwdConfig(BK=64, num_warps=4, num_stages=1, keys_as_rows=True)


def bwd_config(K: int) -> IndexerBwdConfig:
    """The preferred tiles for K slots a row (before fitting)."""
    return replace(BWD_CONFIG, BK=min(BWD_CONFIG.BK, _pow2(K)))


def bwd_spec(q_dtype, w_dtype, H: int, D: int, cfg: IndexerBwdConfig, *, mode=MODE_KL, dk_mode=DK_ATOMIC,
             has_len: bool = True) -> fit.KernelSpec:
    el = fit.ptr(q_dtype)
    types = dict(Q=el, Kp=el, W=fit.ptr(w_dtype), IDX="*i32", LEN="*i32", BASE="*i32", GIN="*fp32", STATS="*fp32",
                 SCALE="*fp32", POS="*i32", DQ=el, DK="*fp32", DW=fit.ptr(w_dtype), sm_scale="fp32")
    const = dict(H=H, BH=_pow2(H), D=D, BD=_pow2(D), BK=cfg.BK, HAS_LEN=has_len, MODE=int(mode),
                 DK_MODE=int(dk_mode), PREC=input_precision(q_dtype), KEYS_AS_ROWS=cfg.keys_as_rows)
    return fit.KernelSpec(_indexer_bwd_kernel, types, const, cfg.num_warps, cfg.num_stages)


def pick(q: torch.Tensor, w_dtype, K: int,
         target: Optional[fit.Target] = None) -> Tuple[Optional[IndexerBwdConfig], str]:
    """The backward tiles that fit ``target`` (q's device when None), every mode alike."""
    H, D = q.shape[1], q.shape[2]
    base = bwd_config(K)
    return fit.pick(lambda: fit.shrinking(base, (("num_stages", 1), ("BK", 16))),
                    lambda c: bwd_spec(q.dtype, w_dtype, H, D, c), target or fit.device_target(q),
                    ("indexer_bwd", q.dtype, w_dtype, H, D, base))


def supports(args) -> Optional[str]:
    if isinstance(args, (SparseIndexerArgs, IndexerArgs)):
        return indexer_reason(args.q, args.weights)
    return f"triton: no kernel for {type(args).__name__}"


def tiles_reason(fn_name: str, args) -> Optional[str]:
    """Why no backward tiles fit the device (None if some do)."""
    K = args.K if isinstance(args, SparseIndexerArgs) else args.max_seqlen_k
    return pick(args.q, args.weights.dtype, K)[1] or None


# --------------------------------------------------------------------------
# host functions


@dataclass(frozen=True)
class _Problem:
    """What one backward launch needs, whatever the mode."""

    q: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor  # [T, K] (any int32 tensor in DENSE mode)
    length: Optional[torch.Tensor]  # [T] int32 or None
    base: Optional[torch.Tensor]  # [T] int32 (DENSE)
    grad_in: torch.Tensor  # [T, >= K] fp32
    stats: Optional[torch.Tensor]
    scale: Optional[torch.Tensor]
    sm_scale: float
    K: int
    mode: int


def _launch(p: _Problem, dq, dw, dk, t_start: int, rows: int, dk_mode: int, pos=None) -> None:
    T, H, D = p.q.shape
    cfg, why = pick(p.q, p.weights.dtype, p.K)
    if cfg is None:
        raise ValueError(why)
    spec = bwd_spec(p.q.dtype, p.weights.dtype, H, D, cfg, mode=p.mode, dk_mode=dk_mode,
                    has_len=p.length is not None)
    dummy = p.indices
    _indexer_bwd_kernel[(rows,)](
        p.q, p.k, p.weights, p.indices,
        dummy if p.length is None else p.length,
        dummy if p.base is None else p.base,
        p.grad_in,
        p.grad_in if p.stats is None else p.stats,
        p.grad_in if p.scale is None else p.scale,
        dummy if pos is None else pos,
        dq, dk, dw, p.sm_scale, p.k.shape[0], p.K, p.grad_in.stride(0), t_start,
        **spec.launch_kwargs(),
    )


def _deterministic_dk(p: _Problem, dq, dw, dk) -> None:
    """``deterministic=True`` (see the module header): per chunk, the main pass
    stores each slot's fp32 dk row at its grouped position; contiguous sums per key."""
    T, _, D = p.q.shape
    N = p.k.shape[0]
    rows = chunk_rows(T, p.K * D * 4, device=dk.device)
    pos, start = slot_positions(p.indices, p.length, N, rows)
    ws = torch.empty(rows * p.K, D, device=p.q.device, dtype=torch.float32)
    for c, t0 in enumerate(range(0, T, rows)):
        t1 = min(T, t0 + rows)
        _launch(p, dq, dw, ws, t0, t1 - t0, DK_GROUPED, pos=pos)
        grouped_segment_sum(ws, start[c], dk, block_d=_pow2(D))


DENSE_DK_BN, DENSE_DK_BM = 64, 32  # keys a program, query rows a step of the deterministic dense dk


def dense_dk_spec(q_dtype, w_dtype, H: int, D: int) -> fit.KernelSpec:
    """``_dense_dk_kernel`` at its one configuration (fixed tiles: a deterministic opt-in, not tuned)."""
    el = fit.ptr(q_dtype)
    types = dict(Q=el, Kp=el, W=fit.ptr(w_dtype), GIN="*fp32", LIMIT="*i32", CU_Q="*i32", CU_K="*i32",
                 DK="*fp32", sm_scale="fp32")
    const = dict(H=H, D=D, BD=_pow2(D), BN=DENSE_DK_BN, BM=DENSE_DK_BM, PREC=input_precision(q_dtype))
    return fit.KernelSpec(_dense_dk_kernel, types, const, 8, 1)  # no spill on sm_80 .. sm_120 (4 warps spill)


def _dense_deterministic_dk(p: _Problem, a: IndexerArgs, dq, dw, dk) -> None:
    """DENSE under ``torch.use_deterministic_algorithms`` (see the module header): the main pass without
    dk, then ``_dense_dk_kernel``."""
    T, H, D = p.q.shape
    _launch(p, dq, dw, dk, 0, T, DK_NONE)
    if T and a.max_seqlen_k:
        grid = (a.batch, triton.cdiv(a.max_seqlen_k, DENSE_DK_BN))
        _dense_dk_kernel[grid](
            p.q, p.k, p.weights, p.grad_in, p.length, a.cu_seqlens_q, a.cu_seqlens_k, dk, p.sm_scale,
            p.grad_in.stride(0), **dense_dk_spec(p.q.dtype, p.weights.dtype, H, D).launch_kwargs(),
        )


def _backward(p: _Problem, deterministic: bool, dense: Optional[IndexerArgs] = None
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dweights of ``p``; ``dense``: the IndexerArgs of a DENSE problem."""
    T, _, D = p.q.shape
    N = p.k.shape[0]
    dq = torch.empty_like(p.q)
    dw = torch.empty_like(p.weights)
    dk = torch.zeros(N, D, device=p.k.device, dtype=torch.float32)
    if not deterministic:
        _launch(p, dq, dw, dk, 0, T, DK_ATOMIC)
    elif dense is not None:
        _dense_deterministic_dk(p, dense, dq, dw, dk)
    else:
        _deterministic_dk(p, dq, dw, dk)
    return dq, dk.to(p.k.dtype), dw


def _sparse_problem(a: SparseIndexerArgs, grad_in, stats, scale, mode) -> _Problem:
    return _Problem(
        a.q, a.k, a.weights, a.indices, a.topk_length, None, grad_in, stats, scale, a.sm_scale, a.K, int(mode)
    )


def sparse_indexer_bwd(a: SparseIndexerArgs, dlogits: torch.Tensor):
    """-> dq, dk (fp32-accumulated), dweights of sparse_indexer_scores; dlogits [T, K]."""
    p = _sparse_problem(a, dlogits.float().contiguous(), None, None, MODE_SPARSE)
    return _backward(p, a.deterministic)


def indexer_kl_bwd(a: SparseIndexerArgs, target: torch.Tensor, stats: torch.Tensor, scale: torch.Tensor,
                   logits: Optional[torch.Tensor] = None):
    """-> dq, dk, dweights of the KL loss; stats [T, 4] of the forward, scale = dloss / max(R, 1);
    logits (the deterministic forward's) are not needed: the kernel recomputes its own."""
    p = _sparse_problem(
        a, target.float().contiguous(), stats.float().contiguous(), scale.float().reshape(()), MODE_KL
    )
    return _backward(p, a.deterministic)


def indexer_scores_bwd(a: IndexerArgs, dscores: torch.Tensor):
    """-> dq, dk, dweights of indexer_scores; dscores [T_q, max_seqlen_k], ignored where not visible.

    dk adds by atomics; under ``torch.use_deterministic_algorithms(True)`` (the op has no keyword of its
    own) the main pass leaves dk to ``_dense_dk_kernel``, which sums each key's rows in a fixed order:
    bitwise reproducible, at the cost of a second pass over the visible (row, key) pairs."""
    base, limit = dense_rows(a)
    p = _Problem(
        a.q, a.k, a.weights, base, limit, base, dscores.float().contiguous(), None, None,
        a.sm_scale, a.max_seqlen_k, int(MODE_DENSE),
    )
    return _backward(p, torch.are_deterministic_algorithms_enabled(), dense=a)
