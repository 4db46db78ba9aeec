"""Host time of a sparse-decode call: the function, the plan, and the launches alone.

    python3 bench/decode_host.py [--out DIR] [--formats fp8_v32,native] [--batches 1,32,128]
        [--heads 64,128] [--calls 100] [--reps 20]

Each row is one decode step of V3.2's shapes (D 576, d_v 512, K 2048, one
query row a sequence, caches of 8192 tokens a sequence in pages of 64
scattered by a block table, a sink) on a ``fp8_v32`` cache or a bf16 one
(``native``, [pages, 64, 1, 576]). Paths, each the same call:

- ``function``: ``dsa.sparse_decode(q, cache, positions, block_table=bt, sink=sink)``;
- ``plan``: ``plan(q, cache, positions, block_table=bt, sink=sink)``, the plan
  made once by ``dsa.sparse_decode_plan`` with the same arguments;
- ``plan_out``: the same with ``out=`` a buffer of the caller's (no allocation);
- ``launches``: the plan's prepared launches alone (the backend's share).

Method on a GPU: host time is the wall time of ``--calls`` back-to-back
calls divided by their number, taken while the stream is held behind a
sleeping kernel (``torch.cuda._sleep``, sized from a calibration to outlast
the loop), so that no call ever waits for the device: every launch only
queues. An event recorded after the sleep is queried when the loop ends; if
the device was no longer asleep the sample is discarded and the sleep
doubled. Python's garbage collector is off while a path is timed (as in
``timeit``), after a collection. The figure is the minimum over ``--reps`` samples (the median is
kept too); the queue stays far below the driver's limit (three launches a
call at most). Kernel time is bench/decode_peers.py's.

On a machine without CUDA the same paths run on CPU tensors with the Triton
backend (``TRITON_INTERPRET=1``) and its two kernel launchers replaced by a
compiled-kernel stand-in whose launch does nothing, the SM count taken to be
an H200's 132 (so the plans split as they do there): the host time of
everything but Triton's own launch and the CUDA allocator. Those figures
are CPU-side estimates; ``view_us`` (a ``tensor.view``, timed alongside) is
the yardstick to scale them to another CPU. Prints a table; ``--out DIR``
writes DIR/decode_host.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # before anything imports triton: the launches run (stubbed) under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dsa  # noqa: E402
from dsa.kv_cache import FORMATS  # noqa: E402

PAGE = 64
K = 2048
D = 576
SMS_STUB = 132  # the H200's SM count, for the split counts of the CPU run


# ----------------------------------------------------------------------------
# Timing


def _cycles_per_us() -> float:
    """Clock cycles of ``torch.cuda._sleep`` a microsecond, on the current device."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    torch.cuda.synchronize()
    return 10**7 / (start.elapsed_time(end) * 1e3)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Python's garbage collector collected first and kept off while timing, as ``timeit`` does: a
    collection of what compiling the kernels left behind would otherwise land in the first row's loops."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@_no_gc()
def host_us_cuda(fn: Callable[[], Any], calls: int, reps: int) -> Tuple[float, float]:
    """(min, median) host microseconds a call of ``fn``, the stream held behind a sleep (module header)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    cycles = _cycles_per_us() * calls * 500.0  # room for 500 us of host time a call
    samples: List[float] = []
    while len(samples) < reps:
        torch.cuda._sleep(int(cycles))
        asleep = torch.cuda.Event()
        asleep.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        dt = time.perf_counter() - t0
        ahead = not asleep.query()  # still asleep: no call waited for the device
        torch.cuda.synchronize()
        if ahead:
            samples.append(dt / calls * 1e6)
        elif cycles > 1e12:
            raise RuntimeError("the device finished a sleep of 1e12 cycles before the loop: no host figure")
        else:
            cycles *= 2
    return min(samples), statistics.median(samples)


@_no_gc()
def host_us_cpu(fn: Callable[[], Any], calls: int, reps: int) -> Tuple[float, float]:
    """(min, median) microseconds a call of ``fn`` over ``reps`` loops of ``calls`` calls."""
    for _ in range(5):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return min(samples), statistics.median(samples)


class _NoLaunch:
    """A compiled kernel whose launch does nothing (the CPU run's stand-in)."""

    packed_metadata = ()

    def __getitem__(self, grid: Tuple[int, ...]) -> Callable[..., None]:
        return lambda *args: None


class _Stub:
    """The JIT function of a launcher, returning :class:`_NoLaunch` for every launch."""

    def __init__(self, fn: Any):
        self.arg_names = fn.arg_names

    def __getitem__(self, grid: Tuple[int, ...]) -> Callable[..., _NoLaunch]:
        return lambda *args, **kw: _NoLaunch()


@contextlib.contextmanager
def stubbed_launches() -> Iterator[None]:
    """The Triton decode's launches do nothing and the device has SMS_STUB SMs, for the block; restored after."""
    from dsa import decode as decode_mod
    from dsa.triton import decode as tdecode

    # plans and kept calls made under the stub split for 132 SMs: none outlives it
    kept = (dict(tdecode._PLANS), dict(decode_mod._KNOWN))
    saved = (tdecode._DECODE.fn, tdecode._COMBINE.fn, tdecode.sm_count)
    tdecode._DECODE.fn, tdecode._COMBINE.fn = _Stub(tdecode._DECODE.fn), _Stub(tdecode._COMBINE.fn)
    tdecode.sm_count = lambda device: SMS_STUB
    tdecode._PLANS.clear()
    decode_mod._KNOWN.clear()
    try:
        yield
    finally:
        tdecode._DECODE.fn, tdecode._COMBINE.fn, tdecode.sm_count = saved
        for live, before in zip((tdecode._PLANS, decode_mod._KNOWN), kept):
            live.clear()
            live.update(before)
        for launcher in (tdecode._DECODE, tdecode._COMBINE):
            launcher._compiled = {k: v for k, v in launcher._compiled.items() if not isinstance(v[0], _NoLaunch)}


# ----------------------------------------------------------------------------
# The calls


def problem(fmt: str, B: int, H: int, L: int, device: torch.device) -> Dict[str, Any]:
    """q, the cache (uninitialised on CPU, where nothing reads it), positions, block table, sink."""
    g = torch.Generator(device=device).manual_seed(0)
    per_seq = L // PAGE
    P = B * per_seq
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's dtype on CPU
    if fmt == "native":
        cache = torch.empty(P, PAGE, 1, D, dtype=dtype, device=device)
    else:
        cache = torch.empty(P, PAGE, FORMATS[fmt].bytes_per_token, dtype=torch.uint8, device=device)
    if device.type == "cuda":  # finite values (the kernels run): e4m3 bytes below 0x7F are no NaN, scales 1/16
        if fmt == "native":
            cache.normal_(generator=g)
        else:
            fmt_ = FORMATS[fmt]
            cache.random_(0, 0x7F, generator=g)
            cache[..., 512:528].view(torch.float32).fill_(2.0**-4)
            # RoPE as bf16 values: random bytes there can be ~1e38, whose products overflow to NaN
            rope = cache[..., fmt_.rope_offset:fmt_.rope_offset + 2 * fmt_.d_rope].view(torch.bfloat16)
            rope.copy_(torch.randn(rope.shape, device=device, generator=g))
    bt = torch.randperm(P, device=device, generator=g).view(B, per_seq).int()
    pos = torch.rand(B, L, device=device, generator=g).topk(K, dim=-1).indices.sort(dim=-1).values.int().view(B, 1, K)
    q = torch.randn(B, 1, H, D, device=device, generator=g).to(dtype)
    sink = torch.randn(H, device=device, generator=g)
    return dict(q=q, cache=cache, pos=pos, bt=bt, sink=sink)


def run_row(fmt: str, B: int, H: int, L: int, calls: int, reps: int, backend: str) -> Dict[str, Any]:
    dev = torch.device("cuda" if CUDA else "cpu")
    pb = problem(fmt, B, H, L, dev)
    q, cache, pos, bt, sink = (pb[k] for k in ("q", "cache", "pos", "bt", "sink"))
    plan = dsa.sparse_decode_plan(q, cache, pos, block_table=bt, sink=sink, backend=backend)
    out = torch.empty(B, 1, H, 512, dtype=q.dtype, device=dev)
    paths: Dict[str, Callable[[], Any]] = {
        "function": lambda: dsa.sparse_decode(q, cache, pos, block_table=bt, sink=sink, backend=backend),
        "plan": lambda: plan(q, cache, pos, block_table=bt, sink=sink),
        "plan_out": lambda: plan(q, cache, pos, block_table=bt, sink=sink, out=out),
    }
    run = plan._run  # the backend's prepared launches (None: it offers none)
    if run is not None:
        kv, lse = plan._form.cache(cache), torch.empty(B, 1, H, dtype=torch.float32, device=dev)
        paths["launches"] = lambda: run(q, kv, pos, None, bt, None, sink, out, lse)
    if CUDA:
        if not torch.equal(paths["plan"](), paths["function"]()):
            raise AssertionError(f"{fmt} B{B} H{H}: the plan's result is not the function's")
    row: Dict[str, Any] = dict(format=fmt, B=B, H=H, K=K, cache_len=L, backend=plan.backend,
                               splits=getattr(getattr(run, "plan", None), "splits", None))
    measure = host_us_cuda if CUDA else host_us_cpu
    for name, fn in paths.items():
        row[f"{name}_us"], row[f"{name}_median_us"] = measure(fn, calls, reps)
    print(f"{fmt:8s} {B:4d} {H:4d} {str(row['splits']):>6s}  " + "  ".join(
        f"{row.get(f'{n}_us', float('nan')):9.1f}" for n in ("function", "plan", "plan_out", "launches")), flush=True)
    return row


def _view_us(calls: int, reps: int) -> float:
    x = torch.zeros(4, 4)
    return host_us_cpu(lambda: x.view(16), calls, reps)[0]


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--formats", default="fp8_v32,native")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--heads", default="64,128")
    p.add_argument("--cache-len", type=int, default=8192)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    backend = "auto" if CUDA else "triton"
    device = torch.cuda.get_device_name() if CUDA else "cpu (Triton launches stubbed: CPU-side estimates)"
    import triton

    print(device, "torch", torch.__version__, "triton", triton.__version__)
    print(f"host us a call ({'GPU held asleep' if CUDA else 'CPU, launches stubbed'}; min of {args.reps} x "
          f"{args.calls} calls)")
    print(f"{'format':8s} {'B':>4s} {'H':>4s} {'splits':>6s}  {'function':>9s}  {'plan':>9s}  {'plan_out':>9s}  "
          f"{'launches':>9s}")
    with contextlib.nullcontext() if CUDA else stubbed_launches():
        rows = [run_row(fmt, B, H, args.cache_len, args.calls, args.reps, backend)
                for fmt in args.formats.split(",") for H in ints(args.heads) for B in ints(args.batches)]
    result = dict(device=device, torch=torch.__version__, triton=triton.__version__, stubbed=not CUDA,
                  method="GPU held asleep, min over reps" if CUDA else "CPU, Triton launches stubbed, min over reps",
                  view_us=_view_us(args.calls, args.reps), rows=rows)
    print(f"tensor.view: {result['view_us']:.2f} us")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_host.json"), "w") as fh:
            json.dump(result, fh, indent=1)
    sys.stdout.flush()
    return result


if __name__ == "__main__":
    main()
