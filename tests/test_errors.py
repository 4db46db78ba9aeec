"""Bad input raises ValueError (TypeError for a wrong type) naming the
argument: one test per bad-input class of the "Errors" section of docs/semantics.md."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dsa
from conftest import CUDA, TRITON_IMPORTABLE

T, H, D, N, K = 4, 4, 32, 10, 6
PLAN_BACKEND = "triton" if TRITON_IMPORTABLE and not CUDA else "reference"


def _gen():
    return torch.Generator().manual_seed(0)


def sparse_inputs(**over):
    g = _gen()
    base = dict(
        q=torch.randn(T, H, D, generator=g),
        kv=torch.randn(N, D, generator=g),
        indices=torch.randint(0, N, (T, K), generator=g, dtype=torch.int32),
    )
    base.update(over)
    return base


def sa(q, kv, indices, **kw):
    return dsa.sparse_attention(q, kv, indices, backend="reference", **kw)


def test_valid_baseline_runs():
    """The inputs every test below breaks one piece of are themselves fine."""
    out = sa(**sparse_inputs(), sink=torch.zeros(H), topk_length=torch.full((T,), 3, dtype=torch.int32))
    assert out.shape == (T, H, D) and torch.isfinite(out).all()


# --------------------------------------------------------------------------
# sparse_attention: wrong rank


@pytest.mark.parametrize(
    "arg,value",
    [
        ("q", torch.randn(T, H * D)),
        ("q", torch.randn(1, 1, T, H, D)),
        ("kv", torch.randn(N * D)),
        ("kv", torch.randn(1, 1, N, 1, D)),
        ("indices", torch.zeros(T * K, dtype=torch.int32)),
        ("indices", torch.zeros(1, T, 1, 1, K, dtype=torch.int32)),
    ],
)
def test_sparse_wrong_rank(arg, value):
    with pytest.raises(ValueError, match=arg):
        sa(**sparse_inputs(**{arg: value}))


def test_sparse_wrong_rank_topk_length_and_sink():
    with pytest.raises(ValueError, match="topk_length"):
        sa(**sparse_inputs(), topk_length=torch.zeros(T, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="sink"):
        sa(**sparse_inputs(), sink=torch.zeros(1, H))


# --------------------------------------------------------------------------
# sparse_attention: mismatched shapes


@pytest.mark.parametrize(
    "arg,over,kw",
    [
        ("kv", dict(kv=torch.randn(N, D + 16)), {}),  # head dim differs from q
        ("indices", dict(indices=torch.zeros(T + 1, K, dtype=torch.int32)), {}),  # rows differ
        ("indices", dict(indices=torch.zeros(T, 2, K, dtype=torch.int32)), {}),  # 2 kv heads for an MQA kv
        ("indices", dict(kv=torch.randn(N, 2, D), indices=torch.zeros(T, 4, K, dtype=torch.int32)), {}),
        ("indices", dict(kv=torch.randn(N, 2, D)), {}),  # GQA kv needs [T, H_kv, K]
        ("topk_length", {}, dict(topk_length=torch.zeros(T + 1, dtype=torch.int32))),
        ("sink", {}, dict(sink=torch.zeros(H + 1))),
    ],
)
def test_sparse_mismatched_shapes_packed(arg, over, kw):
    with pytest.raises(ValueError, match=arg):
        sa(**sparse_inputs(**over), **kw)


@pytest.mark.parametrize(
    "arg,over,kw",
    [
        ("kv", dict(kv=torch.randn(3, N, D)), {}),  # batch size differs from q's 2
        ("indices", dict(indices=torch.zeros(2, 4, K, dtype=torch.int32)), {}),  # S differs
        ("indices", dict(indices=torch.zeros(3, 2, K, dtype=torch.int32)), {}),  # B differs
        ("topk_length", {}, dict(topk_length=torch.zeros(2 * 2, dtype=torch.int32))),  # needs [B, S]
    ],
)
def test_sparse_mismatched_shapes_batched(arg, over, kw):
    g = _gen()
    base = dict(
        q=torch.randn(2, 2, H, D, generator=g),
        kv=torch.randn(2, N, D, generator=g),
        indices=torch.zeros(2, 2, K, dtype=torch.int32),
    )
    base.update(over)
    with pytest.raises(ValueError, match=arg):
        sa(**base, **kw)


def test_sparse_heads_not_divisible():
    with pytest.raises(ValueError, match=r"kv|H_kv|head"):
        sa(**sparse_inputs(kv=torch.randn(N, 3, D), indices=torch.zeros(T, 3, K, dtype=torch.int32)))


def test_sparse_d_v_larger_than_D():
    with pytest.raises(ValueError, match="d_v"):
        sa(**sparse_inputs(), d_v=D + 1)
    with pytest.raises(ValueError, match="d_v"):
        sa(**sparse_inputs(), d_v=0)


# --------------------------------------------------------------------------
# sparse_attention: dtypes, devices, types


def test_sparse_mismatched_dtypes():
    with pytest.raises(ValueError, match="kv"):
        sa(**sparse_inputs(kv=torch.randn(N, D).half()))
    with pytest.raises(ValueError, match="kv"):
        sa(**sparse_inputs(q=torch.randn(T, H, D).half()))


@pytest.mark.parametrize(
    "arg,value",
    [
        ("q", [[[0.0] * D] * H] * T),  # a list
        ("q", torch.zeros(T, H, D, dtype=torch.int32)),  # not floating point
        ("kv", torch.zeros(N, D, dtype=torch.int64)),
        ("indices", torch.zeros(T, K)),  # float indices
        ("indices", [[0] * K] * T),
    ],
)
def test_sparse_wrong_types(arg, value):
    with pytest.raises(TypeError, match=arg):
        sa(**sparse_inputs(**{arg: value}))


@pytest.mark.parametrize(
    "arg,value",
    [
        ("topk_length", torch.zeros(T)),  # float lengths
        ("topk_length", [1] * T),  # a list
        ("sink", [0.0] * H),
        ("sink", torch.zeros(H, dtype=torch.int32)),
    ],
)
def test_sparse_wrong_types_keywords(arg, value):
    with pytest.raises(TypeError, match=arg):
        sa(**sparse_inputs(), **{arg: value})


def test_sparse_wrong_types_scalars():
    with pytest.raises(TypeError, match="d_v"):
        sa(**sparse_inputs(), d_v=16.0)
    with pytest.raises(TypeError, match="sm_scale"):
        sa(**sparse_inputs(), sm_scale="0.5")


def _not_dense(kind, x):
    if kind == "nested":
        return torch.nested.nested_tensor(list(x))
    return x.to_sparse() if kind == "coo" else x.to_sparse_csr()


@pytest.mark.filterwarnings("ignore:.*(CSR|nested).*:UserWarning")  # torch's notes on beta / prototype layouts
@pytest.mark.parametrize("kind", ["coo", "csr", "nested"])
@pytest.mark.parametrize("arg", ["q", "kv", "indices", "sink", "topk_length"])
def test_not_dense_tensors_raise_type_error(arg, kind):
    """A sparse or nested tensor is refused by name (the kernels address elements by strides), on every op
    that takes it, and explain() says the same."""
    base = sparse_inputs()
    kw = dict(sink=torch.zeros(H), topk_length=torch.full((T,), 3, dtype=torch.int32))
    value = {**base, **kw}[arg]
    if kind == "csr" and value.dim() != 2:
        value = value.reshape(value.shape[0], -1)  # CSR is 2-d: the layout is refused before the shape
    bad = _not_dense(kind, value)
    call = {**base, **kw, arg: bad}
    want = r"dense \(strided\) tensor, got " + ("a nested tensor" if kind == "nested" else "layout sparse_")
    with pytest.raises(TypeError, match=f"^{arg}: expected a {want}"):
        sa(**call)
    dsa.sparse_decode(base["q"], base["kv"], base["indices"], backend="reference", **kw)  # kept: the dense call
    decode_arg = "kv_cache" if arg == "kv" else arg
    with pytest.raises(TypeError, match=f"^{decode_arg}: expected a {want}"):
        dsa.sparse_decode(call["q"], call["kv"], call["indices"], backend="reference",
                          sink=call["sink"], topk_length=call["topk_length"])
    # the Triton plan's lean path (a kept tensor test after its first call) where it runs
    plan = dsa.sparse_decode_plan(base["q"], base["kv"], base["indices"], backend=PLAN_BACKEND, **kw)
    plan(base["q"], base["kv"], base["indices"], **kw)
    with pytest.raises(TypeError, match=f"^{decode_arg}: expected a {want}"):
        plan(call["q"], call["kv"], call["indices"], sink=call["sink"], topk_length=call["topk_length"])
    if arg == "q":
        with pytest.raises(TypeError, match=f"^out: expected a {want}"):
            plan(base["q"], base["kv"], base["indices"], **kw, out=_not_dense(kind, torch.zeros(T, H * D).reshape(
                (T, H * D) if kind == "csr" else (T, H, D))))
    with pytest.raises(TypeError, match=f"^{arg}: expected a {want}"):
        dsa.explain("sparse_attention", **{**base, **kw, arg: bad})
    if arg in ("q", "kv"):
        scores_args = dict(q=base["q"], k=base["kv"], weights=torch.ones(T, H))
        name = "k" if arg == "kv" else arg
        with pytest.raises(TypeError, match=f"^{name}: expected a {want}"):
            dsa.indexer_scores(**{**scores_args, name: bad}, backend="reference")
    with pytest.raises(TypeError, match=f"^scores: expected a {want}"):
        dsa.topk_indices(_not_dense(kind, torch.randn(T, N)), 3, backend="reference")


@pytest.mark.filterwarnings("ignore:.*(CSR|nested).*:UserWarning")
@pytest.mark.parametrize("kind", ["coo", "csr", "nested"])
def test_not_dense_caches_raise_type_error(kind):
    """The KV-cache quantiser and dequantiser refuse sparse and nested tensors by name too."""
    kv = torch.randn(2, 4, 576, generator=_gen())
    bad_kv = _not_dense(kind, kv.reshape(2, -1) if kind == "csr" else kv)
    with pytest.raises(TypeError, match="^kv: expected a dense"):
        dsa.quantize_kv_cache(bad_kv, "fp8_v32")
    cache = dsa.quantize_kv_cache(kv, "fp8_v32")
    bad_cache = _not_dense(kind, cache.reshape(2, -1) if kind == "csr" else cache)
    with pytest.raises(TypeError, match="^kv_cache: expected a dense"):
        dsa.dequantize_kv_cache(bad_cache, "fp8_v32")


@pytest.mark.parametrize("arg", ["kv", "indices", "sink", "topk_length"])
def test_sparse_mismatched_devices(arg):
    meta = "meta"
    inputs = sparse_inputs()
    kw = {}
    if arg in ("kv", "indices"):
        inputs[arg] = inputs[arg].to(meta)
    elif arg == "sink":
        kw["sink"] = torch.zeros(H, device=meta)
    else:
        kw["topk_length"] = torch.zeros(T, dtype=torch.int32, device=meta)
    with pytest.raises(ValueError, match=arg):
        sa(**inputs, **kw)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        dsa.sparse_attention(**sparse_inputs(), backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        dsa.topk_indices(torch.zeros(2, 3), 1, backend="nope")
    g = _gen()
    with pytest.raises(ValueError, match="backend"):
        dsa.indexer_scores(torch.randn(1, 2, 2, 8, generator=g), torch.randn(1, 3, 8, generator=g),
                           torch.randn(1, 2, 2, generator=g), backend="Reference")


# --------------------------------------------------------------------------
# indexer


def indexer_inputs(**over):
    g = _gen()
    base = dict(
        q=torch.randn(2, 3, 2, 16, generator=g),
        k=torch.randn(2, 5, 16, generator=g),
        weights=torch.randn(2, 3, 2, generator=g),
    )
    base.update(over)
    return base


def packed_indexer_inputs(**over):
    g = _gen()
    base = dict(
        q=torch.randn(5, 2, 16, generator=g),
        k=torch.randn(7, 16, generator=g),
        weights=torch.randn(5, 2, generator=g),
        cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 3, 7], dtype=torch.int32),
        max_seqlen_k=4,
    )
    base.update(over)
    return base


def ix(**kw):
    return dsa.indexer_scores(backend="reference", **kw)


def test_indexer_valid_baselines_run():
    assert torch.isfinite(ix(**indexer_inputs(), causal=False)).all()
    assert ix(**packed_indexer_inputs()).shape == (5, 4)


@pytest.mark.parametrize(
    "arg,over",
    [
        ("q", dict(q=torch.randn(6, 32))),
        ("k", dict(k=torch.randn(2, 5, 2, 16))),  # more than one key head
        ("k", dict(k=torch.randn(80))),
        ("k", dict(k=torch.randn(2, 5, 8))),  # head dim differs from q
        ("k", dict(k=torch.randn(3, 5, 16))),  # batch differs
        ("weights", dict(weights=torch.randn(2, 3, 3))),
        ("weights", dict(weights=torch.randn(2, 3))),
    ],
)
def test_indexer_wrong_rank_or_shape(arg, over):
    with pytest.raises(ValueError, match=arg):
        ix(**indexer_inputs(**over))


def test_indexer_dtypes_types_devices():
    with pytest.raises(ValueError, match=r"\bk\b"):
        ix(**indexer_inputs(k=torch.randn(2, 5, 16).half()))
    with pytest.raises(TypeError, match="q"):
        ix(**indexer_inputs(q=[1.0, 2.0]))
    with pytest.raises(TypeError, match="weights"):
        ix(**indexer_inputs(weights=torch.zeros(2, 3, 2, dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"\bk\b"):
        ix(**indexer_inputs(k=torch.randn(2, 5, 16, device="meta")))
    with pytest.raises(ValueError, match="weights"):
        ix(**indexer_inputs(weights=torch.randn(2, 3, 2, device="meta")))
    with pytest.raises(TypeError, match="q_offsets"):
        ix(**indexer_inputs(), q_offsets=torch.zeros(2))
    with pytest.raises(ValueError, match="q_offsets"):
        ix(**indexer_inputs(), q_offsets=torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("ratio", [0, -1])
def test_indexer_ratio_below_one(ratio):
    with pytest.raises(ValueError, match="ratio"):
        ix(**indexer_inputs(), ratio=ratio)
    with pytest.raises(ValueError, match="ratio"):
        dsa.indexer_topk(**indexer_inputs(), topk=2, ratio=ratio, backend="reference")


def test_indexer_ratio_wrong_type():
    with pytest.raises(TypeError, match="ratio"):
        ix(**indexer_inputs(), ratio=2.0)


@pytest.mark.parametrize(
    "arg,over",
    [
        ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 4, 2, 5], dtype=torch.int32),
                              cu_seqlens_k=torch.tensor([0, 3, 5, 7], dtype=torch.int32))),  # not monotone
        ("cu_seqlens_k", dict(cu_seqlens_k=torch.tensor([0, 5, 3, 7], dtype=torch.int32),
                              cu_seqlens_q=torch.tensor([0, 2, 3, 5], dtype=torch.int32))),
        ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 2, 6], dtype=torch.int32))),  # ends past T_q
        ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32))),  # ends before T_q
        ("cu_seqlens_k", dict(cu_seqlens_k=torch.tensor([0, 3, 8], dtype=torch.int32))),
        ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([1, 2, 5], dtype=torch.int32))),  # not from 0
        ("cu_seqlens", dict(cu_seqlens_k=torch.tensor([0, 3, 5, 7], dtype=torch.int32))),  # B differs
        ("max_seqlen_k", dict(max_seqlen_k=3)),  # shorter than a key sequence (4)
    ],
)
def test_indexer_bad_cu_seqlens(arg, over):
    with pytest.raises(ValueError, match=arg):
        ix(**packed_indexer_inputs(**over))


def test_indexer_cu_seqlens_wrong_type():
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        ix(**packed_indexer_inputs(cu_seqlens_q=torch.tensor([0.0, 2.0, 5.0])))


def test_indexer_packed_q_offsets_shape():
    with pytest.raises(ValueError, match="q_offsets"):
        ix(**packed_indexer_inputs(), q_offsets=torch.zeros(3, dtype=torch.int32))


# --------------------------------------------------------------------------
# top-k


def test_topk_negative_k():
    with pytest.raises(ValueError, match=r"\bk\b"):
        dsa.topk_indices(torch.zeros(2, 3), -1, backend="reference")
    with pytest.raises(ValueError, match="topk"):
        dsa.indexer_topk(**indexer_inputs(), topk=-2, backend="reference")


def test_topk_wrong_types():
    with pytest.raises(TypeError, match="scores"):
        dsa.topk_indices([[1.0, 2.0]], 1, backend="reference")
    with pytest.raises(TypeError, match="scores"):
        dsa.topk_indices(torch.zeros(2, 3, dtype=torch.int32), 1, backend="reference")
    with pytest.raises(TypeError, match=r"\bk\b"):
        dsa.topk_indices(torch.zeros(2, 3), 1.5, backend="reference")
    with pytest.raises(TypeError, match="topk"):
        dsa.indexer_topk(**indexer_inputs(), topk=2.0, backend="reference")


def test_topk_zero_dim_scores():
    with pytest.raises(ValueError, match="scores"):
        dsa.topk_indices(torch.tensor(1.0), 1, backend="reference")


def test_errors_are_not_asserts():
    """User-input checks survive python -O: they are raised, never `assert`ed."""
    import inspect

    import dsa._checks
    import dsa.api

    for module in (dsa._checks, dsa.api):
        assert "assert " not in inspect.getsource(module), module.__name__


def test_kernel_dtype_reason_names_each_dtype():
    """The dtypes the kernels read directly, stated once for the cute and Triton supports()."""
    from dsa._args import SparseAttnArgs

    q, kv = torch.zeros(2, 4, 16), torch.zeros(8, 1, 16)
    idx, length, sink = torch.zeros(2, 1, 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), torch.zeros(4)
    ok = SparseAttnArgs(q, kv, idx, length, sink, 1.0, 16)
    assert ok.kernel_dtype_reason() is None
    cases = {"indices": {"indices": idx.long()}, "topk_length": {"topk_length": length.long()},
             "sink": {"sink": sink.half()}}
    for name, change in cases.items():
        why = dataclasses.replace(ok, **change).kernel_dtype_reason()
        assert why is not None and why.startswith(name), why
