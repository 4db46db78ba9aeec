"""The per-key quanta of the deterministic attention dkv (dsa/triton/dkv_quanta.py).

Against float64 and exact rational computations written here, on CPU (the
Triton kernels under the interpreter, fp16 / fp32 inputs):

* the magic numbers equal, bit for bit, the module's rule (the smallest
  power of two Q meeting the sum and the max conditions, clamped) applied
  to the same int64 unit sums, on inputs whose fp32 bounds are exact
  (dyadic values with few bits), so the reference sees the kernel's b;
* invalid slots (past the row length, index -1, >= N, 2^31 - 1) count for
  nothing and are never read; a bound that is not finite counts as 0;
* contributions rounded with (x + magic) - magic sum to the same bits in
  any order, equal to their float64 sum;
* value_norms matches float64, NaN rows giving 0;
* every kernel compiles for sm_80 and sm_90 offline.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from fractions import Fraction

import pytest
import torch

from dsa.triton import dk_quanta as dk_quanta_module
from dsa.triton import dkv_quanta as dkv_quanta_module
from dsa.triton.dk_quanta import MARGIN
from dsa.triton.dkv_quanta import dkv_quanta, value_norms

F64 = torch.float64


# ----------------------------------------------------------------------------
# The reference


def _valid(idx, length, N):
    """[T, G, K] bool: slot j < clamp(length[t], 0, K) and 0 <= index < N."""
    T, G, K = idx.shape
    L = length.long().clamp(0, K) if length is not None else torch.full((T,), K)
    return (torch.arange(K)[None, None, :] < L[:, None, None]) & (idx >= 0) & (idx < N)


def _bounds(xy, idx, length, vnorm, N):
    """(b [T, G, K] float64, 0 where invalid or not a finite positive number,
    past fp32's range included (the kernel's b is fp32); valid)."""
    valid = _valid(idx, length, N)
    G = idx.shape[1]
    vn = vnorm.double()[torch.where(valid, idx.long(), 0), torch.arange(G)[None, :, None]]
    s = xy.double().sum(0)
    b = MARGIN * (s[..., 0] + s[..., 1] * vn)
    fits = torch.isfinite(b) & (b <= torch.finfo(torch.float32).max)
    return torch.where(valid & fits & (b > 0), b, 0.0), valid


def _keys(idx, N, tokens_per_copy):
    """[T, G, K] int64: ((t // tokens_per_copy) * N + n) * G + g (meaningful where valid)."""
    T, G, K = idx.shape
    t = torch.arange(T)[:, None, None]
    return ((t // tokens_per_copy) * N + idx.long()) * G + torch.arange(G)[None, :, None]


def _ceil_log2(x: Fraction) -> int:
    """The smallest integer e with 2^e >= x > 0."""
    e = x.numerator.bit_length() - x.denominator.bit_length()
    while Fraction(2) ** e < x:
        e += 1
    while Fraction(2) ** (e - 1) >= x:
        e -= 1
    return e


def _expected(b, valid, keys, nkeys, bits):
    """(magic [nkeys] float64, the condition that decided each key's Q: "sum",
    "max" or None where B = 0; the key sums S and counts c), by the rule in
    exact arithmetic from the same units: U = 2^max(e - bits, -126) with
    e = frexp(max b)'s exponent, ceil(b / U) units a slot (at least one
    where b > 0), B = U S, Q the smallest power of two with Q (2^24 - c / 2)
    >= B and Q 2^22 >= max b, clamped to [2^-126, 2^104]."""
    u = max(math.frexp(float(b.max()) if b.numel() else 0.0)[1] - bits, -126)
    units = torch.where(b > 0, torch.ceil(b / 2.0**u).clamp_min(1.0), 0.0).long()
    k = keys[valid]
    S = torch.zeros(nkeys, dtype=torch.int64).index_add_(0, k, units[valid])
    c = torch.zeros(nkeys, dtype=torch.int64).index_add_(0, k, torch.ones_like(k))
    bmax = torch.zeros(nkeys, dtype=F64).scatter_reduce_(0, k, b[valid], "amax")
    magic = torch.zeros(nkeys, dtype=F64)
    decided = [None] * nkeys
    for key in range(nkeys):
        if S[key] == 0:
            continue
        e_sum = _ceil_log2(Fraction(int(S[key])) * Fraction(2) ** u / (2**24 - Fraction(int(c[key]), 2)))
        e_max = _ceil_log2(Fraction(float(bmax[key])) / 2**22) if bmax[key] > 0 else -126
        e = min(max(e_sum, e_max, -126), 104)
        magic[key] = 1.5 * 2.0**23 * 2.0**e
        decided[key] = "sum" if e_sum > e_max else "max"
    return magic, decided, S, c


# ----------------------------------------------------------------------------
# dkv_quanta: the exact rule


def _edge_inputs(scale):
    """Dyadic inputs with every edge case; b = MARGIN (s0 + s1 vn) is exact in fp32.

    T = 7, G = 2, K = 6, N = 5, P = 2: row lengths 0, partial, > K and < 0;
    indices -1, N, N + 1, 2^31 - 1 and duplicates; a hot key (every slot of
    tokens 0..2 at head 1 names row 1, equal bounds: the sum decides); NaN in
    xy at invalid slots and at one valid one; a named key whose bounds are 0
    (row 4 at head 0, named by token 6 alone)."""
    g = torch.Generator().manual_seed(11)
    P, T, G, K, N = 2, 7, 2, 6, 5
    xy = torch.randint(0, 64, (P, T, G, K, 2), generator=g).float() / 16 * scale
    vnorm = torch.randint(1, 16, (N, G), generator=g).float() / 4
    idx = torch.randint(-1, N + 2, (T, G, K), generator=g, dtype=torch.int32)
    length = torch.tensor([6, 0, 3, 9, -2, 6, 4], dtype=torch.int32)
    idx[0:3, 1, :] = 1
    xy[:, 0:3, 1, :, :] = torch.tensor([0.5, 0.25]) * scale
    idx[0, 0, :4] = 2  # duplicates in a row
    idx[5, 0, 1] = 2**31 - 1
    idx[5, 1, 2] = N
    xy[0, 1, 0, 2, 0] = float("nan")  # row 1 has length 0
    xy[1, 5, 0, 1, 1] = float("nan")  # index 2^31 - 1
    xy[0, 6, 1, 5, 0] = float("nan")  # past row 6's length 4
    idx[0, 0, 5] = 3
    xy[1, 0, 0, 5, 1] = float("nan")  # valid: its bound counts as 0
    head0 = idx[:, 0]
    head0[head0 == 4] = 3
    idx[6, 0, :] = torch.tensor([4, 4, -1, 0, 6, 1], dtype=torch.int32)
    xy[:, 6, 0, :2, :] = 0.0  # key (row 4, head 0) only here, in any copy: two slots, B = 0
    return xy, idx, length, vnorm, N


@pytest.mark.parametrize("scale", [2.0**-120, 2.0**-90, 1.0, 2.0**100], ids=["tiny", "small", "unit", "huge"])
@pytest.mark.parametrize("units", ["packed", "apart", "coarse"])
@pytest.mark.parametrize("copies,tokens_per_copy", [(3, 3), (1, 7), (4, 2)])
def test_magic_is_the_rule(monkeypatch, scale, units, copies, tokens_per_copy):
    """magic equals the rule's, exactly; the count packed in the sums or apart
    (dk_quanta's MIN_UNIT_BITS), or units of 3 bits (U >= max b / 8) so
    that rounding b up to whole units changes Q; bounds near 2^-120 (U and
    Q at their 2^-126 floor), 2^-90 (U at the floor, Q above it) and 2^100."""
    if units == "apart":
        monkeypatch.setattr(dk_quanta_module, "MIN_UNIT_BITS", 63)
    if units == "coarse":
        monkeypatch.setattr(dkv_quanta_module, "_key_bits", lambda slots: (3, 0))
    xy, idx, length, vnorm, N = _edge_inputs(scale)
    T, G, K = idx.shape
    bits, cb = dkv_quanta_module._key_bits(min(T, tokens_per_copy) * K)
    assert (cb > 0) == (units == "packed")
    got = dkv_quanta(xy, idx, length, vnorm, N, copies, tokens_per_copy)
    assert got.shape == (copies, N, G) and got.dtype == torch.float32
    b, valid = _bounds(xy, idx, length, vnorm, N)
    magic, decided, S, c = _expected(b, valid, _keys(idx, N, tokens_per_copy), copies * N * G, bits)
    assert torch.equal(got.flatten().double(), magic)
    # the cases the inputs are built for do occur
    assert "sum" in decided and "max" in decided
    assert ((S == 0) & (c > 0)).any()  # named, all bounds 0: magic 0
    if copies > 1:
        assert ((c == 0) & (magic == 0)).any()  # named by no valid slot
    floor = 1.5 * 2.0**23 * 2.0**-126
    if scale == 2.0**-120:
        assert magic.max() == floor  # every Q at the floor
    if scale == 2.0**-90:
        assert magic.max() > floor


@pytest.mark.parametrize("apart", [False, True], ids=["count packed", "count apart"])
def test_count_decides_at_the_boundary(monkeypatch, apart):
    """Keys whose B sits at the sum condition's edge, where c decides Q (k = 0):
    head 1, 67 slots, B = 2^k (2^24 - 67 / 2) exactly: Q = 2^k (one slot more
    would need 2^(k + 1)); head 0, 35 slots, one of them NaN (b = 0, still an
    addend), B = 2^k (2^24 - 35 / 2 + 1 / 4): Q = 2^(k + 1) (34 would give 2^k).
    The bounds are exact in fp32 and whole units (b = 65 / 64 s, 65 dividing
    2^25 - 67 and 2^26 - 69)."""
    if apart:
        monkeypatch.setattr(dk_quanta_module, "MIN_UNIT_BITS", 63)
    K = 67
    xy = torch.zeros(1, 2, 2, K, 2)
    idx = torch.full((2, 2, K), -1, dtype=torch.int32)
    idx[0, 0, :35] = 0
    xy[0, 0, 0, :34, 0] = torch.tensor([30366.0] * 33 + [30365.0]) * 16  # sum 2^4 (2^26 - 69) / 65
    xy[0, 0, 0, 34, 0] = float("nan")
    idx[1, 1, :] = 0
    xy[0, 1, 1, :, 0] = torch.tensor([7705.0] * 53 + [7704.0] * 14) * 32  # sum 2^5 (2^25 - 67) / 65
    length = torch.tensor([35, K], dtype=torch.int32)
    vnorm = torch.ones(1, 2)
    got = dkv_quanta(xy, idx, length, vnorm, 1, 1, 2).flatten()
    assert got[0] == 1.5 * 2.0**24 and got[1] == 1.5 * 2.0**23
    b, valid = _bounds(xy, idx, length, vnorm, 1)
    magic, decided, S, c = _expected(b, valid, _keys(idx, 1, 2), 2, dkv_quanta_module._key_bits(2 * K)[0])
    assert torch.equal(got.double(), magic) and decided == ["sum", "sum"] and c.tolist() == [35, 67]


def test_invalid_slots_do_not_count():
    """Changing what invalid slots hold or name (xy, the index, rows past the
    length) leaves magic as it was; a valid slot whose bound is NaN or Inf
    counts as one whose bound is 0 (still an addend)."""
    xy, idx, length, vnorm, N = _edge_inputs(1.0)
    base = dkv_quanta(xy, idx, length, vnorm, N, 3, 3)
    valid = _valid(idx, length, N)
    g = torch.Generator().manual_seed(3)
    xy2 = torch.where(valid[None, ..., None], xy, torch.randn(xy.shape, generator=g) * 1e30)
    idx2 = torch.where(valid, idx, torch.randint(-3, 0, idx.shape, generator=g, dtype=torch.int32))
    assert torch.equal(dkv_quanta(xy2, idx2, length, vnorm, N, 3, 3), base)
    nan_slot = (1, 0, 0, 5, 1)
    assert valid[nan_slot[1:4]]
    zero = xy.clone()
    zero[nan_slot[:4]] = 0.0
    assert torch.equal(dkv_quanta(zero, idx, length, vnorm, N, 3, 3), base)
    zero[nan_slot[:4] + (0,)] = float("inf")
    assert torch.equal(dkv_quanta(zero, idx, length, vnorm, N, 3, 3), base)


def test_extremes_and_empty():
    """A bound past 2^126 gets Q = 2^104 (the clamp); a bound that overflows
    to Inf counts as 0 (magic 0); a subnormal one takes one whole unit; no
    tokens, slots or rows give zeros."""
    xy = torch.zeros(1, 1, 1, 3, 2)
    xy[0, 0, 0, :, 0] = torch.tensor([2.0**126, 2.0**127, 2.0**-140])
    xy[0, 0, 0, 1, 1] = 2.0**127
    idx = torch.tensor([[[0, 1, 2]]], dtype=torch.int32)
    vnorm = torch.full((3, 1), 4.0)
    got = dkv_quanta(xy, idx, None, vnorm, 3, 1, 1).flatten()
    b, valid = _bounds(xy, idx, None, vnorm, 3)
    assert b[0, 0, 1] == 0 and 0 < b[0, 0, 2] < 2.0**-126
    magic, _, S, _ = _expected(b, valid, _keys(idx, 3, 1), 3, dkv_quanta_module._key_bits(3)[0])
    assert got[0] == 1.5 * 2.0**127 and got[1] == 0 and S[2] == 1
    assert torch.equal(got.double(), magic)
    for T, K, N in ((0, 4, 3), (2, 0, 3), (2, 4, 0)):
        out = dkv_quanta(torch.ones(2, T, 2, K, 2), torch.zeros(T, 2, K, dtype=torch.int32), None,
                         torch.ones(N, 2), N, 2, 1 + T)
        assert out.shape == (2, N, 2) and not out.any()


def test_arguments_are_checked():
    xy = torch.ones(1, 4, 1, 3, 2)
    idx = torch.zeros(4, 1, 3, dtype=torch.int32)
    vnorm = torch.ones(2, 1)
    with pytest.raises(ValueError, match="do not cover"):
        dkv_quanta(xy, idx, None, vnorm, 2, 2, 1)
    with pytest.raises(ValueError, match="indices"):
        dkv_quanta(xy, idx.long(), None, vnorm, 2, 1, 4)
    with pytest.raises(ValueError, match="contiguous"):
        dkv_quanta(xy.transpose(1, 3).contiguous().transpose(1, 3), idx, None, vnorm, 2, 1, 4)


# ----------------------------------------------------------------------------
# dkv_quanta: rounded contributions add exactly in any order


@pytest.mark.parametrize("seed", [0, 1])
def test_rounded_contributions_add_exactly(seed):
    """Random fp32 inputs; contributions [D] a slot with |x| <= the bound
    without its margin, half the keys at the worst case (every addend +b):
    (x + magic) - magic is x rounded to the nearest multiple of Q, and a
    key's rounded addends sum to the same bits in two random fp32 orders,
    equal to their float64 sum.  Q is the smallest power of two over the
    float64 need, up to the kernel's fp32 bounds and units (1e-6)."""
    g = torch.Generator().manual_seed(seed)
    P, T, G, K, N, D, copies, tpc = 2, 9, 2, 8, 6, 4, 2, 5
    xy = torch.rand(P, T, G, K, 2, generator=g) * torch.rand(P, T, G, K, 1, generator=g) ** 4 * 3
    vnorm = torch.rand(N, G, generator=g) * 5
    idx = torch.randint(-1, N + 1, (T, G, K), generator=g, dtype=torch.int32)
    idx[:, 0, :3] = 0  # a hot key in each copy
    length = torch.randint(-1, K + 2, (T,), generator=g, dtype=torch.int32)
    magic = dkv_quanta(xy, idx, length, vnorm, N, copies, tpc).flatten()
    b, valid = _bounds(xy, idx, length, vnorm, N)
    keys = _keys(idx, N, tpc)
    Q = magic.double() / (1.5 * 2.0**23)
    checked = 0
    for key in range(copies * N * G):
        bk = b[valid & (keys == key)] / MARGIN  # [c]
        if not (bk > 0).any():
            assert magic[key] == 0, key
            continue
        c = bk.numel()
        need = max(float(bk.sum()) * MARGIN / (2**24 - c / 2), float(bk.max()) * MARGIN / 2**22)
        assert need * (1 - 1e-6) <= Q[key] <= 2 * need * (1 + 1e-6), (key, float(Q[key]), need)
        u = torch.rand(c, D, generator=g, dtype=F64) * 2 - 1 if key % 2 else torch.ones(c, D, dtype=F64)
        x = (u * bk[:, None]).float()
        m = magic[key]
        xr = (x + m) - m
        assert torch.equal(xr.double(), torch.round(x.double() / Q[key]) * Q[key]), key
        exact = xr.double().sum(0)
        for _ in range(2):
            acc = torch.zeros(D)
            for r in torch.randperm(c, generator=g):
                acc = acc + xr[r]
            assert torch.equal(acc.double(), exact), key
        checked += 1
    assert checked >= 8


# ----------------------------------------------------------------------------
# value_norms


SCALED = [(torch.float16, 1.0), (torch.float32, 1.0), (torch.float32, 2.0**-90), (torch.float32, 2.0**70)]
SCALED_IDS = ["fp16", "fp32", "fp32 2^-90", "fp32 2^70"]


def _finite_or_zero(x):
    return torch.where(torch.isfinite(x), x, 0.0)


@pytest.mark.parametrize("dtype,scale", SCALED, ids=SCALED_IDS)
def test_value_norms(dtype, scale):
    """||kv[n, g, :d_v]|| against float64 on a strided kv; NaN or Inf in the
    first d_v columns gives 0, past them it is not read."""
    g = torch.Generator().manual_seed(6)
    N, G, D, d_v = 11, 2, 150, 136
    kv = (torch.randn(G, N, D, generator=g) * scale).to(dtype).transpose(0, 1)  # [N, G, D], not contiguous
    kv[4, 1, 3] = float("nan")
    kv[6, 0, 0] = float("inf")
    kv[5, 0, 140] = float("nan")
    kv[2, 1, 131] = 300 * scale  # the largest in the last chunk: the sum so far is rescaled
    got = value_norms(kv, d_v)
    assert got.shape == (N, G) and got.dtype == torch.float32
    exp = _finite_or_zero(kv[..., :d_v].double().norm(dim=-1))
    torch.testing.assert_close(got.double(), exp, rtol=1e-6, atol=0)
    assert got[4, 1] == 0 and got[6, 0] == 0 and got[5, 0] > 0


# ----------------------------------------------------------------------------
# Offline compiles


_AOT = r"""
import json, sys, torch
from dsa.triton import dkv_quanta as m, fit
from dsa.triton.dk_quanta import MARGIN
f32, i32, i64, bf16 = (fit.ptr(d) for d in (torch.float32, torch.int32, torch.int64, torch.bfloat16))
slots = dict(XY=f32, IDX=i32, LEN=i32, VNORM=f32, TOP=i32)
specs = [
    fit.KernelSpec(m._value_norms_kernel, dict(KV=bf16, OUT=f32), dict(DV=512, BR=16, BDV=128), 4, 3),
    fit.KernelSpec(m._top_kernel, slots, dict(BK=1024, HAS_LEN=True, MARGIN=MARGIN), 4, 3),
    fit.KernelSpec(m._key_sum_kernel, dict(slots, SUM=i64, COUNT=i64, BMAX=i32),
                   dict(BK=1024, HAS_LEN=True, MARGIN=MARGIN, BITS=20, CB=21), 4, 3),
    fit.KernelSpec(m._key_sum_kernel, dict(slots, SUM=i64, COUNT=i32, BMAX=i32),
                   dict(BK=1024, HAS_LEN=False, MARGIN=MARGIN, BITS=26, CB=0), 4, 3),
    fit.KernelSpec(m._magic_kernel, dict(TOP=i32, SUM=i64, COUNT=i64, BMAX=i32, OUT=f32),
                   dict(BITS=20, CB=21, BLOCK=1024), 4, 3),
    fit.KernelSpec(m._copies_sum_kernel, dict(BUF=f32, OUT=bf16), dict(C=8, D=576, BR=16), 4, 3),
    fit.KernelSpec(m._forward_bounds_kernel, dict(HS=f32, LV=f32, Q=bf16, STATS=f32, DELTA=f32, LG=f32, LEN=i32,
                                                  XY=f32, abs_scale="fp32"),
                   dict(HG=128, BH=64, D=576, BD=64, HAS_LEN=True), 4, 3),
]
out = {}
for i, spec in enumerate(specs):
    c = fit.compile_for(spec, fit.Target.of(int(sys.argv[1])))
    out[f"{i}/{spec.fn.__name__}"] = dict(cubin=len(c.asm["cubin"]), shared=c.metadata.shared,
                                          atomics=c.asm["ptx"].count("atom.global"))
print(json.dumps(out))
"""


def _forward_bounds_expected(hs, levels, q, stats, delta, lg2den, length, K, sm_scale):
    """float64 xy [HB, T, G, K, 2] of ``forward_bounds`` (its docstring's
    rule), NaN where the kernel writes nothing (blocks past a row's last)."""
    T, G, HB, NB = hs.shape[:4]
    H, D = q.shape[1:]
    HG = H // G
    s = abs(sm_scale)
    qm = q.double().abs().amax(-1)
    wa = stats[..., 0].double() + s * qm * delta.double().abs()
    wc = s * qm * stats[..., 1].double()
    wa = torch.where(wa < math.inf, wa, 0.0)   # NaN fails it too
    wc = torch.where(wc < math.inf, wc, 0.0)
    L = length.long().clamp(0, K) if length is not None else torch.full((T,), K)
    xy = torch.full((HB, T, G, K, 2), math.nan, dtype=F64)
    corr = torch.exp2(levels.double() - lg2den.double()[:, None, :])          # [T, NB, H]
    sums = hs.double().sum(4).reshape(T, G, HB, NB * 64)[..., :K]
    for g in range(G):
        for hb in range(HB):
            h = slice(g * HG + hb * 64, g * HG + min(HG, hb * 64 + 64))
            c = corr[..., h].amax(-1).repeat_interleave(64, 1)[:, :K]        # [T, K]
            a = sums[:, g, hb] * c
            xy[hb, :, g, :, 0] = a * wa[:, h].amax(-1)[:, None]
            xy[hb, :, g, :, 1] = a * wc[:, h].amax(-1)[:, None]
    done = torch.arange(K)[None, :] < ((L + 63) // 64 * 64)[:, None]
    return torch.where(done[None, :, None, :, None], xy, math.nan), done


@pytest.mark.parametrize("H,G,K,dtype", [(128, 1, 150, torch.float32), (16, 2, 64, torch.float16),
                                          (64, 1, 129, torch.float16)], ids=["h128", "gqa-2x8", "h64-k129"])
def test_forward_bounds_is_its_rule(H, G, K, dtype):
    """``forward_bounds`` against float64 of its rule, on the rows' computed
    blocks only (topk_length 0, negative, past K, mid-block), with NaN and Inf dO
    stats and an infinite lg2den (an empty row) among the heads, levels of
    -inf (no valid slot yet), and NaN wherever the forward wrote nothing (it
    must not be read)."""
    from dsa.triton.dkv_quanta import forward_bounds

    gen = torch.Generator().manual_seed(7)
    T, D = 6, 40
    HB, NB = -(-(H // G) // 64), -(-K // 64)
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    stats = torch.rand(T, H, 2, generator=gen) * 3
    stats[1, 3, 0] = math.nan
    stats[4, 5, 1] = math.inf
    delta = torch.randn(T, H, generator=gen)
    lg2den = torch.randn(T, H, generator=gen) * 4 + 8
    lg2den[2, :] = math.inf
    length = torch.tensor([0, -4, K + 9, 1, 65, K - 1], dtype=torch.int32)
    L = length.long().clamp(0, K)
    hs = torch.rand(T, G, HB, NB, 4, 64, generator=gen) * 16
    levels = lg2den.clamp(max=12.0)[:, None, :] - torch.rand(T, NB, H, generator=gen) * 6  # <= lg2den
    levels[3, 0, :5] = -math.inf
    # what the forward never writes: blocks past the row's last computed one
    blocks = torch.arange(NB)[None, :] >= ((L + 63) // 64)[:, None]                  # [T, NB]
    hs[blocks[:, None, None, :, None, None].expand_as(hs)] = math.nan
    levels[blocks[..., None].expand_as(levels)] = math.nan
    xy = forward_bounds(hs, levels, q, stats, delta, lg2den, length, K, 1.0 / math.sqrt(D))
    exp, done = _forward_bounds_expected(hs, levels, q, stats, delta, lg2den, length, K, 1.0 / math.sqrt(D))
    assert xy.shape == (HB, T, G, K, 2)
    sel = done[None, :, None, :, None].expand_as(xy)
    assert not xy[sel].isnan().any()
    torch.testing.assert_close(xy.double()[sel], exp[sel], rtol=2e-6, atol=0)
    assert (xy[:, 2][done[2][None, None, :, None].expand_as(xy[:, 2])] == 0).all()  # an empty row: no bound
    with pytest.raises(ValueError, match="forward_bounds"):
        forward_bounds(hs, levels[:, :-1] if NB > 1 else levels[:-1], q, stats, delta, lg2den, length, K, 1.0)


@pytest.mark.parametrize("cap", [80, 90])
def test_kernels_compile_offline(cap):
    """Every kernel of the module compiles to a binary for sm_80 and sm_90 at
    the V3.2 shapes (H 128, D 576, d_v 512, K 1024 a block), outside the
    interpreter and without a GPU; the key sums use the atomics, both ways
    of keeping the count."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", _AOT, str(cap)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got) == 7, got
    for name, r in got.items():
        assert r["cubin"] > 0 and r["shared"] <= 4096, (name, r)
        if "_key_sum_" in name:
            assert r["atomics"] > 0, (name, r)


@pytest.mark.parametrize("C,N,G,D", [(3, 5, 2, 576), (1, 17, 1, 512), (4, 1, 1, 64)])
def test_copies_sum_in_order_and_natural_columns(C, N, G, D):
    """copies_sum: the copies added in copy order in fp32 (bitwise the
    sequential sum), each 16-column group's fragment order undone (position
    4 q + 2 h + e holds column 8 h + 2 q + e), cast to the requested dtype;
    rows past a program's 16 and columns past D untouched."""
    from dsa.cute.sparse_attention_bwd import natural_columns
    from dsa.triton.dkv_quanta import copies_sum

    gen = torch.Generator().manual_seed(C * 100 + N)
    buf = torch.randn(C, N, G, D, generator=gen) * torch.logspace(-3, 3, C)[:, None, None, None]
    seq = buf[0].clone()
    for k in range(1, C):
        seq += buf[k]
    frag = seq.clone()
    exp = torch.empty_like(seq)
    for m in range(D // 16):
        for q in range(4):
            for h in range(2):
                for e in range(2):
                    exp[..., 16 * m + 8 * h + 2 * q + e] = frag[..., 16 * m + 4 * q + 2 * h + e]
    assert torch.equal(natural_columns(frag, torch.float32), exp)
    assert torch.equal(copies_sum(buf, torch.float32), exp)
    assert torch.equal(copies_sum(buf, torch.float16), exp.half())
    with pytest.raises(ValueError, match="contiguous fp32"):
        copies_sum(buf.double(), torch.float32)
