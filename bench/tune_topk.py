"""Check and time the resident top-k kernel's variants on one device call.

    PYTHONPATH=$PWD python bench/tune_topk.py

Every variant is compared with the reference on random, tied, NaN/+-inf and
16-bit rows (exact equality of indices and lengths), then timed with
triton.testing.do_bench (median) on fresh random fp32 rows, k = 2048.
On CPU (TRITON_INTERPRET=1) it runs the checks only, on small rows.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa import reference  # noqa: E402
from dsa._args import TopkArgs  # noqa: E402
from dsa.triton import topk as tk  # noqa: E402


def rows(R, S, dev, g):
    yield torch.randn(R, S, device=dev, generator=g)
    yield torch.randint(-5, 5, (R, S), device=dev, generator=g).float()  # heavy ties
    x = torch.randn(R, S, device=dev, generator=g)
    x[:, ::7], x[:, ::5], x[:, ::11] = float("nan"), float("-inf"), float("inf")
    yield x
    yield torch.randn(R, S, device=dev, generator=g).half()
    if dev == "cuda":  # the interpreter computes bf16 wrongly
        yield torch.randn(R, S, device=dev, generator=g).bfloat16()


def run(x, k, cfg):
    R = x.shape[0]
    i = torch.empty(R, k, dtype=torch.int32, device=x.device)
    n = torch.empty(R, dtype=torch.int32, device=x.device)
    tk.launch(x, k, i, n, config=cfg)
    return i, n


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    sizes = [(64, 4096), (64, 16384), (32, 1000)] if dev == "cuda" else [(3, 50), (4, 300)]
    bad = 0
    for R, S in sizes:
        warps = tk._resident_config(max(16, 1 << (S - 1).bit_length())).num_warps
        for k in (1, 17, S // 2, S + 3):
            for x in rows(R, S, dev, g):
                ref = reference.topk(TopkArgs(x, k))
                for early in (False, True):
                    got = run(x, k, tk.ResidentConfig(warps, early))
                    if not (torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])):
                        bad += 1
                        print(f"MISMATCH R={R} S={S} k={k} {x.dtype} early_exit={early}")
    print(f"checks: {bad} mismatches")
    if dev != "cuda":
        return
    import triton

    for S, warps in ((4096, (4, 8)), (16384, (8, 16))):
        x = torch.randn(4096, S, device=dev, generator=g)
        for early in (False, True):
            for w in warps:
                cfg = tk.ResidentConfig(w, early)
                ms = triton.testing.do_bench(lambda: run(x, 2048, cfg), warmup=25, rep=100, return_mode="median")
                print(f"topk 4096x{S} k=2048 early_exit={early} warps={w}: {ms:.4f} ms")


if __name__ == "__main__":
    main()
