"""Reference backend of indexer training: docs/semantics.md, "Training the indexer", in plain PyTorch.

Runs on any device, computes in float32 (float64 for float64 inputs) and is
chunked over query rows, so no intermediate is ever held for all rows at once
(in particular never the [T, K, H_i] relu products of the sparse indexer).

Attention target (sparse attention's validity rule; g = kv head of the row,
M = H / H_kv query heads per kv head):
    target[t, g, j] = (1/M) sum_{h in g} exp(s[t, h, j] - lse[t, h])   valid j
                    = 0                                                 otherwise
    with s = sm_scale * q[t, h] . kv[indices[t, g, j], g] over all D dims and
    lse the log-sum-exp of sparse attention (sink excluded, +inf when empty).

Sparse indexer (MQA key k [N, D_i]):
    logits[t, j] = sm_scale * sum_h weights[t, h] * relu(q[t, h] . k[indices[t, j]])   valid j
                 = -inf                                                          otherwise

KL loss, over the R rows that have a valid slot (terms with target 0 count 0;
the target of an invalid slot is ignored, attention_target gives 0 there):
    loss_t = sum_valid target[t, j] * (log target[t, j] - log_softmax(logits[t])_j)
    loss   = sum_t loss_t / max(R, 1)
    dloss/dlogits[t, j] = (softmax(logits[t])_j * sum_valid target[t] - target[t, j]) / R

Backward of the relu-weighted dot, with g = dlogits (0 on invalid slots):
    ds[t, h, j] = g[t, j] * sm_scale * weights[t, h] * [q[t, h] . k_j > 0]
    dq[t, h]    = sum_j ds[t, h, j] k_j          dk[n] = sum_{(t, j) -> n} sum_h ds[t, h, j] q[t, h]
    dweights[t, h] = sm_scale * sum_j g[t, j] relu(q[t, h] . k_j)
The dense ``indexer_scores`` backward is the same with every visible key a slot.

Dense attention target (the indexer's visibility rule, MQA kv [T_k, D]):
    target[i, j] = (1/H) sum_h softmax_{visible j}(sm_scale * q[i, h] . kv[j]),  0 elsewhere.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from dsa._args import DenseTargetArgs, IndexerArgs, SparseAttnArgs, SparseIndexerArgs
from dsa._rules import acc_dtype, dense_rows, segment_sum, slot_validity

# elements of the largest per-chunk intermediate (fp32: 128 MiB), as in dsa.reference
_CHUNK_ELEMS = 1 << 25

_NEG_INF = float("-inf")

# per-row stats of the KL forward, saved for its backward: [T, 4] columns
STAT_LOSS, STAT_LSE, STAT_TSUM, STAT_VALID = range(4)


def _row_chunk(per_row: int) -> int:
    return max(1, _CHUNK_ELEMS // max(1, per_row))


# --------------------------------------------------------------------------
# attention targets


def attention_target(a: SparseAttnArgs, lse: torch.Tensor) -> torch.Tensor:
    """-> target [T, G, K] fp32 (fp64 for fp64 q); lse [T, H] from sparse attention."""
    acc = acc_dtype(a.q)
    T, H, G, K, D = a.T, a.H, a.G, a.K, a.D
    M = H // G
    out = torch.empty(T, G, K, device=a.q.device, dtype=acc)
    g = torch.arange(G, device=a.q.device).view(1, G, 1)
    step = _row_chunk(G * K * D + 2 * H * K)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        C = t1 - t0
        valid, safe = slot_validity(a.indices[t0:t1], None if a.topk_length is None else a.topk_length[t0:t1], a.N)
        k = torch.where(valid[..., None], a.kv[safe, g].to(acc), 0.0)  # [C, G, K, D]; never an unreferenced row
        q = a.q[t0:t1].to(acc).view(C, G, M, D)
        s = torch.einsum("cgmd,cgkd->cgmk", q, k) * a.sm_scale
        p = torch.exp(s - lse[t0:t1].to(acc).view(C, G, M, 1))  # lse = +inf on an empty row: 0
        out[t0:t1] = torch.where(valid, p.mean(2), 0.0)
    return out


def _dense_chunks(a, keys: torch.Tensor, per_key: int):
    """Yield (k0, k1, keys [S_k, D] in the accumulation dtype, r0, r1, visible [C, S_k])
    per chunk of query rows [r0, r1) of each sequence with keys (the indexer's
    visibility rule); ``per_key`` is the workspace of one row per key."""
    acc = acc_dtype(a.q)
    _, limit = dense_rows(a)
    cu_q, cu_k = a.cu_seqlens_q.tolist(), a.cu_seqlens_k.tolist()
    for b in range(a.batch):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        s_k = k1 - k0
        if s_k == 0:
            continue
        kb = keys[k0:k1].to(acc)
        step = _row_chunk(per_key * s_k)
        for r0 in range(q0, q1, step):
            r1 = min(q1, r0 + step)
            yield k0, k1, kb, r0, r1, torch.arange(s_k, device=kb.device) < limit[r0:r1, None]


def dense_attention_target(a: DenseTargetArgs) -> torch.Tensor:
    """-> target [T_q, max_seqlen_k] fp32 (fp64 for fp64 q), 0 where not visible."""
    acc = acc_dtype(a.q)
    Tq, H, _ = a.q.shape
    out = torch.zeros(Tq, a.max_seqlen_k, device=a.q.device, dtype=acc)
    for k0, k1, kv, r0, r1, vis in _dense_chunks(a, a.kv, 2 * H):
        s = torch.einsum("chd,jd->chj", a.q[r0:r1].to(acc), kv) * a.sm_scale
        vis = vis.unsqueeze(1)  # [C, 1, S_k]
        s = torch.where(vis, s, _NEG_INF)
        p = torch.exp(s - torch.logsumexp(s, -1, keepdim=True))  # NaN on an empty row ...
        out[r0:r1, : k1 - k0] = torch.where(vis, p, 0.0).mean(1)  # ... selected away here
    return out


# --------------------------------------------------------------------------
# sparse indexer


class _IndexerSlots:
    """Rows [t0, t1) of the sparse indexer: gathered keys, relu'd dots and logits.

    valid [C, K]; k [C, K, D] with invalid slots zeroed (never the stored row);
    dots [C, H, K] = q . k (0 on invalid slots); logits [C, K] (-inf invalid).
    """

    def __init__(self, a: SparseIndexerArgs, t0: int, t1: int):
        acc = acc_dtype(a.q)
        length = None if a.topk_length is None else a.topk_length[t0:t1]
        self.valid, safe = slot_validity(a.indices[t0:t1], length, a.N)
        self.safe = safe
        self.k = torch.where(self.valid[..., None], a.k[safe].to(acc), 0.0)
        self.q = a.q[t0:t1].to(acc)
        self.w = a.weights[t0:t1].to(acc)
        dots = torch.einsum("chd,ckd->chk", self.q, self.k)
        self.dots = torch.where(self.valid[:, None, :], dots, 0.0)
        lg = torch.einsum("chk,ch->ck", torch.relu(self.dots), self.w) * a.sm_scale
        self.logits = torch.where(self.valid, lg, _NEG_INF)


def _relu_dot_bwd(q, w, dots, g, valid, sm_scale):
    """(ds [C, H, K], dw [C, H]) of logits = sm_scale * sum_h w * relu(dots), given g = dlogits.

    valid [C, K] (or [C, 1, K] broadcastable); g must be finite where valid.
    """
    g = torch.where(valid, g, 0.0)
    live = (dots > 0) & valid[:, None, :]
    ds = torch.where(live, g[:, None, :] * w[:, :, None] * sm_scale, 0.0)
    dw = torch.einsum("chk,ck->ch", torch.where(live, dots, 0.0), g) * sm_scale
    return ds, dw


def _sparse_bwd(a: SparseIndexerArgs, grad_of_chunk) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared backward loop; grad_of_chunk(slots, t0, t1) -> dlogits [C, K]."""
    acc = acc_dtype(a.q)
    T, H, D, K = a.T, a.H, a.D, a.K
    dq = torch.empty_like(a.q)
    dw = torch.empty_like(a.weights)
    dk = torch.zeros(a.N, D, device=a.k.device, dtype=acc)
    step = _row_chunk(K * (2 * D + 4 * H))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        sl = _IndexerSlots(a, t0, t1)
        ds, dw_c = _relu_dot_bwd(sl.q, sl.w, sl.dots, grad_of_chunk(sl, t0, t1), sl.valid, a.sm_scale)
        dq[t0:t1] = torch.einsum("chk,ckd->chd", ds, sl.k).to(dq.dtype)
        dw[t0:t1] = dw_c.to(dw.dtype)
        dk_slots = torch.einsum("chk,chd->ckd", ds, sl.q)
        dk_slots = torch.where(sl.valid[..., None], dk_slots, 0.0)  # not even 0 * NaN from a NaN q row
        if a.deterministic:
            dk += segment_sum(sl.safe.reshape(-1), dk_slots.reshape(-1, D), a.N)
        else:
            dk.index_add_(0, sl.safe.reshape(-1), dk_slots.reshape(-1, D))
    return dq, dk.to(a.k.dtype), dw


def sparse_indexer_fwd(a: SparseIndexerArgs) -> torch.Tensor:
    """-> logits [T, K] fp32 (fp64 for fp64 q), -inf on invalid slots."""
    out = torch.empty(a.T, a.K, device=a.q.device, dtype=acc_dtype(a.q))
    step = _row_chunk(a.K * (a.D + 2 * a.H))
    for t0 in range(0, a.T, step):
        t1 = min(a.T, t0 + step)
        out[t0:t1] = _IndexerSlots(a, t0, t1).logits
    return out


def sparse_indexer_bwd(a: SparseIndexerArgs, dlogits: torch.Tensor):
    """-> dq (q.dtype), dk (k.dtype, fp32-accumulated), dweights (weights.dtype)."""
    return _sparse_bwd(a, lambda sl, t0, t1: dlogits[t0:t1].to(sl.q.dtype))


def kl_stats(logits: torch.Tensor, valid: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """stats [C, 4] (loss_t, logsumexp of the logits, sum of valid target, has
    a valid slot) of rows of logits [C, K] (-inf on invalid slots), their
    slots' validity [C, K] and target [C, K], in the logits' dtype."""
    t = target.to(logits.dtype)
    lse = torch.logsumexp(logits, -1)  # -inf on an empty row
    live = valid & (t != 0)
    term = torch.where(live, t * (torch.log(torch.where(live, t, 1.0)) - (logits - lse[:, None])), 0.0)
    has = valid.any(-1)
    return torch.stack([torch.where(has, term.sum(-1), 0.0), lse, torch.where(valid, t, 0.0).sum(-1),
                        has.to(logits.dtype)], -1)


def indexer_kl_fwd(a: SparseIndexerArgs, target: torch.Tensor) -> torch.Tensor:
    """-> stats [T, 4] (loss_t, logsumexp of the logits, sum of valid target, has a valid slot)."""
    stats = torch.empty(a.T, 4, device=a.q.device, dtype=acc_dtype(a.q))
    step = _row_chunk(a.K * (a.D + 2 * a.H))
    for t0 in range(0, a.T, step):
        t1 = min(a.T, t0 + step)
        sl = _IndexerSlots(a, t0, t1)
        stats[t0:t1] = kl_stats(sl.logits, sl.valid, target[t0:t1])
    return stats


def kl_stats_of_logits(a: SparseIndexerArgs, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """indexer_kl_fwd's stats [T, 4] from logits [T, K] already computed (any
    backend's ``sparse_indexer_fwd``), the rows in chunks."""
    stats = torch.empty(a.T, 4, device=logits.device, dtype=logits.dtype)
    step = _row_chunk(a.K * 6)
    for t0 in range(0, a.T, step):
        t1 = min(a.T, t0 + step)
        length = None if a.topk_length is None else a.topk_length[t0:t1]
        valid, _ = slot_validity(a.indices[t0:t1], length, a.N)
        stats[t0:t1] = kl_stats(logits[t0:t1], valid, target[t0:t1])
    return stats


def indexer_kl_bwd(a: SparseIndexerArgs, target: torch.Tensor, stats: torch.Tensor, scale: torch.Tensor,
                   logits: Optional[torch.Tensor] = None):
    """-> dq, dk, dweights of scale * sum_t loss_t (scale = dloss / max(R, 1), a 0-dim tensor);
    logits (the deterministic forward's) are not needed: the chunks recompute theirs."""

    def grad(sl, t0, t1):
        lse = stats[t0:t1, STAT_LSE, None]
        tsum = stats[t0:t1, STAT_TSUM, None]
        p = torch.exp(torch.where(sl.valid, sl.logits - lse, _NEG_INF))
        return (p * tsum - target[t0:t1].to(p.dtype)) * scale.to(p.dtype)

    return _sparse_bwd(a, grad)


# --------------------------------------------------------------------------
# dense indexer backward


def indexer_scores_bwd(a: IndexerArgs, dscores: torch.Tensor):
    """Backward of ``indexer_scores`` -> dq (q.dtype), dk (k.dtype), dweights (weights.dtype).

    dscores [T_q, max_seqlen_k]; entries at keys a row does not see are ignored.
    """
    acc = acc_dtype(a.q)
    Tq, H, D = a.q.shape
    dq = torch.zeros(Tq, H, D, device=a.q.device, dtype=acc)
    dw = torch.zeros(Tq, H, device=a.q.device, dtype=acc)
    dk = torch.zeros(a.k.shape[0], D, device=a.k.device, dtype=acc)
    for k0, k1, kb, r0, r1, vis in _dense_chunks(a, a.k, 4 * H + 2 * D):
        q = a.q[r0:r1].to(acc)
        dots = torch.where(vis[:, None, :], torch.einsum("chd,jd->chj", q, kb), 0.0)
        g = dscores[r0:r1, : k1 - k0].to(acc)
        ds, dw_c = _relu_dot_bwd(q, a.weights[r0:r1].to(acc), dots, g, vis, a.sm_scale)
        # keys a row does not see are never read, and add nothing to dk (not
        # even 0 * NaN from a NaN key past the causal window or a NaN query row)
        k_vis = torch.where(vis[..., None], kb, 0.0)  # [C, S_k, D]
        dq[r0:r1] = torch.einsum("chj,cjd->chd", ds, k_vis)
        dw[r0:r1] = dw_c
        dk_rows = torch.einsum("chj,chd->cjd", ds, q)
        dk[k0:k1] += torch.where(vis[..., None], dk_rows, 0.0).sum(0)
    return dq.to(a.q.dtype), dk.to(a.k.dtype), dw.to(a.weights.dtype)


OPS = {
    "attention_target": attention_target,
    "dense_attention_target": dense_attention_target,
    "sparse_indexer_fwd": sparse_indexer_fwd,
    "sparse_indexer_bwd": sparse_indexer_bwd,
    "indexer_kl_fwd": indexer_kl_fwd,
    "indexer_kl_bwd": indexer_kl_bwd,
    "indexer_scores_bwd": indexer_scores_bwd,
}
