"""Input checking for every op and every backend, in one place.

Each ``*_args`` function validates the user's arguments (raising ``TypeError``
for a wrong type and ``ValueError`` for a wrong value, always naming the
argument, the expectation and what was given) and reduces the call to the
canonical form of :mod:`dsa._args`. Checks on shapes, dtypes and devices are
free of host synchronisation so that ``torch.compile`` traces them; only the
packed indexer's ``cu_seqlens`` checks read values back. They are left out
while compiling, and run on the device (``torch._assert_async``) while a
CUDA graph is being captured; both need ``max_seqlen_k`` given.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
import re
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from dsa import kv_cache as kv_formats
from dsa._args import DenseTargetArgs, IndexerArgs, SparseAttnArgs, SparseDecodeArgs, SparseIndexerArgs, TopkArgs
from dsa._rules import acc_dtype, slot_validity

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INT_DTYPES = (torch.int32, torch.int64)


def dense_tensor(name: str, x) -> torch.Tensor:
    """x, a torch.Tensor of the strided layout (the kernels address elements by strides); TypeError naming
    ``name`` for anything else (a sparse or nested tensor included)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.layout is not torch.strided or x.is_nested:
        kind = "a nested tensor" if x.is_nested else f"layout {str(x.layout).replace('torch.', '')}"
        raise TypeError(f"{name}: expected a dense (strided) tensor, got {kind}")
    return x


def _tensor(name: str, x, *, dtypes: Sequence[torch.dtype] = None) -> torch.Tensor:
    dense_tensor(name, x)
    if dtypes is not None and x.dtype not in dtypes:
        want = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({want}), got {str(x.dtype).replace('torch.', '')}")
    return x


def _rank(name: str, x: torch.Tensor, ranks: Sequence[int], what: str) -> None:
    if x.dim() not in ranks:
        raise ValueError(f"{name}: expected {what}, got shape {tuple(x.shape)}")


def _shape(name: str, x: torch.Tensor, shape: Tuple[int, ...], what: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({what}), got {tuple(x.shape)}")


def _query_and_keys(q, keys_name: str, keys, layouts: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [.., D] and the key tensor that shares its dtype (kv or k), their types and q's rank checked."""
    q = _tensor("q", q, dtypes=FLOAT_DTYPES)
    keys = _tensor(keys_name, keys, dtypes=FLOAT_DTYPES)
    _rank("q", q, (3, 4), layouts)
    if keys.dtype != q.dtype:
        raise ValueError(f"{keys_name}: expected dtype {q.dtype} (that of q), got {keys.dtype}")
    return q, keys


def _optional(name: str, x, dtypes: Sequence[torch.dtype]) -> None:
    if x is not None:
        _tensor(name, x, dtypes=dtypes)


def _same_device(ref_name: str, ref: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name}: expected device {ref.device} (that of {ref_name}), got {t.device}")


# the ops' schemas carry ints as int64: a larger value would fail inside torch
_INT64_MAX = 2**63 - 1


def _is_bool(v) -> bool:
    # bool, numpy's bool and a bool tensor are flags, never counts or scales
    return isinstance(v, bool) or type(v).__name__ in ("bool_", "bool") or (
        isinstance(v, torch.Tensor) and v.dtype == torch.bool
    )


def _int(name: str, v, *, low: int = None) -> int:
    """An int, a numpy integer or a one-element integer tensor, as a Python int."""
    try:
        if _is_bool(v):
            raise TypeError
        v = operator.index(v)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}") from None
    if low is not None and v < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {v}")
    if v > _INT64_MAX:
        raise ValueError(f"{name}: expected an int < 2**63, got {v}")
    return v


def flag(name: str, v) -> bool:
    """A bool keyword (return_lse, return_lengths, global_indices, ...)."""
    if not isinstance(v, bool):
        raise TypeError(f"{name}: expected a bool, got {type(v).__name__}")
    return v


def backend_arg(backend) -> str:
    """The ``backend`` keyword's type (its value is the selector's to judge).

    Checked before any custom op is called: the op's schema would reject a
    non-str with a RuntimeError that does not say what was expected.
    """
    if not isinstance(backend, str):
        raise TypeError(
            f"backend: expected a str ('auto', 'reference', 'triton' or 'cute'), got {type(backend).__name__}"
        )
    return backend


def _float(name: str, v) -> float:
    """A real number (int, float, numpy scalar or 0-dim tensor), as a Python float."""
    zero_dim = isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_complex()
    if _is_bool(v) or not (isinstance(v, numbers.Real) or zero_dim):
        raise TypeError(f"{name}: expected a float, got {type(v).__name__}")
    try:
        return float(v)
    except OverflowError:  # an int past the float range
        raise ValueError(f"{name}: expected a float, got an int too large for one ({len(str(abs(v)))} digits)") from None


def _int32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int32 else x.to(torch.int32)


def _safe_indices(idx: torch.Tensor, n: int, base: Optional[torch.Tensor]) -> torch.Tensor:
    """int32 global rows; anything outside [0, n) becomes -1 (still invalid).

    Needed when a conversion could turn an invalid index into a valid one:
    int64 values past 2**31 wrap on a cast, and a batch-local index >= n
    would land in the next batch once offset.
    """
    ok, _ = slot_validity(idx, None, n)
    if base is not None:
        idx = idx + base
    return torch.where(ok, idx, -1).to(torch.int32)


# --------------------------------------------------------------------------
# sparse attention


@dataclass(frozen=True)
class SparseAttnLayout:
    """How to give canonical outputs back the user's layout."""

    batch: Optional[int]  # B for the batched layout, None for packed
    seqlen: int  # S (batched) or T (packed)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> the user's leading dims."""
        if self.batch is None:
            return x
        return x.view(self.batch, self.seqlen, *x.shape[1:])


def _sparse_shapes(q, kv, indices):
    """-> (B or None, S, H, D, N, G, K) of a sparse-attention call, its shapes checked."""
    batched = q.dim() == 4
    lead = 1 if batched else 0  # leading batch axis
    if batched:
        B, S, H, D = q.shape
        _rank("kv", kv, (3, 4), "[B, N, D] or [B, N, H_kv, D] for batched q")
        if kv.shape[0] != B:
            raise ValueError(f"kv: expected batch size {B} (that of q), got {kv.shape[0]}")
    else:
        S, H, D = q.shape
        B = None
        _rank("kv", kv, (2, 3), "[N, D] or [N, H_kv, D] for packed q")
    if D == 0:
        raise ValueError(f"q: expected head dim D >= 1 (the last dim), got shape {tuple(q.shape)}")
    N = kv.shape[lead]
    G = kv.shape[lead + 1] if kv.dim() == 3 + lead else 1
    if kv.shape[-1] != D:
        raise ValueError(f"kv: expected head dim {D} (that of q), got {kv.shape[-1]}")
    if G < 1 or H % G != 0:
        raise ValueError(f"kv: the number of kv heads H_kv={G} must divide the query heads H={H}")

    _indices_shape(indices, *_row_shape(B, S), G, "kv")
    return B, S, H, D, N, G, indices.shape[-1]


def _indices_shape(indices: torch.Tensor, row_shape: Tuple[int, ...], rows: str, G: int, kv_name: str) -> None:
    """indices [*row_shape, K], or [*row_shape, G, K] (required when G > 1)."""
    if indices.dim() == len(row_shape) + 2:
        if indices.shape[len(row_shape)] != G:
            raise ValueError(
                f"indices: expected {G} kv heads on dim {len(row_shape)} (that of {kv_name}), "
                f"got shape {tuple(indices.shape)}"
            )
    elif not (indices.dim() == len(row_shape) + 1 and G == 1):
        want = f"{rows[:-1]}, K]" if G == 1 else f"{rows[:-1]}, H_kv={G}, K]"
        raise ValueError(f"indices: expected shape {want}, got {tuple(indices.shape)}")
    if tuple(indices.shape[: len(row_shape)]) != tuple(row_shape):
        raise ValueError(
            f"indices: expected leading dims {tuple(row_shape)} (those of q), got {tuple(indices.shape)}"
        )


def _row_shape(B: Optional[int], S: int) -> Tuple[Tuple[int, ...], str]:
    return ((B, S), "[B, S]") if B is not None else ((S,), "[T]")


def _scale_dv_sink(q: torch.Tensor, D: int, H: int, sm_scale, d_v, sink) -> Tuple[float, int, Optional[torch.Tensor]]:
    """sm_scale (default 1/sqrt(D)), d_v (default min(D, 512), at most D) and the sink [H] fp32, checked."""
    d_v = _int("d_v", min(D, 512) if d_v is None else d_v, low=1)
    if d_v > D:
        raise ValueError(f"d_v: expected d_v <= D={D}, got {d_v}")
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else _float("sm_scale", sm_scale)
    if sink is not None:
        _shape("sink", sink, (H,), "one value per query head")
        if q.dtype != torch.float64 and sink.dtype != torch.float32:
            raise TypeError(f"sink: expected dtype float32, got {sink.dtype}")
        sink = sink.contiguous()
    return sm_scale, d_v, sink


def sparse_attention_args(
    q, kv, indices, sm_scale, d_v, sink, topk_length, deterministic
) -> Tuple[SparseAttnArgs, SparseAttnLayout]:
    q, kv = _query_and_keys(q, "kv", kv, "[T, H, D] (packed) or [B, S, H, D] (batched)")
    indices = _tensor("indices", indices, dtypes=INT_DTYPES)
    _optional("sink", sink, (torch.float32, torch.float64))
    _optional("topk_length", topk_length, INT_DTYPES)
    _same_device("q", q, kv=kv, indices=indices, sink=sink, topk_length=topk_length)
    B, S, H, D, N, G, K = _sparse_shapes(q, kv, indices)

    sm_scale, d_v, sink = _scale_dv_sink(q, D, H, sm_scale, d_v, sink)
    # torch.use_deterministic_algorithms(True) asks the same of every op that has a deterministic mode
    deterministic = flag("deterministic", deterministic) or torch.are_deterministic_algorithms_enabled()
    row_shape, rows = _row_shape(B, S)
    if topk_length is not None:
        _shape("topk_length", topk_length, row_shape, f"one length per query row {rows}")

    T = S * B if B is not None else S
    idx = indices.reshape(T, G, K)
    if B is not None:
        base = (torch.arange(B, device=idx.device, dtype=idx.dtype) * N).view(B, 1, 1, 1)
        idx = _safe_indices(indices.reshape(B, S, G, K), N, base).view(T, G, K)
    elif idx.dtype != torch.int32:
        idx = _safe_indices(idx, N, None)
    if topk_length is not None:
        # clamp before the cast so int64 lengths past 2**31 cannot wrap negative
        topk_length = _int32(topk_length.reshape(T).clamp(-1, K)).contiguous()
    kvc = kv.reshape(N * B if B is not None else N, G, D).contiguous()
    args = SparseAttnArgs(q.reshape(T, H, D).contiguous(), kvc, idx.contiguous(), topk_length, sink, sm_scale, d_v,
                          deterministic)
    return args, SparseAttnLayout(batch=B, seqlen=S)


# --------------------------------------------------------------------------
# sparse decode
#
# A decode call's checks depend on its arguments' metadata alone (types,
# shapes, dtypes, devices, the cache's strides, the scalars), so they run in
# two parts: sparse_decode_form checks the metadata and concludes a
# DecodeForm (the sizes, the resolved scalars, how each tensor becomes
# canonical); DecodeForm.args applies it to the tensors. A serving loop
# repeats its metadata every step: dsa.sparse_decode keeps the forms by
# decode_key, and a dsa.SparseDecodePlan keeps one.


def _decode_format(kv_cache: torch.Tensor, cache_format) -> str:
    """The cache's format: the one named, else inferred (a byte cache by its bytes a token)."""
    if cache_format is not None and not isinstance(cache_format, str):
        raise TypeError(f"cache_format: expected a str or None, got {type(cache_format).__name__}")
    byte_cache = kv_cache.dtype in kv_formats.BYTE_DTYPES
    if cache_format is None:
        if not byte_cache:
            return kv_formats.NATIVE
        name = kv_formats.format_of_bytes(kv_cache.shape[-1]) if kv_cache.dim() else None
        if name is None:
            sizes = ", ".join(f"{n}: {f.bytes_per_token}" for n, f in kv_formats.FORMATS.items())
            raise ValueError(f"kv_cache: a byte cache of {kv_cache.shape[-1] if kv_cache.dim() else 0} bytes a token "
                             f"matches no FP8 format ({sizes}); pass cache_format")
        return name
    if cache_format not in kv_formats.CACHE_FORMATS:
        raise ValueError(f"cache_format: expected one of {kv_formats.CACHE_FORMATS} or None, got {cache_format!r}")
    if (cache_format == kv_formats.NATIVE) == byte_cache:
        want = "q's dtype" if cache_format == kv_formats.NATIVE else "a byte dtype (uint8, int8, float8_e4m3fn)"
        raise ValueError(f"kv_cache: cache_format={cache_format!r} needs {want}, got {kv_cache.dtype}")
    return cache_format


def _cache_view(kv_cache: torch.Tensor, name: str) -> torch.Tensor:
    """The cache as the canonical view: uint8 [P, page_size, bytes] (FP8) or [P, page_size, H_kv, D] (native;
    a flat cache is P = N pages of one row)."""
    if name != kv_formats.NATIVE:
        c = kv_cache.view(torch.uint8) if kv_cache.dtype != torch.uint8 else kv_cache
        return c[:, :, 0] if c.dim() == 4 else c
    if kv_cache.dim() == 2:
        return kv_cache[:, None, None]
    return kv_cache[:, None] if kv_cache.dim() == 3 else kv_cache


def _decode_cache(q: torch.Tensor, kv_cache: torch.Tensor, name: str) -> Tuple[torch.Tensor, int, bool, bool]:
    """-> (the canonical view of the cache, the D of its rows, whether it is paged, whether its rows must be
    copied to be contiguous: a native cache's page stride may be anything, its rows' layout may not)."""
    if name != kv_formats.NATIVE:
        fmt = kv_formats.cache_format_of(kv_cache, name)
        c = _cache_view(kv_cache, name)
        if (c.shape[2] > 1 and c.stride(2) != 1) or (c.shape[1] > 1 and c.stride(1) != c.shape[2]):
            raise ValueError(f"kv_cache: the {fmt.bytes_per_token} bytes of each token and the tokens of a page "
                             f"must be contiguous, got strides {tuple(kv_cache.stride())}")
        return c, fmt.D, True, False
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache: expected dtype {q.dtype} (that of q) for a native cache, got {kv_cache.dtype}")
    _rank("kv_cache", kv_cache, (2, 3, 4),
          "[N, D] or [N, H_kv, D] (flat) or [num_pages, page_size, H_kv, D] (paged)")
    kv4 = _cache_view(kv_cache, name)
    _, PS, G, D = kv4.shape
    copy = (D > 1 and kv4.stride(3) != 1) or (G > 1 and kv4.stride(2) != D) or (PS > 1 and kv4.stride(1) != G * D)
    return kv4, D, kv_cache.dim() == 4, copy


def _decode_tables(block_table, seq_lens, B: int, paged: bool) -> None:
    """block_table [B, W] and seq_lens [B] (only with a block table, on a paged cache), their shapes checked."""
    if block_table is None:
        if seq_lens is not None:
            raise ValueError("seq_lens: only with a block_table (it bounds the positions the table translates)")
        return
    if not paged:
        raise ValueError("block_table: needs a paged kv_cache ([num_pages, page_size, ...]); this one is flat")
    _rank("block_table", block_table, (2,), f"[B={B}, max_pages]")
    if block_table.shape[0] != B:
        raise ValueError(f"block_table: expected {B} rows (one per sequence), got shape {tuple(block_table.shape)}")
    if seq_lens is not None:
        _shape("seq_lens", seq_lens, (B,), "one length per sequence [B]")


def _canonical(x: torch.Tensor, shape: Tuple[int, ...], views: bool) -> torch.Tensor:
    """x's elements as a contiguous tensor of ``shape`` (``views=False``: x itself when contiguous)."""
    if x.is_contiguous():
        return x.view(shape) if views and x.shape != shape else x
    return x.reshape(shape).contiguous()


@dataclass(frozen=True)
class DecodeForm:
    """What the checks of a sparse-decode call concluded from its metadata.

    B sequences of S query rows (T = B * S; packed q is S = 1), H heads of
    D, G kv heads, K slots; the cache's format, its canonical shape
    ``cache_shape`` and whether it is a copy (``cache_copy``: a native cache
    whose rows are not contiguous); which of the optional tensors are given
    and which need int64 -> int32 conversion. :meth:`args` builds the
    canonical arguments; equal metadata, equal form."""

    cache_format: str
    B: int
    S: int
    H: int
    D: int
    G: int
    K: int
    batched: bool
    sm_scale: float
    d_v: int
    cache_shape: Tuple[int, ...]
    cache_copy: bool
    table_width: Optional[int]  # W of block_table [B, W], None without one
    wide: Tuple[bool, bool, bool, bool]  # int64 indices, block_table, seq_lens, topk_length: converted to int32
    layout: SparseAttnLayout

    @property
    def T(self) -> int:
        return self.B * self.S

    @property
    def slots(self) -> int:
        """How many slots an index may address: the table's or the cache's pages times page_size."""
        pages = self.table_width if self.table_width is not None else self.cache_shape[0]
        return pages * self.cache_shape[1]

    def cache(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The canonical cache of ``kv_cache`` (metadata as checked): a view, or a copy when ``cache_copy``."""
        c = _cache_view(kv_cache, self.cache_format)
        return c.contiguous() if self.cache_copy else c

    def rows(self, q, indices, block_table, seq_lens, topk_length, *,
             views: bool = True) -> Tuple[Optional[torch.Tensor], ...]:
        """(q, indices, block_table, seq_lens, topk_length) of a call with the form's metadata, canonical:
        q [T, H, D], indices [T, G, K], topk_length [T] or [B]; the integers int32 (int64 values outside
        their range made invalid, or clamped, before the cast so that none wraps); all contiguous. With
        ``views=False`` a contiguous tensor keeps its own shape: its contents are the canonical ones (the
        form a launch that reads pointers takes, without the views' host time)."""
        T, K = self.T, self.K
        wide_idx, wide_bt, wide_sl, wide_tl = self.wide
        q = _canonical(q, (T, self.H, self.D), views)
        idx = _canonical(indices, (T, self.G, K), views)
        if wide_idx:
            idx = _safe_indices(idx, self.slots, None)
        if block_table is not None:
            if wide_bt:
                block_table = _safe_indices(block_table, self.cache_shape[0], None)
            block_table = block_table.contiguous()
        if seq_lens is not None:
            seq_lens = (_int32(seq_lens.clamp(-1, self.slots)) if wide_sl else seq_lens).contiguous()
        if topk_length is not None:
            topk_length = _canonical(topk_length, (topk_length.numel(),), views)
            if wide_tl:  # clamped before the cast (int32 lengths are clamped where they are read)
                topk_length = _int32(topk_length.clamp(-1, K))
        return q, idx, block_table, seq_lens, topk_length

    def args(self, q, kv_cache, indices, block_table, seq_lens, topk_length, sink) -> SparseDecodeArgs:
        """The canonical arguments of tensors whose metadata is the form's."""
        return self.bind(self.rows(q, indices, block_table, seq_lens, topk_length), self.cache(kv_cache),
                         None if sink is None else sink.contiguous())

    def bind(self, rows: Tuple[Optional[torch.Tensor], ...], kv: torch.Tensor,
             sink: Optional[torch.Tensor]) -> SparseDecodeArgs:
        """The canonical arguments of :meth:`rows`' tensors, the canonical cache and a contiguous sink."""
        q, idx, block_table, seq_lens, topk_length = rows
        return SparseDecodeArgs(q, kv, idx, topk_length, block_table, seq_lens, sink, self.sm_scale, self.d_v,
                                self.cache_format, self.S)


def sparse_decode_form(
    q, kv_cache, indices, block_table, seq_lens, topk_length, sink, sm_scale, d_v, cache_format
) -> DecodeForm:
    """Every check of a sparse-decode call (batched q [B, S_q, H, D] with indices [B, S_q, K] and
    topk_length [B, S_q] or [B]; packed q [T, H, D], each row its own sequence, with indices [T, K] and
    topk_length [T]; indices carry an H_kv axis before K when the native cache has H_kv > 1;
    block_table [B, W], seq_lens [B]), on metadata only: no tensor is read or written."""
    q = _tensor("q", q, dtypes=FLOAT_DTYPES)
    _rank("q", q, (3, 4), "[B, S_q, H, D] (batched) or [T, H, D] (packed)")
    kv_cache = _tensor("kv_cache", kv_cache)
    indices = _tensor("indices", indices, dtypes=INT_DTYPES)
    _optional("block_table", block_table, INT_DTYPES)
    _optional("seq_lens", seq_lens, INT_DTYPES)
    _optional("topk_length", topk_length, INT_DTYPES)
    _optional("sink", sink, (torch.float32, torch.float64))
    _same_device("q", q, kv_cache=kv_cache, indices=indices, block_table=block_table, seq_lens=seq_lens,
                 topk_length=topk_length, sink=sink)
    name = _decode_format(kv_cache, cache_format)
    kv, D_kv, paged, copy = _decode_cache(q, kv_cache, name)
    batched = q.dim() == 4
    B, S = (q.shape[0], q.shape[1]) if batched else (q.shape[0], 1)
    H, D = q.shape[-2], q.shape[-1]
    if D != D_kv:
        raise ValueError(f"q: expected head dim {D_kv} (that of the {name} kv_cache), got {D}")
    G = kv.shape[2] if kv.dim() == 4 else 1
    if G < 1 or H % G != 0:
        raise ValueError(f"kv_cache: the number of kv heads H_kv={G} must divide the query heads H={H}")
    row_shape, rows = _row_shape(B if batched else None, S if batched else B)
    _indices_shape(indices, row_shape, rows, G, "kv_cache")
    K = indices.shape[-1]
    sm_scale, d_v, _ = _scale_dv_sink(q, D, H, sm_scale, d_v, sink)
    _decode_tables(block_table, seq_lens, B, paged)
    if topk_length is not None and not (batched and tuple(topk_length.shape) == (B,)):
        _shape("topk_length", topk_length, row_shape,
               f"one length per query row {rows}" + (" or per sequence [B]" if batched else ""))
    wide = tuple(t is not None and t.dtype != torch.int32 for t in (indices, block_table, seq_lens, topk_length))
    return DecodeForm(name, B, S, H, D, G, K, batched, sm_scale, d_v, tuple(kv.shape), copy,
                      None if block_table is None else block_table.shape[1], wide,
                      SparseAttnLayout(batch=B if batched else None, seqlen=S if batched else B))


def sparse_decode_args(
    q, kv_cache, indices, block_table, seq_lens, topk_length, sink, sm_scale, d_v, cache_format
) -> Tuple[SparseDecodeArgs, SparseAttnLayout]:
    """Sparse decode's canonical arguments and the user's layout (:func:`sparse_decode_form`'s checks)."""
    form = sparse_decode_form(q, kv_cache, indices, block_table, seq_lens, topk_length, sink, sm_scale, d_v,
                              cache_format)
    return form.args(q, kv_cache, indices, block_table, seq_lens, topk_length, sink), form.layout


def _meta(x) -> Optional[tuple]:
    """What the checks read of a tensor argument (strides: the cache's alone)."""
    return None if x is None else (x.dtype, x.shape, x.device)


def decode_key(q, kv_cache, indices, block_table, seq_lens, topk_length, sink, sm_scale, d_v,
               cache_format) -> Optional[tuple]:
    """Everything :func:`sparse_decode_form` reads, as a hashable key: calls with equal keys have equal forms
    (and pass or fail its checks alike). It is each tensor's dtype, shape and device, the cache's strides and
    the scalars; None (no key: check the call afresh) unless every tensor is a plain, dense ``torch.Tensor``
    (or None) and sm_scale, d_v and cache_format are a Python float or int, int and str (or None)."""
    for x in (q, kv_cache, indices, block_table, seq_lens, topk_length, sink):
        if x is not None and (type(x) is not torch.Tensor or x.layout is not torch.strided):
            return None
    if q.is_meta:  # no data: the op's fake implementation gives the results' shapes, whatever the backend
        return None
    # bool is not int here, and 2 and 2.0 are one key with one result (sm_scale 2.0)
    if not ((sm_scale is None or type(sm_scale) is float or type(sm_scale) is int)
            and (d_v is None or type(d_v) is int) and (cache_format is None or type(cache_format) is str)):
        return None
    try:
        return (_meta(q), _meta(kv_cache), kv_cache.stride(), _meta(indices), _meta(block_table), _meta(seq_lens),
                _meta(topk_length), _meta(sink), sm_scale, d_v, cache_format)
    except RuntimeError:  # a nested tensor has no sizes: the checks name it
        return None


# --------------------------------------------------------------------------
# indexer


@dataclass(frozen=True)
class IndexerLayout:
    batch: Optional[int]  # B for batched, None for packed
    seqlen_q: int

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch is None:
            return x
        return x.view(self.batch, self.seqlen_q, *x.shape[1:])


@functools.lru_cache(maxsize=64)
def _uniform_cached(device: torch.device, B: int, Sq: int, Sk: int) -> Tuple[torch.Tensor, ...]:
    # One blocking copy per new key, so the tensors are complete before any
    # stream reads them; never written afterwards.
    cu = torch.tensor([b * Sq for b in range(B + 1)] + [b * Sk for b in range(B + 1)], dtype=torch.int32,
                      device=device)
    return cu[: B + 1], cu[B + 1 :], torch.tensor([0] * B, dtype=torch.int64, device=device)


def _uniform_offsets(device: torch.device, B: int, Sq: int, Sk: int) -> Tuple[torch.Tensor, ...]:
    """(cu_seqlens_q, cu_seqlens_k) int32 [B+1] of B sequences of Sq / Sk
    rows, and zero q_offsets int64 [B]. Cached for small B: otherwise five
    tiny launches a call, a large part of the host time of a short kernel.
    Not cached while tracing or capturing a CUDA graph."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if B <= 64 and not capturing and not torch.compiler.is_compiling():
        return _uniform_cached(device, B, Sq, Sk)
    base = torch.arange(B + 1, device=device, dtype=torch.int32)
    return base * Sq, base * Sk, torch.zeros(B, device=device, dtype=torch.int64)


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream: no value may be read back then."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _cu_seqlens(name: str, cu, total: int, device: torch.device, read: bool) -> Tuple[torch.Tensor, list]:
    """cu_seqlens as int32, and its values when ``read`` (checked on the host), else None."""
    cu = _tensor(name, cu, dtypes=INT_DTYPES)
    _rank(name, cu, (1,), "a 1-D tensor [B+1]")
    if cu.shape[0] < 1:
        raise ValueError(f"{name}: expected at least one entry [B+1], got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name}: expected device {device} (that of q), got {cu.device}")
    if not read:
        return _int32(cu).contiguous(), None
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(f"{name}: expected to start at 0, got {vals[0]}")
    if any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"{name}: expected non-decreasing offsets, got {vals}")
    if vals[-1] != total:
        raise ValueError(f"{name}: expected to end at {total} (the number of packed rows), got {vals[-1]}")
    return _int32(cu).contiguous(), vals


def cu_seqlens_on_device(name: str, cu: torch.Tensor, total: int, max_len: Optional[int] = None) -> None:
    """The value checks of cu_seqlens, run on the device: nothing is read back.

    Used while a CUDA graph is captured (the check is captured with the call
    and runs at every replay). With ``max_len``, every sequence must also be
    at most that long (max_seqlen_k).
    """
    lens = cu[1:] - cu[:-1]
    ok = (cu[0] == 0) & (cu[-1] == total) & (lens >= 0).all()
    what = f"start at 0, be non-decreasing and end at {total}"
    if max_len is not None:
        ok &= (lens <= max_len).all()
        what += f", with no sequence longer than max_seqlen_k={max_len}"
    torch._assert_async(ok, f"{name}: expected to {what}")


def _packed_sequences(cu_seqlens_q, cu_seqlens_k, Tq: int, Tk: int, max_seqlen_k, device):
    """-> (cu_q, cu_k, zero q_offsets or None, max_k) of the packed layout."""
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q/cu_seqlens_k: give both or neither (neither means one sequence)")
    if max_seqlen_k is not None:
        max_seqlen_k = _int("max_seqlen_k", max_seqlen_k, low=0)
    if cu_seqlens_q is None:
        cu_q, cu_k, zero_offsets = _uniform_offsets(device, 1, Tq, Tk)
        longest = Tk
    else:
        zero_offsets = None
        capturing = _capturing(device)
        if max_seqlen_k is None and (capturing or torch.compiler.is_compiling()):
            raise ValueError("max_seqlen_k: required for the packed layout under torch.compile or CUDA-graph capture")
        read = not (capturing or torch.compiler.is_compiling())
        cu_q, _ = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, Tq, device, read)
        cu_k, vk = _cu_seqlens("cu_seqlens_k", cu_seqlens_k, Tk, device, read)
        if cu_k.shape[0] != cu_q.shape[0]:
            raise ValueError(
                f"cu_seqlens_k: expected {cu_q.shape[0]} entries (that of cu_seqlens_q), got {cu_k.shape[0]}"
            )
        if capturing:
            cu_seqlens_on_device("cu_seqlens_q", cu_q, Tq)
            cu_seqlens_on_device("cu_seqlens_k", cu_k, Tk, max_seqlen_k)
        longest = None if vk is None else max((b - a for a, b in zip(vk, vk[1:])), default=0)
    if max_seqlen_k is None:
        return cu_q, cu_k, zero_offsets, longest
    if longest is not None and max_seqlen_k < longest:
        raise ValueError(f"max_seqlen_k: expected >= the longest key sequence {longest}, got {max_seqlen_k}")
    return cu_q, cu_k, zero_offsets, max_seqlen_k


def _batched_sequences(q, k, weights, max_seqlen_k):
    """-> (Tq, Tk, cu_q, cu_k, zero q_offsets, max_k) of the batched layout, shapes checked."""
    B, Sq, H, _ = q.shape
    _rank("k", k, (3, 4), "[B, S_k, D_i] or [B, S_k, 1, D_i] for batched q")
    if k.dim() == 4 and k.shape[2] != 1:
        raise ValueError(f"k: expected a single shared key head [B, S_k, 1, D_i], got {tuple(k.shape)}")
    if k.shape[0] != B:
        raise ValueError(f"k: expected batch size {B} (that of q), got {k.shape[0]}")
    Sk = k.shape[1]
    _shape("weights", weights, (B, Sq, H), "[B, S_q, H_i]")
    if max_seqlen_k is not None and _int("max_seqlen_k", max_seqlen_k) != Sk:
        raise ValueError(f"max_seqlen_k: expected S_k={Sk} for batched k, got {max_seqlen_k}")
    return (B * Sq, B * Sk) + _uniform_offsets(q.device, B, Sq, Sk) + (Sk,)


def _q_offsets(q_offsets, B: int, Tq: int, ratio: int, max_k: int) -> torch.Tensor:
    q_offsets = _tensor("q_offsets", q_offsets, dtypes=INT_DTYPES)
    _shape("q_offsets", q_offsets, (B,), "one offset per sequence [B]")
    # int64, clamped to a range that gives every query the same visible keys
    # (at or below -(Tq + 1) nothing is visible, at or above ratio * max_k
    # everything is) and in which q_offsets + i + 1 cannot overflow; an int32
    # cast would wrap offsets past 2**31 into different (valid) ones.
    hi = min(ratio * max_k, _INT64_MAX - Tq - 1)
    return q_offsets.long().clamp(-(Tq + 1), hi).contiguous()


def indexer_args(
    q, k, weights, ratio, sm_scale, causal, q_offsets, cu_seqlens_q, cu_seqlens_k, max_seqlen_k
) -> Tuple[IndexerArgs, IndexerLayout]:
    q, k = _query_and_keys(q, "k", k, "[T_q, H_i, D_i] (packed) or [B, S_q, H_i, D_i] (batched)")
    weights = _tensor("weights", weights, dtypes=FLOAT_DTYPES)
    _optional("q_offsets", q_offsets, INT_DTYPES)
    _same_device("q", q, k=k, weights=weights, q_offsets=q_offsets)
    ratio = _int("ratio", ratio, low=1)
    sm_scale = _float("sm_scale", sm_scale)
    flag("causal", causal)
    H, D = q.shape[-2], q.shape[-1]

    if q.dim() == 4:
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise ValueError("cu_seqlens_q/cu_seqlens_k: only for the packed layout (q [T_q, H_i, D_i]); q is batched")
        Tq, Tk, cu_q, cu_k, zero_offsets, max_k = _batched_sequences(q, k, weights, max_seqlen_k)
        layout = IndexerLayout(batch=q.shape[0], seqlen_q=q.shape[1])
    else:
        Tq, Tk = q.shape[0], k.shape[0]
        _rank("k", k, (2, 3), "[T_k, D_i] or [T_k, 1, D_i] for packed q")
        if k.dim() == 3 and k.shape[1] != 1:
            raise ValueError(f"k: expected a single shared key head [T_k, 1, D_i], got {tuple(k.shape)}")
        _shape("weights", weights, (Tq, H), "[T_q, H_i]")
        cu_q, cu_k, zero_offsets, max_k = _packed_sequences(cu_seqlens_q, cu_seqlens_k, Tq, Tk, max_seqlen_k, q.device)
        layout = IndexerLayout(batch=None, seqlen_q=Tq)
    if k.shape[-1] != D:
        raise ValueError(f"k: expected head dim {D} (that of q), got {k.shape[-1]}")
    B = cu_q.shape[0] - 1
    if q_offsets is not None:
        q_offsets = _q_offsets(q_offsets, B, Tq, ratio, max_k)
    else:
        q_offsets = zero_offsets if zero_offsets is not None else torch.zeros(B, device=q.device, dtype=torch.int64)
    qc, kc, wc = q.reshape(Tq, H, D).contiguous(), k.reshape(Tk, D).contiguous(), weights.reshape(Tq, H).contiguous()
    return IndexerArgs(qc, kc, wc, cu_q, cu_k, q_offsets, max_k, ratio, causal, sm_scale), layout


# --------------------------------------------------------------------------
# top-k


def topk_args(scores, k, row_ends=None) -> Tuple[TopkArgs, Tuple[int, ...]]:
    scores = _tensor("scores", scores, dtypes=FLOAT_DTYPES)
    _rank("scores", scores, tuple(range(1, 9)), "at least one dim (top-k runs on the last)")
    k = _int("k", k, low=0)
    _optional("row_ends", row_ends, INT_DTYPES)
    _same_device("scores", scores, row_ends=row_ends)
    lead = tuple(scores.shape[:-1])
    S = scores.shape[-1]
    rows = math.prod(lead)  # not reshape(-1, S): ambiguous when S == 0
    if row_ends is not None:
        _shape("row_ends", row_ends, lead, "one end per row of scores, scores.shape[:-1]")
        row_ends = row_ends.reshape(rows)
        if row_ends.dtype != torch.int32:
            # clamped before the cast so int64 ends past 2**31 cannot wrap (int32 is clamped where it is read)
            row_ends = _int32(row_ends.clamp(0, S))
        row_ends = row_ends.contiguous()
    return TopkArgs(scores=scores.reshape(rows, S).contiguous(), topk=k, row_ends=row_ends), lead


def topk_value(name: str, topk) -> int:
    return _int(name, topk, low=0)


# --------------------------------------------------------------------------
# indexer training (attention targets, sparse indexer, KL loss)


def _renamed(renames, fn, *args, **kwargs):
    """Call a shared checker, naming the caller's arguments in its errors.

    The training ops reuse :func:`sparse_attention_args` and
    :func:`indexer_args`, whose messages say ``q`` / ``kv`` / ``k``; a user of
    ``sparse_indexer_scores`` passed ``q_i`` / ``k_i`` and must read those.
    """
    try:
        return fn(*args, **kwargs)
    except (TypeError, ValueError) as e:
        pattern = re.compile(r"\b(" + "|".join(re.escape(n) for n in renames) + r")\b")
        raise type(e)(pattern.sub(lambda m: renames[m.group(1)], str(e))) from None


def attention_target_args(
    q, kv, indices, lse, sm_scale, d_v, sink, topk_length
) -> Tuple[SparseAttnArgs, torch.Tensor, SparseAttnLayout, bool]:
    """-> (canonical args, lse [T, H], layout, whether indices carry an H_kv axis).

    Same layouts and checks as sparse attention (sink and d_v are checked but
    change nothing); lse is [T, H] / [B, S, H] float32 from
    ``sparse_attention(..., return_lse=True)``.
    """
    a, layout = sparse_attention_args(q, kv, indices, sm_scale, d_v, sink, topk_length, False)
    lse = _tensor("lse", lse, dtypes=(torch.float32, torch.float64))
    _shape("lse", lse, tuple(q.shape[:-1]), "one value per query row and head, as sparse_attention(..., return_lse=True) gives")
    _same_device("q", q, lse=lse)
    lse = lse.reshape(a.T, a.H).to(acc_dtype(q)).contiguous()
    return a, lse, layout, indices.dim() == q.dim()


def sparse_indexer_args(
    q_i, k_i, weights, indices, sm_scale, topk_length, deterministic
) -> Tuple[SparseIndexerArgs, SparseAttnLayout]:
    """The indexer on sparse-attention slots: packed q_i [T, H_i, D_i], k_i [N, D_i],
    weights [T, H_i], indices [T, K] (global rows of k_i), or batched q_i
    [B, S, H_i, D_i], k_i [B, N, D_i], weights [B, S, H_i], indices [B, S, K]
    (rows local to the batch)."""
    q_i = _tensor("q_i", q_i, dtypes=FLOAT_DTYPES)
    k_i = _tensor("k_i", k_i, dtypes=FLOAT_DTYPES)
    weights = _tensor("weights", weights, dtypes=FLOAT_DTYPES)
    _rank("q_i", q_i, (3, 4), "[T, H_i, D_i] (packed) or [B, S, H_i, D_i] (batched)")
    if q_i.dim() == 4:
        _rank("k_i", k_i, (3,), "one shared key [B, N, D_i] for batched q_i")
    else:
        _rank("k_i", k_i, (2,), "one shared key [N, D_i] for packed q_i")
    sm_scale = _float("sm_scale", sm_scale)
    renames = {"q": "q_i", "kv": "k_i"}
    a, layout = _renamed(renames, sparse_attention_args, q_i, k_i, indices, sm_scale, None, None, topk_length,
                         deterministic)
    _shape("weights", weights, tuple(q_i.shape[:-1]), "one weight per query row and head")
    _same_device("q_i", q_i, weights=weights)
    wc = weights.reshape(a.T, a.H).contiguous()
    k = a.kv.view(a.N, a.D)
    return SparseIndexerArgs(a.q, k, wc, a.indices.view(a.T, a.K), a.topk_length, a.sm_scale, a.deterministic), layout


def kl_target_arg(target, a: SparseIndexerArgs, indices_shape: Tuple[int, ...]) -> torch.Tensor:
    """target [.., K] (the shape of indices) -> [T, K] float32 (float64 for float64 q_i)."""
    target = _tensor("target", target, dtypes=FLOAT_DTYPES)
    _shape("target", target, tuple(indices_shape), "one value per slot, the shape of indices")
    _same_device("q_i", a.q, target=target)
    return target.reshape(a.T, a.K).to(acc_dtype(a.q)).contiguous()


def dense_target_args(
    q, kv, ratio, sm_scale, causal, q_offsets, cu_seqlens_q, cu_seqlens_k, max_seqlen_k
) -> Tuple[DenseTargetArgs, IndexerLayout]:
    """Dense attention target: the indexer's layouts and visibility with kv
    [B, S_k, D] / packed [T_k, D] in place of the indexer key and no weights."""
    q = _tensor("q", q, dtypes=FLOAT_DTYPES)
    kv = _tensor("kv", kv, dtypes=FLOAT_DTYPES)
    _rank("q", q, (3, 4), "[T_q, H, D] (packed) or [B, S_q, H, D] (batched)")
    if sm_scale is None and q.shape[-1] == 0:
        raise ValueError(f"q: expected head dim D >= 1 (sm_scale defaults to 1/sqrt(D)), got shape {tuple(q.shape)}")
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else _float("sm_scale", sm_scale)
    # indexer_args wants head weights; a broadcast of ones stands in (never read)
    ones = torch.ones((), device=q.device, dtype=torch.float32).expand(q.shape[:-1])
    ia, layout = _renamed({"k": "kv"}, indexer_args, q, kv, ones, ratio, sm_scale, causal, q_offsets, cu_seqlens_q,
                          cu_seqlens_k, max_seqlen_k)
    # the same fields but the weights, which the target has not
    values = {f.name: getattr(ia, f.name) for f in dataclasses.fields(ia)}
    values["kv"] = values.pop("k")
    del values["weights"]
    return DenseTargetArgs(**values), layout
