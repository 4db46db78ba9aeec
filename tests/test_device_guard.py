"""Every op runs on its tensors' device, whatever device is current.

On CPU the guard's wiring is checked with the device of the call faked: each
op body must be entered under ``torch.cuda.device(<its tensors' device>)``
when that differs from the current one, and not otherwise. On a GPU the calls
run for real (cuda:1 against cuda:0 where two GPUs exist).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import bruteforce as bf
import dsa
from dsa.ops import _core

CUDA = torch.cuda.is_available()


@pytest.fixture
def entered(monkeypatch):
    """Fake a call on cuda:1 while cuda:0 is current; record the guards entered."""
    seen = []

    @contextlib.contextmanager
    def device(dev):
        seen.append(torch.device(dev))
        yield

    monkeypatch.setattr(_core, "_device", lambda a: torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", device)
    return seen


def _sparse(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 2, 16, generator=g, dtype=torch.float64)
    kv = torch.randn(6, 16, generator=g, dtype=torch.float64)
    idx = torch.tensor([[0, 5, -1, 2], [1, 1, 3, 9], [4, 0, 2, 5]], dtype=torch.int32)
    return q, kv, idx


@pytest.mark.skipif(CUDA, reason="the faked device is for CPU runs")
def test_forward_and_backward_enter_their_tensors_device(entered):
    q, kv, idx = _sparse()
    q.requires_grad_(True)
    out = dsa.sparse_attention(q, kv, idx, d_v=8, backend="reference")
    out.sum().backward()
    # the forward op and the backward op each entered cuda:1
    assert entered.count(torch.device("cuda", 1)) >= 2
    exp = bf.sparse_attention(q.detach(), kv, idx, d_v=8, dout=torch.ones_like(out))
    torch.testing.assert_close(out.detach(), exp["out"])
    torch.testing.assert_close(q.grad, exp["dq"])


@pytest.mark.skipif(CUDA, reason="the faked device is for CPU runs")
def test_every_op_family_is_guarded(entered):
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(4, 9, generator=g)
    dsa.topk_indices(scores, 3, backend="reference")
    q, k, w = torch.randn(1, 5, 2, 8, generator=g), torch.randn(1, 5, 8, generator=g), torch.randn(1, 5, 2, generator=g)
    dsa.indexer_scores(q, k, w, backend="reference")
    dsa.indexer_topk(q, k, w, 2, backend="reference")
    assert len(entered) == 3


@pytest.mark.skipif(CUDA, reason="the faked device is for CPU runs")
def test_no_guard_when_the_device_is_current(monkeypatch):
    def refuse(dev):
        raise AssertionError("guard entered although the device is current")

    monkeypatch.setattr(_core, "_device", lambda a: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", refuse)
    q, kv, idx = _sparse()
    dsa.sparse_attention(q, kv, idx, d_v=8, backend="reference")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_call_on_another_device_matches(backend):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    g = torch.Generator().manual_seed(2)
    q = torch.randn(64, 64, 512, generator=g).bfloat16()
    kv = torch.randn(256, 512, generator=g).bfloat16()
    idx = torch.randint(-4, 260, (64, 128), generator=g, dtype=torch.int32)
    res = {}
    for dev, current in (("cuda:0", 1), ("cuda:1", 0)):
        with torch.cuda.device(current):
            res[dev] = dsa.sparse_attention(q.to(dev), kv.to(dev), idx.to(dev), backend=backend).cpu()
    assert torch.equal(res["cuda:0"], res["cuda:1"])
