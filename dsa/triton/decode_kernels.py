"""Sparse decode kernels (Triton): split-K over the top-k slots, and the lse-weighted merge.

For query row t, head h (kv head g), the valid slots j of (t, g) address
cache rows k_j (paged, through a block table or not; FP8 rows dequantised):

    s_j = sm_scale * q[t, h] . k_j,   out = sum_j softmax(s)_j * k_j[:d_v] * sink factor

``sparse_decode_kernel`` runs one program per (row, kv head, block of BH
heads, split). A split covers the slots [split * CHUNK, (split + 1) * CHUNK)
of the row (stopping at its length), so a decode step of a few rows still
fills the GPU. With one split the program finishes the row (sink fold, lse);
with several it writes its normalised partial output and its log2-domain
partial lse (-inf when it saw no valid slot, its output then left unwritten),
and ``decode_combine_kernel`` merges the parts:

    lse = log2 sum_s 2**lse_s,   out = sum_s 2**(lse_s - lse) * out_s * sink factor

FP8 rows: a chunk of columns is one scale tile (128 NoPE values in V3.2, 64
in MODEL1) or the bf16 RoPE part. The e4m3 bytes convert exactly to the dot
dtype and the per-(slot, tile) scale is applied to the [heads, slots] tiles
instead of the [slots, columns] one: scores as ``dot(q_c, k8_c) * scale_c``
and values as ``dot(p * scale_c, k8_c)``, exact for power-of-two scales in
bf16 / fp32. fp16 has too little range for that (p * 2**-13 underflows), so
with DEQ_TILE the tile itself is dequantised in fp32 and rounded to fp16.
The per-chunk layout (KIND, SRC, SC_OFF, SCALED) comes from the host, which
reads it from dsa.kv_cache's format table.

Validity (dsa/triton/rules.py): every gather is masked, so an invalid slot
is never read; page and row offsets are int64.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsa.triton.rules import (
    LN2,
    bf16_bits_to,
    decode_slots,
    e4m3_to,
    e8m0_to_f32,
    online_softmax_step,
    row_length,
    sink_factor,
)
from dsa.triton.sparse_attention_common import load_chunks, store_chunks

# KIND of a column chunk (plain ints for the host, constexprs for the kernels)
KIND_NATIVE, KIND_E4M3, KIND_BF16 = 0, 1, 2  # q's dtype as is; FP8 NoPE values of one scale tile; bf16 RoPE bits
_NATIVE = tl.constexpr(KIND_NATIVE)
_E4M3 = tl.constexpr(KIND_E4M3)


@triton.jit
def kv_tiles(p_rows, p_scales, valid, WS: tl.constexpr, KIND: tl.constexpr, SRC: tl.constexpr,
             SC_OFF: tl.constexpr, SC_FP32: tl.constexpr, DEQ_TILE: tl.constexpr, DT: tl.constexpr,
             HW_FP8: tl.constexpr, BN: tl.constexpr):
    """The gathered rows' column chunks and their scales.

    p_rows [BN]: each slot's row (elements for a native cache, bytes for
    FP8); p_scales [BN]: its scale record (bytes). Chunk c starts SRC[c]
    elements / bytes into the row. Returns (tiles: [BN, WS[c]] in DT, scales:
    [BN] fp32, 1 where the chunk has no scale or DEQ_TILE applied it); invalid
    slots read as 0 and are not loaded."""
    tiles = ()
    scales = ()
    for c in tl.static_range(len(WS)):
        o_c = SRC[c] + tl.arange(0, WS[c])
        sc = tl.full([BN], 1.0, tl.float32)
        if KIND[c] == _NATIVE:
            tile = tl.load(p_rows[:, None] + o_c[None, :], mask=valid[:, None], other=0.0)
        elif KIND[c] == _E4M3:
            b = tl.load(p_rows[:, None] + o_c[None, :], mask=valid[:, None], other=0)
            if SC_FP32:
                sc = tl.load((p_scales + SC_OFF[c]).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
            else:
                sc = e8m0_to_f32(tl.load(p_scales + SC_OFF[c], mask=valid, other=127))
            if DEQ_TILE:
                tile = (e4m3_to(b, tl.float32, HW_FP8) * sc[:, None]).to(DT)
                sc = tl.full([BN], 1.0, tl.float32)
            else:
                tile = e4m3_to(b, DT, HW_FP8)
        else:
            p16 = p_rows.to(tl.pointer_type(tl.uint16))  # SRC[c] counts bf16 values here
            bits = tl.load(p16[:, None] + o_c[None, :], mask=valid[:, None], other=0)
            tile = bf16_bits_to(bits, DT)
        tiles = tiles + (tile,)
        scales = scales + (sc,)
    return tiles, scales


@triton.jit
def scaled_scores(b_qs, b_ks, b_scs, SCALED: tl.constexpr, PREC: tl.constexpr):
    """sum_c dot(q_c, k_c^T) (* scale_c per slot where SCALED[c]): [BH, BN] fp32."""
    b_s = tl.dot(b_qs[0], tl.trans(b_ks[0]), input_precision=PREC)
    if SCALED[0]:
        b_s = b_s * b_scs[0][None, :]
    for c in tl.static_range(1, len(SCALED)):
        if SCALED[c]:
            b_s = b_s + tl.dot(b_qs[c], tl.trans(b_ks[c]), input_precision=PREC) * b_scs[c][None, :]
        else:
            b_s = tl.dot(b_qs[c], tl.trans(b_ks[c]), b_s, input_precision=PREC)
    return b_s


@triton.jit
def sparse_decode_kernel(
    q_ptr, kv_ptr, idx_ptr, len_ptr, bt_ptr, seqlen_ptr, sink_ptr, out_ptr, lse_ptr,
    N, P, K, CHUNK, LEN_DIV, ROWS_PER_SEQ, BT_W, PAGE_STRIDE, qk_scale,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, D_V: tl.constexpr,
    OFFS: tl.constexpr, WS: tl.constexpr, NV: tl.constexpr,
    KIND: tl.constexpr, SRC: tl.constexpr, SC_OFF: tl.constexpr, SCALED: tl.constexpr,
    SC_FP32: tl.constexpr, PS: tl.constexpr, TOK: tl.constexpr, SC_BASE: tl.constexpr, SC_TOK: tl.constexpr,
    DEQ_TILE: tl.constexpr, HW_FP8: tl.constexpr,
    BH: tl.constexpr, BN: tl.constexpr,
    HAS_LEN: tl.constexpr, HAS_BT: tl.constexpr, HAS_SEQLEN: tl.constexpr, HAS_SINK: tl.constexpr,
    SPLIT: tl.constexpr, PREC: tl.constexpr,
):
    HG: tl.constexpr = H // G
    NC: tl.constexpr = len(WS)
    pid = tl.program_id(0)  # t * G + g
    t = pid // G
    g = pid % G
    split = tl.program_id(2)
    o_h = tl.program_id(1) * BH + tl.arange(0, BH)
    m_h = o_h < HG
    head = g * HG + o_h
    DT = q_ptr.dtype.element_ty

    b_qs = load_chunks(q_ptr + (t.to(tl.int64) * H + head) * D, m_h, OFFS, WS, 0, NC)
    L = row_length(len_ptr, t // LEN_DIV, K, HAS_LEN)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, L)
    seq = t // ROWS_PER_SEQ
    p_bt = bt_ptr  # the row's block-table row (bt_ptr is None without one)
    if HAS_BT:
        p_bt = bt_ptr + seq.to(tl.int64) * BT_W
    seq_len = 0
    if HAS_SEQLEN:
        seq_len = tl.load(seqlen_ptr + seq)
    p_idx = idx_ptr + pid.to(tl.int64) * K

    b_m = tl.full([BH], float("-inf"), tl.float32)
    b_l = tl.zeros([BH], tl.float32)
    b_os = ()
    for c in tl.static_range(NV):
        b_os = b_os + (tl.zeros(b_qs[c].shape, tl.float32),)

    for start in range(lo, hi, BN):
        o_n = start + tl.arange(0, BN)
        m_n = o_n < hi
        idx = tl.load(p_idx + o_n, mask=m_n, other=-1)
        page, off, valid = decode_slots(idx, m_n, p_bt, seq_len, N, P, PS, HAS_BT, HAS_SEQLEN)
        p_page = kv_ptr + page * PAGE_STRIDE
        # [BN, w] gathers of the slots' rows (and their scales); invalid slots are never read
        b_ks, b_scs = kv_tiles(p_page + off * TOK + g * D, p_page + SC_BASE + off * SC_TOK, valid, WS, KIND, SRC,
                               SC_OFF, SC_FP32, DEQ_TILE, DT, HW_FP8, BN)
        b_s = scaled_scores(b_qs, b_ks, b_scs, SCALED, PREC)  # [BH, BN]
        b_s = tl.where(valid[None, :], b_s * qk_scale, float("-inf"))
        b_m, b_l, b_p, b_alpha = online_softmax_step(b_s, b_m, b_l, 1)
        b_pc = b_p.to(DT)
        new = ()
        for c in tl.static_range(NV):
            if SCALED[c]:
                b_pv = (b_p * b_scs[c][None, :]).to(DT)
            else:
                b_pv = b_pc
            new = new + (tl.dot(b_pv, b_ks[c], b_os[c] * b_alpha[:, None], input_precision=PREC),)
        b_os = new

    # log2-domain lse of the slots seen, -inf when none was valid
    b_lse2 = tl.where(b_l == 0.0, float("-inf"), b_m + tl.log2(tl.where(b_l == 0.0, 1.0, b_l)))
    b_inv = tl.where(b_l == 0.0, 0.0, 1.0 / b_l)
    if SPLIT:
        n_split = tl.num_programs(2)
        row = (t.to(tl.int64) * H + head) * n_split + split
        b_parts = ()
        for c in tl.static_range(NV):
            b_parts = b_parts + (b_os[c] * b_inv[:, None],)
        store_chunks(out_ptr + row * D_V, m_h & (b_l != 0.0), b_parts, OFFS, WS, 0, NV)
        tl.store(lse_ptr + row, b_lse2, mask=m_h)
    else:
        b_f = b_inv * sink_factor(b_lse2, sink_ptr, head, m_h, HAS_SINK)
        b_outs = ()
        for c in tl.static_range(NV):
            b_outs = b_outs + ((b_os[c] * b_f[:, None]).to(out_ptr.dtype.element_ty),)
        store_chunks(out_ptr + (t.to(tl.int64) * H + head) * D_V, m_h, b_outs, OFFS, WS, 0, NV)
        tl.store(lse_ptr + t.to(tl.int64) * H + head, tl.where(b_lse2 == float("-inf"), float("inf"), b_lse2 * LN2),
                 mask=m_h)


@triton.jit
def decode_combine_kernel(
    part_out_ptr, part_lse_ptr, sink_ptr, out_ptr, lse_ptr, n_split,
    H: tl.constexpr, D_V: tl.constexpr, BHC: tl.constexpr, BV: tl.constexpr, S_P2: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    """out[t, h, columns of block v] and lse[t, h] from the n_split parts of
    (t, h): parts [T, H, n_split, D_V] fp32 (normalised, unwritten where the
    part's lse is -inf) and their log2 lse [T, H, n_split]."""
    t = tl.program_id(0)
    o_h = tl.program_id(1) * BHC + tl.arange(0, BHC)
    m_h = o_h < H
    o_v = tl.program_id(2) * BV + tl.arange(0, BV)
    m_v = o_v < D_V
    o_s = tl.arange(0, S_P2)
    rows = (t.to(tl.int64) * H + o_h) * n_split  # [BHC]: each head's first part
    b_lse = tl.load(part_lse_ptr + rows[:, None] + o_s[None, :], mask=m_h[:, None] & (o_s < n_split)[None, :],
                    other=float("-inf"))  # [BHC, S_P2]
    b_m = tl.max(b_lse, 1)
    b_m_use = tl.where(b_m == float("-inf"), 0.0, b_m)
    b_l = tl.sum(tl.exp2(b_lse - b_m_use[:, None]), 1)  # NaN when a part is NaN
    b_acc = tl.zeros([BHC, BV], tl.float32)
    for s in range(n_split):
        b_lse_s = tl.load(part_lse_ptr + rows + s, mask=m_h, other=float("-inf"))
        b_w = tl.exp2(b_lse_s - b_m_use)
        b_o = tl.load(part_out_ptr + (rows + s)[:, None] * D_V + o_v[None, :],
                      mask=(m_h & (b_lse_s != float("-inf")))[:, None] & m_v[None, :], other=0.0)
        b_acc += b_w[:, None] * b_o
    b_lse2 = tl.where(b_l == 0.0, float("-inf"), b_m_use + tl.log2(tl.where(b_l == 0.0, 1.0, b_l)))
    b_f = tl.where(b_l == 0.0, 0.0, 1.0 / b_l) * sink_factor(b_lse2, sink_ptr, o_h, m_h, HAS_SINK)
    p_out = out_ptr + (t.to(tl.int64) * H + o_h)[:, None] * D_V + o_v[None, :]
    tl.store(p_out, (b_acc * b_f[:, None]).to(out_ptr.dtype.element_ty), mask=m_h[:, None] & m_v[None, :])
    if tl.program_id(2) == 0:
        tl.store(lse_ptr + t.to(tl.int64) * H + o_h,
                 tl.where(b_lse2 == float("-inf"), float("inf"), b_lse2 * LN2), mask=m_h)
