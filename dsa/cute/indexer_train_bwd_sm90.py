"""The sparse indexer's backward for Hopper (SM90) in CuTe DSL: the KL loss's and the logits'.

With g_j the gradient of logit j (KL: softmax_j * S - target_j from the
forward's lse and S; logits: dlogits[t, j]; 0 on an invalid slot),

    G[j, h]        = g_j * sm_scale * weights[t, h] * [s[j, h] > 0]
    dq[t]          = G^T K_slots                      [H, D]
    dweights[t, h] = sm_scale * sum_j g_j * relu(s[j, h])
    dk[idx_j]     += (G q[t])[j]                      fp32 atomics

(the KL loss's 1/R * dloss scale, a device scalar, multiplies dq, dk and
dweights).  The CTA is the forward's (``indexer_train_sm90``): one per query
row, the producer gathering k rows into the ring of stages, two consumers
taking the blocks in turn, one CTA an SM.  A consumer, for its block:

* S^T = K Q^T [64 slots, H] (wgmma), the logits (the forward's head sum),
  g, the dweights sums in registers, and G (bf16 / fp16) into its own
  shared buffer [64 slots, H] (slots' rows, heads contiguous);
* dq += G^T K (the buffer and the stage read MN-major; dq [H, D] fp32 in
  registers for the whole row), after which the stage is released;
* dk of the block, one [64 slots, 64 columns] chunk at a time, G Q_c (Q's
  columns read MN-major), added into dk's fp32 rows with 16-byte vector
  atomics in the accumulator's column order (``dsa.cute.dkv``; the host
  puts the columns back); ``deterministic``, each value rounded first to a
  multiple of its key's quantum (``quanta``, from ``dsa.triton.dk_quanta``),
  which makes every add exact, so dk is the same whatever their order.

After the loop consumer 1 hands its dq and dweights sums to consumer 0
through the ring's shared memory, which adds them in a fixed order and
stores dq and dweights.  Served: H = 64 and D a multiple of 64 up to 128
(dq's accumulator).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup

from dsa.cute import dkv as dk_reduce
from dsa.cute.gmem import load
from dsa.cute.indexer_train_sm90 import BN, CONSUMERS, THREADS, IndexerSm90Config, SparseIndexerSm90, indexer_reason
from dsa.cute.pipeline import NamedBarrier, named_barriers
from dsa.cute.rules import LOG2E

BWD_H = 64
# one CTA an SM (launched with 168 registers a thread): producer + 2 x consumers <= 504
BWD_REGS = (40, 232)


@named_barriers
class BwdBarrier(NamedBarrier):
    """Named barriers of the backward's consumers."""

    G0 = 2     # consumer 0's G is in its buffer (its 128 threads)
    G1 = 3     # consumer 1's
    DONE = 4   # both consumers are past their last block: the ring is free
    SUMS = 5   # consumer 1's dq and dweights sums are in the ring


def bwd_reason(dtype, H: int, D: int) -> str | None:
    """Why the backward cannot be built for (dtype, H, D) (None when it can)."""
    why = indexer_reason(dtype, H, D)
    if why is not None:
        return why
    if H != BWD_H or D > 128:
        return f"H_i = {H}, D_i = {D}: the cute indexer backward takes 64 heads and D_i up to 128"
    return None


class SparseIndexerBwdSm90(SparseIndexerSm90):
    """Host-side builder of the backward kernel for one static configuration."""

    def __init__(self, dtype, w_dtype, H: int, D: int, has_len: bool, kl: bool, stages: int = 4,
                 deterministic: bool = False):
        why = bwd_reason(dtype, H, D)
        if why is not None:
            raise ValueError(f"SparseIndexerBwdSm90: {why}")
        super().__init__(dtype, w_dtype, H, D, has_len, kl, stages)
        self.config = IndexerSm90Config(dtype, w_dtype, H, D, has_len, kl, stages, True, deterministic)
        self.deterministic = deterministic
        self.ctas, self.regs = 1, BWD_REGS

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer, k_ptr: cute.Pointer, w_ptr: cute.Pointer, idx_ptr: cute.Pointer,
        len_ptr: cute.Pointer, gin_ptr: cute.Pointer, stats_ptr: cute.Pointer, scale_ptr: cute.Pointer,
        dq_ptr: cute.Pointer, dk_ptr: cute.Pointer, dw_ptr: cute.Pointer, quanta_ptr: cute.Pointer,
        zero_ptr: cute.Pointer, T: Int32, N: Int32, K: Int32, sm_scale: Float32, stream,
    ):
        dt = self.dtype
        KM = warpgroup.OperandMajorMode.K
        MN = warpgroup.OperandMajorMode.MN
        SM = warpgroup.OperandSource.SMEM

        def mma(m, n, a_major, b_major):
            return cute.make_tiled_mma(cute.make_mma_atom(warpgroup.MmaF16BF16Op(
                dt, Float32, (m, n, 16), SM, a_major, b_major)), (1, 1, 1))

        s_mma = mma(BN, self.H, KM, KM)       # S^T = K Q^T
        dq_mma = mma(self.H, self.D, MN, MN)  # dq += G^T K: G and the stage read MN-major
        dk_mma = mma(BN, 64, KM, MN)          # dk_c = G Q_c: Q's columns read MN-major
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dt)
        mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, dt)
        sq_layout = cute.tile_to_shape(k_atom, (self.H, self.D), order=(0, 1))
        sk_layout = cute.tile_to_shape(k_atom, (BN, self.D, self.stages), order=(0, 1, 2))
        # the same bytes: a stage as [D, 64 slots] (MN-major), G as [H, 64 slots]
        # and as [64 slots, H], a 64-column chunk of Q as [64 columns, H]
        kt_layout = cute.tile_to_shape(mn_atom, (self.D, BN, self.stages), order=(1, 0, 2))
        sg_layout = cute.tile_to_shape(k_atom, (BN, self.H), order=(0, 1))
        gt_layout = cute.tile_to_shape(mn_atom, (self.H, BN), order=(1, 0))
        qc_layout = cute.tile_to_shape(mn_atom, (64, self.H), order=(1, 0))

        @cute.struct
        class Smem:
            q_full: cute.struct.MemRange[Int64, 1]
            full: cute.struct.MemRange[Int64, self.stages]
            empty: cute.struct.MemRange[Int64, self.stages]
            sOk: cute.struct.MemRange[Float32, BN * self.stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sq_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sk_layout)], 1024]
            sG: cute.struct.Align[cute.struct.MemRange[dt, 2 * cute.cosize(sg_layout)], 1024]

        self.smem = Smem
        self.kernel(s_mma, dq_mma, dk_mma, sq_layout, sk_layout, kt_layout, sg_layout, gt_layout, qc_layout,
                    q_ptr, k_ptr, w_ptr, idx_ptr, len_ptr, gin_ptr, stats_ptr, scale_ptr, dq_ptr, dk_ptr, dw_ptr,
                    quanta_ptr, zero_ptr, N, K, sm_scale).launch(grid=[T, 1, 1], block=[THREADS, 1, 1], stream=stream,
                                                     min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self, s_mma: cute.TiledMma, dq_mma: cute.TiledMma, dk_mma: cute.TiledMma,
        sq_layout: cute.ComposedLayout, sk_layout: cute.ComposedLayout, kt_layout: cute.ComposedLayout,
        sg_layout: cute.ComposedLayout, gt_layout: cute.ComposedLayout, qc_layout: cute.ComposedLayout,
        q_ptr: cute.Pointer, k_ptr: cute.Pointer, w_ptr: cute.Pointer, idx_ptr: cute.Pointer,
        len_ptr: cute.Pointer, gin_ptr: cute.Pointer, stats_ptr: cute.Pointer, scale_ptr: cute.Pointer,
        dq_ptr: cute.Pointer, dk_ptr: cute.Pointer, dw_ptr: cute.Pointer, quanta_ptr: cute.Pointer,
        zero_ptr: cute.Pointer, N: Int32, K: Int32, sm_scale: Float32,
    ):
        self.run(sq_layout, sk_layout, q_ptr, k_ptr, idx_ptr, len_ptr, zero_ptr, N, K,
                 ((s_mma, dq_mma, dk_mma), (kt_layout, sg_layout, gt_layout, qc_layout),
                  (w_ptr, gin_ptr, stats_ptr, scale_ptr, dq_ptr, dk_ptr, dw_ptr, quanta_ptr), sm_scale))

    @cute.jit
    def consumers(self, tidx, row, st, sQ, sK, bars, N, K, extra):
        """Warpgroups 1 and 2: the gradients (``consumer_bwd``)."""
        (s_mma, dq_mma, dk_mma), (kt_layout, sg_layout, gt_layout, qc_layout), ptrs, sm_scale = extra
        w_ptr, gin_ptr, stats_ptr, scale_ptr, dq_ptr, dk_ptr, dw_ptr, quanta_ptr = ptrs
        t, L, n_blocks, idx_row = row
        quanta = quanta_ptr if self.deterministic else None
        q_full, full, empty = bars
        for m_ in (s_mma, dq_mma, dk_mma):
            m_.set(warpgroup.Field.ACCUMULATE, True)
        raw_k = cute.recast_ptr(sK.iterator, None)
        raw_g = cute.recast_ptr(st.sG.data_ptr(), None)
        views = (sQ, sK, cute.make_tensor(cute.recast_ptr(raw_k, kt_layout.inner), kt_layout.outer), raw_g,
                 sg_layout, gt_layout, qc_layout)
        args = (s_mma, dq_mma, dk_mma, tidx % 128, views, st.sOk.data_ptr(), q_full, full, empty, w_ptr, idx_row,
                gin_ptr, stats_ptr, scale_ptr, dq_ptr, dk_ptr, dw_ptr, quanta, t, L, n_blocks, N, K, sm_scale)
        if cute.arch.make_warp_uniform(tidx // 128) == 1:
            self.consumer_bwd(0, *args)
        else:
            self.consumer_bwd(1, *args)

    @cute.jit
    def consumer_bwd(self, c: cutlass.Constexpr, s_mma, dq_mma, dk_mma, wtid, views, ok, q_full, full, empty, w_ptr,
                     idx_row, gin_ptr, stats_ptr, scale_ptr, dq_ptr, dk_ptr, dw_ptr, quanta, t, L, n_blocks, N, K,
                     sm_scale):
        """Blocks c, c + 2, ...: S^T, g, G, dq, dk (see the module header);
        then the row's dq and dweights (``finish``).  quanta: the keys' quanta
        (deterministic), else None."""
        sQ, sK, sKt, raw_g, sg_layout, gt_layout, qc_layout = views
        sc = self.scores_setup(s_mma, wtid, sQ, sK, w_ptr, t, sm_scale)
        lane, row_lo, col_lane, thr_s, acc_s, wv, mask = sc[0], sc[1], sc[2], sc[3], sc[4], sc[6], sc[7]
        NS = cute.size(acc_s)
        g_own = raw_g + c * BN * self.H
        sG = cute.make_tensor(cute.recast_ptr(g_own, sg_layout.inner), sg_layout.outer)
        tGs = thr_s.partition_C(sG)
        rG = cute.make_rmem_tensor(acc_s.shape, self.dtype)
        # dq += G^T K over the stage's columns
        thr_q = dq_mma.get_slice(wtid)
        gt = cute.make_tensor(cute.recast_ptr(g_own, gt_layout.inner), gt_layout.outer)
        tQrG = dq_mma.make_fragment_A(thr_q.partition_A(gt))     # (MMA, 1, BN / 16)
        tQrK = dq_mma.make_fragment_B(thr_q.partition_B(sKt))    # (MMA, 1, BN / 16, stages)
        acc_dq = cute.make_rmem_tensor(thr_q.partition_shape_C((self.H, self.D)), Float32)
        acc_dq.fill(0.0)
        # dk_c = G Q_c
        thr_k = dk_mma.get_slice(wtid)
        tKrG = dk_mma.make_fragment_A(thr_k.partition_A(sG))     # (MMA, 1, H / 16)
        raw_q = cute.recast_ptr(sQ.iterator, None)
        acc_k = cute.make_rmem_tensor(thr_k.partition_shape_C((BN, 64)), Float32)
        rows = cute.make_rmem_tensor((4,), Int64)
        rok = cute.make_rmem_tensor((4,), Int32)
        qz = cute.make_rmem_tensor((8,), Float32) if self.deterministic else None
        pol = dk_reduce.evict_last_policy()
        dwv = cute.make_rmem_tensor((NS // 2,), Float32)
        dwv.fill(0.0)
        lse = Float32(0.0)
        tsum = Float32(0.0)
        scale = Float32(1.0)
        if const_expr(self.kl):
            lse = load(stats_ptr, Int64(t) * Int64(4) + Int64(1))
            tsum = load(stats_ptr, Int64(t) * Int64(4) + Int64(2))
            scale = load(scale_ptr, Int64(0))
        lg = cute.make_rmem_tensor((2,), Float32)
        gv = cute.make_rmem_tensor((2,), Float32)
        gin_row = gin_ptr + Int64(t) * Int64(K)
        g_bar = BwdBarrier.G0 if const_expr(c == 0) else BwdBarrier.G1
        cute.arch.mbarrier_wait(q_full, 0)
        for i in cutlass.range(c, n_blocks, 2, unroll=1):
            dk_reduce.slot_rows(rows, rok, i, row_lo, lane, L, Int64(0), idx_row, dk_ptr, N, 1, self.D, False,
                                quanta, qz)
            s = self.block_scores(sc, ok, full, i)
            self.block_logits(acc_s, wv, mask, lg)
            for r in cutlass.range_constexpr(2):
                gr = Float32(0.0)
                if mask[r] == 0.0:
                    slot = Int64(i * BN + row_lo + 8 * r)
                    if const_expr(self.kl):
                        gr = cute.math.exp2((lg[r] - lse) * LOG2E, fastmath=False) * tsum - load(gin_row, slot)
                    else:
                        gr = load(gin_row, slot)
                gv[r] = gr
            for i_ in cutlass.range_constexpr(NS):
                j, r, e = i_ // 4, (i_ // 2) % 2, i_ % 2
                x = acc_s[i_]
                dwv[2 * j + e] = dwv[2 * j + e] + gv[r] * cute.arch.fmax(x, Float32(0.0))
                gx = Float32(0.0)
                if x > 0.0:
                    gx = gv[r] * wv[2 * j + e]
                rG[i_] = gx.to(self.dtype)
            cute.autovec_copy(rG, tGs)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=g_bar, number_of_threads=128)
            warpgroup.fence()
            for k in cutlass.range_constexpr(BN // 16):
                cute.gemm(dq_mma, acc_dq, tQrG[None, None, k], tQrK[None, None, k, s], acc_dq)
            warpgroup.commit_group()
            for ch in cutlass.range_constexpr(self.D // 64):
                qc = cute.make_tensor(cute.recast_ptr(raw_q + ch * self.H * 64, qc_layout.inner), qc_layout.outer)
                tKrQ = dk_mma.make_fragment_B(thr_k.partition_B(qc))
                acc_k.fill(0.0)
                warpgroup.fence()
                for k in cutlass.range_constexpr(self.H // 16):
                    cute.gemm(dk_mma, acc_k, tKrG[None, None, k], tKrQ[None, None, k], acc_k)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                if const_expr(ch == 0):
                    cute.arch.mbarrier_arrive(empty + s)  # dq's product, the stage's last reader, is done
                if const_expr(self.kl):
                    for i_ in cutlass.range_constexpr(cute.size(acc_k)):
                        acc_k[i_] = acc_k[i_] * scale
                dk_reduce.scatter(acc_k, ch, rows, rok, pol, False, qz)
        self.finish(c, acc_dq, dwv, wtid, lane, row_lo, col_lane, raw_g, sK, dq_ptr, dw_ptr, t, scale, sm_scale)

    @cute.jit
    def finish(self, c: cutlass.Constexpr, acc_dq, dwv, wtid, lane, row_lo, col_lane, raw_g, sK, dq_ptr, dw_ptr,
               t, scale, sm_scale):
        """Consumer 1's dq (fragment order, a thread's own slice) and its
        warps' dweights sums into the ring's shared memory; consumer 0 adds
        them to its own in a fixed order and stores dq [H, D] and dweights
        [H] (times scale, and sm_scale for dweights)."""
        # the head sums of a thread's columns over the warp's rows (lanes with the same col_lane)
        for d in cutlass.range_constexpr(2, 5):
            for f in cutlass.range_constexpr(cute.size(dwv)):
                dwv[f] = dwv[f] + cute.arch.shuffle_sync_bfly(dwv[f], 1 << d)
        ring = cute.recast_ptr(cute.recast_ptr(sK.iterator, None), dtype=Float32)
        NQ = cute.size(acc_dq)
        dw_part = ring + 128 * NQ  # [8 warps, H] after consumer 1's dq
        cute.arch.barrier(barrier_id=BwdBarrier.DONE, number_of_threads=CONSUMERS)
        if lane < 4:
            put_heads(dw_part + (c * 4 + wtid // 32) * self.H, dwv, col_lane)
        if const_expr(c == 1):
            for i_ in cutlass.range_constexpr(NQ):
                cute.make_tensor(ring + (wtid * NQ + i_), cute.make_layout((1,)))[0] = acc_dq[i_]
        cute.arch.barrier(barrier_id=BwdBarrier.SUMS, number_of_threads=CONSUMERS)
        if const_expr(c == 0):
            for i_ in cutlass.range_constexpr(NQ):
                acc_dq[i_] = (acc_dq[i_] + cute.make_tensor(ring + (wtid * NQ + i_), cute.make_layout((1,)))[0]) * scale
            self.store_dq(acc_dq, t, row_lo, col_lane, dq_ptr)
            if wtid < self.H:
                v = Float32(0.0)
                for w_ in cutlass.range_constexpr(8):
                    v = v + cute.make_tensor(dw_part + (w_ * self.H + wtid), cute.make_layout((1,)))[0]
                out = cute.make_tensor(dw_ptr + (Int64(t) * Int64(self.H) + Int64(wtid)), cute.make_layout((1,)))
                out[0] = (v * sm_scale * scale).to(self.w_dtype)

    @cute.jit
    def store_dq(self, acc_dq, t, row_lo, col_lane, dq_ptr):
        """dq[t, row, column] in q's dtype, two columns a 32-bit store;
        accumulator element 4j + 2r + e is head row_lo + 8r, column 8j + col_lane + e."""
        NO = cute.size(acc_dq)
        ob = cute.make_rmem_tensor((NO,), self.dtype)
        for i_ in cutlass.range_constexpr(NO):
            ob[i_] = acc_dq[i_].to(self.dtype)
        ow = cute.recast_tensor(ob, Int32)
        ES = self.dtype.width // 8
        base = dq_ptr.toint() + Int64(t) * Int64(self.H * self.D * ES)
        for j in cutlass.range_constexpr(NO // 4):
            for r in cutlass.range_constexpr(2):
                addr = base + (Int64(row_lo + 8 * r) * Int64(self.D) + 8 * j + col_lane) * ES
                dst = cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4),
                                       cute.make_layout((1,)))
                dst[0] = ow[2 * j + r]


@cute.jit
def put_heads(dst, dwv, col_lane):
    """A warp's dweights sums of one thread's heads 8 j + col_lane + e (at
    2 j + e of dwv) into dst[head] (shared memory)."""
    for j in cutlass.range_constexpr(cute.size(dwv) // 2):
        for e in cutlass.range_constexpr(2):
            cute.make_tensor(dst + (8 * j + col_lane + e), cute.make_layout((1,)))[0] = dwv[2 * j + e]
