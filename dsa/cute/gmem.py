"""Global-memory access helpers shared by the CuTe DSL kernels."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int64


@cute.jit
def load(ptr: cute.Pointer, off: Int64):
    """ptr[off]: one element of global memory."""
    return cute.make_tensor(ptr + off, cute.make_layout((1,)))[0]


@cute.jit
def aligned(dtype: cutlass.Constexpr, addr: Int64, align: cutlass.Constexpr = 16) -> cute.Pointer:
    """A global pointer of ``dtype`` at byte address ``addr``, promised to be
    ``align``-byte aligned (so that copies from it may be vectorised)."""
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)
