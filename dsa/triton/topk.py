"""Triton top-k over the last dim of a [R, S] score matrix.

For each row r: the positions of the k largest scores, where NaN and -inf are
never selected (+inf is, as the largest), ties at the cut go to the smaller
position; the row of the output lists the selected positions in ascending
position order, then -1 up to k. ``lengths[r]`` counts the selected entries.

Method: every score becomes a uint32 *order key* (the fp32 bit pattern mapped
so that unsigned order is value order, -0.0 folded onto +0.0, NaN and -inf
mapped to 0, below every selectable value). The k-th largest key ``thr`` is
found exactly, then one prefix scan emits, in position order, every key
``> thr`` and the first ``k - count(> thr)`` keys ``== thr`` (a scan of one
flag when the cut splits no tie, the usual case: see ``_emit_gt``). The
stores keep the load's layout (``dsa.triton.ptx``).

* Resident kernel (S <= RESIDENT_MAX): one program per row holds the row in
  registers (read once) and finds ``thr`` with the search of
  ``ResidentConfig.search``; a round is one block-wide reduction (its
  barriers and shuffles are the cost). All keep ``count(key >= lo) >= k >
  count(key >= hi)`` and stop once exactly k keys are >= a candidate (the
  top k, a tie at the cut whole); rows of at most k selectable keys skip it.

  - ``bisect``: a key bit a round, MSB first (about log2(S) + a few rounds).
  - ``radix``: ``radix_bits`` bits a round, the 2^b - 1 candidate digits in
    one packed reduction; 16-bit inputs stop at their last key bit.
  - ``interp``: two candidates a round in one packed reduction, placed by a
    model of the values: a normal fit (sums reduced with the valid count) in
    round 1, then interpolation between the bracket ends or a secant through
    the last two points, aiming at counts k +- a shrinking spread. A round
    that does not halve the bracket brings a snap (both ends onto the
    nearest keys inside: a tied cut ends there), then a split in thirds, so
    the rounds stay bounded: about 4 on randn rows of 4096 / 16384 keys
    instead of 12 / 20.
  - ``guess``: interp's first round, then thirds of the key range.

  ``vec_load=False``: the kernel without the vectorized row load.
* List path (rows of at least LIST_MIN keys, k well below S): the build
  kernel takes the rank-r key ``lo`` of a sample of the row (1/16 of it, at
  most 4096 scores in runs of 8; r puts count(key >= lo) below k only 5
  binomial spreads out), then one read of the row appends every score with
  key >= lo, and its position, to the row's list. The list holds every key
  >= the k-th largest in position order: the resident search and emit on it
  give the row's result. The build does that itself for lists of at most
  the select block (``inline_select``: the list is read back from L2 and the
  search overlaps other programs' row reads on the SM; the select kernel
  takes only longer lists); it takes a batch's rows last first (causal rows
  grow with the index: the long ones start first) and on sm_90+ asks L2 for
  the chunks ``prefetch`` ahead of its loads (bytes in flight that hold no
  registers). Rows the bound missed run the streaming select in the
  fallback kernel, so the result never depends on the sample. H200, fp32
  randn, k 2048, before the inline select and the prefetch: 8192x32768
  0.73 ms, 65536^2 causal 8.3 ms (streaming: 5.1, 82 ms).
* Row ends (``launch(..., ends=)``, the fused indexer's causal windows):
  row r is read only up to ends[r], the rest counting as -inf; the list
  build then spreads its sample over [0, ends[r]) and sets the rank for that
  length (rows up to the select block are taken whole).
* Streaming kernel (other long rows, and the fallback): chunks of the row,
  ``thr`` from a 4-pass radix select (8-bit digits, 256-bin histograms),
  then an emit pass over the chunks in order with running counters.

The first of these that fits the device runs (``pick``, ``dsa.triton.fit``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import triton
import triton.language as tl

from dsa._args import TopkArgs
from dsa.triton import fit, ptx


def _env_set_flag(name: str) -> Optional[bool]:
    """None when the variable is unset (the setting follows the row length),
    else whether it is other than "0"."""
    v = os.environ.get(name)
    return None if v is None else v != "0"


def _env_pow2(name: str, default: Optional[int], zero: bool = False) -> Optional[int]:
    """A power of two from the environment (0 too where ``zero``): sample
    sizes are block shapes and warp counts powers of two.  Unset: the
    default (None: the setting follows the row length)."""
    if os.environ.get(name) is None and default is None:
        return None
    v = int(os.environ.get(name, str(default)))
    if not ((zero and v == 0) or (v >= 1 and v & (v - 1) == 0)):
        raise ValueError(f"{name} must be a power of two{' or 0' if zero else ''}, got {v}")
    return v


# Longest row held in registers (BLOCK_S = next_pow2(S)): 32768 spills even at
# 16 warps (sm_90a), and the packed 16-bit scan counters need BLOCK_S <= 32768.
RESIDENT_MAX = 16384
STREAM_CHUNK = 4096
_FILL_BLOCK = 1024
# List path (rows of at least LIST_MIN keys, see _list_plan): chunk read, sample
# (at most 1 / LIST_SAMPLE_FRACTION of the row), longest list, batch scratch.
LIST_MIN = 16384
LIST_CHUNK = 1024  # 512 up to LIST_SMALL_CHUNK_MAX keys (H200: up to 3% faster there, 7% slower at 65536)
LIST_SMALL_CHUNK_MAX = 32768
# The sample: 1 / 16 of the row, at most 4096 scores, above LIST_ORDER_MAX_S
# keys; twice that (1 / 8, at most 8192) up to it, where the bound sits
# closer to the cut (at k 1024 the lists then fit a select block of 2048
# keys instead of 4096).  DSA_TOPK_LIST_SAMPLE_FRACTION / _SAMPLE_MAX when
# set.  H200, fp32, one process (run C91): 4096 x 16384 0.2542 / 0.2286 ms
# (k 2048 / 1024) against 0.2636 / 0.2389; 32768^2 causal with row ends
# 1.9897 / 1.7788 against 2.0059 / 1.7857; at 65536 keys twice the sample
# cost 8-12% (C68).
LIST_SAMPLE_MAX = _env_pow2("DSA_TOPK_LIST_SAMPLE_MAX", None)
LIST_SAMPLE_FRACTION = _env_pow2("DSA_TOPK_LIST_SAMPLE_FRACTION", None)
LIST_MAX = 16384
LIST_SCRATCH = 1 << 26
# Whether the build kernel selects the lists that fit the select block itself
# (env DSA_TOPK_LIST_INLINE=1; default: the separate select kernel), and
# whether it takes the rows of a batch last first (DSA_TOPK_LIST_REVERSE=0:
# first row first); read at import. H200, fp32 randn, k 2048 (run C58,
# bench/topk_peers.py --variants): the inline select is slower everywhere
# (32768^2 causal 2.90 ms against 2.60 separate; 65536^2 9.17 against 8.24;
# 4096 x 16384 0.304 against 0.270), the row order and the prefetch move the
# separate path by 1-3%; indexer_topk 0.9-2% faster with the separate select.
LIST_INLINE_SELECT = os.environ.get("DSA_TOPK_LIST_INLINE", "0") != "0"
# Unset, the row order and the L2 prefetch (DSA_TOPK_LIST_PREFETCH: chunks the
# build asks L2 for ahead of the next one, sm_90+ where rows are 16-byte
# aligned; 0: none) follow the row length: first row first and no prefetch
# up to LIST_ORDER_MAX_S keys, last row first and 4 chunks ahead above.  H200,
# fp32, the separate select (run C68, same process): 32768^2 causal with row
# ends 2.017 / 1.790 ms (k 2048 / 1024) first-first without prefetch against
# 2.110 / 1.905 last-first with 4; 4096 x 16384 0.2653 against 0.2700; 65536^2
# causal 7.044 / 6.580 against 6.825 / 6.365.
LIST_ORDER_MAX_S = 32768
LIST_REVERSE = _env_set_flag("DSA_TOPK_LIST_REVERSE")
LIST_PREFETCH: Optional[int] = (None if os.environ.get("DSA_TOPK_LIST_PREFETCH") is None
                                else int(os.environ["DSA_TOPK_LIST_PREFETCH"]))
# Settings bench/topk_peers.py --variants sweeps for short rows, selectable by
# env and off (or at the measured value) by default until a GPU run says
# otherwise: rows a batch holds
# (DSA_TOPK_LIST_BATCH_ROWS; 0: as many as LIST_SCRATCH holds), fewer so that
# a batch's lists are still in L2 when its select reads them; the build's and
# the first select block's warps (DSA_TOPK_LIST_BUILD_WARPS,
# DSA_TOPK_LIST_SELECT_WARPS; 0: 4 up to 4096 keys, else 8); score loads
# marked evict-first (DSA_TOPK_EVICT_FIRST=1: read once, they leave L2 to the
# lists), in the resident kernel and the list build.
LIST_BATCH_ROWS = int(os.environ.get("DSA_TOPK_LIST_BATCH_ROWS", "0"))
if LIST_BATCH_ROWS < 0:
    raise ValueError(f"DSA_TOPK_LIST_BATCH_ROWS must be >= 0, got {LIST_BATCH_ROWS}")
LIST_BUILD_WARPS = _env_pow2("DSA_TOPK_LIST_BUILD_WARPS", 4)
LIST_SELECT_WARPS = _env_pow2("DSA_TOPK_LIST_SELECT_WARPS", 0, zero=True)
EVICT_FIRST = os.environ.get("DSA_TOPK_EVICT_FIRST", "0") != "0"
# With row ends, a row of at most a quarter (half) of S keys samples a quarter
# (half) of the planned sample, the same fraction of its length: the sample's
# search, the build's compute before its row read, then costs about what the
# row's length does.  DSA_TOPK_LIST_SCALED_SAMPLE (0 / 1) when set, else
# above LIST_ORDER_MAX_S keys.  H200, fp32 causal rows with row ends, same
# process (run C74): 65536^2 6.726 / 6.272 ms (k 2048 / 1024) against 6.818 /
# 6.359 with the whole sample; 32768^2 2.026 / 1.803 against 2.015 / 1.787.
LIST_SCALED_SAMPLE = _env_set_flag("DSA_TOPK_LIST_SCALED_SAMPLE")
LIST_INLINE_CHUNK = 2048  # the build's chunk with the inline select (half up to LIST_INLINE_SMALL keys)
LIST_INLINE_SMALL = 16384
_SAMPLE_Z = tl.constexpr(5.0)

SEARCHES = ("bisect", "radix", "interp", "guess")  # ResidentConfig.search; SEARCH = its index

# Order keys of +inf and of -FLT_MAX (the largest and smallest selectable
# finite-or-inf keys; NaN and -inf are 0 and no valid key lies in between).
_KEY_PINF = tl.constexpr(0xFF800000)
_KEY_MIN = tl.constexpr(0x00800000)
# interp: spreads in sd of the count at the normal guess (round 1), of the cut's
# rank (interpolation) and of the secant's reach (tuned on a NumPy model of the
# search over randn, exponential, uniform and fp16 rows: 4.3 rounds on average).
_GUESS_SPREAD = tl.constexpr(1.0)
_INTERP_SPREAD = tl.constexpr(0.75)
_SECANT_SPREAD = tl.constexpr(0.375)
_MODE_GUESS = tl.constexpr(0)
_MODE_SNAP = tl.constexpr(1)
_MODE_INTERP = tl.constexpr(2)
_MODE_SPLIT = tl.constexpr(3)


# --------------------------------------------------------------------------
# Device helpers


@triton.jit
def _order_key(x):
    """fp32 [N] -> uint32 keys, unsigned order == value order; NaN, -inf -> 0."""
    x = x + 0.0  # -0.0 + 0.0 = +0.0 (round to nearest): -0.0 ties with +0.0
    bits = x.to(tl.int32, bitcast=True)
    # Negative floats: flip the 31 magnitude bits (reverses their order); then
    # flip the sign bit so that the signed order becomes the unsigned order.
    signed = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = signed.to(tl.uint32, bitcast=True) ^ 0x80000000
    valid = (x == x) & (x != float("-inf"))
    return tl.where(valid, key, tl.zeros_like(key))


@triton.jit
def _key_value(key):
    """Inverse of _order_key on selectable keys: uint32 -> fp32."""
    signed = (key ^ 0x80000000).to(tl.int32, bitcast=True)
    bits = signed ^ ((signed >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _count_pair(b_key, ca, cb):
    """(count(key >= ca), count(key >= cb)) from one block reduction: two
    16-bit fields of an int32 (a block holds at most 2^16 - 1 keys >= ca)."""
    packed = (b_key >= ca).to(tl.int32) + ((b_key >= cb).to(tl.int32) << 16)
    n = tl.sum(packed, axis=0)
    return n & 0xFFFF, (n >> 16) & 0xFFFF


@triton.jit
def _sum3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _min_max(a_min, a_max, b_min, b_max):
    return tl.minimum(a_min, b_min), tl.maximum(a_max, b_max)


@triton.jit
def _upper_normal_quantile(p):
    """z with P(N(0, 1) > z) ~= p for p in (0, 1) (Abramowitz-Stegun 26.2.23,
    |error| < 4.5e-4: only a first guess)."""
    q = tl.minimum(p, 1.0 - p)
    t = tl.sqrt(-2.0 * tl.log(q))
    z = t - (2.515517 + t * (0.802853 + t * 0.010328)) / (1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308)))
    return tl.where(p > 0.5, -z, z)


@triton.jit
def _emit_gt(idx_row_ptr, key, pos, thr, K, ASM: tl.constexpr):
    """_emit_block of a whole row when no key == thr is taken (need == 0, the
    usual case: the search stops on an exact count): one flag, one scan.
    Keys past the row are 0 and thr >= 0, so they are never > thr."""
    gt = (key > thr).to(tl.int32)
    slot = tl.cumsum(gt, axis=0) - gt
    ptx.store_i32(idx_row_ptr + slot, pos, (gt != 0) & (slot < K), ASM)
    return tl.sum(gt, axis=0)


@triton.jit
def _emit_block(idx_row_ptr, key, pos, m, thr, need, gt_run, eq_run, K, ONE_SUM: tl.constexpr = False,
                ASM: tl.constexpr = False):
    """Store the selected positions of one block; return the block's counts.

    Selected: key > thr, or key == thr among the first ``need`` such keys of
    the row (``eq_run`` of them lie in earlier blocks). The output slot is the
    number of selected keys before it. Both prefix counts come out of one
    scan: gt in the low 16 bits, eq in the high 16 (a block is < 2^15 long).
    Slots >= K are never written: a wrong threshold gives wrong indices, not
    a fault.
    """
    gt = (key > thr) & m
    eq = (key == thr) & m & (need > 0)
    packed = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
    excl = tl.cumsum(packed, axis=0) - packed
    gt_before = gt_run + (excl & 0xFFFF)
    eq_before = eq_run + (excl >> 16)
    sel = gt | (eq & (eq_before < need))
    slot = gt_before + tl.minimum(eq_before, need)
    ptx.store_i32(idx_row_ptr + slot, pos, sel & (slot < K), ASM)
    if ONE_SUM:  # both counts from one reduction of the packed flags
        n = tl.sum(packed, axis=0)
        return n & 0xFFFF, (n >> 16) & 0xFFFF
    return tl.sum(gt.to(tl.int32), axis=0), tl.sum(eq.to(tl.int32), axis=0)


@triton.jit
def _pad_row(idx_row_ptr, length, K, BLOCK: tl.constexpr):
    """idx_row[length:K] = -1."""
    for j0 in range((length // BLOCK) * BLOCK, K, BLOCK):
        o_j = j0 + tl.arange(0, BLOCK)
        tl.store(idx_row_ptr + o_j, tl.full([BLOCK], -1, tl.int32), mask=(o_j >= length) & (o_j < K))


@triton.jit
def _emit_row(idx_row_ptr, len_ptr, r, key, pos, m, thr, need, K, FILL: tl.constexpr, ASM: tl.constexpr):
    """A row's output from one block: the selected positions (keys > thr, the
    first ``need`` keys == thr), the length at len_ptr + r, -1 up to K."""
    if need == 0:  # the cut splits no tie
        length = _emit_gt(idx_row_ptr, key, pos, thr, K, ASM)
    else:
        n_gt, n_eq = _emit_block(idx_row_ptr, key, pos, m, thr, need, 0, 0, K, True, ASM)
        length = n_gt + tl.minimum(n_eq, need)
    tl.store(len_ptr + r, length)
    _pad_row(idx_row_ptr, length, K, FILL)


# --------------------------------------------------------------------------
# Threshold searches: (thr, need): every key > thr, the first ``need`` == thr.


@triton.jit
def _search_bisect(b_key, n_valid, K, EARLY_EXIT: tl.constexpr):
    thr = tl.zeros([], tl.uint32)
    if EARLY_EXIT:
        # Stopped once exactly K keys are >= thr: the top K, ties whole
        # (distinct scores: after about log2(S) + a few bits instead of 32).
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
    return thr, need


@triton.jit
def _sum2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _sum4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _sum8(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6, a7 + b7


@triton.jit
def _radix_word(b_key, thr, sh, n_dig, J: tl.constexpr):
    """Per key: (key >= candidate 2J+1) + (key >= candidate 2J+2) << 16, the
    candidate of digit d being thr | d << sh (none past the round's digits)."""
    ca = tl.where(2 * J + 1 < n_dig, thr | ((2 * J + 1) << sh), 0xFFFFFFFF)  # no key is >= 0xFFFFFFFF
    cb = tl.where(2 * J + 2 < n_dig, thr | ((2 * J + 2) << sh), 0xFFFFFFFF)
    return (b_key >= ca).to(tl.int32) + ((b_key >= cb).to(tl.int32) << 16)


@triton.jit
def _radix_counts(b_key, thr, sh, n_dig, BITS: tl.constexpr):
    """The round's 2^BITS - 1 candidate counts, two 16-bit fields per int32,
    from one block reduction (a tuple of 2^(BITS-1) words, all scalars: the
    digit logic after it runs on uniform registers, no small-vector layout)."""
    if BITS == 1:
        words = (tl.sum(_radix_word(b_key, thr, sh, n_dig, 0), axis=0), )
    elif BITS == 2:
        words = tl.reduce((_radix_word(b_key, thr, sh, n_dig, 0), _radix_word(b_key, thr, sh, n_dig, 1)), 0, _sum2)
    elif BITS == 3:
        words = tl.reduce((_radix_word(b_key, thr, sh, n_dig, 0), _radix_word(b_key, thr, sh, n_dig, 1),
                           _radix_word(b_key, thr, sh, n_dig, 2), _radix_word(b_key, thr, sh, n_dig, 3)), 0, _sum4)
    else:
        words = tl.reduce((_radix_word(b_key, thr, sh, n_dig, 0), _radix_word(b_key, thr, sh, n_dig, 1),
                           _radix_word(b_key, thr, sh, n_dig, 2), _radix_word(b_key, thr, sh, n_dig, 3),
                           _radix_word(b_key, thr, sh, n_dig, 4), _radix_word(b_key, thr, sh, n_dig, 5),
                           _radix_word(b_key, thr, sh, n_dig, 6), _radix_word(b_key, thr, sh, n_dig, 7)), 0, _sum8)
    return words


@triton.jit
def _search_radix(b_key, K, BITS: tl.constexpr, LOW_BITS: tl.constexpr):
    """Radix select on the key, BITS bits a round from the top down to bit
    LOW_BITS (below it every key of a 16-bit input is all zeros or all ones).

    Round: count the candidates thr | d << sh, d = 1 .. 2^BITS - 1, in one
    reduction; counts fall with d, so the digit kept is the number of them
    >= K. c_up = count(key >= the range's upper end) carries ``need`` to the
    end without another reduction.
    """
    NP: tl.constexpr = 1 << (BITS - 1)
    WIDTH: tl.constexpr = 32 - LOW_BITS
    FIRST: tl.constexpr = WIDTH - BITS * ((WIDTH - 1) // BITS)  # bits of round 1
    zero = tl.zeros([], tl.int32)
    thr = tl.zeros([], tl.uint32)
    c_up = zero
    hit_key = tl.zeros([], tl.uint32)
    shift = zero + (32 - FIRST)
    width = zero + FIRST
    while (shift >= LOW_BITS) & (hit_key == 0):
        sh = shift.to(tl.uint32)
        n_dig = tl.full([], 1, tl.uint32) << width.to(tl.uint32)
        words = _radix_counts(b_key, thr, sh, n_dig, BITS)
        dig = tl.zeros([], tl.uint32)
        hit = tl.zeros([], tl.uint32)
        n_below = zero  # the largest count < K: that of digit dig + 1
        for j in tl.static_range(NP):
            for f in tl.static_range(2):
                c = (words[j] >> (16 * f)) & 0xFFFF
                dig += (c >= K).to(tl.uint32)
                hit = tl.where(c == K, 2 * j + 1 + f, hit)
                n_below = tl.maximum(n_below, tl.where(c < K, c, 0))
        c_up = tl.where(dig + 1 < n_dig, n_below, c_up)
        hit_key = tl.where(hit > 0, thr | (hit << sh), hit_key)
        thr = thr | (dig << sh)
        shift -= BITS
        width = zero + BITS
    # All keys in [thr, thr + 2^LOW_BITS) equal the K-th one; negative values
    # carry ones below LOW_BITS (see _order_key).
    low = (tl.full([], 1, tl.uint32) << LOW_BITS) - 1
    thr = tl.where(thr < 0x80000000, thr | low, thr)
    need = K - c_up
    # exact hit: the keys >= hit_key are the top K
    thr = tl.where(hit_key > 0, hit_key - 1, thr)
    need = tl.where(hit_key > 0, 0, need)
    return thr, need


@triton.jit
def _interp_candidates(lo, hi, m, r, K, mode, snapped, na, nb, va_p, vb_p, va_g, vb_g):
    """A round's keys lo < ca <= cb < hi: interpolation at the cut's rank +-
    INTERP_SPREAD sd, the secant through the last two candidates when both
    fell on one side, the normal guess (round 1), the bracket's thirds
    (split) or the keys next to a snapped end."""
    mf = m.to(tl.float32)
    rf = r.to(tl.float32)
    f_lo = _key_value(lo)
    f_hi = _key_value(hi - 1)
    d = tl.maximum(_INTERP_SPREAD * tl.sqrt(rf * (mf - rf) / mf), 0.5)
    pa = tl.clamp((rf - d) / mf, 0.0, 1.0)
    pb = tl.clamp((rf + d) / mf, 0.0, 1.0)
    va = f_lo * (1.0 - pa) + f_hi * pa
    vb = f_lo * (1.0 - pb) + f_hi * pb
    same_side = ((na >= K) == (nb >= K)) & (na != nb) & (snapped == 0) & (mode == _MODE_INTERP)
    slope = (na - nb).to(tl.float32) / (vb_p - va_p)
    above = nb >= K
    near_v = tl.where(above, vb_p, va_p)
    near_n = tl.where(above, nb, na).to(tl.float32)
    reach = tl.abs(near_n - K)
    ds = 0.5 + _SECANT_SPREAD * (tl.sqrt(reach) + reach / tl.sqrt((na - nb).to(tl.float32)))
    va = tl.where(same_side, near_v + (near_n - (K + ds)) / slope, va)
    vb = tl.where(same_side, near_v + (near_n - (K - ds)) / slope, vb)
    va = tl.where(mode == _MODE_GUESS, va_g, va)
    vb = tl.where(mode == _MODE_GUESS, vb_g, vb)
    ca = _order_key(va)  # NaN -> 0, clamped to lo + 1 below
    cb = _order_key(vb)
    # right after a snap lo and hi - 1 are keys: one above lo (or hi - 1
    # itself) is the cut when one key of the bracket lies on that side
    ca = tl.where((snapped != 0) & (r == 1), lo + 1, ca)
    cb = tl.where((snapped != 0) & (m - r == 1), hi - 1, cb)
    third = tl.maximum((hi - lo) // 3, 1)
    ca = tl.where(mode == _MODE_SPLIT, lo + third, ca)
    cb = tl.where(mode == _MODE_SPLIT, hi - third, cb)
    ca = tl.minimum(tl.maximum(ca, lo + 1), hi - 1)
    cb = tl.minimum(tl.maximum(cb, ca), hi - 1)
    return ca, cb


@triton.jit
def _interp_step(b_key, lo, hi, c_lo, c_hi, ca, cb, m, K, mode, fails, INTERP: tl.constexpr):
    """Count the candidates and move the bracket ends onto them; the next
    mode: interpolation while rounds halve the bracket, else a snap and a
    split in turn (without INTERP always a split)."""
    na, nb = _count_pair(b_key, ca, cb)
    va_p = _key_value(ca)
    vb_p = _key_value(cb)
    up = nb >= K
    mid = na >= K
    lo = tl.where(up, cb, tl.where(mid, ca, lo))
    c_lo = tl.where(up, nb, tl.where(mid, na, c_lo))
    hi = tl.where(up, hi, tl.where(mid, cb, ca))
    c_hi = tl.where(up, c_hi, tl.where(mid, nb, na))
    # the first round is a guess, not a step of the model: not judged
    fails = tl.where((2 * (c_lo - c_hi) > m) & (mode != _MODE_GUESS), fails + 1, 0)
    if INTERP:
        mode = tl.where(fails == 0, _MODE_INTERP, tl.where(fails % 2 == 1, _MODE_SNAP, _MODE_SPLIT))
        # an end still at the start key and no slope from this round:
        # snap for a data value there first
        unbounded = (lo == _KEY_MIN) | (hi == _KEY_PINF)
        mode = tl.where(unbounded & (na == nb) & (mode == _MODE_INTERP), _MODE_SNAP, mode)
    else:
        mode = tl.zeros([], tl.int32) + _MODE_SPLIT
    return lo, hi, c_lo, c_hi, na, nb, va_p, vb_p, fails, mode


@triton.jit
def _search_interp(b_key, n_valid, n_pinf, s1, s2, K, INTERP: tl.constexpr, SLACK=0):
    """Candidates from a model of the values (see the module header).
    SLACK > 0: also stop once count(>= lo) <= K + SLACK (a bound, not a cut).
    State: lo < hi keys with c_lo = count(>= lo) >= K > c_hi = count(>= hi),
    start [key(-FLT_MAX), key(+inf)). Candidates only decide how fast the
    bracket shrinks; every count is exact, so any placement is correct.
    Without INTERP the rounds after the first split the key range in thirds.
    """
    lo = tl.full([], _KEY_MIN, tl.uint32)
    hi = tl.full([], _KEY_PINF, tl.uint32)
    c_lo = n_valid
    c_hi = n_pinf
    if n_pinf >= K:  # the K-th key is +inf
        lo = hi
        hi = lo + 1
        c_lo = n_pinf
        c_hi = tl.zeros([], tl.int32)
    # Round 1: a normal fit to the finite values, counts K +- GUESS_SPREAD sd.
    nf = (n_valid - n_pinf).to(tl.float32)
    mean = s1 / nf
    sd = tl.sqrt(tl.maximum(s2 / nf - mean * mean, 0.0))
    t = (K - n_pinf).to(tl.float32)
    d0 = 0.5 + _GUESS_SPREAD * tl.sqrt(tl.maximum(t * (nf - t), 0.0) / nf)
    p_min = 0.5 / nf
    va_g = mean + sd * _upper_normal_quantile(tl.clamp((t + d0) / nf, p_min, 1.0 - p_min))
    vb_g = mean + sd * _upper_normal_quantile(tl.clamp((t - d0) / nf, p_min, 1.0 - p_min))
    guess_ok = (tl.abs(va_g) < float("inf")) & (tl.abs(vb_g) < float("inf"))
    mode = tl.where(guess_ok, _MODE_GUESS, _MODE_SNAP)

    zero = tl.zeros([], tl.int32)
    fails = zero  # rounds in a row that did not halve the bracket
    snapped = zero
    na = zero  # counts and values of the last round's candidates
    nb = zero
    va_p = tl.zeros([], tl.float32)
    vb_p = tl.zeros([], tl.float32)
    while (c_lo - K > SLACK) & (hi - lo > 1):
        if mode == _MODE_SNAP:
            # Ends onto the keys inside [lo, hi): same counts, and a bracket
            # holding a single (tied) key is then done.
            lo, hi_key = tl.reduce((tl.where(b_key >= lo, b_key, 0xFFFFFFFF), tl.where(b_key < hi, b_key, 0)),
                                   0, _min_max)
            hi = hi_key + 1
            snapped = zero + 1
            mode = zero + (_MODE_INTERP if INTERP else _MODE_SPLIT)
        else:
            m = c_lo - c_hi
            r = c_lo - K  # keys of the bracket below the cut
            ca, cb = _interp_candidates(lo, hi, m, r, K, mode, snapped, na, nb, va_p, vb_p, va_g, vb_g)
            lo, hi, c_lo, c_hi, na, nb, va_p, vb_p, fails, mode = _interp_step(b_key, lo, hi, c_lo, c_hi, ca, cb, m, K,
                                                                               mode, fails, INTERP)
            snapped = zero
    exact = c_lo == K  # keys >= lo are the top K
    thr = tl.where(exact, lo - 1, lo)
    need = tl.where(exact, 0, K - c_hi)
    return thr, need


# --------------------------------------------------------------------------
# Kernels


def _topk_resident_kernel(
    s_ptr, idx_ptr, len_ptr, end_ptr, S, K, stride_s, stride_i,
    BLOCK_S: tl.constexpr, FILL: tl.constexpr, EARLY_EXIT: tl.constexpr,
    SEARCH: tl.constexpr = 0, RADIX_BITS: tl.constexpr = 2, LOW_BITS: tl.constexpr = 0,
    ASM_STORE: tl.constexpr = False, HAS_END: tl.constexpr = False, EVICT_FIRST: tl.constexpr = False,
):
    # SEARCH: index in SEARCHES; LOW_BITS: key bits below the input's precision; ASM_STORE: see ptx.py;
    # HAS_END: only the first end[r] scores of row r are read (see _row_len); EVICT_FIRST: see _load_upto
    r = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    L = _row_len(end_ptr, r, S, HAS_END)
    m_s = o_s < L
    b_x = _load_upto(s_ptr + r * stride_s, o_s, L, S, HAS_END, EVICT_FIRST)
    b_key = _order_key(b_x)  # [BLOCK_S]
    idx_row = idx_ptr + r * stride_i

    if SEARCH == 0:
        n_valid = tl.sum((b_key != 0).to(tl.int32), axis=0)
        thr = tl.zeros([], tl.uint32)
        need = tl.zeros([], tl.int32)
        if n_valid > K:  # else every valid key is taken (rows of early causal queries)
            thr, need = _search_bisect(b_key, n_valid, K, EARLY_EXIT)
        # thr == 0 when every valid key is taken: "key > 0" is exactly "valid".
    else:
        if SEARCH == 1:
            n_valid = tl.sum((b_key != 0).to(tl.int32), axis=0)
        else:
            # valid and +inf counts with the sums for the first guess, one reduction
            fin = (b_key != 0) & (b_key != _KEY_PINF)
            b_xf = tl.where(fin, b_x, 0.0)
            packed = (b_key != 0).to(tl.int32) + ((b_key == _KEY_PINF).to(tl.int32) << 16)
            n_packed, s1, s2 = tl.reduce((packed, b_xf, b_xf * b_xf), 0, _sum3)
            n_valid = n_packed & 0xFFFF
        thr = tl.where(K > 0, 0, 0xFFFFFFFF).to(tl.uint32)  # k = 0: nothing is > thr
        need = tl.zeros([], tl.int32)
        if (n_valid > K) & (K > 0):
            if SEARCH == 1:
                thr, need = _search_radix(b_key, K, RADIX_BITS, LOW_BITS)
            else:
                thr, need = _search_interp(b_key, n_valid, (n_packed >> 16) & 0xFFFF, s1, s2, K, SEARCH == 2, 0)
    _emit_row(idx_row, len_ptr, r, b_key, o_s, m_s, thr, need, K, FILL, ASM_STORE)


# The same kernel with S and the row stride unspecialized: the row load is not
# vectorized, so every tensor keeps the one-key-a-thread layout of the store and
# the emit converts no 64-bit pointers through shared memory (sm_90a, 16384
# keys: 13 instead of 25 barriers a row, same registers).
_topk_resident_kernel_scalar = triton.jit(do_not_specialize=["S", "stride_s"])(_topk_resident_kernel)
_topk_resident_kernel = triton.jit(_topk_resident_kernel)


@triton.jit
def _row_len(end_ptr, r, S, HAS_END: tl.constexpr):
    """The columns of row r that are read: end[r] clamped to [0, S] (the rest
    of the row counts as -inf: the fused indexer's causal window), or S."""
    if HAS_END:
        return tl.minimum(tl.maximum(tl.load(end_ptr + r), 0), S)
    else:
        return S


@triton.jit
def _load_upto(p, o, L, S, HAS_END: tl.constexpr, EVICT_FIRST: tl.constexpr = False):
    """fp32 scores p[o] for o < L, -inf past it. With HAS_END the load's mask
    is o < L rounded up to 16 (and o < S): a mask constant over aligned
    groups, so the load stays vectorized although L is any number.
    EVICT_FIRST: the lines read leave L2 first (scores are read once)."""
    if HAS_END:
        m = (o < (L + 15) // 16 * 16) & (o < S)
    else:
        m = o < L
    if EVICT_FIRST:
        x = tl.load(p + o, mask=m, other=float("-inf"), eviction_policy="evict_first").to(tl.float32)
    else:
        x = tl.load(p + o, mask=m, other=float("-inf")).to(tl.float32)
    if HAS_END:
        x = tl.where(o < L, x, float("-inf"))
    return x


@triton.jit
def _stream_row(s_row, idx_row, len_ptr, S, K, CHUNK: tl.constexpr, FILL: tl.constexpr):
    """The top K of one row of any length, read in chunks: thr from a 4-pass
    radix select (8-bit digits, 256-bin histograms), then one emit pass in
    chunk order with running counters."""
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

    gt_run = tl.zeros([], tl.int32)
    eq_run = tl.zeros([], tl.int32)
    for c0 in range(0, S, CHUNK):
        m = (c0 + o_c) < S
        key = _order_key(tl.load(s_row + c0 + o_c, mask=m, other=float("-inf")).to(tl.float32))
        n_gt, n_eq = _emit_block(idx_row, key, c0 + o_c, m, thr, need, gt_run, eq_run, K)
        gt_run += n_gt
        eq_run += n_eq
    length = gt_run + tl.minimum(eq_run, need)
    tl.store(len_ptr, length)
    _pad_row(idx_row, length, K, FILL)


@triton.jit
def _topk_stream_kernel(
    s_ptr, idx_ptr, len_ptr, end_ptr, S, K, stride_s, stride_i,
    CHUNK: tl.constexpr, FILL: tl.constexpr, HAS_END: tl.constexpr = False,
):
    r = tl.program_id(0).to(tl.int64)
    L = _row_len(end_ptr, r, S, HAS_END)
    _stream_row(s_ptr + r * stride_s, idx_ptr + r * stride_i, len_ptr + r, L, K, CHUNK, FILL)


# --------------------------------------------------------------------------
# List path: a sampled bound, the keys above it compacted, an exact select.


@triton.jit
def _select_rank(b_x, b_key, K, SLACK, SEARCH: tl.constexpr = 2):
    """(thr, need, selectable keys) of the top K keys of a block (the
    resident interp search): every key > thr and the first ``need`` keys ==
    thr. K = 0: nothing. SEARCH: index in SEARCHES; SLACK (interp only):
    stop once count(key >= thr) <= K + SLACK, need then counted from there."""
    fin = (b_key != 0) & (b_key != _KEY_PINF)
    b_xf = tl.where(fin, b_x, 0.0)
    packed = (b_key != 0).to(tl.int32) + ((b_key == _KEY_PINF).to(tl.int32) << 16)
    n_packed, s1, s2 = tl.reduce((packed, b_xf, b_xf * b_xf), 0, _sum3)
    n_valid = n_packed & 0xFFFF
    thr = tl.where(K > 0, 0, 0xFFFFFFFF).to(tl.uint32)
    need = tl.zeros([], tl.int32)
    if (n_valid > K) & (K > 0):
        if SEARCH == 0:
            thr, need = _search_bisect(b_key, n_valid, K, True)
        elif SEARCH == 1:
            thr, need = _search_radix(b_key, K, 3, 0)
        else:
            thr, need = _search_interp(b_key, n_valid, (n_packed >> 16) & 0xFFFF, s1, s2, K, True, SLACK)
    return thr, need, n_valid


@triton.jit
def _prefetch_l2(p, nbytes):
    """Ask L2 for the nbytes at p (16-byte aligned, a multiple of 16; sm_90+):
    one bulk prefetch by the block's first thread. Bytes in flight that hold
    no registers: the row read keeps HBM busy ahead of its loads."""
    tl.inline_asm_elementwise(
        "{ .reg .pred q; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 q, t, 0; "
        "@q cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [p, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _sample_bound(s_row, L, S, RANK, SLACK, STRIDE, SAMPLE: tl.constexpr, HAS_END: tl.constexpr):
    """The RANK-th largest key of SAMPLE scores of the row's first L (runs
    of 8 at STRIDE), or 1 (every selectable key) if the sample holds fewer:
    a key ``lo`` with count(key >= lo) close to RANK * L / SAMPLE. SLACK: any
    key with RANK to RANK + SLACK sampled keys >= it will do (fewer rounds)."""
    o = tl.arange(0, SAMPLE)
    col = (o // 8) * STRIDE + o % 8
    x = _load_upto(s_row, col, L, S, HAS_END)
    key = _order_key(x)
    thr, need, n_valid = _select_rank(x, key, RANK, SLACK)
    # need == 0: the RANK-th key is the least key > thr
    least = tl.min(tl.where(key > thr, key, 0xFFFFFFFF), axis=0)
    lo = tl.where(need == 0, least, thr)
    return tl.where(n_valid > RANK, lo, 1)


@triton.jit
def _row_sample_plan(L, K, RANK, SLACK, STRIDE, WHOLE_MAX: tl.constexpr, SAMPLE: tl.constexpr,
                     HAS_END: tl.constexpr):
    """(rank, slack, stride, whole) of the sample of a row of L read columns.
    Without HAS_END the host's plan for the full row length. With it, the
    plan of _list_plan for L: runs spread over [0, L) and the rank that keeps
    count(key >= bound) >= K as many spreads out (so the list stays about the
    planned length on shorter rows); a row shorter than the sample is all
    sampled (rank K: the bound is the K-th key itself); a row of at most
    WHOLE_MAX columns is taken whole (its list is every selectable key)."""
    if HAS_END:
        n = SAMPLE * 1.0
        m = (K * 1.0) * n / tl.maximum(L, 1).to(tl.float32)  # K * 1.0: K == 1 is passed as a constexpr
        root = (_SAMPLE_Z + tl.sqrt(_SAMPLE_Z * _SAMPLE_Z + 4.0 * m)) * 0.5
        rank = tl.ceil(root * root).to(tl.int32)
        slack = tl.maximum(tl.sqrt(rank.to(tl.float32) * 0.25).to(tl.int32), 1)
        short = L < SAMPLE
        rank = tl.where(short, K, rank)
        slack = tl.where(short, 0, slack)
        # a multiple of 8: runs 32-byte aligned (fp32), each two 16-byte loads
        stride = tl.maximum(L // (SAMPLE // 8) // 8, 1) * 8
        return rank, slack, stride, L <= WHOLE_MAX
    else:
        return RANK, SLACK, STRIDE, False


@triton.jit
def _row_bound(s_row, L, S, K, RANK, SLACK, STRIDE, WHOLE_MAX: tl.constexpr, SAMPLE: tl.constexpr,
               HAS_END: tl.constexpr):
    """The row's sample bound from SAMPLE scores (``_row_sample_plan``, then
    ``_sample_bound``), or 1 (every selectable key) for a row taken whole."""
    rank, slack, stride, whole = _row_sample_plan(L, K, RANK, SLACK, STRIDE, WHOLE_MAX, SAMPLE, HAS_END)
    lo = tl.full([], 1, tl.uint32)
    if whole == 0:
        lo = _sample_bound(s_row, L, S, rank, slack, stride, SAMPLE, HAS_END)
    return lo


@triton.jit
def _list_build_kernel(
    s_ptr, val_ptr, pos_ptr, meta_ptr, end_ptr, idx_ptr, len_ptr, row0, n_rows, S, K, stride_s, stride_i, RANK,
    SLACK, STRIDE,
    CAP: tl.constexpr, CHUNK: tl.constexpr, SAMPLE: tl.constexpr, ASM_STORE: tl.constexpr,
    HAS_END: tl.constexpr = False, SELECT_BLOCK: tl.constexpr = 0, SEARCH: tl.constexpr = 2,
    FILL: tl.constexpr = 1024, REVERSE: tl.constexpr = False, WHOLE_MAX: tl.constexpr = 0,
    PREFETCH: tl.constexpr = 0, CHUNK_BYTES: tl.constexpr = 0, EVICT_FIRST: tl.constexpr = False,
    SCALED_SAMPLE: tl.constexpr = False,
):
    """Row row0 + b: list b = (value, position) of every key >= the sample
    bound, in position order (the first CAP of them); meta b = (list length,
    selectable keys of the row). HAS_END: the row is its first end[r]
    columns (rows of at most WHOLE_MAX taken whole). SELECT_BLOCK > 0: a
    list of at most SELECT_BLOCK keys that holds the row's top K is selected
    and emitted here (the select kernel's work, done while the list is still
    in L2 and overlapping other programs' row reads); the select kernel then
    takes only the longer lists. REVERSE: the
    last row first (causal rows grow with the row index: the longest start
    first and the tail is short rows). PREFETCH > 0 (sm_90+, 16-byte aligned
    rows): the chunks up to PREFETCH past the next one are prefetched to L2
    (CHUNK_BYTES each), the first ones before the sample's search.
    EVICT_FIRST: the chunk loads (not the sample's, read again by them)
    leave L2 first. SCALED_SAMPLE (with HAS_END): rows of at most S / 4
    (S / 2) keys sample SAMPLE / 4 (SAMPLE / 2) scores."""
    if REVERSE:
        b = n_rows - 1 - tl.program_id(0)
    else:
        b = tl.program_id(0)
    r = (row0 + b).to(tl.int64)
    s_row = s_ptr + r * stride_s
    L = _row_len(end_ptr, r, S, HAS_END)
    if PREFETCH > 0:  # chunks 2 .. PREFETCH + 1 (0 and 1 are loaded below)
        for j in tl.static_range(2, PREFETCH + 2):
            if (j + 1) * CHUNK <= L:
                _prefetch_l2(s_row + j * CHUNK, CHUNK_BYTES)
    if SCALED_SAMPLE and HAS_END:
        # the planned fraction of the row: a quarter or half of the sample for rows of at most S / 4, S / 2
        if 4 * L <= S:
            lo = _row_bound(s_row, L, S, K, RANK, SLACK, STRIDE, WHOLE_MAX, SAMPLE // 4, HAS_END)
        elif 2 * L <= S:
            lo = _row_bound(s_row, L, S, K, RANK, SLACK, STRIDE, WHOLE_MAX, SAMPLE // 2, HAS_END)
        else:
            lo = _row_bound(s_row, L, S, K, RANK, SLACK, STRIDE, WHOLE_MAX, SAMPLE, HAS_END)
    else:
        lo = _row_bound(s_row, L, S, K, RANK, SLACK, STRIDE, WHOLE_MAX, SAMPLE, HAS_END)
    p_val = val_ptr + b.to(tl.int64) * CAP
    p_pos = pos_ptr + b.to(tl.int64) * CAP
    o_c = tl.arange(0, CHUNK)
    run = tl.zeros([], tl.int32)
    n_valid = tl.zeros([CHUNK], tl.int32)
    # the next chunk is loaded before this one is compacted: two chunks in flight
    x_next = _load_upto(s_row, o_c, L, S, HAS_END, EVICT_FIRST)
    for c0 in range(0, L, CHUNK):
        if PREFETCH > 0:
            c_pf = c0 + (PREFETCH + 2) * CHUNK
            if c_pf + CHUNK <= L:
                _prefetch_l2(s_row + c_pf, CHUNK_BYTES)
        o = c0 + o_c
        x = x_next
        x_next = _load_upto(s_row, CHUNK + o, L, S, HAS_END, EVICT_FIRST)
        key = _order_key(x)
        n_valid += (key != 0).to(tl.int32)
        sel = (key >= lo).to(tl.int32)
        n_sel = tl.sum(sel, axis=0)
        if n_sel > 0:  # no scan for a chunk with nothing to keep (the -inf tail of a causal row)
            slot = run + tl.cumsum(sel, axis=0) - sel
            keep = (sel != 0) & (slot < CAP)
            ptx.store_i32(p_val + slot, x.to(tl.int32, bitcast=True), keep, ASM_STORE)
            ptx.store_i32(p_pos + slot, o, keep, ASM_STORE)
        run += n_sel
    n_row = tl.sum(n_valid, axis=0)
    tl.store(meta_ptr + 2 * b, run)
    tl.store(meta_ptr + 2 * b + 1, n_row)
    if SELECT_BLOCK > 0:
        ok = (run <= CAP) & ((run >= K) | (run == n_row))
        if ok & (run <= SELECT_BLOCK):
            # the list's stores are visible to the whole block after the
            # barrier; .cg reads them from L2, past this SM's L1
            tl.debug_barrier()
            _select_list(p_val, p_pos, run, idx_ptr, len_ptr, r, K, stride_i, SELECT_BLOCK, FILL, ASM_STORE,
                         SEARCH)


@triton.jit
def _select_list(p_val, p_pos, n_list, idx_ptr, len_ptr, r, K, stride_i, BLOCK: tl.constexpr, FILL: tl.constexpr,
                 ASM_STORE: tl.constexpr, SEARCH: tl.constexpr):
    """Row r's top K from its list (n_list <= BLOCK entries holding every key
    >= the K-th largest, in position order): search and emit."""
    o = tl.arange(0, BLOCK)
    m = o < n_list
    # values as int32 bit patterns (the store keeps the load's layout)
    x = tl.load(p_val + o, mask=m, other=-8388608, cache_modifier=".cg")
    x = x.to(tl.float32, bitcast=True)
    pos = tl.load(p_pos + o, mask=m, other=0, cache_modifier=".cg")
    key = _order_key(x)
    thr, need, _ = _select_rank(x, key, K, 0, SEARCH)
    _emit_row(idx_ptr + r * stride_i, len_ptr, r, key, pos, m, thr, need, K, FILL, ASM_STORE)


@triton.jit
def _list_ok(meta_ptr, b, K, CAP: tl.constexpr):
    """(list length, whether the list holds the row's top K exactly)."""
    n_list = tl.load(meta_ptr + 2 * b)
    n_valid = tl.load(meta_ptr + 2 * b + 1)
    return n_list, (n_list <= CAP) & ((n_list >= K) | (n_list == n_valid))


@triton.jit
def _list_select_kernel(
    val_ptr, pos_ptr, meta_ptr, idx_ptr, len_ptr, row0, K, stride_i, LEN_LO,
    CAP: tl.constexpr, BLOCK: tl.constexpr, FILL: tl.constexpr, ASM_STORE: tl.constexpr,
    SEARCH: tl.constexpr = 2,
):
    """Rows whose list is exact and LEN_LO < length <= BLOCK: the top K of the
    list (it holds every key >= the K-th largest, in position order)."""
    b = tl.program_id(0)
    n_list, ok = _list_ok(meta_ptr, b, K, CAP)
    if ok & (n_list > LEN_LO) & (n_list <= BLOCK):
        r = (row0 + b).to(tl.int64)
        _select_list(val_ptr + b.to(tl.int64) * CAP, pos_ptr + b.to(tl.int64) * CAP, n_list, idx_ptr, len_ptr, r,
                     K, stride_i, BLOCK, FILL, ASM_STORE, SEARCH)


@triton.jit
def _list_fallback_kernel(
    s_ptr, meta_ptr, idx_ptr, len_ptr, end_ptr, row0, S, K, stride_s, stride_i,
    CAP: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr, HAS_END: tl.constexpr = False,
):
    """Rows whose list is not exact (the sample bound missed: too few keys
    above it, or more than CAP): the streaming radix select."""
    b = tl.program_id(0)
    _, ok = _list_ok(meta_ptr, b, K, CAP)
    if ok == 0:
        r = (row0 + b).to(tl.int64)
        L = _row_len(end_ptr, r, S, HAS_END)
        _stream_row(s_ptr + r * stride_s, idx_ptr + r * stride_i, len_ptr + r, L, K, CHUNK, FILL)


# --------------------------------------------------------------------------
# Host side


@dataclass(frozen=True)
class ResidentConfig:
    num_warps: int
    # H200, fp32, k=2048: 4096x4096 0.189 -> 0.122 ms, 4096x16384 0.949 -> 0.721
    early_exit: bool = True
    search: str = "bisect"  # one of SEARCHES; _resident_config picks interp
    radix_bits: int = 2  # radix: bits a round, 1..4
    # ptxas register cap (None: its choice). 4 warps at 4096 keys take 168
    # registers, 3 programs an SM; 128: 4 without spills (sm_90a; 96 spills).
    maxnreg: Optional[int] = None
    vec_load: bool = True  # False: _topk_resident_kernel_scalar (slower on the H200, C10)
    evict_first: bool = False  # the row load marked evict-first (EVICT_FIRST above)

    def __post_init__(self):
        if self.search not in SEARCHES:
            raise ValueError(f"ResidentConfig.search must be one of {SEARCHES}, got {self.search!r}")
        if not 1 <= self.radix_bits <= 4:
            raise ValueError(f"ResidentConfig.radix_bits must be in 1..4, got {self.radix_bits}")

    def constexprs(self, dtype: torch.dtype) -> dict:
        """The kernel's compile-time switches for this config and score dtype."""
        search = SEARCHES.index(self.search)
        # key bits below the input's precision: fp16 (10-bit mantissa) leaves
        # 13 zero bits in the fp32 pattern, bf16 16
        low = {torch.float16: 13, torch.bfloat16: 16}.get(dtype, 0)
        return dict(EARLY_EXIT=self.early_exit, SEARCH=search, RADIX_BITS=self.radix_bits, LOW_BITS=low,
                    EVICT_FIRST=self.evict_first)


def _resident_config(block_s: int) -> ResidentConfig:
    # H200, fp32, k=2048, 4096 rows (bench/tune_topk.py, RESULTS.md C10, C17,
    # C22): interp beats bisect, radix (2-4 bits) and guess at both lengths.
    # 4096 keys: 4 warps capped at 128 registers 0.082 ms (uncapped 0.123, 8
    # warps 0.096); 16384: 8 warps at 128 (2 programs an SM) 0.335 ms, 16 at
    # 64 0.333, 16 uncapped 0.400, 32 0.461, 8 uncapped 0.480.
    if block_s == 16384:
        return ResidentConfig(num_warps=8, search="interp", maxnreg=128, evict_first=EVICT_FIRST)
    warps = max(4, min(16, block_s // 1024))
    return ResidentConfig(num_warps=warps, search="interp", maxnreg=128 if block_s == 4096 else None,
                          evict_first=EVICT_FIRST)


@dataclass(frozen=True)
class ListPlan:
    """Sizes of the list path for one (row length, k); see _list_plan."""

    sample: int  # sampled scores a row (a power of two, runs of 8)
    stride: int  # columns between the starts of two runs
    rank: int  # the bound is the sample's rank-th largest key
    block: int  # keys of the select kernel's block (most rows' lists fit)
    cap: int  # list capacity a row (>= block; longer lists take the fallback)
    chunk: int = LIST_CHUNK
    select_warps: int = 4
    # ptxas cap of the first select block (4096 keys, 4 warps: 199 registers
    # uncapped, 2 programs an SM; 128: 4, 8 bytes spilled; sm_90a)
    select_maxnreg: Optional[int] = None
    build_warps: int = 4
    slack: int = 0  # the sample bound's count window (see _sample_bound)
    list_search: str = "interp"  # the select kernel's search (one of SEARCHES but guess)
    # the build kernel selects the lists of at most `block` keys itself (the
    # select kernel then takes only the longer ones); one read of the row,
    # the select's compute overlapping other programs' reads
    inline_select: bool = LIST_INLINE_SELECT
    reverse: bool = True  # the build takes the last row of a batch first
    build_maxnreg: Optional[int] = None  # ptxas cap of the build kernel (None: its choice)
    prefetch: int = 0  # chunks the build prefetches to L2 ahead of its loads (sm_90+; 0: none)
    batch_rows: int = 0  # rows a batch holds at most (0: as many as LIST_SCRATCH holds)
    evict_first: bool = False  # the build's chunk loads marked evict-first
    scaled_sample: bool = False  # with row ends, shorter rows sample less (LIST_SCALED_SAMPLE)


def _by_row_length(S: int, setting, long, short):
    """A list-path setting for rows of S keys: the environment's ``setting``
    when set (not None), else ``long`` above LIST_ORDER_MAX_S keys and
    ``short`` up to it (the row order, the L2 prefetch, the sample's size and
    its scaling)."""
    return (long if S > LIST_ORDER_MAX_S else short) if setting is None else setting


def _list_plan(S: int, k: int, sample: Optional[int] = None) -> Optional[ListPlan]:
    """The list path's sizes, or None where it does not pay (k near S).

    A sample of n scores and its r-th largest key ``lo``: count(key >= lo)
    over the row is about r * S / n with a relative spread of 1 / sqrt(r)
    (binomial). r is the smallest with r - Z sqrt(r) >= k n / S, so that
    fewer than k keys reach ``lo`` only Z = 5 spreads out (about 3e-7 a row:
    such rows take the exact streaming fallback); the block holds the
    expected length + 2 spreads, the capacity + 7.
    """
    if k < 1 or S < 1024:
        return None
    fraction = _by_row_length(S, LIST_SAMPLE_FRACTION, 16, 8)
    n = sample or max(64, min(_by_row_length(S, LIST_SAMPLE_MAX, 4096, 8192), triton.next_power_of_2(S) // fraction))
    m = k * n / S
    z = _SAMPLE_Z.value
    rank = math.ceil(((z + math.sqrt(z**2 + 4 * m)) / 2) ** 2)
    slack = max(1, int(math.sqrt(rank) / 2))  # the bound's count window: about a quarter spread
    mean = (rank + slack) * S / n
    spread = math.sqrt(rank) * S / n
    block = max(16, triton.next_power_of_2(math.ceil(mean + 2 * spread)))
    cap = min(LIST_MAX, triton.next_power_of_2(math.ceil(mean + 7 * spread)))
    if block > LIST_MAX or 2 * mean > S:
        return None
    warps = LIST_SELECT_WARPS or (4 if block <= 4096 else 8)
    if LIST_INLINE_SELECT:
        # the select's block sets the registers (128 at 4096 keys, 4 warps,
        # sm_90a): chunks of 2048 cost none more and keep twice the bytes in flight
        chunk = LIST_INLINE_CHUNK if S > LIST_INLINE_SMALL else LIST_INLINE_CHUNK // 2
    else:
        chunk = LIST_CHUNK // 2 if S <= LIST_SMALL_CHUNK_MAX else LIST_CHUNK
    return ListPlan(sample=n, stride=S // (n // 8), rank=rank, block=block, cap=cap, select_warps=warps,
                    select_maxnreg=128 if block == 4096 and warps == 4 else None, slack=slack, chunk=chunk,
                    inline_select=LIST_INLINE_SELECT, reverse=_by_row_length(S, LIST_REVERSE, True, False),
                    prefetch=_by_row_length(S, LIST_PREFETCH, 4, 0),
                    build_maxnreg=128 if block == 4096 and LIST_INLINE_SELECT else None,
                    build_warps=LIST_BUILD_WARPS, batch_rows=LIST_BATCH_ROWS, evict_first=EVICT_FIRST,
                    scaled_sample=_by_row_length(S, LIST_SCALED_SAMPLE, True, False))


def _l2_prefetch_ok(scores: torch.Tensor) -> bool:
    """Whether the list build may prefetch rows of ``scores`` to L2: PTX on
    sm_90+ (the bulk prefetch) and every row start 16-byte aligned."""
    if not ptx.enabled(scores):
        return False
    target = fit.device_target(scores)
    return (target is not None and target.capability >= 90 and scores.data_ptr() % 16 == 0
            and scores.stride(0) * scores.element_size() % 16 == 0)


def _launch_list(scores: torch.Tensor, k: int, indices: torch.Tensor, lengths: torch.Tensor,
                 plan: ListPlan, ends: Optional[torch.Tensor] = None) -> None:
    """The list path, in row batches whose lists fit LIST_SCRATCH entries."""
    R, S = scores.shape
    dev = scores.device
    rows = max(1, min(R, LIST_SCRATCH // plan.cap, plan.batch_rows or R))
    vals = torch.empty((rows, plan.cap), dtype=torch.int32, device=dev)  # fp32 bit patterns
    poss = torch.empty((rows, plan.cap), dtype=torch.int32, device=dev)
    meta = torch.empty((rows, 2), dtype=torch.int32, device=dev)
    has_end = ends is not None
    end = ends if has_end else lengths  # never read without HAS_END
    build, *selects, fallback = route_specs(("list", plan), scores.dtype, ptx.enabled(scores), has_end,
                                            _l2_prefetch_ok(scores))
    if plan.inline_select:  # the build selects the lists of the first block itself
        selects = [sp for sp in selects if sp.constexprs["BLOCK"] != plan.block]
    for r0 in range(0, R, rows):
        n = min(rows, R - r0)
        build.fn[(n,)](scores, vals, poss, meta, end, indices, lengths, r0, n, S, k, scores.stride(0),
                       indices.stride(0), plan.rank, plan.slack, plan.stride, **build.launch_kwargs())
        for select in selects:  # the larger block takes the rows of longer lists
            len_lo = -1 if select.constexprs["BLOCK"] == plan.block else plan.block
            select.fn[(n,)](vals, poss, meta, indices, lengths, r0, k, indices.stride(0), len_lo,
                            **select.launch_kwargs())
        fallback.fn[(n,)](scores, meta, indices, lengths, end, r0, S, k, scores.stride(0), indices.stride(0),
                          **fallback.launch_kwargs())


def route_specs(route: Tuple[str, Any], dtype: torch.dtype, asm: bool, has_end: bool = False,
                l2_prefetch: bool = False) -> List[fit.KernelSpec]:
    """Every kernel a route launches for ``dtype`` scores (asm: whether
    ptx.store_i32 may emit PTX; has_end: rows read up to per-row ends;
    l2_prefetch: the list build may prefetch, see ``_l2_prefetch_ok``).
    Routes: ("list", ListPlan): build, select (a second one at the capacity
    when it exceeds the block), fallback; ("resident", (BLOCK_S,
    ResidentConfig)); ("stream", CHUNK)."""
    kind, p = route
    i32, el = "*i32", fit.ptr(dtype)
    if kind == "list":
        tiers = [(p.block, p.select_warps, {} if p.select_maxnreg is None else {"maxnreg": p.select_maxnreg})]
        tiers += [(p.cap, 8 if p.cap <= 8192 else 16, {})] if p.cap > p.block else []
        types = dict(val_ptr=i32, pos_ptr=i32, meta_ptr=i32, idx_ptr=i32, len_ptr=i32)
        search = SEARCHES.index(p.list_search)
        const = dict(CAP=p.cap, FILL=_FILL_BLOCK, ASM_STORE=asm, SEARCH=search)
        build_const = dict(CAP=p.cap, CHUNK=p.chunk, SAMPLE=p.sample, ASM_STORE=asm, HAS_END=has_end,
                           SELECT_BLOCK=p.block if p.inline_select else 0, SEARCH=search, FILL=_FILL_BLOCK,
                           REVERSE=p.reverse, WHOLE_MAX=p.block, PREFETCH=0, CHUNK_BYTES=0,
                           EVICT_FIRST=p.evict_first,
                           # a quarter of the sample keeps whole runs of 8
                           SCALED_SAMPLE=p.scaled_sample and has_end and p.sample >= 32)
        if l2_prefetch and p.prefetch > 0:
            build_const.update(PREFETCH=p.prefetch, CHUNK_BYTES=p.chunk * torch.finfo(dtype).bits // 8)
        build_warps = max(p.build_warps, p.select_warps) if p.inline_select else p.build_warps
        build_opts = {} if p.build_maxnreg is None else {"maxnreg": p.build_maxnreg}
        return [fit.KernelSpec(_list_build_kernel, dict(s_ptr=el, val_ptr=i32, pos_ptr=i32, meta_ptr=i32,
                                                        end_ptr=i32, idx_ptr=i32, len_ptr=i32),
                               build_const, build_warps, 1, build_opts),
                *(fit.KernelSpec(_list_select_kernel, types, dict(const, BLOCK=b), w, 3, o) for b, w, o in tiers),
                fit.KernelSpec(_list_fallback_kernel, dict(s_ptr=el, meta_ptr=i32, idx_ptr=i32, len_ptr=i32,
                                                           end_ptr=i32),
                               dict(CAP=p.cap, CHUNK=STREAM_CHUNK, FILL=_FILL_BLOCK, HAS_END=has_end), 8, 3)]
    types = dict(s_ptr=el, idx_ptr=i32, len_ptr=i32, end_ptr=i32)
    if kind == "stream":
        return [fit.KernelSpec(_topk_stream_kernel, types, dict(CHUNK=p, FILL=_FILL_BLOCK, HAS_END=has_end), 8, 3)]
    block_s, cfg = p
    kernel = _topk_resident_kernel if cfg.vec_load else _topk_resident_kernel_scalar
    const = dict(BLOCK_S=block_s, FILL=_FILL_BLOCK, **cfg.constexprs(dtype), ASM_STORE=asm, HAS_END=has_end)
    opts = {} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}
    return [fit.KernelSpec(kernel, types, const, cfg.num_warps, 3, opts)]


def pick(S: int, k: int, dtype: torch.dtype, target: Optional[fit.Target], asm: bool = True,
         resident_max: int = RESIDENT_MAX, chunk: int = STREAM_CHUNK, config: Optional[ResidentConfig] = None,
         list_min: int = LIST_MIN, plan: Optional[ListPlan] = None) -> Tuple[Optional[Tuple[str, Any]], str]:
    """(the first route for rows of S keys whose kernels all fit ``target``,
    "") or (None, why); keywords as in :func:`launch`. Ranked: the list path
    or the resident kernel where they apply, then streaming at halved chunks."""
    if plan is None and S >= list_min and config is None:
        plan = _list_plan(S, k)
    routes: Tuple[Tuple[str, Any], ...] = ()
    if plan is not None:
        routes = (("list", plan),)
    elif S <= resident_max:
        block_s = max(16, triton.next_power_of_2(S))
        routes = (("resident", (block_s, config or _resident_config(block_s))),)
    routes += tuple(("stream", c) for c in fit.halvings(chunk, 256))

    def spec_of(route) -> fit.KernelSpec:  # the route's kernel with the most shared memory
        specs = route_specs(route, dtype, asm)
        return specs[0] if target is None else max(specs, key=lambda sp: fit.shared_bytes(sp, target))

    return fit.pick(lambda: routes, spec_of, target, ("topk", dtype, asm, routes))


def tiles_reason(fn_name: str, a: TopkArgs) -> Optional[str]:
    """Why no top-k kernel fits a's device (None if one does)."""
    s = a.scores
    return pick(s.shape[1], a.topk, s.dtype, fit.device_target(s), ptx.enabled(s))[1] or None


def supports(a: TopkArgs) -> Optional[str]:
    s = a.scores
    if s.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"triton top-k takes fp32/fp16/bf16 scores, got {s.dtype}"
    if s.dim() != 2:
        return f"triton top-k takes a 2-D score matrix, got {s.dim()} dims"
    if s.shape[1] >= 2**31 or a.topk >= 2**31:
        return "triton top-k: row length and k must fit in int32"
    return None


def launch(scores: torch.Tensor, k: int, indices: torch.Tensor, lengths: torch.Tensor,
           resident_max: int = RESIDENT_MAX, chunk: int = STREAM_CHUNK, config: Optional[ResidentConfig] = None,
           list_min: int = LIST_MIN, plan: Optional[ListPlan] = None, ends: Optional[torch.Tensor] = None) -> None:
    """Top-k of each row of ``scores`` [R, S] into ``indices`` [R, k] and
    ``lengths`` [R] (both int32, rows unit-stride in the last dim). ``ends``
    (int32 [R], optional): row r is read only up to column ends[r] (clamped
    to [0, S]), as if the rest were -inf. The keywords override the kernel
    choice (tests and tuning): rows of at least ``list_min`` keys take the
    list path where ``_list_plan`` (or ``plan``) allows, else rows up to
    ``resident_max`` the resident kernel, else the streaming one (the first
    of ``pick``'s routes that fits the device)."""
    R, S = scores.shape
    route, why = pick(S, k, scores.dtype, fit.device_target(scores), ptx.enabled(scores), resident_max, chunk,
                      config, list_min, plan)
    if route is None:
        raise ValueError(why)
    if route[0] == "list":
        return _launch_list(scores, k, indices, lengths, route[1], ends)
    spec = route_specs(route, scores.dtype, ptx.enabled(scores), ends is not None)[0]
    spec.fn[(R,)](scores, indices, lengths, lengths if ends is None else ends, S, k, scores.stride(0),
                  indices.stride(0), **spec.launch_kwargs())


def topk(a: TopkArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    """scores [R, S] -> (indices [R, k] int32, lengths [R] int32); with
    a.row_ends (int32 [R]) every route reads row r only up to its end."""
    R = a.scores.shape[0]
    indices = torch.empty((R, a.topk), dtype=torch.int32, device=a.scores.device)
    lengths = torch.empty((R,), dtype=torch.int32, device=a.scores.device)
    launch(a.scores, a.topk, indices, lengths, ends=a.row_ends)
    return indices, lengths
