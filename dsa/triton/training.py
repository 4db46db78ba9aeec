"""Triton kernels of indexer training, forward side: attention targets and the sparse indexer.

Attention target (one program per query row t and kv head g; M = H / H_kv
query heads form the rows of the MMA, slots its columns):

    s[h, j]      = sm_scale * q[t, h] . kv[indices[t, g, j], g]      (all D dims)
    target[t, g, j] = (1/M) sum_h exp(s[h, j] - lse[t, h])           (valid j, else 0)

It recomputes only S = Q K^T (no P V) and reuses the forward's lse, so it
costs 2*M*K*D per row. Scores are kept in the log2 domain (sm_scale * log2 e
folded into one multiply, then exp2), as flash attention does. The dense
target of the warm-up stage runs the same kernel with implicit slots (slot j
of row i is key cu_seqlens_k[b] + j, valid iff j < its visible limit): a first
pass computes lse over the visible keys, a second the target.

Sparse indexer (one program per query row; H_i heads are the MMA rows, the
whole D_i row stays in registers):

    logits[t, j] = sm_scale * sum_h weights[t, h] * relu(q[t, h] . k[indices[t, j]])

With KL=True the same loop never stores the logits: it keeps an online
log-sum-exp (max m, sum l) and, relative to the running max m,
    A = sum_j target_j * (logit_j - m)      B = sum_j target_j * log target_j
    S = sum_j target_j
(rebasing A by (m_old - m_new) * S when the max grows), so that
    loss_t = B - A + log(l) * S = sum_j target_j (log target_j - log_softmax_j)
without subtracting two large numbers. It writes per-row stats
(loss_t, lse, S, has-a-valid-slot) for the backward (dsa/triton/indexer_bwd.py).

Validity (sparse attention's rule): slot j is valid iff j < clamp(topk_length[t], 0, K)
and 0 <= index < N. Every gather is masked with it, so an invalid slot is
never read; loops end at the row's last valid block; row offsets are int64.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from dsa._args import DenseTargetArgs, IndexerArgs, SparseAttnArgs, SparseIndexerArgs
from dsa._rules import dense_rows
from dsa.triton import fit
from dsa.triton.rules import LOG2E, input_precision, load_slots, online_softmax_step, row_length, slot_rows

# the most query heads one program holds as MMA rows (every head of a row: the
# attention target sums over them, the indexer kernels reduce the logits over
# them), and the widest indexer row
MAX_HEADS = fit.MAX_ROW_HEADS
MAX_INDEXER_DIM = 256


# --------------------------------------------------------------------------
# kernels


@triton.jit
def _q_chunks(p_q, m_q, o_bd, D: tl.constexpr, BD: tl.constexpr, HEAD_AX: tl.constexpr):
    """Q's D chunks (each [BM, BD], or [BD, BM] with keys as rows), loaded once."""
    qs = ()
    for c in tl.static_range((D + BD - 1) // BD):
        o_dq = tl.expand_dims(c * BD + o_bd, HEAD_AX)
        qs = qs + (tl.load(p_q + o_dq, mask=m_q & (o_dq < D), other=0.0),)
    return qs


@triton.jit
def _target_scores(p_q, m_q, qs, p_kv, m_kv, o_bd, BM: tl.constexpr, BK: tl.constexpr, D: tl.constexpr,
                   BD: tl.constexpr, PREC: tl.constexpr, Q_RESIDENT: tl.constexpr, KEYS_AS_ROWS: tl.constexpr):
    """One slot block's S = Q K^T over all D dims ([BM, BK], or S^T [BK, BM])."""
    HEAD_AX: tl.constexpr = 1 if KEYS_AS_ROWS else 0
    SLOT_AX: tl.constexpr = 1 - HEAD_AX
    if KEYS_AS_ROWS:
        b_s = tl.zeros([BK, BM], tl.float32)
    else:
        b_s = tl.zeros([BM, BK], tl.float32)
    if Q_RESIDENT:
        for c in tl.static_range((D + BD - 1) // BD):
            o_dk = tl.expand_dims(c * BD + o_bd, SLOT_AX)
            b_k = tl.load(p_kv + o_dk, mask=m_kv & (o_dk < D), other=0.0)
            if KEYS_AS_ROWS:
                b_s = tl.dot(b_k, qs[c], b_s, input_precision=PREC)
            else:
                b_s = tl.dot(qs[c], b_k, b_s, input_precision=PREC)
    else:
        # the D reduction as a dynamic loop: its loads are software-pipelined
        for d0 in range(0, D, BD):
            o_dq = tl.expand_dims(d0 + o_bd, HEAD_AX)
            o_dk = tl.expand_dims(d0 + o_bd, SLOT_AX)
            b_q = tl.load(p_q + o_dq, mask=m_q & (o_dq < D), other=0.0)
            b_k = tl.load(p_kv + o_dk, mask=m_kv & (o_dk < D), other=0.0)
            if KEYS_AS_ROWS:
                b_s = tl.dot(b_k, b_q, b_s, input_precision=PREC)
            else:
                b_s = tl.dot(b_q, b_k, b_s, input_precision=PREC)
    return b_s


@triton.jit
def _target_kernel(
    Q,  # [T, H, D]
    KV,  # [N, G, D] (dense: [T_k, 1, D])
    IDX,  # [T, G, K] int32 (unused when IMPLICIT)
    LEN,  # [T] int32: topk_length, or the visible limit when IMPLICIT
    BASE,  # [T] int32: first key row of the row's sequence (IMPLICIT only)
    LSE,  # [T, H] fp32: read (target pass) or written (LSE_PASS)
    OUT,  # [T, G, K] fp32, zero-initialised
    sm_scale, N, K,
    H: tl.constexpr, G: tl.constexpr,
    M: tl.constexpr,  # query heads per kv head
    BM: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr,
    HAS_LEN: tl.constexpr, IMPLICIT: tl.constexpr, LSE_PASS: tl.constexpr, PREC: tl.constexpr,
    Q_RESIDENT: tl.constexpr = False,  # Q's D chunks loaded once and kept on chip
    KEYS_AS_ROWS: tl.constexpr = False,  # S^T = KV Q^T: slots on the MMA's rows, the head sum along its columns
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    o_m = tl.arange(0, BM)
    m_m = o_m < M
    o_bd = tl.arange(0, BD)
    # b_s is [heads, slots], or [slots, heads] with KEYS_AS_ROWS; the Q tile
    # is [BM, BD], or Q^T's [BD, BM]
    HEAD_AX: tl.constexpr = 1 if KEYS_AS_ROWS else 0
    SLOT_AX: tl.constexpr = 1 - HEAD_AX
    p_q = Q + t * (H * D) + tl.expand_dims((g * M + o_m) * D, SLOT_AX)
    m_q = tl.expand_dims(m_m, SLOT_AX)
    length = row_length(LEN, t, K, HAS_LEN)
    base = t
    if IMPLICIT:
        base = tl.load(BASE + t).to(tl.int64)
    qk_scale = sm_scale * LOG2E  # log2 domain: one multiply, then exp2
    p_lse = LSE + t * H + g * M + o_m
    if LSE_PASS:
        b_m = tl.full([BM], float("-inf"), tl.float32)
        b_l = tl.zeros([BM], tl.float32)
    else:
        # padded heads read +inf: exp2(s - inf) = 0
        b_lse = tl.load(p_lse, mask=m_m, other=float("inf")) * LOG2E
    qs = ()
    if Q_RESIDENT:
        # Q read once, not once per slot block: the L2 traffic of a block is
        # then its kv rows only
        qs = _q_chunks(p_q, m_q, o_bd, D, BD, HEAD_AX)
    for k0 in range(0, length, BK):
        o_k, m_k, rows, valid = slot_rows(IDX, t * G + g, K, base, k0, length, N, BK, IMPLICIT)
        # the kv tile is K^T's [BD, BK] (not a transposed [BK, BD]) so the
        # pipeliner feeds the MMA directly, or K's [BK, BD] with KEYS_AS_ROWS
        p_kv = KV + tl.expand_dims((rows * G + g) * D, HEAD_AX)
        m_kv = tl.expand_dims(valid, HEAD_AX)
        b_s = _target_scores(p_q, m_q, qs, p_kv, m_kv, o_bd, BM, BK, D, BD, PREC, Q_RESIDENT, KEYS_AS_ROWS)
        b_s = b_s * qk_scale
        if LSE_PASS:
            b_s = tl.where(m_kv, b_s, float("-inf"))
            b_m, b_l, _, _ = online_softmax_step(b_s, b_m, b_l, SLOT_AX)
        else:
            b_p = tl.exp2(b_s - tl.expand_dims(b_lse, SLOT_AX))
            b_p = tl.where(m_q & m_kv, b_p, 0.0)
            tl.store(OUT + (t * G + g) * K + o_k, tl.sum(b_p, HEAD_AX) / M, mask=m_k)
    if LSE_PASS:
        # natural-log lse; +inf on a row with no visible key (sparse attention's convention)
        lse = tl.where(b_l > 0, (b_m + tl.log2(b_l)) / LOG2E, float("inf"))
        tl.store(p_lse, lse, mask=m_m)


@triton.jit
def _kl_lanes_step(v_m, v_l, v_a, v_b, v_ts, v_n, b_lg, b_t, valid):
    """Fold one slot block into the per-lane KL sums (see the module header)."""
    live = valid & (b_t != 0.0)  # target 0 counts 0 (and an invalid slot's target is ignored)
    v_mn = tl.maximum(v_m, b_lg)
    v_ms = tl.where(v_mn == float("-inf"), 0.0, v_mn)
    v_l = v_l * tl.exp(v_m - v_ms) + tl.exp(b_lg - v_ms)
    v_a += tl.where(v_m == float("-inf"), 0.0, (v_m - v_ms) * v_ts)  # rebase to the new max
    v_a += tl.where(live, b_t * (b_lg - v_ms), 0.0)
    v_b += tl.where(live, b_t * tl.log(b_t), 0.0)
    v_ts += tl.where(valid, b_t, 0.0)
    v_n += valid.to(tl.int32)
    return v_mn, v_l, v_a, v_b, v_ts, v_n


@triton.jit
def _kl_lanes_store(STATS, t, v_m, v_l, v_a, v_b, v_ts, v_n):
    """Reduce the lanes and store the row's stats (loss_t, lse, S, has a valid slot)."""
    b_m = tl.max(v_m, 0)
    b_ms = tl.where(b_m == float("-inf"), 0.0, b_m)
    v_ms = tl.where(v_m == float("-inf"), b_ms, v_m)  # a lane with no valid slot holds only zeros
    b_l = tl.sum(v_l * tl.exp(v_ms - b_ms), 0)
    b_a = tl.sum(v_a + (v_ms - b_ms) * v_ts, 0)  # sum target * (logit - m)
    b_ts = tl.sum(v_ts, 0)
    has = tl.sum(v_n, 0) > 0
    log_l = tl.log(b_l)  # = lse - m
    # sum t (log t - logit + lse) = sum t log t - sum t (logit - m) + (lse - m) sum t
    loss = tl.where(has, tl.sum(v_b, 0) - b_a + log_l * b_ts, 0.0)
    p_st = STATS + t * 4
    tl.store(p_st, loss)
    tl.store(p_st + 1, tl.where(has, b_m + log_l, float("-inf")))
    tl.store(p_st + 2, b_ts)
    tl.store(p_st + 3, has.to(tl.float32))


@triton.jit
def _kl_stats_kernel(LG, IDX, LEN, TGT, STATS, N, K, BK: tl.constexpr, HAS_LEN: tl.constexpr):
    """Row t's KL stats from its logits LG [T, K] (the forward kernel's lanes, reading the logits)."""
    t = tl.program_id(0).to(tl.int64)
    length = row_length(LEN, t, K, HAS_LEN)
    v_m = tl.full([BK], float("-inf"), tl.float32)
    v_l = tl.zeros([BK], tl.float32)
    v_a = tl.zeros([BK], tl.float32)
    v_b = tl.zeros([BK], tl.float32)
    v_ts = tl.zeros([BK], tl.float32)
    v_n = tl.zeros([BK], tl.int32)
    for k0 in range(0, length, BK):
        o_k, _, idx, valid = load_slots(IDX, t, K, k0, length, N, BK)
        b_lg = tl.load(LG + t * K + o_k, mask=valid, other=float("-inf"))
        b_t = tl.load(TGT + t * K + o_k, mask=valid, other=0.0)
        v_m, v_l, v_a, v_b, v_ts, v_n = _kl_lanes_step(v_m, v_l, v_a, v_b, v_ts, v_n, b_lg, b_t, valid)
    _kl_lanes_store(STATS, t, v_m, v_l, v_a, v_b, v_ts, v_n)


@triton.jit
def _sparse_indexer_fwd_kernel(
    Q,  # [T, H, D]
    Kp,  # [N, D]
    W,  # [T, H]
    IDX,  # [T, K] int32
    LEN,  # [T] int32 (HAS_LEN)
    TGT,  # [T, K] fp32 (KL)
    OUT,  # [T, K] fp32 logits, every slot written (not KL)
    STATS,  # [T, 4] fp32 (KL): loss_t, lse, sum target, has a valid slot
    sm_scale, N, K,
    H: tl.constexpr, BH: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr,
    HAS_LEN: tl.constexpr, KL: tl.constexpr, PREC: tl.constexpr,
    KEYS_AS_ROWS: tl.constexpr = False,  # S^T = K Q^T: the head sum runs along the MMA's columns
):
    t = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BH)
    m_h = o_h < H
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_q = tl.load(Q + t * (H * D) + o_h[:, None] * D + o_d[None, :], mask=m_h[:, None] & m_d[None, :], other=0.0)
    b_w = tl.load(W + t * H + o_h, mask=m_h, other=0.0).to(tl.float32) * sm_scale  # [BH]
    length = row_length(LEN, t, K, HAS_LEN)
    if KL:
        # Per slot lane (slot k0 + i keeps lane i): a running max and sum of
        # exp, and plain sums; reduced across lanes once after the loop, so
        # no block-wide reduction sits inside it.
        v_m = tl.full([BK], float("-inf"), tl.float32)
        v_l = tl.zeros([BK], tl.float32)  # sum exp(logit - v_m)
        v_a = tl.zeros([BK], tl.float32)  # sum target * (logit - the lane's max)
        v_b = tl.zeros([BK], tl.float32)  # sum target * log target
        v_ts = tl.zeros([BK], tl.float32)  # sum target
        v_n = tl.zeros([BK], tl.int32)  # valid slots
    for k0 in range(0, length, BK):
        o_k, _, idx, valid = load_slots(IDX, t, K, k0, length, N, BK)
        if KEYS_AS_ROWS:
            # keys on the MMA's rows: each thread sums its own columns (heads),
            # then across the 4 threads of a row, instead of across warps
            b_k = tl.load(
                Kp + idx.to(tl.int64)[:, None] * D + o_d[None, :], mask=valid[:, None] & m_d[None, :], other=0.0
            )  # [BK, BD]
            b_st = tl.dot(b_k, tl.trans(b_q), input_precision=PREC)  # [BK, BH]
            b_lg = tl.sum(tl.maximum(b_st, 0.0) * b_w[None, :], 1)  # [BK]
        else:
            b_kt = tl.load(
                Kp + idx.to(tl.int64)[None, :] * D + o_d[:, None], mask=m_d[:, None] & valid[None, :], other=0.0
            )  # [BD, BK]: K^T as the MMA's B operand, loaded in that shape so it is pipelined
            b_s = tl.dot(b_q, b_kt, input_precision=PREC)  # [BH, BK]
            b_lg = tl.sum(tl.maximum(b_s, 0.0) * b_w[:, None], 0)  # [BK]
        b_lg = tl.where(valid, b_lg, float("-inf"))
        if KL:
            b_t = tl.load(TGT + t * K + o_k, mask=valid, other=0.0)
            v_m, v_l, v_a, v_b, v_ts, v_n = _kl_lanes_step(v_m, v_l, v_a, v_b, v_ts, v_n, b_lg, b_t, valid)
        else:
            tl.store(OUT + t * K + o_k, b_lg, mask=o_k < K)  # -inf at slots past the length
    if KL:
        _kl_lanes_store(STATS, t, v_m, v_l, v_a, v_b, v_ts, v_n)
    else:
        # the blocks past the length: -inf here rather than a fill of the whole output first
        for k0 in range(tl.cdiv(length, BK) * BK, K, BK):
            o_k = k0 + tl.arange(0, BK)
            tl.store(OUT + t * K + o_k, tl.full([BK], float("-inf"), tl.float32), mask=o_k < K)


# --------------------------------------------------------------------------
# configs


@dataclass(frozen=True)
class TrainingTileConfig:
    """Tile sizes and launch shape of the attention-target or sparse-indexer forward kernel."""

    BK: int  # slots per block
    BD: int  # head-dim chunk
    num_warps: int
    num_stages: int
    q_resident: bool = False  # attention target: Q held across slot blocks
    keys_as_rows: bool = False  # attention target, sparse indexer forward: slots as the MMA's rows




# attention target, by query heads per program (MMA rows); BD 64 divides 576 and 512.
# H200 bf16, V3.2 step (T=4096, H=128, D=576, K=2048; python bench/test_bench_training.py --sweep):
# (BK, BD, warps, stages) = (64,64,4,3) 3.40 ms (364 TFLOP/s); (64,64,8,3) 3.72; (128,32,8,4) 3.88;
# (64,64,8,2) 4.30; (128,64,8,2) 5.25; (64,32,4,4) 5.66; second run (64,64,4,3) 3.48, (64,64,4,4) 3.53,
# (64,64,4,2) 3.98, (32,64,4,3) 8.96. The 64- and 32-head rows are not measured.
# Offline (sm_90a) the default takes 255 registers and spills 1400 B; each slot block re-reads
# Q (144 KB at H=128, D=576) besides its 72 KB of kv rows. q_resident=True loads Q once into
# shared memory (8 warps, BK 32: 139 registers, no spills) but measures slower: (32,64,8,3) 4.73 ms
# (262 TFLOP/s) against the default's 3.40 (364); (64,64,8,2) needs 297 KB of shared memory (RESULTS.md C16).
# keys_as_rows=True (S^T = KV Q^T, the head sum within each thread's row), same step (RESULTS.md C17,
# C18, C19): (128,64,8,4) 2.76-2.82 ms (449-438 TFLOP/s); (128,64,8,3) 2.98-2.99; (128,32,8,4) 3.16; (64,64,4,3) 3.19;
# (64,64,8,3) 3.25; (64,64,8,4) 3.33; (128,64,8,2) 4.62; (64,32,4,4) 5.78; with q_resident (64,64,8,1) 5.50;
# heads as rows (64,64,4,3) 3.39-3.40 in the same runs.
TARGET_CONFIGS = {
    128: TrainingTileConfig(BK=128, BD=64, num_warps=8, num_stages=4, keys_as_rows=True),
    64: TrainingTileConfig(BK=64, BD=64, num_warps=4, num_stages=3),
    0: TrainingTileConfig(BK=32, BD=64, num_warps=4, num_stages=2),  # <= 32 heads
}
# sparse indexer / KL forward, whole D_i row per tile. H200 bf16, T=4096, H_i=64, D_i=128, K=2048:
# (BK, warps, stages) = (32,4,4) 0.97 ms; (32,4,3) 0.97; (32,4,5) 0.99; (64,4,3) 1.09; (16,4,4) 1.30;
# (64,8,3) 1.62; (128,8,3) 1.92.
# keys_as_rows=True (slots as the MMA's 64 rows, heads as its columns): (64,4,3) and (64,4,4) 0.688 ms
# in the KL forward against 0.976 for heads as rows at (32,4,4) (RESULTS.md C16).
# With the KL sums kept per slot lane (no block-wide reduction inside the loop): 0.458 ms at
# (64,4,3) keys as rows, from 0.678 with the per-block reductions (RESULTS.md C27).
# Logits only, the row's slots split over programs of 1024 / 512 / 256: 0.4153 / 0.4476 / 0.5060 ms
# against 0.4103 for a program a row (RESULTS.md C63): not kept.
INDEXER_FWD_CONFIG = TrainingTileConfig(BK=64, BD=0, num_warps=4, num_stages=3, keys_as_rows=True)


def _pow2(x: int, low: int = 16) -> int:
    return max(low, triton.next_power_of_2(x))


# Where a preferred config does not fit a GPU's shared memory: fewer stages, then fewer slots a block.
_SHRINK = (("num_stages", 1), ("BK", 16))


def target_config(M: int, D: int, K: int) -> TrainingTileConfig:
    """The preferred attention-target tiles for M query heads per kv head (before fitting)."""
    cfg = TARGET_CONFIGS[128 if M > 64 else (64 if M > 32 else 0)]
    return replace(cfg, BK=min(cfg.BK, _pow2(K)), BD=min(cfg.BD, _pow2(D)))


def indexer_fwd_config(D: int, K: int) -> TrainingTileConfig:
    """The preferred sparse-indexer forward tiles (before fitting)."""
    c = INDEXER_FWD_CONFIG
    return replace(c, BK=min(c.BK, _pow2(K)), BD=_pow2(D), q_resident=False)


def target_spec(q_dtype, H: int, G: int, D: int, cfg: TrainingTileConfig, *, has_len: bool = True,
                implicit: bool = False, lse_pass: bool = False) -> fit.KernelSpec:
    el = fit.ptr(q_dtype)
    types = dict(Q=el, KV=el, IDX="*i32", LEN="*i32", BASE="*i32", LSE="*fp32", OUT="*fp32", sm_scale="fp32")
    M = H // G
    const = dict(H=H, G=G, M=M, BM=_pow2(M), D=D, BD=cfg.BD, BK=cfg.BK, HAS_LEN=has_len, IMPLICIT=implicit,
                 LSE_PASS=lse_pass, PREC=input_precision(q_dtype), Q_RESIDENT=cfg.q_resident,
                 KEYS_AS_ROWS=cfg.keys_as_rows)
    return fit.KernelSpec(_target_kernel, types, const, cfg.num_warps, cfg.num_stages)


def indexer_fwd_spec(q_dtype, w_dtype, H: int, D: int, cfg: TrainingTileConfig, *, has_len: bool = True,
                     kl: bool = False) -> fit.KernelSpec:
    el = fit.ptr(q_dtype)
    types = dict(Q=el, Kp=el, W=fit.ptr(w_dtype), IDX="*i32", LEN="*i32", TGT="*fp32", OUT="*fp32", STATS="*fp32",
                 sm_scale="fp32")
    const = dict(H=H, BH=_pow2(H), D=D, BD=cfg.BD, BK=cfg.BK, HAS_LEN=has_len, KL=kl,
                 PREC=input_precision(q_dtype), KEYS_AS_ROWS=cfg.keys_as_rows)
    return fit.KernelSpec(_sparse_indexer_fwd_kernel, types, const, cfg.num_warps, cfg.num_stages)


def pick_target(q: torch.Tensor, H: int, G: int, D: int, K: int,
                target: Optional[fit.Target] = None) -> Tuple[Optional[TrainingTileConfig], str]:
    """The attention-target tiles that fit ``target`` (q's device when None), for the
    target and the dense lse pass alike."""
    base = target_config(H // G, D, K)
    return fit.pick(lambda: fit.shrinking(base, _SHRINK), lambda c: target_spec(q.dtype, H, G, D, c),
                    target or fit.device_target(q), ("attention_target", q.dtype, H, G, D, base))


def pick_indexer_fwd(a, target: Optional[fit.Target] = None) -> Tuple[Optional[TrainingTileConfig], str]:
    """The sparse-indexer forward tiles that fit ``target`` (a's device when None), logits and KL alike."""
    base = indexer_fwd_config(a.q.shape[2], a.K)
    H, D = a.q.shape[1], a.q.shape[2]
    return fit.pick(lambda: fit.shrinking(base, _SHRINK),
                    lambda c: indexer_fwd_spec(a.q.dtype, a.weights.dtype, H, D, c, kl=True),
                    target or fit.device_target(a.q), ("sparse_indexer_fwd", a.q.dtype, a.weights.dtype, H, D, base))


def _fitted(picked: Tuple[Optional[TrainingTileConfig], str]) -> TrainingTileConfig:
    cfg, why = picked
    if cfg is None:
        raise ValueError(why)
    return cfg


# --------------------------------------------------------------------------
# supports


def _dtype_reason(q: torch.Tensor) -> Optional[str]:
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"triton: {str(q.dtype).replace('torch.', '')} inputs are not implemented (use the reference)"
    return None


def _heads_reason(m: int, what: str) -> Optional[str]:
    if m > MAX_HEADS:
        return f"triton: more than {MAX_HEADS} {what} per program is not implemented (got {m})"
    return None


def indexer_reason(q: torch.Tensor, weights: torch.Tensor) -> Optional[str]:
    """Why the Triton indexer-training kernels cannot serve these inputs (None if they can)."""
    why = _dtype_reason(q) or _heads_reason(q.shape[1], "indexer heads")
    if why is None and weights.dtype == torch.float64:
        why = "triton: float64 weights are not implemented (use the reference)"
    if why is None and q.shape[2] > MAX_INDEXER_DIM:
        why = f"triton: an indexer head dim above {MAX_INDEXER_DIM} is not implemented (got {q.shape[2]})"
    return why


def tiles_reason(fn_name: str, args) -> Optional[str]:
    """Why no tiles of ``fn_name`` fit the device (None if some do)."""
    if fn_name in ("attention_target", "dense_attention_target"):
        H, D = args.q.shape[1], args.q.shape[2]
        G = args.G if isinstance(args, SparseAttnArgs) else 1
        K = args.K if isinstance(args, SparseAttnArgs) else args.max_seqlen_k
        return pick_target(args.q, H, G, D, K)[1] or None
    return pick_indexer_fwd(args)[1] or None


def supports(args) -> Optional[str]:
    if isinstance(args, SparseAttnArgs):
        return _dtype_reason(args.q) or _heads_reason(args.H // args.G, "query heads per kv head")
    if isinstance(args, DenseTargetArgs):
        return _dtype_reason(args.q) or _heads_reason(args.q.shape[1], "query heads")
    if isinstance(args, (SparseIndexerArgs, IndexerArgs)):
        return indexer_reason(args.q, args.weights)
    return f"triton: no kernel for {type(args).__name__}"


# --------------------------------------------------------------------------
# host functions


def _launch_target(q, kv, idx, length, base, lse, out, sm_scale, N, K, G, *, has_len, implicit, lse_pass):
    T, H, D = q.shape
    cfg = _fitted(pick_target(q, H, G, D, K))
    spec = target_spec(q.dtype, H, G, D, cfg, has_len=has_len, implicit=implicit, lse_pass=lse_pass)
    _target_kernel[(T, G)](q, kv, idx, length, base, lse, out, sm_scale, N, K, **spec.launch_kwargs())


def attention_target(a: SparseAttnArgs, lse: torch.Tensor) -> torch.Tensor:
    """-> target [T, G, K] fp32; lse [T, H] fp32 from the sparse attention forward."""
    out = torch.zeros(a.T, a.G, a.K, device=a.q.device, dtype=torch.float32)
    length = a.indices if a.topk_length is None else a.topk_length  # any tensor when HAS_LEN is off
    _launch_target(
        a.q, a.kv, a.indices, length, a.indices, lse.float().contiguous(), out, a.sm_scale, a.N, a.K, a.G,
        has_len=a.topk_length is not None, implicit=False, lse_pass=False,
    )
    return out


def dense_attention_target(a: DenseTargetArgs) -> torch.Tensor:
    """-> target [T_q, max_seqlen_k] fp32: an lse pass over the visible keys, then the target pass."""
    Tq, H, _ = a.q.shape
    base, limit = dense_rows(a)
    kv = a.kv.view(a.kv.shape[0], 1, a.kv.shape[1])
    lse = torch.empty(Tq, H, device=a.q.device, dtype=torch.float32)
    out = torch.zeros(Tq, a.max_seqlen_k, device=a.q.device, dtype=torch.float32)
    for lse_pass in (True, False):
        _launch_target(
            a.q, kv, base, limit, base, lse, out, a.sm_scale, kv.shape[0], a.max_seqlen_k, 1,
            has_len=True, implicit=True, lse_pass=lse_pass,
        )
    return out


def _launch_indexer_fwd(a: SparseIndexerArgs, target, out, stats, *, kl: bool) -> None:
    cfg = _fitted(pick_indexer_fwd(a))
    spec = indexer_fwd_spec(a.q.dtype, a.weights.dtype, a.H, a.D, cfg, has_len=a.topk_length is not None, kl=kl)
    length = a.indices if a.topk_length is None else a.topk_length
    _sparse_indexer_fwd_kernel[(a.T,)](
        a.q, a.k, a.weights, a.indices, length, target, out, stats, a.sm_scale, a.N, a.K, **spec.launch_kwargs(),
    )


def sparse_indexer_fwd(a: SparseIndexerArgs) -> torch.Tensor:
    """-> logits [T, K] fp32, -inf on invalid slots (the kernel writes every slot)."""
    out = torch.empty((a.T, a.K), device=a.q.device, dtype=torch.float32)
    _launch_indexer_fwd(a, out, out, out, kl=False)
    return out


def kl_stats_of_logits(a: SparseIndexerArgs, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """indexer_kl_fwd's stats [T, 4] fp32 from the logits [T, K] fp32 of a's
    ``sparse_indexer_fwd`` (one pass over them and the target)."""
    stats = torch.empty(a.T, 4, device=logits.device, dtype=torch.float32)
    length = a.indices if a.topk_length is None else a.topk_length
    BK = min(1024, triton.next_power_of_2(max(a.K, 16)))
    _kl_stats_kernel[(a.T,)](logits.contiguous(), a.indices, length, target.float().contiguous(), stats, a.N, a.K,
                             BK=BK, HAS_LEN=a.topk_length is not None, num_warps=4)
    return stats


def indexer_kl_fwd(a: SparseIndexerArgs, target: torch.Tensor) -> torch.Tensor:
    """-> stats [T, 4] fp32 (loss_t, lse of the logits, sum of valid target, has a valid slot)."""
    stats = torch.empty(a.T, 4, device=a.q.device, dtype=torch.float32)
    _launch_indexer_fwd(a, target.float().contiguous(), stats, stats, kl=True)
    return stats
