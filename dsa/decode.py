"""Sparse decode for serving: a few query rows a sequence against a paged, possibly FP8, KV cache.

    out = sparse_decode(q, kv_cache, indices, block_table=bt, seq_lens=lens, topk_length=n)

    plan = sparse_decode_plan(q, kv_cache, indices, block_table=bt, seq_lens=lens, topk_length=n)
    out = plan(q, kv_cache, indices, block_table=bt, seq_lens=lens, topk_length=n)   # every layer and step

The computation is sparse attention's (docs/semantics.md, "Sparse decode"):
the same scores, sink and lse, on the rows that ``indices`` address in the
cache, dequantised when the cache is FP8 (:mod:`dsa.kv_cache`). The op is
``dsa::sparse_decode`` (:mod:`dsa.ops.decode`); the Triton backend splits each
row's slots over several programs when the rows alone would leave the GPU
idle, and merges the parts by their lse.

Host time. A decode kernel takes tens of microseconds, so the Python around
its launches matters. Every check of a call depends on its arguments'
metadata alone (``dsa._checks.sparse_decode_form``), so the function keeps
what the checks concluded, the backend's choice and the backend's prepared
launches (``prepare`` in :mod:`dsa.ops.decode`) per metadata
(``dsa._checks.decode_key``); a repeated call pays the key, the views that
make its tensors canonical, its output allocations and the launches. A
:class:`SparseDecodePlan` goes further: it checks one call's metadata once,
and a call compares its tensors' shapes, dtypes and devices with the plan's
(no key, no environment read) and launches, its scratch memory allocated
once; a repeated call's tensors are compared with the last call's in one
C++ test (torch's ``TensorGuards``, the guards of ``torch.compile``). Eager
calls run the chosen implementation directly; anything the dispatcher
must see (``torch.compile``, a dispatch mode, a functorch transform, a tensor
subclass, autograd) goes through the op.
"""

from __future__ import annotations

import operator
import os
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from dsa import _checks, ops
from dsa._kept import kept
from dsa._rules import acc_dtype
from dsa.ops import decode as decode_op
from dsa.ops._core import direct_plain, traced

Backend = str  # "auto" | "reference" | "triton" | "cute"

try:  # one C++ test of a call's tensors: class, dispatch keys, dtype, device, sizes, strides, requires_grad
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # the plan's Python tests (SparseDecodePlan._lean_ok) then serve alone
    _TensorGuards = None
_IS_NESTED = operator.attrgetter("is_nested")


def _decode(q, kv_cache, indices, block_table, seq_lens, topk_length, sink, sm_scale, d_v, cache_format,
            return_lse, backend):
    _checks.flag("return_lse", return_lse)
    _checks.backend_arg(backend)
    return _checks.sparse_decode_args(q, kv_cache, indices, block_table, seq_lens, topk_length, sink, sm_scale,
                                      d_v, cache_format)


def _on_device(index: Optional[int], run: Callable[..., Any], *args: Any) -> Any:
    """run(*args) with CUDA device ``index`` current (None: not CUDA), as the op's body runs
    (dsa.ops._core.on_device): kernels launch on the current device. (``index`` is only ever a device
    that already holds tensors, so CUDA is initialised: torch's device query without its init check.)"""
    if index is not None and index != torch._C._cuda_getDevice():
        with torch.cuda.device(index):
            return run(*args)
    return run(*args)


class _Known:
    """What sparse_decode keeps for one call metadata (``_checks.decode_key``): the checks' form, the
    shape key, the outputs' shapes, and per backend asked for (and steering variables) the chosen
    implementation with its prepared launches (None when it offers none or the call is empty)."""

    def __init__(self, form: _checks.DecodeForm, a, q: Tensor):
        self.form = form
        self.shape_key = a.shape_key
        self.empty = a.empty
        self.out_shape = q.shape[:-1] + (form.d_v,)
        self.lse_shape = q.shape[:-1]
        self.lse_dtype = acc_dtype(q)
        self.cuda = q.get_device() if q.is_cuda else None
        self.runs: Dict[Tuple, Tuple[Callable[..., Any], Optional[Callable[..., None]]]] = {}

    def run(self, a, backend: str) -> Tuple[Callable[..., Any], Optional[Callable[..., None]]]:
        key = (backend, os.environ.get("DSA_BACKEND"), os.environ.get("DSA_DISABLE_CUTE"))
        run = self.runs.get(key)
        if run is None:
            if a is None:
                return None, None
            fn = decode_op.choice(a, backend).fn
            prepare = getattr(fn, "prepare", None)
            run = self.runs[key] = (fn, prepare(a, False) if prepare is not None and not self.empty else None)
        return run


_KNOWN: Dict[tuple, _Known] = {}  # per call metadata; a serving loop has a few per batch size and layer shape


def sparse_decode(
    q: Tensor, kv_cache: Tensor, indices: Tensor, *, block_table: Optional[Tensor] = None,
    seq_lens: Optional[Tensor] = None, topk_length: Optional[Tensor] = None, sink: Optional[Tensor] = None,
    sm_scale: Optional[float] = None, d_v: Optional[int] = None, cache_format: Optional[str] = None,
    return_lse: bool = False, backend: Backend = "auto",
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Sparse attention of a few query rows per sequence over a KV cache (forward only).

    q: [B, S_q, H, D] (S_q query rows of each of B sequences, e.g. 1, or 2-4
    with speculative decoding) or [T, H, D] (each row its own sequence);
    bf16 / fp16 (fp32 on the reference and Triton backends).

    kv_cache, by ``cache_format`` (None infers it from the dtype and the bytes a token):

    - ``"native"``, q's dtype: flat [N, D] or [N, H_kv, D], or paged
      [num_pages, page_size, H_kv, D];
    - ``"fp8_v32"`` (656 B a token, D = 576) or ``"fp8_model1"`` (584 B a
      token, D = 512): uint8 / int8 / float8_e4m3fn [num_pages, page_size,
      bytes] or [num_pages, page_size, 1, bytes], as written by
      :func:`dsa.quantize_kv_cache` (FlashMLA's layouts). Pages may be padded.

    indices: [B, S_q, K] / [T, K] (an H_kv axis before K for a native cache
    with H_kv > 1) int32 (int64 accepted). Without ``block_table`` an index is
    a row of a flat cache or the slot page * page_size + offset of a paged
    one (FlashMLA's convention); with ``block_table`` [B, max_pages] int32 it
    is a position within the row's sequence, whose slot is
    block_table[b, index // page_size] * page_size + index % page_size.
    ``seq_lens`` [B] (with a block table) makes positions >= seq_lens[b]
    invalid. Invalid slots (-1, out of range, past topk_length, a page
    outside the cache) are never read.

    topk_length: [B, S_q] or [B] (batched) / [T] (packed) int32; sink: [H]
    fp32; sm_scale defaults to 1/sqrt(D), d_v to min(D, 512).

    Returns out [..., H, d_v] in q's dtype and, with ``return_lse``, lse
    [..., H] fp32 (natural log, sink excluded, +inf on a row with no valid slot).

    A serving loop that repeats one shape every step saves most of the host
    time per call with :func:`sparse_decode_plan`.
    """
    if not torch.compiler.is_compiling():
        key = _checks.decode_key(q, kv_cache, indices, block_table, seq_lens, topk_length, sink, sm_scale, d_v,
                                 cache_format)
        if key is not None:
            return _known_call(key, q, kv_cache, indices, block_table, seq_lens, topk_length, sink, sm_scale, d_v,
                               cache_format, return_lse, backend)
    a, layout = _decode(q, kv_cache, indices, block_table, seq_lens, topk_length, sink, sm_scale, d_v, cache_format,
                        return_lse, backend)
    out, lse = ops.call(ops.sparse_decode, a, backend)
    out = layout.unpack(out)
    return (out, layout.unpack(lse)) if return_lse else out


def _known_call(key, q, kv_cache, indices, block_table, seq_lens, topk_length, sink, sm_scale, d_v, cache_format,
                return_lse, backend):
    """An eager call whose metadata has a key: checked once per key, then run through the kept choice."""
    _checks.flag("return_lse", return_lse)
    _checks.backend_arg(backend)
    known = _KNOWN.get(key)
    a = None
    if known is None:
        form = _checks.sparse_decode_form(q, kv_cache, indices, block_table, seq_lens, topk_length, sink, sm_scale,
                                          d_v, cache_format)
        a = form.args(q, kv_cache, indices, block_table, seq_lens, topk_length, sink)
        known = kept(_KNOWN, key, lambda: _Known(form, a, q))
    form = known.form
    fn, prepared = known.run(a, backend)
    if fn is None:  # a new backend (or steering variable) for this metadata: the choice needs the arguments
        a = form.args(q, kv_cache, indices, block_table, seq_lens, topk_length, sink)
        fn, prepared = known.run(a, backend)
    # decode_key gave a key: every tensor is a plain torch.Tensor
    if prepared is not None and direct_plain((q, kv_cache, indices, block_table, seq_lens, topk_length, sink)):
        rows = form.rows(q, indices, block_table, seq_lens, topk_length, views=False)
        out = q.new_empty(known.out_shape)
        lse = q.new_empty(known.lse_shape, dtype=known.lse_dtype)
        _on_device(known.cuda, prepared, rows[0], form.cache(kv_cache), rows[1], rows[4], rows[2], rows[3],
                   None if sink is None else sink.contiguous(), out, lse)
        return (out, lse) if return_lse else out
    if a is None:
        a = form.args(q, kv_cache, indices, block_table, seq_lens, topk_length, sink)
    a.__dict__["shape_key"] = known.shape_key  # what the cached property computes for this metadata
    out, lse = ops.call(ops.sparse_decode, a, backend)
    out = form.layout.unpack(out)
    return (out, form.layout.unpack(lse)) if return_lse else out


# ----------------------------------------------------------------------------
# The plan: checked once, called every step


def _meta(x: Optional[Tensor]) -> Optional[Tuple[Any, ...]]:
    """What a plan compares of a per-call tensor: its class (a subclass goes through the dispatcher),
    shape, dtype, device and layout. Raises AttributeError for a non-tensor, RuntimeError for a nested
    tensor."""
    return None if x is None else (x.__class__, x.shape, x.dtype, x.device, x.layout)


_PER_CALL = ("q", "kv_cache", "indices", "block_table", "seq_lens", "topk_length", "sink")


class SparseDecodePlan:
    """:func:`sparse_decode` planned for one shape of call: made once (:func:`sparse_decode_plan`), called
    every decode step of every layer of that shape.

    The plan checks the example call's arguments once (the cache's layout and strides, the block table,
    the dtypes, the scalars), chooses the backend once and prepares its launches (grids, integer
    arguments, the split workspace). A call passes the step's tensors; each must have the example's
    class, shape, dtype and device (the cache also its strides): attribute comparisons (for a repeated
    call one C++ test against the last call's tensors), then the launches.
    A call reads nothing back from the device and allocates only its outputs (none with ``out=`` and
    ``lse=``), so it captures in a CUDA graph; its result is bitwise that of :func:`sparse_decode` with the
    same arguments.

    The workspace is the plan's, shared by its calls: they must run in order on one stream, as the
    layers of a decode step do (steps decoded concurrently on two streams take a plan each).

    Attributes: ``backend``, the backend chosen; :meth:`explain` says why.
    """

    def __init__(
        self, q: Tensor, kv_cache: Tensor, indices: Tensor, *, block_table: Optional[Tensor] = None,
        seq_lens: Optional[Tensor] = None, topk_length: Optional[Tensor] = None, sink: Optional[Tensor] = None,
        sm_scale: Optional[float] = None, d_v: Optional[int] = None, cache_format: Optional[str] = None,
        return_lse: bool = False, backend: Backend = "auto",
    ) -> None:
        self.return_lse = _checks.flag("return_lse", return_lse)
        _checks.backend_arg(backend)
        form = _checks.sparse_decode_form(q, kv_cache, indices, block_table, seq_lens, topk_length, sink, sm_scale,
                                          d_v, cache_format)
        if form.cache_copy:
            raise ValueError(f"kv_cache: each row ([H_kv, D] of a token) must be contiguous for a plan, which reads "
                             f"the cache in place (the page stride may be anything); got strides "
                             f"{tuple(kv_cache.stride())}")
        self._form = form
        a = form.args(q, kv_cache, indices, block_table, seq_lens, topk_length, sink)
        self._choice = decode_op.choice(a, backend)
        self.backend: str = self._choice.backend
        self._fn = self._choice.fn
        self._empty = a.empty
        prepare = getattr(self._fn, "prepare", None)
        self._run = prepare(a, True) if prepare is not None and not self._empty else None
        self._cuda = q.get_device() if q.is_cuda else None
        tensors = (q, kv_cache, indices, block_table, seq_lens, topk_length, sink)
        self._want = tuple(None if x is None else (Tensor, x.shape, x.dtype, x.device, torch.strided)
                           for x in tensors)
        self._cache_stride = kv_cache.stride()
        self._out = (q.shape[:-1] + (form.d_v,), q.dtype, q.device)
        self._lse = (q.shape[:-1], acc_dtype(q), q.device)
        # the kernels' lse when the caller keeps none: written every call, never read
        self._lse_scratch = None if return_lse or self._run is None else torch.empty(
            self._lse[0], dtype=self._lse[1], device=q.device)
        # the eager call's own check (``_lean_call``: ``_want`` and contiguity), for plans whose calls need no
        # conversion (int32 integers) and launch prepared kernels
        self._lean = (self._run is not None and not any(form.wide)
                      and form.cache(kv_cache).dtype == kv_cache.dtype)  # a launch that compiles sees the dtype
        # per pattern of absent arguments, a C++ test of the tensors of the last lean call (``_remember``)
        self._seen: Dict[Tuple[bool, ...], Tuple[Any, Callable[..., Tuple[Tensor, ...]]]] = {}

    def explain(self) -> str:
        """Which backend the plan runs and why (as :func:`dsa.explain` says it)."""
        return self._choice.describe("sparse_decode")

    def __call__(
        self, q: Tensor, kv_cache: Tensor, indices: Tensor, *, block_table: Optional[Tensor] = None,
        seq_lens: Optional[Tensor] = None, topk_length: Optional[Tensor] = None, sink: Optional[Tensor] = None,
        out: Optional[Tensor] = None, lse: Optional[Tensor] = None,
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """One decode step of one layer: the arguments of :func:`sparse_decode`, each with the class,
        shape, dtype and device of the plan's example (the cache also its strides; each optional one given
        iff the example had it).

        out: [..., H, d_v] in q's dtype and lse: [..., H] fp32, contiguous, where the results are written
        (allocated when not given; lse is written when given, returned with ``return_lse``). Returns out,
        or (out, lse) with ``return_lse``.
        """
        if self._lean and not traced():  # tracing and compiling never reach the tests below
            seen = self._seen.get((block_table is None, seq_lens is None, topk_length is None, sink is None,
                                   out is None, lse is None))
            try:
                kept = False
                if seen is not None:
                    test, pick = seen
                    given = pick((q, kv_cache, indices, block_table, seq_lens, topk_length, sink, out, lse))
                    # TensorGuards reads each tensor's sizes first, which a nested tensor refuses by aborting
                    kept = not any(map(_IS_NESTED, given)) and test.check(*given)
                kept = kept or self._lean_ok(q, kv_cache, indices, block_table, seq_lens, topk_length, sink, out,
                                             lse)
            except (AttributeError, RuntimeError):  # a non-tensor, a sparse or nested one: the general path names it
                kept = False
            if kept:
                if out is None:
                    out = q.new_empty(self._out[0])
                if lse is None:
                    lse = self._lse_scratch if self._lse_scratch is not None else q.new_empty(
                        self._lse[0], dtype=self._lse[1])
                _on_device(self._cuda, self._run, q, kv_cache, indices, topk_length, block_table, seq_lens, sink,
                           out, lse)
                return (out, lse) if self.return_lse else out
        try:
            plain = (_meta(q), _meta(kv_cache), _meta(indices), _meta(block_table), _meta(seq_lens),
                     _meta(topk_length), _meta(sink)) == self._want and kv_cache.stride() == self._cache_stride
        except (AttributeError, RuntimeError):  # not a tensor, or a nested one: _mismatch says which
            plain = False
        if not plain:
            self._mismatch((q, kv_cache, indices, block_table, seq_lens, topk_length, sink))
        if out is not None:
            self._output("out", out, self._out)
        if lse is not None:
            self._output("lse", lse, self._lse)
        form = self._form
        if sink is not None:
            sink = sink.contiguous()
        eager = plain and direct_plain((q, kv_cache, indices, block_table, seq_lens, topk_length, sink))
        # the launches write out and lse as stored; a negative view of either takes the copy below
        if self._run is not None and eager and not (out is not None and out.is_neg()
                                                    or lse is not None and lse.is_neg()):
            if out is None:
                out = q.new_empty(self._out[0])
            if lse is None:
                lse = self._lse_scratch if self._lse_scratch is not None else q.new_empty(
                    self._lse[0], dtype=self._lse[1])
            q, indices, block_table, seq_lens, topk_length = form.rows(q, indices, block_table, seq_lens,
                                                                       topk_length, views=False)
            _on_device(self._cuda, self._run, q, form.cache(kv_cache), indices, topk_length, block_table, seq_lens,
                       sink, out, lse)
            return (out, lse) if self.return_lse else out
        a = form.bind(form.rows(q, indices, block_table, seq_lens, topk_length), form.cache(kv_cache), sink)
        if eager:  # a backend without prepared launches, or an empty call
            res_out, res_lse = decode_op.empty(a) if self._empty else _on_device(self._cuda, self._fn, a)
        else:  # through the dispatcher: torch.compile, a dispatch mode or transform, a subclass, autograd
            res_out, res_lse = ops.sparse_decode(a, self.backend)
        res_out, res_lse = res_out.view(self._out[0]), res_lse.view(self._lse[0])
        if out is not None:
            res_out = out.copy_(res_out)
        if lse is not None:
            res_lse = lse.copy_(res_lse)
        return (res_out, res_lse) if self.return_lse else res_out

    def _lean_ok(self, q, kv_cache, indices, block_table, seq_lens, topk_length, sink, out, lse) -> bool:
        """Whether an untraced call is a plain eager one, whose prepared launches run on the given tensors
        as they are; False when it needs more (a mismatch, a view to copy, a tensor subclass, a negative
        view, autograd), which the general path then handles with the same result or the same error.

        Every tensor a launch reads must be a plain tensor with the plan's shape, dtype and device, and
        contiguous; the cache also has the plan's strides. A contiguous tensor's elements are in the
        canonical order whatever its shape, and the launches read addresses only, so no view is made.
        (Spelled out tensor by tensor: a loop or a helper call each costs more than the tests.)"""
        w_q, w_kv, w_idx, w_bt, w_sl, w_tl, w_sink = self._want
        if not (q.__class__ is Tensor and q.shape == w_q[1] and q.dtype is w_q[2] and q.device == w_q[3]
                and q.is_contiguous() and not q.is_neg()
                and kv_cache.__class__ is Tensor and kv_cache.shape == w_kv[1] and kv_cache.dtype is w_kv[2]
                and kv_cache.device == w_kv[3] and kv_cache.stride() == self._cache_stride
                and not kv_cache.is_neg()
                and indices.__class__ is Tensor and indices.shape == w_idx[1] and indices.dtype is w_idx[2]
                and indices.device == w_idx[3] and indices.is_contiguous() and not indices.is_neg()):
            return False
        if w_bt is None:
            if block_table is not None:
                return False
        elif not (block_table.__class__ is Tensor and block_table.shape == w_bt[1] and block_table.dtype is w_bt[2]
                  and block_table.device == w_bt[3] and block_table.is_contiguous()
                  and not block_table.is_neg()):
            return False
        if w_sl is None:
            if seq_lens is not None:
                return False
        elif not (seq_lens.__class__ is Tensor and seq_lens.shape == w_sl[1] and seq_lens.dtype is w_sl[2]
                  and seq_lens.device == w_sl[3] and seq_lens.is_contiguous() and not seq_lens.is_neg()):
            return False
        if w_tl is None:
            if topk_length is not None:
                return False
        elif not (topk_length.__class__ is Tensor and topk_length.shape == w_tl[1] and topk_length.dtype is w_tl[2]
                  and topk_length.device == w_tl[3] and topk_length.is_contiguous()
                  and not topk_length.is_neg()):
            return False
        if w_sink is None:
            if sink is not None:
                return False
        elif not (sink.__class__ is Tensor and sink.shape == w_sink[1] and sink.dtype is w_sink[2]
                  and sink.device == w_sink[3] and sink.is_contiguous() and not sink.is_neg()):
            return False
        if out is not None and not (out.__class__ is Tensor and out.shape == self._out[0]
                                    and out.dtype is self._out[1] and out.device == w_q[3] and out.is_contiguous()
                                    and not out.is_neg()):
            return False
        if lse is not None and not (lse.__class__ is Tensor and lse.shape == self._lse[0]
                                    and lse.dtype is self._lse[1] and lse.device == w_q[3] and lse.is_contiguous()
                                    and not lse.is_neg()):
            return False
        grads = q.requires_grad or kv_cache.requires_grad or (sink is not None and sink.requires_grad)
        if grads and torch.is_grad_enabled():
            return False
        if _TensorGuards is not None and not grads:
            self._remember((q, kv_cache, indices, block_table, seq_lens, topk_length, sink, out, lse))
        return True

    def _remember(self, given: Tuple[Optional[Tensor], ...]) -> None:
        """Keep a C++ test of these tensors' metadata for the next calls with the same arguments absent.

        It compares what ``_lean_ok`` tests and more (each tensor's dispatch keys, strides and
        requires_grad), so a call it passes passes ``_lean_ok``; one it fails (another mode's tensors, a
        tensor requiring grad, a size-1 dimension's stride) is tested by ``_lean_ok`` as before. Only
        tensors requiring no grad are kept: requires_grad is then part of the test, and a call that needs
        autograd never passes it."""
        present = tuple(i for i, x in enumerate(given) if x is not None)
        pick = operator.itemgetter(*present)
        self._seen[tuple(x is None for x in given[3:])] = (
            _TensorGuards(*pick(given), dynamic_dims_sizes=None, dynamic_dims_strides=None), pick)

    def _mismatch(self, given: Tuple[Any, ...]) -> None:
        """Raise for the first argument that is not what the plan was made with (a tensor subclass with
        the plan's metadata passes: it goes through the dispatcher)."""
        for name, x, want in zip(_PER_CALL, given, self._want):
            if want is None:
                if x is not None:
                    raise ValueError(f"{name}: the plan was made without one; make a plan with it")
                continue
            if x is None:
                raise ValueError(f"{name}: the plan was made with one ({_describe(want[1:4])}), got None")
            _checks.dense_tensor(name, x)
            _, shape, dtype, device, _ = want
            if x.shape != shape:
                raise ValueError(f"{name}: expected shape {tuple(shape)} (the plan's), got {tuple(x.shape)}; a plan "
                                 f"serves one shape of call: make one for this shape, or call dsa.sparse_decode")
            if x.dtype != dtype:
                raise ValueError(f"{name}: expected dtype {dtype} (the plan's), got {x.dtype}")
            if x.device != device:
                raise ValueError(f"{name}: expected device {device} (the plan's), got {x.device}")
        if given[1].stride() != self._cache_stride:
            raise ValueError(f"kv_cache: expected strides {self._cache_stride} (the plan's cache layout), got "
                             f"{given[1].stride()}")

    @staticmethod
    def _output(name: str, x: Any, want: Tuple[Any, ...]) -> None:
        """Raise unless ``x`` is a contiguous tensor of shape, dtype and device ``want``."""
        _checks.dense_tensor(name, x)
        if (x.shape, x.dtype, x.device) != want:
            raise ValueError(f"{name}: expected {_describe(want)}, got {_describe((x.shape, x.dtype, x.device))}")
        if not x.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {x.stride()}")


def _describe(meta: Tuple[Any, ...]) -> str:
    shape, dtype, device = meta
    return f"shape {tuple(shape)}, {str(dtype).replace('torch.', '')} on {device}"


def sparse_decode_plan(
    q: Tensor, kv_cache: Tensor, indices: Tensor, *, block_table: Optional[Tensor] = None,
    seq_lens: Optional[Tensor] = None, topk_length: Optional[Tensor] = None, sink: Optional[Tensor] = None,
    sm_scale: Optional[float] = None, d_v: Optional[int] = None, cache_format: Optional[str] = None,
    return_lse: bool = False, backend: Backend = "auto",
) -> SparseDecodePlan:
    """A :class:`SparseDecodePlan`: :func:`sparse_decode` checked, its backend chosen and its launches
    prepared once, for calls whose tensors are shaped like these and whose sm_scale, d_v, cache_format,
    return_lse and backend are these.

    Arguments as in :func:`sparse_decode`; only the tensors' metadata is used (the cache's layout and
    strides, each tensor's shape, dtype and device), never their values. Raises what
    :func:`sparse_decode` raises for them, and ValueError for a native cache whose rows are not
    contiguous (which every call would have to copy)::

        plan = dsa.sparse_decode_plan(q, caches[0], positions, block_table=bt, seq_lens=lens,
                                      topk_length=n, sink=sinks[0])
        for layer in range(layers):                   # every step: new q, positions, lengths
            out = plan(q, caches[layer], positions, block_table=bt, seq_lens=lens, topk_length=n,
                       sink=sinks[layer])
    """
    return SparseDecodePlan(q, kv_cache, indices, block_table=block_table, seq_lens=seq_lens,
                            topk_length=topk_length, sink=sink, sm_scale=sm_scale, d_v=d_v, cache_format=cache_format,
                            return_lse=return_lse, backend=backend)


# public name -> (the public function, its preparation, the ops it runs), for dsa.explain
EXPLAIN = {"sparse_decode": (sparse_decode, _decode, ("sparse_decode",))}
