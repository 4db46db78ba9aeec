"""Sparse attention against its peers in one process, on the same inputs (H200).

    PYTHONPATH=$PWD python bench/peers.py [--out DIR] [--shapes V3.2,V4-pro] [--cute-build JSON]
                                          [--cute-alt JSON] [--rounds R]
    PYTHONPATH=$PWD python bench/peers.py --k-sweep '64,576;64,512' [--k-values 128,...,2048] [--k-tokens T]

Forward: dsa ``cute`` and ``triton`` against FlashMLA's SM90 sparse prefill
kernel (``flash_mla.flash_mla_sparse_fwd(..., use_legacy=True)``). Backward:
dsa ``triton`` (and ``cute`` where it serves the backward) against cuDNN's
``sparse_attention_backward_wrapper``, all fed the same dsa forward's out and
lse. Plus the training step (forward + backward) under ``auto``. On
half-valid rows the cute forward (whose persistent grid takes the tiles by
descending topk_length, ``dsa.cute.sparse_attention.token_order``) is also
timed in plain token order (``fwd_cute_plain_ms``). A peer that
is not installed is reported as such and skipped. ``--cute-alt`` also times
the cute backward under other build options, in the same process (row
``bwd_cute_alt_ms``).

bf16, sink on, fresh ``torch.randn`` inputs, indices K distinct ascending rows
of [0, N) per query row (``half`` rows: topk_length uniform in [0, K]).
``triton.testing.do_bench`` medians (warmup 25 ms, rep 100 ms). TFLOP/s:
forward 2*T*H*K*(D + d_v), backward 2*T*H*K*(3*D + 2*d_v), at full K even
for half-valid rows. Each backward's dq / dkv / dsink is compared with dsa
triton's by relative L2.

Head to head (``--rounds``, 5 by default): after the single timings above,
the cute forward and FlashMLA's, and the cute backward and cuDNN's, are timed
again in R rounds, the two of a pair back to back and their order swapped
every round, so that neither always runs on a GPU the other has just heated.
Reported: each one's median over the rounds and the median of the rounds'
ratios (``h2h`` in the row; peer time / cute time, above 1 when cute is
faster).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

import dsa

SHAPES = {  # name: (T, N, H, D, K, half_valid)
    "V3.2": (4096, 8192, 128, 576, 2048, False),
    "V4-pro": (8192, 8192, 128, 512, 1152, False),
    "V4-flash": (8192, 8192, 64, 512, 640, False),
    "H64-D576": (4096, 8192, 64, 576, 2048, False),
    "H16-D576": (4096, 8192, 16, 576, 2048, False),
    "H32-D576": (4096, 8192, 32, 576, 2048, False),
    "V3.2-half": (4096, 8192, 128, 576, 2048, True),
}
D_V = 512


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def inputs(T, N, H, D, K, half, seed=0):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(T, H, D, generator=g, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(N, D, generator=g, device=dev, dtype=torch.bfloat16)
    idx = torch.empty(T, K, dtype=torch.int32, device=dev)
    step = max(1, (64 << 20) // N)
    for t0 in range(0, T, step):
        keys = torch.rand(min(step, T - t0), N, generator=g, device=dev)
        idx[t0:t0 + step] = keys.topk(K, dim=-1).indices.sort(dim=-1).values.int()
    sink = torch.randn(H, generator=g, device=dev)
    tl = torch.randint(0, K + 1, (T,), generator=g, device=dev, dtype=torch.int32) if half else None
    dout = torch.randn(T, H, D_V, generator=g, device=dev, dtype=torch.bfloat16)
    return q, kv, idx, sink, tl, dout


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _flashmla_fwd(q, kv, idx, sink, tl, scale):
    import flash_mla

    def run():
        return flash_mla.flash_mla_sparse_fwd(q, kv[:, None], idx[:, None], scale, d_v=D_V, attn_sink=sink,
                                              topk_length=tl, use_legacy=True)
    return run


def _cute_fwd_plain(q, kv, idx, sink, tl):
    """The cute forward with a persistent grid's tiles in token order
    (``dsa.cute.sparse_attention.ORDER_ROUNDS`` None)."""
    from dsa.cute import sparse_attention as cute_sa

    def run():
        keep, cute_sa.ORDER_ROUNDS = cute_sa.ORDER_ROUNDS, None
        try:
            return dsa.sparse_attention(q, kv, idx, sink=sink, topk_length=tl, backend="cute")
        finally:
            cute_sa.ORDER_ROUNDS = keep
    return run


def _cudnn_bwd(q, kv, out, dout, lse, sink, idx, tl, scale):
    from cudnn import deepseek_sparse_attention as cd

    def run():
        return cd.sparse_attention_backward_wrapper(q, kv, out, dout, lse, sink, idx, softmax_scale=scale,
                                                    topk_length=tl)
    return run


def _dsa_bwd(q, kv, idx, sink, tl, dout, backend):
    qg, kvg, sg = (t.detach().clone().requires_grad_(True) for t in (q, kv, sink))
    out = dsa.sparse_attention(qg, kvg, idx, sink=sg, topk_length=tl, backend=backend)
    run = lambda: torch.autograd.grad(out, (qg, kvg, sg), dout, retain_graph=True)  # noqa: E731
    return run


def _peer(name, build, row, key, flops, fns=None):
    try:
        fn = build()
        res = fn()
        ms = bench(fn)
    except Exception as e:  # a missing or refusing peer is a row, not a crash
        row[key] = f"{type(e).__name__}: {str(e)[:120]}"
        print(f"  {name}: {row[key]}")
        return None
    row[key] = ms
    if fns is not None:
        fns[key] = fn
    print(f"  {name}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s")
    return res


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def head_to_head(fns, pairs, rounds):
    """{pair: {"cute_ms", "peer_ms", "ratio"}}: each (cute key, peer key) in
    pairs timed back to back for ``rounds`` rounds, the order swapped every
    round; medians of the times and of the per-round peer / cute ratios."""
    out = {}
    for ck, pk in pairs:
        if ck not in fns or pk not in fns:
            continue
        times = {ck: [], pk: []}
        for r in range(rounds):
            for k in ((ck, pk) if r % 2 == 0 else (pk, ck)):
                times[k].append(bench(fns[k]))
        ratios = [p / c for c, p in zip(times[ck], times[pk])]
        out[f"{pk}/{ck}"] = dict(cute_ms=_median(times[ck]), peer_ms=_median(times[pk]), ratio=_median(ratios),
                                 cute_all=times[ck], peer_all=times[pk])
        print(f"  head to head {pk} / {ck} ({rounds} rounds): {_median(times[pk]):.3f} / "
              f"{_median(times[ck]):.3f} ms, median ratio {_median(ratios):.3f} "
              f"(rounds {min(ratios):.3f}-{max(ratios):.3f})")
    return out


def run_shape(name, T, N, H, D, K, half, alt=None, rounds=5):
    q, kv, idx, sink, tl, dout = inputs(T, N, H, D, K, half)
    scale = D ** -0.5
    ffw, fbw = 2 * T * H * K * (D + D_V), 2 * T * H * K * (3 * D + 2 * D_V)
    row = dict(shape=name, T=T, N=N, H=H, D=D, K=K, half_valid=half, flops_fwd=ffw, flops_bwd=fbw)
    print(f"{name}: T={T} N={N} H={H} D={D} K={K} half={half}")
    out, lse = dsa.sparse_attention(q, kv, idx, sink=sink, topk_length=tl, return_lse=True, backend="triton")
    fns = {}
    for backend in ("cute", "triton"):
        _peer(f"fwd dsa {backend}", lambda: (lambda: dsa.sparse_attention(
            q, kv, idx, sink=sink, topk_length=tl, backend=backend)), row, f"fwd_{backend}_ms", ffw, fns)
    if half:
        _peer("fwd dsa cute, tiles in token order", lambda: _cute_fwd_plain(q, kv, idx, sink, tl), row,
              "fwd_cute_plain_ms", ffw, fns)
    fm = _peer("fwd flashmla", lambda: _flashmla_fwd(q, kv, idx, sink, tl, scale), row, "fwd_flashmla_ms", ffw,
               fns)
    if fm is not None:
        row["fwd_flashmla_rel_out"] = rel(fm[0], out)
    ref = _peer("bwd dsa triton", lambda: _dsa_bwd(q, kv, idx, sink, tl, dout, "triton"), row, "bwd_triton_ms", fbw)
    for backend in ("cute", "auto"):
        got = _peer(f"bwd dsa {backend}", lambda: _dsa_bwd(q, kv, idx, sink, tl, dout, backend), row,
                    f"bwd_{backend}_ms", fbw, fns)
        if got is not None and ref is not None:
            row[f"bwd_{backend}_rel"] = [rel(a, b) for a, b in zip(got, ref)]
    if alt:
        from dsa.cute import sparse_attention_bwd as cbwd

        keep = cbwd.BUILD
        cbwd.BUILD = dict(keep, **alt)
        try:
            _peer(f"bwd dsa cute {alt}", lambda: _dsa_bwd(q, kv, idx, sink, tl, dout, "cute"), row,
                  "bwd_cute_alt_ms", fbw)
        finally:
            cbwd.BUILD = keep
    cd = _peer("bwd cudnn", lambda: _cudnn_bwd(q, kv, out, dout, lse, sink, idx, tl, scale), row, "bwd_cudnn_ms", fbw,
               fns)
    if cd is not None and ref is not None:
        row["bwd_cudnn_rel"] = [rel(cd["dq"], ref[0]), rel(cd["dkv"], ref[1]), rel(cd["d_sink"], ref[2])]

    def step():
        qg, kvg, sg = (t.detach().requires_grad_(True) for t in (q, kv, sink))
        o = dsa.sparse_attention(qg, kvg, idx, sink=sg, topk_length=tl)
        torch.autograd.grad(o, (qg, kvg, sg), dout)
    _peer("step auto (fwd+bwd)", lambda: step, row, "step_auto_ms", ffw + fbw)
    if rounds > 0:
        row["h2h"] = head_to_head(fns, (("fwd_cute_ms", "fwd_flashmla_ms"), ("bwd_cute_ms", "bwd_cudnn_ms"),
                                        ("fwd_cute_ms", "fwd_cute_plain_ms")), rounds)
    for k in ("bwd_cute_rel", "bwd_auto_rel", "bwd_cudnn_rel", "fwd_flashmla_rel_out"):
        if k in row:
            print(f"  {k}: {row[k]}")
    return row


def _fit(xs, ys):
    """Least-squares (intercept, slope) of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def k_sweep(heads: str, T: int, ks) -> list:
    """The backward's cost over K at fixed T, N 8192 (full rows): the cute
    backward, the same without its dkv adds (``scatter`` off: timing only)
    and cuDNN's, ms; then the straight-line fit of each over K, its intercept
    put per tile (T x head blocks tiles over the SMs in waves): the fixed
    cost a tile pays whatever its length, and the cost of 64 slots."""
    from dsa.cute import sparse_attention_bwd as cbwd

    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for spec in heads.split(";"):
        H, D = (int(v) for v in spec.split(","))
        got = {"cute": [], "cute_noadds": [], "cudnn": []}
        for K in ks:
            q, kv, idx, sink, tl, dout = inputs(T, 8192, H, D, K, False)
            out, lse = dsa.sparse_attention(q, kv, idx, sink=sink, return_lse=True, backend="triton")
            keep = cbwd.BUILD
            for key in got:
                cbwd.BUILD = dict(keep, scatter=False) if key == "cute_noadds" else keep
                try:
                    fn = (_cudnn_bwd(q, kv, out, dout, lse, sink, idx, None, D ** -0.5) if key == "cudnn"
                          else _dsa_bwd(q, kv, idx, sink, None, dout, "cute"))
                    fn()
                    got[key].append(bench(fn))
                finally:
                    cbwd.BUILD = keep
            print(f"k-sweep H{H} D{D} T{T} K{K}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in got.items()) + " ms",
                  flush=True)
        waves = T * max(1, H // 64) / sms
        for key, ys in got.items():
            icpt, slope = _fit(list(ks), ys)
            print(f"k-sweep H{H} D{D} fit {key}: {icpt:.4f} ms + {slope * 64:.4f} ms a 64 slots; a tile "
                  f"{icpt / waves * 1e3:.2f} us fixed + {slope * 64 / waves * 1e3:.2f} us a block", flush=True)
        rows.append(dict(H=H, D=D, T=T, K=list(ks), **got))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--cute-build", default=None,
                   help='options of the cute backward build (dsa.cute.sparse_attention_bwd.BUILD), JSON')
    p.add_argument("--cute-alt", default=None, help="other build options also timed (a row of their own), JSON")
    p.add_argument("--rounds", type=int, default=5, help="head-to-head rounds against the peers (0: none)")
    p.add_argument("--k-sweep", default=None, help="'H,D;H,D': the backward over K instead (k_sweep)")
    p.add_argument("--k-values", default="128,256,512,1024,2048")
    p.add_argument("--k-tokens", type=int, default=4096)
    args = p.parse_args()
    alt = json.loads(args.cute_alt) if args.cute_alt else None
    if args.cute_build:
        from dsa.cute import sparse_attention_bwd as cbwd

        cbwd.BUILD = dict(cbwd.BUILD, **json.loads(args.cute_build))
        print("cute backward build:", cbwd.BUILD)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    if args.k_sweep:
        rows = k_sweep(args.k_sweep, args.k_tokens, [int(k) for k in args.k_values.split(",")])
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "k_sweep.json"), "w") as f:
                json.dump(rows, f, indent=1)
        return
    rows = [run_shape(n, *SHAPES[n], alt=alt, rounds=args.rounds) for n in args.shapes.split(",")]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "peers.json"), "w") as f:
            json.dump(rows, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
