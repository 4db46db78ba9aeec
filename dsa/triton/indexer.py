"""Triton lightning indexer: dense scores and the fused indexer + top-k.

Canonical packed layout (``dsa._args.IndexerArgs``): q [Tq, H, D], one key
k [Tk, D] shared by all heads, weights [Tq, H], sequences given by
cu_seqlens_q / cu_seqlens_k. For sequence b, local query i and local key j:

    visible(i, j) = j < S_k[b]  and (not causal or
                    j < clamp((q_offsets[b] + i + 1) // ratio, 0, S_k[b]))
    score[row, j] = sm_scale * sum_h weights[row, h] * relu(q[row, h] . k[cu_k[b] + j])

for visible j, -inf otherwise (every column up to max_seqlen_k). fp32
accumulation.

Kernel layout: a program owns BQ consecutive queries of one sequence and
keeps their q rows resident as one [BQ*HP, D] operand (HP = H padded to a
power of two; padded heads carry weight 0). It walks the key blocks of the
causal window only (blocks past the window are written -inf without being
computed): for each [BN, D] key tile one MMA gives the [BN, BQ*HP] dot
products of every (query, head) pair; relu, the weights and the sum over
heads reduce them to the [BN, BQ] score tile. With the heads on the MMA's N
dimension the head sum stays inside a thread and its quad (no shared memory),
and each key tile byte loaded serves 2*BQ*HP flops.

``indexer_topk`` runs the same kernel on query chunks whose score rows fit
scratch buffers of about max(Tq*topk/4, TOPK_CHUNK_FLOATS) floats, and the
top-k kernel on each chunk. Chunk c goes to buffer and stream c % TOPK_BUFFERS
(streams forked from the caller's and joined back), so a chunk's top-k
(memory-bound) and the last wave of its scores (compute-bound) run beside
the next chunk's scores instead of leaving the SMs idle. The top-k reads
each row only up to its causal window's end (``row_ends``), so the scores
kernel writes no -inf past the windows: about half the score bytes of a
causal problem are neither written nor read. The scores of a row do not
depend on the chunking (same kernel, same tile config, same accumulation
order), so the result equals ``topk(scores(a))`` bit for bit, ties
included, while memory stays O(Tq*topk) whatever S_k is.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

import torch
import triton
import triton.language as tl

from dsa._args import IndexerArgs
from dsa.triton import fit
from dsa.triton import topk as _topk
from dsa.triton.rules import input_precision

_TABLE_BLOCK = 1024  # sequences a step of the block-table kernel
_MAX_DIM = 256
_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------


@triton.jit
def _block_table_kernel(cu_q_ptr, out_ptr, n_seq, Tq, rows_per_chunk, BQ: tl.constexpr, BLOCK_B: tl.constexpr):
    """out[c, b] = number of BQ-query blocks in sequences < b, counting only
    rows of chunk c = [c * rows_per_chunk, (c + 1) * rows_per_chunk) (b = 0..B).
    A kernel, so that no host sync or chain of small torch ops sits in front
    of every scores launch."""
    c = tl.program_id(0)
    r0 = c * rows_per_chunk
    r1 = tl.minimum(r0 + rows_per_chunk, Tq)
    p_out = out_ptr + c * (n_seq + 1)
    tl.store(p_out, 0)
    carry = tl.zeros([], tl.int32)
    for b0 in range(0, n_seq, BLOCK_B):
        o_b = b0 + tl.arange(0, BLOCK_B)
        m_b = o_b < n_seq
        lo = tl.maximum(tl.load(cu_q_ptr + o_b, mask=m_b, other=0), r0)
        hi = tl.minimum(tl.load(cu_q_ptr + o_b + 1, mask=m_b, other=0), r1)
        n_blk = tl.where(m_b, (tl.maximum(hi - lo, 0) + BQ - 1) // BQ, 0)
        tl.store(p_out + 1 + o_b, carry + tl.cumsum(n_blk, axis=0), mask=m_b)
        carry += tl.sum(n_blk, axis=0)


@triton.jit
def _row_ends_kernel(cu_q_ptr, cu_k_ptr, off_ptr, out_ptr, Tq, n_seq, n_iter, ratio, max_seqlen_k,
                     CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = the end of query row t's visible window: keys j < out[t] of
    its sequence may be visible, every later column of its score row is
    -inf (the scores kernel's ``end``, clamped to max_seqlen_k)."""
    o_t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_t = o_t < Tq
    # the sequence b of row t: the last b with cu_q[b] <= t (binary search)
    lo = tl.zeros([BLOCK], tl.int32)
    hi = lo + n_seq
    for _ in range(n_iter):
        mid = (lo + hi) // 2
        go_right = tl.load(cu_q_ptr + mid, mask=m_t, other=0) <= o_t
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    q_seq0 = tl.load(cu_q_ptr + lo, mask=m_t, other=0)
    s_k = tl.load(cu_k_ptr + lo + 1, mask=m_t, other=0) - tl.load(cu_k_ptr + lo, mask=m_t, other=0)
    if CAUSAL:
        first = tl.load(off_ptr + lo, mask=m_t, other=0) + (o_t - q_seq0) + 1
        end = tl.minimum(tl.maximum(first // ratio, 0), s_k)
    else:
        end = s_k
    tl.store(out_ptr + o_t, tl.minimum(end, max_seqlen_k).to(tl.int32), mask=m_t)


@triton.jit
def _find_block(blk_cum_ptr, blk, n_seq, n_iter):
    """The sequence b with blk_cum[b] <= blk < blk_cum[b+1] (binary search)."""
    lo = tl.zeros([], tl.int32)
    hi = lo + n_seq
    for _ in range(n_iter):
        mid = (lo + hi) // 2
        go_right = tl.load(blk_cum_ptr + mid) <= blk
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _epilogue(b_s, b_w, p_out, j0, end, m_bq, max_seqlen_k, sm_scale,
              BN: tl.constexpr, BQ: tl.constexpr, HP: tl.constexpr):
    """[BN, BQ*HP] dot products -> the [BN, BQ] score tile at keys j0.., stored."""
    b_s = tl.maximum(b_s, 0.0) * b_w[None, :]
    b_o = tl.sum(tl.reshape(b_s, [BN, BQ, HP]), axis=2) * sm_scale  # [BN, BQ]
    o_j = j0 + tl.arange(0, BN)
    b_o = tl.where(o_j[:, None] < end[None, :], b_o, float("-inf"))
    tl.store(p_out[None, :] + o_j[:, None], b_o, mask=m_bq[None, :] & (o_j[:, None] < max_seqlen_k))


@triton.jit
def _indexer_scores_kernel(
    q_ptr, k_ptr, w_ptr, out_ptr,
    cu_q_ptr, cu_k_ptr, off_ptr, blk_cum_ptr,
    row_begin, row_end, n_seq, n_iter, max_seqlen_k, ratio, sm_scale,
    stride_qt, stride_qh, stride_kt, stride_wt, stride_ot,
    H, D,
    CAUSAL: tl.constexpr, BQ: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
    BN: tl.constexpr, PREC: tl.constexpr, SINGLE: tl.constexpr, FILL_INF: tl.constexpr = True,
):
    # Blocks are taken last-first: in a causal batch the late query blocks
    # have the most keys, and starting them first evens out the tail.
    # SINGLE (one sequence): the blocks are those of [row_begin, row_end),
    # no block table.
    if SINGLE:
        total = tl.cdiv(row_end - row_begin, BQ)
    else:
        total = tl.load(blk_cum_ptr + n_seq)
    blk = total - 1 - tl.program_id(0)
    if blk < 0:
        return
    if SINGLE:
        b = 0
        blk_first = 0
    else:
        b = _find_block(blk_cum_ptr, blk, n_seq, n_iter)
        blk_first = tl.load(blk_cum_ptr + b)
    q_seq0 = tl.load(cu_q_ptr + b)
    q_lo = tl.maximum(q_seq0, row_begin)
    q_hi = tl.minimum(tl.load(cu_q_ptr + b + 1), row_end)
    k_seq0 = tl.load(cu_k_ptr + b)
    s_k = tl.load(cu_k_ptr + b + 1) - k_seq0
    t0 = q_lo + (blk - blk_first) * BQ

    # Per-query visible key count.
    o_bq = tl.arange(0, BQ)
    m_bq = (t0 + o_bq) < q_hi
    if CAUSAL:
        first = tl.load(off_ptr + b) + (t0 - q_seq0) + 1
        end = tl.minimum(tl.maximum((first + o_bq) // ratio, 0), s_k)
    else:
        end = tl.zeros([BQ], tl.int32) + s_k
    end = tl.where(m_bq, end, 0)
    k_end = tl.max(end, axis=0)  # the causal window of the whole block

    # q of BQ queries as [BQ*HP, DP]: column c of the MMA is (query c // HP, head c % HP).
    o_c = tl.arange(0, BQ * HP)
    o_cq = o_c // HP
    o_ch = o_c % HP
    o_d = tl.arange(0, DP)
    t_c = (t0 + o_cq).to(tl.int64)
    m_c = ((t0 + o_cq) < q_hi) & (o_ch < H)
    p_q = q_ptr + t_c[:, None] * stride_qt + o_ch[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_c[:, None] & (o_d[None, :] < D), other=0.0)  # [BQ*HP, DP]
    b_qt = tl.trans(b_q)  # [DP, BQ*HP]
    b_w = tl.load(w_ptr + t_c * stride_wt + o_ch, mask=m_c, other=0.0).to(tl.float32)  # [BQ*HP]

    t_q = (t0 + o_bq).to(tl.int64)
    p_out = out_ptr + (t_q - row_begin) * stride_ot  # [BQ] row starts
    o_n = tl.arange(0, BN)
    p_k = k_ptr + (k_seq0 + o_n).to(tl.int64)[:, None] * stride_kt + o_d[None, :]
    m_d = o_d[None, :] < D
    for j0 in range(0, k_end, BN):
        b_k = tl.load(p_k + j0 * stride_kt, mask=((j0 + o_n) < k_end)[:, None] & m_d, other=0.0)
        b_s = tl.dot(b_k, b_qt, input_precision=PREC)  # [BN, BQ*HP]
        _epilogue(b_s, b_w, p_out, j0, end, m_bq, max_seqlen_k, sm_scale, BN, BQ, HP)

    # Past the window: -inf, no compute. Tiles [BQ, BN], keys contiguous.
    # Without FILL_INF (indexer_topk: its top-k reads each row only up to
    # its window's end) these columns are left unwritten.
    if FILL_INF:
        b_inf = tl.full([BQ, BN], float("-inf"), tl.float32)
        for j0 in range(tl.cdiv(k_end, BN) * BN, max_seqlen_k, BN):
            o_j = j0 + o_n
            tl.store(p_out[:, None] + o_j[None, :], b_inf, mask=m_bq[:, None] & (o_j[None, :] < max_seqlen_k))


# --------------------------------------------------------------------------
# Tile configuration
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexerConfig:
    """Tile shape of the scores kernel: BN keys x (BQ queries * HP heads)."""

    BN: int
    NCOLS: int  # BQ * HP, the MMA's N
    num_warps: int
    num_stages: int
    maxnreg: Optional[int] = None  # ptxas register cap (None: its choice)


# Chosen per dtype class and head count only (never per Tq or S_k):
# indexer_topk's chunked calls must compute exactly what scores() computes.
_CONFIGS = {
    # H200, bf16, H=64 D=128, causal: 567-574 / 589-600 / 575 TFLOP/s at
    # S=4096, S=16384 (ratio 1) and 16384x4096 (ratio 4), against 517-522 /
    # 520-531 / 512 with one warpgroup and 2 queries a program (bench/RESULTS.md
    # C120, C122): the two warpgroups share each key tile, so a score costs half
    # the key bytes from L2; 2 programs an SM (128 registers, 113 KB shared).
    # 128 / 256 heads (C123, 4096^2 and 16384^2): 586 / 601 and 588 / 624
    # TFLOP/s against 535 / 551 and 568 / 593.
    "mma": IndexerConfig(BN=64, NCOLS=256, num_warps=8, num_stages=3),
    # Fewer than 64 heads (C122, H 32 / 16, 4096^2 and 16384^2 causal): these
    # tiles 441 / 471 and 324 / 426 TFLOP/s, the two-warpgroup ones 438 / 466
    # and 369 / 399.  See bench/notes_indexer.md for the others.
    "mma_narrow": IndexerConfig(BN=64, NCOLS=128, num_warps=4, num_stages=2),
    # fp32 runs in full fp32 (FMA dot, not tuned): ptxas spills 5 KB a thread
    # at 4 warps, none at 8 (56 registers, sm_90a, H=64 D=128).
    "fp32": IndexerConfig(BN=32, NCOLS=64, num_warps=8, num_stages=2),
}


def _class(a: IndexerArgs) -> str:
    """The ``_CONFIGS`` entry of a's dtype and head count."""
    if a.q.dtype == torch.float32:
        return "fp32"
    return "mma" if a.q.shape[1] >= 64 else "mma_narrow"


def _candidates(a: IndexerArgs) -> Iterator[IndexerConfig]:
    """The class's config first, then one stage, then fewer keys a tile,
    then fewer (query, head) columns."""
    return fit.shrinking(_CONFIGS[_class(a)], (("num_stages", 1), ("BN", 16), ("NCOLS", 16)))


def pick(a: IndexerArgs, target: Optional[fit.Target] = None) -> Tuple[Optional[IndexerConfig], str]:
    """(the scores tiles that fit ``target`` (a's device when None), "") or (None, why)."""
    key = ("indexer_scores", a.q.dtype, a.weights.dtype, a.q.shape[1], a.q.shape[2], bool(a.causal),
           _CONFIGS[_class(a)])
    return fit.pick(lambda: _candidates(a), lambda c: scores_spec(a, c), target or fit.device_target(a.q),
                    key)


def _config(a: IndexerArgs) -> IndexerConfig:
    cfg, why = pick(a)
    if cfg is None:
        raise ValueError(why)
    return cfg


def tiles_reason(fn_name: str, a: IndexerArgs) -> Optional[str]:
    """Why no scores tiles fit a's device (None if some do); both ops run the scores kernel."""
    return pick(a)[1] or None


def scores_spec(a: IndexerArgs, cfg: IndexerConfig, single: bool = True, fill_inf: bool = True) -> fit.KernelSpec:
    BQ, HP, DP = _dims(a, cfg)
    el = fit.ptr(a.q.dtype)
    types = dict(q_ptr=el, k_ptr=el, w_ptr=fit.ptr(a.weights.dtype), out_ptr="*fp32", cu_q_ptr="*i32",
                 cu_k_ptr="*i32", off_ptr="*i32", blk_cum_ptr="*i32", sm_scale="fp32")
    const = dict(CAUSAL=bool(a.causal), BQ=BQ, HP=HP, DP=DP, BN=cfg.BN, PREC=input_precision(a.q.dtype),
                 SINGLE=single, FILL_INF=fill_inf)
    options = {} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}
    return fit.KernelSpec(_indexer_scores_kernel, types, const, cfg.num_warps, cfg.num_stages, options)


def _dims(a: IndexerArgs, cfg: IndexerConfig) -> Tuple[int, int, int]:
    H, D = a.q.shape[1], a.q.shape[2]
    HP = triton.next_power_of_2(H)
    DP = max(16, triton.next_power_of_2(D))
    BQ = max(1, cfg.NCOLS // HP, 16 // HP)
    return BQ, HP, DP


# --------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------


def supports(a: IndexerArgs) -> Optional[str]:
    if a.q.dtype not in _FLOAT:
        return f"triton indexer takes fp32/fp16/bf16 q, got {a.q.dtype}"
    if a.k.dtype != a.q.dtype:
        return f"triton indexer needs k in q's dtype ({a.q.dtype}), got {a.k.dtype}"
    if a.weights.dtype not in _FLOAT:
        return f"triton indexer takes fp32/fp16/bf16 weights, got {a.weights.dtype}"
    if a.q.shape[1] > fit.MAX_SCORE_HEADS:
        return f"triton indexer supports up to {fit.MAX_SCORE_HEADS} heads, got {a.q.shape[1]}"
    if a.q.shape[2] > _MAX_DIM:
        return f"triton indexer supports head dims up to {_MAX_DIM}, got {a.q.shape[2]}"
    if a.q.shape[0] >= 2**31 or a.k.shape[0] >= 2**31:
        return "triton indexer: token counts must fit in int32"
    return None


def block_tables(a: IndexerArgs, BQ: int, rows_per_chunk: int, n_chunks: int) -> Optional[torch.Tensor]:
    """[n_chunks, B+1] int32 cumulative block counts (see _block_table_kernel);
    None for one sequence, whose kernel needs no table (one launch less)."""
    B = a.batch
    if B == 1:
        return None
    out = torch.empty((n_chunks, B + 1), dtype=torch.int32, device=a.q.device)
    _block_table_kernel[(n_chunks,)](
        a.cu_seqlens_q, out, B, a.q.shape[0], rows_per_chunk,
        BQ=BQ, BLOCK_B=min(_TABLE_BLOCK, max(16, triton.next_power_of_2(B))), num_warps=4,
    )
    return out


def _launch_scores(a: IndexerArgs, out: torch.Tensor, blk_cum: Optional[torch.Tensor], row_begin: int,
                   row_end: int, fill_inf: bool = True) -> None:
    """Score rows [row_begin, row_end) of the packed queries into out[0 :
    row_end - row_begin]; without fill_inf the columns past each query
    block's window are left unwritten."""
    cfg = _config(a)
    H, D = a.q.shape[1], a.q.shape[2]
    B = a.batch
    spec = scores_spec(a, cfg, single=blk_cum is None, fill_inf=fill_inf)
    # >= the block count; spare programs exit
    grid = (triton.cdiv(row_end - row_begin, spec.constexprs["BQ"]) + (0 if blk_cum is None else B),)
    _indexer_scores_kernel[grid](
        a.q, a.k, a.weights, out,
        a.cu_seqlens_q, a.cu_seqlens_k, a.q_offsets, a.cu_seqlens_q if blk_cum is None else blk_cum,
        row_begin, row_end, B, max(0, (B - 1).bit_length()), a.max_seqlen_k, a.ratio, float(a.sm_scale),
        a.q.stride(0), a.q.stride(1), a.k.stride(0), a.weights.stride(0), out.stride(0),
        H, D, **spec.launch_kwargs(),
    )


def scores(a: IndexerArgs) -> torch.Tensor:
    """-> [Tq, max_seqlen_k] fp32 (-inf where not visible)."""
    Tq = a.q.shape[0]
    out = torch.empty((Tq, a.max_seqlen_k), dtype=torch.float32, device=a.q.device)
    BQ, _, _ = _dims(a, _config(a))
    table = block_tables(a, BQ, Tq, 1)
    _launch_scores(a, out, None if table is None else table[0], 0, Tq)
    return out


# indexer_topk's chunking. Each chunk's scores go to one of TOPK_BUFFERS
# scratch buffers of about TOPK_CHUNK_FLOATS floats (at least one row; no
# more than Tq rows) and are selected on the stream that computed them; chunk
# c takes buffer and stream c % TOPK_BUFFERS (the first the caller's, the
# others forked from it and joined back at the end), so one chunk's top-k
# and the tail of its scores run beside the next chunk's scores. ROW_ENDS:
# the top-k reads each row only up to its window's end, and the scores
# kernel writes no -inf past the windows. Env at import:
# DSA_INDEXER_TOPK_BUFFERS, DSA_INDEXER_TOPK_CHUNK (floats, a power-of-two
# exponent), DSA_INDEXER_TOPK_ROW_ENDS (0: whole rows, -inf written).
TOPK_BUFFERS = int(os.environ.get("DSA_INDEXER_TOPK_BUFFERS", "2"))
TOPK_CHUNK_FLOATS = 1 << int(os.environ.get("DSA_INDEXER_TOPK_CHUNK", "26"))
TOPK_ROW_ENDS = os.environ.get("DSA_INDEXER_TOPK_ROW_ENDS", "1") != "0"
_ENDS_BLOCK = 1024
_SIDE_STREAMS: Dict[Tuple[int, int], torch.cuda.Stream] = {}


def chunk_rows(Tq: int, S_k: int, topk: int, floats: Optional[int] = None) -> int:
    """Query rows per chunk of ``indexer_topk``: the chunk's scores take about
    max(Tq*topk/4, ``floats`` or TOPK_CHUNK_FLOATS) floats, whatever S_k is
    (at least one row)."""
    budget = max(Tq * topk // 4, TOPK_CHUNK_FLOATS if floats is None else floats)
    return max(1, min(Tq, budget // max(1, S_k)))


def row_ends(a: IndexerArgs) -> torch.Tensor:
    """[Tq] int32: the end of each query row's visible window (every column
    of its score row from there on is -inf)."""
    Tq = a.q.shape[0]
    out = torch.empty((Tq,), dtype=torch.int32, device=a.q.device)
    B = a.batch
    _row_ends_kernel[(triton.cdiv(Tq, _ENDS_BLOCK),)](
        a.cu_seqlens_q, a.cu_seqlens_k, a.q_offsets, out, Tq, B, max(0, (B - 1).bit_length()), a.ratio,
        a.max_seqlen_k, CAUSAL=bool(a.causal), BLOCK=_ENDS_BLOCK, num_warps=4,
    )
    return out


def _side_stream(device: torch.device, i: int) -> torch.cuda.Stream:
    key = (device.index if device.index is not None else torch.cuda.current_device(), i)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[key]


def indexer_topk(a: IndexerArgs, topk: int, launch_topk=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """-> (indices [Tq, topk] int32 local key positions, -1 padded; lengths [Tq] int32).
    ``launch_topk``: another top-k kernel for the chunks (``chunked_topk``)."""
    BQ, _, _ = _dims(a, _config(a))
    if TOPK_ROW_ENDS:  # the top-k reads only the windows: no -inf past them
        return chunked_topk(a, topk, BQ, lambda *args: _launch_scores(*args, fill_inf=False), launch_topk=launch_topk)
    return chunked_topk(a, topk, BQ, _launch_scores, launch_topk=launch_topk)


def chunked_topk(a: IndexerArgs, topk: int, BQ: int, launch_scores, buffers: Optional[int] = None,
                 row_ends_: Optional[bool] = None, launch_topk=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``indexer_topk`` with any scores kernel: ``launch_scores(a, out,
    block table or None, row_begin, row_end)`` writes the score rows [row_begin,
    row_end) into out (its query blocks of BQ rows per ``_block_tables``),
    chunk by chunk, and the top-k kernel selects from each chunk (up to each
    row's window end with ``row_ends_``, default TOPK_ROW_ENDS). ``buffers``
    (default TOPK_BUFFERS): chunks in flight, each on its own stream.
    ``launch_topk(scores, k, indices, lengths, ends=)``: the top-k kernel
    (default ``dsa.triton.topk.launch``)."""
    Tq, S = a.q.shape[0], a.max_seqlen_k
    dev = a.q.device
    indices = torch.empty((Tq, topk), dtype=torch.int32, device=dev)
    lengths = torch.empty((Tq,), dtype=torch.int32, device=dev)
    rows = chunk_rows(Tq, S, topk)
    starts = list(range(0, Tq, rows))
    tables = block_tables(a, BQ, rows, len(starts))
    ends = row_ends(a) if (TOPK_ROW_ENDS if row_ends_ is None else row_ends_) else None
    n_buf = max(1, min(TOPK_BUFFERS if buffers is None else buffers, len(starts)))
    scratch = [torch.empty((min(rows, Tq), S), dtype=torch.float32, device=dev) for _ in range(n_buf)]
    streams = [None] * n_buf
    forked = n_buf > 1 and dev.type == "cuda"
    if forked:
        cur = torch.cuda.current_stream(dev)
        streams = [cur] + [_side_stream(dev, i) for i in range(1, n_buf)]
        for st in streams[1:]:
            st.wait_stream(cur)
    for c, r0 in enumerate(starts):
        r1 = min(r0 + rows, Tq)
        buf = scratch[c % n_buf]
        with contextlib.nullcontext() if streams[c % n_buf] is None else torch.cuda.stream(streams[c % n_buf]):
            launch_scores(a, buf, None if tables is None else tables[c], r0, r1)
            (launch_topk or _topk.launch)(buf[: r1 - r0], topk, indices[r0:r1], lengths[r0:r1],
                                          ends=None if ends is None else ends[r0:r1])
    if forked:
        for st in streams[1:]:
            cur.wait_stream(st)
    return indices, lengths
