"""The suite's one measuring scheme: rotation, timing, memory, extra_info.

How a benchmark is measured (bench/README.md says the same for users):

1. The inputs are ``n`` fresh random sets (never zeros; seeded per shape so
   every backend and every commit sees the same data) and each timed call
   takes the next set in turn (:class:`Rotation`).
2. A first call compiles / autotunes and decides whether the backend can run
   the shape at all: a ``dsa`` backend that raises ``ValueError`` is skipped
   with that reason; a peer is skipped on any exception; every backend is
   skipped on CUDA out-of-memory, or when one warm call takes longer than
   ``DSA_BENCH_MAX_CALL_S``.
3. The number reported is ``triton.testing.do_bench``'s median
   (CUDA events around each call, L2 flushed before each call, warm-up and
   repetition in ms) — the same value ``return_mode="median"`` gives; we ask
   for ``"all"`` to keep the 20th/80th percentiles as a noise band. TFLOP/s
   and GB/s in ``extra_info`` come from that median.
4. pytest-benchmark then times a *synchronised* call of the same rotation
   (``fn(); torch.cuda.synchronize()``) with ``benchmark.pedantic``: its
   Min/Median/Mean columns are host wall-clock including launch overhead, so
   ``--benchmark-compare`` works, but the kernel time is ``extra_info``'s
   ``median_ms``.
5. Peak memory above what was allocated before the call (all input sets
   included in the base) is read with ``torch.cuda.max_memory_allocated``.

Knobs (environment): DSA_BENCH_WARMUP_MS (25), DSA_BENCH_REP_MS (100),
DSA_BENCH_SETS (4), DSA_BENCH_ROUNDS_S (0.2: host seconds of
pytest-benchmark rounds per benchmark), DSA_BENCH_MAX_CALL_S (5),
DSA_BENCH_REFERENCE (0), DSA_BENCH_SMOKE (0; private CPU smoke mode).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type

import pytest
import torch

def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}: expected a number, got {raw!r}") from None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def smoke() -> bool:
    """Private smoke mode: tiny shapes, CPU allowed. Never what CI runs."""
    return _env_flag("DSA_BENCH_SMOKE")


def resolve(shape: Any) -> Any:
    """The registered shape, or its tiny stand-in in smoke mode."""
    return shape.smoke() if smoke() else shape


def reference_everywhere() -> bool:
    return _env_flag("DSA_BENCH_REFERENCE")


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if smoke():
        return torch.device("cpu")
    # conftest.py skips every item before this can be reached on CPU.
    raise RuntimeError("the benchmark suite needs CUDA (or DSA_BENCH_SMOKE=1)")


def dtype() -> torch.dtype:
    """bf16 (every benchmark); fp32 in CPU smoke mode, which the Triton interpreter needs."""
    if smoke() and not torch.cuda.is_available():
        return torch.float32
    return torch.bfloat16


def n_sets() -> int:
    n = int(_env_float("DSA_BENCH_SETS", 4))
    if n < 1:
        raise ValueError(f"DSA_BENCH_SETS: expected >= 1, got {n}")
    return n


def graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn captured in a CUDA graph (warmed up on a side stream first); returns
    its replay, which times the GPU's work without the host's."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def synchronize(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sets_that_fit(set_bytes: int, budget_bytes: int = 24 << 30) -> int:
    """How many input sets to rotate: DSA_BENCH_SETS, fewer (>= 2) if huge."""
    n = n_sets()
    if set_bytes > 0 and n * set_bytes > budget_bytes:
        n = max(min(n, 2), budget_bytes // set_bytes)
    return int(n)


class Rotation:
    """A zero-argument callable that runs the next call of ``calls`` in turn."""

    def __init__(self, calls: Sequence[Callable[[], Any]]):
        if not calls:
            raise ValueError("Rotation: expected at least one call")
        self.calls = list(calls)
        self.i = 0

    def __call__(self) -> Any:
        fn = self.calls[self.i]
        self.i = (self.i + 1) % len(self.calls)
        return fn()


def _short(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_call(
    fn: Callable[[], Any],
    dev: torch.device,
    label: str,
    skip_on: Tuple[Type[BaseException], ...] = (ValueError,),
) -> Any:
    """Run ``fn`` once (compiles); skip the benchmark if it cannot run."""
    reason: Optional[str] = None
    out = None
    try:
        out = fn()
        synchronize(dev)
    except torch.OutOfMemoryError as e:
        reason = f"{label}: CUDA out of memory at this shape ({_short(e, 160)})"
    except skip_on as e:
        kind = "" if isinstance(e, ValueError) else f"{type(e).__name__}: "
        reason = f"{label}: {kind}{_short(e)}"
    if reason is not None:
        out = None
        free_memory()
        pytest.skip(reason)
    return out


def nan_free(out: Any) -> bool:
    """True when no floating tensor in ``out`` holds a NaN (+-inf are legitimate:
    masked scores, empty-row lse)."""
    tensors: Iterable[Any] = out if isinstance(out, (tuple, list)) else (out,)
    ok = True
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            ok = ok and not bool(torch.isnan(t).any())
    return ok


def guard_call_time(fn: Callable[[], Any], dev: torch.device, label: str) -> float:
    """Time one warm call on the host; skip when it is too slow for the suite."""
    limit = _env_float("DSA_BENCH_MAX_CALL_S", 5.0)
    synchronize(dev)
    t0 = time.perf_counter()
    fn()
    synchronize(dev)
    dt = time.perf_counter() - t0
    if dt > limit:
        free_memory()
        pytest.skip(f"{label}: one call took {dt:.1f} s (> DSA_BENCH_MAX_CALL_S={limit:g})")
    return dt


def time_ms(fn: Callable[[], Any], dev: torch.device) -> Dict[str, float]:
    """Median and spread of ``fn``'s device time in ms (see module docstring)."""
    if dev.type == "cuda":
        import triton.testing

        times: List[float] = triton.testing.do_bench(
            fn,
            warmup=_env_float("DSA_BENCH_WARMUP_MS", 25.0),
            rep=_env_float("DSA_BENCH_REP_MS", 100.0),
            return_mode="all",
        )
        method = "triton.testing.do_bench median (CUDA events, L2 flushed per call)"
    else:  # smoke mode on CPU: host clock, a few calls
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        method = "host perf_counter median (CPU smoke mode; not a measurement)"
    times = sorted(float(t) for t in times)
    q = statistics.quantiles(times, n=5, method="inclusive") if len(times) > 1 else [times[0]] * 4
    return {
        "median_ms": statistics.median(times),
        "p20_ms": q[0],
        "p80_ms": q[3],
        "min_ms": times[0],
        "n_timed": len(times),
        "timing": method,
    }


def peak_extra_bytes(fn: Callable[[], Any], dev: torch.device) -> Optional[int]:
    """Peak allocated bytes during one call, above what was live before it."""
    if dev.type != "cuda":
        return None
    synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    out = fn()
    synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    del out
    return int(peak - base)


def environment(dev: torch.device) -> Dict[str, Any]:
    info: Dict[str, Any] = {"torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info["device"] = torch.cuda.get_device_name(dev)
        info["capability"] = f"{props.major}.{props.minor}"
        info["sm_count"] = props.multi_processor_count
    else:
        info["device"] = "cpu"
        info["capability"] = None
    return info


def rates(flops: Optional[float], nbytes: Optional[float], ms: float) -> Dict[str, Optional[float]]:
    s = ms * 1e-3
    return {
        "tflops": (flops / s / 1e12) if flops and s > 0 else None,
        "gbps": (nbytes / s / 1e9) if nbytes and s > 0 else None,
    }


def run(
    benchmark: Any,
    fn: Callable[[], Any],
    dev: torch.device,
    *,
    op: str,
    shape: Any,
    backend: str,
    flops: Optional[float],
    nbytes: Optional[float],
    metric: str,
    sets: int,
    label: str,
    skip_on: Tuple[Type[BaseException], ...] = (ValueError,),
    extra: Optional[Dict[str, Any]] = None,
    before_record: Optional[Callable[[Dict[str, Any]], None]] = None,
) -> Dict[str, Any]:
    """Measure ``fn`` (a :class:`Rotation`) and record it in ``benchmark``.

    ``before_record(info)`` may add entries (e.g. a second timing) after the
    main timing and before pytest-benchmark's rounds.
    """
    out = first_call(fn, dev, label, skip_on)
    clean = nan_free(out)
    del out
    guard_call_time(fn, dev, label)
    stats = time_ms(fn, dev)
    info: Dict[str, Any] = {
        "op": op,
        "shape": shape.name,
        "backend": backend,
        "metric": metric,
        "dtype": str(dtype()).replace("torch.", ""),
        "n_sets": sets,
        "flops": flops,
        "bytes": nbytes,
        **stats,
        **rates(flops, nbytes, stats["median_ms"]),
        "peak_extra_bytes": peak_extra_bytes(fn, dev),
        "nan_free": clean,
        "shape_params": shape.params,
        "smoke": smoke(),
        **environment(dev),
    }
    if extra:
        info.update(extra)
    if before_record is not None:
        before_record(info)

    benchmark.group = f"{op} {shape.name}"
    benchmark.extra_info.update(info)

    def synced() -> None:
        fn()
        synchronize(dev)

    budget_s = _env_float("DSA_BENCH_ROUNDS_S", 0.2)
    rounds = int(min(100, max(3, budget_s * 1e3 / max(stats["median_ms"], 1e-3))))
    benchmark.pedantic(synced, rounds=rounds, iterations=1, warmup_rounds=1)
    return info
