"""Measure where the cute kernel beats Triton, and write the placement table.

    PYTHONPATH=$PWD python bench/place_cute.py --out DIR [--commit SHA] [--op bwd]

``--op fwd`` (the default) times the forward and writes
``placement_{arch}.json``; ``--op bwd`` times the backward (the same grids,
each call fed the Triton forward's out and lse and a random dO) and writes
``placement_{arch}_bwd.json``.  Copy the file to ``dsa/cute/``.

1. Training grid (``TRAIN``, 120 shapes): every shape is timed on both backends; each
   becomes one table entry naming the faster one.
2. Holdout grid (``HOLDOUT``): a fixed list written down before any timing
   (shapes off the training grid: other K, T, N, sink and topk_length), timed
   the same way.  The table picks a backend for each holdout shape by its
   nearest entry (``dsa.cute.placement.nearest``); the regret of a shape is
   time(picked) / min(time(cute), time(triton)), and its geometric mean over
   the holdout must be <= 1.02 for the table to be written
   (``DIR/placement_sm90.json``, or ``placement_sm100.json`` on an SM100 GPU,
   where the SM100 kernel is timed; copy it to ``dsa/cute/``).

Timing: every kernel configuration is compiled before anything is timed
(an idle GPU during a compile lowers its clocks, and the next small shape
would be timed slow), the GPU is kept busy for a second, then each shape is
timed twice per backend, alternating, with triton.testing.do_bench (median,
warmup 25 ms, rep 60 ms) on fresh random inputs, and the lower median kept.
bf16 or fp16, kv rows drawn uniformly from [0, N).  Shapes whose calls are
a few tens of microseconds are launch-bound: their ranking moved between the
runs of 96cb385 and 88ce576 (bench/placement/), which is why the timing is
done this way.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import time

import torch
import triton

from dsa._args import SparseAttnArgs
from dsa.cute import host, placement
from dsa.cute import sparse_attention as cute_sa
from dsa.cute import sparse_attention_bwd as cute_bwd
from dsa.cute.sm100 import sparse_attention as sm100_sa
from dsa.triton import sparse_attention as triton_sa

# (dtype, D, HG, K, T, N, sink, topk_length)
TRAIN = [
    (dt, D, HG, K, T, 8192, False, False)
    for dt, D, HG, K, T in itertools.product(
        ("bfloat16", "float16"), (512, 576), (64, 128), (128, 512, 2048), (16, 128, 256, 1024, 8192))
]  # T = 256: the first T whose grid needs more than one wave of CTAs on 132 SMs

# Frozen before timing: off-grid K, T and N, with sinks and half-valid rows.
HOLDOUT = [
    ("bfloat16", 576, 128, 2048, 4096, 8192, False, False),    # V3.2
    ("bfloat16", 512, 128, 1152, 8192, 8192, True, False),     # V4-pro
    ("bfloat16", 512, 64, 640, 8192, 8192, True, False),       # V4-flash
    ("bfloat16", 576, 64, 2048, 4096, 8192, False, False),     # H64 / D576
    ("bfloat16", 576, 128, 2048, 4096, 8192, False, True),     # V3.2, half-valid rows
    ("bfloat16", 576, 128, 1000, 300, 16384, True, False),
    ("bfloat16", 512, 64, 3000, 2000, 65536, False, True),
    ("bfloat16", 576, 64, 200, 6000, 4096, True, True),
    ("bfloat16", 512, 128, 384, 40, 65536, False, False),
    ("bfloat16", 576, 128, 64, 2500, 8192, False, False),
    ("bfloat16", 512, 128, 4096, 700, 16384, True, False),
    ("bfloat16", 576, 64, 1536, 90, 32768, False, True),
    ("float16", 576, 128, 2048, 3000, 8192, False, False),
    ("float16", 512, 64, 640, 5000, 16384, True, False),
    ("float16", 576, 64, 300, 200, 4096, True, True),
    ("float16", 512, 128, 1536, 1500, 32768, False, True),
    ("float16", 576, 128, 96, 12000, 8192, True, False),
    ("float16", 512, 64, 2500, 24, 65536, False, False),
]


def make(shape, seed):
    dt, D, HG, K, T, N, sink, half = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    dtype = getattr(torch, dt)
    q = torch.randn(T, HG, D, device="cuda", dtype=dtype, generator=g)
    kv = torch.randn(N, 1, D, device="cuda", dtype=dtype, generator=g)
    idx = torch.randint(0, N, (T, 1, K), device="cuda", dtype=torch.int32, generator=g)
    L = torch.randint(0, K + 1, (T,), device="cuda", dtype=torch.int32, generator=g) if half else None
    s = torch.randn(HG, device="cuda", generator=g) if sink else None
    return SparseAttnArgs(q, kv, idx, L, s, D ** -0.5, 512, False)


# the GPU's architecture names the table (placement_sm90.json, placement_sm100.json) and picks its kernel
ARCH = host.arch_of(torch.device("cuda")) if torch.cuda.is_available() else None
FORWARD = (("cute", sm100_sa.forward if ARCH == "sm100" else cute_sa.forward), ("triton", triton_sa.forward))
BACKWARD = (("cute", sm100_sa.backward if ARCH == "sm100" else cute_bwd.backward), ("triton", triton_sa.backward))


def inputs(shape, seed, op):
    """The arguments of one timed call: (args,) forward; (args, out, lse, dO) backward."""
    a = make(shape, seed)
    if op == "fwd":
        return (a,)
    out, lse = triton_sa.forward(a)
    g = torch.Generator(device="cuda").manual_seed(seed + 1000)
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
    return a, out, lse, dout


def compile_all(shapes, backends, op):
    seen = set()
    for shape in shapes:
        dt, D, HG, K, T, N, sink, half = shape
        key = (dt, D, HG, sink, half)
        if key not in seen:
            seen.add(key)
            x = inputs((dt, D, HG, 64, 1, 64, sink, half), 0, op)
            for _, fn in backends:
                fn(*x)
    torch.cuda.synchronize()


def keep_busy(seconds=1.0):
    a = make(("bfloat16", 576, 128, 2048, 2048, 8192, False, False), 0)
    t_end = time.time() + seconds
    while time.time() < t_end:
        triton_sa.forward(a)
        torch.cuda.synchronize()


def time_both(shape, backends, op):
    sets = [inputs(shape, seed, op) for seed in range(2)]
    res = {}
    for _ in range(2):
        for name, fn in backends:
            it = itertools.count()
            ms = triton.testing.do_bench(lambda: fn(*sets[next(it) % 2]), warmup=25, rep=60,
                                         return_mode="median")
            res[name] = min(res.get(name, ms), ms)
    return res


def features(shape):
    dt, D, HG, K, T, N, sink, half = shape
    return dict(dtype=dt, D=D, HG=HG, K=K, T=T)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--op", choices=("fwd", "bwd"), default="fwd")
    args = ap.parse_args()
    backends = FORWARD if args.op == "fwd" else BACKWARD
    os.makedirs(args.out, exist_ok=True)

    compile_all(TRAIN + HOLDOUT, backends, args.op)
    keep_busy()
    entries = []
    for shape in TRAIN:
        t = time_both(shape, backends, args.op)
        e = dict(features(shape), backend=min(t, key=t.get), cute_ms=round(t["cute"], 5),
                 triton_ms=round(t["triton"], 5))
        entries.append(e)
        print(f"train {shape}: cute {t['cute']:.4f} ms triton {t['triton']:.4f} ms -> {e['backend']}", flush=True)
    table = [placement.Entry(**e) for e in entries]

    rows, logs = [], []
    for shape in HOLDOUT:
        t = time_both(shape, backends, args.op)
        entry = placement.nearest(features(shape), table)
        pick = entry.backend if entry is not None else "triton"
        regret = t[pick] / min(t.values())
        logs.append(math.log(regret))
        rows.append(dict(shape=list(shape), cute_ms=round(t["cute"], 5), triton_ms=round(t["triton"], 5),
                         picked=pick, regret=round(regret, 4)))
        print(f"holdout {shape}: cute {t['cute']:.4f} ms triton {t['triton']:.4f} ms picked {pick} "
              f"regret {regret:.3f}", flush=True)
    geo = math.exp(sum(logs) / len(logs))
    print(f"holdout regret (geomean over {len(rows)} shapes): {geo:.4f}", flush=True)
    doc = dict(
        device=torch.cuda.get_device_name(), date=str(datetime.date.today()), commit=args.commit,
        timing="compile first, GPU kept busy 1 s, then per shape the lower of two do_bench medians "
               f"(warmup 25 ms, rep 60 ms) per backend; op {args.op}",
        features="exact dtype and D; nearest in log2 of HG, K, T",
        entries=entries, holdout=dict(regret_geomean=round(geo, 4), shapes=rows),
    )
    name = f"placement_{ARCH}" + ("_bwd" if args.op == "bwd" else "")
    path = os.path.join(args.out, f"{name}.json" if geo <= 1.02 else f"{name}.rejected.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
