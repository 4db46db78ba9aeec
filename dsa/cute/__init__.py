"""CuTe DSL backend: hand-tuned kernels for Hopper (SM90).

Served: ``sparse_attention_fwd`` on SM90 (``dsa.cute.sparse_attention``).
Every other op is declined with that reason, so asking for
``backend="cute"`` raises a ``ValueError`` that says so (the backward of a
cute forward included: train with ``backend="auto"`` or ``"triton"``).

Under ``backend="auto"`` a call the kernel can serve goes to cute only where
the measured placement table (``dsa.cute.placement``) says cute is faster;
``explain()`` names the table entry that decided.  Without a readable table
measured on a GPU of this name (``bench/place_cute.py`` writes one only when
it passes its holdout check) auto keeps Triton.
"""

from __future__ import annotations

from typing import Any, Callable

from dsa._args import Unsupported


class _Chosen:
    """An op implementation with the sentence that explains the choice."""

    def __init__(self, fn: Callable[..., Any], note: str):
        self.fn, self.note = fn, note

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def backend_op(op: str, args: Any, auto: bool = False) -> Callable[..., Any]:
    if op != "sparse_attention_fwd":
        raise Unsupported(f"the cute backend has no kernel for {op} in this release")
    from dsa.cute import sparse_attention

    why = sparse_attention.supports(args)
    if why is not None:
        raise Unsupported(why)
    if not auto:
        return sparse_attention.forward
    from dsa.cute import placement

    why = placement.unusable(args.q.device)
    if why is not None:
        raise Unsupported(why)
    entry = placement.lookup(args)
    if entry is None:
        raise Unsupported("no measured placement table entry covers this shape")
    if entry.backend != "cute":
        raise Unsupported(f"placement table entry {entry.describe()} says {entry.backend} is faster")
    return _Chosen(sparse_attention.forward, f"placement table entry {entry.describe()}")
