"""Check and time the resident top-k kernel's threshold searches in one device call.

    PYTHONPATH=$PWD python bench/tune_topk.py

Every variant (ResidentConfig.search and its options) is compared with the
reference (exact equality of indices and lengths) on random, tied, NaN/+-inf,
short (causal-like) and extreme-valued fp32 rows of 4096, 16384 and 1000 keys
and on fp16 / bf16 rows (random and tied) of 1000 keys, k in {1, 17, S/2,
2048, S+3}; then every timed config is checked on its own inputs and timed
with triton.testing.do_bench (median, warmup 25 ms, rep 100 ms) on fresh
torch.randn fp32 rows and on tied rows, 4096 rows, k = 2048.
On CPU (TRITON_INTERPRET=1) it runs the checks only, on small rows.
"""

from __future__ import annotations

import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa import reference  # noqa: E402
from dsa._args import TopkArgs  # noqa: E402
from dsa.triton import topk as tk  # noqa: E402

RC = tk.ResidentConfig
# name -> ResidentConfig fields besides num_warps
VARIANTS = {
    "bisect": {},
    "bisect_s": {"vec_load": False},
    "radix2": {"search": "radix", "radix_bits": 2},
    "radix3": {"search": "radix", "radix_bits": 3},
    "radix4": {"search": "radix", "radix_bits": 4},
    "interp": {"search": "interp"},
    "interp_s": {"search": "interp", "vec_load": False},
    "guess": {"search": "guess"},
}
# (row length, variant, num_warps, maxnreg): the timed configs, the default
# first for each length. maxnreg 128 at 4096 keys: 4 programs an SM instead
# of 3, no spills; at 16384 keys (ptxas, sm_90a, with the one-flag emit):
# 8 warps 255 registers unless capped (128: 2 programs an SM, 140 B spilled),
# 16 warps 120 (80: no spills; 64: 2 programs an SM, 72 B spilled), 32 warps
# 64 and no spills.
TIMED = [
    (4096, "interp", 4, 128),
    (4096, "interp", 4, None), (4096, "bisect", 4, 128), (4096, "interp", 8, None),
    (16384, "interp", 8, 128), (16384, "interp", 16, None), (16384, "interp", 16, 80), (16384, "interp", 16, 64),
    (16384, "interp", 32, None), (16384, "interp", 8, None),
    (16384, "guess", 16, None), (16384, "bisect", 16, None), (16384, "radix2", 16, None),
]


def config(name, num_warps, **kw):
    return RC(num_warps, **VARIANTS[name], **kw)


def rows(R, S, dev, g, half):
    """(name, scores) test rows; ``half``: add the fp16 / bf16 kinds."""
    yield "randn", torch.randn(R, S, device=dev, generator=g)
    yield "ties", torch.randint(-5, 5, (R, S), device=dev, generator=g).float()
    x = torch.randn(R, S, device=dev, generator=g)
    x[:, ::7], x[:, ::5], x[:, ::11] = float("nan"), float("-inf"), float("inf")
    yield "nan_inf", x
    x = torch.randint(-50, 50, (R, S), device=dev, generator=g).float()
    x[: R // 2, S // 3:] = float("-inf")  # short rows: fewer than k selectable
    x[:, ::97] = float("nan")
    yield "short", x
    x = torch.randn(R, S, device=dev, generator=g)
    x[0::4, ::3] = torch.finfo(torch.float32).max  # the sums of the first guess overflow
    x[1::4, S // 2] = 1e30  # a lone outlier
    x[2::4] *= torch.finfo(torch.float32).tiny  # denormals
    x[3::4] = x[3::4].exp() * 1e-3  # skewed
    yield "extreme", x
    if half:
        yield "fp16", torch.randn(R, S, device=dev, generator=g).half()
        yield "fp16_ties", torch.randint(-8, 8, (R, S), device=dev, generator=g).half()
        if dev == "cuda":  # the interpreter computes bf16 wrongly
            yield "bf16", torch.randn(R, S, device=dev, generator=g).bfloat16()
            yield "bf16_ties", (torch.randint(-8, 8, (R, S), device=dev, generator=g) * 0.125).bfloat16()


def run(x, k, cfg, out=None):
    R = x.shape[0]
    i, n = out if out is not None else (torch.empty(R, k, dtype=torch.int32, device=x.device),
                                        torch.empty(R, dtype=torch.int32, device=x.device))
    tk.launch(x, k, i, n, config=cfg)
    return i, n


def same(got, ref):
    return torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def check_all(dev, g):
    if dev == "cuda":  # 16-bit rows at one length: every (variant, length, dtype) is a compile
        sizes = [(64, 4096, False), (64, 16384, False), (48, 1000, True)]
    else:
        sizes = [(3, 40, True), (2, 100, False)]
    bad = {name: 0 for name in VARIANTS}
    n_cases = 0
    for R, S, half in sizes:
        warps = tk._resident_config(max(16, 1 << (S - 1).bit_length())).num_warps
        ks = sorted({1, 17, S // 2, S + 3} | ({2048} if S >= 4096 else set()))
        if dev != "cuda":
            ks = [1, S // 2, S + 3]
        for kind, x in rows(R, S, dev, g, half):
            for k in ks:
                ref = reference.topk(TopkArgs(x, k))
                n_cases += 1
                for name in VARIANTS:
                    if not same(run(x, k, config(name, warps)), ref):
                        bad[name] += 1
                        print(f"MISMATCH {name} warps={warps} R={R} S={S} k={k} {kind} {x.dtype}")
    for name, n in bad.items():
        print(f"checks {name}: {n} mismatches of {n_cases}")
    print(f"checks: {sum(bad.values())} mismatches in total")


def time_all(dev, g):
    import triton

    base = {}
    for S in sorted({t[0] for t in TIMED}):
        x = torch.randn(4096, S, device=dev, generator=g)
        xt = torch.randint(-100, 100, (4096, S), device=dev, generator=g).float()  # ties at the cut
        k = 2048
        ref, ref_t = reference.topk(TopkArgs(x, k)), reference.topk(TopkArgs(xt, k))
        out = (torch.empty(4096, k, dtype=torch.int32, device=dev), torch.empty(4096, dtype=torch.int32, device=dev))
        for S_, name, w, maxnreg in TIMED:
            if S_ != S:
                continue
            cfg = config(name, w, maxnreg=maxnreg)
            ok = same(run(x, k, cfg), ref) and same(run(xt, k, cfg), ref_t)
            ms = triton.testing.do_bench(lambda: run(x, k, cfg, out), warmup=25, rep=100, return_mode="median")
            ms_t = triton.testing.do_bench(lambda: run(xt, k, cfg, out), warmup=25, rep=100, return_mode="median")
            base.setdefault(S, ms)  # the first line of a shape is the current default
            print(f"topk 4096x{S} k={k} {name:8s} warps={w:2d} maxnreg={str(maxnreg):4s}: {ms:.4f} ms "
                  f"(x{base[S] / ms:.2f} vs default; ties rows {ms_t:.4f} ms) ok={ok}", flush=True)
        ms = triton.testing.do_bench(lambda: torch.topk(x, k, dim=1), warmup=25, rep=100, return_mode="median")
        print(f"topk 4096x{S} k={k} torch.topk: {ms:.4f} ms", flush=True)


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    t0 = time.time()
    check_all(dev, g)
    print(f"checks took {time.time() - t0:.1f} s", flush=True)
    if dev == "cuda":
        t0 = time.time()
        time_all(dev, g)
        print(f"timing took {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
