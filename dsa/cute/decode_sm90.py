"""Sparse decode for Hopper (SM90) in CuTe DSL: the forward kernel over a KV cache, split over the slots.

The kernel is ``sparse_attention_sm90.SparseAttnFwdSm90`` (its producer,
consumers, pipeline and online softmax, unchanged) with three differences,
each one of its hooks:

* **Tiles** (``slot_tiles`` / ``tile_of``, ``scheduler.SplitSlotTiles``): a
  tile is (token, kv head, 64-head block, split).  Split s covers the slots
  ``[s * chunk, min((s + 1) * chunk, L))`` of its row, chunk a whole number
  of 64-slot blocks; the body sees them as a row of that length.  A decode
  step has few rows (B1 at H = 128 is 2 tiles for 132 SMs), so the host
  picks the split count to fill about one wave.
* **Rows** (``row_sources`` / ``resolve_rows``, ``rules.PagedCache``): a
  slot's row comes from a paged cache through a block table (positions,
  seq_lens) or FlashMLA's slots page * page_size + offset; every invalid
  slot reads the zero row and is masked, as in the forward.
* **Epilogue**: with one split the tile finishes the row as the forward does
  (sink, lse).  With several it writes its normalised fp32 part to
  ``[T, H, S, d_v]`` and its log2-domain lse to ``[T, H, S]`` (-inf, and no
  part, when it saw no valid slot): the parts the Triton merge
  (``dsa.triton.decode_kernels.decode_combine_kernel``) combines and folds
  the sink into.

FP8 caches (``fp8_v32``, ``dsa.kv_cache``): the producer dequantises while it
gathers (``convert_half``): 16-byte global loads of e4m3 NoPE bytes into
registers, all of a half stage's (and the rows' scales) issued before the
first is converted, then e4m3 -> f16 -> f32, times the token's fp32 scale
(exact: the contract's fp32 value), rounded once to bf16 and stored into
the same swizzled K-major positions the bf16 gather fills; a
``fence.proxy.async`` and a release arrival then hand the stores to the
consumers' wgmma (``signal_fill``).  The RoPE bf16 columns go by cp.async
as in the forward.  Loads into registers cannot be many in flight, so the
rows' lines are prefetched into L2 when their addresses are resolved, a
pair of blocks ahead (``resolve_rows``).

Compiled per ``DecodeSm90Config`` and cached by ``dsa.cute.decode``.
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

from dsa.cute import rules, scheduler
from dsa.cute.gmem import aligned
from dsa.cute.rules import finite_shift
from dsa.cute.sparse_attention_sm90 import (
    BLOCK_H,
    BN,
    L_CHUNKS,
    PROF_ISSUE,
    PROF_LOOKUP,
    THREADS,
    SparseAttnFwdSm90,
)

NATIVE = "native"
FP8_V32 = "fp8_v32"
CACHES = (NATIVE, FP8_V32)

# fp8_v32's token record (dsa.kv_cache.FORMATS["fp8_v32"]): NoPE e4m3 bytes,
# then 4 fp32 scales (one per 128 values), then 64 bf16 RoPE values.
FP8_TOKEN = 656
FP8_NOPE = 512
FP8_SCALES = 512
FP8_ROPE = 528
FP8_TILE = 128
L2_LINE = 128

# Registers a thread (setmaxnreg) for an FP8 cache: the producer holds a half
# stage's e4m3 bytes (4 rows x 32 bytes) and scales while it converts them,
# so it takes more than the bf16 gather's 56 (consumers 224); 80 + 2 * 216
# fill the register file.  ptxas (sm_90a, H 128, block table, split): no
# spills at 80 / 216 and at 112 / 200, 16 bytes at 96 / 208.
FP8_PRODUCER_REGS = 80
FP8_CONSUMER_REGS = 216


@dsl_user_op
def e4m3x2_to_bf16x2(word: Int32, upper: bool, scale: Float32, *, loc=None, ip=None) -> Int32:
    """The two e4m3 bytes of ``word``'s lower (upper) half, each times
    ``scale``, as bf16x2 (the lower byte in the lower half): e4m3 -> f16 is
    exact, f16 -> f32 is exact, the fp32 product is the contract's dequantised
    value (exact for a power-of-two scale), and it is rounded once to bf16.
    A NaN byte (0x7F / 0xFF) stays NaN."""
    asm = ("{\n.reg .b16 lo, hi;\n.reg .b32 h2;\n.reg .f16 x, y;\n.reg .f32 fx, fy;\n"
           "mov.b32 {lo, hi}, $1;\n"
           f"cvt.rn.f16x2.e4m3x2 h2, {'hi' if upper else 'lo'};\n"
           "mov.b32 {x, y}, h2;\n"
           "cvt.f32.f16 fx, x;\ncvt.f32.f16 fy, y;\n"
           "mul.rn.f32 fx, fx, $2;\nmul.rn.f32 fy, fy, $2;\n"
           "cvt.rn.bf16x2.f32 $0, fy, fx;\n}")
    operands = [Int32(word).ir_value(loc=loc, ip=ip), Float32(scale).ir_value(loc=loc, ip=ip)]
    return Int32(llvm.inline_asm(T.i32(), operands, asm, "=r,r,f", has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def prefetch_l2(addr: Int64, *, loc=None, ip=None) -> None:
    """Bring the 128-byte line holding global byte address ``addr`` into L2."""
    llvm.inline_asm(res=None, operands_=[Int64(addr).ir_value(loc=loc, ip=ip)],
                    asm_string="prefetch.global.L2 [$0];", constraints="l", has_side_effects=True,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dataclass(frozen=True)
class DecodeSm90Config(scheduler.ProblemConfig):
    """The static configuration of one compiled decode kernel (its compile
    key): the problem, then has_sink, cache ("native" or "fp8_v32"),
    page_size (tokens a page; 1 for a flat cache), has_bt (indices are
    positions through a block table), has_seqlen (seq_lens cut them) and
    split (several splits a row: the kernel writes parts for the merge)."""

    has_sink: bool
    cache: str
    page_size: int
    has_bt: bool
    has_seqlen: bool
    split: bool


def decode_reason(dtype, D: int, d_v: int, H: int, G: int, cache: str, page_size: int, has_bt: bool,
                  has_seqlen: bool) -> Optional[str]:
    """Why the decode kernel cannot serve this configuration (None if it can)."""
    why = SparseAttnFwdSm90.can_implement(dtype, D, d_v, H, G)
    if why is not None:
        return why
    if cache not in CACHES:
        return f"cache format {cache!r}: the cute decode reads {CACHES}"
    if cache == FP8_V32:
        if dtype is not cutlass.BFloat16:
            return (f"q dtype {dtype} with fp8_v32: the cute decode dequantises FP8 to bf16 "
                    f"(fp16 cannot hold every scaled value); use bf16 q")
        if D != 576 or G != 1:
            return f"fp8_v32 holds one kv head of D = 576, got D={D}, H_kv={G}"
    if page_size < 1:
        return f"page_size {page_size} < 1"
    if has_seqlen and not has_bt:
        return "seq_lens without a block table"
    return None


class SparseDecodeSm90(SparseAttnFwdSm90):
    """Host-side builder of the decode kernel for one static configuration."""

    def __init__(self, dtype, D: int, d_v: int, H: int, G: int, has_len: bool, has_sink: bool, cache: str,
                 page_size: int, has_bt: bool, has_seqlen: bool, split: bool):
        why = decode_reason(dtype, D, d_v, H, G, cache, page_size, has_bt, has_seqlen)
        if why is not None:
            raise ValueError(f"SparseDecodeSm90: {why}")
        super().__init__(dtype, D, d_v, H, G, has_len, has_sink)
        self.config = DecodeSm90Config(dtype, D, d_v, H, G, has_len, has_sink, cache, page_size, has_bt,
                                       has_seqlen, split)
        self.cache, self.page_size = cache, page_size
        self.has_bt, self.has_seqlen, self.split = has_bt, has_seqlen, split
        self.fp8 = cache == FP8_V32
        if self.fp8:
            self.producer_regs, self.consumer_regs = FP8_PRODUCER_REGS, FP8_CONSUMER_REGS

    @classmethod
    def from_config(cls, config: DecodeSm90Config) -> "SparseDecodeSm90":
        return cls(**{f.name: getattr(config, f.name) for f in fields(config)})

    def row_bytes(self) -> int:
        """Bytes of one (token, kv head) row of the cache."""
        return FP8_TOKEN if self.fp8 else self.D * (self.dtype.width // 8)

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        bt_ptr: cute.Pointer, seqlen_ptr: cute.Pointer, sink_ptr: cute.Pointer, out_ptr: cute.Pointer,
        lse_ptr: cute.Pointer, zero_ptr: cute.Pointer,
        T: Int32, K: Int32, n_pages: Int32, page_stride: Int64, bt_w: Int32, chunk: Int32, n_split: Int32,
        len_div: Int32, rows_per_seq: Int32, scale_log2: Float32, n_cta: Int32, stream,
    ):
        mmas, layouts = self.operands()
        n_tiles = scheduler.tile_count(T, self.G, self.HG // BLOCK_H) * n_split
        self.kernel(
            *mmas, *layouts,
            q_ptr, kv_ptr, idx_ptr, len_ptr, bt_ptr, seqlen_ptr, sink_ptr, out_ptr, lse_ptr, zero_ptr,
            K, n_pages, page_stride, bt_w, chunk, n_split, len_div, rows_per_seq, n_tiles, scale_log2,
        ).launch(grid=[scheduler.grid_size(n_cta, n_tiles), 1, 1], block=[THREADS, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, pv_mma_ss: cute.TiledMma,
        sq_layout: cute.ComposedLayout, sk_layout: cute.ComposedLayout, sv_layout: cute.ComposedLayout,
        sp_layout: cute.ComposedLayout,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        bt_ptr: cute.Pointer, seqlen_ptr: cute.Pointer, sink_ptr: cute.Pointer, out_ptr: cute.Pointer,
        lse_ptr: cute.Pointer, zero_ptr: cute.Pointer,
        K: Int32, n_pages: Int32, page_stride: Int64, bt_w: Int32, chunk: Int32, n_split: Int32,
        len_div: Int32, rows_per_seq: Int32, n_tiles: Int32, scale_log2: Float32,
    ):
        cache = rules.PagedCache(kv_ptr, zero_ptr, n_pages, page_stride, bt_ptr, bt_w, seqlen_ptr,
                                 self.page_size, self.G, self.row_bytes(), self.has_bt, self.has_seqlen)
        # the profiling counters are the forward's alone: lse_ptr stands in for prof_ptr, never written
        self.run((qk_mma, pv_mma, pv_mma_ss), (sv_layout, sp_layout), sq_layout, sk_layout, n_tiles,
                 (idx_ptr, len_ptr, K, chunk, n_split, len_div, rows_per_seq), (cache, zero_ptr, n_split),
                 q_ptr, sink_ptr, out_ptr, lse_ptr, lse_ptr, scale_log2)

    # ------------------------------------------------------------- the hooks
    def slot_tiles(self, sched, idx_ptr, len_ptr, K, chunk, n_split, len_div, rows_per_seq):
        return scheduler.SplitSlotTiles(sched, idx_ptr, len_ptr, K, chunk, n_split, len_div, rows_per_seq)

    def tile_of(self, tiles, tile_id):
        t, g, head0, L, n_blocks, idx_row, (seq, split) = tiles.tile(tile_id, self.HG, BLOCK_H, BN, self.has_len)
        return t, g, head0, L, n_blocks, idx_row, (seq, split, tiles.n_split)

    def row_sources(self, cache, zero_ptr, n_split, g, L, row_in_pass, col0, extra):
        bt_row, lim = cache.sequence(extra[0])
        return (cache, g, L, row_in_pass, col0, bt_row, lim)

    @cute.jit
    def resolve_rows(self, base, mk, ns, b, cache, g, L, row_in_pass, col0, bt_row, lim):
        """base[m] / mk[m]: source address and mask of this thread's m-th row
        of block b (``rules.paged_block_sources``); base is the row's first
        byte for an FP8 cache (``copy_half`` adds the columns), its first
        column of this thread for a native one.  An FP8 row is read into
        registers, not copied asynchronously: its lines are prefetched into
        L2 now, a pair ahead of their loads, so that those hit L2."""
        t0 = self.timer.tick()
        col_bytes = 0 if const_expr(self.fp8) else col0 * (self.dtype.width // 8)
        rules.paged_block_sources(base, mk, ns, b, L, cache, g, bt_row, lim, col_bytes, BN, row_in_pass, 16)
        if const_expr(self.fp8):
            line = col0 // 8  # this thread's 128-byte line of each of its rows (a token spans 6)
            if line * L2_LINE < FP8_TOKEN:
                for m in cutlass.range_constexpr(BN // 16):
                    prefetch_l2(base[m] + line * L2_LINE)
        self.timer.tock(PROF_LOOKUP, t0)

    # ----------------------------------------------------------- FP8 gather
    def fill_arrivals(self, h: int) -> int:
        # FP8: each producer thread also arrives (release) after its converted stores
        return 256 if self.fp8 else 128

    def signal_fill(self, bar):
        if self.fp8:
            # the converted values were written through the generic proxy; the
            # consumers' wgmma reads them through the async proxy
            cute.arch.fence_view_async_shared()
            cute.arch.mbarrier_arrive(bar)
        cute.arch.cp_async_mbarrier_arrive_noinc(bar)

    def stage_partitions(self, thr, sK, tidx):
        """The forward's slices, and for an FP8 cache also the thread's slices
        of each stage's NoPE columns [64, 512] for the converted stores: 16
        columns (two 16-byte units) of each 128-column group, thread tid at
        row tid // 8 of a pass of 16 rows and columns 16 (tid % 8) onwards,
        so that its 16-byte global loads of e4m3 bytes are 8 threads' 128
        contiguous bytes of a row."""
        tK0, tK1 = SparseAttnFwdSm90.stage_partitions(self, thr, sK, tidx)
        if not self.fp8:
            return tK0, tK1
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        tiled = cute.make_tiled_copy_tv(atom, cute.make_ordered_layout((16, 8), order=(1, 0)),
                                        cute.make_layout((1, 16)))
        fthr = tiled.get_slice(tidx)
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.dtype)
        # a stage's NoPE columns are its first 8 column atoms: the same bytes
        # and swizzle as the stage's own layout (rows first, then columns)
        nope = cute.tile_to_shape(k_atom, (BN, FP8_NOPE), order=(0, 1))
        raw = cute.recast_ptr(sK.iterator, None)
        views = [cute.make_tensor(cute.recast_ptr(raw + s * BN * self.D, nope.inner), nope.outer) for s in (0, 1)]
        lane = tidx % 8
        return ((tK0, fthr.partition_D(views[0]), lane), (tK1, fthr.partition_D(views[1]), lane))

    @cute.jit
    def copy_half(self, atom, base, tKs, c_lo: cutlass.Constexpr, c_hi: cutlass.Constexpr):
        if const_expr(self.fp8):
            self.convert_half(atom, base, tKs, c_lo, c_hi)
        else:
            SparseAttnFwdSm90.copy_half(self, atom, base, tKs, c_lo, c_hi)

    @cute.jit
    def convert_half(self, atom, base, tKs, c_lo: cutlass.Constexpr, c_hi: cutlass.Constexpr):
        """An FP8 half stage: the NoPE columns [64 c_lo, 64 min(c_hi, 8)) of
        this thread's 4 rows loaded (all 8 loads of 16 e4m3 bytes, and the
        rows' two scales, issued before the first conversion), dequantised
        to bf16 and stored; the RoPE chunk (c_hi = 9) by cp.async from the
        token's bf16 values."""
        tK, tN, lane = tKs
        R = BN // 16
        n_lo = c_lo * 64                        # first NoPE column (byte) of the half
        groups = (min(c_hi, 8) - c_lo) * 64 // FP8_TILE  # 128-value groups: one scale each
        t0 = self.timer.tick()
        raw = cute.make_rmem_tensor((4, groups, R), Int32)
        sc = cute.make_rmem_tensor((groups, R), Float32)
        for m in cutlass.range_constexpr(R):
            for k in cutlass.range_constexpr(groups):
                src = cute.make_tensor(aligned(Int32, base[m] + (n_lo + FP8_TILE * k) + 16 * lane),
                                       cute.make_layout((4,)))
                cute.autovec_copy(src, raw[None, k, m])
        for m in cutlass.range_constexpr(R):
            src = cute.make_tensor(aligned(Float32, base[m] + (FP8_SCALES + 4 * (n_lo // FP8_TILE)), 4 * groups),
                                   cute.make_layout((groups,)))
            cute.autovec_copy(src, sc[None, m])
        if const_expr(c_hi > FP8_NOPE // 64):
            ES = self.dtype.width // 8
            for m in cutlass.range_constexpr(R):
                src = cute.make_tensor(aligned(self.dtype, base[m] + FP8_ROPE + 8 * lane * ES), cute.make_layout((8,)))
                cute.copy(atom, src, tK[None, m, FP8_NOPE // 64])
        vals = cute.make_rmem_tensor((16,), self.dtype)
        words = cute.recast_tensor(vals, Int32)
        for m in cutlass.range_constexpr(R):
            for k in cutlass.range_constexpr(groups):
                s_ = sc[k, m]
                for w in cutlass.range_constexpr(4):
                    words[2 * w] = e4m3x2_to_bf16x2(raw[w, k, m], False, s_)
                    words[2 * w + 1] = e4m3x2_to_bf16x2(raw[w, k, m], True, s_)
                cute.autovec_copy(vals, tN[None, m, n_lo // FP8_TILE + k])
        self.timer.tock(PROF_ISSUE, t0)

    @cute.jit
    def epilogue(self, acc_o, m_run, l_run, half, lane, row_lo, col_lane, sink_ptr, out_ptr, lse_ptr,
                 t, head0, extra):
        if const_expr(self.split):
            self.store_part(acc_o, m_run, l_run, half, lane, row_lo, col_lane, out_ptr, lse_ptr, t, head0,
                            extra[1], extra[2])
        else:
            SparseAttnFwdSm90.epilogue(self, acc_o, m_run, l_run, half, lane, row_lo, col_lane, sink_ptr,
                                       out_ptr, lse_ptr, t, head0, extra)

    @cute.jit
    def store_part(self, acc_o, m_run, l_run, half, lane, row_lo, col_lane, part_ptr, part_lse_ptr, t, head0,
                   split, n_split):
        """The split's part: O / l in fp32 at part[t, head, split, half * 256 + column]
        and lse2 = m + log2(l) (log2 domain, no sink) at part_lse[t, head,
        split]; a row with no valid slot in the split gets lse2 = -inf and
        no part (the merge never reads it)."""
        dvh = self.dv_half
        NO = cute.size(acc_o)
        v2 = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            l = l_run[r]
            prow = (Int64(t) * Int64(self.H) + Int64(head0 + row_lo + 8 * r)) * Int64(n_split) + Int64(split)
            if l != 0.0:
                inv = 1.0 / l
                row_ptr = part_ptr + (prow * Int64(self.d_v) + half * dvh + col_lane)
                # element 4j + 2r + e sits at column 8j + col_lane + e of row row_lo + 8r
                for j in cutlass.range_constexpr(NO // 4):
                    for e in cutlass.range_constexpr(2):
                        v2[e] = acc_o[4 * j + 2 * r + e] * inv
                    dst = cute.make_ptr(Float32, (row_ptr + 8 * j).toint(), cute.AddressSpace.gmem,
                                        assumed_align=8)
                    cute.autovec_copy(v2, cute.make_tensor(dst, cute.make_layout((2,))))
            if half == 0 and lane % 4 == 0:
                lse2 = -Float32.inf
                if l != 0.0:
                    lse2 = finite_shift(m_run[r]) + cute.math.log2(l, fastmath=False)
                cute.make_tensor(part_lse_ptr + prow, cute.make_layout((1,)))[0] = lse2
