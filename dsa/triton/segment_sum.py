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
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from dsa.triton import fit


@triton.jit
def segment_sum_kernel(
    SRC,  # [PARTS * part_rows, D] fp32 workspace rows
    ORDER,  # [M] int64: workspace rows sorted by destination (stable)
    START,  # [n_dst + 1] int64: destination n owns ORDER[START[n]:START[n+1]]
    DST,  # [n_dst, D] fp32, added to
    part_rows,
    D: tl.constexpr,
    PARTS: tl.constexpr,
    BR: tl.constexpr,
    BD: tl.constexpr,
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
            ref = tl.load(ORDER + o_r, mask=m_r, other=0)
            m = m_r[:, None] & m_d[None, :]
            for part in tl.static_range(PARTS):
                p = SRC + (part * part_rows + ref)[:, None] * D + o_d[None, :]
                b_acc += tl.sum(tl.load(p, mask=m, other=0.0), 0)  # a fixed tree: the same bits every run
        p_dst = DST + row * D + o_d
        tl.store(p_dst, tl.load(p_dst, mask=m_d, other=0.0) + b_acc, mask=m_d)


# Bytes of per-slot fp32 rows a deterministic backward holds at once: the
# rows of as many query rows as fit are written, then summed, chunk by chunk.
# A smaller budget means more chunks, each paying a sort and a launch over
# every destination (the indexer's 64 MB chunks made its deterministic KL step
# 8.9x the default at V3.2).
WORKSPACE_BYTES = 1 << 30


def chunk_rows(total: int, row_bytes: int) -> int:
    """How many of ``total`` query rows (each ``row_bytes`` of workspace) one
    chunk of ``WORKSPACE_BYTES`` holds: at least 1, at most ``total``."""
    return max(1, min(total, WORKSPACE_BYTES // row_bytes))


def inverse_index(keys: torch.Tensor, n_dst: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(order, start) for workspace rows with destination ``keys`` [M] (int64;
    any key >= n_dst marks a row that is never summed): order [M] int64 lists
    the rows by destination, ascending within one, and destination n owns
    order[start[n]:start[n + 1]] (start [n_dst + 1] int64)."""
    sorted_keys, order = torch.sort(keys, stable=True)
    start = torch.searchsorted(sorted_keys, torch.arange(n_dst + 1, device=keys.device))
    return order, start


def spec(D: int, parts: int, block_d: int) -> fit.KernelSpec:
    """16 rows of BD <= block_d columns a step: a few KB of shared memory at
    most, on every target."""
    BD = min(block_d, triton.next_power_of_2(D))
    types = dict(SRC="*fp32", ORDER="*i64", START="*i64", DST="*fp32")
    return fit.KernelSpec(segment_sum_kernel, types, dict(D=D, PARTS=parts, BR=16, BD=BD), 2 if BD <= 64 else 4, 3)


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
