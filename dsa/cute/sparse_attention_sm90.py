"""Sparse attention forward for Hopper (SM90) in CuTe DSL.

One CTA per (token t, kv head g, block of 64 query heads), three warpgroups:

* warpgroup 0, the producer, gathers the 64 kv rows of each slot block with
  cp.async into a swizzled two-stage shared-memory ring (TMA cannot gather
  rows on SM90). A slot that is not valid is filled from a row of zeros, so
  NaN or Inf stored in kv rows that no valid slot names is never read.
  Completion is signalled per stage with ``cp.async.mbarrier.arrive``.
* warpgroups 1 and 2, the consumers, each compute S = Q K^T for the whole
  [64 heads, 64 slots] block with wgmma (both operands in shared memory),
  mask invalid slots, run the online softmax in the log2 domain and
  accumulate O += P V with P in registers, each over its own half of the
  512-wide V (so a thread holds a [64, 256] fp32 accumulator slice).
  The consumers release a stage once both of their wgmma groups that read
  it have retired.

The loop stops after the last block holding a valid slot (topk_length), so a
row of length L costs about L / K of a full row.  The kernel is compiled per
(dtype, D, d_v, H, G, topk_length?, sink?) and cached.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

BLOCK_H = 64   # query heads per CTA: the M of one wgmma
BLOCK_N = 64   # slots per pipeline stage
STAGES = 2
THREADS = 384  # producer + two consumer warpgroups
PRODUCER_REGS = 40
CONSUMER_REGS = 232


class SparseAttnFwdSm90:
    """Host-side builder of the kernel for one static configuration."""

    def __init__(self, dtype, D: int, d_v: int, H: int, G: int, has_len: bool, has_sink: bool,
                 split: bool = True, early_release: bool = True):
        if D % 64 or d_v != 512 or (H // G) % BLOCK_H:
            raise ValueError("SparseAttnFwdSm90 needs D % 64 == 0, d_v == 512, (H / G) % 64 == 0")
        self.dtype = dtype
        self.D, self.d_v, self.H, self.G = D, d_v, H, G
        self.HG = H // G
        self.dv_half = d_v // 2
        self.has_len, self.has_sink = has_len, has_sink
        # split: the two consumers take alternate slot blocks for S = Q K^T
        # and exchange row maxima and P through shared memory (no S computed
        # twice); otherwise both compute S of every block.
        self.split = split
        self.early_release = early_release

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        sink_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, zero_ptr: cute.Pointer,
        T: Int32, N: Int32, K: Int32, scale_log2: Float32, stream,
    ):
        dt = self.dtype
        qk_mma = cute.make_tiled_mma(cute.make_mma_atom(warpgroup.MmaF16BF16Op(
            dt, Float32, (BLOCK_H, BLOCK_N, 16), warpgroup.OperandSource.SMEM,
            warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K)), (1, 1, 1))
        pv_mma = cute.make_tiled_mma(cute.make_mma_atom(warpgroup.MmaF16BF16Op(
            dt, Float32, (BLOCK_H, self.dv_half, 16), warpgroup.OperandSource.RMEM,
            warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN)), (1, 1, 1))
        # O += P V with the other consumer's P, read from shared memory.
        pv_mma_ss = cute.make_tiled_mma(cute.make_mma_atom(warpgroup.MmaF16BF16Op(
            dt, Float32, (BLOCK_H, self.dv_half, 16), warpgroup.OperandSource.SMEM,
            warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN)), (1, 1, 1))

        # Q: [64 heads, D] and K: [64 slots, D] per stage, K-major 128B-swizzled
        # atoms of 8 rows x 64 columns, rows first.  The V operand of P V is
        # the same bytes read MN-major: the atom of 64 columns x 8 slots with
        # the columns contiguous is byte-for-byte the K-major atom, and tiling
        # slots first keeps the atom order.
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dt)
        mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, dt)
        sq_layout = cute.tile_to_shape(k_atom, (BLOCK_H, self.D), order=(0, 1))
        sk_layout = cute.tile_to_shape(k_atom, (BLOCK_N, self.D, STAGES), order=(0, 1, 2))
        sv_layout = cute.tile_to_shape(mn_atom, (self.dv_half, BLOCK_N), order=(1, 0))
        # P [64 heads, 64 slots] as a K-major A operand: 8 contiguous atoms,
        # the same shape as the columns 512..575 of a K stage, which the split
        # consumers reuse for P once S of that stage is computed (for D = 576;
        # D = 512 has a buffer of its own).
        sp_layout = cute.tile_to_shape(k_atom, (BLOCK_H, BLOCK_N), order=(0, 1))
        p_elems = 0 if self.D > self.d_v else STAGES * BLOCK_H * BLOCK_N

        @cute.struct
        class Smem:
            q_full: cute.struct.MemRange[Int64, 1]
            full: cute.struct.MemRange[Int64, STAGES]
            empty: cute.struct.MemRange[Int64, STAGES]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sq_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sk_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[dt, max(p_elems, 8)], 1024]
            sM: cute.struct.MemRange[Float32, STAGES * BLOCK_H]
            sL: cute.struct.MemRange[Float32, STAGES * BLOCK_H]

        self.smem = Smem
        grid_x = T * self.G
        self.kernel(
            qk_mma, pv_mma, pv_mma_ss, sq_layout, sk_layout, sv_layout, sp_layout,
            q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr, zero_ptr,
            N, K, scale_log2,
        ).launch(grid=[grid_x, self.HG // BLOCK_H, 1], block=[THREADS, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

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
        D, G, H, HG = self.D, self.G, self.H, self.HG
        tidx, _, _ = cute.arch.thread_idx()
        pid, hblk, _ = cute.arch.block_idx()
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
            for s in cutlass.range_constexpr(STAGES):
                cute.arch.mbarrier_init(full + s, 128)
                cute.arch.mbarrier_init(empty + s, 256)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # Slots [0, L) may be valid; the loops stop at the block holding L - 1.
        L = K
        if const_expr(self.has_len):
            L = _load_i32(len_ptr, Int64(t))
            L = cutlass.max(Int32(0), cutlass.min(L, K))
        n_blocks = (L + BLOCK_N - 1) // BLOCK_N
        idx_row = idx_ptr + Int64(pid) * Int64(K)

        if const_expr(self.split):
            # The split consumers zero their accumulators by hand: the MMA
            # objects are shared by both code paths and never change inside.
            for mma in (qk_mma, pv_mma, pv_mma_ss):
                mma.set(warpgroup.Field.ACCUMULATE, True)
        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.producer(tidx, sQ, sK, q_full, full, empty, q_ptr, kv_ptr, idx_row, zero_ptr,
                          t, g, head0, L, N, n_blocks)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            if const_expr(not self.split):
                self.consumer(qk_mma, pv_mma, sv_layout, tidx - 128, wg - 1, sQ, sK, q_full, full, empty,
                              idx_row, sink_ptr, out_ptr, lse_ptr, t, head0, L, N, n_blocks, scale_log2)
            else:
                sP = st.sP.data_ptr()
                sM = st.sM.data_ptr()
                sL = st.sL.data_ptr()
                args = (qk_mma, pv_mma, pv_mma_ss, sv_layout, sp_layout, tidx % 128, sQ, sK, sP, sM, sL,
                        q_full, full, empty, idx_row, sink_ptr, out_ptr, lse_ptr, t, head0, L, N,
                        n_blocks, scale_log2)
                # One code path per consumer, with its stage and V half static.
                if wg == 1:
                    self.consumer_split(0, *args)
                else:
                    self.consumer_split(1, *args)

    @cute.jit
    def producer(self, tidx, sQ, sK, q_full, full, empty, q_ptr, kv_ptr, idx_row, zero_ptr,
                 t, g, head0, L, N, n_blocks):
        D, G = self.D, self.G
        # 8 threads per row, 16 B (8 elements) each per copy: a row's 128-byte
        # segments go out as full sectors; 16 rows per pass.
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.dtype, num_bits_per_copy=128)
        tiled = cute.make_tiled_copy_tv(atom, cute.make_ordered_layout((16, 8), order=(1, 0)),
                                        cute.make_layout((1, 8)))
        thr = tiled.get_slice(tidx)
        row_in_pass = tidx // 8
        col0 = (tidx % 8) * 8
        ROWS = BLOCK_N // 16
        CHUNKS = D // 64
        ES = self.dtype.width // 8

        # Q tile: heads head0 .. head0 + 63 of token t.
        tQs = thr.partition_D(sQ)  # (8, ROWS, CHUNKS)
        for m in cutlass.range_constexpr(ROWS):
            row = head0 + row_in_pass + m * 16
            addr = q_ptr.toint() + (Int64(t) * Int64(self.H) + Int64(row)) * Int64(D * ES) + col0 * ES
            for c in cutlass.range_constexpr(CHUNKS):
                src = cute.make_tensor(_aligned(self.dtype, addr + c * 64 * ES), cute.make_layout((8,)))
                cute.copy(atom, src, tQs[None, m, c])
        cute.arch.cp_async_mbarrier_arrive_noinc(q_full)

        # The next block's kv rows are looked up while this block's copies fly.
        rows = cute.make_rmem_tensor((ROWS,), Int32)
        self.lookup(rows, 0, idx_row, L, N, row_in_pass)
        for b in cutlass.range(n_blocks, unroll=1):
            s = b % STAGES
            use = b // STAGES
            if b >= STAGES:
                cute.arch.mbarrier_wait(empty + s, (use - 1) % 2)
            tKs = thr.partition_D(sK[None, None, s])
            for m in cutlass.range_constexpr(ROWS):
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
        """rows[m]: the kv row of slot b * 64 + row_in_pass + 16 m, or -1 if
        that slot is not valid."""
        for m in cutlass.range_constexpr(BLOCK_N // 16):
            slot = b * BLOCK_N + row_in_pass + m * 16
            n = Int32(-1)
            if slot < L:
                n = _load_i32(idx_row, Int64(slot))
                if n < 0 or n >= N:
                    n = Int32(-1)
            rows[m] = n

    @cute.jit
    def consumer(self, qk_mma, pv_mma, sv_layout, ctid, half, sQ, sK, q_full, full, empty,
                 idx_row, sink_ptr, out_ptr, lse_ptr, t, head0, L, N, n_blocks, scale_log2):
        D, dvh = self.D, self.dv_half
        wtid = ctid % 128
        lane = wtid % 32
        warp = wtid // 32
        thr_qk = qk_mma.get_slice(wtid)
        thr_pv = pv_mma.get_slice(wtid)

        tSrQ = qk_mma.make_fragment_A(thr_qk.partition_A(sQ))   # (MMA, 1, D/16)
        tSrK = qk_mma.make_fragment_B(thr_qk.partition_B(sK))   # (MMA, 1, D/16, STAGES)
        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((BLOCK_H, BLOCK_N)), Float32)
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((BLOCK_H, dvh)), Float32)
        acc_o.fill(0.0)
        r_p = cute.make_rmem_tensor(thr_pv.partition_shape_A((BLOCK_H, BLOCK_N)), self.dtype)

        # The V half of this warpgroup in each stage: columns [half * 256, +256).
        sk_base = sK.iterator
        tOrV = []
        for s in cutlass.range_constexpr(STAGES):
            v_ptr = cute.recast_ptr(
                cute.recast_ptr(sk_base, None) + (s * BLOCK_N * D) + half * (BLOCK_N * dvh),
                sv_layout.inner)
            sV = cute.make_tensor(v_ptr, sv_layout.outer)
            tOrV.append(pv_mma.make_fragment_B(thr_pv.partition_B(sV)))

        # Accumulator layout of m64nNk16: element i of a thread sits at row
        # warp * 16 + lane / 4 + 8 * ((i / 2) % 2), column 8 * (i / 4) + 2 * (lane % 4) + i % 2.
        row_lo = warp * 16 + lane // 4
        col_lane = 2 * (lane % 4)
        m_run = cute.make_rmem_tensor((2,), Float32)
        l_run = cute.make_rmem_tensor((2,), Float32)
        m_run.fill(-Float32.inf)
        l_run.fill(0.0)

        cute.arch.mbarrier_wait(q_full, 0)
        NS = cute.size(acc_s)
        NO = cute.size(acc_o)
        for b in cutlass.range(n_blocks, unroll=1):
            s = b % STAGES
            cute.arch.mbarrier_wait(full + s, (b // STAGES) % 2)
            warpgroup.fence()
            for k in cutlass.range_constexpr(D // 16):
                qk_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                cute.gemm(qk_mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k, s], acc_s)
            warpgroup.commit_group()

            # Validity of this thread's 16 columns, while the wgmma runs.
            valid = cute.make_rmem_tensor((NS // 4, 2), cutlass.Boolean)
            for j in cutlass.range_constexpr(NS // 4):
                for e in cutlass.range_constexpr(2):
                    slot = b * BLOCK_N + 8 * j + col_lane + e
                    ok = slot < L
                    if ok:
                        n = _load_i32(idx_row, Int64(slot))
                        ok = n >= 0 and n < N
                    valid[j, e] = ok
            warpgroup.wait_group(0)

            alpha = cute.make_rmem_tensor((2,), Float32)
            m_use = cute.make_rmem_tensor((2,), Float32)
            for r in cutlass.range_constexpr(2):
                mx = m_run[r]
                for j in cutlass.range_constexpr(NS // 4):
                    for e in cutlass.range_constexpr(2):
                        i = 4 * j + 2 * r + e
                        v = acc_s[i] * scale_log2
                        if not valid[j, e]:
                            v = -Float32.inf
                        acc_s[i] = v
                        mx = cute.arch.fmax(mx, v)
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 1))
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 2))
                # A row that has seen no valid slot keeps m = -inf; shift by 0
                # there so that no (-inf) - (-inf) appears.
                mu = mx
                if mx == -Float32.inf:
                    mu = Float32(0.0)
                alpha[r] = cute.math.exp2(m_run[r] - mu, fastmath=True)
                m_use[r] = mu
                m_run[r] = mx
            for r in cutlass.range_constexpr(2):
                rs = Float32(0.0)
                for j in cutlass.range_constexpr(NS // 4):
                    for e in cutlass.range_constexpr(2):
                        i = 4 * j + 2 * r + e
                        p = cute.math.exp2(acc_s[i] - m_use[r], fastmath=True)
                        acc_s[i] = p
                        rs = rs + p
                l_run[r] = l_run[r] * alpha[r] + rs
            for i in cutlass.range_constexpr(NO):
                acc_o[i] = acc_o[i] * alpha[(i // 2) % 2]
            # The fp32 accumulator of QK^T and the 16-bit A operand of P V
            # share their per-thread element order.
            for i in cutlass.range_constexpr(NS):
                r_p[i] = acc_s[i].to(self.dtype)

            warpgroup.fence()
            for k in cutlass.range_constexpr(BLOCK_N // 16):
                pv_mma.set(warpgroup.Field.ACCUMULATE, True)
                if s == 0:
                    cute.gemm(pv_mma, acc_o, r_p[None, None, k], tOrV[0][None, None, k], acc_o)
                else:
                    cute.gemm(pv_mma, acc_o, r_p[None, None, k], tOrV[1][None, None, k], acc_o)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            cute.arch.mbarrier_arrive(empty + s)

        # Epilogue: the row sums are spread over the 4 threads of a row.
        for r in cutlass.range_constexpr(2):
            l = l_run[r]
            l = l + cute.arch.shuffle_sync_bfly(l, 1)
            l = l + cute.arch.shuffle_sync_bfly(l, 2)
            l_run[r] = l
        self.epilogue(acc_o, m_run, l_run, half, lane, row_lo, col_lane, sink_ptr, out_ptr, lse_ptr, t, head0)

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
                sk = _load_f32(sink_ptr, Int64(head0 + row_lo + 8 * r)) * LOG2E
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
    def consumer_split(self, w: cutlass.Constexpr, qk_mma, pv_mma, pv_mma_ss, sv_layout, sp_layout, wtid,
                       sQ, sK, sP, sM, sL, q_full, full, empty, idx_row, sink_ptr, out_ptr, lse_ptr,
                       t, head0, L, N, n_blocks, scale_log2):
        """Consumer w of the split scheme: S of the blocks 2i + w, O for the
        columns [256 w, 256 w + 256) of every block."""
        D, dvh = self.D, self.dv_half
        o = 1 - w  # the other consumer, and the stage it computes S of
        lane = wtid % 32
        warp = wtid // 32
        thr_qk = qk_mma.get_slice(wtid)
        thr_pv = pv_mma.get_slice(wtid)
        thr_ss = pv_mma_ss.get_slice(wtid)

        tSrQ = qk_mma.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = qk_mma.make_fragment_B(thr_qk.partition_B(sK))   # (MMA, 1, D/16, STAGES)
        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((BLOCK_H, BLOCK_N)), Float32)
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((BLOCK_H, dvh)), Float32)
        acc_o.fill(0.0)
        r_p = cute.make_rmem_tensor(thr_pv.partition_shape_A((BLOCK_H, BLOCK_N)), self.dtype)

        raw = cute.recast_ptr(sK.iterator, None)
        v_own = cute.make_tensor(cute.recast_ptr(raw + (w * BLOCK_N * D + w * BLOCK_N * dvh), sv_layout.inner),
                                 sv_layout.outer)
        v_oth = cute.make_tensor(cute.recast_ptr(raw + (o * BLOCK_N * D + w * BLOCK_N * dvh), sv_layout.inner),
                                 sv_layout.outer)
        if const_expr(D > self.d_v):
            p_base = raw + BLOCK_N * self.d_v  # columns d_v.. of stage 0
            p_stride = BLOCK_N * D
        else:
            p_base = cute.recast_ptr(sP, None)
            p_stride = BLOCK_H * BLOCK_N
        p_own = cute.make_tensor(cute.recast_ptr(p_base + w * p_stride, sp_layout.inner), sp_layout.outer)
        p_oth = cute.make_tensor(cute.recast_ptr(p_base + o * p_stride, sp_layout.inner), sp_layout.outer)
        tPs_own = thr_qk.partition_C(p_own)
        tOrV_own = pv_mma.make_fragment_B(thr_pv.partition_B(v_own))
        tOrV_oth = pv_mma_ss.make_fragment_B(thr_ss.partition_B(v_oth))
        tOrP_oth = pv_mma_ss.make_fragment_A(thr_ss.partition_A(p_oth))
        m_own = cute.make_tensor(sM + w * BLOCK_H, cute.make_layout((BLOCK_H,)))
        m_oth = cute.make_tensor(sM + o * BLOCK_H, cute.make_layout((BLOCK_H,)))

        row_lo = warp * 16 + lane // 4
        col_lane = 2 * (lane % 4)
        m_run = cute.make_rmem_tensor((2,), Float32)
        l_run = cute.make_rmem_tensor((2,), Float32)
        m_run.fill(-Float32.inf)
        l_run.fill(0.0)
        NS = cute.size(acc_s)
        NO = cute.size(acc_o)

        cute.arch.mbarrier_wait(q_full, 0)
        ctx = (qk_mma, pv_mma, pv_mma_ss, tSrQ, tSrK, tPs_own, tOrV_own, tOrV_oth, tOrP_oth, m_own, m_oth,
               acc_s, acc_o, r_p, m_run, l_run, full, empty, idx_row, L, N, row_lo, col_lane, lane, scale_log2)
        n_pairs = n_blocks // 2
        for i in cutlass.range(n_pairs, unroll=1):
            self.pair(w, i, True, True, *ctx)
        if n_blocks % 2 == 1:  # a last block of its own: stage 0, consumer 0's S
            self.pair(w, n_pairs, w == 0, w == 1, *ctx)

        # Epilogue: row sums over the 4 threads of a row, then over both consumers.
        l_own = cute.make_tensor(sL + w * BLOCK_H, cute.make_layout((BLOCK_H,)))
        l_oth = cute.make_tensor(sL + o * BLOCK_H, cute.make_layout((BLOCK_H,)))
        for r in cutlass.range_constexpr(2):
            l = l_run[r]
            l = l + cute.arch.shuffle_sync_bfly(l, 1)
            l = l + cute.arch.shuffle_sync_bfly(l, 2)
            l_run[r] = l
            if lane % 4 == 0:
                l_own[row_lo + 8 * r] = l
        cute.arch.barrier(barrier_id=3, number_of_threads=256)
        for r in cutlass.range_constexpr(2):
            l_run[r] = l_run[r] + l_oth[row_lo + 8 * r]
        self.epilogue(acc_o, m_run, l_run, w, lane, row_lo, col_lane, sink_ptr, out_ptr, lse_ptr, t, head0)

    @cute.jit
    def pair(self, w: cutlass.Constexpr, i, has_own: cutlass.Constexpr, has_oth: cutlass.Constexpr,
             qk_mma, pv_mma, pv_mma_ss, tSrQ, tSrK, tPs_own, tOrV_own, tOrV_oth, tOrP_oth, m_own, m_oth,
             acc_s, acc_o, r_p, m_run, l_run, full, empty, idx_row, L, N, row_lo, col_lane, lane, scale_log2):
        """Blocks 2i (stage 0) and 2i + 1 (stage 1) for consumer w: S of its
        own block when it exists, then O += P V over the blocks that exist."""
        D = self.D
        o = 1 - w
        b = 2 * i + w
        NS = cute.size(acc_s)
        NO = cute.size(acc_o)
        if const_expr(has_own):
            cute.arch.mbarrier_wait(full + w, i % 2)
            acc_s.fill(0.0)
            warpgroup.fence()
            for k in cutlass.range_constexpr(D // 16):
                cute.gemm(qk_mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k, w], acc_s)
            warpgroup.commit_group()
            valid = cute.make_rmem_tensor((NS // 4, 2), cutlass.Boolean)
            for j in cutlass.range_constexpr(NS // 4):
                for e in cutlass.range_constexpr(2):
                    slot = b * BLOCK_N + 8 * j + col_lane + e
                    ok = slot < L
                    if ok:
                        n = _load_i32(idx_row, Int64(slot))
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

        # Row maxima of this block, exchanged with the other consumer so
        # that both scale O and P by the same running maximum.
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
        cute.arch.barrier(barrier_id=1, number_of_threads=256)
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
        for i_ in cutlass.range_constexpr(NS):
            r_p[i_] = acc_s[i_].to(self.dtype)
        if const_expr(has_own):
            for i_ in cutlass.range_constexpr(NS):
                tPs_own[i_] = r_p[i_]
            # P is read by the other consumer's wgmma (the async proxy).
            cute.arch.fence_view_async_shared()
        for i_ in cutlass.range(NO, unroll_full=True):
            acc_o[i_] = acc_o[i_] * alpha[(i_ // 2) % 2]
        cute.arch.barrier(barrier_id=2, number_of_threads=256)

        warpgroup.fence()
        if const_expr(self.early_release):
            # Both consumers read stage 0 first and release it as soon as
            # that wgmma group retires, so the producer refills it while the
            # stage-1 group runs.
            if const_expr(w == 0):
                self.pv_own(has_own, pv_mma, acc_o, r_p, tOrV_own)
                warpgroup.commit_group()
                self.pv_oth(has_oth, pv_mma_ss, acc_o, tOrP_oth, tOrV_oth)
                warpgroup.commit_group()
                warpgroup.wait_group(1)
                if const_expr(has_own):
                    cute.arch.mbarrier_arrive(empty + 0)
                warpgroup.wait_group(0)
                if const_expr(has_oth):
                    cute.arch.mbarrier_arrive(empty + 1)
            else:
                self.pv_oth(has_oth, pv_mma_ss, acc_o, tOrP_oth, tOrV_oth)
                warpgroup.commit_group()
                self.pv_own(has_own, pv_mma, acc_o, r_p, tOrV_own)
                warpgroup.commit_group()
                warpgroup.wait_group(1)
                if const_expr(has_oth):
                    cute.arch.mbarrier_arrive(empty + 0)
                warpgroup.wait_group(0)
                if const_expr(has_own):
                    cute.arch.mbarrier_arrive(empty + 1)
        else:
            self.pv_own(has_own, pv_mma, acc_o, r_p, tOrV_own)
            self.pv_oth(has_oth, pv_mma_ss, acc_o, tOrP_oth, tOrV_oth)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            if const_expr(has_own):
                cute.arch.mbarrier_arrive(empty + w)
            if const_expr(has_oth):
                cute.arch.mbarrier_arrive(empty + o)

    @cute.jit
    def pv_own(self, has: cutlass.Constexpr, pv_mma, acc_o, r_p, tOrV):
        """O += P V for this consumer's own block, P from registers."""
        if const_expr(has):
            for k in cutlass.range_constexpr(BLOCK_N // 16):
                cute.gemm(pv_mma, acc_o, r_p[None, None, k], tOrV[None, None, k], acc_o)

    @cute.jit
    def pv_oth(self, has: cutlass.Constexpr, pv_mma_ss, acc_o, tOrP, tOrV):
        """O += P V for the other consumer's block, P from shared memory."""
        if const_expr(has):
            for k in cutlass.range_constexpr(BLOCK_N // 16):
                cute.gemm(pv_mma_ss, acc_o, tOrP[None, None, k], tOrV[None, None, k], acc_o)

@cute.jit
def _aligned(dtype, addr: Int64) -> cute.Pointer:
    # Row starts are 16-byte aligned (D % 64 == 0, 16-byte aligned bases).
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=16)


@cute.jit
def _load_i32(ptr: cute.Pointer, off: Int64) -> Int32:
    return cute.make_tensor(ptr + off, cute.make_layout((1,)))[0]


@cute.jit
def _load_f32(ptr: cute.Pointer, off: Int64) -> Float32:
    return cute.make_tensor(ptr + off, cute.make_layout((1,)))[0]
