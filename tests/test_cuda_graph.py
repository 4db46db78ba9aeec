"""A whole indexer-training step captures in one CUDA graph and replays equal to eager.

indexer_topk -> sparse_attention forward and backward -> attention_target ->
indexer_kl_loss and its backward, every op on its default backend. The graph
is captured once; its inputs are then refilled with new random values and the
replay is compared with an eager step on those same values (indices and
lengths exactly; the float results to within the rounding that the order of
fp32 atomics can change).
"""

from __future__ import annotations

import pytest
import torch

import dsa

pytestmark = pytest.mark.gpu

T, H, D, D_V, K, H_I, D_I = 256, 64, 576, 512, 128, 16, 64


def _fill(tensors, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for t in tensors:
        t.copy_(torch.randn(t.shape, device="cuda", generator=g, dtype=t.dtype))


def _inputs():
    def empty(*shape, dtype=torch.bfloat16, grad=False):
        return torch.empty(*shape, device="cuda", dtype=dtype).requires_grad_(grad)

    x = dict(q=empty(T, H, D, grad=True), kv=empty(T, D, grad=True), q_i=empty(T, H_I, D_I, grad=True),
             k_i=empty(T, D_I, grad=True), w=empty(T, H_I, dtype=torch.float32, grad=True),
             sink=empty(H, dtype=torch.float32, grad=True), dout=empty(T, H, D_V))
    return x


def _step(x):
    """One step; returns every output and gradient it makes."""
    idx, n = dsa.indexer_topk(x["q_i"].detach(), x["k_i"].detach(), x["w"].detach(), K, sm_scale=D_I ** -0.5,
                              return_lengths=True)
    out, lse = dsa.sparse_attention(x["q"], x["kv"], idx, sink=x["sink"], topk_length=n, return_lse=True)
    dq, dkv, dsink = torch.autograd.grad(out, (x["q"], x["kv"], x["sink"]), x["dout"])
    target = dsa.attention_target(x["q"].detach(), x["kv"].detach(), idx, lse, topk_length=n)
    loss = dsa.indexer_kl_loss(x["q_i"], x["k_i"], x["w"], idx, target, sm_scale=D_I ** -0.5, topk_length=n)
    dq_i, dk_i, dw = torch.autograd.grad(loss, (x["q_i"], x["k_i"], x["w"]))
    return dict(idx=idx, n=n, out=out, lse=lse, dq=dq, dkv=dkv, dsink=dsink, target=target, loss=loss,
                dq_i=dq_i, dk_i=dk_i, dw=dw)


def _rel(a, b):
    a, b = a.double(), b.double()
    finite = torch.isfinite(b)
    assert torch.equal(finite, torch.isfinite(a)), "the inf/NaN pattern differs"
    return float((a[finite] - b[finite]).norm() / b[finite].norm().clamp_min(1e-30))


def test_training_step_replays_equal_to_eager():
    x = _inputs()
    with torch.no_grad():
        _fill(x.values(), 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, autotune and fill every cache outside the capture
        for _ in range(3):
            _step(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(x)

    with torch.no_grad():
        _fill(x.values(), 1)  # new values in the captured input buffers
    graph.replay()
    torch.cuda.synchronize()
    eager = _step(x)
    for name in ("idx", "n"):
        assert torch.equal(captured[name], eager[name]), name
    for name in ("out", "lse", "dq", "dkv", "dsink", "target", "loss", "dq_i", "dk_i", "dw"):
        assert _rel(captured[name], eager[name]) < 1e-3, name
    assert captured["n"].float().mean() > K / 2  # the step selected real slots
