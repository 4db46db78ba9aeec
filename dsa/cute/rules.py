"""The contract's validity rules on the device, for the CuTe DSL kernels.

docs/semantics.md states them; ``dsa._rules`` is their host form.  A row
(token t, kv head g) has the slots ``[0, L)`` with L = clamp(topk_length[t],
0, K) (K without ``topk_length``); slot s is valid when s < L and its index n
satisfies 0 <= n < N.  A kernel decides validity in one place, where it
resolves the source row of each slot (``slot_source``):

* an invalid slot reads a row of zeros instead of kv, so NaN or Inf stored
  in a kv row that no valid slot names never enters a tile;
* its score mask is -inf (0 for a valid slot), added to S;
* no index past L is read (``fetch_indices``), and a kernel's loop over
  blocks of slots ends at the last block holding a slot below L
  (``block_count``).

A decode kernel reads a paged cache (``PagedCache``,
``paged_block_sources``): an index is a slot page * page_size + offset, or
with a block table a position of the row's sequence, valid below
seq_lens[b] and where the table's page is in [0, P).

Row maxima are kept in the log2 domain; a row with no valid slot so far
keeps the maximum -inf and is shifted by 0 (``finite_shift``), so that no
(-inf) - (-inf) appears, and its lse is +inf (``row_lse``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from dsa.cute.gmem import load

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@cute.jit
def row_length(len_ptr: cute.Pointer, t, K, has_len: cutlass.Constexpr):
    """L = clamp(topk_length[t], 0, K) (int32 topk_length), or K when the
    call has none (``len_ptr`` is then never read)."""
    L = K
    if const_expr(has_len):
        L = load(len_ptr, Int64(t))
        L = cutlass.max(Int32(0), cutlass.min(L, K))
    return L


def block_count(L, block: int):
    """The blocks of ``block`` slots that hold the slots [0, L): a loop over
    blocks ends after the last one holding a valid slot."""
    return (L + block - 1) // block


@cute.jit
def fetch_indices(ns, idx_row: cute.Pointer, block, block_slots: cutlass.Constexpr, first, stride: cutlass.Constexpr,
                  L):
    """ns[m] <- the index of slot block * block_slots + first + stride * m
    (this thread's slots of a block; int32 indices of one row at
    ``idx_row``), all loads issued with no branch between them so that they
    fly together.  A slot past L reads slot L - 1 instead (nothing past
    topk_length is read; ``slot_source`` drops it); nothing is read when
    L == 0."""
    if L > 0:
        for m in cutlass.range_constexpr(cute.size(ns)):
            slot = block * block_slots + first + m * stride
            ns[m] = load(idx_row, Int64(cutlass.min(slot, L - 1)))


@cute.jit
def slot_source(slot, L, n, N, kv_ptr: cute.Pointer, zero_ptr: cute.Pointer, g,
                G: cutlass.Constexpr, row_bytes: cutlass.Constexpr):
    """(byte address, mask) of slot ``slot`` whose index is ``n``: the kv row
    (n, g) of a [N, G, row_bytes] tensor at ``kv_ptr`` and mask 0 when the
    slot is valid (slot < L, 0 <= n < N), else the zero row at ``zero_ptr``
    and mask -inf.  ``n`` is only looked at for a slot below L."""
    addr = zero_ptr.toint()
    mask = -Float32.inf
    if slot < L:
        if n >= 0 and n < N:
            addr = kv_ptr.toint() + (Int64(n) * Int64(G) + Int64(g)) * Int64(row_bytes)
            mask = Float32(0.0)
    return addr, mask


@cute.jit
def slot_index(idx_row: cute.Pointer, slot, L):
    """The index of slot ``slot`` of a row, or -1 (invalid) for a slot at or
    past L, whose index is never read."""
    n = Int32(-1)
    if slot < L:
        n = load(idx_row, Int64(slot))
    return n


@cute.jit
def block_sources(base, mk, ns, block, L, N, kv_ptr: cute.Pointer, zero_ptr: cute.Pointer, g,
                  G: cutlass.Constexpr, row_bytes: cutlass.Constexpr, col_bytes,
                  block_slots: cutlass.Constexpr, row_in_pass, rows_per_pass: cutlass.Constexpr):
    """The sources of one copying thread's rows of a block: for its m-th row,
    slot ``block * block_slots + row_in_pass + rows_per_pass * m`` whose index
    is ns[m], base[m] = the byte address it copies from (``slot_source``'s
    row, plus ``col_bytes``) and mk[m] = its mask (0 valid, -inf not)."""
    for m in cutlass.range_constexpr(block_slots // rows_per_pass):
        slot = block * block_slots + row_in_pass + m * rows_per_pass
        addr, mask = slot_source(slot, L, ns[m], N, kv_ptr, zero_ptr, g, G, row_bytes)
        base[m] = addr + col_bytes
        mk[m] = mask


@cute.jit
def walk_blocks(visit, idx_row: cute.Pointer, n_blocks, L, N, kv_ptr: cute.Pointer, zero_ptr: cute.Pointer, g,
                G: cutlass.Constexpr, row_bytes: cutlass.Constexpr, col_bytes, block_slots: cutlass.Constexpr,
                row_in_pass, rows_per_pass: cutlass.Constexpr):
    """A gathering thread's walk over a row's blocks in order: for block i,
    ``visit(i, base, mk)`` with its ``block_sources``.  The indices of blocks
    2 p and 2 p + 1 sit in two register sets, each refilled two blocks ahead
    of its use, so a block's sources never wait out its index loads."""
    R = block_slots // rows_per_pass
    ns = (cute.make_rmem_tensor((R,), Int32), cute.make_rmem_tensor((R,), Int32))
    base = cute.make_rmem_tensor((R,), Int64)
    mk = cute.make_rmem_tensor((R,), Float32)
    for h in cutlass.range_constexpr(2):
        fetch_indices(ns[h], idx_row, h, block_slots, row_in_pass, rows_per_pass, L)
    for i0 in cutlass.range(0, n_blocks, 2, unroll=1):
        for h in cutlass.range_constexpr(2):
            i = i0 + h
            if i < n_blocks:
                block_sources(base, mk, ns[h], i, L, N, kv_ptr, zero_ptr, g, G, row_bytes, col_bytes, block_slots,
                              row_in_pass, rows_per_pass)
                if i + 2 < n_blocks:
                    fetch_indices(ns[h], idx_row, i + 2, block_slots, row_in_pass, rows_per_pass, L)
                visit(i, base, mk)


@dataclass(frozen=True)
class PagedCache:
    """A decode kernel's KV cache (docs/semantics.md, "Sparse decode"): pages
    of ``page_size`` tokens ``page_stride`` bytes apart, token ``o`` of a
    page at byte ``o * G * row_bytes``, kv head g ``g * row_bytes`` further
    (an FP8 token is one row of ``row_bytes`` = its record).  With a block
    table an index is a position p of the row's sequence, looked up in the
    sequence's row of ``bt_ptr`` ([B, bt_w] int32); without one it is the
    slot page * page_size + offset.  Built once per kernel, never
    reassigned."""

    kv_ptr: Any
    zero_ptr: Any      # the row an invalid slot reads
    n_pages: Any       # Int32
    page_stride: Any   # Int64, bytes
    bt_ptr: Any
    bt_w: Any          # Int32: pages of the block table a sequence
    seqlen_ptr: Any
    page_size: int
    G: int
    row_bytes: int
    has_bt: bool
    has_seqlen: bool

    @cute.jit
    def sequence(self, seq):
        """(the sequence's block-table row, the positions it may address):
        without a block table, the cache's slots and no row."""
        bt_row = self.bt_ptr
        lim = self.n_pages * self.page_size
        if const_expr(self.has_bt):
            bt_row = self.bt_ptr + Int64(seq) * Int64(self.bt_w)
            lim = self.bt_w * self.page_size
            if const_expr(self.has_seqlen):
                # positions from seq_lens[b] on are invalid
                lim = cutlass.min(lim, load(self.seqlen_ptr, Int64(seq)))
        return bt_row, lim


@cute.jit
def paged_block_sources(base, mk, ns, block, L, cache: PagedCache, g, bt_row, lim, col_bytes,
                        block_slots: cutlass.Constexpr, row_in_pass, rows_per_pass: cutlass.Constexpr,
                        offs=None):
    """``block_sources`` for a paged cache: slot s (index n, below L) is
    valid iff 0 <= n < lim (``PagedCache.sequence``) and, with a block
    table, its page bt_row[n // page_size] is in [0, n_pages); its row is
    offset n % page_size of that page.  Every block-table entry looked up
    is inside the sequence's row (a bad position is clamped there, then
    masked), and all lookups issue before any is used.  offs, when given,
    receives each row's offset in its page (0 for the zero row).  The
    thread's rows are as many as ``mk`` holds (block_slots // rows_per_pass,
    or fewer when several warpgroups share a block's slots)."""
    R = cute.size(mk)
    PS = cache.page_size
    pages = cute.make_rmem_tensor((R,), Int32)
    ids = cute.make_rmem_tensor((R,), Int32)
    for m in cutlass.range_constexpr(R):
        # ns[m] was read only for a slot below L (fetch_indices): 0 stands in past it
        n = Int32(0)
        if block * block_slots + row_in_pass + m * rows_per_pass < L:
            n = ns[m]
        ids[m] = n
    if const_expr(cache.has_bt):
        for m in cutlass.range_constexpr(R):
            col = cutlass.min(cutlass.max(ids[m], Int32(0)) // PS, cache.bt_w - 1)
            pages[m] = load(bt_row, Int64(col))
    for m in cutlass.range_constexpr(R):
        slot = block * block_slots + row_in_pass + m * rows_per_pass
        n = ids[m]
        addr = cache.zero_ptr.toint()
        mask = -Float32.inf
        off = Int32(0)
        if slot < L:
            if n >= 0:
                if n < lim:
                    page = n // PS
                    if const_expr(cache.has_bt):
                        page = pages[m]
                    if page >= 0:
                        if page < cache.n_pages:
                            off = n % PS
                            addr = (cache.kv_ptr.toint() + Int64(page) * cache.page_stride
                                    + Int64(off * cache.G + g) * Int64(cache.row_bytes))
                            mask = Float32(0.0)
        base[m] = addr + col_bytes
        mk[m] = mask
        if const_expr(offs is not None):
            offs[m] = off


@cute.jit
def finite_shift(m):
    """The subtrahend of exp2(x - m): m, or 0 for a row whose maximum is -inf."""
    mu = m
    if m == -Float32.inf:
        mu = Float32(0.0)
    return mu


@cute.jit
def row_lse(mu, l, r: cutlass.Constexpr):
    """lse (natural log) of row r from the register tensors ``mu`` (shifted
    log2-domain maxima, ``finite_shift``) and ``l`` (row sums): +inf for a
    row with no valid slot (l == 0)."""
    lse = Float32.inf
    if l[r] != 0.0:
        lse = (mu[r] + cute.math.log2(l[r], fastmath=False)) * LN2
    return lse
