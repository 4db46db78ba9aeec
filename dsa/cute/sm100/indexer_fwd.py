"""The lean lightning-indexer forward for Blackwell (SM100) in CuTe DSL.

    score[i, j] = sm_scale * sum_h w[i, h] * relu(q[i, h] . k[j])    (visible j; -inf otherwise)

for 64 heads of 128 dims and one key shared by every head (MQA), in the
packed layout of ``dsa._args.IndexerArgs`` (the visibility rule is
docs/semantics.md's, ``q_offsets`` and ``ratio`` included).  fp32 scores.

A work unit is a block of ``BQ`` = 4 consecutive queries of one sequence;
its keys are the dense 128-row tiles of its window [0, k_end) (k_end: the
last query's visible count, or S_k without causality).  One tcgen05.mma
(M = 128 keys, N = 4 queries x 64 heads = 256, K = 16) is issued per 16
dims: the keys are the A operand, so TMEM lane j of the accumulator is key
j of the tile and its 256 columns are the (query, head) pairs, and a
thread of the epilogue sums its key's 64 heads of a query in registers.

Units are numbered last-first over the block table of the Triton indexer
(``dsa.triton.indexer.block_tables``), which within a causal sequence is the
longest-first (reversed LPT) order, and CTA c of a static persistent grid
runs units c, c + grid, ...  Warps:

* warp 4 loads Q [256 rows, 128] once a unit and each key tile [128, 128]
  into one of ``K_STAGES`` stages with TMA (rows past the tensor read as
  zeros; rows of the next sequence are computed and masked);
* warp 5 issues the MMAs into one of two TMEM accumulators [128, 256];
* warps 0-3 read an accumulator (``tcgen05.ld``, 32 lanes a warp), apply
  relu (NaN-preserving) and the weights, mask the invisible keys to -inf
  and store the scores; the columns past the window are written -inf
  without compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05

from dsa.cute import pipeline
from dsa.cute.gmem import load
from dsa.cute.sm100 import sync

HEADS = 64
DIM = 128
BQ = 4                       # queries a unit: N = BQ * HEADS = 256, the largest N of one MMA
BK = 128                     # keys a tile: M = 128, one TMEM lane a key
N_COLS = BQ * HEADS
K_STAGES = 4                 # key tiles in flight (32 KB each)
ACC = 2                      # TMEM accumulators (2 x 256 columns: all 512)
EPI_WARPS = 4
LOAD_WARP = EPI_WARPS
MMA_WARP = EPI_WARPS + 1
THREADS = 32 * (MMA_WARP + 1)
TMEM_COLS = 512
CHUNK = 32                   # heads a thread loads from TMEM at once
SMEM_LIMIT = 227 * 1024


@pipeline.named_barriers
class EpiBarrier(pipeline.NamedBarrier):
    """The epilogue warps' own barrier, around the shared weights of a unit."""

    WEIGHTS = 1


@dataclass(frozen=True)
class IndexerSm100Config:
    """The static configuration one compiled kernel serves (its compile key):
    the q / k dtype (``cutlass.BFloat16`` or ``cutlass.Float16``), the weights
    dtype (those or ``cutlass.Float32``), causal, and single (one sequence:
    no block table)."""

    dtype: Any
    w_dtype: Any
    causal: bool
    single: bool


@dataclass(frozen=True)
class Units:
    """What decoding a unit needs (the same for every role)."""

    cu_q: Any
    cu_k: Any
    offsets: Any
    blk_cum: Any
    row_begin: Any
    row_end: Any
    n_seq: Any
    n_iter: Any
    ratio: Any


@dataclass(frozen=True)
class Unit:
    t0: Any       # first query row (packed)
    q_hi: Any     # one past the last query row of the unit's sequence (and chunk)
    k_seq0: Any   # first key row of the sequence
    s_k: Any      # its keys
    first: Any    # q_offsets + local index + 1 of query t0 (int64)
    n_kv: Any     # key tiles of the window


def smem_bytes(elem_bytes: int) -> int:
    """Shared memory of the ``Smem`` struct: barriers, the TMEM address, the
    weights [4, 64] fp32, Q [256, 128] and the key stages [128, 128], the
    tiles 1024-byte aligned; the whole rounded up to that alignment."""
    def up(n: int, a: int = 1024) -> int:
        return -(-n // a) * a

    head = 8 * (2 + 2 * K_STAGES + 2 * ACC) + 4 + 4 * N_COLS
    return up(up(head) + N_COLS * DIM * elem_bytes + K_STAGES * BK * DIM * elem_bytes)


class IndexerFwdSm100:
    """Host-side builder of the kernel for one static configuration."""

    def __init__(self, dtype, w_dtype, causal: bool, single: bool):
        self.config = IndexerSm100Config(dtype, w_dtype, causal, single)
        self.dtype, self.w_dtype = dtype, w_dtype
        self.causal, self.single = causal, single
        if smem_bytes(dtype.width // 8) > SMEM_LIMIT:
            raise ValueError("IndexerFwdSm100: shared memory exceeds an SM100 CTA's")

    @cute.jit
    def __call__(
        self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, w_ptr: cute.Pointer, out_ptr: cute.Pointer,
        cu_q_ptr: cute.Pointer, cu_k_ptr: cute.Pointer, off_ptr: cute.Pointer, blk_cum_ptr: cute.Pointer,
        Tq: Int32, Tk: Int32, row_begin: Int32, row_end: Int32, n_seq: Int32, n_iter: Int32, max_k: Int32,
        ratio: Int64, sm_scale: Float32, out_stride: Int64, n_cta: Int32, stream,
    ):
        dt = self.dtype
        K_ = OperandMajorMode.K
        mma = cute.make_tiled_mma(tcgen05.MmaF16BF16Op(
            dt, Float32, (BK, N_COLS, 16), tcgen05.CtaGroup.ONE, tcgen05.OperandSource.SMEM, K_, K_))
        tiler = (BK, N_COLS, DIM)
        sk_layout = sm100_utils.make_smem_layout_a(mma, tiler, dt, K_STAGES)
        sq_layout = sm100_utils.make_smem_layout_b(mma, tiler, dt, 1)
        # q as [Tq * 64, 128] (row = query x head) and k [Tk, 128]: the TMA tiles
        mQ = cute.make_tensor(q_ptr, cute.make_layout((Tq * HEADS, DIM), stride=(DIM, 1)))
        mK = cute.make_tensor(k_ptr, cute.make_layout((Tk, DIM), stride=(DIM, 1)))
        op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        tma_k, tma_mk = cute.nvgpu.make_tiled_tma_atom_A(op, mK, cute.select(sk_layout, mode=[0, 1, 2]), tiler, mma)
        tma_q, tma_mq = cute.nvgpu.make_tiled_tma_atom_B(op, mQ, cute.select(sq_layout, mode=[0, 1, 2]), tiler, mma)

        @cute.struct
        class Smem:  # smem_bytes() is its size
            # Why no barrier runs two phases ahead of its waiter: q_full needs
            # q_empty, which needs the MMA warp past its wait; k_full[s] /
            # k_empty[s] alternate between the load and MMA warps; acc_full[a] /
            # acc_empty[a] between the MMA warp and the epilogue.
            q_full: cute.struct.MemRange[cutlass.Int64, 1]
            q_empty: cute.struct.MemRange[cutlass.Int64, 1]
            k_full: cute.struct.MemRange[cutlass.Int64, K_STAGES]
            k_empty: cute.struct.MemRange[cutlass.Int64, K_STAGES]
            acc_full: cute.struct.MemRange[cutlass.Int64, ACC]
            acc_empty: cute.struct.MemRange[cutlass.Int64, ACC]
            tmem_addr: Int32
            sW: cute.struct.MemRange[Float32, N_COLS]  # the unit's weights, query-major
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sq_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sk_layout)], 1024]

        self.smem = Smem
        units = Units(cu_q_ptr, cu_k_ptr, off_ptr, blk_cum_ptr, row_begin, row_end, n_seq, n_iter, ratio)
        # n_cta: the host's min(SMs, an upper bound of the units); the kernel reads the exact count
        self.kernel(mma, tma_k, tma_mk, tma_q, tma_mq, sk_layout, sq_layout, w_ptr, out_ptr, units, max_k,
                    sm_scale, out_stride).launch(grid=[n_cta, 1, 1], block=[THREADS, 1, 1], stream=stream,
                                                 min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mma: cute.TiledMma, tma_k: cute.CopyAtom, tma_mk: cute.Tensor, tma_q: cute.CopyAtom,
               tma_mq: cute.Tensor, sk_layout: cute.ComposedLayout, sq_layout: cute.ComposedLayout,
               w_ptr: cute.Pointer, out_ptr: cute.Pointer, units: Units, max_k: Int32, sm_scale: Float32,
               out_stride: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(self.smem)
        sQ = st.sQ.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sK = st.sK.get_tensor(sk_layout.outer, swizzle=sk_layout.inner)
        bars = (st.q_full.data_ptr(), st.q_empty.data_ptr(), st.k_full.data_ptr(), st.k_empty.data_ptr(),
                st.acc_full.data_ptr(), st.acc_empty.data_ptr())
        q_full, q_empty, k_full, k_empty, acc_full, acc_empty = bars

        sync.alloc_tmem(warp, MMA_WARP, TMEM_COLS, st.tmem_addr.ptr)
        if warp == LOAD_WARP:
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_q)
        arrivals = [(q_full, 0, 1), (q_empty, 0, 1)]
        for s in cutlass.range_constexpr(K_STAGES):
            arrivals += [(k_full, s, 1), (k_empty, s, 1)]
        for a in cutlass.range_constexpr(ACC):
            arrivals += [(acc_full, a, 1), (acc_empty, a, 32 * EPI_WARPS)]
        pipeline.init_mbarriers(tidx, arrivals)
        tmem = sync.tmem_pointer(st.tmem_addr.ptr)

        total = self.unit_count(units)
        if warp < EPI_WARPS:
            self.epilogue(tidx, tmem, st.sW.data_ptr(), bars, units, total, w_ptr, out_ptr, max_k, sm_scale,
                          out_stride)
        elif warp == LOAD_WARP:
            self.load(tma_k, tma_mk, tma_q, tma_mq, mma, sK, sQ, bars, units, total)
        else:
            self.mma(mma, sK, sQ, tmem, bars, units, total)

        sync.free_tmem(warp, MMA_WARP, TMEM_COLS, tmem)

    @cute.jit
    def unit_count(self, units: Units):
        """The units of rows [row_begin, row_end): from the block table's last
        entry, or the row count for one sequence."""
        total = (units.row_end - units.row_begin + BQ - 1) // BQ
        if const_expr(not self.single):
            total = load(units.blk_cum, Int64(units.n_seq))
        return total

    @cute.jit
    def unit(self, units: Units, total, u):
        """Unit u of the schedule, taken last-first: its rows, keys and window."""
        blk = total - 1 - u
        b = Int32(0)
        blk_first = Int32(0)
        if const_expr(not self.single):
            # the sequence b with blk_cum[b] <= blk < blk_cum[b + 1]
            lo = Int32(0)
            hi = units.n_seq
            for _ in cutlass.range(units.n_iter, unroll=1):
                mid = (lo + hi) // 2
                if load(units.blk_cum, Int64(mid)) <= blk:
                    lo = mid
                else:
                    hi = mid
            b = lo
            blk_first = load(units.blk_cum, Int64(b))
        q_seq0 = load(units.cu_q, Int64(b))
        q_lo = cutlass.max(q_seq0, units.row_begin)
        q_hi = cutlass.min(load(units.cu_q, Int64(b + 1)), units.row_end)
        k_seq0 = load(units.cu_k, Int64(b))
        s_k = load(units.cu_k, Int64(b + 1)) - k_seq0
        t0 = q_lo + (blk - blk_first) * BQ
        first = load(units.offsets, Int64(b)) + Int64(t0 - q_seq0 + 1)
        k_end = s_k
        if const_expr(self.causal):
            last = cutlass.min(t0 + BQ, q_hi) - 1  # the block's last query sees the most keys
            k_end = self.visible(first + Int64(last - t0), units.ratio, s_k)
        return Unit(t0, q_hi, k_seq0, s_k, first, (k_end + BK - 1) // BK)

    @cute.jit
    def visible(self, pos, ratio, s_k):
        """The indexer's causal rule: keys j < clamp(pos // ratio, 0, s_k) (pos int64)."""
        v = pos // ratio
        return Int32(cutlass.max(Int64(0), cutlass.min(v, Int64(s_k))))

    # ---------------------------------------------------------------- loader
    @cute.jit
    def load(self, tma_k, tma_mk, tma_q, tma_mq, mma, sK, sQ, bars, units: Units, total):
        q_full, q_empty, k_full, k_empty, acc_full, acc_empty = bars
        thr = mma.get_slice(0)
        cta, _, _ = cute.arch.block_idx()
        n_cta, _, _ = cute.arch.grid_dim()
        kt = Int32(0)  # key tiles loaded by earlier units (stage kt % K_STAGES)
        jq = Int32(0)  # units with a key tile
        for u in cutlass.range(cta, total, n_cta, unroll=1):
            un = self.unit(units, total, u)
            if un.n_kv > 0:
                gK = cute.local_tile(cute.domain_offset((un.k_seq0, 0), tma_mk), (BK, DIM), (None, 0))
                tKs, tKg = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
                                                 cute.group_modes(thr.partition_A(gK), 0, 3))
                for i in cutlass.range(un.n_kv, unroll=1):
                    s = (kt + i) % K_STAGES
                    n = (kt + i) // K_STAGES
                    if n > 0:  # the MMAs on the tile that last used the stage retired
                        cute.arch.mbarrier_wait(k_empty + s, pipeline.phase(n - 1))
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(k_full + s, BK * DIM * (self.dtype.width // 8))
                    cute.copy(tma_k, tKg[None, i], tKs[None, s], tma_bar_ptr=k_full + s)
                    if i == 0:
                        # Q after the first key tile, which may land while the last unit's MMAs finish
                        if jq > 0:  # every MMA of the last unit retired: Q may be overwritten
                            cute.arch.mbarrier_wait(q_empty, pipeline.phase(jq - 1))
                        gQ = cute.local_tile(cute.domain_offset((un.t0 * HEADS, 0), tma_mq), (N_COLS, DIM), (0, 0))
                        tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
                                                         cute.group_modes(thr.partition_B(gQ), 0, 3))
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(q_full, N_COLS * DIM * (self.dtype.width // 8))
                        cute.copy(tma_q, tQg, tQs[None, 0], tma_bar_ptr=q_full)
                kt = kt + un.n_kv
                jq = jq + 1

    # ------------------------------------------------------------------- MMA
    @cute.jit
    def mma(self, mma, sK, sQ, tmem, bars, units: Units, total):
        q_full, q_empty, k_full, k_empty, acc_full, acc_empty = bars
        tSrK = mma.make_fragment_A(sK)   # (MMA, 1, DIM / 16, stage)
        tSrQ = mma.make_fragment_B(sQ)   # (MMA, 1, DIM / 16, 1)
        acc_layout = mma.make_fragment_C(mma.partition_shape_C((BK, N_COLS))).layout
        sync.check_identity_acc(acc_layout, BK, N_COLS)  # key j of a tile in lane j, (query, head) n in column n
        cta, _, _ = cute.arch.block_idx()
        n_cta, _, _ = cute.arch.grid_dim()
        kt = Int32(0)
        jq = Int32(0)
        for u in cutlass.range(cta, total, n_cta, unroll=1):
            un = self.unit(units, total, u)
            if un.n_kv > 0:
                cute.arch.mbarrier_wait(q_full, pipeline.phase(jq))
                for i in cutlass.range(un.n_kv, unroll=1):
                    s = (kt + i) % K_STAGES
                    a = (kt + i) % ACC
                    cute.arch.mbarrier_wait(k_full + s, pipeline.phase((kt + i) // K_STAGES))
                    if kt + i >= ACC:  # the epilogue has read this accumulator's last tile
                        cute.arch.mbarrier_wait(acc_empty + a, pipeline.phase((kt + i) // ACC - 1))
                    sync.after_sync()
                    acc = cute.make_tensor(tmem + a * N_COLS, acc_layout)
                    atom = cute.make_mma_atom(mma.op)
                    for k in cutlass.range_constexpr(DIM // 16):
                        atom.set(tcgen05.Field.ACCUMULATE, k != 0)
                        cute.gemm(atom, acc, tSrK[None, None, k, s], tSrQ[None, None, k, 0], acc)
                    sync.commit(k_empty + s)
                    sync.commit(acc_full + a)
                sync.commit(q_empty)
                kt = kt + un.n_kv
                jq = jq + 1

    # -------------------------------------------------------------- epilogue
    @cute.jit
    def epilogue(self, wtid, tmem, sW, bars, units: Units, total, w_ptr, out_ptr, max_k, sm_scale, out_stride):
        q_full, q_empty, k_full, k_empty, acc_full, acc_empty = bars
        phys = cute.make_tensor(tmem, cute.make_layout((32 * EPI_WARPS, CHUNK), stride=(1 << 16, 1)))
        tiled = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), Float32),
                                       phys)
        sync.check_lane_copy(tiled, True, 32 * EPI_WARPS, CHUNK)
        t2r = tiled.get_slice(wtid)
        rS = cute.make_rmem_tensor(t2r.partition_D(cute.make_identity_tensor((32 * EPI_WARPS, CHUNK))).shape,
                                   Float32)
        w = cute.make_tensor(sW, cute.make_layout((N_COLS,)))
        limits = cute.make_rmem_tensor((BQ,), Int32)
        cta, _, _ = cute.arch.block_idx()
        n_cta, _, _ = cute.arch.grid_dim()
        kt = Int32(0)
        for u in cutlass.range(cta, total, n_cta, unroll=1):
            un = self.unit(units, total, u)
            # the unit's weights, fp32 and query-major, once the last unit's reads are done
            pipeline.sync(EpiBarrier.WEIGHTS, 32 * EPI_WARPS)
            for e in cutlass.range_constexpr(N_COLS // (32 * EPI_WARPS)):
                idx = wtid + e * 32 * EPI_WARPS
                t = un.t0 + idx // HEADS
                v = Float32(0.0)
                if t < un.q_hi:
                    v = load(w_ptr, Int64(t) * HEADS + idx % HEADS).to(Float32)
                w[idx] = v
            pipeline.sync(EpiBarrier.WEIGHTS, 32 * EPI_WARPS)
            for c in cutlass.range_constexpr(BQ):
                lim = un.s_k
                if const_expr(self.causal):
                    lim = self.visible(un.first + c, units.ratio, un.s_k)
                limits[c] = lim
            for i in cutlass.range(un.n_kv, unroll=1):
                a = (kt + i) % ACC
                cute.arch.mbarrier_wait(acc_full + a, pipeline.phase((kt + i) // ACC))
                sync.after_sync()
                j = i * BK + wtid  # this thread's key (its TMEM lane)
                for c in cutlass.range_constexpr(BQ):
                    sc = Float32(0.0)
                    for h in cutlass.range_constexpr(HEADS // CHUNK):
                        cols = cute.make_tensor(tmem + a * N_COLS + c * HEADS + h * CHUNK, phys.layout)
                        cute.copy(t2r, t2r.partition_S(cols), rS)
                        sync.wait_ld()
                        for x in cutlass.range_constexpr(CHUNK):
                            # relu that keeps a NaN (max.NaN): NaN in q or k reaches the score
                            sc = sc + w[c * HEADS + h * CHUNK + x] * cute.arch.fmax(rS[x], Float32(0.0), nan=True)
                    self.store(out_ptr, out_stride, un, units, c, j, sc * sm_scale, limits[c], max_k)
                sync.before_sync()
                cute.arch.mbarrier_arrive(acc_empty + a)
            # past the window: -inf without compute
            for c in cutlass.range_constexpr(BQ):
                for j in cutlass.range(un.n_kv * BK + wtid, max_k, 32 * EPI_WARPS, unroll=1):
                    self.store(out_ptr, out_stride, un, units, c, j, -Float32.inf, 0, max_k)
            kt = kt + un.n_kv

    @cute.jit
    def store(self, out_ptr, out_stride, un: Unit, units: Units, c: cutlass.Constexpr, j, score, limit, max_k):
        """out[row t0 + c, column j] = score for a visible key, -inf otherwise;
        nothing for a query past the unit's sequence or a column past max_k."""
        t = un.t0 + c
        if t < un.q_hi and j < max_k:
            v = -Float32.inf
            if j < limit:
                v = score
            dst = cute.make_tensor(out_ptr + (Int64(t - units.row_begin) * out_stride + Int64(j)),
                                   cute.make_layout((1,)))
            dst[0] = v
