"""Cluster helpers of the SM100 two-CTA kernels: a (2, 1, 1) cluster whose
CTAs issue ``cta_group::2`` MMAs from the first (the leader).

* ``rank()``: this CTA's rank in the cluster (0 leads).
* ``arrive(bar, rank)``: arrive on mbarrier ``bar`` (an address in this
  CTA's shared memory, the same struct field in every CTA) of CTA ``rank``,
  with cluster-scope release: every shared-memory write of this thread
  before it, local or remote, is visible to a cluster-scope acquirer
  (``wait``) of that barrier.
* ``wait(bar, phase)``: wait for a phase of a local mbarrier with
  cluster-scope acquire (for barriers other CTAs arrive on).
* ``commit(bar)``: the leader's MMA thread arrives on ``bar`` of both CTAs
  when every MMA it issued so far has completed (multicast).
* ``store16(addr, rank, words)``: 16 bytes (four 32-bit words) to the
  shared-memory address ``addr`` (this CTA's offset) of CTA ``rank``
  (``mapa`` + ``st.shared::cluster``); ``fence_remote()`` after such stores
  orders them before the tensor core's (async proxy) reads, ahead of the
  arrive that hands them over.
* ``alloc_tmem`` / ``free_tmem``: the two-CTA tensor memory allocation, made
  by one warp of each CTA; the free waits for the peer's warp so that no
  CTA releases its columns while the peer's MMAs may still write them.
* ``sync()``: a cluster-wide barrier (every thread of both CTAs).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.nvgpu import tcgen05
from cutlass.cutlass_dsl import dsl_user_op

PAIR = 2           # CTAs of a cluster
BOTH = 0b11        # multicast mask: both CTAs


def rank():
    return cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())


def arrive(bar, to_rank) -> None:
    cute.arch.mbarrier_arrive(bar, to_rank, scope=nvvm.MemScopeKind.CLUSTER)


@dsl_user_op
def _try_wait(bar, phase, *, loc=None, ip=None) -> Int32:
    addr = bar.toint(loc=loc, ip=ip).ir_value()
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [addr, Int32(phase).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [$1], $2, 10000000;\n\t"
        "selp.u32 $0, 1, 0, p;\n\t}",
        "=r,r,r", has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    ))


@cute.jit
def wait(bar, phase):
    done = _try_wait(bar, phase)
    while done == 0:
        done = _try_wait(bar, phase)


@cute.jit
def commit(bar):
    with cute.arch.elect_one():
        tcgen05.commit(bar, BOTH, tcgen05.CtaGroup.TWO)


@dsl_user_op
def store16(addr, to_rank, w0, w1, w2, w3, *, loc=None, ip=None) -> None:
    """addr: Int32 shared-memory address in this CTA's window."""
    ops = [Int32(addr).ir_value(loc=loc, ip=ip), Int32(to_rank).ir_value(loc=loc, ip=ip)]
    ops += [Int32(w).ir_value(loc=loc, ip=ip) for w in (w0, w1, w2, w3)]
    llvm.inline_asm(
        None, ops,
        "{\n\t.reg .b32 ra;\n\tmapa.shared::cluster.u32 ra, $0, $1;\n\t"
        "st.shared::cluster.v4.b32 [ra], {$2, $3, $4, $5};\n\t}",
        "r,r,r,r,r,r", has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )


def fence_remote() -> None:
    cute.arch.fence_proxy("async.shared", space="cluster")


def sync() -> None:
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()


@cute.jit
def alloc_tmem(warp, owner: cutlass.Constexpr, cols: cutlass.Constexpr, addr):
    """Warp ``owner`` of each CTA allocates ``cols`` columns for the pair
    (``tcgen05.alloc.cta_group::2``); call before the barriers' initialisation."""
    if warp == owner:
        cute.arch.alloc_tmem(cols, addr, is_two_cta=True)
        cute.arch.relinquish_tmem_alloc_permit(is_two_cta=True)
        nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC)


@cute.jit
def free_tmem(warp, owner: cutlass.Constexpr, cols: cutlass.Constexpr, tmem, bar):
    """After the cluster's last synchronisation: warp ``owner`` tells the
    peer's it is done (``bar``, 32 arrivals, in each CTA), waits for the
    peer's word, and frees the pair's columns."""
    if warp == owner:
        nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC)
        cute.arch.mbarrier_arrive(bar, rank() ^ 1, scope=nvvm.MemScopeKind.CLUSTER)
        wait(bar, 0)
        cute.arch.dealloc_tmem(tmem, cols, is_two_cta=True)
