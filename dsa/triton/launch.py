"""Launching a Triton kernel without re-binding its arguments on every call.

``fn[grid](*args, **constexprs)`` binds every argument, derives the
specialization (each pointer's dtype and 16-byte alignment, each integer's
width, divisibility by 16 and whether it is 1), turns it into a cache key and
looks the compiled kernel up: tens of microseconds of Python a launch, more
than a decode step's kernel takes. :class:`Launcher` does that lookup once
per (plan key, specialization) and afterwards calls the compiled kernel's own
launcher (``CompiledKernel[grid](*all_args)``) directly. Its specialization
key, :func:`arg_spec`, holds at least what Triton's does (tests check it
against Triton's own), so a call never reaches a kernel compiled for other
alignments or widths. Under the interpreter there is no compiled kernel, and
every call goes through ``fn[grid]``.
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, Sequence, Tuple

def arg_spec(x: Any) -> Hashable:
    """What Triton specializes a runtime argument on, less a tensor's dtype
    (the launcher's key holds the dtypes): a tensor's 16-byte alignment; an
    int's width (i32, i64, u64), divisibility by 16 and whether it is 1;
    None; a float's type (never specialized)."""
    c = x.__class__
    if c is int:
        return (x == 1) | ((x & 15 == 0) << 1) | ((not -(2**31) <= x < 2**31) << 2) | ((x >= 2**63) << 3)
    if x is None or c is float or c is bool:
        return x if c is bool else c
    return x.data_ptr() & 15 == 0


class Launcher:
    """Launches one ``@triton.jit`` function whose runtime arguments come
    first and whose constexprs follow, in signature order."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled: Dict[Hashable, Tuple[Any, Tuple[Any, ...]]] = {}

    def __call__(self, grid: Tuple[int, ...], args: Sequence[Any], constexprs: Dict[str, Any], key: Hashable) -> None:
        """``fn[grid](*args, **constexprs)``. ``key`` stands for the constexprs and the tensor arguments'
        dtypes: equal keys, equal constexprs and dtypes."""
        spec = (key, *map(arg_spec, args))
        hit = self._compiled.get(spec)
        if hit is not None:
            kernel, tail = hit
            kernel[grid](*args, *tail)
            return
        kernel = self.fn[grid](*args, **constexprs)
        if kernel is not None and hasattr(kernel, "packed_metadata"):  # a compiled kernel (not the interpreter)
            names = self.fn.arg_names[len(args):]
            self._compiled[spec] = (kernel, tuple(constexprs[n] for n in names))
