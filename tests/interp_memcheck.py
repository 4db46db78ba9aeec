"""Address checks for kernels run by the Triton interpreter.

Under ``TRITON_INTERPRET=1`` a kernel reads and writes host memory: the
storages of the tensors it was passed. Every load, store and atomic whose
mask is on must stay inside one of them; an access past a tensor's end would
corrupt the heap here and, on a GPU, usually land unseen in the caching
allocator's slack (compute-sanitizer sees whole cudaMalloc blocks, not
tensors). :func:`install` patches the interpreter once; :func:`take` returns
the out-of-range accesses seen since its last call, and clears them.
"""

from __future__ import annotations

import os
import traceback
from typing import List

import numpy as np

_ranges: List[tuple] = []  # (lo, hi, argument name) of the running launch
_kernel = [""]
_found: List[str] = []


def _where(p: int) -> str:
    near = min(_ranges, key=lambda r: min(abs(p - r[0]), abs(p - r[1])), default=None)
    if near is None:
        return f"{p:#x} (the kernel has no tensor argument)"
    lo, hi, name = near
    if p < lo:
        rel = f"{lo - p} bytes before"
    elif p >= hi:
        rel = f"{p - hi} bytes past the end of"
    else:  # starts inside, runs past the end
        rel = f"{p - lo} bytes into the end of"
    return f"{p:#x}, {rel} {name} ({hi - lo} bytes)"


def _check(kind: str, ptrs, mask, size: int) -> None:
    p = np.asarray(ptrs).astype(np.int64)
    if mask is not None:  # masks come as bool or 0/1 integers
        p = p[np.broadcast_to(np.asarray(mask).astype(bool), p.shape)]
    p = p.ravel()
    if p.size == 0:
        return
    ok = np.zeros(p.shape, bool)
    for lo, hi, _ in _ranges:
        ok |= (p >= lo) & (p + size <= hi)
    if ok.all():
        return
    bad = p[~ok]
    ours = [f for f in traceback.extract_stack()[:-3] if f"{os.sep}triton{os.sep}" not in f.filename]
    lines = [f"{f.name}:{f.lineno}" for f in ours]
    _found.append(f"{_kernel[0]}: {kind} of {bad.size} element(s), first at {_where(int(bad[0]))}; "
                  f"at {' < '.join(reversed(lines[-3:]))}")


def install() -> None:
    """Patch the interpreter's launches and memory operations (idempotent)."""
    import triton.runtime.interpreter as interp

    if getattr(interp, "_dsa_memcheck", False):
        return
    executor, builder = interp.GridExecutor, interp.InterpreterBuilder
    init_args = executor._init_args_hst

    def init_checked(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        _ranges.clear()
        _kernel[0] = getattr(self.fn, "__name__", "?")
        names = list(self.arg_names) + list(kwargs_hst)

        def add(x, name):
            if isinstance(x, tuple):
                for y in x:
                    add(y, name)
            elif hasattr(x, "untyped_storage"):
                s = x.untyped_storage()
                _ranges.append((s.data_ptr(), s.data_ptr() + s.nbytes(), name))
            elif hasattr(getattr(x, "base", None), "untyped_storage"):  # a tensor descriptor
                add(x.base, name)

        for name, x in zip(names, list(args_hst) + list(kwargs_hst.values())):
            add(x, name)
        return args_hst, kwargs_hst

    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def load_checked(self, ptrs, mask, other, *a):
        _check("load", ptrs.data, mask.data, interp._get_np_dtype(ptrs.get_element_ty()).itemsize)
        return load(self, ptrs, mask, other, *a)

    def store_checked(self, ptrs, value, mask, *a):
        _check("store", ptrs.data, mask.data, value.data.dtype.itemsize)
        return store(self, ptrs, value, mask, *a)

    def rmw_checked(self, op, ptr, val, mask, *a):
        _check("atomic", ptr.data, mask.data, val.data.dtype.itemsize)
        return rmw(self, op, ptr, val, mask, *a)

    def cas_checked(self, ptr, cmp, val, *a):
        _check("atomic_cas", ptr.data, None, val.data.dtype.itemsize)
        return cas(self, ptr, cmp, val, *a)

    executor._init_args_hst = init_checked
    builder.create_masked_load, builder.create_masked_store = load_checked, store_checked
    builder.create_atomic_rmw, builder.create_atomic_cas = rmw_checked, cas_checked
    interp._dsa_memcheck = True


def take() -> List[str]:
    """The out-of-range accesses since the last call (then forgotten)."""
    found = list(_found)
    _found.clear()
    return found


def report(found: List[str]) -> str:
    """What a failure says of ``found`` (its first five)."""
    return "out-of-range accesses under the interpreter:\n" + "\n".join(found[:5])
