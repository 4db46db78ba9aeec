"""Triton backend: kernels for every CUDA GPU (and CPU under TRITON_INTERPRET=1).

Each op module exposes ``supports(args) -> Optional[str]`` (None when it can
serve the canonical ``args``, else the reason), the op functions named in
``_MODULES`` and, where tiles are fitted to the device (``dsa.triton.fit``),
``tiles_reason(function, args)``: why no tiles fit (None when some do). This
file is the backend's one hook into :mod:`dsa.selector`.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any, Callable, Optional

from dsa._args import Unsupported

# module in this package -> {op name: the module's function}
_MODULES = {
    "sparse_attention": {"sparse_attention_fwd": "forward", "sparse_attention_bwd": "backward"},
    "decode": {"sparse_decode": "decode"},
    "indexer": {"indexer_scores": "scores", "indexer_topk": "indexer_topk"},
    "topk": {"topk": "topk"},
    # indexer training
    "training": {op: op for op in ("attention_target", "dense_attention_target", "sparse_indexer_fwd",
                                   "indexer_kl_fwd")},
    "indexer_bwd": {op: op for op in ("sparse_indexer_bwd", "indexer_kl_bwd", "indexer_scores_bwd")},
}
_OPS = {op: (module, fn) for module, ops in _MODULES.items() for op, fn in ops.items()}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_reason(t: Any) -> Optional[str]:
    """Why Triton cannot run on this tensor's device (None if it can)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if t.device.type == "cuda":
        return None
    if t.device.type == "cpu" and interpreting():
        return None
    return f"tensors are on '{t.device.type}'; triton needs CUDA (or CPU with TRITON_INTERPRET=1)"


def backend_op(op: str, args: Any, auto: bool = False) -> Callable[..., Any]:
    if op not in _OPS:
        raise Unsupported(f"triton has no kernel for {op}")
    first = getattr(args, "q", None)
    if first is None:
        first = args.scores
    why = device_reason(first)
    if why is None:
        module, fn_name = _module(op)
        why = module.supports(args)
        if why is None and hasattr(module, "tiles_reason"):
            why = module.tiles_reason(fn_name, args)  # no tiles fit the device's limits
        if why is None:
            return getattr(module, fn_name)
    raise Unsupported(why)


@functools.lru_cache(maxsize=None)
def _module(op: str):
    """(the op's module, its function name); imported on first use."""
    module_name, fn_name = _OPS[op]
    return importlib.import_module(f"{__name__}.{module_name}"), fn_name
