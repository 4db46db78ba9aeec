"""CuTe DSL kernels for Blackwell (SM100: capability 10.0 and 10.3).

Served: ``sparse_attention_fwd`` and ``sparse_attention_bwd``
(``sparse_attention``; both modes of ``deterministic``; the backward of
bf16 H128 / D576 by a two-CTA kernel) and the lean
indexer's ``indexer_scores`` / ``indexer_topk`` (``indexer``).  No machine of
this project has an SM100 GPU: the kernels are compiled and
instruction-checked offline on every CI run, and never run here.  So every
configuration is trusted only after its self-check at first use on the
user's GPU (``dsa.cute.gate``): it runs next to the Triton kernel on a small
hostile problem, and a mismatch disables it for the process.

Under ``backend="auto"`` a call goes here when the kernel serves it, its
self-check passed, and the op's SM100 placement table (``placement_sm100.json``
for the forward, ``placement_sm100_bwd.json`` for the backward), where one
is measured on this GPU, says cute is faster; without such a table every
served shape that passed goes to cute.  The indexer is chosen only where its grid
fills the GPU.  ``backend="cute"`` skips the table and the grid rule but
never the self-check.
"""

from __future__ import annotations

from typing import Any, Callable

from dsa._args import Unsupported

OUT_NAMES = {"sparse_attention_fwd": ("out", "lse"), "sparse_attention_bwd": ("dq", "dkv", "dsink"),
             "indexer_scores": ("scores",)}


def backend_op(op: str, args: Any, auto: bool = False) -> Callable[..., Any]:
    """The SM100 implementation of ``op`` for ``args`` on an SM100 GPU, or
    ``Unsupported`` with the reason (``dsa.cute.backend_op`` sends SM100
    calls here)."""
    if op in _ATTENTION:
        return _attention(op, args, auto)
    if op in ("indexer_scores", "indexer_topk"):
        return _indexer(op, args, auto)
    raise Unsupported(f"the cute backend has no SM100 kernel for {op} in this release")


# op -> the names in dsa.cute.sm100.sparse_attention of its checks (what the
# kernel serves, its config, the self-check), its function, and the
# placement table of dsa.cute.placement that decides auto
_ATTENTION = {
    "sparse_attention_fwd": ("supports", "kernel_config", "self_check", "forward", "TABLE_SM100"),
    "sparse_attention_bwd": ("supports_backward", "backward_config", "self_check_backward", "backward",
                             "TABLE_SM100_BWD"),
}


def _attention(op: str, args: Any, auto: bool) -> Callable[..., Any]:
    from dsa.cute import _Chosen
    from dsa.cute.sm100 import sparse_attention as sa

    *checks, table = _ATTENTION[op]
    supports, config, self_check, fn = (getattr(sa, name) for name in checks)  # looked up per call
    why = supports(args)
    if why is not None:
        raise Unsupported(why)
    placed = _placement(args, table) if auto else None
    cfg = config(args)
    v = _checked(op, cfg, args.q.device, lambda: self_check(cfg, args.q.device))
    note = _note(v, placed)
    if op == "sparse_attention_bwd":
        note = f"{sa.kernel_name(cfg)}; {note}"
    return _Chosen(fn, note)


def _indexer(op: str, args: Any, auto: bool) -> Callable[..., Any]:
    from dsa.cute import _Chosen
    from dsa.cute.sm100 import indexer

    why = indexer.supports(args)
    if why is None and auto:
        why = indexer.grid_reason(args)
    if why is not None:
        raise Unsupported(why)
    cfg = indexer.kernel_config(args)
    # indexer_topk runs the same scores kernel: one self-check covers both ops
    v = _checked("indexer_scores", cfg, args.q.device, lambda: indexer.self_check(cfg, args.q.device))
    fn = indexer.scores if op == "indexer_scores" else indexer.indexer_topk
    return _Chosen(fn, _note(v, "its grid fills the GPU" if auto else None))


def _checked(op: str, cfg: Any, device: Any, run: Callable[[], Any]):
    """The self-check's verdict on (op, cfg) on ``device``; Unsupported when it failed."""
    from dsa.cute import gate

    what = f"the cute SM100 kernel for {op} ({describe(cfg)})"
    v = gate.verdict((op, cfg, device.index), run, OUT_NAMES[op], device, what)
    if not v.passed:
        raise Unsupported(f"self-check at first use failed: {v.detail}; this configuration is disabled for "
                          "the process")
    return v


def describe(cfg: Any) -> str:
    """A kernel config (a dataclass) as 'dtype=BFloat16, D=576, ...'."""
    return ", ".join(f"{f}={getattr(v, '__name__', v)}" for f, v in vars(cfg).items())


def _note(v: Any, placed: Any) -> str:
    note = f"self-check at first use passed: {v.detail}"
    return note if placed is None else f"{note}; {placed}"


def _placement(args: Any, table: str) -> str:
    """Why auto may send this call to cute (the entry of the measured SM100
    table ``placement.<table>``, or the absence of a table for this GPU);
    Unsupported when the table says Triton."""
    from dsa.cute import placement

    path = getattr(placement, table)
    why = placement.table_reason(args.q.device, path)
    if why is not None:
        return f"{why}: auto upgrades every served shape that passes its self-check"
    entry = placement.lookup(args, path)
    if entry is None:
        raise Unsupported("no entry of the SM100 placement table covers this shape")
    if entry.backend != "cute":
        raise Unsupported(f"placement table entry {entry.describe()} says {entry.backend} is faster")
    return f"placement table entry {entry.describe()}"
