"""``dsa::sparse_decode``: definition and fake (forward only: decode has no backward)."""

from __future__ import annotations

import torch

from dsa._args import SparseDecodeArgs
from dsa._rules import acc_dtype
from dsa.ops._core import op
from dsa.selector import select


@op("sparse_decode", SparseDecodeArgs, returns="(Tensor, Tensor)")
def sparse_decode(a: SparseDecodeArgs, backend: str):
    """-> out [T, H, d_v] (q.dtype), lse [T, H] fp32 (+inf on rows with no valid slot)."""
    if a.empty:
        lse = torch.full((a.T, a.H), float("inf"), device=a.q.device, dtype=acc_dtype(a.q))
        return a.q.new_zeros(a.T, a.H, a.d_v), lse
    return select("sparse_decode", a, backend).fn(a)


@sparse_decode.fake
def _(a: SparseDecodeArgs, backend):
    return a.q.new_empty(a.T, a.H, a.d_v), a.q.new_empty(a.T, a.H, dtype=acc_dtype(a.q))
