"""The dkv reduction shared by the CuTe DSL backwards (SM90 and SM100).

A backward computes dKV of a block of 64 slots one [64 slots, 64 columns]
chunk at a time, fp32, and adds each chunk into the rows of its slots'
kv rows (``red.global.add.v4.f32``), or stores it per slot for the
deterministic reduction (``st.global.v4.f32``); with per-row quanta
(``dsa.triton.dk_quanta``: 1 / Q and Q of each destination row; or
``dsa.triton.dkv_quanta``: one constant 1.5 2^23 Q a row) each value is
first rounded to a multiple of its row's Q, which makes the adds exact and
so order-free.  The chunk arrives in
registers in the MMA accumulator's fragment order (SM90's wgmma m64n64
accumulator; on SM100 a ``tcgen05.ld.16x256b`` of the TMEM accumulator,
which hands out the same fragment): thread i of warp w holds rows
``16 w + i / 4 + 8 r`` (r = 0, 1) and columns ``8 j + 2 (i % 4) + e``
(j = 0..7, e = 0, 1) at register ``4 j + 2 r + e``.

The dkv buffer holds each row's columns in that fragment order (position
``4 q + 2 h + e`` of a 16-column group holds column ``8 h + 2 q + e``; the
host's ``sparse_attention_bwd.natural_columns`` puts them back), so a
thread's four floats of a group are adjacent: one 16-byte add.  Lanes l and
l ^ 4 hold rows 2 p and 2 p + 1 and swap half their values with one shuffle
each (``scatter``), so that every warp instruction covers four whole
128-byte lines.

* ``dkv_row0`` / ``slot_rows``: where a thread's rows go (validity included);
* ``scatter``: a chunk's registers into those rows;
* ``global_f32`` / ``evict_last_policy``: the vector add / store and the L2
  policy that keeps dkv resident while gathered kv rows stream through;
* ``quantize`` / ``round_to_grid``: x rounded to the nearest multiple of
  Q (ties to even), by a conversion or by two adds.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from dsa.cute import rules
from dsa.cute.gmem import EVICT_LAST, l2_policy, load

RED_ADD = "red.relaxed.gpu.global.add"
STORE = "st.global"
BN = 64  # slots of a block: the rows of a chunk


@dsl_user_op
def global_f32(op: str, addr: Int64, *values: Float32, policy: Optional[Int64] = None, loc=None,
               ip=None) -> None:
    """``op``.v{n}.f32 of the n = len(values) adjacent fp32 at global address
    addr (aligned to 4 n bytes): op ``RED_ADD`` adds them atomically,
    ``STORE`` stores them; with an L2 cache ``policy``
    (``evict_last_policy``) under that policy."""
    n = len(values)
    regs = ", ".join(f"${i + 1}" for i in range(n))
    operands = [Int64(addr).ir_value(loc=loc, ip=ip)] + [Float32(x).ir_value(loc=loc, ip=ip) for x in values]
    hint, tail, cons = "", "", ""
    if policy is not None:
        hint, tail, cons = ".L2::cache_hint", f", ${n + 1}", ",l"
        operands.append(Int64(policy).ir_value(loc=loc, ip=ip))
    llvm.inline_asm(
        None, operands,
        f"{op}{hint}.v{n}.f32 [$0], {{{regs}}}{tail};",
        "l," + ",".join("f" * n) + cons,
        has_side_effects=True,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip,
    )


@dsl_user_op
def quantize(x: Float32, inv_q: Float32, q: Float32, *, loc=None, ip=None) -> Float32:
    """rint(x * inv_q) * q: x on the grid of q (inv_q = 1 / q, both powers
    of two, so both products are exact); NaN and Inf stay."""
    asm = "{ .reg .f32 r; mul.rn.f32 r, $1, $2; cvt.rni.f32.f32 r, r; mul.rn.f32 $0, r, $3; }"
    operands = [Float32(v).ir_value(loc=loc, ip=ip) for v in (x, inv_q, q)]
    return Float32(llvm.inline_asm(T.f32(), operands, asm, "=f,f,f,f", has_side_effects=False,
                                   is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def round_to_grid(x: Float32, magic: Float32, *, loc=None, ip=None) -> Float32:
    """(x + magic) - magic for magic = 1.5 2^23 Q (Q a power of two): x on
    the grid of Q, exact for |x| <= 2^22 Q (x + magic then lies where fp32's
    spacing is Q).  Two adds at the full fp32 rate, where ``quantize``'s
    conversion issues at a fraction of it; magic 0 leaves x as it is.  The
    adds are one asm block so that no compiler folds them away."""
    asm = "{ .reg .f32 r; add.rn.f32 r, $1, $2; sub.rn.f32 $0, r, $2; }"
    operands = [Float32(v).ir_value(loc=loc, ip=ip) for v in (x, magic)]
    return Float32(llvm.inline_asm(T.f32(), operands, asm, "=f,f,f", has_side_effects=False,
                                   is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


def evict_last_policy() -> Int64:
    """An L2 cache policy that keeps the lines it touches ahead of normal ones."""
    return l2_policy(EVICT_LAST)


@cute.jit
def dkv_row0(deterministic: cutlass.Constexpr, G: cutlass.Constexpr, tl, g, hb, T, K):
    """The dkv buffer row of the tile's slot 0 (deterministic: the per-slot
    buffer [HB, T, G, K, D] of the launch's T tokens, slot j at row0 + j) or,
    atomic, the kv head g (kv row n is n G + row0); tl is the token within
    the launch, hb the head block.  Computed once a tile so that the loop
    keeps one value live, not five."""
    row0 = Int64(g)
    if const_expr(deterministic):
        row0 = ((Int64(hb) * Int64(T) + Int64(tl)) * Int64(G) + Int64(g)) * Int64(K)
    return row0


@cute.jit
def slot_rows(rows, rok, i, row_lo, lane, L, row0, idx_row, dkv_ptr, N, G: cutlass.Constexpr,
              D: cutlass.Constexpr, deterministic: cutlass.Constexpr, quanta=None, qz=None, magic=None, mz=None):
    """For each slot row of block i this thread writes (rows of a dKV chunk):
    whether it is valid (``rok``, 0 / 1) and the byte address the thread
    writes at (``rows``, int64).  Entry 2 r + k is row 2 p + k + 8 r of its
    quad pair (p = row_lo // 2), at the offset of the half of each 128-byte
    line the thread writes for that row.  row0: ``dkv_row0`` of the tile;
    validity is ``rules.slot_index``'s (no index past L is read).  With
    ``quanta`` (fp32 [N, 2]: 1 / Q, Q of each kv row; G = 1) entries
    2 s, 2 s + 1 of ``qz`` get those of entry s's row (0 where invalid).
    With ``magic`` (fp32, one grid constant per accumulator row, indexed as
    the rows: n G + row0) entry s of ``mz`` gets entry s's (0 where
    invalid)."""
    odd = row_lo % 2
    for s_ in cutlass.range_constexpr(4):
        r, k = s_ // 2, s_ % 2
        row = row_lo - odd + k + 8 * r
        # its 4 floats of a 16-column group sit at 4 q, in the first group
        # of a line for its own row, the second for its partner's
        col = 4 * (lane % 4) + 16 * (odd if k == 0 else 1 - odd)
        slot = i * BN + row
        n = rules.slot_index(idx_row, slot, L)  # -1 past L: invalid without a read
        v = Int32(0)
        off = Int64(0)
        if n >= 0 and n < N:
            v = Int32(1)
            if const_expr(deterministic):
                off = row0 + Int64(slot)
            else:
                off = Int64(n) * Int64(G) + row0
        if const_expr(quanta is not None):
            iq, qq = Float32(0.0), Float32(0.0)
            if v != 0:
                iq = load(quanta, Int64(n) * Int64(2))
                qq = load(quanta, Int64(n) * Int64(2) + Int64(1))
            qz[2 * s_] = iq
            qz[2 * s_ + 1] = qq
        if const_expr(magic is not None):
            mg = Float32(0.0)
            if v != 0:
                mg = load(magic, off)
            mz[s_] = mg
        rok[s_] = v
        rows[s_] = dkv_ptr.toint() + off * Int64(D * 4) + Int64(col * 4)


@cute.jit
def scatter(acc, ch: cutlass.Constexpr, rows, rok, pol, deterministic: cutlass.Constexpr, qz=None, mz=None):
    """A [64 slots, 64 columns] dKV chunk (registers ``acc`` in fragment
    order) into column chunk ``ch`` of the slots' rows (valid slots only):
    added, or stored in the deterministic build.  Lanes l and l ^ 4 hold rows
    2 p and 2 p + 1 (+ 8 r).  For each 128-byte line (16-column groups 2 l'
    and 2 l' + 1 of the chunk) each sends the other its second group: the
    first instruction then writes row 2 p (the even lane its first group,
    the odd lane the received second) and the second row 2 p + 1, so a
    warp's instruction covers four whole lines.  A thread's floats of a
    group go out as they sit in its fragment, columns 8 h + 2 q + e at
    4 q + 2 h + e.  pol: the L2 policy of the adds (None for none).  qz:
    ``slot_rows``' quanta of the rows, each value rounded to its row's
    before the add (None: added as computed); mz: ``slot_rows``' grid
    constants of the rows, the same rounding by ``round_to_grid``."""
    odd = (cute.arch.lane_idx() // 4) % 2 == 1
    for r in cutlass.range_constexpr(2):
        for l_ in cutlass.range_constexpr(2):
            first = cute.make_rmem_tensor((4,), Float32)
            second = cute.make_rmem_tensor((4,), Float32)
            for k in cutlass.range_constexpr(4):
                j, e = 4 * l_ + k // 2, k % 2     # fragment column pair j: columns 8 j + 2 q + e
                mine = acc[4 * j + 2 * r + e]
                recv = cute.arch.shuffle_sync_bfly(Float32(acc[4 * (j + 2) + 2 * r + e]), 4)
                first[k] = Float32(cutlass.select_(odd, recv, mine))
                second[k] = Float32(cutlass.select_(odd, mine, recv))
            for k2, vals in ((0, first), (1, second)):
                if const_expr(qz is not None):
                    for k in cutlass.range_constexpr(4):
                        vals[k] = quantize(vals[k], qz[2 * (2 * r + k2)], qz[2 * (2 * r + k2) + 1])
                if const_expr(mz is not None):
                    for k in cutlass.range_constexpr(4):
                        vals[k] = round_to_grid(vals[k], mz[2 * r + k2])
                addr = rows[2 * r + k2] + (ch * 64 + 32 * l_) * 4
                write4(rok[2 * r + k2], addr, [vals[0], vals[1], vals[2], vals[3]], pol, deterministic)


@cute.jit
def write4(ok, addr, vals, pol, deterministic: cutlass.Constexpr):
    """Four adjacent floats to addr when ok: added or, deterministic,
    stored (under the L2 policy pol, None for none)."""
    if ok != 0:
        if const_expr(deterministic):
            global_f32(STORE, addr, *vals, policy=pol)
        else:
            global_f32(RED_ADD, addr, *vals, policy=pol)
