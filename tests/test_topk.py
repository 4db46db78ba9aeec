"""topk_indices and indexer_topk against the brute force of docs/semantics.md's
"Top-k": valid positions first in ascending order, -1 padding, ties at the
cut to the smaller position, NaN / -inf never selected, +inf selectable."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bruteforce as bf
import dsa

INF = float("inf")
NAN = float("nan")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ints(values, device, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def topk_dtype(case):
    """Score dtype for a case: fp32 (fp16 for the low-precision cases)."""
    return torch.float32 if case.dtype in (torch.float64, torch.float32) else case.dtype


def special_scores(R, S, dtype, gen, device):
    """Random scores with NaN, -inf, +inf and many ties sprinkled in."""
    s = torch.randn(R, S, generator=gen)
    ties = torch.randint(0, 4, (R, S), generator=gen).float()
    s = torch.where(torch.rand(R, S, generator=gen) < 0.4, ties, s)  # ~40% integer-valued: ties
    u = torch.rand(R, S, generator=gen)
    s[u < 0.08] = NAN
    s[(u >= 0.08) & (u < 0.16)] = -INF
    s[(u >= 0.16) & (u < 0.19)] = INF
    s[0] = -INF  # a row with nothing selectable
    s[1] = 2.0  # a row of ties only
    s[1, ::3] = NAN
    return s.to(dtype).to(device)


def check_topk(call, backend, scores, k, row_ends=None):
    kw = {} if row_ends is None else {"row_ends": row_ends}
    idx, lengths = call(dsa.topk_indices, scores, k, return_lengths=True, backend=backend, **kw)
    want_idx, want_len = bf.topk(scores, k, row_ends)
    assert idx.dtype == torch.int32 and lengths.dtype == torch.int32
    assert idx.shape == (*scores.shape[:-1], k) and lengths.shape == scores.shape[:-1]
    assert torch.equal(idx.cpu().long(), want_idx), f"indices differ:\n{idx}\n{want_idx}"
    assert torch.equal(lengths.cpu().long(), want_len)
    only = call(dsa.topk_indices, scores, k, backend=backend, **kw)
    assert torch.equal(only, idx)
    return idx, lengths


@pytest.mark.parametrize("k", [0, 1, 5, 16, 20, 27])
def test_topk_rules(case, call, k):
    gen = _gen(k)
    scores = special_scores(6, 20, topk_dtype(case), gen, case.device)
    check_topk(call, case.backend, scores, k)


def test_topk_order_and_padding_explicit(backend, call):
    s = torch.tensor(
        [
            [0.5, 3.0, -INF, 3.0, NAN, 1.0, INF, 3.0],  # +inf largest; ties at 3.0 -> smaller positions
            [NAN, NAN, -INF, 7.0, NAN, -INF, NAN, NAN],  # one selectable entry
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # all ties
        ]
    )
    idx, lengths = call(dsa.topk_indices, s, 3, return_lengths=True, backend=backend)
    assert idx.tolist() == [[1, 3, 6], [3, -1, -1], [0, 1, 2]]
    assert lengths.tolist() == [3, 1, 3]
    idx, lengths = call(dsa.topk_indices, s, 10, return_lengths=True, backend=backend)
    assert idx.tolist() == [
        [0, 1, 3, 5, 6, 7, -1, -1, -1, -1],
        [3, -1, -1, -1, -1, -1, -1, -1, -1, -1],
        [0, 1, 2, 3, 4, 5, 6, 7, -1, -1],
    ]
    assert lengths.tolist() == [6, 1, 8]


def test_topk_higher_rank(fast_case, call):
    case = fast_case
    gen = _gen(100)
    scores = special_scores(6, 13, topk_dtype(case), gen, case.device).view(2, 3, 13)
    check_topk(call, case.backend, scores, 7)
    check_topk(call, case.backend, scores.view(1, 2, 3, 13), 4)


def test_topk_one_dim_and_empty(fast_case, call):
    case = fast_case
    gen = _gen(101)
    s = special_scores(3, 9, topk_dtype(case), gen, case.device)
    check_topk(call, case.backend, s[2], 4)  # [S] -> [k], lengths []
    check_topk(call, case.backend, s[:0], 4)  # no rows


def test_topk_rows_of_length_zero(fast_case, call):
    """[R, 0] scores (e.g. an indexer whose key sequences are all empty):
    every row is padding, length 0."""
    case = fast_case
    s = torch.zeros(3, 0, dtype=topk_dtype(case), device=case.device)
    check_topk(call, case.backend, s, 3)
    check_topk(call, case.backend, s.view(3, 1, 0), 2)


def test_topk_non_contiguous(fast_case, call):
    case = fast_case
    gen = _gen(102)
    s = special_scores(12, 10, topk_dtype(case), gen, case.device).t()  # [10, 12] strided
    assert not s.is_contiguous()
    check_topk(call, case.backend, s, 5)


def test_topk_long_rows(fast_case, call):
    """Rows longer than one block, k not a power of two."""
    case = fast_case
    gen = _gen(103)
    s = special_scores(4, 300, topk_dtype(case), gen, case.device)
    check_topk(call, case.backend, s, 37)


# --------------------------------------------------------------------------
# row_ends: each row only up to its end, whatever lies past it


def poison_past(scores: torch.Tensor, ends: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """scores with +inf, NaN and huge values right past each row's end (and
    here and there further on): selected by anything that reads past it."""
    x = scores.clone()
    flat = x.view(-1, x.shape[-1])
    S = flat.shape[1]
    for r, e in enumerate(ends.reshape(-1).tolist()):
        e = min(max(e, 0), S)
        tail = torch.tensor([INF, NAN, 1e30, INF], dtype=x.dtype)[torch.randint(0, 4, (S - e,), generator=gen)]
        flat[r, e:] = tail.to(x.device)
    return x


@pytest.mark.parametrize("k", [1, 9, 30])
def test_topk_row_ends(case, call, k):
    """Ends of 0, inside, S, past S and negative, int32 then int64 (one past
    2**31: clamped, not wrapped); ties, NaN and +-inf inside the rows, +inf /
    NaN / huge values past the ends."""
    gen = _gen(700 + k)
    R, S = 10, 24
    scores = special_scores(R, S, topk_dtype(case), gen, "cpu")
    ends = torch.tensor([24, 0, 13, 40, -3, 1, 7, 16, 17, 2**31 - 1])
    scores = poison_past(scores, ends, gen).to(case.device)
    big = ends.clone()
    big[3] = 2**32 + 5
    for e in (ends.to(torch.int32), big):
        idx, lengths = call(dsa.topk_indices, scores, k, row_ends=e.to(case.device), return_lengths=True,
                            backend=case.backend)
        want_idx, want_len = bf.topk(scores, k, e)
        assert idx.dtype == torch.int32 and lengths.dtype == torch.int32 and idx.shape == (R, k)
        assert torch.equal(idx.cpu().long(), want_idx), f"indices differ:\n{idx}\n{want_idx}"
        assert torch.equal(lengths.cpu().long(), want_len)
        assert (idx.cpu() < ends.clamp(0, S).view(-1, 1)).all()


def test_topk_row_ends_equal_the_masked_rows(fast_case, call):
    """With ends the result is that of the rows with -inf past the ends (and
    of whole rows where every end is >= S); higher-rank scores take ends of
    their leading shape."""
    case = fast_case
    gen = _gen(710)
    scores = special_scores(6, 13, topk_dtype(case), gen, "cpu").view(2, 3, 13)
    ends = torch.tensor([[13, 0, 5], [12, 99, 1]])
    col = torch.arange(13)
    masked = torch.where(col < ends.clamp(0, 13)[..., None], scores, torch.full_like(scores, -INF))
    scores = poison_past(scores, ends, gen)
    dev = case.device
    got = call(dsa.topk_indices, scores.to(dev), 4, row_ends=ends.to(dev), return_lengths=True, backend=case.backend)
    want = call(dsa.topk_indices, masked.to(dev), 4, return_lengths=True, backend=case.backend)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    whole = call(dsa.topk_indices, scores.to(dev), 4, backend=case.backend)
    full = call(dsa.topk_indices, scores.to(dev), 4, row_ends=torch.full((2, 3), 13, device=dev),
                backend=case.backend)
    assert torch.equal(whole, full)
    check_topk(call, case.backend, scores[1, 2].to(dev), 4, ends[1, 2].to(dev))  # [S] with a 0-dim end
    check_topk(call, case.backend, scores[:0].to(dev), 4, ends[:0].to(dev))  # no rows


def test_topk_row_ends_through_the_op():
    """The dispatcher's path (the schema's optional row_ends) on every CPU
    backend, the fake's shapes, and what explain() reports."""
    from dsa import _checks, ops
    from conftest import _cpu_backend_params

    gen = _gen(720)
    s = special_scores(4, 11, torch.float32, gen, "cpu")
    ends = torch.tensor([11, 0, 6, 3], dtype=torch.int32)
    a, _ = _checks.topk_args(s, 3, ends)
    want = bf.topk(s, 3, ends)
    for backend in _cpu_backend_params():
        idx, lengths = ops.topk(a, backend)
        assert torch.equal(idx.long(), want[0]) and torch.equal(lengths.long(), want[1]), backend
    torch.library.opcheck(ops.topk.op, (s, 3, ends, "reference"), test_utils=("test_schema", "test_faketensor"))
    assert "row_ends" in dsa.explain("topk_indices", s, 3, row_ends=ends)
    assert "row_ends" not in dsa.explain("topk_indices", s, 3)


def test_topk_row_ends_errors():
    s = torch.zeros(2, 3, 5)
    with pytest.raises(TypeError, match="row_ends"):
        dsa.topk_indices(s, 2, row_ends=torch.zeros(2, 3), backend="reference")  # float ends
    with pytest.raises(TypeError, match="row_ends"):
        dsa.topk_indices(s, 2, row_ends=[[1, 2, 3], [1, 2, 3]], backend="reference")
    for shape in ((6,), (2, 3, 1), (3, 2), ()):
        with pytest.raises(ValueError, match=r"row_ends: expected shape \(2, 3\)"):
            dsa.topk_indices(s, 2, row_ends=torch.zeros(shape, dtype=torch.int32), backend="reference")
    with pytest.raises(ValueError, match="row_ends: expected device cpu"):
        dsa.topk_indices(s, 2, row_ends=torch.zeros(2, 3, dtype=torch.int32, device="meta"), backend="reference")


_VALUES = st.sampled_from([0.0, 1.0, -1.0, 2.5, INF, -INF, NAN, 1e-30, -0.0])


@st.composite
def _score_rows(draw):
    R, S = draw(st.integers(1, 4)), draw(st.integers(1, 12))
    return [draw(st.lists(_VALUES, min_size=S, max_size=S)) for _ in range(R)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=_score_rows(), k=st.integers(0, 14))
def test_topk_property_reference(call, rows, k):
    check_topk(call, "reference", torch.tensor(rows, dtype=torch.float32), k)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=_score_rows(), k=st.integers(0, 14), data=st.data())
def test_topk_property_row_ends_reference(call, rows, k, data):
    ends = data.draw(st.lists(st.integers(-2, 14), min_size=len(rows), max_size=len(rows)))
    check_topk(call, "reference", torch.tensor(rows, dtype=torch.float32), k, torch.tensor(ends))


# --------------------------------------------------------------------------
# indexer_topk


def _rand(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def _packed(case, gen, lens_q, lens_k, H=2, D=32, dup_keys=True):
    cu_q = ints([0] + torch.tensor(lens_q).cumsum(0).tolist(), case.device)
    cu_k = ints([0] + torch.tensor(lens_k).cumsum(0).tolist(), case.device)
    q = _rand((sum(lens_q), H, D), case.dtype, case.device, gen)
    k = _rand((sum(lens_k), D), case.dtype, case.device, gen)
    if dup_keys and k.shape[0] > 4:
        k[3] = k[1]  # identical keys: exact ties between columns
        k[4] = k[1]
    w = _rand((sum(lens_q), H), case.dtype, case.device, gen)
    return q, k, w, cu_q, cu_k


@pytest.mark.parametrize("topk", [0, 3, 8, 40])
@pytest.mark.parametrize("ratio", [1, 4])
def test_indexer_topk_batched_equals_two_steps(case, call, topk, ratio):
    gen = _gen(200 + topk)
    B, Sq, Sk, H, D = 2, 5, 12, 3, 32
    q = _rand((B, Sq, H, D), case.dtype, case.device, gen)
    k = _rand((B, Sk, D), case.dtype, case.device, gen)
    k[:, 5] = k[:, 2]  # exact ties
    w = _rand((B, Sq, H), case.dtype, case.device, gen)
    kw = dict(ratio=ratio, q_offsets=ints([7, 40], case.device), sm_scale=0.5)
    idx, lengths = call(dsa.indexer_topk, q, k, w, topk, return_lengths=True, backend=case.backend, **kw)
    scores = call(dsa.indexer_scores, q, k, w, backend=case.backend, **kw)
    want_idx, want_len = call(dsa.topk_indices, scores, topk, return_lengths=True, backend=case.backend)
    assert idx.dtype == torch.int32 and lengths.dtype == torch.int32
    assert torch.equal(idx, want_idx) and torch.equal(lengths, want_len)
    # and the composition is the contract's top-k of the scores
    b_idx, b_len = bf.topk(scores, topk)
    assert torch.equal(idx.cpu().long(), b_idx) and torch.equal(lengths.cpu().long(), b_len)
    only = call(dsa.indexer_topk, q, k, w, topk, backend=case.backend, **kw)
    assert torch.equal(only, idx)


@pytest.mark.parametrize("topk", [2, 6, 9])
def test_indexer_topk_packed_global_indices(case, call, topk):
    gen = _gen(300 + topk)
    lens_q, lens_k = [3, 0, 4, 2], [7, 4, 0, 6]
    q, k, w, cu_q, cu_k = _packed(case, gen, lens_q, lens_k)
    kw = dict(ratio=1, q_offsets=ints([4, 0, 1, 2], case.device), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
              max_seqlen_k=8)
    local, lengths = call(dsa.indexer_topk, q, k, w, topk, return_lengths=True, backend=case.backend, **kw)
    scores = call(dsa.indexer_scores, q, k, w, backend=case.backend, **kw)
    want_idx, want_len = call(dsa.topk_indices, scores, topk, return_lengths=True, backend=case.backend)
    assert torch.equal(local, want_idx) and torch.equal(lengths, want_len)
    b_idx, b_len = bf.topk(scores, topk)
    assert torch.equal(local.cpu().long(), b_idx) and torch.equal(lengths.cpu().long(), b_len)
    assert (lengths[3:7] == 0).all() and (local[3:7] == -1).all()  # zero-length key sequence

    glob, glen = call(dsa.indexer_topk, q, k, w, topk, global_indices=True, return_lengths=True,
                      backend=case.backend, **kw)
    assert glob.dtype == torch.int32 and torch.equal(glen, lengths)
    base = torch.tensor([0] * 3 + [11] * 4 + [11] * 2).view(-1, 1)  # cu_seqlens_k[b] of each query row
    want = torch.where(local.cpu() >= 0, local.cpu() + base.to(torch.int32), -1)
    assert torch.equal(glob.cpu(), want)
    assert (glob[7:][glob[7:] >= 0] >= 11).all()


def test_indexer_topk_packed_ratio_and_causal_false(fast_case, call):
    case = fast_case
    gen = _gen(400)
    q, k, w, cu_q, cu_k = _packed(case, gen, [4, 3], [5, 9])
    for kw in (dict(ratio=4, q_offsets=ints([9, 30], case.device)), dict(causal=False)):
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_k=9)
        idx, lengths = call(dsa.indexer_topk, q, k, w, 4, return_lengths=True, backend=case.backend, **kw)
        scores = call(dsa.indexer_scores, q, k, w, backend=case.backend, **kw)
        b_idx, b_len = bf.topk(scores, 4)
        assert torch.equal(idx.cpu().long(), b_idx) and torch.equal(lengths.cpu().long(), b_len)


def test_indexer_topk_feeds_sparse_attention(fast_case, call):
    """End to end: global indices and lengths go straight into a packed
    sparse_attention, which matches the brute force on them."""
    case = fast_case
    gen = _gen(500)
    lens_q, lens_k = [3, 4], [6, 10]
    qi, ki, wi, cu_q, cu_k = _packed(case, gen, lens_q, lens_k, dup_keys=False)
    idx, lengths = call(dsa.indexer_topk, qi, ki, wi, 5, global_indices=True, return_lengths=True,
                        q_offsets=ints([3, 6], case.device), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                        max_seqlen_k=10, backend=case.backend)
    T, H, D, N = 7, 3, 32, 16
    q = _rand((T, H, D), case.dtype, case.device, gen)
    kv = _rand((N, D), case.dtype, case.device, gen)
    sink = _rand((H,), torch.float32, case.device, gen)
    out, lse = call(dsa.sparse_attention, q, kv, idx, topk_length=lengths, sink=sink, d_v=16, return_lse=True,
                    backend=case.backend)
    exp = bf.sparse_attention(q, kv, idx, topk_length=lengths, sink=sink, d_v=16)
    bf.assert_close(out, exp["out"], case.dtype, "out")
    bf.assert_close(lse, exp["lse"], max(case.dtype, torch.float32, key=[torch.float64, torch.float32,
                                                                         torch.float16, torch.bfloat16].index),
                    "lse")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["reference", "triton", "cute"])
@pytest.mark.parametrize("k", [64, 512, 2048])
def test_topk_model_sizes_cuda(call, backend, k):
    gen = _gen(600 + k)
    scores = special_scores(8, 4096, torch.float32, gen, "cuda")
    scores[2, 100:] = -INF  # an early causal row: fewer than k selectable
    check_topk(call, backend, scores, k)
