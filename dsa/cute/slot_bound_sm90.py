"""Per-slot bounds on the sparse attention backward's dkv contributions, for
Hopper (SM90) in CuTe DSL.

The deterministic cute backward adds dkv with exact atomics: each value is
rounded to a power-of-two quantum of its (kv row, token range) before the add
(``dsa.triton.dkv_quanta``), which needs, before the backward runs, a bound
on the sum of |contributions| each row will receive.  Slot j of token t (kv
head g, kv row n) adds to column c of dkv[n, g]

    sum_h P[h, j] dO[h, c]  (value columns only)
    + sm_scale sum_h P[h, j] (dP[h, j] - Delta[h]) q[h, c],

and with |dP[h, j]| <= ||dO_h|| ||v_n|| every column is within

    X_j + Y_j ||v_n||,   X_j = sum_h P[h, j] wa_h,   Y_j = sum_h P[h, j] wc_h

(wa_h = max|dO_h| + |sm_scale| max|q_h| |Delta_h|, wc_h = |sm_scale|
max|q_h| ||dO_h||).  This kernel computes X and Y: P needs S = Q K^T, the
backward's first product, and nothing else of it; the weights come from Q
in shared memory and the preprocess's max|dO_h| and ||dO_h|| bound
(``dsa.triton.sparse_attention.preprocess`` with ``stats``).

One CTA per (token t, kv head g, part of up to 128 query heads), one
producer warpgroup and one consumer warpgroup per 64 heads of the part:

* the producer gathers the kv rows of each block of 64 slots by index, one
  64-column chunk at a time, into a ring of chunk stages [64 slots, 64
  columns], each with a full and an empty mbarrier, and copies Q [heads,
  D] once, chunk c of it with block 0's chunk c (a barrier a chunk), so
  that the first product waits for one chunk of each, not for all of Q.  A
  chunk stage is refilled as soon as the wgmma reading it retires, so the
  ring keeps loads in flight even where it holds a single block (128 heads
  at D 576: Q takes 144 KB).  It is the one place that
  decides validity (``dsa.cute.rules``): an invalid slot gathers the zero
  row, and the block's mask (0 or -inf by slot) is published with its first
  chunk;
* each consumer computes S^T = K Q^T [64 slots, its heads] chunk by chunk,
  so that a slot's head sums run along a thread's own accumulator row and
  then across its quad (two shuffles), then P = exp2(S scale log2(e) + mask
  - log2 den) as the backward forms it, and X, Y of its two slots, stored at
  xy[part, t, g, j] (fp32 pairs; part = the CTA's part times the consumers
  plus the consumer).  Two accumulators alternate by block: a block's sums
  run while the next block's first chunk is in the tensor cores.  Before
  the first sums (Q is whole by then) the consumer forms its heads' weights:
  max|q_h| from Q in shared memory, a few threads a head, max|dO_h| and
  ||dO_h|| from ``stats``, published through shared memory.  Slots of
  blocks past the last one holding a valid slot are not written; nothing
  reads them.

A part of up to 64 heads (Q at most 72 KB) runs two CTAs an SM, so that one
CTA's start (Q's first chunk, the ring's first fill) and end overlap the
other's products.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from dsa.cute import pipeline, rules
from dsa.cute.gmem import aligned, gather_copier, load
from dsa.cute.pipeline import NamedBarrier, freed_phase, named_barriers, phase

BN = 64            # slots per block: the M of one wgmma
CHUNK = 64         # columns of a ring stage
HC = 64            # query heads a consumer warpgroup takes at most
MASK_WRITERS = 16  # producer threads that write a block's mask: one per row of a copy pass
SMEM_LIMIT = 227 * 1024
HEADER = 3072      # barriers, masks and the heads' weights, ahead of Q (1024-byte aligned)
# setmaxnreg targets (producer, consumers) by (CTAs an SM, consumers): the
# launch gives each thread 65536 / (CTAs x threads) registers, and p + c x
# consumers must stay within (1 + consumers) times that
REGS = {(1, 2): (56, 224), (2, 1): (56, 200)}


@named_barriers
class Barrier(NamedBarrier):
    """Named barriers, one a consumer warpgroup (128 threads each)."""

    WEIGHTS = 1          # consumer 0's heads' weights are in shared memory
    WEIGHTS_SECOND = 2   # consumer 1's


def part_heads(HG: int) -> int:
    """Query heads of one CTA for HG heads per kv head: all of them up to
    128, else 128 (or 64 where 128 does not divide HG)."""
    if HG <= 128:
        return HG
    return 128 if HG % 128 == 0 else 64


def ctas_per_sm(heads: int) -> int:
    """Two CTAs an SM for a part of up to 64 heads (Q at most 72 KB), else one."""
    return 2 if heads <= HC else 1


def ring_stages(heads: int, D: int, elem_bytes: int) -> int:
    """Chunk stages of the ring: what a CTA's share of shared memory leaves
    beside Q, at most two blocks' worth."""
    free = SMEM_LIMIT // ctas_per_sm(heads) - heads * D * elem_bytes - HEADER
    return max(2, min(2 * (D // CHUNK), free // (BN * CHUNK * elem_bytes)))


@dsl_user_op
def abs_max2(word: Int32, acc: Int32, half2: str, *, loc=None, ip=None) -> Int32:
    """max(|word|, acc) of two packed 16-bit floats (``half2`` bf16x2 or
    f16x2); a NaN half gives way to the other operand's."""
    asm = f"{{ .reg .b32 a; abs.{half2} a, $1; max.{half2} $0, $2, a; }}"
    operands = [Int32(word).ir_value(loc=loc, ip=ip), Int32(acc).ir_value(loc=loc, ip=ip)]
    return Int32(llvm.inline_asm(T.i32(), operands, asm, "=r,r,r", has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def halves_max(word: Int32, half2: str, *, loc=None, ip=None) -> Float32:
    """The larger of a word's two packed 16-bit floats (``half2``), as fp32."""
    if half2 == "bf16x2":
        asm = "{ .reg .b32 lo, hi; shl.b32 lo, $1, 16; and.b32 hi, $1, 0xFFFF0000; max.f32 $0, lo, hi; }"
    else:
        asm = ("{ .reg .f16 l, h; .reg .f32 a, b; mov.b32 {l, h}, $1; cvt.f32.f16 a, l; cvt.f32.f16 b, h; "
               "max.f32 $0, a, b; }")
    return Float32(llvm.inline_asm(T.f32(), [Int32(word).ir_value(loc=loc, ip=ip)], asm, "=f,r",
                                   has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dataclass(frozen=True)
class SlotBoundSm90Config:
    """The static configuration of one compiled kernel (its compile key):
    q / kv dtype, head dim D, query heads H, kv heads G, whether topk_length
    is given."""

    dtype: object
    D: int
    H: int
    G: int
    has_len: bool


class SlotBoundSm90:
    """Host-side builder of the bound kernel for one static configuration.

    Pointers: q [T, H, D], kv [N, G, D], indices [T, G, K] int32, topk_length
    [T] int32 (read only with has_len), lg2den [T, H] fp32 (the backward's
    log2 denominators, sink included), stats [T, H, 2] fp32 (max|dO| and a
    bound of ||dO|| a row: the preprocess's), delta [T, H] fp32, xy [parts,
    T, G, K, 2] fp32 (out), the zero row [D]; scalars T, N, K, sm_scale *
    log2(e), |sm_scale|."""

    def __init__(self, dtype, D: int, H: int, G: int, has_len: bool):
        why = self.can_implement(dtype, D, H, G)
        if why is not None:
            raise ValueError(f"SlotBoundSm90: {why}")
        self.config = SlotBoundSm90Config(dtype, D, H, G, has_len)
        self.dtype, self.D, self.H, self.G, self.has_len = dtype, D, H, G, has_len
        self.HG = H // G
        self.heads = part_heads(self.HG)
        self.parts = self.HG // self.heads
        self.consumers = (self.heads + HC - 1) // HC
        self.hc = min(self.heads, HC)
        self.nch = D // CHUNK
        self.stages = ring_stages(self.heads, D, dtype.width // 8)
        # a block's mask stays until its consumers are past its first chunk
        self.masks = (self.stages + self.nch - 1) // self.nch + 1
        self.threads = 128 * (1 + self.consumers)
        self.ctas = ctas_per_sm(self.heads)
        self.regs = REGS.get((self.ctas, self.consumers))

    @staticmethod
    def can_implement(dtype, D: int, H: int, G: int) -> Optional[str]:
        """Why the kernel cannot be built (None when it can); dtype is a ``cutlass`` type."""
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            return f"dtype {dtype}: the bound kernel takes bf16 or fp16"
        if D % CHUNK or not CHUNK <= D <= 576:
            return f"D = {D}: the bound kernel takes a multiple of 64 up to 576"
        if G < 1 or H % G:
            return f"H = {H} is not a multiple of G = {G}"
        HG = H // G
        if HG not in (16, 32) and HG % HC:
            return f"{HG} query heads per kv head: the bound kernel takes 16, 32 or a multiple of 64"
        return None

    @classmethod
    def from_config(cls, config: SlotBoundSm90Config) -> "SlotBoundSm90":
        """The builder of ``config``."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(config)})

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        lg2den_ptr: cute.Pointer, stats_ptr: cute.Pointer, delta_ptr: cute.Pointer, xy_ptr: cute.Pointer,
        zero_ptr: cute.Pointer, T: Int32, N: Int32, K: Int32, scale_log2: Float32, abs_scale: Float32, stream,
    ):
        dt = self.dtype
        KM = warpgroup.OperandMajorMode.K
        mma = cute.make_tiled_mma(cute.make_mma_atom(warpgroup.MmaF16BF16Op(
            dt, Float32, (BN, self.hc, 16), warpgroup.OperandSource.SMEM, KM, KM)), (1, 1, 1))
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dt)
        # each consumer's heads contiguous: [hc, D] tiles, one per consumer
        sq_layout = cute.tile_to_shape(atom, (self.hc, self.D, self.consumers), order=(0, 1, 2))
        sk_layout = cute.tile_to_shape(atom, (BN, CHUNK, self.stages), order=(0, 1, 2))

        @cute.struct
        class Smem:
            q_full: cute.struct.MemRange[Int64, self.nch]  # Q's column chunks
            full: cute.struct.MemRange[Int64, self.stages]
            empty: cute.struct.MemRange[Int64, self.stages]
            sOk: cute.struct.MemRange[Float32, BN * self.masks]  # blocks' masks by slot: 0 or -inf
            sW: cute.struct.MemRange[Float32, 2 * self.consumers * self.hc]  # each consumer's heads' wa, wc
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sq_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sk_layout)], 1024]

        self.smem = Smem
        self.kernel(mma, sq_layout, sk_layout, q_ptr, kv_ptr, idx_ptr, len_ptr, lg2den_ptr, stats_ptr, delta_ptr,
                    xy_ptr, zero_ptr, T, N, K, scale_log2, abs_scale).launch(
            grid=[T * self.G * self.parts, 1, 1], block=[self.threads, 1, 1], stream=stream,
            min_blocks_per_mp=self.ctas, preferred_smem_carveout=100)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self, mma: cute.TiledMma, sq_layout: cute.ComposedLayout, sk_layout: cute.ComposedLayout,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        lg2den_ptr: cute.Pointer, stats_ptr: cute.Pointer, delta_ptr: cute.Pointer, xy_ptr: cute.Pointer,
        zero_ptr: cute.Pointer, T: Int32, N: Int32, K: Int32, scale_log2: Float32, abs_scale: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(self.smem)
        q_full, full, empty = st.q_full.data_ptr(), st.full.data_ptr(), st.empty.data_ptr()
        sQ = st.sQ.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sK = st.sK.get_tensor(sk_layout.outer, swizzle=sk_layout.inner)
        arrivals = [(q_full, c, 128) for c in range(self.nch)]
        for s in cutlass.range_constexpr(self.stages):
            arrivals.append((full, s, 128 + MASK_WRITERS))   # the copies, then the mask writers
            arrivals.append((empty, s, 128 * self.consumers))  # every consumer thread that read it
        pipeline.init_mbarriers(tidx, arrivals)

        part = cta % self.parts
        tg = cta // self.parts      # t * G + g
        t = tg // self.G
        g = tg - t * self.G
        head0 = g * self.HG + part * self.heads
        L = rules.row_length(len_ptr, t, K, self.has_len)
        n_blocks = rules.block_count(L, BN)
        idx_row = idx_ptr + Int64(tg) * Int64(K)
        ok = st.sOk.data_ptr()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        if wg == 0:
            if const_expr(self.regs is not None):
                cute.arch.setmaxregister_decrease(self.regs[0])
            self.producer(tidx, sQ, sK, ok, q_full, full, empty, q_ptr, kv_ptr, zero_ptr, idx_row, t, g, head0,
                          L, n_blocks, N)
        else:
            if const_expr(self.regs is not None):
                cute.arch.setmaxregister_increase(self.regs[1])
            mma.set(warpgroup.Field.ACCUMULATE, True)
            for w in cutlass.range_constexpr(self.consumers):
                if wg == w + 1:
                    terms = (st.sQ.data_ptr(), st.sW.data_ptr(), stats_ptr, delta_ptr, abs_scale)
                    self.consumer(w, mma, tidx % 128, sQ, sK, ok, q_full, full, empty, lg2den_ptr, terms, xy_ptr,
                                  t, tg, part, head0, n_blocks, T, K, scale_log2)

    @cute.jit
    def producer(self, tidx, sQ, sK, ok, q_full, full, empty, q_ptr, kv_ptr, zero_ptr, idx_row, t, g, head0, L,
                 n_blocks, N):
        """Every block's kv rows, chunk by chunk, into the ring, with Q's
        chunk c just before block 0's."""
        dt = self.dtype
        ES = dt.width // 8
        atom, thr, row_in_pass, col0 = gather_copier(dt, tidx)
        tQ = thr.partition_D(sQ)  # [copy, pass, column chunk, consumer]
        q_rows = cute.make_rmem_tensor((self.consumers * (self.hc // 16),), Int64)
        for w in cutlass.range_constexpr(self.consumers):
            for m in cutlass.range_constexpr(self.hc // 16):
                row = Int64(t) * Int64(self.H) + Int64(head0 + w * HC + row_in_pass + 16 * m)
                q_rows[w * (self.hc // 16) + m] = q_ptr.toint() + (row * Int64(self.D) + Int64(col0)) * ES
        tK = thr.partition_D(sK)  # [copy, pass, 1, stage]
        R = BN // 16

        def visit(i, base, mk):
            for c in cutlass.range_constexpr(self.nch):
                u = i * self.nch + c
                s = u % self.stages
                use = u // self.stages
                if use > 0:
                    cute.arch.mbarrier_wait(empty + s, freed_phase(use))
                if i == 0:
                    self.copy_q(atom, tQ, q_rows, q_full, c)
                for m in cutlass.range_constexpr(R):
                    src = cute.make_tensor(aligned(dt, base[m] + c * CHUNK * ES), cute.make_layout((8,)))
                    cute.copy(atom, src, tK[None, m, 0, s])
                cute.arch.cp_async_mbarrier_arrive_noinc(full + s)
                if col0 == 0:
                    if const_expr(c == 0):
                        mb = (i % self.masks) * BN
                        for m in cutlass.range_constexpr(R):
                            dst = cute.make_tensor(ok + (mb + row_in_pass + 16 * m), cute.make_layout((1,)))
                            dst[0] = mk[m]
                    cute.arch.mbarrier_arrive(full + s)

        rules.walk_blocks(visit, idx_row, n_blocks, L, N, kv_ptr, zero_ptr, g, self.G, self.D * ES, col0 * ES, BN,
                          row_in_pass, 16)

    @cute.jit
    def copy_q(self, atom, tQ, q_rows, q_full, c: cutlass.Constexpr):
        """Column chunk c of this thread's rows of Q, signalled on q_full[c]."""
        ES = self.dtype.width // 8
        for w in cutlass.range_constexpr(self.consumers):
            for m in cutlass.range_constexpr(self.hc // 16):
                src = cute.make_tensor(aligned(self.dtype, q_rows[w * (self.hc // 16) + m] + c * CHUNK * ES),
                                       cute.make_layout((8,)))
                cute.copy(atom, src, tQ[None, m, c, w])
        cute.arch.cp_async_mbarrier_arrive_noinc(q_full + c)

    @cute.jit
    def consumer(self, w: cutlass.Constexpr, mma, wtid, sQ, sK, ok, q_full, full, empty, lg2den_ptr, terms,
                 xy_ptr, t, tg, part, head0, n_blocks, T, K, scale_log2):
        """Consumer w (heads head0 + 64 w ...): S^T of each block chunk by
        chunk, each chunk released once its wgmma retires, then the block's
        X, Y."""
        lane = wtid % 32
        row_lo = (wtid // 32) * 16 + lane // 4
        col_lane = 2 * (lane % 4)
        thr = mma.get_slice(wtid)
        tSrK = mma.make_fragment_A(thr.partition_A(sK))                      # (MMA, 1, 4, stages)
        tSrQ = mma.make_fragment_B(thr.partition_B(sQ[None, None, w]))       # (MMA, 1, D / 16)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((BN, self.hc)), Float32)
        NA = cute.size(acc)
        # accumulator element 4j + 2r + e: slot row_lo + 8r, head 8j + col_lane + e
        lg2 = cute.make_rmem_tensor((NA // 2,), Float32)
        wa = cute.make_rmem_tensor((NA // 2,), Float32)
        wc = cute.make_rmem_tensor((NA // 2,), Float32)
        for j in cutlass.range_constexpr(NA // 4):
            for e in cutlass.range_constexpr(2):
                h = Int64(t) * Int64(self.H) + Int64(head0 + w * HC + 8 * j + col_lane + e)
                lg2[2 * j + e] = load(lg2den_ptr, h)
        # wa, wc: ``weights``, before the first block's sums
        wts = (w, wtid, col_lane, terms, t, head0 + w * HC, wa, wc)
        mask0 = cute.make_rmem_tensor((2,), Float32)
        mask1 = cute.make_rmem_tensor((2,), Float32)
        acc1 = cute.make_rmem_tensor(thr.partition_shape_C((BN, self.hc)), Float32)
        out_row = Int64(part * self.consumers + w) * Int64(T) * Int64(self.G) + Int64(tg)
        sums = (lg2, wa, wc, lane, row_lo, out_row, xy_ptr, K, scale_log2)
        blk = (mma, tSrK, tSrQ, ok, q_full, full, empty, row_lo, sums, wts)
        for i0 in cutlass.range(0, n_blocks, 2, unroll=1):
            self.block(i0, acc, mask0, acc1, mask1, blk)
            if i0 + 1 < n_blocks:
                self.block(i0 + 1, acc1, mask1, acc, mask0, blk)
        if n_blocks > 0:
            warpgroup.wait_group(0)
            last = n_blocks - 1
            cute.arch.mbarrier_arrive(empty + (last * self.nch + self.nch - 1) % self.stages)
            if n_blocks == 1:
                self.weights(wts)
            if last % 2 == 0:
                self.block_sums(acc, mask0, last, sums)
            else:
                self.block_sums(acc1, mask1, last, sums)

    @cute.jit
    def block(self, i, cur, mask, prev, prev_mask, blk):
        """Block i's S^T into ``cur``, chunk by chunk, each chunk's stage
        released once its wgmma retires; with block i - 1's sums (``prev``)
        while block i's first chunk computes."""
        mma, tSrK, tSrQ, ok, q_full, full, empty, row_lo, sums, wts = blk
        cur.fill(0.0)
        for c in cutlass.range_constexpr(self.nch):
            u = i * self.nch + c
            s = u % self.stages
            cute.arch.mbarrier_wait(full + s, phase(u // self.stages))
            if i == 0:
                cute.arch.mbarrier_wait(q_full + c, 0)
            if const_expr(c == 0):
                mb = (i % self.masks) * BN
                for r in cutlass.range_constexpr(2):
                    mask[r] = cute.make_tensor(ok + (mb + row_lo + 8 * r), cute.make_layout((1,)))[0]
            warpgroup.fence()
            for k in cutlass.range_constexpr(CHUNK // 16):
                cute.gemm(mma, cur, tSrK[None, None, k, s], tSrQ[None, None, c * (CHUNK // 16) + k], cur)
            warpgroup.commit_group()
            if const_expr(c > 0):
                # the previous chunk's wgmma has retired: its stage is free
                warpgroup.wait_group(1)
                cute.arch.mbarrier_arrive(empty + (u - 1) % self.stages)
            else:
                if i > 0:
                    # block i - 1 is done: free its last chunk, then its sums
                    # while this chunk computes
                    warpgroup.wait_group(1)
                    cute.arch.mbarrier_arrive(empty + (u - 1) % self.stages)
                    if i == 1:
                        self.weights(wts)
                    self.block_sums(prev, prev_mask, i - 1, sums)

    @cute.jit
    def weights(self, wts):
        """wa and wc of this thread's heads (its registers ``wa``, ``wc``, as
        ``lg2``): 128 / hc threads a head take max|q| over Q's column chunks
        in shared memory (each row's 64-column chunk is whole 128 bytes,
        permuted by the swizzle); the head's first thread reads max|dO| and
        the bound of ||dO|| the preprocess wrote (``stats``) and publishes
        wa, wc in shared memory.  A weight that is not finite is 0 (its
        contributions are NaN or Inf and propagate as they would without the
        grids).  All 128 threads of the consumer call it at the same point,
        Q whole in shared memory."""
        w, wtid, col_lane, terms, t, h0, wa, wc = wts
        sq_ptr, sw_ptr, stats_ptr, delta_ptr, abs_scale = terms
        tph = 128 // self.hc
        h = wtid // tph
        p = wtid % tph
        # max|q| two values a word: a 16-bit max is exact, and each row chunk
        # is 128 aligned bytes (8 vector loads)
        half2 = "bf16x2" if self.dtype == cutlass.BFloat16 else "f16x2"
        qm2 = Int32(0)
        sq_addr = Int32(sq_ptr.toint())
        for k in cutlass.range_constexpr(self.nch):
            if k % tph == p:
                row = sq_addr + ((h // 8 + (self.hc // 8) * (k + self.nch * w)) * 512 + (h % 8) * 64) * 2
                for v in cutlass.range(8, unroll=2):
                    words = cute.make_rmem_tensor((4,), Int32)
                    cute.autovec_copy(cute.make_tensor(cute.make_ptr(Int32, row + 16 * v, cute.AddressSpace.smem,
                                                                     assumed_align=16), cute.make_layout((4,))), words)
                    for e in cutlass.range_constexpr(4):
                        qm2 = abs_max2(words[e], qm2, half2)
        qm = halves_max(qm2, half2)
        for d in cutlass.range_constexpr(tph.bit_length() - 1):
            qm = cute.arch.fmax(qm, cute.arch.shuffle_sync_bfly(qm, 1 << d))
        if p == 0:
            r = Int64(t) * Int64(self.H) + Int64(h0 + h)
            dm = load(stats_ptr, r * Int64(2))
            norm = load(stats_ptr, r * Int64(2) + Int64(1))
            dl = cute.math.absf(load(delta_ptr, r))
            a = dm + abs_scale * qm * dl
            c = abs_scale * qm * norm
            a = Float32(cutlass.select_(a < Float32.inf, a, Float32(0.0)))  # NaN fails it too
            c = Float32(cutlass.select_(c < Float32.inf, c, Float32(0.0)))
            out = cute.make_tensor(sw_ptr + 2 * self.hc * w, cute.make_layout((2, self.hc), stride=(self.hc, 1)))
            out[0, h] = a
            out[1, h] = c
        pipeline.sync(Barrier.WEIGHTS + w, 128)
        mine = cute.make_tensor(sw_ptr + 2 * self.hc * w, cute.make_layout((2, self.hc), stride=(self.hc, 1)))
        for j in cutlass.range_constexpr(cute.size(wa) // 2):
            for e in cutlass.range_constexpr(2):
                wa[2 * j + e] = mine[0, 8 * j + col_lane + e]
                wc[2 * j + e] = mine[1, 8 * j + col_lane + e]

    @cute.jit
    def block_sums(self, acc, mask, i, sums):
        """X, Y of block i's two slots of this thread from its finished
        accumulator: the heads' sums along its row, then across the quad;
        stored by the quad's first thread."""
        lg2, wa, wc, lane, row_lo, out_row, xy_ptr, K, scale_log2 = sums
        NA = cute.size(acc)
        for r in cutlass.range_constexpr(2):
            x = Float32(0.0)
            y = Float32(0.0)
            for j in cutlass.range_constexpr(NA // 4):
                for e in cutlass.range_constexpr(2):
                    p = cute.math.exp2(acc[4 * j + 2 * r + e] * scale_log2 + mask[r] - lg2[2 * j + e], fastmath=True)
                    x = x + p * wa[2 * j + e]
                    y = y + p * wc[2 * j + e]
            x = x + cute.arch.shuffle_sync_bfly(x, 1)
            y = y + cute.arch.shuffle_sync_bfly(y, 1)
            x = x + cute.arch.shuffle_sync_bfly(x, 2)
            y = y + cute.arch.shuffle_sync_bfly(y, 2)
            slot = i * BN + row_lo + 8 * r
            if lane % 4 == 0:
                if slot < K:
                    dst = cute.make_tensor(xy_ptr + (out_row * Int64(K) + Int64(slot)) * Int64(2),
                                           cute.make_layout((2,)))
                    dst[0] = x
                    dst[1] = y
