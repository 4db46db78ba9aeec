"""Public API of dsa: sparse attention, the lightning indexer and top-k.

Every function checks its input once (:mod:`dsa._checks`), reduces the layout
to the canonical one of :mod:`dsa._args`, and calls a ``torch.library``
custom op (:mod:`dsa.ops`) that picks the backend (:mod:`dsa.selector`).
:func:`explain` checks the same arguments the same way and reports the
selector's choice instead of running it.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Optional, Tuple, Union

import torch
from torch import Tensor

from dsa import _checks, decode, ops, training
from dsa._args import IndexerArgs, SparseAttnArgs, SparseDecodeArgs, SparseIndexerArgs, TopkArgs
from dsa.selector import select

Backend = str  # "auto" | "reference" | "triton" | "cute"


def _sparse(q, kv, indices, sm_scale, d_v, sink, topk_length, return_lse, deterministic, backend):
    _checks.flag("return_lse", return_lse)
    _checks.backend_arg(backend)
    return _checks.sparse_attention_args(q, kv, indices, sm_scale, d_v, sink, topk_length, deterministic)


def sparse_attention(
    q: Tensor, kv: Tensor, indices: Tensor, *, sm_scale: Optional[float] = None, d_v: Optional[int] = None,
    sink: Optional[Tensor] = None, topk_length: Optional[Tensor] = None, return_lse: bool = False,
    deterministic: bool = False, backend: Backend = "auto",
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Sparse attention over top-k gathered KV rows (MLA in MQA/GQA form).

    Layouts (H_kv = 1 is MQA; with H_kv > 1 query head h uses kv head
    h // (H / H_kv)):

    - packed:  q [T, H, D], kv [N, D] or [N, H_kv, D], indices [T, K] or
      [T, H_kv, K] (global rows of kv), topk_length [T];
    - batched: q [B, S, H, D], kv [B, N, D] or [B, N, H_kv, D], indices
      [B, S, K] or [B, S, H_kv, K] (rows local to the batch), topk_length [B, S].

    q and kv: bf16 or fp16 (fp32 on the reference and Triton backends);
    indices int32 (int64 accepted); topk_length int32; sink fp32 [H].
    Slot j of a row is valid iff j < clamp(topk_length, 0, K) and
    0 <= index < N; invalid slots are never read. ``sm_scale`` defaults to
    1/sqrt(D), ``d_v`` to min(D, 512) (V = kv[..., :d_v]).

    Returns out [..., H, d_v] in q's dtype and, with ``return_lse``, lse
    [..., H] fp32 (natural log, sink excluded, +inf for a row with no valid
    slot; lse carries no gradient). Differentiable in q, kv and sink;
    ``deterministic=True`` (or ``torch.use_deterministic_algorithms(True)``)
    makes the gradients bitwise reproducible.
    """
    a, layout = _sparse(q, kv, indices, sm_scale, d_v, sink, topk_length, return_lse, deterministic, backend)
    if a.deterministic and ops.direct_plain((q, kv, sink)):
        # no backward will run (no autograd, tracing or transform), and the forward is reproducible as it
        # is: the cute forward need not write the deterministic backward's bounds
        a = dataclasses.replace(a, deterministic=False)
    out, lse, _ = ops.call(ops.sparse_attention_fwd, a, backend)
    out = layout.unpack(out)
    return (out, layout.unpack(lse)) if return_lse else out


def _indexer(q, k, weights, ratio, sm_scale, causal, q_offsets, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, backend):
    _checks.backend_arg(backend)
    return _checks.indexer_args(q, k, weights, ratio, sm_scale, causal, q_offsets, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_k)


def indexer_scores(
    q: Tensor, k: Tensor, weights: Tensor, *, ratio: int = 1, sm_scale: float = 1.0, causal: bool = True,
    q_offsets: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None, max_seqlen_k: Optional[int] = None, backend: Backend = "auto",
) -> Tensor:
    """Lightning-indexer scores of every (query, key) pair.

    score[i, j] = sm_scale * sum_h weights[i, h] * relu(q[i, h] . k[j]) for
    visible j, -inf otherwise. With ``causal``, query i (local to its
    sequence) sees key j iff j < clamp((q_offsets[b] + i + 1) // ratio, 0, S_k).

    - batched: q [B, S_q, H_i, D_i], k [B, S_k, D_i] or [B, S_k, 1, D_i],
      weights [B, S_q, H_i] -> scores [B, S_q, S_k] fp32;
    - packed: q [T_q, H_i, D_i], k [T_k, D_i], weights [T_q, H_i],
      cu_seqlens_q / cu_seqlens_k [B+1] (both omitted: one sequence)
      -> scores [T_q, max_seqlen_k] fp32, local key columns, -inf past each
      sequence's own S_k.

    q, k: bf16/fp16 (fp32 on reference and Triton); weights bf16/fp16/fp32;
    q_offsets int [B].
    """
    a, layout = _indexer(q, k, weights, ratio, sm_scale, causal, q_offsets, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_k, backend)
    return layout.unpack(ops.call(ops.indexer_scores, a, backend))


def _topk(scores, k, row_ends, return_lengths, backend):
    _checks.flag("return_lengths", return_lengths)
    _checks.backend_arg(backend)
    return _checks.topk_args(scores, k, row_ends)


def topk_indices(
    scores: Tensor, k: int, *, row_ends: Optional[Tensor] = None, return_lengths: bool = False,
    backend: Backend = "auto",
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Positions of the k largest scores of each row (last dim).

    scores [..., S] (fp32/bf16/fp16) -> indices [..., k] int32: the selected
    positions in ascending order, then -1 padding. NaN and -inf are never
    selected (+inf is, as the largest); ties at the cut go to the smaller
    position; k may exceed S. ``row_ends`` [...] (scores.shape[:-1], int32 or
    int64, on the scores' device): row r is only its first
    clamp(row_ends[r], 0, S) scores, the columns past it count as -inf
    whatever they hold (a causal row i: min(S, (i + 1) // ratio)); the Triton
    kernels read only that prefix. With ``return_lengths`` also lengths
    [...] int32, the count of valid entries, ready to pass as
    ``topk_length``.
    """
    a, lead = _topk(scores, k, row_ends, return_lengths, backend)
    idx, lengths = ops.call(ops.topk, a, backend)
    idx, lengths = idx.view(*lead, a.topk), lengths.view(lead)
    return (idx, lengths) if return_lengths else idx


def _indexer_topk(q, k, weights, topk, ratio, sm_scale, causal, q_offsets, cu_seqlens_q, cu_seqlens_k,
                  max_seqlen_k, global_indices, return_lengths, backend):
    topk = _checks.topk_value("topk", topk)
    _checks.flag("global_indices", global_indices)
    _checks.flag("return_lengths", return_lengths)
    a, layout = _indexer(q, k, weights, ratio, sm_scale, causal, q_offsets, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_k, backend)
    if global_indices and layout.batch is not None:
        raise ValueError("global_indices: only for the packed layout (q [T_q, H_i, D_i]); q is batched")
    return a, layout, topk


def _global_rows(a: IndexerArgs, idx: Tensor) -> Tensor:
    """Local key positions -> global kv rows (cu_seqlens_k[b] added to every valid index)."""
    seq = torch.repeat_interleave(
        torch.arange(a.batch, device=idx.device), torch.diff(a.cu_seqlens_q).long(), output_size=idx.shape[0]
    )
    base = a.cu_seqlens_k[:-1][seq].view(-1, 1)
    return torch.where(idx >= 0, idx + base, idx)


def indexer_topk(
    q: Tensor, k: Tensor, weights: Tensor, topk: int, *, ratio: int = 1, sm_scale: float = 1.0,
    causal: bool = True, q_offsets: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None, max_seqlen_k: Optional[int] = None, global_indices: bool = False,
    return_lengths: bool = False, backend: Backend = "auto",
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``topk_indices(indexer_scores(...), topk)`` without the score matrix.

    Same layouts and keywords as :func:`indexer_scores`; returns indices
    [B, S_q, topk] or [T_q, topk] int32 (local key positions, ascending, -1
    padded) and, with ``return_lengths``, lengths [B, S_q] or [T_q] int32.
    ``global_indices=True`` (packed layout) adds cu_seqlens_k[b] to every
    valid index so the result feeds a packed ``sparse_attention`` directly.
    """
    a, layout, topk = _indexer_topk(q, k, weights, topk, ratio, sm_scale, causal, q_offsets, cu_seqlens_q,
                                    cu_seqlens_k, max_seqlen_k, global_indices, return_lengths, backend)
    idx, lengths = ops.call(ops.indexer_topk, a, topk, backend)
    if global_indices:
        idx = _global_rows(a, idx)
    idx, lengths = layout.unpack(idx), layout.unpack(lengths)
    return (idx, lengths) if return_lengths else idx


# --------------------------------------------------------------------------
# explain: the arguments are bound to the public function's signature, then
# checked by the same preparation the call uses


def _dtype(t: Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def shape_line(a) -> str:
    """The canonical problem size of an argument dataclass, for explain()."""
    if isinstance(a, SparseAttnArgs):
        return f"T={a.T} H={a.H} H_kv={a.G} D={a.D} d_v={a.d_v} K={a.K} N={a.N} {_dtype(a.q)}"
    if isinstance(a, SparseDecodeArgs):
        return (f"T={a.T} H={a.H} H_kv={a.G} D={a.D} d_v={a.d_v} K={a.K} pages={a.num_pages}x{a.page_size} "
                f"{a.cache_format} {_dtype(a.q)}" + (" block_table" if a.block_table is not None else ""))
    if isinstance(a, SparseIndexerArgs):
        return f"T={a.T} H_i={a.H} D_i={a.D} K={a.K} N={a.N} {_dtype(a.q)}"
    if isinstance(a, TopkArgs):
        return (f"R={a.scores.shape[0]} S={a.scores.shape[1]} k={a.topk} {_dtype(a.scores)}"
                + (" row_ends" if a.row_ends is not None else ""))
    T_q, H, D = a.q.shape
    return f"B={a.batch} T_q={T_q} H={H} D={D} max_seqlen_k={a.max_seqlen_k} {_dtype(a.q)}"


# public name -> (the public function, its preparation, the ops it runs)
_EXPLAIN = {
    "sparse_attention": (sparse_attention, _sparse, ("sparse_attention_fwd", "sparse_attention_bwd")),
    "indexer_scores": (indexer_scores, _indexer, ("indexer_scores",)),
    "indexer_topk": (indexer_topk, _indexer_topk, ("indexer_topk",)),
    "topk_indices": (topk_indices, _topk, ("topk",)),
    **training.EXPLAIN,
    **decode.EXPLAIN,  # sparse_decode  # attention_target, sparse_indexer_scores, indexer_kl_loss, dense_attention_target
}


def explain(op: Union[str, Callable], *args, **kwargs) -> str:
    """Which backend ``backend="auto"`` (or the one named) picks for this call, and why.

    ``op`` is the public function or its name, followed by the call's own
    arguments, e.g. ``explain("sparse_attention", q, kv, indices, sink=sink)``.
    Raises the same errors as the call itself would.
    """
    name = op if isinstance(op, str) else getattr(op, "__name__", repr(op))
    if name not in _EXPLAIN:
        raise ValueError(f"op: expected one of {sorted(_EXPLAIN)}, got {name!r}")
    fn, prepare, op_names = _EXPLAIN[name]
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:  # what the call itself would say: a missing or unexpected argument
        raise TypeError(f"{name}(): {e}") from None
    bound.apply_defaults()
    a = prepare(**bound.arguments)[0]
    backend = bound.arguments["backend"]
    return "\n".join([f"{name} [{shape_line(a)}]"] + [select(o, a, backend).describe(o) for o in op_names])
