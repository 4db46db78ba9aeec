"""CuTe DSL sparse attention forward: what it serves, compilation cache, launch.

    forward(a) -> out [T, H, d_v] (q.dtype), lse [T, H] fp32
                  (+ bounds, fp32 [bound_numel(a)], with a.deterministic)

on the canonical packed layout of :class:`dsa._args.SparseAttnArgs`.  The
kernel is ``sparse_attention_sm90.SparseAttnFwdSm90``; what it can serve is
its ``can_implement``.  With ``deterministic`` the kernel's bounds build also
writes what the deterministic cute backward needs to bound each slot's
contributions (``bound_views``), which saves that backward a second S = Q K^T.
Compiled kernels are cached per (``FwdSm90Config``, device); every launch
runs under the tensors' device and its current stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from dsa._args import SparseAttnArgs
from dsa._rules import LOG2E
from dsa.cute.host import (address, alignment_reason, compile_kernel, cutlass_dtype, dsl_reason, int32_reason,
                           sm90_reason, stream_handle, zero_row)

SERVED_DV = 512


@dataclass(frozen=True)
class GridConfig:
    """The launch grid. A tile is one (token, kv head, 64 query heads).

    persistent: min(ctas, tiles) CTAs, each running the tiles c, c + ctas,
    ... in turn, so that a tile's first gathers and Q overlap the previous
    tile's final pair and epilogue; ctas None means the GPU's SM count (the
    default; tests take small counts to run many tiles a CTA).
    persistent False: one CTA per tile. The same compiled kernel serves both."""

    persistent: bool = True
    ctas: Optional[int] = None

    def grid(self, device: torch.device) -> int:
        """The CTA count passed to the kernel (it launches min(count, tiles))."""
        if not self.persistent:
            return 2**31 - 1
        if self.ctas is not None:
            return self.ctas
        return torch.cuda.get_device_properties(device).multi_processor_count


# The grid forward() runs when none is given.
DEFAULT = GridConfig()

# (FwdSm90Config, device index) -> compiled kernel: a compiled kernel's
# module is loaded in the context of the device it was compiled on.
_COMPILED: Dict[tuple, object] = {}


def supports(a: SparseAttnArgs) -> Optional[str]:
    """None when the SM90 kernel can serve ``a``, else the reason."""
    why = sm90_reason(a.q.device, "the cute sparse attention kernel")
    if why:
        return why

    def can_implement(*problem):
        from dsa.cute.sparse_attention_sm90 import SparseAttnFwdSm90

        return SparseAttnFwdSm90.can_implement(*problem)

    return call_reason(a, can_implement)


def call_reason(a: SparseAttnArgs, can_implement: Callable[..., Optional[str]]) -> Optional[str]:
    """Why a cute forward kernel whose ``can_implement(dtype, D, d_v, H, G)``
    is given cannot serve ``a`` on a GPU of its architecture (None if it can):
    dtypes, the kernel's shapes, int32 sizes, 16-byte aligned q and kv."""
    if a.kv.dtype != a.q.dtype:
        return f"kv dtype {a.kv.dtype} differs from q dtype {a.q.dtype}"
    why = dsl_reason()
    if why:
        return why
    why = can_implement(cutlass_dtype(a.q.dtype) or a.q.dtype, a.D, a.d_v, a.H, a.G)
    if why:
        return why
    why = a.kernel_dtype_reason()
    if why:
        return why
    why = int32_reason(a)
    if why:
        return why
    return alignment_reason(a, ("q", "kv"))


def kernel_config(a: SparseAttnArgs, profile: bool = False, refill: bool = True, ordered: bool = False):
    """The ``FwdSm90Config`` that serves ``a`` (the bounds build with
    a.deterministic; ordered: the build taking ``token_order``'s tiles)."""
    from dsa.cute.sparse_attention_sm90 import FwdSm90Config

    return FwdSm90Config(cutlass_dtype(a.q.dtype), a.D, a.d_v, a.H, a.G, a.topk_length is not None,
                         a.sink is not None, profile, refill, bool(a.deterministic), ordered)


# With an int R, a persistent grid running more than R rounds of tiles takes
# them in the order of descending topk_length: with rows of unequal length a
# static round-robin leaves its CTAs unequal shares.  Measured on an H200
# (bench/tune_cute.py --order, lengths uniform in [0, K], CUDA graphs): from
# 7.8 rounds on 1.02-1.11x faster at K 1152 and 2048 and level at K 640; at
# 3 rounds 0.83-1.17x, the argsort's cost against a short call's gain.
# None: always in token order.
ORDER_ROUNDS: Optional[int] = 4


def token_order(a: SparseAttnArgs, n_cta: int) -> Optional[torch.Tensor]:
    """int64 [T]: the tokens by descending topk_length, the order a
    persistent grid of ``n_cta`` CTAs takes a's tiles in
    (``scheduler.SlotTiles.order``); None where ``ORDER_ROUNDS`` is None,
    the call has no topk_length or the grid runs at most ``ORDER_ROUNDS``
    rounds of tiles.  Any order gives the same out: each tile is computed
    alone."""
    from dsa.cute.host import head_blocks

    if ORDER_ROUNDS is None or a.topk_length is None:
        return None
    if a.T * a.G * head_blocks(a.H // a.G) <= ORDER_ROUNDS * n_cta:
        return None
    # lengths past [0, K] order as their clamped values do; ties in any order
    return torch.argsort(a.topk_length, descending=True)


def bound_shapes(a: SparseAttnArgs) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """The shapes of the bounds build's two outputs: the head sums [T, G,
    HB, NB, 4, 64] (HB head blocks of 64 a kv head, NB = ceil(K / 64) slot
    blocks; one partial sum a warp of 16 heads) and the levels [T, NB, H]."""
    from dsa.cute.host import head_blocks

    nb = -(-a.K // 64)
    return (a.T, a.G, head_blocks(a.H // a.G), nb, 4, 64), (a.T, nb, a.H)


def bound_numel(a: SparseAttnArgs) -> int:
    """Elements of the forward's flat fp32 ``bounds`` output."""
    hs, lv = bound_shapes(a)
    return math.prod(hs) + math.prod(lv)


def bound_views(a: SparseAttnArgs, bounds: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(head sums, levels) of the flat ``bounds`` (``bound_shapes``).  Entries
    of blocks past a row's last one holding a valid slot are never written.

    head sums[t, g, hb, b, w, c]: sum over the heads 16 w .. 16 w + 15 of
    head block hb of p_h / l_h for slot 64 b + c, where at block b the kernel
    had p_h = exp2(S_h scale log2(e) - mu_h) and its running row sum l_h at
    mu_h (0 for an invalid slot); levels[t, b, h] = mu_h + log2(l_h).  The
    final P of slot j is at most p_h / l_h 2^(level_h - log2 den_h).
    Raises ValueError unless bounds is fp32 [bound_numel(a)]."""
    hs, lv = bound_shapes(a)
    n, total = math.prod(hs), bound_numel(a)
    if bounds.dim() != 1 or bounds.numel() != total or bounds.dtype != torch.float32:
        raise ValueError(f"the forward's bounds must be fp32 [{total}], got {bounds.dtype} {tuple(bounds.shape)}")
    return bounds[:n].view(hs), bounds[n:].view(lv)


def _compiled(a: SparseAttnArgs, profile: bool = False, refill: bool = True, ordered: bool = False):
    """The compiled kernel for ``a`` on a's device (compiled on first use,
    under that device)."""
    cfg = kernel_config(a, profile, refill, ordered)
    key = (cfg, a.q.device.index)
    fn = _COMPILED.get(key)
    if fn is None:
        from dsa.cute.sparse_attention_sm90 import SparseAttnFwdSm90

        fn = _COMPILED[key] = compile_kernel(SparseAttnFwdSm90.from_config(cfg), _sm90_pointer_types(cfg.dtype),
                                             scalar_types())
    return fn


def forward(a: SparseAttnArgs, config: Optional[GridConfig] = None,
            profile: Optional[torch.Tensor] = None, refill: bool = True) -> Tuple[torch.Tensor, ...]:
    """out [T, H, d_v] in q.dtype and lse [T, H] fp32 (sink excluded, +inf on
    empty rows); with a.deterministic also bounds, fp32 [bound_numel(a)]
    (``bound_views``), for the deterministic cute backward.

    profile: an int64 tensor of at least CTAs x 12 x 8 elements runs the
    kernel built with cycle counters (``sparse_attention_sm90.PROF_*``) and
    receives them, [CTA, warp, counter].  refill False runs the timing build
    that gathers each stage once (``bench/profile_cute.py``); its out is not
    the attention."""
    cfg = config or DEFAULT
    # Under a's device: its zero row, SM count, current stream and compiled
    # kernel are that device's, whatever device is current.
    with torch.cuda.device(a.q.device):
        out = torch.empty((a.T, a.H, a.d_v), dtype=a.q.dtype, device=a.q.device)
        lse = torch.empty((a.T, a.H), dtype=torch.float32, device=a.q.device)
        bounds = torch.empty(bound_numel(a), dtype=torch.float32, device=a.q.device) if a.deterministic else None
        # the cycle counters' and the bounds' pointers: written only by the profiling and the bounds builds
        ptrs = kernel_pointers(a, out, lse) + (address(profile if profile is not None else lse),)
        if bounds is not None:
            hs, lv = bound_views(a, bounds)
            ptrs += (address(hs), address(lv))
        else:
            ptrs += (address(lse), address(lse))
        n_cta = cfg.grid(a.q.device)
        order = token_order(a, n_cta)
        ptrs += (address(order if order is not None else lse),)  # read by the ordered build only
        scalars = kernel_scalars(a, n_cta)
        _compiled(a, profile is not None, refill, order is not None)(*ptrs, *scalars, stream_handle(a.q.device))
    return (out, lse) if bounds is None else (out, lse, bounds)


def pointer_types(dt) -> Tuple:
    """(element type, alignment) of ``kernel_pointers``' arguments, in order."""
    import cutlass

    I32, F32 = cutlass.Int32, cutlass.Float32
    return (dt, 16), (dt, 16), (I32, 4), (I32, 4), (F32, 4), (dt, 16), (F32, 4), (dt, 16)


def _sm90_pointer_types(dt) -> Tuple:
    """``pointer_types``, then the SM90 kernel's cycle counters (int64), head
    sums and levels (fp32, ``bound_views``) and token order (int64,
    ``token_order``)."""
    import cutlass

    I64 = cutlass.Int64
    return pointer_types(dt) + ((I64, 4), (cutlass.Float32, 8), (cutlass.Float32, 4), (I64, 4))


def kernel_pointers(a: SparseAttnArgs, out: torch.Tensor, lse: torch.Tensor) -> Tuple[int, ...]:
    """The pointer arguments every arch's forward kernel takes first: q, kv,
    indices, topk_length, sink, out, lse and the zero row."""
    # Absent optional inputs are never read; any valid address stands in.
    length = a.topk_length if a.topk_length is not None else a.indices
    sink = a.sink if a.sink is not None else lse
    return (address(a.q), address(a.kv), address(a.indices), address(length), address(sink), address(out),
            address(lse), address(zero_row(a.q.device, a.q.dtype, a.D)))


def scalar_types() -> Tuple:
    """The types of ``kernel_scalars``' values, in order."""
    import cutlass

    I32 = cutlass.Int32
    return I32, I32, I32, cutlass.Float32, I32


def kernel_scalars(a: SparseAttnArgs, n_cta: int) -> Tuple:
    """The kernel's scalar arguments: T, N, K, sm_scale * log2(e), the CTAs."""
    return a.T, a.N, a.K, float(a.sm_scale * LOG2E), n_cta


def compile_offline(dtype: torch.dtype, D: int, H: int, G: int, has_len: bool, has_sink: bool,
                    profile: bool = False, refill: bool = True, options: str = "--keep-ptx", bounds: bool = False,
                    ordered: bool = False):
    """Compile the kernel without a GPU (``CUTE_DSL_ARCH=sm_90a``), for CI and
    inspection; returns the compiled object (options: ``cute.compile``'s, the
    PTX kept by default)."""
    from dsa.cute.sparse_attention_sm90 import SparseAttnFwdSm90

    dt = cutlass_dtype(dtype) or dtype
    kernel = SparseAttnFwdSm90(dt, D, SERVED_DV, H, G, has_len, has_sink, profile, refill, bounds, ordered)
    return compile_kernel(kernel, _sm90_pointer_types(dt), scalar_types(), options)
