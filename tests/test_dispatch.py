"""ops.call: the public API skips the torch.library dispatcher only where it
adds nothing (no autograd, tracing or dispatch mode), with the same result;
and the cached offsets of uniform sequences."""

from __future__ import annotations

import torch

import dsa
from dsa import _checks, ops


def _count_bodies(monkeypatch, op):
    calls = []
    body = ops._BODIES[op]

    def counted(*args):
        calls.append(1)
        return body(*args)

    monkeypatch.setitem(ops._BODIES, op, counted)
    return calls


def test_direct_body_without_autograd(monkeypatch):
    calls = _count_bodies(monkeypatch, ops.topk)
    s = torch.randn(3, 10)
    idx = dsa.topk_indices(s, 4, backend="reference")
    assert calls == [1]
    via_op, _ = ops.topk(s, 4, "reference")  # the dispatcher: same body, same result
    assert calls == [1] and torch.equal(idx, via_op)


def test_dispatcher_when_autograd_needs_it(monkeypatch):
    calls = _count_bodies(monkeypatch, ops.sparse_attention_fwd)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 16, generator=g, dtype=torch.float64)
    kv = torch.randn(5, 16, generator=g, dtype=torch.float64)
    idx = torch.tensor([[0, 1], [2, 3], [4, -1]], dtype=torch.int32)
    with torch.no_grad():
        ref = dsa.sparse_attention(q, kv, idx, backend="reference")
    assert calls == [1]
    q.requires_grad_()
    out = dsa.sparse_attention(q, kv, idx, backend="reference")
    assert calls == [1]  # through the op: autograd recorded
    assert out.grad_fn is not None and torch.equal(out.detach(), ref)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_uniform_offsets_cached():
    dev = torch.device("cpu")
    cu_q, cu_k, off = _checks._uniform_offsets(dev, 3, 5, 7)
    assert cu_q.tolist() == [0, 5, 10, 15] and cu_k.tolist() == [0, 7, 14, 21] and off.tolist() == [0, 0, 0]
    assert cu_q.dtype == cu_k.dtype == torch.int32 and off.dtype == torch.int64
    again = _checks._uniform_offsets(dev, 3, 5, 7)
    assert again[0] is cu_q and again[2] is off
