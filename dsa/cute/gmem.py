"""Global-memory access helpers shared by the CuTe DSL kernels."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op

# createpolicy's L2 eviction priorities
EVICT_FIRST = "evict_first"
EVICT_LAST = "evict_last"


@cute.jit
def load(ptr: cute.Pointer, off: Int64):
    """ptr[off]: one element of global memory."""
    return cute.make_tensor(ptr + off, cute.make_layout((1,)))[0]


@cute.jit
def aligned(dtype: cutlass.Constexpr, addr: Int64, align: cutlass.Constexpr = 16) -> cute.Pointer:
    """A global pointer of ``dtype`` at byte address ``addr``, promised to be
    ``align``-byte aligned (so that copies from it may be vectorised)."""
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


@dsl_user_op
def l2_policy(priority: str, *, loc=None, ip=None) -> Int64:
    """An L2 cache policy giving the lines it touches ``priority``
    (``EVICT_FIRST``: streamed data that should leave L2 first;
    ``EVICT_LAST``: data that should stay)."""
    return Int64(llvm.inline_asm(
        Int64.mlir_type, [], f"createpolicy.fractional.L2::{priority}.b64 $0, 1.0;", "=l",
        has_side_effects=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    ))


@dsl_user_op
def _asm(text: str, constraints: str, *operands, loc=None, ip=None) -> None:
    """One instruction with side effects and no result, on DSL scalars."""
    llvm.inline_asm(None, [x.ir_value(loc=loc, ip=ip) for x in operands], text, constraints,
                    has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def store_b32_hinted(addr: Int64, value: Int32, policy: Int64) -> None:
    """``st.global.b32`` of value at addr under the L2 ``policy``."""
    _asm("st.global.L2::cache_hint.b32 [$0], $1, $2;", "l,r,l", Int64(addr), Int32(value), Int64(policy))


@cute.jit
def copy16_hinted(dst: cute.Tensor, src_addr: Int64, policy: Int64):
    """A 16-byte cp.async of global ``src_addr`` into ``dst`` (16 contiguous
    bytes of a shared tile under the 128-byte swizzle, ``S<3,4,3>``, of a
    1024-byte-aligned buffer) under the L2 ``policy``; completion is tracked
    as any cp.async's.  The DSL's pointer holds the address before the
    swizzle, so it is applied here: bits 4-6 ^= bits 7-9."""
    a = Int32(dst.iterator.toint())
    _asm("cp.async.cg.shared.global.L2::cache_hint [$0], [$1], 16, $2;", "r,l,l", a ^ ((a >> 3) & 0x70),
         Int64(src_addr), Int64(policy))


@cute.jit
def copy_head_rows(atom, tS, ptr: cute.Pointer, dtype: cutlass.Constexpr, t, H: cutlass.Constexpr, head0,
                   rows: cutlass.Constexpr, width: cutlass.Constexpr, row_in_pass, col0,
                   rows_per_pass: cutlass.Constexpr = 16, chunk: cutlass.Constexpr = 64,
                   real_rows: cutlass.Constexpr = None, zero_ptr: cute.Pointer = None, policy=None):
    """Issue the async copies of rows head0 .. head0 + rows - 1 of token t of
    a [T, H, width] tensor at ``ptr`` into ``tS`` (this thread's slice of the
    shared tile, [copy, pass, column chunk]): the thread copies columns
    col0 .. col0 + 7 of each ``chunk``-column chunk of the rows head0 +
    row_in_pass + rows_per_pass * m.  With ``real_rows`` (a multiple of
    rows_per_pass) the rows from head0 + real_rows on are copies of the
    zero row at ``zero_ptr`` (at least ``width`` elements): a tile padded
    past its heads.  With an L2 ``policy`` (``l2_policy``) the copies go
    out under it (``copy16_hinted``: the tile must be 128-byte swizzled).
    The caller signals their completion."""
    ES = dtype.width // 8
    for m in cutlass.range_constexpr(rows // rows_per_pass):
        row = head0 + row_in_pass + m * rows_per_pass
        addr = ptr.toint() + (Int64(t) * Int64(H) + Int64(row)) * Int64(width * ES) + col0 * ES
        if const_expr(real_rows is not None and m * rows_per_pass >= real_rows):
            addr = zero_ptr.toint() + col0 * ES
        for c in cutlass.range_constexpr(width // chunk):
            if const_expr(policy is not None):
                copy16_hinted(tS[None, m, c], addr + c * chunk * ES, policy)
            else:
                src = cute.make_tensor(aligned(dtype, addr + c * chunk * ES), cute.make_layout((8,)))
                cute.copy(atom, src, tS[None, m, c])


def gather_copier(dtype, tid):
    """The 16-byte cp.async atom of a 128-thread gather of [rows, 64 k]
    tiles and thread tid's slice of it: 8 threads per row, so each row's
    128-byte segments go out as full sectors; 16 rows per pass.  Returns
    (atom, slice, the thread's row in a pass, its first column)."""
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                               num_bits_per_copy=128)
    tiled = cute.make_tiled_copy_tv(atom, cute.make_ordered_layout((16, 8), order=(1, 0)), cute.make_layout((1, 8)))
    return atom, tiled.get_slice(tid), tid // 8, (tid % 8) * 8
