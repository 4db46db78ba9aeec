"""The CuTe SM90 sparse attention backward against the Triton backward.

    compute-sanitizer --tool memcheck python bench/bench_cute_bwd.py --sanitize
    python bench/bench_cute_bwd.py [--shapes v32,v4pro,...,v32-half,...]   (SHAPES, VARIANTS)
    python bench/bench_cute_bwd.py --shapes 'v32@evict_last=0+c0_chunks=1'     (any build at a shape)
    python bench/bench_cute_bwd.py --parts --shapes v32,v4flash          (the backward's pieces timed apart)
    python bench/bench_cute_bwd.py --timeline --shapes h64k128,h64d576   (where a tile's time goes)
    python bench/bench_cute_bwd.py --rounds 5 --shapes v4flash,v4flash@dq_early=1   (builds in turn, same inputs)
    compute-sanitizer ... python bench/bench_cute_bwd.py --sanitize --build '{"tma_rows": true}'  (another build)

One process, the same inputs for both (fresh ``torch.randn``, bf16, sink on,
random indices), ``triton.testing.do_bench`` medians (warmup 25 ms, rep
100 ms); TFLOP/s = 2 T H K (3 D + 2 d_v) / t.  Each shape also prints the
relative L2 distance of the cute dq / dkv / dsink from Triton's, a check at
full size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import torch
import triton

from dsa._args import SparseAttnArgs
from dsa.cute import sparse_attention as cute_sa
from dsa.cute import sparse_attention_bwd as cbwd
from dsa.triton import sparse_attention as tsa

# name: (T, N, H, D, K, half-valid rows, deterministic)
SHAPES = {
    "v32": (4096, 8192, 128, 576, 2048, False, False),
    "v4pro": (8192, 16384, 128, 512, 1152, False, False),
    "v4flash": (8192, 16384, 64, 512, 640, False, False),
    "h64d576": (4096, 8192, 64, 576, 2048, False, False),
    "h64k128": (4096, 8192, 64, 576, 128, False, False),
    "v32half": (4096, 8192, 128, 576, 2048, True, False),
    "v32det": (4096, 8192, 128, 576, 2048, False, True),
    "v4prodet": (8192, 16384, 128, 512, 1152, False, True),
    "v4flashdet": (8192, 16384, 64, 512, 640, False, True),
    "h64det": (4096, 8192, 64, 576, 2048, False, True),
    # tensor-parallel shards: 16 / 32 heads, one tile padded to 64 rows
    "tp16": (4096, 8192, 16, 576, 2048, False, False),
    "tp32": (4096, 8192, 32, 576, 2048, False, False),
}
# other builds of the kernel (sparse_attention_bwd.BUILD) at a shape; their
# Triton time is not measured again
VARIANTS = {
    "v32-nohint": ("v32", dict(evict_last=False)),
    "v32-c0x0": ("v32", dict(c0_chunks=0)),
    "v32-c0x3": ("v32", dict(c0_chunks=3)),
    # timing only (dkv is not added): the cost of everything but the atomics
    "v32-noscatter": ("v32", dict(scatter=False)),
}


def _variant(name: str):
    """(shape, build) of a VARIANTS name or of 'shape@key=value+...'."""
    if "@" not in name:
        return VARIANTS.get(name, (name, {}))
    shape, spec = name.split("@", 1)
    build = {}
    for item in spec.split("+"):
        key, value = item.split("=", 1)
        build[key] = int(value) if value.lstrip("-").isdigit() else value
        if key in _flags():
            build[key] = bool(build[key])
    return shape, build


def _flags() -> set:
    """The build options that are on / off (``BwdSm90Config``'s fields with a bool default)."""
    from dsa.cute.sparse_attention_bwd_sm90 import BwdSm90Config

    return {f.name for f in dataclasses.fields(BwdSm90Config) if isinstance(f.default, bool)}
DEFAULT_BUILD = dict(cbwd.BUILD)


def _args(T, N, H, D, K, half, det, seed=0) -> SparseAttnArgs:
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(T, H, D, device=dev, generator=g).to(dt)
    kv = torch.randn(N, 1, D, device=dev, generator=g).to(dt)
    idx = torch.randint(0, N, (T, 1, K), device=dev, generator=g, dtype=torch.int32)
    tl = torch.randint(0, K + 1, (T,), device=dev, generator=g, dtype=torch.int32) if half else None
    sink = torch.randn(H, device=dev, generator=g)
    return SparseAttnArgs(q, kv, idx, tl, sink, 1.0 / math.sqrt(D), 512, det)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30)).item()


def _setup(name: str):
    """The build of ``name`` in place, its shape's arguments, the forward's
    out and lse (the Triton forward's; at a deterministic shape the cute
    forward's, with its bounds), a random dO; (shape, a, out, lse, dout, bounds)."""
    shape, build = _variant(name)
    cbwd.BUILD = dict(DEFAULT_BUILD, **build)
    a = _args(*SHAPES[shape])
    out, lse, *bounds = cute_sa.forward(a) if a.deterministic else tsa.forward(a)
    dout = torch.randn(a.T, a.H, 512, device="cuda", dtype=torch.bfloat16)
    return SHAPES[shape], a, out, lse, dout, (bounds[0] if bounds else None)


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def run(name: str, triton_too: bool = True) -> None:
    (T, N, H, D, K, half, det), a, out, lse, dout, bounds = _setup(name)
    flop = 2 * T * H * K * (3 * D + 2 * 512)
    res = {}
    grads = {}
    backends = (("cute", lambda *x: cbwd.backward(*x, bounds)),)
    if name in SHAPES and triton_too:
        backends += (("triton", tsa.backward),)
    for backend, fn in backends:
        grads[backend] = fn(a, out, lse, dout)
        torch.cuda.synchronize()
        res[backend] = _ms(lambda: fn(a, out, lse, dout))
    c = grads["cute"]
    line = (f"{name:11s} T={T} N={N} H={H} D={D} K={K} half={half} det={det} build={cbwd.BUILD}: "
            f"cute {res['cute']:.3f} ms ({flop / res['cute'] / 1e9:.1f} TFLOP/s)")
    if "triton" in res:
        t = grads["triton"]
        err = f"dq {_rel(c[0], t[0]):.2e} dkv {_rel(c[1], t[1]):.2e} dsink {_rel(c[2], t[2]):.2e}"
        line += (f"  triton {res['triton']:.3f} ms ({flop / res['triton'] / 1e9:.1f} TFLOP/s)"
                 f"  speedup {res['triton'] / res['cute']:.2f}x  | cute vs triton: {err}")
    print(line, flush=True)
    if det:
        again = cbwd.backward(a, out, lse, dout, bounds)
        same = all(torch.equal(x, y) for x, y in zip(again, c))
        # the default (atomic) backward on the same inputs, and the deterministic one bounding by its own kernel
        d = dataclasses.replace(a, deterministic=False)
        ms = _ms(lambda: cbwd.backward(d, out, lse, dout))
        own = _ms(lambda: cbwd.backward(a, out, lse, dout))
        own_dkv = cbwd.backward(a, out, lse, dout)[1]
        free = cbwd.backward(d, out, lse, dout)
        print(f"{name:9s} deterministic: bitwise equal on a second run: {same}; the default {ms:.3f} ms, "
              f"deterministic / default speed {ms / res['cute']:.3f} (the forward's bounds; "
              f"{ms / own:.3f} with the bound kernel, {own:.3f} ms), dkv vs the default's "
              f"{_rel(c[1], free[1]):.2e} ({_rel(own_dkv, free[1]):.2e}), dq equal {torch.equal(c[0], free[0])}",
              flush=True)
        fd, fn_ = _ms(lambda: cute_sa.forward(a)), _ms(lambda: cute_sa.forward(d))
        o2, l2 = cute_sa.forward(d)
        print(f"{name:9s} cute forward with the bounds {fd:.3f} ms, without {fn_:.3f} ms ({fd / fn_:.3f}); "
              f"out equal {torch.equal(o2, out)}, lse equal {torch.equal(l2, lse)}; training step "
              f"deterministic {fd + res['cute']:.3f} ms, default {fn_ + ms:.3f} ms", flush=True)


def parts(name: str) -> None:
    """The cute backward's pieces timed apart at a shape: the whole call, the
    per-row preprocess (a pass over out and dO unless the build computes
    Delta in the kernel), the fp32 dkv zero fill,
    the kernel alone and the column-order cast of dkv, ms; at a
    deterministic shape also the pieces of its exact adds."""
    from dsa.triton.sparse_attention import preprocess

    (T, N, H, D, K, half, det), a, out, lse, dout, bounds = _setup(name)
    delta, lg2den, _ = preprocess(a, out, lse, dout)
    dq = torch.empty_like(a.q)
    dkv = torch.zeros((N, 1, D), dtype=torch.float32, device="cuda")
    cbwd.backward(a, out, lse, dout)
    nd = dataclasses.replace(a, deterministic=False)
    pre_delta = not cbwd.kernel_config(nd).kernel_delta  # the default mode's preprocess
    steps = {
        "whole": lambda: cbwd.backward(a, out, lse, dout, bounds),
        "preprocess": lambda: preprocess(a, out, lse, dout, delta=pre_delta),
        "zero": lambda: dkv.zero_(),
        "kernel": lambda: cbwd._launch(nd, dout, lg2den, delta, dq, dkv, 0, T, out=out),
        "columns": lambda: cbwd.natural_columns(dkv, torch.bfloat16),
    }
    if det:
        # the deterministic mode's pieces: the preprocess with dO's stats,
        # the slot bounds, the value norms,
        # the rows' grids, the copies' zero fill, the kernel with rounded
        # adds, the copies' sum
        from dsa.triton.dkv_quanta import copies_sum, dkv_quanta, forward_bounds, value_norms

        stats = torch.empty((T, H, 2), dtype=torch.float32, device="cuda")
        preprocess(a, out, lse, dout, stats)
        xy = cbwd.slot_bounds(a, lg2den, stats, delta)
        copies, tpc = cbwd.dkv_copies(a)
        vn = value_norms(a.kv, 512)
        magic = dkv_quanta(xy, a.indices, a.topk_length, vn, N, copies, tpc)
        buf = torch.zeros((copies, N, 1, D), dtype=torch.float32, device="cuda")

        steps.update({
            "preprocess_stats": lambda: preprocess(a, out, lse, dout, stats),
            "bounds": lambda: cbwd.slot_bounds(a, lg2den, stats, delta),
            "forward_bounds": lambda: forward_bounds(*cute_sa.bound_views(a, bounds), a.q, stats, delta, lg2den,
                                                     a.topk_length, K, a.sm_scale),
            "vnorm": lambda: value_norms(a.kv, 512),
            "quanta": lambda: dkv_quanta(xy, a.indices, a.topk_length, vn, N, copies, tpc),
            "zero_copies": lambda: buf.zero_(),
            "kernel_det": lambda: cbwd._launch(a, dout, lg2den, delta, dq, buf, 0, T, magic, tpc),
            "copy_sum": lambda: copies_sum(buf, torch.bfloat16),
        })
        print(f"{name:11s} deterministic: {copies} dkv copies of {tpc} tokens", flush=True)
    ms = {k: triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median") for k, f in steps.items()}
    flop = 2 * T * H * K * (3 * D + 2 * 512)
    print(f"{name:11s} parts, ms: " + "  ".join(f"{k} {v:.4f}" for k, v in ms.items())
          + f"  | kernel {flop / ms['kernel'] / 1e9:.1f} TFLOP/s, whole {flop / ms['whole'] / 1e9:.1f}", flush=True)


def _tiles_by_sm(sms: torch.Tensor, start: torch.Tensor) -> list:
    """Per SM, the rows of its tiles in the order of their start."""
    orders = []
    for sm in sms.unique().tolist():
        rows = (sms == sm).nonzero().flatten()
        orders.append(rows[start[rows].argsort()])
    return orders


def timeline_spans(marks: torch.Tensor, ms_marked: float) -> dict:
    """The timeline build's int64 [tiles, TL_N] marks (on the host) read as
    ``timeline`` prints them; ms_marked: the marked kernel's time."""
    from dsa.cute import sparse_attention_bwd_sm90 as k

    raw = marks.clone()
    raw[:, k.TL_NS:] -= raw[:, k.TL_NS + k.TL_START].min()  # nanoseconds since ~1970: too many for a double
    m = raw.double()
    end = torch.maximum(m[:, k.TL_END0], m[:, k.TL_END1])
    sms = m[:, k.TL_SM].long()
    spans, gaps = [], []
    for order in _tiles_by_sm(sms, m[:, k.TL_START]):
        spans.append((end[order].max() - m[order, k.TL_START].min()).item())
        gaps.append((m[order[1:], k.TL_START] - end[order[:-1]]).mean().item() if len(order) > 1 else 0.0)
    hz = sorted(spans)[len(spans) // 2] / (ms_marked * 1e-3)
    us = lambda c: c / hz * 1e6  # noqa: E731
    has_block = m[:, k.TL_BLOCK0] > 0  # tiles with a block: the block marks are written
    part = {  # one thread's marks: warpgroup 0's thread 0, warpgroup 1's thread 128
        "Q, dO, out in": m[:, k.TL_Q] - m[:, k.TL_START],
        "Delta, block 0 issued": m[:, k.TL_DELTA] - m[:, k.TL_Q],
        "block 0 in": (m[:, k.TL_BLOCK0] - m[:, k.TL_DELTA])[has_block],
        "wg0 blocks": (m[:, k.TL_LOOP0] - m[:, k.TL_BLOCK0])[has_block],
        "wg0 dq store": m[:, k.TL_END0] - m[:, k.TL_LOOP0],
        "wg1 blocks": (m[:, k.TL_LOOP1] - m[:, k.TL_READY1])[has_block],
        "wg1 dq store": m[:, k.TL_END1] - m[:, k.TL_LOOP1],
    }
    # across the two warpgroups' threads, from the global nanosecond timer
    # (their SM clocks were seen to disagree)
    ns = lambda mark: m[:, k.TL_NS + mark]  # noqa: E731
    ns_end = torch.maximum(ns(k.TL_END0), ns(k.TL_END1))
    ns_gaps = []
    for order in _tiles_by_sm(sms, ns(k.TL_START)):
        if len(order) > 1:
            ns_gaps.append((ns(k.TL_START)[order[1:]] - ns_end[order[:-1]]).mean().item())
    cross = {
        "wg1 first hand-off": (ns(k.TL_READY1) - ns(k.TL_START))[has_block],
        "wg1 end after wg0's": ns(k.TL_END1) - ns(k.TL_END0),
        "tile": ns_end - ns(k.TL_START),
    }
    starts = ns(k.TL_START).sort().values
    step = (starts[1:] - starts[:-1])
    step = step[step > 0].min().item() if bool((step > 0).any()) else float("nan")
    # warpgroup 1 passes block 0's hand-off only after warpgroup 0 has block
    # 0: a tile whose marks read otherwise shows the two clocks apart
    early = (m[:, k.TL_READY1] < m[:, k.TL_BLOCK0])[has_block].double().mean().item()
    early_ns = (ns(k.TL_READY1) < ns(k.TL_BLOCK0))[has_block].double().mean().item()
    return dict(hz=hz, us=us, part=part, cross=cross, gap_ns=sum(ns_gaps) / max(1, len(ns_gaps)),
                gap_clock=sum(gaps) / len(gaps), step=step, early=early, early_ns=early_ns, sms=len(spans))


def timeline(name: str) -> None:
    """Where a tile's time goes: the timeline build (``BwdSm90Config.timeline``:
    the SM clock and the global timer at each warpgroup's marks, ``TL_*``)
    run once, its dq checked bitwise against the plain build's; per tile,
    the mean of each span between one thread's marks in microseconds at the
    clock the run implies (cycles over the kernel's do_bench time, per SM),
    and from the global timer the spans across the two warpgroups, the whole
    tile and the gap on its SM from the end of the tile before to its
    start."""
    from dsa.cute import sparse_attention_bwd_sm90 as k
    from dsa.cute.host import head_blocks
    from dsa.triton.sparse_attention import preprocess

    (T, N, H, D, K, half, det), a, out, lse, dout, _ = _setup(name)
    delta, lg2den, _ = preprocess(a, out, lse, dout)
    out = out.contiguous()
    plain = cbwd.kernel_config(a)
    marked = dataclasses.replace(plain, timeline=True)
    tiles = a.T * a.G * head_blocks(a.H // a.G)
    marks = torch.zeros((tiles, k.TL_N), dtype=torch.int64, device="cuda")
    dqs, ms = [], {}
    for cfg, buf in ((plain, None), (marked, marks)):
        dq = torch.full_like(a.q, float("nan"))
        dkv = torch.zeros((N, 1, D), dtype=torch.float32, device="cuda")
        run = lambda: cbwd._launch(a, dout, lg2den, delta, dq, dkv, 0, T, magic=buf, out=out, cfg=cfg)  # noqa: E731
        run()
        dqs.append(dq.clone())
        ms[cfg.timeline] = _ms(run)
    marks.zero_()
    cbwd._launch(a, dout, lg2den, delta, dq, dkv, 0, T, magic=marks, out=out, cfg=marked)
    r = timeline_spans(marks.cpu(), ms[True])
    part, cross, us = r["part"], r["cross"], r["us"]
    print(f"{name:11s} timeline: kernel {ms[False]:.4f} ms plain, {ms[True]:.4f} with marks; dq bitwise "
          f"{torch.equal(dqs[0], dqs[1])}; SM clock {r['hz'] / 1e6:.0f} MHz; {tiles} tiles on {r['sms']} SMs; us a "
          "tile, one thread's SM clock: " + ", ".join(f"{n} {us(v.mean().item()):.2f}" for n, v in part.items())
          + "; across the warpgroups, global timer: "
          + ", ".join(f"{n} {v.mean().item() / 1e3:.2f}" for n, v in cross.items())
          + f", gap before a tile {r['gap_ns'] / 1e3:.2f} (SM clock {us(r['gap_clock']):.2f}); timer step "
          f"{r['step']:.0f} ns; hand-off read before block 0 in {r['early']:.1%} of tiles by the SM clock, "
          f"{r['early_ns']:.1%} by the global timer", flush=True)


def rounds(names, n: int) -> None:
    """The builds of each shape timed in turn for n rounds on one set of
    inputs (the shape's first name's), each round in a rotated order; per
    build the median ms and the median over rounds of the first build's
    time over its own, and dq's relative distance from the first build's."""
    groups = {}
    for name in names:
        groups.setdefault(_variant(name)[0], []).append(name)
    for shape, group in groups.items():
        (T, N, H, D, K, half, det), a, out, lse, dout, bounds = _setup(group[0])
        flop = 2 * T * H * K * (3 * D + 2 * 512)
        builds = [dict(DEFAULT_BUILD, **_variant(name)[1]) for name in group]
        dqs = []
        for b in builds:
            cbwd.BUILD = b
            dqs.append(cbwd.backward(a, out, lse, dout, bounds)[0])
        times = [[] for _ in group]
        for r in range(n):
            for j in range(len(group)):
                k = (j + r) % len(group)
                cbwd.BUILD = builds[k]
                times[k].append(_ms(lambda: cbwd.backward(a, out, lse, dout, bounds)))
        base = torch.tensor(times[0])
        for name, ts, dq in zip(group, times, dqs):
            t = torch.tensor(ts)
            print(f"{name:30s} T={T} H={H} D={D} K={K} half={half}: {t.median().item():.4f} ms "
                  f"({flop / t.median().item() / 1e9:.1f} TFLOP/s), {group[0]} / it {(base / t).median().item():.4f} "
                  f"(rounds {(base / t).min().item():.3f}-{(base / t).max().item():.3f}), dq vs {group[0]} "
                  f"{_rel(dq, dqs[0]):.1e}", flush=True)
        cbwd.BUILD = dict(DEFAULT_BUILD)
        torch.cuda.empty_cache()


def sanitize() -> None:
    """A small call with hostile indices (out of range both ways, past
    topk_length, duplicates) through the cute forward (also its ordered
    build on a persistent grid of 3 CTAs, ``token_order``), then the cute
    backward in both modes: run under compute-sanitizer."""
    T, N, D, K = 8, 256, 576, 256
    for H in (128, 16):  # 16: a tile padded past the heads, the last one past q's end
        a = _args(T, N, H, D, K, True, False)
        idx = a.indices.clone()
        idx[..., 0::7] = -5
        idx[..., 3::11] = N
        idx[..., 5::13] = 2**30
        idx[..., 8:24] = idx[..., 1:2]
        tl = torch.tensor([0, -3, K + 9, 1, 65, 200, K, 17], dtype=torch.int32, device="cuda")
        for det in (False, True):
            b = SparseAttnArgs(a.q, a.kv, idx, tl, a.sink, a.sm_scale, 512, det)
            out, lse, *bounds = cute_sa.forward(b)
            ref_out, _ = tsa.forward(b)
            keep, cute_sa.ORDER_ROUNDS = cute_sa.ORDER_ROUNDS, 2
            try:
                ordered = cute_sa.forward(b, cute_sa.GridConfig(ctas=3))
            finally:
                cute_sa.ORDER_ROUNDS = keep
            same = torch.equal(ordered[0], out) and torch.equal(ordered[1], lse)
            dout = torch.randn(T, H, 512, device="cuda", dtype=torch.bfloat16)
            dq, dkv, dsink = cbwd.backward(b, out, lse, dout, *bounds)
            torch.cuda.synchronize()
            print(f"sanitize H={H} det={det}: out vs triton {_rel(out, ref_out):.1e}, ordered build bitwise "
                  f"{same}, finite {bool(dq.isfinite().all() and dkv.isfinite().all())}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(list(SHAPES) + list(VARIANTS)))
    ap.add_argument("--sanitize", action="store_true", help="only the small hostile call (compute-sanitizer)")
    ap.add_argument("--parts", action="store_true", help="time the backward's pieces apart")
    ap.add_argument("--no-triton", action="store_true", help="time the cute backward alone")
    ap.add_argument("--timeline", action="store_true", help="where a tile's time goes (the timeline build)")
    ap.add_argument("--rounds", type=int, default=0, help="the shapes' builds timed in turn, this many rounds")
    ap.add_argument("--build", default=None, help="JSON: options every run's build starts from (BUILD updated)")
    args = ap.parse_args()
    if args.build:
        DEFAULT_BUILD.update(json.loads(args.build))
        cbwd.BUILD = dict(DEFAULT_BUILD)
    if args.sanitize:
        sanitize()
        return
    if args.rounds:
        rounds(args.shapes.split(","), args.rounds)
        return
    for name in args.shapes.split(","):
        if args.timeline:
            timeline(name)
        elif args.parts:
            parts(name)
        else:
            run(name, not args.no_triton)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
