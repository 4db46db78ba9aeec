"""``dsa::topk``: top-k over the last dim of a 2-D score matrix."""

from __future__ import annotations

import torch

from dsa._args import TopkArgs
from dsa.ops._core import no_selection, op
from dsa.selector import select_kept


@op("topk", TopkArgs, returns="(Tensor, Tensor)")
def topk(a: TopkArgs, backend: str):
    """-> indices [R, topk] int32 (ascending, -1 padded), lengths [R] int32."""
    if a.empty:
        return no_selection(a.scores.shape[0], a.topk, a.scores.device)
    return select_kept("topk", a, backend).fn(a)


@topk.fake
def _(a: TopkArgs, backend):
    R = a.scores.shape[0]
    return a.scores.new_empty(R, a.topk, dtype=torch.int32), a.scores.new_empty(R, dtype=torch.int32)
