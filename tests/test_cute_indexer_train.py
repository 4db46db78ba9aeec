"""The CuTe DSL SM90 sparse indexer forward: logits and KL stats.

* CPU (CI): the kernel compiles ahead of time for sm_90a (``CUTE_DSL_ARCH``)
  with wgmma and the cp.async gather in its PTX, no spill, and register
  targets its launch can grant; what it serves, and the routing (auto keeps
  Triton until this GPU is measured, ``explain()`` says why).
* GPU (``-m gpu``, an SM90 device): logits and the KL stats against a float64
  computation written here, with hostile indices, every kind of topk_length,
  rows of K not a multiple of 64, NaN in k rows no valid slot names, and an
  output whose memory held NaN before the call.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

import dsa
from cute_offline import HAVE_DSL, SM90, compile_reports, fake_launch
from dsa._args import SparseIndexerArgs
from dsa.cute import indexer_train as cit

needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl is not installed")
gpu = pytest.mark.gpu
sm90 = pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")


# --------------------------------------------------------------------------
# ahead-of-time compilation (CPU)

_CONFIGS = [
    # name, q dtype, weights dtype, H, D, topk_length, kl
    ("v32_logits", "bfloat16", "float32", 64, 128, True, False),
    ("v32_kl", "bfloat16", "float32", 64, 128, False, True),
    ("h128_kl_fp16", "float16", "bfloat16", 128, 128, True, True),
    ("h16_d64_logits", "bfloat16", "bfloat16", 16, 64, False, False),
    ("h32_d256_kl", "float16", "float16", 32, 256, True, True),
]


@needs_dsl
def test_compiles_offline_for_sm90_without_spills(tmp_path):
    from dsa.cute.indexer_train_sm90 import REGS, ctas_per_sm

    calls = [(name, "dsa.cute.indexer_train:compile_offline", [f"torch.{dt}", f"torch.{wt}", H, D, has_len, kl], {})
             for name, dt, wt, H, D, has_len, kl in _CONFIGS]
    needles = ("wgmma.mma_async", "cp.async.cg.shared.global", "cp.async.mbarrier.arrive.noinc", "shfl.sync",
               "setmaxnreg.inc", "setmaxnreg.dec", "st.global.f32", "ex2.approx")
    res = compile_reports(calls, needles, "sm_90a", tmp_path)
    for name, dt, wt, H, D, has_len, kl in _CONFIGS:
        r = res[name]
        n = r["needles"]
        # S^T = K Q^T: D / 16 steps in each consumer's copy of the loop
        assert n["wgmma.mma_async"] == 2 * (D // 16), (name, n)
        # Q's copies (H / 16 passes) and the gather's (4 passes, in each of
        # the two blocks a loop step fills), a 16-byte copy per 64-column chunk
        assert n["cp.async.cg.shared.global"] == (H // 16 + 8) * (D // 64), (name, n)
        assert n["cp.async.mbarrier.arrive.noinc"] == 3, (name, n)
        assert n["shfl.sync"] >= 4, (name, n)  # the quad's head sums
        assert n["setmaxnreg.inc"] == 1 and n["setmaxnreg.dec"] == 1, (name, n)
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and not r["wgmma_serialized"], (name, r)
        # the register targets fit what the launch gives a thread
        p, c = REGS[ctas_per_sm(H, D)]
        assert r["registers"] == 65536 // (384 * ctas_per_sm(H, D)) // 8 * 8, (name, r)
        assert p + 2 * c <= 3 * r["registers"], (name, r)
        assert r["smem"] * ctas_per_sm(H, D) <= r["smem_limit"], (name, r)


_BWD_CONFIGS = [
    # name, q dtype, weights dtype, D, topk_length, kl, deterministic
    ("v32_kl", "bfloat16", "float32", 128, False, True, False),
    ("logits_len_fp16", "float16", "bfloat16", 128, True, False, False),
    ("d64_kl_len", "bfloat16", "bfloat16", 64, True, True, False),
    ("v32_kl_det", "bfloat16", "float32", 128, False, True, True),
    ("logits_len_fp16_det", "float16", "bfloat16", 128, True, False, True),
]


@needs_dsl
def test_backward_compiles_offline_for_sm90_without_spills(tmp_path):
    from dsa.cute.indexer_train_bwd_sm90 import BWD_REGS

    calls = [(name, "dsa.cute.indexer_train:compile_offline", [f"torch.{dt}", f"torch.{wt}", 64, D, has_len, kl],
              {"backward": True, "deterministic": det}) for name, dt, wt, D, has_len, kl, det in _BWD_CONFIGS]
    red = "red.relaxed.gpu.global.add.L2::cache_hint.v4.f32"
    needles = ("wgmma.mma_async", red, "createpolicy", "st.global.b32", "bar.sync", "cvt.rni.f32.f32")
    res = compile_reports(calls, needles, "sm_90a", tmp_path)
    for name, dt, wt, D, has_len, kl, det in _BWD_CONFIGS:
        r = res[name]
        n = r["needles"]
        # each consumer: S^T (D / 16 steps), dq (4: 64 slots), dk (4: 64 heads) per 64-column chunk
        assert n["wgmma.mma_async"] == 2 * (D // 16 + 4 + 4 * (D // 64)), (name, n)
        # each consumer: 8 four-float adds a thread and chunk, under the evict-last policy
        assert n[red] == 2 * 8 * (D // 64), (name, n)
        assert n["createpolicy"] >= 2, (name, n)
        # deterministic: each added value rounded to its key's quantum first
        assert n["cvt.rni.f32.f32"] == (2 * 8 * 4 * (D // 64) if det else 0), (name, n)
        assert not r["wgmma_serialized"], (name, r)
        assert n["st.global.b32"] >= (64 * D // 128) // 2, (name, n)  # dq, two columns a word
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (name, r)
        assert r["registers"] == 168 and BWD_REGS[0] + 2 * BWD_REGS[1] <= 3 * r["registers"], (name, r)


# --------------------------------------------------------------------------
# host logic (CPU)


def _args(T=3, N=40, H=64, D=128, K=70, dtype=torch.bfloat16, w_dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k = torch.randn(N, D, generator=g).to(dtype)
    w = torch.randn(T, H, generator=g).to(w_dtype)
    idx = torch.randint(0, N, (T, K), generator=g, dtype=torch.int32)
    return SparseIndexerArgs(q.to(device), k.to(device), w.to(device), idx.to(device), None, 0.5)


@needs_dsl
@pytest.mark.parametrize("change, words", [
    (dict(H=8), "multiple of 16 heads"),
    (dict(H=256), "multiple of 16 heads"),
    (dict(D=96), "D_i = 96"),
    (dict(dtype=torch.float32), "bf16 or fp16"),
    (dict(w_dtype=torch.float64), "weights dtype"),
])
def test_shape_reasons(change, words):
    assert words in cit.shape_reason(_args(**change))


@needs_dsl
def test_backward_reasons():
    from dsa.cute.indexer_train_bwd_sm90 import bwd_reason

    import cutlass

    assert bwd_reason(cutlass.BFloat16, 64, 128) is None
    assert "64 heads" in bwd_reason(cutlass.BFloat16, 32, 128)
    assert "64 heads" in bwd_reason(cutlass.BFloat16, 64, 256)


@needs_dsl
def test_served_shapes_have_no_reason():
    for H, D in ((16, 64), (64, 128), (128, 256)):
        assert cit.shape_reason(_args(H=H, D=D)) is None


def test_a_cpu_call_is_declined_with_the_architecture():
    assert "CUDA GPU" in cit.supports(_args())
    with pytest.raises(ValueError, match="CUDA GPU"):
        dsa.sparse_indexer_scores(*_public(_args()), backend="cute")


def _public(a: SparseIndexerArgs):
    return a.q, a.k, a.weights, a.indices


def test_auto_keeps_triton_on_a_gpu_not_measured(monkeypatch):
    monkeypatch.setattr(cit, "PLACEMENT", {})
    monkeypatch.setattr(cit, "device_name", lambda dev: "Some GPU")
    assert "no measurement" in cit.placement_reason(_args(), "indexer_kl_fwd")
    monkeypatch.setattr(cit, "PLACEMENT", {"Some GPU": (("sparse_indexer_fwd", "indexer_kl_fwd"), ((64, 128),))})
    assert cit.placement_reason(_args(), "indexer_kl_fwd") is None
    assert "Triton's measured faster" in cit.placement_reason(_args(), "indexer_kl_bwd")
    assert "not measured" in cit.placement_reason(_args(H=32), "indexer_kl_fwd")


def _fake_sm90(deterministic=False, H=64, D=128, q_ptr=1024):
    """A stand-in for SparseIndexerArgs on an SM90 device (the V3.2 indexer's shape)."""
    dev = torch.device("cuda", 0)
    q = types.SimpleNamespace(dtype=torch.bfloat16, device=dev, data_ptr=lambda: q_ptr)
    k = types.SimpleNamespace(dtype=torch.bfloat16, data_ptr=lambda: 2048)
    w = types.SimpleNamespace(dtype=torch.float32)
    return types.SimpleNamespace(q=q, k=k, weights=w, H=H, D=D, T=4096, N=8192, K=2048, topk_length=None,
                                 deterministic=deterministic)


@needs_dsl
def test_routing_on_an_sm90_gpu(monkeypatch):
    """backend="cute" takes every op the kernels serve, deterministic
    gradients included; auto takes them only where PLACEMENT names this GPU
    and shape; other head counts are declined with their reasons."""
    from dsa._args import Unsupported

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    from dsa.cute import host

    monkeypatch.setattr(host, "_NAMES", {})
    for op in cit.FORWARD + cit.BACKWARD:
        assert dsa.cute.backend_op(op, _fake_sm90(), auto=False) is cit._OPS[op]
        chosen = dsa.cute.backend_op(op, _fake_sm90(), auto=True)
        assert chosen.fn is cit._OPS[op] and "measured faster" in chosen.note
    for op in cit.FORWARD + cit.BACKWARD:
        assert dsa.cute.backend_op(op, _fake_sm90(deterministic=True), auto=False) is cit._OPS[op]
    with pytest.raises(Unsupported, match="64 heads"):
        dsa.cute.backend_op("sparse_indexer_bwd", _fake_sm90(H=32), auto=False)
    with pytest.raises(Unsupported, match="not measured"):
        dsa.cute.backend_op("sparse_indexer_fwd", _fake_sm90(H=32), auto=True)
    with pytest.raises(Unsupported, match="16-byte aligned"):
        dsa.cute.backend_op("sparse_indexer_fwd", _fake_sm90(q_ptr=1032), auto=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(host, "_NAMES", {})
    with pytest.raises(Unsupported, match="no measurement"):
        dsa.cute.backend_op("indexer_kl_fwd", _fake_sm90(), auto=True)


@needs_dsl
def test_host_passes_each_kernel_its_buffers_in_order(monkeypatch):
    """The four ops' host side, with the launch recorded instead of run:
    every pointer in the kernel's order (``_ptr_types``), the zero row
    last, the scalars and stream after it, all under q's device; dk comes
    back from the fragment column order as k's dtype."""
    events, launches, zero = fake_launch(monkeypatch, cit, 128)
    monkeypatch.setattr(cit, "supports", lambda a, op="": None)
    b = _args(T=3, N=40, K=70)
    a = SparseIndexerArgs(b.q, b.k, b.weights, b.indices, torch.ones(3, dtype=torch.int32), 0.5)
    out = cit.sparse_indexer_fwd(a)
    target = torch.rand(3, 70)
    stats = cit.indexer_kl_fwd(a, target)
    stats.normal_()  # the recorded launch wrote nothing: give the empty buffer finite values to compare
    scale = torch.tensor(0.25)
    dq, dk, dw = cit.indexer_kl_bwd(a, target, stats, scale)
    dl = torch.randn(3, 70)
    cit.sparse_indexer_bwd(a, dl)
    assert len(launches) == 4
    for args in launches:
        assert args[:5] == (a.q, a.k, a.weights, a.indices, a.topk_length)
        assert args[-6] is zero and args[-5:] == (3, 40, 70, 0.5, "stream")
    assert launches[0][5] is out and launches[0][6] is out
    assert torch.equal(launches[1][5], target) and launches[1][6] is stats
    g, st, sc, dq_, dk_, dw_, pos = launches[2][5:12]
    assert torch.equal(g, target) and torch.equal(st, stats) and float(sc) == 0.25 and dq_ is dq and dw_ is dw
    assert dk_.dtype == torch.float32 and dk_.shape == (40, 128) and dk.dtype == a.k.dtype
    assert pos is dk_  # no positions without deterministic: never read
    assert all(torch.equal(x, dl) for x in launches[3][5:8])
    assert all(e[1] == a.q.device for e in events if e[0] in ("enter", "stream", "zero_row"))


@needs_dsl
@pytest.mark.parametrize("kl, given", [(False, False), (True, False), (True, True)])
def test_deterministic_host_passes_the_keys_quanta(monkeypatch, kl, given):
    """deterministic=True on the host: one backward launch whose last buffer
    is the keys' quanta (``dsa.triton.dk_quanta``) from the gradient's
    bound; for the KL loss from the forward's logits, or where none are
    given from logits the forward kernel recomputes first."""
    from dsa.triton.dk_quanta import dk_quanta

    events, launches, zero = fake_launch(monkeypatch, cit, 128)
    monkeypatch.setattr(cit, "supports", lambda a, op="": None)
    b = _args(T=5, N=40, K=70)
    length = torch.tensor([70, 0, 5, -1, 64], dtype=torch.int32)
    a = SparseIndexerArgs(b.q, b.k, b.weights, b.indices, length, 0.5, deterministic=True)
    logits = torch.randn(5, 70)
    calls = []

    def kernel(*args):
        calls.append(args)
        if len(args) == 13:  # the forward: (q, k, w, idx, len, target, out, zero, T, N, K, sm, stream)
            args[6].copy_(logits)

    monkeypatch.setattr(cit, "_compiled", lambda *x: kernel)
    target, stats, scale = torch.rand(5, 70), torch.rand(5, 4), torch.tensor(0.25)
    if kl:
        cit.indexer_kl_bwd(a, target, stats, scale, logits if given else None)
        exp = dk_quanta(a.q, a.weights, a.indices, length, 40, 0.5, target, scale.reshape(1), logits, stats)
    else:
        cit.sparse_indexer_bwd(a, target)
        exp = dk_quanta(a.q, a.weights, a.indices, length, 40, 0.5, target, torch.ones(1))
    assert [len(c) for c in calls] == ([13, 18] if kl and not given else [18])
    bwd = calls[-1]
    assert bwd[-6] is zero and torch.equal(bwd[11], exp) and bwd[11].shape == (40, 2)
    assert bwd[9].shape == (40, 128) and bwd[9].dtype == torch.float32  # dk's accumulator, added into


# --------------------------------------------------------------------------
# GPU: against float64


def _f64_logits(q, k, w, idx, length, sm_scale):
    """[T, K] float64: sm_scale sum_h w relu(q . k[idx]) on valid slots, -inf elsewhere."""
    q, k, w, idx = q.double().cpu(), k.double().cpu(), w.double().cpu(), idx.long().cpu()
    T, K = idx.shape
    N = k.shape[0]
    L = torch.full((T,), K) if length is None else length.long().cpu().clamp(0, K)
    valid = (torch.arange(K)[None, :] < L[:, None]) & (idx >= 0) & (idx < N)
    rows = k[idx.clamp(0, N - 1)]                          # [T, K, D]
    dots = torch.einsum("thd,tkd->tkh", q, rows)           # [T, K, H]
    lg = sm_scale * (torch.relu(dots) * w[:, None, :]).sum(-1)
    return torch.where(valid, lg, -math.inf), valid


def _f64_stats(lg, valid, target):
    """[T, 4]: loss_t, lse, sum of valid target, has a valid slot."""
    tg = torch.where(valid, target.double().cpu(), 0.0)
    out = torch.zeros(lg.shape[0], 4, dtype=torch.float64)
    for t in range(lg.shape[0]):
        v = valid[t]
        if not v.any():
            out[t, 1] = -math.inf
            continue
        lse = torch.logsumexp(lg[t][v], 0)
        nz = v & (tg[t] != 0)
        out[t, 0] = (tg[t][nz] * (torch.log(tg[t][nz]) - (lg[t][nz] - lse))).sum()
        out[t, 1], out[t, 2], out[t, 3] = lse, tg[t].sum(), 1.0
    return out


def _rel(got, exp):
    got, exp = got.double().cpu(), exp.double().cpu()
    fin = torch.isfinite(exp)
    assert torch.equal(torch.isfinite(got), fin), "non-finite entries differ"
    assert torch.equal(got[~fin], exp[~fin])
    return ((got[fin] - exp[fin]).norm() / exp[fin].norm().clamp_min(1e-30)).item()


def _hostile(T, N, K, H, D, dtype, w_dtype, seed):
    """Inputs with every kind of slot: hostile indices, lengths below 0, 0,
    inside, K and past K, and NaN in the k rows 0-3, which only invalid
    slots and slots past a row's length name."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(N, D, device="cuda", generator=g).to(dtype)
    k[:4] = float("nan")
    w = torch.randn(T, H, device="cuda", generator=g).to(w_dtype)
    idx = torch.randint(4, N, (T, K), device="cuda", generator=g, dtype=torch.int32)
    bad = torch.rand(T, K, device="cuda", generator=g) < 0.1
    choices = torch.tensor([-1, N, N + 3, 2**31 - 1, -(2**31)], device="cuda", dtype=torch.int32)
    idx = torch.where(bad, choices[torch.randint(0, 5, (T, K), device="cuda", generator=g)], idx)
    length = torch.randint(1, K + 1, (T,), device="cuda", generator=g, dtype=torch.int32)
    length[: min(T, 5)] = torch.tensor([-3, 0, 1, K, K + 7], dtype=torch.int32)[: min(T, 5)]
    past = torch.arange(K, device="cuda")[None, :] >= length[:, None]
    idx = torch.where(past, torch.randint(0, 4, (T, K), device="cuda", generator=g, dtype=torch.int32), idx)
    return q, k, w, idx, length


def _poisoned_pool(nbytes):
    """Leave NaN in the caching allocator's free memory, so an output the
    kernel fails to write shows."""
    torch.empty(nbytes // 4 + 1024, device="cuda").fill_(float("nan"))
    torch.cuda.synchronize()


_GPU_SHAPES = [
    # T, N, K, H, D, dtype, weights dtype
    (64, 300, 200, 64, 128, torch.bfloat16, torch.float32),
    (33, 1000, 512, 64, 128, torch.float16, torch.bfloat16),
    (17, 257, 130, 128, 128, torch.bfloat16, torch.float32),
    (20, 200, 64, 16, 64, torch.bfloat16, torch.bfloat16),
    (9, 150, 100, 32, 256, torch.float16, torch.float16),
]


@gpu
@sm90
@needs_dsl
@pytest.mark.parametrize("T, N, K, H, D, dtype, w_dtype", _GPU_SHAPES)
def test_gpu_logits_against_float64(T, N, K, H, D, dtype, w_dtype):
    q, k, w, idx, length = _hostile(T, N, K, H, D, dtype, w_dtype, seed=T + K)
    a = SparseIndexerArgs(q, k, w, idx, length, 0.3)
    _poisoned_pool(T * K * 4)
    got = cit.sparse_indexer_fwd(a)
    exp, _ = _f64_logits(q, k, w, idx, length, 0.3)
    assert _rel(got, exp) < 1e-5


@gpu
@sm90
@needs_dsl
@pytest.mark.parametrize("T, N, K, H, D, dtype, w_dtype", _GPU_SHAPES)
def test_gpu_kl_stats_against_float64(T, N, K, H, D, dtype, w_dtype):
    q, k, w, idx, length = _hostile(T, N, K, H, D, dtype, w_dtype, seed=2 * T + K)
    a = SparseIndexerArgs(q, k, w, idx, length, 0.3)
    g = torch.Generator(device="cuda").manual_seed(7)
    target = torch.rand(T, K, device="cuda", generator=g)
    target[torch.rand(T, K, device="cuda", generator=g) < 0.3] = 0.0  # zero targets count 0
    target[:, 1::7] = float("nan")  # read only where valid: an invalid slot's target is ignored
    lg, valid = _f64_logits(q, k, w, idx, length, 0.3)
    target = torch.where(valid.cuda(), target.nan_to_num(0.5), target)
    _poisoned_pool(T * 16)
    got = cit.indexer_kl_fwd(a, target)
    exp = _f64_stats(lg, valid, target)
    assert torch.equal(got[:, 3].cpu(), exp[:, 3].float())
    for col in range(3):
        assert _rel(got[:, col], exp[:, col]) < 1e-4, col


@gpu
@sm90
@needs_dsl
def test_gpu_public_path_auto_takes_cute_where_placed(monkeypatch):
    from dsa import selector

    q, k, w, idx, length = _hostile(40, 500, 300, 64, 128, torch.bfloat16, torch.float32, seed=3)
    want = dsa.sparse_indexer_scores(q, k, w, idx, sm_scale=0.2, topk_length=length, backend="triton")
    monkeypatch.setattr(cit, "PLACEMENT", {torch.cuda.get_device_name(): (cit.FORWARD, ((64, 128),))})
    selector.forget()
    got = dsa.sparse_indexer_scores(q, k, w, idx, sm_scale=0.2, topk_length=length)
    assert "cute" in dsa.explain("sparse_indexer_scores", q, k, w, idx, sm_scale=0.2, topk_length=length)
    assert _rel(got, want) < 1e-5
    target = torch.rand(40, 300, device="cuda")
    qg, kg, wg = (x.clone().requires_grad_() for x in (q, k, w))
    loss = dsa.indexer_kl_loss(qg, kg, wg, idx, target, sm_scale=0.2, topk_length=length)
    ref = dsa.indexer_kl_loss(q, k, w, idx, target, sm_scale=0.2, topk_length=length, backend="triton")
    assert abs(loss.item() - ref.item()) <= 1e-4 * abs(ref.item())
    loss.backward()  # the backward stays Triton's
    assert torch.isfinite(qg.grad).all() and torch.isfinite(kg.grad).all()


def _f64_leaves(q, k, w):
    return tuple(x.detach().double().cpu().requires_grad_() for x in (q, k, w))


def _f64_logits_grad(q, k, w, idx, length, sm_scale):
    """Differentiable float64 logits [T, K] and validity: invalid slots gather
    a zero row (so the NaN rows never enter) and get -inf."""
    idx = idx.long().cpu()
    T, K = idx.shape
    N = k.shape[0]
    L = torch.full((T,), K) if length is None else length.long().cpu().clamp(0, K)
    valid = (torch.arange(K)[None, :] < L[:, None]) & (idx >= 0) & (idx < N)
    rows = torch.where(valid[..., None], k[idx.clamp(0, N - 1)], 0.0)
    lg = sm_scale * (torch.relu(torch.einsum("thd,tkd->tkh", q, rows)) * w[:, None, :]).sum(-1)
    return torch.where(valid, lg, -math.inf), valid


@gpu
@sm90
@needs_dsl
@pytest.mark.parametrize("det", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("kl", [True, False], ids=["kl", "logits"])
@pytest.mark.parametrize("T, N, K, D, dtype, w_dtype", [
    (48, 300, 200, 128, torch.bfloat16, torch.float32),
    (21, 1000, 512, 64, torch.float16, torch.bfloat16),
])
def test_gpu_backward_against_float64(det, kl, T, N, K, D, dtype, w_dtype):
    """dq, dk and dweights against float64 on hostile inputs, outputs over
    NaN-filled memory; deterministic: bitwise equal on a second call."""
    q, k, w, idx, length = _hostile(T, N, K, 64, D, dtype, w_dtype, seed=5 * T + K)
    k = torch.where(torch.isnan(k), 0.0, k)  # the float64 gradient of a NaN row is NaN; the kernel reads none
    a = SparseIndexerArgs(q, k, w, idx, length, 0.4, deterministic=det)
    ql, kl_, wl = _f64_leaves(q, k, w)
    lg, valid = _f64_logits_grad(ql, kl_, wl, idx, length, 0.4)
    g = torch.Generator(device="cuda").manual_seed(11)
    if kl:
        target = torch.rand(T, K, device="cuda", generator=g)
        target[torch.rand(T, K, device="cuda", generator=g) < 0.3] = 0.0
        stats = cit.indexer_kl_fwd(a, target)
        R = max(int(valid.any(1).sum()), 1)
        scale = torch.tensor(1.0 / R, device="cuda")
        tg = torch.where(valid, target.double().cpu(), 0.0)
        lse = torch.logsumexp(lg, -1, keepdim=True)
        nz = valid & (tg != 0)
        terms = torch.where(nz, tg * (torch.log(torch.where(nz, tg, 1.0)) - (lg - lse)), 0.0)
        (terms.sum() / R).backward()
        _poisoned_pool(T * 64 * D * 2)
        dq, dk, dw = cit.indexer_kl_bwd(a, target, stats, scale)
        again = cit.indexer_kl_bwd(a, target, stats, scale)
    else:
        dl = torch.randn(T, K, device="cuda", generator=g)
        (torch.where(valid, lg, 0.0) * dl.double().cpu()).sum().backward()
        dl = torch.where(valid.cuda(), dl, float("nan"))  # an invalid slot's gradient is never read
        _poisoned_pool(T * 64 * D * 2)
        dq, dk, dw = cit.sparse_indexer_bwd(a, dl)
        again = cit.sparse_indexer_bwd(a, dl)
    for name, got, leaf, x, y in zip(("dq", "dk", "dw"), (dq, dk, dw), (ql, kl_, wl), (q, k, w), again):
        assert got.dtype == x.dtype and got.shape == x.shape, name
        assert _rel(got, leaf.grad) < 1e-2, name
        if det:
            assert torch.equal(got, y), name
    # k rows no valid slot names get exactly zero
    named = torch.zeros(N, dtype=torch.bool)
    named[idx.long().cpu()[valid].unique()] = True
    assert torch.equal(dk.cpu()[~named], torch.zeros_like(dk.cpu()[~named]))


@gpu
@sm90
@needs_dsl
def test_gpu_kl_step_captures_in_a_cuda_graph():
    """The cute forward and backward of the KL loss, captured once, replay
    equal to an eager step on new inputs (dk to the atomics' rounding)."""
    T, N, K = 64, 700, 384
    q, k, w, idx, length = _hostile(T, N, K, 64, 128, torch.bfloat16, torch.float32, seed=9)
    k = torch.where(torch.isnan(k), 0.0, k)
    target = torch.rand(T, K, device="cuda")
    leaves = [x.clone().requires_grad_() for x in (q, k, w)]

    def step():
        loss = dsa.indexer_kl_loss(*leaves, idx, target, sm_scale=0.3, topk_length=length, backend="cute")
        return (loss, *torch.autograd.grad(loss, leaves))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    g = torch.Generator(device="cuda").manual_seed(10)
    with torch.no_grad():
        for x in leaves:
            x.copy_(torch.randn(x.shape, device="cuda", generator=g, dtype=x.dtype))
        target.copy_(torch.rand(T, K, device="cuda", generator=g))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    assert torch.equal(captured[0], eager[0])
    for name, a_, b_ in zip(("dq", "dk", "dw"), captured[1:], eager[1:]):
        assert _rel(a_, b_) < 1e-5, name
