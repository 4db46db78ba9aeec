"""The per-key quanta of the deterministic indexer dk (dsa/triton/dk_quanta.py).

Against a float64 computation written here, on CPU (the Triton kernels under
the interpreter): every key's quantum is a power of two no finer than its
bound needs and at most about twice as coarse as needed; rows whose inputs
are not finite, invalid slots and keys no valid slot names are left out; and
the contributions, once rounded to their key's quantum, sum to the same
bits in any order, equal to their float64 sum (no addition rounds).
"""

from __future__ import annotations

import math

import pytest
import torch

from dsa.triton import dk_quanta as dk_quanta_module
from dsa.triton.dk_quanta import MARGIN, dk_quanta

H, D = 8, 32


def _inputs(seed, T=9, N=13, K=24, w_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    k = torch.randn(N, D, generator=g).to(torch.bfloat16)
    w = torch.randn(T, H, generator=g) * w_scale
    idx = torch.randint(-2, N + 2, (T, K), generator=g, dtype=torch.int32)
    idx[1, 1::2] = 3  # duplicates
    idx[:, 0] = N - 1
    length = torch.randint(-1, K + 3, (T,), generator=g, dtype=torch.int32)
    length[0] = K
    return q, k, w, idx, length


def _valid(idx, length, N):
    K = idx.shape[1]
    L = length.long().clamp(0, K) if length is not None else torch.full((idx.shape[0],), K)
    return (torch.arange(K)[None, :] < L[:, None]) & (idx >= 0) & (idx < N)


def _logits(q, k, w, idx, valid, sm):
    rows = k.double()[idx.long().clamp(0, k.shape[0] - 1)]
    dots = torch.einsum("thd,tkd->tkh", q.double(), rows)
    lg = sm * (torch.relu(dots) * w.double()[:, None, :]).sum(-1)
    return torch.where(valid, lg, -math.inf), dots


def _contributions(q, w, g, dots, valid, sm, scale):
    """c [T, K, D] fp32 as the kernel forms it: G rounded to bf16, fp32 sums."""
    G = (g[..., None] * sm * w.double()[:, None, :] * (dots > 0)).to(torch.bfloat16).float()
    c = torch.einsum("tkh,thd->tkd", G, q.float()) * scale
    return torch.where(valid[..., None], c, 0.0)


def _exact_bound(q, w, g, valid, sm, scale, idx, N):
    """B_n in float64: sum over the key's valid slots of |g| A_t."""
    A = MARGIN * abs(sm * scale) * (w.double().abs() * q.double().abs().amax(-1)).sum(-1)
    b = torch.where(valid, g.abs() * A[:, None], 0.0)
    B = torch.zeros(N, dtype=torch.float64)
    B.index_add_(0, torch.where(valid, idx.long(), 0).flatten(), b.flatten())
    return B


def _check(quanta, B, c, idx, valid, N):
    inv, Q = quanta[:, 0].double(), quanta[:, 1].double()
    for n in range(N):
        if B[n] == 0:
            assert inv[n] == 0 and Q[n] == 0, n
            continue
        e = math.log2(Q[n])
        assert e == round(e) and inv[n] * Q[n] == 1.0, (n, Q[n])
        rows = c[valid & (idx == n)]  # [count, D] fp32
        need = B[n] / (2**24 - rows.shape[0] / 2)  # every partial sum, each addend rounded, within 2^24 Q
        assert need * (1 - 1e-6) <= Q[n] <= 2 * need * (1 + 1e-6), (n, Q[n], need)
        qz = torch.round(rows * quanta[n, 0]) * quanta[n, 1]
        exact = qz.double().sum(0)
        for order in (torch.arange(rows.shape[0]), torch.arange(rows.shape[0]).flip(0),
                      torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(n))):
            acc = torch.zeros(rows.shape[1], dtype=torch.float32)
            for r in order:
                acc = acc + qz[r]
            assert torch.equal(acc.double(), exact), n


@pytest.mark.parametrize("w_scale", [1e-20, 1.0, 1e20])
@pytest.mark.parametrize("packed", [True, False], ids=["count packed", "count apart"])
def test_logits_quanta_make_any_order_exact(monkeypatch, w_scale, packed):
    if not packed:  # the count's own array, as for T * K past 2^26
        monkeypatch.setattr(dk_quanta_module, "MIN_UNIT_BITS", 63)
    q, k, w, idx, length = _inputs(1, w_scale=w_scale)
    N, sm = k.shape[0], 0.6
    valid = _valid(idx, length, N)
    _, dots = _logits(q, k, w, idx, valid, sm)
    dl = torch.randn(idx.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    quanta = dk_quanta(q, w, idx, length, N, sm, torch.where(valid, dl, float("nan")).float(), torch.ones(1))
    g = torch.where(valid, dl, 0.0)
    _check(quanta, _exact_bound(q, w, g, valid, sm, 1.0, idx, N), _contributions(q, w, g, dots, valid, sm, 1.0),
           idx, valid, N)


def test_kl_quanta_make_any_order_exact():
    q, k, w, idx, length = _inputs(3)
    N, sm, scale = k.shape[0], 0.4, 1.0 / 7
    valid = _valid(idx, length, N)
    lg, dots = _logits(q, k, w, idx, valid, sm)
    tgt = torch.rand(idx.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    tgt[tgt < 0.2] = 0.0
    lse = torch.logsumexp(lg, -1)
    S = torch.where(valid, tgt, 0.0).sum(-1)
    stats = torch.stack([torch.zeros_like(lse), lse, S, valid.any(-1).double()], -1).float()
    p = torch.where(valid, torch.exp(lg - lse[:, None]), 0.0)
    g = torch.where(valid, p * S[:, None] - tgt, 0.0)
    quanta = dk_quanta(q, w, idx, length, N, sm, tgt.float(), torch.tensor(scale), lg.float(), stats)
    gb = torch.where(valid, p * S[:, None] + tgt, 0.0)  # the bound's |g|: softmax S + target
    _check(quanta, _exact_bound(q, w, gb, valid, sm, scale, idx, N),
           _contributions(q, w, g, dots, valid, sm, scale), idx, valid, N)


def test_rows_that_are_not_finite_add_nothing():
    """A row with NaN in q (its contributions are NaN and propagate) or Inf
    in its weights leaves the other rows' quanta as they were without it."""
    q, k, w, idx, length = _inputs(5)
    N, sm = k.shape[0], 1.0
    dl = torch.randn(idx.shape, generator=torch.Generator().manual_seed(6))
    base = dk_quanta(q, w, idx, length, N, sm, dl, torch.ones(1))
    q2, w2 = q.clone(), w.clone()
    q2[2, 1, 3] = float("nan")
    w2[4, 0] = float("inf")
    keep = torch.ones(idx.shape[0], dtype=torch.bool)
    keep[[2, 4]] = False
    got = dk_quanta(q2, w2, idx, length, N, sm, dl, torch.ones(1))
    exp = dk_quanta(q, w, torch.where(keep[:, None], idx, -1), length, N, sm, dl, torch.ones(1))
    assert torch.isfinite(got).all() and torch.equal(got, exp)
    assert not torch.equal(got, base)  # those rows did count before


def test_no_slot_no_row():
    """Keys no valid slot names get (0, 0); no rows, or no slots, give all zeros."""
    q, k, w, idx, length = _inputs(7)
    N = k.shape[0] + 5
    quanta = dk_quanta(q, w, idx, length, N, 1.0, torch.randn(idx.shape), torch.ones(1))
    named = torch.zeros(N, dtype=torch.bool)
    valid = _valid(idx, length, N)
    named[idx.long()[valid].unique()] = True
    assert torch.equal(quanta[~named], torch.zeros(int((~named).sum()), 2))
    assert (quanta[named, 1] > 0).all()
    for T, K in ((0, 24), (9, 0)):
        out = dk_quanta(q[:T], w[:T], idx[:T, :K], None, N, 1.0, torch.randn(T, K), torch.ones(1))
        assert torch.equal(out, torch.zeros(N, 2))
