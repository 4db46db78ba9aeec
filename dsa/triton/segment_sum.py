"""The deterministic scatter-add of the Triton backwards: sort, then sum each segment.

A backward whose gradient rows are scattered to data-dependent destinations
(sparse attention's dkv, the indexer's dk) can add them with atomics (fast,
order left to the hardware) or, with ``deterministic=True``, write every
contribution to a workspace row and sum them here:

1. :func:`inverse_index`: the destination key of every workspace row (an
   out-of-range key for a row that contributes nothing) is sorted stably, so
   each destination owns a contiguous segment of workspace rows in ascending
   row order, and ``start[n]`` points at destination n's segment;
2. :func:`segment_sum_kernel`: one program per (destination, column block)
   sums its segment in that fixed order with a fixed reduction tree, over
   ``PARTS`` workspace copies (sparse attention writes one per head block).

Every sum has a fixed order, so the result is bitwise reproducible.

A backward that can write each contribution straight to its destination's
segment (the indexer's dk) skips the gather: :func:`slot_positions` sorts the
keys of every chunk of workspace rows once (one sort a step), giving each row
its position within its chunk's workspace and each chunk's ``start``; the
writer stores row i at ``pos[i]``, and :func:`grouped_segment_sum` sums
contiguous rows (the same kernel without ``ORDER``: whole 512-byte lines
streamed in order).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from dsa.triton import fit
from dsa.triton.rules import load_slots, row_length


@triton.jit
def segment_sum_kernel(
    SRC,  # [PARTS * part_rows, D] fp32 (or bf16) workspace rows, summed in fp32
    ORDER,  # [M] int64: workspace rows sorted by destination (stable); unused without GATHER
    START,  # [n_dst + 1] int64: destination n owns ORDER[START[n]:START[n+1]] (SRC rows, without GATHER)
    DST,  # [n_dst, D] fp32, added to
    part_rows,
    D: tl.constexpr,
    PARTS: tl.constexpr,
    BR: tl.constexpr,
    BD: tl.constexpr,
    GATHER: tl.constexpr = True,  # False: the rows are already grouped by destination
):
    row = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_d = o_d < D
    lo = tl.load(START + row)
    hi = tl.load(START + row + 1)
    if hi > lo:
        b_acc = tl.zeros([BD], tl.float32)
        for r0 in range(lo, hi, BR):
            o_r = r0 + tl.arange(0, BR)
            m_r = o_r < hi
            if GATHER:
                ref = tl.load(ORDER + o_r, mask=m_r, other=0)
            else:
                ref = o_r
            m = m_r[:, None] & m_d[None, :]
            for part in tl.static_range(PARTS):
                p = SRC + (part * part_rows + ref)[:, None] * D + o_d[None, :]
                # a fixed tree: the same bits every run
                b_acc += tl.sum(tl.load(p, mask=m, other=0.0).to(tl.float32), 0)
        p_dst = DST + row * D + o_d
        tl.store(p_dst, tl.load(p_dst, mask=m_d, other=0.0) + b_acc, mask=m_d)


# Bytes of per-slot rows a deterministic backward holds at once: the rows of
# as many query rows as fit are written, then summed, chunk by chunk.  A
# smaller budget means more chunks, each paying a sort, a launch over every
# destination and a last wave of partly idle SMs (the indexer's 64 MB chunks
# made its deterministic KL step 8.9x the default at V3.2; the cute sparse
# attention backward's at V3.2 took 32.3 ms with 1 GiB, 26.9 with 4 GiB and
# 27.2 with 8 GiB (bench/RESULTS.md C93), 26.5 with 4 GiB in whole waves
# (C95)).  A device holds at most 1 / WORKSPACE_SHARE of its memory in it.
WORKSPACE_BYTES = 4 << 30
WORKSPACE_SHARE = 16


def workspace_bytes(device: Optional[torch.device] = None) -> int:
    """The workspace budget on ``device``: ``WORKSPACE_BYTES``, at most
    1 / ``WORKSPACE_SHARE`` of a CUDA device's memory."""
    if device is None or device.type != "cuda":
        return WORKSPACE_BYTES
    return min(WORKSPACE_BYTES, torch.cuda.get_device_properties(device).total_memory // WORKSPACE_SHARE)


def chunk_rows(total: int, row_bytes: int, multiple: int = 1, device: Optional[torch.device] = None) -> int:
    """How many of ``total`` query rows (each ``row_bytes`` of workspace) one
    chunk of ``workspace_bytes(device)`` holds: at least 1, at most
    ``total``; a chunk shorter than ``total`` is rounded down to a multiple of
    ``multiple`` when it holds one (whole waves of a kernel's programs)."""
    rows = max(1, min(total, workspace_bytes(device) // row_bytes))
    if rows < total and rows >= multiple:
        rows -= rows % multiple
    return rows


def inverse_index(keys: torch.Tensor, n_dst: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(order, start) for workspace rows with destination ``keys`` [M] (int64;
    any key >= n_dst marks a row that is never summed): order [M] int64 lists
    the rows by destination, ascending within one, and destination n owns
    order[start[n]:start[n + 1]] (start [n_dst + 1] int64)."""
    dt = sort_dtype(n_dst + 1)
    sorted_keys, order = torch.sort(keys.clamp(max=n_dst).to(dt), stable=True)
    start = torch.searchsorted(sorted_keys, torch.arange(n_dst + 1, device=keys.device, dtype=dt))
    return order, start


def sort_dtype(span: int) -> torch.dtype:
    """The narrowest integer type holding keys in [0, span): a radix sort
    makes one pass per 8 bits of its keys (int16: 2, int32: 4, int64: 8)."""
    if span <= 2**15:
        return torch.int16
    return torch.int32 if span <= 2**31 else torch.int64


@triton.jit
def _slot_keys_kernel(IDX, LEN, OUT, K, N, rows, HAS_LEN: tl.constexpr, BK: tl.constexpr):
    """OUT[t * K + j] = c * (N + 1) + key of slot j of row t, c = t // rows its
    chunk, key its index where valid and N where not."""
    t = tl.program_id(0)
    o_n, m_n, idx, valid = load_slots(IDX, t, K, tl.program_id(1) * BK, row_length(LEN, t, K, HAS_LEN), N, BK)
    key = (t // rows).to(tl.int64) * (N + 1) + tl.where(valid, idx, N).to(tl.int64)
    tl.store(OUT + t.to(tl.int64) * K + o_n, key.to(OUT.dtype.element_ty), mask=o_n < K)


@triton.jit
def _place_kernel(ORDER, POS, M, chunk, BLOCK: tl.constexpr):
    """POS[ORDER[i]] = i - c * chunk: workspace row ORDER[i], of chunk
    c = ORDER[i] // chunk, ranks i-th in the sort, and chunk c's rows fill
    ranks [c * chunk, (c + 1) * chunk)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < M
    o = tl.load(ORDER + i, mask=m, other=0)
    tl.store(POS + o, (i - (o // chunk) * chunk).to(tl.int32), mask=m)


def slot_positions(indices: torch.Tensor, topk_length: Optional[torch.Tensor], n_dst: int,
                   rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(pos [T * K] int32, start [C, n_dst + 1] int64) for the slots of
    indices [T, K] (int32) with topk_length [T] int32 or None, each keyed by
    its index where valid and by n_dst where not (never summed;
    ``dsa._rules.slot_validity``), written in chunks of ``rows`` query rows
    (rows * K workspace rows, C chunks): slot i goes to position pos[i] of
    its chunk's workspace, where the rows of destination n are start[c, n]
    .. start[c, n + 1], in ascending i.  One stable sort of the keys
    c * (n_dst + 1) + key (computed in one kernel, in the narrowest integer
    type) orders them by chunk, destination, slot; another kernel places them."""
    T, K = indices.shape
    M = T * K
    C = max(1, -(-T // rows))
    if M == 0:
        return (torch.empty(0, device=indices.device, dtype=torch.int32),
                torch.zeros(C, n_dst + 1, device=indices.device, dtype=torch.int64))
    span = n_dst + 1
    dt = sort_dtype(C * span)
    keys = torch.empty(M, device=indices.device, dtype=dt)
    length = topk_length if topk_length is not None else indices
    BK = min(1024, triton.next_power_of_2(max(K, 1)))
    _slot_keys_kernel[(T, triton.cdiv(K, BK))](indices, length, keys, K, n_dst, rows,
                                               HAS_LEN=topk_length is not None, BK=BK, num_warps=4)
    comp_sorted, order = torch.sort(keys, stable=True)
    pos = torch.empty(M, device=indices.device, dtype=torch.int32)
    _place_kernel[(triton.cdiv(M, 1024),)](order, pos, M, rows * K, BLOCK=1024, num_warps=4)
    # destination n of chunk c begins where key c * span + n would sort, less the chunk's first rank
    dev = indices.device
    bounds = torch.arange(C, device=dev)[:, None] * span + torch.arange(span, device=dev)[None, :]
    start = torch.searchsorted(comp_sorted, bounds.flatten().to(dt)).view(C, span)
    return pos, start - torch.arange(C, device=dev)[:, None] * (rows * K)


def spec(D: int, parts: int, block_d: int, gather: bool = True, src: str = "*fp32") -> fit.KernelSpec:
    """16 rows of BD <= block_d columns a step: a few KB of shared memory at
    most, on every target."""
    BD = min(block_d, triton.next_power_of_2(D))
    types = dict(SRC=src, ORDER="*i64", START="*i64", DST="*fp32")
    return fit.KernelSpec(segment_sum_kernel, types, dict(D=D, PARTS=parts, BR=16, BD=BD, GATHER=gather),
                          2 if BD <= 64 else 4, 3)


def segment_sum(src: torch.Tensor, keys: torch.Tensor, dst: torch.Tensor, *, parts: int = 1,
                block_d: int = 64) -> None:
    """dst[n] += the sum of the rows of src whose key is n, in a fixed order.

    src [parts * M, D] fp32 holds ``parts`` copies of M workspace rows (summed
    together), keys [M] int64, dst [n_dst, D] fp32 contiguous."""
    n_dst, D = dst.shape
    order, start = inverse_index(keys, n_dst)
    s = spec(D, parts, block_d)
    segment_sum_kernel[(n_dst, triton.cdiv(D, s.constexprs["BD"]))](
        src, order, start, dst, keys.numel(), **s.launch_kwargs())


def grouped_segment_sum(src: torch.Tensor, start: torch.Tensor, dst: torch.Tensor, *, block_d: int = 64) -> None:
    """dst[n] += src[start[n]:start[n + 1]].sum(0), rows in order, in fp32
    (one chunk of :func:`slot_positions`). src [M, D] fp32 or bf16,
    start [n_dst + 1] int64, dst [n_dst, D] fp32 contiguous."""
    n_dst, D = dst.shape
    s = spec(D, 1, block_d, gather=False, src="*bf16" if src.dtype == torch.bfloat16 else "*fp32")
    segment_sum_kernel[(n_dst, triton.cdiv(D, s.constexprs["BD"]))](
        src, start, start, dst, src.shape[0], **s.launch_kwargs())
