"""An independent float64 brute force of docs/semantics.md, written as plain loops.

Nothing here imports or calls ``dsa``: every formula is re-derived from the
contract, one query row / head / slot at a time, in float64 numpy. It is slow
on purpose (obviously right beats fast); use small sizes only.

Also holds the comparison helpers the tests use (they do not call dsa either).
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import numpy as np
import torch

INF = float("inf")


def _np(t: Optional[torch.Tensor]) -> Optional[np.ndarray]:
    if t is None:
        return None
    t = t.detach().cpu()
    if t.is_floating_point():
        return t.to(torch.float64).numpy()
    return t.to(torch.int64).numpy()


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a, order="C"))  # keeps 0-d arrays 0-d


# --------------------------------------------------------------------------
# Sparse attention
# --------------------------------------------------------------------------


def _sparse_attention_packed(q, kv, idx, sm_scale, d_v, sink, topk_length, dout):
    """q [T,H,D], kv [N,G,D], idx [T,G,K] (global rows), topk_length [T] or None,
    sink [H] or None, dout [T,H,d_v] or None; all numpy (float64 / int64)."""
    T, H, D = q.shape
    N, G, _ = kv.shape
    K = idx.shape[2]
    heads_per_group = H // G
    out = np.zeros((T, H, d_v))
    lse = np.full((T, H), INF)
    dq = np.zeros_like(q)
    dkv = np.zeros_like(kv)
    dsink = np.zeros(H)
    for t in range(T):
        length = K if topk_length is None else min(max(int(topk_length[t]), 0), K)
        for h in range(H):
            g = h // heads_per_group
            rows = [int(idx[t, g, j]) for j in range(length) if 0 <= int(idx[t, g, j]) < N]
            if not rows:
                continue  # out 0, lse +inf, no gradient contribution
            s = np.array([sm_scale * np.dot(q[t, h], kv[r, g]) for r in rows])
            m = np.max(s)  # NaN propagates
            lse[t, h] = m + math.log(np.sum(np.exp(s - m))) if not np.isnan(m) else np.nan
            sk = None if sink is None else float(sink[h])
            if sk == INF:
                p = np.zeros(len(rows))
                p_sink = 1.0
            else:
                mm = m if sk is None or sk == -INF else np.maximum(m, sk)
                e = np.exp(s - mm)
                e_sink = 0.0 if sk is None or sk == -INF else np.exp(sk - mm)
                den = np.sum(e) + e_sink
                p = e / den
                p_sink = e_sink / den
            o = np.zeros(d_v)
            for j, r in enumerate(rows):
                o = o + p[j] * kv[r, g, :d_v]
            out[t, h] = o
            if dout is None:
                continue
            do = dout[t, h]
            delta = np.dot(do, o)
            dsink[h] += -p_sink * delta
            for j, r in enumerate(rows):
                dp = np.dot(do, kv[r, g, :d_v])
                ds = p[j] * (dp - delta)
                dq[t, h] += sm_scale * ds * kv[r, g]
                dkv[r, g] += sm_scale * ds * q[t, h]
                dkv[r, g, :d_v] += p[j] * do
    return out, lse, dq, dkv, dsink


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    *,
    sm_scale: Optional[float] = None,
    d_v: Optional[int] = None,
    sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    dout: Optional[torch.Tensor] = None,
) -> Dict[str, torch.Tensor]:
    """Brute-force sparse attention in float64, any layout of docs/semantics.md.

    Returns {"out", "lse"} and, when ``dout`` is given, {"dq", "dkv", "dsink"}
    (dsink only when sink is given), shaped like the public API's results.
    """
    D = q.shape[-1]
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    d_v = min(D, 512) if d_v is None else int(d_v)
    batched = q.dim() == 4
    mqa = kv.dim() == (3 if batched else 2)
    qn, kvn, idxn = _np(q), _np(kv), _np(indices)
    sinkn, tln = _np(sink), _np(topk_length)
    doutn = _np(dout)
    if mqa:
        kvn = kvn[..., None, :]
        idxn = idxn[..., None, :]
    if not batched:
        qn, kvn, idxn = qn[None], kvn[None], idxn[None]
        tln = None if tln is None else tln[None]
        doutn = None if doutn is None else doutn[None]
    B, S, H, _ = qn.shape
    out = np.zeros((B, S, H, d_v))
    lse = np.zeros((B, S, H))
    dq = np.zeros_like(qn)
    dkv = np.zeros_like(kvn)
    dsink = np.zeros(H)
    for b in range(B):
        o, l, a, c, s = _sparse_attention_packed(
            qn[b], kvn[b], idxn[b], sm_scale, d_v, sinkn,
            None if tln is None else tln[b],
            None if doutn is None else doutn[b],
        )
        out[b], lse[b], dq[b], dkv[b] = o, l, a, c
        dsink += s
    if mqa:
        dkv = dkv[..., 0, :]
    if not batched:
        out, lse, dq, dkv = out[0], lse[0], dq[0], dkv[0]
    res = {"out": _t(out), "lse": _t(lse)}
    if dout is not None:
        res["dq"] = _t(dq)
        res["dkv"] = _t(dkv)
        if sink is not None:
            res["dsink"] = _t(dsink)
    return res


# --------------------------------------------------------------------------
# Indexer
# --------------------------------------------------------------------------


def indexer_scores(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, *, ratio: int = 1, sm_scale: float = 1.0,
    causal: bool = True, q_offsets: Optional[torch.Tensor] = None, cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_k: Optional[int] = None,
    grad: Optional[torch.Tensor] = None,
) -> Dict[str, torch.Tensor]:
    """Brute-force indexer scores (float64) with the causal/ratio/offset rule.

    Batched: q [B,Sq,H,D], k [B,Sk,D] or [B,Sk,1,D], weights [B,Sq,H].
    Packed: q [Tq,H,D], k [Tk,D], weights [Tq,H] plus cu_seqlens_q/k.
    Returns {"scores"} and with ``grad`` (shaped like scores) {"dq","dk","dw"}.
    """
    qn, kn, wn = _np(q), _np(k), _np(weights)
    gn = _np(grad)
    packed = q.dim() == 3
    if packed:
        cq = [int(x) for x in _np(cu_seqlens_q)]
        ck = [int(x) for x in _np(cu_seqlens_k)]
        B = len(cq) - 1
        lens_k = [ck[b + 1] - ck[b] for b in range(B)]
        width = max(lens_k + [0]) if max_seqlen_k is None else int(max_seqlen_k)
        scores = np.full((qn.shape[0], width), -INF)
    else:
        if kn.ndim == 4:
            kn = kn[:, :, 0, :]
        B, Sq = qn.shape[:2]
        Sk = kn.shape[1]
        cq = [b * Sq for b in range(B + 1)]
        ck = [b * Sk for b in range(B + 1)]
        qn = qn.reshape(B * Sq, *qn.shape[2:])
        wn = wn.reshape(B * Sq, wn.shape[2])
        kn = kn.reshape(B * Sk, kn.shape[2])
        if gn is not None:
            gn = gn.reshape(B * Sq, Sk)
        scores = np.full((B * Sq, Sk), -INF)
    offs = [0] * B if q_offsets is None else [int(x) for x in _np(q_offsets)]
    H = qn.shape[1]
    dq, dk, dw = np.zeros_like(qn), np.zeros_like(kn), np.zeros_like(wn)
    for b in range(B):
        s_k = ck[b + 1] - ck[b]
        for i in range(cq[b + 1] - cq[b]):
            row = cq[b] + i
            if causal:
                visible = min(max((offs[b] + i + 1) // ratio, 0), s_k)
            else:
                visible = s_k
            for j in range(visible):
                kr = ck[b] + j
                total = 0.0
                for h in range(H):
                    dot = np.dot(qn[row, h], kn[kr])
                    total += wn[row, h] * max(dot, 0.0)
                    if gn is not None and dot > 0:
                        g = gn[row, j] * sm_scale
                        dq[row, h] += g * wn[row, h] * kn[kr]
                        dk[kr] += g * wn[row, h] * qn[row, h]
                    if gn is not None:
                        dw[row, h] += gn[row, j] * sm_scale * max(dot, 0.0)
                scores[row, j] = sm_scale * total
    if not packed:
        scores = scores.reshape(B, Sq, Sk)
        dq = dq.reshape(q.shape)
        dw = dw.reshape(weights.shape)
        dk = dk.reshape(k.shape)
    res = {"scores": _t(scores)}
    if gn is not None:
        res.update(dq=_t(dq), dk=_t(dk), dw=_t(dw))
    return res


# --------------------------------------------------------------------------
# Top-k
# --------------------------------------------------------------------------


def topk(scores: torch.Tensor, k: int):
    """Per row of the last dim: positions of the k largest scores that are not
    NaN and not -inf (+inf counts as the largest), ties going to the smaller
    position, valid ones first in ascending position order, padded with -1.
    Returns (indices int64 [..., k], lengths int64 [...])."""
    a = _np(scores)
    lead = a.shape[:-1]
    rows = a.reshape(int(np.prod(lead, dtype=np.int64)), a.shape[-1])
    out = np.full((rows.shape[0], k), -1, dtype=np.int64)
    lengths = np.zeros(rows.shape[0], dtype=np.int64)
    for r in range(rows.shape[0]):
        cands = [(float(v), j) for j, v in enumerate(rows[r]) if not math.isnan(v) and v != -INF]
        cands.sort(key=lambda c: (-c[0], c[1]))
        chosen = sorted(j for _, j in cands[:k])
        out[r, : len(chosen)] = chosen
        lengths[r] = len(chosen)
    return _t(out.reshape(*lead, k)), _t(lengths.reshape(lead))


# --------------------------------------------------------------------------
# Comparison helpers
# --------------------------------------------------------------------------


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a = actual.detach().cpu().double()
    e = expected.detach().cpu().double()
    num = torch.linalg.vector_norm(a - e).item()
    den = torch.linalg.vector_norm(e).item()
    return num / den if den > 0 else num


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, name: str = "") -> None:
    """Compare a result against the float64 brute force.

    NaN and +-inf must sit at exactly the same places; finite entries must be
    close for the input ``dtype``: tight for float64/float32, relative L2
    error <= 1e-2 (and no wild element) for float16/bfloat16.
    """
    a = actual.detach().cpu().double()
    e = expected.detach().cpu().double()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    assert torch.equal(torch.isnan(a), torch.isnan(e)), f"{name}: NaN pattern differs"
    assert torch.equal(torch.isposinf(a), torch.isposinf(e)), f"{name}: +inf pattern differs"
    assert torch.equal(torch.isneginf(a), torch.isneginf(e)), f"{name}: -inf pattern differs"
    fin = torch.isfinite(e)
    a, e = a[fin], e[fin]
    if a.numel() == 0:
        return
    if dtype == torch.float64:
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")
    elif dtype == torch.float32:
        torch.testing.assert_close(a, e, rtol=2e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")
    else:
        err = rel_l2(a, e)
        assert err <= 1e-2, f"{name}: relative L2 error {err:.3e} > 1e-2"
        scale = max(1.0, e.abs().max().item())
        worst = (a - e).abs().max().item()
        assert worst <= 5e-2 * scale, f"{name}: max abs error {worst:.3e} (scale {scale:.2e})"
