"""sparse_attention against the float64 brute force: every rule and edge case
of the "Sparse attention" section of docs/semantics.md, on every backend.

Sizes stay tiny (D=32, d_v=16, H<=5, K<=40, T<=6) so the Triton interpreter
keeps up; the reference backend also gets a few larger shapes.
"""

from __future__ import annotations

import math

import pytest
import torch

import bruteforce as bf
import dsa

INF = float("inf")


# --------------------------------------------------------------------------
# helpers


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(shape, case, gen, scale=1.0) -> torch.Tensor:
    """Random normal values in the case's dtype and on its device."""
    return (torch.randn(shape, generator=gen) * scale).to(case.dtype).to(case.device)


def distinct_indices(rows_shape, K, N, gen, device="cpu") -> torch.Tensor:
    """int32 [*rows_shape, K]: each row K distinct rows of [0, N) (needs K <= N),
    so reading a wrong row changes the result."""
    n_rows = math.prod(rows_shape)
    out = torch.stack([torch.randperm(N, generator=gen)[:K] for _ in range(n_rows)]) if n_rows else torch.zeros(0, K)
    return out.reshape(*rows_shape, K).to(torch.int32).to(device)


def f64_leaves(gen, T, H, G, D, N):
    """q [T, H, D], kv [N, G, D] and sink [H]: float64 leaves that require grad."""
    shapes = ((T, H, D), (N, G, D), (H,))
    return [torch.randn(*sh, generator=gen, dtype=torch.float64, requires_grad=True) for sh in shapes]


def packed_inputs(case, gen, T, H, D, K, N, idx_device=None):
    """q [T, H, D], kv [N, D] and distinct in-range indices [T, K] (on idx_device, default case's)."""
    q = rand((T, H, D), case, gen)
    kv = rand((N, D), case, gen)
    return q, kv, distinct_indices((T,), K, N, gen, idx_device or case.device)


def run(call, case, q, kv, indices, *, grads=True, dout=None, seed=123, **kw):
    """Call dsa.sparse_attention (return_lse=True) and, with ``grads``, its
    backward for a random dout. Returns (results dict, dout)."""
    leaves = [q, kv] + ([kw["sink"]] if kw.get("sink") is not None else [])
    if grads:
        for t in leaves:
            t.requires_grad_(True)
    out, lse = call(dsa.sparse_attention, q, kv, indices, return_lse=True, backend=case.backend, **kw)
    res = {"out": out, "lse": lse}
    assert out.dtype == q.dtype, f"out dtype {out.dtype} != q dtype {q.dtype}"
    # fp32 lse (float64 is the reference backend's extension: full precision)
    lse_dtypes = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
    assert lse.dtype in lse_dtypes, f"lse dtype {lse.dtype}"
    assert out.device == q.device and lse.device == q.device
    if grads:
        if dout is None:
            dout = rand(out.shape, case, _gen(seed))
        g = call(torch.autograd.grad, (out,), leaves, (dout,))
        res["dq"], res["dkv"] = g[0], g[1]
        assert res["dq"].dtype == q.dtype and res["dkv"].dtype == kv.dtype
        if len(g) == 3:
            res["dsink"] = g[2]
            assert res["dsink"].dtype == kw["sink"].dtype and res["dsink"].shape == kw["sink"].shape
        for t in leaves:
            t.requires_grad_(False)
    return res, dout


def expect(q, kv, indices, dout=None, **kw):
    return bf.sparse_attention(q, kv, indices, dout=dout, **kw)


_PRECISION = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def check(res, exp, case, keys=None):
    for key in keys or res:
        if key in exp:
            # tolerance of the less precise of the inputs and the result (dsink is fp32)
            dt = max(case.dtype, res[key].dtype, key=_PRECISION.index)
            bf.assert_close(res[key], exp[key], dt, name=key)


def run_and_check(call, case, q, kv, indices, grads=True, **kw):
    res, dout = run(call, case, q, kv, indices, grads=grads, **kw)
    exp = expect(q, kv, indices, dout=dout, **kw)
    check(res, exp, case)
    return res, exp


def sink_tensor(values, case):
    return torch.tensor(values, dtype=torch.float32, device=case.device)


def lengths_tensor(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


# --------------------------------------------------------------------------
# the brute force itself, against an independent dense autograd formulation


def test_bruteforce_matches_dense_autograd():
    gen = _gen(0)
    T, H, G, D, d_v, N, K = 4, 4, 2, 8, 5, 10, 6
    q, kv, sink = f64_leaves(gen, T, H, G, D, N)
    idx = torch.randint(-2, N + 2, (T, G, K), generator=gen)
    tl = torch.tensor([6, 3, 0, 9])
    scale = 0.37
    # dense: mask[t, g, n] = number of valid slots of row t, group g hitting n
    cnt = torch.zeros(T, G, N, dtype=torch.float64)
    for t in range(T):
        for g in range(G):
            for j in range(min(max(int(tl[t]), 0), K)):
                if 0 <= idx[t, g, j] < N:
                    cnt[t, g, idx[t, g, j]] += 1
    kvh = kv.repeat_interleave(H // G, dim=1)  # [N, H, D]
    cnth = cnt.repeat_interleave(H // G, dim=1)  # [T, H, N]
    s = scale * torch.einsum("thd,nhd->thn", q, kvh)
    w = cnth * torch.exp(s - s.amax(-1, keepdim=True))
    m = s.amax(-1, keepdim=True)
    den = w.sum(-1, keepdim=True) + torch.exp(sink.view(1, H, 1) - m)
    out = torch.einsum("thn,nhd->thd", w / den, kvh[..., :d_v])
    lse = torch.where(cnth.sum(-1) > 0, m[..., 0] + torch.log(w.sum(-1)), torch.full_like(m[..., 0], INF))
    dout = torch.randn(T, H, d_v, generator=gen, dtype=torch.float64)
    dq, dkv, dsink = torch.autograd.grad(out, (q, kv, sink), dout)
    exp = bf.sparse_attention(q, kv, idx, sm_scale=scale, d_v=d_v, sink=sink, topk_length=tl, dout=dout)
    torch.testing.assert_close(exp["out"], out.detach())
    torch.testing.assert_close(exp["lse"], lse.detach())
    torch.testing.assert_close(exp["dq"], dq)
    torch.testing.assert_close(exp["dkv"], dkv)
    torch.testing.assert_close(exp["dsink"], dsink)
    # and the closed form of docs/semantics.md: dsink[h] = -sum_t exp(sink[h] - log den) * dout.out
    with torch.no_grad():
        log_den = m[..., 0] + torch.log(w.sum(-1) + torch.exp(sink.view(1, H) - m[..., 0]))
        closed = -(torch.exp(sink.view(1, H) - log_den) * (dout * out).sum(-1)).sum(0)
    torch.testing.assert_close(exp["dsink"], closed)


# --------------------------------------------------------------------------
# layouts and the basic formula, every backend and dtype


@pytest.mark.parametrize("T,H,K,N", [(5, 3, 24, 40), (1, 5, 17, 33), (6, 1, 40, 64), (4, 2, 1, 8)])
def test_packed_mqa(case, call, T, H, K, N):
    gen = _gen(1)
    D, d_v = 32, 16
    q, kv, idx = packed_inputs(case, gen, T, H, D, K, N)
    sink = rand((H,), case, gen).float()
    run_and_check(call, case, q, kv, idx, d_v=d_v, sink=sink)


@pytest.mark.parametrize("H,G", [(4, 2), (3, 3), (4, 4), (5, 1)])
def test_packed_gqa(case, call, H, G):
    gen = _gen(2)
    T, D, d_v, K, N = 4, 32, 16, 20, 36
    q = rand((T, H, D), case, gen)
    kv = rand((N, G, D), case, gen)
    idx = distinct_indices((T, G), K, N, gen, case.device)
    tl = lengths_tensor([20, 7, 13, 1], case.device)
    run_and_check(call, case, q, kv, idx, d_v=d_v, topk_length=tl)


def test_gqa_with_one_kv_head_equals_mqa(fast_case, call):
    case = fast_case
    gen = _gen(3)
    T, H, D, K, N = 3, 3, 32, 12, 20
    q, kv, idx = packed_inputs(case, gen, T, H, D, K, N)
    a = call(dsa.sparse_attention, q, kv, idx, d_v=16, backend=case.backend)
    b = call(dsa.sparse_attention, q, kv.unsqueeze(1), idx.unsqueeze(1), d_v=16, backend=case.backend)
    assert torch.equal(a, b)
    bf.assert_close(a, expect(q, kv, idx, d_v=16)["out"], case.dtype, "out")


def test_batched_mqa(case, call):
    gen = _gen(4)
    B, S, H, D, d_v, K, N = 2, 3, 3, 32, 16, 10, 16
    q = rand((B, S, H, D), case, gen)
    kv = rand((B, N, D), case, gen)
    idx = distinct_indices((B, S), K, N, gen, case.device)
    tl = lengths_tensor([[10, 4, 0], [7, 10, 2]], case.device)
    sink = rand((H,), case, gen).float()
    run_and_check(call, case, q, kv, idx, d_v=d_v, topk_length=tl, sink=sink)


def test_batched_gqa(case, call):
    gen = _gen(5)
    B, S, H, G, D, d_v, K, N = 2, 2, 4, 2, 32, 16, 9, 12
    q = rand((B, S, H, D), case, gen)
    kv = rand((B, N, G, D), case, gen)
    idx = distinct_indices((B, S, G), K, N, gen, case.device)
    run_and_check(call, case, q, kv, idx, d_v=d_v)


def test_batched_indices_are_local(fast_case, call):
    """A batch-local index outside [0, N) is invalid: it must not read a row of
    the neighbouring batch (which a naive b * N + i would)."""
    case = fast_case
    gen = _gen(6)
    B, S, H, D, d_v, K, N = 3, 2, 2, 32, 16, 8, 10
    q = rand((B, S, H, D), case, gen)
    kv = rand((B, N, D), case, gen)
    idx = distinct_indices((B, S), K, N, gen)
    # half of each row points into the next / previous batch's rows
    idx[0, :, :3] = torch.tensor([N, N + 1, 2 * N - 1], dtype=torch.int32)
    idx[1, :, :3] = torch.tensor([-1, -N, 2 * N + 3], dtype=torch.int32)
    idx[2, :, :3] = torch.tensor([-N + 2, -2 * N, 2**31 - 1], dtype=torch.int32)
    idx = idx.to(case.device)
    res, exp = run_and_check(call, case, q, kv, idx, d_v=d_v)
    # and they are exactly dropped: same as the row without those slots
    res2, _ = run(call, case, q, kv, idx[..., 3:].contiguous(), grads=False, d_v=d_v)
    bf.assert_close(res["out"], res2["out"].detach(), case.dtype, "out")


def test_batched_int64_local_indices(fast_case, call):
    case = fast_case
    gen = _gen(7)
    B, S, H, D, K, N = 2, 2, 2, 32, 6, 8
    q = rand((B, S, H, D), case, gen)
    kv = rand((B, N, D), case, gen)
    idx = distinct_indices((B, S), K, N, gen).long()
    idx[1, 0, 0] = 2**32 + 1  # wraps to 1 on a naive int32 cast
    idx[0, 1, 1] = -(2**32) + 2
    idx[1, 1, 2] = 2**40
    idx = idx.to(case.device)
    run_and_check(call, case, q, kv, idx, d_v=16)


@pytest.mark.parametrize("d_v,sm_scale", [(None, None), (32, 0.3), (16, 1.0), (16, None), (None, 0.3)])
def test_d_v_and_sm_scale(fast_case, call, d_v, sm_scale):
    """d_v defaults to min(D, 512) (here D), V is kv[..., :d_v]; sm_scale defaults to 1/sqrt(D)."""
    case = fast_case
    gen = _gen(8)
    T, H, D, K, N = 3, 2, 32, 12, 20
    q, kv, idx = packed_inputs(case, gen, T, H, D, K, N)
    res, _ = run_and_check(call, case, q, kv, idx, d_v=d_v, sm_scale=sm_scale)
    assert res["out"].shape == (T, H, D if d_v is None else d_v)
    if sm_scale is None:
        exp = expect(q, kv, idx, d_v=D if d_v is None else d_v, sm_scale=1 / math.sqrt(D))
        bf.assert_close(res["out"], exp["out"], case.dtype, "out")


@pytest.mark.parametrize("d_v", [8, 1, 31])
def test_odd_d_v_reference(call, d_v):
    """Any 1 <= d_v <= D is valid (the kernels may decline non-multiples of 16)."""
    case = type("C", (), {"backend": "reference", "dtype": torch.float64, "device": "cpu"})()
    gen = _gen(8)
    T, H, D, K, N = 3, 2, 32, 12, 20
    q, kv, idx = packed_inputs(case, gen, T, H, D, K, N, idx_device="cpu")
    run_and_check(call, case, q, kv, idx, d_v=d_v, sink=rand((H,), case, gen).float())


def test_default_d_v_is_512_when_D_is_larger(call):
    """V3.2's head: D = 576 (512 latent + 64 RoPE), d_v defaults to 512."""
    case = type("C", (), {"backend": "reference", "dtype": torch.float32, "device": "cpu"})()
    gen = _gen(9)
    T, H, D, K, N = 2, 2, 576, 6, 10
    q, kv, idx = packed_inputs(case, gen, T, H, D, K, N, idx_device="cpu")
    res, _ = run_and_check(call, case, q, kv, idx)
    assert res["out"].shape == (T, H, 512)


def test_return_lse_false_returns_out_only(fast_case, call):
    case = fast_case
    gen = _gen(11)
    q = rand((2, 2, 32), case, gen)
    kv = rand((8, 32), case, gen)
    idx = distinct_indices((2,), 5, 8, gen, case.device)
    out = call(dsa.sparse_attention, q, kv, idx, d_v=16, backend=case.backend)
    assert isinstance(out, torch.Tensor)
    bf.assert_close(out, expect(q, kv, idx, d_v=16)["out"], case.dtype, "out")


def test_non_contiguous_inputs(fast_case, call):
    case = fast_case
    gen = _gen(12)
    T, H, D, K, N = 4, 3, 32, 10, 16
    q = rand((H, T, 2 * D), case, gen).transpose(0, 1)[..., ::2]  # [T, H, D], strided
    kv = rand((2 * N, D), case, gen)[::2]
    idx = distinct_indices((K,), T, N, gen).t().to(case.device)  # [T, K] transposed
    assert not q.is_contiguous() and not kv.is_contiguous() and not idx.is_contiguous()
    run_and_check(call, case, q, kv, idx, d_v=16)


# --------------------------------------------------------------------------
# validity: topk_length, out-of-range indices, duplicates


def test_topk_length_all_regimes(case, call):
    """topk_length < 0, 0, partial, == K and > K; empty rows give out 0 and
    lse +inf and no gradient."""
    gen = _gen(13)
    T, H, D, K, N = 6, 3, 32, 20, 30
    q, kv, idx = packed_inputs(case, gen, T, H, D, K, N)
    tl = lengths_tensor([-3, 0, 5, K, K + 7, 1], case.device)
    sink = rand((H,), case, gen).float()
    res, exp = run_and_check(call, case, q, kv, idx, d_v=16, topk_length=tl, sink=sink)
    for t in (0, 1):
        assert torch.equal(res["out"][t], torch.zeros_like(res["out"][t]))
        assert torch.isposinf(res["lse"][t]).all()
        assert torch.equal(res["dq"][t], torch.zeros_like(res["dq"][t]))


def test_topk_length_int64(fast_case, call):
    case = fast_case
    gen = _gen(14)
    T, H, D, K, N = 3, 2, 32, 8, 12
    q, kv, idx = packed_inputs(case, gen, T, H, D, K, N)
    tl = torch.tensor([2**33, -(2**33), 3], dtype=torch.int64, device=case.device)
    res, _ = run(call, case, q, kv, idx, grads=False, d_v=16, topk_length=tl)
    exp = expect(q, kv, idx, d_v=16, topk_length=tl)
    check(res, exp, case)


def test_invalid_indices_int32(case, call):
    gen = _gen(15)
    T, H, D, K, N = 5, 3, 32, 18, 24
    q, kv, idx = packed_inputs(case, gen, T, H, D, K, N, idx_device="cpu")
    bad = torch.tensor([-1, N, N + 5, 2**31 - 1, -(2**31), -7], dtype=torch.int32)
    for t in range(T):
        pos = torch.randperm(K, generator=gen)[: t + 1]
        idx[t, pos] = bad[torch.arange(t + 1) % len(bad)]
    idx[4] = bad[torch.arange(K) % len(bad)]  # a row with no valid slot at all
    idx = idx.to(case.device)
    res, exp = run_and_check(call, case, q, kv, idx, d_v=16, sink=rand((H,), case, gen).float())
    assert torch.isposinf(res["lse"][4]).all() and not res["out"][4].any()


def test_invalid_indices_int64(fast_case, call):
    """int64 indices are converted; a value past 2**31 must stay invalid
    (2**32 + r would wrap to the valid row r on a plain cast)."""
    case = fast_case
    gen = _gen(16)
    T, H, D, K, N = 4, 2, 32, 10, 16
    q = rand((T, H, D), case, gen)
    kv = rand((N, D), case, gen)
    idx = distinct_indices((T,), K, N, gen).long()
    idx[0, 0] = 2**40
    idx[1, 1] = 2**32 + 3
    idx[2, 2] = -(2**32) + 5
    idx[3, 3] = 2**63 - 1
    idx[3, 4] = -(2**63)
    idx[0, 5] = 2**31
    idx = idx.to(case.device)
    res, exp = run_and_check(call, case, q, kv, idx, d_v=16)
    # int64 in-range indices give the same as int32
    ok = distinct_indices((T,), K, N, _gen(17), case.device)
    a = call(dsa.sparse_attention, q, kv, ok, d_v=16, backend=case.backend)
    b = call(dsa.sparse_attention, q, kv, ok.long(), d_v=16, backend=case.backend)
    assert torch.equal(a, b)


def test_duplicate_indices_are_separate_slots(case, call):
    gen = _gen(18)
    T, H, D, K, N = 4, 2, 32, 12, 16
    q, kv, idx = packed_inputs(case, gen, T, H, D, K, N, idx_device="cpu")
    idx[0, :] = 3  # one row repeated K times
    idx[1, 6:] = idx[1, :6]  # every slot twice
    idx[2, 1:5] = idx[2, 0]  # one row five times among others
    idx = idx.to(case.device)
    res, exp = run_and_check(call, case, q, kv, idx, d_v=16, sink=rand((H,), case, gen).float())
    # row 1 counts each of its 6 rows twice: lse is that of the 6 rows + log 2
    dedup = idx[1:2, :6].contiguous()
    single, _ = run(call, case, q[1:2], kv, dedup, grads=False, d_v=16)
    bf.assert_close(res["lse"][1:2], single["lse"] + math.log(2.0), torch.float32, "lse")
    # row 0: K copies of kv[3] without sink is exactly kv[3, :d_v]
    row0, _ = run(call, case, q[0:1], kv, idx[0:1], grads=False, d_v=16)
    bf.assert_close(row0["out"][0], kv[3, :16].double().expand(H, 16), case.dtype, "out")


# --------------------------------------------------------------------------
# sink


def test_sink_values_per_head(case, call):
    """One call, one sink kind per head: finite, -inf, +inf, 2.4e38, finite."""
    gen = _gen(19)
    T, H, D, K, N = 4, 5, 32, 16, 24
    q, kv, idx = packed_inputs(case, gen, T, H, D, K, N)
    sink = sink_tensor([0.7, -INF, INF, 2.4e38, -1.3], case)
    tl = lengths_tensor([16, 9, 0, 3], case.device)
    res, exp = run_and_check(call, case, q, kv, idx, d_v=16, sink=sink, topk_length=tl)
    for key in ("out", "dq", "dkv", "dsink"):
        assert not torch.isnan(res[key]).any(), key
    # heads 2 and 3 (sink +inf / overflowing): out exactly 0, dq 0, dsink 0
    for h in (2, 3):
        assert not res["out"][:, h].any()
        assert not res["dq"][:, h].any()
        assert res["dsink"][h].item() == 0.0
    assert res["dsink"][1].item() == 0.0  # -inf sink
    # lse excludes the sink: identical to no sink at all
    lse_nosink = call(dsa.sparse_attention, q, kv, idx, d_v=16, topk_length=tl, return_lse=True,
                      backend=case.backend)[1]
    bf.assert_close(res["lse"], lse_nosink, torch.float32, "lse")


@pytest.mark.parametrize("value", [INF, 2.4e38])
def test_sink_overflow_zeroes_everything(fast_case, call, value):
    case = fast_case
    gen = _gen(20)
    T, H, D, K, N = 3, 2, 32, 10, 16
    q, kv, idx = packed_inputs(case, gen, T, H, D, K, N)
    sink = sink_tensor([value] * H, case)
    res, exp = run_and_check(call, case, q, kv, idx, d_v=16, sink=sink)
    for key in ("out", "dq", "dkv", "dsink"):
        assert not res[key].isnan().any(), key
        assert not res[key].any(), f"{key} should be all 0"
    assert torch.isfinite(res["lse"]).all()


def test_sink_minus_inf_equals_no_sink(fast_case, call):
    case = fast_case
    gen = _gen(21)
    T, H, D, K, N = 4, 3, 32, 14, 20
    q, kv, idx = packed_inputs(case, gen, T, H, D, K, N)
    tl = lengths_tensor([14, 0, 5, 20], case.device)
    with_sink, dout = run(call, case, q, kv, idx, d_v=16, topk_length=tl, sink=sink_tensor([-INF] * H, case))
    no_sink, _ = run(call, case, q, kv, idx, d_v=16, topk_length=tl, dout=dout)
    for key in ("out", "lse", "dq", "dkv"):
        bf.assert_close(with_sink[key], no_sink[key].detach(), case.dtype, key)
    assert torch.equal(with_sink["dsink"], torch.zeros(H, device=case.device))
    check(no_sink, expect(q, kv, idx, d_v=16, topk_length=tl, dout=dout), case)


def test_sink_changes_output(fast_case, call):
    """A finite sink really enters the denominator (out shrinks by 1 - p_sink)."""
    case = fast_case
    gen = _gen(22)
    T, H, D, K, N = 3, 2, 32, 8, 12
    q, kv, idx = packed_inputs(case, gen, T, H, D, K, N)
    sink = sink_tensor([1.5, 3.0], case)
    a = call(dsa.sparse_attention, q, kv, idx, d_v=16, sink=sink, backend=case.backend)
    b, lse = call(dsa.sparse_attention, q, kv, idx, d_v=16, return_lse=True, backend=case.backend)
    frac = 1.0 / (1.0 + torch.exp(sink.double().view(1, H) - lse.double()))  # [T, H]
    bf.assert_close(a, b.double() * frac.unsqueeze(-1), case.dtype, "out")


# --------------------------------------------------------------------------
# NaN / Inf: unreferenced poison stays out, referenced NaN propagates


def test_poison_in_unreferenced_kv_rows(case, call):
    gen = _gen(23)
    T, H, D, K, N = 4, 3, 32, 12, 32
    q = rand((T, H, D), case, gen)
    kv = rand((N, D), case, gen)
    poisoned = torch.arange(20, 32)
    kv[20] = float("nan")
    kv[21, 0] = INF
    kv[22, -1] = -INF
    kv[23, 5] = float("nan")
    kv[24:32, ::3] = float("nan")
    kv[24:32, 1::3] = INF
    perm = torch.randperm(20, generator=gen)
    idx = torch.stack([perm.roll(t)[:8] for t in range(T)]).to(torch.int32)  # valid part
    tail = poisoned[torch.randperm(12, generator=gen)[:4]].to(torch.int32)
    idx = torch.cat([idx, tail.expand(T, 4)], dim=1)  # slots 8..11 hit poison
    tl = lengths_tensor([8, 5, 8, 0], case.device)  # ...but are never valid
    idx = idx.to(case.device)
    sink = rand((H,), case, gen).float()
    res, exp = run_and_check(call, case, q, kv, idx, d_v=16, topk_length=tl, sink=sink)
    for key in ("out", "dq", "dkv", "dsink"):
        assert torch.isfinite(res[key]).all(), f"poison reached {key}"
    assert not res["dkv"][20:].any()


def test_nan_in_q_propagates(fast_case, call):
    """NaN in q[1, 2] makes that row's out/lse/dq NaN, and the dkv of the rows
    it validly reads; its invalid slots (and every other row) stay finite."""
    case = fast_case
    gen = _gen(24)
    T, H, D, K, N = 3, 3, 32, 10, 16
    q = rand((T, H, D), case, gen)
    q[1, 2, 7] = float("nan")
    kv = rand((N, D), case, gen)
    idx = torch.stack([torch.randperm(N - 1, generator=gen)[:K] + 1 for _ in range(T)]).to(torch.int32)
    idx[1, 2] = -1  # invalid slots of the NaN row (row 0 of kv is never read by it)
    idx[1, 3] = N
    idx[1, 8:] = 0  # past its topk_length
    idx = idx.to(case.device)
    tl = lengths_tensor([K, 8, K], case.device)
    sink = rand((H,), case, gen).float()
    res, dout = run(call, case, q, kv, idx, d_v=16, topk_length=tl, sink=sink)
    check(res, expect(q, kv, idx, d_v=16, topk_length=tl, sink=sink, dout=dout), case)
    assert res["out"][1, 2].isnan().all() and res["lse"][1, 2].isnan()
    assert not res["out"][0].isnan().any() and not res["out"][1, :2].isnan().any()
    assert res["dq"][1, 2].isnan().all() and not res["dq"][[0, 2]].isnan().any()
    assert not res["dkv"][0].isnan().any(), "an invalid slot of the NaN row wrote into kv row 0"
    assert res["dsink"][2].isnan() and not res["dsink"][:2].isnan().any()


def test_nan_in_valid_kv_row_propagates(fast_case, call):
    case = fast_case
    gen = _gen(25)
    T, H, G, D, K, N = 4, 4, 2, 32, 6, 16
    q = rand((T, H, D), case, gen)
    kv = rand((N, G, D), case, gen)
    kv[5, 0, 0] = float("nan")  # read as K and as V
    kv[6, 1, 20] = float("nan")  # read as K only (d_v = 16)
    idx = distinct_indices((T, G), K, 16, gen)
    idx[idx == 5] = 0
    idx[idx == 6] = 1
    idx[0, 0, 2] = 5  # row 0, kv head 0 -> query heads 0, 1
    idx[2, 1, 4] = 6  # row 2, kv head 1 -> query heads 2, 3
    idx[3, 0, 1] = 5
    tl = lengths_tensor([6, 6, 6, 1], case.device)  # row 3's slot 1 is invalid
    idx = idx.to(case.device)
    res, _ = run(call, case, q, kv, idx, grads=False, d_v=16, topk_length=tl)
    check(res, expect(q, kv, idx, d_v=16, topk_length=tl), case)
    nan = res["out"].isnan().any(-1)
    want = torch.zeros(T, H, dtype=torch.bool)
    want[0, :2] = True
    want[2, 2:] = True
    assert torch.equal(nan.cpu(), want)


def test_nan_in_sink_propagates(fast_case, call):
    case = fast_case
    gen = _gen(26)
    T, H, D, K, N = 3, 3, 32, 8, 12
    q, kv, idx = packed_inputs(case, gen, T, H, D, K, N)
    sink = sink_tensor([0.5, float("nan"), -0.5], case)
    res, _ = run(call, case, q, kv, idx, grads=False, d_v=16, sink=sink)
    check(res, expect(q, kv, idx, d_v=16, sink=sink), case)
    assert res["out"][:, 1].isnan().all()
    assert not res["out"][:, [0, 2]].isnan().any()
    assert torch.isfinite(res["lse"]).all()  # lse excludes the sink


# --------------------------------------------------------------------------
# empty problems


def _zero_grads_check(res, q, kv, sink):
    assert res["dq"].shape == q.shape and not res["dq"].any()
    assert res["dkv"].shape == kv.shape and not res["dkv"].any()
    if sink is not None:
        assert res["dsink"].shape == sink.shape and not res["dsink"].any()


@pytest.mark.parametrize(
    "what",
    ["T=0", "K=0", "B=0", "S=0", "N=0", "K=0 gqa", "T=0 gqa"],
)
def test_empty_shapes(fast_case, call, what):
    case = fast_case
    gen = _gen(27)
    H, D, d_v = 3, 32, 16
    sink = rand((H,), case, gen).float()
    shapes = {
        "T=0": ((0, H, D), (10, D), (0, 5)),
        "K=0": ((4, H, D), (10, D), (4, 0)),
        "B=0": ((0, 3, H, D), (0, 10, D), (0, 3, 5)),
        "S=0": ((2, 0, H, D), (2, 10, D), (2, 0, 5)),
        "N=0": ((4, H, D), (0, D), (4, 5)),
        "K=0 gqa": ((4, H, D), (10, 3, D), (4, 3, 0)),
        "T=0 gqa": ((0, H, D), (10, 3, D), (0, 3, 5)),
    }[what]
    q = rand(shapes[0], case, gen)
    kv = rand(shapes[1], case, gen)
    idx = torch.randint(0, 10, shapes[2], generator=gen, dtype=torch.int32).to(case.device)
    res, _ = run(call, case, q, kv, idx, d_v=d_v, sink=sink)
    lead = q.shape[:-1]
    assert res["out"].shape == (*lead, d_v) and not res["out"].any()
    assert res["lse"].shape == lead and torch.isposinf(res["lse"]).all()
    _zero_grads_check(res, q, kv, sink)


# --------------------------------------------------------------------------
# gradients


def test_gradients_mixed_validity(case, call):
    """dq, dkv, dsink with partial lengths, invalid and duplicate indices and
    several query rows sharing kv rows (dkv accumulates)."""
    gen = _gen(28)
    T, H, D, K, N = 6, 3, 32, 24, 28
    q, kv, idx = packed_inputs(case, gen, T, H, D, K, N, idx_device="cpu")
    idx[0, 3] = -1
    idx[1, 4] = N
    idx[2, 5:8] = idx[2, 0]
    idx[3, :] = idx[4, :]  # rows 3 and 4 share every kv row
    idx = idx.to(case.device)
    tl = lengths_tensor([24, 17, 24, 9, 24, 0], case.device)
    sink = rand((H,), case, gen).float()
    run_and_check(call, case, q, kv, idx, d_v=16, topk_length=tl, sink=sink)


def test_gradients_batched_gqa_with_sink(fast_case, call):
    case = fast_case
    gen = _gen(29)
    B, S, H, G, D, K, N = 2, 3, 4, 2, 32, 8, 12
    q = rand((B, S, H, D), case, gen)
    kv = rand((B, N, G, D), case, gen)
    idx = distinct_indices((B, S, G), K, N, gen)
    idx[0, 1, 1, 2] = N + 1
    idx = idx.to(case.device)
    tl = lengths_tensor([[8, 3, 8], [0, 8, 5]], case.device)
    sink = rand((H,), case, gen).float()
    run_and_check(call, case, q, kv, idx, d_v=16, topk_length=tl, sink=sink)


def test_gradcheck_float64_reference():
    gen = _gen(30)
    T, H, G, D, d_v, K, N = 3, 4, 2, 6, 4, 5, 7
    q, kv, sink = f64_leaves(gen, T, H, G, D, N)
    idx = torch.tensor(
        [[[0, 1, 2, 6, 3], [4, 4, 5, -1, 2]],
         [[6, 5, 9, 1, 0], [0, 2, 3, 3, 1]],
         [[2, 2, 2, 4, 5], [1, 6, 0, 7, 3]]],
        dtype=torch.int32,
    )
    tl = torch.tensor([5, 3, 4], dtype=torch.int32)

    def f(q, kv, sink):
        return dsa.sparse_attention(q, kv, idx, d_v=d_v, sink=sink, topk_length=tl, backend="reference")

    assert torch.autograd.gradcheck(f, (q, kv, sink), eps=1e-6, atol=1e-7)

    def g(q, kv):  # no sink, batched MQA
        return dsa.sparse_attention(q.view(1, T, H, D), kv[:, 0].unsqueeze(0), idx[:, 1].unsqueeze(0),
                                    sm_scale=0.7, d_v=d_v, backend="reference")

    assert torch.autograd.gradcheck(g, (q, kv), eps=1e-6, atol=1e-7)


def test_deterministic_bitwise(fast_case, call):
    """deterministic=True: every output and gradient bitwise identical twice,
    on a problem where many rows accumulate into the same kv rows."""
    case = fast_case
    gen = _gen(31)
    T, H, D, K, N = 6, 4, 32, 32, 6
    q = rand((T, H, D), case, gen)
    kv = rand((N, D), case, gen)
    idx = torch.randint(0, N, (T, K), generator=gen, dtype=torch.int32).to(case.device)
    sink = rand((H,), case, gen).float()
    kw = dict(d_v=16, sink=sink, deterministic=True)
    first, dout = run(call, case, q, kv, idx, **kw)
    second, _ = run(call, case, q, kv, idx, dout=dout, **kw)
    for key in first:
        assert torch.equal(first[key], second[key]), f"{key} differs between runs"
    check(first, expect(q, kv, idx, d_v=16, sink=sink, dout=dout), case)


# --------------------------------------------------------------------------
# larger shapes on the reference backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_larger_shape(call, dtype):
    case = type("C", (), {"backend": "reference", "dtype": dtype, "device": "cpu"})()
    gen = _gen(32)
    T, H, G, D, d_v, K, N = 8, 8, 2, 64, 48, 64, 96
    q = rand((T, H, D), case, gen)
    kv = rand((N, G, D), case, gen)
    idx = distinct_indices((T, G), K, N, gen)
    idx[::3, :, ::5] = -1
    tl = lengths_tensor([64, 50, 1, 33, 64, 0, 17, 80], "cpu")
    sink = rand((H,), case, gen).float()
    run_and_check(call, case, q, kv, idx, d_v=d_v, topk_length=tl, sink=sink)


# --------------------------------------------------------------------------
# the model shapes of docs/semantics.md, on CUDA (H reduced as tensor parallelism does)


def _gpu_case(backend, dtype):
    return type("C", (), {"backend": backend, "dtype": dtype, "device": "cuda"})()


GPU_SHAPES = [
    pytest.param(16, 576, 512, 128, id="v3.2-H16-D576-K128"),
    pytest.param(8, 512, 512, 160, id="v4-H8-D512-K160"),
    pytest.param(32, 576, 512, 64, id="glm-H32-D576-K64"),
    pytest.param(64, 512, 512, 48, id="v4flash-H64-D512-K48"),
    pytest.param(128, 576, 512, 32, id="v3.2-H128-D576-K32"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["reference", "triton", "cute"])
@pytest.mark.parametrize("H,D,d_v,K", GPU_SHAPES)
def test_model_shapes_cuda(call, backend, dtype, H, D, d_v, K):
    case = _gpu_case(backend, dtype)
    gen = _gen(40)
    T, N = 4, 3 * K
    q, kv, idx = packed_inputs(case, gen, T, H, D, K, N, idx_device="cpu")
    idx[1, ::7] = -1
    idx = idx.to("cuda")
    tl = lengths_tensor([K, K // 2 + 3, 0, 1], "cuda")
    sink = rand((H,), case, gen).float()
    res, dout = run(call, case, q, kv, idx, d_v=d_v, topk_length=tl, sink=sink)
    for key in ("out", "lse", "dq", "dkv", "dsink"):
        assert not res[key].isnan().any(), f"NaN in {key} from finite inputs"
    check(res, expect(q, kv, idx, dout=dout, d_v=d_v, topk_length=tl, sink=sink), case)
