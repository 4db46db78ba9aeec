"""Time the Triton sparse-attention kernels (and tiling variants) on a GPU.

    PYTHONPATH=$PWD python bench/tune_sparse_attention.py [--quick] [--out DIR]

Shapes of docs/semantics.md at full size, bf16, fresh random inputs.  FLOPs:
forward 2*T*H*K*(D + d_v), backward 2*T*H*K*(3*D + 2*d_v) (valid slots only
for the half-valid rows).  Prints one table row per (shape, pass, variant).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

from dsa._args import SparseAttnArgs
from dsa.triton import sparse_attention as sa

SHAPES = {  # name: T, N, H, D, d_v, K, sink
    "V3.2": (4096, 8192, 128, 576, 512, 2048, False),
    "V4-pro": (8192, 8192, 128, 512, 512, 1152, True),
    "V4-flash": (8192, 8192, 64, 512, 512, 640, True),
    "TP16": (4096, 8192, 16, 576, 512, 2048, True),
    "TP32": (4096, 8192, 32, 576, 512, 2048, True),
}

C = sa.TileConfig
FWD_VARIANTS = {
    "bh64-bn32-cw256-s2": C(64, 32, 256, 8, 2),
    "bh64-bn64-cw256-s2": C(64, 64, 256, 8, 2),
    "bh64-bn64-cw128-s1": C(64, 64, 128, 8, 1),
    "skew-bh64-bn32-cw128-s1": C(64, 32, 128, 8, 1, True),
    "no-prefetch": C(64, 64, 128, 8, 2, prefetch=False),
    # slots as the MMAs' rows (see sparse_attention_fwd): the TP-shard head counts
    "kar-bh16-bn64-cw128-w4-s2": C(16, 64, 128, 4, 2, keys_as_rows=True),
    "kar-bh16-bn128-cw64-w8-s1": C(16, 128, 64, 8, 1, keys_as_rows=True),
    "kar-bh32-bn64-cw128-w4-s2": C(32, 64, 128, 4, 2, keys_as_rows=True),
}
BWD_VARIANTS = {
    "bh64-bn32-cw128-s1": C(64, 32, 128, 8, 1),
    "bh64-bn32-cw128-s2": C(64, 32, 128, 8, 2),
    "bh64-bn16-cw128-s2": C(64, 16, 128, 8, 2),
    "bh64-bn64-cw128-s1": C(64, 64, 128, 8, 1),
    "bh16-bn32-cw128-w4-s1": C(16, 32, 128, 4, 1),
    "bh16-bn64-cw128-w8-s1": C(16, 64, 128, 8, 1),
    # slots as the MMAs' rows (see sparse_attention_bwd): the TP-shard head counts
    "kar-bh16-bn64-cw64-w4-s2": C(16, 64, 64, 4, 2, keys_as_rows=True),
    "kar-bh16-bn64-cw128-w4-s2": C(16, 64, 128, 4, 2, keys_as_rows=True),
    "kar-bh16-bn128-cw64-w8-s1": C(16, 128, 64, 8, 1, keys_as_rows=True),
    "kar-bh32-bn64-cw128-w8-s1": C(32, 64, 128, 8, 1, keys_as_rows=True),
    "kar-bh32-bn64-cw64-w4-s1": C(32, 64, 64, 4, 1, keys_as_rows=True),
}


def make(name, half=False, seed=0, deterministic=False):
    T, N, H, D, d_v, K, sink = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(N, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = torch.randint(0, N, (T, 1, K), device="cuda", dtype=torch.int32, generator=g)
    L = None
    if half:
        L = torch.randint(0, K + 1, (T,), device="cuda", dtype=torch.int32, generator=g)
    s = torch.randn(H, device="cuda", generator=g) if sink else None
    dout = torch.randn(T, H, d_v, device="cuda", dtype=torch.bfloat16, generator=g)
    a = SparseAttnArgs(q, kv, idx, L, s, D ** -0.5, d_v, deterministic)
    slots = T * H * (L.clamp(0, K).sum().item() / T if half else K)
    return a, dout, slots


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel(x, y):
    return ((x.float() - y.float()).norm() / y.float().norm()).item()


def reporter(rows):
    """report(shape, pass, variant, ms, flops, extra=""): prints one timing
    line with its TFLOP/s and appends it to ``rows``."""
    def report(shape, pas, variant, ms, flops, extra=""):
        tf = flops / ms / 1e9
        rows.append(dict(shape=shape, pass_=pas, variant=variant, ms=ms, tflops=tf, extra=extra))
        print(f"{shape:9s} {pas:5s} {variant:28s} {ms:9.3f} ms {tf:7.1f} TFLOP/s {extra}", flush=True)
    return report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="default configs only")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default="V3.2,V4-pro")
    ap.add_argument("--fwd", default="", help="comma list of FWD_VARIANTS names")
    ap.add_argument("--bwd", default="", help="comma list of BWD_VARIANTS names")
    ap.add_argument("--half", default="", help="comma list of FWD_VARIANTS names to time on half-valid rows too")
    ap.add_argument("--no-bwd", action="store_true", help="forward only")
    ap.add_argument("--no-det", action="store_true", help="skip the deterministic backward")
    args = ap.parse_args()
    rows = []

    report = reporter(rows)

    for shape in args.shapes.split(","):
        T, N, H, D, d_v, K, sink = SHAPES[shape]
        a, dout, slots = make(shape)
        f_fwd = 2 * slots * (D + d_v)
        f_bwd = 2 * slots * (3 * D + 2 * d_v)
        fv = {"default": None} if args.quick else {"default": None, **FWD_VARIANTS}
        if args.fwd:
            fv = {"default": None, **{k: FWD_VARIANTS[k] for k in args.fwd.split(",")}}
        ref_out = None
        for name, cfg in fv.items():
            try:
                t0 = time.time()
                out, lse = sa.forward(a, cfg)
                torch.cuda.synchronize()
                if ref_out is None:
                    ref_out, ref_lse = out, lse
                err = f"d_out {rel(out, ref_out):.1e} first {time.time() - t0:.1f}s"
                report(shape, "fwd", name, bench(lambda: sa.forward(a, cfg)), f_fwd, err)
            except Exception as e:  # keep timing the others
                print(shape, "fwd", name, "FAILED", type(e).__name__, str(e)[:300], flush=True)
        out, lse = ref_out, ref_lse
        bv = {"default": None} if args.quick else {"default": None, **BWD_VARIANTS}
        if args.no_bwd:
            bv = {}
        if args.bwd:
            bv = {"default": None, **{k: BWD_VARIANTS[k] for k in args.bwd.split(",")}}
        ref_g = grads = None
        for name, cfg in bv.items():
            try:
                t0 = time.time()
                grads = sa.backward(a, out, lse, dout, cfg)
                torch.cuda.synchronize()
                if ref_g is None:
                    ref_g = grads
                err = (f"d_dq {rel(grads[0], ref_g[0]):.1e} d_dkv {rel(grads[1], ref_g[1]):.1e} "
                       f"first {time.time() - t0:.1f}s")
                report(shape, "bwd", name, bench(lambda: sa.backward(a, out, lse, dout, cfg)), f_bwd, err)
            except Exception as e:
                print(shape, "bwd", name, "FAILED", type(e).__name__, str(e)[:300], flush=True)
        del grads, ref_g
        # half-valid rows (topk_length uniform in [0, K]): time relative to full rows
        full_f = next(r["ms"] for r in rows if r["shape"] == shape and r["pass_"] == "fwd")
        ah, douth, slots_h = make(shape, half=True, seed=1)
        outh, lseh = sa.forward(ah)
        ms = bench(lambda: sa.forward(ah))
        report(shape, "fwd", "default half-valid", ms, 2 * slots_h * (D + d_v), f"ratio {ms / full_f:.3f}")
        for name in filter(None, args.half.split(",")):
            cfg = FWD_VARIANTS[name]
            o, _ = sa.forward(ah, cfg)
            err = f"d_out {rel(o, outh):.1e}"
            o, _ = sa.forward(a, cfg)
            ms_full = bench(lambda: sa.forward(a, cfg))
            report(shape, "fwd", name, ms_full, f_fwd, f"d_out {rel(o, ref_out):.1e}")
            ms = bench(lambda: sa.forward(ah, cfg))
            report(shape, "fwd", name + " half-valid", ms, 2 * slots_h * (D + d_v),
                   f"ratio {ms / full_f:.3f} (own full {ms / ms_full:.3f}) {err}")
        if args.no_bwd:
            continue
        full_b = next(r["ms"] for r in rows if r["shape"] == shape and r["pass_"] == "bwd")
        ms = bench(lambda: sa.backward(ah, outh, lseh, douth))
        report(shape, "bwd", "default half-valid", ms, 2 * slots_h * (3 * D + 2 * d_v), f"ratio {ms / full_b:.3f}")
        del ah, douth, outh, lseh
        if args.no_det:
            continue
        # deterministic backward
        ad = SparseAttnArgs(**{**a.__dict__, "deterministic": True})
        g1 = sa.backward(ad, out, lse, dout)
        g2 = sa.backward(ad, out, lse, dout)
        same = all(torch.equal(x, y) for x, y in zip(g1, g2) if x is not None)
        ms = bench(lambda: sa.backward(ad, out, lse, dout))
        g0 = sa.backward(a, out, lse, dout)
        report(shape, "bwd", "deterministic", ms, f_bwd,
               f"bitwise {same} d_dkv {rel(g1[1], g0[1]):.1e} d_dq {rel(g1[0], g0[0]):.1e}")
        del a, dout, out, lse, g1, g2, g0, ad
        torch.cuda.empty_cache()

    with open(os.path.join(args.out, "tune_sparse_attention.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\nshape     pass  variant                      time        rate")
    for r in rows:
        print(f"{r['shape']:9s} {r['pass_']:5s} {r['variant']:28s} {r['ms']:8.3f} ms "
              f"{r['tflops']:6.1f} TFLOP/s {r['extra']}")


if __name__ == "__main__":
    sys.exit(main())
