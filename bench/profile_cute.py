"""Where the CuTe DSL SM90 sparse-attention forward spends its cycles, and the
SM clock it runs at.

    PYTHONPATH=$PWD python bench/profile_cute.py [--shapes V3.2,...]

For each shape (the inputs of bench/tune_cute.py): the profiling build of the
kernel (``SparseAttnFwdSm90(profile=True)``: clock64 counters around every
wait) runs once on the persistent grid; each role's counters are averaged
over the CTAs and that role's warps and printed as fractions of the tile
loop. Its out must equal the plain build's. Then the plain build is timed
(do_bench median) while ``nvidia-smi`` samples the SM clock and power, and
the same for a bf16 8192^3 ``torch.matmul`` (the ceiling's workload), so the
two rates can be compared cycle for cycle.

``--no-refill`` also counts and times the timing build whose producer gathers
each stage once and afterwards only signals it (``refill=False``): the same
pipeline, barriers and masks with no gather round trip to wait for, so its
rate bounds what a faster gather could give.
"""

from __future__ import annotations

import argparse
import subprocess
import time

import torch
import triton

from bench.tune_cute import SHAPES, make
from dsa.cute import sparse_attention as cute_sa
from dsa.cute import sparse_attention_sm90 as k

CONSUMER = {"stage-full waits": k.PROF_FULL, "hand-off and row-sum barriers": k.PROF_BAR,
            "wgmma waits": k.PROF_WGMMA, "Q wait": k.PROF_Q, "epilogue": k.PROF_EPI}
PRODUCER = {"stage-empty waits": k.PROF_EMPTY, "kv-row lookups": k.PROF_LOOKUP,
            "copy issue": k.PROF_ISSUE, "Q-empty wait": k.PROF_Q}


def counters(a, refill: bool = True) -> torch.Tensor:
    n = torch.cuda.get_device_properties(0).multi_processor_count
    prof = torch.zeros(n, k.THREADS // 32, k.PROF_N, dtype=torch.int64, device="cuda")
    out, _ = cute_sa.forward(a, profile=prof, refill=refill)
    if refill:
        ref, _ = cute_sa.forward(a)
        torch.cuda.synchronize()
        d = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        print(f"  profiling build: out {'equal to' if torch.equal(out, ref) else f'{d:.1e} rel L2 from'} "
              "the plain build's")
    prof.zero_()
    cute_sa.forward(a, profile=prof, refill=refill)  # compiled and warm: the counted launch
    torch.cuda.synchronize()
    return prof.double()


def report(prof: torch.Tensor) -> None:
    for role, warps, cats in (("consumer 0", slice(4, 8), CONSUMER), ("consumer 1", slice(8, 12), CONSUMER),
                              ("producer", slice(0, 4), PRODUCER)):
        p = prof[:, warps].mean((0, 1))
        total = p[k.PROF_TOTAL].item()
        parts = ", ".join(f"{name} {p[c].item() / total:.3f}" for name, c in cats.items())
        print(f"  {role:10s} loop {total / 1e6:7.3f} Mcycles: {parts}", flush=True)


def sampled(fn, seconds: float = 3.0):
    """(do_bench median ms, median SM MHz, median W) with fn running back to back."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=subprocess.PIPE, text=True)
    t0 = time.time()
    while time.time() - t0 < seconds:
        fn()
        torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    smi.terminate()
    rows = [r.split(",") for r in smi.communicate()[0].strip().splitlines() if r.count(",") == 1]
    mhz = sorted(float(r[0]) for r in rows)
    watts = sorted(float(r[1]) for r in rows)
    return ms, mhz[len(mhz) // 2], watts[len(watts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="V3.2")
    ap.add_argument("--no-refill", action="store_true", help="also the build that gathers each stage once")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms, mhz, w = sampled(lambda: x @ y)
    print(f"matmul 8192^3 bf16: {ms:.3f} ms, {2 * 8192**3 / ms / 1e9:.1f} TFLOP/s at {mhz:.0f} MHz, {w:.0f} W",
          flush=True)
    del x, y
    for name in args.shapes.split(","):
        a, flops = make(name)
        print(f"{name}:", flush=True)
        report(counters(a))
        ms, mhz, w = sampled(lambda: cute_sa.forward(a))
        print(f"  plain build: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s at {mhz:.0f} MHz, {w:.0f} W",
              flush=True)
        if args.no_refill:
            print("  no-refill build (each stage gathered once):", flush=True)
            report(counters(a, refill=False))
            ms, mhz, w = sampled(lambda: cute_sa.forward(a, refill=False))
            print(f"  no-refill build: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s at {mhz:.0f} MHz, {w:.0f} W",
                  flush=True)
        del a
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
