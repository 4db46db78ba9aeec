"""Time the kernel that uses dsa.triton.ptx with its PTX on and off (CUDA).

    PYTHONPATH=$PWD python bench/ab_ptx.py

Off means the plain tl.store, which Triton gives a layout of its own. The
two results are compared first (indices and lengths equal). Timing:
triton.testing.do_bench, median, warmup 25 ms, rep 100 ms, fresh
torch.randn fp32 rows, 4096 x {4096, 16384}, k = 2048.
"""

from __future__ import annotations

import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dsa.triton import ptx  # noqa: E402

ON = ptx.enabled


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    from dsa.triton import topk as tk

    for S in (4096, 16384):
        x = torch.randn(4096, S, device="cuda")
        i = torch.empty(4096, 2048, dtype=torch.int32, device="cuda")
        n = torch.empty(4096, dtype=torch.int32, device="cuda")
        run = lambda: tk.launch(x, 2048, i, n)  # noqa: E731
        res, ms = {}, {}
        for mode in ("on", "off", "on", "off"):  # results, then times
            ptx.enabled = ON if mode == "on" else (lambda t: False)
            if mode not in res:
                run()
                res[mode] = (i.clone(), n.clone())
            else:
                ms[mode] = bench(run)
        ptx.enabled = ON
        same = all(torch.equal(a, b) for a, b in zip(res["on"], res["off"]))
        print(f"topk 4096x{S} k=2048: ptx on {ms['on']:.4f} ms, off {ms['off']:.4f} ms, same results {same}",
              flush=True)


if __name__ == "__main__":
    main()
