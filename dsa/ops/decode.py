"""``dsa::sparse_decode``: definition and fake (forward only: decode has no backward).

A decode step calls the op once a layer with the same shapes, so the
selector's choice is kept per shape (``SparseDecodeArgs.shape_key``), the
backend asked for and the two environment variables that steer it: the
selector runs once per such key, not once per call.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Tuple

import torch

from dsa._args import SparseDecodeArgs
from dsa._rules import acc_dtype
from dsa.ops._core import op
from dsa.selector import select


_CHOICES: Dict[Tuple, Callable[..., Any]] = {}


def _chosen(a: SparseDecodeArgs, backend: str) -> Callable[..., Any]:
    key = (a.shape_key, backend, os.environ.get("DSA_BACKEND"), os.environ.get("DSA_DISABLE_CUTE"))
    fn = _CHOICES.get(key)
    if fn is None:
        if len(_CHOICES) >= 4096:
            _CHOICES.clear()
        fn = _CHOICES[key] = select("sparse_decode", a, backend).fn
    return fn


@op("sparse_decode", SparseDecodeArgs, returns="(Tensor, Tensor)")
def sparse_decode(a: SparseDecodeArgs, backend: str):
    """-> out [T, H, d_v] (q.dtype), lse [T, H] fp32 (+inf on rows with no valid slot)."""
    if a.empty:
        lse = torch.full((a.T, a.H), float("inf"), device=a.q.device, dtype=acc_dtype(a.q))
        return a.q.new_zeros(a.T, a.H, a.d_v), lse
    return _chosen(a, backend)(a)


@sparse_decode.fake
def _(a: SparseDecodeArgs, backend):
    return a.q.new_empty(a.T, a.H, a.d_v), a.q.new_empty(a.T, a.H, dtype=acc_dtype(a.q))
