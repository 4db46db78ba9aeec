"""The sparse indexer's logits and KL forward for Hopper (SM90) in CuTe DSL.

    logits[t, j] = sm_scale * sum_h weights[t, h] * relu(q[t, h] . k[indices[t, j]])

on the valid slots, -inf elsewhere (``dsa._args.SparseIndexerArgs``).  One
CTA per query row t, 384 threads, two CTAs an SM:

* warpgroup 0 (the producer) copies q[t] [H, D] once, then gathers the k
  rows of each block of 64 slots by index with 16-byte cp.async (8 threads
  a 128-byte segment of a row) into a ring of ``stages`` swizzled stages
  [64, D], each with a full and an empty mbarrier.  It is the one place
  that decides validity (``dsa.cute.rules``): an invalid slot copies the
  row of zeros and its mask (0 or -inf by slot, written to shared memory by
  one thread a row) is published with the stage.
* warpgroups 1 and 2 (the consumers) take the blocks in turn (consumer c
  the blocks c, c + 2, ...).  Slots are the rows of the product:
  S^T = K Q^T [64 slots, H heads] (wgmma, both operands in shared memory),
  so a slot's head sum is along a thread's own accumulator row and across
  the four threads of a quad (two shuffles), with the weights (times
  sm_scale) held in registers for the thread's columns.  The stage is
  released as soon as the product is in registers.
* Logits: the quad's first thread stores its two slots; the slots past the
  last block holding a valid one get -inf after the loop.  KL: each slot
  position keeps running sums (max, exp-sum, target sums rebased to its
  own max), combined across the 128 positions in shared memory after the
  loop (the Triton forward's per-lane form, ``dsa.triton.training``), and
  the row's stats (loss_t, lse, sum of valid target, has a valid slot)
  are stored.

Compiled per ``IndexerSm90Config`` and cached by ``dsa.cute.indexer_train``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup

from dsa.cute import pipeline, rules
from dsa.cute.gmem import aligned, copy_head_rows, gather_copier, load
from dsa.cute.pipeline import NamedBarrier, freed_phase, named_barriers, phase
from dsa.cute.rules import LN2, LOG2E, finite_shift

BN = 64            # slots per block: the M of one wgmma
THREADS = 384      # the producer and two consumer warpgroups
CONSUMERS = 256
MASK_WRITERS = 16  # producer threads that write a block's mask: one per row of a copy pass
STATS = 6          # a slot position's KL sums: max, exp-sum, target (logit - max), target log target, target, count
# setmaxnreg targets (producer, consumers) by CTAs an SM: the launch gives
# each thread 65536 / (384 x CTAs) registers (80 at two, 168 at one), and
# p + 2 c must stay within 3 x that, or a consumer's increase waits forever.
REGS = {2: (40, 96), 1: (56, 224)}


def ctas_per_sm(H: int, D: int) -> int:
    """CTAs an SM the kernel is launched for: two up to 64 heads (S^T 32
    registers a thread) and 128 dims (the ring and Q in half the shared
    memory); 128 heads need more than 80 registers for the wgmma alone."""
    return 2 if H <= 64 and D <= 128 else 1


@named_barriers
class Barrier(NamedBarrier):
    """Named barriers of the consumers."""

    LANES = 1  # both consumers' per-position KL sums are in shared memory


@dataclass(frozen=True)
class IndexerSm90Config:
    """The static configuration of one compiled kernel (its compile key):
    q / k dtype, weights dtype, heads H, head dim D, whether topk_length is
    given, kl (the KL loss's stats, or its gradient, instead of the logits
    or theirs), the ring's stages, backward (the gradients' kernel,
    ``indexer_train_bwd_sm90``) and, for it, deterministic (each dk value
    rounded to its key's quantum before the add, ``dsa.triton.dk_quanta``)."""

    dtype: object
    w_dtype: object
    H: int
    D: int
    has_len: bool
    kl: bool
    stages: int = 4
    backward: bool = False
    deterministic: bool = False


def indexer_reason(dtype, H: int, D: int) -> Optional[str]:
    """Why the kernel cannot be built for (dtype, H, D) (None when it can);
    dtype is a ``cutlass`` type."""
    if dtype not in (cutlass.BFloat16, cutlass.Float16):
        return f"q dtype {dtype}: the cute indexer kernels take bf16 or fp16"
    if H % 16 or not 16 <= H <= 128:
        return f"H_i = {H}: the cute indexer kernels take a multiple of 16 heads, 16 to 128"
    if D % 64 or not 64 <= D <= 256:
        return f"D_i = {D}: the cute indexer kernels take a multiple of 64, 64 to 256"
    return None


class SparseIndexerSm90:
    """Host-side builder of the kernel for one static configuration."""

    def __init__(self, dtype, w_dtype, H: int, D: int, has_len: bool, kl: bool, stages: int = 4):
        why = indexer_reason(dtype, H, D)
        if why is not None:
            raise ValueError(f"SparseIndexerSm90: {why}")
        self.config = IndexerSm90Config(dtype, w_dtype, H, D, has_len, kl, stages)
        self.dtype, self.w_dtype = dtype, w_dtype
        self.H, self.D, self.has_len, self.kl, self.stages = H, D, has_len, kl, stages
        self.ctas = ctas_per_sm(H, D)
        self.regs = REGS[self.ctas]

    @classmethod
    def from_config(cls, config: IndexerSm90Config) -> "SparseIndexerSm90":
        """The builder of ``config`` (whose ``backward`` names the class: this
        one's or its subclass's, which alone takes ``deterministic``)."""
        skip = ("backward",) if config.backward else ("backward", "deterministic")
        return cls(**{f.name: getattr(config, f.name) for f in fields(config) if f.name not in skip})

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer, k_ptr: cute.Pointer, w_ptr: cute.Pointer, idx_ptr: cute.Pointer,
        len_ptr: cute.Pointer, tgt_ptr: cute.Pointer, out_ptr: cute.Pointer, zero_ptr: cute.Pointer,
        T: Int32, N: Int32, K: Int32, sm_scale: Float32, stream,
    ):
        dt = self.dtype
        KM = warpgroup.OperandMajorMode.K
        mma = cute.make_tiled_mma(cute.make_mma_atom(warpgroup.MmaF16BF16Op(
            dt, Float32, (BN, self.H, 16), warpgroup.OperandSource.SMEM, KM, KM)), (1, 1, 1))
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dt)
        sq_layout = cute.tile_to_shape(atom, (self.H, self.D), order=(0, 1))
        sk_layout = cute.tile_to_shape(atom, (BN, self.D, self.stages), order=(0, 1, 2))

        @cute.struct
        class Smem:
            q_full: cute.struct.MemRange[Int64, 1]
            full: cute.struct.MemRange[Int64, self.stages]
            empty: cute.struct.MemRange[Int64, self.stages]
            sOk: cute.struct.MemRange[Float32, BN * self.stages]  # each stage's mask by slot: 0 or -inf
            sLanes: cute.struct.MemRange[Float32, 2 * BN * STATS]  # the KL sums of the 128 slot positions
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sq_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sk_layout)], 1024]

        self.smem = Smem
        self.kernel(mma, sq_layout, sk_layout, q_ptr, k_ptr, w_ptr, idx_ptr, len_ptr, tgt_ptr, out_ptr, zero_ptr,
                    N, K, sm_scale).launch(grid=[T, 1, 1], block=[THREADS, 1, 1], stream=stream,
                                           min_blocks_per_mp=self.ctas,
                                           preferred_smem_carveout=100)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self, mma: cute.TiledMma, sq_layout: cute.ComposedLayout, sk_layout: cute.ComposedLayout,
        q_ptr: cute.Pointer, k_ptr: cute.Pointer, w_ptr: cute.Pointer, idx_ptr: cute.Pointer,
        len_ptr: cute.Pointer, tgt_ptr: cute.Pointer, out_ptr: cute.Pointer, zero_ptr: cute.Pointer,
        N: Int32, K: Int32, sm_scale: Float32,
    ):
        self.run(sq_layout, sk_layout, q_ptr, k_ptr, idx_ptr, len_ptr, zero_ptr, N, K,
                 (mma, w_ptr, tgt_ptr, out_ptr, sm_scale))

    @cute.jit
    def run(self, sq_layout, sk_layout, q_ptr, k_ptr, idx_ptr, len_ptr, zero_ptr, N, K, extra):
        """The kernel body: the CTA's start, then warpgroup 0 the producer,
        warpgroups 1 and 2 ``consumers`` (with ``extra``, what they read
        besides the ring)."""
        tidx, row, st, sQ, sK, (q_full, full, empty) = self.start(sq_layout, sk_layout, len_ptr, idx_ptr, K)
        t, L, n_blocks, idx_row = row
        ok = st.sOk.data_ptr()
        if tidx < 128:
            cute.arch.setmaxregister_decrease(self.regs[0])
            self.producer(tidx, sQ, sK, ok, q_full, full, empty, q_ptr, k_ptr, zero_ptr, idx_row, t, L, n_blocks, N)
        else:
            cute.arch.setmaxregister_increase(self.regs[1])
            self.consumers(tidx, row, st, sQ, sK, (q_full, full, empty), N, K, extra)

    @cute.jit
    def consumers(self, tidx, row, st, sQ, sK, bars, N, K, extra):
        """Warpgroups 1 and 2: the logits or the KL stats (``consumer``)."""
        mma, w_ptr, tgt_ptr, out_ptr, sm_scale = extra
        t, L, n_blocks, _ = row
        q_full, full, empty = bars
        mma.set(warpgroup.Field.ACCUMULATE, True)
        args = (mma, tidx % 128, sQ, sK, st.sOk.data_ptr(), st.sLanes.data_ptr(), q_full, full, empty, w_ptr,
                tgt_ptr, out_ptr, t, L, n_blocks, K, sm_scale)
        if cute.arch.make_warp_uniform(tidx // 128) == 1:
            self.consumer(0, *args)
        else:
            self.consumer(1, *args)

    @cute.jit
    def start(self, sq_layout, sk_layout, len_ptr, idx_ptr, K):
        """A CTA's start: (thread index, its row (t, L, blocks, the row's
        indices), the shared storage, Q and the ring as tensors, the
        barriers (q_full, full[stages], empty[stages]) initialised)."""
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        st, sQ, sK, bars = self.shared(tidx, sq_layout, sk_layout)
        L = rules.row_length(len_ptr, t, K, self.has_len)
        row = (t, L, rules.block_count(L, BN), idx_ptr + Int64(t) * Int64(K))
        return tidx, row, st, sQ, sK, bars

    @cute.jit
    def shared(self, tidx, sq_layout, sk_layout):
        """The shared storage (``self.smem``), Q and the ring as tensors, and
        the barriers (q_full, full[stages], empty[stages]) initialised."""
        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(self.smem)
        q_full, full, empty = st.q_full.data_ptr(), st.full.data_ptr(), st.empty.data_ptr()
        sQ = st.sQ.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sK = st.sK.get_tensor(sk_layout.outer, swizzle=sk_layout.inner)
        arrivals = [(q_full, 0, 128)]  # the producer's copies
        for s in cutlass.range_constexpr(self.stages):
            arrivals.append((full, s, 128 + MASK_WRITERS))  # the copies, then one mask writer a row
            arrivals.append((empty, s, 128))                # the consumer that read the stage
        pipeline.init_mbarriers(tidx, arrivals)
        return st, sQ, sK, (q_full, full, empty)

    @cute.jit
    def producer(self, tidx, sQ, sK, ok, q_full, full, empty, q_ptr, k_ptr, zero_ptr, idx_row, t, L, n_blocks, N):
        """q[t] once, then every block's k rows into the ring, each stage
        refilled once the consumer that read it has released it."""
        atom, thr, row_in_pass, col0 = gather_copier(self.dtype, tidx)
        copy_head_rows(atom, thr.partition_D(sQ), q_ptr, self.dtype, t, self.H, 0, self.H, self.D,
                       row_in_pass, col0)
        cute.arch.cp_async_mbarrier_arrive_noinc(q_full)
        tK = thr.partition_D(sK)  # [copy, pass, 64-column chunk, stage]
        ES = self.dtype.width // 8

        def visit(i, base, mk):
            self.fill_stage(atom, tK, ok, full, empty, base, mk, i, row_in_pass, col0)

        rules.walk_blocks(visit, idx_row, n_blocks, L, N, k_ptr, zero_ptr, 0, 1, self.D * ES, col0 * ES, BN,
                          row_in_pass, 16)

    @cute.jit
    def fill_stage(self, atom, tK, ok, full, empty, base, mk, i, row_in_pass, col0):
        """Block i's rows into its stage once the stage is free, and its mask."""
        s = i % self.stages
        use = i // self.stages
        ES = self.dtype.width // 8
        R = BN // 16
        if use > 0:
            cute.arch.mbarrier_wait(empty + s, freed_phase(use))
        for m in cutlass.range_constexpr(R):
            for c in cutlass.range_constexpr(self.D // 64):
                src = cute.make_tensor(aligned(self.dtype, base[m] + c * 64 * ES), cute.make_layout((8,)))
                cute.copy(atom, src, tK[None, m, c, s])
        cute.arch.cp_async_mbarrier_arrive_noinc(full + s)
        if col0 == 0:
            for m in cutlass.range_constexpr(R):
                cute.make_tensor(ok + (s * BN + row_in_pass + 16 * m), cute.make_layout((1,)))[0] = mk[m]
            cute.arch.mbarrier_arrive(full + s)

    @cute.jit
    def consumer(self, c: cutlass.Constexpr, mma, wtid, sQ, sK, ok, lanes, q_full, full, empty, w_ptr, tgt_ptr,
                 out_ptr, t, L, n_blocks, K, sm_scale):
        """Blocks c, c + 2, ...: S^T = K Q^T, the slots' logits, then their
        store (logits) or the running KL sums of the thread's two slot
        positions (kl)."""
        sc = self.scores_setup(mma, wtid, sQ, sK, w_ptr, t, sm_scale)
        lane, row_lo, acc, wv, mask = sc[0], sc[1], sc[4], sc[6], sc[7]
        lg = cute.make_rmem_tensor((2,), Float32)
        sums = cute.make_rmem_tensor((2, STATS), Float32)
        for r in cutlass.range_constexpr(2):
            sums[r, 0] = -Float32.inf
            for f in cutlass.range_constexpr(1, STATS):
                sums[r, f] = Float32(0.0)
        cute.arch.mbarrier_wait(q_full, 0)
        for i in cutlass.range(c, n_blocks, 2, unroll=1):
            s = self.block_scores(sc, ok, full, i)
            cute.arch.mbarrier_arrive(empty + s)
            self.block_logits(acc, wv, mask, lg)
            slot0 = i * BN + row_lo
            if const_expr(self.kl):
                self.kl_step(sums, lg, mask, tgt_ptr, t, K, slot0)
            else:
                if lane % 4 == 0:
                    for r in cutlass.range_constexpr(2):
                        if slot0 + 8 * r < K:
                            cute.make_tensor(out_ptr + (Int64(t) * Int64(K) + Int64(slot0 + 8 * r)),
                                             cute.make_layout((1,)))[0] = lg[r]
        if const_expr(self.kl):
            self.kl_store(c, sums, lanes, wtid, row_lo, lane, out_ptr, t)
        else:
            # the slots past the last block holding a valid one
            out_row = out_ptr + Int64(t) * Int64(K)
            for slot in cutlass.range(n_blocks * BN + c * 128 + wtid, K, CONSUMERS, unroll=1):
                cute.make_tensor(out_row + Int64(slot), cute.make_layout((1,)))[0] = -Float32.inf

    @cute.jit
    def scores_setup(self, mma, wtid, sQ, sK, w_ptr, t, sm_scale):
        """A consumer's registers for S^T = K Q^T: (lane, row_lo, col_lane,
        the MMA's slice, the accumulator, the operands (K stages, Q), the
        weights times sm_scale of the thread's heads, the mask of its two
        slots).  Accumulator element 4j + 2r + e sits at slot row_lo + 8r,
        head 8j + col_lane + e."""
        lane = wtid % 32
        row_lo = (wtid // 32) * 16 + lane // 4
        col_lane = 2 * (lane % 4)
        thr = mma.get_slice(wtid)
        tSrK = mma.make_fragment_A(thr.partition_A(sK))  # (MMA, 1, D / 16, stages)
        tSrQ = mma.make_fragment_B(thr.partition_B(sQ))  # (MMA, 1, D / 16)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((BN, self.H)), Float32)
        NA = cute.size(acc)
        wv = cute.make_rmem_tensor((NA // 2,), Float32)
        for j in cutlass.range_constexpr(NA // 4):
            for e in cutlass.range_constexpr(2):
                w = load(w_ptr, Int64(t) * Int64(self.H) + Int64(8 * j + col_lane + e))
                wv[2 * j + e] = w.to(Float32) * sm_scale
        return (lane, row_lo, col_lane, thr, acc, (mma, tSrK, tSrQ), wv, cute.make_rmem_tensor((2,), Float32))

    @cute.jit
    def block_scores(self, sc, ok, full, i):
        """Block i's S^T = K Q^T into the accumulator and its two slots'
        mask, once its stage is full; returns the stage (the caller
        releases it)."""
        row_lo, acc, (mma, tSrK, tSrQ), mask = sc[1], sc[4], sc[5], sc[7]
        s = i % self.stages
        cute.arch.mbarrier_wait(full + s, phase(i // self.stages))
        acc.fill(0.0)
        warpgroup.fence()
        for k in cutlass.range_constexpr(self.D // 16):
            cute.gemm(mma, acc, tSrK[None, None, k, s], tSrQ[None, None, k], acc)
        warpgroup.commit_group()
        for r in cutlass.range_constexpr(2):
            mask[r] = cute.make_tensor(ok + (s * BN + row_lo + 8 * r), cute.make_layout((1,)))[0]
        warpgroup.wait_group(0)
        return s

    @cute.jit
    def block_logits(self, acc, wv, mask, lg):
        """lg[r] <- the logit of the thread's slot row_lo + 8r: its row's
        weighted relu sum over the heads (its own columns, then the quad's),
        -inf where the mask says the slot is invalid."""
        NA = cute.size(acc)
        for r in cutlass.range_constexpr(2):
            v = Float32(0.0)
            for j in cutlass.range_constexpr(NA // 4):
                for e in cutlass.range_constexpr(2):
                    v = v + cute.arch.fmax(acc[4 * j + 2 * r + e], Float32(0.0)) * wv[2 * j + e]
            v = v + cute.arch.shuffle_sync_bfly(v, 1)
            v = v + cute.arch.shuffle_sync_bfly(v, 2)
            x = -Float32.inf
            if mask[r] == 0.0:
                x = v
            lg[r] = x

    @cute.jit
    def kl_step(self, sums, lg, mask, tgt_ptr, t, K, slot0):
        """Fold the thread's two slots into their positions' running sums:
        max m, sum of exp(logit - m), sum target (logit - m) and target log
        target over the slots whose target is nonzero, sum of target and
        count over the valid ones."""
        for r in cutlass.range_constexpr(2):
            x = lg[r]
            tg = Float32(0.0)
            valid = mask[r] == 0.0
            if valid:
                tg = load(tgt_ptr, Int64(t) * Int64(K) + Int64(slot0 + 8 * r))
            m_old = sums[r, 0]
            m_new = cute.arch.fmax(m_old, x)
            ms = finite_shift(m_new)
            sums[r, 1] = sums[r, 1] * cute.math.exp2((m_old - ms) * LOG2E, fastmath=False) + \
                cute.math.exp2((x - ms) * LOG2E, fastmath=False)
            if m_old != -Float32.inf:
                sums[r, 2] = sums[r, 2] + (m_old - ms) * sums[r, 4]  # rebased to the new max
            if valid:
                if tg != 0.0:
                    sums[r, 2] = sums[r, 2] + tg * (x - ms)
                    sums[r, 3] = sums[r, 3] + tg * cute.math.log2(tg, fastmath=False) * LN2
                sums[r, 4] = sums[r, 4] + tg
                sums[r, 5] = sums[r, 5] + 1.0
            sums[r, 0] = m_new

    @cute.jit
    def kl_store(self, c: cutlass.Constexpr, sums, lanes, wtid, row_lo, lane, out_ptr, t):
        """The 128 positions' sums (both consumers) into shared memory, then
        one warp combines them in a fixed order and stores the row's stats
        (loss_t, lse, sum of valid target, has a valid slot) at out[t]."""
        if lane % 4 == 0:
            for r in cutlass.range_constexpr(2):
                for f in cutlass.range_constexpr(STATS):
                    pos = c * BN + row_lo + 8 * r
                    cute.make_tensor(lanes + (pos * STATS + f), cute.make_layout((1,)))[0] = sums[r, f]
        cute.arch.barrier(barrier_id=Barrier.LANES, number_of_threads=CONSUMERS)
        if const_expr(c == 0):
            if wtid < 32:
                acc = cute.make_rmem_tensor((STATS,), Float32)
                one = cute.make_rmem_tensor((STATS,), Float32)
                for q in cutlass.range_constexpr(2 * BN // 32):
                    for f in cutlass.range_constexpr(STATS):
                        one[f] = cute.make_tensor(lanes + ((q * 32 + wtid) * STATS + f), cute.make_layout((1,)))[0]
                    if const_expr(q == 0):
                        for f in cutlass.range_constexpr(STATS):
                            acc[f] = one[f]
                    else:
                        combine(acc, one)
                for d in cutlass.range_constexpr(5):
                    for f in cutlass.range_constexpr(STATS):
                        one[f] = cute.arch.shuffle_sync_bfly(acc[f], 1 << d)
                    combine(acc, one)
                if wtid == 0:
                    m, l, a, b, ts, n = acc[0], acc[1], acc[2], acc[3], acc[4], acc[5]
                    has = n > 0.0
                    log_l = cute.math.log2(l, fastmath=False) * LN2
                    loss = Float32(0.0)
                    lse = -Float32.inf
                    flag = Float32(0.0)
                    if has:
                        loss = b - a + log_l * ts
                        lse = m + log_l
                        flag = Float32(1.0)
                    row = cute.make_tensor(out_ptr + Int64(t) * Int64(4), cute.make_layout((4,)))
                    row[0] = loss
                    row[1] = lse
                    row[2] = ts
                    row[3] = flag


@cute.jit
def combine(acc, one):
    """acc <- the KL sums of two slot positions' sums, rebased to their
    common max (a side with no finite max adds its exp-sum and target sums
    unshifted: they are zero, or its target sums carry no logit)."""
    m = cute.arch.fmax(acc[0], one[0])
    ms = finite_shift(m)
    for side in cutlass.range_constexpr(2):
        x = acc if const_expr(side == 0) else one
        if x[0] != -Float32.inf:
            x[2] = x[2] + (x[0] - ms) * x[4]
            x[1] = x[1] * cute.math.exp2((x[0] - ms) * LOG2E, fastmath=False)
    acc[0] = m
    for f in cutlass.range_constexpr(1, STATS):
        acc[f] = acc[f] + one[f]
