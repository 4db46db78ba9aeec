"""Per-key quanta that make the indexer's dk atomics exact, so their order cannot matter.

The sparse indexer backward adds, for every valid slot (t, j) with key
n = indices[t, j], a row c[t, j, :] = scale * sum_h G[j, h] q[t, h, :] into
dk[n] (``G[j, h] = g_j * sm_scale * weights[t, h] * [s > 0]``, rounded to
the MMA's 16-bit type).  fp32 atomics add those rows in an order the
hardware picks, and fp32 addition is not associative.  It is, exactly,
when every addend is a multiple of one power of two Q_n and every partial
sum stays within 2^24 Q_n: the sums are then integers times Q_n, each
representable, so no addition rounds and any order gives the same bits.

This module gives each key such a quantum from a bound B_n on the sum of
|c| over the key's slots:

    |c[t, j, d]| <= b[t, j] = |g_j| * A_t,
    A_t = (1 + 2^-6) * |scale * sm_scale| * sum_h |weights[t, h]| * max_d |q[t, h, d]|

(the factor covers the 16-bit rounding of G and the fp32 accumulation),
B_n = sum of b over the key's valid slots, and Q_n the smallest power of
two with 2^24 Q_n >= B_n + c_n Q_n / 2 (c_n the key's valid slots): every
partial sum, each addend rounded to Q_n (by at most Q_n / 2), stays within
2^24 Q_n.  B_n itself must be the
same on every run: the b are added as integers (int64 atomics, exact) in
units of U = 2^(ceil(log2 max b) - bits), each rounded up (so B_n stays a
bound), with bits small enough that no key's sum can overflow; the key's
count c_n shares the same atomic in its low bits where that leaves U at
least ``MIN_UNIT_BITS`` (14 bits at T K = 2^23), else has its own.

|g_j| comes from the loss: the KL loss's |softmax_j S - target_j| <=
softmax_j S + target_j (from the recomputed logits and the forward's lse
and S), or the logits' |dlogits[t, j]|.  A row whose bound is not finite
(NaN or Inf in its inputs) adds nothing to B: its contributions are NaN or
Inf and propagate through the adds as they would without quanta.

The kernel that adds rounds each value x to rint(x / Q_n) * Q_n (``quanta``
holds 1 / Q_n and Q_n, both exact powers of two, Q_n in [2^-126, 2^127]; a
key with B_n = 0 gets 0 and 0: its contributions are all zero).  The
rounding costs at most Q_n / 2 an addend, about 2^-24 sqrt(c_n / 12) B_n
on a key's sum: relative to the sum itself that is the bound's looseness
(the head sum's and the slots' cancellation, roughly sqrt(c_n) for slots
of random sign) times 2^-24 sqrt(c_n / 12), so it grows with the slots a
key gathers: 1.6e-3 of dk from the atomics' result at the V3.2 step's
1024 a key, dk 2.0e-3 from float64 against their 1.8e-3
(bench/notes_indexer.md).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from dsa.triton.rules import load_slots, row_length

# margin of A_t over the exact bound: G's 16-bit rounding (2^-8) and fp32 sums
MARGIN = 1.0 + 2.0**-6


@triton.jit
def _g_bound(LG, GIN, STATS, t, K, o_n, valid, KL: tl.constexpr):
    """|g| bounds of slots o_n of row t (0 where invalid; nothing read there)."""
    if KL:
        lse = tl.load(STATS + t * 4 + 1)
        S = tl.load(STATS + t * 4 + 2)
        lg = tl.load(LG + t * K + o_n, mask=valid, other=float("-inf"))
        tg = tl.load(GIN + t * K + o_n, mask=valid, other=0.0)
        p = tl.where(valid & (lg > float("-inf")), tl.exp(lg - lse), 0.0)
        gb = p * tl.abs(S) + tl.abs(tg)
    else:
        gb = tl.abs(tl.load(GIN + t * K + o_n, mask=valid, other=0.0))
    return tl.where(valid, gb, 0.0)


@triton.jit
def _row_bound_kernel(Q, W, IDX, LEN, LG, GIN, STATS, SCALE, A, R, K, N, sm_scale,
                      H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
                      BK: tl.constexpr, HAS_LEN: tl.constexpr, KL: tl.constexpr, MARGIN: tl.constexpr):
    """A[t] = A_t (module header) and R[t] = A_t * max_j |g_j| of row t, 0 where not finite."""
    t = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BH)
    o_d = tl.arange(0, BD)
    m_h = o_h < H
    q = tl.load(Q + (t * H + o_h[:, None]) * D + o_d[None, :], mask=m_h[:, None] & (o_d[None, :] < D), other=0.0)
    w = tl.load(W + t * H + o_h, mask=m_h, other=0.0).to(tl.float32)
    a = tl.sum(tl.abs(w) * tl.max(tl.abs(q.to(tl.float32)), 1), 0)
    a = a * MARGIN * tl.abs(sm_scale * tl.load(SCALE).to(tl.float32))
    a = tl.where(tl.abs(a) < float("inf"), a, 0.0)  # NaN fails both
    L = row_length(LEN, t, K, HAS_LEN)
    gmax = tl.zeros([BK], tl.float32)
    for k0 in range(0, L, BK):
        o_n, m_n, idx, valid = load_slots(IDX, t, K, k0, L, N, BK)
        gb = _g_bound(LG, GIN, STATS, t, K, o_n, valid, KL)
        gmax = tl.maximum(gmax, tl.where(tl.abs(gb) < float("inf"), gb, 0.0))
    r = a * tl.max(gmax, 0)
    tl.store(A + t, a)
    tl.store(R + t, tl.where(tl.abs(r) < float("inf"), r, 0.0))


@triton.jit
def _key_sum_kernel(IDX, LEN, LG, GIN, STATS, A, UNIT, B, C, K, N, BK: tl.constexpr, HAS_LEN: tl.constexpr,
                    KL: tl.constexpr, CB: tl.constexpr):
    """Over the valid slots [k0, k0 + BK) of row t (integer atomics): B[key]
    += ceil(b / U) and C[key] += 1, or with CB > 0 both in B, as
    ceil(b / U) * 2^CB + 1 (the count in the low CB bits)."""
    t = tl.program_id(0).to(tl.int64)
    k0 = tl.program_id(1) * BK
    L = row_length(LEN, t, K, HAS_LEN)
    if k0 < L:
        o_n, m_n, idx, valid = load_slots(IDX, t, K, k0, L, N, BK)
        b = _g_bound(LG, GIN, STATS, t, K, o_n, valid, KL) * tl.load(A + t)
        units = tl.ceil(b / tl.load(UNIT))
        units = tl.where((units > 0) & (units < float("inf")), units, 0.0).to(tl.int64)
        key = tl.where(valid, idx, 0)
        if CB > 0:
            tl.atomic_add(B + key, units * (1 << CB) + 1, mask=valid, sem="relaxed")
        else:
            tl.atomic_add(B + key, units, mask=valid & (units > 0), sem="relaxed")
            tl.atomic_add(C + key, tl.full([BK], 1, tl.int32), mask=valid, sem="relaxed")


@triton.jit
def _quanta_kernel(B, C, UNIT, OUT, N, BLOCK: tl.constexpr, CB: tl.constexpr):
    """OUT[n] = (1 / Q_n, Q_n), Q_n = 2^ceil(log2(B_n / (2^24 - c_n / 2)))
    clamped to [2^-126, 2^127]; (0, 0) where B_n = 0."""
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = n < N
    raw = tl.load(B + n, mask=m, other=0)
    if CB > 0:
        count = (raw & ((1 << CB) - 1)).to(tl.float32)
        raw = raw >> CB
    else:
        count = tl.load(C + n, mask=m, other=0).to(tl.float32)
    bn = raw.to(tl.float32) * tl.load(UNIT)
    e = tl.minimum(tl.maximum(tl.ceil(tl.log2(tl.maximum(bn / (16777216.0 - 0.5 * count), 1e-45))), -126.0), 127.0)
    q = tl.where(bn > 0, tl.exp2(e), 0.0)
    inv = tl.where(bn > 0, tl.exp2(-e), 0.0)
    tl.store(OUT + 2 * n, inv, mask=m)
    tl.store(OUT + 2 * n + 1, q, mask=m)


# fewest bits of resolution U leaves each b for the count to share B's 63 (else a count array of its own)
MIN_UNIT_BITS = 10


def _unit_bits(slots: int) -> tuple:
    """(bits of U's resolution under the largest b, CB: the count's bits in
    B or 0) for ``slots`` = T * K: no key's sum can overflow int64."""
    cb = max(1, slots).bit_length()  # a key's count < 2^cb
    packed = 62 - 2 * cb
    return (packed, cb) if packed >= MIN_UNIT_BITS else (62 - cb, 0)


def dk_quanta(q: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, topk_length: Optional[torch.Tensor],
              N: int, sm_scale: float, gin: torch.Tensor, scale: torch.Tensor, logits: Optional[torch.Tensor] = None,
              stats: Optional[torch.Tensor] = None) -> torch.Tensor:
    """quanta [N, 2] fp32 (1 / Q_n, Q_n) for the dk rows of a sparse indexer
    backward (module header).  q [T, H, D], weights [T, H], indices [T, K]
    int32, topk_length [T] int32 or None; gin [T, K] fp32: dlogits, or with
    ``logits`` (the recomputed [T, K] fp32 logits) and ``stats`` ([T, 4],
    the forward's) the KL loss's target; scale: the 0-dim (or 1-element)
    fp32 factor of every row (the KL loss's dloss / R, else 1).  No host
    sync: the unit is computed on the device."""
    T, H, D = q.shape
    K = indices.shape[1]
    dev = q.device
    kl = logits is not None
    lg = logits if kl else gin
    st = stats if kl else gin
    length = topk_length if topk_length is not None else indices
    A = torch.empty(T, device=dev, dtype=torch.float32)
    R = torch.empty(T, device=dev, dtype=torch.float32)
    BK = min(1024, triton.next_power_of_2(max(K, 1)))
    if T:
        _row_bound_kernel[(T,)](q, weights, indices, length, lg, gin, st, scale, A, R, K, N, float(sm_scale),
                                H=H, D=D, BH=triton.next_power_of_2(H), BD=triton.next_power_of_2(D), BK=BK,
                                HAS_LEN=topk_length is not None, KL=kl, MARGIN=MARGIN, num_warps=8)
    bits, cb = _unit_bits(T * K)
    top = R.max() if T else torch.zeros((), device=dev)
    unit = torch.where(top > 0, torch.exp2(torch.ceil(torch.log2(top.clamp_min(1e-38))) - bits),
                       torch.ones((), device=dev)).float().reshape(1)
    B = torch.zeros(N, device=dev, dtype=torch.int64)
    C = B if cb else torch.zeros(N, device=dev, dtype=torch.int32)
    if T and K:
        _key_sum_kernel[(T, triton.cdiv(K, BK))](indices, length, lg, gin, st, A, unit, B, C, K, N, BK=BK,
                                                 HAS_LEN=topk_length is not None, KL=kl, CB=cb, num_warps=4)
    out = torch.empty(N, 2, device=dev, dtype=torch.float32)
    if N:
        _quanta_kernel[(triton.cdiv(N, 1024),)](B, C, unit, out, N, BLOCK=1024, CB=cb, num_warps=4)
    return out
