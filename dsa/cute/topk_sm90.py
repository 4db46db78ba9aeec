"""Top-k of score rows in CuTe DSL: a radix select with the row in shared memory.

One CTA a row of ``scores`` [R, S] (fp32, fp16 or bf16).  The contract is
``dsa.triton.topk``'s: the positions of the k largest scores, ascending,
then -1; NaN and -inf never selected; ties at the cut go to the smaller
position; row r is its first clamp(ends[r], 0, S) scores when ends are given.

* **Keys.**  Each score becomes a signed *order key* (``order_key``): the
  fp32 bit pattern (16-bit scores widened exactly) with the magnitude bits
  of negative values flipped, so that signed integer order is value order;
  -0.0 folds onto +0.0, NaN and -inf become ``INVALID`` (the int32 minimum),
  below every selectable key.  The row is read from global memory once:
  its keys go to shared memory (``s_max`` of them at most: the build's
  bucket) while the first histogram is counted.
* **Radix select.**  Three digit passes, 11 / 11 / 10 bits from the top
  (2048 / 2048 / 1024 shared-memory bins, ``red.shared.add``); after each a
  block-wide suffix scan of the bins finds the digit of the k-th largest key
  and how many keys lie above it.  A pass whose digit's keys are all
  selected ends the search there (``key >= prefix``); otherwise the next
  pass counts only the keys sharing the prefix, read back from shared
  memory.  After the third the k-th key ``T`` is exact and ``need`` of its
  ties are taken.
* **Emit.**  One pass over the row in position order, ``emit_cols``
  chunks at a time (a thread's 4 x emit_cols contiguous keys): per thread
  the counts of keys above the cut and of ties (packed in one word), a
  block-wide prefix scan, then each selected key's output slot is (keys
  above before it) + min(ties before it, need).  Slots go to shared memory
  (over the histograms, dead by then), written out with the -1 padding by
  coalesced stores.

Every barrier is CTA-uniform: the pass structure depends only on values
read back from shared memory after a barrier.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from dsa.cute.gmem import _asm, aligned

KEYS_PER_THREAD = 4          # contiguous keys a thread takes per chunk (one 16-byte vector of keys)
INVALID = -(2**31)           # the key of NaN, -inf and the columns past a row's end
NO_TIE = -2139095041         # 0x807FFFFF: the key -inf would have, never stored; "no tie taken"
BINS = (2048, 2048, 1024)    # digits of 11, 11 and 10 bits
SHIFTS = (21, 10, 0)
UNROLL_MAX = 8               # chunks loaded before the first is used (bytes in flight)
SMEM_LIMIT = 227 * 1024


@dataclass(frozen=True)
class TopkSm90Config:
    """A build: score dtype (a CuTe type), the longest row it holds (a
    multiple of the chunk), the largest k, row ends, threads a CTA."""

    dtype: object
    s_max: int
    k_max: int
    has_end: bool
    threads: int = 512
    emit_max: int = 2    # key vectors a thread takes per scan of the emit, at most (fewer barriers)
    # timing builds only (their output is not the top-k): 1 stops after the
    # row's load without counting, 2 after the first count, 3 before the emit
    probe: int = 0
    min_blocks: int = 0  # CTAs an SM the registers must allow (a launch bound; 0: none)

    @property
    def chunk(self) -> int:
        return self.threads * KEYS_PER_THREAD

    @property
    def unroll(self) -> int:
        return min(UNROLL_MAX, self.s_max // self.chunk)

    @property
    def emit_cols(self) -> int:
        return min(self.emit_max, self.s_max // self.chunk)


def smem_bytes(c: TopkSm90Config) -> int:
    """Shared memory of a build: keys, the output slots, two histograms, scan words."""
    return 4 * (c.s_max + work_words(c) + 2 * (c.threads // 32) + 16) + 64


def work_words(c: TopkSm90Config) -> int:
    """The words the two histograms take, and after them the output slots (the emit's)."""
    return max(2 * BINS[0], c.k_max)


@dsl_user_op
def order_key(bits: Int32, *, loc=None, ip=None) -> Int32:
    """The signed order key of an fp32 bit pattern (see the module doc)."""
    asm = ("{\n.reg .pred p, q;\n.reg .b32 t, m;\n"
           "shr.s32 t, $1, 31;\nand.b32 t, t, 0x7FFFFFFF;\nxor.b32 $0, $1, t;\n"
           "setp.eq.b32 p, $0, -1;\nselp.b32 $0, 0, $0, p;\n"               # -0.0 -> +0.0
           "and.b32 m, $1, 0x7FFFFFFF;\nsetp.gt.u32 q, m, 0x7F800000;\n"    # NaN
           "setp.eq.b32 p, $0, 0x807FFFFF;\nor.pred q, q, p;\n"             # -inf
           "selp.b32 $0, 0x80000000, $0, q;\n}")
    return Int32(llvm.inline_asm(T.i32(), [Int32(bits).ir_value(loc=loc, ip=ip)], asm, "=r,r",
                                 has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                 loc=loc, ip=ip))


@dsl_user_op
def f16_bits(word: Int32, upper: bool, *, loc=None, ip=None) -> Int32:
    """The fp32 bit pattern of the fp16 in ``word``'s lower (upper) half (exact)."""
    asm = ("{\n.reg .b16 l, h;\n.reg .f32 f;\nmov.b32 {l, h}, $1;\n"
           f"cvt.f32.f16 f, {'h' if upper else 'l'};\nmov.b32 $0, f;\n}}")
    return Int32(llvm.inline_asm(T.i32(), [Int32(word).ir_value(loc=loc, ip=ip)], asm, "=r,r",
                                 has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                 loc=loc, ip=ip))


@dsl_user_op
def ld_shared(addr: Int32, *, loc=None, ip=None) -> Int32:
    """One word of shared memory (a volatile asm: never moved across a barrier)."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(addr).ir_value(loc=loc, ip=ip)], "ld.shared.b32 $0, [$1];",
                                 "=r,r", has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


def sel(cond, a, b) -> Int32:
    """cond ? a : b on Int32 values (a select, no branch)."""
    return Int32(cutlass.select_(cond, a, b))


def st_shared(addr: Int32, value: Int32) -> None:
    _asm("st.shared.b32 [$0], $1;", "r,r", Int32(addr), Int32(value))


def red_shared_add(addr: Int32) -> None:
    """Count one in the shared-memory word at addr."""
    _asm("red.shared.add.u32 [$0], 1;", "r", Int32(addr))


class TopkSm90:
    """Host-side builder of the kernel for one ``TopkSm90Config``."""

    def __init__(self, config: TopkSm90Config):
        c = self.config = config
        step = c.chunk * max(c.unroll, c.emit_cols)
        # the emit packs a scan group's counts (at most chunk * emit_cols keys) in 16 bits
        if c.s_max % step or c.threads % 32 or c.threads > BINS[2] or c.chunk * c.emit_cols >= 2**16:
            raise ValueError(f"TopkSm90: s_max {c.s_max} must be a multiple of {step}, threads a multiple of 32 "
                             f"up to {BINS[2]}, a scan group under 65536 keys")
        self.fit(smem_bytes(c))

    def fit(self, nbytes: int) -> None:
        """Check a build's shared memory against the launch limit; set the warps and the score's bytes."""
        if nbytes > SMEM_LIMIT:
            raise ValueError(f"{type(self).__name__}: {nbytes} bytes of shared memory exceed {SMEM_LIMIT}")
        self.warps = self.config.threads // 32
        self.es = self.config.dtype.width // 8

    def smem_layout(self):
        """The kernel's shared memory (a ``cute.struct``; its fields' types made here, not as
        annotations, which this module's postponed evaluation leaves as strings)."""
        c = self.config
        fields = {
            "keys": cute.struct.Align[cute.struct.MemRange[Int32, c.s_max], 16],
            # two histograms; the output slots once the search is over
            "work": cute.struct.Align[cute.struct.MemRange[Int32, work_words(c)], 16],
            "warp": cute.struct.MemRange[Int32, 2 * (c.threads // 32)],
            "pick": cute.struct.MemRange[Int32, 16],  # per pass: digit, keys above it, its count, total
        }
        return cute.struct(type("Smem", (), {"__annotations__": fields}))

    @cute.jit
    def __call__(self, scores_ptr: cute.Pointer, ends_ptr: cute.Pointer, idx_ptr: cute.Pointer,
                 len_ptr: cute.Pointer, R: Int32, S: Int32, K: Int32, stream):
        """One CTA a row (the builders' shared launch)."""
        c = self.config
        self.smem = self.smem_layout()
        self.kernel(scores_ptr, ends_ptr, idx_ptr, len_ptr, S, K).launch(
            grid=[R, 1, 1], block=[c.threads, 1, 1], stream=stream,
            # the carveout given (all of it shared memory): else the DSL asks the device for its size
            **({"min_blocks_per_mp": c.min_blocks, "preferred_smem_carveout": 100} if c.min_blocks else {}))

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, scores_ptr: cute.Pointer, ends_ptr: cute.Pointer, idx_ptr: cute.Pointer,
               len_ptr: cute.Pointer, S: Int32, K: Int32):
        c = self.config
        tid, _, _ = cute.arch.thread_idx()
        r, _, _ = cute.arch.block_idx()
        lane = tid % 32
        warp = tid // 32
        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(self.smem)
        # keys [4, s_max / 4]: column j holds positions 4j .. 4j + 3 (one 16-byte vector)
        keys = st.keys.get_tensor(cute.make_layout((KEYS_PER_THREAD, c.s_max // KEYS_PER_THREAD)))
        hist = Int32(st.work.data_ptr().toint())
        slots = hist
        warp_words = Int32(st.warp.data_ptr().toint())
        pick = Int32(st.pick.data_ptr().toint())

        L = self.row_end(ends_ptr, r, S)
        self.clear(hist, pick, tid)

        n_chunks = (L + c.chunk - 1) // c.chunk
        self.load_row(scores_ptr, keys, hist, r, S, L, n_chunks, tid)
        cute.arch.sync_threads()

        if const_expr(c.probe in (0, 3)):
            # pass 1 over every valid key; passes 2 and 3 only where the search is not over
            d1, above, h, total = self.pick_digit(hist, BINS[0], K, pick, warp_words, tid, lane, warp)
            t_hi = Int32(INVALID + 1)  # no digit: every valid key is selected
            t_eq = Int32(NO_TIE)
            need_eq = Int32(0)
            if d1 >= 0:
                p1 = d1 - BINS[0] // 2
                need = K - above
                t_hi = p1 * (1 << SHIFTS[0])
                if h != need:
                    self.count_digits(keys, hist + 4 * BINS[0], n_chunks, tid, p1, 1)
                    cute.arch.sync_threads()
                    self.zero(hist, BINS[0], tid)  # hist 0 again, for pass 3
                    d2, above, h, _ = self.pick_digit(hist + 4 * BINS[0], BINS[1], need, pick + 16, warp_words, tid,
                                                      lane, warp)
                    p2 = p1 * BINS[1] + d2
                    need = need - above
                    t_hi = p2 * (1 << SHIFTS[1])
                    if h != need:
                        self.count_digits(keys, hist, n_chunks, tid, p2, 2)
                        cute.arch.sync_threads()
                        d3, above, h, _ = self.pick_digit(hist, BINS[2], need, pick + 32, warp_words, tid, lane, warp)
                        t_eq = p2 * BINS[2] + d3
                        t_hi = t_eq + 1
                        need_eq = need - above
            count = cutlass.min(K, total)
            if const_expr(c.probe == 0):
                self.emit(keys, slots, warp_words, L, n_chunks, t_hi, t_eq, need_eq, tid, lane, warp)
                cute.arch.sync_threads()
                self.write_out(slots, idx_ptr, len_ptr, r, K, count, tid)
            elif tid == 0:  # keeps the probe's work alive
                cute.make_tensor(len_ptr + Int64(r), cute.make_layout((1,)))[0] = count + t_hi + need_eq
        else:
            if tid == 0:  # keeps the probe's work alive
                cute.make_tensor(len_ptr + Int64(r), cute.make_layout((1,)))[0] = ld_shared(hist + 4 * 1500) + \
                    keys[0, 5]

    @cute.jit
    def zero(self, hist: Int32, nbins: cutlass.Constexpr, tid):
        """nbins words of shared memory from hist set to 0 (a word a thread at a time)."""
        for i in cutlass.range_constexpr(nbins // self.config.threads):
            st_shared(hist + 4 * (tid + i * self.config.threads), Int32(0))

    @cute.jit
    def clear(self, hist: Int32, pick: Int32, tid):
        """A row's start: both histograms 0, pick[0] -1 (pass 1 finds no digit when the row has
        fewer than k valid keys), then a barrier."""
        self.zero(hist, 2 * BINS[0], tid)
        if tid == 0:
            st_shared(pick, Int32(-1))
        cute.arch.sync_threads()

    @cute.jit
    def row_end(self, ends_ptr: cute.Pointer, r, S) -> Int32:
        """Row r's length: clamp(ends[r], 0, S), or S without row ends."""
        L = S
        if const_expr(self.config.has_end):
            e = cute.make_tensor(ends_ptr + Int64(r), cute.make_layout((1,)))[0]
            L = cutlass.min(cutlass.max(e, Int32(0)), S)
        return L

    def row_base(self, scores_ptr: cute.Pointer, r, S) -> Int64:
        """The address of row r's first score."""
        return scores_ptr.toint() + Int64(r) * Int64(S) * self.es

    @cute.jit
    def load_row(self, scores_ptr: cute.Pointer, keys: cute.Tensor, hist: Int32, r, S, L, n_chunks, tid):
        """The row's keys into shared memory (INVALID past L) and the first
        digit counted in ``hist``: ``unroll`` chunks' loads issued before the
        first is converted.  Vectors past L load the row's first one (in
        bounds, cached) and are discarded."""
        c = self.config
        es = self.es
        words = 4 if const_expr(es == 4) else 2
        row = self.row_base(scores_ptr, r, S)
        for c0 in cutlass.range(0, n_chunks, c.unroll):
            raw = cute.make_rmem_tensor((words, c.unroll), Int32)
            for u in cutlass.range_constexpr(c.unroll):
                pos = (c0 + u) * c.chunk + tid * KEYS_PER_THREAD
                src = row + Int64(sel(pos < L, pos, Int32(0))) * es
                cute.autovec_copy(cute.make_tensor(aligned(Int32, src, 4 * words), cute.make_layout((words,))),
                                  raw[None, u])
            for u in cutlass.range_constexpr(c.unroll):
                pos = (c0 + u) * c.chunk + tid * KEYS_PER_THREAD
                kv = cute.make_rmem_tensor((KEYS_PER_THREAD,), Int32)
                for j in cutlass.range_constexpr(KEYS_PER_THREAD):
                    if const_expr(es == 4):
                        bits = raw[j, u]
                    elif const_expr(c.dtype is cutlass.Float16):
                        bits = f16_bits(raw[j // 2, u], j % 2 == 1)
                    else:  # bf16: the upper 16 bits of an fp32
                        bits = (raw[j // 2, u] << 16) if const_expr(j % 2 == 0) else (raw[j // 2, u] & -65536)
                    k_ = order_key(bits)
                    k_ = sel(pos + j < L, k_, Int32(INVALID))
                    kv[j] = k_
                    if k_ != INVALID and const_expr(c.probe != 1):
                        red_shared_add(hist + 4 * ((k_ >> SHIFTS[0]) + BINS[0] // 2))
                cute.autovec_copy(kv, keys[None, (c0 + u) * (c.chunk // KEYS_PER_THREAD) + tid])

    @cute.jit
    def count_digits(self, keys: cute.Tensor, hist: Int32, n_chunks, tid, prefix, p: cutlass.Constexpr):
        """Pass p (1 or 2): count digit p of the keys whose digits above it are ``prefix``."""
        c = self.config
        shift_hi = SHIFTS[p - 1]
        mask = BINS[p] - 1
        for ci in cutlass.range(0, n_chunks):
            kv = cute.make_rmem_tensor((KEYS_PER_THREAD,), Int32)
            cute.autovec_copy(keys[None, ci * (c.chunk // KEYS_PER_THREAD) + tid], kv)
            for j in cutlass.range_constexpr(KEYS_PER_THREAD):
                k_ = kv[j]
                if (k_ >> shift_hi) == prefix:
                    red_shared_add(hist + 4 * ((k_ >> SHIFTS[p]) & mask))

    @cute.jit
    def pick_digit(self, hist: Int32, nbins: cutlass.Constexpr, need, pick: Int32, warp_words: Int32, tid, lane,
                   warp):
        """The digit d whose bin holds the need-th largest key counted in
        ``hist``: (d, keys in the bins above it, its count, all counted), the
        same in every thread; d = -1 when fewer than ``need`` were counted
        (the caller set pick[0] to -1)."""
        c = self.config
        per = nbins // c.threads
        hs = cute.make_rmem_tensor((per,), Int32)
        for j in cutlass.range_constexpr(per):
            hs[j] = ld_shared(hist + 4 * (tid * per + j))
        mine = Int32(0)
        for j in cutlass.range_constexpr(per):
            mine = mine + hs[j]
        # suffix sums: the bins above a thread's are those of the threads after it
        x = mine
        for o in cutlass.range_constexpr(5):
            y = cute.arch.shuffle_sync_down(x, offset=1 << o)
            x = x + sel(lane + (1 << o) < 32, y, Int32(0))
        if lane == 0:
            st_shared(warp_words + 4 * warp, x)
        cute.arch.sync_threads()
        above = x - mine
        for w in cutlass.range_constexpr(self.warps):
            above = above + sel(warp < w, ld_shared(warp_words + 4 * w), Int32(0))
        if tid == 0:
            st_shared(pick + 12, above + mine)
        for jj in cutlass.range_constexpr(per):
            j = per - 1 - jj
            if above < need and need <= above + hs[j]:
                st_shared(pick, tid * per + j)
                st_shared(pick + 4, above)
                st_shared(pick + 8, hs[j])
            above = above + hs[j]
        cute.arch.sync_threads()
        return ld_shared(pick), ld_shared(pick + 4), ld_shared(pick + 8), ld_shared(pick + 12)

    @cute.jit
    def write_out(self, slots: Int32, idx_ptr: cute.Pointer, len_ptr: cute.Pointer, r, K, count, tid):
        """Row r of the output: the ``count`` slots in shared memory, then -1; its length."""
        c = self.config
        out_row = idx_ptr.toint() + Int64(r) * Int64(K) * 4
        for i in cutlass.range(tid, K, c.threads):
            v = Int32(-1)
            if i < count:
                v = ld_shared(slots + 4 * i)
            cute.make_tensor(aligned(Int32, out_row + Int64(i) * 4, 4), cute.make_layout((1,)))[0] = v
        if tid == 0:
            cute.make_tensor(len_ptr + Int64(r), cute.make_layout((1,)))[0] = count

    @cute.jit
    def scan_counts(self, ng, ne, words: Int32, lane, warp):
        """The CTA-wide scan of a group's (ties, above) counts, packed in one
        word (ties << 16 | above; a group holds under 65536 keys): (the
        threads' before this one, the group's total), both packed.  One
        barrier; ``words`` (a word a warp) must not be read by a thread
        still at the previous scan, hence two sets used by parity."""
        mine = ne * 65536 + ng
        x = mine
        for o in cutlass.range_constexpr(5):
            y = cute.arch.shuffle_sync_up(x, offset=1 << o)
            x = x + sel(lane >= (1 << o), y, Int32(0))
        if lane == 31:
            st_shared(words + 4 * warp, x)
        cute.arch.sync_threads()
        before = x - mine
        tot = Int32(0)
        for w in cutlass.range_constexpr(self.warps):
            v = ld_shared(words + 4 * w)
            before = before + sel(w < warp, v, Int32(0))
            tot = tot + v
        return before, tot

    @cute.jit
    def emit(self, keys: cute.Tensor, slots: Int32, warp_words: Int32, L, n_chunks, t_hi, t_eq, need_eq, tid, lane,
             warp):
        """Each selected key's position into its output slot (shared
        memory): keys >= t_hi, and the first need_eq keys == t_eq in
        position order.  A scan covers ``emit_cols`` chunks, a thread its
        4 * emit_cols contiguous keys; keys past L (never stored) are
        masked."""
        c = self.config
        E = c.emit_cols
        V = KEYS_PER_THREAD * E
        gt_run = Int32(0)
        eq_run = Int32(0)
        for g in cutlass.range(0, (n_chunks + E - 1) // E):
            kv = cute.make_rmem_tensor((KEYS_PER_THREAD, E), Int32)
            for e in cutlass.range_constexpr(E):
                cute.autovec_copy(keys[None, (g * c.threads + tid) * E + e], kv[None, e])
            pos = g * c.chunk * E + tid * V
            ng = Int32(0)
            ne = Int32(0)
            for j in cutlass.range_constexpr(V):
                kj = sel(pos + j < L, kv[j % KEYS_PER_THREAD, j // KEYS_PER_THREAD], Int32(INVALID))
                kv[j % KEYS_PER_THREAD, j // KEYS_PER_THREAD] = kj
                ng = ng + sel(kj >= t_hi, Int32(1), Int32(0))
                ne = ne + sel(kj == t_eq, Int32(1), Int32(0))
            # by parity: one barrier a scan
            before, tot = self.scan_counts(ng, ne, warp_words + 4 * self.warps * (g % 2), lane, warp)
            gb = gt_run + (before & 65535)
            eb = eq_run + (before >> 16)
            if (ng + ne) > 0:
                for j in cutlass.range_constexpr(V):
                    kj = kv[j % KEYS_PER_THREAD, j // KEYS_PER_THREAD]
                    gt = kj >= t_hi
                    eq = kj == t_eq
                    if gt or (eq and eb < need_eq):
                        st_shared(slots + 4 * (gb + cutlass.min(eb, need_eq)), pos + j)
                    gb = gb + sel(gt, Int32(1), Int32(0))
                    eb = eb + sel(eq, Int32(1), Int32(0))
            gt_run = gt_run + (tot & 65535)
            eq_run = eq_run + (tot >> 16)
