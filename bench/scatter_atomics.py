"""Throughput of the indexer backward's dk scatter alone: fp32 atomic adds of
[rows, 128] tiles into random key rows, as scalar ``tl.atomic_add`` and as
``red.global.add.v4.f32`` (four floats an instruction).

    python bench/scatter_atomics.py      (CUDA)

The V3.2 step: T * K = 4096 * 2048 slot rows of D_i = 128 floats (4.3 GB of
adds) into N = 8192 keys. Each result is checked against a float64
index_add_ first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _values(r, c):
    # a distinct, cheap value per (row, column): no load competes with the adds
    return (r[:, None] * 7 + c[None, :]).to(tl.float32) * 1e-6


@triton.jit
def _block(IDX, R, BK: tl.constexpr):
    """This program's slot rows, their mask and their key rows (0 past R)."""
    r = tl.program_id(0) * BK + tl.arange(0, BK)
    m = r < R
    return r, m, tl.load(IDX + r, mask=m, other=0)


@triton.jit
def _scalar_kernel(DK, IDX, R, D: tl.constexpr, BK: tl.constexpr):
    r, m, n = _block(IDX, R, BK)
    c = tl.arange(0, D)
    tl.atomic_add(DK + n[:, None] * D + c[None, :], _values(r, c), mask=m[:, None], sem="relaxed")


@triton.jit
def _vec4_kernel(DK, IDX, R, D: tl.constexpr, BK: tl.constexpr):
    r, m, n = _block(IDX, R, BK)
    c = tl.arange(0, D)
    v = tl.where(m[:, None], _values(r, c), 0.0)  # rows past R add zeros to key 0
    a, b = tl.split(tl.reshape(v, (BK, D // 4, 2, 2)))
    v0, v1 = tl.split(a)
    v2, v3 = tl.split(b)
    p = DK + n[:, None] * D + (tl.arange(0, D // 4) * 4)[None, :]
    tl.inline_asm_elementwise(
        "red.relaxed.gpu.global.add.v4.f32 [$1], {$2, $3, $4, $5}; mov.u32 $0, 0;",
        "=r,l,f,f,f,f", [p.to(tl.int64, bitcast=True), v0, v1, v2, v3], dtype=tl.int32, is_pure=False, pack=1)


def main() -> None:
    dev = "cuda"
    N, D, R = 8192, 128, 4096 * 2048
    g = torch.Generator(device=dev).manual_seed(0)
    idx = torch.randint(0, N, (R,), device=dev, generator=g, dtype=torch.int32)
    rr = torch.arange(R, device=dev, dtype=torch.float64)
    vals = (rr[:, None] * 7 + torch.arange(D, device=dev, dtype=torch.float64)[None]).float().double() * 1e-6
    ref = torch.zeros(N, D, device=dev, dtype=torch.float64).index_add_(0, idx.long(), vals)
    del vals
    print(f"scatter of {R} rows x {D} fp32 into {N} keys ({R * D * 4 / 1e9:.2f} GB of adds)", flush=True)
    for BK in (32, 64):
        for name, kernel in (("scalar", _scalar_kernel), ("vec4", _vec4_kernel)):
            dk = torch.zeros(N, D, device=dev)
            launch = lambda: kernel[(triton.cdiv(R, BK),)](dk, idx, R, D=D, BK=BK, num_warps=4)  # noqa: E731
            launch()
            err = ((dk.double() - ref).norm() / ref.norm()).item()
            ms = triton.testing.do_bench(launch, warmup=25, rep=100, return_mode="median")
            print(f"{name} BK={BK}: {ms:.3f} ms, {R * D * 4 / ms / 1e9:.2f} TB/s of fp32 adds, "
                  f"rel err of one pass {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
