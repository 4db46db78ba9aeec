"""The KV gather of the SM100 attention kernels' loader warpgroup.

A block is 64 slots of a tile's row of indices.  The loader's 128 threads
copy its kv rows by index into a shared-memory stage [64 slots, D] with
16-byte cp.async (``dsa.cute.gmem.gather_copier``: 8 threads a row, 16 rows
a pass), a row of zeros for an invalid slot, and publish the block's mask
(0 or -inf by slot) with it; the validity rules are ``dsa.cute.rules``'.  A
block's indices are loaded while the previous block's copies fly.

Per block, a loader thread calls ``sources`` (the block's source rows and
masks, then the next block's indices), waits for the stage to be free (its
kernel's barrier), ``issue`` (the copies and the mask), possibly issues
more copies of its own, then ``land`` (its copies have landed and are
visible to the tensor core) before it arrives on the stage's barrier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from dsa.cute import rules
from dsa.cute.gmem import aligned, gather_copier

BN = 64             # slots a block
ROWS_PER_PASS = 16  # rows a copy pass of the 128 loader threads covers


@dataclass(frozen=True)
class BlockGather:
    """One loader thread's share of the gathers (built once per kernel by
    ``create``, never reassigned; its registers are updated in place)."""

    atom: Any         # the 16-byte cp.async atom
    thr: Any          # this thread's slice of the gather's tiled copy
    row_in_pass: Any  # this thread's row in a pass, and its first column
    col0: Any
    ns: Any           # indices of this thread's rows of the next block
    base: Any         # their source byte addresses (the kv row or the zero row) ...
    mk: Any           # ... and masks
    dtype: Any
    D: int
    G: int

    @staticmethod
    def create(dtype, ltid, D: int, G: int) -> "BlockGather":
        atom, thr, row_in_pass, col0 = gather_copier(dtype, ltid)
        n = BN // ROWS_PER_PASS
        return BlockGather(atom, thr, row_in_pass, col0, cute.make_rmem_tensor((n,), Int32),
                           cute.make_rmem_tensor((n,), Int64), cute.make_rmem_tensor((n,), Float32), dtype, D, G)

    @cute.jit
    def first(self, idx_row, L):
        """The indices of the tile's first block (its row at idx_row, slots [0, L) may be valid)."""
        rules.fetch_indices(self.ns, idx_row, 0, BN, self.row_in_pass, ROWS_PER_PASS, L)

    @cute.jit
    def sources(self, i, idx_row, L, N, kv_ptr, zero_ptr, g):
        """Block i's source rows and masks; then the indices of block i + 1
        load while block i's copies fly."""
        ES = self.dtype.width // 8
        rules.block_sources(self.base, self.mk, self.ns, i, L, N, kv_ptr, zero_ptr, g, self.G, self.D * ES,
                            self.col0 * ES, BN, self.row_in_pass, ROWS_PER_PASS)
        rules.fetch_indices(self.ns, idx_row, i + 1, BN, self.row_in_pass, ROWS_PER_PASS, L)

    @cute.jit
    def issue(self, tK, ok):
        """Copy the block into the stage (``tK``: this thread's partition of
        it, (copy, pass, 64-column chunk)) as one commit group, and write its
        mask (``ok``: the stage's [64] fp32 by slot; one thread a row)."""
        ES = self.dtype.width // 8
        for m in cutlass.range_constexpr(BN // ROWS_PER_PASS):
            for c in cutlass.range_constexpr(self.D // 64):
                src = cute.make_tensor(aligned(self.dtype, self.base[m] + c * 64 * ES), cute.make_layout((8,)))
                cute.copy(self.atom, src, tK[None, m, c])
        cute.arch.cp_async_commit_group()
        if self.col0 == 0:
            for m in cutlass.range_constexpr(BN // ROWS_PER_PASS):
                ok[self.row_in_pass + ROWS_PER_PASS * m] = self.mk[m]

    @cute.jit
    def land(self):
        """This thread's copies have landed; the fence makes them (and the
        mask) visible to the tensor core's async proxy before the caller's
        arrive releases them."""
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()
