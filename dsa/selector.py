"""Backend selection: which implementation serves a call, and why.

Every backend package (``dsa.reference``'s ops, ``dsa.triton``, ``dsa.cute``)
exposes one hook, ``backend_op(op, args, auto)``, that returns the
implementation of ``op`` for the canonical ``args`` or raises
:class:`Unsupported` with the reason (``auto`` is True when the call did not
name the backend, so a backend may also decline on measured speed). That
hook is the single place where a backend states what it supports; the
selector only orders the candidates.

Order under ``backend="auto"``:
  1. ``DSA_BACKEND`` (if set to a backend's name) forces that backend
     everywhere, an explicit ``backend=`` included, and the choice says so;
     ``DSA_BACKEND=auto`` (or empty) forces nothing;
  2. ``cute`` where the device, the shape and the measured placement table
     say it leads, unless ``DSA_DISABLE_CUTE`` is set (1/true/yes/on);
  3. ``triton`` on CUDA tensors;
  4. ``reference`` (CPU tensors, and anything else).
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import torch

from dsa._args import Unsupported, field_names
from dsa._kept import kept
from dsa._rules import env_flag

BACKENDS = ("reference", "triton", "cute")


@dataclass
class Choice:
    backend: str
    fn: Callable[..., Any]
    reasons: List[Tuple[str, str]] = field(default_factory=list)  # (backend, why not)
    forced: Optional[str] = None  # what DSA_BACKEND overrode, when it decided

    def describe(self, op: str) -> str:
        lines = [f"{op}: backend '{self.backend}'"]
        if self.forced is not None:
            lines.append(f"  DSA_BACKEND={self.backend} overrides backend={self.forced!r}")
        note = getattr(self.fn, "note", None)  # why this backend, where it says
        if note:
            lines.append(f"  {self.backend}: {note}")
        for name, why in self.reasons:
            lines.append(f"  {name}: {why}")
        return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def _hook(name: str) -> Callable[..., Callable[..., Any]]:
    module = {"reference": "dsa.reference", "triton": "dsa.triton", "cute": "dsa.cute"}[name]
    return importlib.import_module(module).backend_op


def _try(name: str, op: str, args: Any, auto: bool) -> Tuple[Callable[..., Any] | None, str]:
    try:
        return _hook(name)(op, args, auto=auto), ""
    except Unsupported as e:
        return None, str(e)


def _device_type(args: Any) -> str:
    for f in ("q", "scores"):
        t = getattr(args, f, None)
        if t is not None:
            return t.device.type
    return "cpu"


def cute_disabled() -> bool:
    """DSA_DISABLE_CUTE: 1/true/yes/on disable the tier; 0/false/no/off/empty do not."""
    return env_flag("DSA_DISABLE_CUTE")


def forced_backend() -> Optional[str]:
    """The backend DSA_BACKEND forces, or None (unset, empty or ``auto``)."""
    forced = os.environ.get("DSA_BACKEND", "").strip().lower()
    if forced in ("", "auto"):
        return None
    if forced not in BACKENDS:
        raise ValueError(f"DSA_BACKEND: expected one of {('auto',) + BACKENDS}, got {os.environ['DSA_BACKEND']!r}")
    return forced


def select(op: str, args: Any, backend: str = "auto") -> Choice:
    """Pick the implementation of ``op`` for canonical ``args``.

    Raises ``ValueError`` when an explicitly requested backend cannot serve
    the call, with the backend's own reason.
    """
    if backend not in ("auto",) + BACKENDS:
        raise ValueError(f"backend: expected one of {('auto',) + BACKENDS}, got {backend!r}")
    forced = forced_backend()
    if forced is not None:
        fn, why = _try(forced, op, args, auto=False)
        if fn is None:
            raise ValueError(f"backend '{forced}' (DSA_BACKEND) cannot run {op}: {why}")
        return Choice(forced, fn, forced=backend)
    if backend != "auto":
        fn, why = _try(backend, op, args, auto=False)
        if fn is None:
            raise ValueError(f"backend '{backend}' cannot run {op}: {why}")
        return Choice(backend, fn)

    reasons: List[Tuple[str, str]] = []
    disabled = cute_disabled()  # read (and checked) whatever the device
    candidates = ["cute", "triton"] if _device_type(args) == "cuda" else []
    for name in candidates:
        if name == "cute" and disabled:
            reasons.append((name, f"disabled by DSA_DISABLE_CUTE={os.environ['DSA_DISABLE_CUTE']}"))
            continue
        fn, why = _try(name, op, args, auto=True)
        if fn is not None:
            return Choice(name, fn, reasons)
        reasons.append((name, why))
    if not candidates:
        reasons.append(("triton/cute", f"tensors are on '{_device_type(args)}', not CUDA"))
    fn, why = _try("reference", op, args, auto=True)
    if fn is None:  # the reference serves every valid call
        raise ValueError(f"no backend can run {op}: {why}")
    if candidates:  # a CUDA call that every GPU backend declined
        reasons.insert(0, ("reference", "chosen because no GPU backend serves this call (their reasons follow); "
                                        "exact, and bitwise reproducible with deterministic=True"))
    return Choice("reference", fn, reasons)


# (op, call key, backend asked for, steering variables) -> the choice
_KEPT: Dict[Tuple, Choice] = {}


def call_key(args: Any) -> Tuple:
    """What a backend hook may read of the canonical ``args`` (a dataclass of
    :mod:`dsa._args`), hashable: each tensor field's dtype, device, shape,
    strides and address modulo 16 (the alignment a kernel may assume), each
    other field's value. Never a tensor's values: no hook reads them."""
    key = []
    for name in field_names(type(args)):
        x = getattr(args, name)
        if isinstance(x, torch.Tensor):
            key.append((x.dtype, x.device, x.shape, x.stride(), x.data_ptr() % 16))
        else:
            key.append(x)
    return tuple(key)


def select_kept(op: str, args: Any, backend: str, key: Optional[Hashable] = None) -> Choice:
    """``select(op, args, backend)``, kept per ``key`` (default ``call_key(args)``:
    everything of the call that the backends' hooks read), the backend asked
    for and the variables that steer the choice (DSA_BACKEND,
    DSA_DISABLE_CUTE, TRITON_INTERPRET). The hooks then run once per such
    key, not once per call; a choice that raises is not kept."""
    if key is None:
        key = call_key(args)
    env = os.environ
    full = (op, key, backend, env.get("DSA_BACKEND"), env.get("DSA_DISABLE_CUTE"), env.get("TRITON_INTERPRET"))
    return kept(_KEPT, full, lambda: select(op, args, backend))


def forget() -> None:
    """Drop every kept choice (after a placement table or a backend hook changes, as tests do)."""
    _KEPT.clear()
