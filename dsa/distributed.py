"""Context-parallel sparse attention and indexer over a torch.distributed group.

The sequence is split into contiguous shards, one per rank in group-rank
order. Each rank holds the queries of its shard and the latent KV rows (and
indexer keys) of the same tokens. A DSA KV row is small and shared by every
head, so the ranks exchange KV rather than queries:

- forward: all-gather the KV shards into the full KV, attend with the local
  queries (indices are global token positions);
- backward: dq and dsink are local; dkv of the full KV is reduce-scattered
  (summed over ranks) back to the shards.

Shards may be ragged (different token counts per rank, zero included): the
gathers pad every shard to the longest one so that one fixed-size collective
serves NCCL and gloo alike, and strip the padding after.

Counts are exchanged with one small all-gather (a host sync on GPUs) unless
given; they are the same for every layer of a step, so compute them once
with :func:`shard_sizes` and pass them as ``kv_sizes`` / ``q_sizes``.
"""

from __future__ import annotations

import numbers
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

import dsa

__all__ = ["GatheredKV", "gather_kv", "indexer_topk", "shard_sizes", "sparse_attention"]

# fixed-size collectives into / out of one tensor (newer torch renames them)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --------------------------------------------------------------------------
# group and shard counts


def _group_info(group) -> Tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised (call torch.distributed.init_process_group)")
    return dist.get_rank(group), dist.get_world_size(group)


def _exchange_counts(counts: Sequence[int], group, device: torch.device) -> List[List[int]]:
    """All ranks' ``counts`` in group-rank order: one all-gather of len(counts) ints."""
    _, world = _group_info(group)
    mine = torch.tensor(list(counts), dtype=torch.int64, device=device)
    every = torch.empty(world * len(counts), dtype=torch.int64, device=device)
    _all_gather(every, mine, group=group)
    return every.view(world, len(counts)).tolist()


def shard_sizes(n_local: int, *, group=None, device: Optional[torch.device] = None) -> List[int]:
    """Every rank's ``n_local`` (its token count), in group-rank order.

    One all-gather of one int64 per rank; ``device`` is where that tensor
    lives (default: the current CUDA device for an NCCL group, else CPU).
    The result is the ``kv_sizes`` / ``q_sizes`` argument of this module's
    functions; it is the same for every layer of a step.
    """
    if isinstance(n_local, bool) or not isinstance(n_local, int) or n_local < 0:
        raise ValueError(f"n_local: expected an int >= 0, got {n_local!r}")
    if device is None:
        _group_info(group)
        nccl = "nccl" in str(dist.get_backend(group)).lower()
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    return [row[0] for row in _exchange_counts([n_local], group, device)]


def _check_sizes(name: str, sizes, n_local: int, rank: int, world: int) -> List[int]:
    if isinstance(sizes, Tensor):
        sizes = sizes.tolist()
    sizes = list(sizes)
    if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) for s in sizes):
        raise TypeError(f"{name}: expected ints, got {sizes}")
    sizes = [int(s) for s in sizes]
    if len(sizes) != world or any(s < 0 for s in sizes):
        raise ValueError(f"{name}: expected {world} ints >= 0 (one per rank of the group), got {sizes}")
    if sizes[rank] != n_local:
        raise ValueError(f"{name}: entry {rank} (this rank) is {sizes[rank]}, but the local shard holds {n_local} rows")
    return sizes


# --------------------------------------------------------------------------
# the KV all-gather and its reduce-scatter


class _AllGatherPadded(torch.autograd.Function):
    """[m, ...] on each rank -> [world * m, ...]; backward: reduce-scatter (sum).

    The forward only issues the all-gather and returns its (still filling)
    output; the caller waits on ``works[0]`` before reading it.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group, works: list) -> Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
        works.append(_all_gather(out, x, group=group, async_op=True))
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        world = dist.get_world_size(ctx.group)
        dout = dout.contiguous()
        dx = dout.new_empty((dout.shape[0] // world,) + tuple(dout.shape[1:]))
        # waited here: on NCCL that is a stream dependency, not a host stall
        _reduce_scatter(dx, dout, op=dist.ReduceOp.SUM, group=ctx.group, async_op=True).wait()
        return dx, None, None


class GatheredKV:
    """A KV (or key) all-gather in flight, from :func:`gather_kv`.

    ``wait()`` returns the full tensor (differentiable: its gradient is
    reduce-scattered back to the local shard). Pass the object itself as
    ``kv`` to :func:`sparse_attention` or as ``k`` to :func:`indexer_topk`
    to overlap the gather with whatever runs between.
    """

    def __init__(self, buf: Tensor, works: list, local: Tensor, sizes: List[int], dim: int, group):
        self._buf, self._works, self._local = buf, works, local
        self.group = group
        self.sizes = sizes
        self.dim = dim
        self._full: Optional[Tensor] = None

    def wait(self) -> Tensor:
        if self._full is None:
            for w in self._works:
                w.wait()
            m = self._buf.shape[0] // len(self.sizes)
            full = self._buf
            if any(s != m for s in self.sizes):
                full = torch.cat([full[r * m : r * m + s] for r, s in enumerate(self.sizes)])
            self._full = full.movedim(0, self.dim).contiguous() if self.dim else full
            self._buf = self._local = None
        return self._full


def gather_kv(
    kv: Tensor,
    *,
    group=None,
    kv_sizes: Optional[Sequence[int]] = None,
    dim: int = 0,
    async_op: bool = False,
) -> Union[Tensor, GatheredKV]:
    """All-gather the shards of ``kv`` along its token dim ``dim``, in rank order.

    kv: the local shard, e.g. [N_local, D] / [N_local, H_kv, D] (dim 0) or
    [B, N_local, ...] (dim 1); any dtype the group's backend carries.
    kv_sizes: every rank's N_local (default: exchanged, see
    :func:`shard_sizes`). Returns the full tensor with N = sum(kv_sizes) rows
    on ``dim``, or with ``async_op`` a :class:`GatheredKV` whose ``wait()``
    gives it. Differentiable: the backward reduce-scatters (sums) the full
    gradient back to each shard, so every rank must run that backward.
    """
    if not isinstance(kv, Tensor):
        raise TypeError(f"kv: expected a torch.Tensor, got {type(kv).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < kv.dim():
        raise ValueError(f"dim: expected an int in [0, {kv.dim()}) (the token dim of kv), got {dim!r}")
    rank, world = _group_info(group)
    n_local = kv.shape[dim]
    if kv_sizes is None:
        kv_sizes = [row[0] for row in _exchange_counts([n_local], group, kv.device)]
    sizes = _check_sizes("kv_sizes", kv_sizes, n_local, rank, world)
    x = kv.movedim(dim, 0) if dim else kv
    m = max(sizes)
    if n_local < m:
        x = torch.cat([x, x.new_zeros((m - n_local,) + tuple(x.shape[1:]))])
    x = x.contiguous()
    works: list = []
    buf = _AllGatherPadded.apply(x, group, works)
    pending = GatheredKV(buf, works, x, sizes, dim, group)
    return pending if async_op else pending.wait()


# --------------------------------------------------------------------------
# sparse attention


def _full_kv(kv, group, kv_sizes, dim: int, name: str) -> Tensor:
    if isinstance(kv, GatheredKV):
        if kv.dim != dim:
            raise ValueError(f"{name}: gathered along dim {kv.dim}, but this layout's token dim is {dim}")
        if kv.group is not group:
            raise ValueError(f"group: {group!r} is not the group {name} was gathered over ({kv.group!r})")
        if kv_sizes is not None and list(kv_sizes) != kv.sizes:
            raise ValueError(f"kv_sizes: {list(kv_sizes)} differs from the gathered {name}'s sizes {kv.sizes}")
        return kv.wait()
    if not isinstance(kv, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or a GatheredKV, got {type(kv).__name__}")
    return gather_kv(kv, group=group, kv_sizes=kv_sizes, dim=dim)


def _token_dim(q) -> int:
    if not isinstance(q, Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.dim() not in (3, 4):
        raise ValueError(f"q: expected [T_local, H, D] (packed) or [B, S_local, H, D] (batched), got {tuple(q.shape)}")
    return 1 if q.dim() == 4 else 0


def sparse_attention(
    q: Tensor,
    kv: Union[Tensor, GatheredKV],
    indices: Tensor,
    *,
    group=None,
    kv_sizes: Optional[Sequence[int]] = None,
    sm_scale: Optional[float] = None,
    d_v: Optional[int] = None,
    sink: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
    return_lse: bool = False,
    deterministic: bool = False,
    backend: str = "auto",
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Context-parallel :func:`dsa.sparse_attention`: local queries, gathered KV.

    - packed: q [T_local, H, D], kv [N_local, D] or [N_local, H_kv, D],
      indices [T_local, K] or [T_local, H_kv, K], topk_length [T_local];
    - batched: q [B, S_local, H, D], kv [B, N_local, D] or
      [B, N_local, H_kv, D], indices [B, S_local, K] or [B, S_local, H_kv, K],
      topk_length [B, S_local].

    indices are GLOBAL rows: positions in the KV of all ranks concatenated in
    group-rank order (per batch element when batched), as
    :func:`indexer_topk` returns them; -1 and anything outside [0, N) are
    invalid slots. kv may also be a :class:`GatheredKV` started earlier.
    kv_sizes: every rank's N_local (default: exchanged).

    Returns what :func:`dsa.sparse_attention` returns for the local rows.
    Gradients: dq local; dkv summed over every rank's queries and scattered
    back to the shard; dsink is this rank's rows' contribution, like the
    gradient of every other replicated parameter (summing it over ranks, as
    DDP/FSDP do, gives the gradient of the whole sequence).
    """
    dim = _token_dim(q)
    kv_full = _full_kv(kv, group, kv_sizes, dim, "kv")
    return dsa.sparse_attention(
        q, kv_full, indices, sm_scale=sm_scale, d_v=d_v, sink=sink, topk_length=topk_length,
        return_lse=return_lse, deterministic=deterministic, backend=backend,
    )


# --------------------------------------------------------------------------
# indexer


def indexer_topk(
    q: Tensor,
    k: Union[Tensor, GatheredKV],
    weights: Tensor,
    topk: int,
    *,
    group=None,
    q_sizes: Optional[Sequence[int]] = None,
    k_sizes: Optional[Sequence[int]] = None,
    ratio: int = 1,
    sm_scale: float = 1.0,
    causal: bool = True,
    return_lengths: bool = False,
    backend: str = "auto",
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Context-parallel :func:`dsa.indexer_topk`: local queries, gathered keys.

    - packed: q [T_local, H_i, D_i], k [S_k_local, D_i] or
      [S_k_local, 1, D_i], weights [T_local, H_i] -> [T_local, topk];
    - batched: q [B, S_local, H_i, D_i], k [B, S_k_local, D_i] or
      [B, S_k_local, 1, D_i], weights [B, S_local, H_i] -> [B, S_local, topk].

    The rank's first query sits at global position sum(q_sizes[:rank]) (its
    ``q_offsets``). With ``ratio > 1`` the keys are compressed (one per
    ``ratio`` tokens) and sharded on their own: k_sizes need not follow
    q_sizes. q_sizes / k_sizes default to an exchange (one all-gather for
    both); k may be a :class:`GatheredKV`, whose sizes are then used.

    Returns int32 GLOBAL key positions (in the keys of all ranks
    concatenated), ascending, -1 padded, and with ``return_lengths`` the
    counts; they feed :func:`sparse_attention` (with the KV sharded like k)
    as ``indices`` and ``topk_length`` directly. Not differentiable.
    """
    dim = _token_dim(q)
    rank, world = _group_info(group)
    n_q = q.shape[dim]
    gathered = isinstance(k, GatheredKV)
    if not gathered and not isinstance(k, Tensor):
        raise TypeError(f"k: expected a torch.Tensor or a GatheredKV, got {type(k).__name__}")
    if gathered:
        if k_sizes is not None and list(k_sizes) != k.sizes:
            raise ValueError(f"k_sizes: {list(k_sizes)} differs from the gathered k's sizes {k.sizes}")
        k_sizes = k.sizes
    if q_sizes is None and k_sizes is None:
        both = _exchange_counts([n_q, k.shape[dim]], group, q.device)
        q_sizes, k_sizes = [r[0] for r in both], [r[1] for r in both]
    elif q_sizes is None:
        q_sizes = [r[0] for r in _exchange_counts([n_q], group, q.device)]
    q_sizes = _check_sizes("q_sizes", q_sizes, n_q, rank, world)
    # the selection is not differentiable: gather the keys outside autograd
    k_full = _full_kv(k if gathered else k.detach(), group, k_sizes, dim, "k")
    B = q.shape[0] if dim else 1
    q_offsets = torch.full((B,), sum(q_sizes[:rank]), dtype=torch.int64, device=q.device)
    return dsa.indexer_topk(
        q, k_full, weights, topk, ratio=ratio, sm_scale=sm_scale, causal=causal, q_offsets=q_offsets,
        return_lengths=return_lengths, backend=backend,
    )
