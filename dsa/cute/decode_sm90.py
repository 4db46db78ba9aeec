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
  part, when it saw no valid slot), and the same host function then
  launches ``merge_kernel``, which combines the parts and folds the sink
  in: one call from Python launches both kernels, so a split decode costs
  the host no more than an unsplit one.

FP8 caches (``fp8_v32`` and ``fp8_model1``, laid out in ``dsa.kv_cache``):
the producer dequantises while it gathers (``convert_half``): 16-byte
global loads of e4m3 NoPE bytes into registers, all of a half stage's (and
the rows' scales) issued before the first is converted, then e4m3 -> f16
-> f32, times the token's scale (fp32, or e8m0 made fp32: exact, the
contract's fp32 value), rounded once to bf16 and stored into the same
swizzled K-major positions the bf16 gather fills; a
``fence.proxy.async`` and a release arrival then hand the stores to the
consumers' wgmma (``signal_fill``).  The RoPE bf16 columns go by cp.async
as in the forward.  Loads into registers cannot be many in flight, so the
rows' lines are prefetched into L2 when their addresses are resolved
(``resolve_rows``).

``fp8_v32`` runs lockstep (``lockstep``, the consumers and producer of
the section so named): the forward's staggered consumers each hold S, P and
half of O (216 registers), which leaves the producer room for one half
stage of loads, and each half then waits out a load round trip.  In
lockstep consumer 1 holds only its half of O (160), and the producer (136)
keeps two half stages of e4m3 loads in flight: 0.80-0.93 of the staggered
build's time on the H200 (bench/RESULTS.md C171).

A lockstep build may have two producer warpgroups (``dual``, the caches of
``DUAL_CACHES``): warpgroup 3 is a second producer, so that two warps a
scheduler issue the conversions, and producer p gathers rows 32 p to
32 p + 31 of every block (two buffers of two rows a thread).  Both fill
every half; the first alone loads Q.  The CTA has 512 threads launched
with 128 registers each: 2 x 72 + 208 + 160, and P V is two wgmma of 128
columns (one of 256 needs more than 128 registers).

A lockstep build of 128 heads a kv head may run ``crossover``: the two
64-head blocks of a (token, split) are a cluster of two CTAs, and CTA r
gathers and converts only rows 32 r to 32 r + 31 of every block, into its
own stages and the other CTA's (one ``cp.async.bulk`` a 64-column chunk
once its producers have met; the RoPE units through registers).  Thread 0 expects the other
CTA's bytes on each half's full barrier, each empty barrier also counts
one arrival from each of the other CTA's consumer warps, and the CTAs meet
after the barriers' set-up and before exit.  On by default for the caches
of ``CROSSOVER_CACHES``.

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
from dsa.cute.gmem import aligned, load
from dsa.cute.pipeline import freed_phase, phase
from dsa.cute.rules import LN2, LOG2E, finite_shift
from dsa.cute.sparse_attention_sm90 import (
    BLOCK_H,
    BN,
    CONSUMER_REGS,
    L_CHUNKS,
    PROF_EMPTY,
    PROF_BAR,
    PROF_ISSUE,
    PROF_LOOKUP,
    PROF_Q,
    PROF_WGMMA,
    MASK_WRITERS,
    PRODUCER_REGS,
    SparseAttnFwdSm90,
)
from dsa.kv_cache import FORMATS

NATIVE = "native"
FP8_V32 = "fp8_v32"
FP8_MODEL1 = "fp8_model1"
CACHES = (NATIVE, FP8_V32, FP8_MODEL1)
MERGE_THREADS = 128  # a merge CTA: one thread a (token, head, 4 value columns)
MERGE_VEC = 4
MERGE_UNROLL = 4  # parts a merge thread loads before using them
GROUP = 128    # NoPE columns a row's 8 gathering threads load at once: 16 e4m3 bytes each
L2_LINE = 128

# Registers a thread (setmaxnreg) for an FP8 cache, producer / consumers
# (one figure for both, or consumer 0's and consumer 1's): the producer holds
# e4m3 bytes and scales while it converts them, so it takes more than the
# bf16 gather's 56.  The producer and the consumers must not sum past 3 x
# the registers the CTA was launched with (LAUNCH_REGS, 168 at 384 threads:
# 504), or a consumer's setmaxnreg.inc waits forever for registers the CTA
# does not hold.  fp8_v32 runs lockstep (``lockstep``): its producer keeps
# two half stages of loads in flight (two buffers of 4 rows x 32 bytes and
# their scales), consumer 0 holds S, P and the left O, consumer 1 only the
# right O.  Staggered (both consumers at 216): fp8_v32 no spill at 72 / 216;
# fp8_model1, whose producer also holds each row's page offset and scale
# record, none at 96 / 200 (ptxas, sm_90a; 12 bytes in an H 128 split build
# at 96 / 200, 40 at 88 / 208 split).
FP8_REGS = {FP8_V32: (72, 216), FP8_MODEL1: (96, 200)}
LOCKSTEP_REGS = (136, (208, 160))  # no spill in any build of tests/test_cute_decode.py
# the caches a decode runs lockstep on by default (``lockstep``)
LOCKSTEP_CACHES = (FP8_V32,)
# dual: a lockstep build with a second producer warpgroup (warpgroup 3; 512
# threads launched with 128 registers each), each producer gathering half of
# every block's rows (32 of 64: two buffers of 2 rows a thread), so that two
# warps a scheduler issue the conversions.  2 x 72 + 208 + 160 = 4 x 128.
DUAL_REGS = (72, (208, 160))
# the lockstep caches a decode runs dual on by default: fp8_v32 ran 1.02-1.10x as fast as with one producer
# (bench/RESULTS.md C224, bitwise the same outputs)
DUAL_CACHES = (FP8_V32,)
# the dual caches a decode of 128 heads a kv head (or a multiple) runs crossover on by default: fp8_v32
# through a block table ran 1.11-1.13x as fast as dual at B >= 32 (0.99x at B1, 16 splits), the same bits,
# and on FlashMLA's slots 1.07-1.12x, though a producer spills 8 bytes there (bench/RESULTS.md C229, C230)
CROSSOVER_CACHES = (FP8_V32,)
PEER_BARRIER = 6  # the named barrier the producers of a CTA meet on before a bulk hand-over


def warpgroup_regs(cache: str, lockstep: bool = False, dual: bool = False):
    """(producer, consumers) setmaxnreg targets of a build: consumers is one
    figure for both or a pair (consumer 0, consumer 1); a dual build's
    producer figure is each of its two producers' (a crossover build's too)."""
    if dual:
        return DUAL_REGS
    if lockstep:
        return LOCKSTEP_REGS
    if cache == NATIVE:
        return PRODUCER_REGS, CONSUMER_REGS
    return FP8_REGS[cache]


def regs_sum(cache: str, lockstep: bool = False, dual: bool = False) -> int:
    """What the warpgroups' targets of a build add up to (at most the launch's
    registers times its warpgroups)."""
    p, c = warpgroup_regs(cache, lockstep, dual)
    return p * (2 if dual else 1) + (2 * c if isinstance(c, int) else sum(c))


def _e4m3x2_asm(upper: bool, product: str) -> str:
    """PTX for two e4m3 bytes of $1's lower (upper) half made the two fp32
    fx, fy (exact, through f16), then ``product``: the scaling and rounding
    into bf16x2 $0 (the lower byte in the lower half)."""
    return ("{\n.reg .b16 lo, hi;\n.reg .b32 h2;\n.reg .f16 x, y;\n.reg .f32 fx, fy;\n"
            "mov.b32 {lo, hi}, $1;\n"
            f"cvt.rn.f16x2.e4m3x2 h2, {'hi' if upper else 'lo'};\n"
            "mov.b32 {x, y}, h2;\n"
            "cvt.f32.f16 fx, x;\ncvt.f32.f16 fy, y;\n" + product + "}")


@dsl_user_op
def e4m3x2_to_bf16x2(word: Int32, upper: bool, scale: Float32, *, loc=None, ip=None) -> Int32:
    """The two e4m3 bytes of ``word``'s lower (upper) half, each times
    ``scale``, as bf16x2 (the lower byte in the lower half): e4m3 -> f16 is
    exact, f16 -> f32 is exact, the fp32 product is the contract's dequantised
    value (exact for a power-of-two scale), and it is rounded once to bf16.
    A NaN byte (0x7F / 0xFF) stays NaN."""
    asm = _e4m3x2_asm(upper, "mul.rn.f32 fx, fx, $2;\nmul.rn.f32 fy, fy, $2;\ncvt.rn.bf16x2.f32 $0, fy, fx;\n")
    operands = [Int32(word).ir_value(loc=loc, ip=ip), Float32(scale).ir_value(loc=loc, ip=ip)]
    return Int32(llvm.inline_asm(T.i32(), operands, asm, "=r,r,f", has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def e4m3x2_times_bf16x2(word: Int32, upper: bool, scale2: Int32, *, loc=None, ip=None) -> Int32:
    """``e4m3x2_to_bf16x2`` for a scale that is a bf16 value (its fp32 bits'
    low 16 are zero; ``scale2`` holds it twice as bf16x2): each byte made
    bf16 (exact), then one bf16x2 product, rounded once.  The same bits with
    one instruction fewer a pair: an e4m3 value's lowest bit is at least
    2^-9 and a bf16 value's at least 2^-133, so the fp32 product is exact
    too, and both orders round the exact product once.  A NaN byte stays
    NaN."""
    asm = _e4m3x2_asm(upper, "cvt.rn.bf16x2.f32 h2, fy, fx;\nmul.rn.bf16x2 $0, h2, $2;\n")
    operands = [Int32(word).ir_value(loc=loc, ip=ip), Int32(scale2).ir_value(loc=loc, ip=ip)]
    return Int32(llvm.inline_asm(T.i32(), operands, asm, "=r,r,r", has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def bf16x2_of(scale: Float32, *, loc=None, ip=None) -> Int32:
    """scale rounded to bf16, in both halves (exact for a bf16 value)."""
    return Int32(llvm.inline_asm(T.i32(), [Float32(scale).ir_value(loc=loc, ip=ip)],
                                 "cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,f", has_side_effects=False,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def e8m0_to_f32(byte: Int32, *, loc=None, ip=None) -> Float32:
    """An e8m0 scale byte b (0..255) as fp32: 2^(b - 127), NaN for 255 (b = 0
    is 2^-127, an fp32 subnormal)."""
    asm = ("{\n.reg .pred z, n;\n.reg .b32 r;\n"
           "shl.b32 r, $1, 23;\n"
           "setp.eq.u32 z, $1, 0;\nsetp.eq.u32 n, $1, 255;\n"
           "selp.b32 r, 0x00400000, r, z;\nselp.b32 r, 0x7FFFFFFF, r, n;\n"
           "mov.b32 $0, r;\n}")
    return Float32(llvm.inline_asm(T.f32(), [Int32(byte).ir_value(loc=loc, ip=ip)], asm, "=f,r",
                                   has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def prefetch_l2(addr: Int64, *, loc=None, ip=None) -> None:
    """Bring the 128-byte line holding global byte address ``addr`` into L2."""
    llvm.inline_asm(res=None, operands_=[Int64(addr).ir_value(loc=loc, ip=ip)],
                    asm_string="prefetch.global.L2 [$0];", constraints="l", has_side_effects=True,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def peer_address(addr: Int32, rank: Int32, *, loc=None, ip=None) -> Int32:
    """The shared::cluster address in CTA ``rank`` of the cluster of this
    CTA's shared-memory byte address ``addr`` (``mapa``)."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(addr).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip)],
                                 "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r", has_side_effects=False,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def arrive_remote(bar: Int32, *, loc=None, ip=None) -> None:
    """An arrival on the mbarrier at shared::cluster address ``bar`` (of
    another CTA of the cluster), at CTA scope: it frees a buffer whose reads
    have retired and carries no data, and a cluster-scope release would
    cost a GPU-wide fence."""
    llvm.inline_asm(None, [Int32(bar).ir_value(loc=loc, ip=ip)],
                    "mbarrier.arrive.shared::cluster.b64 _, [$0];", "r", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def copy_to_peer(dst: Int32, src: Int32, size: int, bar: Int32, *, loc=None, ip=None) -> None:
    """``size`` bytes of this CTA's shared memory at ``src`` to the shared::cluster
    address ``dst`` of another CTA, counted on its mbarrier at ``bar``
    (``cp.async.bulk``: the async proxy reads the source)."""
    ops = [Int32(x).ir_value(loc=loc, ip=ip) for x in (dst, src, size, bar)]
    llvm.inline_asm(None, ops, "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes "
                    "[$0], [$1], $2, [$3];", "r,r,r,r", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def peer_rank():
    """The other CTA's rank in a cluster of two."""
    return 1 - cute.arch.block_idx_in_cluster()


@dataclass(frozen=True)
class DecodeSm90Config(scheduler.ProblemConfig):
    """The static configuration of one compiled decode kernel (its compile
    key): the problem, then has_sink, cache ("native", "fp8_v32" or "fp8_model1"),
    page_size (tokens a page; 1 for a flat cache), has_bt (indices are
    positions through a block table), has_seqlen (seq_lens cut them),
    split (several splits a row: the kernel writes parts for the merge) and
    lockstep (consumer 0 computes every S, consumer 1 only half of P V, and
    the producer keeps two half stages of loads in flight; ``fp8_v32``), dual
    (a lockstep build with two producer warpgroups, each gathering half of
    every block's rows) and crossover (a lockstep build whose CTAs run in
    clusters of two, the two 64-head blocks of a (token, split), each
    converting half of every block's rows into both CTAs' stages)."""

    has_sink: bool
    cache: str
    page_size: int
    has_bt: bool
    has_seqlen: bool
    split: bool
    lockstep: bool = False
    dual: bool = False
    crossover: bool = False


def decode_reason(dtype, D: int, d_v: int, H: int, G: int, cache: str, page_size: int, has_bt: bool,
                  has_seqlen: bool, lockstep: bool = False, dual: bool = False,
                  crossover: bool = False) -> Optional[str]:
    """Why the decode kernel cannot serve this configuration (None if it can)."""
    why = SparseAttnFwdSm90.can_implement(dtype, D, d_v, H, G)
    if why is not None:
        return why
    if (H // G) % BLOCK_H:
        return (f"{H // G} query heads per kv head: the cute decode needs a multiple of {BLOCK_H} "
                f"(its split parts are not written for padded tiles)")
    if cache not in CACHES:
        return f"cache format {cache!r}: the cute decode reads {CACHES}"
    if cache != NATIVE:
        if dtype is not cutlass.BFloat16:
            return (f"q dtype {dtype} with {cache}: the cute decode dequantises FP8 to bf16 "
                    f"(fp16 cannot hold every scaled value); use bf16 q")
        fmt = FORMATS[cache]
        if D != fmt.D or G != 1:
            return f"{cache} holds one kv head of D = {fmt.D}, got D={D}, H_kv={G}"
    if page_size < 1:
        return f"page_size {page_size} < 1"
    if has_seqlen and not has_bt:
        return "seq_lens without a block table"
    if lockstep and cache != FP8_V32:
        return f"the lockstep decode converts fp8_v32 rows, not {cache!r}"
    if dual and not lockstep:
        return "the dual-producer decode is a lockstep build"
    if crossover and not dual:
        # with one producer warpgroup of 136 registers, the bulk hand-over spills (10 bytes, ptxas sm_90a)
        return "the crossover decode is a dual-producer build"
    if crossover and (H // G) % (2 * BLOCK_H):
        return f"{H // G} query heads per kv head: the crossover decode pairs blocks of {BLOCK_H} heads"
    return None


class SparseDecodeSm90(SparseAttnFwdSm90):
    """Host-side builder of the decode kernel for one static configuration."""

    def __init__(self, dtype, D: int, d_v: int, H: int, G: int, has_len: bool, has_sink: bool, cache: str,
                 page_size: int, has_bt: bool, has_seqlen: bool, split: bool, lockstep: bool = False,
                 dual: bool = False, crossover: bool = False):
        why = decode_reason(dtype, D, d_v, H, G, cache, page_size, has_bt, has_seqlen, lockstep, dual, crossover)
        if why is not None:
            raise ValueError(f"SparseDecodeSm90: {why}")
        super().__init__(dtype, D, d_v, H, G, has_len, has_sink)
        self.config = DecodeSm90Config(dtype, D, d_v, H, G, has_len, has_sink, cache, page_size, has_bt,
                                       has_seqlen, split, lockstep, dual, crossover)
        self.cache, self.page_size = cache, page_size
        self.has_bt, self.has_seqlen, self.split = has_bt, has_seqlen, split
        self.fp8 = cache != NATIVE
        self.fmt = FORMATS[cache] if self.fp8 else None  # the FP8 layout (dsa.kv_cache)
        self.lockstep, self.dual, self.crossover = lockstep, dual, crossover
        self.producer_wgs = 2 if dual else 1
        # the parts of a block's rows: one a producer warpgroup of each CTA of the cluster
        self.parts = self.producer_wgs * (2 if crossover else 1)
        # rows of a block a producer thread gathers: one of each 16-row pass of its part
        self.R = BN // 16 // self.parts
        if self.fp8:
            self.producer_regs, self.consumer_regs = warpgroup_regs(cache, lockstep, dual)

    @classmethod
    def from_config(cls, config: DecodeSm90Config) -> "SparseDecodeSm90":
        return cls(**{f.name: getattr(config, f.name) for f in fields(config)})

    def row_bytes(self) -> int:
        """Bytes of one (token, kv head) row of the cache."""
        return self.fmt.token_bytes if self.fp8 else self.D * (self.dtype.width // 8)

    def zero_row_bytes(self) -> int:
        """Bytes of the row invalid slots read: a row, and for per-page scales
        (fp8_model1) the page's records up to token 0's scales, which an
        invalid slot reads at that place."""
        if self.fp8 and self.fmt.per_page:
            return self.fmt.scale_base(self.page_size) + self.fmt.scale_record
        return self.row_bytes()

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        bt_ptr: cute.Pointer, seqlen_ptr: cute.Pointer, sink_ptr: cute.Pointer, out_ptr: cute.Pointer,
        lse_ptr: cute.Pointer, zero_ptr: cute.Pointer, fin_out_ptr: cute.Pointer, fin_lse_ptr: cute.Pointer,
        T: Int32, K: Int32, n_pages: Int32, page_stride: Int64, bt_w: Int32, chunk: Int32, n_split: Int32,
        len_div: Int32, rows_per_seq: Int32, scale_log2: Float32, n_cta: Int32, stream,
    ):
        """The decode, and with splits its merge: out_ptr and lse_ptr are then
        the parts' workspace, and the merge writes fin_out_ptr [T, H, d_v] and
        fin_lse_ptr [T, H] (unused without splits)."""
        mmas, layouts = self.operands()
        n_tiles = scheduler.tile_count(T, self.G, self.HG // BLOCK_H) * n_split
        kernel = self.kernel(
            *mmas, *layouts,
            q_ptr, kv_ptr, idx_ptr, len_ptr, bt_ptr, seqlen_ptr, sink_ptr, out_ptr, lse_ptr, zero_ptr,
            K, n_pages, page_stride, bt_w, chunk, n_split, len_div, rows_per_seq, n_tiles, scale_log2,
        )
        if const_expr(self.crossover):
            # CTAs 2c and 2c + 1 are a cluster: tiles are numbered head blocks fastest, so with an even
            # grid the two take the two head blocks of one (token, split) at every step
            kernel.launch(grid=[scheduler.grid_size(n_cta // 2 * 2, n_tiles), 1, 1], block=[self.threads(), 1, 1],
                          cluster=[2, 1, 1], stream=stream, min_blocks_per_mp=1)
        else:
            kernel.launch(grid=[scheduler.grid_size(n_cta, n_tiles), 1, 1], block=[self.threads(), 1, 1],
                          stream=stream, min_blocks_per_mp=1)
        if const_expr(self.split):
            n_units = T * (self.H * (self.d_v // MERGE_VEC))
            # a programmatic dependent launch: the merge's CTAs start on the SMs the decode leaves free
            # and wait (griddepcontrol.wait) for its end, so its launch latency hides behind the decode
            self.merge_kernel(out_ptr, lse_ptr, sink_ptr, fin_out_ptr, fin_lse_ptr, n_units, n_split).launch(
                grid=[(n_units + MERGE_THREADS - 1) // MERGE_THREADS, 1, 1], block=[MERGE_THREADS, 1, 1],
                stream=stream, use_pdl=True)

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
        if const_expr(self.split):
            # the merge (a programmatic dependent launch) may start now: it waits for this grid's end itself
            cute.arch.griddepcontrol_launch_dependents()
        cache = rules.PagedCache(kv_ptr, zero_ptr, n_pages, page_stride, bt_ptr, bt_w, seqlen_ptr,
                                 self.page_size, self.G, self.row_bytes(), self.has_bt, self.has_seqlen)
        # the profiling counters are the forward's alone: lse_ptr stands in for prof_ptr, never written
        self.run((qk_mma, pv_mma, pv_mma_ss), (sv_layout, sp_layout), sq_layout, sk_layout, n_tiles,
                 (idx_ptr, len_ptr, K, chunk, n_split, len_div, rows_per_seq), (cache, zero_ptr, n_split),
                 q_ptr, sink_ptr, out_ptr, lse_ptr, lse_ptr, scale_log2)

    @cute.kernel
    def merge_kernel(self, part_ptr: cute.Pointer, part_lse_ptr: cute.Pointer, sink_ptr: cute.Pointer,
                     out_ptr: cute.Pointer, lse_ptr: cute.Pointer, n_units: Int32, n_split: Int32):
        """out[t, h, c:c + 4] (q.dtype) and lse[t, h] (natural log, sink
        excluded, +inf on an empty row) from the n_split parts of (t, h): a
        thread a unit (t, h, c).  The parts are weighted by exp2(lse2_s - m),
        m their largest lse2; a part with lse2 = -inf was never written and
        does not count (it is loaded and dropped); the sink scales the row by
        exp(lse) / (exp(lse) + exp(sink)).  A NaN part or lse makes the row NaN."""
        # launched as the decode's programmatic dependent: its parts are complete and visible past this
        cute.arch.griddepcontrol_wait()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        u = bidx * MERGE_THREADS + tidx
        if u < n_units:
            per_row = self.d_v // MERGE_VEC
            th = u // per_row          # t * H + h
            c = (u - th * per_row) * MERGE_VEC
            rows = Int64(th) * Int64(n_split)
            plse = cute.make_tensor(part_lse_ptr + rows, cute.make_layout((n_split,)))
            # unrolled and branch-free, so that the loads of several parts are in flight at once
            m = -Float32.inf
            for s in cutlass.range(n_split, unroll=MERGE_UNROLL):
                m = cute.arch.fmax(m, plse[s])
            m = finite_shift(m)
            acc = cute.make_rmem_tensor((MERGE_VEC,), Float32)
            acc.fill(0.0)
            part = cute.make_rmem_tensor((MERGE_VEC,), Float32)
            l = Float32(0.0)
            for s in cutlass.range(n_split, unroll=MERGE_UNROLL):
                ls = plse[s]
                w = cute.math.exp2(ls - m, fastmath=False)  # 0 for a part with lse2 = -inf
                l = l + w
                # an unwritten part is loaded but never used: a select, not a product, drops it
                src = aligned(Float32, (part_ptr + ((rows + s) * Int64(self.d_v) + c)).toint())
                cute.autovec_copy(cute.make_tensor(src, cute.make_layout((MERGE_VEC,))), part)
                written = ls != -Float32.inf
                for i in cutlass.range_constexpr(MERGE_VEC):
                    acc[i] = Float32(cutlass.select_(written, acc[i] + w * part[i], acc[i]))
            lse2 = -Float32.inf
            f = Float32(0.0)
            if l != 0.0:
                lse2 = m + cute.math.log2(l, fastmath=False)
                f = 1.0 / l
                if const_expr(self.has_sink):
                    # sink * log2(e) above the float range is +inf: the row is then 0
                    s2 = load(sink_ptr, Int64(th % self.H)) * LOG2E
                    f = f / (1.0 + cute.math.exp2(s2 - lse2, fastmath=False))
            res = cute.make_rmem_tensor((MERGE_VEC,), self.dtype)
            for i in cutlass.range_constexpr(MERGE_VEC):
                res[i] = (acc[i] * f).to(self.dtype)
            dst = cute.make_ptr(self.dtype, (out_ptr + (Int64(th) * Int64(self.d_v) + c)).toint(),
                                cute.AddressSpace.gmem, assumed_align=8)
            cute.autovec_copy(res, cute.make_tensor(dst, cute.make_layout((MERGE_VEC,))))
            if c == 0:
                lse = Float32.inf
                if lse2 != -Float32.inf:
                    lse = lse2 * LN2
                cute.make_tensor(lse_ptr + Int64(th), cute.make_layout((1,)))[0] = lse

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
        if const_expr(not self.fp8):
            rules.paged_block_sources(base, mk, ns, b, L, cache, g, bt_row, lim, col0 * (self.dtype.width // 8),
                                      BN, row_in_pass, 16)
        elif const_expr(not self.fmt.per_page):
            rules.paged_block_sources(base, mk, ns, b, L, cache, g, bt_row, lim, 0, BN, row_in_pass, 16)
            self.prefetch_rows(base, None, col0 // 8)
        else:
            addr, offs = base
            rules.paged_block_sources(addr, mk, ns, b, L, cache, g, bt_row, lim, 0, BN, row_in_pass, 16, offs)
            self.prefetch_rows(addr, offs, col0 // 8)
        self.timer.tock(PROF_LOOKUP, t0)

    @cute.jit
    def prefetch_rows(self, addr, offs, lane):
        """This thread's 128-byte line ``lane`` of each of its 4 rows into L2
        (a token record spans 5 or 6 lines); with per-page scales, the next
        lane takes the rows' scale records."""
        f = self.fmt
        lines = -(-f.token_bytes // L2_LINE)
        if lane < lines:
            for m in cutlass.range_constexpr(self.R):
                prefetch_l2(addr[m] + lane * L2_LINE)
        if const_expr(f.per_page):
            if lane == lines:
                for m in cutlass.range_constexpr(self.R):
                    prefetch_l2(addr[m] + self.scale_offset(offs[m]))

    def scale_offset(self, off):
        """Bytes from a token's record to its scale record, for per-page
        scales: token o's record is at o * token_bytes of its page, its
        scales at scale_base + o * scale_record."""
        f = self.fmt
        return Int64(f.scale_base(self.page_size)) + Int64(off) * (f.scale_record - f.token_bytes)

    # ------------------------------------------------------------ lockstep
    # fp8_v32: consumer 0 computes each block's S, its softmax and the left
    # 256 value columns; it leaves P (in the stage's RoPE columns for stage 0,
    # the P buffer for stage 1) and the block's row maxima (sM, by stage) for
    # consumer 1 and arrives on the stage's ``ready`` barrier; consumer 1
    # rescales its O and adds P V over the right 256 columns.  The halves free
    # in stage order (L by consumer 0 once its P V retires, R by consumer 1),
    # and the producer fills them in that order with the next half's loads
    # already in flight.  Consumer 1 holds only its O (160 registers), and
    # what it leaves goes to the producer: two half stages of e4m3 bytes in
    # registers instead of one, so a half's load round trip overlaps the wait
    # for the half before.
    @cute.jit
    def consumer(self, w: cutlass.Constexpr, qk_mma, pv_mma, pv_mma_ss, sv_layout, sp_layout, wtid,
                 sQ, sK, sP, sM, sL, sOk, bars, tiles, sink_ptr, out_ptr, lse_ptr, scale_log2, bound_args=None):
        if const_expr(not self.lockstep):
            SparseAttnFwdSm90.consumer(self, w, qk_mma, pv_mma, pv_mma_ss, sv_layout, sp_layout, wtid, sQ, sK, sP,
                                       sM, sL, sOk, bars, tiles, sink_ptr, out_ptr, lse_ptr, scale_log2,
                                       bound_args)
        else:
            self.lockstep_consumer(w, qk_mma, pv_mma, pv_mma_ss, sv_layout, sp_layout, wtid, sQ, sK, sP, sM, sL,
                                   sOk, bars, tiles, sink_ptr, out_ptr, lse_ptr, scale_log2)

    def lockstep_views(self, w: int, pv_mma, pv_mma_ss, sv_layout, sp_layout, wtid, sK, sP):
        """Consumer w's operands of both stages: consumer 0, P's stores (C
        layout of S) and the left V (B of P V with P from registers);
        consumer 1, P and the right V (both from shared memory)."""
        raw = cute.recast_ptr(sK.iterator, None)
        p_raw = cute.recast_ptr(sP, None)
        if const_expr(self.D > self.d_v):
            p_ptrs = (raw + BN * self.d_v, p_raw)   # stage 0's P in its RoPE columns
        else:
            p_ptrs = (p_raw + BLOCK_H * BN, p_raw)
        ps = [cute.make_tensor(cute.recast_ptr(pp, sp_layout.inner), sp_layout.outer) for pp in p_ptrs]
        vs = [cute.make_tensor(cute.recast_ptr(raw + (s * BN * self.D + w * BN * self.dv_half), sv_layout.inner),
                               sv_layout.outer) for s in range(2)]
        if const_expr(w == 0):
            return None, [pv_mma.make_fragment_B(pv_mma.get_slice(wtid).partition_B(v)) for v in vs], ps
        thr = pv_mma_ss.get_slice(wtid)
        return ([pv_mma_ss.make_fragment_A(thr.partition_A(p)) for p in ps],
                [pv_mma_ss.make_fragment_B(thr.partition_B(v)) for v in vs], None)

    @cute.jit
    def lockstep_consumer(self, w: cutlass.Constexpr, qk_mma, pv_mma, pv_mma_ss, sv_layout, sp_layout, wtid,
                          sQ, sK, sP, sM, sL, sOk, bars, tiles, sink_ptr, out_ptr, lse_ptr, scale_log2):
        q_full, q_empty, full, empty = bars
        ready = empty + 4  # the Smem struct's ``ready``, right after ``empty``
        sched = tiles.sched
        cs = self.consumer_state(w, qk_mma, pv_mma, pv_mma_ss, sv_layout, sp_layout, wtid, sQ, sK, sP, sM, sOk,
                                 bars, scale_log2)
        tOrP, tOrV, ps = self.lockstep_views(w, pv_mma, pv_mma_ss, sv_layout, sp_layout, wtid, sK, sP)
        tPs = None
        if const_expr(w == 0):
            thr_qk = qk_mma.get_slice(wtid)
            tPs = [thr_qk.partition_C(p) for p in ps]
        u0 = Int32(0)  # uses of stage 0 / stage 1 by earlier tiles
        u1 = Int32(0)
        j = Int32(0)   # tiles done
        for tile_id in cutlass.range(sched.first, sched.n_tiles, sched.stride, unroll=1):
            t, g, head0, L, n_blocks, idx_row, extra = self.begin_tile(cs, tiles, tile_id)
            n_full = n_blocks // 2
            if const_expr(w == 0):
                self.timer.wait_mbarrier(q_full, phase(j), PROF_Q)
                if n_blocks > 0:
                    self.qk(cs, 0, 0, phase(u0), True, release=False)
                for i in cutlass.range(n_full, unroll=1):
                    self.lockstep0(cs, 0, tPs, tOrV, ready, 2 * i, n_blocks, phase(u1 + i))
                    self.lockstep0(cs, 1, tPs, tOrV, ready, 2 * i + 1, n_blocks, phase(u0 + i + 1))
                if n_blocks % 2 == 1:
                    self.lockstep0(cs, 0, tPs, tOrV, ready, n_blocks - 1, n_blocks, phase(u1 + n_full))
            else:
                for i in cutlass.range(n_full, unroll=1):
                    self.lockstep1(cs, 0, tOrP, tOrV, ready, phase(u0 + i))
                    self.lockstep1(cs, 1, tOrP, tOrV, ready, phase(u1 + i))
                if n_blocks % 2 == 1:
                    self.lockstep1(cs, 0, tOrP, tOrV, ready, phase(u0 + n_full))
            cute.arch.mbarrier_arrive(q_empty)  # Q may be refilled
            self.tile_end(w, cs, sL + (j % 2) * (2 * BLOCK_H), sink_ptr, out_ptr, lse_ptr, t, head0, extra)
            u0 = u0 + (n_blocks + 1) // 2
            u1 = u1 + n_full
            j = j + 1

    @cute.jit
    def lockstep0(self, cs, s: cutlass.Constexpr, tPs, tOrV, ready, b, n_blocks, ph_next):
        """Consumer 0, block b in stage s (its masked S in acc_s): the row
        maxima and P for consumer 1, then O += P V over the left columns with
        the next block's S behind it (which releases this stage's L once the
        P V retires).  ph_next: the phase of the next block's stage."""
        acc_s, m_run, row_lo = cs.acc_s, cs.m_run, cs.row_lo
        m_s = cs.m0 if s == 0 else cs.m1
        mx = cute.make_rmem_tensor((2,), Float32)
        self.row_max(acc_s, mx)
        for r in cutlass.range_constexpr(2):
            mx[r] = cute.arch.fmax(mx[r], m_run[r])
            if cs.lane % 4 == 0:
                m_s[row_lo + 8 * r] = mx[r]
        self.softmax(cs, mx)
        self.store_p(cs.r_p, acc_s, tPs[s])
        cute.arch.mbarrier_arrive(ready + s)
        self.pv(cs.pv_mma, cs.acc_o, cs.r_p, tOrV[s])
        if b + 1 < n_blocks:
            self.qk(cs, 1 - s, 0, ph_next, True, release=True)
        else:
            self.timer.wait_wgmma(0, PROF_WGMMA)
            self.release(cs, 2 * s)

    @cute.jit
    def lockstep1(self, cs, s: cutlass.Constexpr, tOrP, tOrV, ready, ph):
        """Consumer 1, the block in stage s: O rescaled to consumer 0's new row
        maxima, then O += P V over the right columns; releases the stage's R."""
        acc_o, m_run, l_run, row_lo = cs.acc_o, cs.m_run, cs.l_run, cs.row_lo
        m_s = cs.m0 if s == 0 else cs.m1
        self.timer.wait_mbarrier(ready + s, ph, PROF_BAR)
        alpha = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            mx = m_s[row_lo + 8 * r]
            alpha[r] = cute.math.exp2(m_run[r] - finite_shift(mx), fastmath=True)
            l_run[r] = l_run[r] * alpha[r]
            m_run[r] = mx
        self.rescale_o(acc_o, alpha)
        self.pv(cs.pv_mma_ss, acc_o, tOrP[s], tOrV[s])
        self.timer.wait_wgmma(0, PROF_WGMMA)
        self.release(cs, 2 * s + 1)

    @cute.jit
    def producer(self, tidx, sQ, sK, sOk, bars, tiles, q_ptr, kv_ptr, zero_ptr, N):
        if const_expr(not self.lockstep):
            SparseAttnFwdSm90.producer(self, tidx, sQ, sK, sOk, bars, tiles, q_ptr, kv_ptr, zero_ptr, N)
        else:
            self.lockstep_producer(tidx, sQ, sK, sOk, bars, tiles, q_ptr, kv_ptr, zero_ptr, N)

    @cute.jit
    def lockstep_producer(self, tidx, sQ, sK, sOk, bars, tiles, q_ptr, kv_ptr, zero_ptr, N):
        """The halves in the order the lockstep consumers free them (L0, R0,
        L1, R1 a pair), each converted from loads issued before the wait for
        the half ahead of it: buffer A carries the L halves, B the R halves.
        A pair's stage-0 rows are resolved once its R0 is stored, so the next
        pair's L0 and R0 loads leave before this pair's L1 and R1 wait."""
        q_full, q_empty, full, empty = bars
        sched = tiles.sched
        ps = self.producer_state(tidx, sK, sOk)
        atom, thr, row_in_pass, col0, tK0, tK1, base0, base1, masks, ns0, ns1 = ps
        mk0, mk1 = masks[0], masks[1]
        CH = self.D // 64
        buf_a = self.half_buffers(0, L_CHUNKS)
        buf_b = self.half_buffers(L_CHUNKS, CH)
        # crossover: where half h's copies go in the other CTA, and the barrier that counts them there
        pr = [None] * 4
        if const_expr(self.crossover):
            here = Int32(cute.recast_ptr(sK.iterator, None).toint())
            delta = peer_address(here, peer_rank()) - here
            # the barrier's address is made at each use: four more live registers spill in some builds
            pr = [(delta, full + h) for h in range(4)]
        # Q's rows are the copier's own (tidx // 8), whatever block rows the thread gathers
        q_row = row_in_pass % 16 if const_expr(self.crossover) else row_in_pass
        u0 = Int32(0)
        u1 = Int32(0)
        j = Int32(0)
        for tile_id in cutlass.range(sched.first, sched.n_tiles, sched.stride, unroll=1):
            t, head0, L, n_blocks, idx_row, rows, n_pairs = self.start_tile(tiles, tile_id, ps, kv_ptr, zero_ptr, N)
            if n_pairs > 0:
                self.fetch_rows(ns0, 2, idx_row, L, row_in_pass)
                self.fetch_rows(ns1, 3, idx_row, L, row_in_pass)
                self.ahead(base0, tK0, buf_a, 0, L_CHUNKS)
                self.ahead(base0, tK0, buf_b, L_CHUNKS, CH)
            if tidx < 128:
                # the first producer warpgroup loads Q (its copier's rows are its own, tidx // 8), once both
                # consumers are past their last S of the previous tile
                if j > 0:
                    self.timer.wait_mbarrier(q_empty, freed_phase(j), PROF_Q)
                self.load_q(atom, thr, sQ, q_full, q_ptr, zero_ptr, t, head0, q_row, col0)
            for i in cutlass.range(n_pairs, unroll=1):
                has1 = 2 * i + 1 < n_blocks
                more = 2 * i + 2 < n_blocks
                n0 = u0 + i
                n1 = u1 + i
                if n0 > 0:
                    self.timer.wait_mbarrier(empty + 0, freed_phase(n0), PROF_EMPTY)
                self.swap(atom, base0, tK0, buf_a, 0, L_CHUNKS, n0, base1, tK1, has1)
                self.expect_peer(tidx, full, 0)
                self.signal_fill(full + 0)
                self.publish_rows(masks, 0, full + 0, base0, zero_ptr)
                self.send_half(tidx, sK, masks, 0, pr[0])
                if n0 > 0:
                    self.timer.wait_mbarrier(empty + 1, freed_phase(n0), PROF_EMPTY)
                self.swap(atom, base0, tK0, buf_b, L_CHUNKS, CH, n0, base1, tK1, has1)
                self.expect_peer(tidx, full, 1)
                # before this CTA's arrivals: consumer 0 writes its P over this half's RoPE columns
                self.send_half(tidx, sK, masks, 1, pr[1])
                self.signal_fill(full + 1)
                self.resolve_rows(base0, mk0, ns0, 2 * i + 2, *rows)
                if has1:
                    if n1 > 0:
                        self.timer.wait_mbarrier(empty + 2, freed_phase(n1), PROF_EMPTY)
                    self.swap(atom, base1, tK1, buf_a, 0, L_CHUNKS, n1, base0, tK0, more)
                    self.expect_peer(tidx, full, 2)
                    self.signal_fill(full + 2)
                    self.send_half(tidx, sK, masks, 2, pr[2])
                    if n1 > 0:
                        self.timer.wait_mbarrier(empty + 3, freed_phase(n1), PROF_EMPTY)
                    self.swap(atom, base1, tK1, buf_b, L_CHUNKS, CH, n1, base0, tK0, more)
                    self.expect_peer(tidx, full, 3)
                    self.signal_fill(full + 3)
                    self.publish_rows(masks, 1, full + 3, base1, zero_ptr)
                    self.send_half(tidx, sK, masks, 3, pr[3])
                    self.resolve_rows(base1, mk1, ns1, 2 * i + 3, *rows)
                self.fetch_rows(ns0, 2 * i + 4, idx_row, L, row_in_pass)
                self.fetch_rows(ns1, 2 * i + 5, idx_row, L, row_in_pass)
            u0 = u0 + n_pairs
            u1 = u1 + n_blocks // 2
            j = j + 1

    @cute.jit
    def publish_rows(self, masks, stage: cutlass.Constexpr, bar, base, zero_ptr):
        """``publish_mask``; dual, each row's mask from its address (an invalid
        slot's is the zero row's), which frees the producer the registers of
        the masks (a dual producer has 72); crossover, fenced for the copy
        that hands them to the other CTA (``send_half``)."""
        if const_expr(not (self.dual or self.crossover)):
            self.publish_mask(masks, stage, bar)
        else:
            ok, writer, row_in_pass = masks[2], masks[3], masks[4]
            if writer:
                for m in cutlass.range_constexpr(self.R):
                    mask = Float32(0.0)
                    if base[m] == zero_ptr.toint():
                        mask = -Float32.inf
                    ok[stage, row_in_pass + 16 * m] = mask
                if const_expr(self.crossover):
                    cute.arch.fence_view_async_shared()  # the bulk copy reads them through the async proxy
                cute.arch.mbarrier_arrive(bar)

    @cute.jit
    def expect_peer(self, tidx, full, h: cutlass.Constexpr):
        """Crossover: before the first producer thread's arrival on half h's
        full barrier, the bytes the other CTA stores into the half (its rows'
        values, and with a stage's first half its rows' masks), counted by
        its copies (``send_half``); they may land before this, as the
        barrier's phase cannot complete without this thread's arrival."""
        if const_expr(self.crossover):
            if tidx == 0:
                cute.arch.mbarrier_expect_tx(full + h, self.peer_bytes(h))

    @cute.jit
    def send_half(self, tidx, sK, masks, h: cutlass.Constexpr, peer):
        """Crossover's hand-over: once every producer thread has
        stored (and fenced) its units of half h, the first copies this CTA's
        BN / 2 rows of each of the half's 64-column chunks (4 KB, contiguous
        in the swizzled stage) into the other CTA, and with halves 0 and 3 the
        rows' masks.  Half 1 (stage 0's R) goes before the producers' arrivals
        on its full barrier, and its first producer thread arrives only once
        the copies have read their source: consumer 0 writes its P over the
        stage's RoPE columns as soon as its S is done."""
        if const_expr(self.crossover):
            if const_expr(h == 1):
                cute.arch.fence_view_async_shared()  # signal_fill's fence comes after this
            cute.arch.barrier(barrier_id=PEER_BARRIER, number_of_threads=128 * self.producer_wgs)
            if tidx == 0:
                here = Int32(cute.recast_ptr(sK.iterator, None).toint())
                rank = cute.arch.block_idx_in_cluster()
                stage = h // 2
                c_lo = 0 if h % 2 == 0 else L_CHUNKS
                c_hi = L_CHUNKS if h % 2 == 0 else self.D // 64
                rows = rank * (BN // 2 * 128)
                for c in cutlass.range_constexpr(c_lo, c_hi):
                    src = here + (stage * BN * self.D * (self.dtype.width // 8) + c * BN * 128) + rows
                    copy_to_peer(src + peer[0], src, BN // 2 * 128, self.peer_bar(peer))
                if const_expr(h in (0, 3)):
                    src = Int32(masks[2].iterator.toint()) + 4 * stage * BN + rank * (4 * BN // 2)
                    copy_to_peer(src + peer[0], src, 4 * BN // 2, self.peer_bar(peer))
                if const_expr(h == 1):
                    cute.arch.cp_async_bulk_commit_group()
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    @staticmethod
    def peer_bar(peer):
        """The other CTA's copy of the full barrier of ``peer`` = (the other CTA's
        address less this one's, this CTA's barrier)."""
        return Int32(peer[1].toint()) + peer[0]

    def peer_bytes(self, h: int) -> int:
        """What the other CTA of a crossover cluster stores into half h
        (stage h // 2; L when h is even): its BN / 2 rows' values of the
        half's chunks, and their masks with halves 0 and 3."""
        rows = BN // 2
        chunks = L_CHUNKS if h % 2 == 0 else self.D // 64 - L_CHUNKS
        return rows * chunks * 64 * (self.dtype.width // 8) + (4 * rows if h in (0, 3) else 0)

    @cute.jit
    def ahead(self, base, tKs, buf, c_lo: cutlass.Constexpr, c_hi: cutlass.Constexpr):
        """A half's loads issued ahead of its wait (none in the no-refill timing build)."""
        if const_expr(self.refill):
            self.load_half(base, tKs, buf, c_lo, c_hi)

    @cute.jit
    def swap(self, atom, base, tKs, buf, c_lo: cutlass.Constexpr, c_hi: cutlass.Constexpr, n, nbase, ntKs, more):
        """A half's loaded bytes converted into the stage (its use n), then,
        when ``more``, the same half of the next block that uses ``buf``
        loaded from its rows nbase in their place, before anything else the
        producer does next (a row lookup waits on the block table).  The
        no-refill timing build loads and converts on the first use only."""
        if const_expr(self.refill):
            self.store_half(atom, base, tKs, buf, c_lo, c_hi)
            if more:
                self.load_half(nbase, ntKs, buf, c_lo, c_hi)
        else:
            if n == 0:
                self.load_half(base, tKs, buf, c_lo, c_hi)
                self.store_half(atom, base, tKs, buf, c_lo, c_hi)

    # ----------------------------------------------------------- FP8 gather
    def row_addresses(self):
        """Per-page scales (fp8_model1) need each row's offset in its page too."""
        base0, base1 = SparseAttnFwdSm90.row_addresses(self)
        if not (self.fp8 and self.fmt.per_page):
            return base0, base1
        R = self.rows_per_thread()
        return (base0, cute.make_rmem_tensor((R,), Int32)), (base1, cute.make_rmem_tensor((R,), Int32))

    def producer_thread(self, tidx, rank=None):
        # the block's rows in parts of BN / parts: dual, warpgroup 3 takes the part after warpgroup 0's;
        # crossover, the CTA of rank 1 (in its cluster; ``rank`` stands in for it at trace time) the parts
        # after rank 0's
        if not (self.dual or self.crossover):
            return tidx, None
        part = tidx // (3 * 128) if self.dual else 0
        if self.crossover:
            part = part + self.producer_wgs * (cute.arch.block_idx_in_cluster() if rank is None else rank)
        return tidx % 128, (BN // self.parts) * part

    def rows_per_thread(self) -> int:
        return self.R

    def fill_arrivals(self, h: int) -> int:
        # FP8: each producer thread also arrives (release) after its converted stores
        return (256 if self.fp8 else 128) * self.producer_wgs

    def mask_writers(self) -> int:
        return MASK_WRITERS * self.producer_wgs

    def release_arrivals(self) -> int:
        # crossover: the other CTA's consumer also arrives, one thread a warp, as its producer fills this half
        return 128 + (4 if self.crossover else 0)

    @cute.jit
    def release(self, cs, h: cutlass.Constexpr):
        SparseAttnFwdSm90.release(self, cs, h)
        if const_expr(self.crossover):
            if cs.lane == 0:
                # its wgmma has retired: the other CTA's producer may fill this CTA's half h
                arrive_remote(peer_address(Int32((cs.empty + h).toint()), peer_rank()))

    def cluster_start(self):
        if self.crossover:
            # the other CTA's barriers exist before any thread arrives on one or stores into its stages
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()

    def cluster_end(self):
        if self.crossover:
            # no CTA leaves while the other may still arrive on its barriers
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    def signal_fill(self, bar):
        if self.fp8:
            # the converted values were written through the generic proxy; the
            # consumers' wgmma reads them through the async proxy
            cute.arch.fence_view_async_shared()
            cute.arch.mbarrier_arrive(bar)
        cute.arch.cp_async_mbarrier_arrive_noinc(bar)

    def stage_partitions(self, thr, sK, tidx, row):
        """The forward's slices, and for an FP8 cache also the thread's slices
        of each stage's NoPE columns [64, 512] for the converted stores: 16
        columns (two 16-byte units) of each 128-column group, thread tid at
        row ``row`` (tid // 8, past its warpgroup's first row) of each pass of
        16 rows and columns 16 (tid % 8) onwards, so that its 16-byte global
        loads of e4m3 bytes are 8 threads' 128 contiguous bytes of a row."""
        tK0, tK1 = SparseAttnFwdSm90.stage_partitions(self, thr, sK, tidx, row)
        if not self.fp8:
            return tK0, tK1
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        tiled = cute.make_tiled_copy_tv(atom, cute.make_ordered_layout((16, 8), order=(1, 0)),
                                        cute.make_layout((1, 16)))
        fthr = tiled.get_slice(tidx)
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.dtype)
        # a stage's NoPE columns are its first 8 column atoms: the same bytes
        # and swizzle as the stage's own layout (rows first, then columns)
        nope = cute.tile_to_shape(k_atom, (BN, self.nope_view_cols()), order=(0, 1))
        raw = cute.recast_ptr(sK.iterator, None)
        views = [cute.make_tensor(cute.recast_ptr(raw + s * BN * self.D, nope.inner), nope.outer) for s in (0, 1)]
        lane = tidx % 8
        # lockstep builds store their converted units at two addresses placed
        # once a thread (``nope_units``), each store a constant away, instead of
        # through the swizzled partition (an add, a shift and an xor a store);
        # the staggered builds, short of registers, keep the partition (the two
        # live addresses spill there)
        if const_expr(self.lockstep):
            stage_bytes = BN * self.D * (self.dtype.width // 8)
            stages = [Int32(raw.toint()) + s * stage_bytes for s in (0, 1)]
            units = [self.nope_units(st, row, lane) for st in stages]
            if const_expr(self.dual or self.crossover):
                # the RoPE unit's address too: the forward's partition places rows by the copier's own row
                rope = [self.rope_unit(st, row, lane) for st in stages]
                return (tK0, units[0], lane, rope[0]), (tK1, units[1], lane, rope[1])
            return (tK0, units[0], lane), (tK1, units[1], lane)
        return ((tK0, fthr.partition_D(views[0]), lane), (tK1, fthr.partition_D(views[1]), lane))

    @staticmethod
    def nope_units(stage, row, lane):
        """The byte addresses of this thread's two 16-byte units (columns
        [16 lane, 16 lane + 16) of group 0, row ``row`` < 16) in the stage at
        ``stage`` (1024-byte aligned), as the stage's layout places them: its
        128-byte-swizzled K-major atoms (8 rows x 64 columns, rows first, then
        columns) put column c of row r at byte 8192 (c // 64) + 1024 (r // 8)
        + 128 (r % 8) + 16 u + 2 (c % 8), u = ((c % 64) // 8) xor (r % 8)."""
        r8 = row % 8
        at = stage + (lane // 4) * (BN * 128) + (row // 8) * 1024 + r8 * 128
        u = 2 * (lane % 4)
        return at + (u ^ r8) * 16, at + ((u + 1) ^ r8) * 16

    def rope_unit(self, stage, row, lane):
        """The byte address of this thread's 16-byte unit of the RoPE chunk
        (columns d_nope + [8 lane, 8 lane + 8)) in row ``row`` of the stage
        at ``stage``, placed as ``nope_units`` places the NoPE columns."""
        r8 = row % 8
        return stage + (self.fmt.d_nope // 64) * (BN * 128) + (row // 8) * 1024 + r8 * 128 + (lane ^ r8) * 16

    @staticmethod
    def nope_offset(m: int, g: int) -> int:
        """Bytes from a thread's unit in row r and group 0 to the same unit in
        row r + 16 m and group g: neither changes r % 8 or the column within a
        64-column atom, so the swizzle is the same."""
        return 16 * m * 128 + 2 * g * BN * 128

    def nope_view_cols(self) -> int:
        """Columns of the stores' view of a stage: the NoPE columns in whole
        128-column groups (fp8_model1's 448 take 4; the last group's RoPE half
        is never stored through it)."""
        return -(-self.fmt.d_nope // GROUP) * GROUP

    @cute.jit
    def copy_half(self, atom, base, tKs, c_lo: cutlass.Constexpr, c_hi: cutlass.Constexpr):
        if const_expr(self.fp8):
            self.convert_half(atom, base, tKs, c_lo, c_hi)
        else:
            SparseAttnFwdSm90.copy_half(self, atom, base, tKs, c_lo, c_hi)

    @cute.jit
    def convert_half(self, atom, base, tKs, c_lo: cutlass.Constexpr, c_hi: cutlass.Constexpr):
        """An FP8 half stage: the NoPE columns of the chunks [c_lo, c_hi) of
        this thread's 4 rows, 16 a row and 128-column group (its loads of 16
        e4m3 bytes and the rows' scales all issued before the first
        conversion, ``load_half``), dequantised to bf16 and stored; the RoPE
        chunk by cp.async from the token's bf16 values (``store_half``)."""
        t0 = self.timer.tick()
        buf = self.half_buffers(c_lo, c_hi)
        self.load_half(base, tKs, buf, c_lo, c_hi)
        self.store_half(atom, base, tKs, buf, c_lo, c_hi)
        self.timer.tock(PROF_ISSUE, t0)

    def half_groups(self, c_lo: int, c_hi: int):
        """(first column, end of the NoPE columns, 128-column groups) of the
        half stage of chunks [c_lo, c_hi)."""
        n_lo = c_lo * 64
        n_hi = min(c_hi * 64, self.fmt.d_nope)
        return n_lo, n_hi, -(-(n_hi - n_lo) // GROUP)

    def half_buffers(self, c_lo: int, c_hi: int):
        """Registers for a half stage's loads: e4m3 words [4, groups, rows]
        and the rows' scales (``load_scales``)."""
        _, _, groups = self.half_groups(c_lo, c_hi)
        R = self.R
        raw = cute.make_rmem_tensor((4, groups, R), Int32)
        if const_expr(not self.fmt.per_page):
            sc = cute.make_rmem_tensor((groups, R), Float32)
        else:
            sc = cute.make_rmem_tensor((2, R), Int32)
        if const_expr(self.crossover and c_hi > self.fmt.d_nope // 64):
            # crossover: the half's RoPE units through registers, for the other CTA's copy too
            return raw, sc, cute.make_rmem_tensor((4, R), Int32)
        return raw, sc

    @cute.jit
    def load_half(self, base, tKs, buf, c_lo: cutlass.Constexpr, c_hi: cutlass.Constexpr):
        """The global loads of a half stage into ``buf``: this thread's 16
        e4m3 bytes of each row and 128-column group, then the rows' scales."""
        f = self.fmt
        addr, offs = base if const_expr(f.per_page) else (base, None)
        raw, sc = buf[0], buf[1]
        n_lo, _, groups = self.half_groups(c_lo, c_hi)
        lane = tKs[2]
        for m in cutlass.range_constexpr(self.R):
            for k in cutlass.range_constexpr(groups):
                cute.autovec_copy(self.nope_src(addr[m], n_lo, k, lane), raw[None, k, m])
        self.load_scales(sc, addr, offs, n_lo, groups, self.R)
        if const_expr(len(buf) == 3):
            for m in cutlass.range_constexpr(self.R):
                src = cute.make_tensor(aligned(Int32, addr[m] + f.rope_offset + 16 * lane), cute.make_layout((4,)))
                cute.autovec_copy(src, buf[2][None, m])

    def nope_src(self, row_addr, n_lo: int, k: int, lane):
        """This thread's 16 e4m3 bytes of group k of a half from column n_lo, as 4 words."""
        return cute.make_tensor(aligned(Int32, row_addr + (n_lo + GROUP * k) + 16 * lane), cute.make_layout((4,)))

    @cute.jit
    def store_half(self, atom, base, tKs, buf, c_lo: cutlass.Constexpr, c_hi: cutlass.Constexpr):
        """A loaded half stage into shared memory: the RoPE chunk (when the
        half has it) by cp.async, the NoPE columns dequantised.  In a group
        the NoPE columns end inside (fp8_model1's 384..447), the lanes past
        them loaded bytes of the same record and store nothing."""
        f = self.fmt
        tK, tN, lane = tKs[0], tKs[1], tKs[2]
        addr = base[0] if const_expr(f.per_page) else base
        raw, sc = buf[0], buf[1]
        R = self.R
        n_lo, n_hi, groups = self.half_groups(c_lo, c_hi)
        if const_expr(len(buf) == 3):
            # crossover: the RoPE units loaded with the half (the other CTA gets them by send_half)
            for m in cutlass.range_constexpr(R):
                self.store_unit(tKs[3] + m * (16 * 128), buf[2][None, m])
        elif const_expr(c_hi > f.d_nope // 64):
            ES = self.dtype.width // 8
            for m in cutlass.range_constexpr(R):
                src = cute.make_tensor(aligned(self.dtype, addr[m] + f.rope_offset + 8 * lane * ES),
                                       cute.make_layout((8,)))
                if const_expr(self.dual):
                    # rows 16 apart are 2048 bytes apart with the same swizzle (``nope_offset``)
                    dst = cute.make_ptr(self.dtype, tKs[3] + m * (16 * 128), cute.AddressSpace.smem,
                                        assumed_align=16)
                    cute.copy(atom, src, cute.make_tensor(dst, cute.make_layout((8,))))
                else:
                    cute.copy(atom, src, tK[None, m, f.d_nope // 64])
        # e8m0 scales are powers of two (2^-127 included): bf16 values, for which the bf16 order gives the
        # contract's bits with one product a pair (5.7% faster at B128 H64, C222); fp32 scales take the
        # contract's order (for fp8_v32 a per-half test of its scales cost more than it saved, C219, C222)
        self.convert_units(tN, lane, raw, sc, n_lo, n_hi, groups, f.per_page)

    @cute.jit
    def convert_units(self, tN, lane, raw, sc, n_lo: cutlass.Constexpr, n_hi: cutlass.Constexpr,
                      groups: cutlass.Constexpr, bf16_product: cutlass.Constexpr):
        """A half's loaded e4m3 words dequantised and stored, 16 values a row
        pass and group: by ``e4m3x2_times_bf16x2`` when ``bf16_product`` (every
        scale a bf16 value), else by ``e4m3x2_to_bf16x2``; the same bits."""
        vals = cute.make_rmem_tensor((16,), self.dtype)
        words = cute.recast_tensor(vals, Int32)
        for m in cutlass.range_constexpr(self.R):
            for k in cutlass.range_constexpr(groups):
                s_ = self.scale_of(sc, k, m, n_lo, lane)
                if const_expr(bf16_product):
                    convert, s_ = e4m3x2_times_bf16x2, bf16x2_of(s_)
                else:
                    convert = e4m3x2_to_bf16x2
                for w in cutlass.range_constexpr(4):
                    words[2 * w] = convert(raw[w, k, m], False, s_)
                    words[2 * w + 1] = convert(raw[w, k, m], True, s_)
                if const_expr(n_lo + GROUP * (k + 1) <= n_hi):
                    self.store_vals(vals, tN, m, n_lo // GROUP + k)
                else:
                    if n_lo + GROUP * k + 16 * lane < n_hi:
                        self.store_vals(vals, tN, m, n_lo // GROUP + k)

    @cute.jit
    def store_vals(self, vals, tN, m: cutlass.Constexpr, g: cutlass.Constexpr):
        """A thread's 16 converted values of row pass m and group g into the stage: at the two addresses
        ``tN`` (lockstep, ``stage_partitions``) plus an offset, or through the partition ``tN``."""
        if const_expr(self.lockstep):
            words = cute.recast_tensor(vals, Int32)
            unit = cute.make_rmem_tensor((4,), Int32)
            for h in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(4):
                    unit[e] = words[4 * h + e]
                self.store_unit(tN[h] + self.nope_offset(m, g), unit)
        else:
            cute.autovec_copy(vals, tN[None, m, g])

    @cute.jit
    def store_unit(self, at, unit):
        """A 16-byte unit (4 words in registers) into shared memory at byte address ``at``."""
        dst = cute.make_ptr(Int32, at, cute.AddressSpace.smem, assumed_align=16)
        cute.autovec_copy(unit, cute.make_tensor(dst, cute.make_layout((4,))))

    @cute.jit
    def load_scales(self, sc, addr, offs, n_lo: cutlass.Constexpr, groups: cutlass.Constexpr,
                    R: cutlass.Constexpr):
        """sc <- the rows' scales the half needs: fp8_v32, the fp32 scale of
        each 128-column group ([groups, R]); fp8_model1, each row's 8-byte
        record of e8m0 scales ([2, R] words)."""
        f = self.fmt
        if const_expr(not f.per_page):
            first = f.scale_base(self.page_size) + 4 * (n_lo // f.tile)
            for m in cutlass.range_constexpr(R):
                src = cute.make_tensor(aligned(Float32, addr[m] + first, 4 * groups), cute.make_layout((groups,)))
                cute.autovec_copy(src, sc[None, m])
        else:
            for m in cutlass.range_constexpr(R):
                src = cute.make_tensor(aligned(Int32, addr[m] + self.scale_offset(offs[m]), 8),
                                       cute.make_layout((2,)))
                cute.autovec_copy(src, sc[None, m])

    @cute.jit
    def scale_of(self, sc, k: cutlass.Constexpr, m: cutlass.Constexpr, n_lo: cutlass.Constexpr, lane):
        """The fp32 scale of this thread's 16 columns of group k, row m: one
        per group (fp8_v32's tile is the group), or the e8m0 byte of tile
        j + lane // 4, j = the group's first tile (fp8_model1's tiles of 64:
        j is even, so both candidates sit in word j // 4 of the record and
        the byte is a shift away, not an indexed load)."""
        f = self.fmt
        if const_expr(not f.per_page):
            return sc[k, m]
        j = (n_lo + GROUP * k) // f.tile
        word = sc[(j // 4), m]
        shift = 8 * (j % 4) + 8 * (lane // 4)
        return e8m0_to_f32((word >> shift) & 0xFF)

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
