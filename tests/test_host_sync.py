"""The GPU paths never make the host wait for the device.

A call that synchronises (a blocking host-to-device copy, ``.item()``, a
data-dependent shape) stalls the host behind every queued kernel, so the
next launch starts late and short kernels become host-bound. Under
``torch.cuda.set_sync_debug_mode("error")`` any such operation raises.

Only the calls that must read device values are exempt: explicit
``cu_seqlens`` are validated on the host in eager mode (docs/semantics.md,
"Host synchronisation"), so the packed calls here use the one-sequence form,
which needs no such read. While a CUDA graph is captured those checks run on
the device, so the packed varlen call captures and replays.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import dsa

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _twice(fn):
    fn()  # compiles and autotunes outside the checked region
    with no_sync():
        fn()


def _indexer_inputs(T=256, H=16, D=64, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(T, H, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(T, D, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(T, H, device="cuda", dtype=torch.float32, generator=g)
    return q, k, w


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_indexer_calls_do_not_sync(backend):
    q, k, w = _indexer_inputs()
    _twice(lambda: dsa.indexer_scores(q, k, w, ratio=2, backend=backend))
    _twice(lambda: dsa.indexer_scores(q.view(2, 128, *q.shape[1:]), k.view(2, 128, -1), w.view(2, 128, -1),
                                      backend=backend))
    _twice(lambda: dsa.indexer_topk(q, k, w, 64, return_lengths=True, backend=backend))
    s = torch.randn(64, 1000, device="cuda")
    _twice(lambda: dsa.topk_indices(s, 100, return_lengths=True, backend=backend))


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_sparse_attention_does_not_sync(backend):
    g = torch.Generator(device="cuda").manual_seed(1)
    T, N, H, D, d_v, K = 64, 300, 16, 192, 128, 96
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    kv = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    idx = torch.randint(-5, N + 5, (T, K), device="cuda", dtype=torch.int32, generator=g)
    lens = torch.randint(0, K + 1, (T,), device="cuda", dtype=torch.int32, generator=g)
    sink = torch.randn(H, device="cuda", generator=g).requires_grad_()
    dout = torch.randn(T, H, d_v, device="cuda", dtype=torch.bfloat16, generator=g)

    def step():
        out, lse = dsa.sparse_attention(q, kv, idx, d_v=d_v, sink=sink, topk_length=lens, return_lse=True,
                                        backend=backend)
        torch.autograd.backward(out, dout)
        return lse

    _twice(step)


def test_packed_indexer_topk_with_cu_seqlens_captures_in_a_cuda_graph():
    """A packed varlen indexer_topk call is captured in a CUDA graph and its
    replay equals the eager call, also after new inputs are copied in."""
    q, k, w = _indexer_inputs(T=256)
    cu_q = torch.tensor([0, 100, 180, 256], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, 90, 200, 256], device="cuda", dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_k=110, ratio=1, return_lengths=True,
              global_indices=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles and autotunes outside the capture
        dsa.indexer_topk(q, k, w, 32, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx, lengths = dsa.indexer_topk(q, k, w, 32, **kw)
    g = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(2):
        q.copy_(torch.randn(q.shape, device="cuda", generator=g).to(q.dtype))
        graph.replay()
        exp_idx, exp_len = dsa.indexer_topk(q, k, w, 32, **kw)
        torch.cuda.synchronize()
        assert torch.equal(idx, exp_idx) and torch.equal(lengths, exp_len)
        assert (lengths > 0).any() and (idx >= 100).any()  # global rows of the later sequences


def _decode_step(B=4, H=64, K=256, P=64, PS=64, seed=3):
    """A decode step on a V3.2 FP8 cache with a block table: (q, cache, positions, keywords)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = dsa.quantize_kv_cache(torch.randn(P, PS, 576, device="cuda", generator=g), "fp8_v32")
    q = torch.randn(B, 1, H, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.randint(-1, 4 * PS, (B, 1, K), device="cuda", generator=g).int()
    kw = dict(block_table=torch.randperm(P, device="cuda", generator=g)[: B * 4].view(B, 4).int(),
              seq_lens=torch.randint(0, 4 * PS + 1, (B,), device="cuda", generator=g).int(),
              topk_length=torch.randint(0, K + 1, (B,), device="cuda", generator=g).int(),
              sink=torch.randn(H, device="cuda", generator=g))
    return q, cache, pos, kw


@pytest.mark.parametrize("B", [1, 4])
def test_sparse_decode_plan_does_not_sync_and_captures(B):
    """A plan's call (split over programs at B1, and with its outputs given) neither syncs nor allocates
    by value: it captures in a CUDA graph, whose replays follow new inputs and equal the function's."""
    q, cache, pos, kw = _decode_step(B=B)
    plan = dsa.sparse_decode_plan(q, cache, pos, **kw, return_lse=True)
    out, lse = torch.empty(B, 1, 64, 512, device="cuda", dtype=torch.bfloat16), torch.empty(B, 1, 64, device="cuda")
    _twice(lambda: plan(q, cache, pos, **kw))
    _twice(lambda: plan(q, cache, pos, **kw, out=out, lse=lse))
    _twice(lambda: dsa.sparse_decode(q, cache, pos, **kw, return_lse=True))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = plan(q, cache, pos, **kw)
    g = torch.Generator(device="cuda").manual_seed(9)
    for _ in range(2):
        q.copy_(torch.randn(q.shape, device="cuda", generator=g).to(q.dtype))
        graph.replay()
        exp_out, exp_lse = dsa.sparse_decode(q, cache, pos, **kw, return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(g_out, exp_out) and torch.equal(g_lse, exp_lse)
