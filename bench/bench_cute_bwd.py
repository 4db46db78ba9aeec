"""The CuTe SM90 sparse attention backward against the Triton backward.

    python bench/bench_cute_bwd.py [--shapes v32,v4pro,v4flash,h64d576,v32half,v32det]

One process, the same inputs for both (fresh ``torch.randn``, bf16, sink on,
random indices), ``triton.testing.do_bench`` medians (warmup 25 ms, rep
100 ms); TFLOP/s = 2 T H K (3 D + 2 d_v) / t.  Each shape also prints the
relative L2 distance of the cute dq / dkv / dsink from Triton's, a check at
full size.
"""

from __future__ import annotations

import argparse
import math

import torch
import triton

from dsa._args import SparseAttnArgs
from dsa.cute import sparse_attention_bwd as cbwd
from dsa.triton import sparse_attention as tsa

# name: (T, N, H, D, K, half-valid rows, deterministic)
SHAPES = {
    "v32": (4096, 8192, 128, 576, 2048, False, False),
    "v4pro": (8192, 16384, 128, 512, 1152, False, False),
    "v4flash": (8192, 16384, 64, 512, 640, False, False),
    "h64d576": (4096, 8192, 64, 576, 2048, False, False),
    "v32half": (4096, 8192, 128, 576, 2048, True, False),
    "v32det": (4096, 8192, 128, 576, 2048, False, True),
}
# the same shape with the build whose dkv chunks are not pipelined
SERIAL = {"v32serial": "v32", "v4proserial": "v4pro"}


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


def run(name: str) -> None:
    cbwd.PIPELINED = name not in SERIAL
    T, N, H, D, K, half, det = SHAPES[SERIAL.get(name, name)]
    a = _args(T, N, H, D, K, half, det)
    out, lse = tsa.forward(a)
    dout = torch.randn(T, H, 512, device="cuda", dtype=torch.bfloat16)
    flop = 2 * T * H * K * (3 * D + 2 * 512)
    res = {}
    grads = {}
    for backend, fn in (("cute", cbwd.backward), ("triton", tsa.backward)):
        grads[backend] = fn(a, out, lse, dout)
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(lambda: fn(a, out, lse, dout), warmup=25, rep=100, return_mode="median")
        res[backend] = ms
    c, t = grads["cute"], grads["triton"]
    err = f"dq {_rel(c[0], t[0]):.2e} dkv {_rel(c[1], t[1]):.2e} dsink {_rel(c[2], t[2]):.2e}"
    print(f"{name:9s} T={T} N={N} H={H} D={D} K={K} half={half} det={det}: "
          f"cute {res['cute']:.3f} ms ({flop / res['cute'] / 1e9:.1f} TFLOP/s)  "
          f"triton {res['triton']:.3f} ms ({flop / res['triton'] / 1e9:.1f} TFLOP/s)  "
          f"speedup {res['triton'] / res['cute']:.2f}x  | cute vs triton: {err}", flush=True)
    if det:
        again = cbwd.backward(a, out, lse, dout)
        same = all(torch.equal(x, y) for x, y in zip(again, c))
        print(f"{name:9s} deterministic: bitwise equal on a second run: {same}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    for name in ap.parse_args().shapes.split(","):
        run(name)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
