"""Builds of the cute top-k (dsa.cute.topk) against each other, Triton and cuDNN, in one process.

    PYTHONPATH=$PWD python bench/tune_cute_topk.py [--shapes 0,1] [--ks 2048,1024]
        [--builds '{"threads": 256};{"threads": 512, "min_blocks": 2}'] [--probes]
    compute-sanitizer --tool memcheck python3 bench/tune_cute_topk.py --sanitize

fp32 scores from torch.randn, rows x columns of ``SHAPES`` (causal: row i
keeps its first i + 1 scores, given as row ends). Each build is
``dsa.cute.topk.config(...)`` with the JSON fields given (none: the
shipped build of the row length; ``"stream": true`` / ``false`` picks the
streaming or the resident kernel, whose builds take only rows their
``s_max`` holds); ``--probes`` adds the shipped build's
timing builds (``probe`` 1 / 2 / 3: stopped after the load, after the first
count, before the emit), whose outputs are not checked. Every other build
is checked against the contract on a spread of rows first. Times:
triton.testing.do_bench medians (warmup 25, rep 100), ms; Triton's
``topk`` and cuDNN's ``indexer_top_k_wrapper`` (when importable) on the
same scores.

``--sanitize``: no timing; hostile rows (few distinct values, NaN, +-inf,
rows with nothing selectable) with row ends before, inside and past the
row, through the shipped resident and streaming builds (fp32, bf16, fp16,
k not a multiple of 4, rows whose sampled columns are far above the rest),
for compute-sanitizer to watch every access.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.topk_peers import causal_lengths, check_rows, cudnn_wrappers, make_scores  # noqa: E402

SHAPES = [(4096, 4096, False), (4096, 8192, False), (4096, 16384, False), (8192, 32768, False),
          (32768, 32768, True), (65536, 65536, True)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    ap.add_argument("--shapes", type=ints, default=None, help="indices into SHAPES (default all)")
    ap.add_argument("--ks", type=ints, default=[2048, 1024])
    ap.add_argument("--builds", default="{}", help="';'-separated JSON objects of config fields")
    ap.add_argument("--probes", action="store_true", help="also the shipped build's timing builds")
    ap.add_argument("--sanitize", action="store_true", help="hostile rows through the shipped builds, untimed")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_cute_topk: needs an SM90 GPU")
        return 2
    if args.sanitize:
        return sanitize()
    import triton

    from dsa._args import TopkArgs
    from dsa.cute import topk as ct
    from dsa.triton import topk as tt

    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    builds = [json.loads(b) for b in args.builds.split(";")]
    if args.probes:
        builds += [{"probe": p} for p in (1, 2, 3)]
    cd = cudnn_wrappers()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for i, (R, S, causal) in enumerate(SHAPES):
        if args.shapes is not None and i not in args.shapes:
            continue
        x = make_scores(R, S, causal, gen, "cuda")
        seq = causal_lengths(R, S, 1, x.device) if causal else torch.full((R,), S, dtype=torch.int32,
                                                                            device=x.device)
        ends = seq if causal else None
        for k in args.ks:
            row = {}
            idx = torch.empty((R, k), dtype=torch.int32, device="cuda")
            lens = torch.empty(R, dtype=torch.int32, device="cuda")
            for kw in builds:
                name = "cute" + "".join(f"_{a}{b}" for a, b in kw.items())
                stream = kw.get("stream", ct.streams(S))
                if stream and "probe" in kw:
                    continue  # timing builds are the resident kernel's
                if not stream and ct.bucket(S) is None and kw.get("s_max", 0) < S:
                    continue  # resident builds: only those given an s_max that holds the rows
                cfg = ct.config(x.dtype, S if stream else min(S, ct.BUCKETS[-1][0]), k, ends is not None, **kw)
                idx.fill_(-7)
                ct.launch(x, k, idx, lens, ends, cfg)
                ok = None if kw.get("probe") else check_rows(x, k, idx, lens)
                row[name] = (round(bench(lambda: ct.launch(x, k, idx, lens, ends, cfg)), 4), ok)
            a = TopkArgs(x, k, ends)
            row["triton"] = round(bench(lambda: tt.topk(a)), 4)
            if cd is not None:
                row["cudnn"] = round(bench(lambda: cd["topk"](x, seq, k, next_n=1, return_val=False)), 4)
            print(f"{R}x{S}{' causal' if causal else ''} k {k}: {json.dumps(row)}", flush=True)
        x = None  # the next shape's scores replace these
        torch.cuda.empty_cache()
    return 0


def sanitize() -> int:
    """Hostile rows through the shipped builds (see the module doc)."""
    from dsa.cute import topk as ct

    gen = torch.Generator(device="cuda").manual_seed(3)
    R = 64
    calls = 0
    for S, k, dtype in ((4096, 2048, torch.float32), (8192, 1001, torch.bfloat16), (40000, 2048, torch.float32),
                        (65544, 4096, torch.float16), (131072, 7, torch.float32)):
        x = torch.randint(-3, 4, (R, S), device="cuda", generator=gen).float()
        x[::3, ::7] = float("nan")
        x[1::3, ::5] = float("-inf")
        x[2::3, ::11] = float("inf")
        x[0] = float("-inf")
        x[1] = float("nan")
        if ct.streams(S):  # the sampled columns far above the rest: the row read again
            cols = torch.arange(256, device="cuda") * ((S // 4) // 256) * 4
            x[3, cols] = 1e30
        x = x.to(dtype)
        ends = torch.randint(-5, S + 50, (R,), device="cuda", dtype=torch.int32, generator=gen)
        idx = torch.empty((R, k), dtype=torch.int32, device="cuda")
        lens = torch.empty(R, dtype=torch.int32, device="cuda")
        for e in (None, ends):
            ct.launch(x, k, idx, lens, e)
            calls += 1
    torch.cuda.synchronize()
    print(f"sanitize: {calls} launches of the shipped cute top-k builds done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
