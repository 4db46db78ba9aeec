"""tcgen05 ordering helpers for the SM100 kernels.

The tensor core's asynchronous operations (``tcgen05.mma``, ``tcgen05.ld``,
``tcgen05.st``) are ordered against a thread synchronisation (an mbarrier
arrive or wait, a ``bar.sync``) only through the two tcgen05 fences:

* ``before_sync()`` after a thread's TMEM loads / stores have completed
  (``tcgen05.wait::ld`` / ``::st``) and before it arrives on the barrier
  that hands the TMEM columns (or the MMA that may now overwrite them) to
  another warp;
* ``after_sync()`` after a wait on such a barrier and before the thread
  issues the tcgen05 operations that depend on it.

``wait_ld`` / ``wait_st`` wait for this thread's outstanding TMEM loads /
stores.  ``commit(bar)`` arrives once on mbarrier ``bar`` when every MMA the
issuing thread has launched so far has completed (one elected lane issues
it).  ``alloc_tmem`` / ``tmem_pointer`` / ``free_tmem``: one warp allocates
the columns before the CTA synchronisation of ``pipeline.init_mbarriers``,
every thread reads the address after it, and the warp frees them once every
thread is past its last TMEM access.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import tcgen05


def before_sync() -> None:
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC)


def after_sync() -> None:
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC)


def wait_ld() -> None:
    cute.arch.fence_view_async_tmem_load()


def wait_st() -> None:
    cute.arch.fence_view_async_tmem_store()


@cute.jit
def commit(bar):
    with cute.arch.elect_one():
        tcgen05.commit(bar)


@cute.jit
def alloc_tmem(warp, owner: cutlass.Constexpr, cols: cutlass.Constexpr, addr):
    """Warp ``owner`` allocates ``cols`` TMEM columns, their address written to
    shared memory at ``addr``; call before ``pipeline.init_mbarriers``."""
    if warp == owner:
        cute.arch.alloc_tmem(cols, addr)
        cute.arch.relinquish_tmem_alloc_permit()
        before_sync()


def tmem_pointer(addr):
    """The allocated TMEM (fp32 view), read after the synchronisation."""
    after_sync()
    return cute.arch.retrieve_tmem_ptr(Float32, 16, addr)


@cute.jit
def free_tmem(warp, owner: cutlass.Constexpr, cols: cutlass.Constexpr, tmem):
    """Every thread past its last TMEM access and (so) every MMA retired, warp
    ``owner`` frees the columns."""
    before_sync()
    cute.arch.sync_threads()
    if warp == owner:
        after_sync()
        cute.arch.dealloc_tmem(tmem, cols)


def check_lane_copy(tiled, load: bool, lanes: int, cols: int) -> None:
    """A TMEM load (``load``) or store over a [lanes, cols] view of TMEM as
    the kernels use it: thread i holds lane i, its register j column j.
    Checked at trace time on the register side's coordinates (the TMEM side
    is each warp's 32-lane block); a DSL that partitioned otherwise fails
    the compile instead of the results."""
    for i in sorted({0, 1, 15, 16, 31, 32, lanes // 2, lanes - 1}):
        thr = tiled.get_slice(i)
        regs = thr.partition_D if load else thr.partition_S
        c = regs(cute.make_identity_tensor((lanes, cols)))
        got = [c[j] for j in range(cols)]
        if got != [(i, j) for j in range(cols)]:
            raise ValueError(f"unexpected TMEM copy partition for thread {i}: {got}")


def check_identity_acc(layout, rows: int, cols: int) -> None:
    """An M = 128 accumulator as the kernels read it: row r in TMEM lane r,
    column c in column c (checked at trace time)."""
    for r in range(rows):
        for c in (0, 1, cols - 1):
            if cute.crd2idx(((r, c), 0, 0), layout) != (r << 16) + c:
                raise ValueError(f"unexpected TMEM accumulator layout {layout} at ({r}, {c})")
