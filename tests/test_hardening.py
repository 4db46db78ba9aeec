"""Host-side hardening: argument forms a user reaches for first, explain's
errors, deterministic reference gradients without atomics, packed indexer
checks that read nothing back while a CUDA graph is captured, and the README
example on a machine without a GPU."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import dsa
from dsa import _checks, _rules

ROOT = Path(__file__).resolve().parents[1]


def _sparse_inputs(T=3, H=2, D=16, N=5, K=4, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D, generator=g, dtype=dtype)
    kv = torch.randn(N, D, generator=g, dtype=dtype)
    idx = torch.randint(-1, N, (T, K), generator=g, dtype=torch.int32)
    return q, kv, idx


def _indexer_inputs(T=6, H=2, D=8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(T, H, D, generator=g), torch.randn(T, D, generator=g), torch.randn(T, H, generator=g)


# --------------------------------------------------------------------------
# D = 0, explain without a required argument, numpy and 0-dim scalars


def test_zero_head_dim_blames_q():
    q, kv, idx = _sparse_inputs()
    with pytest.raises(ValueError, match=r"^q: .*head dim D >= 1"):
        dsa.sparse_attention(q[..., :0], kv[..., :0], idx)
    with pytest.raises(ValueError, match=r"^q: .*head dim D >= 1"):
        dsa.explain("sparse_attention", q[..., :0], kv[..., :0], idx)


@pytest.mark.parametrize("name,args,missing", [
    ("sparse_attention", 2, "indices"),
    ("indexer_topk", 3, "topk"),
    ("topk_indices", 1, "k"),
    ("attention_target", 3, "lse"),
])
def test_explain_names_a_missing_argument(name, args, missing):
    q, kv, idx = _sparse_inputs()
    given = {"sparse_attention": (q, kv, idx), "indexer_topk": _indexer_inputs(), "topk_indices": (q[0],),
             "attention_target": (q, kv, idx)}[name][:args]
    with pytest.raises(TypeError, match=rf"^{name}\(\): missing a required argument: '{missing}'"):
        dsa.explain(name, *given)
    with pytest.raises(TypeError, match=missing):
        getattr(dsa, name)(*given)


def test_numpy_scalars_are_accepted():
    q, kv, idx = _sparse_inputs(D=24)
    ref = dsa.sparse_attention(q, kv, idx, sm_scale=0.25, d_v=16)
    for sm, dv in ((np.float32(0.25), np.int64(16)), (np.float64(0.25), np.int32(16)),
                   (torch.tensor(0.25), torch.tensor(16))):
        assert torch.equal(dsa.sparse_attention(q, kv, idx, sm_scale=sm, d_v=dv), ref)
    qi, ki, wi = _indexer_inputs()
    ref = dsa.indexer_topk(qi, ki, wi, 3, sm_scale=0.5, ratio=2)
    for k in (np.int64(3), torch.tensor(3), torch.tensor(3, dtype=torch.int32)):
        assert torch.equal(dsa.indexer_topk(qi, ki, wi, k, sm_scale=np.float32(0.5), ratio=np.int64(2)), ref)
    s = torch.randn(4, 9)
    assert torch.equal(dsa.topk_indices(s, np.int64(5)), dsa.topk_indices(s, 5))
    assert torch.equal(dsa.topk_indices(s, torch.tensor(5)), dsa.topk_indices(s, 5))


@pytest.mark.parametrize("bad", [True, np.bool_(True), 2.0, np.float32(2.0), torch.tensor([2, 3]), torch.tensor(2.0)])
def test_counts_stay_integers(bad):
    with pytest.raises(TypeError, match=r"^k: expected an int"):
        dsa.topk_indices(torch.randn(2, 5), bad)


def test_scales_stay_real_numbers():
    q, kv, idx = _sparse_inputs()
    for bad in (True, np.bool_(False), "0.1", torch.tensor([0.1, 0.2])):
        with pytest.raises(TypeError, match=r"^sm_scale: expected a float"):
            dsa.sparse_attention(q, kv, idx, sm_scale=bad)


# --------------------------------------------------------------------------
# deterministic gradients: one segment sum, no atomics


def _interleave(index: torch.Tensor, seed: int) -> torch.Tensor:
    """A new order of the entries: the destinations interleaved at random,
    each destination's own entries kept in their order (what atomics vary)."""
    pos = torch.randperm(index.shape[0], generator=torch.Generator().manual_seed(seed))
    new_index = index[pos]
    order = torch.empty_like(pos)
    for i in index.unique():
        order[new_index == i] = torch.nonzero(index == i).flatten()
    assert torch.equal(index[order], new_index)
    return order


def test_segment_sum_is_exact_and_bitwise_across_interleavings():
    g = torch.Generator().manual_seed(2)
    n, M, D = 7, 300, 3
    index = torch.randint(0, n, (M,), generator=g)
    # magnitudes from 1e-6 to 1e6: fp32 sums of these depend on the order of the additions
    src = torch.randn(M, D, generator=g) * torch.logspace(-6, 6, M).view(M, 1)
    got = _rules.segment_sum(index, src, n)
    exact = torch.zeros(n, D, dtype=torch.float64).index_add_(0, index, src.double())
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-3)
    assert got.dtype == src.dtype and got.shape == (n, D)
    for seed in range(6):
        order = _interleave(index, seed)
        assert torch.equal(_rules.segment_sum(index[order], src[order], n), got)
    assert torch.equal(_rules.segment_sum(index[:0], src[:0], n), torch.zeros(n, D))
    one = _rules.segment_sum(index[:1], src[:1], n)
    assert torch.equal(one[index[0]], src[0]) and one.count_nonzero() == src[0].count_nonzero()


def test_chunk_rows_fills_the_budget_in_whole_waves(monkeypatch):
    from dsa.triton import segment_sum

    monkeypatch.setattr(segment_sum, "WORKSPACE_BYTES", 1000)
    assert segment_sum.chunk_rows(50, 10) == 50             # all rows fit: one chunk
    assert segment_sum.chunk_rows(500, 10) == 100           # the budget's rows
    assert segment_sum.chunk_rows(500, 10, 66) == 66        # rounded down to whole waves
    assert segment_sum.chunk_rows(500, 10, 30) == 90
    assert segment_sum.chunk_rows(500, 10, 132) == 100      # fewer rows than a wave: not rounded
    assert segment_sum.chunk_rows(500, 4000, 66) == 1       # a row over the budget: one a chunk
    assert segment_sum.chunk_rows(100, 10, 66) == 100       # a single chunk is never cut


@pytest.mark.parametrize("n_dst", [5, 2**15 - 1, 2**15, 40000])
def test_inverse_index_on_narrow_sort_keys(n_dst):
    """The stable sort runs on int16 keys up to 2**15 destinations (the
    never-summed key n_dst included), int32 above: the same order and starts
    as a stable sort of the int64 keys."""
    from dsa.triton import segment_sum

    g = torch.Generator().manual_seed(n_dst)
    keys = torch.randint(0, n_dst, (3000,), generator=g)
    keys[::7] = n_dst          # never summed
    keys[5::11] = n_dst + 123  # any key past n_dst is
    keys[1:40] = n_dst - 1     # a long run at the top key
    order, start = segment_sum.inverse_index(keys, n_dst)
    want = torch.sort(keys.clamp(max=n_dst), stable=True)
    assert torch.equal(order, want.indices)
    assert torch.equal(start, torch.searchsorted(want.values, torch.arange(n_dst + 1)))
    assert segment_sum.sort_dtype(n_dst + 1) == (torch.int16 if n_dst < 2**15 else torch.int32)


@pytest.fixture
def no_index_add(monkeypatch):
    """index_add_ (atomics on CUDA) raises: a deterministic path must not use it."""

    def refuse(*args, **kwargs):
        raise AssertionError("index_add_ on a deterministic path")

    monkeypatch.setattr(torch.Tensor, "index_add_", refuse)


def test_reference_deterministic_sparse_backward_uses_no_atomics(no_index_add):
    q, kv, idx = _sparse_inputs(T=6, K=8, N=4)  # many duplicate rows
    idx = idx.clamp(0, 3)
    sink = torch.randn(2, dtype=torch.float32)
    ql, kvl = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out = dsa.sparse_attention(ql, kvl, idx, sink=sink, deterministic=True, backend="reference")
    out.square().sum().backward()
    # and it is the gradient: the float64 autograd of the forward formula
    qe, kve = q.clone().requires_grad_(), kv.clone().requires_grad_()
    s = torch.einsum("thd,tkd->thk", qe, kve[idx.long()]) * q.shape[-1] ** -0.5
    den = torch.logaddexp(torch.logsumexp(s, -1), sink.double())
    oe = torch.einsum("thk,tkd->thd", torch.exp(s - den[..., None]), kve[idx.long()])
    oe.square().sum().backward()
    torch.testing.assert_close(kvl.grad, kve.grad)
    torch.testing.assert_close(ql.grad, qe.grad)
    with pytest.raises(AssertionError, match="deterministic path"):  # the fixture is live
        out = dsa.sparse_attention(ql, kvl, idx, deterministic=False, backend="reference")
        out.sum().backward()


def test_reference_deterministic_indexer_backward_uses_no_atomics(no_index_add):
    g = torch.Generator().manual_seed(4)
    q, k, w = torch.randn(5, 2, 8, generator=g), torch.randn(3, 8, generator=g), torch.randn(5, 2, generator=g)
    idx = torch.randint(0, 3, (5, 6), generator=g, dtype=torch.int32)
    kl = k.clone().requires_grad_()
    target = torch.softmax(torch.randn(5, 6, generator=g), -1)
    dsa.indexer_kl_loss(q, kl, w, idx, target, deterministic=True, backend="reference").backward()
    dsa.sparse_indexer_scores(q, kl, w, idx, deterministic=True, backend="reference").sum().backward()
    assert kl.grad is not None and torch.isfinite(kl.grad).all() and kl.grad.abs().sum() > 0


# --------------------------------------------------------------------------
# packed indexer checks while a CUDA graph is captured: nothing read back


def _refuse(*args, **kwargs):
    raise AssertionError("a value was read back to the host")


def _capture(mp: pytest.MonkeyPatch) -> None:
    """The checks see a capture in progress, and any read-back raises."""
    mp.setattr(_checks, "_capturing", lambda device: True)
    mp.setattr(torch.Tensor, "tolist", _refuse)
    mp.setattr(torch.Tensor, "item", _refuse)


@pytest.fixture
def capturing(monkeypatch):
    _capture(monkeypatch)


def _packed(T_q=7, T_k=9):
    g = torch.Generator().manual_seed(6)
    q, k, w = torch.randn(T_q, 2, 8, generator=g), torch.randn(T_k, 8, generator=g), torch.randn(T_q, 2, generator=g)
    return q, k, w, torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)


def test_packed_checks_read_nothing_back_while_capturing():
    q, k, w, cu_q, cu_k = _packed()
    eager, _ = _checks.indexer_args(q, k, w, 2, 1.0, True, torch.tensor([3, -1]), cu_q, cu_k, 6)
    with pytest.MonkeyPatch.context() as mp:
        _capture(mp)
        captured, _ = _checks.indexer_args(q, k, w, 2, 1.0, True, torch.tensor([3, -1]), cu_q, cu_k, 6)
    for f in ("q", "k", "weights", "cu_seqlens_q", "cu_seqlens_k", "q_offsets"):
        assert torch.equal(getattr(captured, f), getattr(eager, f)), f
    assert (captured.max_seqlen_k, captured.ratio, captured.causal) == (6, 2, True)


def test_packed_checks_while_capturing_run_on_the_device(capturing):
    q, k, w, cu_q, cu_k = _packed()
    # on CPU the device check raises at once; on CUDA it fails the replay
    for bad_q, bad_k, name in ((torch.tensor([0, 5, 3], dtype=torch.int32), cu_k, "cu_seqlens_q"),
                               (cu_q, torch.tensor([1, 4, 9], dtype=torch.int32), "cu_seqlens_k"),
                               (cu_q, torch.tensor([0, 4, 8], dtype=torch.int32), "cu_seqlens_k")):
        with pytest.raises(RuntimeError, match=name):
            _checks.indexer_args(q, k, w, 1, 1.0, True, None, bad_q, bad_k, 6)
    with pytest.raises(RuntimeError, match="max_seqlen_k=4"):  # the second sequence has 5 keys
        _checks.indexer_args(q, k, w, 1, 1.0, True, None, cu_q, cu_k, 4)
    with pytest.raises(ValueError, match=r"^max_seqlen_k: required"):
        _checks.indexer_args(q, k, w, 1, 1.0, True, None, cu_q, cu_k, None)


# --------------------------------------------------------------------------
# the README example runs on a machine without a GPU


def test_readme_example_runs_on_cpu(monkeypatch):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README.md has no python example"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    assert scope["out"].device.type == "cpu" and scope["q"].grad is not None
    assert torch.isfinite(scope["q"].grad).all() and torch.isfinite(scope["out"]).all()


# --------------------------------------------------------------------------
# the CPU demo checks the Triton kernels against the reference


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU demo")
def test_cpu_demo_checks_triton_against_the_reference(monkeypatch, capsys):
    pytest.importorskip("triton")
    from dsa import demo

    monkeypatch.setattr(demo, "CPU_SHAPE", demo.Shape("tiny", T=12, H=4, D=64, d_v=32, K=8, H_i=2, D_i=16))
    backends = []
    real = dsa.sparse_attention

    def recorded(*args, backend="auto", **kwargs):
        backends.append(backend)
        return real(*args, backend=backend, **kwargs)

    monkeypatch.setattr(dsa, "sparse_attention", recorded)
    demo.main()
    text = capsys.readouterr().out
    assert set(backends) == {"reference", "triton"}, backends
    assert "TRITON_INTERPRET=1" in text and "triton matches the reference" in text
    for name in ("out", "lse", "dq", "dkv", "dsink"):
        err = float(re.search(rf"{name}\s+max rel error (\S+)", text).group(1))
        assert err <= 1e-3, (name, err)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype", [("reference", torch.bfloat16), ("reference", torch.float32),
                                           ("auto", torch.float32)])
def test_deterministic_gradients_are_bitwise_on_cuda(backend, dtype):
    """Many slots add into few kv rows (where atomics reorder additions); with
    deterministic=True every run gives the same bits, whichever backend auto picks."""
    g = torch.Generator(device="cuda").manual_seed(7)
    T, H, D, N, K = 256, 16, 64, 12, 64
    q = torch.randn(T, H, D, device="cuda", generator=g).to(dtype)
    kv = torch.randn(N, D, device="cuda", generator=g).to(dtype)
    idx = torch.randint(0, N, (T, K), device="cuda", generator=g, dtype=torch.int32)
    dout = torch.randn(T, H, D, device="cuda", generator=g).to(dtype)
    sink = torch.randn(H, device="cuda", generator=g)

    def grads():
        ql, kvl, sl = (x.clone().requires_grad_() for x in (q, kv, sink))
        out = dsa.sparse_attention(ql, kvl, idx, d_v=D, sink=sl, deterministic=True, backend=backend)
        return torch.autograd.grad(out, (ql, kvl, sl), dout)

    first = grads()
    for _ in range(3):
        for a, b in zip(first, grads()):
            assert torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU demo's flow, on CPU tensors")
def test_gpu_demo_flow_on_cpu(monkeypatch, capsys):
    """Every row of the GPU table (one per backend, cute refusing on CPU), timed here
    by a stand-in for do_bench, with the max errors against the reference."""
    pytest.importorskip("triton")
    import time

    from dsa import demo

    def bench(fn, slow):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    monkeypatch.setattr(demo, "_bench", bench)
    demo.gpu_demo((demo.Shape("tiny", T=12, H=4, D=64, d_v=32, K=8, H_i=2, D_i=16),), "cpu", torch.float32)
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[1]: line for line in lines[2:]}
    assert set(rows) == {"reference", "triton", "cute"}, lines
    assert "cannot run" in rows["cute"] and rows["cute"].split()[2] == "-"
    errs = dict(re.findall(r"(out|dq|dkv|dsink) (\S+)", rows["triton"]))
    assert set(errs) == {"out", "dq", "dkv", "dsink"} and all(float(e) < 1e-3 for e in errs.values()), rows["triton"]
