"""Barriers and pipeline helpers shared by the CuTe DSL kernels.

Three kinds of synchronisation run a warp-specialised kernel here:

* **mbarriers** in shared memory carry a stage between a producer and its
  consumers.  A barrier completes a phase each time its arrival count is
  reached; a waiter names the parity of the phase it waits for.  The n-th
  use (0-based) of a barrier that is arrived on once per use completes
  phase parity ``phase(n)``; a producer refilling a buffer waits for the
  release of its previous use, ``freed_phase(n)``.  ``init_mbarriers`` sets
  them up once per CTA.
* **named barriers** (``bar.sync`` / ``bar.arrive`` with an id) order
  warpgroups that hand registers' results to each other through shared
  memory: one side arrives, the other waits.  A kernel lists its ids in an
  enum derived from ``NamedBarrier`` and checked by ``named_barriers``.
* **wgmma groups**: ``warpgroup.wait_group(n)`` waits until at most n
  committed groups are in flight.

``Timer`` wraps each of these waits with per-warp cycle counters for a
kernel's profiling build; with the counters off it emits no instruction, so
the plain build is unchanged by it.
"""

from __future__ import annotations

import enum
from typing import Iterable, Tuple, Type

import cutlass
import cutlass.cute as cute
from cutlass import Int64, const_expr
from cutlass.cute.nvgpu import warpgroup

# bar.sync ids 0..15; 0 is the one sync_threads uses.
MAX_NAMED_BARRIER = 15


class NamedBarrier(enum.IntEnum):
    """Base of a kernel's named-barrier ids (derive an IntEnum with members 1..15)."""


def named_barriers(cls: Type[NamedBarrier]) -> Type[NamedBarrier]:
    """Class decorator: the ids are unique and in 1..15 (0 is sync_threads')."""
    ids = [int(m) for m in cls.__members__.values()]  # aliases (repeated values) included
    if len(set(ids)) != len(ids) or not all(1 <= i <= MAX_NAMED_BARRIER for i in ids):
        raise ValueError(f"{cls.__name__}: named barrier ids must be unique and in 1..{MAX_NAMED_BARRIER}, "
                         f"got {ids}")
    return cls


def arrive(barrier: int, threads: int) -> None:
    """Arrive on named barrier ``barrier`` of ``threads`` threads without waiting."""
    cute.arch.barrier_arrive(barrier_id=barrier, number_of_threads=threads)


def sync(barrier: int, threads: int) -> None:
    """Arrive on named barrier ``barrier`` of ``threads`` threads and wait for the others."""
    cute.arch.barrier(barrier_id=barrier, number_of_threads=threads)


@cute.jit
def init_mbarriers(tidx, arrivals: Iterable[Tuple[cute.Pointer, int, int]]):
    """Thread 0 initialises each (mbarrier array, element, arrival count) in
    the order given; then every thread fences the initialisation and the CTA
    synchronises, so that no thread arrives on or waits for a barrier before
    it exists."""
    if tidx == 0:
        for array, element, count in arrivals:
            cute.arch.mbarrier_init(array + element, count)
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()


def phase(use):
    """The phase parity that the ``use``-th completion (0-based) of an mbarrier ends."""
    return use % 2


def freed_phase(use):
    """The parity a producer waits on before its ``use``-th fill (use > 0) of a
    buffer: the release of the previous use, one phase ago."""
    return (use + 1) % 2


class Timer:
    """Per-warp cycle counters (``counters`` int64 slots) for a profiling build.

    ``start`` opens the counters in registers, ``tick`` / ``tock(slot, t0)``
    add the cycles between them to a slot, the ``wait_*`` methods are the
    timed waits, ``store`` writes the counters of each warp.  Disabled, every
    method compiles to nothing (``tick`` returns a constant 0)."""

    def __init__(self, enabled: bool, counters: int):
        self.enabled, self.counters = enabled, counters

    @cute.jit
    def start(self):
        if const_expr(self.enabled):
            self._acc = cute.make_rmem_tensor((self.counters,), Int64)
            self._acc.fill(0)
            self._t0 = cute.arch.clock64()

    @cute.jit
    def tick(self):
        t = Int64(0)
        if const_expr(self.enabled):
            t = cute.arch.clock64()
        return t

    @cute.jit
    def tock(self, slot: cutlass.Constexpr, t0):
        if const_expr(self.enabled):
            self._acc[slot] = self._acc[slot] + (cute.arch.clock64() - t0)

    @cute.jit
    def wait_mbarrier(self, bar, parity, slot: cutlass.Constexpr):
        """Wait for the phase of parity ``parity`` of mbarrier ``bar``."""
        t0 = self.tick()
        cute.arch.mbarrier_wait(bar, parity)
        self.tock(slot, t0)

    @cute.jit
    def wait_wgmma(self, pending: cutlass.Constexpr, slot: cutlass.Constexpr):
        """Wait until at most ``pending`` committed wgmma groups are in flight."""
        t0 = self.tick()
        warpgroup.wait_group(pending)
        self.tock(slot, t0)

    @cute.jit
    def wait_barrier(self, barrier: cutlass.Constexpr, threads: cutlass.Constexpr, slot: cutlass.Constexpr):
        """Arrive on named barrier ``barrier`` of ``threads`` threads and wait for it."""
        t0 = self.tick()
        cute.arch.barrier(barrier_id=barrier, number_of_threads=threads)
        self.tock(slot, t0)

    @cute.jit
    def store(self, prof_ptr, tidx, warps_per_cta: cutlass.Constexpr, total: cutlass.Constexpr):
        """Slot ``total`` gets the cycles since ``start``; lane 0 of each warp
        writes its counters to prof[cta, warp, :] (int64, [CTAs, warps_per_cta,
        counters])."""
        if const_expr(self.enabled):
            self._acc[total] = cute.arch.clock64() - self._t0
            cta, _, _ = cute.arch.block_idx()
            if tidx % 32 == 0:
                base = (Int64(cta) * Int64(warps_per_cta) + Int64(tidx // 32)) * Int64(self.counters)
                out = cute.make_tensor(prof_ptr + base, cute.make_layout((self.counters,)))
                for c in cutlass.range_constexpr(self.counters):
                    out[c] = self._acc[c]
