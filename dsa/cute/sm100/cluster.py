"""Cluster helpers of the SM100 two-CTA kernels: a (2, 1, 1) cluster whose
CTAs issue ``cta_group::2`` MMAs from the first (the leader).  The helpers
every cluster kernel shares (rank, remote arrive, cluster-scope wait, remote
stores, the proxy fence, the cluster barrier) are ``dsa.cute.cluster``'s,
re-exported here.

* ``commit(bar)``: the leader's MMA thread arrives on ``bar`` of both CTAs
  when every MMA it issued so far has completed (multicast).
* ``alloc_tmem`` / ``free_tmem``: the two-CTA tensor memory allocation, made
  by one warp of each CTA; the free waits for the peer's warp so that no
  CTA releases its columns while the peer's MMAs may still write them.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import tcgen05

from dsa.cute.cluster import PAIR, arrive, fence_remote, rank, store16, sync, wait  # noqa: F401 (re-exported)

BOTH = 0b11        # multicast mask: both CTAs


@cute.jit
def commit(bar):
    with cute.arch.elect_one():
        tcgen05.commit(bar, BOTH, tcgen05.CtaGroup.TWO)


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
