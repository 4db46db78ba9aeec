"""Sparse attention forward kernel (Triton).

For query row t, head h (kv head g = h // (H / G)) and the valid slots j of
(t, g) (see sparse_attention_common):

    s_j = sm_scale * q[t, h] . kv[indices[t, g, j], g]
    lse = log(sum_j exp(s_j))                      (+inf when no slot is valid)
    out = sum_j exp(s_j) / (sum_j exp(s_j) + exp(sink[h])) * kv[idx_j, g, :d_v]

One program per (token, kv head, block of BH query heads): the gathered
[BN, D] kv tile is shared by all BH heads (MQA: up to 64 heads per program),
which turns the gather into BH-row matrix products on the tensor cores.  The
softmax runs online in the log2 domain (exp2 with log2(e) folded into the
scale).  The loop stops at the last block of valid slots, so a row with
topk_length L costs about L / K of a full row.  PREFETCH loads a block's
indices one iteration ahead, so the gather's addresses are ready when the
block starts (on an H200 1-5% faster on full rows, and half-valid rows drop
from 0.56 to 0.52-0.54 of a full row's time; the backward is 4-9% slower
with it, so it loads them in the block that uses them).

SKEW: Triton lays out a dot whose result feeds another dot with all warps
along M; with BH = 64 rows and 8 warps both warpgroups would then compute the
same S = Q K^T.  With SKEW the loop computes S of block i + 1 and hands it
over to the next iteration (together with the V tile) before doing the
softmax and P @ V of block i; S then has no dot in its forward slice and is
split [4, 2] over the warps.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsa.triton.rules import LN2, LOG2E, online_softmax_step, row_length, slot_block
from dsa.triton.sparse_attention_common import load_chunks, store_chunks


@triton.jit
def scores(b_qs, b_ks, NC: tl.constexpr, PREC: tl.constexpr):
    """sum_c q_c k_c^T: [BH, BN] fp32 from the per-chunk [BH, w] / [BN, w] tiles."""
    b_s = tl.dot(b_qs[0], tl.trans(b_ks[0]), input_precision=PREC)
    for c in tl.static_range(1, NC):
        b_s = tl.dot(b_qs[c], tl.trans(b_ks[c]), b_s, input_precision=PREC)
    return b_s


@triton.jit
def first_chunks(bs, N: tl.constexpr):
    out = ()
    for c in tl.static_range(N):
        out = out + (bs[c],)
    return out


@triton.jit
def online_softmax_pv(b_s, valid, qk_scale, b_m, b_l, b_os, b_vs, NV: tl.constexpr,
                      PREC: tl.constexpr):
    """One block of the online softmax (log2 domain) and O += P V."""
    b_s = tl.where(valid[None, :], b_s * qk_scale, float("-inf"))
    b_m_new, b_l, b_p, b_alpha = online_softmax_step(b_s, b_m, b_l, 1)
    b_pc = b_p.to(b_vs[0].dtype)
    new = ()
    for c in tl.static_range(NV):
        new = new + (tl.dot(b_pc, b_vs[c], b_os[c] * b_alpha[:, None], input_precision=PREC),)
    return b_m_new, b_l, new


@triton.jit
def sparse_attn_fwd_kernel(
    q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr,
    N, K, qk_scale,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, D_V: tl.constexpr,
    OFFS: tl.constexpr, WS: tl.constexpr, NV: tl.constexpr,
    BH: tl.constexpr, BN: tl.constexpr, SKEW: tl.constexpr,
    HAS_LEN: tl.constexpr, HAS_SINK: tl.constexpr, PREC: tl.constexpr,
    PREFETCH: tl.constexpr = True, KEYS_AS_ROWS: tl.constexpr = False,
):
    HG: tl.constexpr = H // G
    NC: tl.constexpr = len(WS)
    pid = tl.program_id(0)  # t * G + g
    t = pid // G
    g = pid % G
    o_h = tl.program_id(1) * BH + tl.arange(0, BH)
    m_h = o_h < HG
    head = g * HG + o_h
    p_q = q_ptr + (t.to(tl.int64) * H + head) * D  # [BH] row pointers

    b_qs = load_chunks(p_q, m_h, OFFS, WS, 0, NC)  # q stays on chip for the row
    L = row_length(len_ptr, t, K, HAS_LEN)
    p_idx = idx_ptr + pid.to(tl.int64) * K
    p_kv = kv_ptr + g * D

    b_m = tl.full([BH], float("-inf"), tl.float32)
    b_l = tl.zeros([BH], tl.float32)
    b_os = ()  # O [BH, w] per V chunk, or O^T [w, BH] with KEYS_AS_ROWS
    for c in tl.static_range(NV):
        if KEYS_AS_ROWS:
            b_os = b_os + (tl.zeros(tl.trans(b_qs[c]).shape, tl.float32),)
        else:
            b_os = b_os + (tl.zeros(b_qs[c].shape, tl.float32),)

    if KEYS_AS_ROWS:
        # The slots as the MMAs' rows (16 or 32 heads a program, see
        # sparse_attention_bwd): S^T = K Q^T [BN, BH] and O^T += V^T P^T
        # [w, BH], so M = BN or w and the heads are only N.
        for start in range(0, L, BN):
            idx, valid = slot_block(p_idx, start, L, N, BN)
            b_ks = load_chunks(p_kv + idx * (G * D), valid, OFFS, WS, 0, NC)
            b_sT = scores(b_ks, b_qs, NC, PREC)  # [BN, BH]
            b_sT = tl.where(valid[:, None], b_sT * qk_scale, float("-inf"))
            b_m, b_l, b_pT, b_alpha = online_softmax_step(b_sT, b_m, b_l, 0)
            b_pTc = b_pT.to(b_ks[0].dtype)
            new = ()
            for c in tl.static_range(NV):
                new = new + (tl.dot(tl.trans(b_ks[c]), b_pTc, b_os[c] * b_alpha[None, :], input_precision=PREC),)
            b_os = new
    elif SKEW:
        idx, valid = slot_block(p_idx, 0, L, N, BN)
        b_ks = load_chunks(p_kv + idx * (G * D), valid, OFFS, WS, 0, NC)
        b_s = scores(b_qs, b_ks, NC, PREC)
        b_vs = first_chunks(b_ks, NV)
        for start in range(BN, L + BN, BN):
            idx_n, valid_n = slot_block(p_idx, start, L, N, BN)
            b_ks_n = load_chunks(p_kv + idx_n * (G * D), valid_n, OFFS, WS, 0, NC)
            b_s_n = scores(b_qs, b_ks_n, NC, PREC)
            b_m, b_l, b_os = online_softmax_pv(b_s, valid, qk_scale, b_m, b_l, b_os, b_vs, NV, PREC)
            b_s = b_s_n
            valid = valid_n
            b_vs = first_chunks(b_ks_n, NV)
    else:
        if PREFETCH:
            idx, valid = slot_block(p_idx, 0, L, N, BN)
        for start in range(0, L, BN):
            if PREFETCH:  # the next block's indices load while this block computes
                idx_n, valid_n = slot_block(p_idx, start + BN, L, N, BN)
            else:
                idx, valid = slot_block(p_idx, start, L, N, BN)
            # [BN, w] gathers of the selected rows; invalid slots are never read.
            b_ks = load_chunks(p_kv + idx * (G * D), valid, OFFS, WS, 0, NC)
            b_s = scores(b_qs, b_ks, NC, PREC)  # [BH, BN]
            b_m, b_l, b_os = online_softmax_pv(b_s, valid, qk_scale, b_m, b_l, b_os, b_ks, NV, PREC)
            if PREFETCH:
                idx, valid = idx_n, valid_n

    b_m_use = tl.where(b_m == float("-inf"), 0.0, b_m)
    b_den = b_l
    if HAS_SINK:
        # sink * log2(e) overflows to +inf for sinks above ~2.4e38, which is
        # what we want: the sink's probability is then 1 and out is 0.
        b_sink = tl.load(sink_ptr + head, mask=m_h, other=float("-inf")) * LOG2E
        b_den = b_den + tl.exp2(b_sink - b_m_use)
    # den == 0 only for a row with no valid slot and no sink: out = 0 there.
    b_inv = tl.where(b_den == 0.0, 0.0, 1.0 / b_den)

    p_out = out_ptr + (t.to(tl.int64) * H + head) * D_V
    b_outs = ()
    for c in tl.static_range(NV):
        if KEYS_AS_ROWS:
            b_outs = b_outs + (tl.trans(b_os[c] * b_inv[None, :]).to(out_ptr.dtype.element_ty),)
        else:
            b_outs = b_outs + ((b_os[c] * b_inv[:, None]).to(out_ptr.dtype.element_ty),)
    store_chunks(p_out, m_h, b_outs, OFFS, WS, 0, NV)
    b_lse = tl.where(b_l == 0.0, float("inf"), (b_m + tl.log2(b_l)) * LN2)
    tl.store(lse_ptr + t.to(tl.int64) * H + head, b_lse, mask=m_h)
