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

A caller that has its arguments' addresses at hand (``Launcher.launch`` with
``raw``) goes one step further: ``CompiledKernel[grid]`` still looks up the
current device and stream, builds launch metadata for launch hooks and
defines a scratch allocator, and its C launcher asks the driver about every
tensor's address; :func:`direct_launch` calls Triton's C launcher alone,
with the addresses as integers. It follows Triton 3.6's own runner
(``CompiledKernel.__getitem__`` and ``CudaLauncher.__call__``, which a test
reads to notice a change), and steps aside, back to the runner, while a
launch hook is set or for a kernel that needs scratch memory.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, Optional, Sequence, Tuple

from triton import knobs


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


def _hooked() -> bool:
    """Whether a launch hook is set (a profiler's): then launches take Triton's runner, which calls it."""
    for h in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):  # Triton 3.6 keeps hooks in a HookChain (its .calls)
            return True
    return False


def direct_launch(kernel: Any) -> Optional[Callable[..., None]]:
    """``run(grid, stream, args, tail)``: what ``kernel[grid](*args, *tail)``
    does on ``stream`` with no launch hook set, by Triton's C launcher alone
    (tensors passed as their addresses); None when ``kernel`` does not have
    the structure this follows (Triton 3.6's ``CompiledKernel`` with a
    ``CudaLauncher``) or needs scratch memory."""
    launcher = getattr(kernel, "run", None)  # a property: loads the module on first use
    launch = getattr(launcher, "launch", None)
    if launch is None or not all(hasattr(launcher, a) for a in (
            "launch_cooperative_grid", "launch_pdl", "global_scratch_size", "profile_scratch_size")):
        return None
    if launcher.global_scratch_size > 0 or launcher.profile_scratch_size > 0:
        return None
    function, metadata = kernel.function, kernel.packed_metadata
    coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl

    def run(grid: Tuple[int, ...], stream: int, args: Sequence[Any], tail: Sequence[Any]) -> None:
        # CudaLauncher.__call__'s launch with no scratch, no launch metadata and no hooks
        launch(grid[0], grid[1], grid[2], stream, function, coop, pdl, None, None, metadata, None, None, None,
               *args, *tail)

    return run


class Launcher:
    """Launches one ``@triton.jit`` function whose runtime arguments come
    first and whose constexprs follow, in signature order."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled: Dict[Hashable, Tuple[Any, Tuple[Any, ...], Optional[Callable[..., None]]]] = {}

    def __call__(self, grid: Tuple[int, ...], args: Sequence[Any], constexprs: Dict[str, Any], key: Hashable) -> None:
        """``fn[grid](*args, **constexprs)``. ``key`` stands for the constexprs and the tensor arguments'
        dtypes: equal keys, equal constexprs and dtypes."""
        self.launch(grid, args, constexprs, (key, *map(arg_spec, args)))

    def launch(self, grid: Tuple[int, ...], args: Sequence[Any], constexprs: Dict[str, Any], spec: Hashable,
               raw: Optional[Sequence[Any]] = None, stream: Optional[int] = None) -> None:
        """``fn[grid](*args, **constexprs)`` where ``spec`` stands for everything the compiled kernel
        depends on: the constexprs, the tensors' dtypes and every argument's :func:`arg_spec` (a caller
        that knows some of those fixed builds it from the rest). ``raw``: ``args`` with each tensor given
        as its ``data_ptr()`` and ``stream`` the current CUDA stream's handle, for :func:`direct_launch`."""
        hit = self._compiled.get(spec)
        if hit is not None:
            kernel, tail, run = hit
            if run is not None and raw is not None and not _hooked():
                run(grid, stream, raw, tail)
            else:
                kernel[grid](*args, *tail)
            return
        kernel = self.fn[grid](*args, **constexprs)
        if kernel is not None and hasattr(kernel, "packed_metadata"):  # a compiled kernel (not the interpreter)
            names = self.fn.arg_names[len(args):]
            self._compiled[spec] = (kernel, tuple(constexprs[n] for n in names), direct_launch(kernel))
