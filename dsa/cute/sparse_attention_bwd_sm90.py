"""Sparse attention backward for Hopper (SM90) in CuTe DSL.

One CTA per (token t, kv head g, block of 64 query heads; a kv head of 16 or
32 query heads, a tensor-parallel shard, is one block whose other rows are
zero), two warpgroups of up to 255 registers each (with a third, producer
warpgroup the consumers get 240 and ptxas spills and serialises their wgmma):

* warpgroup 0 loads Q [64, D] and dO [64, d_v] of the tile once (with
  ``kernel_delta`` also out's rows [64, d_v], into the stage: Delta is the
  diagonal of dO out^T, the dP product on them, before block 0 is
  gathered there) and gathers
  the kv rows of each block of 64 slots by index with 16-byte cp.async into
  one swizzled stage [64, D], signalled on ``full`` with
  ``cp.async.mbarrier.arrive``; block i + 1's gather is issued as soon as
  both warpgroups are past block i's dQ, the last reader of the stage.  An
  invalid slot copies a row of zeros, so whatever is stored in kv rows no
  valid slot names is never read; the block's mask (0 or -inf by slot) is
  published with the stage.  It computes S = Q K^T and dP = dO V^T (wgmma,
  both operands in shared memory), P = exp2(S log2e scale - log2 den)
  (masked) and dS = P (dP - Delta) sm_scale, and stores dS and P, [64 heads,
  64 slots] K-major, in shared memory.
* Then both, for their share of the columns (warpgroup 0: [0, 256),
  warpgroup 1: [256, D)):
    dQ[:, own] += dS K[:, own]        (register accumulator, the whole loop)
  after which the stage is free.  dKV of the block is computed per 64-column
  chunk c (warpgroup 0: the first ``c0_chunks``, warpgroup 1: the rest),
  dKV_c = dS^T Q[:, c] (+ P^T dO[:, c] for value columns) [64 slots, 64],
  and added into dkv[idx] (fp32) with 16-byte ``red.global.add.v4.f32``
  (``dsa.cute.dkv``, shared with the SM100 backward).  The deterministic
  build adds into one dkv copy per range of ``tpc`` tokens and first rounds
  each value to its (copy, kv row)'s power-of-two grid (``magic``, from
  ``dsa.triton.dkv_quanta``), which makes the adds exact and so their
  order irrelevant.  The dkv buffer
  holds each row's columns in the order the accumulator fragments hold them
  (the host's ``natural_columns`` puts them back), so a thread's four floats
  of a 16-column group are adjacent, and the two quads of a row pair swap
  half their values with one shuffle each, so that every warp instruction
  covers four whole 128-byte lines.  The adds are the cost: at V3.2 a build
  without them takes 9.2 of the 14.2 ms on an H200.  V is the K tile itself
  (its first d_v columns); transposed operands are the same shared-memory
  bytes read MN-major, as in the forward.
* Two named barriers hand the dS / P buffers between the warpgroups: READY
  (warpgroup 0 has stored the block's) and FREE (warpgroup 1's last wgmma on
  the previous block's is done), so warpgroup 0 computes block i + 1's
  scores while warpgroup 1 still adds block i.

The loop stops after the last block holding a valid slot (topk_length), so a
row of length L costs about L / K of a full row.  The validity rules are
``dsa.cute.rules`` (as in the forward), the barriers ``dsa.cute.pipeline``.
Compiled per ``BwdSm90Config`` and cached by ``dsa.cute.sparse_attention_bwd``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from dsa.cute import dkv as dkv_reduce
from dsa.cute import pipeline, rules, scheduler
from dsa.cute.gmem import EVICT_FIRST, aligned, copy_head_rows, l2_policy, load, store_b32_hinted
from dsa.cute.host import head_blocks
from dsa.cute.pipeline import NamedBarrier, freed_phase, named_barriers, phase
from dsa.cute.scheduler import PADDED_HEADS

BLOCK_H = 64   # query heads per CTA: the M of one wgmma
BN = 64        # slots per block
MASK_WRITERS = 16  # producer threads that write a block's mask: one per row of a copy pass
PAIR_THREADS = 256  # the two warpgroups
DQ_N = 256     # columns of warpgroup 0's dQ tile; warpgroup 1 holds [256, D)
# the timeline build's marks a tile (``BwdSm90Config.timeline``): warpgroup
# 0 at its start, Q / dO (and out) landed, Delta done and block 0's gather
# issued, block 0 landed, its loop done, its dq stored; warpgroup 1 past
# block 0's hand-off, its loop done, its dq stored; then the SM's id
TL_START, TL_Q, TL_DELTA, TL_BLOCK0, TL_LOOP0, TL_END0, TL_END1, TL_READY1, TL_LOOP1, TL_SM = range(10)
TL_NS = 10  # the same marks again from the global nanosecond timer, at TL_NS + mark
TL_N = 19


@named_barriers
class Barrier(NamedBarrier):
    """Named barriers between the warpgroups: one side arrives, the other waits."""

    FREE = 1   # warpgroup 1 is done reading the dS / P buffers
    READY = 2  # dS and P of the block are in shared memory
    DELTA = 3  # warpgroup 0: the tile's Delta is in shared memory (kernel_delta)
    DQ0 = 4    # dq_tma: warpgroup 0's dq is in the stage
    DQ1 = 5    # dq_tma: warpgroup 1's


@dataclass(frozen=True)
class BwdSm90Config(scheduler.ProblemConfig):
    """The static configuration one compiled kernel serves (its compile key):
    the problem (dtype of q, kv, dout and dq), then deterministic (each
    value rounded to its row's grid before the add, into per-token-range
    dkv copies) and the build options: evict_last (the
    adds keep dkv's lines in L2 ahead of the gathered rows), c0_chunks (the
    64-column dkv chunks warpgroup 0 takes), scatter False (a timing build
    that adds none of dkv: its dkv is not the gradient), l2_hints (bits: 1
    Q and dO loaded evict-first, 2 dq stored evict-first), index_ahead (a
    block's kv-row indices loaded while the block before it is computed),
    kernel_delta (Delta = dO . out computed by the kernel, out's rows loaded
    into the stage before the first gather, and written to delta; the
    default build reads the preprocess's), timeline (a timing build: the
    first thread of each warpgroup writes the SM clock at its tile's marks,
    ``TL_*``, with the SM's id, and the global nanosecond timer at the same
    marks (``TL_NS`` on), into int64 [tiles, TL_N] at magic_ptr,
    which only the deterministic build reads otherwise), dq_early (each
    warpgroup stores its dq right after the last block's dQ, ahead of that
    block's dkv chunks, so that the stores are not queued behind the last
    adds at the tile's end), tma_rows (Q's, dO's and out's rows of a tile
    copied by the tensor memory accelerator as 64 x 64 boxes, issued by one
    lane of warpgroup 0's first warp, in place of warpgroup 0's 16-byte
    cp.async; tiles of 64 real heads only, a padded tile keeps the
    cp.async), dkv_mma False (a timing build: the dkv chunks' wgmma left
    out, their adds of zeros kept, so that a block's cost with its adds and
    without most of its math shows whether the adds alone set it; its dkv
    is not the gradient), dq_tma (with dq_early, on tiles of 64 real
    heads: each warpgroup writes its dq into its own columns of the stage,
    free once its last dQ is done, and one lane sends them to dq as 64 x 64
    boxes of the tensor memory accelerator, in place of 32-bit stores from
    every thread; a row without a block keeps the stores)."""

    deterministic: bool
    evict_last: bool = True
    c0_chunks: int = 2
    scatter: bool = True
    l2_hints: int = 0
    index_ahead: bool = True
    kernel_delta: bool = False
    timeline: bool = False
    dq_early: bool = False
    tma_rows: bool = False
    dkv_mma: bool = True
    dq_tma: bool = False




class SparseAttnBwdSm90:
    """Host-side builder of the backward kernel for one static configuration.

    deterministic False: dkv_ptr is the fp32 [N, G, D] accumulator (atomics).
    deterministic True: dkv_ptr is the fp32 [copies, N, G, D] accumulator, the
    adds of token t going to copy t // tpc, each value first rounded to the
    grid of its (copy, kv row) (magic_ptr: fp32 [copies, N, G], 1.5 2^23 Q,
    0 for a row no bound reaches); magic_ptr and tpc are not read otherwise."""

    def __init__(self, dtype, D: int, d_v: int, H: int, G: int, has_len: bool, deterministic: bool,
                 evict_last: bool = True, c0_chunks: int = 2, scatter: bool = True, l2_hints: int = 0,
                 index_ahead: bool = True, kernel_delta: bool = False, timeline: bool = False,
                 dq_early: bool = False, tma_rows: bool = False, dkv_mma: bool = True,
                 dq_tma: bool = False):
        why = self.can_implement(dtype, D, d_v, H, G)
        if why is not None:
            raise ValueError(f"SparseAttnBwdSm90: {why}")
        if not 0 <= c0_chunks < D // 64:  # warpgroup 1 releases the dS / P buffers after its last chunk
            raise ValueError(f"SparseAttnBwdSm90: c0_chunks={c0_chunks} is not in [0, {D // 64})")
        if kernel_delta and deterministic:  # the exact adds' grids need Delta before the kernel
            raise ValueError("SparseAttnBwdSm90: kernel_delta serves the default build, not the deterministic one")
        if dq_tma and not dq_early:
            raise ValueError("SparseAttnBwdSm90: dq_tma stores dq where dq_early does: set both")
        if timeline and deterministic:  # its marks go where the deterministic build's grids are read
            raise ValueError("SparseAttnBwdSm90: timeline is a build of the default mode")
        self.config = BwdSm90Config(dtype, D, d_v, H, G, has_len, deterministic, evict_last, c0_chunks,
                                    scatter, l2_hints, index_ahead, kernel_delta, timeline, dq_early,
                                    tma_rows, dkv_mma, dq_tma)
        self.dkv_mma = dkv_mma
        self.timeline, self.dq_early = timeline, dq_early
        self.l2_hints, self.index_ahead, self.kernel_delta = l2_hints, index_ahead, kernel_delta
        self.dtype = dtype
        self.D, self.d_v, self.H, self.G = D, d_v, H, G
        self.HG = H // G
        # a kv head of 16 or 32 query heads (a tensor-parallel shard) runs as
        # one tile of 64 rows whose rows past its heads are zero: their P and
        # dS are 0, so they add nothing to dkv, and their dq is not stored
        self.rows = min(self.HG, BLOCK_H)
        # the bulk copies read whole 64-row boxes: a padded tile's rows past
        # its heads would be the next token's
        self.tma = tma_rows and self.rows == BLOCK_H
        # and a 64-row box of dq would overwrite them
        self.dq_tma = dq_tma and self.rows == BLOCK_H
        self.HB = head_blocks(self.HG, BLOCK_H)
        self.has_len, self.deterministic = has_len, deterministic
        # evict_last on the adds: dkv (N D fp32; in the deterministic build
        # the copy the running tokens add to) stays in L2 while the gathered
        # kv rows stream through
        self.evict_last = evict_last
        # scatter False: a timing build that computes dkv but adds none of
        # it (its dkv is not the gradient), the cost of everything else
        self.do_scatter = scatter
        # 64-column chunks of dkv computed and added by each warpgroup:
        # warpgroup 0 also gathers and computes S, dP and dS, so 1 takes most
        self.chunks = (tuple(range(c0_chunks)), tuple(range(c0_chunks, D // 64)))

    @staticmethod
    def can_implement(dtype, D: int, d_v: int, H: int, G: int) -> Optional[str]:
        """The reason this kernel cannot be built for (dtype, D, d_v, H, G),
        None when it can; dtype is a ``cutlass`` type (only BFloat16 and
        Float16 are served; anything else is named as given)."""
        return scheduler.head_block_reason(dtype, D, d_v, H, G, BLOCK_H, PADDED_HEADS)

    @classmethod
    def from_config(cls, config: BwdSm90Config) -> "SparseAttnBwdSm90":
        """The builder of the kernel ``config`` describes."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(config)})

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        dout_ptr: cute.Pointer, lg2den_ptr: cute.Pointer, delta_ptr: cute.Pointer,
        dq_ptr: cute.Pointer, dkv_ptr: cute.Pointer, zero_ptr: cute.Pointer, magic_ptr: cute.Pointer,
        out_ptr: cute.Pointer, T: Int32, t0: Int32, N: Int32, K: Int32, scale_log2: Float32, sm_scale: Float32,
        tpc: Int32, stream,
    ):
        dt = self.dtype
        K_ = warpgroup.OperandMajorMode.K
        MN = warpgroup.OperandMajorMode.MN
        S_ = warpgroup.OperandSource.SMEM

        def mma(n, a_major, b_major):
            return cute.make_tiled_mma(cute.make_mma_atom(warpgroup.MmaF16BF16Op(
                dt, Float32, (BLOCK_H, n, 16), S_, a_major, b_major)), (1, 1, 1))

        s_mma = mma(BN, K_, K_)              # S = Q K^T, dP = dO V^T
        dq_mma = mma(DQ_N, K_, MN)           # dQ += dS K (K read MN-major), 256 columns
        dq1_mma = mma(64, K_, MN)            # and the RoPE columns [512, 576)
        kv_mma = mma(64, MN, MN)             # dKV_c = dS^T Q_c + P^T dO_c
        # K-major 128B-swizzled atoms of 8 rows x 64 columns, rows first; the
        # MN-major views (64 columns x 8 rows atoms, rows first) are the same
        # bytes.
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dt)
        mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, dt)
        sq_layout = cute.tile_to_shape(k_atom, (BLOCK_H, self.D), order=(0, 1))
        sdo_layout = cute.tile_to_shape(k_atom, (BLOCK_H, self.d_v), order=(0, 1))
        sk_layout = cute.tile_to_shape(k_atom, (BN, self.D), order=(0, 1))
        sp_layout = cute.tile_to_shape(k_atom, (BLOCK_H, BN), order=(0, 1))
        kt0_layout = cute.tile_to_shape(mn_atom, (DQ_N, BN), order=(1, 0))
        kt1_layout = cute.tile_to_shape(mn_atom, (64, BN), order=(1, 0))
        # [64 slots, 64 heads] (dS^T, P^T) and [64 columns, 64 heads] (a chunk of Q, dO)
        t64_layout = cute.tile_to_shape(mn_atom, (64, 64), order=(1, 0))

        @cute.struct
        class Smem:
            q_full: cute.struct.MemRange[Int64, 1]
            full: cute.struct.MemRange[Int64, 1]
            empty: cute.struct.MemRange[Int64, 1]
            sOk: cute.struct.MemRange[Float32, BN]  # the block's mask by slot: 0 or -inf
            sDelta: cute.struct.MemRange[Float32, BLOCK_H]  # the tile's Delta (kernel_delta)
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sq_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdo_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sk_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sp_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sp_layout)], 1024]

        self.smem = Smem
        n_tiles = scheduler.tile_count(T, self.G, self.HB)
        tma = (None,) * 6
        if const_expr(self.tma):
            # [rows, columns] views of q, dout and out up to this launch's
            # last token; a tile is the 64-row box at (t H + head0) / 64
            rows = (t0 + T) * self.H
            op = cpasync.CopyBulkTensorTileG2SOp()
            views = ((q_ptr, self.D, sq_layout), (dout_ptr, self.d_v, sdo_layout), (out_ptr, self.d_v, sdo_layout))
            tma = ()
            for ptr, width, layout in views[:3 if const_expr(self.kernel_delta) else 2]:
                g = cute.make_tensor(ptr, cute.make_layout((rows, width), stride=(width, 1)))
                atom, tensor = cpasync.make_tiled_tma_atom(op, g, layout, (BLOCK_H, width))
                tma += (atom, tensor)
            tma += (None,) * (6 - len(tma))
        dqt = (None,) * 4
        if const_expr(self.dq_tma):
            # dq [rows, D] by 64 x 64 boxes; a warpgroup's 256 columns of the stage as [64, 256]
            box_layout = cute.tile_to_shape(k_atom, (BLOCK_H, 64), order=(0, 1))
            wide_layout = cute.tile_to_shape(k_atom, (BLOCK_H, DQ_N), order=(0, 1))
            g = cute.make_tensor(dq_ptr, cute.make_layout(((t0 + T) * self.H, self.D), stride=(self.D, 1)))
            atom, tensor = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), g, box_layout,
                                                       (BLOCK_H, 64))
            dqt = (atom, tensor, wide_layout, box_layout)
        self.kernel(
            s_mma, dq_mma, dq1_mma, kv_mma,
            sq_layout, sdo_layout, sk_layout, sp_layout, kt0_layout, kt1_layout, t64_layout,
            q_ptr, kv_ptr, idx_ptr, len_ptr, dout_ptr, lg2den_ptr, delta_ptr, dq_ptr, dkv_ptr, zero_ptr,
            magic_ptr, out_ptr, T, t0, N, K, scale_log2, sm_scale, tpc, *tma, *dqt,
        ).launch(grid=[n_tiles, 1, 1], block=[PAIR_THREADS, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self, s_mma: cute.TiledMma, dq_mma: cute.TiledMma, dq1_mma: cute.TiledMma, kv_mma: cute.TiledMma,
        sq_layout: cute.ComposedLayout, sdo_layout: cute.ComposedLayout, sk_layout: cute.ComposedLayout,
        sp_layout: cute.ComposedLayout, kt0_layout: cute.ComposedLayout, kt1_layout: cute.ComposedLayout,
        t64_layout: cute.ComposedLayout,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        dout_ptr: cute.Pointer, lg2den_ptr: cute.Pointer, delta_ptr: cute.Pointer,
        dq_ptr: cute.Pointer, dkv_ptr: cute.Pointer, zero_ptr: cute.Pointer, magic_ptr: cute.Pointer,
        out_ptr: cute.Pointer, T: Int32, t0: Int32, N: Int32, K: Int32, scale_log2: Float32, sm_scale: Float32,
        tpc: Int32, tma_q: Optional[cute.CopyAtom], gq: Optional[cute.Tensor], tma_do: Optional[cute.CopyAtom],
        gdo: Optional[cute.Tensor], tma_o: Optional[cute.CopyAtom], go: Optional[cute.Tensor],
        tma_dq: Optional[cute.CopyAtom], gdq: Optional[cute.Tensor], wide_layout: Optional[cute.ComposedLayout],
        box_layout: Optional[cute.ComposedLayout],
    ):
        tidx, _, _ = cute.arch.thread_idx()
        tile_id, _, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128)

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(self.smem)
        bars = (st.q_full.data_ptr(), st.full.data_ptr(), st.empty.data_ptr())
        sQ = st.sQ.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sdO = st.sdO.get_tensor(sdo_layout.outer, swizzle=sdo_layout.inner)
        sK = st.sK.get_tensor(sk_layout.outer, swizzle=sk_layout.inner)

        if const_expr(self.tma or self.dq_tma):
            if tidx < 32:
                for a_ in (tma_q, tma_do, tma_o, tma_dq):
                    if const_expr(a_ is not None):
                        cpasync.prefetch_descriptor(a_)
        q_copies = 1 if const_expr(self.tma) else 128  # one thread's bulk copies, or the warpgroup's
        pipeline.init_mbarriers(tidx, [(bars[0], 0, q_copies),             # warpgroup 0's copies
                                       (bars[1], 0, 128 + MASK_WRITERS),   # copies, then the mask writers
                                       (bars[2], 0, PAIR_THREADS)])        # both warpgroups, past their dQ

        tile = self.tile(tile_id, t0, idx_ptr, len_ptr, K)
        for m_ in (s_mma, dq_mma, dq1_mma, kv_mma):
            m_.set(warpgroup.Field.ACCUMULATE, True)
        raw_p = cute.recast_ptr(st.sP.data_ptr(), None)
        raw_ds = cute.recast_ptr(st.sdS.data_ptr(), None)
        # out's rows of the tile go into the stage's first d_v columns (the
        # K-major atoms of a [64, D] tile are laid out as those of [64, d_v])
        sO = st.sK.get_tensor(sdo_layout.outer, swizzle=sdo_layout.inner)
        gather = (sQ, sdO, sK, st.sOk.data_ptr(), q_ptr, dout_ptr, kv_ptr, zero_ptr, out_ptr, sO,
                  ((tma_q, gq, sQ), (tma_do, gdo, sdO), (tma_o, go, sO)))
        args = (s_mma, dq_mma, dq1_mma, kv_mma, sp_layout, kt0_layout, kt1_layout, t64_layout,
                tidx % 128, sQ, sdO, sK, raw_ds, raw_p, st.sOk.data_ptr(), st.sDelta.data_ptr(), bars, tile,
                idx_ptr, lg2den_ptr, delta_ptr, dq_ptr, dkv_ptr, magic_ptr, T, t0, N, K, scale_log2,
                sm_scale, tpc, (tma_dq, gdq, wide_layout, box_layout))
        if wg == 0:
            self.warpgroup_main(0, gather, *args)
        else:
            self.warpgroup_main(1, None, *args)

    @cute.jit
    def tile(self, tile_id, t0, idx_ptr, len_ptr, K):
        """Tile tile_id of this launch: (local token tl, token t, kv head g,
        head block hb, first query head head0, slots [0, L) that may be
        valid, blocks holding them, the row's indices)."""
        G, HG, HB = self.G, self.HG, self.HB
        pid = tile_id // HB        # tl * G + g
        hb = tile_id - pid * HB
        tl = pid // G
        g = pid - tl * G
        t = tl + t0
        head0 = g * HG + hb * BLOCK_H
        L = rules.row_length(len_ptr, t, K, self.has_len)
        n_blocks = rules.block_count(L, BN)
        return tl, t, g, hb, head0, L, n_blocks, idx_ptr + (Int64(t) * Int64(G) + Int64(g)) * Int64(K)

    # --------------------------------------------------------- loads, gathers
    @cute.jit
    def loader(self, tidx, gather, tile, q_full):
        """Issue the copies of Q and dO (signalled on q_full) by warpgroup 0's
        thread tidx; return what its block gathers need."""
        sQ, sdO, sK, sOk, q_ptr, dout_ptr, kv_ptr, zero_ptr, out_ptr, sO, tma = gather
        t, head0 = tile[1], tile[4]
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.dtype, num_bits_per_copy=128)
        # 8 threads per row (its 128-byte segments as full sectors), 16 rows a pass
        tiled = cute.make_tiled_copy_tv(atom, cute.make_ordered_layout((16, 8), order=(1, 0)),
                                        cute.make_layout((1, 8)))
        thr = tiled.get_slice(tidx)
        row_in_pass = tidx // 8
        col0 = (tidx % 8) * 8
        pad = dict(real_rows=self.rows, zero_ptr=zero_ptr) if const_expr(self.rows < BLOCK_H) else {}
        if const_expr(self.l2_hints & 1 and not self.tma):
            pad["policy"] = l2_policy(EVICT_FIRST)
        if const_expr(self.tma):
            if tidx < 32:  # the copies elect one lane of the warp
                if tidx == 0:
                    n_cols = self.D + self.d_v * (2 if const_expr(self.kernel_delta) else 1)
                    cute.arch.mbarrier_arrive_and_expect_tx(q_full, BLOCK_H * n_cols * (self.dtype.width // 8))
                for a_, g_, s_ in tma:
                    if const_expr(a_ is not None):
                        self.box_copy(a_, s_, g_, t, head0, 0, True, self.l2_hints & 1, tma_bar_ptr=q_full)
        else:
            copy_head_rows(atom, thr.partition_D(sQ), q_ptr, self.dtype, t, self.H, head0, BLOCK_H, self.D,
                           row_in_pass, col0, **pad)
            copy_head_rows(atom, thr.partition_D(sdO), dout_ptr, self.dtype, t, self.H, head0, BLOCK_H, self.d_v,
                           row_in_pass, col0, **pad)
            if const_expr(self.kernel_delta):
                copy_head_rows(atom, thr.partition_D(sO), out_ptr, self.dtype, t, self.H, head0, BLOCK_H,
                               self.d_v, row_in_pass, col0, **pad)
            cute.arch.cp_async_mbarrier_arrive_noinc(q_full)
        regs = (cute.make_rmem_tensor((BN // 16,), Int32), cute.make_rmem_tensor((BN // 16,), Int64),
                cute.make_rmem_tensor((BN // 16,), Float32))
        return (atom, thr.partition_D(sK), cute.make_tensor(sOk, cute.make_layout((BN,))), regs, kv_ptr,
                zero_ptr, row_in_pass, col0)

    @cute.jit
    def fetch_block(self, ld, i, tile):
        """Issue the index loads of block i (this thread's rows), all in
        flight together; a slot past L reads slot L - 1 instead (nothing past
        topk_length is read) and is dropped.  rules.fetch_indices less its
        L > 0 test: a block runs only when L > 0."""
        ns = ld[3][0]
        row_in_pass = ld[6]
        L, idx_row = tile[5], tile[7]
        for m in cutlass.range_constexpr(BN // 16):
            slot = i * BN + row_in_pass + m * 16
            ns[m] = load(idx_row, Int64(cutlass.min(slot, L - 1)))

    @cute.jit
    def gather_block(self, ld, i, tile, N, full, empty):
        """Gather the kv rows of block i into the stage, once both warpgroups
        are past block i - 1's dQ; the stage's mask with it.  Its indices
        were fetched (``fetch_block``) a block earlier with ``index_ahead``,
        else now; then block i + 1's are fetched."""
        atom, tK, ok, (ns, base, mk), kv_ptr, zero_ptr, row_in_pass, col0 = ld
        g, L = tile[2], tile[5]
        ES = self.dtype.width // 8
        if const_expr(not self.index_ahead):
            self.fetch_block(ld, i, tile)
        self.resolve_rows(base, mk, ns, i, kv_ptr, zero_ptr, g, L, N, row_in_pass, col0)
        if const_expr(self.index_ahead):
            if i + 1 < tile[6]:
                self.fetch_block(ld, i + 1, tile)  # its latency runs under this block's work
        if i > 0:
            cute.arch.mbarrier_wait(empty, freed_phase(i))  # both warpgroups past block i - 1's dQ
        for m in cutlass.range_constexpr(BN // 16):
            for c in cutlass.range_constexpr(self.D // 64):
                src = cute.make_tensor(aligned(self.dtype, base[m] + c * 64 * ES), cute.make_layout((8,)))
                cute.copy(atom, src, tK[None, m, c])
        cute.arch.cp_async_mbarrier_arrive_noinc(full)
        if col0 == 0:
            for m in cutlass.range_constexpr(BN // 16):
                ok[row_in_pass + 16 * m] = mk[m]
            cute.arch.mbarrier_arrive(full)

    @cute.jit
    def resolve_rows(self, base, mk, ns, i, kv_ptr, zero_ptr, g, L, N, row_in_pass, col0):
        """base[m] / mk[m]: source address and mask of this thread's m-th row
        of block i; the one place the kernel decides validity."""
        ES = self.dtype.width // 8
        rules.block_sources(base, mk, ns, i, L, N, kv_ptr, zero_ptr, g, self.G, self.D * ES, col0 * ES,
                            BN, row_in_pass, 16)

    # ------------------------------------------------------------- warpgroups
    @cute.jit
    def warpgroup_main(self, w: cutlass.Constexpr, gather, s_mma, dq_mma, dq1_mma, kv_mma, sp_layout, kt0_layout,
                 kt1_layout, t64_layout, wtid, sQ, sdO, sK, raw_ds, raw_p, sOk, sDelta, bars, tile,
                 idx_ptr, lg2den_ptr, delta_ptr, dq_ptr, dkv_ptr, magic_ptr, T, t0, N, K, scale_log2, sm_scale,
                 tpc, dqt):
        q_full, full, empty = bars
        tl, t, g, hb, head0, L, n_blocks, idx_row = tile
        lane = wtid % 32
        row_lo = (wtid // 32) * 16 + lane // 4
        col_lane = 2 * (lane % 4)
        # dQ: A = dS [heads, slots] K-major, B = the K tile's columns read
        # MN-major; warpgroup w holds [256 w, 256 w + 256), warpgroup 1 also
        # the RoPE columns [512, D)
        sdS_k = cute.make_tensor(cute.recast_ptr(raw_ds, sp_layout.inner), sp_layout.outer)
        raw_k = cute.recast_ptr(sK.iterator, None)
        thr_q = dq_mma.get_slice(wtid)
        kt = cute.make_tensor(cute.recast_ptr(raw_k + w * BN * DQ_N, kt0_layout.inner), kt0_layout.outer)
        tQrdS = dq_mma.make_fragment_A(thr_q.partition_A(sdS_k))
        tQrK = dq_mma.make_fragment_B(thr_q.partition_B(kt))
        acc_dq = cute.make_rmem_tensor(thr_q.partition_shape_C((BLOCK_H, DQ_N)), Float32)
        acc_dq.fill(0.0)
        rope = w == 1 and self.D > self.d_v
        thr_r = dq1_mma.get_slice(wtid)
        ktr = cute.make_tensor(cute.recast_ptr(raw_k + BN * self.d_v, kt1_layout.inner), kt1_layout.outer)
        tRrdS = dq1_mma.make_fragment_A(thr_r.partition_A(sdS_k))
        tRrK = dq1_mma.make_fragment_B(thr_r.partition_B(ktr))
        acc_dqr = cute.make_rmem_tensor(thr_r.partition_shape_C((BLOCK_H, 64)), Float32)
        acc_dqr.fill(0.0)
        dq = (dq_mma, tQrdS, tQrK, acc_dq, dq1_mma, tRrdS, tRrK, acc_dqr, rope)
        # dkv byte address and validity of the slot rows this thread writes:
        # entry 2 r + k is row 2 p + k + 8 r of its quad pair
        rows = cute.make_rmem_tensor((4,), Int64)
        rok = cute.make_rmem_tensor((4,), Int32)
        # the deterministic build's grid of each row (``dkv.slot_rows``)
        mz = cute.make_rmem_tensor((4,), Float32) if const_expr(self.deterministic) else None
        pol = dkv_reduce.evict_last_policy() if const_expr(self.evict_last) else None
        row0 = self.dkv_row0(tile, N, tpc)
        dkv = (kv_mma, t64_layout, wtid, sQ, sdO, raw_ds, raw_p, (rows, rok, pol, mz))

        if const_expr(w == 0):
            self.mark(magic_ptr, wtid, TL_START)
            ld = self.loader(wtid, gather, tile, q_full)
            if n_blocks > 0:
                if const_expr(self.index_ahead):
                    self.fetch_block(ld, 0, tile)
                if const_expr(not self.kernel_delta):
                    self.gather_block(ld, 0, tile, N, full, empty)
            # the rows' lse (and Delta) loads run while Q and dO land
            sc = self.scores_setup(s_mma, sp_layout, wtid, sQ, sdO, sK, raw_ds, raw_p, sOk, t, head0,
                                   row_lo, col_lane, lg2den_ptr, delta_ptr)
            cute.arch.mbarrier_wait(q_full, 0)
            self.mark(magic_ptr, wtid, TL_Q)
            if const_expr(self.kernel_delta):
                # out's rows fill the stage now; block 0 is gathered once they are read
                self.row_delta(sc, sDelta, t, head0, row_lo, col_lane, delta_ptr)
                if n_blocks > 0:
                    self.gather_block(ld, 0, tile, N, full, empty)
            self.mark(magic_ptr, wtid, TL_DELTA)
            for i in cutlass.range(n_blocks, unroll=1):
                self.slot_rows(rows, rok, i, row_lo, lane, L, row0, idx_row, dkv_ptr, N, magic_ptr, mz)
                cute.arch.mbarrier_wait(full, phase(i))
                if i == 0:
                    self.mark(magic_ptr, wtid, TL_BLOCK0)
                self.scores(sc, i, scale_log2, sm_scale)
                pipeline.arrive(Barrier.READY, PAIR_THREADS)
                self.dq_step(dq, empty)
                if i + 1 < n_blocks:  # the stage is free once both are past this dQ
                    self.gather_block(ld, i + 1, tile, N, full, empty)
                if const_expr(self.dq_early):
                    if i + 1 == n_blocks:
                        self.last_dq(dq, 0, wtid, sK, dqt, t, head0, row_lo, col_lane, dq_ptr)
                self.dkv_block(0, dkv, False)
            self.mark(magic_ptr, wtid, TL_LOOP0)
        else:
            cute.arch.mbarrier_wait(q_full, 0)
            for i in cutlass.range(n_blocks, unroll=1):
                self.slot_rows(rows, rok, i, row_lo, lane, L, row0, idx_row, dkv_ptr, N, magic_ptr, mz)
                cute.arch.barrier(barrier_id=Barrier.READY, number_of_threads=PAIR_THREADS)
                if i == 0:
                    self.mark(magic_ptr, wtid, TL_READY1)
                self.dq_step(dq, empty)
                if const_expr(self.dq_early):
                    if i + 1 == n_blocks:
                        self.last_dq(dq, 1, wtid, sK, dqt, t, head0, row_lo, col_lane, dq_ptr)
                self.dkv_block(1, dkv, i + 1 < n_blocks)
            self.mark(magic_ptr, wtid, TL_LOOP1)
        if const_expr(self.dq_early):
            if n_blocks == 0:  # a row with no valid slot: its dq is 0
                self.store_dqs(dq, w, t, head0, row_lo, col_lane, dq_ptr)
        else:
            self.store_dqs(dq, w, t, head0, row_lo, col_lane, dq_ptr)
        if const_expr(self.dq_tma):
            if wtid < 32:  # the stage must outlive the boxes' reads of it
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        self.mark(magic_ptr, wtid, TL_END0 + w)

    @cute.jit
    def last_dq(self, dq, w: cutlass.Constexpr, wtid, sK, dqt, t, head0, row_lo, col_lane, dq_ptr):
        """Warpgroup w's dq after the last block's dQ: stored from the
        registers (``store_dqs``), or with dq_tma written into the warpgroup's
        columns of the stage (which only its own dQ read) and sent as boxes."""
        if const_expr(not self.dq_tma):
            self.store_dqs(dq, w, t, head0, row_lo, col_lane, dq_ptr)
        else:
            dq_mma, acc_dq, dq1_mma, acc_dqr, rope = dq[0], dq[3], dq[4], dq[7], dq[8]
            tma_dq, gdq, wide_layout, box_layout = dqt
            raw_k = cute.recast_ptr(sK.iterator, None)
            # column chunk c of the [64, D] stage is 64 x 64 contiguous elements at c 64 64
            view = cute.make_tensor(cute.recast_ptr(raw_k + w * DQ_N * BLOCK_H, wide_layout.inner), wide_layout.outer)
            self.stage_fragment(acc_dq, dq_mma.get_slice(wtid).partition_C(view))
            if const_expr(rope):
                rv = cute.make_tensor(cute.recast_ptr(raw_k + self.d_v * BLOCK_H, box_layout.inner),
                                      box_layout.outer)
                self.stage_fragment(acc_dqr, dq1_mma.get_slice(wtid).partition_C(rv))
            cute.arch.fence_view_async_shared()  # the writes, then the boxes' reads (the async proxy)
            pipeline.sync(Barrier.DQ0 + w, 128)
            if wtid < 32:  # the copies elect one lane of the warp
                n_chunks = DQ_N // 64 if const_expr(w == 0) else (self.D - DQ_N) // 64
                for c in cutlass.range_constexpr(n_chunks):
                    ch = w * (DQ_N // 64) + c
                    src = cute.make_tensor(cute.recast_ptr(raw_k + ch * 64 * BLOCK_H, box_layout.inner),
                                           box_layout.outer)
                    self.box_copy(tma_dq, src, gdq, t, head0, ch, False, self.l2_hints & 2)
                cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def box_copy(self, atom, smem, gmem, t, head0, col: cutlass.Constexpr, load: cutlass.Constexpr,
                 evict_first: cutlass.Constexpr, **kw):
        """The bulk copy of the tile's 64 rows (token t, heads from head0) of
        the [rows, columns] TMA tensor gmem at column block col (of smem's
        width) into smem (load) or from it, evict-first in L2 if asked."""
        tile = cute.local_tile(gmem, (BLOCK_H, cute.size(smem, mode=[1])), ((t * self.H + head0) // BLOCK_H, col))
        ts, tg = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2),
                                       cute.group_modes(tile, 0, 2))
        if const_expr(evict_first):
            kw["cache_policy"] = l2_policy(EVICT_FIRST)
        if const_expr(load):
            cute.copy(atom, tg, ts, **kw)
        else:
            cute.copy(atom, ts, tg, **kw)

    @cute.jit
    def stage_fragment(self, acc, dst):
        """acc (fp32) in q's dtype into its place dst in shared memory."""
        r = cute.make_rmem_tensor(acc.shape, self.dtype)
        for i_ in cutlass.range_constexpr(cute.size(acc)):
            r[i_] = acc[i_].to(self.dtype)
        cute.autovec_copy(r, dst)

    @cute.jit
    def store_dqs(self, dq, w: cutlass.Constexpr, t, head0, row_lo, col_lane, dq_ptr):
        """Warpgroup w's columns of dq: [256 w, 256 w + 256), and warpgroup 1
        also the RoPE columns [d_v, D)."""
        acc_dq, acc_dqr, rope = dq[3], dq[7], dq[8]
        self.store_dq(acc_dq, w * DQ_N, t, head0, row_lo, col_lane, dq_ptr)
        if const_expr(rope):
            self.store_dq(acc_dqr, self.d_v, t, head0, row_lo, col_lane, dq_ptr)

    @cute.jit
    def mark(self, tl_ptr, wtid, slot: cutlass.Constexpr):
        """The timeline build: the warpgroup's first thread writes the SM
        clock to [tile, slot] and the global timer to [tile, TL_NS + slot]
        (and, at TL_START, the SM's id); else nothing."""
        if const_expr(self.timeline):
            if wtid == 0:
                tile_id, _, _ = cute.arch.block_idx()
                row = cute.make_tensor(aligned(Int64, tl_ptr.toint() + Int64(tile_id) * Int64(TL_N * 8), 8),
                                       cute.make_layout((TL_N,)))
                row[slot] = cute.arch.clock64()
                row[TL_NS + slot] = cute.arch.globaltimer()
                if const_expr(slot == TL_START):
                    row[TL_SM] = Int64(cute.arch.smid())

    @cute.jit
    def scores_setup(self, s_mma, sp_layout, wtid, sQ, sdO, sK, raw_ds, raw_p, sOk, t, head0, row_lo,
                     col_lane, lg2den_ptr, delta_ptr):
        """Warpgroup 0's fragments and registers for S, dP, P and dS."""
        thr_s = s_mma.get_slice(wtid)
        tSrQ = s_mma.make_fragment_A(thr_s.partition_A(sQ))     # (MMA, 1, D / 16)
        tSrK = s_mma.make_fragment_B(thr_s.partition_B(sK))     # (MMA, 1, D / 16)
        tSrdO = s_mma.make_fragment_A(thr_s.partition_A(sdO))   # (MMA, 1, d_v / 16)
        shape = thr_s.partition_shape_C((BLOCK_H, BN))
        acc_s = cute.make_rmem_tensor(shape, Float32)
        acc_dp = cute.make_rmem_tensor(shape, Float32)
        # dS and P: [64 heads, 64 slots] K-major
        ds = cute.make_tensor(cute.recast_ptr(raw_ds, sp_layout.inner), sp_layout.outer)
        pp = cute.make_tensor(cute.recast_ptr(raw_p, sp_layout.inner), sp_layout.outer)
        r_ds = cute.make_rmem_tensor(shape, self.dtype)
        r_p = cute.make_rmem_tensor(shape, self.dtype)
        mask = cute.make_rmem_tensor((cute.size(acc_s) // 4, 2), Float32)
        lg2 = cute.make_rmem_tensor((2,), Float32)
        dl = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            off = Int64(t) * Int64(self.H) + Int64(head0 + row_lo + 8 * r)
            if const_expr(self.rows < BLOCK_H):
                # a padding row: p = exp2(-inf) = 0, so dS = 0 (no load past the heads)
                lg2[r] = Float32(float("inf"))
                dl[r] = Float32(0.0)
                if row_lo + 8 * r < self.rows:
                    lg2[r] = load(lg2den_ptr, off)
                    if const_expr(not self.kernel_delta):
                        dl[r] = load(delta_ptr, off)
            else:
                lg2[r] = load(lg2den_ptr, off)
                if const_expr(not self.kernel_delta):
                    dl[r] = load(delta_ptr, off)
        ok = cute.make_tensor(sOk, cute.make_layout((BN,)))
        return (s_mma, tSrQ, tSrK, tSrdO, acc_s, acc_dp, thr_s.partition_C(ds), thr_s.partition_C(pp),
                r_ds, r_p, mask, lg2, dl, ok, col_lane)

    @cute.jit
    def row_delta(self, sc, sDelta, t, head0, row_lo, col_lane, delta_ptr):
        """kernel_delta, warpgroup 0, with out's rows of the tile in the stage:
        Delta = the diagonal of dO out^T (the dP product on the stage), into
        shared memory, this thread's rows' into dl and every real row's into
        delta [T, H] (dsink's terms); the stage is then free for block 0."""
        s_mma, tSrQ, tSrK, tSrdO, acc_s, acc_dp, tDs, tPs, r_ds, r_p, mask, lg2, dl, ok, _ = sc
        acc_dp.fill(0.0)
        warpgroup.fence()
        for k in cutlass.range_constexpr(self.d_v // 16):
            cute.gemm(s_mma, acc_dp, tSrdO[None, None, k], tSrK[None, None, k], acc_dp)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        sd = cute.make_tensor(sDelta, cute.make_layout((BLOCK_H,)))
        # accumulator element 4j + 2r + e sits at row row_lo + 8r, column 8j + col_lane + e
        for i_ in cutlass.range_constexpr(cute.size(acc_dp)):
            j, r, e = i_ // 4, (i_ // 2) % 2, i_ % 2
            row = row_lo + 8 * r
            if 8 * j + col_lane + e == row:
                sd[row] = acc_dp[i_]
                if row < self.rows:
                    dst = cute.make_tensor(delta_ptr + (Int64(t) * Int64(self.H) + Int64(head0 + row)),
                                           cute.make_layout((1,)))
                    dst[0] = acc_dp[i_]
        cute.arch.barrier(barrier_id=Barrier.DELTA, number_of_threads=128)
        for r in cutlass.range_constexpr(2):
            dl[r] = sd[row_lo + 8 * r]

    @cute.jit
    def scores(self, sc, i, scale_log2, sm_scale):
        """Warpgroup 0, block i: S = Q K^T and dP = dO V^T (both operands in
        shared memory), P and dS = P (dP - Delta) sm_scale, stored once
        warpgroup 1 is done with the previous block's."""
        s_mma, tSrQ, tSrK, tSrdO, acc_s, acc_dp, tDs, tPs, r_ds, r_p, mask, lg2, dl, ok, col_lane = sc
        NS = cute.size(acc_s)
        acc_s.fill(0.0)
        acc_dp.fill(0.0)
        warpgroup.fence()
        for k in cutlass.range_constexpr(self.D // 16):
            cute.gemm(s_mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k], acc_s)
        warpgroup.commit_group()
        for k in cutlass.range_constexpr(self.d_v // 16):
            cute.gemm(s_mma, acc_dp, tSrdO[None, None, k], tSrK[None, None, k], acc_dp)
        warpgroup.commit_group()
        # accumulator element 4j + 2r + e sits at row row_lo + 8r, column 8j + col_lane + e
        for j in cutlass.range_constexpr(NS // 4):
            for e in cutlass.range_constexpr(2):
                mask[j, e] = ok[8 * j + col_lane + e]
        warpgroup.wait_group(1)
        for i_ in cutlass.range_constexpr(NS):
            j, r, e = i_ // 4, (i_ // 2) % 2, i_ % 2
            acc_s[i_] = cute.math.exp2(acc_s[i_] * scale_log2 + mask[j, e] - lg2[r], fastmath=True)
            r_p[i_] = acc_s[i_].to(self.dtype)
        warpgroup.wait_group(0)
        for i_ in cutlass.range_constexpr(NS):
            r = (i_ // 2) % 2
            r_ds[i_] = (acc_s[i_] * (acc_dp[i_] - dl[r]) * sm_scale).to(self.dtype)
        if i > 0:
            cute.arch.barrier(barrier_id=Barrier.FREE, number_of_threads=PAIR_THREADS)
        cute.autovec_copy(r_ds, tDs)
        cute.autovec_copy(r_p, tPs)
        cute.arch.fence_view_async_shared()

    @cute.jit
    def dq_step(self, dq, empty):
        """dQ += dS K over this warpgroup's columns; then the stage is released."""
        dq_mma, tQrdS, tQrK, acc_dq, dq1_mma, tRrdS, tRrK, acc_dqr, rope = dq
        warpgroup.fence()
        for k in cutlass.range_constexpr(BN // 16):
            cute.gemm(dq_mma, acc_dq, tQrdS[None, None, k], tQrK[None, None, k], acc_dq)
        if const_expr(rope):
            for k in cutlass.range_constexpr(BN // 16):
                cute.gemm(dq1_mma, acc_dqr, tRrdS[None, None, k], tRrK[None, None, k], acc_dqr)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        cute.arch.mbarrier_arrive(empty)

    @cute.jit
    def dkv_row0(self, tile, N, tpc):
        """``dsa.cute.dkv.dkv_row0`` of the tile (kv row n at n G + row0 of the
        accumulator); the deterministic build's copy t // tpc starts N G
        rows further per copy."""
        row0 = dkv_reduce.dkv_row0(False, self.G, tile[0], tile[2], tile[3], 0, 0)
        if const_expr(self.deterministic):
            row0 = row0 + Int64(tile[1] // tpc) * Int64(N) * Int64(self.G)
        return row0

    @cute.jit
    def slot_rows(self, rows, rok, i, row_lo, lane, L, row0, idx_row, dkv_ptr, N, magic_ptr, mz):
        """``dsa.cute.dkv.slot_rows`` of block i (with the rows' grids in the
        deterministic build)."""
        dkv_reduce.slot_rows(rows, rok, i, row_lo, lane, L, row0, idx_row, dkv_ptr, N, self.G, self.D,
                             False, magic=magic_ptr if const_expr(self.deterministic) else None, mz=mz)

    @cute.jit
    def dkv_block(self, w: cutlass.Constexpr, dkv, release):
        """dKV of this block for the warpgroup's own chunks, each added to (or
        stored at) the slots' rows once its wgmma is done; dS^T and P^T are
        the dS / P buffers read MN-major.  release: warpgroup 1 frees the
        dS / P buffers once its last wgmma is done."""
        kv_mma, t64_layout, wtid, sQ, sdO, raw_ds, raw_p, dst = dkv
        thr = kv_mma.get_slice(wtid)
        dst_ = cute.make_tensor(cute.recast_ptr(raw_ds, t64_layout.inner), t64_layout.outer)
        pt = cute.make_tensor(cute.recast_ptr(raw_p, t64_layout.inner), t64_layout.outer)
        tArdS = kv_mma.make_fragment_A(thr.partition_A(dst_))
        tArP = kv_mma.make_fragment_A(thr.partition_A(pt))
        raw_q = cute.recast_ptr(sQ.iterator, None)
        raw_do = cute.recast_ptr(sdO.iterator, None)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((BN, 64)), Float32)
        chunks = self.chunks[w]
        n = len(chunks)
        for c in cutlass.range_constexpr(n):
            self.dkv_chunk(kv_mma, thr, t64_layout, tArdS, tArP, raw_q, raw_do, chunks[c], acc)
            warpgroup.wait_group(0)
            if const_expr(w == 1 and c + 1 == n):
                if release:
                    pipeline.arrive(Barrier.FREE, PAIR_THREADS)
            self.scatter(acc, chunks[c], dst)

    @cute.jit
    def dkv_chunk(self, kv_mma, thr, t64_layout, tArdS, tArP, raw_q, raw_do, ch: cutlass.Constexpr, acc):
        """acc <- dS^T Q[:, chunk ch] (+ P^T dO[:, chunk ch] on value columns), one commit group."""
        qc = cute.make_tensor(cute.recast_ptr(raw_q + ch * BLOCK_H * 64, t64_layout.inner), t64_layout.outer)
        tBrQ = kv_mma.make_fragment_B(thr.partition_B(qc))
        acc.fill(0.0)
        warpgroup.fence()
        # the sum runs over the heads (16 a step): a padded tile's zero rows are skipped
        for k in cutlass.range_constexpr(self.rows // 16 if const_expr(self.dkv_mma) else 0):
            cute.gemm(kv_mma, acc, tArdS[None, None, k], tBrQ[None, None, k], acc)
        if const_expr(ch * 64 < self.d_v and self.dkv_mma):
            doc = cute.make_tensor(cute.recast_ptr(raw_do + ch * BLOCK_H * 64, t64_layout.inner),
                                   t64_layout.outer)
            tBrdO = kv_mma.make_fragment_B(thr.partition_B(doc))
            for k in cutlass.range_constexpr(self.rows // 16):
                cute.gemm(kv_mma, acc, tArP[None, None, k], tBrdO[None, None, k], acc)
        warpgroup.commit_group()

    @cute.jit
    def scatter(self, acc, ch: cutlass.Constexpr, dst):
        """``dsa.cute.dkv.scatter`` of a chunk (none in the timing build without scatter)."""
        rows, rok, pol, mz = dst
        if const_expr(self.do_scatter):
            dkv_reduce.scatter(acc, ch, rows, rok, pol, False, mz=mz)

    @cute.jit
    def store_dq(self, acc_dq, c0: cutlass.Constexpr, t, head0, row_lo, col_lane, dq_ptr):
        """dq[t, head0 + row, c0 + tile column] in q's dtype, two columns a 32-bit store."""
        NO = cute.size(acc_dq)
        ob = cute.make_rmem_tensor((NO,), self.dtype)
        for i_ in cutlass.range_constexpr(NO):
            ob[i_] = acc_dq[i_].to(self.dtype)
        ow = cute.recast_tensor(ob, Int32)  # word 2j + r: columns 8j + col_lane + {0, 1} of row r
        ES = self.dtype.width // 8
        base = dq_ptr.toint() + (Int64(t) * Int64(self.H) + Int64(head0)) * Int64(self.D * ES)
        pol = l2_policy(EVICT_FIRST) if const_expr(self.l2_hints & 2) else None
        for j in cutlass.range_constexpr(NO // 4):
            for r in cutlass.range_constexpr(2):
                col = c0 + 8 * j + col_lane
                addr = base + (Int64(row_lo + 8 * r) * Int64(self.D) + col) * ES
                if const_expr(self.rows < BLOCK_H):
                    if row_lo + 8 * r < self.rows:  # padding rows have no dq
                        self.store_word(addr, ow[2 * j + r], pol)
                else:
                    self.store_word(addr, ow[2 * j + r], pol)

    @cute.jit
    def store_word(self, addr, w, pol):
        """One 32-bit word of dq at addr (under the L2 policy pol, None for none)."""
        if const_expr(pol is not None):
            store_b32_hinted(addr, w, pol)
        else:
            dst = cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4),
                                   cute.make_layout((1,)))
            dst[0] = w

