"""Adversarial probes of the public API: each test pins a contract violation
that the rest of the suite missed (found by review), on every CPU backend.

* q_offsets past int32 (int64 input) or near the int32 limit: the visible
  keys are those of the given offset, not of a wrapped / overflowed one;
* ``backend`` of a wrong type, and ints past int64, are TypeError /
  ValueError naming the argument (not a RuntimeError from the op schema);
* ``explain`` raises what the call raises, for the same arguments;
* ``return_lengths`` is type-checked like the other flags;
* ``dense_attention_target`` with D = 0 and the default sm_scale is a ValueError;
* the reference ``indexer_scores`` backward never reads keys a row does not
  see (NaN past the causal window, or a NaN query row, stays out of the
  other gradients), as the Triton backward does.
"""

from __future__ import annotations

import math

import pytest
import torch

import dsa

CPU_BACKENDS = ["reference", "triton"]  # the conftest sets TRITON_INTERPRET=1 without CUDA


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _visible(off, ratio, n_q, s_k):
    """The rule of docs/semantics.md, in Python ints: visible key count of each query."""
    return [min(max((off + i + 1) // ratio, 0), s_k) for i in range(n_q)]


def _indexer_inputs(B=2, Sq=3, Sk=5, H=4, D=16, seed=0, device="cpu"):
    g = _gen(seed)
    q = torch.randn(B, Sq, H, D, generator=g).to(device)
    k = torch.randn(B, Sk, D, generator=g).to(device)
    w = torch.randn(B, Sq, H, generator=g).to(device)
    return q, k, w


# --------------------------------------------------------------------------
# q_offsets: no int32 wrap, no int32 overflow

OFFSETS = [
    # (offsets, dtype): int64 values past 2**31 used to wrap on the int32 cast
    ([2**32, -(2**32)], torch.int64),
    ([2**32 + 1, 2**33 + 2], torch.int64),
    ([-(2**40), 2**40], torch.int64),
    ([2**63 - 1, -(2**63)], torch.int64),
    # int32 values whose q_offsets + i + 1 overflowed int32 in the Triton kernel
    ([2**31 - 1, 2**31 - 2], torch.int32),
    ([2**31 - 3, -(2**31)], torch.int32),
]


@pytest.mark.parametrize("offsets,dtype", OFFSETS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_q_offsets_extremes_indexer(backend, offsets, dtype):
    B, Sq, Sk = 2, 3, 5
    q, k, w = _indexer_inputs(B, Sq, Sk)
    off = torch.tensor(offsets, dtype=dtype)
    for ratio in (1, 2):
        s = dsa.indexer_scores(q, k, w, ratio=ratio, q_offsets=off, backend=backend)
        exp = [_visible(offsets[b], ratio, Sq, Sk) for b in range(B)]
        assert torch.isfinite(s).sum(-1).tolist() == exp
        idx, lengths = dsa.indexer_topk(q, k, w, 4, ratio=ratio, q_offsets=off, return_lengths=True, backend=backend)
        assert lengths.tolist() == [[min(4, n) for n in row] for row in exp]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_q_offsets_extremes_packed_and_dense_target(backend):
    H, D = 16, 16
    lens_q, lens_k = [3, 0, 2], [4, 2, 5]
    cu_q = torch.tensor([0, 3, 3, 5])
    cu_k = torch.tensor([0, 4, 6, 11])
    g = _gen(1)
    q = torch.randn(5, H, D, generator=g)
    k = torch.randn(11, D, generator=g)
    w = torch.randn(5, H, generator=g)
    offsets = [2**32 + 1, 2**31 - 1, -(2**33)]
    kw = dict(q_offsets=torch.tensor(offsets), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_k=6)
    exp = sum((_visible(offsets[b], 1, lens_q[b], lens_k[b]) for b in range(3)), [])
    s = dsa.indexer_scores(q, k, w, backend=backend, **kw)
    assert torch.isfinite(s).sum(-1).tolist() == exp
    t = dsa.dense_attention_target(q, k, backend=backend, **kw)
    assert (t > 0).sum(-1).tolist() == exp
    torch.testing.assert_close(t.sum(-1), torch.tensor([1.0 if n else 0.0 for n in exp]))


@pytest.mark.gpu
def test_q_offsets_near_int32_max_cuda():
    q, k, w = _indexer_inputs(device="cuda")
    q, k = q.bfloat16(), k.bfloat16()
    off = torch.tensor([2**31 - 1, 2**31 - 2], dtype=torch.int32, device="cuda")
    for backend in ("triton", "auto"):
        s = dsa.indexer_scores(q, k, w, q_offsets=off, backend=backend)
        assert torch.isfinite(s).sum(-1).tolist() == [[5, 5, 5], [5, 5, 5]]


# --------------------------------------------------------------------------
# argument types and ranges


def _sparse_inputs():
    g = _gen(2)
    q = torch.randn(3, 4, 16, generator=g)
    kv = torch.randn(5, 16, generator=g)
    idx = torch.randint(-1, 5, (3, 2), generator=g, dtype=torch.int32)
    return q, kv, idx


def _all_ops():
    """(name, args, kwargs) of a valid call of every public op."""
    q, kv, idx = _sparse_inputs()
    qi, ki, wi = _indexer_inputs()
    lse = torch.zeros(3, 4)
    ti, tk, tw = torch.randn(3, 2, 16), torch.randn(5, 16), torch.randn(3, 2)
    target = torch.rand(3, 2)
    return [
        ("sparse_attention", (q, kv, idx), {}),
        ("indexer_scores", (qi, ki, wi), {}),
        ("indexer_topk", (qi, ki, wi, 2), {}),
        ("topk_indices", (torch.randn(3, 7), 2), {}),
        ("attention_target", (q, kv, idx, lse), {}),
        ("sparse_indexer_scores", (ti, tk, tw, idx), {}),
        ("indexer_kl_loss", (ti, tk, tw, idx, target), {}),
        ("dense_attention_target", (qi, ki), {}),
    ]


@pytest.mark.parametrize("bad", [None, 1, ["reference"]])
@pytest.mark.parametrize("name,args,kwargs", _all_ops(), ids=[o[0] for o in _all_ops()])
def test_backend_of_wrong_type_is_a_type_error(name, args, kwargs, bad):
    with pytest.raises(TypeError, match=r"^backend: "):
        getattr(dsa, name)(*args, backend=bad, **kwargs)
    with pytest.raises(TypeError, match=r"^backend: "):
        dsa.explain(name, *args, backend=bad, **kwargs)


def test_ints_past_int64_are_value_errors():
    qi, ki, wi = _indexer_inputs()
    big = 2**64
    with pytest.raises(ValueError, match=r"^ratio: "):
        dsa.indexer_scores(qi, ki, wi, ratio=big)
    with pytest.raises(ValueError, match=r"^topk: "):
        dsa.indexer_topk(qi, ki, wi, big)
    with pytest.raises(ValueError, match=r"^k: "):
        dsa.topk_indices(torch.randn(2, 3), big)
    with pytest.raises(ValueError, match=r"^max_seqlen_k: "):
        dsa.indexer_scores(qi[0], ki[0], wi[0], max_seqlen_k=big)
    with pytest.raises(ValueError, match=r"^ratio: "):
        dsa.dense_attention_target(qi, ki, ratio=big)
    q, kv, idx = _sparse_inputs()
    with pytest.raises(ValueError, match=r"^sm_scale: "):
        dsa.sparse_attention(q, kv, idx, sm_scale=10**400)


def test_return_lengths_is_type_checked():
    with pytest.raises(TypeError, match=r"^return_lengths: "):
        dsa.topk_indices(torch.randn(2, 3), 1, return_lengths=1)
    qi, ki, wi = _indexer_inputs()
    with pytest.raises(TypeError, match=r"^return_lengths: "):
        dsa.indexer_topk(qi, ki, wi, 1, return_lengths="yes")


def test_dense_target_zero_head_dim_is_a_value_error():
    with pytest.raises(ValueError, match=r"^q: "):
        dsa.dense_attention_target(torch.randn(3, 2, 0), torch.randn(4, 0))


# --------------------------------------------------------------------------
# explain raises what the call raises


def _bad_calls():
    q, kv, idx = _sparse_inputs()
    qi, ki, wi = _indexer_inputs()
    ti, tk, tw = torch.randn(3, 2, 16), torch.randn(5, 16), torch.randn(3, 2)
    scores = torch.randn(3, 7)
    return [
        ("sparse_attention", (q, kv, idx), dict(return_lse=1)),
        ("indexer_scores", (qi, ki, wi, 5), {}),  # an extra positional argument
        ("indexer_topk", (qi, ki, wi, -1), {}),
        ("indexer_topk", (qi, ki, wi, 2.0), {}),
        ("indexer_topk", (qi, ki, wi, 2), dict(global_indices=True)),  # batched q
        ("indexer_topk", (qi, ki, wi, 2), dict(global_indices=1)),
        ("indexer_topk", (qi, ki, wi, 2), dict(return_lengths=1)),
        ("indexer_topk", (qi, ki, wi), {}),  # topk missing
        ("topk_indices", (scores, 2), dict(return_lengths=1)),
        ("sparse_indexer_scores", (ti, tk, tw, idx, torch.rand(3, 2)), {}),  # an extra positional argument
        ("indexer_kl_loss", (ti, tk, tw, idx, torch.rand(2, 2)), {}),  # target of the wrong shape
        ("indexer_kl_loss", (ti, tk, tw, idx, torch.rand(3, 2).int()), {}),  # target of the wrong dtype
        ("indexer_kl_loss", (ti, tk, tw, idx), {}),  # target missing
        ("dense_attention_target", (qi, ki, 2), {}),
    ]


@pytest.mark.parametrize("name,args,kwargs", _bad_calls(), ids=[f"{c[0]}-{i}" for i, c in enumerate(_bad_calls())])
def test_explain_raises_like_the_call(name, args, kwargs):
    with pytest.raises((TypeError, ValueError)) as call_err:
        getattr(dsa, name)(*args, **kwargs)
    with pytest.raises(call_err.type):
        dsa.explain(name, *args, **kwargs)


# --------------------------------------------------------------------------
# indexer_scores backward: keys a row does not see are never read


# the Triton indexer_scores backward sums dk by key under torch.use_deterministic_algorithms
@pytest.mark.parametrize("torch_deterministic", [False, True], ids=["default", "torch-deterministic"], indirect=True)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_indexer_scores_grad_ignores_invisible_nan(backend, torch_deterministic):
    B, Sq, Sk, H, D = 1, 3, 6, 4, 16
    q, k, w = _indexer_inputs(B, Sq, Sk, H, D, seed=3)
    poisoned_q, poisoned_k = q.clone(), k.clone()
    poisoned_q[0, 0] = float("nan")  # query 0 sees key 0 only
    poisoned_k[0, 4:] = float("nan")  # keys 4, 5: no query sees them (causal, offset 0)
    dscores = torch.randn(B, Sq, Sk, generator=_gen(4))

    def grads(q, k, w):
        q, k, w = (t.clone().requires_grad_(True) for t in (q, k, w))
        s = dsa.indexer_scores(q, k, w, sm_scale=0.5, backend=backend)
        (torch.where(torch.isfinite(s), s, 0.0) * dscores).sum().backward()
        return q.grad, k.grad, w.grad

    dq, dk, dw = grads(poisoned_q, poisoned_k, w)
    clean_q, clean_k = q.clone(), k.clone()
    clean_k[0, 4:] = 0.0
    cq, ck, cw = grads(clean_q, clean_k, w)
    # rows 1, 2 never see the NaN keys; keys 1.. are never seen by the NaN row
    torch.testing.assert_close(dq[0, 1:], cq[0, 1:])
    torch.testing.assert_close(dw[0, 1:], cw[0, 1:])
    torch.testing.assert_close(dk[0, 1:], ck[0, 1:])
    assert torch.equal(dk[0, 4:], torch.zeros_like(dk[0, 4:]))
    assert torch.isnan(dk[0, 0]).all()  # the NaN row does see key 0: NaN propagates there, as in the contract
    # and the clean gradient is right (float64 autograd of the formula of docs/semantics.md)
    qd, kd, wd = (t.double().requires_grad_(True) for t in (clean_q, clean_k, w))
    total = 0.0
    for i in range(Sq):
        for j in range(_visible(0, 1, Sq, Sk)[i]):
            total = total + dscores[0, i, j] * 0.5 * (wd[0, i] * torch.relu(qd[0, i] @ kd[0, j])).sum()
    total.backward()
    for got, want in ((cq, qd.grad), (ck, kd.grad), (cw, wd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert math.isfinite(float(dk[0, 1:].abs().sum()))
