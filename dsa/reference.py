"""Reference backend: the contract of docs/semantics.md in plain PyTorch.

Runs on any device. Every function works on the canonical arguments of
:mod:`dsa._args` and computes in float32 (float64 for float64 inputs),
chunked over query rows so that memory stays bounded (the V3.2 shape, T=4096,
H=128, D=576, K=2048, runs in a few GB).

Sparse attention, for row t, head h, kv head g = h // (H / G), slot j:
    valid_j = j < clamp(topk_length[t], 0, K) and 0 <= indices[t, g, j] < N
    s_j     = sm_scale * q[t, h] . kv[indices[t, g, j], g]
    lse     = log sum_valid exp(s_j)            (+inf when nothing is valid)
    den     = sum_valid exp(s_j) + exp(sink[h])
    out     = sum_valid exp(s_j) / den * kv[indices[t, g, j], g, :d_v]
The backward is written out from these formulas (not autograd) so that empty
rows and infinite sinks give exact zeros rather than NaN. With
``deterministic`` the kv gradient sums duplicate rows through
:func:`dsa._rules.segment_sum` (a fixed order, no atomics), bitwise
reproducible on CUDA too.

Sparse decode is the same computation on the rows that the paged slots of
:func:`dsa._rules.decode_slots` address, dequantised by :mod:`dsa.kv_cache`
for an FP8 cache.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch

from dsa import reference_training
from dsa._args import IndexerArgs, SparseAttnArgs, SparseDecodeArgs, TopkArgs, Unsupported
from dsa._rules import acc_dtype, decode_slots, segment_sum, slot_validity, visible_keys
from dsa.kv_cache import NATIVE, dequantize_rows

# elements of the largest per-chunk intermediate (fp32: 128 MiB)
_CHUNK_ELEMS = 1 << 25

_NEG_INF = float("-inf")


def _row_chunk(per_row: int) -> int:
    return max(1, _CHUNK_ELEMS // max(1, per_row))


# --------------------------------------------------------------------------
# sparse attention


class _Slots:
    """The gathered slots of a chunk of rows [t0, t1), grouped by kv head.

    valid [C, G, K]; k [C, G, K, D] with invalid slots zeroed (never the
    stored row: NaN in unreferenced kv rows must not leak); scores and
    probabilities [C, G, H/G, K].
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, sm_scale: float,
                 sink: Optional[torch.Tensor]):
        """q [C, H, D], k [C, G, K, D] (the gathered rows, any value on invalid slots), valid [C, G, K]."""
        acc = acc_dtype(q)
        C, H, D = q.shape
        G = k.shape[1]
        self.k = torch.where(valid[..., None], k.to(acc), 0.0)
        self.valid = valid
        self.q = q.to(acc).view(C, G, H // G, D)
        s = torch.einsum("cgmd,cgkd->cgmk", self.q, self.k) * sm_scale
        self.s = torch.where(valid[:, :, None, :], s, _NEG_INF)
        self.lse = torch.logsumexp(self.s, dim=-1)  # [C, G, M]; -inf when empty
        log_den = self.lse
        if sink is not None:
            log_den = torch.logaddexp(self.lse, sink.to(acc).view(1, G, H // G))
        self.log_den = log_den
        # exp(-inf - (-inf)) is NaN on empty rows: select 0 on invalid slots instead
        p = torch.exp(self.s - log_den[..., None])
        self.p = torch.where(valid[:, :, None, :], p, 0.0)

    @staticmethod
    def of(a: SparseAttnArgs, t0: int, t1: int) -> "_Slots":
        """The slots of rows [t0, t1) of a sparse-attention call (``safe``: their rows, 0 where invalid)."""
        length = None if a.topk_length is None else a.topk_length[t0:t1]
        valid, safe = slot_validity(a.indices[t0:t1], length, a.N)
        g = torch.arange(a.G, device=safe.device).view(1, a.G, 1)
        sl = _Slots(a.q[t0:t1], a.kv[safe, g], valid, a.sm_scale, a.sink)  # kv rows [C, G, K, D]
        sl.safe = safe
        return sl

    def v(self, d_v: int) -> torch.Tensor:
        return self.k[..., :d_v]

    def output(self, d_v: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """out [C, H, d_v] in dtype and lse [C, H] in the accumulation dtype (+inf on empty rows)."""
        C, G, M, _ = self.q.shape
        o = torch.einsum("cgmk,cgkd->cgmd", self.p, self.v(d_v))
        lse = self.lse.reshape(C, G * M)
        return o.reshape(C, G * M, d_v).to(dtype), torch.where(torch.isneginf(lse), float("inf"), lse)


def sparse_attention_fwd(a: SparseAttnArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    """-> out [T, H, d_v] (q.dtype), lse [T, H] fp32 (+inf on empty rows)."""
    T, H = a.T, a.H
    out = torch.empty(T, H, a.d_v, device=a.q.device, dtype=a.q.dtype)
    lse = torch.empty(T, H, device=a.q.device, dtype=acc_dtype(a.q))
    step = _row_chunk(a.G * a.K * a.D + H * a.K)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        out[t0:t1], lse[t0:t1] = _Slots.of(a, t0, t1).output(a.d_v, out.dtype)
    return out, lse


def sparse_decode(a: SparseDecodeArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    """-> out [T, H, d_v] (q.dtype), lse [T, H] fp32 (+inf on empty rows), on the
    dequantised cache (dsa.kv_cache) through the paged slots of dsa._rules.decode_slots."""
    T, H, G, K = a.T, a.H, a.G, a.K
    out = torch.empty(T, H, a.d_v, device=a.q.device, dtype=a.q.dtype)
    lse = torch.empty(T, H, device=a.q.device, dtype=acc_dtype(a.q))
    valid, page, offset = decode_slots(a)
    step = _row_chunk(G * K * a.D + H * K)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        pg, off = page[t0:t1], offset[t0:t1]
        if a.cache_format == NATIVE:
            k = a.kv[pg, off, torch.arange(G, device=pg.device).view(1, G, 1)]  # [C, G, K, D]
        else:
            k = dequantize_rows(a.kv, a.cache_format, pg, off).view(t1 - t0, G, K, a.D)
        out[t0:t1], lse[t0:t1] = _Slots(a.q[t0:t1], k, valid[t0:t1], a.sm_scale, a.sink).output(a.d_v, out.dtype)
    return out, lse


def _sink_prob(sink: torch.Tensor, log_den: torch.Tensor) -> torch.Tensor:
    """exp(sink - log den), with sink = +inf giving 1 and sink = -inf giving 0."""
    p = torch.exp(sink - log_den)
    p = torch.where(torch.isposinf(sink), 1.0, p)
    return torch.where(torch.isneginf(sink), 0.0, p)


def sparse_attention_bwd(
    a: SparseAttnArgs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """-> dq [T, H, D] (q.dtype), dkv [N, G, D] (kv.dtype, fp32-accumulated), dsink [H] fp32 or None."""
    acc = acc_dtype(a.q)
    T, H, G, D, K = a.T, a.H, a.G, a.D, a.K
    M = H // G
    dq = torch.empty_like(a.q)
    dkv = torch.zeros(a.N * G, D, device=a.kv.device, dtype=acc)
    dsink = None if a.sink is None else torch.zeros(H, device=a.q.device, dtype=acc)
    step = _row_chunk(3 * G * K * D + 3 * H * K)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        C = t1 - t0
        sl = _Slots.of(a, t0, t1)
        do = dout[t0:t1].to(acc).view(C, G, M, a.d_v)
        o = torch.einsum("cgmk,cgkd->cgmd", sl.p, sl.v(a.d_v))
        delta = (do * o).sum(-1)  # [C, G, M]
        dp = torch.einsum("cgmd,cgkd->cgmk", do, sl.v(a.d_v))
        ds = torch.where(sl.valid[:, :, None, :], sl.p * (dp - delta[..., None]), 0.0)
        dq[t0:t1] = (torch.einsum("cgmk,cgkd->cgmd", ds, sl.k) * a.sm_scale).reshape(C, H, D).to(dq.dtype)
        dk = torch.einsum("cgmk,cgmd->cgkd", ds, sl.q) * a.sm_scale
        dk[..., : a.d_v] += torch.einsum("cgmk,cgmd->cgkd", sl.p, do)
        # invalid slots add nothing, not even 0 * NaN from a NaN query row
        dk = torch.where(sl.valid[..., None], dk, 0.0)
        rows = (sl.safe * G + torch.arange(G, device=dk.device).view(1, G, 1)).reshape(-1)
        if a.deterministic:
            dkv += segment_sum(rows, dk.reshape(-1, D), a.N * G)
        else:
            dkv.index_add_(0, rows, dk.reshape(-1, D))
        if dsink is not None:
            sink = a.sink.to(acc).view(1, G, M)
            dsink -= (_sink_prob(sink, sl.log_den) * delta).sum(0).reshape(H)
    dkv = dkv.view(a.N, G, D).to(a.kv.dtype)
    if dsink is not None and a.q.dtype != torch.float64:
        dsink = dsink.float()
    return dq, dkv, dsink


# --------------------------------------------------------------------------
# indexer


def _visible_limit(a: IndexerArgs, b: int, i0: int, i1: int, s_k: int) -> torch.Tensor:
    """Per query row i in [i0, i1) of sequence b: keys j < limit are visible."""
    i = torch.arange(i0, i1, device=a.q.device, dtype=torch.int64)
    if not a.causal:
        return torch.full_like(i, s_k)
    pos = a.q_offsets[b].long() + i + 1
    return visible_keys(pos, a.ratio, s_k)


def _indexer_chunks(a: IndexerArgs):
    """Yield (row0, row1, scores [C, S_k_b] with -inf where not visible) per chunk."""
    cu_q = a.cu_seqlens_q.tolist()
    cu_k = a.cu_seqlens_k.tolist()
    H = a.q.shape[1]
    acc = acc_dtype(a.q)
    for b in range(a.batch):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        s_k = k1 - k0
        kb = a.k[k0:k1].to(acc)
        step = _row_chunk(H * max(1, s_k))
        for i0 in range(0, q1 - q0, step):
            i1 = min(q1 - q0, i0 + step)
            qb = a.q[q0 + i0 : q0 + i1].to(acc)
            w = a.weights[q0 + i0 : q0 + i1].to(acc)
            dots = torch.relu(torch.einsum("ihd,jd->ihj", qb, kb))
            sc = torch.einsum("ihj,ih->ij", dots, w) * a.sm_scale
            limit = _visible_limit(a, b, i0, i1, s_k)
            vis = torch.arange(s_k, device=sc.device).view(1, -1) < limit.view(-1, 1)
            yield q0 + i0, q0 + i1, torch.where(vis, sc, _NEG_INF)


def indexer_scores(a: IndexerArgs) -> torch.Tensor:
    """-> scores [T_q, max_seqlen_k] fp32 (fp64 for fp64 inputs), -inf where not visible."""
    out = torch.full((a.q.shape[0], a.max_seqlen_k), _NEG_INF, device=a.q.device, dtype=acc_dtype(a.q))
    for r0, r1, sc in _indexer_chunks(a):
        out[r0:r1, : sc.shape[1]] = sc
    return out


def indexer_topk(a: IndexerArgs, topk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """-> indices [T_q, topk] int32 (local key positions, -1 padded), lengths [T_q] int32."""
    Tq = a.q.shape[0]
    idx = torch.full((Tq, topk), -1, device=a.q.device, dtype=torch.int32)
    lengths = torch.zeros(Tq, device=a.q.device, dtype=torch.int32)
    for r0, r1, sc in _indexer_chunks(a):
        i, n = _topk_rows(sc, topk)
        idx[r0:r1], lengths[r0:r1] = i, n
    return idx, lengths


# --------------------------------------------------------------------------
# top-k


def _topk_rows(scores: torch.Tensor, k: int,
               ends: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """scores [R, S] -> (indices [R, k], lengths [R]) int32; ends [R] (any int
    dtype) or None: columns at or past clamp(ends[r], 0, S) count as -inf."""
    R, S = scores.shape
    key = scores if scores.dtype == torch.float64 else scores.float()
    key = torch.where(torch.isnan(key), _NEG_INF, key)
    if ends is not None:
        col = torch.arange(S, device=key.device).view(1, -1)
        key = torch.where(col < ends.clamp(0, S).view(-1, 1), key, _NEG_INF)
    # a stable descending sort keeps equal scores in position order: ties go to the smaller position
    vals, order = torch.sort(key, dim=-1, descending=True, stable=True)
    take = min(k, S)
    chosen = vals[:, :take] > _NEG_INF
    pos = torch.where(chosen, order[:, :take], S)
    pos, _ = torch.sort(pos, dim=-1)
    out = torch.full((R, k), -1, device=scores.device, dtype=torch.int32)
    out[:, :take] = torch.where(pos < S, pos, -1).to(torch.int32)
    return out, chosen.sum(-1).to(torch.int32)


def topk(a: TopkArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    """-> indices [R, k] int32 (selected positions ascending, then -1), lengths [R] int32;
    row r only up to clamp(a.row_ends[r], 0, S) when row_ends is given."""
    R, S = a.scores.shape
    idx = torch.empty((R, a.topk), device=a.scores.device, dtype=torch.int32)
    lengths = torch.empty(R, device=a.scores.device, dtype=torch.int32)
    step = _row_chunk(4 * S)
    for r0 in range(0, R, step):
        r1 = min(R, r0 + step)
        ends = None if a.row_ends is None else a.row_ends[r0:r1]
        idx[r0:r1], lengths[r0:r1] = _topk_rows(a.scores[r0:r1], a.topk, ends)
    return idx, lengths


# --------------------------------------------------------------------------

_OPS = {
    "sparse_attention_fwd": sparse_attention_fwd,
    "sparse_attention_bwd": sparse_attention_bwd,
    "sparse_decode": sparse_decode,
    "indexer_scores": indexer_scores,
    "indexer_topk": indexer_topk,
    "topk": topk,
}
_OPS.update(reference_training.OPS)  # indexer training (dsa/reference_training.py)


def backend_op(op: str, args: Any, auto: bool = False) -> Callable[..., Any]:
    """The reference serves every valid call on every device (deterministic
    gradients included: they never use atomics)."""
    if op not in _OPS:
        raise Unsupported(f"the reference has no implementation of {op}")
    return _OPS[op]
