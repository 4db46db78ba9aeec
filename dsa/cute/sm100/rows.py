"""A thread's row of an M = 64 tile: the convention the SM100 attention kernels share.

Every ``tcgen05.mma`` of the sparse attention kernels has M = 64 (a block of
64 query heads, or of 64 slots).  Its accumulator uses 16 lanes of each
warp's 32-lane TMEM quadrant: the tensor core puts the first N-atom in lanes
0-15 of the quadrants and the second in lanes 16-31 (``check_tmem_rows``
checks the DSL's layout against this when a kernel is traced).  So a warp
of a 4-warp group loads, with one 32-lane ``tcgen05.ld.32x32b``
(``lane_copies``), 32 columns of row ``16 w + l % 16`` in the column half
``l / 16`` (the second atom), and a row's statistics need one shuffle with
lane l ^ 16.

A [64, 64] 16-bit operand tile in shared memory (P, dS) is the MMA's
K-major 128-byte-swizzled tile (``check_k_tile``); a thread writes its
row's 32 values there with four 16-byte stores (``store_tile_row``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import tcgen05

from dsa.cute.gmem import aligned
from dsa.cute.sm100 import sync

ROWS = 64       # M of every MMA: the rows of a tile
ROW_COLS = 32   # columns a thread loads (or stores) at once: one N-atom's share of its row
WARPS = 4       # a row group: one warp per TMEM lane quadrant


def check_tmem_rows(layout, n_atom: int) -> None:
    """The MMA accumulator layout the kernels are written for (M = 64): row
    r, column c at TMEM lane (r % 16) + 32 (r // 16) + 16 (c // n_atom) and
    column c % n_atom.  Checked at trace time; a DSL that laid M = 64
    accumulators out otherwise fails the compile instead of the results."""
    for r in range(ROWS):
        for c in (0, n_atom - 1, n_atom, 2 * n_atom - 1):
            got = cute.crd2idx((((r % 16, r // 16), c % n_atom), 0, c // n_atom), layout)
            want = (((r % 16) + 32 * (r // 16) + 16 * (c // n_atom)) << 16) + c % n_atom
            if got != want:
                raise ValueError(f"unexpected TMEM accumulator layout {layout}: ({r}, {c}) -> {got}, not {want}")


def check_k_tile(layout, dtype, cols: int = 64) -> None:
    """A [64, cols] operand tile's layout as ``store_tile_row`` writes it:
    16-bit elements, row r and column c at element cols r + c before the
    128-byte swizzle (which XORs the 16-byte chunk index, address bits 4-6,
    with bits 7-9)."""
    if dtype.width != 16 or str(layout.inner) != "S<3,4,3>":
        raise ValueError(f"unexpected operand tile layout {layout} for {dtype}")
    for r in range(ROWS):
        for c in range(0, cols, 8):
            if cute.crd2idx((r, c), layout.outer) != r * cols + c:
                raise ValueError(f"unexpected operand tile layout {layout}: ({r}, {c})")


def cols(tmem, col, n: int = ROW_COLS):
    """The row group's [128 lanes, n columns] TMEM view at column col."""
    return cute.make_tensor(tmem + col, cute.make_layout((32 * WARPS, n), stride=(1 << 16, 1)))


_REPEAT = {16: tcgen05.Repetition.x16, 32: tcgen05.Repetition.x32}


def lane_copies(tmem, tid, store: bool = True, n: int = ROW_COLS):
    """Thread tid's (0..127) 32-lane TMEM load and, when asked, store of n
    (16 or 32) columns (its lane, column j in register j; checked at trace
    time), and the register fragment's shape: (load, store or None, shape)."""
    phys = cols(tmem, 0, n)
    load = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(_REPEAT[n]), Float32), phys)
    sync.check_lane_copy(load, True, 32 * WARPS, n)
    r2t = None
    if store:
        st = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.St32x32bOp(_REPEAT[n]), Float32), phys)
        sync.check_lane_copy(st, False, 32 * WARPS, n)
        r2t = st.get_slice(tid)
    t2r = load.get_slice(tid)
    frag = t2r.partition_D(cute.make_identity_tensor((32 * WARPS, n))).shape
    return t2r, r2t, frag


@cute.jit
def store_tile_row(vals, tile_addr, row, half, cols_: cutlass.Constexpr = 64):
    """32 16-bit values ``vals`` of tile row ``row``, columns 32 half .. 32
    half + 31, into the K-major SW128 tile at shared address ``tile_addr``
    (``check_k_tile``): row r at byte 2 cols r, its 16-byte chunk j at chunk
    j ^ (r % 8); each of the four chunks is one 16-byte store.  The caller
    fences them for the tensor core."""
    words = cute.recast_tensor(vals, Int32)  # 16 words: chunk jj is words 4 jj .. 4 jj + 3
    row_addr = tile_addr + row * (cols_ * 2)
    for jj in cutlass.range_constexpr(ROW_COLS // 8):
        chunk = (half * (ROW_COLS // 8) + jj) ^ (row % 8)
        dst = cute.make_ptr(Int32, row_addr + chunk * 16, cute.AddressSpace.smem, assumed_align=16)
        cute.autovec_copy(cute.local_tile(words, (4,), (jj,)), cute.make_tensor(dst, cute.make_layout((4,))))


@cute.jit
def store_global(vals, dtype: cutlass.Constexpr, addr):
    """32 values of ``dtype`` to global memory at byte address addr (16-byte aligned)."""
    dst = cute.make_tensor(aligned(dtype, addr), cute.make_layout((ROW_COLS,)))
    cute.autovec_copy(vals, dst)
