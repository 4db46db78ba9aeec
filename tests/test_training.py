"""Indexer training: attention_target, sparse_indexer_scores, indexer_kl_loss,
dense_attention_target and the gradients of indexer_scores, against an
independent float64 computation written here (plain loops over rows and slots,
torch autograd for the gradients).

On a machine without CUDA the Triton kernels run under the interpreter
(TRITON_INTERPRET=1, set below before triton is imported) in fp32 / fp16 with
tiny shapes; tests marked ``gpu`` run bf16 on CUDA.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import importlib.util  # noqa: E402

import pytest  # noqa: E402

import dsa  # noqa: E402
from dsa import _checks, ops  # noqa: E402

NEG_INF = float("-inf")


# --------------------------------------------------------------------------
# float64 brute force (independent of dsa: loops over rows and slots)


def bf_length(topk_length, t, K):
    return K if topk_length is None else min(max(int(topk_length[t]), 0), K)


def bf_valid(indices, topk_length, N):
    """[T, K] or [T, G, K] bool, by the rule of sparse attention."""
    v = torch.zeros(indices.shape, dtype=torch.bool)
    for t in range(indices.shape[0]):
        L = bf_length(topk_length, t, indices.shape[-1])
        for j in range(L):
            v[t, ..., j] = (indices[t, ..., j] >= 0) & (indices[t, ..., j] < N)
    return v


def bf_target(q, kv, indices, lse, topk_length, sm_scale):
    """q [T, H, D], kv [N, G, D], indices [T, G, K], lse [T, H] -> [T, G, K] float64."""
    q, kv, lse = q.double().cpu(), kv.double().cpu(), lse.double().cpu()
    indices = indices.cpu()
    T, H, _ = q.shape
    N, G, _ = kv.shape
    M = H // G
    valid = bf_valid(indices, topk_length, N)
    out = torch.zeros(indices.shape, dtype=torch.float64)
    for t in range(T):
        for g in range(G):
            for j in range(indices.shape[-1]):
                if valid[t, g, j]:
                    heads = slice(g * M, (g + 1) * M)
                    s = sm_scale * (q[t, heads] @ kv[int(indices[t, g, j]), g])
                    out[t, g, j] = torch.exp(s - lse[t, heads]).mean()
    return out


def bf_logits(q, k, w, indices, topk_length, sm_scale):
    """Differentiable float64 logits [T, K] (q, k, w float64 leaves)."""
    T, K = indices.shape
    valid = bf_valid(indices, topk_length, k.shape[0])
    rows = []
    for t in range(T):
        vals = []
        for j in range(K):
            if valid[t, j]:
                dots = q[t] @ k[int(indices[t, j])]
                vals.append(sm_scale * (w[t] * torch.relu(dots)).sum())
            else:
                vals.append(torch.tensor(NEG_INF, dtype=torch.float64))
        rows.append(torch.stack(vals))
    return torch.stack(rows)


def bf_kl(q, k, w, indices, target, topk_length, sm_scale):
    logits = bf_logits(q, k, w, indices, topk_length, sm_scale)
    valid = bf_valid(indices, topk_length, k.shape[0])
    total, rows = torch.zeros((), dtype=torch.float64), 0
    for t in range(indices.shape[0]):
        if not valid[t].any():
            continue
        rows += 1
        lg = logits[t][valid[t]]
        tt = target[t].double()[valid[t]]
        lsm = lg - torch.logsumexp(lg, 0)
        nz = tt != 0
        total = total + (tt[nz] * (torch.log(tt[nz]) - lsm[nz])).sum()
    return total / max(rows, 1)


def bf_limit(i, b, q_offsets, ratio, causal, s_k):
    if not causal:
        return s_k
    off = 0 if q_offsets is None else int(q_offsets[b])
    return min(max((off + i + 1) // ratio, 0), s_k)


def bf_dense_scores(q, k, w, cu_q, cu_k, q_offsets, ratio, causal, sm_scale, max_k):
    """Differentiable float64 indexer scores [T_q, max_k], packed layout."""
    rows = []
    for b in range(len(cu_q) - 1):
        k0, k1 = cu_k[b], cu_k[b + 1]
        for i in range(cu_q[b + 1] - cu_q[b]):
            t = cu_q[b] + i
            L = bf_limit(i, b, q_offsets, ratio, causal, k1 - k0)
            s = sm_scale * (w[t][:, None] * torch.relu(q[t] @ k[k0 : k0 + L].T)).sum(0)
            rows.append(torch.cat([s, torch.full((max_k - L,), NEG_INF, dtype=torch.float64)]))
    return torch.stack(rows)


def bf_dense_target(q, kv, cu_q, cu_k, q_offsets, ratio, causal, sm_scale, max_k):
    q, kv = q.double().cpu(), kv.double().cpu()
    out = torch.zeros(q.shape[0], max_k, dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        k0, k1 = cu_k[b], cu_k[b + 1]
        for i in range(cu_q[b + 1] - cu_q[b]):
            t = cu_q[b] + i
            L = bf_limit(i, b, q_offsets, ratio, causal, k1 - k0)
            if L > 0:
                s = sm_scale * (q[t] @ kv[k0 : k0 + L].T)  # [H, L]
                out[t, :L] = torch.softmax(s, -1).mean(0)
    return out


# --------------------------------------------------------------------------
# helpers


TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
GRAD_TOL = {torch.float64: 1e-9, torch.float32: 5e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def rel_close(got, exp, tol, what):
    got, exp = got.detach().double().cpu(), exp.detach().double().cpu()
    assert got.shape == exp.shape, f"{what}: shape {tuple(got.shape)} != {tuple(exp.shape)}"
    fin = torch.isfinite(exp)
    assert torch.equal(torch.isfinite(got), fin), f"{what}: non-finite pattern differs"
    assert torch.equal(got[~fin], exp[~fin]), f"{what}: infinities differ"
    err = (got[fin] - exp[fin]).norm().item()
    scale = exp[fin].norm().item()
    assert err <= tol * max(scale, 1e-30) + 1e-30, f"{what}: relative error {err / max(scale, 1e-30):.2e} > {tol:.0e}"


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rand(shape, case, g, scale=1.0, dtype=None):
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype or case.dtype).to(case.device)


def slot_indices(shape, N, g):
    """Random rows with invalid (-1, >= N) entries and duplicates."""
    idx = torch.randint(-1, N + 2, shape, generator=g)
    flat = idx.view(-1, shape[-1])
    flat[:, 1] = flat[:, 0]  # a duplicate in every row
    return idx.to(torch.int32)


def lengths(T, K):
    base = [K, 3, 0, K + 5, -2, K - 1, 1, K]
    return torch.tensor([base[t % len(base)] for t in range(T)], dtype=torch.int32)


def w_dtype(case):
    # fp32 head weights (the models' choice), float64 with float64 inputs
    return torch.float64 if case.dtype == torch.float64 else torch.float32


def indexer_inputs(case, g, T=7, H=3, D=16, N=19, K=20):
    q = rand((T, H, D), case, g)
    k = rand((N, D), case, g)
    w = rand((T, H), case, g, dtype=w_dtype(case))
    return q, k, w, slot_indices((T, K), N, g), lengths(T, K)


def leaves(*xs):
    return [x.detach().double().cpu().requires_grad_() for x in xs]


def grads_of(fn, xs, grad=None):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    out = fn(*xs)
    out.backward(grad)
    return out, [x.grad for x in xs]


def random_target(valid, g):
    """A distribution over the valid slots of each row, with some valid zeros."""
    t = torch.rand(valid.shape, generator=g, dtype=torch.float64) + 0.05
    t[:, 0] = 0.0  # target 0 on a (possibly valid) slot counts 0
    t = torch.where(valid, t, 0.0)
    return t / t.sum(-1, keepdim=True).clamp_min(1e-30)


def score_dtype(case):
    return torch.float64 if case.dtype == torch.float64 else torch.float32


def on(case, *xs):
    return [None if x is None else x.to(case.device) for x in xs]


# --------------------------------------------------------------------------
# attention target


TARGET_VARIANTS = {  # the Triton target kernel's options: (q_resident, keys_as_rows)
    "q-streamed": (False, False), "q-resident": (True, False),
    "keys-as-rows": (False, True), "keys-as-rows-q-resident": (True, True),
}


def target_configs(q_resident: bool, keys_as_rows: bool):
    """The Triton target kernel's configs with these options (Q held across
    slot blocks takes 32-slot blocks and 8 warps: with 64 slots, Q and the kv
    stages of H = 128, D = 576 pass the H200's 227 KB of shared memory)."""
    from dsa.triton import training as tt

    def one(c):
        if q_resident:
            return tt.TrainingTileConfig(32, c.BD, 8, 3, q_resident=True, keys_as_rows=keys_as_rows)
        return tt.TrainingTileConfig(c.BK, c.BD, c.num_warps, c.num_stages, keys_as_rows=keys_as_rows)

    return {m: one(c) for m, c in tt.TARGET_CONFIGS.items()}


@pytest.fixture(params=list(TARGET_VARIANTS))
def target_q(request, case, monkeypatch):
    """The Triton target kernel in each of TARGET_VARIANTS; other backends
    run once."""
    if case.backend != "triton":
        if request.param != next(iter(TARGET_VARIANTS)):
            pytest.skip("a Triton kernel option")
        return request.param
    from dsa.triton import training as tt

    monkeypatch.setattr(tt, "TARGET_CONFIGS", target_configs(*TARGET_VARIANTS[request.param]))
    return request.param


@pytest.mark.usefixtures("target_q")
@pytest.mark.parametrize("layout", ["packed", "gqa", "batched"])
def test_attention_target(case, call, layout):
    g = gen(1)
    T, H, D, N, K = 6, 4, 24, 17, 20
    sm_scale = 0.3
    if layout == "batched":
        B, S = 2, 3
        q, kv = rand((B, S, H, D), case, g), rand((B, N, D), case, g)
        idx, tl = on(case, slot_indices((B, S, K), N, g), lengths(T, K).view(B, S))
    else:
        G = 2 if layout == "gqa" else 1
        q = rand((T, H, D), case, g)
        kv = rand((N, G, D) if G > 1 else (N, D), case, g)
        idx, tl = on(case, slot_indices((T, G, K) if G > 1 else (T, K), N, g), lengths(T, K))
    _, lse = dsa.sparse_attention(q, kv, idx, sm_scale=sm_scale, topk_length=tl, return_lse=True, backend="reference")
    got = call(dsa.attention_target, q, kv, idx, lse, sm_scale=sm_scale, topk_length=tl, backend=case.backend)
    assert got.dtype in (torch.float32, torch.float64) and got.shape == idx.shape

    # the brute force in the packed GQA form
    if layout == "batched":
        q_p, kv_p = q.reshape(T, H, 1, D).squeeze(2), kv.reshape(B * N, 1, D)
        ib = idx.cpu().long()
        ib = torch.where((ib >= 0) & (ib < N), ib + (torch.arange(B) * N).view(B, 1, 1), -1)
        idx_p, lse_p = ib.reshape(T, 1, K), lse.reshape(T, H)
    else:
        q_p, kv_p = q, kv.reshape(N, -1, D)
        idx_p, lse_p = idx.cpu().reshape(T, -1, K), lse
    exp = bf_target(q_p, kv_p, idx_p, lse_p, tl.reshape(-1).cpu(), sm_scale).view(got.shape)
    rel_close(got, exp, TOL[case.dtype], "target")
    # the target is the main attention's distribution: it sums to 1 on a non-empty row
    sums = got.detach().double().cpu().reshape(-1, K).sum(-1)
    nonempty = exp.reshape(-1, K).sum(-1) > 0
    assert torch.allclose(sums[nonempty], torch.ones_like(sums[nonempty]), atol=1e-2)
    assert torch.all(sums[~nonempty] == 0)


@pytest.mark.usefixtures("target_q")
def test_attention_target_several_head_dim_chunks(case, call):
    """D = 144: the kernel reduces D in chunks of 64, the last one partial."""
    g = gen(11)
    T, H, D, N, K = 3, 4, 144, 9, 12
    q, kv = rand((T, H, D), case, g), rand((N, D), case, g)
    idx, tl = on(case, slot_indices((T, K), N, g), lengths(T, K))
    _, lse = dsa.sparse_attention(q, kv, idx, sm_scale=0.1, topk_length=tl, return_lse=True, backend="reference")
    got = call(dsa.attention_target, q, kv, idx, lse, sm_scale=0.1, topk_length=tl, backend=case.backend)
    exp = bf_target(q, kv.reshape(N, 1, D), idx.cpu().reshape(T, 1, K), lse, tl.cpu(), 0.1).view(got.shape)
    rel_close(got, exp, TOL[case.dtype], "target")


def test_attention_target_sink_and_d_v_change_nothing(fast_case, call):
    case = fast_case
    g = gen(2)
    q, kv = rand((5, 4, 32), case, g), rand((11, 32), case, g)
    idx = on(case, slot_indices((5, 8), 11, g))[0]
    sink = torch.randn(4, generator=g).to(case.device)
    _, lse = dsa.sparse_attention(q, kv, idx, sink=sink, d_v=16, return_lse=True, backend="reference")
    a = call(dsa.attention_target, q, kv, idx, lse, backend=case.backend)
    b = call(dsa.attention_target, q, kv, idx, lse, sink=sink, d_v=16, backend=case.backend)
    assert torch.equal(a, b)


# --------------------------------------------------------------------------
# sparse indexer logits and their gradients


def packed_indices(idx, N):
    """Batch-local indices [B, S, K] -> global rows [B*S, K] of the packed k (invalid -> -1)."""
    B = idx.shape[0]
    i = idx.cpu().long()
    ok = (i >= 0) & (i < N)
    return torch.where(ok, i + (torch.arange(B) * N).view(B, 1, 1), -1).reshape(-1, idx.shape[-1])


def layout_inputs(case, g, layout, T=8, H=3, D=16, N=19, K=20):
    """(user inputs, packed float64-brute-force inputs) for both layouts."""
    if layout == "packed":
        q, k, w, idx, tl = indexer_inputs(case, g, T=T, H=H, D=D, N=N, K=K)
        return (q, k, w, idx, tl), (q, k, w, idx, tl)
    B, S = 2, T // 2
    q, w = rand((B, S, H, D), case, g), rand((B, S, H), case, g, dtype=w_dtype(case))
    k = rand((B, N, D), case, g)
    idx, tl = slot_indices((B, S, K), N, g), lengths(T, K).view(B, S)
    packed = (q.reshape(T, H, D), k.reshape(B * N, D), w.reshape(T, H), packed_indices(idx, N), tl.reshape(T))
    return (q, k, w, idx, tl), packed


@pytest.fixture(params=[True, False], ids=["keys-as-rows", "heads-as-rows"])
def indexer_rows(request, monkeypatch):
    """The Triton sparse-indexer forward and backward kernels both ways:
    slots as the MMAs' rows (``keys_as_rows``) and query heads as their rows;
    other backends run once."""
    case = request.getfixturevalue("case" if "case" in request.fixturenames else "fast_case")
    if case.backend != "triton":
        if not request.param:
            pytest.skip("a Triton kernel option")
        return request.param
    from dsa.triton import indexer_bwd as tb
    from dsa.triton import training as tt

    kar = request.param
    c = tt.INDEXER_FWD_CONFIG
    # heads as rows at 16 slots a block: K 20 takes two blocks, the second partial
    fwd = tt.TrainingTileConfig(64, c.BD, 4, 3, keys_as_rows=True) if kar else tt.TrainingTileConfig(16, c.BD, 4, 4)
    monkeypatch.setattr(tt, "INDEXER_FWD_CONFIG", fwd)
    monkeypatch.setattr(tb, "BWD_CONFIG", tb.IndexerBwdConfig(64 if kar else 32, 4, 2, keys_as_rows=kar))
    return request.param


@pytest.mark.usefixtures("indexer_rows")
@pytest.mark.parametrize("layout", ["packed", "batched"])
def test_sparse_indexer_scores(case, call, layout):
    g = gen(3)
    (q, k, w, idx, tl), (qp, kp, wp, idxp, tlp) = layout_inputs(case, g, layout)
    sm_scale = 0.7
    valid = bf_valid(idxp, tlp, kp.shape[0])
    dl = torch.randn(valid.shape, generator=g, dtype=torch.float64)
    ql, kl, wl = leaves(qp, kp, wp)
    exp = bf_logits(ql, kl, wl, idxp, tlp, sm_scale)
    exp.backward(torch.where(valid, dl, 0.0))
    dl = torch.where(valid, dl, float("nan"))  # the gradient of an invalid (-inf) slot is never read
    idx, tl = on(case, idx, tl)
    fn = lambda q_, k_, w_: dsa.sparse_indexer_scores(  # noqa: E731
        q_, k_, w_, idx, sm_scale=sm_scale, topk_length=tl, backend=case.backend
    )
    got, grads = call(grads_of, fn, [q, k, w], dl.to(score_dtype(case)).view(idx.shape).to(case.device))
    assert got.shape == idx.shape
    rel_close(got.reshape(exp.shape), exp, TOL[case.dtype], "logits")
    _check_indexer_grads(case, (q, k, w), grads, (ql, kl, wl))


def _check_indexer_grads(case, inputs, grads, leaves_) -> None:
    """The gradients of (q_i, k_i, weights) against the float64 leaves' gradients."""
    for name, x, gx, leaf in zip(("dq_i", "dk_i", "dweights"), inputs, grads, leaves_):
        assert gx.dtype == x.dtype and gx.shape == x.shape
        rel_close(gx.reshape(leaf.grad.shape), leaf.grad, GRAD_TOL[case.dtype], name)


def test_sparse_indexer_int64_indices(fast_case, call):
    case = fast_case
    g = gen(4)
    q, k, w, idx, tl = indexer_inputs(case, g, T=4, K=8)
    idx64 = idx.long()
    idx64[0, 2] = 2**40  # out of int32 range: invalid, never wraps into range
    idx32 = idx.clone()
    idx32[0, 2] = -1
    a = call(dsa.sparse_indexer_scores, q, k, w, idx64.to(case.device), backend=case.backend)
    b = call(dsa.sparse_indexer_scores, q, k, w, idx32.to(case.device), backend=case.backend)
    assert torch.equal(a, b) and torch.isneginf(a[0, 2])


# --------------------------------------------------------------------------
# KL loss


@pytest.mark.usefixtures("indexer_rows")
@pytest.mark.parametrize("det", [False, True], ids=["", "deterministic"])
@pytest.mark.parametrize("layout", ["packed", "batched"])
def test_indexer_kl_loss(case, call, layout, det):
    """Loss and gradients against float64; deterministic=True takes the
    stats from the logits kernel's output (and the backward may read them)."""
    g = gen(5)
    (q, k, w, idx, tl), (qp, kp, wp, idxp, tlp) = layout_inputs(case, g, layout)
    target = random_target(bf_valid(idxp, tlp, kp.shape[0]), g)
    sm_scale = 0.5
    ql, kl, wl = leaves(qp, kp, wp)
    exp = bf_kl(ql, kl, wl, idxp, target, tlp, sm_scale)
    exp.backward()
    idx, tl = on(case, idx, tl)
    tgt = target.to(score_dtype(case)).view(idx.shape).to(case.device)
    fn = lambda q_, k_, w_: dsa.indexer_kl_loss(  # noqa: E731
        q_, k_, w_, idx, tgt, sm_scale=sm_scale, topk_length=tl, deterministic=det, backend=case.backend
    )
    got, grads = call(grads_of, fn, [q, k, w])
    assert got.dim() == 0 and got.dtype in (torch.float32, torch.float64)
    rel_close(got, exp, TOL[case.dtype], "loss")
    _check_indexer_grads(case, (q, k, w), grads, (ql, kl, wl))


def test_kl_loss_of_attention_target_end_to_end(fast_case, call):
    """target = attention_target(...) -> indexer_kl_loss(...) -> backward."""
    case = fast_case
    g = gen(6)
    T, H, D, N, K = 6, 4, 32, 15, 12
    q, kv = rand((T, H, D), case, g), rand((N, D), case, g)
    idx, tl = on(case, slot_indices((T, K), N, g), lengths(T, K))
    _, lse = dsa.sparse_attention(q, kv, idx, topk_length=tl, return_lse=True, backend="reference")
    tgt = call(dsa.attention_target, q, kv, idx, lse, topk_length=tl, backend=case.backend)
    qi, ki, wi = rand((T, 2, 16), case, g), rand((N, 16), case, g), rand((T, 2), case, g, dtype=torch.float32)
    loss, grads = call(grads_of, lambda a, b, c: dsa.indexer_kl_loss(a, b, c, idx, tgt, topk_length=tl,
                                                                       backend=case.backend), [qi, ki, wi])
    ql, kl, wl = leaves(qi, ki, wi)
    exp = bf_kl(ql, kl, wl, idx.cpu(), tgt.double().cpu(), tl.cpu(), 1.0)
    rel_close(loss, exp, TOL[case.dtype], "loss")
    assert all(torch.isfinite(x).all() for x in grads)


# --------------------------------------------------------------------------
# dense target and the gradients of indexer_scores


DENSE_CASES = {
    "batched-causal-r2": dict(lens_q=[5, 5], lens_k=[7, 7], q_offsets=[3, 0], ratio=2, causal=True),
    "packed-varlen": dict(lens_q=[4, 0, 6], lens_k=[3, 5, 9], q_offsets=[0, 1, 2], ratio=1, causal=True),
    "packed-empty-keys": dict(lens_q=[3, 4], lens_k=[0, 6], q_offsets=None, ratio=1, causal=True),
    "not-causal": dict(lens_q=[3, 4], lens_k=[5, 2], q_offsets=None, ratio=1, causal=False),
}


def _dense_inputs(case, g, spec, H, D, w=False):
    cu_q = [0] + list(torch.tensor(spec["lens_q"]).cumsum(0).tolist())
    cu_k = [0] + list(torch.tensor(spec["lens_k"]).cumsum(0).tolist())
    q, kv = rand((cu_q[-1], H, D), case, g), rand((cu_k[-1], D), case, g)
    off = None if spec["q_offsets"] is None else torch.tensor(spec["q_offsets"], dtype=torch.int32)
    weights = rand((cu_q[-1], H), case, g, dtype=w_dtype(case)) if w else None
    return q, kv, weights, cu_q, cu_k, off


def _dense_kwargs(case, spec, cu_q, cu_k, off):
    kw = dict(ratio=spec["ratio"], causal=spec["causal"], max_seqlen_k=max(spec["lens_k"]) + 1)
    kw["q_offsets"] = None if off is None else off.to(case.device)
    kw["cu_seqlens_q"] = torch.tensor(cu_q, dtype=torch.int32, device=case.device)
    kw["cu_seqlens_k"] = torch.tensor(cu_k, dtype=torch.int32, device=case.device)
    return kw


@pytest.mark.usefixtures("target_q")
@pytest.mark.parametrize("name", list(DENSE_CASES))
def test_dense_attention_target(case, call, name):
    spec = DENSE_CASES[name]
    g = gen(7)
    q, kv, _, cu_q, cu_k, off = _dense_inputs(case, g, spec, H=4, D=24)
    kw = _dense_kwargs(case, spec, cu_q, cu_k, off)
    exp = bf_dense_target(q, kv, cu_q, cu_k, off, spec["ratio"], spec["causal"], 0.4, kw["max_seqlen_k"])
    if name.startswith("batched"):
        B, S, Sk = len(spec["lens_q"]), spec["lens_q"][0], spec["lens_k"][0]
        got = call(dsa.dense_attention_target, q.view(B, S, 4, 24), kv.view(B, Sk, 24), ratio=spec["ratio"],
                   sm_scale=0.4, q_offsets=kw["q_offsets"], backend=case.backend)
        exp = exp[:, :Sk].reshape(B, S, Sk)
    else:
        got = call(dsa.dense_attention_target, q, kv, sm_scale=0.4, backend=case.backend, **kw)
    rel_close(got, exp, TOL[case.dtype], "dense target")


def _scores_bwd(case, a, dscores):
    return ops.indexer_scores_bwd(a, dscores, case.backend)


def _dense_backward_problem(case, name, seed):
    """(q, k, weights, IndexerArgs, dscores, float64 (dq, dk, dweights)) of a DENSE_CASES case:
    dscores NaN where a row sees no key (never read), in the case's score dtype and device."""
    spec = DENSE_CASES[name]
    g = gen(seed)
    q, k, w, cu_q, cu_k, off = _dense_inputs(case, g, spec, H=3, D=16, w=True)
    kw = _dense_kwargs(case, spec, cu_q, cu_k, off)
    a, _ = _checks.indexer_args(q, k, w, sm_scale=0.6, **kw)
    dscores = torch.randn(q.shape[0], kw["max_seqlen_k"], generator=g, dtype=torch.float64)
    ql, kl, wl = leaves(q, k, w)
    exp = bf_dense_scores(ql, kl, wl, cu_q, cu_k, off, spec["ratio"], spec["causal"], 0.6, kw["max_seqlen_k"])
    exp.backward(torch.where(torch.isfinite(exp), dscores, 0.0))
    dscores = torch.where(torch.isfinite(exp), dscores, float("nan"))
    return q, k, w, a, dscores.to(score_dtype(case)).to(case.device), (ql.grad, kl.grad, wl.grad)


@pytest.mark.usefixtures("indexer_rows")
@pytest.mark.parametrize("name", ["batched-causal-r2", "packed-varlen", "not-causal"])
def test_indexer_scores_backward(case, call, name):
    """The backward op of dsa::indexer_scores on this backend (forward independent of it)."""
    q, k, w, a, dscores, expected = _dense_backward_problem(case, name, 8)
    got = call(_scores_bwd, case, a, dscores)
    for name_, x, gx, ex in zip(("dq", "dk", "dweights"), (q, k, w), got, expected):
        assert gx.dtype == x.dtype
        rel_close(gx, ex, GRAD_TOL[case.dtype], name_)


def test_indexer_scores_autograd(fast_case, call):
    case = fast_case
    if case.backend == "triton" and importlib.util.find_spec("dsa.triton.indexer") is None:
        pytest.skip("triton: the indexer_scores forward kernel is not available yet")
    spec = DENSE_CASES["packed-varlen"]
    g = gen(9)
    q, k, w, cu_q, cu_k, off = _dense_inputs(case, g, spec, H=3, D=16, w=True)
    kw = _dense_kwargs(case, spec, cu_q, cu_k, off)
    dscores = torch.randn(q.shape[0], kw["max_seqlen_k"], generator=g)
    got, grads = call(grads_of, lambda a, b, c: dsa.indexer_scores(a, b, c, backend=case.backend, **kw),
                      [q, k, w], dscores.to(case.device))
    ql, kl, wl = leaves(q, k, w)
    exp = bf_dense_scores(ql, kl, wl, cu_q, cu_k, off, spec["ratio"], spec["causal"], 1.0, kw["max_seqlen_k"])
    exp.backward(torch.where(torch.isfinite(exp), dscores.double(), 0.0))
    for name, gx, ex in zip(("dq", "dk", "dweights"), grads, (ql.grad, kl.grad, wl.grad)):
        rel_close(gx, ex, max(GRAD_TOL[case.dtype], 1e-5), name)  # fp32 scores even for fp64 inputs


# --------------------------------------------------------------------------
# gradcheck (float64, reference)


def _f64_inputs(seed, T=5, H=2, D=6, N=9, K=7):
    g = gen(seed)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(N, D, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, w, slot_indices((T, K), N, g), lengths(T, K)


def test_gradcheck_sparse_indexer_scores():
    q, k, w, idx, tl = _f64_inputs(10)

    def f(q, k, w):
        s = dsa.sparse_indexer_scores(q, k, w, idx, sm_scale=0.8, topk_length=tl, backend="reference")
        return torch.where(torch.isfinite(s), s, 0.0)

    assert torch.autograd.gradcheck(f, (q, k, w))


def test_gradcheck_indexer_kl_loss():
    q, k, w, idx, tl = _f64_inputs(11)
    target = random_target(bf_valid(idx, tl, k.shape[0]), gen(12))

    def f(q, k, w):
        return dsa.indexer_kl_loss(q, k, w, idx, target, sm_scale=0.8, topk_length=tl, backend="reference")

    assert torch.autograd.gradcheck(f, (q, k, w))


def test_gradcheck_indexer_scores():
    g = gen(0)
    q = torch.randn(2, 4, 2, 5, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 4, 2, generator=g, dtype=torch.float64, requires_grad=True)
    off = torch.tensor([2, 0], dtype=torch.int32)
    # no relu kink within the finite-difference step
    assert torch.einsum("bihd,bjd->bihj", q, k).abs().min() > 1e-2

    def f(q, k, w):
        s = dsa.indexer_scores(q, k, w, ratio=1, q_offsets=off, sm_scale=0.7, backend="reference")
        return torch.where(torch.isfinite(s), s, 0.0)

    # the reference's scores are fp32 even for float64 inputs: a large step, tolerance above fp32 rounding
    assert torch.autograd.gradcheck(f, (q, k, w), eps=1e-3, atol=2e-3, rtol=1e-2)


# --------------------------------------------------------------------------
# edge cases


def test_rows_without_valid_slot_contribute_nothing(fast_case, call):
    case = fast_case
    g = gen(14)
    q, k, w, idx, _ = indexer_inputs(case, g, T=6, K=8)
    idx = idx.clone()
    idx[1] = -1  # no valid index
    tl = torch.tensor([8, 8, 0, 8, 8, 8], dtype=torch.int32)  # row 2: length 0
    idx, tl = on(case, idx, tl)
    q = q.clone()
    q[1] = float("nan")  # even NaN queries on an empty row give zero gradients
    target = random_target(bf_valid(idx.cpu(), tl.cpu(), k.shape[0]), g).float().to(case.device)
    fn = lambda a, b, c: dsa.indexer_kl_loss(a, b, c, idx, target, topk_length=tl, backend=case.backend)  # noqa
    loss, (dq, dk, dw) = call(grads_of, fn, [q, k, w])
    keep = torch.tensor([0, 3, 4, 5])
    sub = call(dsa.indexer_kl_loss, q[keep], k, w[keep], idx[keep], target[keep], topk_length=tl[keep],
               backend=case.backend)
    rel_close(loss, sub, TOL[case.dtype], "loss without the empty rows")
    for x in (dq, dw):
        assert torch.all(x[1:3] == 0)
    assert torch.isfinite(dk).all()
    logits = call(dsa.sparse_indexer_scores, q, k, w, idx, topk_length=tl, backend=case.backend)
    assert torch.isneginf(logits[1:3]).all()


def test_no_valid_row_gives_zero_loss(fast_case, call):
    case = fast_case
    g = gen(15)
    q, k, w, idx, _ = indexer_inputs(case, g, T=3, K=8)
    idx = torch.full_like(idx, -1).to(case.device)
    target = torch.zeros(idx.shape, device=case.device)
    loss, grads = call(grads_of, lambda a, b, c: dsa.indexer_kl_loss(a, b, c, idx, target, backend=case.backend),
                       [q, k, w])
    assert loss.item() == 0.0
    assert all(torch.all(x == 0) for x in grads)
    tgt = call(dsa.attention_target, q, k, idx, torch.full((3, 3), float("inf"), device=case.device),
               backend=case.backend)
    assert torch.all(tgt == 0)


def test_nan_in_unreferenced_rows_never_leaks(fast_case, call):
    case = fast_case
    g = gen(16)
    T, H, D, N, K = 5, 3, 16, 12, 8
    q, w = rand((T, H, D), case, g), rand((T, H), case, g, dtype=torch.float32)
    k = rand((N, D), case, g)
    idx = torch.randint(0, 6, (T, K), generator=g, dtype=torch.int32)  # rows 0..5 only
    idx[:, -1] = 7  # slot past topk_length (K - 1): never read
    tl = torch.full((T,), K - 1, dtype=torch.int32)
    k = k.clone()
    k[6:] = float("nan")
    idx, tl = on(case, idx, tl)
    target = random_target(bf_valid(idx.cpu(), tl.cpu(), N), g).float().to(case.device)
    fn = lambda a, b, c: dsa.indexer_kl_loss(a, b, c, idx, target, topk_length=tl, backend=case.backend)  # noqa
    loss, (dq, dk, dw) = call(grads_of, fn, [q, k, w])
    assert torch.isfinite(loss) and torch.isfinite(dq).all() and torch.isfinite(dw).all()
    assert torch.isfinite(dk[:6]).all() and torch.all(dk[6:] == 0)
    fn2 = lambda a, b, c: dsa.sparse_indexer_scores(a, b, c, idx, topk_length=tl, backend=case.backend)  # noqa
    lg, (dq, dk, dw) = call(grads_of, fn2, [q, k, w], torch.ones(T, K, device=case.device))
    assert not torch.isnan(lg).any() and torch.isfinite(dq).all() and torch.all(dk[6:] == 0)
    # attention target: NaN in kv rows no slot references
    kv = rand((N, 32), case, g)
    kv[6:] = float("nan")
    qa = rand((T, 4, 32), case, g)
    _, lse = dsa.sparse_attention(qa, kv, idx, topk_length=tl, return_lse=True, backend="reference")
    tgt = call(dsa.attention_target, qa, kv, idx, lse, topk_length=tl, backend=case.backend)
    assert torch.isfinite(tgt).all()


def test_duplicates_are_separate_slots(fast_case, call):
    case = fast_case
    g = gen(17)
    q, k, w, _, _ = indexer_inputs(case, g, T=2, K=4)
    idx = torch.tensor([[3, 3, 3, 5], [5, 5, 1, 1]], dtype=torch.int32, device=case.device)
    target = torch.tensor([[0.2, 0.2, 0.2, 0.4], [0.25, 0.25, 0.25, 0.25]], device=case.device)
    loss, (dq, dk, dw) = call(grads_of, lambda a, b, c: dsa.indexer_kl_loss(a, b, c, idx, target,
                                                                          backend=case.backend), [q, k, w])
    ql, kl, wl = leaves(q, k, w)
    exp = bf_kl(ql, kl, wl, idx.cpu(), target.cpu().double(), None, 1.0)
    exp.backward()
    rel_close(loss, exp, TOL[case.dtype], "loss")
    rel_close(dk, kl.grad, GRAD_TOL[case.dtype], "dk_i")
    _, lse = dsa.sparse_attention(q, k, idx, return_lse=True, backend="reference")
    tgt = call(dsa.attention_target, q, k, idx, lse, backend=case.backend)
    assert torch.allclose(tgt[0, 0], tgt[0, 2]) and torch.allclose(tgt.sum(-1).double().cpu(),
                                                                    torch.ones(2, dtype=torch.float64), atol=1e-2)


def test_far_out_of_range_indices(fast_case, call):
    case = fast_case
    g = gen(18)
    q, k, w, idx, _ = indexer_inputs(case, g, T=3, K=4)
    idx = torch.tensor([[2**31 - 1, 0, -(2**31), 1]] * 3, dtype=torch.int32, device=case.device)
    lg = call(dsa.sparse_indexer_scores, q, k, w, idx, backend=case.backend)
    assert torch.isneginf(lg[:, [0, 2]]).all() and torch.isfinite(lg[:, [1, 3]]).all()


def test_empty_problems(fast_case, call):
    case = fast_case
    g = gen(19)
    q, k, w, _, _ = indexer_inputs(case, g, T=3, K=4)
    idx0 = torch.zeros(3, 0, dtype=torch.int32, device=case.device)
    lg = call(dsa.sparse_indexer_scores, q, k, w, idx0, backend=case.backend)
    assert lg.shape == (3, 0)
    loss = call(dsa.indexer_kl_loss, q, k, w, idx0, torch.zeros(3, 0, device=case.device), backend=case.backend)
    assert loss.item() == 0.0
    qe, we = q[:0], w[:0]
    idx = torch.zeros(0, 4, dtype=torch.int32, device=case.device)
    assert call(dsa.sparse_indexer_scores, qe, k, we, idx, backend=case.backend).shape == (0, 4)
    tgt = call(dsa.attention_target, qe, k, idx, torch.zeros(0, 3, device=case.device), backend=case.backend)
    assert tgt.shape == (0, 4)


def _indexer_grads(call, fn_name, backend, q, k, w, idx, tl, target, dl, det):
    """(dq, dk, dweights) of indexer_kl_loss (against ``target``) or of
    sparse_indexer_scores (with upstream gradient ``dl``)."""
    if fn_name == "indexer_kl_loss":
        f = lambda a, b, c: dsa.indexer_kl_loss(a, b, c, idx, target, topk_length=tl,  # noqa: E731
                                                deterministic=det, backend=backend)
        return call(grads_of, f, [q, k, w])[1]
    f = lambda a, b, c: dsa.sparse_indexer_scores(a, b, c, idx, topk_length=tl,  # noqa: E731
                                                  deterministic=det, backend=backend)
    return call(grads_of, f, [q, k, w], dl)[1]


@pytest.mark.usefixtures("indexer_rows")
@pytest.mark.parametrize("fn_name", ["sparse_indexer_scores", "indexer_kl_loss"])
def test_deterministic_is_bitwise_repeatable(fast_case, call, fn_name):
    case = fast_case
    g = gen(20)
    q, k, w, idx, tl = indexer_inputs(case, g, T=9, N=6, K=16)  # few keys: many rows scatter into each
    idx, tl = on(case, idx, tl)
    target = random_target(bf_valid(idx.cpu(), tl.cpu(), 6), g).float().to(case.device)
    dl = torch.randn(idx.shape, generator=g).to(case.device)

    def run(det):
        return _indexer_grads(call, fn_name, case.backend, q, k, w, idx, tl, target, dl, det)

    first, second, loose = run(True), run(True), run(False)
    for a, b, c in zip(first, second, loose):
        assert torch.equal(a, b)
        rel_close(c, a, GRAD_TOL[case.dtype], "deterministic vs atomic")
    if case.backend == "triton":  # query rows in chunks of 4, each chunk summed in order
        from dsa.triton import segment_sum

        old = segment_sum.WORKSPACE_BYTES
        try:
            segment_sum.WORKSPACE_BYTES = 4 * idx.shape[-1] * q.shape[-1] * 4
            chunked, again = run(True), run(True)
        finally:
            segment_sum.WORKSPACE_BYTES = old
        for a, b, c in zip(first, chunked, again):
            assert torch.equal(b, c)
            rel_close(b, a, 1e-6, "chunked vs one chunk")


CPU_BACKENDS = ["reference"] + (["triton"] if importlib.util.find_spec("triton") and not torch.cuda.is_available()
                                else [])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_torch_deterministic_setting_means_deterministic(torch_deterministic, backend, monkeypatch):
    """Under torch.use_deterministic_algorithms(True) every op with a deterministic mode runs it, as with
    deterministic=True: the backends are told so, and the gradients are bitwise deterministic=True's."""
    told = []
    checks = _checks.sparse_attention_args
    monkeypatch.setattr(_checks, "sparse_attention_args",
                        lambda *a: (lambda r: told.append(r[0].deterministic) or r)(checks(*a)))
    g = gen(31)
    q, kv = torch.randn(5, 2, 16, generator=g), torch.randn(4, 16, generator=g)  # few rows: shared dkv rows
    w, idx = torch.randn(5, 2, generator=g), torch.randint(-1, 4, (5, 6), generator=g, dtype=torch.int32)
    target = torch.rand(5, 6, generator=g)
    calls = {
        "sparse_attention": lambda a, b, c, det: dsa.sparse_attention(a, b, idx, deterministic=det,
                                                                      backend=backend).square().sum(),
        "sparse_indexer_scores": lambda a, b, c, det: dsa.sparse_indexer_scores(
            a, b, c, idx, deterministic=det, backend=backend).nan_to_num(neginf=0.0).square().sum(),
        "indexer_kl_loss": lambda a, b, c, det: dsa.indexer_kl_loss(a, b, c, idx, target, deterministic=det,
                                                                    backend=backend),
    }
    for name, f in calls.items():
        told.clear()
        ins = [x.clone().requires_grad_() for x in (q, kv, w)]
        got = torch.autograd.grad(f(*ins, False), ins, allow_unused=True)
        assert told and all(told), name
        torch.use_deterministic_algorithms(False)
        try:
            ins = [x.clone().requires_grad_() for x in (q, kv, w)]
            want = torch.autograd.grad(f(*ins, True), ins, allow_unused=True)
        finally:
            torch.use_deterministic_algorithms(True)
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.skipif(not importlib.util.find_spec("triton") or torch.cuda.is_available(),
                    reason="the Triton backward under the interpreter (CPU)")
@pytest.mark.parametrize("name", list(DENSE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_torch_deterministic_setting_dense_indexer_backward(torch_deterministic, name, dtype, monkeypatch):
    """indexer_scores has no keyword of its own: under torch.use_deterministic_algorithms(True) its Triton
    backward sums dk by key with no atomics (``_dense_dk_kernel``): within the dtype's tolerance of
    float64 on the varlen, ratio-causal and empty cases, bitwise over runs, dq and dweights bitwise the
    default pass's."""
    from conftest import Case
    from dsa.triton import indexer_bwd

    case = Case("cpu", "triton", dtype)
    dk_modes = []
    launch = indexer_bwd._launch
    monkeypatch.setattr(indexer_bwd, "_launch", lambda p, *a, **k: dk_modes.append(a[5]) or launch(p, *a, **k))
    q, k, w, a, dscores, expected = _dense_backward_problem(case, name, 33)
    first, again = ops.indexer_scores_bwd(a, dscores, "triton"), ops.indexer_scores_bwd(a, dscores, "triton")
    assert dk_modes == [int(indexer_bwd.DK_NONE)] * 2
    for name_, x, gx, ex, ax in zip(("dq", "dk", "dweights"), (q, k, w), first, expected, again):
        assert gx.dtype == x.dtype and torch.equal(gx, ax), name_
        rel_close(gx, ex, GRAD_TOL[dtype], name_)
    torch.use_deterministic_algorithms(False)
    atomic = ops.indexer_scores_bwd(a, dscores, "triton")
    assert torch.equal(atomic[0], first[0]) and torch.equal(atomic[2], first[2])


@pytest.mark.parametrize("fn_name", ["sparse_indexer_scores", "indexer_kl_loss"])
def test_deterministic_chunked_against_float64(fast_case, call, fn_name, monkeypatch):
    """The deterministic backward over chunks of 4 query rows (the last one
    short), topk_length, duplicates and invalid indices in: every gradient
    within the dtype's tolerance of float64; dq and dweights (the same pass,
    dk stored instead of added) the non-deterministic path's (for the KL
    loss to fp32 rounding: the deterministic forward takes its stats from
    the logits), and dk within fp32 reordering of its."""
    case = fast_case
    if case.backend != "triton":
        pytest.skip("the Triton deterministic dk")
    from dsa.triton import segment_sum

    g = gen(26)
    T, N, K = 9, 6, 16
    q, k, w, idx, tl = indexer_inputs(case, g, T=T, N=N, K=K)
    valid = bf_valid(idx, tl, N)
    assert (idx[:, 0] == idx[:, 1]).all() and ((idx < 0) | (idx >= N)).any() and valid.any()
    ql, kl, wl = leaves(q, k, w)
    dl = torch.randn(idx.shape, generator=g, dtype=torch.float64)
    target = None
    if fn_name == "indexer_kl_loss":
        target = random_target(valid, g)
        bf_kl(ql, kl, wl, idx, target, tl, 1.0).backward()
        target = target.float().to(case.device)
    else:
        bf_logits(ql, kl, wl, idx, tl, 1.0).backward(torch.where(valid, dl, 0.0))
    dl = dl.to(case.device, torch.float32)
    idx, tl = on(case, idx, tl)
    monkeypatch.setattr(segment_sum, "WORKSPACE_BYTES", 4 * K * q.shape[-1] * 4)  # rows 0-3, 4-7, 8

    def run(det):
        return _indexer_grads(call, fn_name, case.backend, q, k, w, idx, tl, target, dl, det)

    det, loose = run(True), run(False)
    for name, x, y, ref in zip(("dq", "dk", "dw"), det, loose, (ql.grad, kl.grad, wl.grad)):
        rel_close(x, ref, GRAD_TOL[case.dtype], f"{name} vs float64")
        if name != "dk" and case.device == "cpu" and fn_name != "indexer_kl_loss":
            assert torch.equal(x, y), name
        else:  # dk's sums in another order (and on the GPU, kernels that may pick other MMA instructions)
            rel_close(x, y, GRAD_TOL[case.dtype] if case.low_precision else 1e-6, f"{name} vs atomic")


def grouped_positions(keys: torch.Tensor, chunk: int, n_dst: int):
    """The oracle of ``segment_sum.slot_positions``, in torch: (pos [M] int32,
    start [C, n_dst + 1] int64) for M workspace rows with destination
    ``keys`` (>= n_dst: never summed) written in chunks of ``chunk`` rows;
    row i goes to position pos[i] of its chunk's workspace, where the rows of
    destination n are start[c, n] .. start[c, n + 1], in ascending i."""
    M = keys.numel()
    C = max(1, -(-M // chunk))
    span = n_dst + 1
    row = torch.arange(M, device=keys.device)
    comp_sorted, order = torch.sort((row // chunk) * span + keys.clamp(0, n_dst), stable=True)
    pos = torch.empty(M, device=keys.device, dtype=torch.int32)
    pos[order] = (row - (order // chunk) * chunk).to(torch.int32)  # chunk c fills ranks [c chunk, (c + 1) chunk)
    bounds = torch.arange(C, device=keys.device)[:, None] * span + torch.arange(span, device=keys.device)[None, :]
    start = torch.searchsorted(comp_sorted, bounds.flatten()).view(C, span)
    return pos, start - torch.arange(C, device=keys.device)[:, None] * chunk


def test_grouped_positions():
    """The oracle: each chunk's rows land on a permutation of its positions,
    grouped by key in ascending row order, with start bounding every key's
    run; keys >= n_dst (invalid) last, in no run."""
    g = gen(27)
    n_dst, chunk, M = 5, 7, 26
    keys = torch.randint(0, n_dst + 3, (M,), generator=g)
    pos, start = grouped_positions(keys, chunk, n_dst)
    assert pos.dtype == torch.int32 and start.shape == (4, n_dst + 1)
    for c in range(4):
        rows = torch.arange(c * chunk, min(M, (c + 1) * chunk))
        p = pos[rows].long()
        assert sorted(p.tolist()) == list(range(rows.numel()))
        for n in range(n_dst):
            run = rows[keys[rows] == n]
            assert p[keys[rows] == n].tolist() == list(range(int(start[c, n]), int(start[c, n + 1])))
            assert run.tolist() == sorted(run.tolist())
        assert int(start[c, n_dst]) == int((keys[rows] < n_dst).sum())


@pytest.mark.parametrize("T, K, N, rows, with_len", [(9, 37, 11, 4, True), (5, 70, 300, 5, False),
                                                    (3, 16, 7, 1, True), (4, 0, 5, 2, False)])
def test_slot_positions_match_grouped_positions(T, K, N, rows, with_len):
    """The kernels' positions equal grouped_positions of the slots' keys (the
    index where valid, N where not), chunk for chunk, on hostile indices and
    every kind of row length."""
    from dsa._rules import slot_validity
    from dsa.triton.segment_sum import slot_positions

    g = gen(T * K + N)
    idx = torch.randint(-3, N + 3, (T, K), generator=g, dtype=torch.int32)
    idx[0, : K // 2] = 2**31 - 1
    idx[-1, ::3] = 1  # duplicates in a row
    tl = torch.randint(-2, K + 3, (T,), generator=g, dtype=torch.int32) if with_len else None
    pos, start = slot_positions(idx, tl, N, rows)
    if K == 0:  # no slots: every chunk's segments empty
        assert pos.numel() == 0 and torch.equal(start, torch.zeros(-(-T // rows), N + 1, dtype=torch.int64))
        return
    valid, safe = slot_validity(idx, tl, N)
    exp_pos, exp_start = grouped_positions(torch.where(valid, safe, N).view(-1), rows * K, N)
    assert pos.dtype == torch.int32 and torch.equal(pos, exp_pos)
    assert torch.equal(start, exp_start)


def _det_dk_grads(case, q, k, w, idx, tl, dl, sm_scale=1.0):
    f = lambda a, b, c: dsa.sparse_indexer_scores(a, b, c, idx, topk_length=tl, sm_scale=sm_scale,  # noqa: E731
                                                  deterministic=True, backend=case.backend)
    return grads_of(f, [q, k, w], dl)[1]


@pytest.mark.parametrize("w_scale", [1e-30, 1.0, 1e30])
def test_deterministic_dk_against_float64(fast_case, call, w_scale):
    """The deterministic dk at any magnitude, within fp32 rounding of float64;
    duplicates and invalid slots in."""
    case = fast_case
    if case.backend != "triton":
        pytest.skip("the Triton deterministic dk")
    g = gen(24)
    q, k, w, idx, tl = indexer_inputs(case, g, T=6, N=5, K=12)
    w = w * w_scale
    valid = bf_valid(idx, tl, k.shape[0])
    dl = torch.randn(valid.shape, generator=g, dtype=torch.float64)
    ql, kl, wl = leaves(q, k, w)
    exp = bf_logits(ql, kl, wl, idx, tl, 0.7)
    exp.backward(torch.where(valid, dl, 0.0))
    dl = torch.where(valid, dl, float("nan"))  # never read, not even by the bound
    idx, tl = on(case, idx, tl)
    dq, dk, dw = call(_det_dk_grads, case, q, k, w, idx, tl, dl.to(case.device, score_dtype(case)), 0.7)
    tol = GRAD_TOL[case.dtype] if case.low_precision else 2e-6
    rel_close(dk, kl.grad, tol, "dk_i")
    rel_close(dw, wl.grad, max(tol, GRAD_TOL[case.dtype]), "dweights")


def test_deterministic_dk_non_finite_term(fast_case, call):
    """A NaN gradient on one valid slot: the key row it reaches is NaN, every
    other key row keeps its float64 value."""
    case = fast_case
    if case.backend != "triton":
        pytest.skip("the Triton deterministic dk")
    g = gen(25)
    T, H, D, N, K = 5, 3, 16, 9, 6
    q, k, w = rand((T, H, D), case, g), rand((N, D), case, g), rand((T, H), case, g, dtype=torch.float32)
    idx = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    dots = torch.einsum("hd,kd->hk", q[0].double().cpu(), k[idx[0].long()].double().cpu())
    j0 = int(torch.nonzero((dots > 0).any(0))[0])  # a slot of row 0 that some head passes through relu
    n0 = int(idx[0, j0])
    dl = torch.randn(T, K, generator=g, dtype=torch.float64)
    ql, kl, wl = leaves(q, k, w)
    dl[0, j0] = 0.0
    bf_logits(ql, kl, wl, idx, None, 1.0).backward(dl)
    dl[0, j0] = float("nan")
    dq, dk, dw = call(_det_dk_grads, case, q, k, w, idx.to(case.device), None, dl.to(case.device, torch.float32))
    assert torch.isnan(dk[n0]).all()
    keep = torch.arange(N) != n0
    tol = GRAD_TOL[case.dtype] if case.low_precision else 2e-6
    rel_close(dk[keep.to(dk.device)], kl.grad[keep], tol, "the other key rows")


# --------------------------------------------------------------------------
# API: explain, errors, torch.compile


def test_explain_every_training_op():
    g = gen(21)
    q, kv = torch.randn(3, 2, 8, generator=g), torch.randn(5, 8, generator=g)
    idx = torch.zeros(3, 4, dtype=torch.int32)
    lse = torch.zeros(3, 2)
    for text in (
        dsa.explain("attention_target", q, kv, idx, lse),
        dsa.explain(dsa.sparse_indexer_scores, q, kv, lse, idx),
        dsa.explain("indexer_kl_loss", q, kv, lse, idx, torch.zeros(3, 4)),
        dsa.explain("dense_attention_target", q.unsqueeze(0), kv.unsqueeze(0)),
    ):
        assert "backend '" in text


def test_errors_name_the_arguments():
    q, k, w = torch.randn(3, 2, 8), torch.randn(5, 8), torch.randn(3, 2)
    idx = torch.zeros(3, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^k_i: .*head dim"):
        dsa.sparse_indexer_scores(q, torch.randn(5, 6), w, idx)
    with pytest.raises(ValueError, match=r"^k_i: .*dtype"):
        dsa.sparse_indexer_scores(q, k.double(), w, idx)
    with pytest.raises(ValueError, match=r"^k_i: .*one shared key"):
        dsa.sparse_indexer_scores(q, k.view(5, 1, 8), w, idx)
    with pytest.raises(ValueError, match=r"^q_i: "):
        dsa.sparse_indexer_scores(q[0], k, w, idx)
    with pytest.raises(ValueError, match=r"^weights: "):
        dsa.sparse_indexer_scores(q, k, w[:, :1], idx)
    with pytest.raises(ValueError, match=r"^indices: .*q_i"):
        dsa.sparse_indexer_scores(q, k, w, idx[:2])
    with pytest.raises(TypeError, match=r"^sm_scale: "):
        dsa.sparse_indexer_scores(q, k, w, idx, sm_scale=None)
    with pytest.raises(ValueError, match=r"^target: "):
        dsa.indexer_kl_loss(q, k, w, idx, torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"^lse: "):
        dsa.attention_target(q, k, idx, torch.zeros(3, 3))
    with pytest.raises(TypeError, match=r"^lse: "):
        dsa.attention_target(q, k, idx, torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^kv: .*dtype"):
        dsa.dense_attention_target(q, k.half())
    with pytest.raises(ValueError, match=r"^ratio: "):
        dsa.dense_attention_target(q, k, ratio=0)


def test_torch_compile_fullgraph():
    q, k, w, idx, tl = indexer_inputs(type("C", (), {"dtype": torch.float32, "device": "cpu"}), gen(22), T=4, K=6)
    target = random_target(bf_valid(idx, tl, k.shape[0]), gen(23)).float()

    def step(q, k, w):
        logits = dsa.sparse_indexer_scores(q, k, w, idx, topk_length=tl, backend="reference")
        loss = dsa.indexer_kl_loss(q, k, w, idx, target, topk_length=tl, backend="reference")
        return loss + torch.where(torch.isfinite(logits), logits, 0.0).sum() * 1e-3

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    (a, ga), (b, gb) = grads_of(step, [q, k, w]), grads_of(compiled, [q, k, w])
    assert torch.allclose(a, b)
    assert all(torch.allclose(x, y) for x, y in zip(ga, gb))


# --------------------------------------------------------------------------
# GPU (bf16) at reduced model shapes


@pytest.mark.gpu
def test_gpu_bf16_model_shapes():
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    T, H, D, N, K = 64, 128, 576, 1024, 512
    q = torch.randn(T, H, D, device=dev, dtype=bf16, generator=g)
    kv = torch.randn(N, D, device=dev, dtype=bf16, generator=g)
    idx = torch.randint(-8, N, (T, K), device=dev, dtype=torch.int32, generator=g)
    tl = torch.randint(0, K + 1, (T,), device=dev, dtype=torch.int32, generator=g)
    _, lse = dsa.sparse_attention(q, kv, idx, topk_length=tl, return_lse=True, backend="reference")
    a = dsa.attention_target(q, kv, idx, lse, topk_length=tl, backend="triton")
    b = dsa.attention_target(q, kv, idx, lse, topk_length=tl, backend="reference")
    rel_close(a, b, 2e-2, "target")
    from dsa.triton import training as tt

    default = dict(tt.TARGET_CONFIGS)
    try:  # the kernel's other options
        for name, opts in TARGET_VARIANTS.items():
            tt.TARGET_CONFIGS.update(target_configs(*opts))
            rel_close(dsa.attention_target(q, kv, idx, lse, topk_length=tl, backend="triton"), b, 2e-2, name)
    finally:
        tt.TARGET_CONFIGS.update(default)
    Hi, Di = 64, 128
    qi = torch.randn(T, Hi, Di, device=dev, dtype=bf16, generator=g)
    ki = torch.randn(N, Di, device=dev, dtype=bf16, generator=g)
    wi = torch.randn(T, Hi, device=dev, generator=g) * Hi**-0.5
    res = {}
    for be in ("triton", "reference"):
        for det in ((False, True) if be == "triton" else (False,)):
            f = lambda x, y, z: dsa.indexer_kl_loss(x, y, z, idx, b, topk_length=tl, sm_scale=Di**-0.5,  # noqa
                                                    deterministic=det, backend=be)
            res[be, det] = grads_of(f, [qi, ki, wi])
    ref_loss, ref_grads = res["reference", False]
    for key in (("triton", False), ("triton", True)):
        loss, grads = res[key]
        rel_close(loss, ref_loss, 2e-2, f"{key} loss")
        for name, x, y in zip(("dq", "dk", "dw"), grads, ref_grads):
            rel_close(x, y, 4e-2, f"{key} {name}")


@pytest.mark.gpu
def test_gpu_torch_deterministic_dense_indexer_backward(torch_deterministic):
    """On the GPU, under torch.use_deterministic_algorithms(True): the Triton indexer_scores backward at
    H_i 64 / D_i 128 bf16, two sequences (varlen, ratio 4), bitwise over runs, dq and dweights bitwise the
    atomic pass's, dk within bf16 rounding of it."""
    g = torch.Generator(device="cuda").manual_seed(5)
    dev, bf16 = "cuda", torch.bfloat16
    lens_q, lens_k = [700, 324], [300, 200]
    q = torch.randn(sum(lens_q), 64, 128, device=dev, dtype=bf16, generator=g)
    k = torch.randn(sum(lens_k), 128, device=dev, dtype=bf16, generator=g)
    w = torch.randn(sum(lens_q), 64, device=dev, generator=g) * 0.125
    cu_q = torch.tensor([0, 700, 1024], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, 300, 500], dtype=torch.int32, device=dev)
    # ratio 4, sm_scale 1, causal, no q_offsets, varlen, max_seqlen_k 300
    a, _ = _checks.indexer_args(q, k, w, 4, 1.0, True, None, cu_q, cu_k, 300)
    dscores = torch.randn(sum(lens_q), 300, device=dev, generator=g)
    first, again = ops.indexer_scores_bwd(a, dscores, "triton"), ops.indexer_scores_bwd(a, dscores, "triton")
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    torch.use_deterministic_algorithms(False)
    atomic = ops.indexer_scores_bwd(a, dscores, "triton")
    assert torch.equal(atomic[0], first[0]) and torch.equal(atomic[2], first[2])
    rel_close(first[1], atomic[1], 1e-2, "dk")
