"""torch.compile(fullgraph=True) traces every op without a graph break (they
are torch.library custom ops with fake implementations) and matches eager."""

from __future__ import annotations

import pytest
import torch

import bruteforce as bf
import dsa


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _sparse_inputs(seed=0, batched=False):
    g = torch.Generator().manual_seed(seed)
    T, H, D, K, N = 5, 4, 32, 12, 24
    if batched:
        q = torch.randn(1, T, H, D, generator=g)
        kv = torch.randn(1, N, D, generator=g)
        idx = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(T)]).view(1, T, K).int()
        tl = torch.tensor([[12, 5, 0, 7, 20]], dtype=torch.int32)
    else:
        q = torch.randn(T, H, D, generator=g)
        kv = torch.randn(N, D, generator=g)
        idx = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(T)]).int()
        idx[1, 2] = -1
        tl = torch.tensor([12, 5, 0, 7, 20], dtype=torch.int32)
    sink = torch.randn(H, generator=g)
    dout = torch.randn(*q.shape[:-1], 16, generator=g)
    return q, kv, idx, tl, sink, dout


def _fwd_bwd(fn, q, kv, idx, tl, sink, dout):
    q, kv, sink = (t.detach().clone().requires_grad_(True) for t in (q, kv, sink))
    out, lse = fn(q, kv, idx, tl, sink)
    (out * dout).sum().backward()
    return out.detach(), lse.detach(), q.grad, kv.grad, sink.grad


def _attn(q, kv, idx, tl, sink):
    return dsa.sparse_attention(q, kv, idx, d_v=16, sink=sink, topk_length=tl, return_lse=True,
                                backend="reference")


@pytest.mark.parametrize("batched", [False, True])
def test_compile_sparse_attention_fullgraph(batched):
    inputs = _sparse_inputs(batched=batched)
    eager = _fwd_bwd(_attn, *inputs)
    compiled = _fwd_bwd(torch.compile(_attn, fullgraph=True), *inputs)
    for name, a, b in zip(("out", "lse", "dq", "dkv", "dsink"), compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # and eager itself is right (so equal-to-eager means right)
    q, kv, idx, tl, sink, dout = inputs
    exp = bf.sparse_attention(q, kv, idx, d_v=16, sink=sink, topk_length=tl, dout=dout)
    for name, a in zip(("out", "lse", "dq", "dkv", "dsink"), eager):
        bf.assert_close(a, exp[name], torch.float32, name)


def test_compile_no_graph_break_with_surrounding_ops():
    """Ops before and after the call stay in one graph."""
    q, kv, idx, tl, sink, dout = _sparse_inputs(seed=1)

    def f(q, kv, idx, tl, sink):
        out, lse = dsa.sparse_attention(q * 2.0, kv + 0.5, idx, d_v=16, sink=sink.tanh(), topk_length=tl,
                                        return_lse=True, backend="reference")
        return out.relu() * 3.0, torch.where(torch.isfinite(lse), lse, 0.0)

    explanation = torch._dynamo.explain(f)(q, kv, idx, tl, sink)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    eager = _fwd_bwd(f, q, kv, idx, tl, sink, dout)
    compiled = _fwd_bwd(torch.compile(f, fullgraph=True), q, kv, idx, tl, sink, dout)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _indexer_inputs(packed):
    g = torch.Generator().manual_seed(2)
    if packed:
        q = torch.randn(9, 3, 16, generator=g)
        k = torch.randn(11, 16, generator=g)
        w = torch.randn(9, 3, generator=g)
        kw = dict(cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32),
                  cu_seqlens_k=torch.tensor([0, 5, 11], dtype=torch.int32), max_seqlen_k=6)
    else:
        q = torch.randn(2, 4, 3, 16, generator=g)
        k = torch.randn(2, 6, 16, generator=g)
        w = torch.randn(2, 4, 3, generator=g)
        kw = {}
    kw.update(ratio=2, q_offsets=torch.tensor([3, 0], dtype=torch.int32))
    return q, k, w, kw


@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
def test_compile_indexer_and_topk_fullgraph(packed):
    q, k, w, kw = _indexer_inputs(packed)

    def f(q, k, w):
        s = dsa.indexer_scores(q, k, w, backend="reference", **kw)
        i, n = dsa.topk_indices(s, 3, return_lengths=True, backend="reference")
        j, m = dsa.indexer_topk(q, k, w, 3, global_indices=packed, return_lengths=True, backend="reference", **kw)
        return s, i, n, j, m

    eager = f(q, k, w)
    compiled = torch.compile(f, fullgraph=True)(q, k, w)
    torch.testing.assert_close(compiled[0], eager[0])
    for a, b in zip(compiled[1:], eager[1:]):
        assert torch.equal(a, b)
    exp = bf.indexer_scores(q, k, w, **kw)["scores"]
    bf.assert_close(eager[0], exp, torch.float32, "scores")
