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
# Sparse decode: paged caches, block tables, FP8 bytes
# --------------------------------------------------------------------------

# FP8 layouts, re-derived from the contract: (bytes a token, NoPE values,
# values a scale, scale bytes, NoPE / scale / RoPE byte offsets in a token
# record, token record bytes, scales per page after the records)
_V32 = dict(bytes=656, nope=512, tile=128, scale_bytes=4, rope_at=528, scale_at=512, record=656, per_page=False)
_MODEL1 = dict(bytes=584, nope=448, tile=64, scale_bytes=1, rope_at=448, scale_at=None, record=576, per_page=True)
FP8_LAYOUTS = {"fp8_v32": _V32, "fp8_model1": _MODEL1}


def e4m3_value(byte: int) -> float:
    """OCP E4M3FN: 1 sign, 4 exponent (bias 7), 3 mantissa bits; S.1111.111 is NaN, no infinities."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 0x7
    if e == 0xF and m == 0x7:
        return float("nan")
    if e == 0:
        return sign * m / 8.0 * 2.0 ** -6
    return sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)


def e8m0_value(byte: int) -> float:
    return float("nan") if byte == 255 else 2.0 ** (byte - 127)


def _bf16_value(lo: int, hi: int) -> float:
    return float(np.array([(hi << 24) | (lo << 16)], dtype=np.uint32).view(np.float32)[0])


def _fp32_value(b4) -> float:
    return float(np.array(b4, dtype=np.uint8).view(np.float32)[0])


def fp8_cache_rows(cache: torch.Tensor, cache_format: str) -> np.ndarray:
    """Every token of an FP8 cache [P, page_size, bytes] (or [P, page_size, 1, bytes], any page
    stride) dequantised byte by byte: float64 [P, page_size, D]."""
    L = FP8_LAYOUTS[cache_format]
    c = cache.detach().cpu()
    c = c.view(torch.uint8) if c.dtype != torch.uint8 else c
    if c.dim() == 4:
        c = c[:, :, 0]
    P, PS, B = c.shape
    assert B == L["bytes"]
    n_tiles, d_rope = L["nope"] // L["tile"], 64
    rows = np.zeros((P, PS, L["nope"] + d_rope))
    for p in range(P):
        page = c[p].reshape(-1).numpy().astype(np.int64)  # the page's bytes, in order
        for i in range(PS):
            rec = page[i * L["record"]:(i + 1) * L["record"]]
            if L["per_page"]:
                sb = page[PS * L["record"] + 8 * i: PS * L["record"] + 8 * i + n_tiles]
                scales = [e8m0_value(int(b)) for b in sb]
            else:
                scales = [_fp32_value(rec[L["scale_at"] + 4 * k: L["scale_at"] + 4 * k + 4]) for k in range(n_tiles)]
            for v in range(L["nope"]):
                rows[p, i, v] = e4m3_value(int(rec[v])) * scales[v // L["tile"]]
            for v in range(d_rope):
                lo, hi = int(rec[L["rope_at"] + 2 * v]), int(rec[L["rope_at"] + 2 * v + 1])
                rows[p, i, L["nope"] + v] = _bf16_value(lo, hi)
    return rows


def _e4m3_nearest(x: np.ndarray) -> np.ndarray:
    """The e4m3 bytes nearest to the values x (|x| <= 448), ties to the even
    mantissa; the sign bit is x's own (a tiny negative value gives -0)."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    codes = [b for b in range(128) if not math.isnan(e4m3_value(b))]  # the non-negative codes
    values = np.array([e4m3_value(b) for b in codes])
    dist = np.abs(values[None, :] - np.abs(x)[:, None])
    best = dist.min(axis=1, keepdims=True)
    odd = np.array([b & 1 for b in codes])[None, :]
    # among the nearest codes the even one wins: rank by (distance, odd)
    pick = np.argmin(np.where(dist == best, odd, 2), axis=1)
    return np.array(codes, dtype=np.uint8)[pick] | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)


def quantize_fp8(kv: torch.Tensor, cache_format: str) -> np.ndarray:
    """The contract's quantiser, written out: [P, page_size, D] floats -> uint8 [P, page_size, bytes]."""
    L = FP8_LAYOUTS[cache_format]
    x = kv.detach().cpu().float().numpy()
    P, PS, _ = x.shape
    n_tiles = L["nope"] // L["tile"]
    out = np.zeros((P, PS * L["bytes"]), dtype=np.uint8)
    for p in range(P):
        for i in range(PS):
            rec = np.zeros(L["record"], dtype=np.uint8)
            scale_bytes = []
            for k in range(n_tiles):
                tile = x[p, i, k * L["tile"]:(k + 1) * L["tile"]]
                amax = np.float32(np.max(np.abs(tile)))
                ratio = max(float(np.float32(amax / np.float32(448.0))), float(np.float32(1e-4)))
                scale = 2.0 ** math.ceil(math.log2(ratio))
                rec[k * L["tile"]:(k + 1) * L["tile"]] = _e4m3_nearest(np.clip(tile.astype(np.float64) / scale,
                                                                               -448.0, 448.0))
                if L["per_page"]:
                    scale_bytes.append(int(round(math.log2(scale))) + 127)
                else:
                    rec[L["scale_at"] + 4 * k: L["scale_at"] + 4 * k + 4] = np.array([scale], np.float32).view(np.uint8)
            rope = torch.from_numpy(x[p, i, L["nope"]:].copy()).to(torch.bfloat16).view(torch.int16).numpy()
            rec[L["rope_at"]:L["rope_at"] + 128] = rope.view(np.uint8)
            out[p, i * L["record"]:(i + 1) * L["record"]] = rec
            if L["per_page"]:
                at = PS * L["record"] + 8 * i
                out[p, at:at + n_tiles] = scale_bytes
    return out.reshape(P, PS, L["bytes"])


def sparse_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, *, block_table: Optional[torch.Tensor] = None,
    seq_lens: Optional[torch.Tensor] = None, topk_length: Optional[torch.Tensor] = None,
    sink: Optional[torch.Tensor] = None, sm_scale: Optional[float] = None, d_v: Optional[int] = None,
    cache_format: str = "native",
) -> Dict[str, torch.Tensor]:
    """Brute-force sparse decode in float64 (docs/semantics.md, "Sparse decode").

    q [B, S_q, H, D] or [T, H, D] (each row its own sequence); kv_cache native
    [N, D] / [N, H_kv, D] (flat: an index is a row) or [P, page_size, H_kv, D],
    or an FP8 byte cache; indices [.., K] or [.., H_kv, K]. Each slot is
    resolved to a cache row here (or -1), then attended as in
    :func:`sparse_attention`. Returns {"out", "lse"} shaped like the API's."""
    batched = q.dim() == 4
    qn = _np(q)
    B, S = (qn.shape[0], qn.shape[1]) if batched else (qn.shape[0], 1)
    H, D = qn.shape[-2], qn.shape[-1]
    T = B * S
    if cache_format == "native":
        kvn = _np(kv_cache)
        flat = kvn.ndim <= 3
        if kvn.ndim == 2:
            kvn = kvn[:, None, :]
        rows = kvn if flat else kvn.reshape(-1, kvn.shape[-2], kvn.shape[-1])  # [P * page_size, G, D]
        PS = 1 if flat else kvn.shape[1]
    else:
        deq = fp8_cache_rows(kv_cache, cache_format)
        PS = deq.shape[1]
        rows = deq.reshape(-1, 1, deq.shape[-1])
    G = rows.shape[1]
    P = rows.shape[0] // PS
    idx = _np(indices).reshape(T, G, -1)
    K = idx.shape[-1]
    tl = None
    if topk_length is not None:
        tln = _np(topk_length).reshape(-1)
        tl = np.repeat(tln, T // len(tln)) if len(tln) else tln
    bt = None if block_table is None else _np(block_table)
    sl = None if seq_lens is None else _np(seq_lens)
    slot = np.full((T, G, K), -1, dtype=np.int64)
    for t in range(T):
        b = t // S
        for g in range(G):
            for j in range(K):
                i = int(idx[t, g, j])
                if i < 0:
                    continue
                if bt is None:
                    if i < P * PS:
                        slot[t, g, j] = i
                    continue
                if (sl is not None and i >= int(sl[b])) or i // PS >= bt.shape[1]:
                    continue
                page = int(bt[b, i // PS])
                if 0 <= page < P:
                    slot[t, g, j] = page * PS + i % PS
    d_v = min(D, 512) if d_v is None else int(d_v)
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    out, lse, *_ = _sparse_attention_packed(qn.reshape(T, H, D), rows, slot, sm_scale, d_v, _np(sink), tl, None)
    lead = (B, S) if batched else (T,)
    return {"out": _t(out.reshape(*lead, H, d_v)), "lse": _t(lse.reshape(*lead, H))}


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


def topk(scores: torch.Tensor, k: int, row_ends: Optional[torch.Tensor] = None):
    """Per row of the last dim: positions of the k largest scores that are not
    NaN and not -inf (+inf counts as the largest), ties going to the smaller
    position, valid ones first in ascending position order, padded with -1.
    row_ends (int, scores.shape[:-1]) or None: a row is only its first
    min(max(row_ends[r], 0), S) scores, whatever lies past them.
    Returns (indices int64 [..., k], lengths int64 [...])."""
    a = _np(scores)
    lead = a.shape[:-1]
    S = a.shape[-1]
    rows = a.reshape(int(np.prod(lead, dtype=np.int64)), S)
    ends = [S] * rows.shape[0] if row_ends is None else [min(max(int(e), 0), S) for e in _np(row_ends).reshape(-1)]
    out = np.full((rows.shape[0], k), -1, dtype=np.int64)
    lengths = np.zeros(rows.shape[0], dtype=np.int64)
    for r in range(rows.shape[0]):
        cands = [(float(v), j) for j, v in enumerate(rows[r, : ends[r]]) if not math.isnan(v) and v != -INF]
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
