"""The sparse-attention backward at the TP-shard head counts (16 and 32 query
heads a kv head): the heads-as-rows tiles against the keys-as-rows ones
(``TileConfig.keys_as_rows``, see dsa/triton/sparse_attention_bwd.py), in one
process on the same inputs.

    PYTHONPATH=$PWD python bench/bwd_tp_shards.py [--shapes TP16,TP32] [--no-det]

Shapes (bench/tune_sparse_attention.SHAPES): TP16 = T 4096, N 8192, H 16 (one
kv head), D 576, d_v 512, K 2048, sink on, bf16; TP32 the same with H 32.
FLOPs: backward 2*T*H*K*(3*D + 2*d_v), forward 2*T*H*K*(D + d_v).  For each
shape: the forward's default (timed, its out and lse feed every backward) and
its keys-as-rows variants (out and lse as rel L2 against the default);
the backward's default pick and each keys-as-rows variant, timed with
``triton.testing.do_bench`` medians, with dq, dkv and dsink as rel L2 against
the default pick; then the deterministic backward of the first keys-as-rows
variant (bitwise over two runs, rel L2 against the default).  Writes
bwd_tp_shards.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from bench.tune_sparse_attention import BWD_VARIANTS, FWD_VARIANTS, SHAPES, bench, make, rel, reporter
from dsa._args import SparseAttnArgs
from dsa.triton import sparse_attention as sa

VARIANTS = {  # shape: BWD_VARIANTS names, the first also timed deterministic
    "TP16": ["kar-bh16-bn64-cw64-w4-s2", "kar-bh16-bn64-cw128-w4-s2", "kar-bh16-bn128-cw64-w8-s1"],
    "TP32": ["kar-bh32-bn64-cw128-w8-s1", "kar-bh32-bn64-cw64-w4-s1"],
}
FWD = {  # shape: FWD_VARIANTS names
    "TP16": ["kar-bh16-bn64-cw128-w4-s2", "kar-bh16-bn128-cw64-w8-s1"],
    "TP32": ["kar-bh32-bn64-cw128-w4-s2"],
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="TP16,TP32")
    ap.add_argument("--no-det", action="store_true", help="skip the deterministic backward")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rows = []

    report = reporter(rows)

    print(torch.cuda.get_device_name(), flush=True)
    for shape in args.shapes.split(","):
        T, N, H, D, d_v, K, _ = SHAPES[shape]
        a, dout, slots = make(shape)
        f_fwd, f_bwd = 2 * slots * (D + d_v), 2 * slots * (3 * D + 2 * d_v)
        out, lse = sa.forward(a)
        report(shape, "fwd", f"default {sa.fwd_config(a)}", bench(lambda: sa.forward(a)), f_fwd)
        for name in FWD[shape]:
            cfg = FWD_VARIANTS[name]
            try:
                o, l = sa.forward(a, cfg)
                fin = torch.isfinite(lse)
                err = f"out {rel(o, out):.1e} lse {rel(l[fin], lse[fin]):.1e}"
                del o, l
                report(shape, "fwd", name, bench(lambda: sa.forward(a, cfg)), f_fwd, err)
            except Exception as e:
                print(shape, "fwd", name, "FAILED", type(e).__name__, str(e)[:300], flush=True)
        ref = sa.backward(a, out, lse, dout)
        report(shape, "bwd", f"default {sa.bwd_config(a)} kar={sa.bwd_config(a).keys_as_rows}",
               bench(lambda: sa.backward(a, out, lse, dout)), f_bwd)
        for name in VARIANTS[shape]:
            cfg = BWD_VARIANTS[name]
            try:
                t0 = time.time()
                got = sa.backward(a, out, lse, dout, cfg)
                torch.cuda.synchronize()
                err = (f"dq {rel(got[0], ref[0]):.1e} dkv {rel(got[1], ref[1]):.1e} "
                       f"dsink {rel(got[2], ref[2]):.1e} first {time.time() - t0:.1f}s")
                del got
                report(shape, "bwd", name, bench(lambda: sa.backward(a, out, lse, dout, cfg)), f_bwd, err)
            except Exception as e:  # keep timing the others
                print(shape, "bwd", name, "FAILED", type(e).__name__, str(e)[:300], flush=True)
        if not args.no_det:
            name = VARIANTS[shape][0]
            cfg = BWD_VARIANTS[name]
            ad = SparseAttnArgs(**{**a.__dict__, "deterministic": True})
            try:
                g1 = sa.backward(ad, out, lse, dout, cfg)
                g2 = sa.backward(ad, out, lse, dout, cfg)
                same = all(torch.equal(x, y) for x, y in zip(g1, g2))
                err = f"bitwise {same} dq {rel(g1[0], ref[0]):.1e} dkv {rel(g1[1], ref[1]):.1e}"
                del g1, g2
                report(shape, "bwd", name + " deterministic", bench(lambda: sa.backward(ad, out, lse, dout, cfg)),
                       f_bwd, err)
                report(shape, "bwd", "default deterministic", bench(lambda: sa.backward(ad, out, lse, dout)), f_bwd)
            except Exception as e:
                print(shape, "bwd", name, "deterministic FAILED", type(e).__name__, str(e)[:300], flush=True)
        del a, dout, out, lse, ref
        torch.cuda.empty_cache()

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bwd_tp_shards.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
