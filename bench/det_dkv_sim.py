"""Exact fp32 atomics for the attention backward's dkv, simulated on the CPU.

    python bench/det_dkv_sim.py [--tokens 1024] [--slots 256] [--rows 128] [--heads 64]

The question: can the cute backward's deterministic dkv use the indexer's
exact atomics (``dsa.triton.dk_quanta``: every value rounded to a
power-of-two quantum Q of its kv row before the fp32 add, Q large enough
that no partial sum rounds) instead of per-slot rows, and how accurate is
the result?  Q comes from a bound B on the sum of |contributions| a row
receives, known before the first add: ``2^24 Q >= B + c Q / 2`` for c adds.

Per (token, slot) the contribution to its kv row is
``scale * sum_h dS_h q_h`` (dK) plus ``sum_h P_h dO_h`` (dV, the first d_v
columns), ``dS_h = P_h (dP_h - Delta_h)``, ``dP_h = dO_h . v``.  Bounds:

* ``exact``: ``sum_h |dS_h| scale max|q_h| + P_h max|dO_h|``: needs P and
  dP, a pre-pass of S and dP (two fifths of the backward's MMAs);
* ``cs``: ``sum_h P_h (|dO_h|_2 |v|_2 + |Delta_h|) scale max|q_h| + P_h
  max|dO_h|``: needs P only (an S-only pre-pass, a fifth of the MMAs);
  Cauchy-Schwarz stands in for dP;
* ``fwd``: the same with dO's factors replaced by the token's maxima over
  heads, so that P enters only as ``sum_h P_h max|q_h|`` and ``sum_h P_h``,
  two numbers a (token, slot) the forward could keep.

The rounding's error grows with c (adds a row) times the bound's looseness,
so the adds may go to ``copies`` dkv buffers, token range t * copies // T
to copy k, each with its own quanta, summed in a fixed order at the end:
the error falls as 1 / copies.  One 64-head block of V3.2's shapes by
default (D 576, d_v 512), c = T K / N adds a row (2048 by default, as V3.2's
two head blocks give).  Prints, per bound and copy count, dkv's relative L2
error against the float64 sum and the bound's looseness (the median of
bound / max |contribution| over (token, slot)); ``--hot`` adds rows that
every token reads, whose error is printed apart.  No GPU: float64 torch, the
quantisation in fp32 as the kernel does it.
"""

from __future__ import annotations

import argparse

import torch

F64 = torch.float64


def problem(T: int, K: int, N: int, H: int, D: int, d_v: int, seed: int, hot: int = 0):
    """q, kv, dO and indices (each token's K distinct rows; with ``hot``, rows
    0 .. hot - 1 in every token's first slots, the rows every token reads),
    float64."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g, dtype=F64)
    kv = torch.randn(N, D, generator=g, dtype=F64)
    dO = torch.randn(T, H, d_v, generator=g, dtype=F64)
    idx = hot + torch.rand(T, N - hot, generator=g).argsort(dim=1)[:, :K - hot]
    idx = torch.cat([torch.arange(hot).expand(T, hot), idx], dim=1)
    return q, kv, dO, idx


def contributions(q, kv, dO, idx, d_v: int):
    """(contribution [T, K, D], and the bounds [T, K]: exact, Cauchy-Schwarz, forward's)."""
    T, H, D = q.shape
    scale = D ** -0.5
    k = kv[idx]                                       # [T, K, D]
    v = k[..., :d_v]
    S = scale * torch.einsum("thd,tkd->thk", q, k)
    P = torch.softmax(S, dim=-1)
    O = torch.einsum("thk,tkv->thv", P, v)
    delta = (dO * O).sum(-1)                          # [T, H]
    dP = torch.einsum("thv,tkv->thk", dO, v)
    dS = P * (dP - delta[..., None])
    c = scale * torch.einsum("thk,thd->tkd", dS, q)
    c[..., :d_v] += torch.einsum("thk,thv->tkv", P, dO)
    a = q.abs().amax(-1)                              # [T, H]
    e = dO.abs().amax(-1)
    exact = torch.einsum("thk,th->tk", dS.abs(), scale * a) + torch.einsum("thk,th->tk", P, e)
    vn = v.norm(dim=-1)                               # [T, K]
    dpb = dO.norm(dim=-1)[..., None] * vn[:, None, :] + delta.abs()[..., None]  # >= |dP - Delta|
    cs = torch.einsum("thk,th->tk", P * dpb, scale * a) + torch.einsum("thk,th->tk", P, e)
    # what the forward could keep a (token, slot): sum_h P a_h and sum_h P; dO's factors as the token's maxima
    pa, p0 = torch.einsum("thk,th->tk", P, a), P.sum(1)
    fwd = scale * pa * (dO.norm(dim=-1).amax(-1, keepdim=True) * vn + delta.abs().amax(-1, keepdim=True)) \
        + p0 * e.amax(-1, keepdim=True)
    return c, exact, cs, fwd


def quantized_sum(c, bound, idx, N: int, copies: int):
    """dkv [N, D] summed from the contributions rounded to each (row, copy)'s
    quantum, as the kernel's exact atomics would sum them."""
    T, K, D = c.shape
    copy = (torch.arange(T) * copies // T)[:, None].expand(T, K)
    key = (idx * copies + copy).reshape(-1)           # (row, copy)
    B = torch.zeros(N * copies, dtype=F64).index_add_(0, key, bound.reshape(-1) * (1 + 2.0 ** -6))
    cnt = torch.zeros(N * copies, dtype=F64).index_add_(0, key, torch.ones(T * K, dtype=F64))
    Q = torch.where(B > 0, torch.exp2(torch.ceil(torch.log2(B / (2.0 ** 24 - cnt / 2)))), torch.ones_like(B))
    Qs = Q[key][:, None]
    c32 = c.reshape(-1, D).float().double()
    rounded = torch.round(c32 / Qs) * Qs
    # each (row, copy)'s sum is exact in fp32: check it, then add the copies in order
    part = torch.zeros(N * copies, D, dtype=F64).index_add_(0, key, rounded)
    assert (part.abs().amax(1) <= 2.0 ** 24 * Q).all(), "a partial sum left the exact range"
    return part.view(N, copies, D).sum(1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--dim", type=int, default=576)
    p.add_argument("--dim-v", type=int, default=512)
    p.add_argument("--copies", default="1,4,16,64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hot", type=int, default=0, help="rows every token reads (their error is printed apart)")
    args = p.parse_args(argv)
    T, K, N = args.tokens, args.slots, args.rows
    q, kv, dO, idx = problem(T, K, N, args.heads, args.dim, args.dim_v, args.seed, args.hot)
    c, exact, cs, fwd = contributions(q, kv, dO, idx, args.dim_v)
    ref = torch.zeros(N, args.dim, dtype=F64).index_add_(0, idx.reshape(-1), c.reshape(-1, args.dim))
    cmax = c.abs().amax(-1)
    print(f"T {T} K {K} N {N} H {args.heads} D {args.dim} d_v {args.dim_v}: {T * K // N} adds a row")
    c32 = c.float().double().view(-1, args.dim)
    plain = torch.zeros(N, args.dim, dtype=F64).index_add_(0, idx.reshape(-1), c32)
    print(f"fp32 contributions summed in float64: rel L2 {((plain - ref).norm() / ref.norm()).item():.2e}")
    for name, bound in (("exact", exact), ("cs", cs), ("fwd", fwd)):
        loose = (bound / cmax).median().item()
        errs = []
        for copies in [int(x) for x in args.copies.split(",")]:
            got = quantized_sum(c, bound, idx, N, copies)
            err = f"{copies} copies {((got - ref).norm() / ref.norm()).item():.2e}"
            if args.hot:
                h = slice(0, args.hot)
                err += f" (hot rows {((got[h] - ref[h]).norm() / ref[h].norm()).item():.2e})"
            errs.append(err)
        print(f"bound {name:5s} looseness {loose:8.1f}: " + ", ".join(errs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
