"""Host time of a sparse-attention call, forward and backward, by backend (GPU only).

    python3 bench/attention_host.py [--out DIR] [--tokens 1,16] [--backends cute,triton]

Each row is one call at V3.2's head shape (H 128, D 576, d_v 512, one kv
head, N 8192, K 2048, bf16, a sink) with T query tokens, small enough that
the host's work is what a call costs. Paths:

- ``public``: ``dsa.sparse_attention(q, kv, indices, sink=sink, backend=...)``
  under ``torch.no_grad()`` (checks, the op, the backend's launch);
- ``forward``: the backend's forward alone on the canonical arguments
  (``dsa.cute.sparse_attention.forward`` / ``dsa.triton.sparse_attention.forward``);
- ``backward``: the backend's backward alone (the Triton preprocess, the
  dkv accumulator, the kernel, the column order and cast of dkv).

Method: ``bench/decode_host.py``'s (``host_us_cuda``): wall time of back-to-back
calls while the stream is held behind a sleeping kernel, so that no call waits
for the device; the minimum over ``--reps`` samples (the median kept too).
Prints a table; ``--out DIR`` writes DIR/attention_host.json.

On a machine without CUDA (``--cpu``): the ``public`` path alone, on CPU
tensors with the Triton backend asked for and its forward replaced by a
stand-in that returns preallocated outputs: the host time of everything
but the launch (checks, the backend's choice, the op). A CPU-side
estimate; ``tensor.view``'s time, printed with it, scales it to another CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Dict, List, Optional

import torch

from bench.decode_host import _view_us, host_us_cuda  # first: on CPU it sets TRITON_INTERPRET before triton loads

import dsa  # noqa: E402
from dsa._args import SparseAttnArgs  # noqa: E402

H, D, DV, N, K = 128, 576, 512, 8192, 2048


def _problem(T: int) -> Dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(T)
    q = torch.randn(T, H, D, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(N, D, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.rand(T, N, device="cuda", generator=g).topk(K, dim=-1).indices.int()
    sink = torch.randn(H, device="cuda", generator=g)
    return dict(q=q, kv=kv, idx=idx, sink=sink)


def run_row(T: int, backend: str, calls: int, reps: int) -> Dict[str, Any]:
    p = _problem(T)
    q, kv, idx, sink = p["q"], p["kv"], p["idx"], p["sink"]
    a = SparseAttnArgs(q, kv.view(N, 1, D), idx.view(T, 1, K), None, sink, D ** -0.5, DV)
    if backend == "cute":
        from dsa.cute import sparse_attention as fwd_mod
        from dsa.cute import sparse_attention_bwd as bwd_mod
    else:
        from dsa.triton import sparse_attention as fwd_mod
        bwd_mod = fwd_mod
    out, lse = fwd_mod.forward(a)
    dout = torch.randn_like(out)

    def public():
        with torch.no_grad():
            return dsa.sparse_attention(q, kv, idx, sink=sink, d_v=DV, backend=backend)

    paths: Dict[str, Callable[[], Any]] = {
        "public": public,
        "forward": lambda: fwd_mod.forward(a),
        "backward": lambda: bwd_mod.backward(a, out, lse, dout),
    }
    row: Dict[str, Any] = dict(T=T, H=H, D=D, K=K, backend=backend)
    for name, fn in paths.items():
        row[f"{name}_us"], row[f"{name}_median_us"] = host_us_cuda(fn, calls, reps)
    print(f"{backend:7s} {T:4d}  " + "  ".join(f"{row[f'{n}_us']:9.1f}" for n in paths), flush=True)
    return row


def cpu_public_us(T: int, calls: int, reps: int) -> float:
    """``public``'s host time on CPU tensors, the Triton forward stubbed (module header)."""
    from bench.decode_host import host_us_cpu
    from dsa.triton import sparse_attention as tsa

    g = torch.Generator().manual_seed(T)
    q, kv = torch.randn(T, H, D, generator=g), torch.randn(N, D, generator=g)
    idx = torch.randint(0, N, (T, K), generator=g, dtype=torch.int32)
    sink = torch.randn(H, generator=g)
    outs = (torch.zeros(T, H, DV), torch.zeros(T, H))
    saved, tsa.forward = tsa.forward, lambda a, *x, **kw: outs
    try:
        with torch.no_grad():
            return host_us_cpu(lambda: dsa.sparse_attention(q, kv, idx, sink=sink, d_v=DV, backend="triton"),
                               calls, reps)[0]
    finally:
        tsa.forward = saved


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--tokens", default="1,16")
    p.add_argument("--backends", default="cute,triton")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--cpu", action="store_true", help="without CUDA: the public path, the launch stubbed")
    args = p.parse_args(argv)
    if args.cpu:
        tokens = map(int, args.tokens.split(","))
        rows = [dict(T=T, public_us=cpu_public_us(T, args.calls * 10, args.reps)) for T in tokens]
        res = dict(device="cpu", stubbed=True, rows=rows, view_us=_view_us(args.calls * 10, args.reps))
        for r in rows:
            print(f"T {r['T']}: public {r['public_us']:.1f} us (CPU, triton forward stubbed)")
        print(f"tensor.view: {res['view_us']:.2f} us")
        return res
    if not torch.cuda.is_available():
        print("attention_host.py: needs a CUDA GPU (or --cpu)", file=sys.stderr)
        return {}
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print("host us a call (GPU held asleep; min of reps x calls)")
    print("backend    T     public    forward   backward")
    rows = [run_row(T, b, args.calls, args.reps) for b in args.backends.split(",")
            for T in map(int, args.tokens.split(","))]
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows,
               view_us=_view_us(args.calls, args.reps))
    print(f"tensor.view: {res['view_us']:.2f} us")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attention_host.json"), "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
