"""Which implementations each benchmark is parametrised over, and when to skip.

``reference``, ``triton`` and ``cute`` are ``dsa`` backends, called through
the public API with ``backend=...``: one that cannot serve a call raises
``ValueError`` and the benchmark is skipped with that reason. ``torch`` (plain
PyTorch, bench/torch_peer.py) and ``cudnn`` (cuDNN frontend DSA kernels,
bench/cudnn_peer.py) are peers timed in the same run.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple, Type

import pytest

from bench import cudnn_peer, harness

DSA_BACKENDS = ("reference", "triton", "cute")
PEERS = ("torch", "cudnn")
BACKENDS = DSA_BACKENDS + PEERS


def skip_unless_runnable(backend: str, shape: Any) -> None:
    """Skip early (before any input is drawn) for reasons that need no trial call."""
    if backend == "reference" and not (shape.reference or harness.reference_everywhere() or harness.smoke()):
        pytest.skip(
            "reference: timed only at shapes marked reference=True in bench/shapes.py "
            "(plain chunked PyTorch; set DSA_BENCH_REFERENCE=1 to time it everywhere)"
        )
    forced = os.environ.get("DSA_BACKEND", "")
    if forced and backend in DSA_BACKENDS and backend != forced:
        pytest.skip(f"{backend}: DSA_BACKEND={forced} forces every dsa call onto '{forced}'")
    if backend == "cudnn":
        reason = cudnn_peer.unavailable()
        if reason:
            pytest.skip(reason)


def skip_on(backend: str) -> Tuple[Type[BaseException], ...]:
    """Exceptions of the first call that mean "cannot run" rather than a bug."""
    if backend in DSA_BACKENDS:
        return (ValueError,)  # docs/semantics.md: a backend that cannot serve a call raises ValueError
    return (Exception,)  # peers: any failure of a third-party or plain implementation


def dsa() -> Any:
    """The public API, imported when a benchmark runs (collection never needs it)."""
    import dsa as _dsa

    return _dsa


def auto_explain(op: str, *args: Any, **kwargs: Any) -> Optional[str]:
    """``dsa.explain`` for this call: which backend ``auto`` picks here, and why."""
    try:
        return dsa().explain(op, *args, **kwargs)
    except Exception as e:  # informative only; never fails a benchmark
        return f"explain failed: {type(e).__name__}: {e}"
