"""Indexer training against cuDNN, on the same inputs, in one process.

    PYTHONPATH=$PWD python bench/training_peers.py [--out DIR] [--runs 10] [--sweep] [--no-f64] [--cute]

The V3.2 step of bench/test_bench_training.py (T 4096, N 8192, K 2048, main
attention H 128 / D 576, indexer H_i 64 / D_i 128, bf16, fp32 weights).
Timed (triton.testing.do_bench, warmup 25 ms, rep 100 ms, median, ms):

* ``attention_target`` against cuDNN's ``sparse_attn_score_recompute_wrapper``;
* ``sparse_indexer_scores`` against ``sparse_indexer_score_recompute_wrapper``
  (which also takes the softmax);
* the KL step (loss forward + backward to q_i, k_i, weights): dsa by default,
  dsa ``deterministic=True`` (Triton's, dsa/triton/indexer_bwd.py: fp32 dk
  rows stored grouped by key by the main pass, summed per key in order;
  with ``--cute`` also the cute backward's, dsa/cute/indexer_train.py: bf16
  rows, and auto's), and
  cuDNN's (softmax recompute + ``indexer_backward_wrapper``; its bf16
  weights cast outside the timing);
* the deterministic step's floor, piece by piece: the dk rows' fp32 atomics
  alone (the default's scatter), the positions a step (slot_positions: one sort),
  the fp32 or bf16 rows stored to the workspace and summed back, and the sum alone;
* with ``--sweep``, the default backward's other tiles;
* with ``--cute`` (the CuTe DSL importable, an SM90 GPU), the same ops and
  the KL step under ``backend="cute"`` (``dsa.cute.indexer_train``) and
  ``"auto"``.

Checked: the deterministic step bitwise equal over ``--runs`` runs, and
the gradients of every KL step against float64 (relative L2; for cuDNN also
the least-squares scale between its gradient and float64's). cuDNN rows are
skipped with the reason when ``import cudnn`` fails. Writes DIR/training_peers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import cudnn_peer  # noqa: E402
from bench.test_bench_training import TRAINING, kl_call, make_set  # noqa: E402


def bench(fn: Callable[[], object]) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def rel_l2(got: torch.Tensor, exp: torch.Tensor) -> float:
    got, exp = got.double(), exp.double()
    return ((got - exp).norm() / exp.norm().clamp_min(1e-300)).item()


def ls_scale(got: torch.Tensor, exp: torch.Tensor) -> float:
    """The c minimising |c * exp - got|: 1 when only the rounding differs."""
    got, exp = got.double().flatten(), exp.double().flatten()
    return (got @ exp / (exp @ exp).clamp_min(1e-300)).item()


def f64_grads(s: Dict[str, torch.Tensor], sm_scale: float, rows: int = 128):
    """dq_i, dk_i, dweights of the KL loss in float64, rows chunk by chunk
    (every row of the step has valid slots: the mean is over T)."""
    q, k, w = (s[n].double() for n in ("q_i", "k_i", "weights"))
    idx, tgt = s["indices"].long(), s["target"].double()
    T = q.shape[0]
    dq, dw = torch.empty_like(q), torch.empty_like(w)
    kl = k.clone().requires_grad_()
    for t0 in range(0, T, rows):
        qc = q[t0:t0 + rows].clone().requires_grad_()
        wc = w[t0:t0 + rows].clone().requires_grad_()
        ic, tc = idx[t0:t0 + rows], tgt[t0:t0 + rows]
        dots = torch.einsum("thd,tkd->tkh", qc, kl[ic])
        logits = sm_scale * (torch.relu(dots) * wc[:, None, :]).sum(-1)
        lsm = torch.log_softmax(logits, -1)
        nz = tc > 0
        loss = torch.where(nz, tc * (torch.log(torch.where(nz, tc, 1.0)) - lsm), 0.0).sum() / T
        loss.backward()
        dq[t0:t0 + rows], dw[t0:t0 + rows] = qc.grad, wc.grad
        del dots, logits, lsm, loss
    return dq, kl.grad, dw


class Table:
    def __init__(self) -> None:
        self.rows: List[dict] = []

    def add(self, op: str, method: str, ms: Optional[float], **extra) -> None:
        self.rows.append(dict(op=op, method=method, ms=ms, **extra))
        tail = " ".join(f"{k}={v}" for k, v in extra.items())
        print(f"{op:24s} {method:34s} {'-' if ms is None else f'{ms:9.4f}':>9s} ms {tail}", flush=True)


def guarded(table: Table, op: str, method: str, fn: Callable[[], object], **extra):
    """Time fn (a first call compiles); a failure is a row with its reason."""
    try:
        fn()
        torch.cuda.synchronize()
        ms = bench(fn)
    except Exception as e:  # one peer failing must not lose the table
        table.add(op, method, None, error=f"{type(e).__name__}: {str(e)[:300]}", **extra)
        return None
    table.add(op, method, ms, **extra)
    return ms


def run_floor(table: Table, s, shape) -> None:
    """The pieces of a deterministic dk at the step's sizes: T * K rows of
    D_i fp32 scattered by fp32 atomics into N keys (the default's dk), the
    sort, and the rows stored at their grouped positions and summed back,
    chunk by chunk as the deterministic backward does (no MMAs: the traffic alone)."""
    import triton
    import triton.language as tl

    from dsa.triton import segment_sum as ss

    @triton.jit
    def rows(OUT, IDX, R, D: tl.constexpr, BK: tl.constexpr, ATOMIC: tl.constexpr):
        r = tl.program_id(0) * BK + tl.arange(0, BK)
        m = r < R
        n = tl.load(IDX + r, mask=m, other=0).to(tl.int64)
        c = tl.arange(0, D)
        v = ((r[:, None] * 7 + c[None, :]) % 1000 - 500).to(tl.float32)
        if ATOMIC:
            tl.atomic_add(OUT + n[:, None] * D + c[None, :], v, mask=m[:, None], sem="relaxed")
        else:
            tl.store(OUT + n[:, None] * D + c[None, :], v.to(OUT.dtype.element_ty), mask=m[:, None])

    T, K, N, D = shape.T, shape.K, shape.N, shape.D_i
    R = T * K
    keys = s["indices"].long().view(-1)
    dk = torch.zeros(N, D, device="cuda", dtype=torch.float32)
    idx32 = keys.to(torch.int32)
    guarded(table, "dk floor", "fp32 atomics of the rows", lambda: rows[(triton.cdiv(R, 64),)](
        dk, idx32, R, D=D, BK=64, ATOMIC=True, num_warps=4), gb=round(R * D * 4 / 1e9, 2))
    for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        per = ss.chunk_rows(T, K * D * dt.itemsize) * K
        guarded(table, "dk floor", f"positions (slot_positions, chunks of {per} rows)",
                lambda per=per: ss.slot_positions(s["indices"], None, N, per // K))
        pos, start = ss.slot_positions(s["indices"], None, N, per // K)
        ws = torch.empty(per, D, device="cuda", dtype=dt)

        def store_sum(per=per, pos=pos, start=start, ws=ws):
            for c, r0 in enumerate(range(0, R, per)):
                n = min(per, R - r0)
                rows[(triton.cdiv(n, 64),)](ws, pos[r0:r0 + n], n, D=D, BK=64, ATOMIC=False, num_warps=4)
                ss.grouped_segment_sum(ws, start[c], dk, block_d=D)

        def sum_only(per=per, start=start, ws=ws):
            for c, r0 in enumerate(range(0, R, per)):
                ss.grouped_segment_sum(ws, start[c], dk, block_d=D)

        gb = R * D * dt.itemsize / 1e9
        guarded(table, "dk floor", f"store + grouped sum, {name} rows", store_sum, gb=round(2 * gb, 2))
        guarded(table, "dk floor", f"grouped sum alone, {name} rows", sum_only, gb=round(gb, 2))
        del pos, start, ws


def run_kl(table: Table, s, shape, args, ref) -> None:
    sm = shape.D_i ** -0.5
    step = kl_call(s, "triton", False)
    guarded(table, "KL step", "dsa default", step)
    results = {"dsa default": step()}
    import dsa

    if args.cute:
        for backend in ("cute", "auto"):
            step_b = kl_call(s, backend, False)
            if guarded(table, "KL step", f"dsa {backend}", step_b) is not None:
                results[f"dsa {backend}"] = step_b()

    # where the step goes: the backward alone (the forward is "indexer_kl_loss fwd")
    for backend, method in (("triton", "dsa default"), ("cute", "dsa cute")):
        if backend == "cute" and not args.cute:
            continue
        leaves = [s[n].detach().clone().requires_grad_() for n in ("q_i", "k_i", "weights")]
        loss = dsa.indexer_kl_loss(*leaves, s["indices"], s["target"], sm_scale=sm, backend=backend)
        guarded(table, "KL backward alone", method,
                lambda loss=loss, leaves=leaves: torch.autograd.grad(loss, leaves, retain_graph=True))
        lg = dsa.sparse_indexer_scores(*leaves, s["indices"], sm_scale=sm, backend=backend)
        dl = torch.randn_like(lg)
        guarded(table, "sparse_indexer_scores backward alone", method,
                lambda lg=lg, leaves=leaves, dl=dl: torch.autograd.grad(lg, leaves, dl, retain_graph=True))
        del loss, lg
    dets = [("triton", "dsa deterministic")]
    if args.cute:
        dets += [("cute", "dsa deterministic cute"), ("auto", "dsa deterministic auto")]
    for backend, name in dets:
        det = kl_call(s, backend, True)
        if guarded(table, "KL step", name, det) is not None:
            first = det()
            same = all(all(torch.equal(a, b) for a, b in zip(first, det())) for _ in range(args.runs - 1))
            table.add("KL step", f"{name} bitwise", None, runs=args.runs, equal=same)
            results[name] = first
    why = cudnn_peer.unavailable()
    if why is None:
        # cuDNN takes bf16 weights (and the recompute sm_scale-scaled ones): cast once, outside the timing
        w, ws = cudnn_peer.indexer_weights(s["weights"], sm)
        qk = (s["q_i"], s["k_i"])
        tgt = s["target"].clone()
        step_c = lambda: cudnn_peer.indexer_kl_step(*qk, w, s["indices"], tgt, sm_scale=sm,  # noqa: E731
                                                    scaled_weights=ws)
        if guarded(table, "KL step", "cudnn (recompute + indexer_backward)", step_c) is not None:
            results["cudnn"] = cudnn_peer.indexer_kl_step(*qk, w, s["indices"], s["target"].clone(), sm_scale=sm,
                                                          scaled_weights=ws)
            # a wrong argument (weights, scale) shows here first, whatever float64 says
            table.add("KL grads cudnn vs dsa default", "rel_l2", None, **{
                n: float(f"{rel_l2(g, r):.3g}") for n, g, r in zip(("dq", "dk", "dw"), results["cudnn"],
                                                                  results["dsa default"])})
    else:
        table.add("KL step", "cudnn", None, skipped=why)
    if ref is not None:
        for method, grads in results.items():
            errs = {n: float(f"{rel_l2(g, r):.3g}") for n, g, r in zip(("dq", "dk", "dw"), grads, ref)}
            scales = {n: round(ls_scale(g, r), 5) for n, g, r in zip(("dq", "dk", "dw"), grads, ref)}
            table.add("KL grads vs float64", method, None, rel_l2=errs, scale=scales)


def run_forward_ops(table: Table, s, shape, cute: bool = False) -> None:
    import dsa

    sm = shape.D_i ** -0.5
    with torch.no_grad():
        guarded(table, "attention_target", "dsa", lambda: dsa.attention_target(
            s["q"], s["kv"], s["indices"], s["lse"], backend="triton"))
        guarded(table, "sparse_indexer_scores", "dsa", lambda: dsa.sparse_indexer_scores(
            s["q_i"], s["k_i"], s["weights"], s["indices"], sm_scale=sm, backend="triton"))
        guarded(table, "indexer_kl_loss fwd", "dsa", lambda: dsa.indexer_kl_loss(
            s["q_i"], s["k_i"], s["weights"], s["indices"], s["target"], sm_scale=sm, backend="triton"))
        if cute:
            want = dsa.sparse_indexer_scores(s["q_i"], s["k_i"], s["weights"], s["indices"], sm_scale=sm,
                                             backend="triton")
            got = dsa.sparse_indexer_scores(s["q_i"], s["k_i"], s["weights"], s["indices"], sm_scale=sm,
                                            backend="cute")
            guarded(table, "sparse_indexer_scores", "dsa cute", lambda: dsa.sparse_indexer_scores(
                s["q_i"], s["k_i"], s["weights"], s["indices"], sm_scale=sm, backend="cute"),
                rel_l2_to_triton=float(f"{rel_l2(got, want):.3g}"))
            guarded(table, "indexer_kl_loss fwd", "dsa cute", lambda: dsa.indexer_kl_loss(
                s["q_i"], s["k_i"], s["weights"], s["indices"], s["target"], sm_scale=sm, backend="cute"))
            guarded(table, "sparse_indexer_scores", "dsa auto", lambda: dsa.sparse_indexer_scores(
                s["q_i"], s["k_i"], s["weights"], s["indices"], sm_scale=sm))
        why = cudnn_peer.unavailable()
        if why is not None:
            table.add("attention_target", "cudnn", None, skipped=why)
            return
        ms = guarded(table, "attention_target", "cudnn", lambda: cudnn_peer.attention_target(
            s["q"], s["kv"], s["indices"], s["lse"], sm_scale=shape.D ** -0.5))
        if ms is not None:
            got = cudnn_peer.attention_target(s["q"], s["kv"], s["indices"], s["lse"], sm_scale=shape.D ** -0.5)
            table.add("attention_target", "cudnn vs dsa", None, rel_l2=float(f"{rel_l2(got, s['target']):.3g}"))
        w, ws = cudnn_peer.indexer_weights(s["weights"], sm)  # bf16, cast outside the timing
        ms = guarded(table, "sparse_indexer_scores", "cudnn (softmax)", lambda: cudnn_peer.indexer_softmax(
            s["q_i"], s["k_i"], w, s["indices"], sm_scale=sm, scaled_weights=ws))
        if ms is not None:
            got = cudnn_peer.indexer_softmax(s["q_i"], s["k_i"], w, s["indices"], sm_scale=sm, scaled_weights=ws)
            exp = torch.softmax(dsa.sparse_indexer_scores(s["q_i"], s["k_i"], s["weights"], s["indices"],
                                                          sm_scale=sm, backend="triton"), -1)
            table.add("sparse_indexer_scores", "cudnn softmax vs dsa's", None,
                      rel_l2=float(f"{rel_l2(got, exp):.3g}"))


def run_sweep(table: Table, s) -> None:
    """The default backward's other tiles (KL step, deterministic off), and
    the sparse indexer forward's (sparse_indexer_scores)."""
    import dataclasses

    import dsa
    from dsa.triton import indexer_bwd as ib
    from dsa.triton import training as tt

    fwd = tt.INDEXER_FWD_CONFIG
    sm = s["q_i"].shape[-1] ** -0.5
    for cfg in (dataclasses.replace(fwd, num_stages=4), dataclasses.replace(fwd, num_stages=2),
                dataclasses.replace(fwd, num_warps=8), dataclasses.replace(fwd, BK=128, num_warps=8),
                dataclasses.replace(fwd, BK=128, num_warps=8, num_stages=4), dataclasses.replace(fwd, BK=32),
                dataclasses.replace(fwd, BK=128), dataclasses.replace(fwd, BK=128, num_stages=2)):
        tt.INDEXER_FWD_CONFIG = cfg
        try:
            with torch.no_grad():
                guarded(table, "sparse_indexer_scores", f"dsa {cfg}", lambda: dsa.sparse_indexer_scores(
                    s["q_i"], s["k_i"], s["weights"], s["indices"], sm_scale=sm, backend="triton"))
        finally:
            tt.INDEXER_FWD_CONFIG = fwd

    base = ib.BWD_CONFIG
    for cfg in (dataclasses.replace(base, num_stages=2), dataclasses.replace(base, BK=128, num_warps=8),
                dataclasses.replace(base, BK=128, num_warps=8, num_stages=2),
                dataclasses.replace(base, num_warps=8)):
        ib.BWD_CONFIG = cfg
        try:
            guarded(table, "KL step", f"dsa default {cfg}", kl_call(s, "triton", False))
        finally:
            ib.BWD_CONFIG = base


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="training_peers_out")
    ap.add_argument("--runs", type=int, default=10, help="deterministic runs compared bitwise")
    ap.add_argument("--sweep", action="store_true", help="also time the backward's other tiles")
    ap.add_argument("--no-f64", action="store_true", help="skip the float64 gradients")
    ap.add_argument("--cute", action="store_true", help="also time the cute indexer kernels")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("training_peers: needs a CUDA device")
        return 2
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    shape = TRAINING[0]
    s = make_set(shape, torch.device("cuda"))
    print(f"shape {shape}; cudnn: {cudnn_peer.unavailable() or 'available'}", flush=True)
    table = Table()
    run_forward_ops(table, s, shape, args.cute)
    ref = None if args.no_f64 else f64_grads(s, shape.D_i ** -0.5)
    run_kl(table, s, shape, args, ref)
    del ref
    torch.cuda.empty_cache()
    run_floor(table, s, shape)
    if args.sweep:
        run_sweep(table, s)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "seconds": time.time() - t0}
    with open(os.path.join(args.out, "training_peers.json"), "w") as f:
        json.dump({"meta": meta, "shape": shape.params, "rows": table.rows}, f, indent=1, default=str)
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
