"""CuTe DSL backend: hand-tuned kernels for Hopper (SM90) and Blackwell (SM100).

No CuTe DSL kernel has been released yet, so this backend declines every op
with that reason; ``backend="auto"`` then uses Triton, and asking for
``backend="cute"`` raises a ``ValueError`` that says so.
"""

from __future__ import annotations

from typing import Any, Callable

from dsa.selector import Unsupported


def backend_op(op: str, args: Any, auto: bool = False) -> Callable[..., Any]:
    raise Unsupported(f"the cute backend has no kernel for {op} in this release")
