"""A tour of dsa: indexer -> top-k -> sparse attention forward and backward.

    python -m dsa.demo          (or: make demo)

Without a GPU, the Triton kernels run under Triton's interpreter
(``TRITON_INTERPRET=1``, set here before Triton is imported) at small fp32
shapes, and every output and gradient is checked against the reference
backend: the demo prints the max errors and fails if one is out of bounds.

On a GPU it runs the model shapes (DeepSeek V3.2, V4-flash) and prints, for
each backend that serves the call, the median time (``triton.testing.do_bench``),
the TFLOP/s of the forward (2*T*H*K*(D + d_v) flops) and of the backward
(2*T*H*K*(3*D + 2*d_v)) and the max error against the reference.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch


def _interpret_without_gpu() -> None:
    """Triton reads TRITON_INTERPRET when it is imported: set it first (or start again)."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:  # imported already, without the interpreter
        os.execv(sys.executable, [sys.executable, "-m", "dsa.demo", *sys.argv[1:]])


@dataclass(frozen=True)
class Shape:
    name: str
    T: int  # query rows (and kv rows)
    H: int
    D: int
    d_v: int
    K: int
    H_i: int = 64  # indexer heads
    D_i: int = 128  # indexer head dim


GPU_SHAPES = (
    Shape("V3.2", T=4096, H=128, D=576, d_v=512, K=2048),
    Shape("V4-flash", T=4096, H=64, D=512, d_v=512, K=640),
)
# small enough for the interpreter on two CPU cores, with every rule exercised
CPU_SHAPE = Shape("small", T=32, H=16, D=576, d_v=512, K=32, H_i=4, D_i=32)


def _inputs(s: Shape, device: str, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, device=device, dtype=dt, generator=g)

    return dict(q_i=rnd(s.T, s.H_i, s.D_i), k_i=rnd(s.T, s.D_i), w=rnd(s.T, s.H_i, dt=torch.float32),
                q=rnd(s.T, s.H, s.D), kv=rnd(s.T, s.D), sink=rnd(s.H, dt=torch.float32), dout=rnd(s.T, s.H, s.d_v))


def _sparse(x: Dict[str, torch.Tensor], s: Shape, backend: str) -> Dict[str, torch.Tensor]:
    """Sparse attention forward and backward on the selection x["idx"] / x["lengths"]."""
    import dsa

    q, kv, sink = (x[n].detach().requires_grad_() for n in ("q", "kv", "sink"))
    out, lse = dsa.sparse_attention(q, kv, x["idx"], d_v=s.d_v, sink=sink, topk_length=x["lengths"],
                                    return_lse=True, backend=backend)
    dq, dkv, dsink = torch.autograd.grad(out, (q, kv, sink), x["dout"])
    return dict(out=out, lse=lse, dq=dq, dkv=dkv, dsink=dsink)


def _pipeline(x: Dict[str, torch.Tensor], s: Shape, backend: str) -> Dict[str, torch.Tensor]:
    """indexer_scores, indexer_topk, then sparse attention forward and backward on one backend."""
    import dsa

    sm = s.D_i**-0.5
    scores = dsa.indexer_scores(x["q_i"], x["k_i"], x["w"], sm_scale=sm, backend=backend)
    idx, lengths = dsa.indexer_topk(x["q_i"], x["k_i"], x["w"], s.K, sm_scale=sm, return_lengths=True,
                                    backend=backend)
    return dict(scores=scores, idx=idx, lengths=lengths, **_sparse(x, s, backend))


def _max_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |got - ref| over finite reference entries, relative to max |ref|; inf if the
    non-finite pattern differs."""
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(got), fin):
        return float("inf")
    got, ref = got[fin].double(), ref[fin].double()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item() if ref.numel() else 0.0


def _compare(res: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> List[Tuple[str, str]]:
    rows = [(n, f"{_max_err(res[n], ref[n]):.1e}") for n in ("scores", "out", "lse", "dq", "dkv", "dsink") if n in res]
    if "idx" in res:
        rows.append(("indices", f"{(res['idx'] == ref['idx']).float().mean().item():.2%} equal"))
    return rows


def cpu_demo(tol: float = 1e-3) -> None:
    s = CPU_SHAPE
    x = _inputs(s, "cpu", torch.float32)
    import dsa

    # both backends attend to the same selection, the reference's
    x["idx"], x["lengths"] = dsa.indexer_topk(x["q_i"], x["k_i"], x["w"], s.K, sm_scale=s.D_i**-0.5,
                                              return_lengths=True, backend="reference")
    ref = _pipeline(x, s, "reference")
    got = _pipeline(x, s, "triton")
    print(f"dsa {dsa.__version__} on CPU: the Triton kernels under TRITON_INTERPRET=1 against the reference")
    print(f"shape: T={s.T} H={s.H} D={s.D} d_v={s.d_v} K={s.K} indexer {s.H_i}x{s.D_i}, fp32, sink, topk_length")
    rows = _compare(got, ref)
    for name, err in rows:
        print(f"  {name:8} max rel error {err}" if name != "indices" else f"  {name:8} {err}")
    bad = [n for n, e in rows if n != "indices" and not float(e) <= tol]
    if bad or not torch.equal(got["idx"], ref["idx"]):
        raise SystemExit(f"triton differs from the reference: {bad or ['indices']}")
    print("triton matches the reference")


def _flops(s: Shape) -> Tuple[float, float]:
    fwd = 2.0 * s.T * s.H * s.K * (s.D + s.d_v)
    return fwd, 2.0 * s.T * s.H * s.K * (3 * s.D + 2 * s.d_v)


def _bench(fn: Callable[[], object], slow: bool) -> float:
    """Median ms of ``fn`` by triton.testing.do_bench; for the (slow) reference, one
    timed run after a warm-up run, so that the demo stays short."""
    if slow:
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _sparse_timings(x, s: Shape, backend: str) -> Tuple[str, str]:
    """The forward's and the backward's median ms and TFLOP/s, or why the backend cannot serve it."""
    import dsa

    f_fwd, f_bwd = _flops(s)
    slow = backend == "reference"
    q, kv, sink = (x[n].detach().requires_grad_() for n in ("q", "kv", "sink"))
    kw = dict(d_v=s.d_v, sink=sink, topk_length=x["lengths"], backend=backend)
    try:
        with torch.no_grad():
            fwd = _bench(lambda: dsa.sparse_attention(q, kv, x["idx"], **kw), slow)
    except ValueError as e:
        return f"{'-':>8} {'-':>8}", str(e)
    out = dsa.sparse_attention(q, kv, x["idx"], **kw)
    cols = f"{fwd:8.3f} {f_fwd / fwd / 1e9:8.1f}"
    try:
        bwd = _bench(lambda: torch.autograd.grad(out, (q, kv, sink), x["dout"], retain_graph=True), slow)
    except ValueError as e:  # e.g. a tier with a forward only
        return f"{cols} {'-':>8} {'-':>8}", str(e)
    return f"{cols} {bwd:8.3f} {f_bwd / bwd / 1e9:8.1f}", ""


def gpu_demo(shapes=GPU_SHAPES, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> None:
    import dsa

    where = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"dsa {dsa.__version__} on {where}, {str(dtype).replace('torch.', '')}, sink and topk_length; "
          "median times of triton.testing.do_bench (the reference: one run)")
    print(f"{'shape':9} {'backend':10} {'fwd ms':>8} {'TFLOP/s':>8} {'bwd ms':>8} {'TFLOP/s':>8}  "
          "max rel error vs reference")
    for s in shapes:
        x = _inputs(s, device, dtype)
        x["idx"], x["lengths"] = dsa.indexer_topk(x["q_i"], x["k_i"], x["w"], s.K, sm_scale=s.D_i**-0.5,
                                                  return_lengths=True)
        ref = _sparse(x, s, "reference")
        for backend in ("reference", "triton", "cute"):
            cols, why = _sparse_timings(x, s, backend)
            if not why and backend != "reference":
                try:
                    why = " ".join(f"{n} {e}" for n, e in _compare(_sparse(x, s, backend), ref) if n != "lse")
                except ValueError as e:
                    why = " ".join(f"{n} {e}" for n, e in _compare(_forward_only(x, s, backend), ref))
            print(f"{s.name:9} {backend:10} {cols}  {why[:90]}")


def _forward_only(x, s: Shape, backend: str) -> Dict[str, torch.Tensor]:
    import dsa

    out = dsa.sparse_attention(x["q"], x["kv"], x["idx"], d_v=s.d_v, sink=x["sink"], topk_length=x["lengths"],
                               backend=backend)
    return dict(out=out)


def main() -> None:
    _interpret_without_gpu()
    if torch.cuda.is_available():
        gpu_demo()
    else:
        # the interpreter computes masked-off lanes too, in numpy, and warns on them
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
        cpu_demo()


if __name__ == "__main__":
    main()
