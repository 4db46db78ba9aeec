"""Top-k of long score rows in CuTe DSL: one pass over the row, candidates kept in shared memory.

One CTA a row of ``scores`` [R, S] (fp32, fp16 or bf16), any S; the contract
is ``dsa.cute.topk_sm90``'s (and ``dsa.triton.topk``'s), with its order keys.
Where the resident kernel holds the whole row, this one holds a buffer of
``cap = k_max + round`` candidates (key and position) in position order:

* **Threshold.**  A row longer than the buffer first reads a spread sample
  (``samples`` vectors a thread, by cp.async into shared memory: it holds no
  registers; the first round's loads are in flight meanwhile) and takes, by
  two digit passes (one with ``coarse``: the first digit's edge, lower), a
  key ``t`` that about ``margin4 / 4 * k`` of the row's keys reach (the
  sample's rank scaled by its share of the row).  Shorter rows start with
  every valid key a candidate.
* **Stream.**  The row is read once, a round (``vectors`` 4-key vectors a
  thread, each warp a contiguous segment) at a time, the next round's loads
  in flight while one is taken and each warp's segment ``prefetch`` rounds
  ahead requested into L2 (``cp.async.bulk.prefetch``: bytes in flight that
  hold no registers); two rounds a loop iteration, so that the two rounds'
  registers swap roles without a copy.  Scores are tested as fp32 against
  the value of t (``value_bits``; the position against the row's end only in
  its last round), a lane's flags packed in a mask a vector, and those at or
  above it appended in position order with their keys: one packed warp scan
  of the lanes' counts gives each its place within its warp, a block-wide
  sum of the warps' counts (one barrier a round) the warp's place in the
  buffer.
* **Compaction.**  A round that would overflow the buffer first compacts
  it: the radix select of ``topk_sm90`` (three digit passes) on the
  buffer's keys finds the k-th, the k selected entries move to the front in
  order, and t rises to the cut (a later key enters only above it: ties go
  to the smaller position).  The buffer is then a superset of the row's
  top-k so far, whatever the row's order.
* **Select.**  At the end the same radix select and an ordered scan write
  the positions out.  If the sampled threshold left fewer than k
  candidates, the row is streamed again from every valid key (exact
  whatever the sample saw; also the path of a long row with fewer than k
  valid keys).

Every barrier is CTA-uniform: what decides a branch is a block-wide sum or
a value read back from shared memory after a barrier.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from dsa.cute.gmem import _asm, aligned
from dsa.cute.topk_sm90 import (BINS, INVALID, KEYS_PER_THREAD, NO_TIE, SHIFTS, TopkSm90, f16_bits,
                                ld_shared, order_key, red_shared_add, sel, st_shared)


KEY_OF_NEG_MAX = -2139095040  # 0x80800000: the order key of -FLT_MAX, the lowest valid finite score
NEG_MAX_BITS = -8388609       # 0xFF7FFFFF: -FLT_MAX


def value_bits(t: Int32) -> Int32:
    """The fp32 pattern f with x >= f exactly when order_key(x) >= t, for
    every valid x (not NaN, not -inf): the inverse of the order key, and
    -FLT_MAX for keys at or below its key (every valid score)."""
    return sel(t <= KEY_OF_NEG_MAX, Int32(NEG_MAX_BITS), sel(t >= 0, t, t ^ 0x7FFFFFFF))


@dsl_user_op
def candidate(bits: Int32, tf: Int32, pos: Int32, L: Int32, *, loc=None, ip=None) -> Int32:
    """1 when the fp32 ``bits`` >= the fp32 ``tf`` (never for NaN) and pos < L, else 0."""
    asm = ("{\n.reg .pred p, q;\n.reg .f32 a, b;\nmov.b32 a, $1;\nmov.b32 b, $2;\n"
           "setp.ge.f32 p, a, b;\nsetp.lt.s32 q, $3, $4;\nand.pred p, p, q;\nselp.u32 $0, 1, 0, p;\n}")
    return Int32(llvm.inline_asm(T.i32(), [Int32(v).ir_value(loc=loc, ip=ip) for v in (bits, tf, pos, L)], asm,
                                 "=r,r,r,r,r", has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def at_least(bits: Int32, tf: Int32, *, loc=None, ip=None) -> Int32:
    """1 when the fp32 ``bits`` >= the fp32 ``tf`` (never for NaN), else 0."""
    asm = ("{\n.reg .pred p;\n.reg .f32 a, b;\nmov.b32 a, $1;\nmov.b32 b, $2;\n"
           "setp.ge.f32 p, a, b;\nselp.u32 $0, 1, 0, p;\n}")
    return Int32(llvm.inline_asm(T.i32(), [Int32(v).ir_value(loc=loc, ip=ip) for v in (bits, tf)], asm,
                                 "=r,r,r", has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dataclass(frozen=True)
class TopkStreamSm90Config:
    """A build: score dtype (a CuTe type), the largest k, row ends, threads
    a CTA, 4-key vectors a thread per round, the sample, the L2 prefetch
    and a launch bound (0: none)."""

    dtype: object
    k_max: int
    has_end: bool
    threads: int = 256
    vectors: int = 4
    margin4: int = 6     # candidates the sampled threshold aims at: margin4 / 4 * k
    samples: int = 1     # 4-key vectors a thread samples
    prefetch: int = 2    # rounds ahead of the loads each warp prefetches into L2 (0: none)
    min_blocks: int = 0
    coarse: bool = False  # the sampled threshold an 11-bit prefix edge (one digit pass, not two)

    @property
    def round(self) -> int:
        return self.threads * KEYS_PER_THREAD * self.vectors

    @property
    def cap(self) -> int:
        return self.k_max + self.round


def smem_bytes(c: TopkStreamSm90Config) -> int:
    """Shared memory of a build: the candidates' keys and positions, two histograms, the sample, scan words."""
    return 4 * (2 * c.cap + max(2 * BINS[0], c.k_max) + sample_words(c) + 6 * (c.threads // 32) + 48) + 64


def sample_words(c: TopkStreamSm90Config) -> int:
    """The sample's words in shared memory: ``samples`` 4-score vectors a thread."""
    return c.threads * c.samples * KEYS_PER_THREAD * c.dtype.width // 32


class TopkStreamSm90(TopkSm90):
    """Host-side builder of the kernel for one ``TopkStreamSm90Config`` (the
    digit search and the write-out are ``TopkSm90``'s)."""

    def __init__(self, config: TopkStreamSm90Config):
        c = self.config = config
        if c.threads % 32 or c.threads > BINS[2] or BINS[2] % c.threads or c.k_max % 4:
            raise ValueError(f"TopkStreamSm90: threads must be a multiple of 32 dividing {BINS[2]}, k_max of 4")
        if c.vectors not in (1, 2, 4):
            raise ValueError("TopkStreamSm90: the packed scan takes 1, 2 or 4 vectors a thread (8-bit counts)")
        if not 1 <= c.samples <= c.vectors or c.margin4 < 4:
            # a sampled row is longer than a round: samples <= vectors keeps the sample's spacing >= 1 vector
            raise ValueError("TopkStreamSm90: samples in [1, vectors], margin4 >= 4 (at least k candidates aimed at)")
        self.fit(smem_bytes(c))

    def smem_layout(self):
        """The candidates, the histograms and the scan words (as ``TopkSm90.smem_layout``)."""
        c = self.config
        fields = {
            "keys": cute.struct.Align[cute.struct.MemRange[Int32, c.cap], 16],
            "pos": cute.struct.Align[cute.struct.MemRange[Int32, c.cap], 16],
            # two histograms; the output slots at the end
            "work": cute.struct.Align[cute.struct.MemRange[Int32, max(2 * BINS[0], c.k_max)], 16],
            # the sample (cp.async: in flight without registers)
            "sample": cute.struct.Align[cute.struct.MemRange[Int32, sample_words(c)], 16],
            # the digit search's, the rounds' and the ordered scan's warp words (two sets each: by parity)
            "warp": cute.struct.MemRange[Int32, 6 * (c.threads // 32)],
            "pick": cute.struct.MemRange[Int32, 48],
        }
        return cute.struct(type("Smem", (), {"__annotations__": fields}))

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
        bk = Int32(st.keys.data_ptr().toint())
        bp = Int32(st.pos.data_ptr().toint())
        hist = Int32(st.work.data_ptr().toint())
        words = Int32(st.warp.data_ptr().toint())
        pick = Int32(st.pick.data_ptr().toint())
        samp = Int32(st.sample.data_ptr().toint())

        L = self.row_end(ends_ptr, r, S)
        row = self.row_base(scores_ptr, r, S)
        cur = cute.make_rmem_tensor((4 if const_expr(self.es == 4) else 2, c.vectors), Int32)
        self.start(cur, row, L, S, lane, warp)
        if L > c.cap:
            self.sample_load(samp, row, L, tid)
        self.clear(hist, pick, tid)
        t0 = Int32(INVALID + 1)
        if L > c.cap:
            t0 = self.sample_threshold(samp, L, K, hist, pick, words, tid, lane, warp)

        # a second stream from every valid key when the sampled threshold was too high
        n = Int32(0)
        go = Int32(1)
        for _ in cutlass.range(0, 2, 1, unroll=1):
            if go != 0:
                n = self.stream(cur, row, L, S, t0, K, bk, bp, hist, words, pick, tid, lane, warp)
                go = Int32(0)
                # fewer than K after a sampled threshold: the sample misled, or the row has
                # fewer than K valid keys; streaming again from every valid key is exact either way
                if n < K and t0 != INVALID + 1:
                    go = Int32(1)
                    t0 = Int32(INVALID + 1)
                    self.start(cur, row, L, S, lane, warp)

        t_hi, t_eq, need_eq = self.select(bk, n, K, hist, pick, words, tid, lane, warp)
        self.ordered(bk, bp, n, t_hi, t_eq, need_eq, hist, words + 4 * 4 * self.warps, tid, lane, warp, False)
        cute.arch.sync_threads()
        self.write_out(hist, idx_ptr, len_ptr, r, K, cutlass.min(K, n), tid)

    @cute.jit
    def load_round(self, raw: cute.Tensor, row: Int64, base, L, lane, warp):
        """A round's vectors (warp w's segment from base + w * 128 * vectors)
        into ``raw``; vectors past L load the row's first one (discarded)."""
        c = self.config
        words = 4 if const_expr(self.es == 4) else 2
        seg = base + warp * (32 * KEYS_PER_THREAD * c.vectors)
        for j in cutlass.range_constexpr(c.vectors):
            pos = seg + j * (32 * KEYS_PER_THREAD) + lane * KEYS_PER_THREAD
            src = row + Int64(sel(pos < L, pos, Int32(0))) * self.es
            cute.autovec_copy(cute.make_tensor(aligned(Int32, src, 4 * words), cute.make_layout((words,))),
                              raw[None, j])

    @cute.jit
    def start(self, cur: cute.Tensor, row: Int64, L, S, lane, warp):
        """The first round's loads into ``cur``, and the prefetch of the rounds after it."""
        c = self.config
        self.load_round(cur, row, Int32(0), L, lane, warp)
        for p in cutlass.range_constexpr(1, c.prefetch + 1):
            self.prefetch_l2(row, p * c.round, L, S, lane, warp)

    @cute.jit
    def prefetch_l2(self, row: Int64, base, L, S, lane, warp):
        """Warp ``warp``'s segment of the round at base requested into L2
        (lane 0; only a segment that starts before L and lies in the row)."""
        seg_keys = 32 * KEYS_PER_THREAD * self.config.vectors
        seg = base + warp * seg_keys
        if lane == 0 and seg < L and seg + seg_keys <= S:
            _asm("cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r", row + Int64(seg) * self.es,
                 Int32(seg_keys * self.es))

    @cute.jit
    def bits_of(self, raw: cute.Tensor, i: cutlass.Constexpr, j: cutlass.Constexpr) -> Int32:
        """The fp32 pattern of score i of vector j of ``raw`` (16-bit scores widened exactly)."""
        if const_expr(self.es == 4):
            bits = raw[i, j]
        elif const_expr(self.config.dtype is cutlass.Float16):
            bits = f16_bits(raw[i // 2, j], i % 2 == 1)
        else:  # bf16: the upper 16 bits of an fp32
            bits = (raw[i // 2, j] << 16) if const_expr(i % 2 == 0) else (raw[i // 2, j] & -65536)
        return bits

    @cute.jit
    def keys_of(self, raw: cute.Tensor, j: cutlass.Constexpr, kv: cute.Tensor, pos, L):
        """The order keys of vector j of ``raw`` (positions pos ..) into kv[:, j]; INVALID past L."""
        for i in cutlass.range_constexpr(KEYS_PER_THREAD):
            kv[i, j] = sel(pos + i < L, order_key(self.bits_of(raw, i, j)), Int32(INVALID))

    def sample_step(self, L):
        """The spacing of the sampled vectors over [0, L), in keys (a multiple of 4)."""
        return (L // KEYS_PER_THREAD) // (self.config.threads * self.config.samples) * KEYS_PER_THREAD

    @cute.jit
    def sample_load(self, samp: Int32, row: Int64, L, tid):
        """The sample's vectors (``samples`` a thread, spread over [0, L))
        copied to shared memory at ``samp`` by cp.async: in flight without
        holding registers (the stream's are at the launch bound)."""
        c = self.config
        step = self.sample_step(L)
        for j in cutlass.range_constexpr(c.samples):
            v = tid + j * c.threads
            src = row + Int64(v * step) * self.es
            if const_expr(self.es == 4):
                _asm("cp.async.cg.shared.global [$0], [$1], 16;", "r,l", samp + 16 * v, src)
            else:
                _asm("cp.async.ca.shared.global [$0], [$1], 8;", "r,l", samp + 8 * v, src)

    @cute.jit
    def sample_threshold(self, samp: Int32, L, K, hist: Int32, pick: Int32, words: Int32, tid, lane,
                         warp) -> Int32:
        """A key about margin4 / 4 * K of the row's keys reach: the lower
        edge of the 22-bit prefix (11-bit with ``coarse``) of the sample's
        matching rank (the vectors ``sample_load`` copied to ``samp``);
        INVALID + 1 when too few valid."""
        c = self.config
        wd = 4 if const_expr(self.es == 4) else 2
        ns = c.threads * c.samples
        raw = cute.make_rmem_tensor((wd, c.samples), Int32)
        kv = cute.make_rmem_tensor((KEYS_PER_THREAD, c.samples), Int32)
        step = self.sample_step(L)
        _asm("cp.async.wait_all;", "")  # a thread reads only the vectors it copied
        for j in cutlass.range_constexpr(c.samples):
            for w in cutlass.range_constexpr(wd):
                raw[w, j] = ld_shared(samp + 4 * (wd * (tid + j * c.threads) + w))
        for j in cutlass.range_constexpr(c.samples):
            self.keys_of(raw, j, kv, (tid + j * c.threads) * step, L)
            for i in cutlass.range_constexpr(KEYS_PER_THREAD):
                if kv[i, j] != INVALID:
                    red_shared_add(hist + 4 * ((kv[i, j] >> SHIFTS[0]) + BINS[0] // 2))
        cute.arch.sync_threads()
        # the rank among ns * 4 sampled keys that about margin4 / 4 * K of the row's L reach
        rank = cutlass.max((c.margin4 * ns * K + L - 1) // L, Int32(1))
        d1, above, h, _ = self.pick_digit(hist, BINS[0], rank, pick, words, tid, lane, warp)
        self.zero(hist, BINS[0], tid)
        t = Int32(INVALID + 1)
        if d1 >= 0:
            p1 = d1 - BINS[0] // 2
            t = p1 * (1 << SHIFTS[0])
            need = rank - above
            if const_expr(not c.coarse):
                if h != need:
                    for j in cutlass.range_constexpr(c.samples):
                        for i in cutlass.range_constexpr(KEYS_PER_THREAD):
                            if (kv[i, j] >> SHIFTS[0]) == p1:
                                red_shared_add(hist + 4 * (BINS[0] + ((kv[i, j] >> SHIFTS[1]) & (BINS[1] - 1))))
                    cute.arch.sync_threads()
                    d2, _, _, _ = self.pick_digit(hist + 4 * BINS[0], BINS[1], need, pick + 16, words, tid, lane,
                                                  warp)
                    self.zero(hist + 4 * BINS[0], BINS[1], tid)
                    t = (p1 * BINS[1] + d2) * (1 << SHIFTS[1])
        return t

    @cute.jit
    def stream(self, cur: cute.Tensor, row: Int64, L, S, t0, K, bk: Int32, bp: Int32, hist: Int32,
               words: Int32, pick: Int32, tid, lane, warp) -> Int32:
        """The row's scores at or above the running threshold appended to the
        buffer (key and position), which is compacted to the top K whenever
        a round would overflow it; returns the entries.  ``cur`` holds the
        first round's loads (``start``).  Scores are tested as fp32 against
        the threshold's value (``value_bits``): a key is made only for a
        candidate.  Two rounds an iteration, the loads' registers swapping
        roles (no copy between them)."""
        c = self.config
        nxt = cute.make_rmem_tensor((4 if const_expr(self.es == 4) else 2, c.vectors), Int32)
        n = Int32(0)
        t = t0
        tf = value_bits(t0)
        n_rounds = (L + c.round - 1) // c.round
        for ri in cutlass.range(0, n_rounds, 2, unroll=1):
            n, t, tf = self.round_(cur, nxt, ri, 0, n, t, tf, row, L, S, K, bk, bp, hist, words, pick, tid, lane,
                                   warp)
            if ri + 1 < n_rounds:
                n, t, tf = self.round_(nxt, cur, ri + 1, 1, n, t, tf, row, L, S, K, bk, bp, hist, words, pick, tid,
                                       lane, warp)
        cute.arch.sync_threads()
        return n

    @cute.jit
    def round_(self, cur: cute.Tensor, nxt: cute.Tensor, ri, parity: cutlass.Constexpr, n, t, tf, row: Int64, L,
               S, K, bk: Int32, bp: Int32, hist: Int32, words: Int32, pick: Int32, tid, lane, warp):
        """Round ri of the stream (its scores in ``cur``; the next round's
        loads into ``nxt``): returns the buffer's entries, the threshold
        and its fp32 value after it."""
        c = self.config
        V = c.vectors
        offs = cute.make_rmem_tensor((V,), Int32)
        cm = cute.make_rmem_tensor((V,), Int32)
        base = ri * c.round
        self.load_round(nxt, row, base + c.round, L, lane, warp)
        if const_expr(c.prefetch > 0):
            self.prefetch_l2(row, base + (c.prefetch + 1) * c.round, L, S, lane, warp)
        seg = base + warp * (32 * KEYS_PER_THREAD * V) + lane * KEYS_PER_THREAD
        inside = base + c.round <= L  # the whole round lies before the row's end (CTA-uniform)
        self.flag(cur, cm, tf, seg, L, inside)
        rw = words + 4 * 2 * self.warps + 4 * self.warps * parity
        total, before = self.locate(cm, offs, rw, lane, warp)
        if n + total > c.cap:
            t_hi, t_eq, need_eq = self.select(bk, n, K, hist, pick, words, tid, lane, warp)
            self.ordered(bk, bp, n, t_hi, t_eq, need_eq, bk, words + 4 * 4 * self.warps, tid, lane, warp, True)
            n = K
            t = t_hi
            tf = value_bits(t)
            self.flag(cur, cm, tf, seg, L, inside)
            total, before = self.locate(cm, offs, rw, lane, warp)
        for j in cutlass.range_constexpr(V):
            o = n + before + offs[j]
            # a lane's candidates of the vector one at a time: a warp takes as many
            # steps as its busiest lane (most lanes have none), not a branch a score
            m = cm[j]
            b0 = self.bits_of(cur, 0, j)
            b1 = self.bits_of(cur, 1, j)
            b2 = self.bits_of(cur, 2, j)
            b3 = self.bits_of(cur, 3, j)
            while m != 0:
                low = m & (0 - m)
                i = cute.arch.popc(low - 1)
                bits = sel(i == 0, b0, sel(i == 1, b1, sel(i == 2, b2, b3)))
                st_shared(bk + 4 * o, order_key(bits))
                st_shared(bp + 4 * o, seg + j * (32 * KEYS_PER_THREAD) + i)
                o = o + 1
                m = m ^ low
        return n + total, t, tf

    @cute.jit
    def flag(self, cur: cute.Tensor, cm: cute.Tensor, tf, seg, L, inside):
        """cm[j]: bit i set where score i of vector j (position seg + 128 j + i) is a candidate against
        ``tf`` (a mask a vector, not a register a score: the stream's registers are at the launch bound).
        Positions are checked against L only in a round that ``inside`` says reaches past it."""
        if inside:
            self.masks(cur, cm, tf, seg, L, False)
        else:
            self.masks(cur, cm, tf, seg, L, True)

    @cute.jit
    def masks(self, cur: cute.Tensor, cm: cute.Tensor, tf, seg, L, check_end: cutlass.Constexpr):
        """``flag``'s masks, each position tested against L or (``check_end`` False) none."""
        for j in cutlass.range_constexpr(self.config.vectors):
            m = Int32(0)
            for i in cutlass.range_constexpr(KEYS_PER_THREAD):
                bits = self.bits_of(cur, i, j)
                if const_expr(check_end):
                    m = m | (candidate(bits, tf, seg + j * (32 * KEYS_PER_THREAD) + i, L) << i)
                else:
                    m = m | (at_least(bits, tf) << i)
            cm[j] = m

    @cute.jit
    def locate(self, cm: cute.Tensor, offs: cute.Tensor, rw: Int32, lane, warp):
        """Where this thread's candidates (``flag``'s masks) go in a round, in
        position order (warp segment, vector, lane, score): offs[j] the
        place of its first of vector j in the warp's share; returns (the
        round's total, the entries of the warps before this one).  A lane's
        count a vector is one byte of a word (at most 128 a warp): one
        inclusive warp scan of the word, one barrier."""
        c = self.config
        mine = Int32(0)
        for j in cutlass.range_constexpr(c.vectors):
            mine = mine + (cute.arch.popc(cm[j]) << (8 * j))
        x = mine
        for o in cutlass.range_constexpr(5):
            y = cute.arch.shuffle_sync_up(x, offset=1 << o)
            x = x + sel(lane >= (1 << o), y, Int32(0))
        tot = cute.arch.shuffle_sync(x, 31)
        excl = x - mine
        wsum = Int32(0)
        for j in cutlass.range_constexpr(c.vectors):
            offs[j] = wsum + ((excl >> (8 * j)) & 255)
            wsum = wsum + ((tot >> (8 * j)) & 255)
        if lane == 0:
            st_shared(rw + 4 * warp, wsum)
        cute.arch.sync_threads()
        total = Int32(0)
        before = Int32(0)
        for w in cutlass.range_constexpr(self.warps):
            v = ld_shared(rw + 4 * w)
            total = total + v
            before = before + sel(w < warp, v, Int32(0))
        return total, before

    @cute.jit
    def count_buffer(self, bk: Int32, n, hist: Int32, p: cutlass.Constexpr, prefix, tid):
        """Digit p (0, 1, 2) of the buffer's n keys whose digits above it are ``prefix`` counted in ``hist``."""
        c = self.config
        for v in cutlass.range(tid, (n + 3) // 4, c.threads, unroll=1):
            kv = cute.make_rmem_tensor((KEYS_PER_THREAD,), Int32)
            cute.autovec_copy(cute.make_tensor(cute.make_ptr(Int32, bk + 16 * v, cute.AddressSpace.smem,
                                                             assumed_align=16), cute.make_layout((4,))), kv)
            for i in cutlass.range_constexpr(KEYS_PER_THREAD):
                k_ = kv[i]
                if const_expr(p == 0):
                    if 4 * v + i < n:
                        red_shared_add(hist + 4 * ((k_ >> SHIFTS[0]) + BINS[0] // 2))
                else:
                    if 4 * v + i < n and (k_ >> SHIFTS[p - 1]) == prefix:
                        red_shared_add(hist + 4 * ((k_ >> SHIFTS[p]) & (BINS[p] - 1)))

    @cute.jit
    def select(self, bk: Int32, n, K, hist: Int32, pick: Int32, words: Int32, tid, lane, warp):
        """The cut of the buffer's top K (``topk_sm90``'s three digit
        passes): (t_hi, t_eq, need_eq): keys >= t_hi and the first need_eq
        keys == t_eq.  Leaves both histograms zero."""
        if tid == 0:
            st_shared(pick, Int32(-1))  # no digit when fewer than K keys: all are taken
        self.count_buffer(bk, n, hist, 0, Int32(0), tid)
        cute.arch.sync_threads()
        d1, above, h, _ = self.pick_digit(hist, BINS[0], K, pick, words, tid, lane, warp)
        self.zero(hist, BINS[0], tid)
        t_hi = Int32(INVALID + 1)
        t_eq = Int32(NO_TIE)
        need_eq = Int32(0)
        if d1 >= 0:
            p1 = d1 - BINS[0] // 2
            need = K - above
            t_hi = p1 * (1 << SHIFTS[0])
            if h != need:
                h2 = hist + 4 * BINS[0]
                self.count_buffer(bk, n, h2, 1, p1, tid)
                cute.arch.sync_threads()
                d2, above, h, _ = self.pick_digit(h2, BINS[1], need, pick + 16, words, tid, lane, warp)
                self.zero(h2, BINS[1], tid)
                p2 = p1 * BINS[1] + d2
                need = need - above
                t_hi = p2 * (1 << SHIFTS[1])
                if h != need:
                    self.count_buffer(bk, n, hist, 2, p2, tid)
                    cute.arch.sync_threads()
                    d3, above, _, _ = self.pick_digit(hist, BINS[2], need, pick + 32, words, tid, lane, warp)
                    self.zero(hist, BINS[2], tid)
                    t_eq = p2 * BINS[2] + d3
                    t_hi = t_eq + 1
                    need_eq = need - above
        return t_hi, t_eq, need_eq

    @cute.jit
    def ordered(self, bk: Int32, bp: Int32, n, t_hi, t_eq, need_eq, dst: Int32, words: Int32, tid, lane, warp,
                compact: cutlass.Constexpr):
        """The selected entries of the buffer (keys >= t_hi, the first
        need_eq == t_eq) in order: their keys and positions moved to the
        buffer's front (``compact``; in place: an entry never moves up), or
        their positions to the slots at ``dst``.  A thread takes 4
        contiguous entries a group, one barrier a group."""
        c = self.config
        gt_run = Int32(0)
        eq_run = Int32(0)
        for g in cutlass.range(0, (n + 4 * c.threads - 1) // (4 * c.threads), 1, unroll=1):
            e0 = (g * c.threads + tid) * 4
            kv = cute.make_rmem_tensor((KEYS_PER_THREAD,), Int32)
            pv = cute.make_rmem_tensor((KEYS_PER_THREAD,), Int32)
            cute.autovec_copy(cute.make_tensor(cute.make_ptr(Int32, bk + 4 * e0, cute.AddressSpace.smem,
                                                             assumed_align=16), cute.make_layout((4,))), kv)
            cute.autovec_copy(cute.make_tensor(cute.make_ptr(Int32, bp + 4 * e0, cute.AddressSpace.smem,
                                                             assumed_align=16), cute.make_layout((4,))), pv)
            ng = Int32(0)
            ne = Int32(0)
            for i in cutlass.range_constexpr(KEYS_PER_THREAD):
                k_ = sel(e0 + i < n, kv[i], Int32(INVALID))
                kv[i] = k_
                ng = ng + sel(k_ >= t_hi, Int32(1), Int32(0))
                ne = ne + sel(k_ == t_eq, Int32(1), Int32(0))
            # by parity: one barrier a group
            before, tot = self.scan_counts(ng, ne, words + 4 * self.warps * (g % 2), lane, warp)
            gb = gt_run + (before & 65535)
            eb = eq_run + (before >> 16)
            if (ng + ne) > 0:
                for i in cutlass.range_constexpr(KEYS_PER_THREAD):
                    k_ = kv[i]
                    gt = k_ >= t_hi
                    eq = k_ == t_eq
                    if gt or (eq and eb < need_eq):
                        slot = gb + cutlass.min(eb, need_eq)
                        if const_expr(compact):
                            st_shared(dst + 4 * slot, k_)
                            st_shared(bp + 4 * slot, pv[i])
                        else:
                            st_shared(dst + 4 * slot, pv[i])
                    gb = gb + sel(gt, Int32(1), Int32(0))
                    eb = eb + sel(eq, Int32(1), Int32(0))
            gt_run = gt_run + (tot & 65535)
            eq_run = eq_run + (tot >> 16)
        cute.arch.sync_threads()
