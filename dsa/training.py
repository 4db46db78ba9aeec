"""Training the indexer: attention targets, sparse indexer logits and the KL loss.

DeepSeek trains the lightning indexer to match the main attention (DESIGN.md
"Training the indexer"). For each query row the target is the main
attention's distribution over the selected slots, averaged over heads; the
loss is the KL divergence from it to the softmax of the indexer's logits on
the same slots:

    target = attention_target(q, kv, indices, lse)            # no gradient
    loss   = indexer_kl_loss(q_i, k_i, weights, indices, target)
    loss.backward()                                           # -> q_i, k_i, weights

The dense warm-up stage uses ``indexer_scores`` (made differentiable here)
against ``dense_attention_target``.

This module holds the ``torch.library`` custom ops (fake implementations for
``torch.compile``, autograd through ``register_autograd``, including the
autograd of the existing ``dsa::indexer_scores``) and the public functions.
Backends implement the ops on the canonical arguments of :mod:`dsa._args`
(``dsa/reference_training.py``, ``dsa/triton/training.py``,
``dsa/triton/indexer_bwd.py``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from dsa import _checks
from dsa import ops as _ops  # noqa: F401  (defines dsa::indexer_scores, whose autograd is registered here)
from dsa._args import DenseTargetArgs, IndexerArgs, SparseAttnArgs, SparseIndexerArgs
from dsa.selector import select

Backend = str  # "auto" | "reference" | "triton" | "cute"

# columns of the per-row stats of the KL forward (dsa.reference_training.STAT_*)
_STAT_LOSS, _STAT_VALID = 0, 3


def _acc(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------
# attention target (sparse)


def _target_args(q, kv, indices, topk_length, sm_scale) -> SparseAttnArgs:
    # sink and d_v do not change the target; d_v = D keeps the dataclass consistent
    return SparseAttnArgs(q, kv, indices, topk_length, None, sm_scale, q.shape[-1], False)


@torch.library.custom_op("dsa::attention_target", mutates_args=())
def _attention_target(
    q: Tensor, kv: Tensor, indices: Tensor, topk_length: Optional[Tensor], lse: Tensor, sm_scale: float, backend: str
) -> Tensor:
    a = _target_args(q, kv, indices, topk_length, sm_scale)
    if a.T == 0 or a.K == 0 or a.N == 0 or a.H == 0:
        return q.new_zeros(a.T, a.G, a.K, dtype=_acc(q))
    return select("attention_target", a, backend).fn(a, lse)


@_attention_target.register_fake
def _(q, kv, indices, topk_length, lse, sm_scale, backend):
    return q.new_empty(q.shape[0], kv.shape[1], indices.shape[2], dtype=_acc(q))


def attention_target(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    lse: Tensor,
    *,
    sm_scale: Optional[float] = None,
    d_v: Optional[int] = None,
    sink: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
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
    _checks.backend_arg(backend)
    a, lse, layout, head_axis = _checks.attention_target_args(
        q, kv, indices, lse, sm_scale=sm_scale, d_v=d_v, sink=sink, topk_length=topk_length
    )
    tgt = _attention_target(a.q.detach(), a.kv.detach(), a.indices, a.topk_length, lse.detach(), a.sm_scale, backend)
    if not head_axis:
        tgt = tgt.view(a.T, a.K)
    return layout.unpack(tgt)


# --------------------------------------------------------------------------
# dense attention target (warm-up stage)


@torch.library.custom_op("dsa::dense_attention_target", mutates_args=())
def _dense_attention_target(
    q: Tensor,
    kv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    q_offsets: Tensor,
    max_seqlen_k: int,
    ratio: int,
    causal: bool,
    sm_scale: float,
    backend: str,
) -> Tensor:
    a = DenseTargetArgs(q, kv, cu_seqlens_q, cu_seqlens_k, q_offsets, max_seqlen_k, ratio, causal, sm_scale)
    if q.shape[0] == 0 or kv.shape[0] == 0 or max_seqlen_k == 0 or q.shape[1] == 0:
        return q.new_zeros(q.shape[0], max_seqlen_k, dtype=_acc(q))
    return select("dense_attention_target", a, backend).fn(a)


@_dense_attention_target.register_fake
def _(q, kv, cu_seqlens_q, cu_seqlens_k, q_offsets, max_seqlen_k, ratio, causal, sm_scale, backend):
    return q.new_empty(q.shape[0], max_seqlen_k, dtype=_acc(q))


def _dense_call(q, kv, ratio, sm_scale, causal, q_offsets, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, backend):
    _checks.backend_arg(backend)
    return _checks.dense_target_args(
        q,
        kv,
        ratio=ratio,
        sm_scale=sm_scale,
        causal=causal,
        q_offsets=q_offsets,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_k=max_seqlen_k,
    )


def dense_attention_target(
    q: Tensor,
    kv: Tensor,
    *,
    ratio: int = 1,
    sm_scale: Optional[float] = None,
    causal: bool = True,
    q_offsets: Optional[Tensor] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_k: Optional[int] = None,
    backend: Backend = "auto",
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
    a, layout = _dense_call(
        q, kv, ratio, sm_scale, causal, q_offsets, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, backend
    )
    out = _dense_attention_target(
        a.q.detach(), a.kv.detach(), a.cu_seqlens_q, a.cu_seqlens_k, a.q_offsets, a.max_seqlen_k,
        a.ratio, a.causal, a.sm_scale, backend,
    )
    return layout.unpack(out)


# --------------------------------------------------------------------------
# sparse indexer logits


def _indexer_args(q, k, weights, indices, topk_length, sm_scale, deterministic) -> SparseIndexerArgs:
    return SparseIndexerArgs(q, k, weights, indices, topk_length, sm_scale, deterministic)


def _indexer_empty(a: SparseIndexerArgs) -> bool:
    return a.T == 0 or a.K == 0 or a.N == 0 or a.H == 0


def _zero_grads(a: SparseIndexerArgs) -> Tuple[Tensor, Tensor, Tensor]:
    return torch.zeros_like(a.q), torch.zeros_like(a.k), torch.zeros_like(a.weights)


@torch.library.custom_op("dsa::sparse_indexer_fwd", mutates_args=())
def _sparse_indexer_fwd(
    q: Tensor,
    k: Tensor,
    weights: Tensor,
    indices: Tensor,
    topk_length: Optional[Tensor],
    sm_scale: float,
    deterministic: bool,
    backend: str,
) -> Tensor:
    a = _indexer_args(q, k, weights, indices, topk_length, sm_scale, deterministic)
    if _indexer_empty(a):
        return torch.full((a.T, a.K), float("-inf"), device=q.device, dtype=_acc(q))
    return select("sparse_indexer_fwd", a, backend).fn(a)


@_sparse_indexer_fwd.register_fake
def _(q, k, weights, indices, topk_length, sm_scale, deterministic, backend):
    return q.new_empty(q.shape[0], indices.shape[1], dtype=_acc(q))


@torch.library.custom_op("dsa::sparse_indexer_bwd", mutates_args=())
def _sparse_indexer_bwd(
    q: Tensor,
    k: Tensor,
    weights: Tensor,
    indices: Tensor,
    topk_length: Optional[Tensor],
    dlogits: Tensor,
    sm_scale: float,
    deterministic: bool,
    backend: str,
) -> Tuple[Tensor, Tensor, Tensor]:
    a = _indexer_args(q, k, weights, indices, topk_length, sm_scale, deterministic)
    if _indexer_empty(a):
        return _zero_grads(a)
    return select("sparse_indexer_bwd", a, backend).fn(a, dlogits.contiguous())


@_sparse_indexer_bwd.register_fake
def _(q, k, weights, indices, topk_length, dlogits, sm_scale, deterministic, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(weights)


def _indexer_setup(ctx, inputs, output):
    q, k, weights, indices, topk_length, sm_scale, deterministic, backend = inputs
    ctx.save_for_backward(q, k, weights, indices, topk_length)
    ctx.cfg = (sm_scale, deterministic, backend)


def _indexer_backward(ctx, dlogits):
    q, k, weights, indices, topk_length = ctx.saved_tensors
    dq, dk, dw = _sparse_indexer_bwd(q, k, weights, indices, topk_length, dlogits, *ctx.cfg)
    return dq, dk, dw, None, None, None, None, None


torch.library.register_autograd("dsa::sparse_indexer_fwd", _indexer_backward, setup_context=_indexer_setup)


def sparse_indexer_scores(
    q_i: Tensor,
    k_i: Tensor,
    weights: Tensor,
    indices: Tensor,
    *,
    sm_scale: float = 1.0,
    topk_length: Optional[Tensor] = None,
    deterministic: bool = False,
    backend: Backend = "auto",
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
    _checks.backend_arg(backend)
    a, layout = _checks.sparse_indexer_args(
        q_i, k_i, weights, indices, sm_scale=sm_scale, topk_length=topk_length, deterministic=deterministic
    )
    logits = _sparse_indexer_fwd(
        a.q, a.k, a.weights, a.indices, a.topk_length, a.sm_scale, a.deterministic, backend
    )
    return layout.unpack(logits)


# --------------------------------------------------------------------------
# KL loss


@torch.library.custom_op("dsa::indexer_kl_fwd", mutates_args=())
def _indexer_kl_fwd(
    q: Tensor,
    k: Tensor,
    weights: Tensor,
    indices: Tensor,
    topk_length: Optional[Tensor],
    target: Tensor,
    sm_scale: float,
    deterministic: bool,
    backend: str,
) -> Tuple[Tensor, Tensor]:
    """-> loss [] and per-row stats [T, 4] (loss_t, lse of the logits, sum of valid target, has a valid slot)."""
    a = _indexer_args(q, k, weights, indices, topk_length, sm_scale, deterministic)
    if _indexer_empty(a):
        stats = torch.zeros(a.T, 4, device=q.device, dtype=_acc(q))
        stats[:, 1] = float("-inf")
        return q.new_zeros((), dtype=_acc(q)), stats
    stats = select("indexer_kl_fwd", a, backend).fn(a, target)
    # rows with no valid slot are out of the mean; with no valid row at all the loss is 0
    loss = stats[:, _STAT_LOSS].sum() / stats[:, _STAT_VALID].sum().clamp(min=1.0)
    return loss, stats


@_indexer_kl_fwd.register_fake
def _(q, k, weights, indices, topk_length, target, sm_scale, deterministic, backend):
    return q.new_empty((), dtype=_acc(q)), q.new_empty(q.shape[0], 4, dtype=_acc(q))


@torch.library.custom_op("dsa::indexer_kl_bwd", mutates_args=())
def _indexer_kl_bwd(
    q: Tensor,
    k: Tensor,
    weights: Tensor,
    indices: Tensor,
    topk_length: Optional[Tensor],
    target: Tensor,
    stats: Tensor,
    scale: Tensor,
    sm_scale: float,
    deterministic: bool,
    backend: str,
) -> Tuple[Tensor, Tensor, Tensor]:
    """scale: 0-dim, dloss / max(R, 1) (kept on the device: no host sync)."""
    a = _indexer_args(q, k, weights, indices, topk_length, sm_scale, deterministic)
    if _indexer_empty(a):
        return _zero_grads(a)
    return select("indexer_kl_bwd", a, backend).fn(a, target, stats, scale)


@_indexer_kl_bwd.register_fake
def _(q, k, weights, indices, topk_length, target, stats, scale, sm_scale, deterministic, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(weights)


def _kl_setup(ctx, inputs, output):
    q, k, weights, indices, topk_length, target, sm_scale, deterministic, backend = inputs
    _, stats = output
    ctx.save_for_backward(q, k, weights, indices, topk_length, target, stats)
    ctx.cfg = (sm_scale, deterministic, backend)
    ctx.mark_non_differentiable(stats)


def _kl_backward(ctx, dloss, _dstats):
    q, k, weights, indices, topk_length, target, stats = ctx.saved_tensors
    scale = (dloss / stats[:, _STAT_VALID].sum().clamp(min=1.0)).to(stats.dtype)
    dq, dk, dw = _indexer_kl_bwd(q, k, weights, indices, topk_length, target, stats, scale, *ctx.cfg)
    # the target is not differentiated (it comes from the detached main attention)
    return dq, dk, dw, None, None, None, None, None, None


torch.library.register_autograd("dsa::indexer_kl_fwd", _kl_backward, setup_context=_kl_setup)


def _kl_call(q_i, k_i, weights, indices, target, sm_scale, topk_length, deterministic, backend):
    _checks.backend_arg(backend)
    a, _ = _checks.sparse_indexer_args(
        q_i, k_i, weights, indices, sm_scale=sm_scale, topk_length=topk_length, deterministic=deterministic
    )
    return a, _checks.kl_target_arg(target, a, tuple(indices.shape)).detach()


def indexer_kl_loss(
    q_i: Tensor,
    k_i: Tensor,
    weights: Tensor,
    indices: Tensor,
    target: Tensor,
    *,
    sm_scale: float = 1.0,
    topk_length: Optional[Tensor] = None,
    deterministic: bool = False,
    backend: Backend = "auto",
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
    a, tgt = _kl_call(q_i, k_i, weights, indices, target, sm_scale, topk_length, deterministic, backend)
    loss, _ = _indexer_kl_fwd(
        a.q, a.k, a.weights, a.indices, a.topk_length, tgt, a.sm_scale, a.deterministic, backend
    )
    return loss


# --------------------------------------------------------------------------
# autograd of the dense indexer scores (dsa::indexer_scores, defined in dsa.ops)


@torch.library.custom_op("dsa::indexer_scores_bwd", mutates_args=())
def _indexer_scores_bwd(
    q: Tensor,
    k: Tensor,
    weights: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    q_offsets: Tensor,
    max_seqlen_k: int,
    ratio: int,
    causal: bool,
    sm_scale: float,
    dscores: Tensor,
    backend: str,
) -> Tuple[Tensor, Tensor, Tensor]:
    """-> dq, dk, dweights of indexer_scores; dscores at non-visible keys are ignored."""
    a = IndexerArgs(q, k, weights, cu_seqlens_q, cu_seqlens_k, q_offsets, max_seqlen_k, ratio, causal, sm_scale)
    if q.shape[0] == 0 or k.shape[0] == 0 or max_seqlen_k == 0 or q.shape[1] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(weights)
    return select("indexer_scores_bwd", a, backend).fn(a, dscores.contiguous())


@_indexer_scores_bwd.register_fake
def _(q, k, weights, cu_seqlens_q, cu_seqlens_k, q_offsets, max_seqlen_k, ratio, causal, sm_scale, dscores, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(weights)


def _scores_setup(ctx, inputs, output):
    q, k, weights, cu_q, cu_k, q_offsets, max_seqlen_k, ratio, causal, sm_scale, backend = inputs
    ctx.save_for_backward(q, k, weights, cu_q, cu_k, q_offsets)
    ctx.cfg = (max_seqlen_k, ratio, causal, sm_scale)
    ctx.backend = backend


def _scores_backward(ctx, dscores):
    q, k, weights, cu_q, cu_k, q_offsets = ctx.saved_tensors
    dq, dk, dw = _indexer_scores_bwd(q, k, weights, cu_q, cu_k, q_offsets, *ctx.cfg, dscores, ctx.backend)
    return dq, dk, dw, None, None, None, None, None, None, None, None


torch.library.register_autograd("dsa::indexer_scores", _scores_backward, setup_context=_scores_setup)


# --------------------------------------------------------------------------
# explain


def _explain_target(q, kv, indices, lse, *, sm_scale=None, d_v=None, sink=None, topk_length=None, backend="auto"):
    _checks.backend_arg(backend)
    a, _, _, _ = _checks.attention_target_args(
        q, kv, indices, lse, sm_scale=sm_scale, d_v=d_v, sink=sink, topk_length=topk_length
    )
    shape = f"T={a.T} H={a.H} H_kv={a.G} D={a.D} K={a.K} N={a.N} {str(a.q.dtype).replace('torch.', '')}"
    return f"attention_target [{shape}]\n" + select("attention_target", a, backend).describe("attention_target")


def _describe_sparse_indexer(name, fwd, bwd, a, backend):
    shape = f"T={a.T} H_i={a.H} D_i={a.D} K={a.K} N={a.N} {str(a.q.dtype).replace('torch.', '')}"
    parts = [f"{name} [{shape}]"] + [select(op, a, backend).describe(op) for op in (fwd, bwd)]
    return "\n".join(parts)


def _explain_sparse_indexer(q_i, k_i, weights, indices, *, sm_scale=1.0, topk_length=None, deterministic=False,
                            backend="auto"):
    _checks.backend_arg(backend)
    a, _ = _checks.sparse_indexer_args(
        q_i, k_i, weights, indices, sm_scale=sm_scale, topk_length=topk_length, deterministic=deterministic
    )
    return _describe_sparse_indexer("sparse_indexer_scores", "sparse_indexer_fwd", "sparse_indexer_bwd", a, backend)


def _explain_kl(q_i, k_i, weights, indices, target, *, sm_scale=1.0, topk_length=None, deterministic=False,
                backend="auto"):
    a, _ = _kl_call(q_i, k_i, weights, indices, target, sm_scale, topk_length, deterministic, backend)
    return _describe_sparse_indexer("indexer_kl_loss", "indexer_kl_fwd", "indexer_kl_bwd", a, backend)


def _explain_dense(q, kv, *, ratio=1, sm_scale=None, causal=True, q_offsets=None, cu_seqlens_q=None,
                   cu_seqlens_k=None, max_seqlen_k=None, backend="auto"):
    a, _ = _dense_call(q, kv, ratio, sm_scale, causal, q_offsets, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, backend)
    return select("dense_attention_target", a, backend).describe("dense_attention_target")


EXPLAIN = {
    "attention_target": _explain_target,
    "sparse_indexer_scores": _explain_sparse_indexer,
    "indexer_kl_loss": _explain_kl,
    "dense_attention_target": _explain_dense,
}
