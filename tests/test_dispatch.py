"""ops.call: the public API (forward and training ops) skips the torch.library dispatcher only where it
adds nothing (no autograd, tracing or dispatch mode), with the same result;
and the cached offsets of uniform sequences."""

from __future__ import annotations

import pytest
import torch

import dsa
from dsa import _checks, ops
from conftest import CUDA, TRITON_IMPORTABLE


def _count_dispatches(monkeypatch, op):
    """Count the calls of ``op`` that go through the torch.library dispatcher."""
    calls = []
    through = op.op

    def counted(*args):
        calls.append(1)
        return through(*args)

    monkeypatch.setattr(op, "op", counted)
    return calls


def test_direct_body_without_autograd(monkeypatch):
    calls = _count_dispatches(monkeypatch, ops.topk)
    s = torch.randn(3, 10)
    idx = dsa.topk_indices(s, 4, backend="reference")
    assert calls == []
    via_op, _ = ops.topk(_checks.topk_args(s, 4)[0], "reference")  # the dispatcher: same body, same result
    assert calls == [1] and torch.equal(idx, via_op)


def test_dispatcher_when_autograd_needs_it(monkeypatch):
    calls = _count_dispatches(monkeypatch, ops.sparse_attention_fwd)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 16, generator=g, dtype=torch.float64)
    kv = torch.randn(5, 16, generator=g, dtype=torch.float64)
    idx = torch.tensor([[0, 1], [2, 3], [4, -1]], dtype=torch.int32)
    with torch.no_grad():
        ref = dsa.sparse_attention(q, kv, idx, backend="reference")
    assert calls == []
    q.requires_grad_()
    out = dsa.sparse_attention(q, kv, idx, backend="reference")
    assert calls == [1]  # through the op: autograd recorded
    assert out.grad_fn is not None and torch.equal(out.detach(), ref)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_training_ops_take_the_fast_path(monkeypatch):
    """The training ops skip the dispatcher like the forward ops, and use it under autograd."""
    g = torch.Generator().manual_seed(1)
    q, kv = torch.randn(3, 2, 8, generator=g), torch.randn(5, 8, generator=g)
    w, idx = torch.randn(3, 2, generator=g), torch.tensor([[0, 1], [2, 3], [4, -1]], dtype=torch.int32)
    _, lse = dsa.sparse_attention(q, kv, idx, return_lse=True, backend="reference")
    counts = {op: _count_dispatches(monkeypatch, op) for op in
              (ops.attention_target, ops.sparse_indexer_fwd, ops.indexer_kl_fwd, ops.dense_attention_target)}
    target = dsa.attention_target(q, kv, idx, lse, backend="reference")
    logits = dsa.sparse_indexer_scores(q, kv, w, idx, backend="reference")
    loss = dsa.indexer_kl_loss(q, kv, w, idx, target, backend="reference")
    dense = dsa.dense_attention_target(q, kv, backend="reference")
    assert all(c == [] for c in counts.values())
    ql = q.clone().requires_grad_()
    loss_g = dsa.indexer_kl_loss(ql, kv, w, idx, target, backend="reference")
    logits_g = dsa.sparse_indexer_scores(ql, kv, w, idx, backend="reference")
    assert counts[ops.indexer_kl_fwd] == [1] and counts[ops.sparse_indexer_fwd] == [1]
    assert torch.equal(loss_g.detach(), loss) and torch.equal(logits_g.detach(), logits)
    assert dense.shape == (3, 5) and torch.isfinite(target).all()


def test_uniform_offsets_cached():
    dev = torch.device("cpu")
    cu_q, cu_k, off = _checks._uniform_offsets(dev, 3, 5, 7)
    assert cu_q.tolist() == [0, 5, 10, 15] and cu_k.tolist() == [0, 7, 14, 21] and off.tolist() == [0, 0, 0]
    assert cu_q.dtype == cu_k.dtype == torch.int32 and off.dtype == torch.int64
    again = _checks._uniform_offsets(dev, 3, 5, 7)
    assert again[0] is cu_q and again[2] is off


def test_forward_bounds_reach_a_backward_that_takes_them(monkeypatch):
    """The forward op's third output (what a forward writes for its tier's
    deterministic backward; empty from a forward that writes none) is saved
    and given to the backward whose implementation says it takes it
    (``takes_bounds``), eagerly and under torch.compile; a backward without
    the attribute gets the four usual arguments."""
    import importlib

    from dsa import reference
    from dsa.selector import Choice

    mod = importlib.import_module("dsa.ops.sparse_attention")
    marker = torch.arange(7.0)
    seen = []

    modes = []

    def fwd(a):
        modes.append(a.deterministic)
        out, lse = reference.sparse_attention_fwd(a)
        return (out, lse, marker.clone()) if a.deterministic else (out, lse)

    def bwd(a, out, lse, dout, *extra):
        seen.append([x.clone() for x in extra])
        return reference.sparse_attention_bwd(a, out, lse, dout)

    def select(op, a, backend):
        return Choice("reference", fwd if op == "sparse_attention_fwd" else bwd)

    monkeypatch.setattr(mod, "select_kept", select)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(5, 16, generator=g, dtype=torch.float64)
    idx = torch.tensor([[0, 1], [2, 3], [4, -1]], dtype=torch.int32)

    def run(det, compiled=False):
        seen.clear()
        f = lambda q_: dsa.sparse_attention(q_, kv, idx, deterministic=det, backend="reference")  # noqa: E731
        if compiled:
            f = torch.compile(f, fullgraph=True, backend="aot_eager")
        f(q).sum().backward()
        q.grad = None
        return seen[0]

    bwd.takes_bounds = True
    for compiled in (False, True):
        got = run(True, compiled)
        assert len(got) == 1 and torch.equal(got[0], marker), compiled
    assert run(False) == []                   # no bounds written: none passed
    del bwd.takes_bounds
    assert run(True) == []                    # a backward that does not take them
    # without a backward to come the forward runs in the default mode: no bounds to write
    modes.clear()
    with torch.no_grad():
        dsa.sparse_attention(q, kv, idx, deterministic=True, backend="reference")
    dsa.sparse_attention(q.detach(), kv, idx, deterministic=True, backend="reference")
    assert modes == [False, False]


@pytest.mark.parametrize("backend", ["reference"] + (["triton"] if TRITON_IMPORTABLE and not CUDA else []))
def test_negative_views_read_as_their_values(backend):
    """A tensor with the negative bit (``torch._neg_view``; the imaginary part of a conjugated complex
    tensor is one) holds its values negated in memory. The kernels read memory as stored, so such a call
    takes the dispatcher, which materialises the values: every result is that of the same values
    stored plainly."""
    g = torch.Generator().manual_seed(3)
    q, kv = torch.randn(4, 2, 16, generator=g), torch.randn(6, 16, generator=g)
    idx = torch.randint(-1, 6, (4, 3), generator=g, dtype=torch.int32)
    sink = torch.randn(2, generator=g)

    def neg(x):  # the same values, stored negated
        v = torch._neg_view(x.neg())
        assert v.is_neg() and torch.equal(v, x)
        return v

    exp = dsa.sparse_attention(q, kv, idx, sink=sink, backend=backend)
    exp_decode = dsa.sparse_decode(q, kv, idx, sink=sink, backend=backend)
    for args in ((neg(q), kv, idx, sink), (q, neg(kv), idx, sink), (q, kv, neg(idx), sink), (q, kv, idx, neg(sink))):
        assert torch.equal(dsa.sparse_attention(*args[:3], sink=args[3], backend=backend), exp)
        assert torch.equal(dsa.sparse_decode(*args[:3], sink=args[3], backend=backend), exp_decode)
    w = torch.randn(4, 2, generator=g)
    scores = dsa.indexer_scores(q, kv, w, backend=backend)
    assert torch.equal(dsa.indexer_scores(neg(q), kv, neg(w), backend=backend), scores)
    assert torch.equal(dsa.topk_indices(neg(scores), 3, backend=backend), dsa.topk_indices(scores, 3, backend=backend))


@pytest.mark.parametrize("backend", ["auto", "reference"] + (["triton"] if TRITON_IMPORTABLE and not CUDA else []))
def test_meta_tensors_give_the_results_shapes(backend):
    """Meta tensors (no data) take the dispatcher, whose fake implementations give every result's shape
    and dtype, those of the same call on real tensors, whatever the backend; autograd too."""
    g = torch.Generator().manual_seed(4)
    q, kv = torch.randn(4, 2, 16, generator=g), torch.randn(6, 16, generator=g)
    idx = torch.randint(-1, 6, (4, 3), generator=g, dtype=torch.int32)
    w, lse = torch.randn(4, 2, generator=g), torch.randn(4, 2, generator=g)
    calls = {
        "sparse_attention": lambda q, kv, idx, w, lse: dsa.sparse_attention(q, kv, idx, return_lse=True,
                                                                            backend=backend),
        "sparse_decode": lambda q, kv, idx, w, lse: dsa.sparse_decode(q, kv, idx, return_lse=True, backend=backend),
        "indexer_scores": lambda q, kv, idx, w, lse: dsa.indexer_scores(q, kv, w, backend=backend),
        "indexer_topk": lambda q, kv, idx, w, lse: dsa.indexer_topk(q, kv, w, 3, backend=backend),
        "topk_indices": lambda q, kv, idx, w, lse: dsa.topk_indices(kv, 3, return_lengths=True, backend=backend),
        "attention_target": lambda q, kv, idx, w, lse: dsa.attention_target(q, kv, idx, lse, backend=backend),
        "sparse_indexer_scores": lambda q, kv, idx, w, lse: dsa.sparse_indexer_scores(q, kv, w, idx,
                                                                                      backend=backend),
        "dense_attention_target": lambda q, kv, idx, w, lse: dsa.dense_attention_target(q, kv, backend=backend),
    }
    meta = [x.to("meta") for x in (q, kv, idx, w, lse)]
    for name, call in calls.items():
        real, fake = call(q, kv, idx, w, lse), call(*meta)
        real, fake = (real, fake) if isinstance(real, tuple) else ((real,), (fake,))
        for r, f in zip(real, fake):
            assert f.device.type == "meta" and f.shape == r.shape and f.dtype == r.dtype, name
    qm = meta[0].clone().requires_grad_()
    dq, = torch.autograd.grad(dsa.sparse_attention(qm, meta[1], meta[2], backend=backend).sum(), [qm])
    assert dq.device.type == "meta" and dq.shape == q.shape
