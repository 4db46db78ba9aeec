"""Kernel tests of dsa.triton.sparse_attention against a float64 computation.

On a machine without CUDA the kernels run under the Triton interpreter
(TRITON_INTERPRET=1, set below before triton is imported) with tiny shapes in
fp32 and fp16; the tests marked ``gpu`` run bf16 / fp16 at the docs/semantics.md
shapes (reduced T) on CUDA.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa._args import SparseAttnArgs  # noqa: E402
from dsa.triton import sparse_attention as sa  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


# ----------------------------------------------------------------------------
# float64 reference (plain torch: gather + masked softmax, explicit gradients)


def valid_mask(indices, topk_length, N):
    T, G, K = indices.shape
    valid = (indices >= 0) & (indices < N)
    if topk_length is not None:
        L = topk_length.long().clamp(0, K)
        valid &= torch.arange(K, device=indices.device)[None, None, :] < L[:, None, None]
    return valid


def reference(q, kv, indices, topk_length, sink, sm_scale, d_v, dout=None):
    """out, lse and (when dout is given) dq, dkv, dsink, all float64."""
    T, H, D = q.shape
    N, G, _ = kv.shape
    K = indices.shape[2]
    hg = H // G
    valid = valid_mask(indices, topk_length, N)  # [T, G, K]
    safe = torch.where(valid, indices.long(), 0)
    q64 = q.double().view(T, G, hg, D)
    kv64 = kv.double()
    g_ar = torch.arange(G, device=q.device)[None, :, None]
    kg = kv64[safe, g_ar]  # [T, G, K, D]
    kg = torch.where(valid[..., None], kg, 0.0)  # never touch unreferenced rows
    vg = kg[..., :d_v]
    s = torch.einsum("tghd,tgkd->tghk", q64, kg) * sm_scale
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)  # -inf for empty rows
    logden = lse
    if sink is not None:
        s64 = sink.double().view(1, G, hg)
        logden = torch.where(s64 == math.inf, math.inf, torch.logaddexp(lse, s64))
    p = torch.where(valid[:, :, None, :], torch.exp(s - logden[..., None]), 0.0)
    out = torch.einsum("tghk,tgkv->tghv", p, vg)
    lse_out = torch.where(lse == -math.inf, math.inf, lse).reshape(T, H)
    res = dict(out=out.reshape(T, H, d_v), lse=lse_out)
    if dout is None:
        return res
    do64 = dout.double().view(T, G, hg, d_v)
    dp = torch.einsum("tghv,tgkv->tghk", do64, vg)
    delta = (do64 * out).sum(-1)
    ds = torch.where(valid[:, :, None, :], p * (dp - delta[..., None]), 0.0)
    dq = torch.einsum("tghk,tgkd->tghd", ds, kg) * sm_scale
    contrib = torch.einsum("tghk,tghd->tgkd", ds, q64) * sm_scale
    contrib[..., :d_v] += torch.einsum("tghk,tghv->tgkv", p, do64)
    contrib = torch.where(valid[..., None], contrib, 0.0)
    dkv = torch.zeros(N * G, D, dtype=torch.float64, device=q.device)
    dkv.index_add_(0, (safe * G + g_ar).flatten(), contrib.reshape(-1, D))
    res.update(dq=dq.reshape(T, H, D), dkv=dkv.view(N, G, D), dsink=None)
    if sink is not None:
        s64 = sink.double().view(1, G, hg)
        psink = torch.where(s64 == math.inf, 1.0,
                            torch.where(s64 == -math.inf, 0.0, torch.exp(s64 - logden)))
        res["dsink"] = -(psink * delta).sum(0).reshape(H)
    return res


# ----------------------------------------------------------------------------
# helpers


def make_inputs(T, H, G, N, K, D, d_v, dtype, *, lengths=False, sink=False, seed=0,
                device=DEV, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, D, generator=gen) * scale).to(dtype).to(device)
    kv = torch.randn(N, G, D, generator=gen).to(dtype).to(device)
    indices = torch.randint(0, N, (T, G, K), generator=gen, dtype=torch.int32).to(device)
    topk_length = None
    if lengths:
        topk_length = torch.randint(0, K + 1, (T,), generator=gen, dtype=torch.int32).to(device)
    s = torch.randn(H, generator=gen).to(device) if sink else None
    dout = torch.randn(T, H, d_v, generator=gen).to(dtype).to(device)
    return q, kv, indices, topk_length, s, dout


def args(q, kv, indices, topk_length=None, sink=None, d_v=None, deterministic=False, sm_scale=None):
    D = q.shape[-1]
    return SparseAttnArgs(q=q, kv=kv, indices=indices, topk_length=topk_length, sink=sink,
                          sm_scale=sm_scale if sm_scale is not None else D ** -0.5,
                          d_v=d_v if d_v is not None else min(D, 512),
                          deterministic=deterministic)


def rel(x, ref):
    x = x.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def close(x, ref, tol, name):
    assert x.shape == ref.shape, (name, x.shape, ref.shape)
    x = x.double()
    assert torch.equal(torch.isnan(x), torch.isnan(ref)), f"{name}: NaN pattern differs"
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(x), inf) and torch.equal(x[inf], ref[inf]), f"{name}: inf differs"
    finite = torch.isfinite(ref)
    xe, re = torch.where(finite, x, 0.0), torch.where(finite, ref, 0.0)
    if re.norm() == 0:
        assert xe.norm() == 0, f"{name}: expected exact zeros"
    else:
        err = rel(xe, re)
        assert err <= tol, f"{name}: rel err {err:.3e} > {tol}"


def run_all(a, dout):
    out, lse = sa.forward(a)
    dq, dkv, dsink = sa.backward(a, out, lse, dout)
    return dict(out=out, lse=lse, dq=dq, dkv=dkv, dsink=dsink)


def check(a, dout, tol):
    got = run_all(a, dout)
    ref = reference(a.q, a.kv, a.indices, a.topk_length, a.sink, a.sm_scale, a.d_v, dout)
    assert got["out"].dtype == a.q.dtype and got["lse"].dtype == torch.float32
    assert got["dq"].dtype == a.q.dtype and got["dkv"].dtype == a.kv.dtype
    for name in ("out", "lse", "dq", "dkv"):
        close(got[name], ref[name], tol, name)
    if a.sink is None:
        assert got["dsink"] is None
    else:
        assert got["dsink"].dtype == torch.float32
        close(got["dsink"], ref["dsink"], tol, "dsink")
    return got, ref


TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}


# ----------------------------------------------------------------------------
# reference self-check (float64 autograd of a naive softmax)


def test_reference_matches_autograd():
    q, kv, idx, L, s, dout = make_inputs(3, 4, 2, 9, 7, 32, 16, torch.float64, lengths=True,
                                         sink=True, device="cpu")
    L[0] = 7
    q.requires_grad_(True); kv.requires_grad_(True); s.requires_grad_(True)
    valid = valid_mask(idx, L, 9)
    kg = kv[idx.long(), torch.arange(2)[None, :, None]]  # [T, G, K, D]
    logits = torch.einsum("tghd,tgkd->tghk", q.view(3, 2, 2, 32), kg) * 0.3
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    full = torch.cat([logits, s.view(1, 2, 2, 1).expand(3, 2, 2, 1)], -1)
    p = torch.softmax(full, -1)[..., :-1]
    out = torch.einsum("tghk,tgkv->tghv", p, kg[..., :16]).reshape(3, 4, 16)
    out.backward(dout)
    ref = reference(q.detach(), kv.detach(), idx, L, s.detach(), 0.3, 16, dout)
    torch.testing.assert_close(ref["out"], out.detach())
    torch.testing.assert_close(ref["dq"], q.grad)
    torch.testing.assert_close(ref["dkv"], kv.grad)
    torch.testing.assert_close(ref["dsink"], s.grad.double())


# ----------------------------------------------------------------------------
# CPU-size kernel tests (also run on CUDA)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,H,G,N,K,D,d_v,lengths,sink", [
    (3, 3, 1, 20, 19, 48, 32, False, False),   # K not a multiple of the block, H odd
    (1, 5, 1, 11, 5, 32, 16, True, True),      # T = 1, H = 5
    (4, 4, 2, 13, 21, 32, 16, True, True),     # GQA, G = 2
    (2, 2, 1, 9, 17, 80, 48, False, True),     # three column chunks, V ends mid-chunk
    (2, 3, 1, 9, 6, 48, 48, True, False),      # d_v = D, V spans two chunks
])
def test_matches_reference(dtype, T, H, G, N, K, D, d_v, lengths, sink):
    q, kv, idx, L, s, dout = make_inputs(T, H, G, N, K, D, d_v, dtype, lengths=lengths, sink=sink)
    check(args(q, kv, idx, L, s, d_v=d_v), dout, TOL[dtype])


@pytest.mark.parametrize("cfg", [
    sa.TileConfig(BH=16, BN=16, CW=16, num_warps=4, num_stages=1, skew=True),
    sa.TileConfig(BH=16, BN=32, CW=32, num_warps=4, num_stages=1, skew=False),
    sa.TileConfig(BH=16, BN=16, CW=32, num_warps=4, num_stages=1, prefetch=False),
])
def test_tile_configs(cfg):
    """Other tilings (chunk width, block, skewed forward loop, indices loaded in
    the block that uses them) on the same math."""
    T, H, G, N, K, D, d_v = 3, 4, 2, 13, 37, 80, 48
    q, kv, idx, L, s, dout = make_inputs(T, H, G, N, K, D, d_v, torch.float32, lengths=True, sink=True)
    L[0] = K
    a = args(q, kv, idx, L, s, d_v=d_v)
    ref = reference(q, kv, idx, L, s, a.sm_scale, d_v, dout)
    out, lse = sa.forward(a, cfg)
    dq, dkv, dsink = sa.backward(a, out, lse, dout, cfg)
    for name, x in dict(out=out, lse=lse, dq=dq, dkv=dkv, dsink=dsink).items():
        close(x, ref[name], TOL[torch.float32], name)


def test_invalid_slots_never_read():
    T, H, G, N, K, D, d_v = 4, 3, 1, 16, 19, 48, 32
    q, kv, idx, _, s, dout = make_inputs(T, H, G, N, K, D, d_v, torch.float32, sink=True)
    L = torch.tensor([19, 7, 0, -3], dtype=torch.int32, device=DEV)
    idx = (idx % 9) + 1  # rows 0 and 10.. are referenced by no valid slot
    idx[:, :, ::3] = torch.tensor(-5, dtype=torch.int32)
    idx[:, :, 1::5] = torch.tensor(2 ** 31 - 1, dtype=torch.int32)
    idx[:, :, 2::7] = N
    idx[1, 0, 7:] = 0  # past topk_length: row 0 is poisoned below
    idx[0, 0, 4] = idx[0, 0, 5] = 3  # duplicates are separate slots
    valid = valid_mask(idx, L, N)
    used = torch.zeros(N, dtype=torch.bool, device=DEV)
    used[idx[valid].long()] = True
    assert used.any() and not used.all() and not used[0]
    kv[~used] = float("nan")
    kv[~used & (torch.arange(N, device=DEV) % 2 == 0)] = float("inf")
    got, ref = check(args(q, kv, idx, L, s, d_v=d_v), dout, TOL[torch.float32])
    for name in ("out", "lse", "dq", "dsink"):
        assert not torch.isnan(got[name]).any(), name
    assert not torch.isnan(got["dkv"][used]).any()
    assert torch.equal(got["dkv"][~used], torch.zeros_like(got["dkv"][~used]))


def test_empty_rows():
    T, H, G, N, K, D, d_v = 3, 3, 1, 10, 5, 32, 16
    q, kv, idx, _, s, dout = make_inputs(T, H, G, N, K, D, d_v, torch.float32, sink=True)
    L = torch.tensor([0, 5, 2], dtype=torch.int32, device=DEV)
    idx[2] = -1  # row 2: no valid slot although topk_length is 2
    for sink in (None, s):
        got, _ = check(args(q, kv, idx, L, sink, d_v=d_v), dout, TOL[torch.float32])
        for r in (0, 2):
            assert torch.equal(got["out"][r], torch.zeros_like(got["out"][r]))
            assert torch.all(got["lse"][r] == math.inf)
            assert torch.equal(got["dq"][r], torch.zeros_like(got["dq"][r]))
        # only row 1 contributes to dkv
        a1 = args(q[1:2], kv, idx[1:2], L[1:2], sink, d_v=d_v)
        one = run_all(a1, dout[1:2])
        torch.testing.assert_close(got["dkv"], one["dkv"], rtol=1e-6, atol=1e-7)
        if sink is not None:
            torch.testing.assert_close(got["dsink"], one["dsink"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sink_extremes(dtype):
    T, H, G, N, K, D, d_v = 3, 4, 2, 12, 9, 32, 16
    q, kv, idx, L, _, dout = make_inputs(T, H, G, N, K, D, d_v, dtype, lengths=True)
    L[0] = 0
    sink = torch.tensor([math.inf, 2.4e38, -math.inf, 0.5], device=DEV)
    got, _ = check(args(q, kv, idx, L, sink, d_v=d_v), dout, TOL[dtype])
    for name in ("out", "dq", "dkv", "dsink"):
        assert not torch.isnan(got[name]).any(), name
    zero = lambda x: torch.equal(x, torch.zeros_like(x))  # noqa: E731
    assert zero(got["out"][:, :2]) and zero(got["dq"][:, :2]) and zero(got["dsink"][:3])
    # sink = -inf is no sink at all
    ref = run_all(args(q[:, 2:3].contiguous(), kv[:, 1:2].contiguous(), idx[:, 1:2].contiguous(),
                       L, None, d_v=d_v), dout[:, 2:3].contiguous())
    torch.testing.assert_close(got["out"][:, 2:3], ref["out"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["dq"][:, 2:3], ref["dq"], rtol=1e-6, atol=1e-6)


def test_nan_propagates():
    T, H, G, N, K, D, d_v = 3, 3, 1, 10, 6, 32, 16
    q, kv, idx, _, s, dout = make_inputs(T, H, G, N, K, D, d_v, torch.float32, sink=True)
    q[0, 1, 3] = float("nan")
    bad = int(idx[1, 0, 2])
    kv[bad, 0, 5] = float("nan")
    s[2] = float("nan")
    out, lse = sa.forward(args(q, kv, idx, None, s, d_v=d_v))
    assert torch.isnan(out[0, 1]).all() and torch.isnan(lse[0, 1])
    assert torch.isnan(out[1]).any()
    assert torch.isnan(out[:, 2]).all()
    clean = ~torch.isin(idx[2, 0], torch.tensor([bad], device=DEV))
    if clean.all():
        assert not torch.isnan(out[2, :2]).any()


def test_deterministic_bitwise():
    T, H, G, N, K, D, d_v = 5, 4, 2, 7, 23, 48, 32  # few rows: many references each
    q, kv, idx, L, s, dout = make_inputs(T, H, G, N, K, D, d_v, torch.float32,
                                         lengths=True, sink=True, seed=3)
    a = args(q, kv, idx, L, s, d_v=d_v, deterministic=True)
    first, _ = check(a, dout, TOL[torch.float32])
    second = run_all(a, dout)
    for name in ("out", "lse", "dq", "dkv", "dsink"):
        assert torch.equal(first[name], second[name]), name
    # token chunking of the deterministic path gives the same result
    from dsa.triton import segment_sum

    old = segment_sum.WORKSPACE_BYTES
    try:
        segment_sum.WORKSPACE_BYTES = 2 * 4 * G * K * D * 4  # two tokens per chunk
        third = run_all(a, dout)
    finally:
        segment_sum.WORKSPACE_BYTES = old
    torch.testing.assert_close(third["dkv"], first["dkv"], rtol=1e-6, atol=1e-6)
    assert torch.equal(third["dq"], first["dq"])


def test_column_chunks():
    from dsa.triton.sparse_attention_common import ColumnChunks
    assert ColumnChunks.of(576, 512) == ColumnChunks((0, 256, 512), (256, 256, 64), 2)
    assert ColumnChunks.of(512, 512, 128).WS == (128,) * 4
    for D in range(16, 577, 16):
        for d_v in range(16, D + 1, 16):
            c = ColumnChunks.of(D, d_v)
            assert sum(c.WS) == D and sum(c.WS[:c.NV]) == d_v
            assert all(w & (w - 1) == 0 and w >= 16 for w in c.WS)


@pytest.mark.parametrize("sink", [False, True])
def test_preprocess_matches_float64(sink):
    """Delta, log2 den (sink folded in, +inf where every p is 0) and dsink's
    parts: the per-row terms both backwards (Triton and cute) read."""
    gen = torch.Generator().manual_seed(1)
    s_ = torch.randn(64, generator=gen) if sink else None
    a = SparseAttnArgs(torch.randn(6, 64, 576, generator=gen, device=DEV), torch.randn(32, 1, 576, device=DEV),
                       torch.zeros(6, 1, 8, dtype=torch.int32, device=DEV), None,
                       None if s_ is None else s_.to(DEV), 576 ** -0.5, 512)
    out = torch.randn(6, 64, 512, generator=gen)
    dout = torch.randn(6, 64, 512, generator=gen)
    lse = torch.randn(6, 64, generator=gen)
    lse[0, :5] = math.inf  # empty rows
    if sink:
        a.sink[:4] = torch.tensor([math.inf, -math.inf, 1e30, 3.4e38], device=DEV)
    delta, lg2, parts = (x.cpu() if x is not None else None
                         for x in sa.preprocess(a, out.to(DEV), lse.to(DEV), dout.to(DEV)))
    dsink = parts.sum(0) if parts is not None else None
    a = SparseAttnArgs(*(x.cpu() if x is not None else None for x in (a.q, a.kv, a.indices, a.topk_length,
                                                                        a.sink)), a.sm_scale, a.d_v)
    d64 = (out.double() * dout.double()).sum(-1)
    torch.testing.assert_close(delta.double(), d64, rtol=1e-5, atol=1e-4)
    l64 = torch.where(torch.isposinf(lse), -math.inf, lse).double()
    if sink:
        l64 = torch.logaddexp(l64, a.sink.double()[None])
        ps = torch.exp(a.sink.double()[None] - l64)
        ps = torch.where(torch.isposinf(a.sink.double())[None], 1.0, ps)
        ps = torch.where(torch.isneginf(a.sink.double())[None], 0.0, ps)
        torch.testing.assert_close(dsink.double(), -(ps * d64).sum(0), rtol=1e-5, atol=1e-4)
        assert torch.isfinite(dsink).all()
    else:
        assert dsink is None
    # in fp32: log2 den of a sink near the fp32 maximum overflows to +inf
    exp = torch.where(torch.isneginf(l64), math.inf, l64 * 1.4426950408889634).float().double()
    # every row whose probabilities are all 0 has +inf, nothing is NaN
    assert not torch.isnan(lg2).any()
    assert torch.equal(torch.isposinf(lg2), torch.isposinf(exp))
    fin = torch.isfinite(exp)
    torch.testing.assert_close(lg2.double()[fin], exp[fin], rtol=1e-6, atol=1e-5)



def test_slot_keys_name_the_kv_row_of_valid_slots():
    """The kv row of each slot of the deterministic backwards' per-slot rows."""
    gen = torch.Generator().manual_seed(0)
    a = SparseAttnArgs(torch.zeros(5, 128, 512), torch.zeros(16, 2, 512),
                       torch.randint(0, 16, (5, 2, 24), generator=gen, dtype=torch.int32),
                       torch.randint(-3, 29, (5,), generator=gen, dtype=torch.int32), None, 0.1, 512)
    a.indices[0, 0, :3] = torch.tensor([-5, 16, 2**30], dtype=torch.int32)
    a.indices[1, 1, :4] = 7  # duplicates
    t0, tc = 1, 3
    keys = sa.slot_keys(a, t0, tc)
    G, K, N = a.G, a.K, a.N
    assert keys.shape == (tc * G * K,)
    L = a.topk_length.clamp(0, K)
    for t in range(t0, t0 + tc):
        for g in range(G):
            for j in range(K):
                n = int(a.indices[t, g, j])
                ok = j < int(L[t]) and 0 <= n < N
                # the kernel's deterministic row ((t - t0) * G + g) * K + j
                assert int(keys[((t - t0) * G + g) * K + j]) == (n * G + g if ok else N * G), (t, g, j)


def test_supports():
    q, kv, idx, L, s, _ = make_inputs(2, 2, 1, 4, 3, 32, 16, torch.float32, device="cpu")
    assert sa.supports(args(q, kv, idx)) is None
    q2, kv2 = torch.randn(2, 2, 40), torch.randn(4, 1, 40)
    assert "multiples of 16" in sa.supports(args(q2, kv2, idx, d_v=40))
    q3, kv3 = torch.randn(2, 2, 640), torch.randn(4, 1, 640)
    assert "576" in sa.supports(args(q3, kv3, idx))
    assert "int32" in sa.supports(args(q, kv, idx.long()))


def test_no_fitting_tiles_declines(monkeypatch):
    """On a device whose shared memory no candidate fits, the op declines with
    the reason (auto then serves it elsewhere; an explicit triton raises
    ValueError), instead of a launch raising Triton's OutOfResources."""
    import dsa
    import dsa.triton
    from dsa._args import Unsupported
    from dsa.triton import fit

    tiny = fit.Target(90, fit.DeviceLimits(90, 1024))
    monkeypatch.setattr(fit, "device_target", lambda t: tiny)
    monkeypatch.setattr(fit, "_PICKED", {})
    monkeypatch.setattr(fit, "shared_bytes", lambda spec, target: 4096)  # every candidate compiles too big
    q, kv, idx, _, _, _ = make_inputs(2, 2, 1, 4, 3, 32, 16, torch.float32, device="cpu")
    a = args(q, kv, idx)
    for op, fn in (("sparse_attention_fwd", "forward"), ("sparse_attention_bwd", "backward")):
        why = sa.tiles_reason(fn, a)
        assert "sm_90" in why and "1024 B of shared memory" in why, why
        with pytest.raises(Unsupported, match="shared memory"):
            dsa.triton.backend_op(op, a)
    with pytest.raises(ValueError, match="shared memory"):
        sa.forward(a)
    with pytest.raises(ValueError, match="shared memory"):
        dsa.sparse_attention(q, kv, idx, d_v=16, backend="triton")
    out = dsa.sparse_attention(q, kv, idx, d_v=16, backend="auto")
    assert rel(out, reference(q, kv, idx, None, None, 32 ** -0.5, 16)["out"]) < 1e-6


def test_fit_pick_order(monkeypatch):
    """pick takes the first candidate whose estimate and compiled size fit,
    and says how close the smallest came when none does."""
    from dsa.triton import fit

    sizes = {"a": 300, "b": 150, "c": 90}
    monkeypatch.setattr(fit, "shared_bytes", lambda spec, target: sizes[spec])
    t = fit.Target(80, fit.DeviceLimits(80, 100))

    class Spec(str):
        fn = type("K", (), {"__name__": "k"})

    def spec_of(c):
        return Spec(c)

    assert fit.pick(lambda: "abc", spec_of, t, ("t1",)) == ("c", "")
    # the estimate gates: "c" estimated over the limit is never compiled
    cfg, why = fit.pick(lambda: "abc", spec_of, t, ("t2",), estimate=lambda c: 200 if c == "c" else 0)
    assert cfg is None and "150 B" in why and "sm_80" in why
    assert fit.pick(lambda: "abc", spec_of, None, ("t3",)) == ("a", "")  # the interpreter: no limits
    assert fit.limits_of(87).smem_per_block == fit.LIMITS[86].smem_per_block
    assert fit.limits_of(75).smem_per_block == min(v.smem_per_block for v in fit.LIMITS.values())


# ----------------------------------------------------------------------------
# GPU tests at the docs/semantics.md shapes (reduced T)

SHAPES = {  # name: (H, D, d_v, K, sink)
    "V3.2": (128, 576, 512, 2048, False),
    "V4-pro": (128, 512, 512, 1152, True),
    "V4-flash": (64, 512, 512, 640, True),
    "GLM": (64, 576, 512, 2048, False),
    "TP8": (8, 576, 512, 2048, True),
    "H96": (96, 576, 512, 1000, True),
}


def gpu_case(name, dtype, T=128, N=4096, G=1, seed=0):
    H, D, d_v, K, sink = SHAPES[name]
    q, kv, idx, L, s, dout = make_inputs(T, H, G, N, K, D, d_v, dtype, lengths=True,
                                         sink=sink, seed=seed)
    L[:T // 2] = K  # half the rows full, half random lengths
    idx[:, :, ::17] = -1
    return args(q, kv, idx, L, s, d_v=d_v), dout


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name,dtype", [(n, torch.bfloat16) for n in SHAPES]
                         + [("V4-pro", torch.float16), ("TP8", torch.float16)])
def test_gpu_shapes(name, dtype):
    a, dout = gpu_case(name, dtype)
    ref = reference(a.q, a.kv, a.indices, a.topk_length, a.sink, a.sm_scale, a.d_v, dout)
    got = run_all(a, dout)
    for k in ("out", "lse", "dq", "dkv") + (("dsink",) if a.sink is not None else ()):
        assert not torch.isnan(got[k]).any(), k
        close(got[k], ref[k], 1e-2, k)


@pytest.mark.gpu
@gpu
def test_gpu_outputs_fully_written():
    a, dout = gpu_case("V4-pro", torch.bfloat16, T=64)
    torch.manual_seed(0)
    for _ in range(2):  # the caching allocator hands back the NaN-filled blocks
        junk = [torch.full((64 * 128 * 576,), float("nan"), device=DEV) for _ in range(8)]
        del junk
        got = run_all(a, dout)
        for k, v in got.items():
            assert not torch.isnan(v).any(), k


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["V4-pro", "TP8"])
def test_gpu_deterministic(name):
    a, dout = gpu_case(name, torch.bfloat16, T=64)
    a = SparseAttnArgs(**{**a.__dict__, "deterministic": True})
    ref = reference(a.q, a.kv, a.indices, a.topk_length, a.sink, a.sm_scale, a.d_v, dout)
    first = run_all(a, dout)
    for k in ("dq", "dkv") + (("dsink",) if a.sink is not None else ()):
        close(first[k], ref[k], 1e-2, k)
    for _ in range(9):
        again = run_all(a, dout)
        for k in ("dq", "dkv", "dsink"):
            if first[k] is not None:
                assert torch.equal(first[k], again[k]), k


# ----------------------------------------------------------------------------
# The backward with the slots as the MMAs' rows (keys_as_rows: the TP-shard
# head counts), on the same math and every rule of the heads-as-rows tiles

KAR = sa.TileConfig(BH=16, BN=16, CW=32, num_warps=4, num_stages=1, keys_as_rows=True)


@pytest.fixture
def nan_outputs(monkeypatch):
    """Every float tensor the backward allocates with empty / empty_like starts as NaN."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(x):
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", lambda *s, **k: poison(empty(*s, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *s, **k: poison(empty_like(*s, **k)))


def _bwd_against_reference(a, dout, cfg, tol):
    ref = reference(a.q, a.kv, a.indices, a.topk_length, a.sink, a.sm_scale, a.d_v, dout)
    out, lse = sa.forward(a)
    dq, dkv, dsink = sa.backward(a, out, lse, dout, cfg)
    assert dq.dtype == a.q.dtype and dkv.dtype == a.kv.dtype
    for name, x in dict(dq=dq, dkv=dkv).items():
        close(x, ref[name], tol, name)
    if a.sink is not None:
        close(dsink, ref["dsink"], tol, "dsink")
    return dict(dq=dq, dkv=dkv, dsink=dsink), ref


@pytest.mark.parametrize("dtype,deterministic,cfg", [
    (torch.float32, False, KAR),
    (torch.float16, False, KAR),
    (torch.float32, True, KAR),
    (torch.float32, False, sa.TileConfig(BH=32, BN=32, CW=16, num_warps=4, num_stages=1, keys_as_rows=True)),
])
def test_keys_as_rows_backward(nan_outputs, dtype, deterministic, cfg):
    """GQA, K past the last block, three column chunks with V ending mid-chunk,
    topk_length 0 / negative / past K, -1 and out-of-range indices, NaN and
    Inf in every kv row no valid slot reads, sinks of +-inf and one whose exp
    overflows, and outputs NaN before the call."""
    T, H, G, N, K, D, d_v = 5, 6, 2, 24, 37, 80, 48
    q, kv, idx, _, _, dout = make_inputs(T, H, G, N, K, D, d_v, dtype, seed=5)
    L = torch.tensor([37, 0, -4, 50, 9], dtype=torch.int32, device=DEV)
    idx = idx % 12 + 2  # rows 0, 1 and 14.. are read by no valid slot
    idx[:, :, ::4] = -1
    idx[:, 1, 1::6] = N
    idx[:, 0, 2::9] = torch.tensor(2 ** 31 - 1, dtype=torch.int32)
    idx[4, :, 9:] = 0  # past topk_length: row 0 is poisoned
    kv[:2] = float("nan")
    kv[14:] = float("inf")
    sink = torch.tensor([math.inf, -math.inf, 0.3, 2.4e38, -0.7, 1.1], device=DEV)
    a = args(q, kv, idx, L, sink, d_v=d_v, deterministic=deterministic)
    got, _ = _bwd_against_reference(a, dout, cfg, TOL[dtype])
    for name, x in got.items():
        assert not torch.isnan(x).any(), name
    assert torch.equal(got["dkv"][:2], torch.zeros_like(got["dkv"][:2]))
    assert torch.equal(got["dkv"][14:], torch.zeros_like(got["dkv"][14:]))
    # the rows with no valid slot (topk_length 0 and -4) give exactly 0
    assert torch.equal(got["dq"][1:3], torch.zeros_like(got["dq"][1:3]))
    if deterministic:
        again = sa.backward(a, *sa.forward(a), dout, cfg)
        for x, y in zip(got.values(), again):
            assert torch.equal(x, y)


def test_keys_as_rows_matches_heads_as_rows():
    """The two tilings of the same problem (MQA, 16 heads, no topk_length)
    agree to fp32 rounding, and the keys-as-rows tiles are picked first where
    the table names them."""
    T, H, G, N, K, D, d_v = 2, 16, 1, 40, 33, 48, 32
    q, kv, idx, _, s, dout = make_inputs(T, H, G, N, K, D, d_v, torch.float32, sink=True, seed=7)
    a = args(q, kv, idx, None, s, d_v=d_v)
    out, lse = sa.forward(a, sa.TileConfig(16, 16, 32, 4, 1))
    for x, y in zip((out, lse), sa.forward(a, KAR)):  # the online softmax across three blocks
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    old = sa.backward(a, out, lse, dout, sa.TileConfig(16, 16, 32, 4, 1))
    new = sa.backward(a, out, lse, dout, KAR)
    for x, y in zip(old, new):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert "keys_as_rows=True" in repr(KAR)  # explain() and the fit tables name the tiling


def test_keys_as_rows_table_leads_the_candidates(monkeypatch):
    """An entry of KEYS_AS_ROWS_BWD (KEYS_AS_ROWS_FWD) is the backward's
    (forward's) first candidate at its BH on a GPU, then its stage and block
    fallbacks, then the heads-as-rows tiles; fp32 never takes it."""
    cfg = sa.TileConfig(16, 64, 64, 4, 2, keys_as_rows=True)
    monkeypatch.setitem(sa.KEYS_AS_ROWS_BWD, 16, cfg)
    meta = dict(device="meta")
    a = SparseAttnArgs(torch.empty(4, 16, 576, dtype=torch.bfloat16, **meta),
                       torch.empty(64, 1, 576, dtype=torch.bfloat16, **meta),
                       torch.empty(4, 1, 2048, dtype=torch.int32, **meta), None, None, 0.1, 512)
    got = list(sa._candidates(a, True))
    assert got[0] == cfg and got[1].num_stages == 1 and got[1].keys_as_rows
    assert [c.BN for c in got if c.keys_as_rows] == [64, 64, 32, 16]
    assert not got[-1].keys_as_rows
    assert not any(c.keys_as_rows for c in sa._candidates(a, False))
    a32 = SparseAttnArgs(**{**a.__dict__, "q": torch.empty(4, 16, 576, **meta),
                            "kv": torch.empty(64, 1, 576, **meta)})
    assert not any(c.keys_as_rows for c in sa._candidates(a32, True))
    fwd = sa.TileConfig(32, 64, 128, 4, 2, keys_as_rows=True)
    monkeypatch.setitem(sa.KEYS_AS_ROWS_FWD, 32, fwd)
    a_h32 = SparseAttnArgs(**{**a.__dict__, "q": torch.empty(4, 32, 576, dtype=torch.bfloat16, **meta)})
    got = list(sa._candidates(a_h32, False))
    assert got[0] == fwd and not got[-1].keys_as_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_keys_as_rows_forward(nan_outputs, dtype):
    """The forward with S^T = K Q^T and O^T += V^T P^T: GQA, topk_length 0 /
    negative / past K, invalid indices, NaN in unread kv rows, sink extremes."""
    T, H, G, N, K, D, d_v = 4, 6, 2, 20, 37, 80, 48
    q, kv, idx, _, _, _ = make_inputs(T, H, G, N, K, D, d_v, dtype, seed=9)
    L = torch.tensor([37, 0, -2, 60], dtype=torch.int32, device=DEV)
    idx = idx % 10 + 1
    idx[:, :, ::5] = -1
    idx[:, 0, 3::7] = N
    kv[0] = float("nan")
    kv[11:] = float("inf")
    sink = torch.tensor([math.inf, -math.inf, 0.3, 2.4e38, -0.7, 1.1], device=DEV)
    a = args(q, kv, idx, L, sink, d_v=d_v)
    ref = reference(q, kv, idx, L, sink, a.sm_scale, d_v)
    out, lse = sa.forward(a, sa.TileConfig(16, 16, 32, 4, 1, keys_as_rows=True))
    close(out, ref["out"], TOL[dtype], "out")
    close(lse, ref["lse"], TOL[dtype], "lse")
    assert not torch.isnan(out).any() and torch.all(lse[1:3] == math.inf)


def test_preprocess_without_delta_reads_neither_out_nor_dout():
    """delta=False (the cute backward whose kernel computes Delta): out and dO
    (NaN here) are not read, log2 den is the full pass's and the dsink terms
    are -p_sink, so that terms * Delta are the full pass's terms."""
    gen = torch.Generator().manual_seed(3)
    sink = torch.randn(16, generator=gen)
    sink[:3] = torch.tensor([math.inf, -math.inf, 1e30])
    a = SparseAttnArgs(torch.randn(5, 16, 576, generator=gen, device=DEV), torch.randn(8, 1, 576, device=DEV),
                       torch.zeros(5, 1, 8, dtype=torch.int32, device=DEV), None, sink.to(DEV), 576 ** -0.5, 512)
    out = torch.randn(5, 16, 512, generator=gen)
    dout = torch.randn(5, 16, 512, generator=gen)
    lse = torch.randn(5, 16, generator=gen)
    lse[0, 4:6] = math.inf  # empty rows
    delta, lg2, parts = (x.cpu() for x in sa.preprocess(a, out.to(DEV), lse.to(DEV), dout.to(DEV)))
    nan = torch.full_like(out, math.nan).to(DEV)
    _, lg2_, neg_psink = (x.cpu() for x in sa.preprocess(a, nan, lse.to(DEV), nan, delta=False))
    assert torch.equal(lg2_, lg2)
    assert not torch.isnan(neg_psink).any() and (neg_psink <= 0).all()
    torch.testing.assert_close(neg_psink * delta, parts, rtol=0, atol=0)
    assert torch.equal(neg_psink[:, 0], torch.full((5,), -1.0)) and torch.equal(neg_psink[:, 1], torch.zeros(5))


def test_preprocess_dout_stats():
    """The preprocess's dO stats (the deterministic cute backward's bounds
    read them): max|dO| of each row exactly, ||dO|| within fp32 rounding;
    a row whose squares overflow (or hold NaN) gets sqrt(d_v) max|dO|, still
    a bound of its norm; delta unchanged by the option."""
    gen = torch.Generator().manual_seed(2)
    a = SparseAttnArgs(torch.randn(5, 16, 576, generator=gen, device=DEV), torch.randn(8, 1, 576, device=DEV),
                       torch.zeros(5, 1, 8, dtype=torch.int32, device=DEV), None, None, 576 ** -0.5, 512)
    out = torch.randn(5, 16, 512, generator=gen)
    dout = torch.randn(5, 16, 512, generator=gen) * torch.logspace(-3, 3, 16)[None, :, None]
    dout[1, 2, 7] = 3e20    # its square overflows fp32
    dout[2, 3, 9] = math.nan
    lse = torch.randn(5, 16, generator=gen)
    stats = torch.full((5, 16, 2), math.nan, device=DEV)
    delta, _, _ = sa.preprocess(a, out.to(DEV), lse.to(DEV), dout.to(DEV), stats)
    plain, _, _ = sa.preprocess(a, out.to(DEV), lse.to(DEV), dout.to(DEV))
    torch.testing.assert_close(delta.cpu(), plain.cpu(), rtol=0, atol=0, equal_nan=True)
    stats = stats.cpu().double()
    d = dout.double()
    finite = d.isfinite().all(-1)
    assert torch.equal(stats[..., 0][finite], d.abs().amax(-1)[finite])
    norm = d.norm(dim=-1)
    ok = finite.clone()
    ok[1, 2] = False
    torch.testing.assert_close(stats[..., 1][ok], norm[ok], rtol=1e-6, atol=0)
    # the fallback, in fp32: a row whose squares overflow, a row with NaN
    for t, h in ((1, 2), (2, 3)):
        assert math.isclose(stats[t, h, 1], 512 ** 0.5 * stats[t, h, 0], rel_tol=1e-6), (t, h)
    assert stats[1, 2, 1] >= norm[1, 2] and stats[1, 2, 0] == d[1, 2, 7]
