"""The static persistent tile schedule shared by the CuTe DSL attention kernels.

A tile is one (token t, kv head g, block of query heads of that kv head);
tiles are numbered with head blocks fastest, then kv heads, then tokens, so
that the tiles of one (t, g) run side by side and the second one's gathers
hit the kv rows the first just pulled into L2.  The grid has
``grid_size(ctas, n_tiles)`` CTAs and CTA c runs the tiles c, c + grid,
c + 2 grid, ...: ``ctas`` = the tile count gives one tile a CTA, the SM
count a persistent grid whose CTAs overlap one tile's loads with the
previous tile's tail.  The same compiled kernel serves both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from dsa.cute import rules
from dsa.cute.gmem import load

# Query heads per kv head served as one tile of ``block_h`` rows whose rows
# past the heads are zero (a tensor-parallel shard of a 64- or 128-head
# model), where a kernel supports it.
PADDED_HEADS = (16, 32)


@dataclass(frozen=True)
class ProblemConfig:
    """The static problem a compiled attention kernel serves, the first
    fields of every kernel's config (its compile key): dtype
    ``cutlass.BFloat16`` or ``cutlass.Float16``; D the q / kv head dim, d_v
    the value columns; H query heads over G kv heads; has_len: the call
    passes ``topk_length``."""

    dtype: Any
    D: int
    d_v: int
    H: int
    G: int
    has_len: bool


def kernel_reason(dtype, D: int, d_v: int, H: int, G: int, block_h: int, smem_bytes: Callable[[int, int, int], int],
                  smem_limit: int, arch: str, padded: tuple = ()) -> Optional[str]:
    """Why an attention kernel over blocks of ``block_h`` query heads cannot
    serve this problem (None if it can): the dtypes, head dims and head
    counts every arch's kernel is built for (``padded``: the head counts a
    kv head below ``block_h`` it serves as one padded tile), then the
    kernel's shared memory (``smem_bytes(D, d_v, element bytes)``) against
    its arch's CTA limit.  dtype: ``cutlass.BFloat16`` / ``cutlass.Float16``
    (anything else is refused, named as given)."""
    why = head_block_reason(dtype, D, d_v, H, G, block_h, padded)
    if why is not None:
        return why
    need = smem_bytes(D, d_v, dtype.width // 8)
    if need > smem_limit:
        return f"needs {need} bytes of shared memory, more than the {smem_limit} of an {arch} CTA"
    return None


def head_block_reason(dtype, D: int, d_v: int, H: int, G: int, block_h: int, padded: tuple = ()) -> Optional[str]:
    """Why a kernel over blocks of ``block_h`` query heads (and the padded
    head counts ``padded``) cannot serve these dtypes, head dims and head
    counts: the rule every attention kernel of the tier shares."""
    if dtype not in (cutlass.BFloat16, cutlass.Float16):
        return f"dtype {dtype} is not bf16 or fp16"
    if D not in (512, 576) or d_v != 512:
        return f"D={D}, d_v={d_v}: the cute kernel serves D in (512, 576) with d_v = 512"
    if G <= 0 or H % G:
        return f"{H} query heads do not split over {G} kv heads"
    if (H // G) % block_h and H // G not in padded:
        also = f", or one of {padded}" if padded else ""
        return f"{H // G} query heads per kv head: the cute kernel needs a multiple of {block_h}{also}"
    return None


def tile_count(T, G: int, head_blocks: int):
    """Tiles of a call: T tokens x G kv heads x ``head_blocks`` head blocks."""
    return T * G * head_blocks


def grid_size(ctas, n_tiles):
    """The CTAs launched for ``ctas`` requested: never more than the tiles."""
    return cutlass.min(ctas, n_tiles)


@dataclass(frozen=True)
class TileScheduler:
    """This CTA's tiles: ``for tile_id in cutlass.range(s.first, s.n_tiles,
    s.stride, unroll=1)``, each decoded by ``decode``.  Built once per kernel
    (``create``) and never reassigned, so it travels as plain Python."""

    first: Any       # Int32: this CTA's index, its first tile
    n_tiles: Any     # Int32
    stride: Any      # Int32: the grid size
    G: int           # kv heads
    head_blocks: int  # head blocks per kv head

    @staticmethod
    def create(n_tiles, G: int, head_blocks: int) -> "TileScheduler":
        cta, _, _ = cute.arch.block_idx()
        n_cta, _, _ = cute.arch.grid_dim()
        return TileScheduler(cta, n_tiles, n_cta, G, head_blocks)

    def decode(self, tile_id):
        """(row, t, g, head block) of tile ``tile_id``; row = t * G + g, the
        (token, kv head) row of the indices."""
        row = tile_id // self.head_blocks
        hblk = tile_id - row * self.head_blocks
        t = row // self.G
        g = row - t * self.G
        return row, t, g, hblk


def snake_position(p, stride, n_tiles, min_, select):
    """The tile a persistent grid of ``stride`` CTAs runs at position p of
    ``range(n_tiles)`` (CTA c takes the positions c, c + stride, ...): round
    r = p // stride runs the tiles of the same round, in reverse on odd
    rounds (the last round over its ``n_tiles - r stride`` tiles only).
    Over tiles sorted by descending cost, every CTA then gets one of the
    costliest and one of the cheapest of each pair of rounds, which evens
    their sums out.  min_ and select (cond, a, b) are the caller's: Python's
    on the host, the DSL's in a kernel."""
    r = p // stride
    j = p - r * stride
    width = min_(stride, n_tiles - r * stride)
    return r * stride + select(r % 2 == 1, width - 1 - j, j)


@dataclass(frozen=True)
class SlotTiles:
    """This CTA's tiles of an attention kernel over top-k slots and what
    decoding one needs: the indices [T * G, K] and topk_length [T] (read
    only when the call has one).  order (int64 [T], or None): the tokens by
    descending topk_length, tiles taken in that token order along
    ``snake_position``, so that a persistent grid's CTAs get even shares of
    unequal rows.  Built once per kernel, never reassigned."""

    sched: TileScheduler
    idx_ptr: Any
    len_ptr: Any
    K: Any
    order: Any = None

    @cute.jit
    def tile(self, tile_id, HG: cutlass.Constexpr, block_h: cutlass.Constexpr, block: cutlass.Constexpr,
             has_len: cutlass.Constexpr):
        """Tile tile_id of HG query heads per kv head in blocks of block_h:
        (token t, kv head g, first query head head0, slots [0, L) that may be
        valid (``rules.row_length``), blocks of ``block`` slots holding them,
        the row's indices)."""
        if const_expr(self.order is not None):
            tile_id = snake_position(tile_id, self.sched.stride, self.sched.n_tiles, cutlass.min, cutlass.select_)
        row, t, g, hblk = self.sched.decode(tile_id)
        if const_expr(self.order is not None):
            t = Int32(load(self.order, Int64(t)))
            row = t * self.sched.G + g
        head0 = g * HG + hblk * block_h
        L = rules.row_length(self.len_ptr, t, self.K, has_len)
        n_blocks = rules.block_count(L, block)
        return t, g, head0, L, n_blocks, self.idx_ptr + Int64(row) * Int64(self.K)


@dataclass(frozen=True)
class SplitSlotTiles:
    """The tiles of a decode kernel: (token t, kv head g, head block, split),
    numbered head blocks fastest, then splits, then (t, g) rows, so that the
    CTAs reading the same slots run side by side.  Split s of a row covers
    its slots [s * chunk, min((s + 1) * chunk, L)) (chunk a whole number of
    blocks), renumbered from 0: the kernel body sees a row of that length
    whose indices start at slot s * chunk.  topk_length has one entry per
    ``len_div`` rows; row t belongs to sequence t // rows_per_seq.  Built
    once per kernel, never reassigned."""

    sched: TileScheduler
    idx_ptr: Any
    len_ptr: Any
    K: Any
    chunk: Any        # Int32: slots of a split
    n_split: Any      # Int32
    len_div: Any      # Int32
    rows_per_seq: Any  # Int32

    @cute.jit
    def tile(self, tile_id, HG: cutlass.Constexpr, block_h: cutlass.Constexpr, block: cutlass.Constexpr,
             has_len: cutlass.Constexpr):
        """(t, g, head0, L, n_blocks, idx_row, (sequence, split)) with L and
        idx_row those of the split (``SlotTiles.tile``'s meaning otherwise)."""
        hb = self.sched.head_blocks
        rest = tile_id // hb
        hblk = tile_id - rest * hb
        row = rest // self.n_split
        split = rest - row * self.n_split
        t = row // self.sched.G
        g = row - t * self.sched.G
        head0 = g * HG + hblk * block_h
        lo = split * self.chunk
        L = rules.row_length(self.len_ptr, t // self.len_div, self.K, has_len)
        L = cutlass.max(cutlass.min(L - lo, self.chunk), 0)
        n_blocks = rules.block_count(L, block)
        idx_row = self.idx_ptr + (Int64(row) * Int64(self.K) + Int64(lo))
        return t, g, head0, L, n_blocks, idx_row, (t // self.rows_per_seq, split)
