"""Sparse attention forward for Blackwell (SM100) in CuTe DSL.

One CTA per tile (token t, kv head g, block of 64 query heads; the
persistent order of ``dsa.cute.scheduler``), nine warps in three roles:

* warps 4-7, the loader, gather the kv rows of each block of 64 slots by
  index with 16-byte cp.async into one of two swizzled shared-memory stages
  [64 slots, D] (a row of zeros for an invalid slot: ``dsa.cute.rules``),
  and Q [64 heads, D] once a tile.  Each thread waits for its own copies,
  fences them into the async proxy the tensor core reads through, and then
  arrives on the stage's ``k_full`` barrier; with the stage it publishes the
  block's mask (0 or -inf by slot) in shared memory.
* warp 8, the MMA warp, allocates the tensor memory and issues every
  ``tcgen05.mma`` from one thread:  S = Q K^T of block i into one of two
  TMEM buffers, then O += P V of block i - 1 (so the softmax of block i
  runs under the tensor core's work on block i - 1).  V is the stage itself
  read MN-major (its first d_v columns), as in the SM90 forward.  A
  ``tcgen05.commit`` after each S and each P V signals its completion.
* warps 0-3, the softmax warpgroup, read S from TMEM (``tcgen05.ld``), mask
  and scale it, keep the running row maxima and sums, write P (q.dtype) to
  shared memory for the P V MMA, rescale O in TMEM when a row maximum grows
  (see below), and at the tile's end read O from TMEM and store out and lse.

Tensor memory (512 columns of 128 lanes, fp32).  Every MMA has M = 64 (one
head block), whose accumulator uses 16 lanes of each warp's 32-lane
quadrant: the tensor core puts the first N-atom of an accumulator in lanes
0-15 of the quadrants and the second in lanes 16-31 (the MMA layouts are
checked against this when the kernel is traced, ``rows.check_tmem_rows``).
So O [64, 512] is two N = 256 atoms in columns [0, 256), and each S buffer
[64, 64] two N = 32 atoms in 32 columns ([256, 288) and [288, 320)).  Thread
l of softmax warp w (its own quadrant) then holds, with one 32-lane TMEM load,
row 16 w + l % 16 of S (slots 32 (l / 16) ...) and of O (columns
256 (l / 16) ...): a row's statistics need one shuffle with lane l ^ 16.

Online softmax with O in TMEM (log2 domain, rows as in ``dsa.cute.rules``).
A row keeps a reference maximum m and exponentiates with it; m moves only
when the block's maximum exceeds it by more than ``RESCALE_LOG2`` (so P <=
2^8), and only then is O rescaled by exp2(m_old - m_new): the warp waits for
the previous P V to retire, loads its rows of O, scales and stores them back,
before it hands P to the MMA warp.  A row whose m is still -inf holds O = 0
(or NaN) and needs no rescale.  Row maxima propagate NaN (``fmax`` with
``nan=True``), and NaN in a score reaches l and O through exp2, so NaN in q
or in a valid kv row gives NaN out; a padded slot's score is -inf whatever
S is, so a NaN query row with no valid slot gives out = 0 and lse = +inf
like any empty row.  The sink is folded into the denominator
at the end relative to m (+inf or a huge sink gives out = 0, -inf none).

Every barrier is an mbarrier used once per block, per tile or per stage
use; the phases are derived from counters that every role keeps the same way
(tiles with no valid slot are skipped by the loader and the MMA warp, and
written as zeros with lse = +inf by the softmax warpgroup).  A barrier
that is waited on with a parity can never run two phases ahead of its
waiter: each one's next arrival depends on the waiter's progress (the
argument is written at each barrier in ``Smem``).  Compiled per
``FwdSm100Config`` and cached by ``dsa.cute.sm100.sparse_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

from dsa.cute import pipeline, rules, scheduler
from dsa.cute.gmem import copy_head_rows
from dsa.cute.rules import LOG2E, finite_shift
from dsa.cute.sm100 import rows, sync
from dsa.cute.sm100.gather import BlockGather
from dsa.cute.sm100.rows import ROW_COLS  # columns of S, and of each O chunk, a thread loads at once

BLOCK_H = 64          # query heads per CTA: the M of every tcgen05.mma
BN = 64               # slots per block and stage; two stages
S_ATOM_N = 32         # the two N-atoms of S share TMEM columns (lanes 0-15 / 16-31)
O_ATOM_N = 256        # likewise the two halves of O
SOFTMAX_WARPS = 4     # one per TMEM lane quadrant
LOADER_WARPS = 4
MMA_WARP = SOFTMAX_WARPS + LOADER_WARPS
THREADS = 32 * (MMA_WARP + 1)
TMEM_COLS = 512       # allocation unit: a power of two >= the 320 used
O_COL = 0             # O: columns [0, 256)
S_COL = 256           # S buffer s: columns [256 + 32 s, 288 + 32 s)
RESCALE_LOG2 = 8.0    # O is rescaled only when a row maximum grows by more (P <= 2^8)
MASK_WRITERS = 16     # loader threads that write a block's mask: one per row of a copy pass
SMEM_LIMIT = 227 * 1024  # the largest dynamic shared memory of an SM100 CTA


@dataclass(frozen=True)
class FwdSm100Config(scheduler.ProblemConfig):
    """The static configuration one compiled kernel serves (its compile key):
    the problem, then has_sink (the call passes ``sink``)."""

    has_sink: bool


def smem_bytes(D: int, d_v: int, elem_bytes: int) -> int:
    """Shared memory of the kernel's ``Smem`` struct, laid out as the DSL
    lays it out: barriers and the TMEM address, Q [64, D], two K stages
    [64, D], the P buffers (two [64, 64] when D == d_v; with D > d_v, P of a
    stage lives in its RoPE columns, dead once S is computed, and the field
    is one unused element), the masks; the tiles 1024-byte aligned for the
    128-byte swizzle, and the whole rounded up to that alignment."""
    def up(n: int, a: int = 1024) -> int:
        return -(-n // a) * a

    p_elems = 1 if D > d_v else 2 * BLOCK_H * BN
    off = up(13 * 8 + 4) + BLOCK_H * D * elem_bytes
    off = up(off) + 2 * BN * D * elem_bytes
    off = up(off) + p_elems * elem_bytes
    return up(up(off, 16) + 4 * 2 * BN)


@dataclass(frozen=True)
class Bars:
    """The mbarriers (shared-memory pointers); s indexes a stage / S buffer."""

    q_full: Any    # loader -> MMA: Q of the tile landed (128 arrivals)
    q_empty: Any   # MMA -> loader: every S of the tile retired (commit)
    k_full: Any    # [2] loader -> MMA, softmax: stage s and its mask landed (128)
    pv_done: Any   # [2] MMA -> loader, softmax: P V of the block in stage s retired (commit)
    s_full: Any    # [2] MMA -> softmax: S of the block in buffer s retired (commit)
    s_free: Any    # [2] softmax -> MMA: S buffer s read (128)
    p_full: Any    # [2] softmax -> MMA: P of stage s written, O rescaled (128)
    o_free: Any    # softmax -> MMA: O of the tile read by the epilogue (128)


@dataclass(frozen=True)
class SoftmaxState:
    """What the softmax warpgroup's steps share over all tiles (built once,
    never reassigned; its tensors are updated in place)."""

    t2r: Any       # 32-lane TMEM load of 32 columns, this thread's slice
    r2t: Any       # the matching TMEM store
    rS: Any        # S of this thread's row, 32 slots (fp32)
    rP: Any        # P in q.dtype
    rM: Any        # the block's mask for those slots
    rO: Any        # a 32-column chunk of O
    st: Any        # [m, l, alpha, fix]: reference maximum, partial row sum, rescale
    tmem: Any      # TMEM base pointer (fp32)
    sK_raw: Any    # stage memory (q.dtype elements) and the P buffers
    sP_raw: Any
    ok: Any        # the loader's masks, [stage, slot]
    row: Any       # this thread's row (0..63) and column half (0 / 1)
    half: Any
    lane: Any
    scale_log2: Any


class SparseAttnFwdSm100:
    """Host-side builder of the kernel for one static configuration."""

    def __init__(self, dtype, D: int, d_v: int, H: int, G: int, has_len: bool, has_sink: bool):
        why = self.can_implement(dtype, D, d_v, H, G)
        if why is not None:
            raise ValueError(f"SparseAttnFwdSm100: {why}")
        self.config = FwdSm100Config(dtype, D, d_v, H, G, has_len, has_sink)
        self.dtype = dtype
        self.D, self.d_v, self.H, self.G = D, d_v, H, G
        self.HG = H // G
        self.has_len, self.has_sink = has_len, has_sink

    @classmethod
    def from_config(cls, config: FwdSm100Config) -> "SparseAttnFwdSm100":
        return cls(**{f.name: getattr(config, f.name) for f in fields(config)})

    @staticmethod
    def can_implement(dtype, D: int, d_v: int, H: int, G: int) -> Optional[str]:
        """None when the kernel serves this configuration, else the reason.
        dtype: ``cutlass.BFloat16`` / ``cutlass.Float16``."""
        return scheduler.kernel_reason(dtype, D, d_v, H, G, BLOCK_H, smem_bytes, SMEM_LIMIT, "SM100")

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        sink_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, zero_ptr: cute.Pointer,
        T: Int32, N: Int32, K: Int32, scale_log2: Float32, n_cta: Int32, stream,
    ):
        dt = self.dtype
        K_, MN = OperandMajorMode.K, OperandMajorMode.MN
        qk_mma = cute.make_tiled_mma(tcgen05.MmaF16BF16Op(
            dt, Float32, (BLOCK_H, S_ATOM_N, 16), tcgen05.CtaGroup.ONE, tcgen05.OperandSource.SMEM, K_, K_))
        pv_mma = cute.make_tiled_mma(tcgen05.MmaF16BF16Op(
            dt, Float32, (BLOCK_H, O_ATOM_N, 16), tcgen05.CtaGroup.ONE, tcgen05.OperandSource.SMEM, K_, MN))
        # Layouts.  Q [64 heads, D] and each K stage [64 slots, D]: K-major
        # 128B-swizzled atoms of 8 rows x 64 columns, rows first, so each
        # 64-column chunk of a tile is one contiguous 8 KB block.  V, the B
        # operand of P V, is the same bytes read MN-major: the MN-major atom
        # (64 columns x 8 slots) is byte for byte the K-major one, and tiling
        # slots first keeps the atom order.  P [64 heads, 64 slots] is a
        # K-major A operand, one 8 KB block: with D = 576 it lives in the
        # stage's last chunk (columns 512..575, read only by S).
        k_atom = tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.K_SW128, dt)
        mn_atom = tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.MN_SW128, dt)
        sq_layout = cute.tile_to_shape(k_atom, (BLOCK_H, self.D), order=(0, 1))
        sk_layout = cute.tile_to_shape(k_atom, (BN, self.D, 2), order=(0, 1, 2))
        sv_layout = cute.tile_to_shape(mn_atom, (self.d_v, BN), order=(1, 0))
        sp_layout = cute.tile_to_shape(k_atom, (BLOCK_H, BN), order=(0, 1))
        p_elems = 1 if self.D > self.d_v else 2 * BLOCK_H * BN  # unused single element with D > d_v
        rows.check_k_tile(sp_layout, dt)

        @cute.struct
        class Smem:  # smem_bytes() is its size
            # Why no barrier can run two phases ahead of a waiter:
            # q_full: the next tile's Q needs q_empty, which needs the MMA
            #   warp past this wait.  q_empty: the next commit needs the next
            #   Q, which needs the loader past this wait.  k_full[s]: refilled
            #   only after pv_done of the block, after both waiters.
            #   pv_done[s]: the next P V in stage s needs p_full from the
            #   softmax, which the loader's refill precedes.  s_full / s_free /
            #   p_full [s]: each next arrival needs the other side's step on
            #   the same buffer.  o_free: the next arrival needs P V of the
            #   next tile, issued after the MMA warp's wait.
            q_full: cute.struct.MemRange[Int64, 1]
            q_empty: cute.struct.MemRange[Int64, 1]
            k_full: cute.struct.MemRange[Int64, 2]
            pv_done: cute.struct.MemRange[Int64, 2]
            s_full: cute.struct.MemRange[Int64, 2]
            s_free: cute.struct.MemRange[Int64, 2]
            p_full: cute.struct.MemRange[Int64, 2]
            o_free: cute.struct.MemRange[Int64, 1]
            tmem_addr: Int32  # written by tcgen05.alloc
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sq_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sk_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[dt, p_elems], 1024]
            # the mask of the block in each stage, by slot
            sOk: cute.struct.Align[cute.struct.MemRange[Float32, 2 * BN], 16]

        self.smem = Smem
        n_tiles = scheduler.tile_count(T, self.G, self.HG // BLOCK_H)
        self.kernel(
            qk_mma, pv_mma, sq_layout, sk_layout, sv_layout, sp_layout,
            q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr, zero_ptr,
            N, K, n_tiles, scale_log2,
        ).launch(grid=[scheduler.grid_size(n_cta, n_tiles), 1, 1], block=[THREADS, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma,
        sq_layout: cute.ComposedLayout, sk_layout: cute.ComposedLayout, sv_layout: cute.ComposedLayout,
        sp_layout: cute.ComposedLayout,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        sink_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, zero_ptr: cute.Pointer,
        N: Int32, K: Int32, n_tiles: Int32, scale_log2: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        sched = scheduler.TileScheduler.create(n_tiles, self.G, self.HG // BLOCK_H)

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(self.smem)
        bars = Bars(st.q_full.data_ptr(), st.q_empty.data_ptr(), st.k_full.data_ptr(), st.pv_done.data_ptr(),
                    st.s_full.data_ptr(), st.s_free.data_ptr(), st.p_full.data_ptr(), st.o_free.data_ptr())
        sQ = st.sQ.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sK = st.sK.get_tensor(sk_layout.outer, swizzle=sk_layout.inner)
        tmem_addr = st.tmem_addr.ptr

        sync.alloc_tmem(warp, MMA_WARP, TMEM_COLS, tmem_addr)
        arrivals = [(bars.q_full, 0, 32 * LOADER_WARPS), (bars.q_empty, 0, 1), (bars.o_free, 0, 32 * SOFTMAX_WARPS)]
        for s in cutlass.range_constexpr(2):
            arrivals += [(bars.k_full, s, 32 * LOADER_WARPS), (bars.pv_done, s, 1), (bars.s_full, s, 1),
                         (bars.s_free, s, 32 * SOFTMAX_WARPS), (bars.p_full, s, 32 * SOFTMAX_WARPS)]
        pipeline.init_mbarriers(tidx, arrivals)
        tmem = sync.tmem_pointer(tmem_addr)

        tiles = scheduler.SlotTiles(sched, idx_ptr, len_ptr, K)
        if warp < SOFTMAX_WARPS:
            ss = self.softmax_state(tidx, tmem, st.sK.data_ptr(), st.sP.data_ptr(), st.sOk.data_ptr(), scale_log2)
            self.softmax(ss, bars, tiles, sink_ptr, out_ptr, lse_ptr)
        elif warp < MMA_WARP:
            self.loader(tidx - 32 * SOFTMAX_WARPS, sQ, sK, st.sOk.data_ptr(), bars, tiles, q_ptr, kv_ptr,
                        zero_ptr, N)
        else:
            self.mma(qk_mma, pv_mma, sv_layout, sp_layout, sQ, sK, st.sP.data_ptr(), tmem, bars, tiles)

        # Every TMEM access and MMA has completed (the softmax warpgroup waited
        # for the last P V of each of its tiles); the MMA warp frees the columns.
        sync.free_tmem(warp, MMA_WARP, TMEM_COLS, tmem)

    @cute.jit
    def tile(self, tiles: scheduler.SlotTiles, tile_id):
        """(t, g, head0, L, n_blocks, the row's indices) of tile tile_id."""
        return tiles.tile(tile_id, self.HG, BLOCK_H, BN, self.has_len)

    # ---------------------------------------------------------------- loader
    @cute.jit
    def loader(self, ltid, sQ, sK, sOk, bars: Bars, tiles: scheduler.SlotTiles, q_ptr, kv_ptr, zero_ptr, N):
        sched = tiles.sched
        gather = BlockGather.create(self.dtype, ltid, self.D, self.G)
        tK = gather.thr.partition_D(sK)  # (copy, pass, 64-column chunk, stage)
        ok = cute.make_tensor(sOk, cute.make_layout((2, BN), stride=(BN, 1)))
        nb = Int32(0)  # blocks of earlier tiles (stage of block b: b % 2, its use: b // 2)
        jq = Int32(0)  # earlier tiles with a valid slot
        for tile_id in cutlass.range(sched.first, sched.n_tiles, sched.stride, unroll=1):
            t, g, head0, L, n_blocks, idx_row = self.tile(tiles, tile_id)
            if n_blocks > 0:
                gather.first(idx_row, L)
                for i in cutlass.range(n_blocks, unroll=1):
                    gather.sources(i, idx_row, L, N, kv_ptr, zero_ptr, g)
                    b = nb + i
                    s = b % 2
                    u = b // 2
                    if u > 0:  # P V of the block that last used the stage (and its P, its mask) retired
                        cute.arch.mbarrier_wait(bars.pv_done + s, pipeline.phase(u - 1))
                    gather.issue(tK[None, None, None, s], ok[s, None])
                    if i == 0:
                        if jq > 0:  # every S of the last tile retired: Q may be overwritten
                            cute.arch.mbarrier_wait(bars.q_empty, pipeline.phase(jq - 1))
                        copy_head_rows(gather.atom, gather.thr.partition_D(sQ), q_ptr, self.dtype, t, self.H,
                                       head0, BLOCK_H, self.D, gather.row_in_pass, gather.col0)
                        cute.arch.cp_async_commit_group()
                    gather.land()
                    if i == 0:
                        cute.arch.mbarrier_arrive(bars.q_full)
                    cute.arch.mbarrier_arrive(bars.k_full + s)
                nb = nb + n_blocks
                jq = jq + 1

    # ------------------------------------------------------------------- MMA
    @cute.jit
    def mma(self, qk_mma, pv_mma, sv_layout, sp_layout, sQ, sK, sP, tmem, bars: Bars, tiles: scheduler.SlotTiles):
        sched = tiles.sched
        thr_qk = qk_mma.get_slice(0)
        thr_pv = pv_mma.get_slice(0)
        tSrQ = qk_mma.make_fragment_A(thr_qk.partition_A(sQ))   # (MMA, 1, D / 16)
        tSrK = qk_mma.make_fragment_B(thr_qk.partition_B(sK))   # (MMA, 2, D / 16, stage)
        s_layout = qk_mma.make_fragment_C(qk_mma.partition_shape_C((BLOCK_H, BN))).layout
        o_layout = pv_mma.make_fragment_C(pv_mma.partition_shape_C((BLOCK_H, self.d_v))).layout
        rows.check_tmem_rows(s_layout, S_ATOM_N)
        rows.check_tmem_rows(o_layout, O_ATOM_N)
        tO = cute.make_tensor(tmem + O_COL, o_layout)
        raw = cute.recast_ptr(sK.iterator, None)
        nb = Int32(0)
        jq = Int32(0)
        for tile_id in cutlass.range(sched.first, sched.n_tiles, sched.stride, unroll=1):
            t, g, head0, L, n_blocks, idx_row = self.tile(tiles, tile_id)
            if n_blocks > 0:
                cute.arch.mbarrier_wait(bars.q_full, pipeline.phase(jq))
                for i in cutlass.range(n_blocks, unroll=1):
                    b = nb + i
                    s = b % 2
                    u = b // 2
                    cute.arch.mbarrier_wait(bars.k_full + s, pipeline.phase(u))
                    if u > 0:  # the softmax has read this S buffer's last block
                        cute.arch.mbarrier_wait(bars.s_free + s, pipeline.phase(u - 1))
                    sync.after_sync()
                    tS = cute.make_tensor(tmem + S_COL + s * S_ATOM_N, s_layout)
                    atom = cute.make_mma_atom(qk_mma.op)  # its accumulate flag is set per MMA
                    for k in cutlass.range_constexpr(self.D // 16):
                        atom.set(tcgen05.Field.ACCUMULATE, k != 0)
                        cute.gemm(atom, tS, tSrQ[None, None, k], tSrK[None, None, k, s], tS)
                    sync.commit(bars.s_full + s)
                    if i == n_blocks - 1:
                        sync.commit(bars.q_empty)
                    if i > 0:
                        self.pv(pv_mma, thr_pv, sv_layout, sp_layout, raw, sP, tO, bars, nb, i - 1, jq)
                self.pv(pv_mma, thr_pv, sv_layout, sp_layout, raw, sP, tO, bars, nb, n_blocks - 1, jq)
                nb = nb + n_blocks
                jq = jq + 1

    @cute.jit
    def p_pointer(self, raw, sP, s):
        """P of stage s (q.dtype elements): the stage's RoPE columns when D > d_v."""
        p = cute.recast_ptr(sP, None) + s * (BLOCK_H * BN)
        if const_expr(self.D > self.d_v):
            p = raw + s * (BN * self.D) + BN * self.d_v
        return p

    @cute.jit
    def pv(self, pv_mma, thr_pv, sv_layout, sp_layout, raw, sP, tO, bars: Bars, nb, i, jq):
        """O += P V of block i of the tile (the first block of a tile
        overwrites O, once the epilogue of the last tile has read it)."""
        b = nb + i
        s = b % 2
        u = b // 2
        if i == 0:
            if jq > 0:
                cute.arch.mbarrier_wait(bars.o_free, pipeline.phase(jq - 1))
        cute.arch.mbarrier_wait(bars.p_full + s, pipeline.phase(u))
        sync.after_sync()
        v = cute.make_tensor(cute.recast_ptr(raw + s * (BN * self.D), sv_layout.inner), sv_layout.outer)
        p = cute.make_tensor(cute.recast_ptr(self.p_pointer(raw, sP, s), sp_layout.inner), sp_layout.outer)
        tOrV = pv_mma.make_fragment_B(thr_pv.partition_B(v))   # (MMA, 2, 4)
        tOrP = pv_mma.make_fragment_A(thr_pv.partition_A(p))   # (MMA, 1, 4)
        atom = cute.make_mma_atom(pv_mma.op)
        for k in cutlass.range_constexpr(BN // 16):
            atom.set(tcgen05.Field.ACCUMULATE, i > 0 or k > 0)
            cute.gemm(atom, tO, tOrP[None, None, k], tOrV[None, None, k], tO)
        sync.commit(bars.pv_done + s)

    # --------------------------------------------------------------- softmax
    @cute.jit
    def softmax_state(self, wtid, tmem, sK, sP, sOk, scale_log2) -> SoftmaxState:
        """Thread wtid's TMEM copies, registers and shared-memory views."""
        lane = wtid % 32
        t2r, r2t, frag = rows.lane_copies(tmem, wtid)
        rS = cute.make_rmem_tensor(frag, Float32)
        rO = cute.make_rmem_tensor(frag, Float32)
        rP = cute.make_rmem_tensor((ROW_COLS,), self.dtype)
        rM = cute.make_rmem_tensor((ROW_COLS,), Float32)
        st = cute.make_rmem_tensor((4,), Float32)
        ok = cute.make_tensor(sOk, cute.make_layout((2, BN), stride=(BN, 1)))
        raw = cute.recast_ptr(sK, None)
        return SoftmaxState(t2r, r2t, rS, rP, rM, rO, st, tmem, raw, sP, ok, 16 * (wtid // 32) + lane % 16,
                            lane // 16, lane, scale_log2)

    @cute.jit
    def tmem_cols(self, ss: SoftmaxState, col):
        """This thread's 32-lane TMEM slice at column col (its lane, 32 columns)."""
        return rows.cols(ss.tmem, col)

    @cute.jit
    def softmax(self, ss: SoftmaxState, bars: Bars, tiles: scheduler.SlotTiles, sink_ptr, out_ptr, lse_ptr):
        sched = tiles.sched
        nb = Int32(0)
        for tile_id in cutlass.range(sched.first, sched.n_tiles, sched.stride, unroll=1):
            t, g, head0, L, n_blocks, idx_row = self.tile(tiles, tile_id)
            if n_blocks == 0:
                self.store_empty(ss, out_ptr, lse_ptr, t, head0)
            else:
                ss.st[0] = -Float32.inf  # reference maximum (log2 domain)
                ss.st[1] = Float32(0.0)  # this thread's share of the row sum
                for i in cutlass.range(n_blocks, unroll=1):
                    self.softmax_block(ss, bars, nb, i)
                last = nb + n_blocks - 1
                cute.arch.mbarrier_wait(bars.pv_done + last % 2, pipeline.phase(last // 2))
                sync.after_sync()
                self.epilogue(ss, sink_ptr, out_ptr, lse_ptr, t, head0)
                sync.before_sync()
                cute.arch.mbarrier_arrive(bars.o_free)
                nb = nb + n_blocks

    @cute.jit
    def softmax_block(self, ss: SoftmaxState, bars: Bars, nb, i):
        """Block i of the tile: S from TMEM, masked and scaled; the row
        maximum and sum; P to shared memory; O rescaled if a maximum grew."""
        b = nb + i
        s = b % 2
        u = b // 2
        rS, rM, st = ss.rS, ss.rM, ss.st
        cute.arch.mbarrier_wait(bars.s_full + s, pipeline.phase(u))
        cute.arch.mbarrier_wait(bars.k_full + s, pipeline.phase(u))  # the block's mask
        sync.after_sync()
        cute.copy(ss.t2r, ss.t2r.partition_S(self.tmem_cols(ss, S_COL + s * S_ATOM_N)), rS)
        sync.wait_ld()
        sync.before_sync()
        cute.arch.mbarrier_arrive(bars.s_free + s)
        slot0 = ss.half * ROW_COLS
        for j in cutlass.range_constexpr(ROW_COLS):
            rM[j] = ss.ok[s, slot0 + j]
        mx = -Float32.inf
        for j in cutlass.range_constexpr(ROW_COLS):
            # a select, not rM added: a padded slot's score is -inf even where
            # q is NaN (its zero row gives S = NaN), a valid slot keeps its NaN
            x = Float32(cutlass.select_(rM[j] == 0.0, rS[j] * ss.scale_log2, -Float32.inf))
            rS[j] = x
            mx = cute.arch.fmax(mx, x, nan=True)
        mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 16), nan=True)  # the row's other half
        m_old = st[0]
        m_new = cute.arch.fmax(m_old, mx, nan=True)
        st[2] = Float32(1.0)  # alpha: O's rescale factor for this row
        st[3] = Float32(0.0)  # whether O needs it
        if m_new > m_old + RESCALE_LOG2:
            # exp2(-inf - m_new) = 0 for a row that saw no valid slot yet; its O
            # is 0 (or NaN) and is left as it is.
            a = cute.math.exp2(m_old - m_new, fastmath=True)
            st[0] = m_new
            st[1] = st[1] * a
            st[2] = a
            if m_old != -Float32.inf:
                st[3] = Float32(1.0)
        mu = finite_shift(st[0])
        rs = Float32(0.0)
        for j in cutlass.range_constexpr(ROW_COLS):
            p = cute.math.exp2(rS[j] - mu, fastmath=True)
            rs = rs + p
            ss.rP[j] = p.to(self.dtype)
        st[1] = st[1] + rs
        self.store_p(ss, s)
        if cute.arch.vote_any_sync(st[3] != 0.0):
            # the previous block's P V has retired: O holds it, and no MMA writes O now
            prev = b - 1
            cute.arch.mbarrier_wait(bars.pv_done + prev % 2, pipeline.phase(prev // 2))
            sync.after_sync()
            self.rescale_o(ss, st[2])
        sync.before_sync()
        cute.arch.mbarrier_arrive(bars.p_full + s)

    @cute.jit
    def store_p(self, ss: SoftmaxState, s):
        """P of this thread's row and 32 slots into the stage's P buffer,
        fenced for the tensor core.  The buffer is the MMA's K-major SW128
        tile (``rows.store_tile_row``)."""
        rows.store_tile_row(ss.rP, self.p_pointer(ss.sK_raw, ss.sP_raw, s).toint(), ss.row, ss.half)
        cute.arch.fence_view_async_shared()

    @cute.jit
    def rescale_o(self, ss: SoftmaxState, alpha):
        """O of this thread's row and column half times alpha, in TMEM."""
        rO = ss.rO
        for c in cutlass.range_constexpr(O_ATOM_N // ROW_COLS):
            cols = self.tmem_cols(ss, O_COL + c * ROW_COLS)
            cute.copy(ss.t2r, ss.t2r.partition_S(cols), rO)
            sync.wait_ld()
            for j in cutlass.range_constexpr(ROW_COLS):
                rO[j] = rO[j] * alpha
            cute.copy(ss.r2t, rO, ss.r2t.partition_D(cols))
        sync.wait_st()

    @cute.jit
    def epilogue(self, ss: SoftmaxState, sink_ptr, out_ptr, lse_ptr, t, head0):
        """out = O / (l + exp(sink)) for this thread's row and column half,
        lse (without the sink, +inf on a row with no valid slot) from the
        threads of the first half.  O is read from TMEM 32 columns at a time."""
        st, rO = ss.st, ss.rO
        l_row = st[1] + cute.arch.shuffle_sync_bfly(st[1], 16)
        mu = finite_shift(st[0])
        den = l_row
        head = head0 + ss.row
        if const_expr(self.has_sink):
            # sink * log2(e) overflows to +inf for sinks above ~2.4e38: the
            # sink then takes all the probability and out is 0.
            sk = cute.make_tensor(sink_ptr + Int64(head), cute.make_layout((1,)))[0] * LOG2E
            den = den + cute.math.exp2(sk - mu, fastmath=False)
        inv = Float32(0.0)
        if den != 0.0:
            inv = 1.0 / den
        row_base = out_ptr.toint() + ((Int64(t) * Int64(self.H) + Int64(head)) * Int64(self.d_v)
                                      + ss.half * O_ATOM_N) * (self.dtype.width // 8)
        for c in cutlass.range_constexpr(O_ATOM_N // ROW_COLS):
            cute.copy(ss.t2r, ss.t2r.partition_S(self.tmem_cols(ss, O_COL + c * ROW_COLS)), rO)
            sync.wait_ld()
            for j in cutlass.range_constexpr(ROW_COLS):
                ss.rP[j] = (rO[j] * inv).to(self.dtype)
            rows.store_global(ss.rP, self.dtype, row_base + c * ROW_COLS * (self.dtype.width // 8))
        if ss.half == 0:
            mul = cute.make_rmem_tensor((1,), Float32)
            lr = cute.make_rmem_tensor((1,), Float32)
            mul[0] = mu
            lr[0] = l_row
            dst = cute.make_tensor(lse_ptr + (Int64(t) * Int64(self.H) + Int64(head)), cute.make_layout((1,)))
            dst[0] = rules.row_lse(mul, lr, 0)

    @cute.jit
    def store_empty(self, ss: SoftmaxState, out_ptr, lse_ptr, t, head0):
        """A tile with no valid slot: out = 0 and lse = +inf, without a kernel
        reading TMEM (whatever O holds is another tile's)."""
        head = head0 + ss.row
        ss.rP.fill(0.0)
        row_base = out_ptr.toint() + ((Int64(t) * Int64(self.H) + Int64(head)) * Int64(self.d_v)
                                      + ss.half * O_ATOM_N) * (self.dtype.width // 8)
        for c in cutlass.range_constexpr(O_ATOM_N // ROW_COLS):
            rows.store_global(ss.rP, self.dtype, row_base + c * ROW_COLS * (self.dtype.width // 8))
        if ss.half == 0:
            dst = cute.make_tensor(lse_ptr + (Int64(t) * Int64(self.H) + Int64(head)), cute.make_layout((1,)))
            dst[0] = Float32.inf
