"""The self-check that gates a cute kernel this project has never run.

A kernel of an architecture no machine of this project has (SM100 today) is
compiled and instruction-checked offline, but its results are first seen on
the user's GPU.  So before ``backend="auto"`` (or ``backend="cute"``) sends a
call to it, each compiled configuration is run once, at its first use, on a
small hostile problem next to the Triton kernel, and the two must agree:

* the same NaN, +inf and -inf positions in every output, and
* a relative L2 error of at most ``REL_L2`` over the positions finite in both.

The verdict is kept for the process (per configuration and device).  A
mismatch, or an exception while checking, warns once and disables that
configuration: auto keeps Triton for it, ``backend="cute"`` raises, and
``explain()`` names the verdict either way.  A check that is first needed
while a CUDA graph is being captured runs outside the capture, on a side
stream the host waits for (``dsa.cute.host``), so nothing of it is captured.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Sequence, Tuple

import torch

REL_L2 = 1e-2


@dataclass(frozen=True)
class Verdict:
    """passed, and the sentence explain() prints: the error measured, or what
    disagreed."""

    passed: bool
    detail: str


# (op, kernel config, device index) -> the verdict of its self-check
_VERDICTS: Dict[Hashable, Verdict] = {}

Pairs = Sequence[Tuple[torch.Tensor, torch.Tensor]]


def compare(pairs: Pairs, names: Sequence[str]) -> Verdict:
    """The verdict on [(kernel's output, Triton's output)], named for the message."""
    worst = 0.0
    for name, (got, want) in zip(names, pairs):
        if got.shape != want.shape:
            return Verdict(False, f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        g, w = got.float(), want.float()
        for what, test in (("NaN", torch.isnan), ("+inf", lambda x: x == math.inf), ("-inf", lambda x: x == -math.inf)):
            differ = int((test(g) != test(w)).sum())
            if differ:
                return Verdict(False, f"{name}: {what} at {differ} positions where Triton's result differs")
        finite = torch.isfinite(g) & torch.isfinite(w)
        diff = float(torch.linalg.vector_norm((g - w)[finite]))
        ref = float(torch.linalg.vector_norm(w[finite]))
        rel = diff / ref if ref > 0 else diff
        if not rel <= REL_L2:  # NaN-safe
            return Verdict(False, f"{name}: relative L2 error {rel:.3g} > {REL_L2}")
        worst = max(worst, rel)
    return Verdict(True, f"relative L2 error {worst:.2g} <= {REL_L2}, same NaN/inf positions as Triton")


def verdict(key: Hashable, run: Callable[[], Pairs], names: Sequence[str], device: torch.device,
            what: str) -> Verdict:
    """The verdict for ``key``, checked now if it is its first use: ``run()``
    returns [(kernel's output, Triton's output)] on the hostile problem.
    A failure warns once, naming ``what`` (the kernel and configuration)."""
    v = _VERDICTS.get(key)
    if v is not None:
        return v
    try:
        v = compare(_outside_capture(run, device), names)
    except Exception as e:  # a compile or launch failure is a failed check too
        v = Verdict(False, f"the check raised {type(e).__name__}: {e}")
    _VERDICTS[key] = v
    if not v.passed:
        warnings.warn(f"dsa: {what} failed its self-check against Triton ({v.detail}); it is disabled for this "
                      "process and Triton serves these calls", RuntimeWarning, stacklevel=2)
    return v


def verdicts() -> List[Tuple[Hashable, Verdict]]:
    """Every verdict of this process (for inspection)."""
    return list(_VERDICTS.items())


def _outside_capture(run: Callable[[], Pairs], device: torch.device) -> Pairs:
    """run(), outside any CUDA-graph capture in progress on ``device``."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        from dsa.cute import host

        return host._outside_capture(run, device)
    return run()
