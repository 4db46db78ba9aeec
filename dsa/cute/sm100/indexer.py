"""CuTe DSL lean indexer forward on SM100: what it serves, compilation cache, launch.

    scores(a) -> [Tq, max_seqlen_k] fp32
    indexer_topk(a, topk) -> (indices [Tq, topk] int32, lengths [Tq] int32)

on the canonical packed layout of :class:`dsa._args.IndexerArgs`, for 64
heads of 128 dims (``indexer_fwd.IndexerFwdSm100``).  ``indexer_topk`` is the
Triton indexer's chunked driver (``dsa.triton.indexer.chunked_topk``) with
these scores, so it returns exactly ``topk_indices(scores(a))``.  Compiled
kernels are cached per (``IndexerSm100Config``, device); every launch runs
under the tensors' device and its current stream.  Whether the kernel is
trusted is ``dsa.cute.sm100``'s decision, after ``self_check``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from dsa._args import IndexerArgs
from dsa.cute.host import address, arch_reason, compile_kernel, cutlass_dtype, dsl_reason, stream_handle

HEADS, DIM, BQ = 64, 128, 4  # as indexer_fwd (not imported: the DSL is only needed once the kernel is)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)

# (IndexerSm100Config, device index) -> compiled kernel
_COMPILED: Dict[tuple, object] = {}


def supports(a: IndexerArgs) -> Optional[str]:
    """None when the SM100 indexer can serve ``a``, else the reason."""
    why = arch_reason(a.q.device, "the cute SM100 indexer", "sm100") or dsl_reason()
    if why:
        return why
    if cutlass_dtype(a.q.dtype) is None or a.k.dtype != a.q.dtype:
        return f"the cute indexer takes bf16 or fp16 q and k of one dtype, got {a.q.dtype} and {a.k.dtype}"
    if a.weights.dtype not in _FLOATS:
        return f"the cute indexer takes bf16, fp16 or fp32 weights, got {a.weights.dtype}"
    H, D = a.q.shape[1], a.q.shape[2]
    if (H, D) != (HEADS, DIM):
        return f"the cute indexer serves {HEADS} heads of {DIM} dims, got {H} of {D}"
    if a.q.shape[0] * HEADS >= 2**31 or a.k.shape[0] >= 2**31 or a.max_seqlen_k >= 2**31:
        return "Tq * 64, Tk and max_seqlen_k must fit in int32"
    for name in ("q", "k"):
        if getattr(a, name).data_ptr() % 16:
            return f"{name} is not 16-byte aligned (TMA)"
    return None


def grid_reason(a: IndexerArgs) -> Optional[str]:
    """Why auto keeps the Triton indexer for ``a``: its grid (a block of 4
    queries a CTA slot, at least ceil(Tq / 4) of them) does not fill the
    GPU's SMs (None when it does)."""
    blocks = -(-a.q.shape[0] // BQ)
    sms = torch.cuda.get_device_properties(a.q.device).multi_processor_count
    if blocks < sms:
        return f"{blocks} query blocks of {BQ} do not fill the {sms} SMs; the Triton indexer serves this call"
    return None


def kernel_config(a: IndexerArgs):
    """The ``IndexerSm100Config`` that serves ``a`` (the self-check's key too)."""
    import cutlass

    from dsa.cute.sm100.indexer_fwd import IndexerSm100Config

    w_dtype = cutlass_dtype(a.weights.dtype) or cutlass.Float32
    return IndexerSm100Config(cutlass_dtype(a.q.dtype), w_dtype, bool(a.causal), a.batch == 1)


def launch_scores(a: IndexerArgs, out: torch.Tensor, blk_cum: Optional[torch.Tensor], row_begin: int,
                  row_end: int) -> None:
    """Score rows [row_begin, row_end) of the packed queries into out[0 : row_end - row_begin]
    (blk_cum: the block table of those rows, None for one sequence)."""
    from dsa.cute.sm100.indexer_fwd import IndexerFwdSm100

    with torch.cuda.device(a.q.device):
        cfg = kernel_config(a)
        B = a.batch
        key = (cfg, a.q.device.index)
        fn = _COMPILED.get(key)
        if fn is None:
            fn = _COMPILED[key] = compile_kernel(IndexerFwdSm100(**vars(cfg)), _pointer_types(cfg), _scalar_types())
        fn(*_pointers(a, out, blk_cum), a.q.shape[0], a.k.shape[0], row_begin, row_end, B,
           max(0, (B - 1).bit_length()), a.max_seqlen_k, a.ratio, float(a.sm_scale), out.stride(0),
           _grid(a, row_begin, row_end), stream_handle(a.q.device))


def _grid(a: IndexerArgs, row_begin: int, row_end: int) -> int:
    """CTAs: the SM count, or fewer when the rows have fewer units (at most
    one partial block of 4 rows a sequence beyond ceil(rows / 4))."""
    units = -(-(row_end - row_begin) // BQ) + (a.batch if a.batch > 1 else 0)
    return max(1, min(units, torch.cuda.get_device_properties(a.q.device).multi_processor_count))


def _pointers(a: IndexerArgs, out: torch.Tensor, blk_cum: Optional[torch.Tensor]) -> Tuple[int, ...]:
    """The kernel's pointer arguments: q, k, weights, out, cu_seqlens_q,
    cu_seqlens_k, q_offsets, the block table."""
    table = blk_cum if blk_cum is not None else a.cu_seqlens_q  # never read for one sequence
    return (address(a.q), address(a.k), address(a.weights), address(out), address(a.cu_seqlens_q),
            address(a.cu_seqlens_k), address(a.q_offsets), address(table))


def _pointer_types(cfg) -> Tuple:
    """(element type, alignment) of ``_pointers``' arguments, in order."""
    import cutlass

    I32 = (cutlass.Int32, 4)
    return ((cfg.dtype, 16), (cfg.dtype, 16), (cfg.w_dtype, 4), (cutlass.Float32, 4), I32, I32, (cutlass.Int64, 8),
            I32)


def _scalar_types() -> Tuple:
    """The scalars' types: Tq, Tk, first and end row, batch, its bit length,
    max_seqlen_k, ratio, sm_scale, out's row stride, CTAs."""
    import cutlass

    I32, I64 = cutlass.Int32, cutlass.Int64
    return I32, I32, I32, I32, I32, I32, I32, I64, cutlass.Float32, I64, I32


def scores(a: IndexerArgs) -> torch.Tensor:
    """-> [Tq, max_seqlen_k] fp32 (-inf where not visible)."""
    from dsa.triton.indexer import block_tables

    Tq = a.q.shape[0]
    out = torch.empty((Tq, a.max_seqlen_k), dtype=torch.float32, device=a.q.device)
    table = block_tables(a, BQ, Tq, 1)
    launch_scores(a, out, None if table is None else table[0], 0, Tq)
    return out


def indexer_topk(a: IndexerArgs, topk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """-> (indices [Tq, topk] int32 local key positions, -1 padded; lengths [Tq] int32)."""
    from dsa.triton.indexer import chunked_topk

    return chunked_topk(a, topk, BQ, launch_scores)


# --------------------------------------------------------------------------
# the self-check: the kernel against the Triton indexer on a hostile problem


def hostile_problem(config, device: torch.device, seed: int = 0) -> IndexerArgs:
    """A small packed problem of ``config``'s static shape (dtypes, causal, one
    sequence or three) on ``device``: with three sequences one has no query
    and rows of another see no key (negative q_offsets) or every key
    (q_offsets past S_k * ratio); ratio 2; max_seqlen_k beyond every S_k (the
    columns written -inf without compute); weights of both signs; and, with
    causality, keys of NaN that share a computed tile with visible keys but
    are visible to no query (they must give -inf, not NaN)."""
    g = torch.Generator().manual_seed(seed)
    names = {"BFloat16": torch.bfloat16, "Float16": torch.float16, "Float32": torch.float32}
    dtype, w_dtype = names[config.dtype.__name__], names[config.w_dtype.__name__]
    if config.single:
        s_q, s_k, offsets = [70], [180], [100]
    else:
        s_q, s_k, offsets = [37, 0, 70], [300, 5, 150], [-5, 3, 250]
    Tq, Tk = sum(s_q), sum(s_k)
    q = torch.randn(Tq, HEADS, DIM, generator=g)
    k = torch.randn(Tk, DIM, generator=g)
    w = torch.randn(Tq, HEADS, generator=g)
    if config.causal:  # the first sequence's keys 100..127 lie past every query's window
        k[100:128] = float("nan")
    cu_q = torch.tensor([0] + s_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + s_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return IndexerArgs(q.to(dtype).to(device), k.to(dtype).to(device), w.to(w_dtype).to(device), cu_q.to(device),
                       cu_k.to(device), torch.tensor(offsets, dtype=torch.int64, device=device),
                       max(s_k) + 200, 2, bool(config.causal), DIM ** -0.5)


def self_check(config, device: torch.device, kernel=None, reference=None) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """[(kernel's scores, the Triton indexer's)] on the hostile problem;
    ``kernel`` / ``reference`` stand in for them (the CPU tests)."""
    if kernel is None:
        kernel = scores
    if reference is None:
        from dsa.triton.indexer import scores as reference
    a = hostile_problem(config, device)
    return [(kernel(a), reference(a))]


def compile_offline(dtype: torch.dtype, w_dtype: torch.dtype, causal: bool, single: bool,
                    options: str = "--keep-ptx"):
    """Compile the kernel without a GPU (``CUTE_DSL_ARCH=sm_100a``), for CI and
    inspection; returns the compiled object (options as the forward's)."""
    import cutlass

    from dsa.cute.sm100.indexer_fwd import IndexerFwdSm100, IndexerSm100Config

    cfg = IndexerSm100Config(cutlass_dtype(dtype), cutlass_dtype(w_dtype) or cutlass.Float32, causal, single)
    return compile_kernel(IndexerFwdSm100(**vars(cfg)), _pointer_types(cfg), _scalar_types(), options)
