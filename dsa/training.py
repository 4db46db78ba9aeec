"""Training the indexer: attention targets, sparse indexer logits and the KL loss.

DeepSeek trains the lightning indexer to match the main attention
(docs/semantics.md, "Training the indexer"). For each query row the target is
the main attention's distribution over the selected slots, averaged over
heads; the loss is the KL divergence from it to the softmax of the indexer's
logits on the same slots:

    target = attention_target(q, kv, indices, lse)            # no gradient
    loss   = indexer_kl_loss(q_i, k_i, weights, indices, target)
    loss.backward()                                           # -> q_i, k_i, weights

The dense warm-up stage uses ``indexer_scores`` (differentiable, see
:mod:`dsa.ops.indexer`) against ``dense_attention_target``.

This module holds the public functions; their ``torch.library`` ops live in
:mod:`dsa.ops.training`, and the backends implement them on the canonical
arguments of :mod:`dsa._args` (``dsa/reference_training.py``,
``dsa/triton/training.py``, ``dsa/triton/indexer_bwd.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from torch import Tensor

from dsa import _checks, ops

Backend = str  # "auto" | "reference" | "triton" | "cute"


def _target(q, kv, indices, lse, sm_scale, d_v, sink, topk_length, backend):
    _checks.backend_arg(backend)
    a, lse, layout, head_axis = _checks.attention_target_args(q, kv, indices, lse, sm_scale, d_v, sink, topk_length)
    # sink and d_v do not change the target; d_v = D keeps the dataclass consistent
    a = dataclasses.replace(a, q=a.q.detach(), kv=a.kv.detach(), sink=None, d_v=a.D, deterministic=False)
    return a, lse.detach(), layout, head_axis


def attention_target(
    q: Tensor, kv: Tensor, indices: Tensor, lse: Tensor, *, sm_scale: Optional[float] = None,
    d_v: Optional[int] = None, sink: Optional[Tensor] = None, topk_length: Optional[Tensor] = None,
    backend: Backend = "auto",
) -> Tensor:
    """The main attention's distribution over its top-k slots: the indexer's target.

    target[t, j] = (1/H) sum_h exp(s[t, h, j] - lse[t, h]) on valid slots, 0 on
    invalid ones (a row with no valid slot is all 0), with s = sm_scale *
    q[t, h] . kv[indices[t, j]] over all D dims. Not differentiable.

    Layouts, dtypes and the validity rule are those of :func:`sparse_attention`
    (packed q [T, H, D], kv [N, D] or [N, H_kv, D], indices [T, K] or
    [T, H_kv, K] global rows, topk_length [T]; batched q [B, S, H, D], kv
    [B, N, D] or [B, N, H_kv, D], indices [B, S, K] or [B, S, H_kv, K] rows
    local to the batch, topk_length [B, S]). ``lse`` is [T, H] / [B, S, H]
    fp32 from ``sparse_attention(..., return_lse=True)`` (+inf on empty rows).

    Returns [T, K] / [B, S, K] fp32 (the shape of indices). With GQA (indices
    [.., H_kv, K]) it returns [.., H_kv, K], averaging over the H/H_kv query
    heads of each group.

    ``sink`` and ``d_v`` are accepted (and checked) for signature parity with
    ``sparse_attention`` but change nothing: lse excludes the sink, so the
    target sums to 1 over the valid slots of a row even with a sink, and the
    scores use all D dims whatever d_v is.
    """
    a, lse, layout, head_axis = _target(q, kv, indices, lse, sm_scale, d_v, sink, topk_length, backend)
    tgt = ops.call(ops.attention_target, a, lse, backend)
    if not head_axis:
        tgt = tgt.view(a.T, a.K)
    return layout.unpack(tgt)


def _dense(q, kv, ratio, sm_scale, causal, q_offsets, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, backend):
    _checks.backend_arg(backend)
    a, layout = _checks.dense_target_args(q, kv, ratio, sm_scale, causal, q_offsets, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_k)
    return dataclasses.replace(a, q=a.q.detach(), kv=a.kv.detach()), layout


def dense_attention_target(
    q: Tensor, kv: Tensor, *, ratio: int = 1, sm_scale: Optional[float] = None, causal: bool = True,
    q_offsets: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None, max_seqlen_k: Optional[int] = None, backend: Backend = "auto",
) -> Tensor:
    """Dense target of the indexer's warm-up stage, to compare with ``indexer_scores``.

    target[i, j] = (1/H) sum_h softmax over visible j of sm_scale * q[i, h] . kv[j]
    for visible j, 0 elsewhere; a row with no visible key is all 0. Visibility
    is the indexer's causal rule (query i of sequence b sees key j iff
    j < clamp((q_offsets[b] + i + 1) // ratio, 0, S_k)); with ``causal=False``
    every j < S_k is visible. Not differentiable.

    - batched: q [B, S_q, H, D], kv [B, S_k, D] -> [B, S_q, S_k] fp32;
    - packed: q [T_q, H, D], kv [T_k, D], cu_seqlens_q / cu_seqlens_k [B+1]
      (both omitted: one sequence) -> [T_q, max_seqlen_k] fp32, local key
      columns, 0 past each sequence's own S_k.

    kv is MQA (one latent row shared by all heads) and there is no sink.
    ``sm_scale`` defaults to 1/sqrt(D). Chunked over query rows: memory stays
    O(S_q * S_k) (the output) plus a bounded workspace.
    """
    a, layout = _dense(q, kv, ratio, sm_scale, causal, q_offsets, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, backend)
    return layout.unpack(ops.call(ops.dense_attention_target, a, backend))


def _logits(q_i, k_i, weights, indices, sm_scale, topk_length, deterministic, backend):
    _checks.backend_arg(backend)
    return _checks.sparse_indexer_args(q_i, k_i, weights, indices, sm_scale, topk_length, deterministic)


def sparse_indexer_scores(
    q_i: Tensor, k_i: Tensor, weights: Tensor, indices: Tensor, *, sm_scale: float = 1.0,
    topk_length: Optional[Tensor] = None, deterministic: bool = False, backend: Backend = "auto",
) -> Tensor:
    """The indexer's logits on the top-k slots of sparse attention.

    logits[t, j] = sm_scale * sum_h weights[t, h] * relu(q_i[t, h] . k_i[indices[t, j]])
    for valid slots, -inf otherwise (valid: j < clamp(topk_length[t], 0, K) and
    0 <= indices[t, j] < N, the rule of sparse attention).

    - packed: q_i [T, H_i, D_i], k_i [N, D_i], weights [T, H_i], indices [T, K]
      (global rows of k_i), topk_length [T] -> logits [T, K] fp32;
    - batched: q_i [B, S, H_i, D_i], k_i [B, N, D_i], weights [B, S, H_i],
      indices [B, S, K] (rows local to the batch), topk_length [B, S]
      -> logits [B, S, K] fp32.

    The indexer key is MQA (one k_i row shared by all H_i heads). q_i, k_i
    bf16/fp16 (fp32 on the reference and Triton backends); weights
    bf16/fp16/fp32; indices int32 (int64 accepted). Differentiable in q_i,
    k_i and weights (k_i's gradient accumulated in fp32; an invalid slot gets
    no gradient); ``deterministic=True`` makes the gradients bitwise
    reproducible.
    """
    a, layout = _logits(q_i, k_i, weights, indices, sm_scale, topk_length, deterministic, backend)
    return layout.unpack(ops.call(ops.sparse_indexer_fwd, a, backend))


def _kl(q_i, k_i, weights, indices, target, sm_scale, topk_length, deterministic, backend):
    a, _ = _logits(q_i, k_i, weights, indices, sm_scale, topk_length, deterministic, backend)
    return a, _checks.kl_target_arg(target, a, tuple(indices.shape)).detach()


def indexer_kl_loss(
    q_i: Tensor, k_i: Tensor, weights: Tensor, indices: Tensor, target: Tensor, *, sm_scale: float = 1.0,
    topk_length: Optional[Tensor] = None, deterministic: bool = False, backend: Backend = "auto",
) -> Tensor:
    """KL divergence from the attention target to the indexer's softmax, fused.

    loss = mean over rows t with a valid slot of
           sum_j target[t, j] * (log target[t, j] - log_softmax(logits[t])_j)
    with ``logits`` those of :func:`sparse_indexer_scores` (same layouts,
    keywords and validity rule) and the softmax over the valid slots of the
    row. Terms with target 0 count 0, and the target of an invalid slot is
    ignored (``attention_target`` gives 0 there). Rows with no valid slot are
    excluded from the mean; a loss with no valid row at all is 0.

    target: [T, K] / [B, S, K] (the shape of indices), e.g. from
    :func:`attention_target`; it gets no gradient. Returns a scalar fp32,
    differentiable in q_i, k_i and weights; the gradient of row t's logits is
    (softmax(logits[t]) * sum_valid target[t] - target[t]) / R (R the number
    of rows with a valid slot), 0 on invalid slots. Never holds the
    [T, K, H_i] intermediate in memory; ``deterministic=True`` makes the
    gradients bitwise reproducible.
    """
    a, tgt = _kl(q_i, k_i, weights, indices, target, sm_scale, topk_length, deterministic, backend)
    loss, _, _ = ops.call(ops.indexer_kl_fwd, a, tgt, backend)
    return loss


# public name -> (the public function, its preparation, the ops it runs), for dsa.explain
EXPLAIN = {
    "attention_target": (attention_target, _target, ("attention_target",)),
    "dense_attention_target": (dense_attention_target, _dense, ("dense_attention_target",)),
    "sparse_indexer_scores": (sparse_indexer_scores, _logits, ("sparse_indexer_fwd", "sparse_indexer_bwd")),
    "indexer_kl_loss": (indexer_kl_loss, _kl, ("indexer_kl_fwd", "indexer_kl_bwd")),
}
