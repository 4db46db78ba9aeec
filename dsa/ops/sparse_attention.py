"""``dsa::sparse_attention_fwd`` and ``dsa::sparse_attention_bwd``: definition, fake and autograd."""

from __future__ import annotations

import torch

from dsa._args import SparseAttnArgs
from dsa._rules import acc_dtype
from dsa.ops._core import op
from dsa.selector import select_kept


@op("sparse_attention_fwd", SparseAttnArgs, returns="(Tensor, Tensor)")
def sparse_attention_fwd(a: SparseAttnArgs, backend: str):
    """-> out [T, H, d_v] (q.dtype), lse [T, H] fp32 (+inf on rows with no valid slot)."""
    if a.empty:
        lse = torch.full((a.T, a.H), float("inf"), device=a.q.device, dtype=acc_dtype(a.q))
        return a.q.new_zeros(a.T, a.H, a.d_v), lse
    return select_kept("sparse_attention_fwd", a, backend).fn(a)


@sparse_attention_fwd.fake
def _(a: SparseAttnArgs, backend):
    return a.q.new_empty(a.T, a.H, a.d_v), a.q.new_empty(a.T, a.H, dtype=acc_dtype(a.q))


@op("sparse_attention_bwd", SparseAttnArgs, extra="Tensor out, Tensor lse, Tensor dout",
    returns="(Tensor, Tensor, Tensor)")
def sparse_attention_bwd(a: SparseAttnArgs, out, lse, dout, backend: str):
    """-> dq, dkv, dsink ([0]-shaped when there is no sink)."""
    n_sink = a.H if a.sink is not None else 0
    if a.empty:
        dsink = torch.zeros(n_sink, device=a.q.device, dtype=acc_dtype(a.q))
        return torch.zeros_like(a.q), torch.zeros_like(a.kv), dsink
    dq, dkv, dsink = select_kept("sparse_attention_bwd", a, backend).fn(a, out, lse, dout.contiguous())
    if dsink is None:
        dsink = a.q.new_zeros(0, dtype=acc_dtype(a.q))
    return dq, dkv, dsink


@sparse_attention_bwd.fake
def _(a: SparseAttnArgs, out, lse, dout, backend):
    n_sink = a.H if a.sink is not None else 0
    return torch.empty_like(a.q), torch.empty_like(a.kv), a.q.new_empty(n_sink, dtype=acc_dtype(a.q))


def _backward(ctx, a: SparseAttnArgs, rest, outputs, dout, _dlse):
    (backend,) = rest
    out, lse = outputs
    dq, dkv, dsink = sparse_attention_bwd(a, out, lse, dout, backend)
    return {"q": dq, "kv": dkv, "sink": dsink if a.sink is not None else None}


# lse is returned for inspection and for the indexer's target; it carries no gradient
sparse_attention_fwd.autograd(_backward, saved_outputs=lambda output: output, non_differentiable=(1,))
