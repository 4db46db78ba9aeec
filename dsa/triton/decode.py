"""Triton sparse decode: split-K over the top-k slots, for every GPU.

Entry points on the canonical :class:`dsa._args.SparseDecodeArgs`:

    decode(a)                  -> out [T, H, d_v] (q.dtype), lse [T, H] fp32
    forward(a, splits=None)    -> the same, the split count forced when given

and ``attention_forward(sa)``, through which a sparse-attention forward of
few rows takes the same kernels. The kernels are in ``decode_kernels``; this
module checks what they serve, picks tiles that fit the device
(``dsa.triton.fit``), chooses the split count and launches them.

Splits. A decode step has few rows: B1 at H = 128 is 2 programs of 64
heads, 2 of an H200's 132 SMs. Each row's K slots are cut into S chunks of
whole BN blocks, S = min(SMs // programs, K / 64), so the programs fill
about one wave; a merge kernel then combines the parts by their lse. S
depends on the shapes and the device only, so the workspace
([T, H, S, d_v] + [T, H, S] fp32) is the same for every call of a shape and
nothing is read back from the device (CUDA graphs capture it). Under the
interpreter the device is taken to have ``INTERPRETER_SMS`` SMs and a split
may be one block, so the tests' few rows and slots run the split path.

Host time. A call's launch parameters (tiles, splits, the constexprs, the
grids) depend only on the shapes, dtypes and flags, and are built once per
such key (:func:`plan`). :class:`Prepared` (the backend's ``prepare``, see
:mod:`dsa.ops.decode`) also binds the integer arguments of one call
metadata and, for a ``dsa.SparseDecodePlan``, the workspace: a call then
reads its tensors' addresses and launches, through Triton's C launcher
once the kernels are compiled (:mod:`dsa.triton.launch`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
import triton

from dsa._args import SparseAttnArgs, SparseDecodeArgs
from dsa._kept import kept
from dsa._rules import LOG2E
from dsa.kv_cache import FORMATS, NATIVE
from dsa.ops.decode import run_fresh
from dsa.triton import fit
from dsa.triton.decode_kernels import KIND_BF16, KIND_E4M3, KIND_NATIVE, decode_combine_kernel, sparse_decode_kernel
from dsa.triton.launch import Launcher, arg_spec
from dsa.triton.rules import input_precision
from dsa.triton.sparse_attention import TileConfig, heads_per_program, shared_reason
from dsa.triton.sparse_attention_common import ColumnChunks

INTERPRETER_SMS = 8  # the SM count the split rule assumes under the interpreter
_COMBINE_HEADS = 16  # heads a merge program holds ([16, 128] fp32: 16 registers a thread at 4 warps)


# ----------------------------------------------------------------------------
# The column chunks of a cache row and where each one is read from


@dataclass(frozen=True)
class RowLayout:
    """The constexprs that place a row's column chunks in the cache (see decode_kernels)."""

    chunks: ColumnChunks
    KIND: Tuple[int, ...]  # NATIVE, E4M3 or BF16 per chunk
    SRC: Tuple[int, ...]  # first element (native), byte (E4M3) or bf16 value (BF16) of the chunk in its row
    SC_OFF: Tuple[int, ...]  # byte of the chunk's scale in the token's scale record
    SCALED: Tuple[bool, ...]  # the chunk's scale multiplies the score / probability tiles
    SC_FP32: bool
    TOK: int  # elements (native) or bytes (FP8) from one token's row to the next
    SC_BASE: int  # bytes from a page's start (plus TOK * offset when inline) to token 0's scales
    SC_TOK: int  # bytes between consecutive tokens' scale records
    DEQ_TILE: bool  # fp16: dequantise the tile itself

    def kernel_args(self) -> Dict[str, Any]:
        f = {k.name: getattr(self, k.name) for k in dataclasses.fields(self) if k.name != "chunks"}
        return dict(self.chunks.kernel_args(), **f)


def row_layout(a: SparseDecodeArgs, CW: int) -> Tuple[Optional[RowLayout], str]:
    """(the layout of a's rows at chunk width CW (a native cache's; an FP8 one
    uses its scale tile), "") or (None, why the chunks cannot follow the format)."""
    if a.cache_format == NATIVE:
        ch = ColumnChunks.of(a.D, a.d_v, CW)
        n = len(ch.WS)
        return RowLayout(ch, (KIND_NATIVE,) * n, ch.OFFS, (0,) * n, (False,) * n, False, a.G * a.D, 0, 0,
                         False), ""
    fmt = FORMATS[a.cache_format]
    ch = ColumnChunks.of(a.D, a.d_v, fmt.tile)
    deq = a.q.dtype == torch.float16
    kind, src, sc_off = [], [], []
    for o, w in zip(ch.OFFS, ch.WS):
        if o + w <= fmt.d_nope and o // fmt.tile == (o + w - 1) // fmt.tile:
            kind.append(KIND_E4M3)
            src.append(o)
            sc_off.append((o // fmt.tile) * fmt.scale_bytes)
        elif o >= fmt.d_nope:
            kind.append(KIND_BF16)
            src.append(fmt.rope_offset // 2 + o - fmt.d_nope)
            sc_off.append(0)
        else:
            return None, (f"d_v={a.d_v} does not fall on {a.cache_format}'s boundaries (scale tiles of {fmt.tile} "
                          f"values, RoPE from {fmt.d_nope}): its column chunks would straddle one")
    scaled = tuple(k == KIND_E4M3 and not deq for k in kind)
    return RowLayout(ch, tuple(kind), tuple(src), tuple(sc_off), scaled, fmt.scale_bytes == 4, fmt.token_bytes,
                     fmt.scale_base(a.page_size), fmt.scale_stride(), deq), ""


# ----------------------------------------------------------------------------
# What the kernels serve


def supports(a: SparseDecodeArgs) -> Optional[str]:
    """None when the Triton kernels can serve ``a``, else the reason."""
    return shared_reason(a) or row_layout(a, 128)[1] or None


# ----------------------------------------------------------------------------
# Tiles


def _chunk_width(a: SparseDecodeArgs, preferred: int) -> int:
    return FORMATS[a.cache_format].tile if a.cache_format != NATIVE else preferred


# Tiles. A native cache takes the sparse-attention forward's measured tiles
# (64 heads, BN = 64, CW = 128, 2 stages: bench/notes_sparse_attention.md).
# An FP8 tile is converted in registers before it reaches shared memory, and
# at BN = 64 that spills (ptxas, sm_90, H = 128 with a block table: 752 B of
# spill stores in V3.2, 1784 B in MODEL1 at H = 64, against 136 B and 480 B at BN = 32
# and 156 B for the native kernel), so FP8 starts at BN = 32. Not yet timed
# on a GPU: bench/decode_peers.py is the measurement to make.
_FP8_BN = 32


def _candidates(a: SparseDecodeArgs) -> Iterator[TileConfig]:
    """Fastest first: 64 heads a program, BN = 64 (FP8: 32), 2 stages, CW =
    128 (an FP8 cache: its scale tile); then one stage, fewer slots a step,
    fewer heads."""
    hg = a.H // a.G
    if a.q.device.type == "cpu":  # the interpreter: small tiles run fastest
        yield TileConfig(heads_per_program(hg), 16, _chunk_width(a, 256), 4, 1)
        return
    if a.q.dtype == torch.float32:
        yield from fit.shrinking(TileConfig(16, 32, _chunk_width(a, 64), 4, 1), (("BN", 16),))
        return
    BN = 64 if a.cache_format == NATIVE else _FP8_BN
    for BH in fit.halvings(heads_per_program(hg), 16):
        warps = 8 if BH * a.d_v >= 64 * 256 else 4
        yield from fit.shrinking(TileConfig(BH, BN, _chunk_width(a, 128), warps, 2), (("num_stages", 1), ("BN", 16)))


def _smem_bytes(a: SparseDecodeArgs, c: TileConfig) -> int:
    """Estimated shared memory: the q tiles and each stage's converted kv tile."""
    return a.q.element_size() * a.D * (c.BH + max(c.num_stages, 1) * c.BN) + 1024


def hw_fp8(target: Optional[fit.Target]) -> bool:
    """The hardware e4m3 conversion: sm_89 and later (never under the interpreter)."""
    return target is not None and target.capability >= 89


def kernel_spec(a: SparseDecodeArgs, c: TileConfig, split: bool, target: Optional[fit.Target]) -> fit.KernelSpec:
    lay, why = row_layout(a, c.CW)
    if lay is None:
        raise ValueError(why)
    el = fit.ptr(a.q.dtype)
    types = dict(q_ptr=el, kv_ptr="*u8" if a.cache_format != NATIVE else el, idx_ptr="*i32", len_ptr="*i32",
                 bt_ptr="*i32", seqlen_ptr="*i32", sink_ptr="*fp32", out_ptr="*fp32" if split else el,
                 lse_ptr="*fp32", N="i64", PAGE_STRIDE="i64", qk_scale="fp32")
    const = dict(H=a.H, G=a.G, D=a.D, D_V=a.d_v, **lay.kernel_args(), PS=a.page_size, HW_FP8=hw_fp8(target),
                 BH=c.BH, BN=c.BN, HAS_LEN=a.topk_length is not None, HAS_BT=a.block_table is not None,
                 HAS_SEQLEN=a.seq_lens is not None, HAS_SINK=a.sink is not None, SPLIT=split,
                 PREC=input_precision(a.q.dtype))
    return fit.KernelSpec(sparse_decode_kernel, types, const, c.num_warps, c.num_stages)


def combine_spec(a: SparseDecodeArgs, splits: int, blocks: Optional[Tuple[int, int]] = None) -> fit.KernelSpec:
    """The merge: 16 heads x up to 128 columns of the parts a program (a few KB of shared memory at most),
    or the (heads, columns) of ``blocks``."""
    types = dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", sink_ptr="*fp32", out_ptr=fit.ptr(a.q.dtype),
                 lse_ptr="*fp32")
    bh, bv = blocks or (min(_COMBINE_HEADS, triton.next_power_of_2(a.H)), min(128, triton.next_power_of_2(a.d_v)))
    const = dict(H=a.H, D_V=a.d_v, BHC=bh, BV=bv, S_P2=triton.next_power_of_2(splits), HAS_SINK=a.sink is not None)
    return fit.KernelSpec(decode_combine_kernel, types, const, 4, 1)


def launch_merge(grid: Tuple[int, int, int], launch: Dict[str, Any], key: Tuple, part_out: torch.Tensor,
                 part_lse: torch.Tensor, sink: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor,
                 splits: int, addresses: Tuple, stream: Optional[int]) -> None:
    """The merge of the split parts into out and lse (its ``combine_spec`` launch, ``key`` naming it);
    ``addresses``: those of part_out, part_lse, sink (None without one), out and lse; ``stream``: the
    raw CUDA stream (None off CUDA)."""
    a_pout, a_plse, a_sink, a_out, a_lse = addresses
    spec = (key, a_pout & 15 == 0, a_plse & 15 == 0, None if a_sink is None else a_sink & 15 == 0,
            a_out & 15 == 0, a_lse & 15 == 0)
    raw = None if stream is None else (*addresses, splits)
    _COMBINE.launch(grid, (part_out, part_lse, sink, out, lse, splits), launch, spec, raw, stream)


def _key(a: SparseDecodeArgs) -> Tuple:
    """What the tiles depend on (not the rows, slots or device)."""
    return ("decode", a.q.dtype, a.H, a.G, a.D, a.d_v, a.cache_format, a.page_size, a.topk_length is not None,
            a.block_table is not None, a.seq_lens is not None, a.sink is not None)


def pick(a: SparseDecodeArgs, target: Optional[fit.Target] = None) -> Tuple[Optional[TileConfig], str]:
    """(the tiles that fit ``target`` (a's device when None), "") or (None, why)."""
    target = target or fit.device_target(a.q)
    return fit.pick(lambda: _candidates(a), lambda c: kernel_spec(a, c, True, target), target, _key(a),
                    lambda c: _smem_bytes(a, c))


def tiles_reason(fn_name: str, a: SparseDecodeArgs) -> Optional[str]:
    """Why no tiles fit a's device (None if some do)."""
    return pick(a)[1] or None


# ----------------------------------------------------------------------------
# Splits


_SMS: Dict[Tuple[str, Optional[int]], int] = {}


def sm_count(device: torch.device) -> int:
    """The device's SM count (INTERPRETER_SMS off CUDA)."""
    key = (device.type, device.index)
    if key not in _SMS:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            _SMS[key] = torch.cuda.get_device_properties(index).multi_processor_count
        else:
            _SMS[key] = INTERPRETER_SMS
    return _SMS[key]


_MIN_SPLIT_SLOTS = 64  # a split reads q and writes a [heads, d_v] fp32 part: give it at least 64 slots


def split_plan(programs: int, K: int, BN: int, sms: int, splits: Optional[int] = None,
               min_slots: int = _MIN_SPLIT_SLOTS) -> Tuple[int, int]:
    """(S, CHUNK): the split count and the slots of a split (whole BN blocks).

    S = min(SMs // programs, K / 64) fills about one wave without a second,
    partial one (B32 at H = 128: 64 programs, 2 splits, 128 of 132 SMs);
    ``splits`` forces S (clamped to [1, K / BN]). S is recomputed from CHUNK
    so that no split starts past K."""
    blocks = triton.cdiv(K, BN)
    if splits is None:
        S = min(max(1, sms // max(programs, 1)), triton.cdiv(K, max(BN, min_slots)))
    else:
        S = min(max(splits, 1), blocks)
    chunk = triton.cdiv(blocks, S) * BN
    return triton.cdiv(K, chunk), chunk


# ----------------------------------------------------------------------------
# Launch


@dataclass(frozen=True, eq=False)
class _Plan:
    key: Tuple  # what it was built from: equal keys, equal plans
    cfg: TileConfig
    splits: int
    chunk: int
    grid: Tuple[int, int, int]
    launch: Dict[str, Any]  # the decode kernel's constexprs and launch options
    combine_grid: Tuple[int, int, int]
    combine: Dict[str, Any]


_PLANS: Dict[Tuple, _Plan] = {}


def _build(key: Tuple, a: SparseDecodeArgs, splits: Optional[int]) -> _Plan:
    cfg, why = pick(a)
    if cfg is None:
        raise ValueError(why)
    programs = a.T * a.G * triton.cdiv(a.H // a.G, cfg.BH)
    # under the interpreter a split may be a single block, so the tests' few slots still split
    S, chunk = split_plan(programs, a.K, cfg.BN, sm_count(a.q.device), splits, _MIN_SPLIT_SLOTS if a.q.is_cuda else 1)
    spec = kernel_spec(a, cfg, S > 1, fit.device_target(a.q))
    grid = (a.T * a.G, triton.cdiv(a.H // a.G, cfg.BH), S)
    comb = combine_spec(a, S)
    c = comb.constexprs
    comb_grid = (a.T, triton.cdiv(a.H, c["BHC"]), triton.cdiv(a.d_v, c["BV"]))
    return _Plan(key, cfg, S, chunk, grid, spec.launch_kwargs(), comb_grid, comb.launch_kwargs())


def plan(a: SparseDecodeArgs, splits: Optional[int] = None) -> _Plan:
    """The launch of ``a``: built once per shape, dtype, flag and device (no tensor is kept)."""
    key = (a.shape_key, splits)
    return kept(_PLANS, key, lambda: _build(key, a, splits))


_DECODE = Launcher(sparse_decode_kernel)
_COMBINE = Launcher(decode_combine_kernel)


class Prepared:
    """The launches of every call with ``a``'s metadata, all but the tensors bound once: the plan, the
    integer arguments and their specialization, and (``reuse_workspace``) the split workspace, which its
    calls then share (ordered on one stream). ``run(q, kv, indices, topk_length, block_table, seq_lens,
    sink, out, lse)`` takes the canonical tensors (any shape of their elements) and writes out and lse:
    the protocol of ``prepare`` in :mod:`dsa.ops.decode`. No tensor of ``a`` is kept.

    A call reads each tensor's address once: for its alignment (the specialization) and, on CUDA, as the
    argument itself (:func:`dsa.triton.launch.direct_launch`)."""

    def __init__(self, a: SparseDecodeArgs, reuse_workspace: bool = False, splits: Optional[int] = None):
        p = self.plan = plan(a, splits)
        bt = a.block_table
        self._ints = (a.N, a.num_pages, a.K, p.chunk, a.len_div, a.rows_per_seq, bt.shape[1] if bt is not None else 0,
                      a.kv.stride(0), a.sm_scale * LOG2E)
        # what the launches' specializations take from the plan and the integers (tensors add their alignment)
        self._spec = (p.key, *map(arg_spec, self._ints))
        self._n_lse = a.T * a.H * p.splits  # the parts' lse [T, H, S], then their outputs [T, H, S, d_v]
        self._n_work = self._n_lse * (a.d_v + 1)
        self._device = a.q.device
        self._cuda = a.q.device.index if a.q.is_cuda else None
        self._work = self._workspace() if reuse_workspace and p.splits > 1 else None

    def _workspace(self) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
        """(the parts' lse, their outputs, the addresses of both)."""
        work = torch.empty(self._n_work, dtype=torch.float32, device=self._device)
        part_lse, part_out = work[: self._n_lse], work[self._n_lse:]
        return part_lse, part_out, part_lse.data_ptr(), part_out.data_ptr()

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, topk_length: Optional[torch.Tensor],
                 block_table: Optional[torch.Tensor], seq_lens: Optional[torch.Tensor], sink: Optional[torch.Tensor],
                 out: torch.Tensor, lse: torch.Tensor) -> None:
        p = self.plan
        # each address read once (spelled out: a generator here costs more than the reads)
        a_q, a_kv, a_idx, a_out, a_lse = q.data_ptr(), kv.data_ptr(), indices.data_ptr(), out.data_ptr(), lse.data_ptr()
        a_len = None if topk_length is None else topk_length.data_ptr()
        a_bt = None if block_table is None else block_table.data_ptr()
        a_sl = None if seq_lens is None else seq_lens.data_ptr()
        a_sink = None if sink is None else sink.data_ptr()
        if p.splits == 1:
            part_out, part_lse, a_pout, a_plse = out, lse, a_out, a_lse
        else:
            part_lse, part_out, a_plse, a_pout = self._work if self._work is not None else self._workspace()
        al_sink = None if a_sink is None else a_sink & 15 == 0
        spec = (self._spec, a_q & 15 == 0, a_kv & 15 == 0, a_idx & 15 == 0, None if a_len is None else a_len & 15 == 0,
                None if a_bt is None else a_bt & 15 == 0, None if a_sl is None else a_sl & 15 == 0, al_sink,
                a_pout & 15 == 0, a_plse & 15 == 0)
        stream = None if self._cuda is None else torch._C._cuda_getCurrentRawStream(self._cuda)
        raw = None if stream is None else (a_q, a_kv, a_idx, a_len, a_bt, a_sl, a_sink, a_pout, a_plse, *self._ints)
        _DECODE.launch(p.grid, (q, kv, indices, topk_length, block_table, seq_lens, sink, part_out, part_lse,
                                *self._ints), p.launch, spec, raw, stream)
        if p.splits > 1:
            launch_merge(p.combine_grid, p.combine, p.key, part_out, part_lse, sink, out, lse, p.splits,
                         (a_pout, a_plse, a_sink, a_out, a_lse), stream)


def prepare(a: SparseDecodeArgs, reuse_workspace: bool = False) -> Prepared:
    """The launches of every call with ``a``'s metadata (see :class:`Prepared`)."""
    return Prepared(a, reuse_workspace)


def forward(a: SparseDecodeArgs, splits: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """out [T, H, d_v] in q.dtype and lse [T, H] fp32 (sink excluded, +inf on empty rows)."""
    return run_fresh(Prepared(a, splits=splits), a)


def decode(a: SparseDecodeArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    """The op's entry point (the selector calls it with ``a`` alone)."""
    return forward(a)


decode.prepare = prepare  # the optional protocol of dsa.ops.decode


# ----------------------------------------------------------------------------
# Sparse attention of few rows


def as_decode(a: SparseAttnArgs) -> SparseDecodeArgs:
    """A packed sparse-attention call as a decode over its flat kv (pages of one row)."""
    return SparseDecodeArgs(a.q, a.kv[:, None], a.indices, a.topk_length, None, None, a.sink, a.sm_scale, a.d_v,
                            NATIVE, 1)


def attention_forward(a: SparseAttnArgs) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The forward of ``a`` through the split kernels when it has too few
    rows to fill the GPU (on CUDA, where the SM count is real), else None."""
    if not a.q.is_cuda:
        return None
    # the fewest programs the rows can take (64 heads each): with no room for a second split, nothing to build
    if sm_count(a.q.device) < 2 * a.T * a.G * triton.cdiv(a.H // a.G, 64):
        return None
    d = as_decode(a)
    if supports(d) is not None or pick(d)[0] is None or plan(d).splits == 1:
        return None
    return forward(d)
