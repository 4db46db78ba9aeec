"""The machinery every ``dsa::`` custom op shares.

An op takes one argument dataclass of :mod:`dsa._args` (flattened into its
fields, in declaration order), then op-specific extras, then the requested
backend name. Its schema is derived from the dataclass's field types, so no
op spells the fields out; its body, fake and backward receive the dataclass
rebuilt from the flat arguments.

:func:`call` is the fast path of the public API: it runs the body directly
when the dispatcher has nothing to add.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from dsa._args import field_names

_SCHEMA_TYPES = {
    Tensor: "Tensor",
    Optional[Tensor]: "Tensor?",
    float: "float",
    int: "SymInt",
    bool: "bool",
    str: "str",
}


def flat(a) -> Tuple[Any, ...]:
    """The fields of an argument dataclass, in order (a shallow astuple; torch.compile traces it)."""
    return tuple([getattr(a, f.name) for f in dataclasses.fields(a)])


@functools.lru_cache(maxsize=None)
def _fields(cls) -> Tuple[Tuple[str, str], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _SCHEMA_TYPES[hints[f.name]]) for f in dataclasses.fields(cls))


def _device(a) -> Optional[torch.device]:
    """The device of a call: that of its first tensor field (q, or scores)."""
    for name in field_names(type(a)):
        x = getattr(a, name)
        if isinstance(x, Tensor):
            return x.device
    return None


def on_device(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body(a, ...)`` run with its tensors' CUDA device current.

    Kernels launch on the current device and stream, and the backends read
    device properties of the current device; a call on cuda:1 made while
    cuda:0 is current must still run on cuda:1. The guard is entered only
    when the devices differ, so the common call pays one comparison.
    """

    @functools.wraps(body)
    def run(a, *rest):
        dev = _device(a)
        if (dev is not None and dev.type == "cuda" and dev.index is not None
                and dev.index != torch.cuda.current_device()):
            with torch.cuda.device(dev):
                return body(a, *rest)
        return body(a, *rest)

    return run


class Op:
    """``dsa::<name>(<fields of cls>, <extra>, str backend) -> <returns>``.

    ``body(a, *extra, backend)`` is the implementation; ``extra`` is schema
    text such as ``"Tensor lse"``. Calling the Op goes through the
    dispatcher (autograd, tracing); :func:`call` may skip it.
    """

    def __init__(self, name: str, cls, body: Callable[..., Any], extra: str, returns: str):
        self.cls = cls
        self.n = len(_fields(cls))
        self.body = on_device(body)
        params = [f"{t} {n}" for n, t in _fields(cls)] + ([extra] if extra else []) + ["str backend"]
        schema = f"({', '.join(params)}) -> {returns}"
        self.name = f"dsa::{name}"
        self.op = torch.library.custom_op(self.name, self._unflat, mutates_args=(), schema=schema)

    def args(self, values: Tuple[Any, ...]):
        """(the dataclass, the remaining arguments) of the op's flat inputs."""
        return self.cls(*values[: self.n]), values[self.n :]

    def _unflat(self, *values):
        a, rest = self.args(values)
        return self.body(a, *rest)

    def __call__(self, a, *rest):
        return self.op(*flat(a), *rest)

    def fake(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Register ``fn(a, *extra, backend)`` as the op's fake (output shapes for tracing)."""

        def fake(*values):
            a, rest = self.args(values)
            return fn(a, *rest)

        self.op.register_fake(fake)
        return fn

    def autograd(self, backward: Callable[..., Any], saved_outputs: Callable[[Any], Tuple[Tensor, ...]] = None,
                 non_differentiable: Tuple[int, ...] = ()) -> None:
        """Make the op differentiable: ``backward(ctx, a, rest, outputs, *grads)`` returns
        a dict {field name: gradient}; every other input gets None.

        The inputs (and the outputs ``saved_outputs(output)`` picks) are
        saved; the outputs listed in ``non_differentiable`` carry no gradient.
        """
        names = [n for n, _ in _fields(self.cls)]

        def setup(ctx, inputs, output):
            outs = saved_outputs(output) if saved_outputs is not None else ()
            tensors = [x for x in inputs if isinstance(x, Tensor)] + list(outs)
            ctx.save_for_backward(*tensors)
            ctx.layout = [isinstance(x, Tensor) for x in inputs]
            ctx.consts = [None if isinstance(x, Tensor) else x for x in inputs]
            for i in non_differentiable:
                ctx.mark_non_differentiable(output[i])

        def grad(ctx, *grads):
            saved = iter(ctx.saved_tensors)
            values = tuple(next(saved) if is_t else c for is_t, c in zip(ctx.layout, ctx.consts))
            a, rest = self.args(values)
            by_name = backward(ctx, a, rest, tuple(saved), *grads)
            return tuple(by_name.get(n) for n in names) + (None,) * (len(values) - self.n)

        torch.library.register_autograd(self.name, grad, setup_context=setup)


def no_selection(rows: int, topk: int, device: torch.device):
    """indices [rows, topk] of -1 and lengths [rows] of 0, int32: a call that selects nothing."""
    return (
        torch.full((rows, topk), -1, device=device, dtype=torch.int32),
        torch.zeros(rows, device=device, dtype=torch.int32),
    )


def op(name: str, cls, *, extra: str = "", returns: str = "Tensor") -> Callable[[Callable[..., Any]], Op]:
    """Decorator: the function ``body(a, *extra, backend)`` becomes the :class:`Op` ``dsa::<name>``."""
    return lambda body: Op(name, cls, body, extra, returns)


# the tests of traced(), bound once: eager calls of short kernels pay for every attribute lookup
_is_compiling = torch.compiler.is_compiling
_transforms_active = torch._C._are_functorch_transforms_active
_dispatch_modes = torch._C._len_torch_dispatch_stack


def traced() -> bool:
    """Compiling or tracing, a dispatch mode or a functorch transform: the dispatcher must see the call."""
    # the last test is torch.utils._python_dispatch._get_current_dispatch_mode() is not None, less its call
    return _is_compiling() or _transforms_active() or _dispatch_modes() > 0


def _plain(values) -> bool:
    """No tensor subclass among ``values``, none with the negative bit (a lazily negated view: the kernels
    read memory as stored, the dispatcher materialises it), none on the meta device (no data: the
    dispatcher runs the op's fake implementation) and none requiring grad while grad mode is on."""
    grad = torch.is_grad_enabled()
    for x in values:
        if isinstance(x, Tensor) and (type(x) is not Tensor or x.is_neg() or x.is_meta
                                      or (grad and x.requires_grad)):
            return False
    return True


def direct(values) -> bool:
    """Whether a call on ``values`` (its tensors, and anything else) may skip the dispatcher and run an
    op's body: no tracing or compiling, no dispatch mode or functorch transform, no tensor subclass,
    negative view or meta tensor, and no autograd (grad mode off or no tensor requiring grad)."""
    return not traced() and _plain(values)


def direct_plain(tensors) -> bool:
    """:func:`direct` for ``tensors`` known to be plain ``torch.Tensor`` objects (or None)."""
    if traced():
        return False
    grad = torch.is_grad_enabled()
    for x in tensors:
        if x is not None and (x.is_neg() or x.is_meta or (grad and x.requires_grad)):
            return False
    return True


def call(op: Op, a, *rest):
    """``op(a, *rest)``, or its body directly when the dispatcher has nothing
    to add (:func:`direct`). Same body, same result; it saves the dispatcher's
    host time (tens of microseconds a call), which short kernels would
    otherwise wait on."""
    if traced() or not _plain([getattr(a, n) for n in field_names(type(a))] + list(rest)):  # eager: names cached
        return op(a, *rest)
    return op.body(a, *rest)
