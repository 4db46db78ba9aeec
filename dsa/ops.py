"""The ``torch.library`` custom ops behind the public API.

Each op takes canonical tensors (see :mod:`dsa._args`) plus plain scalars and
the requested backend name, and picks the implementation at run time through
:mod:`dsa.selector`. Fake (meta) implementations give ``torch.compile`` the
output shapes, so a compiled graph calls these ops without breaking. Empty
problems are answered here, before any backend, so that no kernel is ever
launched on them.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.utils._python_dispatch
from torch import Tensor

from dsa._args import IndexerArgs, SparseAttnArgs, TopkArgs
from dsa.selector import select

# op -> its Python body, for calls that need nothing from the dispatcher
_BODIES = {}


def _op(name: str):
    """torch.library.custom_op(name), keeping the body for :func:`call`."""

    def wrap(fn):
        op = torch.library.custom_op(name, mutates_args=())(fn)
        _BODIES[op] = fn
        return op

    return wrap


def call(op, *args):
    """``op(*args)``, or its body directly when the dispatcher has nothing to
    add: no tracing or compiling, no dispatch mode or functorch transform, no
    tensor subclass, and no autograd (grad mode off or no input requiring
    grad). Same body, same result; it saves the dispatcher's host time
    (tens of microseconds a call), which short kernels would otherwise wait
    on."""
    if (
        torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
        or torch.utils._python_dispatch._get_current_dispatch_mode() is not None
    ):
        return op(*args)
    grad = torch.is_grad_enabled()
    for x in args:
        if isinstance(x, Tensor) and (type(x) is not Tensor or (grad and x.requires_grad)):
            return op(*args)
    return _BODIES[op](*args)


def _acc_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def sparse_args(q, kv, indices, topk_length, sink, sm_scale, d_v, deterministic) -> SparseAttnArgs:
    return SparseAttnArgs(q, kv, indices, topk_length, sink, sm_scale, d_v, deterministic)


def _sparse_empty(a: SparseAttnArgs) -> bool:
    return a.T == 0 or a.K == 0 or a.N == 0 or a.H == 0


# --------------------------------------------------------------------------
# sparse attention


@_op("dsa::sparse_attention_fwd")
def sparse_attention_fwd(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    topk_length: Optional[Tensor],
    sink: Optional[Tensor],
    sm_scale: float,
    d_v: int,
    deterministic: bool,
    backend: str,
) -> Tuple[Tensor, Tensor]:
    a = sparse_args(q, kv, indices, topk_length, sink, sm_scale, d_v, deterministic)
    if _sparse_empty(a):
        out = q.new_zeros(a.T, a.H, d_v)
        return out, torch.full((a.T, a.H), float("inf"), device=q.device, dtype=_acc_dtype(q))
    return select("sparse_attention_fwd", a, backend).fn(a)


@sparse_attention_fwd.register_fake
def _(q, kv, indices, topk_length, sink, sm_scale, d_v, deterministic, backend):
    T, H = q.shape[0], q.shape[1]
    return q.new_empty(T, H, d_v), q.new_empty(T, H, dtype=_acc_dtype(q))


@torch.library.custom_op("dsa::sparse_attention_bwd", mutates_args=())
def sparse_attention_bwd(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    topk_length: Optional[Tensor],
    sink: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    sm_scale: float,
    d_v: int,
    deterministic: bool,
    backend: str,
) -> Tuple[Tensor, Tensor, Tensor]:
    """-> dq, dkv, dsink ([0]-shaped when there is no sink)."""
    a = sparse_args(q, kv, indices, topk_length, sink, sm_scale, d_v, deterministic)
    if _sparse_empty(a):
        dsink = torch.zeros(a.H if sink is not None else 0, device=q.device, dtype=_acc_dtype(q))
        return torch.zeros_like(q), torch.zeros_like(kv), dsink
    dq, dkv, dsink = select("sparse_attention_bwd", a, backend).fn(a, out, lse, dout.contiguous())
    if dsink is None:
        dsink = q.new_zeros(0, dtype=_acc_dtype(q))
    return dq, dkv, dsink


@sparse_attention_bwd.register_fake
def _(q, kv, indices, topk_length, sink, out, lse, dout, sm_scale, d_v, deterministic, backend):
    n_sink = q.shape[1] if sink is not None else 0
    return torch.empty_like(q), torch.empty_like(kv), q.new_empty(n_sink, dtype=_acc_dtype(q))


def _sparse_setup(ctx, inputs, output):
    q, kv, indices, topk_length, sink, sm_scale, d_v, deterministic, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, indices, topk_length, sink, out, lse)
    ctx.cfg = (sm_scale, d_v, deterministic, backend)
    ctx.has_sink = sink is not None
    # lse is returned for inspection and for the indexer's target; it carries no gradient
    ctx.mark_non_differentiable(lse)


def _sparse_backward(ctx, dout, _dlse):
    q, kv, indices, topk_length, sink, out, lse = ctx.saved_tensors
    dq, dkv, dsink = sparse_attention_bwd(q, kv, indices, topk_length, sink, out, lse, dout, *ctx.cfg)
    return dq, dkv, None, None, (dsink if ctx.has_sink else None), None, None, None, None


torch.library.register_autograd("dsa::sparse_attention_fwd", _sparse_backward, setup_context=_sparse_setup)


# --------------------------------------------------------------------------
# indexer


def indexer_args(q, k, weights, cu_q, cu_k, q_offsets, max_seqlen_k, ratio, causal, sm_scale) -> IndexerArgs:
    return IndexerArgs(q, k, weights, cu_q, cu_k, q_offsets, max_seqlen_k, ratio, causal, sm_scale)


@_op("dsa::indexer_scores")
def indexer_scores(
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
    backend: str,
) -> Tensor:
    a = indexer_args(q, k, weights, cu_seqlens_q, cu_seqlens_k, q_offsets, max_seqlen_k, ratio, causal, sm_scale)
    if q.shape[0] == 0 or k.shape[0] == 0 or max_seqlen_k == 0 or q.shape[1] == 0:
        return torch.full((q.shape[0], max_seqlen_k), float("-inf"), device=q.device, dtype=_acc_dtype(q))
    return select("indexer_scores", a, backend).fn(a)


@indexer_scores.register_fake
def _(q, k, weights, cu_seqlens_q, cu_seqlens_k, q_offsets, max_seqlen_k, ratio, causal, sm_scale, backend):
    return q.new_empty(q.shape[0], max_seqlen_k, dtype=_acc_dtype(q))


def _no_selection(rows: int, k: int, device) -> Tuple[Tensor, Tensor]:
    return (
        torch.full((rows, k), -1, device=device, dtype=torch.int32),
        torch.zeros(rows, device=device, dtype=torch.int32),
    )


@_op("dsa::indexer_topk")
def indexer_topk(
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
    topk: int,
    backend: str,
) -> Tuple[Tensor, Tensor]:
    a = indexer_args(q, k, weights, cu_seqlens_q, cu_seqlens_k, q_offsets, max_seqlen_k, ratio, causal, sm_scale)
    if q.shape[0] == 0 or k.shape[0] == 0 or max_seqlen_k == 0 or topk == 0 or q.shape[1] == 0:
        return _no_selection(q.shape[0], topk, q.device)
    return select("indexer_topk", a, backend).fn(a, topk)


@indexer_topk.register_fake
def _(q, k, weights, cu_seqlens_q, cu_seqlens_k, q_offsets, max_seqlen_k, ratio, causal, sm_scale, topk, backend):
    T = q.shape[0]
    return q.new_empty(T, topk, dtype=torch.int32), q.new_empty(T, dtype=torch.int32)


# --------------------------------------------------------------------------
# top-k


@_op("dsa::topk")
def topk(scores: Tensor, k: int, backend: str) -> Tuple[Tensor, Tensor]:
    R, S = scores.shape
    if R == 0 or S == 0 or k == 0:
        return _no_selection(R, k, scores.device)
    a = TopkArgs(scores, k)
    return select("topk", a, backend).fn(a)


@topk.register_fake
def _(scores, k, backend):
    R = scores.shape[0]
    return scores.new_empty(R, k, dtype=torch.int32), scores.new_empty(R, dtype=torch.int32)
