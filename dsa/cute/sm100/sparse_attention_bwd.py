"""Sparse attention backward for Blackwell (SM100) in CuTe DSL.

With p_j = exp2(s_j log2(e) sm_scale - log2 den) (the forward's
probabilities, sink included in den), dp_j = dO . v_j and Delta = dO . out,
for a tile (token t, kv head g, block of 64 query heads) and each block of
64 slots:

    S = Q K^T, dP = dO V^T          [64 heads, 64 slots]
    P = exp2(S scale_log2 - log2 den), dS = P (dP - Delta) sm_scale
    dQ += dS K                      [64 heads, D], the whole tile
    dKV_c = dS^T Q_c (+ P^T dO_c)   [64 slots, 64 columns], per column chunk c

log2 den and Delta come from the Triton preprocess (``dsa.triton.
sparse_attention.preprocess``, which also folds the sink: +inf, -inf and a
finite sink whose exp overflows) and dsink from its per-row parts; the
kernel computes dq and dkv.  One persistent CTA per SM runs the tiles of
``dsa.cute.scheduler`` in turn, thirteen warps in four roles:

* warps 4-7, the loader, load Q [64, D] and dO [64, d_v] once a tile and
  gather the kv rows of each block of 64 slots by index with 16-byte
  cp.async into one swizzled stage [64 slots, D] (a row of zeros for an
  invalid slot: ``dsa.cute.rules``), publishing the block's mask (0 or
  -inf by slot) with it.  The stage is refilled once dQ of its block has
  retired.
* warp 12, the MMA warp, allocates the tensor memory and issues every
  ``tcgen05.mma`` from one thread: S and dP of a block; once the softmax
  warpgroup has written P and dS to shared memory, dQ += dS K (dQ stays in
  TMEM over the whole tile; the first MMA of a tile overwrites it, so no
  accumulator is ever read before it is written) and then, stage free,
  the block's dKV chunks into a ring of four TMEM buffers.  V is the stage
  read MN-major (its first d_v columns), dS^T and P^T the dS / P tiles read
  MN-major, Q_c and dO_c the loaded tiles' chunks read MN-major: no operand
  is ever transposed in memory.
* warps 0-3, the softmax warpgroup, read S and dP from TMEM (a thread holds
  32 slots of one head row, ``dsa.cute.sm100.rows``), compute P and dS, and
  write them (q.dtype) as the K-major tiles the MMAs read.  Padded slots
  are clamped to exactly 0 by a select on the mask, not by adding -inf to
  the score: a NaN that a valid slot produces (NaN in q or in a valid kv
  row) propagates, while a padded slot of a NaN query row (whose zero row
  makes its score NaN) gives 0, as in the Triton backward.  At a tile's end
  they read dQ from TMEM and store dq (q.dtype); a tile with no valid slot
  stores zeros without touching TMEM.
* warps 8-11, the reducer warpgroup, take the dKV chunks in turn: each is
  loaded from TMEM with ``tcgen05.ld.16x256b`` (which hands every thread
  the wgmma accumulator's fragment), its buffer freed, and the chunk added
  into dkv (fp32) with the whole-line ``red.global.add.v4.f32`` of
  ``dsa.cute.dkv``, or, in the deterministic build, stored per slot for the
  fixed-order reduction.

Tensor memory (512 columns of 128 lanes, fp32; every MMA has M = 64, whose
two N-atoms share columns: ``dsa.cute.sm100.rows``): dQ [64, 512] in columns
[0, 256) and its RoPE part [64, 64] in [256, 288), S [288, 320), dP
[320, 352), the four dKV chunk buffers [352 + 32 k, 384 + 32 k).

Every barrier is an mbarrier used once per block, tile or chunk; phases
come from counters every role keeps the same way (tiles with no valid slot
are skipped by all but the softmax warpgroup, which stores their zeros).
Why none can run two phases ahead of its waiter is written at each barrier
in ``Smem``.  Compiled per ``BwdSm100Config`` and cached by
``dsa.cute.sm100.sparse_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

from dsa.cute import dkv as dkv_reduce
from dsa.cute import pipeline, scheduler
from dsa.cute.gmem import copy_head_rows, load
from dsa.cute.sm100 import rows, sync
from dsa.cute.sm100.gather import BlockGather
from dsa.cute.sm100.rows import ROW_COLS

BLOCK_H = 64          # query heads per CTA: the M of S, dP and dQ
BN = 64               # slots per block: the M of dKV
CHUNK = 64            # dkv columns per chunk (dsa.cute.dkv's chunk)
S_ATOM_N = 32         # S and dP [64, 64]: two N-atoms sharing 32 columns
HALF_COLS = 16        # columns of S and of dP a softmax thread loads at once
DQ_ATOM_N = 256       # dQ [64, 512]: two N-atoms sharing 256 columns
TAIL_ATOM_N = 32      # dQ's RoPE part [64, 64] and each dKV chunk [64, 64]
SOFTMAX_WARPS = 4     # one per TMEM lane quadrant
LOADER_WARPS = 4
REDUCER_WARPS = 4     # one warpgroup (a second would cost registers: see THREADS)
REDUCE_WARP0 = SOFTMAX_WARPS + LOADER_WARPS
MMA_WARP = REDUCE_WARP0 + REDUCER_WARPS
# 13 warps: the SM's four schedulers hold 4, 3, 3 and 3, so each thread may
# have 128 registers (16K a scheduler).  A second reducer warpgroup (17
# warps, 5 on one scheduler) would leave 96, and ptxas spills the softmax
# and the reducers there.
THREADS = 32 * (MMA_WARP + 1)
KV_BUFFERS = 4        # dKV chunk buffers in TMEM, used in turn
TMEM_COLS = 512
DQ_COL = 0
DQ_TAIL_COL = DQ_ATOM_N
S_COL = DQ_TAIL_COL + TAIL_ATOM_N
DP_COL = S_COL + S_ATOM_N
KV_COL = DP_COL + S_ATOM_N
assert KV_COL + KV_BUFFERS * TAIL_ATOM_N <= TMEM_COLS
SMEM_LIMIT = 227 * 1024  # the largest dynamic shared memory of an SM100 CTA
N_BARRIERS = 9 + 2 * KV_BUFFERS


@dataclass(frozen=True)
class BwdSm100Config(scheduler.ProblemConfig):
    """The static configuration one compiled kernel serves (its compile key):
    the problem, then deterministic (dkv rows stored per slot instead of
    added)."""

    deterministic: bool


def smem_bytes(D: int, d_v: int, elem_bytes: int) -> int:
    """Shared memory of the kernel's ``Smem`` struct as the DSL lays it out:
    the barriers, the TMEM address and the block's mask in the first 1024
    bytes, then Q [64, D], dO [64, d_v], the stage [64, D], dS and P
    [64, 64], each 1024-byte aligned for the 128-byte swizzle."""
    def up(n: int, a: int = 1024) -> int:
        return -(-n // a) * a

    head = up(up(N_BARRIERS * 8 + 4, 16) + 4 * BN)
    tiles = (BLOCK_H * D + BLOCK_H * d_v + BN * D + 2 * BLOCK_H * BN) * elem_bytes
    return up(head + tiles)


@dataclass(frozen=True)
class Bars:
    """The mbarriers (shared-memory pointers); k indexes a dKV buffer."""

    q_full: Any    # loader -> MMA: Q and dO of the tile landed (128 arrivals)
    q_empty: Any   # MMA -> loader: every MMA reading Q / dO of the tile retired (commit)
    k_full: Any    # loader -> MMA, softmax: the stage and its mask landed (128)
    k_empty: Any   # MMA -> loader: dQ of the block retired, the stage is free (commit)
    s_full: Any    # MMA -> softmax: S and dP of the block retired (commit)
    ds_full: Any   # softmax -> MMA: P and dS written, S and dP read (128)
    ds_free: Any   # MMA -> softmax: every MMA reading P / dS of the block retired (commit)
    dq_full: Any   # MMA -> softmax: the tile's last dQ retired (commit)
    dq_free: Any   # softmax -> MMA: dQ of the tile read (128)
    c_full: Any    # [4] MMA -> reducer: dKV chunk in buffer k retired (commit)
    c_free: Any    # [4] reducer -> MMA: buffer k read (128)


@dataclass(frozen=True)
class RowState:
    """What the softmax warpgroup's steps share over all tiles (built once,
    never reassigned; its tensors are updated in place)."""

    t2r: Any       # 32-lane TMEM load of 16 columns (S, dP), this thread's slice
    rS: Any        # S of this thread's row, 16 slots (fp32)
    rdP: Any       # dP
    rP: Any        # P of its 32 slots in q.dtype (also the dq row's staging)
    rdS: Any       # dS in q.dtype
    t2r_dq: Any    # 32-lane TMEM load of 32 columns (dQ)
    rdQ: Any       # 32 columns of dQ (fp32)
    ok: Any        # the block's mask, [slot]
    tmem: Any      # TMEM base pointer (fp32)
    sP: Any        # shared addresses of the P and dS tiles
    sdS: Any
    row: Any       # this thread's row (0..63) and column half (0 / 1)
    half: Any


def check_fragment_copy(tiled) -> None:
    """A dKV chunk's TMEM load (16x256b over [128 lanes, 32 columns]) as the
    reducers use it: thread i of warp w, register 4 j + 2 r + e (j < 8),
    holds lane 32 w + 16 (j // 4) + i // 4 + 8 r and column 8 (j % 4) +
    2 (i % 4) + e: chunk row 16 w + i // 4 + 8 r, column 8 j + 2 (i % 4) + e,
    the fragment ``dsa.cute.dkv`` writes.  Checked at trace time."""
    for i in (0, 1, 3, 4, 5, 31, 32, 37, 64, 127):
        c = tiled.get_slice(i).partition_D(cute.make_identity_tensor((128, 32)))
        for k in range(32):
            j, r, e = k // 4, (k // 2) % 2, k % 2
            want = (32 * (i // 32) + 16 * (j // 4) + (i % 32) // 4 + 8 * r, 8 * (j % 4) + 2 * (i % 4) + e)
            if c[k] != want:
                raise ValueError(f"unexpected TMEM fragment copy for thread {i}, register {k}: {c[k]}, not {want}")


class SparseAttnBwdSm100:
    """Host-side builder of the backward kernel for one static configuration.

    deterministic False: dkv_ptr is the fp32 [N, G, D] accumulator (adds).
    deterministic True: dkv_ptr is the fp32 slot buffer [HB, T, G, K, D]
    (HB = H / G / 64) of the launch's T tokens; every valid slot's row is
    stored, invalid ones are left untouched (the reduction never reads
    them).  Either buffer holds each row's columns in ``dsa.cute.dkv``'s
    fragment order."""

    def __init__(self, dtype, D: int, d_v: int, H: int, G: int, has_len: bool, deterministic: bool):
        why = self.can_implement(dtype, D, d_v, H, G)
        if why is not None:
            raise ValueError(f"SparseAttnBwdSm100: {why}")
        self.config = BwdSm100Config(dtype, D, d_v, H, G, has_len, deterministic)
        self.dtype = dtype
        self.D, self.d_v, self.H, self.G = D, d_v, H, G
        self.HG = H // G
        self.has_len, self.deterministic = has_len, deterministic
        self.n_chunks = D // CHUNK

    @classmethod
    def from_config(cls, config: BwdSm100Config) -> "SparseAttnBwdSm100":
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
        dout_ptr: cute.Pointer, lg2den_ptr: cute.Pointer, delta_ptr: cute.Pointer,
        dq_ptr: cute.Pointer, dkv_ptr: cute.Pointer, zero_ptr: cute.Pointer,
        T: Int32, N: Int32, K: Int32, scale_log2: Float32, sm_scale: Float32, n_cta: Int32, stream,
    ):
        dt = self.dtype
        K_, MN = OperandMajorMode.K, OperandMajorMode.MN

        def mma(n, a_major, b_major):
            return cute.make_tiled_mma(tcgen05.MmaF16BF16Op(
                dt, Float32, (BLOCK_H, n, 16), tcgen05.CtaGroup.ONE, tcgen05.OperandSource.SMEM, a_major, b_major))

        s_mma = mma(S_ATOM_N, K_, K_)         # S = Q K^T, dP = dO V^T
        dq_mma = mma(DQ_ATOM_N, K_, MN)       # dQ += dS K[:, :512] (K read MN-major)
        tail_mma = mma(TAIL_ATOM_N, K_, MN)   # and its RoPE columns [512, 576)
        kv_mma = mma(TAIL_ATOM_N, MN, MN)     # dKV_c = dS^T Q_c + P^T dO_c
        # Q [64 heads, D], dO [64, d_v] and the stage [64 slots, D]: K-major
        # 128B-swizzled atoms of 8 rows x 64 columns, rows first, so each
        # 64-column chunk of a tile is one contiguous 8 KB block; dS and P
        # [64 heads, 64 slots] are one such block each.  The MN-major views
        # (atoms of 64 columns x 8 rows, rows first) are the same bytes: the
        # stage as dQ's B [D, 64 slots], dS / P as dKV's A [64 slots, 64
        # heads], a chunk of Q / dO as dKV's B [64 columns, 64 heads].
        k_atom = tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.K_SW128, dt)
        mn_atom = tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.MN_SW128, dt)
        sq_layout = cute.tile_to_shape(k_atom, (BLOCK_H, self.D), order=(0, 1))
        sdo_layout = cute.tile_to_shape(k_atom, (BLOCK_H, self.d_v), order=(0, 1))
        sk_layout = cute.tile_to_shape(k_atom, (BN, self.D), order=(0, 1))
        sp_layout = cute.tile_to_shape(k_atom, (BLOCK_H, BN), order=(0, 1))
        kt_layout = cute.tile_to_shape(mn_atom, (self.d_v, BN), order=(1, 0))
        t64_layout = cute.tile_to_shape(mn_atom, (64, 64), order=(1, 0))
        rows.check_k_tile(sp_layout, dt)

        @cute.struct
        class Smem:  # smem_bytes() is its size
            # Why no barrier can run two phases ahead of a waiter:
            # q_full: the next tile's Q needs q_empty, which needs the MMA
            #   warp past this wait.  q_empty: the next commit needs the next
            #   Q.  k_full: the refill needs k_empty of the block, after the
            #   MMA warp's wait, and dQ, after the softmax's ds_full.  k_empty:
            #   the next commit needs the next k_full, after the loader's
            #   wait.  s_full / ds_full / ds_free / c_full[k] / c_free[k]:
            #   each next arrival needs the other side's step on the same
            #   buffer.  dq_full: the next needs ds_full of the next tile,
            #   after the softmax's epilogue.  dq_free: the next arrival
            #   needs the next dq_full.
            q_full: cute.struct.MemRange[Int64, 1]
            q_empty: cute.struct.MemRange[Int64, 1]
            k_full: cute.struct.MemRange[Int64, 1]
            k_empty: cute.struct.MemRange[Int64, 1]
            s_full: cute.struct.MemRange[Int64, 1]
            ds_full: cute.struct.MemRange[Int64, 1]
            ds_free: cute.struct.MemRange[Int64, 1]
            dq_full: cute.struct.MemRange[Int64, 1]
            dq_free: cute.struct.MemRange[Int64, 1]
            c_full: cute.struct.MemRange[Int64, KV_BUFFERS]
            c_free: cute.struct.MemRange[Int64, KV_BUFFERS]
            tmem_addr: Int32  # written by tcgen05.alloc
            sOk: cute.struct.Align[cute.struct.MemRange[Float32, BN], 16]  # the block's mask, by slot
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sq_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdo_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sk_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sp_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sp_layout)], 1024]

        self.smem = Smem
        n_tiles = scheduler.tile_count(T, self.G, self.HG // BLOCK_H)
        self.kernel(
            s_mma, dq_mma, tail_mma, kv_mma, sq_layout, sdo_layout, sk_layout, sp_layout, kt_layout, t64_layout,
            q_ptr, kv_ptr, idx_ptr, len_ptr, dout_ptr, lg2den_ptr, delta_ptr, dq_ptr, dkv_ptr, zero_ptr,
            T, N, K, n_tiles, scale_log2, sm_scale,
        ).launch(grid=[scheduler.grid_size(n_cta, n_tiles), 1, 1], block=[THREADS, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self, s_mma: cute.TiledMma, dq_mma: cute.TiledMma, tail_mma: cute.TiledMma, kv_mma: cute.TiledMma,
        sq_layout: cute.ComposedLayout, sdo_layout: cute.ComposedLayout, sk_layout: cute.ComposedLayout,
        sp_layout: cute.ComposedLayout, kt_layout: cute.ComposedLayout, t64_layout: cute.ComposedLayout,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        dout_ptr: cute.Pointer, lg2den_ptr: cute.Pointer, delta_ptr: cute.Pointer,
        dq_ptr: cute.Pointer, dkv_ptr: cute.Pointer, zero_ptr: cute.Pointer,
        T: Int32, N: Int32, K: Int32, n_tiles: Int32, scale_log2: Float32, sm_scale: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        sched = scheduler.TileScheduler.create(n_tiles, self.G, self.HG // BLOCK_H)

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(self.smem)
        bars = Bars(st.q_full.data_ptr(), st.q_empty.data_ptr(), st.k_full.data_ptr(), st.k_empty.data_ptr(),
                    st.s_full.data_ptr(), st.ds_full.data_ptr(), st.ds_free.data_ptr(), st.dq_full.data_ptr(),
                    st.dq_free.data_ptr(), st.c_full.data_ptr(), st.c_free.data_ptr())
        sQ = st.sQ.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sdO = st.sdO.get_tensor(sdo_layout.outer, swizzle=sdo_layout.inner)
        sK = st.sK.get_tensor(sk_layout.outer, swizzle=sk_layout.inner)
        tmem_addr = st.tmem_addr.ptr

        sync.alloc_tmem(warp, MMA_WARP, TMEM_COLS, tmem_addr)
        loader, softmax = 32 * LOADER_WARPS, 32 * SOFTMAX_WARPS
        arrivals = [(bars.q_full, 0, loader), (bars.q_empty, 0, 1), (bars.k_full, 0, loader), (bars.k_empty, 0, 1),
                    (bars.s_full, 0, 1), (bars.ds_full, 0, softmax), (bars.ds_free, 0, 1), (bars.dq_full, 0, 1),
                    (bars.dq_free, 0, softmax)]
        for k in cutlass.range_constexpr(KV_BUFFERS):
            arrivals += [(bars.c_full, k, 1), (bars.c_free, k, 128)]
        pipeline.init_mbarriers(tidx, arrivals)
        tmem = sync.tmem_pointer(tmem_addr)

        tiles = scheduler.SlotTiles(sched, idx_ptr, len_ptr, K)
        if warp < SOFTMAX_WARPS:
            self.softmax(tidx, tmem, st.sOk.data_ptr(), st.sP.data_ptr(), st.sdS.data_ptr(), bars, tiles,
                         lg2den_ptr, delta_ptr, dq_ptr, scale_log2, sm_scale)
        elif warp < REDUCE_WARP0:
            self.loader(tidx - softmax, sQ, sdO, sK, st.sOk.data_ptr(), bars, tiles, q_ptr, dout_ptr, kv_ptr,
                        zero_ptr, N)
        elif warp < MMA_WARP:
            self.reducer(tidx - 32 * REDUCE_WARP0, tmem, bars, tiles, dkv_ptr, T, N, K)
        else:
            self.mma(s_mma, dq_mma, tail_mma, kv_mma, sp_layout, kt_layout, t64_layout, sQ, sdO, sK,
                     st.sdS.data_ptr(), st.sP.data_ptr(), tmem, bars, tiles)

        # Every TMEM access and MMA has completed (the reducers waited for
        # every chunk, the softmax warpgroup for every tile's dQ); the MMA
        # warp frees the columns.
        sync.free_tmem(warp, MMA_WARP, TMEM_COLS, tmem)

    @cute.jit
    def tile(self, tiles: scheduler.SlotTiles, tile_id):
        """(t, g, head0, L, n_blocks, the row's indices) of tile tile_id; t
        counts the launch's tokens (its pointers start at its first)."""
        return tiles.tile(tile_id, self.HG, BLOCK_H, BN, self.has_len)

    # ---------------------------------------------------------------- loader
    @cute.jit
    def loader(self, ltid, sQ, sdO, sK, sOk, bars: Bars, tiles: scheduler.SlotTiles, q_ptr, dout_ptr, kv_ptr,
               zero_ptr, N):
        sched = tiles.sched
        gather = BlockGather.create(self.dtype, ltid, self.D, self.G)
        tK = gather.thr.partition_D(sK)  # (copy, pass, 64-column chunk)
        ok = cute.make_tensor(sOk, cute.make_layout((BN,)))
        nb = Int32(0)  # blocks of earlier tiles
        jq = Int32(0)  # earlier tiles with a valid slot
        for tile_id in cutlass.range(sched.first, sched.n_tiles, sched.stride, unroll=1):
            t, g, head0, L, n_blocks, idx_row = self.tile(tiles, tile_id)
            if n_blocks > 0:
                gather.first(idx_row, L)
                for i in cutlass.range(n_blocks, unroll=1):
                    gather.sources(i, idx_row, L, N, kv_ptr, zero_ptr, g)
                    b = nb + i
                    if b > 0:  # dQ of the last block retired: the stage and the mask are free
                        cute.arch.mbarrier_wait(bars.k_empty, pipeline.phase(b - 1))
                    gather.issue(tK, ok)
                    if i == 0:
                        if jq > 0:  # every MMA reading the last tile's Q and dO retired
                            cute.arch.mbarrier_wait(bars.q_empty, pipeline.phase(jq - 1))
                        for sX, ptr, width in ((sQ, q_ptr, self.D), (sdO, dout_ptr, self.d_v)):
                            copy_head_rows(gather.atom, gather.thr.partition_D(sX), ptr, self.dtype, t, self.H,
                                           head0, BLOCK_H, width, gather.row_in_pass, gather.col0)
                        cute.arch.cp_async_commit_group()
                    gather.land()
                    if i == 0:
                        cute.arch.mbarrier_arrive(bars.q_full)
                    cute.arch.mbarrier_arrive(bars.k_full)
                nb = nb + n_blocks
                jq = jq + 1

    # ------------------------------------------------------------------- MMA
    @cute.jit
    def mma(self, s_mma, dq_mma, tail_mma, kv_mma, sp_layout, kt_layout, t64_layout, sQ, sdO, sK, sdS, sP, tmem,
            bars: Bars, tiles: scheduler.SlotTiles):
        sched = tiles.sched
        thr_s = s_mma.get_slice(0)
        tSrQ = s_mma.make_fragment_A(thr_s.partition_A(sQ))     # (MMA, 1, D / 16)
        tSrdO = s_mma.make_fragment_A(thr_s.partition_A(sdO))   # (MMA, 1, d_v / 16)
        tSrK = s_mma.make_fragment_B(thr_s.partition_B(sK))     # (MMA, 2, D / 16)
        s_layout = s_mma.make_fragment_C(s_mma.partition_shape_C((BLOCK_H, BN))).layout
        rows.check_tmem_rows(s_layout, S_ATOM_N)
        tS = cute.make_tensor(tmem + S_COL, s_layout)
        tdP = cute.make_tensor(tmem + DP_COL, s_layout)

        raw_k = cute.recast_ptr(sK.iterator, None)
        ds_k = cute.make_tensor(cute.recast_ptr(cute.recast_ptr(sdS, None), sp_layout.inner), sp_layout.outer)
        thr_q = dq_mma.get_slice(0)
        kt = cute.make_tensor(cute.recast_ptr(raw_k, kt_layout.inner), kt_layout.outer)
        tQrdS = dq_mma.make_fragment_A(thr_q.partition_A(ds_k))  # (MMA, 1, 4)
        tQrK = dq_mma.make_fragment_B(thr_q.partition_B(kt))     # (MMA, 2, 4)
        dq_layout = dq_mma.make_fragment_C(dq_mma.partition_shape_C((BLOCK_H, self.d_v))).layout
        rows.check_tmem_rows(dq_layout, DQ_ATOM_N)
        tdQ = cute.make_tensor(tmem + DQ_COL, dq_layout)
        thr_t = tail_mma.get_slice(0)
        kt_tail = cute.make_tensor(cute.recast_ptr(raw_k + BN * self.d_v, t64_layout.inner), t64_layout.outer)
        tTrdS = tail_mma.make_fragment_A(thr_t.partition_A(ds_k))
        tTrK = tail_mma.make_fragment_B(thr_t.partition_B(kt_tail))
        t64_acc = tail_mma.make_fragment_C(tail_mma.partition_shape_C((64, 64))).layout
        rows.check_tmem_rows(t64_acc, TAIL_ATOM_N)
        tdQt = cute.make_tensor(tmem + DQ_TAIL_COL, t64_acc)

        thr_kv = kv_mma.get_slice(0)
        ds_t = cute.make_tensor(cute.recast_ptr(cute.recast_ptr(sdS, None), t64_layout.inner), t64_layout.outer)
        p_t = cute.make_tensor(cute.recast_ptr(cute.recast_ptr(sP, None), t64_layout.inner), t64_layout.outer)
        tArdS = kv_mma.make_fragment_A(thr_kv.partition_A(ds_t))  # (MMA, 1, 4)
        tArP = kv_mma.make_fragment_A(thr_kv.partition_A(p_t))
        kv_layout = kv_mma.make_fragment_C(kv_mma.partition_shape_C((BN, CHUNK))).layout
        rows.check_tmem_rows(kv_layout, TAIL_ATOM_N)
        raw_q = cute.recast_ptr(sQ.iterator, None)
        raw_do = cute.recast_ptr(sdO.iterator, None)

        nb = Int32(0)
        jq = Int32(0)
        for tile_id in cutlass.range(sched.first, sched.n_tiles, sched.stride, unroll=1):
            n_blocks = self.tile(tiles, tile_id)[4]
            if n_blocks > 0:
                cute.arch.mbarrier_wait(bars.q_full, pipeline.phase(jq))
                for i in cutlass.range(n_blocks, unroll=1):
                    b = nb + i
                    cute.arch.mbarrier_wait(bars.k_full, pipeline.phase(b))
                    sync.after_sync()
                    self.gemm(s_mma, tS, tSrQ, tSrK, self.D // 16, False)
                    self.gemm(s_mma, tdP, tSrdO, tSrK, self.d_v // 16, False)
                    sync.commit(bars.s_full)
                    cute.arch.mbarrier_wait(bars.ds_full, pipeline.phase(b))
                    if i == 0:
                        if jq > 0:  # the epilogue has read the last tile's dQ
                            cute.arch.mbarrier_wait(bars.dq_free, pipeline.phase(jq - 1))
                    sync.after_sync()
                    self.gemm(dq_mma, tdQ, tQrdS, tQrK, BN // 16, i > 0)
                    if const_expr(self.D > self.d_v):
                        self.gemm(tail_mma, tdQt, tTrdS, tTrK, BN // 16, i > 0)
                    sync.commit(bars.k_empty)
                    if i == n_blocks - 1:
                        sync.commit(bars.dq_full)
                    for c in cutlass.range_constexpr(self.n_chunks):
                        kb, u = self.chunk_buffer(c, b)
                        if u > 0:  # its reducer has read the buffer's last chunk
                            cute.arch.mbarrier_wait(bars.c_free + kb, pipeline.phase(u - 1))
                        sync.after_sync()
                        tKV = cute.make_tensor(tmem + KV_COL + kb * TAIL_ATOM_N, kv_layout)
                        qc = cute.make_tensor(cute.recast_ptr(raw_q + c * BLOCK_H * CHUNK, t64_layout.inner),
                                              t64_layout.outer)
                        self.gemm(kv_mma, tKV, tArdS, kv_mma.make_fragment_B(thr_kv.partition_B(qc)),
                                  BLOCK_H // 16, False)
                        if const_expr(c * CHUNK < self.d_v):
                            doc = cute.make_tensor(cute.recast_ptr(raw_do + c * BLOCK_H * CHUNK, t64_layout.inner),
                                                   t64_layout.outer)
                            self.gemm(kv_mma, tKV, tArP, kv_mma.make_fragment_B(thr_kv.partition_B(doc)),
                                      BLOCK_H // 16, True)
                        sync.commit(bars.c_full + kb)
                    sync.commit(bars.ds_free)
                sync.commit(bars.q_empty)
                nb = nb + n_blocks
                jq = jq + 1

    @cute.jit
    def gemm(self, tiled, acc, frag_a, frag_b, steps: cutlass.Constexpr, accumulate):
        """acc (+)= A B over ``steps`` K-steps of 16; the first step
        overwrites acc unless ``accumulate`` (a Boolean, possibly dynamic)."""
        atom = cute.make_mma_atom(tiled.op)  # its accumulate flag is set per MMA
        # A loop, not unrolled: each step's shared-memory descriptors are made
        # when it issues.  Unrolled, the compiler hoists the several hundred
        # loop-invariant descriptors of a block out of the block loop, and
        # 128 registers cannot hold them.
        for k in cutlass.range(steps, unroll=1):
            atom.set(tcgen05.Field.ACCUMULATE, k > 0 or accumulate)
            cute.gemm(atom, acc, frag_a[None, None, k], frag_b[None, None, k], acc)

    def chunk_buffer(self, c: int, b):
        """(TMEM buffer, its use) of dKV chunk c of block b (blocks counted over
        the CTA's tiles): the chunks use the buffers in turn."""
        m = b * self.n_chunks + c
        return m % KV_BUFFERS, m // KV_BUFFERS

    # --------------------------------------------------------------- softmax
    @cute.jit
    def softmax(self, tidx, tmem, sOk, sP, sdS, bars: Bars, tiles: scheduler.SlotTiles, lg2den_ptr, delta_ptr,
                dq_ptr, scale_log2, sm_scale):
        sched = tiles.sched
        lane = tidx % 32
        # S and dP are read 16 columns at a time: 32 of each would hold 64
        # fp32 of a row at once, more than the 128-register budget allows
        t2r, _, frag = rows.lane_copies(tmem, tidx, store=False, n=HALF_COLS)
        t2r_dq, _, frag_dq = rows.lane_copies(tmem, tidx, store=False)
        rs = RowState(t2r, cute.make_rmem_tensor(frag, Float32), cute.make_rmem_tensor(frag, Float32),
                      cute.make_rmem_tensor((ROW_COLS,), self.dtype), cute.make_rmem_tensor((ROW_COLS,), self.dtype),
                      t2r_dq, cute.make_rmem_tensor(frag_dq, Float32),
                      cute.make_tensor(sOk, cute.make_layout((BN,))), tmem, sP.toint(), sdS.toint(),
                      16 * (tidx // 32) + lane % 16, lane // 16)
        nb = Int32(0)
        jq = Int32(0)
        for tile_id in cutlass.range(sched.first, sched.n_tiles, sched.stride, unroll=1):
            t, g, head0, L, n_blocks, idx_row = self.tile(tiles, tile_id)
            row_addr = dq_ptr.toint() + (Int64(t) * Int64(self.H) + Int64(head0 + rs.row)) * Int64(
                self.D * (self.dtype.width // 8))
            if n_blocks == 0:
                self.store_dq_zeros(rs, row_addr)
            else:
                off = Int64(t) * Int64(self.H) + Int64(head0 + rs.row)
                lg2 = load(lg2den_ptr, off)
                dl = load(delta_ptr, off)
                for i in cutlass.range(n_blocks, unroll=1):
                    self.softmax_block(rs, bars, nb + i, lg2, dl, scale_log2, sm_scale)
                cute.arch.mbarrier_wait(bars.dq_full, pipeline.phase(jq))
                sync.after_sync()
                self.store_dq(rs, row_addr)
                sync.before_sync()
                cute.arch.mbarrier_arrive(bars.dq_free)
                nb = nb + n_blocks
                jq = jq + 1

    @cute.jit
    def softmax_block(self, rs: RowState, bars: Bars, b, lg2, dl, scale_log2, sm_scale):
        """Block b (counted over the CTA's tiles): S and dP from TMEM; P and dS
        of this thread's row and 32 slots into shared memory."""
        rS, rdP = rs.rS, rs.rdP
        cute.arch.mbarrier_wait(bars.s_full, pipeline.phase(b))
        cute.arch.mbarrier_wait(bars.k_full, pipeline.phase(b))  # the block's mask
        sync.after_sync()
        for hh in cutlass.range_constexpr(ROW_COLS // HALF_COLS):
            cute.copy(rs.t2r, rs.t2r.partition_S(rows.cols(rs.tmem, S_COL + hh * HALF_COLS, HALF_COLS)), rS)
            cute.copy(rs.t2r, rs.t2r.partition_S(rows.cols(rs.tmem, DP_COL + hh * HALF_COLS, HALF_COLS)), rdP)
            sync.wait_ld()
            slot0 = rs.half * ROW_COLS + hh * HALF_COLS
            for j in cutlass.range_constexpr(HALF_COLS):
                # the NaN-preserving clamp: a padded slot is exactly 0 whatever
                # its score; a valid one keeps exp2's NaN
                valid = rs.ok[slot0 + j] == 0.0
                p = cute.math.exp2(rS[j] * scale_log2 - lg2, fastmath=True)
                ds = p * (rdP[j] - dl) * sm_scale
                rs.rP[hh * HALF_COLS + j] = Float32(cutlass.select_(valid, p, Float32(0.0))).to(self.dtype)
                rs.rdS[hh * HALF_COLS + j] = Float32(cutlass.select_(valid, ds, Float32(0.0))).to(self.dtype)
        if b > 0:  # every MMA reading the last block's P and dS retired
            cute.arch.mbarrier_wait(bars.ds_free, pipeline.phase(b - 1))
        rows.store_tile_row(rs.rP, rs.sP, rs.row, rs.half)
        rows.store_tile_row(rs.rdS, rs.sdS, rs.row, rs.half)
        cute.arch.fence_view_async_shared()
        sync.before_sync()
        cute.arch.mbarrier_arrive(bars.ds_full)

    @cute.jit
    def store_dq(self, rs: RowState, row_addr):
        """dq of this thread's row and column half from TMEM, in q.dtype: the
        value columns [256 half, 256 half + 256), then RoPE columns
        [512 + 32 half, 544 + 32 half)."""
        ES = self.dtype.width // 8
        for c in cutlass.range_constexpr(DQ_ATOM_N // ROW_COLS):
            self.store_dq_cols(rs, DQ_COL + c * ROW_COLS, row_addr + (rs.half * DQ_ATOM_N + c * ROW_COLS) * ES)
        if const_expr(self.D > self.d_v):
            self.store_dq_cols(rs, DQ_TAIL_COL, row_addr + (self.d_v + rs.half * ROW_COLS) * ES)

    @cute.jit
    def store_dq_cols(self, rs: RowState, col, addr):
        cute.copy(rs.t2r_dq, rs.t2r_dq.partition_S(rows.cols(rs.tmem, col)), rs.rdQ)
        sync.wait_ld()
        for j in cutlass.range_constexpr(ROW_COLS):
            rs.rP[j] = rs.rdQ[j].to(self.dtype)
        rows.store_global(rs.rP, self.dtype, addr)

    @cute.jit
    def store_dq_zeros(self, rs: RowState, row_addr):
        """A tile with no valid slot: its dq rows are 0 (TMEM is not read:
        whatever it holds is another tile's)."""
        ES = self.dtype.width // 8
        rs.rP.fill(0.0)
        for c in cutlass.range_constexpr(DQ_ATOM_N // ROW_COLS):
            rows.store_global(rs.rP, self.dtype, row_addr + (rs.half * DQ_ATOM_N + c * ROW_COLS) * ES)
        if const_expr(self.D > self.d_v):
            rows.store_global(rs.rP, self.dtype, row_addr + (self.d_v + rs.half * ROW_COLS) * ES)

    # --------------------------------------------------------------- reducer
    @cute.jit
    def reducer(self, wtid, tmem, bars: Bars, tiles: scheduler.SlotTiles, dkv_ptr, T, N, K):
        """The reducer warpgroup: every dKV chunk from TMEM into dkv."""
        sched = tiles.sched
        lane = wtid % 32
        row_lo = (wtid // 32) * 16 + lane // 4
        load_ = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld16x256bOp(tcgen05.Repetition.x4), Float32),
                                       rows.cols(tmem, 0))
        check_fragment_copy(load_)
        t2r = load_.get_slice(wtid)
        acc = cute.make_rmem_tensor(t2r.partition_D(cute.make_identity_tensor((128, 32))).shape, Float32)
        rws = cute.make_rmem_tensor((4,), Int64)
        rok = cute.make_rmem_tensor((4,), Int32)
        pol = dkv_reduce.evict_last_policy() if const_expr(not self.deterministic) else None
        nb = Int32(0)
        for tile_id in cutlass.range(sched.first, sched.n_tiles, sched.stride, unroll=1):
            t, g, head0, L, n_blocks, idx_row = self.tile(tiles, tile_id)
            if n_blocks > 0:
                hb = (head0 - g * self.HG) // BLOCK_H
                row0 = dkv_reduce.dkv_row0(self.deterministic, self.G, t, g, hb, T, K)
                for i in cutlass.range(n_blocks, unroll=1):
                    dkv_reduce.slot_rows(rws, rok, i, row_lo, lane, L, row0, idx_row, dkv_ptr, N, self.G, self.D,
                                         self.deterministic)
                    for c in cutlass.range_constexpr(self.n_chunks):
                        kb, u = self.chunk_buffer(c, nb + i)
                        cute.arch.mbarrier_wait(bars.c_full + kb, pipeline.phase(u))
                        sync.after_sync()
                        col = cute.assume(kb * TAIL_ATOM_N, divby=TAIL_ATOM_N)  # keeps the 16x256b alignment
                        cute.copy(t2r, t2r.partition_S(rows.cols(tmem, KV_COL + col)), acc)
                        sync.wait_ld()
                        sync.before_sync()
                        cute.arch.mbarrier_arrive(bars.c_free + kb)
                        dkv_reduce.scatter(acc, c, rws, rok, pol, self.deterministic)
                nb = nb + n_blocks
