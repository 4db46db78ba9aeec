"""Per-key quanta that make the attention backward's dkv atomics exact, so their order cannot matter.

The sparse attention backward adds, for every valid slot (t, g, j) with kv
row n = indices[t, g, j], an fp32 row of contributions into dkv[n, g, :].
fp32 atomics add them in an order the hardware picks, and fp32 addition is
not associative.  It is, exactly, when every addend is a multiple of one
power of two Q and every partial sum stays within 2^24 Q: the sums are then
integers times Q, each representable, so no addition rounds and any order
gives the same bits (dsa/triton/dk_quanta.py does the same for the indexer).

The adds may go to ``copies`` dkv buffers, tokens [k tpc, (k + 1) tpc) to
copy k (tpc = ``tokens_per_copy``), so a destination ("key") is
(copy, n, g), flattened as key = ((t // tpc) * N + n) * G + g.

The bound.  Over the heads h of kv head g, with dS_h = P_h (dP_h - Delta_h)
and |dP_h| <= ||dout_h|| ||v_n|| (Cauchy-Schwarz, v_n = kv[n, g, :d_v]), a
contribution's every column is at most

    sum_h P_h (w[t, h, 0] + w[t, h, 1] ||v_n||),
    w[t, h, 0] = max|dout_h| + |sm_scale| max|q_h| |Delta_h|    (dV, and dK's Delta term)
    w[t, h, 1] = |sm_scale| max|q_h| ||dout_h||                  (dK's dP term)

the slot-bound kernel (``dsa.cute.slot_bound_sm90``) computes w and the
head sums xy[p, t, g, j, :] = sum_h P_h w[t, h, :] over the heads of part
p, :func:`value_norms` the ||v_n||; here b[t, g, j] = MARGIN sum_p (xy[p, .., 0] + xy[p, .., 1]
||v_n||) (MARGIN as in dk_quanta: the 16-bit MMAs and fp32 sums).  A b that
is not finite (NaN or Inf in its inputs) counts as 0: those contributions
are NaN or Inf and propagate through the adds as they would without quanta.

The quantum.  Per key, B = sum of b over its valid slots, c = their number
and bmax = their largest b; Q is the smallest power of two with

    Q (2^24 - c / 2) >= B    (every partial sum of addends rounded to Q,
                              each by at most Q / 2, within 2^24 Q)
    Q 2^22 >= bmax           (the consumer rounds x to Q as (x + magic) - magic
                              in fp32, exact only for |x| <= 2^22 Q)

clamped to [2^-126, 2^104] (a key with 2^25 slots or more has no such Q
and gets 2^104).  The result is magic = 1.5 2^23 Q, or 0 where B = 0 (every
contribution of the key is zero).  B must be the same on every run: the b
are added as integers (int64 atomics, exact) in units of U =
2^max(e - bits, -126), 2^e the smallest power of two above the largest b
of all keys, each b rounded up to a whole unit (at least one where b > 0),
so that B = U sum ceil(b / U) stays a bound.  bits (:func:`_key_bits`) is
dk_quanta's for the most slots a key can have, small enough that no key's
sum overflows int64 (and below 2^53, so the sum converts to fp64
exactly); the count c shares the atomic in its low bits where that leaves
enough resolution.  A key whose bounds are all far below U is thus
charged a unit a slot: its Q is at least about U 2^-24.  bmax is an
integer atomic max on the fp32 bits of b (b >= 0: the bits order as the
values).  Q is then found exactly in fp64.

Three passes, no host sync (the unit is read from device memory by the
kernels that use it): the largest b (one atomic max a program), the key
sums (b recomputed by the same code, so no [T, G, K] temporary), then the
magic numbers.  Memory: int64 sums and int32 maxima a key (and int32
counts when the count cannot share the sums).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from dsa.triton.dk_quanta import MARGIN, _unit_bits
from dsa.triton.rules import load_slots, row_length


@triton.jit
def _pow2_scale(m):
    """(s, 1 / s), both normal fp32: a power of two s with m * s in [1, 4)
    for a finite m >= 2^-126, and 2^126 for a smaller m (m * s < 1)."""
    e = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(e, 1), 253)
    return ((254 - e) << 23).to(tl.float32, bitcast=True), (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _norm_step(ax, m, inv_s, acc):
    """One chunk of a scaled one-pass L2 norm along axis 1.

    ax [R, C] fp32 |x| of the chunk; m [R] the running max, inv_s [R] the
    inverse of its power of two scale s, acc [R] the sum of (x s)^2 so far.
    Scaling the squares by a power of two near 1 / max keeps them from
    overflowing or underflowing for any finite input (the norm is a bound:
    an underflow would make it too small).  Powers of two are multiplied,
    not divided: exact, whatever the division's rounding.  Returns the new
    (m, inv_s, acc); the norm is sqrt(acc) * inv_s."""
    m_new = tl.maximum(m, tl.max(ax, 1))
    s_new, inv_new = _pow2_scale(m_new)
    r = s_new * inv_s  # a power of two <= 1, or 0 where the old sum is negligible
    xs = ax * s_new[:, None]
    return m_new, inv_new, acc * (r * r) + tl.sum(xs * xs, 1)


@triton.jit
def _value_norms_kernel(KV, OUT, R, G, stride_n, stride_g, DV: tl.constexpr, BR: tl.constexpr,
                        BDV: tl.constexpr):
    """OUT[r] = ||KV[r // G, r % G, :DV]||_2 for rows [BR p, BR (p + 1)), 0 where not finite."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = o_r < R
    base = (o_r // G) * stride_n + (o_r % G) * stride_g
    nan = tl.zeros([BR], tl.float32)
    vmax = tl.zeros([BR], tl.float32)
    inv_s = _pow2_scale(vmax)[1]
    ssq = tl.zeros([BR], tl.float32)
    for d0 in range(0, DV, BDV):
        o_d = d0 + tl.arange(0, BDV)
        b_v = tl.load(KV + base[:, None] + o_d[None, :], mask=m_r[:, None] & (o_d[None, :] < DV), other=0.0)
        b_v = tl.abs(b_v.to(tl.float32))
        vmax, inv_s, ssq = _norm_step(b_v, vmax, inv_s, ssq)
        nan += tl.sum(b_v * 0.0, 1)
    norm = tl.sqrt_rn(ssq) * inv_s + nan
    tl.store(OUT + o_r, tl.where(norm < float("inf"), norm, 0.0), mask=m_r)


@triton.jit
def _slot_bounds(XY, IDX, VNORM, row, t, g, k0, L, P, T, G, K, N, BK: tl.constexpr, MARGIN: tl.constexpr):
    """b of slots [k0, k0 + BK) of row (t, g) of the [T, G, K] indices (row = t G + g, L its length).

    Returns (idx [BK] as loaded, valid [BK], b [BK] fp32: 0 where invalid or
    not a finite positive number; nothing is read for an invalid slot)."""
    o_n, m_n, idx, valid = load_slots(IDX, row, K, k0, L, N, BK)
    vn = tl.load(VNORM + tl.where(valid, idx, 0).to(tl.int64) * G + g, mask=valid, other=0.0)
    o_c = tl.arange(0, 2)
    s0 = tl.zeros([BK], tl.float32)
    s1 = tl.zeros([BK], tl.float32)
    for p in range(P):
        p_xy = XY + (((p * T + t) * G + g) * K + o_n[:, None]) * 2 + o_c[None, :]
        x0, x1 = tl.split(tl.load(p_xy, mask=valid[:, None], other=0.0))  # [BK, 2] -> 2 x [BK]
        s0 += x0
        s1 += x1
    b = MARGIN * (s0 + s1 * vn)
    return idx, valid, tl.where(valid & (b > 0) & (b < float("inf")), b, 0.0)


@triton.jit
def _unit_exponent(TOP, BITS: tl.constexpr):
    """u with U = 2^u from the largest b's fp32 bits at TOP: max(e - BITS, -126),
    e = biased exponent - 126, so that M < 2^e (M subnormal or 0 falls to the clamp)."""
    e = ((tl.load(TOP) >> 23) & 0xFF) - 126
    return tl.maximum(e - BITS, -126)


@triton.jit
def _program_slots(LEN, G, K, BK: tl.constexpr, HAS_LEN: tl.constexpr):
    """The row (t, g) and first slot k0 of a program over slots [k0, k0 + BK)
    of the [T, G, K] indices (grid (T G, K / BK)), and the row's length L."""
    row = tl.program_id(0).to(tl.int64)
    t = row // G
    return row, t, row % G, tl.program_id(1) * BK, row_length(LEN, t, K, HAS_LEN)


@triton.jit
def _top_kernel(XY, IDX, LEN, VNORM, TOP, P, T, G, K, N, BK: tl.constexpr, HAS_LEN: tl.constexpr,
                MARGIN: tl.constexpr):
    """TOP = max(TOP, the bits of the largest b of slots [k0, k0 + BK) of row (t, g))."""
    row, t, g, k0, L = _program_slots(LEN, G, K, BK, HAS_LEN)
    if k0 < L:
        idx, valid, b = _slot_bounds(XY, IDX, VNORM, row, t, g, k0, L, P, T, G, K, N, BK, MARGIN)
        tl.atomic_max(TOP, tl.max(b, 0).to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _key_sum_kernel(XY, IDX, LEN, VNORM, TOP, SUM, COUNT, BMAX, P, T, G, K, N, TPC, BK: tl.constexpr,
                    HAS_LEN: tl.constexpr, MARGIN: tl.constexpr, BITS: tl.constexpr, CB: tl.constexpr):
    """Over the valid slots [k0, k0 + BK) of row (t, g) (integer atomics):
    SUM[key] += ceil(b / U) and COUNT[key] += 1, or with CB > 0 both in SUM
    as ceil(b / U) 2^CB + 1; BMAX[key] = max(BMAX[key], bits of b)."""
    row, t, g, k0, L = _program_slots(LEN, G, K, BK, HAS_LEN)
    if k0 < L:
        idx, valid, b = _slot_bounds(XY, IDX, VNORM, row, t, g, k0, L, P, T, G, K, N, BK, MARGIN)
        u = _unit_exponent(TOP, BITS)
        inv_unit = ((127 - u) << 23).to(tl.float32, bitcast=True)  # 2^-u, u in [-126, 118]: exact
        # a b too small for b / U to be a normal fp32 still takes a unit: B stays a bound
        units = tl.where(b > 0, tl.maximum(tl.ceil(b * inv_unit), 1.0), 0.0).to(tl.int64)
        key = ((t // TPC) * N + tl.where(valid, idx, 0).to(tl.int64)) * G + g
        if CB > 0:
            tl.atomic_add(SUM + key, units * (1 << CB) + 1, mask=valid, sem="relaxed")
        else:
            tl.atomic_add(SUM + key, units, mask=valid & (units > 0), sem="relaxed")
            tl.atomic_add(COUNT + key, tl.full([BK], 1, tl.int32), mask=valid, sem="relaxed")
        tl.atomic_max(BMAX + key, b.to(tl.int32, bitcast=True), mask=valid & (b > 0), sem="relaxed")


@triton.jit
def _pow2_f64(e):
    """2^e as fp64 for integer e in [-1022, 1023], exactly."""
    return ((e.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _ceil_log2_f64(x):
    """ceil(log2 x) for a normal fp64 x > 0, exactly (from its bits)."""
    bits = x.to(tl.int64, bitcast=True)
    e = ((bits >> 52) & 0x7FF) - 1023
    return e + ((bits & 0xFFFFFFFFFFFFF) != 0).to(tl.int64)


@triton.jit
def _magic_kernel(TOP, SUM, COUNT, BMAX, OUT, KEYS, BITS: tl.constexpr, CB: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[key] = 1.5 2^23 Q (module header), 0 where B = 0, for keys [BLOCK p, BLOCK (p + 1))."""
    o_k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_k = o_k < KEYS
    raw = tl.load(SUM + o_k, mask=m_k, other=0)
    if CB > 0:
        count = raw & ((1 << CB) - 1)
        raw = raw >> CB
    else:
        count = tl.load(COUNT + o_k, mask=m_k, other=0)
    has = raw > 0
    # B = raw U exactly (raw < 2^53, U a power of two); d = 2^24 - c / 2 exactly
    bsum = tl.where(has, raw, 1).to(tl.float64) * _pow2_f64(_unit_exponent(TOP, BITS))
    d = 16777216.0 - 0.5 * count.to(tl.float64)
    d_ok = d > 0
    d = tl.where(d_ok, d, 1.0)
    # ceil(log2) of the rounded quotient can only fall one short (the quotient rounded onto a power of
    # two; raw < 2^53 rules it out for a correctly rounded division): one exact check, so Q never depends on it
    e_sum = _ceil_log2_f64(bsum / d)
    e_sum = tl.where(_pow2_f64(e_sum) * d < bsum, e_sum + 1, e_sum)
    e_sum = tl.where(d_ok, e_sum, 104)
    bmax = tl.load(BMAX + o_k, mask=m_k, other=0).to(tl.float32, bitcast=True).to(tl.float64)
    e_max = _ceil_log2_f64(tl.where(bmax > 0, bmax, 1.0)) - 22
    e_max = tl.where(bmax > 0, e_max, -126)
    e = tl.minimum(tl.maximum(tl.maximum(e_sum, e_max), -126), 104)
    magic = (((e + 150) << 23) | (1 << 22)).to(tl.int32).to(tl.float32, bitcast=True)  # 1.5 2^(e + 23)
    tl.store(OUT + o_k, tl.where(has, magic, 0.0), mask=m_k)


def _key_bits(slots: int) -> tuple:
    """(bits of U's resolution under the largest b, CB: the count's bits in
    the sums or 0) for keys of at most ``slots`` valid slots: dk_quanta's,
    with bits lowered where needed so that a key's sum (< slots 2^bits)
    stays below 2^53 and converts to fp64 exactly."""
    bits, cb = _unit_bits(slots)
    return min(bits, 53 - max(1, slots).bit_length()), cb


@triton.jit
def _copies_sum_kernel(BUF, OUT, R, C: tl.constexpr, D: tl.constexpr, BR: tl.constexpr):
    """OUT[r, :64 chunk] = the copies' rows summed in order, columns back in
    their natural order, in OUT's dtype (C a compile-time count, so that
    every copy's load is in flight at once)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    o = tl.program_id(1) * 64 + tl.arange(0, 64)
    m = (r < R)[:, None] & (o < D)[None, :]
    # column 8 h + 2 q + e of a 16-column group sits at 4 q + 2 h + e
    w = o % 16
    src = o - w + 4 * ((w // 2) % 4) + 2 * (w // 8) + w % 2
    rows = r.to(tl.int64)[:, None] * D
    acc = tl.zeros([BR, 64], tl.float32)
    p = BUF + rows + src[None, :]
    step = R.to(tl.int64) * D
    for _ in tl.static_range(C):
        acc += tl.load(p, mask=m, other=0.0)
        p += step
    tl.store(OUT + rows + o[None, :], acc.to(OUT.dtype.element_ty), mask=m)


def copies_sum(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dkv copies buf [C, N, G, D] fp32 (contiguous; each row's 16-column
    groups in the MMA fragment order of ``dsa.cute.dkv``) summed in copy
    order, as [N, G, D] in ``dtype`` with the columns in their natural order:
    one pass that reads every copy once."""
    C, N, G, D = buf.shape
    if buf.dtype != torch.float32 or not buf.is_contiguous() or D % 16:
        raise ValueError(f"copies_sum: buf must be a contiguous fp32 [C, N, G, D], D a multiple of 16, got "
                         f"{buf.dtype} {tuple(buf.shape)}")
    out = torch.empty((N, G, D), dtype=dtype, device=buf.device)
    if N * G and D:
        BR = 16
        _copies_sum_kernel[(triton.cdiv(N * G, BR), triton.cdiv(D, 64))](buf, out, N * G, C=C, D=D, BR=BR,
                                                                          num_warps=4)
    return out


@triton.jit
def _forward_bounds_kernel(HS, LV, Q, STATS, DELTA, LG, LEN, XY, T, G, HB, NB, K, abs_scale,
                           HG: tl.constexpr, BH: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                           HAS_LEN: tl.constexpr):
    """XY[hb, t, g, slots of the row's blocks] from the forward's head sums
    and levels (``forward_bounds``), for program (t, g, hb)."""
    pid = tl.program_id(0).to(tl.int64)
    t = pid // (G * HB)
    g = (pid // HB) % G
    hb = pid % HB
    o_r = tl.arange(0, BH)
    m_h = hb * BH + o_r < HG
    head = g * HG + hb * BH + o_r
    H = G * HG
    # the heads' weights (slot_bound_sm90's wa, wc), at most over the block's heads
    qmax = tl.zeros([BH], tl.float32)
    for d0 in tl.static_range(0, D, BD):
        o_d = d0 + tl.arange(0, BD)
        q = tl.load(Q + (t * H + head)[:, None] * D + o_d[None, :], mask=m_h[:, None] & (o_d[None, :] < D),
                    other=0.0)
        qmax = tl.maximum(qmax, tl.max(tl.abs(q.to(tl.float32)), 1))
    row = t * H + head
    dm = tl.load(STATS + row * 2, mask=m_h, other=0.0)
    norm = tl.load(STATS + row * 2 + 1, mask=m_h, other=0.0)
    dl = tl.abs(tl.load(DELTA + row, mask=m_h, other=0.0))
    wa = dm + abs_scale * qmax * dl
    wc = abs_scale * qmax * norm
    wa = tl.max(tl.where(wa < float("inf"), wa, 0.0), 0)  # NaN fails the test too
    wc = tl.max(tl.where(wc < float("inf"), wc, 0.0), 0)
    lg = tl.load(LG + row, mask=m_h, other=float("inf"))
    L = row_length(LEN, t, K, HAS_LEN)
    o_w = tl.arange(0, 4)
    o_c = tl.arange(0, 64)
    o_xy = tl.arange(0, 2)
    w_xy = tl.where(o_xy == 0, wa, wc)
    tile = (t * G + g) * HB + hb
    for b in range(0, tl.cdiv(L, 64)):
        lv = tl.load(LV + (t * NB + b) * H + head, mask=m_h, other=-float("inf"))
        corr = tl.max(tl.exp2(lv - lg), 0)
        hs = tl.load(HS + ((tile * NB + b) * 4 + o_w[:, None]) * 64 + o_c[None, :])
        a = tl.sum(hs, 0) * corr
        slot = b * 64 + o_c
        p_xy = XY + (((hb * T + t) * G + g) * K + slot[:, None]) * 2 + o_xy[None, :]
        tl.store(p_xy, a[:, None] * w_xy[None, :], mask=(slot < K)[:, None])


def forward_bounds(hs: torch.Tensor, levels: torch.Tensor, q: torch.Tensor, stats: torch.Tensor,
                   delta: torch.Tensor, lg2den: torch.Tensor, topk_length: Optional[torch.Tensor], K: int,
                   sm_scale: float) -> torch.Tensor:
    """xy [HB, T, G, K, 2] fp32, as ``dsa.cute.slot_bound_sm90`` writes it
    (X, Y a slot, its columns' contributions within X + Y ||v_n||), from the
    cute forward's bounds (``dsa.cute.sparse_attention.bound_views``) instead
    of a second S = Q K^T.

    hs [T, G, HB, NB, 4, 64] and levels [T, NB, H] fp32 (the forward's),
    q [T, H, D], stats [T, H, 2] (max|dO_h| and the ||dO_h|| bound), delta
    and lg2den [T, H] fp32 (the preprocess's).  Slot j of block b gets

        X = A_j c_b max_h wa_h,  Y = A_j c_b max_h wc_h,

    A_j the forward's sum over the block's heads of p_h / l_h, c_b =
    max_h 2^(level_h - lg2den_h) (at most 1; A_j c_b >= sum_h P_h), wa, wc
    the weights of ``slot_bound_sm90`` over the head block (a weight that is
    not finite taken as 0).  Slots of blocks past the row's last one holding
    a valid slot are not written."""
    T, G, HB, NB = hs.shape[:4]
    H, D = q.shape[1], q.shape[2]
    if tuple(hs.shape[4:]) != (4, 64) or tuple(levels.shape) != (T, NB, H) or NB != -(-K // 64):
        raise ValueError(f"forward_bounds: head sums {tuple(hs.shape)} and levels {tuple(levels.shape)} do not "
                         f"match T {T}, H {H}, K {K}")
    xy = torch.empty((HB, T, G, K, 2), dtype=torch.float32, device=q.device)
    if T and G and K:
        HG = H // G
        BH = min(64, triton.next_power_of_2(HG))
        length = topk_length if topk_length is not None else delta
        _forward_bounds_kernel[(T * G * HB,)](hs, levels, q, stats, delta, lg2den, length, xy, T, G, HB, NB, K,
                                              abs(float(sm_scale)), HG=HG, BH=BH, D=D, BD=64,
                                              HAS_LEN=topk_length is not None, num_warps=4)
    return xy


def _last_dim_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def value_norms(kv: torch.Tensor, d_v: int) -> torch.Tensor:
    """vnorm [N, G] fp32: ||kv[n, g, :d_v]||_2 of kv [N, G, D] (any float
    dtype), in fp32 (squares scaled by a power of two: no overflow or
    underflow), 0 where not finite."""
    N, G, D = kv.shape
    if not 0 <= d_v <= D:
        raise ValueError(f"value_norms: d_v {d_v} outside [0, {D}]")
    kv = _last_dim_dense(kv)
    out = torch.empty(N, G, device=kv.device, dtype=torch.float32)
    if N * G:
        BR = 16
        _value_norms_kernel[(triton.cdiv(N * G, BR),)](kv, out, N * G, G, kv.stride(0), kv.stride(1), DV=d_v, BR=BR,
                                                       BDV=min(128, triton.next_power_of_2(max(d_v, 1))),
                                                       num_warps=4)
    return out


def _check(xy, indices, topk_length, vnorm, N, copies, tokens_per_copy):
    if xy.dim() != 5 or xy.shape[-1] != 2 or xy.dtype != torch.float32 or not xy.is_contiguous():
        raise ValueError(f"dkv_quanta: xy must be a contiguous fp32 [P, T, G, K, 2], got {xy.dtype} "
                         f"{tuple(xy.shape)}")
    P, T, G, K, _ = xy.shape
    if tuple(indices.shape) != (T, G, K) or indices.dtype != torch.int32:
        raise ValueError(f"dkv_quanta: indices must be int32 [{T}, {G}, {K}], got {indices.dtype} "
                         f"{tuple(indices.shape)}")
    if topk_length is not None and (tuple(topk_length.shape) != (T,) or topk_length.dtype != torch.int32):
        raise ValueError(f"dkv_quanta: topk_length must be int32 [{T}]")
    if tuple(vnorm.shape) != (N, G) or vnorm.dtype != torch.float32:
        raise ValueError(f"dkv_quanta: vnorm must be fp32 [{N}, {G}], got {vnorm.dtype} {tuple(vnorm.shape)}")
    if copies < 1 or tokens_per_copy < 1 or copies * tokens_per_copy < T:
        raise ValueError(f"dkv_quanta: {copies} copies of {tokens_per_copy} tokens do not cover {T} tokens")


def dkv_quanta(xy: torch.Tensor, indices: torch.Tensor, topk_length: Optional[torch.Tensor], vnorm: torch.Tensor,
               N: int, copies: int, tokens_per_copy: int) -> torch.Tensor:
    """magic [copies, N, G] fp32 (module header): 1.5 2^23 Q of each key
    (copy, n, g), 0 for a key with no bound.

    xy [P, T, G, K, 2] fp32 contiguous, indices [T, G, K] int32, topk_length
    [T] int32 or None, vnorm [N, G] fp32 (:func:`value_norms`); token t adds
    to copy t // tokens_per_copy.  No host sync: the unit is computed on
    the device."""
    _check(xy, indices, topk_length, vnorm, N, copies, tokens_per_copy)
    P, T, G, K, _ = xy.shape
    dev = xy.device
    indices, vnorm = indices.contiguous(), vnorm.contiguous()
    length = topk_length if topk_length is not None else indices
    keys = copies * N * G
    bits, cb = _key_bits(min(T, tokens_per_copy) * K)
    top = torch.zeros(1, device=dev, dtype=torch.int32)
    sums = torch.zeros(keys, device=dev, dtype=torch.int64)
    count = sums if cb else torch.zeros(keys, device=dev, dtype=torch.int32)
    bmax = torch.zeros(keys, device=dev, dtype=torch.int32)
    if P and T and G and K and N:
        BK = min(1024, triton.next_power_of_2(K))
        grid = (T * G, triton.cdiv(K, BK))
        common = dict(BK=BK, HAS_LEN=topk_length is not None, MARGIN=MARGIN, num_warps=4)
        _top_kernel[grid](xy, indices, length, vnorm, top, P, T, G, K, N, **common)
        _key_sum_kernel[grid](xy, indices, length, vnorm, top, sums, count, bmax, P, T, G, K, N, tokens_per_copy,
                              BITS=bits, CB=cb, **common)
    out = torch.empty(copies, N, G, device=dev, dtype=torch.float32)
    if keys:
        _magic_kernel[(triton.cdiv(keys, 1024),)](top, sums, count, bmax, out, keys, BITS=bits, CB=cb, BLOCK=1024,
                                                  num_warps=4)
    return out
