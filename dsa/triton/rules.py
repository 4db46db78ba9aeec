"""The contract's rules in Triton device code, stated once for every Triton kernel.

``dsa/_rules.py`` states them for host code; these are their device forms:

* the row length: ``clamp(topk_length[t], 0, K)``, or K without topk_length;
* slot validity: slot j of a row is valid iff ``j < row length`` and
  ``0 <= index < N``. Every gather is masked with it, so an invalid slot is
  never read (NaN in unreferenced rows cannot leak, and an index like
  2**31 - 1 cannot fault);
* paged slots (``decode_slots``): an index is a cache slot page * PS +
  offset, or with a block table a position the table turns into one; a
  position past seq_lens or a page outside [0, P) is an invalid slot;
* the sink fold (``sink_factor``): exp(lse) / (exp(lse) + exp(sink)), 0 on a
  row with no valid slot;
* the FP8 cache values (dsa/kv_cache.py): e4m3 and e8m0 bytes and bf16 bits
  decoded exactly, without the hardware's fp8 types where it has none;
* the online-softmax step in the log2 domain (scores pre-multiplied by
  ``LOG2E``), with a row that has seen no valid slot kept at max = -inf;
* the dot products' input precision (:func:`input_precision`, the constexpr
  ``PREC`` of every kernel): full fp32 for fp32 inputs, the tensor cores'
  default for 16-bit inputs (which ignore it).

All helpers are ``@triton.jit`` functions; Triton inlines them, so a kernel
compiles to the same code as with the rule written out in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsa import _rules

LOG2E = tl.constexpr(_rules.LOG2E)
LN2 = tl.constexpr(0.6931471805599453)


def input_precision(dtype: torch.dtype) -> str:
    """The kernels' ``PREC``: fp32 is computed in full fp32 (the contract, and
    the interpreter tests are tight), not TF32; 16-bit inputs ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def row_length(p_len, t, K, HAS_LEN: tl.constexpr):
    """clamp(topk_length[t], 0, K), or K without topk_length."""
    if HAS_LEN:
        L = tl.minimum(tl.maximum(tl.load(p_len + t), 0), K)
    else:
        L = K
    return L


@triton.jit
def index_valid(idx, in_row, N):
    """Slot validity from the loaded indices and ``slot < row length``."""
    return in_row & (idx >= 0) & (idx < N)


@triton.jit
def load_slots(IDX, row, K, start, L, N, BN: tl.constexpr):
    """Slots [start, start + BN) of row ``row`` of the [*, K] indices at IDX
    (row length L; row = K = 0 when IDX already points at the row).

    Returns (o_n [BN] slot numbers, m_n [BN] slot < L, idx [BN] as loaded
    (-1 past L), valid [BN])."""
    o_n = start + tl.arange(0, BN)
    m_n = o_n < L
    idx = tl.load(IDX + row * K + o_n, mask=m_n, other=-1)
    return o_n, m_n, idx, index_valid(idx, m_n, N)


@triton.jit
def slot_block(p_idx, start, L, N, BN: tl.constexpr):
    """Indices and validity of slots [start, start + BN) of the row at p_idx.

    Returns (idx [BN] int64 with invalid slots set to 0, valid [BN] bool)."""
    o_n, m_n, idx, valid = load_slots(p_idx, 0, 0, start, L, N, BN)
    idx = tl.where(valid, idx, 0).to(tl.int64)
    return idx, valid


@triton.jit
def slot_rows(IDX, row, K, base, start, L, N, BN: tl.constexpr, IMPLICIT: tl.constexpr):
    """Rows gathered by slots [start, start + BN) of row ``row``: the indices'
    rows, or with IMPLICIT the keys base + j of a dense row (valid iff j < L).

    Returns (o_n, m_n, rows [BN] int64 (unmasked: read only where valid), valid)."""
    if IMPLICIT:
        o_n = start + tl.arange(0, BN)
        m_n = o_n < L
        rows = base + o_n
        valid = m_n
    else:
        o_n, m_n, idx, valid = load_slots(IDX, row, K, start, L, N, BN)
        rows = idx.to(tl.int64)
    return o_n, m_n, rows, valid


@triton.jit
def decode_slots(idx, in_row, p_bt, seq_len, N, P, PS: tl.constexpr, HAS_BT: tl.constexpr,
                 HAS_SEQLEN: tl.constexpr):
    """Cache pages and offsets of loaded decode indices (dsa._rules.decode_slots).

    idx [BN] as loaded, in_row [BN] slot < row length, p_bt the row's
    block-table row (HAS_BT), seq_len its sequence length (HAS_SEQLEN), N
    the addressable slots (W * PS with a block table, else P * PS). Returns
    (page [BN] int64, offset [BN] int64, valid [BN]); page and offset are 0
    where invalid, so the addresses they make are always in range."""
    valid = index_valid(idx, in_row, N)
    if HAS_SEQLEN:
        valid = valid & (idx < seq_len)
    pos = tl.where(valid, idx, 0)
    if HAS_BT:
        page = tl.load(p_bt + pos // PS, mask=valid, other=-1)
        valid = valid & (page >= 0) & (page < P)
        page = tl.where(valid, page, 0)
    else:
        page = pos // PS
    off = tl.where(valid, pos % PS, 0)
    return page.to(tl.int64), off.to(tl.int64), valid


@triton.jit
def sink_factor(lse2, p_sink, head, m_h, HAS_SINK: tl.constexpr):
    """exp(lse) / (exp(lse) + exp(sink[head])) per row from the log2-domain
    lse2 (-inf on a row with no valid slot, which gets 0): 1 without a sink or
    with sink = -inf, 0 with sink = +inf or one whose exponential overflows;
    NaN in lse2 or the sink stays NaN."""
    empty = lse2 == float("-inf")
    if HAS_SINK:
        s2 = tl.load(p_sink + head, mask=m_h, other=float("-inf")) * LOG2E
        f = 1.0 / (1.0 + tl.exp2(s2 - tl.where(empty, 0.0, lse2)))
    else:
        f = tl.full(lse2.shape, 1.0, tl.float32)
    return tl.where(empty, 0.0, f)


@triton.jit
def e4m3_to(b, DT: tl.constexpr, HW_FP8: tl.constexpr):
    """E4M3FN bytes (uint8) as DT, exactly (0x7F / 0xFF are NaN). HW_FP8 uses
    the hardware conversion (sm_89+); otherwise the bits are placed in an
    fp16 (exponent bias 15 against 7, so times 2**8), subnormals included."""
    if HW_FP8:
        v = b.to(tl.float8e4nv, bitcast=True).to(DT)
    else:
        u = b.to(tl.uint16)
        h = (((u & 0x7F) << 7) | ((u & 0x80) << 8)).to(tl.float16, bitcast=True) * 256.0
        v = tl.where((u & 0x7F) == 0x7F, float("nan"), h.to(tl.float32)).to(DT)
    return v


@triton.jit
def e8m0_to_f32(b):
    """E8M0 scale bytes (uint8): 2**(b - 127), NaN for 255 (b = 0 is 2**-127, an fp32 subnormal)."""
    v = (b.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    v = tl.where(b == 0, 5.877471754111438e-39, v)
    return tl.where(b == 255, float("nan"), v)


@triton.jit
def bf16_bits_to(bits, DT: tl.constexpr):
    """bf16 values stored as uint16 bits, as DT (exact for bf16 and fp32)."""
    if DT == tl.bfloat16:
        v = bits.to(tl.bfloat16, bitcast=True)
    else:
        v = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True).to(DT)
    return v


@triton.jit
def online_softmax_step(b_s, b_m, b_l, AXIS: tl.constexpr):
    """One block of the online softmax along AXIS, log2 domain.

    b_s: the block's scores (times LOG2E; -inf on invalid slots), b_m / b_l:
    the running max and sum of exp2. Returns (m_new, l_new, p = exp2(s -
    m_new), alpha = exp2(m_old - m_new)). A row that has seen no valid slot
    keeps m = -inf and is shifted by 0, so no (-inf) - (-inf) appears."""
    m_new = tl.maximum(b_m, tl.max(b_s, AXIS))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(b_m - m_use)
    p = tl.exp2(b_s - tl.expand_dims(m_use, AXIS))
    l_new = b_l * alpha + tl.sum(p, AXIS)
    return m_new, l_new, p, alpha
