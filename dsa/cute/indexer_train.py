"""CuTe DSL sparse indexer training ops on SM90: what they serve, launch, placement.

    sparse_indexer_fwd(a) -> logits [T, K] fp32, -inf on invalid slots
    indexer_kl_fwd(a, target) -> stats [T, 4] fp32 (loss_t, lse, sum of valid target, has a valid slot)
    sparse_indexer_bwd(a, dlogits) -> dq, dk, dweights
    indexer_kl_bwd(a, target, stats, scale, logits=None) -> dq, dk, dweights

on :class:`dsa._args.SparseIndexerArgs`, with the Triton ops' results
(``dsa.triton.training``, ``dsa.triton.indexer_bwd``).  The kernels are
``indexer_train_sm90.SparseIndexerSm90`` (forward) and
``indexer_train_bwd_sm90.SparseIndexerBwdSm90`` (backward: 64 heads, D_i up
to 128, dk by fp32 atomics); compiled kernels are cached per (config,
device), and every launch runs under q's device and its current stream.

``deterministic=True``: the backward kernel rounds each dk value to a
multiple of its key's quantum before the fp32 atomic add
(``dsa.triton.dk_quanta``: powers of two from a bound on the key's sum),
which makes every add exact and dk the same bits in any order.  The bound
needs each slot's |gradient|: the logits' dlogits, or for the KL loss the
deterministic forward's logits (recomputed by the forward kernel where
none are given) with its lse.

Placement under ``backend="auto"``: ``PLACEMENT`` names, per GPU, the ops the
same process measured ahead of Triton's (bench/training_peers.py --cute)
and the (H_i, D_i) they were measured at; elsewhere auto keeps Triton and
``explain()`` says so.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from dsa._args import SparseIndexerArgs, Unsupported
from dsa.cute.host import (address, alignment_reason, compile_kernel, cutlass_dtype, device_name, dsl_reason,
                           sm90_reason, stream_handle, zero_row)

FORWARD = ("sparse_indexer_fwd", "indexer_kl_fwd")
BACKWARD = ("sparse_indexer_bwd", "indexer_kl_bwd")
# GPU name -> (the ops measured faster than Triton's there, the (H_i, D_i)
# they were measured at).  H200, the V3.2
# step (T 4096, N 8192, K 2048, H_i 64, D_i 128; bench/RESULTS.md C127,
# C128), cute / Triton ms: logits 0.358 / 0.400, KL forward 0.429 / 0.460,
# KL backward 1.597 / 2.113, logits backward 1.512 / 2.040.
PLACEMENT: Dict[str, Tuple[Tuple[str, ...], Tuple[Tuple[int, int], ...]]] = {
    "NVIDIA H200": (FORWARD + BACKWARD, ((64, 128),)),
}
NOTE = "the cute SM90 sparse indexer kernel (gathered k rows in a ring of stages, slots as wgmma rows)"
_W_TYPES = (torch.bfloat16, torch.float16, torch.float32)

# (IndexerSm90Config, device index) -> compiled kernel
_COMPILED: Dict[tuple, object] = {}


def shape_reason(a: SparseIndexerArgs) -> Optional[str]:
    """Why the kernel is not built for a's dtypes and sizes (None when it
    is; no device check, the CuTe DSL must import)."""
    if a.k.dtype != a.q.dtype:
        return f"k dtype {a.k.dtype} differs from q dtype {a.q.dtype}"
    if a.weights.dtype not in _W_TYPES:
        return f"weights dtype {a.weights.dtype}: the cute indexer kernels read {_W_TYPES}"
    from dsa.cute.indexer_train_sm90 import indexer_reason

    why = indexer_reason(cutlass_dtype(a.q.dtype) or a.q.dtype, a.H, a.D)
    if why:
        return why
    if a.T >= 2**31 or a.N >= 2**31 or a.T * a.K >= 2**31:
        return "T, N and T x K must fit in int32"
    return None


def supports(a: SparseIndexerArgs, op: str = "sparse_indexer_fwd") -> Optional[str]:
    """None when the kernel of ``op`` can serve ``a``, else the reason."""
    why = sm90_reason(a.q.device, "the cute sparse indexer kernels")
    if why:
        return why
    why = dsl_reason() or shape_reason(a)
    if why:
        return why
    if op in BACKWARD:
        from dsa.cute.indexer_train_bwd_sm90 import bwd_reason

        why = bwd_reason(cutlass_dtype(a.q.dtype), a.H, a.D)
        if why:
            return why
    return alignment_reason(a, ("q", "k"))


def placement_reason(a: SparseIndexerArgs, op: str) -> Optional[str]:
    """Why auto leaves ``op`` on ``a`` to Triton (None where ``PLACEMENT`` names it on this GPU)."""
    placed = PLACEMENT.get(device_name(a.q.device))
    if placed is None:
        return "no measurement of the cute indexer kernels on this GPU yet"
    ops, shapes = placed
    if op not in ops:
        return f"{op}: Triton's measured faster on this GPU (cute leads at {list(ops)})"
    if (a.H, a.D) not in shapes:
        return f"H_i = {a.H}, D_i = {a.D}: not measured on this GPU (the cute kernels were at {list(shapes)})"
    return None


def backend_op(op: str, a: SparseIndexerArgs, auto: bool) -> Callable:
    """The cute implementation of ``op`` for ``a``; Unsupported with the
    reason where the kernel cannot serve it or, under auto, where it was not
    measured ahead of Triton's."""
    why = supports(a, op)
    if why is None and auto:
        why = placement_reason(a, op)
        if why is None:
            from dsa.cute import _Chosen

            return _Chosen(_OPS[op], f"{NOTE}: measured faster than Triton's on this GPU")
    if why is not None:
        raise Unsupported(why)
    return _OPS[op]


def kernel_config(a: SparseIndexerArgs, kl: bool, backward: bool = False):
    """The ``IndexerSm90Config`` that serves ``a`` (the forward's, or the backward's)."""
    from dsa.cute.indexer_train_sm90 import IndexerSm90Config

    return IndexerSm90Config(cutlass_dtype(a.q.dtype), _w_type(a.weights.dtype), a.H, a.D,
                             a.topk_length is not None, kl, backward=backward,
                             deterministic=backward and bool(a.deterministic))


def _w_type(dt: torch.dtype):
    import cutlass

    return cutlass_dtype(dt) or cutlass.Float32


def _ptr_types(cfg):
    """(cutlass element type, assumed alignment) of each pointer, in order:
    q, k, weights, indices, topk_length, then the forward's target and out,
    or the backward's gin, stats, scale, dq, dk, dweights, quanta; the zero
    row last."""
    import cutlass

    I32, F32 = cutlass.Int32, cutlass.Float32
    dt, wt = cfg.dtype, cfg.w_dtype
    w = (wt, wt.width // 8)
    outs = ((F32, 4), (F32, 4), (F32, 4), (dt, 4), (F32, 16), w, (F32, 8)) if cfg.backward else ((F32, 4), (F32, 4))
    return ((dt, 16), (dt, 16), w, (I32, 4), (I32, 4), *outs, (dt, 16))


def _scalar_types():
    """T, N, K, sm_scale."""
    import cutlass

    return cutlass.Int32, cutlass.Int32, cutlass.Int32, cutlass.Float32


def _compile(cfg, options: str = ""):
    """The kernel of ``cfg`` (forward or backward) compiled for TVM-FFI calls."""
    from dsa.cute.indexer_train_bwd_sm90 import SparseIndexerBwdSm90
    from dsa.cute.indexer_train_sm90 import SparseIndexerSm90

    cls = SparseIndexerBwdSm90 if cfg.backward else SparseIndexerSm90
    return compile_kernel(cls.from_config(cfg), _ptr_types(cfg), _scalar_types(), options)


def _launch(a: SparseIndexerArgs, cfg, *buffers: torch.Tensor) -> None:
    """The kernel of ``cfg`` on ``a`` with its buffers (``_ptr_types``'
    between topk_length and the zero row), under q's device and stream."""
    length = a.topk_length if a.topk_length is not None else a.indices  # never read when absent
    tensors = (a.q, a.k, a.weights, a.indices, length, *buffers, zero_row(a.q.device, a.q.dtype, a.D))
    _compiled(cfg, a.q.device)(*(address(x) for x in tensors), a.T, a.N, a.K, float(a.sm_scale),
                               stream_handle(a.q.device))


def _compiled(cfg, device: torch.device):
    """The compiled kernel of ``cfg`` on ``device`` (compiled at first use)."""
    key = (cfg, device.index)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = _compile(cfg)
    return fn


def _checked(a: SparseIndexerArgs, op: str) -> None:
    why = supports(a, op)
    if why:
        raise ValueError(why)


def sparse_indexer_fwd(a: SparseIndexerArgs) -> torch.Tensor:
    """-> logits [T, K] fp32, -inf on invalid slots (every slot written)."""
    _checked(a, "sparse_indexer_fwd")
    with torch.cuda.device(a.q.device):
        out = torch.empty((a.T, a.K), device=a.q.device, dtype=torch.float32)
        _launch(a, kernel_config(a, kl=False), out, out)
    return out


def indexer_kl_fwd(a: SparseIndexerArgs, target: torch.Tensor) -> torch.Tensor:
    """-> stats [T, 4] fp32 (loss_t, lse of the logits, sum of valid target,
    has a valid slot); target [T, K] (fp32 read)."""
    _checked(a, "indexer_kl_fwd")
    with torch.cuda.device(a.q.device):
        stats = torch.empty(a.T, 4, device=a.q.device, dtype=torch.float32)
        _launch(a, kernel_config(a, kl=True), target.float().contiguous(), stats)
    return stats


def _backward(a: SparseIndexerArgs, gin: torch.Tensor, stats: torch.Tensor, scale: torch.Tensor, kl: bool,
              logits: Optional[torch.Tensor] = None):
    from dsa.cute.sparse_attention_bwd import natural_columns

    with torch.cuda.device(a.q.device):
        dq = torch.empty_like(a.q)
        dw = torch.empty_like(a.weights)
        dk = torch.zeros(a.N, a.D, device=a.q.device, dtype=torch.float32)
        quanta = _quanta(a, gin, stats, scale, kl, logits) if a.deterministic else dk  # dk: never read
        _launch(a, kernel_config(a, kl, backward=True), gin, stats, scale, dq, dk, dw, quanta)
        return dq, natural_columns(dk, a.k.dtype), dw


def _quanta(a: SparseIndexerArgs, gin, stats, scale, kl: bool, logits=None) -> torch.Tensor:
    """The keys' quanta [N, 2] of a deterministic backward (``dsa.triton.dk_quanta``);
    the KL loss's bound reads the logits: the deterministic forward's, or
    recomputed by the forward kernel where none are given."""
    from dsa.triton.dk_quanta import dk_quanta

    if not kl:
        return dk_quanta(a.q, a.weights, a.indices, a.topk_length, a.N, a.sm_scale, gin,
                         torch.ones(1, device=a.q.device))
    if logits is None:
        logits = torch.empty((a.T, a.K), device=a.q.device, dtype=torch.float32)
        _launch(a, kernel_config(a, kl=False), logits, logits)
    return dk_quanta(a.q, a.weights, a.indices, a.topk_length, a.N, a.sm_scale, gin, scale, logits, stats)


def sparse_indexer_bwd(a: SparseIndexerArgs, dlogits: torch.Tensor):
    """-> dq, dk, dweights of the logits; dlogits [T, K] (fp32 read; never read at an invalid slot).
    gin, stats and scale are all dlogits here: the kernel reads the first alone."""
    _checked(a, "sparse_indexer_bwd")
    g = dlogits.float().contiguous()
    return _backward(a, g, g, g, kl=False)


def indexer_kl_bwd(a: SparseIndexerArgs, target: torch.Tensor, stats: torch.Tensor, scale: torch.Tensor,
                   logits: Optional[torch.Tensor] = None):
    """-> dq, dk, dweights of the KL loss; stats [T, 4] of the forward, scale = dloss / max(R, 1) (0-dim);
    logits [T, K]: the deterministic forward's (the dk bound reads them; recomputed when None)."""
    _checked(a, "indexer_kl_bwd")
    lg = None if logits is None else logits.float().contiguous()
    return _backward(a, target.float().contiguous(), stats.float().contiguous(), scale.float().reshape(1), kl=True,
                     logits=lg)


_OPS = {"sparse_indexer_fwd": sparse_indexer_fwd, "indexer_kl_fwd": indexer_kl_fwd,
        "sparse_indexer_bwd": sparse_indexer_bwd, "indexer_kl_bwd": indexer_kl_bwd}
for _fn in _OPS.values():
    _fn.note = NOTE


def compile_offline(dtype: torch.dtype, w_dtype: torch.dtype, H: int, D: int, has_len: bool, kl: bool,
                    backward: bool = False, deterministic: bool = False, options: str = "--keep-ptx"):
    """Compile the forward (or the backward, deterministic or not) without a
    GPU (``CUTE_DSL_ARCH=sm_90a``), for CI and inspection; returns the compiled object."""
    from dsa.cute.indexer_train_sm90 import IndexerSm90Config

    return _compile(IndexerSm90Config(cutlass_dtype(dtype), _w_type(w_dtype), H, D, has_len, kl, backward=backward,
                                      deterministic=deterministic), options)
