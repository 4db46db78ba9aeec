"""The indexer-training ops: the attention targets (``dsa::attention_target``,
``dsa::dense_attention_target``), the sparse indexer logits
(``dsa::sparse_indexer_fwd`` / ``_bwd``) and the fused KL loss
(``dsa::indexer_kl_fwd`` / ``_bwd``), each with its fake and autograd."""

from __future__ import annotations

import torch

from dsa._args import DenseTargetArgs, SparseAttnArgs, SparseIndexerArgs
from dsa._rules import acc_dtype
from dsa.ops._core import op
from dsa.selector import select_kept

# columns of the per-row stats of the KL forward (dsa.reference_training.STAT_*)
STAT_LOSS, STAT_VALID = 0, 3


def _zero_grads(a: SparseIndexerArgs):
    return torch.zeros_like(a.q), torch.zeros_like(a.k), torch.zeros_like(a.weights)


def _empty_grads(a: SparseIndexerArgs):
    return torch.empty_like(a.q), torch.empty_like(a.k), torch.empty_like(a.weights)


# --------------------------------------------------------------------------
# attention targets (not differentiable)


@op("attention_target", SparseAttnArgs, extra="Tensor lse")
def attention_target(a: SparseAttnArgs, lse, backend: str):
    """-> target [T, G, K] fp32; lse [T, H] from sparse attention. Sink and d_v do not enter."""
    if a.empty:
        return a.q.new_zeros(a.T, a.G, a.K, dtype=acc_dtype(a.q))
    return select_kept("attention_target", a, backend).fn(a, lse)


@attention_target.fake
def _(a: SparseAttnArgs, lse, backend):
    return a.q.new_empty(a.T, a.G, a.K, dtype=acc_dtype(a.q))


@op("dense_attention_target", DenseTargetArgs)
def dense_attention_target(a: DenseTargetArgs, backend: str):
    """-> target [T_q, max_seqlen_k] fp32, 0 where not visible."""
    if a.empty:
        return a.q.new_zeros(a.q.shape[0], a.max_seqlen_k, dtype=acc_dtype(a.q))
    return select_kept("dense_attention_target", a, backend).fn(a)


@dense_attention_target.fake
def _(a: DenseTargetArgs, backend):
    return a.q.new_empty(a.q.shape[0], a.max_seqlen_k, dtype=acc_dtype(a.q))


# --------------------------------------------------------------------------
# sparse indexer logits


@op("sparse_indexer_fwd", SparseIndexerArgs)
def sparse_indexer_fwd(a: SparseIndexerArgs, backend: str):
    """-> logits [T, K] fp32, -inf on invalid slots."""
    if a.empty:
        return torch.full((a.T, a.K), float("-inf"), device=a.q.device, dtype=acc_dtype(a.q))
    return select_kept("sparse_indexer_fwd", a, backend).fn(a)


@sparse_indexer_fwd.fake
def _(a: SparseIndexerArgs, backend):
    return a.q.new_empty(a.T, a.K, dtype=acc_dtype(a.q))


@op("sparse_indexer_bwd", SparseIndexerArgs, extra="Tensor dlogits", returns="(Tensor, Tensor, Tensor)")
def sparse_indexer_bwd(a: SparseIndexerArgs, dlogits, backend: str):
    """-> dq, dk, dweights of the sparse indexer logits."""
    if a.empty:
        return _zero_grads(a)
    return select_kept("sparse_indexer_bwd", a, backend).fn(a, dlogits.contiguous())


@sparse_indexer_bwd.fake
def _(a: SparseIndexerArgs, dlogits, backend):
    return _empty_grads(a)


def _logits_backward(ctx, a: SparseIndexerArgs, rest, _outputs, dlogits):
    (backend,) = rest
    return dict(zip(("q", "k", "weights"), sparse_indexer_bwd(a, dlogits, backend)))


sparse_indexer_fwd.autograd(_logits_backward)


# --------------------------------------------------------------------------
# KL loss


@op("indexer_kl_fwd", SparseIndexerArgs, extra="Tensor target", returns="(Tensor, Tensor, Tensor)")
def indexer_kl_fwd(a: SparseIndexerArgs, target, backend: str):
    """-> loss [], per-row stats [T, 4] (loss_t, lse of the logits, sum of
    valid target, has a valid slot) and, deterministic, the logits [T, K]
    the backward may bound its dk sums with ([0, K] otherwise).  The
    deterministic forward is the chosen backend's logits kernel, the stats
    taken from its logits (``kl_stats_of_logits``: the reference's in
    PyTorch, the kernels' by a Triton pass)."""
    acc = acc_dtype(a.q)
    if a.empty:
        stats = torch.zeros(a.T, 4, device=a.q.device, dtype=acc)
        stats[:, 1] = float("-inf")
        return a.q.new_zeros((), dtype=acc), stats, a.q.new_empty(_logits_rows(a), a.K, dtype=acc)
    choice = select_kept("indexer_kl_fwd", a, backend)
    if a.deterministic:
        if choice.backend == "reference":
            from dsa.reference_training import kl_stats_of_logits
        else:
            from dsa.triton.training import kl_stats_of_logits
        logits = select_kept("sparse_indexer_fwd", a, choice.backend).fn(a)
        stats = kl_stats_of_logits(a, logits, target)
    else:
        logits = a.q.new_empty(0, a.K, dtype=acc)
        stats = choice.fn(a, target)
    # rows with no valid slot are out of the mean; with no valid row at all the loss is 0
    loss = stats[:, STAT_LOSS].sum() / stats[:, STAT_VALID].sum().clamp(min=1.0)
    return loss, stats, logits


def _logits_rows(a: SparseIndexerArgs) -> int:
    return a.T if a.deterministic else 0


@indexer_kl_fwd.fake
def _(a: SparseIndexerArgs, target, backend):
    acc = acc_dtype(a.q)
    return a.q.new_empty((), dtype=acc), a.q.new_empty(a.T, 4, dtype=acc), a.q.new_empty(_logits_rows(a), a.K,
                                                                                         dtype=acc)


@op("indexer_kl_bwd", SparseIndexerArgs, extra="Tensor target, Tensor stats, Tensor scale, Tensor logits",
    returns="(Tensor, Tensor, Tensor)")
def indexer_kl_bwd(a: SparseIndexerArgs, target, stats, scale, logits, backend: str):
    """scale: 0-dim, dloss / max(R, 1) (kept on the device: no host sync);
    logits: the forward's third output."""
    if a.empty:
        return _zero_grads(a)
    return select_kept("indexer_kl_bwd", a, backend).fn(a, target, stats, scale, logits if logits.numel() else None)


@indexer_kl_bwd.fake
def _(a: SparseIndexerArgs, target, stats, scale, logits, backend):
    return _empty_grads(a)


def _kl_backward(ctx, a: SparseIndexerArgs, rest, outputs, dloss, _dstats, _dlogits):
    target, backend = rest
    stats, logits = outputs
    scale = (dloss / stats[:, STAT_VALID].sum().clamp(min=1.0)).to(stats.dtype)
    # the target is not differentiated (it comes from the detached main attention)
    return dict(zip(("q", "k", "weights"), indexer_kl_bwd(a, target, stats, scale, logits, backend)))


indexer_kl_fwd.autograd(_kl_backward, saved_outputs=lambda output: output[1:], non_differentiable=(1, 2))
