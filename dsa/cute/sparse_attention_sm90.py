"""Sparse attention forward for Hopper (SM90) in CuTe DSL.

One CTA per (token t, kv head g, block of 64 query heads), three warpgroups:

* warpgroup 0, the producer, gathers the kv rows of each block of 64 slots
  with 16-byte cp.async into one of two swizzled shared-memory stages (TMA
  cannot gather rows on SM90).  An invalid slot copies a row of zeros, so
  NaN or Inf stored in kv rows that no valid slot names is never read.  Each
  stage is two halves with barriers of their own: L, the columns [0, 256),
  and R, the columns [256, D); the producer fills them in the order the
  consumers free them (L of stage 0, R of stage 1, R of stage 0, L of
  stage 1), signalling each with ``cp.async.mbarrier.arrive``.  The kv-row
  indices of a pair are loaded a pair ahead, all of a thread's loads issued
  before any is used, so their latency hides behind the previous pair's
  waits and copies.  The producer is the one place that decides validity:
  with the first half of each stage it publishes the block's mask (0 or
  -inf by slot) in shared memory, and the consumers add it to S.
* warpgroups 1 and 2, the consumers, work on pairs of blocks (2i, 2i + 1):
  consumer w computes S = Q K^T (wgmma, both operands in shared memory) of
  block 2i + w, from stage w, and accumulates O for the value columns
  [256 w, 256 w + 256) of both blocks: its own P from registers, the
  other's from shared memory.  V is the K tile itself read MN-major (see
  the layouts in ``__call__``), so consumer 0 reads only L halves as V and
  consumer 1 only R halves, and each releases a half as soon as its P V on
  it retires.
* The consumers are staggered, not in step.  Consumer 0 finishes its S
  first, publishes its row maxima and starts O += P0 V0 at once; consumer 1
  folds those maxima into its own (making them the pair's), publishes them
  and starts O += P1 V1; consumer 0 rescales P0 to the pair's maxima, hands
  it over, and issues O += P1 V1 followed at once by the S of its next
  block.  The tensor cores have one consumer's work while the other runs its
  softmax.

Row maxima are in the log2 domain; a row with no valid slot so far keeps
-inf and is shifted by 0 (``_shift``), so no (-inf) - (-inf) appears.  The
loop stops after the last block holding a valid slot (topk_length), so a row
of length L costs about L / K of a full row.  Compiled per (dtype, D, d_v,
H, G, topk_length?, sink?) and cached by ``dsa.cute.sparse_attention``.
"""

from __future__ import annotations

import enum

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

BLOCK_H = 64   # query heads per CTA: the M of one wgmma
THREADS = 384  # producer + two consumer warpgroups

PRODUCER_REGS = 56   # 56 + 2 * 224 registers a thread fill the register file
CONSUMER_REGS = 224
BN = 64        # slots per block and stage; two stages
MASK_WRITERS = 16  # producer threads that write a stage's mask: one per row of a copy pass
L_CHUNKS = 4   # 64-column chunks of an L half (the value columns of consumer 0)


# Profile counters (cycles, per warp; SparseAttnFwdSm90(profile=True)):
# consumers: the tile loop, stage-full waits, hand-off and row-sum barrier
# waits, wgmma waits, the Q wait, the epilogue; the producer: the tile loop,
# stage-empty waits, kv-row lookups, copy issue, the Q-empty wait.
PROF_TOTAL, PROF_FULL, PROF_BAR, PROF_WGMMA, PROF_Q, PROF_EPI = range(6)
PROF_EMPTY, PROF_LOOKUP, PROF_ISSUE = PROF_FULL, PROF_BAR, PROF_WGMMA
PROF_N = 8


class Barrier(enum.IntEnum):
    """Named barriers between the consumers: one side arrives, the other waits."""

    MAX0 = 1   # consumer 0's row maxima of the pair are in shared memory
    MAX1 = 2   # consumer 1's (the pair's) maxima are
    P0 = 3     # consumer 0's P, at the pair's maxima, is
    P1 = 4     # consumer 1's P is
    ROW_SUMS = 5


PAIR_THREADS = 256


@cute.jit
def _shift(m):
    """The subtrahend of exp2(x - m): m, or 0 for a row whose maximum is -inf."""
    mu = m
    if m == -Float32.inf:
        mu = Float32(0.0)
    return mu


class SparseAttnFwdSm90:
    """Host-side builder of the kernel for one static configuration."""

    def __init__(self, dtype, D: int, d_v: int, H: int, G: int, has_len: bool, has_sink: bool,
                 profile: bool = False, refill: bool = True):
        # shared memory holds Q and two 64-slot stages up to D = 576
        if D not in (512, 576) or d_v != 512 or (H // G) % BLOCK_H:
            raise ValueError("SparseAttnFwdSm90 needs D in (512, 576), d_v == 512, (H / G) % 64 == 0")
        self.dtype = dtype
        self.D, self.d_v, self.H, self.G = D, d_v, H, G
        self.HG = H // G
        self.dv_half = d_v // 2
        self.has_len, self.has_sink = has_len, has_sink
        self.profile = profile  # per-warp cycle counters into prof_ptr (PROF_*)
        # refill False: a timing build whose producer gathers each stage on
        # its first use only and afterwards just signals it, so the consumers
        # never wait for a gather's round trip; its out is not the attention.
        self.refill = refill

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        sink_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, zero_ptr: cute.Pointer,
        prof_ptr: cute.Pointer,
        T: Int32, N: Int32, K: Int32, scale_log2: Float32, n_cta: Int32, stream,
    ):
        dt = self.dtype
        K_ = warpgroup.OperandMajorMode.K
        MN = warpgroup.OperandMajorMode.MN
        qk_mma = cute.make_tiled_mma(cute.make_mma_atom(warpgroup.MmaF16BF16Op(
            dt, Float32, (BLOCK_H, BN, 16), warpgroup.OperandSource.SMEM, K_, K_)), (1, 1, 1))
        pv_mma = cute.make_tiled_mma(cute.make_mma_atom(warpgroup.MmaF16BF16Op(
            dt, Float32, (BLOCK_H, self.dv_half, 16), warpgroup.OperandSource.RMEM, K_, MN)), (1, 1, 1))
        pv_mma_ss = cute.make_tiled_mma(cute.make_mma_atom(warpgroup.MmaF16BF16Op(
            dt, Float32, (BLOCK_H, self.dv_half, 16), warpgroup.OperandSource.SMEM, K_, MN)), (1, 1, 1))
        # Layouts.  Q [64 heads, D] and each K stage [64 slots, D]: K-major
        # 128B-swizzled atoms of 8 rows x 64 columns, rows first.  V, the
        # B operand of P V, is the same bytes read MN-major: the MN-major atom
        # (64 columns x 8 slots, columns contiguous) is byte-for-byte the
        # K-major one, and tiling slots first keeps the atom order.
        # P [64 heads, 64 slots] is a K-major A operand.  Consumer 0's lives in
        # the columns 512..575 of stage 0 when D = 576 (dead once its S is
        # computed; the stage's R half is refilled only after consumer 1 has
        # read it); consumer 1's always has a buffer of its own, since stage
        # 1's R half is refilled while consumer 0 still reads that P.
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dt)
        mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, dt)
        sq_layout = cute.tile_to_shape(k_atom, (BLOCK_H, self.D), order=(0, 1))
        sk_layout = cute.tile_to_shape(k_atom, (BN, self.D, 2), order=(0, 1, 2))
        sv_layout = cute.tile_to_shape(mn_atom, (self.dv_half, BN), order=(1, 0))
        sp_layout = cute.tile_to_shape(k_atom, (BLOCK_H, BN), order=(0, 1))
        p_elems = (1 if self.D > self.d_v else 2) * BLOCK_H * BN

        @cute.struct
        class Smem:
            q_full: cute.struct.MemRange[Int64, 1]
            q_empty: cute.struct.MemRange[Int64, 1]
            full: cute.struct.MemRange[Int64, 4]   # stage s, half h at 2 s + h (L = 0, R = 1)
            empty: cute.struct.MemRange[Int64, 4]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sq_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sk_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[dt, p_elems], 1024]
            sM: cute.struct.MemRange[Float32, 2 * BLOCK_H]
            sL: cute.struct.MemRange[Float32, 4 * BLOCK_H]  # row sums, by row parity and consumer
            # the mask of the block in each stage, by slot: 0 (valid) or -inf
            sOk: cute.struct.MemRange[Float32, 2 * BN]

        self.smem = Smem
        # Tiles (token, kv head, head block), head blocks fastest: the tiles
        # of one (token, kv head) run side by side, so the second one's
        # gathers hit the rows the first just pulled into L2.  CTA c runs the
        # tiles c, c + n_cta, ...: n_cta = the tile count gives one tile a
        # CTA, the SM count a persistent grid.
        n_tiles = T * self.G * (self.HG // BLOCK_H)
        self.kernel(
            qk_mma, pv_mma, pv_mma_ss, sq_layout, sk_layout, sv_layout, sp_layout,
            q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr, zero_ptr, prof_ptr,
            N, K, n_tiles, scale_log2,
        ).launch(grid=[cutlass.min(n_cta, n_tiles), 1, 1], block=[THREADS, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, pv_mma_ss: cute.TiledMma,
        sq_layout: cute.ComposedLayout, sk_layout: cute.ComposedLayout, sv_layout: cute.ComposedLayout,
        sp_layout: cute.ComposedLayout,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        sink_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, zero_ptr: cute.Pointer,
        prof_ptr: cute.Pointer,
        N: Int32, K: Int32, n_tiles: Int32, scale_log2: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        n_cta, _, _ = cute.arch.grid_dim()
        wg = cute.arch.make_warp_uniform(tidx // 128)

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(self.smem)
        bars = (st.q_full.data_ptr(), st.q_empty.data_ptr(), st.full.data_ptr(), st.empty.data_ptr())
        q_full, q_empty, full, empty = bars
        sQ = st.sQ.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sK = st.sK.get_tensor(sk_layout.outer, swizzle=sk_layout.inner)

        if tidx == 0:
            cute.arch.mbarrier_init(q_full, 128)    # the producer's threads
            cute.arch.mbarrier_init(q_empty, 256)   # both consumers, past their last S of a row
            for h in cutlass.range_constexpr(4):
                # the producer's threads; the first half filled of a stage (L
                # of 0, R of 1) also carries its mask, from one thread a row
                cute.arch.mbarrier_init(full + h, 128 + (MASK_WRITERS if h in (0, 3) else 0))
                cute.arch.mbarrier_init(empty + h, 128)  # the consumer reading that half as V
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        tiles = (cta, n_tiles, n_cta, idx_ptr, len_ptr, K)
        for mma in (qk_mma, pv_mma, pv_mma_ss):
            mma.set(warpgroup.Field.ACCUMULATE, True)
        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.prof_start()
            self.producer(tidx, sQ, sK, st.sOk.data_ptr(), bars, tiles, q_ptr, kv_ptr, zero_ptr, N)
            self.prof_store(prof_ptr, tidx)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            args = (qk_mma, pv_mma, pv_mma_ss, sv_layout, sp_layout, tidx % 128, sQ, sK,
                    st.sP.data_ptr(), st.sM.data_ptr(), st.sL.data_ptr(), st.sOk.data_ptr(), bars, tiles,
                    sink_ptr, out_ptr, lse_ptr, scale_log2)
            self.prof_start()
            if wg == 1:
                self.consumer(0, *args)
            else:
                self.consumer(1, *args)
            self.prof_store(prof_ptr, tidx)

    # -------------------------------------------------------------- profile
    @cute.jit
    def prof_start(self):
        if const_expr(self.profile):
            self._prof = cute.make_rmem_tensor((PROF_N,), Int64)
            self._prof.fill(0)
            self._prof_t0 = cute.arch.clock64()

    @cute.jit
    def tick(self):
        t = Int64(0)
        if const_expr(self.profile):
            t = cute.arch.clock64()
        return t

    @cute.jit
    def tock(self, cat: cutlass.Constexpr, t0):
        if const_expr(self.profile):
            self._prof[cat] = self._prof[cat] + (cute.arch.clock64() - t0)

    @cute.jit
    def mbar_wait(self, bar, phase, cat: cutlass.Constexpr):
        t0 = self.tick()
        cute.arch.mbarrier_wait(bar, phase)
        self.tock(cat, t0)

    @cute.jit
    def wgmma_wait(self, n: cutlass.Constexpr):
        t0 = self.tick()
        warpgroup.wait_group(n)
        self.tock(PROF_WGMMA, t0)

    @cute.jit
    def bar_wait(self, barrier_id: cutlass.Constexpr):
        t0 = self.tick()
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=PAIR_THREADS)
        self.tock(PROF_BAR, t0)

    @cute.jit
    def prof_store(self, prof_ptr, tidx):
        """Lane 0 of each warp writes its counters: prof[cta, warp, PROF_N]."""
        if const_expr(self.profile):
            self._prof[PROF_TOTAL] = cute.arch.clock64() - self._prof_t0
            cta, _, _ = cute.arch.block_idx()
            if tidx % 32 == 0:
                base = (Int64(cta) * Int64(THREADS // 32) + Int64(tidx // 32)) * Int64(PROF_N)
                out = cute.make_tensor(prof_ptr + base, cute.make_layout((PROF_N,)))
                for c in cutlass.range_constexpr(PROF_N):
                    out[c] = self._prof[c]

    @cute.jit
    def tile(self, tile_id, idx_ptr, len_ptr, K):
        """Tile tile_id: (token t, kv head g, first query head head0, slots
        [0, L) that may be valid, blocks holding them, the row's indices)."""
        G, HG = self.G, self.HG
        HB = HG // BLOCK_H
        pid = tile_id // HB  # t * G + g
        hblk = tile_id - pid * HB
        t = pid // G
        g = pid - t * G
        head0 = g * HG + hblk * BLOCK_H
        L = K
        if const_expr(self.has_len):
            L = _load(len_ptr, Int64(t))
            L = cutlass.max(Int32(0), cutlass.min(L, K))
        n_blocks = (L + BN - 1) // BN
        return t, g, head0, L, n_blocks, idx_ptr + Int64(pid) * Int64(K)

    @cute.jit
    def producer(self, tidx, sQ, sK, sOk, bars, tiles, q_ptr, kv_ptr, zero_ptr, N):
        q_full, q_empty, full, empty = bars
        cta, n_tiles, n_cta, idx_ptr, len_ptr, K = tiles
        atom, thr, row_in_pass, col0 = self.copier(tidx)
        tK0 = thr.partition_D(sK[None, None, 0])
        tK1 = thr.partition_D(sK[None, None, 1])
        # kv-row byte offsets of the pair's two blocks (the zero row's for an
        # invalid slot); their indices are loaded a pair ahead (ns0, ns1)
        base0 = cute.make_rmem_tensor((BN // 16,), Int64)
        base1 = cute.make_rmem_tensor((BN // 16,), Int64)
        # their masks (0 or -inf), written to sOk with the stage's first half
        mk0 = cute.make_rmem_tensor((BN // 16,), Float32)
        mk1 = cute.make_rmem_tensor((BN // 16,), Float32)
        ok = cute.make_tensor(sOk, cute.make_layout((2, BN), stride=(BN, 1)))
        masks = (mk0, mk1, ok, col0 == 0, row_in_pass)
        ns0 = cute.make_rmem_tensor((BN // 16,), Int32)
        ns1 = cute.make_rmem_tensor((BN // 16,), Int32)
        u0 = Int32(0)  # uses of stage 0 / stage 1 by earlier tiles
        u1 = Int32(0)
        j = Int32(0)   # tiles done
        for tile_id in cutlass.range(cta, n_tiles, n_cta, unroll=1):
            t, g, head0, L, n_blocks, idx_row = self.tile(tile_id, idx_ptr, len_ptr, K)
            rows = (kv_ptr, zero_ptr, g, L, N, row_in_pass, col0)
            n_pairs = (n_blocks + 1) // 2
            self.fetch_rows(ns0, 0, idx_row, L, row_in_pass)
            self.fetch_rows(ns1, 1, idx_row, L, row_in_pass)
            self.resolve_rows(base0, mk0, ns0, 0, *rows)
            self.resolve_rows(base1, mk1, ns1, 1, *rows)
            # The first pair's copies go out before Q's: its stages free up
            # during the last tile's final pair, Q only after both consumers
            # are past their last S of it.
            if n_pairs > 0:
                self.fetch_rows(ns0, 2, idx_row, L, row_in_pass)
                self.fetch_rows(ns1, 3, idx_row, L, row_in_pass)
                self.produce_pair(atom, base0, base1, masks, tK0, tK1, full, empty, 0, n_blocks, u0, u1)
                self.resolve_rows(base0, mk0, ns0, 2, *rows)
                self.resolve_rows(base1, mk1, ns1, 3, *rows)
            if j > 0:
                self.mbar_wait(q_empty, (j + 1) % 2, PROF_Q)
            self.load_q(atom, thr, sQ, q_full, q_ptr, t, head0, row_in_pass, col0)
            for i in cutlass.range(1, n_pairs, unroll=1):
                # the next pair's indices load while this pair's copies wait and go out
                self.fetch_rows(ns0, 2 * i + 2, idx_row, L, row_in_pass)
                self.fetch_rows(ns1, 2 * i + 3, idx_row, L, row_in_pass)
                self.produce_pair(atom, base0, base1, masks, tK0, tK1, full, empty, i, n_blocks, u0, u1)
                self.resolve_rows(base0, mk0, ns0, 2 * i + 2, *rows)
                self.resolve_rows(base1, mk1, ns1, 2 * i + 3, *rows)
            u0 = u0 + n_pairs
            u1 = u1 + n_blocks // 2
            j = j + 1

    def copier(self, tidx):
        """The producer's 16-byte cp.async atom and this thread's slice: 8
        threads per row, so each row's 128-byte segments go out as full
        sectors; 16 rows per pass."""
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.dtype, num_bits_per_copy=128)
        tiled = cute.make_tiled_copy_tv(atom, cute.make_ordered_layout((16, 8), order=(1, 0)),
                                        cute.make_layout((1, 8)))
        return atom, tiled.get_slice(tidx), tidx // 8, (tidx % 8) * 8

    @cute.jit
    def load_q(self, atom, thr, sQ, q_full, q_ptr, t, head0, row_in_pass, col0):
        """Q: heads head0 .. head0 + 63 of token t, signalled on q_full."""
        D = self.D
        ES = self.dtype.width // 8
        tQs = thr.partition_D(sQ)
        for m in cutlass.range_constexpr(BLOCK_H // 16):
            row = head0 + row_in_pass + m * 16
            addr = q_ptr.toint() + (Int64(t) * Int64(self.H) + Int64(row)) * Int64(D * ES) + col0 * ES
            for c in cutlass.range_constexpr(D // 64):
                src = cute.make_tensor(_aligned(self.dtype, addr + c * 64 * ES), cute.make_layout((8,)))
                cute.copy(atom, src, tQs[None, m, c])
        cute.arch.cp_async_mbarrier_arrive_noinc(q_full)

    @cute.jit
    def produce_pair(self, atom, base0, base1, masks, tK0, tK1, full, empty, i, n_blocks, u0, u1):
        """The copies of pair i, half by half in the order the consumers free
        them, and the two blocks' masks with the first half of each stage.
        u0 / u1: the uses of stage 0 / 1 by earlier tiles (every earlier pair
        of this tile used both stages)."""
        CHUNKS = self.D // 64
        has1 = 2 * i + 1 < n_blocks
        n0 = u0 + i
        n1 = u1 + i
        if n0 > 0:
            self.mbar_wait(empty + 0, (n0 + 1) % 2, PROF_EMPTY)  # the phase completed one use ago
        self.fill(atom, base0, tK0, 0, L_CHUNKS, n0)
        cute.arch.cp_async_mbarrier_arrive_noinc(full + 0)
        self.publish_mask(masks, 0, full + 0)
        if has1:
            if n1 > 0:
                self.mbar_wait(empty + 3, (n1 + 1) % 2, PROF_EMPTY)
            self.fill(atom, base1, tK1, L_CHUNKS, CHUNKS, n1)
            cute.arch.cp_async_mbarrier_arrive_noinc(full + 3)
            self.publish_mask(masks, 1, full + 3)
        if n0 > 0:
            self.mbar_wait(empty + 1, (n0 + 1) % 2, PROF_EMPTY)
        self.fill(atom, base0, tK0, L_CHUNKS, CHUNKS, n0)
        cute.arch.cp_async_mbarrier_arrive_noinc(full + 1)
        if has1:
            if n1 > 0:
                self.mbar_wait(empty + 2, (n1 + 1) % 2, PROF_EMPTY)
            self.fill(atom, base1, tK1, 0, L_CHUNKS, n1)
            cute.arch.cp_async_mbarrier_arrive_noinc(full + 2)

    @cute.jit
    def fetch_rows(self, ns, b, idx_row, L, row_in_pass):
        """ns[m] <- the index of slot b * 64 + row_in_pass + 16 m, issued
        without a branch between the loads so that they fly together; a slot
        past L reads slot L - 1 instead (nothing past topk_length is read) and
        is dropped by resolve_rows; nothing is read when L == 0."""
        t0 = self.tick()
        if L > 0:
            for m in cutlass.range_constexpr(BN // 16):
                slot = b * BN + row_in_pass + m * 16
                ns[m] = _load(idx_row, Int64(cutlass.min(slot, L - 1)))
        self.tock(PROF_LOOKUP, t0)

    @cute.jit
    def resolve_rows(self, base, mk, ns, b, kv_ptr, zero_ptr, g, L, N, row_in_pass, col0):
        """base[m]: the address this thread copies from for slot b * 64 +
        row_in_pass + 16 m (the zero row when the slot is not valid), mk[m]
        its mask: 0 when valid, else -inf.  The one place the kernel decides
        validity: slot < topk_length and 0 <= index < N."""
        t0 = self.tick()
        ES = self.dtype.width // 8
        for m in cutlass.range_constexpr(BN // 16):
            slot = b * BN + row_in_pass + m * 16
            addr = zero_ptr.toint()
            mask = -Float32.inf
            if slot < L:
                n = ns[m]
                if n >= 0 and n < N:
                    addr = kv_ptr.toint() + (Int64(n) * Int64(self.G) + Int64(g)) * Int64(self.D * ES)
                    mask = Float32(0.0)
            base[m] = addr + col0 * ES
            mk[m] = mask
        self.tock(PROF_LOOKUP, t0)

    @cute.jit
    def publish_mask(self, masks, stage: cutlass.Constexpr, bar):
        """One thread a row writes its slots' masks of the block in ``stage``
        and arrives on ``bar`` (release: the consumer that waits on bar sees
        them).  The stage's earlier mask is dead: its reader released this
        half after masking its S."""
        mk0, mk1, ok, writer, row_in_pass = masks
        mk = mk0 if stage == 0 else mk1
        if writer:
            for m in cutlass.range_constexpr(BN // 16):
                ok[stage, row_in_pass + 16 * m] = mk[m]
            cute.arch.mbarrier_arrive(bar)

    @cute.jit
    def fill(self, atom, base, tKs, c_lo: cutlass.Constexpr, c_hi: cutlass.Constexpr, n):
        """The copies of a half stage on its use n (the no-refill build: on
        the first use only)."""
        if const_expr(self.refill):
            self.copy_half(atom, base, tKs, c_lo, c_hi)
        else:
            if n == 0:
                self.copy_half(atom, base, tKs, c_lo, c_hi)

    @cute.jit
    def copy_half(self, atom, base, tKs, c_lo: cutlass.Constexpr, c_hi: cutlass.Constexpr):
        t0 = self.tick()
        ES = self.dtype.width // 8
        for m in cutlass.range_constexpr(BN // 16):
            for c in cutlass.range_constexpr(c_hi - c_lo):
                src = cute.make_tensor(_aligned(self.dtype, base[m] + (c_lo + c) * 64 * ES), cute.make_layout((8,)))
                cute.copy(atom, src, tKs[None, m, c_lo + c])
        self.tock(PROF_ISSUE, t0)

    @cute.jit
    def consumer(self, w: cutlass.Constexpr, qk_mma, pv_mma, pv_mma_ss, sv_layout, sp_layout, wtid,
                 sQ, sK, sP, sM, sL, sOk, bars, tiles, sink_ptr, out_ptr, lse_ptr, scale_log2):
        q_full, q_empty, full, empty = bars
        cta, n_tiles, n_cta, idx_ptr, len_ptr, K = tiles
        D, dvh = self.D, self.dv_half
        lane = wtid % 32
        warp = wtid // 32
        thr_qk = qk_mma.get_slice(wtid)
        thr_pv = pv_mma.get_slice(wtid)
        thr_ss = pv_mma_ss.get_slice(wtid)

        tSrQ = qk_mma.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = qk_mma.make_fragment_B(thr_qk.partition_B(sK))   # (MMA, 1, D / 16, 2)
        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((BLOCK_H, BN)), Float32)
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((BLOCK_H, dvh)), Float32)
        r_p = cute.make_rmem_tensor(thr_pv.partition_shape_A((BLOCK_H, BN)), self.dtype)

        raw = cute.recast_ptr(sK.iterator, None)
        p_raw = cute.recast_ptr(sP, None)
        if const_expr(D > self.d_v):
            p0_ptr, p1_ptr = raw + BN * self.d_v, p_raw     # P0 in stage 0's RoPE columns
        else:
            p0_ptr, p1_ptr = p_raw + BLOCK_H * BN, p_raw
        # consumer w: its own block in stage w, its V columns at w * 256
        v_own = cute.make_tensor(cute.recast_ptr(raw + (w * BN * D + w * BN * dvh), sv_layout.inner),
                                 sv_layout.outer)
        v_oth = cute.make_tensor(cute.recast_ptr(raw + ((1 - w) * BN * D + w * BN * dvh), sv_layout.inner),
                                 sv_layout.outer)
        p_own = cute.make_tensor(cute.recast_ptr(p0_ptr if w == 0 else p1_ptr, sp_layout.inner), sp_layout.outer)
        p_oth = cute.make_tensor(cute.recast_ptr(p1_ptr if w == 0 else p0_ptr, sp_layout.inner), sp_layout.outer)
        tPs_own = thr_qk.partition_C(p_own)
        tOrV_own = pv_mma.make_fragment_B(thr_pv.partition_B(v_own))
        tOrV_oth = pv_mma_ss.make_fragment_B(thr_ss.partition_B(v_oth))
        tOrP_oth = pv_mma_ss.make_fragment_A(thr_ss.partition_A(p_oth))
        m0 = cute.make_tensor(sM, cute.make_layout((BLOCK_H,)))
        m1 = cute.make_tensor(sM + BLOCK_H, cute.make_layout((BLOCK_H,)))
        ok = cute.make_tensor(sOk, cute.make_layout((2, BN), stride=(BN, 1)))  # the producer's masks

        row_lo = warp * 16 + lane // 4
        col_lane = 2 * (lane % 4)
        m_run = cute.make_rmem_tensor((2,), Float32)
        l_run = cute.make_rmem_tensor((2,), Float32)
        mask = cute.make_rmem_tensor((cute.size(acc_s) // 4, 2), Float32)

        u0 = Int32(0)  # uses of stage 0 / stage 1 by earlier tiles
        u1 = Int32(0)
        j = Int32(0)   # tiles done
        for tile_id in cutlass.range(cta, n_tiles, n_cta, unroll=1):
            t, g, head0, L, n_blocks, idx_row = self.tile(tile_id, idx_ptr, len_ptr, K)
            acc_o.fill(0.0)
            m_run.fill(-Float32.inf)
            l_run.fill(0.0)
            cs = (qk_mma, pv_mma, pv_mma_ss, tSrQ, tSrK, acc_s, acc_o, r_p, mask, m_run, l_run, m0, m1,
                  tPs_own, tOrV_own, tOrV_oth, tOrP_oth, full, empty, ok, row_lo, col_lane, lane,
                  scale_log2)
            n_full = n_blocks // 2
            self.mbar_wait(q_full, j % 2, PROF_Q)
            if const_expr(w == 0):
                if n_blocks > 0:
                    self.qk(cs, 0, 0, u0 % 2, True)
                for i in cutlass.range(n_full, unroll=1):
                    self.pair0(cs, i, n_blocks, True, u0)
                if n_blocks % 2 == 1:
                    self.pair0(cs, n_full, n_blocks, False, u0)
            else:
                for i in cutlass.range(n_full, unroll=1):
                    self.pair1(cs, i, True, u1)
                if n_blocks % 2 == 1:
                    self.pair1(cs, n_full, False, u1)
            cute.arch.mbarrier_arrive(q_empty)  # Q may be refilled
            self.tile_end(w, acc_o, m_run, l_run, sL + (j % 2) * (2 * BLOCK_H), lane, row_lo, col_lane,
                          sink_ptr, out_ptr, lse_ptr, t, head0)
            u0 = u0 + (n_blocks + 1) // 2
            u1 = u1 + n_full
            j = j + 1

    @cute.jit
    def tile_end(self, w: cutlass.Constexpr, acc_o, m_run, l_run, sL, lane, row_lo, col_lane,
                 sink_ptr, out_ptr, lse_ptr, t, head0):
        """Row sums over the 4 threads of a row, then over both consumers
        (sL: this tile's buffer of 2 x 64); then the epilogue."""
        l_own = cute.make_tensor(sL + w * BLOCK_H, cute.make_layout((BLOCK_H,)))
        l_oth = cute.make_tensor(sL + (1 - w) * BLOCK_H, cute.make_layout((BLOCK_H,)))
        for r in cutlass.range_constexpr(2):
            l = l_run[r]
            l = l + cute.arch.shuffle_sync_bfly(l, 1)
            l = l + cute.arch.shuffle_sync_bfly(l, 2)
            l_run[r] = l
            if lane % 4 == 0:
                l_own[row_lo + 8 * r] = l
        self.bar_wait(Barrier.ROW_SUMS)
        for r in cutlass.range_constexpr(2):
            l_run[r] = l_run[r] + l_oth[row_lo + 8 * r]
        t0 = self.tick()
        self.epilogue(acc_o, m_run, l_run, w, lane, row_lo, col_lane, sink_ptr, out_ptr, lse_ptr, t, head0)
        self.tock(PROF_EPI, t0)

    # -------------------------------------------------------- consumer steps
    @cute.jit
    def qk(self, cs, stage: cutlass.Constexpr, i, ph, first_l: cutlass.Constexpr):
        """S = Q K^T of the block in ``stage`` for pair i (barrier phase ph), its
        L half first when first_l, then masked and scaled to the log2 domain.
        Consumer 0 calls it with its previous remote P V still in flight and
        releases stage 1's L half between the halves."""
        (qk_mma, pv_mma, pv_mma_ss, tSrQ, tSrK, acc_s, acc_o, r_p, mask, m_run, l_run, m0, m1,
         tPs_own, tOrV_own, tOrV_oth, tOrP_oth, full, empty, ok, row_lo, col_lane, lane,
         scale_log2) = cs
        KD = self.D // 16
        KL = L_CHUNKS * 4
        first = 2 * stage + (0 if first_l else 1)
        acc_s.fill(0.0)
        self.mbar_wait(full + first, ph, PROF_FULL)
        warpgroup.fence()
        if const_expr(first_l):
            for k in cutlass.range_constexpr(KL):
                cute.gemm(qk_mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_s)
        else:
            for k in cutlass.range_constexpr(KD - KL):
                cute.gemm(qk_mma, acc_s, tSrQ[None, None, KL + k], tSrK[None, None, KL + k, stage], acc_s)
        warpgroup.commit_group()
        if const_expr(stage == 0):
            if i > 0:
                # consumer 0's P1 V1 of the last pair has retired: stage 1's L is free
                self.wgmma_wait(1)
                cute.arch.mbarrier_arrive(empty + 2)
        self.mbar_wait(full + (2 * stage + (1 if first_l else 0)), ph, PROF_FULL)
        warpgroup.fence()
        if const_expr(first_l):
            for k in cutlass.range_constexpr(KD - KL):
                cute.gemm(qk_mma, acc_s, tSrQ[None, None, KL + k], tSrK[None, None, KL + k, stage], acc_s)
        else:
            for k in cutlass.range_constexpr(KL):
                cute.gemm(qk_mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_s)
        warpgroup.commit_group()
        # The mask of this thread's columns (the producer's, published with
        # the stage) while the wgmma runs: accumulator element 4j + 2r + e
        # sits at row row_lo + 8r, column 8j + col_lane + e.
        NS = cute.size(acc_s)
        for j in cutlass.range_constexpr(NS // 4):
            for e in cutlass.range_constexpr(2):
                mask[j, e] = ok[stage, 8 * j + col_lane + e]
        self.wgmma_wait(0)
        for j in cutlass.range_constexpr(NS // 4):
            for r in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(2):
                    acc_s[4 * j + 2 * r + e] = acc_s[4 * j + 2 * r + e] * scale_log2 + mask[j, e]

    @cute.jit
    def softmax(self, cs, m_new):
        """acc_s <- exp2(S - m_new) in place, r_p its 16-bit copy; l and O
        rescaled from the running maximum to m_new, which becomes it."""
        (qk_mma, pv_mma, pv_mma_ss, tSrQ, tSrK, acc_s, acc_o, r_p, mask, m_run, l_run, m0, m1,
         tPs_own, tOrV_own, tOrV_oth, tOrP_oth, full, empty, ok, row_lo, col_lane, lane,
         scale_log2) = cs
        NS = cute.size(acc_s)
        alpha = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            mu = _shift(m_new[r])
            alpha[r] = cute.math.exp2(m_run[r] - mu, fastmath=True)
            rs = Float32(0.0)
            for j in cutlass.range_constexpr(NS // 4):
                for e in cutlass.range_constexpr(2):
                    i_ = 4 * j + 2 * r + e
                    p = cute.math.exp2(acc_s[i_] - mu, fastmath=True)
                    acc_s[i_] = p
                    rs = rs + p
            l_run[r] = l_run[r] * alpha[r] + rs
            m_run[r] = m_new[r]
        for i_ in cutlass.range_constexpr(NS):
            r_p[i_] = acc_s[i_].to(self.dtype)
        self.rescale_o(acc_o, alpha)

    @cute.jit
    def rescale_o(self, acc_o, alpha):
        for i_ in cutlass.range(cute.size(acc_o), unroll_full=True):
            acc_o[i_] = acc_o[i_] * alpha[(i_ // 2) % 2]

    @cute.jit
    def row_max(self, acc_s, mx):
        NS = cute.size(acc_s)
        for r in cutlass.range_constexpr(2):
            v = -Float32.inf
            for j in cutlass.range_constexpr(NS // 4):
                for e in cutlass.range_constexpr(2):
                    v = cute.arch.fmax(v, acc_s[4 * j + 2 * r + e])
            v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, 1))
            v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, 2))
            mx[r] = v

    @cute.jit
    def store_p(self, r_p, acc_s, tPs_own):
        # Column pairs are adjacent in the swizzled tile: 32-bit stores; the
        # other consumer's wgmma reads P through the async proxy.
        cute.autovec_copy(cute.make_tensor(r_p.iterator, acc_s.layout), tPs_own)
        cute.arch.fence_view_async_shared()

    @cute.jit
    def pv(self, mma, acc_o, tOrP, tOrV):
        warpgroup.fence()
        for k in cutlass.range_constexpr(BN // 16):
            cute.gemm(mma, acc_o, tOrP[None, None, k], tOrV[None, None, k], acc_o)
        warpgroup.commit_group()

    @cute.jit
    def pair0(self, cs, i, n_blocks, has1: cutlass.Constexpr, u0):
        """Consumer 0, pair i: S of block 2i is in acc_s (masked). u0: uses of
        stage 0 by earlier tiles. Every half it reads as V is released, so the
        next tile finds the stages free."""
        (qk_mma, pv_mma, pv_mma_ss, tSrQ, tSrK, acc_s, acc_o, r_p, mask, m_run, l_run, m0, m1,
         tPs_own, tOrV_own, tOrV_oth, tOrP_oth, full, empty, ok, row_lo, col_lane, lane,
         scale_log2) = cs
        NS = cute.size(acc_s)
        mx = cute.make_rmem_tensor((2,), Float32)
        self.row_max(acc_s, mx)
        for r in cutlass.range_constexpr(2):
            mx[r] = cute.arch.fmax(mx[r], m_run[r])
            if lane % 4 == 0:
                m0[row_lo + 8 * r] = mx[r]
        cute.arch.barrier_arrive(barrier_id=Barrier.MAX0, number_of_threads=PAIR_THREADS)
        self.softmax(cs, mx)
        self.pv(pv_mma, acc_o, r_p, tOrV_own)
        self.wgmma_wait(0)
        cute.arch.mbarrier_arrive(empty + 0)  # stage 0's L: no one reads it again this pair
        if const_expr(has1):
            # the pair's maxima from consumer 1; P0 rescaled to them
            self.bar_wait(Barrier.MAX1)
            sc = cute.make_rmem_tensor((2,), Float32)
            for r in cutlass.range_constexpr(2):
                mp = m1[row_lo + 8 * r]
                sc[r] = cute.math.exp2(m_run[r] - _shift(mp), fastmath=True)
                m_run[r] = mp
                l_run[r] = l_run[r] * sc[r]
            for i_ in cutlass.range_constexpr(NS):
                r_p[i_] = (acc_s[i_] * sc[(i_ // 2) % 2]).to(self.dtype)
            self.store_p(r_p, acc_s, tPs_own)
            cute.arch.barrier_arrive(barrier_id=Barrier.P0, number_of_threads=PAIR_THREADS)
            self.rescale_o(acc_o, sc)
            self.bar_wait(Barrier.P1)
            self.pv(pv_mma_ss, acc_o, tOrP_oth, tOrV_oth)
            if 2 * i + 2 < n_blocks:
                self.qk(cs, 0, i + 1, (u0 + i + 1) % 2, True)  # releases stage 1's L once P1 V1 retires
            else:
                self.wgmma_wait(0)
                cute.arch.mbarrier_arrive(empty + 2)
        else:
            # the last block, alone: its maxima are final, consumer 1 only needs P0
            self.store_p(r_p, acc_s, tPs_own)
            cute.arch.barrier_arrive(barrier_id=Barrier.P0, number_of_threads=PAIR_THREADS)

    @cute.jit
    def pair1(self, cs, i, has1: cutlass.Constexpr, u1):
        """Consumer 1, pair i: S of block 2i + 1 when has1, then O over both.
        u1: uses of stage 1 by earlier tiles."""
        (qk_mma, pv_mma, pv_mma_ss, tSrQ, tSrK, acc_s, acc_o, r_p, mask, m_run, l_run, m0, m1,
         tPs_own, tOrV_own, tOrV_oth, tOrP_oth, full, empty, ok, row_lo, col_lane, lane,
         scale_log2) = cs
        mx = cute.make_rmem_tensor((2,), Float32)
        if const_expr(has1):
            self.qk(cs, 1, i, (u1 + i) % 2, False)
            self.row_max(acc_s, mx)
        else:
            mx.fill(-Float32.inf)
        self.bar_wait(Barrier.MAX0)
        for r in cutlass.range_constexpr(2):
            # consumer 0's maxima already hold every earlier block's
            mx[r] = cute.arch.fmax(mx[r], m0[row_lo + 8 * r])
        if const_expr(has1):
            for r in cutlass.range_constexpr(2):
                if lane % 4 == 0:
                    m1[row_lo + 8 * r] = mx[r]
            cute.arch.barrier_arrive(barrier_id=Barrier.MAX1, number_of_threads=PAIR_THREADS)
            self.softmax(cs, mx)
            self.pv(pv_mma, acc_o, r_p, tOrV_own)
            self.store_p(r_p, acc_s, tPs_own)
        else:
            alpha = cute.make_rmem_tensor((2,), Float32)
            for r in cutlass.range_constexpr(2):
                alpha[r] = cute.math.exp2(m_run[r] - _shift(mx[r]), fastmath=True)
                l_run[r] = l_run[r] * alpha[r]
                m_run[r] = mx[r]
            self.rescale_o(acc_o, alpha)
        self.bar_wait(Barrier.P0)
        self.pv(pv_mma_ss, acc_o, tOrP_oth, tOrV_oth)
        if const_expr(has1):
            cute.arch.barrier_arrive(barrier_id=Barrier.P1, number_of_threads=PAIR_THREADS)
            self.wgmma_wait(1)
            cute.arch.mbarrier_arrive(empty + 3)  # stage 1's R
        self.wgmma_wait(0)
        cute.arch.mbarrier_arrive(empty + 1)      # stage 0's R (and P0 with it)

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
        # Element 4j + 2r + e sits at row row_lo + 8r, column 8j + col_lane + e:
        # a thread holds 4 bytes of each 16-byte chunk j of its rows, the quad
        # the chunk.  Two butterfly exchanges transpose each group of 4 chunks
        # across the quad, so that every thread stores one whole chunk with a
        # 16-byte store: a quarter of the store instructions, each writing
        # 64 contiguous bytes of a row instead of 16.
        ob = cute.make_rmem_tensor((NO,), self.dtype)
        for i_ in cutlass.range_constexpr(NO):
            ob[i_] = (acc_o[i_] * inv[(i_ // 2) % 2]).to(self.dtype)
        ow = cute.recast_tensor(ob, Int32)  # word 2j + r: the 2 columns of chunk j, row r
        q = lane % 4
        masks = (Int32(0) - (q & 1), Int32(0) - ((q >> 1) & 1))  # all ones where the lane bit is 1
        w4 = cute.make_rmem_tensor((4,), Int32)
        for g in cutlass.range_constexpr(NO // 16):
            for r in cutlass.range_constexpr(2):
                w = [ow[2 * (4 * g + jj) + r] for jj in range(4)]
                for bit in cutlass.range_constexpr(2):
                    m = masks[bit]
                    nm = Int32(-1) - m
                    for lo in ((0, 2) if bit == 0 else (0, 1)):
                        hi = lo + (1 << bit)
                        # the lane keeps the slot whose bit matches its own and
                        # swaps the other with its partner's
                        send = (w[lo] & m) | (w[hi] & nm)
                        recv = cute.arch.shuffle_sync_bfly(send, 1 << bit)
                        w[lo], w[hi] = (recv & m) | (w[lo] & nm), (w[hi] & m) | (recv & nm)
                for p_ in cutlass.range_constexpr(4):  # now the columns 8c + 2p_ + {0, 1} of chunk c = 4g + q
                    w4[p_] = w[p_]
                row = row_lo + 8 * r
                off = Int64(row) * Int64(self.d_v) + 8 * (4 * g + q)
                dst = cute.make_ptr(Int32, (out_base + off).toint(), cute.AddressSpace.gmem, assumed_align=16)
                cute.autovec_copy(w4, cute.make_tensor(dst, cute.make_layout((4,))))

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
