"""Peer "torch": what a user would write in plain PyTorch, timed beside dsa.

Not a ``dsa`` backend (that is ``dsa.reference``): no custom kernels, only
gather + einsum + softmax for sparse attention, einsum for the indexer and
``torch.topk`` for top-k, each chunked over query rows so memory stays
bounded (about ``chunk_bytes`` per intermediate) at every registered shape.
Results follow the contract of docs/semantics.md closely enough to do the same work
(valid-slot masking, sink in the denominator, top-k padded with -1 and its
valid positions ascending); tie order and the last bits may differ.
Autograd differentiates :func:`sparse_attention` (q, kv, sink).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

CHUNK_BYTES = 1 << 30


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    *,
    sm_scale: float,
    d_v: int,
    sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """q [T, H, D], kv [N, D], indices [T, K] global rows -> out [T, H, d_v]."""
    T, H, D = q.shape
    K = indices.shape[-1]
    # Per query row: gathered rows [K, D] and fp32 scores [H, K].
    per_row = K * max(D * kv.element_size(), H * 4)
    rows = max(1, chunk_bytes // per_row)
    outs = []
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        tl = topk_length[t0:t1] if topk_length is not None else None
        outs.append(_attn_rows(q[t0:t1], kv, indices[t0:t1], sm_scale, d_v, sink, tl))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _attn_rows(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    sink: Optional[torch.Tensor],
    topk_length: Optional[torch.Tensor],
) -> torch.Tensor:
    N = kv.shape[0]
    K = indices.shape[-1]
    idx = indices.long()
    valid = (idx >= 0) & (idx < N)
    if topk_length is not None:
        slot = torch.arange(K, device=idx.device)
        valid &= slot[None, :] < topk_length.clamp(0, K)[:, None].long()
    rows = kv[idx.clamp(0, N - 1)]  # [c, K, D]
    s = torch.einsum("chd,ckd->chk", q, rows).float() * sm_scale  # [c, H, K]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    if sink is not None:
        m = torch.maximum(m, sink.view(1, -1, 1))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()  # empty rows
    p = torch.exp(s - m)
    den = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        den = den + torch.exp(sink.view(1, -1, 1) - m)
    p = p / den.clamp_min(torch.finfo(torch.float32).tiny)
    return torch.einsum("chk,ckv->chv", p.to(q.dtype), rows[..., :d_v])


def indexer_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    *,
    ratio: int = 1,
    sm_scale: float = 1.0,
    causal: bool = True,
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """q [B, S_q, H_i, D_i], k [B, S_k, D_i], weights [B, S_q, H_i] -> [B, S_q, S_k] fp32."""
    B, S_q = q.shape[:2]
    S_k = k.shape[1]
    out = torch.full((B, S_q, S_k), float("-inf"), dtype=torch.float32, device=q.device)
    for b, i0, i1, kmax, sc in _indexer_chunks(q, k, weights, ratio, sm_scale, causal, chunk_bytes):
        out[b, i0:i1, :kmax] = sc
    return out


def _indexer_chunks(q, k, weights, ratio, sm_scale, causal, chunk_bytes):
    """Yield (b, i0, i1, kmax, scores [i1-i0, kmax] fp32, -inf where masked)."""
    B, S_q, H = q.shape[:3]
    S_k = k.shape[1]
    rows = max(1, chunk_bytes // (H * S_k * 4))
    for b in range(B):
        for i0 in range(0, S_q, rows):
            i1 = min(S_q, i0 + rows)
            # Last query of the chunk sees (i1 // ratio) keys: compute only those.
            kmax = min(S_k, i1 // ratio) if causal else S_k
            if kmax <= 0:
                continue
            logits = torch.einsum("qhd,kd->qhk", q[b, i0:i1], k[b, :kmax]).relu_()
            sc = torch.einsum("qhk,qh->qk", logits.float(), weights[b, i0:i1].float()) * sm_scale
            if causal:
                seen = (torch.arange(i0, i1, device=q.device) + 1) // ratio  # keys visible per row
                cols = torch.arange(kmax, device=q.device)
                sc = sc.masked_fill(cols[None, :] >= seen[:, None], float("-inf"))
            yield b, i0, i1, kmax, sc


def topk_indices(scores: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """[R, S] -> (indices [R, k] int32, valid ascending then -1; lengths [R] int32)."""
    R, S = scores.shape
    kk = min(k, S)
    vals, idx = torch.topk(scores, kk, dim=-1, sorted=False)
    valid = torch.isfinite(vals)
    lengths = valid.sum(dim=-1, dtype=torch.int32)
    idx = torch.where(valid, idx, torch.full_like(idx, S)).sort(dim=-1).values
    idx = torch.where(idx == S, torch.full_like(idx, -1), idx).to(torch.int32)
    if kk < k:
        idx = torch.cat([idx, idx.new_full((R, k - kk), -1)], dim=-1)
    return idx, lengths


def indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    *,
    ratio: int = 1,
    sm_scale: float = 1.0,
    causal: bool = True,
    chunk_bytes: int = CHUNK_BYTES,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the indexer scores, never holding the [S_q, S_k] matrix."""
    B, S_q = q.shape[:2]
    out = torch.full((B, S_q, topk), -1, dtype=torch.int32, device=q.device)
    lengths = torch.zeros((B, S_q), dtype=torch.int32, device=q.device)
    for b, i0, i1, _, sc in _indexer_chunks(q, k, weights, ratio, sm_scale, causal, chunk_bytes):
        out[b, i0:i1], lengths[b, i0:i1] = topk_indices(sc, topk)
    return out, lengths
