"""Sparse attention backward kernels (Triton).

With p_j = exp(s_j - log den) (the forward's probabilities, sink included in
den), dp_j = dO . v_j and Delta = dO . out = sum_j p_j dp_j (the sink's value
is 0):

    ds_j   = p_j * (dp_j - Delta)
    dq     = sm_scale * sum_j ds_j k_j
    dkv_j += sm_scale * ds_j q  (all D columns)  +  p_j dO  (the d_v V columns)
    dsink  = -sum_t p_sink * Delta,   p_sink = exp(sink - log den)

Two kernels, and the deterministic mode's fixed-order sum:

* ``bwd_preprocess_kernel``: per (t, h) Delta, log2(den) (with the forward's
  +inf-lse convention for empty rows and the sink = +inf / overflow cases
  resolved so that no inf - inf appears) and the dsink term -p_sink * Delta.
* ``sparse_attn_bwd_kernel``: query-major, one program per (token, kv head,
  block of BH heads) like the forward.  It recomputes S and dP for a block of
  BN slots, keeps dq in registers, and produces the slots' dkv rows one
  column chunk at a time as dkv^T [w, BN] = q^T ds + dO^T p (sm_scale folded
  into ds), which are either added with fp32 atomics into a [N, G, D] buffer
  (default) or stored per slot (deterministic mode).
* ``KEYS_AS_ROWS`` (the TP-shard head counts, 16 or 32 heads a kv head): the
  same math with every product transposed so that the slots, not the heads,
  are the MMA's rows: S^T = K Q^T and dP^T = V dO^T [BN, BH], dq^T += K^T
  ds^T [w, BH] and dkv = ds^T q + p^T dO [BN, w].  With BH = 16 heads as
  rows an MMA has M = 16, below the 64 rows a Hopper warpgroup MMA (wgmma)
  takes, so the heads-as-rows kernel runs on mma.sync; with the slots
  (BN = 64 or 128) or a column chunk (w = 64..256) as rows every product is
  a wgmma, the heads only its N (>= 16) or its K (= BH, a multiple of 16).
  The dkv rows come out slot-major, so each atomic instruction adds
  contiguous columns of a kv row.
* deterministic mode: ``dsa.triton.segment_sum`` sums each kv row's
  per-slot contributions in the fixed order of a stable sort, token chunk
  after token chunk, so dkv is bitwise reproducible.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsa.triton.rules import LOG2E, row_length, slot_block
from dsa.triton.sparse_attention_common import load_chunks, store_chunks
from dsa.triton.sparse_attention_fwd import scores


@triton.jit
def bwd_preprocess_kernel(
    out_ptr, dout_ptr, lse_ptr, sink_ptr, delta_ptr, lg2den_ptr, dsink_part_ptr, stats_ptr,
    R, H: tl.constexpr, D_V: tl.constexpr,
    BR: tl.constexpr, BV: tl.constexpr, HAS_SINK: tl.constexpr, STATS: tl.constexpr, DELTA: tl.constexpr = True,
):
    """Over the flattened R = T * H rows (t, h).  STATS: also max|dO| and an
    upper bound of ||dO|| a row, stats[r] = (max, norm) fp32.  DELTA False:
    out and dO are not read, delta is not written and the dsink terms are
    -p_sink (a kernel computing Delta multiplies them)."""
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    m_r = o_r < R
    o_r = o_r.to(tl.int64)
    b_delta = tl.zeros([BR], tl.float32)
    b_max = tl.zeros([BR], tl.float32)
    b_ssq = tl.zeros([BR], tl.float32)
    if DELTA:
        for v0 in range(0, D_V, BV):
            o_v = v0 + tl.arange(0, BV)
            m = m_r[:, None] & (o_v[None, :] < D_V)
            p = o_r[:, None] * D_V + o_v[None, :]
            b_o = tl.load(out_ptr + p, mask=m, other=0.0).to(tl.float32)
            b_do = tl.load(dout_ptr + p, mask=m, other=0.0).to(tl.float32)
            b_delta += tl.sum(b_o * b_do, 1)
            if STATS:
                b_max = tl.maximum(b_max, tl.max(tl.abs(b_do), 1))
                b_ssq += tl.sum(b_do * b_do, 1)
    else:
        b_delta += 1.0
    if STATS:
        # a sum of squares that is not a normal number (its squares under- or
        # overflowed, or NaN) gives way to sqrt(d_v) max|dO|, also a bound of ||dO||
        ok = (b_ssq >= 2.0 ** -126) & (b_ssq < float("inf"))
        b_norm = tl.where(ok, tl.sqrt_rn(tl.where(ok, b_ssq, 1.0)), D_V ** 0.5 * b_max)
        tl.store(stats_ptr + 2 * o_r, b_max, mask=m_r)
        tl.store(stats_ptr + 2 * o_r + 1, b_norm, mask=m_r)
    b_lse = tl.load(lse_ptr + o_r, mask=m_r, other=float("inf"))
    # The forward stores +inf for log(0) (empty rows); the math needs -inf.
    b_lse = tl.where(b_lse == float("inf"), float("-inf"), b_lse)
    if HAS_SINK:
        b_sink = tl.load(sink_ptr + o_r % H, mask=m_r, other=float("-inf"))
        b_hi = tl.maximum(b_lse, b_sink, propagate_nan=tl.PropagateNan.ALL)
        b_lo = tl.minimum(b_lse, b_sink, propagate_nan=tl.PropagateNan.ALL)
        b_inf = (b_hi == float("inf")) | (b_hi == float("-inf"))
        b_hi_safe = tl.where(b_inf, 0.0, b_hi)
        b_logden = tl.where(b_inf, b_hi, b_hi_safe + tl.log(1.0 + tl.exp(b_lo - b_hi_safe)))
        # p_sink: 1 for sink = +inf (den = inf), 0 for sink = -inf.
        b_psink = tl.where(b_sink == float("inf"), 1.0,
                           tl.where(b_sink == float("-inf"), 0.0, tl.exp(b_sink - b_logden)))
        tl.store(dsink_part_ptr + o_r, -b_psink * b_delta, mask=m_r)
    else:
        b_logden = b_lse
    # Empty rows (log den = -inf) get +inf so that every p_j = exp2(s - inf) = 0;
    # log2(den) of a huge sink overflows to +inf with the same effect.
    b_lg2 = tl.where(b_logden == float("-inf"), float("inf"), b_logden * LOG2E)
    if DELTA:
        tl.store(delta_ptr + o_r, b_delta, mask=m_r)
    tl.store(lg2den_ptr + o_r, b_lg2, mask=m_r)


@triton.jit
def _dkv_out(p_c, b_dkv, m, STORE_SLOTS: tl.constexpr):
    """The slots' dkv contributions: per-slot rows (deterministic) or fp32 atomics."""
    if STORE_SLOTS:
        tl.store(p_c, b_dkv, mask=m)
    else:
        tl.atomic_add(p_c, b_dkv, mask=m, sem="relaxed")


@triton.jit
def head_rows_step(b_qs, b_dos, b_ks, b_dqs, b_lg2, b_delta, valid, p_out, qk_scale, sm_scale,
                   OFFS: tl.constexpr, WS: tl.constexpr, NC: tl.constexpr, NV: tl.constexpr,
                   STORE_SLOTS: tl.constexpr, PREC: tl.constexpr):
    """One block of BN slots with the heads as the MMAs' rows (64 heads a program)."""
    dtype = b_qs[0].dtype
    b_s = scores(b_qs, b_ks, NC, PREC)  # [BH, BN]
    b_dp = scores(b_dos, b_ks, NV, PREC)  # [BH, BN]
    b_p = tl.where(valid[None, :], tl.exp2(b_s * qk_scale - b_lg2[:, None]), 0.0)
    b_ds = tl.where(valid[None, :], b_p * (b_dp - b_delta[:, None]) * sm_scale, 0.0)
    b_dsc = b_ds.to(dtype)
    b_pc = b_p.to(dtype)
    # The slots' dkv rows, transposed and one column chunk at a time:
    # dkv^T = q^T ds (+ dO^T p), so q and dO are read from the same shared
    # tiles as in S and dP (as transposed A operands) and M = w >= 64 suits
    # wgmma; the [w, BN] fp32 tile lives only until its atomics.
    for c in tl.static_range(NC):
        b_dkvT = tl.dot(tl.trans(b_qs[c]), b_dsc, input_precision=PREC)  # [w, BN]
        if c < NV:
            b_dkvT = tl.dot(tl.trans(b_dos[c]), b_pc, b_dkvT, input_precision=PREC)
        _dkv_out(p_out[None, :] + OFFS[c] + tl.arange(0, WS[c])[:, None], b_dkvT, valid[None, :], STORE_SLOTS)
    new = ()
    for c in tl.static_range(NC):
        new = new + (tl.dot(b_dsc, b_ks[c], b_dqs[c], input_precision=PREC),)  # [BH, w]
    return new


@triton.jit
def slot_rows_step(b_qs, b_dos, b_ks, b_dqs, b_lg2, b_delta, valid, p_out, qk_scale, sm_scale,
                   OFFS: tl.constexpr, WS: tl.constexpr, NC: tl.constexpr, NV: tl.constexpr,
                   STORE_SLOTS: tl.constexpr, PREC: tl.constexpr):
    """The same block with the slots as the MMAs' rows (KEYS_AS_ROWS, 16 or
    32 heads a program): every product has M = BN or w and the heads on N or K."""
    dtype = b_qs[0].dtype
    b_sT = scores(b_ks, b_qs, NC, PREC)  # [BN, BH] = K Q^T
    b_dpT = scores(b_ks, b_dos, NV, PREC)  # [BN, BH] = V dO^T
    b_pT = tl.where(valid[:, None], tl.exp2(b_sT * qk_scale - b_lg2[None, :]), 0.0)
    b_dsT = tl.where(valid[:, None], b_pT * (b_dpT - b_delta[None, :]) * sm_scale, 0.0)
    b_dsTc = b_dsT.to(dtype)
    b_pTc = b_pT.to(dtype)
    # dkv [BN, w] = ds^T q (+ p^T dO): K = BH; the A operands stay in registers.
    for c in tl.static_range(NC):
        b_dkv = tl.dot(b_dsTc, b_qs[c], input_precision=PREC)  # [BN, w]
        if c < NV:
            b_dkv = tl.dot(b_pTc, b_dos[c], b_dkv, input_precision=PREC)
        _dkv_out(p_out[:, None] + OFFS[c] + tl.arange(0, WS[c])[None, :], b_dkv, valid[:, None], STORE_SLOTS)
    new = ()
    for c in tl.static_range(NC):
        new = new + (tl.dot(tl.trans(b_ks[c]), b_dsTc, b_dqs[c], input_precision=PREC),)  # [w, BH]
    return new


@triton.jit
def sparse_attn_bwd_kernel(
    q_ptr, kv_ptr, idx_ptr, len_ptr, dout_ptr, lg2den_ptr, delta_ptr, dq_ptr, dkv_ptr,
    t0, N, K, qk_scale, sm_scale,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, D_V: tl.constexpr,
    OFFS: tl.constexpr, WS: tl.constexpr, NV: tl.constexpr,
    BH: tl.constexpr, BN: tl.constexpr,
    HAS_LEN: tl.constexpr, STORE_SLOTS: tl.constexpr, PREC: tl.constexpr,
    KEYS_AS_ROWS: tl.constexpr = False,
):
    """STORE_SLOTS=False: dkv_ptr is the fp32 [N, G, D] accumulator (atomics).
    STORE_SLOTS=True: dkv_ptr is the fp32 [HB, Tc, G, K, D] per-slot buffer of
    the token chunk starting at t0 (HB = head blocks); only valid slots are
    written."""
    HG: tl.constexpr = H // G
    NC: tl.constexpr = len(WS)
    pid = tl.program_id(0)  # (t - t0) * G + g
    hb = tl.program_id(1)
    t = t0 + pid // G
    g = pid % G
    o_h = hb * BH + tl.arange(0, BH)
    m_h = o_h < HG
    head = g * HG + o_h
    o_th = t.to(tl.int64) * H + head
    dtype = q_ptr.dtype.element_ty

    b_qs = load_chunks(q_ptr + o_th * D, m_h, OFFS, WS, 0, NC)
    b_dos = load_chunks(dout_ptr + o_th * D_V, m_h, OFFS, WS, 0, NV)
    # Masked head rows get log2(den) = +inf, hence p = ds = 0.
    b_lg2 = tl.load(lg2den_ptr + o_th, mask=m_h, other=float("inf"))
    b_delta = tl.load(delta_ptr + o_th, mask=m_h, other=0.0)

    L = row_length(len_ptr, t, K, HAS_LEN)
    p_idx = idx_ptr + (t.to(tl.int64) * G + g) * K
    p_kv = kv_ptr + g * D
    b_dqs = ()  # dq [BH, w] per chunk, or dq^T [w, BH] with KEYS_AS_ROWS
    for c in tl.static_range(NC):
        if KEYS_AS_ROWS:
            b_dqs = b_dqs + (tl.zeros(tl.trans(b_qs[c]).shape, tl.float32),)
        else:
            b_dqs = b_dqs + (tl.zeros(b_qs[c].shape, tl.float32),)

    for start in range(0, L, BN):
        idx, valid = slot_block(p_idx, start, L, N, BN)
        b_ks = load_chunks(p_kv + idx * (G * D), valid, OFFS, WS, 0, NC)  # [BN, w] each
        if STORE_SLOTS:
            # [HB, Tc, G, K, D] buffer: slot (hb, t - t0, g, start + n).
            p_out = dkv_ptr + (((hb * tl.num_programs(0) + pid).to(tl.int64) * K
                                + start + tl.arange(0, BN)) * D)
        else:
            p_out = dkv_ptr + idx * (G * D) + g * D
        if KEYS_AS_ROWS:
            b_dqs = slot_rows_step(b_qs, b_dos, b_ks, b_dqs, b_lg2, b_delta, valid, p_out, qk_scale, sm_scale,
                                   OFFS, WS, NC, NV, STORE_SLOTS, PREC)
        else:
            b_dqs = head_rows_step(b_qs, b_dos, b_ks, b_dqs, b_lg2, b_delta, valid, p_out, qk_scale, sm_scale,
                                   OFFS, WS, NC, NV, STORE_SLOTS, PREC)

    b_dq = ()
    for c in tl.static_range(NC):
        if KEYS_AS_ROWS:
            b_dq = b_dq + (tl.trans(b_dqs[c]).to(dtype),)
        else:
            b_dq = b_dq + (b_dqs[c].to(dtype),)
    store_chunks(dq_ptr + o_th * D, m_h, b_dq, OFFS, WS, 0, NC)
