"""The contract's rules in Triton device code, stated once for every Triton kernel.

``dsa/_rules.py`` states them for host code; these are their device forms:

* the row length: ``clamp(topk_length[t], 0, K)``, or K without topk_length;
* slot validity: slot j of a row is valid iff ``j < row length`` and
  ``0 <= index < N``. Every gather is masked with it, so an invalid slot is
  never read (NaN in unreferenced rows cannot leak, and an index like
  2**31 - 1 cannot fault);
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
