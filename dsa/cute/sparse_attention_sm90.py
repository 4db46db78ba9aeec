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

The validity rules (docs/semantics.md) are ``dsa.cute.rules``: row maxima
are in the log2 domain; a row with no valid slot so far keeps -inf and is
shifted by 0, so no (-inf) - (-inf) appears.  The loop stops after the last
block holding a valid slot (topk_length), so a row of length L costs about
L / K of a full row.  The bounds build (``FwdSm90Config.bounds``, for the
deterministic backward) also writes, for each block, a bound of every slot's
P summed over the heads (``head_sums``).  The barriers and timed waits are
``dsa.cute.pipeline``, the persistent tile order ``dsa.cute.scheduler``.
Compiled per ``FwdSm90Config`` and cached by ``dsa.cute.sparse_attention``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup

from dsa.cute import pipeline, rules, scheduler
from dsa.cute.gmem import aligned, copy_head_rows, gather_copier, load
from dsa.cute.host import head_blocks
from dsa.cute.pipeline import NamedBarrier, Timer, freed_phase, named_barriers, phase
from dsa.cute.rules import LOG2E, finite_shift

BLOCK_H = 64   # query heads per CTA: the M of one wgmma
THREADS = 384  # producer + two consumer warpgroups

PRODUCER_REGS = 56   # 56 + 2 * 224 registers a thread fill the register file
CONSUMER_REGS = 224
# what a CTA of THREADS threads is launched with at most, a thread (the file's 64K, in steps of 8): the
# warpgroups' setmaxnreg targets may not sum past 3 x this, or an increase waits forever for registers
LAUNCH_REGS = 65536 // THREADS // 8 * 8
BN = 64        # slots per block and stage; two stages
MASK_WRITERS = 16  # producer threads that write a stage's mask: one per row of a copy pass
L_CHUNKS = 4   # 64-column chunks of an L half (the value columns of consumer 0)
SMEM_LIMIT = 227 * 1024  # the largest dynamic shared memory of an SM90 CTA


# Profile counters (cycles, per warp; SparseAttnFwdSm90(profile=True)):
# consumers: the tile loop, stage-full waits, hand-off and row-sum barrier
# waits, wgmma waits, the Q wait, the epilogue; the producer: the tile loop,
# stage-empty waits, kv-row lookups, copy issue, the Q-empty wait.
PROF_TOTAL, PROF_FULL, PROF_BAR, PROF_WGMMA, PROF_Q, PROF_EPI = range(6)
PROF_EMPTY, PROF_LOOKUP, PROF_ISSUE = PROF_FULL, PROF_BAR, PROF_WGMMA
PROF_N = 8


@named_barriers
class Barrier(NamedBarrier):
    """Named barriers between the consumers: one side arrives, the other waits."""

    MAX0 = 1   # consumer 0's row maxima of the pair are in shared memory
    MAX1 = 2   # consumer 1's (the pair's) maxima are
    P0 = 3     # consumer 0's P, at the pair's maxima, is
    P1 = 4     # consumer 1's P is
    ROW_SUMS = 5


PAIR_THREADS = 256


@dataclass(frozen=True)
class FwdSm90Config(scheduler.ProblemConfig):
    """The static configuration one compiled kernel serves (its compile key):
    the problem, then has_sink (the call passes ``sink``), profile (per-warp
    cycle counters into prof_ptr, ``PROF_*``), refill (False: a timing
    build whose producer gathers each stage on its first use only and
    afterwards just signals it, so the consumers never wait for a gather's
    round trip; its out is not the attention) and bounds (the deterministic
    backward's slot bounds written beside out: ``SparseAttnFwdSm90.head_sums``)
    and ordered (the tiles taken in a token order the launch passes,
    ``scheduler.SlotTiles.order``)."""

    has_sink: bool
    profile: bool = False
    refill: bool = True
    bounds: bool = False
    ordered: bool = False


def smem_bytes(D: int, d_v: int, elem_bytes: int) -> int:
    """Shared memory of the kernel's ``Smem`` struct: 12 barriers, Q [64, D],
    two K stages [64, D], P (one buffer when D > d_v: consumer 0's lives in
    stage 0's RoPE columns), row maxima, row sums and masks; the tiles
    1024-byte aligned for the 128-byte swizzle."""
    def up(n: int) -> int:
        return -(-n // 1024) * 1024

    p_elems = (1 if D > d_v else 2) * BLOCK_H * BN
    tiles = up(12 * 8) + up(BLOCK_H * D * elem_bytes) + up(2 * BN * D * elem_bytes)
    return up(tiles + p_elems * elem_bytes) + 4 * (2 * BLOCK_H + 4 * BLOCK_H + 2 * BN)


@dataclass(frozen=True)
class ConsumerState:
    """What one consumer's steps share over all its tiles.  Built once before
    the tile loop and never reassigned in a dynamic loop (its tensors are
    updated in place), so it travels through the traced code as plain Python
    and needs no MLIR value protocol."""

    qk_mma: Any        # S = Q K^T, both operands in shared memory
    pv_mma: Any        # O += P V, P from registers
    pv_mma_ss: Any     # O += P V, the other consumer's P from shared memory
    tSrQ: Any          # Q and the two K stages as wgmma operands
    tSrK: Any
    acc_s: Any         # S of this consumer's block (fp32)
    acc_o: Any         # O of its 256 value columns (fp32)
    r_p: Any           # P in q.dtype
    mask: Any          # this thread's columns of the block's mask
    m_run: Any         # running row maxima (log2 domain) and row sums
    l_run: Any
    m0: Any            # consumer 0's / the pair's row maxima in shared memory
    m1: Any
    tPs_own: Any       # where this consumer stores its P for the other
    tOrV_own: Any      # V of its own block, of the other's, the other's P
    tOrV_oth: Any
    tOrP_oth: Any
    full: Any          # the stage halves' barriers (s, h at 2 s + h)
    empty: Any
    ok: Any            # the producer's masks, [stage, slot]
    row_lo: Any        # this thread's rows row_lo, row_lo + 8 and first column
    col_lane: Any
    lane: Any
    scale_log2: Any    # sm_scale * log2(e)
    bnd: Any = None    # the bounds build: (head sums pointer, levels pointer, blocks a row, this
    #                    tile's offsets into both, rmem Int64 (2,)), else None


class SparseAttnFwdSm90:
    """Host-side builder of the kernel for one static configuration."""

    producer_regs = PRODUCER_REGS
    consumer_regs = CONSUMER_REGS
    bounds = False
    # lockstep: consumer 0 computes every block's S and the left value
    # columns, consumer 1 only the right ones (P from shared memory, behind
    # the stage's ``ready`` barrier); a subclass's consumers and producer
    # implement it (dsa.cute.decode_sm90), this kernel's are the staggered pair
    lockstep = False
    # producer warpgroups: a subclass may add a second one as warpgroup 3 (the
    # CTA then has 512 threads, launched with 128 registers each)
    producer_wgs = 1

    def __init__(self, dtype, D: int, d_v: int, H: int, G: int, has_len: bool, has_sink: bool,
                 profile: bool = False, refill: bool = True, bounds: bool = False, ordered: bool = False):
        why = self.can_implement(dtype, D, d_v, H, G)
        if why is not None:
            raise ValueError(f"SparseAttnFwdSm90: {why}")
        if ordered and not has_len:
            raise ValueError("SparseAttnFwdSm90: a token order serves calls with topk_length only")
        self.config = FwdSm90Config(dtype, D, d_v, H, G, has_len, has_sink, profile, refill, bounds, ordered)
        self.ordered = ordered
        self.bounds = bounds
        self.dtype = dtype
        self.D, self.d_v, self.H, self.G = D, d_v, H, G
        self.HG = H // G
        # a kv head of 16 or 32 query heads (a tensor-parallel shard) is one
        # tile of 64 rows: the rows past its heads are zero, and their out,
        # lse and sink are neither read nor written
        self.rows = min(self.HG, BLOCK_H)
        self.HB = head_blocks(self.HG, BLOCK_H)
        self.dv_half = d_v // 2
        self.has_len, self.has_sink = has_len, has_sink
        self.profile = profile
        self.refill = refill
        self.timer = Timer(profile, PROF_N)

    @classmethod
    def from_config(cls, config: FwdSm90Config) -> "SparseAttnFwdSm90":
        return cls(**{f.name: getattr(config, f.name) for f in fields(config)})

    @staticmethod
    def can_implement(dtype, D: int, d_v: int, H: int, G: int) -> Optional[str]:
        """None when the kernel serves this configuration, else the reason.
        dtype: ``cutlass.BFloat16`` / ``cutlass.Float16`` (anything else is
        refused, named as given)."""
        return scheduler.kernel_reason(dtype, D, d_v, H, G, BLOCK_H, smem_bytes, SMEM_LIMIT, "SM90",
                                       scheduler.PADDED_HEADS)

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        sink_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, zero_ptr: cute.Pointer,
        prof_ptr: cute.Pointer, hs_ptr: cute.Pointer, lvl_ptr: cute.Pointer, ord_ptr: cute.Pointer,
        T: Int32, N: Int32, K: Int32, scale_log2: Float32, n_cta: Int32, stream,
    ):
        mmas, layouts = self.operands()
        # tiles (token, kv head, head block) in the order of dsa.cute.scheduler
        n_tiles = scheduler.tile_count(T, self.G, self.HB)
        self.kernel(
            *mmas, *layouts,
            q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr, zero_ptr, prof_ptr, hs_ptr, lvl_ptr,
            ord_ptr, N, K, n_tiles, scale_log2,
        ).launch(grid=[scheduler.grid_size(n_cta, n_tiles), 1, 1], block=[THREADS, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    @cute.jit
    def operands(self):
        """The wgmma atoms (S = Q K^T; O += P V with P from registers or
        from shared memory) and the shared-memory layouts (Q, K stages, V,
        P); sets ``self.smem``, the kernel's shared-memory struct.  Called
        while a launcher is traced."""
        dt = self.dtype
        K_ = warpgroup.OperandMajorMode.K
        MN = warpgroup.OperandMajorMode.MN
        qk_mma = cute.make_tiled_mma(cute.make_mma_atom(warpgroup.MmaF16BF16Op(
            dt, Float32, (BLOCK_H, BN, 16), warpgroup.OperandSource.SMEM, K_, K_)), (1, 1, 1))
        # a CTA of 512 threads compiles every instruction within 128 registers: P V as two wgmma of 128
        # columns each (the accumulator's registers in the same order as one of 256)
        pv_n = self.dv_half if self.producer_wgs == 1 else self.dv_half // 2
        pv_mma = cute.make_tiled_mma(cute.make_mma_atom(warpgroup.MmaF16BF16Op(
            dt, Float32, (BLOCK_H, pv_n, 16), warpgroup.OperandSource.RMEM, K_, MN)), (1, 1, 1))
        pv_mma_ss = cute.make_tiled_mma(cute.make_mma_atom(warpgroup.MmaF16BF16Op(
            dt, Float32, (BLOCK_H, pv_n, 16), warpgroup.OperandSource.SMEM, K_, MN)), (1, 1, 1))
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
        class Smem:  # smem_bytes() is its size
            q_full: cute.struct.MemRange[Int64, 1]
            q_empty: cute.struct.MemRange[Int64, 1]
            full: cute.struct.MemRange[Int64, 4]   # stage s, half h at 2 s + h (L = 0, R = 1)
            empty: cute.struct.MemRange[Int64, 4]
            # lockstep builds: stage s's P and row maxima are in shared memory
            # (right after ``empty``: a lockstep consumer finds them at empty + 4)
            ready: cute.struct.MemRange[Int64, 2]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sq_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sk_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[dt, p_elems], 1024]
            sM: cute.struct.MemRange[Float32, 2 * BLOCK_H]
            sL: cute.struct.MemRange[Float32, 4 * BLOCK_H]  # row sums, by row parity and consumer
            # the mask of the block in each stage, by slot: 0 (valid) or -inf
            sOk: cute.struct.MemRange[Float32, 2 * BN]

        self.smem = Smem
        return (qk_mma, pv_mma, pv_mma_ss), (sq_layout, sk_layout, sv_layout, sp_layout)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, pv_mma_ss: cute.TiledMma,
        sq_layout: cute.ComposedLayout, sk_layout: cute.ComposedLayout, sv_layout: cute.ComposedLayout,
        sp_layout: cute.ComposedLayout,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        sink_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, zero_ptr: cute.Pointer,
        prof_ptr: cute.Pointer, hs_ptr: cute.Pointer, lvl_ptr: cute.Pointer, ord_ptr: cute.Pointer,
        N: Int32, K: Int32, n_tiles: Int32, scale_log2: Float32,
    ):
        self.run((qk_mma, pv_mma, pv_mma_ss), (sv_layout, sp_layout), sq_layout, sk_layout, n_tiles,
                 (idx_ptr, len_ptr, K, ord_ptr), (kv_ptr, zero_ptr, N), q_ptr, sink_ptr, out_ptr, lse_ptr, prof_ptr,
                 scale_log2, (hs_ptr, lvl_ptr, (K + BN - 1) // BN))

    @cute.jit
    def run(self, mmas, pv_layouts, sq_layout: cute.ComposedLayout, sk_layout: cute.ComposedLayout, n_tiles,
            tile_args, kv, q_ptr: cute.Pointer, sink_ptr: cute.Pointer, out_ptr: cute.Pointer,
            lse_ptr: cute.Pointer, prof_ptr: cute.Pointer, scale_log2: Float32, bound_args=None):
        """The kernel body: shared memory, barriers, then the producer or a
        consumer by warpgroup.  tile_args: what ``slot_tiles`` needs besides
        the schedule; kv: where the producer reads rows from (``row_sources``);
        bound_args: the bounds build's (head sums pointer, levels pointer,
        blocks a row)."""
        qk_mma, pv_mma, pv_mma_ss = mmas
        sv_layout, sp_layout = pv_layouts
        tidx, _, _ = cute.arch.thread_idx()
        sched = scheduler.TileScheduler.create(n_tiles, self.G, self.HB)
        wg = cute.arch.make_warp_uniform(tidx // 128)

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(self.smem)
        bars = (st.q_full.data_ptr(), st.q_empty.data_ptr(), st.full.data_ptr(), st.empty.data_ptr())
        q_full, q_empty, full, empty = bars
        sQ = st.sQ.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sK = st.sK.get_tensor(sk_layout.outer, swizzle=sk_layout.inner)

        arrivals = [(q_full, 0, 128),    # the producer's threads
                    (q_empty, 0, 256)]   # both consumers, past their last S of a row
        for h in cutlass.range_constexpr(4):
            # the producer's threads; the first half filled of a stage (L of
            # 0, R of 1) also carries its mask, from one thread a row
            arrivals.append((full, h, self.fill_arrivals(h) + (self.mask_writers() if h in (0, 3) else 0)))
            arrivals.append((empty, h, self.release_arrivals()))  # the consumer reading that half as V
        if const_expr(self.lockstep):
            arrivals += [(st.ready.data_ptr(), s, 128) for s in range(2)]  # consumer 0's threads
        pipeline.init_mbarriers(tidx, arrivals)
        self.cluster_start()

        tiles = self.slot_tiles(sched, *tile_args)
        for mma in (qk_mma, pv_mma, pv_mma_ss):
            mma.set(warpgroup.Field.ACCUMULATE, True)
        if const_expr(self.producer_wgs == 1):
            produces = wg == 0
        else:
            produces = wg % 3 == 0  # warpgroups 0 and 3
        if produces:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            self.timer.start()
            self.producer(tidx, sQ, sK, st.sOk.data_ptr(), bars, tiles, q_ptr, *kv)
            self.timer.store(prof_ptr, tidx, self.threads() // 32, PROF_TOTAL)
            self.cluster_end()
        else:
            args = (qk_mma, pv_mma, pv_mma_ss, sv_layout, sp_layout, tidx % 128, sQ, sK,
                    st.sP.data_ptr(), st.sM.data_ptr(), st.sL.data_ptr(), st.sOk.data_ptr(), bars, tiles,
                    sink_ptr, out_ptr, lse_ptr, scale_log2, bound_args)
            self.timer.start()
            if wg == 1:
                self.set_consumer_regs(0)
                self.consumer(0, *args)
            else:
                self.set_consumer_regs(1)
                self.consumer(1, *args)
            self.timer.store(prof_ptr, tidx, self.threads() // 32, PROF_TOTAL)
            self.cluster_end()

    def set_consumer_regs(self, w: int):
        """Consumer w's setmaxnreg: ``consumer_regs``, or per consumer when it
        is a pair (a lockstep build's consumers differ); up from the launch's
        registers, or down below them."""
        regs = self.consumer_regs if isinstance(self.consumer_regs, int) else self.consumer_regs[w]
        if regs >= self.launch_regs():
            cute.arch.setmaxregister_increase(regs)
        else:
            cute.arch.setmaxregister_decrease(regs)

    # ------------------------------------------------ what a subclass changes
    # A decode kernel (dsa.cute.decode_sm90) replaces these: its tiles carry a
    # split of the slots, its rows come from a paged cache, its epilogue may
    # write a partial result.

    def threads(self) -> int:
        """Threads of a CTA: the producer warpgroups and the two consumers."""
        return THREADS + 128 * (self.producer_wgs - 1)

    def launch_regs(self) -> int:
        """Registers a thread of a CTA is launched with (``LAUNCH_REGS`` at 384 threads)."""
        return 65536 // self.threads() // 8 * 8

    def fill_arrivals(self, h: int) -> int:
        """Arrivals that complete half h's fill (the mask's come on top): one
        per producer thread, its ``cp.async.mbarrier.arrive.noinc``."""
        return 128

    def mask_writers(self) -> int:
        """Producer threads that write a stage's mask (and arrive with it)."""
        return MASK_WRITERS

    def release_arrivals(self) -> int:
        """Arrivals that free a half stage: the threads of the consumer reading it as V (``release``)."""
        return 128

    def release(self, cs: "ConsumerState", h: int):
        """This consumer thread's arrival on half h's empty barrier (``release_arrivals`` counts it)."""
        cute.arch.mbarrier_arrive(cs.empty + h)

    def cluster_start(self):
        """Past the barriers' initialisation, before any thread uses one: nothing (a CTA alone)."""

    def cluster_end(self):
        """Every thread at the end of its loop: nothing (a CTA alone)."""

    def stage_partitions(self, thr, sK, tidx, row):
        """This thread's slices of the two K stages as ``copy_half`` fills
        them (``thr``: its slice of the gather's tiled copy; ``row``: its
        first row of a block)."""
        return thr.partition_D(sK[None, None, 0]), thr.partition_D(sK[None, None, 1])

    def row_addresses(self):
        """Two blocks' worth of this thread's row sources (``resolve_rows``
        writes them, ``copy_half`` reads them): a byte address a row."""
        R = self.rows_per_thread()
        return cute.make_rmem_tensor((R,), Int64), cute.make_rmem_tensor((R,), Int64)

    def signal_fill(self, bar):
        """This thread's arrival on a half's full barrier once its copies of
        the half have landed (``fill_arrivals`` counts it)."""
        cute.arch.cp_async_mbarrier_arrive_noinc(bar)

    def slot_tiles(self, sched, idx_ptr, len_ptr, K, ord_ptr):
        """This CTA's tiles: (token, kv head, head block) over all K slots,
        in the token order at ord_ptr in the ordered build."""
        return scheduler.SlotTiles(sched, idx_ptr, len_ptr, K, ord_ptr if self.ordered else None)

    def tile_of(self, tiles, tile_id):
        """(t, g, head0, L, n_blocks, idx_row, extra) of a tile: its slots are
        [0, L) of the indices at idx_row, in n_blocks blocks; extra is what
        ``row_sources`` and ``epilogue`` need besides (nothing here)."""
        return tiles.tile(tile_id, self.HG, BLOCK_H, BN, self.has_len) + (None,)

    def row_sources(self, kv_ptr, zero_ptr, N, g, L, row_in_pass, col0, extra):
        """What ``resolve_rows`` needs to place this thread's rows of a tile."""
        return (kv_ptr, zero_ptr, g, L, N, row_in_pass, col0)

    # -------------------------------------------------------------- producer
    def producer_state(self, tidx, sK, sOk):
        """The producer's state over its tiles: its gather copier (atom, thr,
        row_in_pass, col0), its slices of the stages (tK0, tK1), the kv-row
        byte offsets of a pair's two blocks (base0, base1; the zero row's for
        an invalid slot), their masks (0 or -inf, written to sOk with the
        stage's first half) and their indices, loaded a pair ahead (ns0, ns1)."""
        ptid, first = self.producer_thread(tidx)
        atom, thr, row_in_pass, col0 = gather_copier(self.dtype, ptid)
        if const_expr(first is not None):
            row_in_pass = row_in_pass + first
        tK0, tK1 = self.stage_partitions(thr, sK, ptid, row_in_pass)
        base0, base1 = self.row_addresses()
        R = self.rows_per_thread()
        mk0 = cute.make_rmem_tensor((R,), Float32)
        mk1 = cute.make_rmem_tensor((R,), Float32)
        ok = cute.make_tensor(sOk, cute.make_layout((2, BN), stride=(BN, 1)))
        masks = (mk0, mk1, ok, col0 == 0, row_in_pass)
        ns0 = cute.make_rmem_tensor((R,), Int32)
        ns1 = cute.make_rmem_tensor((R,), Int32)
        return atom, thr, row_in_pass, col0, tK0, tK1, base0, base1, masks, ns0, ns1

    def producer_thread(self, tidx):
        """(this thread's index in its producer warpgroup, the first row of
        a block its warpgroup gathers, None for row 0): one producer gathers
        every row."""
        return tidx, None

    def rows_per_thread(self) -> int:
        """Rows of a block a producer thread gathers: one of each 16-row pass."""
        return BN // 16

    def start_tile(self, tiles, tile_id, ps, kv_ptr, zero_ptr, N):
        """A tile's rows (``row_sources``) and its blocks 0 and 1 resolved into
        ``producer_state`` ps: (t, head0, L, n_blocks, idx_row, rows, pairs)."""
        _, _, row_in_pass, col0, _, _, base0, base1, masks, ns0, ns1 = ps
        t, g, head0, L, n_blocks, idx_row, extra = self.tile_of(tiles, tile_id)
        rows = self.row_sources(kv_ptr, zero_ptr, N, g, L, row_in_pass, col0, extra)
        n_pairs = (n_blocks + 1) // 2
        self.fetch_rows(ns0, 0, idx_row, L, row_in_pass)
        self.fetch_rows(ns1, 1, idx_row, L, row_in_pass)
        self.resolve_rows(base0, masks[0], ns0, 0, *rows)
        self.resolve_rows(base1, masks[1], ns1, 1, *rows)
        return t, head0, L, n_blocks, idx_row, rows, n_pairs

    @cute.jit
    def producer(self, tidx, sQ, sK, sOk, bars, tiles: scheduler.SlotTiles, q_ptr, kv_ptr, zero_ptr, N):
        q_full, q_empty, full, empty = bars
        sched = tiles.sched
        ps = self.producer_state(tidx, sK, sOk)
        atom, thr, row_in_pass, col0, tK0, tK1, base0, base1, masks, ns0, ns1 = ps
        mk0, mk1 = masks[0], masks[1]
        u0 = Int32(0)  # uses of stage 0 / stage 1 by earlier tiles
        u1 = Int32(0)
        j = Int32(0)   # tiles done
        for tile_id in cutlass.range(sched.first, sched.n_tiles, sched.stride, unroll=1):
            t, head0, L, n_blocks, idx_row, rows, n_pairs = self.start_tile(tiles, tile_id, ps, kv_ptr, zero_ptr, N)
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
                self.timer.wait_mbarrier(q_empty, freed_phase(j), PROF_Q)
            self.load_q(atom, thr, sQ, q_full, q_ptr, zero_ptr, t, head0, row_in_pass, col0)
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

    @cute.jit
    def load_q(self, atom, thr, sQ, q_full, q_ptr, zero_ptr, t, head0, row_in_pass, col0):
        """Q: heads head0 .. head0 + 63 of token t (the zero row past a padded
        tile's heads), signalled on q_full."""
        pad = dict(real_rows=self.rows, zero_ptr=zero_ptr) if const_expr(self.rows < BLOCK_H) else {}
        copy_head_rows(atom, thr.partition_D(sQ), q_ptr, self.dtype, t, self.H, head0, BLOCK_H, self.D,
                       row_in_pass, col0, **pad)
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
            self.timer.wait_mbarrier(empty + 0, freed_phase(n0), PROF_EMPTY)
        self.fill(atom, base0, tK0, 0, L_CHUNKS, n0)
        self.signal_fill(full + 0)
        self.publish_mask(masks, 0, full + 0)
        if has1:
            if n1 > 0:
                self.timer.wait_mbarrier(empty + 3, freed_phase(n1), PROF_EMPTY)
            self.fill(atom, base1, tK1, L_CHUNKS, CHUNKS, n1)
            self.signal_fill(full + 3)
            self.publish_mask(masks, 1, full + 3)
        if n0 > 0:
            self.timer.wait_mbarrier(empty + 1, freed_phase(n0), PROF_EMPTY)
        self.fill(atom, base0, tK0, L_CHUNKS, CHUNKS, n0)
        self.signal_fill(full + 1)
        if has1:
            if n1 > 0:
                self.timer.wait_mbarrier(empty + 2, freed_phase(n1), PROF_EMPTY)
            self.fill(atom, base1, tK1, 0, L_CHUNKS, n1)
            self.signal_fill(full + 2)

    @cute.jit
    def fetch_rows(self, ns, b, idx_row, L, row_in_pass):
        """ns[m] <- the index of slot b * 64 + row_in_pass + 16 m
        (``rules.fetch_indices``: nothing past topk_length is read)."""
        t0 = self.timer.tick()
        rules.fetch_indices(ns, idx_row, b, BN, row_in_pass, 16, L)
        self.timer.tock(PROF_LOOKUP, t0)

    @cute.jit
    def resolve_rows(self, base, mk, ns, b, kv_ptr, zero_ptr, g, L, N, row_in_pass, col0):
        """base[m] / mk[m]: source address and mask of this thread's m-th row
        of block b; the one place the kernel decides validity."""
        t0 = self.timer.tick()
        ES = self.dtype.width // 8
        rules.block_sources(base, mk, ns, b, L, N, kv_ptr, zero_ptr, g, self.G, self.D * ES, col0 * ES,
                            BN, row_in_pass, 16)
        self.timer.tock(PROF_LOOKUP, t0)

    @cute.jit
    def publish_mask(self, masks, stage: cutlass.Constexpr, bar):
        """One thread a row writes its slots' masks of the block in ``stage``
        and arrives on ``bar`` (release: the consumer that waits on bar sees
        them).  The stage's earlier mask is dead: its reader released this
        half after masking its S."""
        mk0, mk1, ok, writer, row_in_pass = masks
        mk = mk0 if stage == 0 else mk1
        if writer:
            for m in cutlass.range_constexpr(cute.size(mk)):
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
        t0 = self.timer.tick()
        ES = self.dtype.width // 8
        for m in cutlass.range_constexpr(BN // 16):
            for c in cutlass.range_constexpr(c_hi - c_lo):
                src = cute.make_tensor(aligned(self.dtype, base[m] + (c_lo + c) * 64 * ES), cute.make_layout((8,)))
                cute.copy(atom, src, tKs[None, m, c_lo + c])
        self.timer.tock(PROF_ISSUE, t0)

    # ------------------------------------------------------------- consumers
    @cute.jit
    def consumer_state(self, w: cutlass.Constexpr, qk_mma, pv_mma, pv_mma_ss, sv_layout, sp_layout, wtid,
                       sQ, sK, sP, sM, sOk, bars, scale_log2, bound_args=None) -> ConsumerState:
        """Consumer w's fragments, accumulators and shared-memory views."""
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
        bnd = None
        if const_expr(self.bounds):
            bnd = tuple(bound_args) + (cute.make_rmem_tensor((2,), Int64),)
        return ConsumerState(qk_mma, pv_mma, pv_mma_ss, tSrQ, tSrK, acc_s, acc_o, r_p, mask, m_run, l_run,
                             m0, m1, tPs_own, tOrV_own, tOrV_oth, tOrP_oth, bars[2], bars[3], ok,
                             row_lo, col_lane, lane, scale_log2, bnd)

    @cute.jit
    def consumer(self, w: cutlass.Constexpr, qk_mma, pv_mma, pv_mma_ss, sv_layout, sp_layout, wtid,
                 sQ, sK, sP, sM, sL, sOk, bars, tiles: scheduler.SlotTiles, sink_ptr, out_ptr, lse_ptr, scale_log2,
                 bound_args=None):
        q_full, q_empty, full, empty = bars
        sched = tiles.sched
        cs = self.consumer_state(w, qk_mma, pv_mma, pv_mma_ss, sv_layout, sp_layout, wtid,
                                 sQ, sK, sP, sM, sOk, bars, scale_log2, bound_args)
        u0 = Int32(0)  # uses of stage 0 / stage 1 by earlier tiles
        u1 = Int32(0)
        j = Int32(0)   # tiles done
        for tile_id in cutlass.range(sched.first, sched.n_tiles, sched.stride, unroll=1):
            t, g, head0, L, n_blocks, idx_row, extra = self.begin_tile(cs, tiles, tile_id)
            if const_expr(self.bounds):
                self.bound_offsets(cs, wtid, t, g, head0)
            n_full = n_blocks // 2
            self.timer.wait_mbarrier(q_full, phase(j), PROF_Q)
            if const_expr(w == 0):
                if n_blocks > 0:
                    self.qk(cs, 0, 0, phase(u0), True)
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
            self.tile_end(w, cs, sL + (j % 2) * (2 * BLOCK_H), sink_ptr, out_ptr, lse_ptr, t, head0, extra)
            u0 = u0 + (n_blocks + 1) // 2
            u1 = u1 + n_full
            j = j + 1

    def begin_tile(self, cs: ConsumerState, tiles, tile_id):
        """A consumer's next tile (``tile_of``), its O and row statistics reset."""
        tile = self.tile_of(tiles, tile_id)
        cs.acc_o.fill(0.0)
        cs.m_run.fill(-Float32.inf)
        cs.l_run.fill(0.0)
        return tile

    @cute.jit
    def tile_end(self, w: cutlass.Constexpr, cs: ConsumerState, sL, sink_ptr, out_ptr, lse_ptr, t, head0, extra):
        """Row sums over the 4 threads of a row, then over both consumers
        (sL: this tile's buffer of 2 x 64); then the epilogue."""
        l_run, lane, row_lo = cs.l_run, cs.lane, cs.row_lo
        l_own = cute.make_tensor(sL + w * BLOCK_H, cute.make_layout((BLOCK_H,)))
        l_oth = cute.make_tensor(sL + (1 - w) * BLOCK_H, cute.make_layout((BLOCK_H,)))
        for r in cutlass.range_constexpr(2):
            l = l_run[r]
            l = l + cute.arch.shuffle_sync_bfly(l, 1)
            l = l + cute.arch.shuffle_sync_bfly(l, 2)
            l_run[r] = l
            if lane % 4 == 0:
                l_own[row_lo + 8 * r] = l
        self.timer.wait_barrier(Barrier.ROW_SUMS, PAIR_THREADS, PROF_BAR)
        for r in cutlass.range_constexpr(2):
            l_run[r] = l_run[r] + l_oth[row_lo + 8 * r]
        t0 = self.timer.tick()
        self.epilogue(cs.acc_o, cs.m_run, l_run, w, lane, row_lo, cs.col_lane, sink_ptr, out_ptr, lse_ptr,
                      t, head0, extra)
        self.timer.tock(PROF_EPI, t0)

    # -------------------------------------------------------- consumer steps
    @cute.jit
    def qk(self, cs: ConsumerState, stage: cutlass.Constexpr, i, ph, first_l: cutlass.Constexpr,
           release: cutlass.Constexpr = None):
        """S = Q K^T of the block in ``stage`` for pair i (barrier phase ph), its
        L half first when first_l, then masked and scaled to the log2 domain.
        Consumer 0 calls it with its previous remote P V still in flight and
        releases stage 1's L half between the halves; a lockstep consumer 0
        passes ``release`` (whether a P V of the other stage is in flight)
        and releases that stage's L there."""
        qk_mma, tSrQ, tSrK, acc_s, mask = cs.qk_mma, cs.tSrQ, cs.tSrK, cs.acc_s, cs.mask
        KD = self.D // 16
        KL = L_CHUNKS * 4
        first = 2 * stage + (0 if first_l else 1)
        acc_s.fill(0.0)
        self.timer.wait_mbarrier(cs.full + first, ph, PROF_FULL)
        warpgroup.fence()
        if const_expr(first_l):
            for k in cutlass.range_constexpr(KL):
                cute.gemm(qk_mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_s)
        else:
            for k in cutlass.range_constexpr(KD - KL):
                cute.gemm(qk_mma, acc_s, tSrQ[None, None, KL + k], tSrK[None, None, KL + k, stage], acc_s)
        warpgroup.commit_group()
        if const_expr(release is None):
            if const_expr(stage == 0):
                if i > 0:
                    # consumer 0's P1 V1 of the last pair has retired: stage 1's L is free
                    self.timer.wait_wgmma(1, PROF_WGMMA)
                    cute.arch.mbarrier_arrive(cs.empty + 2)
        else:
            if release:
                # lockstep: the previous block's P V (the other stage's L as V) has retired
                self.timer.wait_wgmma(1, PROF_WGMMA)
                self.release(cs, 2 * (1 - stage))
        self.timer.wait_mbarrier(cs.full + (2 * stage + (1 if first_l else 0)), ph, PROF_FULL)
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
                mask[j, e] = cs.ok[stage, 8 * j + cs.col_lane + e]
        self.timer.wait_wgmma(0, PROF_WGMMA)
        for j in cutlass.range_constexpr(NS // 4):
            for r in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(2):
                    acc_s[4 * j + 2 * r + e] = acc_s[4 * j + 2 * r + e] * cs.scale_log2 + mask[j, e]

    @cute.jit
    def softmax(self, cs: ConsumerState, m_new):
        """acc_s <- exp2(S - m_new) in place, r_p its 16-bit copy; l and O
        rescaled from the running maximum to m_new, which becomes it."""
        acc_s, r_p, m_run, l_run = cs.acc_s, cs.r_p, cs.m_run, cs.l_run
        NS = cute.size(acc_s)
        alpha = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            mu = finite_shift(m_new[r])
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
        self.rescale_o(cs.acc_o, alpha)

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
    def pair0(self, cs: ConsumerState, i, n_blocks, has1: cutlass.Constexpr, u0):
        """Consumer 0, pair i: S of block 2i is in acc_s (masked). u0: uses of
        stage 0 by earlier tiles. Every half it reads as V is released, so the
        next tile finds the stages free."""
        acc_s, acc_o, r_p, m_run, l_run = cs.acc_s, cs.acc_o, cs.r_p, cs.m_run, cs.l_run
        row_lo = cs.row_lo
        NS = cute.size(acc_s)
        mx = cute.make_rmem_tensor((2,), Float32)
        self.row_max(acc_s, mx)
        for r in cutlass.range_constexpr(2):
            mx[r] = cute.arch.fmax(mx[r], m_run[r])
            if cs.lane % 4 == 0:
                cs.m0[row_lo + 8 * r] = mx[r]
        pipeline.arrive(Barrier.MAX0, PAIR_THREADS)
        self.softmax(cs, mx)
        self.pv(cs.pv_mma, acc_o, r_p, cs.tOrV_own)
        if const_expr(self.bounds and not has1):
            self.head_sums(cs, 2 * i)  # the last block, alone: while P0 V0 runs
        self.timer.wait_wgmma(0, PROF_WGMMA)
        cute.arch.mbarrier_arrive(cs.empty + 0)  # stage 0's L: no one reads it again this pair
        if const_expr(has1):
            # the pair's maxima from consumer 1; P0 rescaled to them
            self.timer.wait_barrier(Barrier.MAX1, PAIR_THREADS, PROF_BAR)
            sc = cute.make_rmem_tensor((2,), Float32)
            for r in cutlass.range_constexpr(2):
                mp = cs.m1[row_lo + 8 * r]
                sc[r] = cute.math.exp2(m_run[r] - finite_shift(mp), fastmath=True)
                m_run[r] = mp
                l_run[r] = l_run[r] * sc[r]
            for i_ in cutlass.range_constexpr(NS):
                r_p[i_] = (acc_s[i_] * sc[(i_ // 2) % 2]).to(self.dtype)
            self.store_p(r_p, acc_s, cs.tPs_own)
            pipeline.arrive(Barrier.P0, PAIR_THREADS)
            self.rescale_o(acc_o, sc)
            self.timer.wait_barrier(Barrier.P1, PAIR_THREADS, PROF_BAR)
            self.pv(cs.pv_mma_ss, acc_o, cs.tOrP_oth, cs.tOrV_oth)
            if const_expr(self.bounds):
                self.head_sums(cs, 2 * i, sc)  # while P1 V1 runs (l and m rescaled by sc since P0)
            if 2 * i + 2 < n_blocks:
                self.qk(cs, 0, i + 1, phase(u0 + i + 1), True)  # releases stage 1's L once P1 V1 retires
            else:
                self.timer.wait_wgmma(0, PROF_WGMMA)
                cute.arch.mbarrier_arrive(cs.empty + 2)
        else:
            # the last block, alone: its maxima are final, consumer 1 only needs P0
            self.store_p(r_p, acc_s, cs.tPs_own)
            pipeline.arrive(Barrier.P0, PAIR_THREADS)

    @cute.jit
    def pair1(self, cs: ConsumerState, i, has1: cutlass.Constexpr, u1):
        """Consumer 1, pair i: S of block 2i + 1 when has1, then O over both.
        u1: uses of stage 1 by earlier tiles."""
        acc_o, m_run, l_run, row_lo = cs.acc_o, cs.m_run, cs.l_run, cs.row_lo
        mx = cute.make_rmem_tensor((2,), Float32)
        if const_expr(has1):
            self.qk(cs, 1, i, phase(u1 + i), False)
            self.row_max(cs.acc_s, mx)
        else:
            mx.fill(-Float32.inf)
        self.timer.wait_barrier(Barrier.MAX0, PAIR_THREADS, PROF_BAR)
        for r in cutlass.range_constexpr(2):
            # consumer 0's maxima already hold every earlier block's
            mx[r] = cute.arch.fmax(mx[r], cs.m0[row_lo + 8 * r])
        if const_expr(has1):
            for r in cutlass.range_constexpr(2):
                if cs.lane % 4 == 0:
                    cs.m1[row_lo + 8 * r] = mx[r]
            pipeline.arrive(Barrier.MAX1, PAIR_THREADS)
            self.softmax(cs, mx)
            self.pv(cs.pv_mma, acc_o, cs.r_p, cs.tOrV_own)
            self.store_p(cs.r_p, cs.acc_s, cs.tPs_own)
        else:
            alpha = cute.make_rmem_tensor((2,), Float32)
            for r in cutlass.range_constexpr(2):
                alpha[r] = cute.math.exp2(m_run[r] - finite_shift(mx[r]), fastmath=True)
                l_run[r] = l_run[r] * alpha[r]
                m_run[r] = mx[r]
            self.rescale_o(acc_o, alpha)
        self.timer.wait_barrier(Barrier.P0, PAIR_THREADS, PROF_BAR)
        self.pv(cs.pv_mma_ss, acc_o, cs.tOrP_oth, cs.tOrV_oth)
        if const_expr(has1):
            pipeline.arrive(Barrier.P1, PAIR_THREADS)
            if const_expr(self.bounds):
                self.head_sums(cs, 2 * i + 1)  # while both P V run
            self.timer.wait_wgmma(1, PROF_WGMMA)
            cute.arch.mbarrier_arrive(cs.empty + 3)  # stage 1's R
        self.timer.wait_wgmma(0, PROF_WGMMA)
        cute.arch.mbarrier_arrive(cs.empty + 1)      # stage 0's R (and P0 with it)

    # ------------------------------------------------ the bounds build
    # For the deterministic backward (dsa.cute.sparse_attention_bwd), which
    # needs, before its first add, a bound of every slot's P summed over the
    # heads.  Right after a block's softmax a consumer holds p = exp2(s - mu)
    # and the row sum l of its own blocks (this one and its earlier ones, at
    # mu; each thread holds its columns' share, summed over the quad): the
    # final P = exp2(s - lg2den) is at most p / l, since the whole row's
    # denominator (both consumers' blocks and the sink) is at least 2^mu l.
    # The kernel writes, a block, sum_h p_h / l_h a slot (one partial sum a
    # warp, so that the order of the sums is fixed) and each head's level
    # mu + log2 l; the backward tightens the sums by max_h 2^(level_h -
    # lg2den_h), exact for one head (``dsa.triton.dkv_quanta.forward_bounds``).

    @cute.jit
    def bound_offsets(self, cs: ConsumerState, wtid, t, g, head0):
        """This tile's offsets into the head sums [T, G, HB, NB, 4, 64] (this
        thread's warp and column pair included) and the levels [T, NB, H]."""
        _, _, nb, offs = cs.bnd
        hb = (head0 - g * self.HG) // BLOCK_H
        tile = (Int64(t) * Int64(self.G) + Int64(g)) * Int64(self.HB) + Int64(hb)
        offs[0] = tile * Int64(nb) * Int64(4 * BN) + Int64((wtid // 32) * BN + 2 * cs.lane)
        offs[1] = Int64(t) * Int64(nb) * Int64(self.H) + Int64(head0)

    @cute.jit
    def head_sums(self, cs: ConsumerState, blk, sc=None):
        """Block blk's sum_h p_h / l_h of each slot over this warp's 16 rows
        and its heads' levels (section comment above).  The 16 column sums
        of a thread are reduced over its 8 row groups (lane bits 2-4) by
        halving: each exchange keeps the half of the columns the lane's bit
        selects, so lane l ends with columns 2l and 2l + 1 (14 shuffles, one
        8-byte store a lane); the row sums first over the quad (4 shuffles).
        sc: the factor l and m_run were rescaled by since the block's softmax
        (consumer 0 after the pair's maxima), so that p / l is the
        softmax-time ratio."""
        hs_ptr, lvl_ptr, nb, offs = cs.bnd
        acc_s, m_run, lane, row_lo = cs.acc_s, cs.m_run, cs.lane, cs.row_lo
        NJ = cute.size(acc_s) // 4
        # a thread's l_run holds its own columns' share: the row's sum is over the quad
        l_row = cute.make_rmem_tensor((2,), Float32)
        inv = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            lr = cs.l_run[r]
            lr = lr + cute.arch.shuffle_sync_bfly(lr, 1)
            lr = lr + cute.arch.shuffle_sync_bfly(lr, 2)
            l_row[r] = lr
            iv = Float32(0.0)
            if lr > 0.0:
                iv = 1.0 / lr
            if const_expr(sc is not None):
                iv = iv * sc[r]
            if const_expr(self.rows < BLOCK_H):
                # the zero rows past a padded tile's heads have p = 1: not heads
                iv = Float32(cutlass.select_(row_lo + 8 * r < self.rows, iv, Float32(0.0)))
            inv[r] = iv
        # element 4j + 2r + e is row row_lo + 8r, column 8j + col_lane + e; vals[2j + e] its column's sum
        vals = [acc_s[4 * j + e] * inv[0] + acc_s[4 * j + 2 + e] * inv[1] for j in range(NJ) for e in range(2)]
        for s in cutlass.range_constexpr(3):
            bit = 16 >> s
            half = NJ >> (s + 1)
            up = (lane & bit) != 0
            kept = []
            for j in cutlass.range_constexpr(half):
                for e in cutlass.range_constexpr(2):
                    lo_v, hi_v = vals[2 * j + e], vals[2 * (j + half) + e]
                    send = Float32(cutlass.select_(up, lo_v, hi_v))
                    keep = Float32(cutlass.select_(up, hi_v, lo_v))
                    kept.append(keep + cute.arch.shuffle_sync_bfly(send, bit))
            vals = kept
        pair = cute.make_rmem_tensor((2,), Float32)
        pair[0] = vals[0]
        pair[1] = vals[1]
        dst = cute.make_ptr(Float32, (hs_ptr + (offs[0] + Int64(blk) * Int64(4 * BN))).toint(),
                            cute.AddressSpace.gmem, assumed_align=8)
        cute.autovec_copy(pair, cute.make_tensor(dst, cute.make_layout((2,))))
        if lane % 4 == 0:
            for r in cutlass.range_constexpr(2):
                row = row_lo + 8 * r
                if self.real_row(row):
                    lv = cute.make_tensor(lvl_ptr + (offs[1] + Int64(blk) * Int64(self.H) + Int64(row)),
                                          cute.make_layout((1,)))
                    lv[0] = finite_shift(m_run[r]) + cute.math.log2(l_row[r], fastmath=True)

    @cute.jit
    def epilogue(self, acc_o, m_run, l_run, half, lane, row_lo, col_lane, sink_ptr, out_ptr, lse_ptr,
                 t, head0, extra):
        """out = O / (l + exp(sink)) for this consumer's column half; lse
        (+inf on a row with no valid slot) from consumer 0.  m_run is the
        running maximum (log2 domain), l_run the whole row sum; extra is
        ``tile_of``'s (unused here)."""
        inv = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            mu = finite_shift(m_run[r])
            m_run[r] = mu
            den = l_run[r]
            if const_expr(self.has_sink):
                # sink * log2(e) overflows to +inf for sinks above ~2.4e38:
                # the sink then takes all the probability and out is 0.
                if self.real_row(row_lo + 8 * r):
                    sk = load(sink_ptr, Int64(head0 + row_lo + 8 * r)) * LOG2E
                    den = den + cute.math.exp2(sk - mu, fastmath=False)
            iv = Float32(0.0)
            if den != 0.0:
                iv = 1.0 / den
            inv[r] = iv
        self.store_out(acc_o, inv, half, lane, row_lo, out_ptr, t, head0)
        if half == 0 and lane % 4 == 0:
            for r in cutlass.range_constexpr(2):
                if self.real_row(row_lo + 8 * r):
                    lse = rules.row_lse(m_run, l_run, r)
                    pl = cute.make_tensor(lse_ptr + (Int64(t) * Int64(self.H) + Int64(head0 + row_lo + 8 * r)),
                                          cute.make_layout((1,)))
                    pl[0] = lse

    def real_row(self, row):
        """Whether tile row ``row`` is one of the kv head's heads (always, but
        in a padded tile): a traced test, or the constant True."""
        if const_expr(self.rows < BLOCK_H):
            return row < self.rows
        return True

    @cute.jit
    def store_out(self, acc_o, inv, half, lane, row_lo, out_ptr, t, head0):
        """out[t, head0 + row, half * 256 + column] = O * inv[row] in q.dtype."""
        dvh = self.dv_half
        NO = cute.size(acc_o)
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
                if self.real_row(row):
                    cute.autovec_copy(w4, cute.make_tensor(dst, cute.make_layout((4,))))
