"""The backend selector: explain(), auto on CPU, DSA_BACKEND, DSA_DISABLE_CUTE
and the ValueError of a backend that cannot serve the call."""

from __future__ import annotations

import os

import pytest
import torch

import dsa

OPS = ("sparse_attention", "indexer_scores", "topk_indices", "indexer_topk")


def _inputs(device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    T, H, D, K, N = 4, 2, 32, 8, 16
    q = torch.randn(T, H, D, generator=g).to(dtype).to(device)
    kv = torch.randn(N, D, generator=g).to(dtype).to(device)
    idx = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(T)]).int().to(device)
    sink = torch.randn(H, generator=g).to(device)
    qi = torch.randn(2, 5, 2, 32, generator=g).to(dtype).to(device)
    ki = torch.randn(2, 6, 32, generator=g).to(dtype).to(device)
    wi = torch.randn(2, 5, 2, generator=g).to(dtype).to(device)
    return q, kv, idx, sink, qi, ki, wi


def _op_args(op, device="cpu", dtype=torch.float32):
    q, kv, idx, sink, qi, ki, wi = _inputs(device, dtype)
    if op == "sparse_attention":
        return (q, kv, idx), dict(sink=sink, d_v=16)
    if op == "indexer_scores":
        return (qi, ki, wi), dict(ratio=2)
    if op == "indexer_topk":
        return (qi, ki, wi, 3), dict(ratio=2)
    return (torch.randn(6, 10, generator=torch.Generator().manual_seed(1)).to(device), 3), {}


def _run_all(backend, device="cpu"):
    """Forward (and sparse attention's backward) of every op with this backend."""
    q, kv, idx, sink, qi, ki, wi = _inputs(device)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    sink.requires_grad_(True)
    out, lse = dsa.sparse_attention(q, kv, idx, sink=sink, d_v=16, return_lse=True, backend=backend)
    dq, dkv, dsink = torch.autograd.grad(out.sum(), (q, kv, sink))
    scores = dsa.indexer_scores(qi, ki, wi, ratio=2, backend=backend)
    top = dsa.topk_indices(scores, 3, return_lengths=True, backend=backend)
    itop = dsa.indexer_topk(qi, ki, wi, 3, ratio=2, return_lengths=True, backend=backend)
    return [out, lse, dq, dkv, dsink, scores, *top, *itop]


@pytest.fixture
def clean_env(monkeypatch):
    """No selector variables set for the test (restored afterwards)."""
    monkeypatch.delenv("DSA_BACKEND", raising=False)
    monkeypatch.delenv("DSA_DISABLE_CUTE", raising=False)
    return monkeypatch


# --------------------------------------------------------------------------
# CPU


@pytest.mark.parametrize("op", OPS)
def test_explain_names_reference_on_cpu(clean_env, op):
    args, kw = _op_args(op)
    before = dict(os.environ)
    text = dsa.explain(op, *args, **kw)
    assert dict(os.environ) == before, "explain changed the environment"
    assert isinstance(text, str)
    assert "reference" in text
    # and it says why the GPU backends were not taken
    assert "triton" in text.lower() and "cute" in text.lower()
    assert "cuda" in text.lower()


def test_auto_on_cpu_is_the_reference(clean_env):
    """CPU tensors use the reference under auto, even with TRITON_INTERPRET=1."""
    auto = _run_all("auto")
    ref = _run_all("reference")
    for a, r in zip(auto, ref):
        assert torch.equal(a, r)


def test_dsa_backend_reference_forces_it(clean_env, call):
    clean_env.setenv("DSA_BACKEND", "reference")
    args, kw = _op_args("sparse_attention")
    assert "reference" in dsa.explain("sparse_attention", *args, **kw)
    forced = _run_all("triton")  # the environment wins over the argument
    clean_env.delenv("DSA_BACKEND")
    ref = _run_all("reference")
    for a, r in zip(forced, ref):
        assert torch.equal(a, r)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter check")
def test_dsa_backend_triton_forces_it_on_cpu(clean_env, call):
    pytest.importorskip("triton")
    clean_env.setenv("DSA_BACKEND", "triton")
    q, kv, idx, sink, *_ = _inputs()
    text = call(dsa.explain, "sparse_attention", q, kv, idx, sink=sink, d_v=16)
    assert "triton" in text
    assert "backend 'reference'" not in text
    forced = call(dsa.sparse_attention, q, kv, idx, sink=sink, d_v=16, backend="auto")
    clean_env.delenv("DSA_BACKEND")
    direct = call(dsa.sparse_attention, q, kv, idx, sink=sink, d_v=16, backend="triton")
    assert torch.equal(forced, direct)


def test_dsa_backend_unknown_value(clean_env):
    clean_env.setenv("DSA_BACKEND", "fastest")
    q, kv, idx, *_ = _inputs()
    with pytest.raises(ValueError, match="DSA_BACKEND"):
        dsa.sparse_attention(q, kv, idx)


def test_cute_on_cpu_raises_with_reason(clean_env):
    q, kv, idx, *_ = _inputs()
    with pytest.raises(ValueError, match="cute") as info:
        dsa.sparse_attention(q, kv, idx, backend="cute")
    assert len(str(info.value)) > len("backend 'cute'") + 10, "the error must say why"
    with pytest.raises(ValueError, match="cute"):
        dsa.topk_indices(torch.zeros(2, 4), 2, backend="cute")


def test_triton_on_cpu_without_interpreter_raises(clean_env):
    clean_env.delenv("TRITON_INTERPRET", raising=False)
    q, kv, idx, *_ = _inputs()
    with pytest.raises(ValueError, match="triton") as info:
        dsa.sparse_attention(q, kv, idx, backend="triton")
    assert "cpu" in str(info.value).lower() or "cuda" in str(info.value).lower()


def test_explain_unknown_op():
    q, kv, idx, *_ = _inputs()
    with pytest.raises(ValueError, match="op"):
        dsa.explain("dense_attention", q, kv, idx)


# --------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_explain_on_cuda_prefers_a_gpu_backend(clean_env, op):
    args, kw = _op_args(op, "cuda", torch.bfloat16)
    text = dsa.explain(op, *args, **kw)
    assert "backend 'triton'" in text or "backend 'cute'" in text, text


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_dsa_disable_cute_in_explain(clean_env, op):
    clean_env.setenv("DSA_DISABLE_CUTE", "1")
    args, kw = _op_args(op, "cuda", torch.bfloat16)
    text = dsa.explain(op, *args, **kw)
    assert "DSA_DISABLE_CUTE" in text, text
    assert "backend 'cute'" not in text


@pytest.mark.gpu
def test_dsa_backend_reference_on_cuda(clean_env):
    clean_env.setenv("DSA_BACKEND", "reference")
    args, kw = _op_args("sparse_attention", "cuda", torch.bfloat16)
    text = dsa.explain("sparse_attention", *args, **kw)
    assert "backend 'reference'" in text and "backend 'triton'" not in text


# --------------------------------------------------------------------------
# environment variables


def test_dsa_backend_auto_forces_nothing(clean_env):
    clean_env.setenv("DSA_BACKEND", "auto")
    args, kw = _op_args("sparse_attention")
    text = dsa.explain("sparse_attention", *args, **kw)
    assert "backend 'reference'" in text and "DSA_BACKEND" not in text
    q, kv, idx, *_ = _inputs()
    assert torch.equal(dsa.sparse_attention(q, kv, idx), dsa.sparse_attention(q, kv, idx, backend="reference"))


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "On"])
def test_dsa_disable_cute_set(clean_env, value):
    from dsa import selector

    clean_env.setenv("DSA_DISABLE_CUTE", value)
    assert selector.cute_disabled() is True


@pytest.mark.parametrize("value", ["0", "false", "False", "no", "OFF", ""])
def test_dsa_disable_cute_not_set(clean_env, value):
    from dsa import selector

    clean_env.setenv("DSA_DISABLE_CUTE", value)
    assert selector.cute_disabled() is False


def test_dsa_disable_cute_other_values_are_errors(clean_env):
    clean_env.setenv("DSA_DISABLE_CUTE", "maybe")
    q, kv, idx, *_ = _inputs()
    with pytest.raises(ValueError, match="DSA_DISABLE_CUTE"):
        dsa.sparse_attention(q, kv, idx)


@pytest.mark.parametrize("explicit", ["auto", "triton", "cute"])
def test_explain_says_dsa_backend_decided(clean_env, explicit):
    clean_env.setenv("DSA_BACKEND", "reference")
    args, kw = _op_args("sparse_attention")
    text = dsa.explain("sparse_attention", *args, backend=explicit, **kw)
    assert f"DSA_BACKEND=reference overrides backend='{explicit}'" in text, text
    clean_env.delenv("DSA_BACKEND")
    assert "DSA_BACKEND" not in dsa.explain("sparse_attention", *args, backend="reference", **kw)


def test_explain_says_why_the_reference_serves_a_cuda_call(clean_env, monkeypatch):
    """A CUDA call no GPU backend serves goes to the reference, and explain says why (checked on CPU
    by making the tensors look like CUDA ones to the selector)."""
    from dsa import selector
    from dsa._args import Unsupported

    real = selector._hook

    def hook(name):
        if name == "reference":
            return real(name)

        def declines(op, args, auto):
            raise Unsupported(f"{name} declines fp32 here")

        return declines

    monkeypatch.setattr(selector, "_device_type", lambda args: "cuda")
    monkeypatch.setattr(selector, "_hook", hook)
    args, kw = _op_args("sparse_attention")
    text = dsa.explain("sparse_attention", *args, deterministic=True, **kw)
    assert "backend 'reference'" in text
    assert "no GPU backend serves this call" in text and "bitwise" in text
    assert "triton declines fp32 here" in text and "cute declines fp32 here" in text


def test_sparse_attention_choice_is_kept_per_call_key(clean_env, monkeypatch):
    """The backends' hooks run once per choice key, not once per call: again
    for another shape, a misaligned kv (the cute kernels assume 16-byte
    aligned q and kv), another backend asked for, or a steering variable set;
    and the kept choice gives the same result as a fresh one."""
    from dsa import selector

    selector.forget()
    runs = []
    real = selector.select
    monkeypatch.setattr(selector, "select", lambda op, a, backend="auto": runs.append(op) or real(op, a, backend))
    q, kv, idx, sink, *_ = _inputs()
    first = dsa.sparse_attention(q, kv, idx, sink=sink, d_v=16)
    assert torch.equal(dsa.sparse_attention(q, kv, idx, sink=sink, d_v=16), first) and len(runs) == 1
    dsa.sparse_attention(q[:3], kv, idx[:3], sink=sink, d_v=16)  # another shape
    assert len(runs) == 2
    shifted = torch.empty(kv.numel() + 1)[1:].view_as(kv).copy_(kv)  # 4-byte aligned, not 16
    assert torch.equal(dsa.sparse_attention(q, shifted, idx, sink=sink, d_v=16), first) and len(runs) == 3
    dsa.sparse_attention(q, kv, idx, sink=sink, d_v=16, backend="reference")
    assert len(runs) == 4
    monkeypatch.setenv("DSA_DISABLE_CUTE", "1")
    dsa.sparse_attention(q, kv, idx, sink=sink, d_v=16)
    assert len(runs) == 5
    dsa.sparse_attention(q, kv, idx, sink=sink, d_v=16)
    assert len(runs) == 5 and runs == ["sparse_attention_fwd"] * 5
    selector.forget()


def test_call_key_holds_metadata_not_values():
    """call_key: equal for another call with the same metadata but other
    values; different for another dtype, shape, stride, 16-byte alignment or
    scalar."""
    from dsa._args import TopkArgs
    from dsa.selector import call_key

    x = torch.randn(6, 40)
    base = call_key(TopkArgs(x, 3, None))
    assert call_key(TopkArgs(torch.randn(6, 40), 3, None)) == base  # other values
    assert call_key(TopkArgs(x.double(), 3, None)) != base
    assert call_key(TopkArgs(x[:5], 3, None)) != base
    assert call_key(TopkArgs(torch.randn(6, 80)[:, ::2], 3, None)) != base  # strides
    assert call_key(TopkArgs(torch.randn(6 * 40 + 1)[1:].view(6, 40), 3, None)) != base  # 4, not 16, aligned
    assert call_key(TopkArgs(x, 4, None)) != base
    assert call_key(TopkArgs(x, 3, torch.full((6,), 9, dtype=torch.int32))) != base


def test_topk_choice_is_kept(clean_env, monkeypatch):
    from dsa import selector

    runs = []
    real = selector.select
    monkeypatch.setattr(selector, "select", lambda op, a, backend="auto": runs.append(op) or real(op, a, backend))
    x = torch.randn(6, 40)
    first = dsa.topk_indices(x, 5)
    assert torch.equal(dsa.topk_indices(x.clone(), 5), first) and runs == ["topk"]
    dsa.topk_indices(x, 6)
    assert runs == ["topk", "topk"]


def test_kept_values_are_made_once_and_bounded():
    from dsa._kept import kept

    cache, made = {}, []
    assert kept(cache, "a", lambda: made.append("a") or 1, limit=2) == 1
    assert kept(cache, "a", lambda: made.append("again") or 2, limit=2) == 1 and made == ["a"]
    kept(cache, "b", lambda: 2, limit=2)
    assert kept(cache, "c", lambda: 3, limit=2) == 3 and cache == {"c": 3}  # full: emptied first

    def fails():
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        kept(cache, "d", fails, limit=2)
    assert "d" not in cache
