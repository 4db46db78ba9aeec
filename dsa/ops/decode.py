"""``dsa::sparse_decode``: definition and fake (forward only: decode has no backward).

A decode step calls the op once a layer with the same shapes, so the
selector's choice is kept per shape (``SparseDecodeArgs.shape_key``), the
backend asked for and the two environment variables that steer it: the
selector runs once per such key, not once per call (:func:`choice`).

A backend's implementation ``fn(a) -> (out, lse)`` may also offer
``fn.prepare(a, reuse_workspace) -> run``: everything a call of ``a``'s
metadata needs but its tensors, built once (``dsa.SparseDecodePlan`` and
the eager ``dsa.sparse_decode`` use it). ``run(q, kv, indices, topk_length,
block_table, seq_lens, sink, out, lse)`` takes the canonical tensors of a
call whose metadata is ``a``'s (contiguous, each in the canonical shape or
another of the same elements, e.g. q [B, S_q, H, D] for [T, H, D]) and
writes out [T, H, d_v] (q.dtype) and lse [T, H] fp32 into the given
contiguous tensors; it allocates nothing whose size depends on values and
reads nothing back to the host. With ``reuse_workspace`` its scratch memory
is allocated once and shared by its calls (which must then be ordered on
one stream); without, every call allocates its own. A backend without
``prepare`` is called as ``fn(a)``.
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch

from dsa._args import SparseDecodeArgs
from dsa._rules import acc_dtype
from dsa.ops._core import op
from dsa.selector import Choice, select_kept


def choice(a: SparseDecodeArgs, backend: str) -> Choice:
    """The selector's choice for ``a``, kept per shape, backend and steering environment variables."""
    return select_kept("sparse_decode", a, backend, a.shape_key)


def empty(a: SparseDecodeArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    """The result of a call without rows, slots, keys or heads: out 0, lse +inf (no kernel)."""
    lse = torch.full((a.T, a.H), float("inf"), device=a.q.device, dtype=acc_dtype(a.q))
    return a.q.new_zeros(a.T, a.H, a.d_v), lse


def run_fresh(run: Callable[..., None], a: SparseDecodeArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    """A prepared ``run`` on a's tensors into new outputs: out [T, H, d_v] (q.dtype), lse [T, H] fp32."""
    out = a.q.new_empty(a.T, a.H, a.d_v)
    lse = a.q.new_empty(a.T, a.H, dtype=torch.float32)
    run(a.q, a.kv, a.indices, a.topk_length, a.block_table, a.seq_lens, a.sink, out, lse)
    return out, lse


@op("sparse_decode", SparseDecodeArgs, returns="(Tensor, Tensor)")
def sparse_decode(a: SparseDecodeArgs, backend: str):
    """-> out [T, H, d_v] (q.dtype), lse [T, H] fp32 (+inf on rows with no valid slot)."""
    if a.empty:
        return empty(a)
    return choice(a, backend).fn(a)


@sparse_decode.fake
def _(a: SparseDecodeArgs, backend):
    return a.q.new_empty(a.T, a.H, a.d_v), a.q.new_empty(a.T, a.H, dtype=acc_dtype(a.q))
