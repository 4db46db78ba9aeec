"""Triton top-k over the last dim of a [R, S] score matrix.

For each row r: the positions of the k largest scores, where NaN and -inf are
never selected (+inf is, as the largest), ties at the cut go to the smaller
position; the row of the output lists the selected positions in ascending
position order, then -1 up to k. ``lengths[r]`` counts the selected entries.

Method: every score becomes a uint32 *order key* (the fp32 bit pattern mapped
so that unsigned order is value order, -0.0 folded onto +0.0, NaN and -inf
mapped to 0, below every selectable value). The k-th largest key ``thr`` is
found exactly, then one prefix scan emits, in position order, every key
``> thr`` and the first ``k - count(> thr)`` keys ``== thr``.

* Resident kernel (S <= RESIDENT_MAX): one program per row holds the whole
  row in registers (read from memory once) and finds ``thr`` by a bisection
  on the key bits, MSB first, each step one compare and one block reduction;
  it stops as soon as exactly k keys are >= thr (about log2(S) + a few steps
  on distinct scores, 32 at most). Rows with at most k selectable keys skip
  the bisection.
* Streaming kernel (longer rows): the row is read in chunks, ``thr`` comes
  from a 4-pass radix select (8-bit digits, 256-bin histograms), and the emit
  pass walks the chunks in order with running counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from dsa._args import TopkArgs

# Longest row held in registers (BLOCK_S = next_pow2(S)); beyond this the
# streaming kernel runs. 32768 spills registers even at 16 warps (ptxas,
# sm_90a). The packed 16-bit counters of the scans need BLOCK_S <= 32768.
RESIDENT_MAX = 16384
STREAM_CHUNK = 4096
_FILL_BLOCK = 1024


# --------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------


@triton.jit
def _order_key(x):
    """fp32 [N] -> uint32 keys, unsigned order == value order; NaN, -inf -> 0."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with +0.0
    bits = x.to(tl.int32, bitcast=True)
    # Negative floats: flip the 31 magnitude bits (reverses their order); then
    # flip the sign bit so that the signed order becomes the unsigned order.
    signed = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = signed.to(tl.uint32, bitcast=True) ^ 0x80000000
    valid = (x == x) & (x != float("-inf"))
    return tl.where(valid, key, tl.zeros_like(key))


@triton.jit
def _emit_block(idx_row_ptr, key, pos, m, thr, need, gt_run, eq_run):
    """Store the selected positions of one block; return the block's counts.

    Selected: key > thr, or key == thr among the first ``need`` such keys of
    the row (``eq_run`` of them lie in earlier blocks). The output slot is the
    number of selected keys before it. Both prefix counts come out of one
    scan: gt in the low 16 bits, eq in the high 16 (a block is < 2^15 long).
    """
    gt = (key > thr) & m
    eq = (key == thr) & m & (need > 0)
    packed = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
    excl = tl.cumsum(packed, axis=0) - packed
    gt_before = gt_run + (excl & 0xFFFF)
    eq_before = eq_run + (excl >> 16)
    sel = gt | (eq & (eq_before < need))
    slot = gt_before + tl.minimum(eq_before, need)
    tl.store(idx_row_ptr + slot, pos, mask=sel)
    return tl.sum(gt.to(tl.int32), axis=0), tl.sum(eq.to(tl.int32), axis=0)


@triton.jit
def _pad_row(idx_row_ptr, length, K, BLOCK: tl.constexpr):
    """idx_row[length:K] = -1."""
    for j0 in range((length // BLOCK) * BLOCK, K, BLOCK):
        o_j = j0 + tl.arange(0, BLOCK)
        tl.store(idx_row_ptr + o_j, tl.full([BLOCK], -1, tl.int32), mask=(o_j >= length) & (o_j < K))


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------


@triton.jit
def _topk_resident_kernel(
    s_ptr, idx_ptr, len_ptr, S, K, stride_s, stride_i,
    BLOCK_S: tl.constexpr, FILL: tl.constexpr, EARLY_EXIT: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < S
    b_x = tl.load(s_ptr + r * stride_s + o_s, mask=m_s, other=float("-inf")).to(tl.float32)
    b_key = _order_key(b_x)  # [BLOCK_S]
    n_valid = tl.sum((b_key != 0).to(tl.int32), axis=0)

    thr = tl.zeros([], tl.uint32)
    need = tl.zeros([], tl.int32)
    if n_valid > K:  # else every valid key is taken (rows of early causal queries)
        if EARLY_EXIT:
            # The same bisection, stopped once exactly K keys are >= thr: that
            # set is the top K, ties included whole (distinct scores get there
            # after about log2(S) + a few bits instead of 32).
            bit = 31
            cnt = n_valid
            while (bit >= 0) & (cnt != K):
                cand = thr | (tl.full([], 1, tl.uint32) << bit)
                cnt = tl.sum((b_key >= cand).to(tl.int32), axis=0)
                thr = tl.where(cnt >= K, cand, thr)
                bit -= 1
        else:
            # Largest thr with count(key >= thr) >= K, one bit at a time, MSB first.
            for bit in range(31, -1, -1):
                cand = thr | (tl.full([], 1, tl.uint32) << bit)
                cnt = tl.sum((b_key >= cand).to(tl.int32), axis=0)
                thr = tl.where(cnt >= K, cand, thr)
        need = K - tl.sum((b_key > thr).to(tl.int32), axis=0)
    # thr == 0 when every valid key is taken: "key > 0" is exactly "valid".

    idx_row = idx_ptr + r * stride_i
    n_gt, n_eq = _emit_block(idx_row, b_key, o_s, m_s, thr, need, 0, 0)
    length = n_gt + tl.minimum(n_eq, need)
    tl.store(len_ptr + r, length)
    _pad_row(idx_row, length, K, FILL)


@triton.jit
def _topk_stream_kernel(
    s_ptr, idx_ptr, len_ptr, S, K, stride_s, stride_i,
    CHUNK: tl.constexpr, FILL: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + r * stride_s
    o_c = tl.arange(0, CHUNK)
    o_bin = tl.arange(0, 256)

    # Radix select, 8 bits a pass from the top: prefix holds the digits of thr
    # found so far, rem the rank of thr among the keys matching that prefix.
    prefix = tl.zeros([], tl.uint32)
    rem = K
    n_valid = 0
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], tl.int32)
        for c0 in range(0, S, CHUNK):
            m = (c0 + o_c) < S
            key = _order_key(tl.load(s_row + c0 + o_c, mask=m, other=float("-inf")).to(tl.float32))
            match = m & (key != 0)
            if p > 0:
                match = match & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
            digit = ((key >> shift) & 0xFF).to(tl.int32)
            hist += tl.histogram(digit, 256, mask=match)
        if p == 0:
            n_valid = tl.sum(hist, axis=0)
        # count of matching keys with digit >= d, for every d
        ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        d_sel = tl.max(tl.where(ge >= rem, o_bin, -1), axis=0)
        above = tl.sum(tl.where(o_bin > d_sel, hist, 0), axis=0)
        rem = rem - above
        prefix = prefix | (d_sel.to(tl.uint32) << shift)
    thr = tl.where(n_valid > K, prefix, tl.zeros([], tl.uint32))
    need = tl.where(n_valid > K, rem, 0)

    idx_row = idx_ptr + r * stride_i
    gt_run = tl.zeros([], tl.int32)
    eq_run = tl.zeros([], tl.int32)
    for c0 in range(0, S, CHUNK):
        m = (c0 + o_c) < S
        key = _order_key(tl.load(s_row + c0 + o_c, mask=m, other=float("-inf")).to(tl.float32))
        n_gt, n_eq = _emit_block(idx_row, key, c0 + o_c, m, thr, need, gt_run, eq_run)
        gt_run += n_gt
        eq_run += n_eq
    length = gt_run + tl.minimum(eq_run, need)
    tl.store(len_ptr + r, length)
    _pad_row(idx_row, length, K, FILL)


# --------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ResidentConfig:
    num_warps: int
    # H200, fp32, k=2048 (bench/tune_topk.py): 4096x4096 0.189 -> 0.122 ms,
    # 4096x16384 0.949 -> 0.721 ms; same results, ties included
    early_exit: bool = True


def _resident_config(block_s: int) -> ResidentConfig:
    # H200, fp32 rows, k=2048, 4096 rows (bench/tune_topk.py, early exit):
    # 4 warps at 4096 keys (0.122 ms; 8 warps 0.133), 16 warps at 16384
    # (0.721 ms; 8 warps 0.789). Without early exit (bench/notes_indexer.md)
    # the same choice held: 0.19 / 0.22 / 0.25 ms at 4/8/16 warps, 0.94 / 1.00
    # / 0.95 ms at 16/8/32.
    return ResidentConfig(num_warps=max(4, min(16, block_s // 1024)))


def supports(a: TopkArgs) -> Optional[str]:
    s = a.scores
    if s.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"triton top-k takes fp32/fp16/bf16 scores, got {s.dtype}"
    if s.dim() != 2:
        return f"triton top-k takes a 2-D score matrix, got {s.dim()} dims"
    if s.shape[1] >= 2**31 or a.k >= 2**31:
        return "triton top-k: row length and k must fit in int32"
    return None


def launch(scores: torch.Tensor, k: int, indices: torch.Tensor, lengths: torch.Tensor,
           resident_max: int = RESIDENT_MAX, chunk: int = STREAM_CHUNK,
           config: Optional[ResidentConfig] = None) -> None:
    """Top-k of each row of ``scores`` [R, S] into ``indices`` [R, k] and
    ``lengths`` [R] (both int32, rows unit-stride in the last dim). The
    keywords override the kernel choice (tests and tuning)."""
    R, S = scores.shape
    if S <= resident_max:
        block_s = max(16, triton.next_power_of_2(S))
        cfg = config or _resident_config(block_s)
        _topk_resident_kernel[(R,)](
            scores, indices, lengths, S, k, scores.stride(0), indices.stride(0),
            BLOCK_S=block_s, FILL=_FILL_BLOCK, EARLY_EXIT=cfg.early_exit, num_warps=cfg.num_warps,
        )
    else:
        _topk_stream_kernel[(R,)](
            scores, indices, lengths, S, k, scores.stride(0), indices.stride(0),
            CHUNK=chunk, FILL=_FILL_BLOCK, num_warps=8,
        )


def topk(a: TopkArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    """scores [R, S] -> (indices [R, k] int32, lengths [R] int32)."""
    R = a.scores.shape[0]
    indices = torch.empty((R, a.k), dtype=torch.int32, device=a.scores.device)
    lengths = torch.empty((R,), dtype=torch.int32, device=a.scores.device)
    launch(a.scores, a.k, indices, lengths)
    return indices, lengths
