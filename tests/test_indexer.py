"""indexer_scores against the float64 brute force: the causal / ratio /
q_offsets mask (exact -inf pattern), values, both layouts, and gradients."""

from __future__ import annotations

import pytest
import torch

import bruteforce as bf
import dsa


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(shape, dtype, device, gen, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def ints(values, device, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def score_dtypes(q_dtype):
    # fp32 scores; float64 is the reference backend's full-precision extension
    return (torch.float32, torch.float64) if q_dtype == torch.float64 else (torch.float32,)


def check_scores(res, exp, case):
    assert res.dtype in score_dtypes(case.dtype), f"scores dtype {res.dtype}"
    assert res.device.type == torch.device(case.device).type
    assert res.shape == exp.shape, f"shape {tuple(res.shape)} != {tuple(exp.shape)}"
    r = res.detach().cpu()
    # the exact -inf pattern, and nothing else non-finite
    assert torch.equal(torch.isneginf(r), torch.isneginf(exp)), "visibility mask differs"
    assert not torch.isnan(r).any() and not torch.isposinf(r).any()
    tol = max(case.dtype, res.dtype, key=[torch.float64, torch.float32, torch.float16, torch.bfloat16].index)
    bf.assert_close(r, exp, tol, "scores")


def batched_inputs(case, gen, B=2, Sq=5, Sk=7, H=3, D=32, k4=False, w_dtype=None):
    q = rand((B, Sq, H, D), case.dtype, case.device, gen)
    k = rand((B, Sk, 1, D) if k4 else (B, Sk, D), case.dtype, case.device, gen)
    w = rand((B, Sq, H), w_dtype or case.dtype, case.device, gen)
    return q, k, w


# --------------------------------------------------------------------------
# batched layout


@pytest.mark.parametrize("ratio", [1, 2, 3, 4])
@pytest.mark.parametrize("offsets", [None, [0, 9], [14, 3]])
def test_batched_causal_mask(case, call, ratio, offsets):
    gen = _gen(ratio)
    B, Sq, Sk = 2, 5, 7
    q, k, w = batched_inputs(case, gen, B, Sq, Sk)
    q_off = None if offsets is None else ints(offsets, case.device)
    res = call(dsa.indexer_scores, q, k, w, ratio=ratio, q_offsets=q_off, backend=case.backend)
    exp = bf.indexer_scores(q, k, w, ratio=ratio, q_offsets=q_off)["scores"]
    check_scores(res, exp, case)
    # the mask itself, written out from the rule
    offs = [0] * B if offsets is None else offsets
    want = torch.ones(B, Sq, Sk, dtype=torch.bool)
    for b in range(B):
        for i in range(Sq):
            want[b, i, : min(max((offs[b] + i + 1) // ratio, 0), Sk)] = False
    assert torch.equal(torch.isneginf(res.detach().cpu()), want)


def test_batched_not_causal(case, call):
    gen = _gen(10)
    q, k, w = batched_inputs(case, gen, 2, 4, 9)
    q_off = ints([0, 0], case.device)
    for ratio in (1, 4):
        res = call(dsa.indexer_scores, q, k, w, ratio=ratio, causal=False, q_offsets=q_off, backend=case.backend)
        exp = bf.indexer_scores(q, k, w, ratio=ratio, causal=False)["scores"]
        check_scores(res, exp, case)
        assert torch.isfinite(res).all()


@pytest.mark.parametrize("sm_scale", [1.0, 0.125])
def test_sm_scale(fast_case, call, sm_scale):
    case = fast_case
    gen = _gen(11)
    q, k, w = batched_inputs(case, gen, 1, 6, 6)
    res = call(dsa.indexer_scores, q, k, w, sm_scale=sm_scale, backend=case.backend)
    check_scores(res, bf.indexer_scores(q, k, w, sm_scale=sm_scale)["scores"], case)


def test_k_with_head_axis(fast_case, call):
    """k [B, S_k, 1, D] is the same as k [B, S_k, D]."""
    case = fast_case
    gen = _gen(12)
    q, k4, w = batched_inputs(case, gen, 2, 5, 6, k4=True)
    a = call(dsa.indexer_scores, q, k4, w, ratio=2, backend=case.backend)
    b = call(dsa.indexer_scores, q, k4[:, :, 0], w, ratio=2, backend=case.backend)
    assert torch.equal(a, b)
    check_scores(a, bf.indexer_scores(q, k4, w, ratio=2)["scores"], case)


def test_weights_in_another_dtype(case, call):
    gen = _gen(13)
    w_dtype = torch.float32 if case.dtype != torch.float32 else torch.float16
    q, k, w = batched_inputs(case, gen, 2, 4, 6, w_dtype=w_dtype)
    assert w.dtype != q.dtype
    res = call(dsa.indexer_scores, q, k, w, ratio=1, backend=case.backend)
    check_scores(res, bf.indexer_scores(q, k, w)["scores"], case)


def test_batched_empty(fast_case, call):
    case = fast_case
    gen = _gen(14)
    for B, Sq, Sk in ((0, 3, 4), (2, 0, 4), (2, 3, 0)):
        q, k, w = batched_inputs(case, gen, B, Sq, Sk)
        res = call(dsa.indexer_scores, q, k, w, backend=case.backend)
        assert res.shape == (B, Sq, Sk)


# --------------------------------------------------------------------------
# packed layout


def packed_inputs(case, gen, lens_q, lens_k, H=3, D=32, w_dtype=None):
    cu_q = ints([0] + torch.tensor(lens_q).cumsum(0).tolist(), case.device)
    cu_k = ints([0] + torch.tensor(lens_k).cumsum(0).tolist(), case.device)
    Tq, Tk = sum(lens_q), sum(lens_k)
    q = rand((Tq, H, D), case.dtype, case.device, gen)
    k = rand((Tk, D), case.dtype, case.device, gen)
    w = rand((Tq, H), w_dtype or case.dtype, case.device, gen)
    return q, k, w, cu_q, cu_k


# 4 sequences: (queries, keys) = (3, 5), (0, 4), (4, 0), (2, 6)
LENS_Q, LENS_K = [3, 0, 4, 2], [5, 4, 0, 6]


@pytest.mark.parametrize("ratio", [1, 2, 3, 4])
def test_packed_varlen(case, call, ratio):
    gen = _gen(20 + ratio)
    q, k, w, cu_q, cu_k = packed_inputs(case, gen, LENS_Q, LENS_K)
    q_off = ints([2, 0, 5, 9], case.device)
    width = 8  # wider than the longest key sequence (6): extra columns are -inf
    res = call(dsa.indexer_scores, q, k, w, ratio=ratio, q_offsets=q_off, cu_seqlens_q=cu_q,
               cu_seqlens_k=cu_k, max_seqlen_k=width, backend=case.backend)
    exp = bf.indexer_scores(q, k, w, ratio=ratio, q_offsets=q_off, cu_seqlens_q=cu_q,
                            cu_seqlens_k=cu_k, max_seqlen_k=width)["scores"]
    check_scores(res, exp, case)
    r = res.detach().cpu()
    # columns past each sequence's own S_k are -inf; the zero-key sequence is all -inf
    assert torch.isneginf(r[:, 6:]).all()
    assert torch.isneginf(r[:3, 5:]).all()
    assert torch.isneginf(r[3:7]).all()
    assert torch.isfinite(r[7:9, :1]).all()  # the last sequence sees key 0 at least


def test_packed_not_causal(fast_case, call):
    case = fast_case
    gen = _gen(30)
    q, k, w, cu_q, cu_k = packed_inputs(case, gen, LENS_Q, LENS_K)
    res = call(dsa.indexer_scores, q, k, w, causal=False, ratio=4, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
               max_seqlen_k=6, backend=case.backend)
    exp = bf.indexer_scores(q, k, w, causal=False, ratio=4, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            max_seqlen_k=6)["scores"]
    check_scores(res, exp, case)
    # every key of its own sequence visible, nothing of another sequence
    vis = torch.isfinite(res.detach().cpu())
    assert vis[:3, :5].all() and not vis[:3, 5:].any()
    assert vis[7:, :6].all()


def test_packed_equals_batched_for_equal_lengths(fast_case, call):
    case = fast_case
    gen = _gen(31)
    B, Sq, Sk, H, D = 3, 4, 6, 2, 32
    q, k, w = batched_inputs(case, gen, B, Sq, Sk, H, D)
    off = ints([0, 2, 20], case.device)
    a = call(dsa.indexer_scores, q, k, w, ratio=2, q_offsets=off, backend=case.backend)
    cu_q = ints([0, 4, 8, 12], case.device)
    cu_k = ints([0, 6, 12, 18], case.device)
    b = call(dsa.indexer_scores, q.reshape(B * Sq, H, D), k.reshape(B * Sk, D), w.reshape(B * Sq, H), ratio=2,
             q_offsets=off, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_k=Sk, backend=case.backend)
    bf.assert_close(b.view(B, Sq, Sk), a, torch.float32, "scores")
    check_scores(a, bf.indexer_scores(q, k, w, ratio=2, q_offsets=off)["scores"], case)


def test_q_offsets_int64(fast_case, call):
    case = fast_case
    gen = _gen(32)
    q, k, w = batched_inputs(case, gen, 2, 3, 8)
    off64 = ints([1, 5], case.device, torch.int64)
    a = call(dsa.indexer_scores, q, k, w, ratio=2, q_offsets=off64, backend=case.backend)
    check_scores(a, bf.indexer_scores(q, k, w, ratio=2, q_offsets=off64)["scores"], case)


def test_reference_larger_shape():
    gen = _gen(33)
    case = type("C", (), {"backend": "reference", "dtype": torch.float32, "device": "cpu"})()
    q, k, w, cu_q, cu_k = packed_inputs(case, gen, [9, 16], [40, 3], H=8, D=64)
    off = ints([150, 0], "cpu")
    res = dsa.indexer_scores(q, k, w, ratio=4, q_offsets=off, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             max_seqlen_k=40, sm_scale=0.3, backend="reference")
    exp = bf.indexer_scores(q, k, w, ratio=4, q_offsets=off, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            max_seqlen_k=40, sm_scale=0.3)["scores"]
    check_scores(res, exp, case)


# --------------------------------------------------------------------------
# gradients (indexer_scores is differentiable in q, k, weights)


def _grads(call, case, q, k, w, grad, **kw):
    for t in (q, k, w):
        t.requires_grad_(True)
    res = call(dsa.indexer_scores, q, k, w, backend=case.backend, **kw)
    g = call(torch.autograd.grad, (res,), (q, k, w), (grad,))
    for t in (q, k, w):
        t.requires_grad_(False)
    return res, g


@pytest.mark.parametrize("layout", ["batched", "packed"])
def test_gradients(fast_case, call, layout):
    case = fast_case
    gen = _gen(40)
    if layout == "batched":
        q, k, w = batched_inputs(case, gen, 2, 4, 6)
        kw = dict(ratio=2, q_offsets=ints([3, 0], case.device))
        shape = (2, 4, 6)
    else:
        q, k, w, cu_q, cu_k = packed_inputs(case, gen, LENS_Q, LENS_K)
        kw = dict(ratio=1, q_offsets=ints([2, 0, 5, 1], case.device), cu_seqlens_q=cu_q,
                  cu_seqlens_k=cu_k, max_seqlen_k=7)
        shape = (sum(LENS_Q), 7)
    grad = rand(shape, torch.float32, case.device, gen)  # also at masked places: must be ignored
    res, (dq, dk, dw) = _grads(call, case, q, k, w, grad, sm_scale=0.5, **kw)
    exp = bf.indexer_scores(q, k, w, sm_scale=0.5, grad=grad, **kw)
    check_scores(res, exp["scores"], case)
    assert dq.dtype == q.dtype and dk.dtype == k.dtype and dw.dtype == w.dtype
    for name, got in (("dq", dq), ("dk", dk), ("dw", dw)):
        tol = max(case.dtype, torch.float32, key=[torch.float64, torch.float32, torch.float16,
                                                   torch.bfloat16].index)
        bf.assert_close(got, exp[name], tol, name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["reference", "triton", "cute"])
@pytest.mark.parametrize("ratio", [1, 4])
def test_model_shape_cuda(call, backend, dtype, ratio):
    """The model indexer of docs/semantics.md: 64 heads x 128 dims, one shared key."""
    case = type("C", (), {"backend": backend, "dtype": dtype, "device": "cuda"})()
    gen = _gen(50)
    q, k, w, cu_q, cu_k = packed_inputs(case, gen, [8, 5], [70, 33], H=64, D=128, w_dtype=torch.float32)
    off = ints([280 - 8 if ratio == 4 else 62, 0], "cuda")
    kw = dict(ratio=ratio, q_offsets=off, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_k=70,
              sm_scale=128 ** -0.5)
    res = call(dsa.indexer_scores, q, k, w, backend=backend, **kw)
    check_scores(res, bf.indexer_scores(q, k, w, **kw)["scores"], case)
