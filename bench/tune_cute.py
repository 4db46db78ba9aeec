"""Check and time the CuTe DSL SM90 sparse-attention forward against Triton.

    PYTHONPATH=$PWD python bench/tune_cute.py [--quick]

For each named shape (bf16, fresh random inputs, distinct-enough random
indices): the relative L2 difference of cute's out / lse from a float64
recomputation on a sample of rows (NaN-poisoned outputs first), then
do_bench medians of both backends' forward and the TFLOP/s
(2*T*H*K*(D + d_v), valid slots only for the half-valid rows).

    PYTHONPATH=$PWD python bench/tune_cute.py --order [--rounds 3]

The persistent grid's tile order on half-valid rows (topk_length uniform in
[0, K], sink on): ``dsa.sparse_attention(backend="cute")`` with the tiles by
descending length (``ORDER_ROUNDS`` 2: every call past two rounds of tiles;
the argsort included)
against token order (None), at each T of ``ORDER_SHAPES``, called and
replayed from a CUDA graph (the GPU's time alone), the two orders
alternating for ``--rounds`` rounds on the same inputs; each one's median
over the rounds and the median of the per-round ratios (plain / ordered,
above 1 when the order pays).
"""

from __future__ import annotations

import argparse
import time

import torch
import triton

from dsa._args import SparseAttnArgs
from dsa.cute import sparse_attention as cute_sa
from dsa.triton import sparse_attention as triton_sa

from harness import graphed  # bench/, the script's folder

SHAPES = {  # name: T, N, H, D, d_v, K, sink, half_valid
    "V3.2": (4096, 8192, 128, 576, 512, 2048, False, False),
    "V3.2-half": (4096, 8192, 128, 576, 512, 2048, False, True),
    "V4-pro": (8192, 8192, 128, 512, 512, 1152, True, False),
    "V4-flash": (8192, 8192, 64, 512, 512, 640, True, False),
    "H64-D576-K2048": (4096, 8192, 64, 576, 512, 2048, False, False),
}


def make(name, seed=0):
    T, N, H, D, d_v, K, sink, half = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(N, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = torch.randint(0, N, (T, 1, K), device="cuda", dtype=torch.int32, generator=g)
    L = torch.randint(0, K + 1, (T,), device="cuda", dtype=torch.int32, generator=g) if half else None
    s = torch.randn(H, device="cuda", generator=g) if sink else None
    a = SparseAttnArgs(q, kv, idx, L, s, D ** -0.5, d_v, False)
    slots = T * H * (L.clamp(0, K).sum().item() / T if half else K)
    return a, 2 * slots * (D + d_v)


def exact_rows(a: SparseAttnArgs, rows):
    """float64 out / lse for a few token rows."""
    outs, lses = [], []
    K = a.K
    for t in rows:
        L = K if a.topk_length is None else max(0, min(int(a.topk_length[t]), K))
        idx = a.indices[t, 0, :L].long()
        kv = a.kv[idx, 0].double()
        s = a.q[t].double() @ kv.T * a.sm_scale  # [H, L]
        lse = torch.logsumexp(s, -1) if L else torch.full((a.H,), float("inf"), device=s.device, dtype=s.dtype)
        den = torch.exp(lse)
        if a.sink is not None:
            den = den + torch.exp(a.sink.double())
        p = torch.exp(s - torch.log(den)[:, None]) if L else s
        outs.append(p @ kv[:, : a.d_v] if L else torch.zeros(a.H, a.d_v, device=s.device, dtype=s.dtype))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def rel(x, y):
    x, y = x.double(), y.double()
    fin = torch.isfinite(y)
    return ((x[fin] - y[fin]).norm() / y[fin].norm().clamp_min(1e-30)).item(), bool(torch.equal(torch.isinf(x), torch.isinf(y)))


# (H, D, K, Ts): the head shapes of V3.2, V4-flash, V4-pro and H64-D576 from
# one round of tiles a CTA (the order is not used) to 62
ORDER_SHAPES = ((128, 576, 2048, (64, 132, 200, 512, 1024, 4096)), (64, 512, 640, (264, 400, 1024, 8192)),
                (128, 512, 1152, (200, 512, 1024, 8192)), (64, 576, 2048, (400, 1024, 4096)))


def order(rounds: int, only: str = "") -> None:
    import dsa

    n_cta = torch.cuda.get_device_properties(0).multi_processor_count
    for H, D, K, Ts in ORDER_SHAPES:
        if only and f"{H},{D},{K}" not in only.split(";"):
            continue
        for T in Ts:
            g = torch.Generator(device="cuda").manual_seed(T)
            q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
            kv = torch.randn(8192, D, device="cuda", dtype=torch.bfloat16, generator=g)
            idx = torch.randint(0, 8192, (T, K), device="cuda", dtype=torch.int32, generator=g)
            tl = torch.randint(0, K + 1, (T,), device="cuda", dtype=torch.int32, generator=g)
            sink = torch.randn(H, device="cuda", generator=g)
            call = lambda: dsa.sparse_attention(q, kv, idx, sink=sink, topk_length=tl, backend="cute")  # noqa: E731
            cute_sa.ORDER_ROUNDS = 2
            torch.cuda.set_sync_debug_mode("warn")  # a synchronising op in the call warns
            try:
                call()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            fns = {}
            for setting in (2, None):
                cute_sa.ORDER_ROUNDS = setting
                fns[(setting, "graph")] = graphed(call)
            times = {k: [] for k in ((2, "call"), (None, "call"), (2, "graph"), (None, "graph"))}
            for r in range(rounds):
                for setting in ((2, None) if r % 2 == 0 else (None, 2)):
                    cute_sa.ORDER_ROUNDS = setting
                    for how in ("call", "graph"):
                        fn = call if how == "call" else fns[(setting, how)]
                        times[(setting, how)].append(triton.testing.do_bench(fn, warmup=25, rep=100,
                                                                             return_mode="median"))
            cute_sa.ORDER_ROUNDS = 2
            line = [f"order H{H} D{D} K{K} T{T} ({T * (H // 64) / n_cta:.1f} rounds of tiles):"]
            for how in ("call", "graph"):
                o, p = times[(2, how)], times[(None, how)]
                ratios = sorted(b / a for a, b in zip(o, p))
                line.append(f"{how}: ordered {sorted(o)[rounds // 2]:.4f} ms, token order {sorted(p)[rounds // 2]:.4f}"
                            f" ms, median ratio {ratios[rounds // 2]:.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f});")
            print(" ".join(line), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--order", action="store_true", help="time the tile order on half-valid rows")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="with --order: head shapes 'H,D,K;...' of ORDER_SHAPES")
    args = ap.parse_args()
    if args.order:
        return order(args.rounds, args.only)
    print(f"device: {torch.cuda.get_device_name()}")
    for name in args.shapes.split(","):
        a, flops = make(name)
        rows = torch.linspace(0, a.T - 1, 6).long().tolist()
        eo, el = exact_rows(a, rows)
        tout, tlse = triton_sa.forward(a)
        configs = (("cute", cute_sa.GridConfig()), ("cute-per-tile", cute_sa.GridConfig(persistent=False)))
        for cname, cfg in configs:
            t0 = time.time()
            torch.cuda.synchronize()
            junk = torch.full((a.T, a.H, a.d_v), float("nan"), dtype=a.q.dtype, device="cuda")
            del junk
            out, lse = cute_sa.forward(a, cfg)
            torch.cuda.synchronize()
            first = time.time() - t0
            e_out, _ = rel(out[rows], eo)
            e_lse, inf_ok = rel(lse[rows], el)
            d_tr = rel(out, tout)[0]
            nan = bool(out.isnan().any() or lse.isnan().any())
            print(f"{name} {cname}: first call (compile+run) {first:.1f}s; vs fp64 rows: out {e_out:.2e} "
                  f"lse {e_lse:.2e} inf-pattern {'ok' if inf_ok else 'DIFFERS'}; vs triton out {d_tr:.2e}; "
                  f"NaN {nan}", flush=True)
        res = {}
        variants = [(cname, lambda x, c=cfg: cute_sa.forward(x, c)) for cname, cfg in configs]
        variants.append(("triton", triton_sa.forward))
        for backend, fn in variants:
            inputs = [make(name, seed=s)[0] for s in range(1 if args.quick else 3)]
            it = iter(range(10**9))
            ms = triton.testing.do_bench(lambda: fn(inputs[next(it) % len(inputs)]), warmup=25, rep=100,
                                         return_mode="median")
            res[backend] = ms
            print(f"  {backend:8s} fwd {name}: {ms:.3f} ms  {flops / ms / 1e9:.1f} TFLOP/s", flush=True)
        print(f"  speedup cute/triton: {res['triton'] / res['cute']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
