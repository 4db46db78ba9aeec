"""Pieces shared by the sparse-attention forward and backward kernels.

Column chunks.  Triton tiles must be powers of two, but the head dims are only
multiples of 16 (V3.2: D = 576 = 512 latent + 64 RoPE, d_v = 512).  Padding
576 to 1024 would nearly double the gather traffic and the QK^T work, so a
row's D columns are cut exactly into power-of-two chunks, V columns first::

    d_v = 512 -> (0, 256) (256, 256)   then D - d_v = 64 -> (512, 64)

The kernels hold one register / shared tile per chunk (Triton tuples, indexed
with static_range) and sum the QK^T products over the chunks; the first NV
chunks are V and get a P@V accumulator each.  Smaller chunks also keep the
live ranges of the backward's per-slot dkv tiles short.

Validity (dsa/triton/rules.py): every gather is masked with slot validity,
so an invalid slot is never read; row offsets are int64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import triton
import triton.language as tl


def _pow2_parts(n: int, max_w: int) -> list:
    """n (a multiple of 16) as a sum of powers of two <= max_w, largest first."""
    parts = []
    while n > 0:
        w = min(max_w, 1 << (n.bit_length() - 1))
        parts.append(w)
        n -= w
    return parts


@dataclass(frozen=True)
class ColumnChunks:
    """The column chunks of a q / kv row (see the module header)."""

    OFFS: Tuple[int, ...]
    WS: Tuple[int, ...]
    NV: int  # the first NV chunks are the V columns [0, d_v)

    @staticmethod
    def of(D: int, d_v: int, max_w: int = 256) -> "ColumnChunks":
        ws = _pow2_parts(d_v, max_w)
        nv = len(ws)
        ws += _pow2_parts(D - d_v, max_w)
        offs, o = [], 0
        for w in ws:
            offs.append(o)
            o += w
        return ColumnChunks(tuple(offs), tuple(ws), nv)

    def kernel_args(self) -> dict:
        return dict(OFFS=self.OFFS, WS=self.WS, NV=self.NV)


@triton.jit
def load_chunks(p_rows, m_rows, OFFS: tl.constexpr, WS: tl.constexpr,
                FIRST: tl.constexpr, LAST: tl.constexpr):
    """Tuple of the [R, WS[c]] blocks of chunks FIRST <= c < LAST of the rows
    p_rows (pointers [R]); rows where m_rows is False read as 0 (not loaded)."""
    bs = ()
    for c in tl.static_range(FIRST, LAST):
        o_c = OFFS[c] + tl.arange(0, WS[c])
        bs = bs + (tl.load(p_rows[:, None] + o_c[None, :], mask=m_rows[:, None], other=0.0),)
    return bs


@triton.jit
def store_chunks(p_rows, m_rows, bs, OFFS: tl.constexpr, WS: tl.constexpr,
                 FIRST: tl.constexpr, LAST: tl.constexpr):
    for c in tl.static_range(FIRST, LAST):
        o_c = OFFS[c] + tl.arange(0, WS[c])
        tl.store(p_rows[:, None] + o_c[None, :], bs[c - FIRST], mask=m_rows[:, None])
