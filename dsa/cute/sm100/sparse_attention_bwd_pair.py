"""Two-CTA sparse attention backward for Blackwell (SM100): H128 / D576 / d_v 512, bf16.

The math is the generic SM100 backward's (``sparse_attention_bwd``): with
p_j = exp2(s_j log2(e) sm_scale - log2 den) and Delta = dO . out from the
Triton preprocess (which folds the sink: +inf, -inf and a finite sink whose
exp overflows; dsink comes from its per-row parts), for a tile (token t, kv
head g, its 128 query heads, a range of blocks of 64 slots) and each block:

    S = Q K^T, dP = dO V^T                 [128 heads, 64 slots]
    P = exp2(S scale_log2 - log2 den), dS = P (dP - Delta) sm_scale
    dQ += dS K                             [128 heads, 576]
    dKV_c = dS^T Q_c + P^T dO_c            [64 slots, 64 columns], chunk c

A (2, 1, 1) cluster runs it: CTA r (r = 0, 1) holds the query heads
[64 r, 64 r + 64), and every MMA is a ``tcgen05.mma.cta_group::2`` issued by
CTA 0's MMA warp, each CTA supplying the operand rows of its half of M and N
at the same shared-memory offsets (which is why each operand below has the
layout it has):

* S and dP (M = 128 heads, N = 64 slots): A is the CTA's Q [64, 576] (the
  D = 64 RoPE tail as a separate round of K-steps) or dO [64, 512]; B is
  the CTA's half of the block's slots, [32 slots, 576] (the score stage,
  slots 32 r ..).
* dQ (M = 128 heads, N = 256 twice, then the tail): A is the CTA's dS
  [64 heads, 64 slots]; B is K^T over all 64 slots and the CTA's half of
  each N: columns [128 r, 128 r + 128) and [256 + 128 r, ..) of the block,
  then the tail [512, 576) as an N = 128 round in which each CTA's B is
  the whole tail, so its two halves hold the same columns and the softmax
  threads of column half h read tail columns [32 h, 32 h + 32) from half h
  (the dQ stage, [64 slots, 320 columns], gathered into the score stage's
  buffer once S and dP have retired).
* dKV (M = 128 columns, N = 64 slots, K = 128 heads in two rounds of 64):
  CTA r's M half is column chunk 2 j + r of pair j (j = 0..4; CTA 1's fifth
  is empty and never read); A is Q^T (then dO^T) of the round's heads for
  that chunk, B the round's dS (then P) for the CTA's half of the slots.
  The rounds' A operands stream through a two-slot ring: the CTA whose
  heads a round is copies its Q / dO chunks into the ring slot of both
  CTAs.  B is [32 slots, 128 heads] (MN-major, 64-byte swizzle) and every
  softmax thread writes its head's 32 slots of P and dS into the B tile of
  the CTA whose half those slots are.  Those two copies, P / dS and the
  ring, are the pair's exchanges, 16-byte ``st.shared::cluster`` stores
  (``dsa.cute.sm100.cluster``).

Warps of each CTA (13, 128 registers a thread, as in the generic kernel):

* 4-7, the loader: per block the score stage (its 32 slots, by index, a
  zero row for an invalid slot: ``dsa.cute.sm100.gather``) and the mask of
  all 64 slots, Q and dO once a tile; then, S and dP retired, the dQ stage;
  then the rounds of the block's dKV into the ring.
* 12, the MMA warp: CTA 0's issues every MMA (CTA 1's only allocates and
  frees the tensor memory with it).
* 0-3, the softmax warpgroup: P and dS of its 64 heads (a thread: one head,
  32 slots), clamped to exactly 0 on padded slots by a select on the mask
  (NaN-preserving: a valid slot's NaN stays); at a tile's end dq from TMEM
  (stored in q.dtype, or, when a row's blocks are split over several
  clusters, added in fp32 to a workspace the host casts).
* 8-11, the reducer: the dKV accumulators (one column of the CTA's chunk
  over 32 slots a thread) added into dkv (fp32, scalar ``red.global.add``,
  columns in ``dsa.cute.dkv``'s fragment order so the host's reorder is
  the generic kernel's), or stored per slot in the deterministic build and
  summed in a fixed order by the host (``segment_sum``; dkv rows hold all
  128 heads, so one part a slot).

Tensor memory (512 columns a CTA; an M = 128 two-CTA accumulator puts its
64 rows in lanes 0-63 for the first half of N and 64-127 for the second,
``check_pair_rows``): dQ [0, 256), its tail [256, 320), S [320, 352), dP
[352, 384), four dKV buffers [384 + 32 k, 416 + 32 k).

Barriers live in both CTAs; those the MMA warp waits on are used in CTA 0
only (both CTAs' threads arrive there, the peer's remotely, with
cluster-scope release), and every MMA completion is committed to both CTAs
(multicast).  A phase is never two ahead of its waiter: each is written at
the struct.  Shared memory: Q 72 KB, dO 64 KB, the stage 40 KB, dS 8 KB,
the B tiles 16 KB, the ring 16 KB (``smem_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.cutlass_dsl import dsl_user_op

from dsa.cute import dkv as dkv_reduce
from dsa.cute import pipeline, rules, scheduler
from dsa.cute.gmem import copy_head_rows, gather_copier, load
from dsa.cute.sm100 import cluster, rows, sync
from dsa.cute.sm100.gather import BlockGather
from dsa.cute.sm100.rows import ROW_COLS

PAIR_H = 128          # query heads of a cluster (per kv head)
BLOCK_H = 64          # query heads of a CTA
BN = 64               # slots per block
HALF_N = 32           # slots of a block in a CTA's half of N
CHUNK = 64            # columns of a dKV chunk (one 128-byte swizzle row)
D_SERVED = 576
DV_SERVED = 512
N_CHUNKS = D_SERVED // CHUNK          # 9
PAIRS = (N_CHUNKS + 1) // 2           # 5 dKV MMAs a block: chunks 2 j + r
KD_CHUNKS = 5                         # dQ stage: 4 chunks of the CTA's N halves, the tail
ROUND_USES = PAIRS * 2 + (DV_SERVED // CHUNK // 2) * 2   # ring uses a block: Q (5 x 2) and dO (4 x 2)
RING = 2
HALF_COLS = 16
SOFTMAX_WARPS = 4
LOADER_WARPS = 4
REDUCER_WARPS = 4
REDUCE_WARP0 = SOFTMAX_WARPS + LOADER_WARPS
MMA_WARP = REDUCE_WARP0 + REDUCER_WARPS
THREADS = 32 * (MMA_WARP + 1)
KV_BUFFERS = 4
TMEM_COLS = 512
DQ_COL = 0            # two N = 256 MMAs: 128 columns each
DQT_COL = 256         # the tail, N = 128: 64 columns
S_COL = 320
DP_COL = 352
KV_COL = 384
assert KV_COL + KV_BUFFERS * HALF_N == TMEM_COLS
SMEM_LIMIT = 227 * 1024
N_BARRIERS = 15 + 2 * RING + 2 * KV_BUFFERS
REDUCE_BARRIER = 1    # named barrier of the reducer warpgroup (its slot rows)

assert ROUND_USES % RING == 0  # a block's uses leave every ring slot at the same point


@dataclass(frozen=True)
class PairBwdSm100Config(scheduler.ProblemConfig):
    """The static configuration of the two-CTA backward (its compile key and
    self-check key): the problem, then deterministic."""

    deterministic: bool


def smem_bytes(D: int = D_SERVED, d_v: int = DV_SERVED, elem_bytes: int = 2) -> int:
    """Shared memory of ``Smem`` as the DSL lays it out: barriers, TMEM
    address, the masks and the reducers' slot rows in the first 2 KB, then
    Q [64, D], dO [64, d_v], the stage (max of [32, D] and [64, 320]), dS
    [64, 64], the B tiles [32, 128] x 2 and the ring [64, 64] x 2, each
    1024-byte aligned."""
    def up(n: int, a: int = 1024) -> int:
        return -(-n // a) * a

    head = up(up(up(N_BARRIERS * 8 + 4, 16) + 4 * 2 * BN, 16) + 8 * 2 * BN)
    stage = max(HALF_N * D, BN * KD_CHUNKS * CHUNK)
    tiles = (BLOCK_H * D + BLOCK_H * d_v + stage + BLOCK_H * BN + 2 * HALF_N * PAIR_H + RING * 64 * 64) * elem_bytes
    return up(head + tiles)


@dataclass(frozen=True)
class Bars:
    """The mbarriers.  (L): waited in CTA 0 only, both CTAs arrive; (2):
    multicast MMA commits, waited in both; (l): local."""

    k_full: Any    # (L) 256: the score stage, the masks (and Q, dO at a tile's first block) landed
    kd_full: Any   # (L) 256: the dQ stage landed
    ks_free: Any   # (2) S and dP of the block retired: the stage may take the dQ stage
    kd_free: Any   # (2) dQ of the block retired: the stage may take the next score stage
    q_free: Any    # (2) the tile's last S / dP retired: Q and dO may be reloaded
    ok_full: Any   # (l) 128: the block's mask written
    s_full: Any    # (2) S and dP retired
    ds_full: Any   # (L) 256: P and dS written (both CTAs' tiles), S and dP read
    ds_free: Any   # (2) every MMA reading P / dS of the block retired
    dq_full: Any   # (2) the tile's last dQ retired
    dq_free: Any   # (L) 256: dQ read
    fin: Any       # (2) the leader's last MMAs retired (the CTAs may leave)
    dealloc: Any   # (l) 32: the peer's MMA warp is done with the tensor memory
    ring_full: Any  # [2] (L) 128: a ring slot written in both CTAs by the round's CTA
    ring_free: Any  # [2] (2) the MMA reading a ring slot retired
    c_full: Any    # [4] (2) a dKV accumulator retired
    c_free: Any    # [4] (L) 256: a dKV accumulator read


@dataclass(frozen=True)
class Tile:
    """A tile as every role decodes it."""

    t: Any
    g: Any
    head0: Any     # this CTA's first query head
    L: Any
    b_lo: Any      # its blocks [b_lo, b_hi) of the row
    b_hi: Any
    idx_row: Any


def check_pair_rows(layout, n: int) -> None:
    """The two-CTA M = 128 accumulator as the kernel reads it: this CTA's
    row r (of 64), column c at TMEM lane r + 64 (c // (n / 2)), column
    c % (n / 2).  Checked at trace time."""
    h = n // 2
    for r in range(BLOCK_H):
        for c in (0, h - 1, h, n - 1):
            got = cute.crd2idx(((r, (c % h, c // h)), 0, 0), layout)
            want = ((r + 64 * (c // h)) << 16) + c % h
            if got != want:
                raise ValueError(f"unexpected two-CTA accumulator layout {layout}: ({r}, {c}) -> {got}, not {want}")


def check_b_tile(layout) -> None:
    """The [32 slots, 128 heads] MN-major 64-byte-swizzled B tile as the
    softmax writes it: slot n, head k at byte 64 k + 2 n before the swizzle,
    which XORs the 16-byte chunk index (bits 4-5) with bits 7-8."""
    if str(layout.inner) != "S<2,4,3>":
        raise ValueError(f"unexpected B tile layout {layout}")
    for k in range(PAIR_H):
        for n in range(0, HALF_N, 8):
            if cute.crd2idx((n, k), layout.outer) != 32 * k + n:
                raise ValueError(f"unexpected B tile layout {layout}: ({n}, {k})")


def check_gather(dtype, rows_: int, cols: int) -> None:
    """The gather's partition of a [rows_, cols] stage as the loader uses it:
    thread i's copy (m, c) is row i / 8 + 16 m, columns 64 c + 8 (i % 8) ..
    (the thread's m-th row of a block, its 16 bytes of chunk c).  Checked at
    trace time."""
    for i in (0, 7, 8, 77, 127):
        c = gather_copier(dtype, i)[1].partition_D(cute.make_identity_tensor((rows_, cols)))
        if cute.shape(c)[1:] != (rows_ // 16, cols // CHUNK):
            raise ValueError(f"unexpected gather partition {cute.shape(c)} of [{rows_}, {cols}]")
        for m in range(rows_ // 16):
            for ch in range(cols // CHUNK):
                if c[((0, 0), m, ch)] != (i // 8 + 16 * m, CHUNK * ch + 8 * (i % 8)):
                    raise ValueError(f"unexpected gather partition for thread {i}: {c[((0, 0), m, ch)]}")


def fragment_position(col):
    """Where column col of a dkv row is stored: in ``dsa.cute.dkv``'s
    fragment order, column 8 h + 2 q + e of a 16-column group at 4 q + 2 h + e
    (the host's ``natural_columns`` puts it back)."""
    w16 = col % 16
    return col - w16 + 4 * ((w16 % 8) // 2) + 2 * (w16 // 8) + w16 % 2


def kd_column(cc: int, r):
    """The first kv column of dQ-stage chunk cc in CTA r: its halves of the
    two N = 256 rounds, then the tail."""
    if cc == KD_CHUNKS - 1:
        return DV_SERVED
    return 256 * (cc // 2) + 128 * r + 64 * (cc % 2)


@dsl_user_op
def _f32_op(op: str, addr, value, *, loc=None, ip=None) -> None:
    """One fp32 ``red.global.add`` / ``st.global`` at a global byte address."""
    llvm.inline_asm(
        None, [Int64(addr).ir_value(loc=loc, ip=ip), Float32(value).ir_value(loc=loc, ip=ip)],
        f"{op}.f32 [$0], $1;", "l,f", has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )


class SparseAttnBwdSm100Pair:
    """Host-side builder of the two-CTA backward for one static configuration.

    dkv_ptr as the generic kernel's (fp32 [N, G, D] accumulator, or in the
    deterministic build the per-slot buffer [1, T, G, K, D]); dqacc_ptr: an
    fp32 [T, H, D] workspace (zeroed) that dq is added into when a row's
    blocks are split over n_parts > 1 clusters (dq_ptr is then not written)."""

    def __init__(self, dtype, D: int, d_v: int, H: int, G: int, has_len: bool, deterministic: bool):
        why = self.can_implement(dtype, D, d_v, H, G)
        if why is not None:
            raise ValueError(f"SparseAttnBwdSm100Pair: {why}")
        self.config = PairBwdSm100Config(dtype, D, d_v, H, G, has_len, deterministic)
        self.dtype = dtype
        self.D, self.d_v, self.H, self.G = D, d_v, H, G
        self.has_len, self.deterministic = has_len, deterministic

    @classmethod
    def from_config(cls, config: PairBwdSm100Config) -> "SparseAttnBwdSm100Pair":
        return cls(**{f.name: getattr(config, f.name) for f in fields(config)})

    @staticmethod
    def can_implement(dtype, D: int, d_v: int, H: int, G: int) -> Optional[str]:
        """None when the kernel serves this configuration, else the reason."""
        if dtype is not cutlass.BFloat16:
            return f"dtype {dtype} is not bf16"
        if D != D_SERVED or d_v != DV_SERVED:
            return f"D={D}, d_v={d_v}: the two-CTA kernel serves D = {D_SERVED}, d_v = {DV_SERVED}"
        if G <= 0 or H % G or H // G != PAIR_H:
            return f"{H} query heads over {G} kv heads: the two-CTA kernel serves {PAIR_H} per kv head"
        if smem_bytes(D, d_v, 2) > SMEM_LIMIT:
            return f"needs {smem_bytes(D, d_v, 2)} bytes of shared memory"
        return None

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        dout_ptr: cute.Pointer, lg2den_ptr: cute.Pointer, delta_ptr: cute.Pointer,
        dq_ptr: cute.Pointer, dkv_ptr: cute.Pointer, zero_ptr: cute.Pointer, dqacc_ptr: cute.Pointer,
        T: Int32, N: Int32, K: Int32, scale_log2: Float32, sm_scale: Float32,
        n_clusters: Int32, n_parts: Int32, part_blocks: Int32, stream,
    ):
        dt = self.dtype
        K_, MN = OperandMajorMode.K, OperandMajorMode.MN

        def mma(m, n, a_major, b_major, group):
            return cute.make_tiled_mma(tcgen05.MmaF16BF16Op(
                dt, Float32, (m, n, 16), group, tcgen05.OperandSource.SMEM, a_major, b_major))

        two, one = tcgen05.CtaGroup.TWO, tcgen05.CtaGroup.ONE
        # the pair's MMAs, and one-CTA MMAs of one CTA's operand shapes that
        # partition its shared-memory operands (a two-CTA MMA reads each
        # CTA's rows at the same offsets: the descriptors are a CTA's)
        mmas2 = (mma(PAIR_H, BN, K_, K_, two), mma(PAIR_H, 256, K_, MN, two), mma(PAIR_H, 128, K_, MN, two),
                 mma(PAIR_H, BN, MN, MN, two))
        mmas1 = (mma(BLOCK_H, HALF_N, K_, K_, one), mma(BLOCK_H, 128, K_, MN, one), mma(BLOCK_H, 64, K_, MN, one),
                 mma(BLOCK_H, HALF_N, MN, MN, one))
        k_atom = tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.K_SW128, dt)
        mn_atom = tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.MN_SW128, dt)
        mn64_atom = tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.MN_SW64, dt)
        sq_layout = cute.tile_to_shape(k_atom, (BLOCK_H, self.D), order=(0, 1))
        sdo_layout = cute.tile_to_shape(k_atom, (BLOCK_H, self.d_v), order=(0, 1))
        sks_layout = cute.tile_to_shape(k_atom, (HALF_N, self.D), order=(0, 1))
        skd_layout = cute.tile_to_shape(k_atom, (BN, KD_CHUNKS * CHUNK), order=(0, 1))
        sp_layout = cute.tile_to_shape(k_atom, (BLOCK_H, BN), order=(0, 1))
        kt_layout = cute.tile_to_shape(mn_atom, (128, BN), order=(1, 0))
        t64_layout = cute.tile_to_shape(mn_atom, (64, 64), order=(1, 0))
        bt_layout = cute.tile_to_shape(mn64_atom, (HALF_N, PAIR_H), order=(0, 1))
        rows.check_k_tile(sp_layout, dt)
        check_b_tile(bt_layout)
        check_gather(dt, HALF_N, self.D)
        check_gather(dt, BN, KD_CHUNKS * CHUNK)
        stage_elems = max(cute.cosize(sks_layout), cute.cosize(skd_layout))

        @cute.struct
        class Smem:  # smem_bytes() is its size
            # Why no barrier runs two phases ahead of a waiter: k_full /
            # kd_full: the next arrivals need ks_free / kd_free of this
            # block, after the MMA warp's wait.  ks_free, kd_free, s_full,
            # ds_free, c_full, ring_free: the next commit needs the next
            # k_full / kd_full / ds_full / ring_full / c_free, which need
            # the waiter (the loader, the softmax, the reducer) past its
            # wait.  q_free: the next needs the next tile's Q, loaded after
            # the wait.  ok_full: the loader writes block b + 2's mask after
            # pushing block b + 1's rounds, which the MMA reads after the
            # softmax's ds_full of b + 1.  ds_full / dq_free / c_free /
            # ring_full: the next arrival needs the next s_full / dq_full /
            # c_full / ring_free, after the MMA warp's wait.  dq_full: the
            # next needs ds_full of the next tile, after the softmax's
            # epilogue.  fin and dealloc: once.
            k_full: cute.struct.MemRange[Int64, 1]
            kd_full: cute.struct.MemRange[Int64, 1]
            ks_free: cute.struct.MemRange[Int64, 1]
            kd_free: cute.struct.MemRange[Int64, 1]
            q_free: cute.struct.MemRange[Int64, 1]
            ok_full: cute.struct.MemRange[Int64, 1]
            s_full: cute.struct.MemRange[Int64, 1]
            ds_full: cute.struct.MemRange[Int64, 1]
            ds_free: cute.struct.MemRange[Int64, 1]
            dq_full: cute.struct.MemRange[Int64, 1]
            dq_free: cute.struct.MemRange[Int64, 1]
            fin: cute.struct.MemRange[Int64, 1]
            dealloc: cute.struct.MemRange[Int64, 1]
            spare: cute.struct.MemRange[Int64, 2]
            ring_full: cute.struct.MemRange[Int64, RING]
            ring_free: cute.struct.MemRange[Int64, RING]
            c_full: cute.struct.MemRange[Int64, KV_BUFFERS]
            c_free: cute.struct.MemRange[Int64, KV_BUFFERS]
            tmem_addr: Int32
            sOk: cute.struct.Align[cute.struct.MemRange[Float32, 2 * BN], 16]   # masks of blocks b % 2
            sRows: cute.struct.Align[cute.struct.MemRange[Int64, 2 * BN], 16]   # dkv row addresses, b % 2
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sq_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdo_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, stage_elems], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sp_layout)], 1024]
            sdSb: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(bt_layout)], 1024]
            sPb: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(bt_layout)], 1024]
            sRing: cute.struct.Align[cute.struct.MemRange[dt, RING * 64 * 64], 1024]

        self.smem = Smem
        n_tiles = T * self.G * n_parts
        grid = cutlass.min(n_clusters, n_tiles) * cluster.PAIR
        self.kernel(
            mmas2, mmas1, sq_layout, sdo_layout, sks_layout, skd_layout, sp_layout, kt_layout, t64_layout,
            bt_layout, q_ptr, kv_ptr, idx_ptr, len_ptr, dout_ptr, lg2den_ptr, delta_ptr, dq_ptr, dkv_ptr, zero_ptr,
            dqacc_ptr, T, N, K, n_tiles, n_parts, part_blocks, scale_log2, sm_scale,
        ).launch(grid=[grid, 1, 1], block=[THREADS, 1, 1], cluster=[cluster.PAIR, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self, mmas2: Any, mmas1: Any, sq_layout: cute.ComposedLayout, sdo_layout: cute.ComposedLayout,
        sks_layout: cute.ComposedLayout, skd_layout: cute.ComposedLayout, sp_layout: cute.ComposedLayout,
        kt_layout: cute.ComposedLayout, t64_layout: cute.ComposedLayout, bt_layout: cute.ComposedLayout,
        q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, len_ptr: cute.Pointer,
        dout_ptr: cute.Pointer, lg2den_ptr: cute.Pointer, delta_ptr: cute.Pointer,
        dq_ptr: cute.Pointer, dkv_ptr: cute.Pointer, zero_ptr: cute.Pointer, dqacc_ptr: cute.Pointer,
        T: Int32, N: Int32, K: Int32, n_tiles: Int32, n_parts: Int32, part_blocks: Int32,
        scale_log2: Float32, sm_scale: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        r = cluster.rank()

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(self.smem)
        bars = Bars(st.k_full.data_ptr(), st.kd_full.data_ptr(), st.ks_free.data_ptr(), st.kd_free.data_ptr(),
                    st.q_free.data_ptr(), st.ok_full.data_ptr(), st.s_full.data_ptr(), st.ds_full.data_ptr(),
                    st.ds_free.data_ptr(), st.dq_full.data_ptr(), st.dq_free.data_ptr(), st.fin.data_ptr(),
                    st.dealloc.data_ptr(), st.ring_full.data_ptr(), st.ring_free.data_ptr(), st.c_full.data_ptr(),
                    st.c_free.data_ptr())
        sQ = st.sQ.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sdO = st.sdO.get_tensor(sdo_layout.outer, swizzle=sdo_layout.inner)
        tmem_addr = st.tmem_addr.ptr

        cluster.alloc_tmem(warp, MMA_WARP, TMEM_COLS, tmem_addr)
        both, loader, softmax = 2 * 128, 32 * LOADER_WARPS, 32 * SOFTMAX_WARPS
        arrivals = [(bars.k_full, 0, both), (bars.kd_full, 0, both), (bars.ks_free, 0, 1), (bars.kd_free, 0, 1),
                    (bars.q_free, 0, 1), (bars.ok_full, 0, loader), (bars.s_full, 0, 1), (bars.ds_full, 0, both),
                    (bars.ds_free, 0, 1), (bars.dq_full, 0, 1), (bars.dq_free, 0, both), (bars.fin, 0, 1),
                    (bars.dealloc, 0, 32)]
        for k in cutlass.range_constexpr(RING):
            arrivals += [(bars.ring_full, k, loader), (bars.ring_free, k, 1)]
        for k in cutlass.range_constexpr(KV_BUFFERS):
            arrivals += [(bars.c_full, k, 1), (bars.c_free, k, both)]
        pipeline.init_mbarriers(tidx, arrivals)
        cluster.sync()  # the peer's barriers exist before anything arrives on them
        tmem = sync.tmem_pointer(tmem_addr)

        cl, _, _ = cute.arch.block_idx()
        ncl, _, _ = cute.arch.grid_dim()
        sched = (cl // cluster.PAIR, n_tiles, ncl // cluster.PAIR)
        if warp < SOFTMAX_WARPS:
            self.softmax(tidx, r, tmem, st.sOk.data_ptr(), st.sdS.data_ptr(), st.sdSb.data_ptr(),
                         st.sPb.data_ptr(), bars, sched, idx_ptr, len_ptr, K, n_parts, part_blocks, lg2den_ptr,
                         delta_ptr, dq_ptr, dqacc_ptr, scale_log2, sm_scale)
        elif warp < REDUCE_WARP0:
            self.loader(tidx - softmax, r, sQ, sdO, sks_layout, skd_layout, st.sK.data_ptr(), st.sOk.data_ptr(),
                        st.sRing.data_ptr(), bars, sched, idx_ptr, len_ptr, K, n_parts, part_blocks, q_ptr,
                        dout_ptr, kv_ptr, zero_ptr, N)
        elif warp < MMA_WARP:
            self.reducer(tidx - 32 * REDUCE_WARP0, r, tmem, st.sRows.data_ptr(), bars, sched, idx_ptr, len_ptr,
                         K, n_parts, part_blocks, dkv_ptr, T, N)
        else:
            if r == 0:
                self.mma(mmas2, mmas1, sp_layout, kt_layout, t64_layout, bt_layout, sQ, sdO, sks_layout,
                         st.sK.data_ptr(), st.sdS.data_ptr(), st.sdSb.data_ptr(), st.sPb.data_ptr(),
                         st.sRing.data_ptr(), tmem, bars, sched, idx_ptr, len_ptr, K, n_parts, part_blocks)
            # the leader's last MMAs retired (their commits to the peer landed) before either CTA leaves
            cluster.wait(bars.fin, 0)

        cute.arch.sync_threads()
        cluster.sync()
        cluster.free_tmem(warp, MMA_WARP, TMEM_COLS, tmem, bars.dealloc)

    @cute.jit
    def tile(self, tile_id, r, idx_ptr, len_ptr, K, n_parts, part_blocks) -> Tile:
        """Tile tile_id: (token, kv head) row tile_id / n_parts and its part
        tile_id % n_parts, whose blocks are [part part_blocks, ..) of the
        row's blocks holding slots below L."""
        row = tile_id // n_parts
        part = tile_id - row * n_parts
        t = row // self.G
        g = row - t * self.G
        L = rules.row_length(len_ptr, t, K, self.has_len)
        n_blocks = rules.block_count(L, BN)
        b_lo = cutlass.min(part * part_blocks, n_blocks)
        b_hi = cutlass.min(b_lo + part_blocks, n_blocks)
        return Tile(t, g, g * PAIR_H + r * BLOCK_H, L, b_lo, b_hi, idx_ptr + Int64(row) * Int64(K))

    # ---------------------------------------------------------------- loader
    @cute.jit
    def loader(self, ltid, r, sQ, sdO, sks_layout, skd_layout, sK, sOk, sRing, bars: Bars, sched, idx_ptr, len_ptr,
               K, n_parts, part_blocks, q_ptr, dout_ptr, kv_ptr, zero_ptr, N):
        ES = self.dtype.width // 8
        gather = BlockGather.create(self.dtype, ltid, self.D, self.G)
        sKs = cute.make_tensor(cute.recast_ptr(sK, sks_layout.inner, dtype=self.dtype), sks_layout.outer)
        sKd = cute.make_tensor(cute.recast_ptr(sK, skd_layout.inner, dtype=self.dtype), skd_layout.outer)
        tKs = gather.thr.partition_D(sKs)  # (copy, 2 passes, 9 chunks)
        tKd = gather.thr.partition_D(sKd)  # (copy, 4 passes, 5 chunks)
        tQ = gather.thr.partition_D(sQ)
        tdO = gather.thr.partition_D(sdO)
        nb = Int32(0)  # blocks of earlier tiles
        jq = Int32(0)  # earlier tiles with a block
        for tile_id in cutlass.range(sched[0], sched[1], sched[2], unroll=1):
            tl = self.tile(tile_id, r, idx_ptr, len_ptr, K, n_parts, part_blocks)
            if tl.b_hi > tl.b_lo:
                rules.fetch_indices(gather.ns, tl.idx_row, tl.b_lo, BN, gather.row_in_pass, 16, tl.L)
                for i in cutlass.range(tl.b_lo, tl.b_hi, unroll=1):
                    b = nb + i - tl.b_lo
                    gather.sources(i, tl.idx_row, tl.L, N, kv_ptr, zero_ptr, tl.g)
                    if b > 0:  # dQ of the last block retired: the stage is free
                        cute.arch.mbarrier_wait(bars.kd_free, pipeline.phase(b - 1))
                    # the score stage: this CTA's 32 slots are the thread's rows 2 r and 2 r + 1
                    for mm in cutlass.range_constexpr(2):
                        src = cutlass.select_(r == 0, gather.base[mm], gather.base[2 + mm])
                        for c in cutlass.range_constexpr(N_CHUNKS):
                            cute.copy(gather.atom, cute.make_tensor(self._gptr(src + c * CHUNK * ES),
                                                                    cute.make_layout((8,))), tKs[None, mm, c])
                    cute.arch.cp_async_commit_group()
                    if gather.col0 == 0:
                        for m in cutlass.range_constexpr(4):
                            sOk_t = cute.make_tensor(sOk, cute.make_layout((2 * BN,)))
                            sOk_t[(b % 2) * BN + gather.row_in_pass + 16 * m] = gather.mk[m]
                    if i == tl.b_lo:
                        if jq > 0:  # every MMA reading the last tile's Q and dO retired
                            cute.arch.mbarrier_wait(bars.q_free, pipeline.phase(jq - 1))
                        copy_head_rows(gather.atom, tQ, q_ptr, self.dtype, tl.t, self.H, tl.head0, BLOCK_H, self.D,
                                       gather.row_in_pass, gather.col0)
                        copy_head_rows(gather.atom, tdO, dout_ptr, self.dtype, tl.t, self.H, tl.head0, BLOCK_H,
                                       self.d_v, gather.row_in_pass, gather.col0)
                        cute.arch.cp_async_commit_group()
                    gather.land()
                    cute.arch.mbarrier_arrive(bars.ok_full)
                    cluster.arrive(bars.k_full, 0)
                    # the dQ stage, once S and dP of the block retired
                    cute.arch.mbarrier_wait(bars.ks_free, pipeline.phase(b))
                    for m in cutlass.range_constexpr(4):
                        for cc in cutlass.range_constexpr(KD_CHUNKS):
                            src = gather.base[m] + kd_column(cc, r) * ES
                            cute.copy(gather.atom, cute.make_tensor(self._gptr(src), cute.make_layout((8,))),
                                      tKd[None, m, cc])
                    cute.arch.cp_async_commit_group()
                    gather.land()
                    cluster.arrive(bars.kd_full, 0)
                    self.push_rounds(ltid, r, b, sQ, sdO, sRing, bars)
                nb = nb + tl.b_hi - tl.b_lo
                jq = jq + 1

    def _gptr(self, addr):
        return cute.make_ptr(self.dtype, addr, cute.AddressSpace.gmem, assumed_align=16)

    @cute.jit
    def push_rounds(self, ltid, r, b, sQ, sdO, sRing, bars: Bars):
        """Block b's dKV rounds, in the MMA warp's order (pair j, round h,
        Q then dO): in round h == r this CTA copies its Q (dO) chunk 2 j + q
        into ring slot u % 2 of CTA q, for q = 0, 1, and arrives on CTA 0's
        ring_full.  (CTA 1 has no chunk 9; no dO past column 512.)  The
        copy is 16-byte words in order: the swizzle is a function of the
        offset in a 1024-byte-aligned tile, the same in both buffers."""
        q_base = cute.recast_ptr(sQ.iterator, None).toint()
        do_base = cute.recast_ptr(sdO.iterator, None).toint()
        ring = sRing.toint()
        TILE = 64 * 64 * 2
        lu = 0
        for j in cutlass.range_constexpr(PAIRS):
            for h in cutlass.range_constexpr(2):
                for x in cutlass.range_constexpr(2):
                    if const_expr(x == 0 or 2 * j + 1 < DV_SERVED // CHUNK):
                        slot = lu % RING
                        use = b * (ROUND_USES // RING) + lu // RING
                        # both CTAs wait for every use of a slot, the pushing one or not, so
                        # that no wait is two phases behind (the slot's uses alternate CTAs)
                        if use > 0:
                            cute.arch.mbarrier_wait(bars.ring_free + slot, pipeline.phase(use - 1))
                        if r == h:
                            src_base = q_base if const_expr(x == 0) else do_base
                            for q in cutlass.range_constexpr(2):
                                if const_expr(2 * j + q < N_CHUNKS):
                                    src = src_base + (2 * j + q) * TILE
                                    for k in cutlass.range_constexpr(TILE // 16 // 128):
                                        off = (ltid + 128 * k) * 16
                                        v = cute.make_rmem_tensor((4,), Int32)
                                        cute.autovec_copy(cute.make_tensor(
                                            cute.make_ptr(Int32, src + off, cute.AddressSpace.smem, assumed_align=16),
                                            cute.make_layout((4,))), v)
                                        cluster.store16(ring + slot * TILE + off, q, v[0], v[1], v[2], v[3])
                            cluster.fence_remote()
                            cluster.arrive(bars.ring_full + slot, 0)
                        lu += 1

    # ------------------------------------------------------------------- MMA
    @cute.jit
    def mma(self, mmas2, mmas1, sp_layout, kt_layout, t64_layout, bt_layout, sQ, sdO, sks_layout, sK, sdS, sdSb,
            sPb, sRing, tmem, bars: Bars, sched, idx_ptr, len_ptr, K, n_parts, part_blocks):
        s2, dq2, dqt2, kv2 = mmas2
        s1, dq1, dqt1, kv1 = mmas1

        def smem_tensor(ptr, layout, off=0):  # off: elements
            return cute.make_tensor(cute.recast_ptr(cute.recast_ptr(ptr, None) + off, layout.inner,
                                                    dtype=self.dtype), layout.outer)

        sKs = cute.make_tensor(cute.recast_ptr(sK, sks_layout.inner, dtype=self.dtype), sks_layout.outer)
        a_s, a_dq, a_dqt, a_kv = (x.get_slice(0) for x in mmas1)
        fQ = s1.make_fragment_A(a_s.partition_A(sQ))        # (MMA, 1, 36)
        fdO = s1.make_fragment_A(a_s.partition_A(sdO))      # (MMA, 1, 32)
        fKs = s1.make_fragment_B(a_s.partition_B(sKs))      # (MMA, 1, 36)
        ds_k = smem_tensor(sdS, sp_layout)
        fdS = dq1.make_fragment_A(a_dq.partition_A(ds_k))   # (MMA, 1, 4)
        fdSt = dqt1.make_fragment_A(a_dqt.partition_A(ds_k))
        chunk_elems = BN * CHUNK
        fKd = [dq1.make_fragment_B(a_dq.partition_B(smem_tensor(sK, kt_layout, 2 * jj * chunk_elems)))
               for jj in range(2)]                           # (MMA, 1, 4)
        fKdt = dqt1.make_fragment_B(a_dqt.partition_B(smem_tensor(sK, t64_layout, 4 * chunk_elems)))
        fRing = [kv1.make_fragment_A(a_kv.partition_A(smem_tensor(sRing, t64_layout, k * 64 * 64)))
                 for k in range(RING)]                       # (MMA, 1, 4)
        fdSb = kv1.make_fragment_B(a_kv.partition_B(smem_tensor(sdSb, bt_layout)))  # (MMA, 1, 8)
        fPb = kv1.make_fragment_B(a_kv.partition_B(smem_tensor(sPb, bt_layout)))

        s_layout = s2.make_fragment_C(s2.partition_shape_C((PAIR_H, BN))).layout
        check_pair_rows(s_layout, BN)
        tS = cute.make_tensor(tmem + S_COL, s_layout)
        tdP = cute.make_tensor(tmem + DP_COL, s_layout)
        dq_layout = dq2.make_fragment_C(dq2.partition_shape_C((PAIR_H, 256))).layout
        check_pair_rows(dq_layout, 256)
        tdQ = [cute.make_tensor(tmem + DQ_COL + 128 * jj, dq_layout) for jj in range(2)]
        dqt_layout = dqt2.make_fragment_C(dqt2.partition_shape_C((PAIR_H, 128))).layout
        check_pair_rows(dqt_layout, 128)
        tdQt = cute.make_tensor(tmem + DQT_COL, dqt_layout)
        kv_layout = kv2.make_fragment_C(kv2.partition_shape_C((PAIR_H, BN))).layout
        check_pair_rows(kv_layout, BN)

        main_steps = self.d_v // 16
        nb = Int32(0)
        jq = Int32(0)
        for tile_id in cutlass.range(sched[0], sched[1], sched[2], unroll=1):
            tl = self.tile(tile_id, 0, idx_ptr, len_ptr, K, n_parts, part_blocks)
            if tl.b_hi > tl.b_lo:
                n = tl.b_hi - tl.b_lo
                for i in cutlass.range(n, unroll=1):
                    b = nb + i
                    cluster.wait(bars.k_full, pipeline.phase(b))
                    sync.after_sync()
                    # S: the 512 latent columns, then the D = 64 tail as its own round
                    self.gemm(s2, tS, fQ, fKs, main_steps, False)
                    self.gemm(s2, tS, fQ, fKs, (self.D - self.d_v) // 16, True, main_steps)
                    self.gemm(s2, tdP, fdO, fKs, main_steps, False)
                    cluster.commit(bars.s_full)
                    cluster.commit(bars.ks_free)
                    if i == n - 1:
                        cluster.commit(bars.q_free)
                    cluster.wait(bars.ds_full, pipeline.phase(b))
                    cluster.wait(bars.kd_full, pipeline.phase(b))
                    if i == 0:
                        if jq > 0:  # both CTAs' epilogues read the last tile's dQ
                            cluster.wait(bars.dq_free, pipeline.phase(jq - 1))
                    sync.after_sync()
                    for jj in cutlass.range_constexpr(2):
                        self.gemm(dq2, tdQ[jj], fdS, fKd[jj], BN // 16, i > 0)
                    self.gemm(dqt2, tdQt, fdSt, fKdt, BN // 16, i > 0)
                    cluster.commit(bars.kd_free)
                    if i == n - 1:
                        cluster.commit(bars.dq_full)
                    self.dkv_block(kv2, kv_layout, fRing, fdSb, fPb, tmem, bars, b)
                    cluster.commit(bars.ds_free)
                nb = nb + n
                jq = jq + 1
        cluster.commit(bars.fin)

    @cute.jit
    def dkv_block(self, kv2, kv_layout, fRing, fdSb, fPb, tmem, bars: Bars, b):
        """Block b's dKV: pair j accumulates over the two rounds of 64 heads
        (dS^T Q, then P^T dO where the chunks are value columns) into the
        TMEM buffer of its turn, read from the ring in the loader's order."""
        lu = 0
        for j in cutlass.range_constexpr(PAIRS):
            m = b * PAIRS + j
            kb = m % KV_BUFFERS
            u = m // KV_BUFFERS
            if u > 0:  # both CTAs' reducers read the buffer's last chunk
                cluster.wait(bars.c_free + kb, pipeline.phase(u - 1))
            tKV = cute.make_tensor(tmem + KV_COL + kb * HALF_N, kv_layout)
            first = True
            for h in cutlass.range_constexpr(2):
                for x in cutlass.range_constexpr(2):
                    if const_expr(x == 0 or 2 * j + 1 < DV_SERVED // CHUNK):
                        slot = lu % RING
                        use = b * (ROUND_USES // RING) + lu // RING
                        cluster.wait(bars.ring_full + slot, pipeline.phase(use))
                        sync.after_sync()
                        fb = fdSb if const_expr(x == 0) else fPb
                        self.gemm(kv2, tKV, fRing[slot], fb, 64 // 16, not first, 0, 4 * h)
                        cluster.commit(bars.ring_free + slot)
                        first = False
                        lu += 1
            cluster.commit(bars.c_full + kb)

    @cute.jit
    def gemm(self, tiled, acc, frag_a, frag_b, steps: cutlass.Constexpr, accumulate, a0: cutlass.Constexpr = 0,
             b0: cutlass.Constexpr = -1):
        """acc (+)= A B over ``steps`` K-steps of 16 from A's step a0 and B's
        b0 (a0 when -1); the first step overwrites acc unless ``accumulate``."""
        atom = cute.make_mma_atom(tiled.op)
        bb = a0 if const_expr(b0 < 0) else b0
        # not unrolled: each step's descriptors are made when it issues (see
        # the generic kernel's gemm)
        for k in cutlass.range(steps, unroll=1):
            atom.set(tcgen05.Field.ACCUMULATE, k > 0 or accumulate)
            cute.gemm(atom, acc, frag_a[None, None, a0 + k], frag_b[None, None, bb + k], acc)

    # --------------------------------------------------------------- softmax
    @cute.jit
    def softmax(self, tidx, r, tmem, sOk, sdS, sdSb, sPb, bars: Bars, sched, idx_ptr, len_ptr, K, n_parts,
                part_blocks, lg2den_ptr, delta_ptr, dq_ptr, dqacc_ptr, scale_log2, sm_scale):
        lane = tidx % 32
        w = tidx // 32
        row = 32 * (w % 2) + lane    # this thread's head (of the CTA's 64) ...
        half = w // 2                # ... and half of the slots / of each N
        t2r, _, frag = rows.lane_copies(tmem, tidx, store=False, n=HALF_COLS)
        t2r_dq, _, frag_dq = rows.lane_copies(tmem, tidx, store=False)
        rS = cute.make_rmem_tensor(frag, Float32)
        rdP = cute.make_rmem_tensor(frag, Float32)
        rP = cute.make_rmem_tensor((ROW_COLS,), self.dtype)
        rdS = cute.make_rmem_tensor((ROW_COLS,), self.dtype)
        rdQ = cute.make_rmem_tensor(frag_dq, Float32)
        ok = cute.make_tensor(sOk, cute.make_layout((2 * BN,)))
        k_row = BLOCK_H * r + row    # this head's K index in the B tiles
        b_off = k_row * 64
        sw = (k_row >> 1) & 3
        nb = Int32(0)
        jq = Int32(0)
        for tile_id in cutlass.range(sched[0], sched[1], sched[2], unroll=1):
            tl = self.tile(tile_id, r, idx_ptr, len_ptr, K, n_parts, part_blocks)
            head = Int64(tl.t) * Int64(self.H) + Int64(tl.head0 + row)
            if tl.b_hi == tl.b_lo:
                if not self.splits(n_parts):  # no valid slot: dq is 0 (a split row's workspace stays 0)
                    rP.fill(0.0)
                    for c in cutlass.range_constexpr(9):
                        rows.store_global(rP, self.dtype, self._dq_addr(dq_ptr, head, self._dq_col(c, half), 2))
            else:
                lg2 = load(lg2den_ptr, head)
                dl = load(delta_ptr, head)
                for i in cutlass.range(tl.b_hi - tl.b_lo, unroll=1):
                    b = nb + i
                    cute.arch.mbarrier_wait(bars.ok_full, pipeline.phase(b))
                    cute.arch.mbarrier_wait(bars.s_full, pipeline.phase(b))
                    sync.after_sync()
                    for hh in cutlass.range_constexpr(ROW_COLS // HALF_COLS):
                        cute.copy(t2r, t2r.partition_S(rows.cols(tmem, S_COL + hh * HALF_COLS, HALF_COLS)), rS)
                        cute.copy(t2r, t2r.partition_S(rows.cols(tmem, DP_COL + hh * HALF_COLS, HALF_COLS)), rdP)
                        sync.wait_ld()
                        slot0 = (b % 2) * BN + half * HALF_N + hh * HALF_COLS
                        for j in cutlass.range_constexpr(HALF_COLS):
                            # the NaN-preserving clamp: a padded slot is exactly 0
                            valid = ok[slot0 + j] == 0.0
                            p = cute.math.exp2(rS[j] * scale_log2 - lg2, fastmath=True)
                            ds = p * (rdP[j] - dl) * sm_scale
                            rP[hh * HALF_COLS + j] = Float32(cutlass.select_(valid, p, Float32(0.0))).to(self.dtype)
                            rdS[hh * HALF_COLS + j] = Float32(cutlass.select_(valid, ds, Float32(0.0))).to(self.dtype)
                    if b > 0:  # every MMA reading the last block's P and dS (both CTAs' tiles) retired
                        cute.arch.mbarrier_wait(bars.ds_free, pipeline.phase(b - 1))
                    rows.store_tile_row(rdS, sdS.toint(), row, half)
                    self.store_b_row(rdS, sdSb.toint() + b_off, sw, half)
                    self.store_b_row(rP, sPb.toint() + b_off, sw, half)
                    cute.arch.fence_view_async_shared()
                    cluster.fence_remote()
                    sync.before_sync()
                    cluster.arrive(bars.ds_full, 0)
                cute.arch.mbarrier_wait(bars.dq_full, pipeline.phase(jq))
                sync.after_sync()
                for c in cutlass.range_constexpr(9):
                    tcol = DQ_COL + 32 * c if const_expr(c < 8) else DQT_COL + 32 * half
                    cute.copy(t2r_dq, t2r_dq.partition_S(rows.cols(tmem, tcol)), rdQ)
                    sync.wait_ld()
                    col = self._dq_col(c, half)
                    if self.splits(n_parts):
                        addr = self._dq_addr(dqacc_ptr, head, col, 4)
                        for v in cutlass.range_constexpr(ROW_COLS // 4):
                            dkv_reduce.global_f32(dkv_reduce.RED_ADD, addr + 16 * v, rdQ[4 * v], rdQ[4 * v + 1],
                                                  rdQ[4 * v + 2], rdQ[4 * v + 3])
                    else:
                        for jj in cutlass.range_constexpr(ROW_COLS):
                            rP[jj] = rdQ[jj].to(self.dtype)
                        rows.store_global(rP, self.dtype, self._dq_addr(dq_ptr, head, col, 2))
                sync.before_sync()
                cluster.arrive(bars.dq_free, 0)
                nb = nb + tl.b_hi - tl.b_lo
                jq = jq + 1

    def splits(self, n_parts):
        """Rows are split over clusters (dq added into the fp32 workspace);
        never in the deterministic build, whose host launches one part."""
        if const_expr(self.deterministic):
            return False
        return n_parts > 1

    def _dq_col(self, c: int, half):
        """The first of the 32 dq columns a thread of column half ``half``
        reads in its c-th TMEM load: dQ round c // 4 (this CTA's N half is
        columns 128 half of it), then the tail's half."""
        if c < 8:
            return 256 * (c // 4) + 128 * half + 32 * (c % 4)
        return DV_SERVED + 32 * half

    def _dq_addr(self, ptr, head, col, es: int):
        return ptr.toint() + (head * Int64(self.D) + Int64(col)) * Int64(es)

    @cute.jit
    def store_b_row(self, vals, addr, sw, half):
        """32 16-bit values of one head (slots 32 half ..) into the B tile of
        CTA ``half`` (``check_b_tile``): four 16-byte stores at chunk n / 8 ^ sw."""
        words = cute.recast_tensor(vals, Int32)
        for cidx in cutlass.range_constexpr(4):
            cluster.store16(addr + ((cidx ^ sw) * 16), half, words[4 * cidx], words[4 * cidx + 1],
                            words[4 * cidx + 2], words[4 * cidx + 3])

    # --------------------------------------------------------------- reducer
    @cute.jit
    def reducer(self, wtid, r, tmem, sRows, bars: Bars, sched, idx_ptr, len_ptr, K, n_parts, part_blocks, dkv_ptr,
                T, N):
        """A thread: column 32 (w % 2) + lane of the CTA's chunk over the 32
        slots of half w / 2 (TMEM lane = thread); the slots' dkv row
        addresses (0: invalid) sit in shared memory, written once a block."""
        lane = wtid % 32
        w = wtid // 32
        mcol = 32 * (w % 2) + lane
        sh = w // 2
        t2r, _, frag = rows.lane_copies(tmem, wtid, store=False)
        acc = cute.make_rmem_tensor(frag, Float32)
        addrs = cute.make_tensor(sRows, cute.make_layout((2 * BN,)))
        nb = Int32(0)
        for tile_id in cutlass.range(sched[0], sched[1], sched[2], unroll=1):
            tl = self.tile(tile_id, r, idx_ptr, len_ptr, K, n_parts, part_blocks)
            if tl.b_hi > tl.b_lo:
                row0 = dkv_reduce.dkv_row0(self.deterministic, self.G, tl.t, tl.g, 0, T, K)
                for i in cutlass.range(tl.b_lo, tl.b_hi, unroll=1):
                    b = nb + i - tl.b_lo
                    if w % 2 == 0:  # warps 0 and 2: the rows of slot halves 0 and 1
                        slot = i * BN + sh * HALF_N + lane
                        n = rules.slot_index(tl.idx_row, slot, tl.L)  # -1 past L: nothing read
                        a = Int64(0)
                        if n >= 0 and n < N:
                            off = Int64(n) * Int64(self.G) + row0
                            if const_expr(self.deterministic):
                                off = row0 + Int64(slot)
                            a = dkv_ptr.toint() + off * Int64(self.D * 4)
                        addrs[(b % 2) * BN + sh * HALF_N + lane] = a
                    # written before read; the buffer of b % 2 is rewritten only after every thread passed
                    # this barrier of block b + 1
                    pipeline.sync(REDUCE_BARRIER, 32 * REDUCER_WARPS)
                    for j in cutlass.range_constexpr(PAIRS):
                        m = b * PAIRS + j
                        kb = m % KV_BUFFERS
                        cute.arch.mbarrier_wait(bars.c_full + kb, pipeline.phase(m // KV_BUFFERS))
                        sync.after_sync()
                        col_ = cute.assume(kb * HALF_N, divby=HALF_N)
                        cute.copy(t2r, t2r.partition_S(rows.cols(tmem, KV_COL + col_)), acc)
                        sync.wait_ld()
                        sync.before_sync()
                        cluster.arrive(bars.c_free + kb, 0)
                        c = 2 * j + r
                        if c < N_CHUNKS:
                            self.scatter(acc, addrs, (b % 2) * BN + sh * HALF_N, c * CHUNK + mcol)
                nb = nb + tl.b_hi - tl.b_lo

    @cute.jit
    def scatter(self, acc, addrs, s0, col):
        """Column ``col`` of 32 slots' dkv rows (addresses addrs[s0 ..]),
        at its position in the fragment order (column 8 h + 2 q + e of a
        16-column group at 4 q + 2 h + e)."""
        pos = fragment_position(col)
        for s in cutlass.range_constexpr(HALF_N):
            a = addrs[s0 + s]
            if a != 0:
                if const_expr(self.deterministic):
                    _f32_op("st.global", a + pos * 4, acc[s])
                else:
                    _f32_op("red.global.add", a + pos * 4, acc[s])
