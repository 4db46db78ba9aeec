"""A DeepSeek-V3.2-shaped sparse attention layer, scaled to the device.

    python -m dsa.demo

indexer_scores -> indexer_topk -> sparse_attention forward and backward, each
checked against the reference backend, with the backend chosen, the shape and
the time of every op.
"""

from __future__ import annotations

import time

import torch

import dsa


def _timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return r, (time.perf_counter() - t0) * 1e3


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _backend(line: str) -> str:
    return line.split("backend '")[1].split("'")[0]


def main() -> None:
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    # V3.2: H=128, D=576 (512 latent + 64 rope), d_v=512, K=2048, indexer 64x128
    S, H, K, Hi = (4096, 128, 2048, 64) if cuda else (256, 16, 64, 8)
    D, Dv, Di = 576, 512, 128
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s, dt=dtype: torch.randn(*s, device=dev, dtype=dt, generator=g)  # noqa: E731
    q_i, k_i, w = rnd(S, Hi, Di), rnd(S, Di), rnd(S, Hi, dt=torch.float32)
    q = rnd(S, H, D, dt=dtype).requires_grad_()
    kv = rnd(S, D, dt=dtype).requires_grad_()
    sink = torch.randn(H, device=dev, generator=g).requires_grad_()
    sm = Di**-0.5
    rows = []

    scores, ms = _timed(lambda: dsa.indexer_scores(q_i, k_i, w, sm_scale=sm))
    ref = dsa.indexer_scores(q_i, k_i, w, sm_scale=sm, backend="reference")
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(scores), fin):
        raise RuntimeError("indexer_scores: the -inf pattern differs from the reference")
    err = _rel(scores[fin], ref[fin])
    rows.append(("indexer_scores", _backend(dsa.explain("indexer_scores", q_i, k_i, w)), f"S={S} H_i={Hi} D_i={Di}", ms, f"rel {err:.1e}"))

    (idx, lengths), ms = _timed(lambda: dsa.indexer_topk(q_i, k_i, w, K, sm_scale=sm, return_lengths=True))
    ref_idx = dsa.topk_indices(scores, K)
    same = (idx == ref_idx).float().mean().item()
    rows.append(("indexer_topk", _backend(dsa.explain("indexer_topk", q_i, k_i, w, K)), f"S={S} k={K}", ms, f"{same:.2%} equal"))

    def fwd_bwd(backend):
        out = dsa.sparse_attention(q, kv, idx, sink=sink, topk_length=lengths, backend=backend)
        grads = torch.autograd.grad(out.float().square().sum(), (q, kv, sink))
        return out, grads

    out, ms_f = _timed(lambda: dsa.sparse_attention(q, kv, idx, sink=sink, topk_length=lengths))
    (out, grads), ms_fb = _timed(lambda: fwd_bwd("auto"))
    ref_out, ref_grads = fwd_bwd("reference")
    choice = _backend(dsa.explain("sparse_attention", q, kv, idx, sink=sink, topk_length=lengths))
    shape = f"T={S} H={H} D={D} d_v={Dv} K={K}"
    rows.append(("sparse_attention fwd", choice, shape, ms_f, f"rel {_rel(out, ref_out):.1e}"))
    errs = " ".join(f"{n} {_rel(a, b):.1e}" for n, a, b in zip(("dq", "dkv", "dsink"), grads, ref_grads))
    rows.append(("sparse_attention fwd+bwd", choice, shape, ms_fb, errs))

    dev_name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"dsa {dsa.__version__} on {dev_name}, {str(dtype).replace('torch.', '')} (first calls include compilation)")
    print(f"{'op':26} {'backend':10} {'shape':32} {'ms':>9}  check vs reference")
    for op, backend, shape, ms, check in rows:
        print(f"{op:26} {backend:10} {shape:32} {ms:9.2f}  {check}")


if __name__ == "__main__":
    main()
