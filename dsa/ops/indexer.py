"""The lightning indexer's ops: ``dsa::indexer_scores`` (definition, fake,
autograd and its backward op ``dsa::indexer_scores_bwd``) and the fused
``dsa::indexer_topk``."""

from __future__ import annotations

import torch

from dsa._args import IndexerArgs
from dsa._rules import acc_dtype
from dsa.ops._core import no_selection, op
from dsa.selector import select_kept


@op("indexer_scores", IndexerArgs)
def indexer_scores(a: IndexerArgs, backend: str):
    """-> scores [T_q, max_seqlen_k] fp32, -inf where not visible."""
    if a.empty:
        return torch.full((a.q.shape[0], a.max_seqlen_k), float("-inf"), device=a.q.device, dtype=acc_dtype(a.q))
    return select_kept("indexer_scores", a, backend).fn(a)


@indexer_scores.fake
def _(a: IndexerArgs, backend):
    return a.q.new_empty(a.q.shape[0], a.max_seqlen_k, dtype=acc_dtype(a.q))


@op("indexer_scores_bwd", IndexerArgs, extra="Tensor dscores", returns="(Tensor, Tensor, Tensor)")
def indexer_scores_bwd(a: IndexerArgs, dscores, backend: str):
    """-> dq, dk, dweights of indexer_scores; dscores at non-visible keys are ignored."""
    if a.empty:
        return torch.zeros_like(a.q), torch.zeros_like(a.k), torch.zeros_like(a.weights)
    return select_kept("indexer_scores_bwd", a, backend).fn(a, dscores.contiguous())


@indexer_scores_bwd.fake
def _(a: IndexerArgs, dscores, backend):
    return torch.empty_like(a.q), torch.empty_like(a.k), torch.empty_like(a.weights)


def _scores_backward(ctx, a: IndexerArgs, rest, _outputs, dscores):
    (backend,) = rest
    dq, dk, dw = indexer_scores_bwd(a, dscores, backend)
    return {"q": dq, "k": dk, "weights": dw}


indexer_scores.autograd(_scores_backward)


@op("indexer_topk", IndexerArgs, extra="SymInt topk", returns="(Tensor, Tensor)")
def indexer_topk(a: IndexerArgs, topk: int, backend: str):
    """-> indices [T_q, topk] int32 (local key positions, -1 padded), lengths [T_q] int32."""
    if a.empty or topk == 0:
        return no_selection(a.q.shape[0], topk, a.q.device)
    return select_kept("indexer_topk", a, backend).fn(a, topk)


@indexer_topk.fake
def _(a: IndexerArgs, topk, backend):
    T = a.q.shape[0]
    return a.q.new_empty(T, topk, dtype=torch.int32), a.q.new_empty(T, dtype=torch.int32)
