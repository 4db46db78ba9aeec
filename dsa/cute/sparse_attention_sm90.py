"""Sparse attention forward for Hopper (SM90) in CuTe DSL.

One CTA per (token t, kv head g, block of 64 query heads), three warpgroups:

* warpgroup 0, the producer, gathers the kv rows of each block of BN slots
  with 16-byte cp.async into a ring of STAGES swizzled shared-memory tiles
  (TMA cannot gather rows on SM90), signalling each stage with
  ``cp.async.mbarrier.arrive``.  An invalid slot copies a row of zeros, so
  NaN or Inf stored in kv rows that no valid slot names is never read.  The
  kv rows of the next block are looked up while the copies of this one fly.
* warpgroups 1 and 2, the consumers, work on pairs of blocks (2i, 2i + 1):
  consumer w computes S = Q K^T of block 2i + w only (wgmma, both operands
  in shared memory), masks invalid slots, swaps its row maxima with the other
  consumer through shared memory so that both scale by the same running
  maximum, and writes its P (bf16 / fp16) to shared memory.  Consumer w then
  accumulates O for the value columns [256 w, 256 w + 256) over both blocks:
  its own P from registers, the other's from shared memory.  V is the K tile
  itself read MN-major (see ``layouts``).
* Both consumers run the wgmma group of the pair's first stage first and
  release that stage as soon as it retires, so its refill overlaps the rest.

The loop stops after the last block holding a valid slot (topk_length), so a
row of length L costs about L / K of a full row.  Compiled per (dtype, D,
d_v, H, G, topk_length?, sink?, BN) and cached by ``dsa.cute.sparse_attention``.
"""

from __future__ import annotations

import enum

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.cute.nvgpu import cpasync

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

BLOCK_H = 64   # query heads per CTA: the M of one wgmma
THREADS = 384  # producer + two consumer warpgroups
PRODUCER_REGS = 40
CONSUMER_REGS = 232
# Shared memory holds Q and 128 slots of K (64 x 2 stages or 32 x 4).
RING_SLOTS = 128


class Barrier(enum.IntEnum):
    """Named barriers of the two consumer warpgroups (id 0 is __syncthreads)."""

    MAX_SWAP = 1  # both row maxima of a pair are in shared memory
    P_READY = 2   # both P tiles of a pair are in shared memory
    ROW_SUMS = 3  # both row sums are in shared memory (epilogue)


CONSUMER_THREADS = 256


class SparseAttnFwdSm90:
    """Host-side builder of the kernel for one static configuration.

    block_n: slots per stage (64: two stages; 32: four, so a whole pair of
    blocks is in flight while the other is computed)."""

    def __init__(self, dtype, D: int, d_v: int, H: int, G: int, has_len: bool, has_sink: bool,
                 block_n: int = 64):
        if D % 64 or d_v != 512 or (H // G) % BLOCK_H or block_n not in (32, 64):
            raise ValueError("SparseAttnFwdSm90 needs D % 64 == 0, d_v == 512, (H / G) % 64 == 0, "
                             "block_n in (32, 64)")
        self.dtype = dtype
        self.D, self.d_v, self.H, self.G = D, d_v, H, G
        self.HG = H // G
        self.dv_half = d_v // 2
        self.has_len, self.has_sink = has_len, has_sink
        self.BN = block_n
        self.stages = RING_SLOTS // block_n
        self.pairs_per_ring = self.stages // 2

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        sink_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, zero_ptr: cute.Pointer,
        T: Int32, N: Int32, K: Int32, scale_log2: Float32, stream,
    ):
        dt, BN, S = self.dtype, self.BN, self.stages
        K_ = warpgroup.OperandMajorMode.K
        MN = warpgroup.OperandMajorMode.MN
        qk_mma = cute.make_tiled_mma(cute.make_mma_atom(warpgroup.MmaF16BF16Op(
            dt, Float32, (BLOCK_H, BN, 16), warpgroup.OperandSource.SMEM, K_, K_)), (1, 1, 1))
        pv_mma = cute.make_tiled_mma(cute.make_mma_atom(warpgroup.MmaF16BF16Op(
            dt, Float32, (BLOCK_H, self.dv_half, 16), warpgroup.OperandSource.RMEM, K_, MN)), (1, 1, 1))
        # O += P V with the other consumer's P, read from shared memory.
        pv_mma_ss = cute.make_tiled_mma(cute.make_mma_atom(warpgroup.MmaF16BF16Op(
            dt, Float32, (BLOCK_H, self.dv_half, 16), warpgroup.OperandSource.SMEM, K_, MN)), (1, 1, 1))

        # Layouts.  Q [64 heads, D] and each K stage [BN slots, D]: K-major
        # 128B-swizzled atoms of 8 rows x 64 columns, rows first.  V, the
        # B operand of P V, is the same bytes read MN-major: the MN-major atom
        # (64 columns x 8 slots, columns contiguous) is byte-for-byte the
        # K-major one, and tiling slots first keeps the atom order.
        # P [64 heads, BN slots] is a K-major A operand; for D = 576 it lives
        # in the columns 512..575 of its own K stage, dead once S is computed
        # (D = 512 has buffers of its own).
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dt)
        mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, dt)
        p_atom = warpgroup.make_smem_layout_atom(
            warpgroup.SmemLayoutAtomKind.K_SW128 if BN == 64 else warpgroup.SmemLayoutAtomKind.K_SW64, dt)
        sq_layout = cute.tile_to_shape(k_atom, (BLOCK_H, self.D), order=(0, 1))
        sk_layout = cute.tile_to_shape(k_atom, (BN, self.D, S), order=(0, 1, 2))
        sv_layout = cute.tile_to_shape(mn_atom, (self.dv_half, BN), order=(1, 0))
        sp_layout = cute.tile_to_shape(p_atom, (BLOCK_H, BN), order=(0, 1))
        p_elems = 0 if self.D > self.d_v else S * BLOCK_H * BN

        @cute.struct
        class Smem:
            q_full: cute.struct.MemRange[Int64, 1]
            full: cute.struct.MemRange[Int64, S]
            empty: cute.struct.MemRange[Int64, S]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sq_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sk_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[dt, max(p_elems, 8)], 1024]
            sM: cute.struct.MemRange[Float32, 2 * BLOCK_H]  # row maxima, one slice per consumer
            sL: cute.struct.MemRange[Float32, 2 * BLOCK_H]  # row sums

        self.smem = Smem
        # One flat grid, head blocks fastest: the CTAs of one (token, kv
        # head) run side by side, so the second one's gathers hit the rows the
        # first just pulled into L2.
        grid_x = T * self.G * (self.HG // BLOCK_H)
        self.kernel(
            qk_mma, pv_mma, pv_mma_ss, sq_layout, sk_layout, sv_layout, sp_layout,
            q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr, zero_ptr,
            N, K, scale_log2,
        ).launch(grid=[grid_x, 1, 1], block=[THREADS, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, pv_mma_ss: cute.TiledMma,
        sq_layout: cute.ComposedLayout, sk_layout: cute.ComposedLayout, sv_layout: cute.ComposedLayout,
        sp_layout: cute.ComposedLayout,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        sink_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, zero_ptr: cute.Pointer,
        N: Int32, K: Int32, scale_log2: Float32,
    ):
        G, HG, BN = self.G, self.HG, self.BN
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        HB = HG // BLOCK_H
        pid = cta // HB  # t * G + g
        hblk = cta - pid * HB
        t = pid // G
        g = pid - t * G
        head0 = g * HG + hblk * BLOCK_H  # first query head of this CTA
        wg = cute.arch.make_warp_uniform(tidx // 128)

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(self.smem)
        q_full = st.q_full.data_ptr()
        full = st.full.data_ptr()
        empty = st.empty.data_ptr()
        sQ = st.sQ.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sK = st.sK.get_tensor(sk_layout.outer, swizzle=sk_layout.inner)

        if tidx == 0:
            cute.arch.mbarrier_init(q_full, 128)
            for s in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(full + s, 128)   # the producer's threads
                cute.arch.mbarrier_init(empty + s, 256)  # both consumers' threads
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # Slots [0, L) may be valid; the loops stop at the block holding L - 1.
        L = K
        if const_expr(self.has_len):
            L = _load(len_ptr, Int64(t))
            L = cutlass.max(Int32(0), cutlass.min(L, K))
        n_blocks = (L + BN - 1) // BN
        idx_row = idx_ptr + Int64(pid) * Int64(K)

        # The consumers zero their accumulators by hand: the MMA objects are
        # shared by every code path and never change inside them.
        for mma in (qk_mma, pv_mma, pv_mma_ss):
            mma.set(warpgroup.Field.ACCUMULATE, True)
        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.producer(tidx, sQ, sK, q_full, full, empty, q_ptr, kv_ptr, idx_row, zero_ptr,
                          t, g, head0, L, N, n_blocks)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            args = (qk_mma, pv_mma, pv_mma_ss, sv_layout, sp_layout, tidx % 128, sQ, sK,
                    st.sP.data_ptr(), st.sM.data_ptr(), st.sL.data_ptr(), q_full, full, empty, idx_row,
                    sink_ptr, out_ptr, lse_ptr, t, head0, L, N, n_blocks, scale_log2)
            # One code path per consumer, its stages and V half static.
            if wg == 1:
                self.consumer(0, *args)
            else:
                self.consumer(1, *args)

    @cute.jit
    def producer(self, tidx, sQ, sK, q_full, full, empty, q_ptr, kv_ptr, idx_row, zero_ptr,
                 t, g, head0, L, N, n_blocks):
        D, G, BN, S = self.D, self.G, self.BN, self.stages
        ES = self.dtype.width // 8
        # 8 threads per row, 16 B each per copy: each row's 128-byte segments
        # go out as full sectors; 16 rows per pass.
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.dtype, num_bits_per_copy=128)
        tiled = cute.make_tiled_copy_tv(atom, cute.make_ordered_layout((16, 8), order=(1, 0)),
                                        cute.make_layout((1, 8)))
        thr = tiled.get_slice(tidx)
        row_in_pass = tidx // 8
        col0 = (tidx % 8) * 8
        CHUNKS = D // 64

        # Q: heads head0 .. head0 + 63 of token t.
        tQs = thr.partition_D(sQ)  # (8, 64 / 16, CHUNKS)
        for m in cutlass.range_constexpr(BLOCK_H // 16):
            row = head0 + row_in_pass + m * 16
            addr = q_ptr.toint() + (Int64(t) * Int64(self.H) + Int64(row)) * Int64(D * ES) + col0 * ES
            for c in cutlass.range_constexpr(CHUNKS):
                src = cute.make_tensor(_aligned(self.dtype, addr + c * 64 * ES), cute.make_layout((8,)))
                cute.copy(atom, src, tQs[None, m, c])
        cute.arch.cp_async_mbarrier_arrive_noinc(q_full)

        rows = cute.make_rmem_tensor((BN // 16,), Int32)
        self.lookup(rows, 0, idx_row, L, N, row_in_pass)
        for b in cutlass.range(n_blocks, unroll=1):
            s = b % S
            use = b // S
            if b >= S:
                cute.arch.mbarrier_wait(empty + s, (use - 1) % 2)
            tKs = thr.partition_D(sK[None, None, s])
            for m in cutlass.range_constexpr(BN // 16):
                n = rows[m]
                addr = zero_ptr.toint()
                if n >= 0:
                    addr = kv_ptr.toint() + (Int64(n) * Int64(G) + Int64(g)) * Int64(D * ES)
                addr = addr + col0 * ES
                for c in cutlass.range_constexpr(CHUNKS):
                    src = cute.make_tensor(_aligned(self.dtype, addr + c * 64 * ES), cute.make_layout((8,)))
                    cute.copy(atom, src, tKs[None, m, c])
            cute.arch.cp_async_mbarrier_arrive_noinc(full + s)
            self.lookup(rows, b + 1, idx_row, L, N, row_in_pass)

    @cute.jit
    def lookup(self, rows, b, idx_row, L, N, row_in_pass):
        """rows[m]: the kv row of slot b * BN + row_in_pass + 16 m, or -1 if
        that slot is not valid."""
        for m in cutlass.range_constexpr(self.BN // 16):
            slot = b * self.BN + row_in_pass + m * 16
            n = Int32(-1)
            if slot < L:
                n = _load(idx_row, Int64(slot))
                if n < 0 or n >= N:
                    n = Int32(-1)
            rows[m] = n

    @cute.jit
    def consumer(self, w: cutlass.Constexpr, qk_mma, pv_mma, pv_mma_ss, sv_layout, sp_layout, wtid,
                 sQ, sK, sP, sM, sL, q_full, full, empty, idx_row, sink_ptr, out_ptr, lse_ptr,
                 t, head0, L, N, n_blocks, scale_log2):
        """Consumer w: S of the blocks 2i + w, O for the value columns
        [256 w, 256 w + 256) of every block."""
        D, dvh, BN, PPR = self.D, self.dv_half, self.BN, self.pairs_per_ring
        o = 1 - w
        lane = wtid % 32
        warp = wtid // 32
        thr_qk = qk_mma.get_slice(wtid)
        thr_pv = pv_mma.get_slice(wtid)
        thr_ss = pv_mma_ss.get_slice(wtid)

        tSrQ = qk_mma.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = qk_mma.make_fragment_B(thr_qk.partition_B(sK))   # (MMA, 1, D / 16, stages)
        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((BLOCK_H, BN)), Float32)
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((BLOCK_H, dvh)), Float32)
        acc_o.fill(0.0)
        r_p = cute.make_rmem_tensor(thr_pv.partition_shape_A((BLOCK_H, BN)), self.dtype)

        # Per pair slot q of the ring: stages 2q (block 2i) and 2q + 1.
        raw = cute.recast_ptr(sK.iterator, None)
        if const_expr(D > self.d_v):
            p_base, p_stride = raw + BN * self.d_v, BN * D  # columns d_v.. of each stage
        else:
            p_base, p_stride = cute.recast_ptr(sP, None), BLOCK_H * BN
        views = []
        for q in cutlass.range_constexpr(PPR):
            own, oth = 2 * q + w, 2 * q + o
            v_own = cute.make_tensor(cute.recast_ptr(raw + (own * BN * D + w * BN * dvh), sv_layout.inner),
                                     sv_layout.outer)
            v_oth = cute.make_tensor(cute.recast_ptr(raw + (oth * BN * D + w * BN * dvh), sv_layout.inner),
                                     sv_layout.outer)
            p_own = cute.make_tensor(cute.recast_ptr(p_base + own * p_stride, sp_layout.inner), sp_layout.outer)
            p_oth = cute.make_tensor(cute.recast_ptr(p_base + oth * p_stride, sp_layout.inner), sp_layout.outer)
            views.append((
                thr_qk.partition_C(p_own),
                pv_mma.make_fragment_B(thr_pv.partition_B(v_own)),
                pv_mma_ss.make_fragment_B(thr_ss.partition_B(v_oth)),
                pv_mma_ss.make_fragment_A(thr_ss.partition_A(p_oth)),
            ))
        m_own = cute.make_tensor(sM + w * BLOCK_H, cute.make_layout((BLOCK_H,)))
        m_oth = cute.make_tensor(sM + o * BLOCK_H, cute.make_layout((BLOCK_H,)))

        row_lo = warp * 16 + lane // 4
        col_lane = 2 * (lane % 4)
        m_run = cute.make_rmem_tensor((2,), Float32)
        l_run = cute.make_rmem_tensor((2,), Float32)
        m_run.fill(-Float32.inf)
        l_run.fill(0.0)

        cute.arch.mbarrier_wait(q_full, 0)
        # A plain tuple: the DSL threads it through the loops unchanged.
        cs = (qk_mma, pv_mma, pv_mma_ss, tSrQ, tSrK, m_own, m_oth, acc_s, acc_o, r_p, m_run, l_run,
              full, empty, idx_row, L, N, row_lo, col_lane, lane, scale_log2)
        n_pairs = n_blocks // 2
        n_rings = n_pairs // PPR
        for it in cutlass.range(n_rings, unroll=1):
            for q in cutlass.range_constexpr(PPR):
                self.pair(w, q, it * PPR + q, True, True, views[q], cs)
        # Pairs left over after the last full turn of the ring, then a last
        # block of its own (consumer 0's S, the first stage of its pair slot).
        rest = n_pairs - n_rings * PPR
        for q in cutlass.range_constexpr(PPR - 1):
            if q < rest:
                self.pair(w, q, n_rings * PPR + q, True, True, views[q], cs)
        if n_blocks % 2 == 1:
            for q in cutlass.range_constexpr(PPR):
                if q == rest:
                    self.pair(w, q, n_pairs, w == 0, w == 1, views[q], cs)

        # Row sums over the 4 threads of a row, then over both consumers.
        l_own = cute.make_tensor(sL + w * BLOCK_H, cute.make_layout((BLOCK_H,)))
        l_oth = cute.make_tensor(sL + o * BLOCK_H, cute.make_layout((BLOCK_H,)))
        for r in cutlass.range_constexpr(2):
            l = l_run[r]
            l = l + cute.arch.shuffle_sync_bfly(l, 1)
            l = l + cute.arch.shuffle_sync_bfly(l, 2)
            l_run[r] = l
            if lane % 4 == 0:
                l_own[row_lo + 8 * r] = l
        cute.arch.barrier(barrier_id=Barrier.ROW_SUMS, number_of_threads=CONSUMER_THREADS)
        for r in cutlass.range_constexpr(2):
            l_run[r] = l_run[r] + l_oth[row_lo + 8 * r]
        self.epilogue(acc_o, m_run, l_run, w, lane, row_lo, col_lane, sink_ptr, out_ptr, lse_ptr, t, head0)

    @cute.jit
    def pair(self, w: cutlass.Constexpr, q: cutlass.Constexpr, i, has_own: cutlass.Constexpr,
             has_oth: cutlass.Constexpr, views, cs):
        """Pair i (blocks 2i and 2i + 1, in stages 2q and 2q + 1) for
        consumer w: S of its own block when that exists, then O += P V over
        the blocks that exist."""
        D, BN = self.D, self.BN
        # cs: the consumer's state, as built in consumer(): MMA objects and
        # operand views, the max-swap buffers, accumulators, softmax state
        # (rmem tensors updated in place) and the row's limits.
        (qk_mma, pv_mma, pv_mma_ss, tSrQ, tSrK, m_own, m_oth, acc_s, acc_o, r_p, m_run, l_run,
         full, empty, idx_row, L, N, row_lo, col_lane, lane, scale_log2) = cs
        own = 2 * q + w
        b = 2 * i + w
        phase = (i // self.pairs_per_ring) % 2
        tPs_own, tOrV_own, tOrV_oth, tOrP_oth = views
        NS = cute.size(acc_s)
        NO = cute.size(acc_o)
        if const_expr(has_own):
            cute.arch.mbarrier_wait(full + own, phase)
            acc_s.fill(0.0)
            warpgroup.fence()
            for k in cutlass.range_constexpr(D // 16):
                cute.gemm(qk_mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k, own], acc_s)
            warpgroup.commit_group()
            # Validity of this thread's columns, while the wgmma runs.
            # Accumulator element 4j + 2r + e sits at row row_lo + 8r,
            # column 8j + col_lane + e.
            valid = cute.make_rmem_tensor((NS // 4, 2), cutlass.Boolean)
            for j in cutlass.range_constexpr(NS // 4):
                for e in cutlass.range_constexpr(2):
                    slot = b * BN + 8 * j + col_lane + e
                    ok = slot < L
                    if ok:
                        n = _load(idx_row, Int64(slot))
                        ok = n >= 0 and n < N
                    valid[j, e] = ok
            warpgroup.wait_group(0)
            for j in cutlass.range_constexpr(NS // 4):
                for r in cutlass.range_constexpr(2):
                    for e in cutlass.range_constexpr(2):
                        v = acc_s[4 * j + 2 * r + e] * scale_log2
                        if not valid[j, e]:
                            v = -Float32.inf
                        acc_s[4 * j + 2 * r + e] = v
        else:
            acc_s.fill(-Float32.inf)

        # Row maxima of this block, swapped with the other consumer.
        mx = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            v = -Float32.inf
            for j in cutlass.range_constexpr(NS // 4):
                for e in cutlass.range_constexpr(2):
                    v = cute.arch.fmax(v, acc_s[4 * j + 2 * r + e])
            v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, 1))
            v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, 2))
            mx[r] = v
            if lane % 4 == 0:
                m_own[row_lo + 8 * r] = v
        cute.arch.barrier(barrier_id=Barrier.MAX_SWAP, number_of_threads=CONSUMER_THREADS)
        alpha = cute.make_rmem_tensor((2,), Float32)
        m_use = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            mn = cute.arch.fmax(m_run[r], cute.arch.fmax(mx[r], m_oth[row_lo + 8 * r]))
            # A row that has seen no valid slot keeps m = -inf; shift by 0
            # there so that no (-inf) - (-inf) appears.
            mu = mn
            if mn == -Float32.inf:
                mu = Float32(0.0)
            alpha[r] = cute.math.exp2(m_run[r] - mu, fastmath=True)
            m_use[r] = mu
            m_run[r] = mn
        for r in cutlass.range_constexpr(2):
            rs = Float32(0.0)
            for j in cutlass.range_constexpr(NS // 4):
                for e in cutlass.range_constexpr(2):
                    i_ = 4 * j + 2 * r + e
                    p = cute.math.exp2(acc_s[i_] - m_use[r], fastmath=True)
                    acc_s[i_] = p
                    rs = rs + p
            l_run[r] = l_run[r] * alpha[r] + rs
        # The fp32 accumulator of Q K^T and the 16-bit A operand of P V
        # share their per-thread element order.
        for i_ in cutlass.range_constexpr(NS):
            r_p[i_] = acc_s[i_].to(self.dtype)
        if const_expr(has_own):
            # Column pairs are adjacent in the swizzled tile: 32-bit stores.
            cute.autovec_copy(cute.make_tensor(r_p.iterator, acc_s.layout), tPs_own)
            # P is read by the other consumer's wgmma (the async proxy).
            cute.arch.fence_view_async_shared()
        for i_ in cutlass.range(NO, unroll_full=True):
            acc_o[i_] = acc_o[i_] * alpha[(i_ // 2) % 2]
        cute.arch.barrier(barrier_id=Barrier.P_READY, number_of_threads=CONSUMER_THREADS)

        # Stage 2q first (consumer 0's own block, consumer 1's other one),
        # released as soon as its group retires.
        warpgroup.fence()
        if const_expr(w == 0):
            self.pv(has_own, pv_mma, acc_o, r_p, tOrV_own)
            warpgroup.commit_group()
            self.pv(has_oth, pv_mma_ss, acc_o, tOrP_oth, tOrV_oth)
        else:
            self.pv(has_oth, pv_mma_ss, acc_o, tOrP_oth, tOrV_oth)
            warpgroup.commit_group()
            self.pv(has_own, pv_mma, acc_o, r_p, tOrV_own)
        warpgroup.commit_group()
        warpgroup.wait_group(1)
        if const_expr(has_own if w == 0 else has_oth):
            cute.arch.mbarrier_arrive(empty + 2 * q)
        warpgroup.wait_group(0)
        if const_expr(has_oth if w == 0 else has_own):
            cute.arch.mbarrier_arrive(empty + 2 * q + 1)

    @cute.jit
    def pv(self, has: cutlass.Constexpr, mma, acc_o, tOrP, tOrV):
        """O += P V over one block (P from registers or shared memory)."""
        if const_expr(has):
            for k in cutlass.range_constexpr(self.BN // 16):
                cute.gemm(mma, acc_o, tOrP[None, None, k], tOrV[None, None, k], acc_o)

    @cute.jit
    def epilogue(self, acc_o, m_run, l_run, half, lane, row_lo, col_lane, sink_ptr, out_ptr, lse_ptr,
                 t, head0):
        """out = O / (l + exp(sink)) for this consumer's column half; lse
        (+inf on a row with no valid slot) from consumer 0.  m_run is the
        running maximum (log2 domain), l_run the whole row sum."""
        dvh = self.dv_half
        NO = cute.size(acc_o)
        inv = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            mu = m_run[r]
            if mu == -Float32.inf:
                mu = Float32(0.0)
            m_run[r] = mu
            den = l_run[r]
            if const_expr(self.has_sink):
                # sink * log2(e) overflows to +inf for sinks above ~2.4e38:
                # the sink then takes all the probability and out is 0.
                sk = _load(sink_ptr, Int64(head0 + row_lo + 8 * r)) * LOG2E
                den = den + cute.math.exp2(sk - mu, fastmath=False)
            iv = Float32(0.0)
            if den != 0.0:
                iv = 1.0 / den
            inv[r] = iv

        out_base = out_ptr + (Int64(t) * Int64(self.H) + Int64(head0)) * Int64(self.d_v) + half * dvh
        for j in cutlass.range_constexpr(NO // 4):
            for r in cutlass.range_constexpr(2):
                row = row_lo + 8 * r
                col = 8 * j + col_lane
                p = out_base + Int64(row) * Int64(self.d_v) + col
                o = cute.make_tensor(p, cute.make_layout((2,)))
                o[0] = (acc_o[4 * j + 2 * r] * inv[r]).to(self.dtype)
                o[1] = (acc_o[4 * j + 2 * r + 1] * inv[r]).to(self.dtype)

        if half == 0 and lane % 4 == 0:
            for r in cutlass.range_constexpr(2):
                lse = Float32.inf
                if l_run[r] != 0.0:
                    lse = (m_run[r] + cute.math.log2(l_run[r], fastmath=False)) * LN2
                pl = cute.make_tensor(lse_ptr + (Int64(t) * Int64(self.H) + Int64(head0 + row_lo + 8 * r)),
                                      cute.make_layout((1,)))
                pl[0] = lse


@cute.jit
def _aligned(dtype, addr: Int64) -> cute.Pointer:
    # Row starts are 16-byte aligned (D % 64 == 0, 16-byte aligned bases).
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=16)


@cute.jit
def _load(ptr: cute.Pointer, off: Int64):
    """ptr[off], one element of global memory."""
    return cute.make_tensor(ptr + off, cute.make_layout((1,)))[0]
