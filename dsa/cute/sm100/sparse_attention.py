"""CuTe DSL sparse attention on SM100, forward and backward: what they serve, compilation cache, launch.

    forward(a) -> out [T, H, d_v] (q.dtype), lse [T, H] fp32
    backward(a, out, lse, dout) -> dq [T, H, D] (q.dtype), dkv [N, G, D] (kv.dtype),
                                   dsink [H] fp32 or None

on the canonical packed layout of :class:`dsa._args.SparseAttnArgs`.  The
kernels are ``sparse_attention_fwd.SparseAttnFwdSm100`` and
``sparse_attention_bwd.SparseAttnBwdSm100``; what each serves is its
``can_implement`` (bf16 / fp16, a multiple of 64 query heads per kv head, D
512 or 576, d_v 512).  Backward calls of bf16, 128 query heads per kv head
and D 576 go to the two-CTA kernel instead
(``sparse_attention_bwd_pair.SparseAttnBwdSm100Pair``, its own config and
self-check; ``pair_launch_shape`` splits a short batch's rows over the
idle clusters).  The backward's host side (the Triton preprocess,
the dkv accumulator, the deterministic mode's per-slot rows and fixed-order
sum) is the SM90 backward's (``dsa.cute.sparse_attention_bwd.run_backward``).
Compiled kernels are cached per (config, device); every launch runs under
the tensors' device and its current stream.  This module never decides
whether a kernel is trusted: ``dsa.cute.sm100`` runs its self-check
(``self_check`` / ``self_check_backward``) first.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from dsa._args import SparseAttnArgs
from dsa._rules import LOG2E
from dsa.cute.host import address, arch_reason, compile_kernel, cutlass_dtype, stream_handle, zero_row
from dsa.cute.sparse_attention import (DEFAULT, SERVED_DV, GridConfig, call_reason, kernel_pointers, kernel_scalars,
                                      pointer_types, scalar_types)

# (FwdSm100Config or BwdSm100Config, device index) -> compiled kernel
_COMPILED: Dict[tuple, object] = {}


def supports(a: SparseAttnArgs) -> Optional[str]:
    """None when the SM100 forward kernel can serve ``a``, else the reason."""
    return _reason(a, "the cute SM100 sparse attention kernel", "sparse_attention_fwd", "SparseAttnFwdSm100")


def _reason(a: SparseAttnArgs, what: str, module: str, builder: str) -> Optional[str]:
    """Why the kernel ``dsa.cute.sm100.<module>.<builder>`` (``what``)
    cannot serve ``a`` (None if it can): the device, then ``call_reason``
    with its ``can_implement``."""
    why = arch_reason(a.q.device, what, "sm100")
    if why:
        return why

    def can_implement(*problem):
        kernel = getattr(importlib.import_module(f"dsa.cute.sm100.{module}"), builder)
        return kernel.can_implement(*problem)

    return call_reason(a, can_implement)


def kernel_config(a: SparseAttnArgs):
    """The ``FwdSm100Config`` that serves ``a`` (the self-check's key too)."""
    from dsa.cute.sm100.sparse_attention_fwd import FwdSm100Config

    return FwdSm100Config(cutlass_dtype(a.q.dtype), a.D, a.d_v, a.H, a.G, a.topk_length is not None,
                          a.sink is not None)


def _compiled(builder, config, device: torch.device, pointers, scalars):
    """The kernel ``builder.from_config(config)`` compiled for ``device``
    (compiled on its first use there; a compiled kernel's module is loaded
    in the context of the device it was compiled on); pointers and scalars:
    its arguments' types (``dsa.cute.host.compile_kernel``)."""
    key = (config, device.index)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = compile_kernel(builder.from_config(config), pointers, scalars)
    return fn


def forward(a: SparseAttnArgs, config: Optional[GridConfig] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """out [T, H, d_v] in q.dtype and lse [T, H] fp32 (sink excluded, +inf on
    empty rows).  config: the grid (default: persistent, one CTA an SM)."""
    from dsa.cute.sm100.sparse_attention_fwd import SparseAttnFwdSm100

    cfg = config or DEFAULT
    with torch.cuda.device(a.q.device):
        out = torch.empty((a.T, a.H, a.d_v), dtype=a.q.dtype, device=a.q.device)
        lse = torch.empty((a.T, a.H), dtype=torch.float32, device=a.q.device)
        config = kernel_config(a)
        fn = _compiled(SparseAttnFwdSm100, config, a.q.device, pointer_types(config.dtype), scalar_types())
        fn(*kernel_pointers(a, out, lse), *kernel_scalars(a, cfg.grid(a.q.device)), stream_handle(a.q.device))
    return out, lse


# --------------------------------------------------------------------------
# the self-check: the kernel against the Triton forward on a hostile problem

SELF_CHECK_T = 7       # tokens: with CTAS, several tiles a CTA, empty ones among them
SELF_CHECK_K = 320     # five blocks of 64 slots: both stages used more than once a tile
SELF_CHECK_N = 200
SELF_CHECK_CTAS = 3


def hostile_problem(config, device: torch.device, seed: int = 0) -> SparseAttnArgs:
    """A small problem of ``config``'s static shape (dtype, D, H, G, with or
    without topk_length and sink) on ``device`` that exercises every rule:
    indices -1, N and 2**31 - 1 and duplicates; topk_length past K,
    negative, 0 (tiles with no valid slot) and mid-block; kv rows of NaN
    named only by slots past topk_length; a query head of NaN (its out and
    lse are NaN), and one in a token whose every slot is invalid (an empty
    row: out 0, lse +inf, no gradient); sinks +inf, -inf, 3e38 and
    ordinary; and, for half the heads, scores that grow along the row by
    more than 2^8 every couple of blocks, so that O is rescaled in flight
    (the other half's shrink)."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if config.dtype.__name__ == "BFloat16" else torch.float16
    T, K, N, H, G, D = SELF_CHECK_T, SELF_CHECK_K, SELF_CHECK_N, config.H, config.G, config.D
    u = torch.randint(0, 2, (D,), generator=g).float() * 2 - 1            # a direction of +-1 entries
    kv = torch.randn(N, G, D, generator=g) * 0.3 + torch.linspace(0, 5, N).view(N, 1, 1) * u
    q = torch.randn(T, H, D, generator=g) + 0.2 * u
    q[:, 1::2] -= 0.4 * u                                                  # odd heads: falling scores
    q[T - 1, H // 2] = float("nan")
    # sorted rows: slot order is kv row order, so the scores rise (or fall) along the row
    idx = torch.sort(torch.randint(0, N - 2, (T, G, K), generator=g, dtype=torch.int32), dim=-1).values
    idx[..., 4::17] = idx[..., 3::17][..., : idx[..., 4::17].shape[-1]]   # duplicates
    idx[..., 1::7] = -1
    idx[..., 2::11] = N
    idx[..., 3::13] = 2**31 - 1
    idx[5] = -1                      # a token with no valid slot though its topk_length is 1 (or K)
    q[5, H // 2] = float("nan")      # and a NaN query head there: out 0, lse +inf, zero gradients
    lengths = torch.tensor([K + 50, -3, 0, 37, K, 1, 130], dtype=torch.int32)[:T]
    kv[N - 2:] = float("nan")
    if config.has_len:
        for t in range(T):
            stop = int(lengths[t].clamp(0, K))
            idx[t, :, stop:stop + 5] = N - 2 + torch.arange(min(5, K - stop)) % 2  # NaN rows, past the length
    sink = None
    if config.has_sink:
        sink = torch.randn(H, generator=g)
        sink[:3] = torch.tensor([float("inf"), float("-inf"), 3.0e38])
    return SparseAttnArgs(q.to(dtype).to(device), kv.to(dtype).to(device), idx.to(device),
                          lengths.to(device) if config.has_len else None,
                          None if sink is None else sink.to(device), D ** -0.5, SERVED_DV, False)


def self_check(config, device: torch.device, kernel=None, reference=None) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """[(kernel's, reference's)] out and lse of ``config``'s kernel on the
    hostile problem (a grid of a few CTAs, so each runs several tiles),
    the reference being the Triton forward.  ``kernel`` / ``reference``
    stand in for them (the tests run the gate on CPU with stand-ins)."""
    if kernel is None:
        def kernel(a):
            return forward(a, GridConfig(ctas=SELF_CHECK_CTAS))
    if reference is None:
        from dsa.triton.sparse_attention import forward as reference
    a = hostile_problem(config, device)
    got, want = kernel(a), reference(a)
    return list(zip(got, want))


def compile_offline(dtype: torch.dtype, D: int, H: int, G: int, has_len: bool, has_sink: bool,
                    options: str = "--keep-ptx"):
    """Compile the kernel without a GPU (``CUTE_DSL_ARCH=sm_100a``), for CI and
    inspection; returns the compiled object.  options: the DSL's compile
    options ("--keep-ptx" keeps the PTX; "remarks{ptx}" prints ptxas's
    register and spill report)."""
    from dsa.cute.sm100.sparse_attention_fwd import SparseAttnFwdSm100

    dt = cutlass_dtype(dtype) or dtype
    kernel = SparseAttnFwdSm100(dt, D, SERVED_DV, H, G, has_len, has_sink)
    return compile_kernel(kernel, pointer_types(dt), scalar_types(), options)


# --------------------------------------------------------------------------
# the backward

def supports_backward(a: SparseAttnArgs) -> Optional[str]:
    """None when the SM100 backward kernel can serve ``a``, else the reason."""
    return _reason(a, "the cute SM100 sparse attention backward", "sparse_attention_bwd", "SparseAttnBwdSm100")


def pair_serves(a: SparseAttnArgs) -> bool:
    """The two-CTA backward (``sparse_attention_bwd_pair``) takes the call:
    bf16, 128 query heads per kv head, D 576, d_v 512."""
    from dsa.cute.sm100.sparse_attention_bwd_pair import SparseAttnBwdSm100Pair

    return SparseAttnBwdSm100Pair.can_implement(cutlass_dtype(a.q.dtype), a.D, a.d_v, a.H, a.G) is None


def backward_config(a: SparseAttnArgs):
    """The config that serves ``a`` (the self-check's key too): the two-CTA
    kernel's ``PairBwdSm100Config`` where it serves the shape, else the
    generic kernel's ``BwdSm100Config``."""
    from dsa.cute.sm100.sparse_attention_bwd import BwdSm100Config
    from dsa.cute.sm100.sparse_attention_bwd_pair import PairBwdSm100Config

    cls = PairBwdSm100Config if pair_serves(a) else BwdSm100Config
    return cls(cutlass_dtype(a.q.dtype), a.D, a.d_v, a.H, a.G, a.topk_length is not None, bool(a.deterministic))


def kernel_name(config) -> str:
    """The backward kernel a config builds, as explain() names it."""
    from dsa.cute.sm100.sparse_attention_bwd_pair import PairBwdSm100Config

    if isinstance(config, PairBwdSm100Config):
        return "the two-CTA SM100 backward (a (2, 1, 1) cluster, cta_group::2 MMAs, H128 / D576)"
    return "the SM100 backward (64 query heads per CTA, cta_group::1 MMAs)"


@dataclass(frozen=True)
class PairGrid:
    """The two-CTA backward's launch: ``clusters`` clusters (None: half the
    SMs), and whether a short batch's rows may be split over several
    clusters (``split``: each cluster then takes a range of a row's blocks
    and dq is added in fp32; never in the deterministic mode)."""

    clusters: Optional[int] = None
    split: bool = True


def pair_launch_shape(T: int, G: int, K: int, clusters: int, split: bool) -> Tuple[int, int, int]:
    """(clusters launched, parts a row is split into, blocks of 64 slots a
    part): rows are split only while the batch's T G rows leave clusters
    idle, never below one block a part; a long batch runs one cluster per
    (token, kv head) row, persistent over the rows."""
    blocks = max(1, -(-K // 64))
    rows_ = max(1, T * G)
    parts = 1
    if split and rows_ < clusters:
        parts = min(blocks, -(-clusters // rows_))
    part_blocks = -(-blocks // parts)
    parts = -(-blocks // part_blocks)
    return max(1, min(clusters, rows_ * parts)), parts, part_blocks


def backward(a: SparseAttnArgs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
             config: Optional[GridConfig] = None,
             pair: Optional[PairGrid] = None) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """dq [T, H, D] (q.dtype), dkv [N, G, D] (kv.dtype, accumulated in fp32),
    dsink [H] fp32 (None without a sink).  out [T, H, d_v], lse [T, H] fp32
    (+inf on empty rows) and dout [T, H, d_v] as the forward's.  config: the
    generic kernel's grid (default: persistent, one CTA an SM); pair: the
    two-CTA kernel's launch (``PairGrid``), for the shapes it serves."""
    from dsa.cute.sparse_attention_bwd import run_backward

    if pair_serves(a):
        from dsa.cute.sm100.sparse_attention_bwd_pair import PAIR_H

        shape = pair or PairGrid()

        def launch_pair(a, dout, lg2den, delta, dq, dkv_buf, t0, tc):
            _launch_pair(a, dout, lg2den, delta, dq, dkv_buf, t0, tc, shape)

        return run_backward(a, out, lse, dout, launch_pair, heads_per_part=PAIR_H)

    grid = config or DEFAULT

    def launch(a, dout, lg2den, delta, dq, dkv_buf, t0, tc):
        _launch_backward(a, dout, lg2den, delta, dq, dkv_buf, t0, tc, grid)

    return run_backward(a, out, lse, dout, launch)


def _launch_backward(a: SparseAttnArgs, dout, lg2den, delta, dq, dkv_buf, t0: int, tc: int,
                     grid: GridConfig) -> None:
    """The kernel over the tokens [t0, t0 + tc), under a's device: every
    per-token pointer starts at token t0, so the kernel sees tc tokens."""
    from dsa.cute.sm100.sparse_attention_bwd import SparseAttnBwdSm100
    from dsa.cute.sparse_attention_bwd import _ptr_types

    rows = slice(t0, t0 + tc)
    length = a.topk_length[rows] if a.topk_length is not None else a.indices  # never read when absent
    with torch.cuda.device(a.q.device):
        tensors = (a.q[rows], a.kv, a.indices[rows], length, dout[rows], lg2den[rows], delta[rows], dq[rows],
                   dkv_buf, zero_row(a.q.device, a.q.dtype, a.D))
        config = backward_config(a)
        fn = _compiled(SparseAttnBwdSm100, config, a.q.device, _ptr_types(config.dtype), _bwd_scalar_types())
        fn(*(address(x) for x in tensors), tc, a.N, a.K, float(a.sm_scale * LOG2E), float(a.sm_scale),
           grid.grid(a.q.device), stream_handle(a.q.device))


def _launch_pair(a: SparseAttnArgs, dout, lg2den, delta, dq, dkv_buf, t0: int, tc: int, shape: PairGrid) -> None:
    """The two-CTA kernel over the tokens [t0, t0 + tc), under a's device;
    a split launch adds dq into an fp32 workspace (zeroed on the launch
    stream, from the caching allocator) and casts it into dq."""
    from dsa.cute.sm100.sparse_attention_bwd_pair import SparseAttnBwdSm100Pair

    rows = slice(t0, t0 + tc)
    length = a.topk_length[rows] if a.topk_length is not None else a.indices  # never read when absent
    with torch.cuda.device(a.q.device):
        clusters = shape.clusters
        if clusters is None:
            clusters = max(1, torch.cuda.get_device_properties(a.q.device).multi_processor_count // 2)
        n_cl, parts, part_blocks = pair_launch_shape(tc, a.G, a.K, clusters, shape.split and not a.deterministic)
        dqacc = torch.zeros((tc, a.H, a.D), dtype=torch.float32, device=a.q.device) if parts > 1 else dkv_buf
        tensors = (a.q[rows], a.kv, a.indices[rows], length, dout[rows], lg2den[rows], delta[rows], dq[rows],
                   dkv_buf, zero_row(a.q.device, a.q.dtype, a.D))
        config = backward_config(a)
        fn = _compiled(SparseAttnBwdSm100Pair, config, a.q.device, _pair_pointer_types(config.dtype),
                       _pair_scalar_types())
        fn(*(address(x) for x in tensors), address(dqacc), tc, a.N, a.K, float(a.sm_scale * LOG2E),
           float(a.sm_scale), n_cl, parts, part_blocks, stream_handle(a.q.device))
        if parts > 1:
            dq[rows].copy_(dqacc)


def self_check_backward(config, device: torch.device, kernel=None,
                        reference=None) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """[(kernel's, reference's)] dq, dkv and dsink of ``config``'s backward
    on the hostile problem of ``hostile_problem`` (with sinks: +inf, -inf,
    3e38), its out and lse from the Triton forward and a random dout, the
    reference being the Triton backward (a grid of a few CTAs, so each runs
    several tiles; the two-CTA kernel runs under both its launch shapes,
    its outputs concatenated and compared with Triton's twice).  ``kernel``
    / ``reference`` (signature: a, out, lse, dout) stand in for them (the
    tests run the gate on CPU with stand-ins)."""
    import dataclasses

    from dsa.cute.sm100.sparse_attention_bwd_pair import PairBwdSm100Config
    from dsa.cute.sm100.sparse_attention_fwd import FwdSm100Config
    from dsa.triton import sparse_attention as triton_sa

    if kernel is None:
        def kernel(a, out, lse, dout):
            if not pair_serves(a):
                return backward(a, out, lse, dout, GridConfig(ctas=SELF_CHECK_CTAS))
            return _both_pair_shapes(a, out, lse, dout)
    if reference is None:
        reference = triton_sa.backward
        if isinstance(config, PairBwdSm100Config):
            def reference(a, out, lse, dout):  # the same result twice, as _both_pair_shapes returns it
                dq, dkv, dsink = triton_sa.backward(a, out, lse, dout)
                return (torch.cat([dq, dq]), torch.cat([dkv, dkv]),
                        None if dsink is None else torch.cat([dsink, dsink]))
    problem = FwdSm100Config(config.dtype, config.D, config.d_v, config.H, config.G, config.has_len, True)
    a = dataclasses.replace(hostile_problem(problem, device), deterministic=config.deterministic)
    out, lse = triton_sa.forward(a)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(a.T, a.H, a.d_v, generator=g).to(a.q.dtype).to(device)
    got, want = kernel(a, out, lse, dout), reference(a, out, lse, dout)
    return list(zip(got, want))


def _both_pair_shapes(a, out, lse, dout):
    """The two-CTA kernel's outputs on one problem under both launch shapes,
    concatenated: a cluster per row (persistent over SELF_CHECK_CTAS
    clusters), then every row split over clusters (dq added in fp32; the
    deterministic mode never splits, so it runs the first shape twice)."""
    one = backward(a, out, lse, dout, pair=PairGrid(clusters=SELF_CHECK_CTAS, split=False))
    split = backward(a, out, lse, dout, pair=PairGrid(clusters=4 * a.T, split=True))
    return tuple(None if x is None else torch.cat([x, y]) for x, y in zip(one, split))


def _bwd_scalar_types() -> Tuple:
    """The generic backward's scalar types: tc, N, K, sm_scale * log2(e), sm_scale, CTAs."""
    import cutlass

    I32, F32 = cutlass.Int32, cutlass.Float32
    return I32, I32, I32, F32, F32, I32


def _pair_pointer_types(dt) -> Tuple:
    """The two-CTA backward's pointer types: the SM90 backward's, then the fp32 dq workspace."""
    import cutlass

    from dsa.cute.sparse_attention_bwd import _ptr_types

    return _ptr_types(dt) + ((cutlass.Float32, 16),)


def _pair_scalar_types() -> Tuple:
    """The two-CTA backward's scalar types: tc, N, K, sm_scale * log2(e), sm_scale, clusters, parts, part blocks."""
    import cutlass

    I32, F32 = cutlass.Int32, cutlass.Float32
    return I32, I32, I32, F32, F32, I32, I32, I32


def compile_offline_pair(dtype: torch.dtype, has_len: bool, deterministic: bool, options: str = "--keep-ptx"):
    """Compile the two-CTA backward (bf16, H128, D576, one kv head) without a
    GPU (``CUTE_DSL_ARCH=sm_100a``); K, T and the launch shape are runtime
    values, so one build serves every K.  options as ``compile_offline``'s."""
    from dsa.cute.sm100.sparse_attention_bwd_pair import SparseAttnBwdSm100Pair

    dt = cutlass_dtype(dtype) or dtype
    kernel = SparseAttnBwdSm100Pair(dt, 576, SERVED_DV, 128, 1, has_len, deterministic)
    return compile_kernel(kernel, _pair_pointer_types(dt), _pair_scalar_types(), options)


def compile_offline_backward(dtype: torch.dtype, D: int, H: int, G: int, has_len: bool, deterministic: bool,
                             options: str = "--keep-ptx"):
    """Compile the backward without a GPU (``CUTE_DSL_ARCH=sm_100a``), for CI
    and inspection; returns the compiled object.  options as ``compile_offline``'s."""
    from dsa.cute.sm100.sparse_attention_bwd import SparseAttnBwdSm100
    from dsa.cute.sparse_attention_bwd import _ptr_types

    dt = cutlass_dtype(dtype) or dtype
    kernel = SparseAttnBwdSm100(dt, D, SERVED_DV, H, G, has_len, deterministic)
    return compile_kernel(kernel, _ptr_types(dt), _bwd_scalar_types(), options)
