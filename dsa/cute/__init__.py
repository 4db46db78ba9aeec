"""CuTe DSL backend: hand-tuned kernels for Hopper (SM90) and Blackwell (SM100).

One module or folder per architecture, sharing the rules (``rules``), the
pipeline helpers (``pipeline``), the tile schedule (``scheduler``) and the
host helpers (``host``).  A call on an SM100 GPU (capability 10.0 or 10.3)
goes to ``dsa.cute.sm100``, whose kernels are trusted only after their
self-check at first use (``dsa.cute.gate``); every other call takes the SM90
path below.

Served on SM90: ``sparse_attention_fwd`` (``dsa.cute.sparse_attention``),
``sparse_attention_bwd`` (``dsa.cute.sparse_attention_bwd``, both modes of
``deterministic``), ``sparse_decode`` (``dsa.cute.decode``: native and
fp8_v32 caches, split over the slots), ``topk`` (``dsa.cute.topk``: a
radix select with the row in shared memory, or streamed once past
candidates kept there) and ``indexer_topk`` (``dsa.cute.indexer_topk``:
Triton's scores chunk by chunk, each chunk's rows selected by the cute
top-k), and the indexer's training ops on the top-k slots
(``dsa.cute.indexer_train``: ``sparse_indexer_fwd`` / ``_bwd``,
``indexer_kl_fwd`` / ``_bwd``).  Every other op is declined with that reason, so asking for
``backend="cute"`` raises a ``ValueError`` that says so.

Under ``backend="auto"`` a call the kernel can serve goes to cute only
where the measured placement table of its op (``dsa.cute.placement``: the
forward's ``placement_sm90.json``, the backward's
``placement_sm90_bwd.json``) says cute is faster; ``explain()`` names the
table entry that decided.  Without a readable table measured on a GPU of
this name (``bench/place_cute.py [--op bwd]`` writes one only when it passes
its holdout check) auto keeps Triton; ``backend="cute"`` runs the kernel.
The decode's placement is ``dsa.cute.decode.PLACEMENT``, a short list of
(GPU, cache format, H, batch range) filled from bench/decode_peers.py;
until it lists this GPU, auto leaves the decode to Triton.  The top-k's is
``dsa.cute.topk.PLACEMENT`` (row lengths per GPU, from
bench/topk_peers.py), the fused indexer top-k's
``dsa.cute.indexer_topk.PLACEMENT`` (max_seqlen_k per GPU), the
indexer training ops' ``dsa.cute.indexer_train.PLACEMENT`` (ops per GPU).
"""

from __future__ import annotations

from typing import Any, Callable

from dsa._args import Unsupported
from dsa.cute import host

class _Chosen:
    """An op implementation with the sentence that explains the choice."""

    def __init__(self, fn: Callable[..., Any], note: str):
        self.fn, self.note = fn, note
        prepare = getattr(fn, "prepare", None)
        if prepare is not None:  # the optional protocol of dsa.ops.decode: prepared launches
            self.prepare = prepare
        if getattr(fn, "takes_bounds", False):  # dsa.ops.sparse_attention's: the forward's bounds
            self.takes_bounds = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def backend_op(op: str, args: Any, auto: bool = False) -> Callable[..., Any]:
    if host.arch_of(_device(args)) == "sm100":
        from dsa.cute import sm100

        return sm100.backend_op(op, args, auto)
    if op == "sparse_attention_bwd":
        return _backward(args, auto)
    if op == "sparse_decode":
        return _decode(args, auto)
    if op == "topk":
        return _topk(args, auto)
    if op == "indexer_topk":
        from dsa.cute import indexer_topk

        return _measured(indexer_topk, indexer_topk.indexer_topk, args, auto)
    if op in ("sparse_indexer_fwd", "indexer_kl_fwd", "sparse_indexer_bwd", "indexer_kl_bwd"):
        from dsa.cute import indexer_train

        return indexer_train.backend_op(op, args, auto)
    if op != "sparse_attention_fwd":
        raise Unsupported(f"the cute backend has no kernel for {op} in this release")
    from dsa.cute import sparse_attention

    why = sparse_attention.supports(args)
    if why is not None:
        raise Unsupported(why)
    return _placed(sparse_attention.forward, args, auto, "TABLE")


def _placed(fn: Callable[..., Any], args: Any, auto: bool, table: str) -> Callable[..., Any]:
    """fn when asked for by name; under auto only where the placement table
    ``placement.<table>`` measured on this GPU names cute for the nearest
    shape (Unsupported with the reason otherwise)."""
    if not auto:
        return fn
    from dsa.cute import placement

    path = getattr(placement, table)
    why = placement.unusable(args.q.device, path)
    if why is not None:
        raise Unsupported(why)
    entry = placement.lookup(args, path)
    if entry is None:
        raise Unsupported("no measured placement table entry covers this shape")
    if entry.backend != "cute":
        raise Unsupported(f"placement table entry {entry.describe()} says {entry.backend} is faster")
    return _Chosen(fn, f"placement table entry {entry.describe()}")


def _device(args: Any):
    """The device of a call's canonical arguments (its q, or the scores)."""
    q = getattr(args, "q", None)
    return (q if q is not None else args.scores).device


def _backward(args: Any, auto: bool) -> Callable[..., Any]:
    """The cute backward where the kernel serves ``args`` (and, under auto,
    the backward's placement table says it is faster)."""
    from dsa.cute import sparse_attention_bwd

    why = sparse_attention_bwd.supports_backward(args)
    if why is not None:
        raise Unsupported(why)
    return _placed(sparse_attention_bwd.backward, args, auto, "TABLE_BWD")


def _decode(args: Any, auto: bool) -> Callable[..., Any]:
    """The cute decode where the kernel serves ``args`` and, under auto,
    where its measured placement (``dsa.cute.decode.PLACEMENT``) names it."""
    from dsa.cute import decode

    return _measured(decode, decode.decode, args, auto)


def _topk(args: Any, auto: bool) -> Callable[..., Any]:
    """The cute top-k where the kernel serves ``args`` and, under auto,
    where its measured placement (``dsa.cute.topk.PLACEMENT``) names it."""
    from dsa.cute import topk

    return _measured(topk, topk.topk, args, auto)


def _measured(module: Any, fn: Callable[..., Any], args: Any, auto: bool) -> Callable[..., Any]:
    """``fn`` where ``module.supports(args)`` allows it and, under auto,
    where ``module.placement_reason(args)`` (its measured placement) does
    too; Unsupported with the reason otherwise."""
    why = module.supports(args)
    if why is None and auto:
        why = module.placement_reason(args)
        if why is None:
            return _Chosen(fn, module.placed_note(args))
    if why is not None:
        raise Unsupported(why)
    return fn
