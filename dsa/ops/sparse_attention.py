"""``dsa::sparse_attention_fwd`` and ``dsa::sparse_attention_bwd``: definition, fake and autograd."""

from __future__ import annotations

import torch

from dsa._args import SparseAttnArgs
from dsa._rules import acc_dtype
from dsa.ops._core import op
from dsa.selector import select_kept


def _no_bounds(a: SparseAttnArgs) -> torch.Tensor:
    return a.q.new_empty(0, dtype=torch.float32)


@op("sparse_attention_fwd", SparseAttnArgs, returns="(Tensor, Tensor, Tensor)")
def sparse_attention_fwd(a: SparseAttnArgs, backend: str):
    """-> out [T, H, d_v] (q.dtype), lse [T, H] fp32 (+inf on rows with no
    valid slot), bounds fp32 1-D: what a forward writes for its tier's
    deterministic backward (the cute SM90 forward with ``deterministic``:
    ``dsa.cute.sparse_attention.bound_views``), else empty."""
    if a.empty:
        lse = torch.full((a.T, a.H), float("inf"), device=a.q.device, dtype=acc_dtype(a.q))
        return a.q.new_zeros(a.T, a.H, a.d_v), lse, _no_bounds(a)
    res = select_kept("sparse_attention_fwd", a, backend).fn(a)
    return res if len(res) == 3 else (res[0], res[1], _no_bounds(a))


@sparse_attention_fwd.fake
def _(a: SparseAttnArgs, backend):
    # whether the bounds are written depends on the backend chosen at run time
    n = torch.library.get_ctx().new_dynamic_size() if a.deterministic else 0
    return (a.q.new_empty(a.T, a.H, a.d_v), a.q.new_empty(a.T, a.H, dtype=acc_dtype(a.q)),
            a.q.new_empty(n, dtype=torch.float32))


@op("sparse_attention_bwd", SparseAttnArgs, extra="Tensor out, Tensor lse, Tensor dout, Tensor bounds",
    returns="(Tensor, Tensor, Tensor)")
def sparse_attention_bwd(a: SparseAttnArgs, out, lse, dout, bounds, backend: str):
    """-> dq, dkv, dsink ([0]-shaped when there is no sink).  bounds: the
    forward's third output, passed to a backward that takes it
    (``takes_bounds``)."""
    n_sink = a.H if a.sink is not None else 0
    if a.empty:
        dsink = torch.zeros(n_sink, device=a.q.device, dtype=acc_dtype(a.q))
        return torch.zeros_like(a.q), torch.zeros_like(a.kv), dsink
    fn = select_kept("sparse_attention_bwd", a, backend).fn
    extra = (bounds,) if bounds.numel() and getattr(fn, "takes_bounds", False) else ()
    dq, dkv, dsink = fn(a, out, lse, dout.contiguous(), *extra)
    if dsink is None:
        dsink = a.q.new_zeros(0, dtype=acc_dtype(a.q))
    return dq, dkv, dsink


@sparse_attention_bwd.fake
def _(a: SparseAttnArgs, out, lse, dout, bounds, backend):
    n_sink = a.H if a.sink is not None else 0
    return torch.empty_like(a.q), torch.empty_like(a.kv), a.q.new_empty(n_sink, dtype=acc_dtype(a.q))


def _backward(ctx, a: SparseAttnArgs, rest, outputs, dout, _dlse, _dbounds):
    (backend,) = rest
    out, lse, bounds = outputs
    dq, dkv, dsink = sparse_attention_bwd(a, out, lse, dout, bounds, backend)
    return {"q": dq, "kv": dkv, "sink": dsink if a.sink is not None else None}


# lse is returned for inspection and for the indexer's target; neither it nor the bounds carry a gradient
sparse_attention_fwd.autograd(_backward, saved_outputs=lambda output: output, non_differentiable=(1, 2))
