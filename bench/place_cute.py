"""Measure where the cute kernel beats Triton, and write the placement table.

    PYTHONPATH=$PWD python bench/place_cute.py --out DIR [--commit SHA] [--op bwd]

``--op fwd`` (the default) times the forward and writes
``placement_{arch}.json``; ``--op bwd`` times the backward (the same grids,
each call fed the Triton forward's out and lse and a random dO) and writes
``placement_{arch}_bwd.json``.  Copy the file to ``dsa/cute/``.

1. Training grid (``TRAIN``, 120 shapes, and ``TRAIN_PADDED``, 120 more):
   every shape is timed on both backends; each becomes one table entry
   naming the faster one.
2. Holdout grid (``HOLDOUT``): a fixed list written down before any timing
   (shapes off the training grid: other K, T, N, sink and topk_length), timed
   the same way.  The table picks a backend for each holdout shape by its
   nearest entry (``dsa.cute.placement.nearest``); the regret of a shape is
   time(picked) / min(time(cute), time(triton)), and its geometric mean over
   the holdout must be <= 1.02 for the table to be written
   (``DIR/placement_sm90.json``, or ``placement_sm100.json`` on an SM100 GPU,
   where the SM100 kernel is timed; copy it to ``dsa/cute/``).

``--dtype`` measures the shapes of one dtype only and writes their raw
timings (``*.part-{dtype}.json``); ``--merge PART...`` builds the table and
its holdout regret from such parts, with no GPU.  A call decides by entries of
its own dtype only, so the parts are independent and merging them gives the
table one process would.  Two parts can run at once on one GPU: each compiles
its kernels (CPU work), then times while holding ``--lock`` (one timer at a
time), which halves the compile wall time of a study.

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
import fcntl
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
# Both kernels also serve 16 and 32 query heads per kv head (tensor-parallel
# shards) as one tile padded to 64 rows: a tile class of its own in the table
# (dsa.cute.placement.FULL_TILE_HEADS), on the same grid.
TRAIN_PADDED = [
    (dt, D, HG, K, T, 8192, False, False)
    for dt, D, HG, K, T in itertools.product(
        ("bfloat16", "float16"), (512, 576), (16, 32), (128, 512, 2048), (16, 128, 256, 1024, 8192))
]

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


def measure(args, backends):
    """Time the training and holdout shapes of args.dtype (all when None):
    (train rows, holdout rows), each a shape with its cute and triton ms."""
    train = [s for s in TRAIN + TRAIN_PADDED if args.dtype in (None, s[0])]
    holdout = [s for s in HOLDOUT if args.dtype in (None, s[0])]
    compile_all(train + holdout, backends, args.op)
    lock = open(args.lock, "w") if args.lock else None
    if lock is not None:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until exit: one part times at a time
    keep_busy()
    out = []
    for kind, shapes in (("train", train), ("holdout", holdout)):
        rows = []
        for shape in shapes:
            t = time_both(shape, backends, args.op)
            rows.append(dict(shape=list(shape), cute_ms=round(t["cute"], 5), triton_ms=round(t["triton"], 5)))
            print(f"{kind} {shape}: cute {t['cute']:.4f} ms triton {t['triton']:.4f} ms", flush=True)
        out.append(rows)
    return out


def build(train_rows, holdout_rows, device, commit, op):
    """The table document (entries and holdout regret) from timed rows."""
    entries = []
    for r in train_rows:
        t = dict(cute=r["cute_ms"], triton=r["triton_ms"])
        entries.append(dict(features(tuple(r["shape"])), backend=min(t, key=t.get), cute_ms=r["cute_ms"],
                            triton_ms=r["triton_ms"]))
    table = [placement.Entry(**e) for e in entries]
    rows, logs = [], []
    for r in holdout_rows:
        t = dict(cute=r["cute_ms"], triton=r["triton_ms"])
        entry = placement.nearest(features(tuple(r["shape"])), table)
        pick = entry.backend if entry is not None else "triton"
        regret = t[pick] / min(t.values())
        logs.append(math.log(regret))
        rows.append(dict(r, picked=pick, regret=round(regret, 4)))
        print(f"holdout {tuple(r['shape'])}: picked {pick} regret {regret:.3f}", flush=True)
    geo = math.exp(sum(logs) / len(logs))
    print(f"holdout regret (geomean over {len(rows)} shapes): {geo:.4f}", flush=True)
    return dict(
        device=device, date=str(datetime.date.today()), commit=commit,
        timing="compile first, GPU kept busy 1 s, then per shape the lower of two do_bench medians "
               f"(warmup 25 ms, rep 60 ms) per backend; op {op}",
        features="exact dtype, D and tile class (HG < 64: one padded tile); nearest in log2 of HG, K, T",
        entries=entries, holdout=dict(regret_geomean=round(geo, 4), shapes=rows),
    ), geo


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--op", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), help="measure one dtype's shapes: a part")
    ap.add_argument("--lock", help="a file locked while timing, shared by parts run at once")
    ap.add_argument("--merge", nargs="+", metavar="PART", help="build the table from parts (no GPU)")
    ap.add_argument("--arch", default=ARCH, help="with --merge: the table's architecture")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    name = f"placement_{args.arch}" + ("_bwd" if args.op == "bwd" else "")

    if args.merge:
        parts = [json.load(open(p)) for p in args.merge]
        if len({(p["device"], p["op"]) for p in parts}) != 1 or parts[0]["op"] != args.op:
            raise SystemExit("parts of different devices or ops")
        train = [r for p in parts for r in p["train"]]
        holdout = [r for p in parts for r in p["holdout"]]
        device, commit = parts[0]["device"], args.commit or parts[0]["commit"]
    else:
        backends = FORWARD if args.op == "fwd" else BACKWARD
        train, holdout = measure(args, backends)
        device = torch.cuda.get_device_name()
        if args.dtype:
            path = os.path.join(args.out, f"{name}.part-{args.dtype}.json")
            with open(path, "w") as f:
                json.dump(dict(device=device, op=args.op, commit=args.commit, train=train, holdout=holdout), f,
                          indent=1)
            print(f"wrote {path}")
            return
        commit = args.commit
    doc, geo = build(train, holdout, device, commit, args.op)
    path = os.path.join(args.out, f"{name}.json" if geo <= 1.02 else f"{name}.rejected.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
