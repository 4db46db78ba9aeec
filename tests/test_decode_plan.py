"""dsa.sparse_decode_plan and the kept checks of dsa.sparse_decode (docs/semantics.md,
"Host time, CUDA graphs and plans").

A plan's call is bitwise the function's on every CPU backend (the reference,
and the Triton kernels under the interpreter in fp32 and fp16), with new
values and another layer's cache each call; a call whose tensors are not the
plan's shape, dtype, device or cache layout raises ValueError naming the
argument; eager calls skip the dispatcher and anything it must see goes
through it. The GPU side (no host sync, CUDA graph capture) is in
tests/test_host_sync.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import bruteforce as bf
import dsa
from dsa import _checks, ops
from dsa import decode as decode_mod
from dsa.ops import decode as decode_op
from conftest import CUDA, TRITON_IMPORTABLE

BACKENDS = [("reference", torch.float32)] + (
    [("triton", torch.float32), ("triton", torch.float16)] if TRITON_IMPORTABLE and not CUDA else [])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fp8_step(gen, dtype, B=2, S=1, H=2, P=5, PS=4, K=10, W=3, fmt="fp8_v32"):
    """One decode step on an FP8 cache with a block table: (q, cache, indices, keywords)."""
    D = {"fp8_v32": 576, "fp8_model1": 512}[fmt]
    cache = dsa.quantize_kv_cache(torch.randn(P, PS, D, generator=gen), fmt)
    q = torch.randn(B, S, H, D, generator=gen).to(dtype)
    idx = torch.randint(-1, W * PS + 1, (B, S, K), generator=gen).int()
    kw = dict(block_table=torch.randint(-1, P, (B, W), generator=gen).int(),
              seq_lens=torch.randint(0, W * PS + 1, (B,), generator=gen).int(),
              topk_length=torch.randint(0, K + 1, (B,), generator=gen).int(),
              sink=torch.randn(H, generator=gen))
    return q, cache, idx, kw


def native_step(gen, dtype, T=3, H=4, G=2, D=32, P=6, PS=4, K=9):
    """Packed q against a paged native cache with 2 kv heads, global slots, int64 indices."""
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    cache = torch.randn(P, PS, G, D, generator=gen).to(dtype)
    idx = torch.randint(-2, P * PS + 2, (T, G, K), generator=gen)
    return q, cache, idx, dict(topk_length=torch.randint(0, K + 1, (T,), generator=gen).int())


def _same(a, b):
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("backend,dtype", BACKENDS)
def test_plan_is_bitwise_the_function(backend, dtype):
    """Two steps on the FP8 cache with a block table (new values and another layer's cache in the
    second, outputs given in it), then a packed native call with int64 indices."""
    gen = _gen(1)
    q, cache, idx, kw = fp8_step(gen, dtype)
    plan = dsa.sparse_decode_plan(q, cache, idx, **kw, d_v=512, return_lse=True, backend=backend)
    assert plan.backend == backend and f"backend '{backend}'" in plan.explain()
    _same(plan(q, cache, idx, **kw), dsa.sparse_decode(q, cache, idx, **kw, return_lse=True, backend=backend))

    q2, cache2, idx2, kw2 = fp8_step(_gen(2), dtype)  # the next layer, or the next step
    out, lse = torch.full((2, 1, 2, 512), float("nan"), dtype=dtype), torch.empty(2, 1, 2)
    got = plan(q2, cache2, idx2, **kw2, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    exp = dsa.sparse_decode(q2, cache2, idx2, **kw2, return_lse=True, backend=backend)
    _same(got, exp)
    ref = bf.sparse_decode(q2.double(), cache2, idx2, cache_format="fp8_v32", **kw2)
    bf.assert_close(out, ref["out"], dtype, "out")

    q, cache, idx, kw = native_step(_gen(3), dtype)
    plan = dsa.sparse_decode_plan(q, cache, idx, **kw, d_v=16, sm_scale=0.25, backend=backend)
    _same([plan(q, cache, idx, **kw)], [dsa.sparse_decode(q, cache, idx, **kw, d_v=16, sm_scale=0.25,
                                                          backend=backend)])


def test_plan_empty_call_and_lse_scratch():
    """An empty plan (no slots) answers out 0 and lse +inf; without return_lse the plan returns out alone."""
    gen = _gen(4)
    q, cache, idx, kw = fp8_step(gen, torch.float32, K=0)
    plan = dsa.sparse_decode_plan(q, cache, idx, **kw, return_lse=True, backend="reference")
    out, lse = plan(q, cache, idx, **kw)
    assert (out == 0).all() and torch.isposinf(lse).all()
    plan = dsa.sparse_decode_plan(q, cache, idx, **kw, backend="reference")
    assert isinstance(plan(q, cache, idx, **kw), torch.Tensor)


def _bad(name):
    return pytest.raises(ValueError, match=f"^{name}: ")


def test_plan_misuse_raises_with_the_argument_named():
    gen = _gen(5)
    q, cache, idx, kw = fp8_step(gen, torch.float32)
    plan = dsa.sparse_decode_plan(q, cache, idx, **kw, backend="reference")
    with _bad("q"):
        plan(q[:1], cache, idx, **kw)  # another batch size
    with _bad("q"):
        plan(q.double(), cache, idx, **kw)
    with _bad("indices"):
        plan(q, cache, idx.long(), **kw)
    with _bad("indices"):
        plan(q, cache, idx.to("meta"), **kw)  # another device
    with _bad("kv_cache"):
        plan(q, cache.view(torch.float8_e4m3fn), idx, **kw)
    with _bad("kv_cache"):  # the same shape with padded pages: another layout
        padded = torch.empty(cache.shape[0], cache[0].numel() + 16, dtype=torch.uint8)[:, :cache[0].numel()]
        plan(q, padded.view(cache.shape), idx, **kw)
    with _bad("kv_cache"):
        plan(q, cache[:, None], idx, **kw)
    with _bad("block_table"):
        plan(q, cache, idx, **dict(kw, block_table=None))
    with _bad("seq_lens"):
        plan(q, cache, idx, **dict(kw, seq_lens=kw["seq_lens"][:1]))
    with _bad("sink"):
        plan(q, cache, idx, **dict(kw, sink=kw["sink"].double()))
    with pytest.raises(TypeError, match="^topk_length: "):
        plan(q, cache, idx, **dict(kw, topk_length=[3, 4]))
    with _bad("out"):
        plan(q, cache, idx, **kw, out=torch.empty(2, 1, 2, 512, dtype=torch.float16))
    with _bad("out"):
        plan(q, cache, idx, **kw, out=torch.empty(2, 1, 512, 2).transpose(-1, -2))
    with _bad("lse"):
        plan(q, cache, idx, **kw, lse=torch.empty(2, 2))
    bare = dsa.sparse_decode_plan(q, cache, idx, backend="reference")
    with _bad("block_table"):
        bare(q, cache, idx, block_table=kw["block_table"])
    # the plan's checks are the function's
    with _bad("d_v"):
        dsa.sparse_decode_plan(q, cache, idx, **kw, d_v=600)
    with pytest.raises(ValueError, match="^backend 'triton' cannot run sparse_decode: .*scale tiles"):
        dsa.sparse_decode_plan(q, cache, idx, **kw, d_v=64, backend="triton")
    # a native cache whose rows are not contiguous would be copied every call
    kv = torch.randn(4, 32, 4).transpose(1, 2)[:, :, None]  # [pages 4, 4 tokens, 1 head, 32] with strided rows
    with pytest.raises(ValueError, match="^kv_cache: each row"):
        dsa.sparse_decode_plan(torch.randn(2, 1, 2, 32), kv, torch.zeros(2, 1, 3, dtype=torch.int32))


def test_plan_eager_skips_the_dispatcher_and_autograd_goes_through_it(monkeypatch):
    gen = _gen(6)
    q, cache, idx, kw = fp8_step(gen, torch.float32)
    plan = dsa.sparse_decode_plan(q, cache, idx, **kw, backend="reference")
    calls = []
    through = ops.sparse_decode.op
    monkeypatch.setattr(ops.sparse_decode, "op", lambda *a: calls.append(1) or through(*a))
    out = plan(q, cache, idx, **kw)
    assert calls == []
    qg = q.clone().requires_grad_()
    with torch.no_grad():
        plan(qg, cache, idx, **kw)
    assert calls == []
    via_op = plan(qg, cache, idx, **kw)  # grad mode on and an input requiring grad: the dispatcher's call
    assert calls == [1] and torch.equal(via_op, out)


@pytest.mark.skipif(not TRITON_IMPORTABLE or CUDA, reason="the Triton decode under the interpreter (CPU)")
def test_plan_lean_call_and_what_it_leaves_to_the_general_path(monkeypatch):
    """A plain eager call of a plan with prepared launches launches them on the tensors as given (no
    canonical views); a call with anything more (a strided input, int64 integers, a misfit) takes the
    general path, with the same result or the same error."""
    gen = _gen(10)
    q, cache, idx, kw = fp8_step(gen, torch.float32)
    plan = dsa.sparse_decode_plan(q, cache, idx, **kw, backend="triton")
    rows = []
    general = _checks.DecodeForm.rows
    monkeypatch.setattr(_checks.DecodeForm, "rows", lambda *a, **k: rows.append(1) or general(*a, **k))
    exp = dsa.sparse_decode(q, cache, idx, **kw, backend="triton")
    rows.clear()
    out = torch.full_like(exp, float("nan"))
    assert plan(q, cache, idx, **kw, out=out) is out and rows == []
    _same([out], [exp])
    # the same values with strided rows: the general path makes them contiguous
    q_strided = torch.empty(q.shape[:-1] + (2 * q.shape[-1],))[..., ::2]
    q_strided.copy_(q)
    _same([plan(q_strided, cache, idx, **kw)], [exp])
    assert rows == [1]
    seq_strided = torch.empty(2 * kw["seq_lens"].numel(), dtype=torch.int32)[::2]
    seq_strided.copy_(kw["seq_lens"])
    _same([plan(q, cache, idx, **dict(kw, seq_lens=seq_strided))], [exp])
    assert rows == [1, 1]
    with _bad("q"):
        plan(q[:1], cache, idx, **kw)
    with _bad("indices"):  # another device that is not CUDA either
        plan(q, cache, idx.to("meta"), **kw)
    with _bad("out"):
        plan(q, cache, idx, **kw, out=torch.empty(2, 1, 512, 2).transpose(-1, -2))
    with _bad("sink"):
        plan(q, cache, idx, **dict(kw, sink=None))
    # under a dispatch mode the call is the op's, which the mode sees
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen() as mode:
        got = plan(q, cache, idx, **kw)
    assert "dsa.sparse_decode.default" in mode.ops
    _same([got], [exp])
    # int64 indices need a conversion every call: every call of such a plan takes the general path
    wide = dsa.sparse_decode_plan(q, cache, idx.long(), **kw, backend="triton")
    rows.clear()
    _same([wide(q, cache, idx.long(), **kw)], [exp])
    assert rows == [1]


@pytest.mark.skipif(not TRITON_IMPORTABLE or CUDA, reason="the Triton decode under the interpreter (CPU)")
@pytest.mark.filterwarnings("ignore:.*nested.*:UserWarning")  # torch's note on the prototype layout
@pytest.mark.parametrize("with_guards", [True, False])
def test_plan_repeat_calls_take_the_kept_tensor_test(monkeypatch, with_guards):
    """After a lean call, a call with the same arguments absent is tested in one C++ call against that
    call's tensors; whatever it rejects (a misfit, another mode's tensors, a tensor requiring grad, a
    negative view) is tested by the Python tests as before, with the same result or error. Without the
    C++ test (an older torch) the Python tests serve alone."""
    if not with_guards:
        monkeypatch.setattr(decode_mod, "_TensorGuards", None)
    elif decode_mod._TensorGuards is None:
        pytest.skip("torch has no TensorGuards")
    gen = _gen(12)
    q, cache, idx, kw = fp8_step(gen, torch.float32)
    plan = dsa.sparse_decode_plan(q, cache, idx, **kw, backend="triton")
    tested = []
    lean_ok = decode_mod.SparseDecodePlan._lean_ok
    monkeypatch.setattr(decode_mod.SparseDecodePlan, "_lean_ok",
                        lambda self, *a: tested.append(1) or lean_ok(self, *a))
    exp = dsa.sparse_decode(q, cache, idx, **kw, backend="triton")
    out = torch.full_like(exp, float("nan"))
    for _ in range(3):  # new values every call: the launches read the call's tensors
        out.fill_(float("nan"))
        assert plan(q, cache, idx, **kw, out=out) is out
        _same([out], [exp])
    assert len(tested) == (1 if with_guards else 3)
    _same([plan(q, cache, idx, **kw)], [exp])  # out absent: another pattern, tested once more
    q2 = torch.randn(q.shape, generator=gen)
    _same([plan(q2, cache, idx, **kw, out=out)], [dsa.sparse_decode(q2, cache, idx, **kw, backend="triton")])
    n = len(tested)
    with _bad("q"):
        plan(q[:1], cache, idx, **kw, out=out)
    with _bad("seq_lens"):
        plan(q, cache, idx, **dict(kw, seq_lens=kw["seq_lens"].long()), out=out)
    assert len(tested) == n + 2
    with pytest.raises(TypeError, match="^indices: expected a torch.Tensor, got list"):
        plan(q, cache, idx.tolist(), **kw, out=out)
    with pytest.raises(TypeError, match="^q: expected a dense"):
        plan(torch.nested.nested_tensor(list(q)), cache, idx, **kw, out=out)
    n = len(tested)
    with torch.inference_mode():  # other dispatch keys: the Python tests, then a test of this mode's tensors
        qi, idxi = q.clone(), idx.clone()
        for _ in range(2):
            _same([plan(qi, cache, idxi, **kw, out=out)], [exp])
    assert len(tested) == n + (1 if with_guards else 2)
    # grad mode on and q requiring grad: never the launches, whatever was kept
    calls = []
    through = ops.sparse_decode.op
    monkeypatch.setattr(ops.sparse_decode, "op", lambda *a: calls.append(1) or through(*a))
    qg = q.clone().requires_grad_()
    _same([plan(qg, cache, idx, **kw).detach()], [exp])
    assert calls == [1]
    with torch.no_grad():
        _same([plan(qg, cache, idx, **kw, out=out)], [exp])
    assert calls == [1]
    # a negative view of an input or an output is never read or written as stored
    neg_q = torch._neg_view(-q)
    assert neg_q.is_neg()
    _same([plan(neg_q, cache, idx, **kw)], [exp])
    neg_out = torch._neg_view(torch.full_like(exp, float("nan")))
    plan(q, cache, idx, **kw, out=neg_out)
    _same([neg_out.resolve_neg()], [exp])
    flipped = kw["block_table"].neg()
    _same([plan(q, cache, idx, **dict(kw, block_table=torch._neg_view(flipped)))], [exp])


def test_compiled_plan_goes_through_the_op():
    torch._dynamo.reset()
    gen = _gen(7)
    q = torch.randn(2, 1, 2, 32, generator=gen)
    kv = torch.randn(3, 4, 1, 32, generator=gen)
    idx = torch.randint(-1, 8, (2, 1, 5), generator=gen).int()
    bt = torch.tensor([[2, 0], [1, -1]], dtype=torch.int32)
    plan = dsa.sparse_decode_plan(q, kv, idx, block_table=bt, d_v=16, return_lse=True, backend="reference")
    try:
        compiled = torch.compile(lambda *a: plan(*a[:3], block_table=a[3]), fullgraph=True)(q, kv, idx, bt)
    finally:
        torch._dynamo.reset()
    _same(compiled, plan(q, kv, idx, block_table=bt))


# --------------------------------------------------------------------------
# the function's kept checks


def test_kept_checks_are_keyed_by_what_they_read(monkeypatch):
    """A repeated call skips the checks; a call differing in any metadata they read is checked
    afresh (and fails where the checks fail); arguments with no cheap key are always checked."""
    gen = _gen(8)
    q, cache, idx, kw = fp8_step(gen, torch.float32)
    checked = []
    form = _checks.sparse_decode_form
    monkeypatch.setattr(_checks, "sparse_decode_form", lambda *a: checked.append(1) or form(*a))
    monkeypatch.setattr(decode_mod, "_KNOWN", {})
    first = dsa.sparse_decode(q, cache, idx, **kw, backend="reference")
    again = dsa.sparse_decode(q + 1, cache.clone(), idx, **kw, backend="reference")
    assert len(checked) == 1 and not torch.equal(first, again)
    with _bad("d_v"):
        dsa.sparse_decode(q, cache, idx, **kw, d_v=600, backend="reference")
    # the tokens' bytes strided: only the strides differ, and the checks say so
    bad = torch.empty(cache.shape[0], cache.shape[1], 2 * cache.shape[2], dtype=torch.uint8)[:, :, ::2]
    with pytest.raises(ValueError, match="^kv_cache: the 656 bytes of each token .* must be contiguous"):
        dsa.sparse_decode(q, bad, idx, **kw, backend="reference")
    with _bad("sink"):
        dsa.sparse_decode(q, cache, idx, **dict(kw, sink=torch.zeros(3)), backend="reference")
    n = len(checked)
    for scale in (np.float32(0.5), torch.tensor(0.5)):  # no cheap key: checked each time
        dsa.sparse_decode(q, cache, idx, **kw, sm_scale=scale, backend="reference")
    with pytest.raises(TypeError, match="^d_v: "):
        dsa.sparse_decode(q, cache, idx, **kw, d_v=True, backend="reference")
    assert len(checked) == n + 3
    assert _checks.decode_key(q, cache, idx, *(kw[k] for k in ("block_table", "seq_lens", "topk_length", "sink")),
                              2, None, None) == _checks.decode_key(
        q, cache, idx, *(kw[k] for k in ("block_table", "seq_lens", "topk_length", "sink")), 2.0, None, None)


def test_kept_shape_key_is_the_computed_one():
    gen = _gen(9)
    q, cache, idx, kw = native_step(gen, torch.float32)
    dsa.sparse_decode(q, cache, idx, **kw, backend="reference")
    key = _checks.decode_key(q, cache, idx, None, None, kw["topk_length"], None, None, None, None)
    a, _ = _checks.sparse_decode_args(q, cache, idx, None, None, kw["topk_length"], None, None, None, None)
    assert decode_mod._KNOWN[key].shape_key == a.shape_key
    assert decode_op.choice(a, "reference").backend == "reference"


# --------------------------------------------------------------------------
# GPU: the model shapes, the direct launches


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["native", "fp8_v32", "fp8_model1"])
@pytest.mark.parametrize("B,H", [(1, 128), (32, 128), (128, 64)])
def test_plan_on_gpu_is_bitwise_the_function(fmt, B, H):
    """K 2048 through a block table (split at B1 and B32), every call launched by Triton's C launcher
    alone once compiled; another layer's cache in the second call."""
    from dsa.triton import decode as tdecode

    D = {"fp8_model1": 512}.get(fmt, 576)
    g = torch.Generator(device="cuda").manual_seed(B)
    P, PS, W, K = 4 * B + 8, 64, 4, 2048

    def cache():
        kv = torch.randn(P, PS, D, device="cuda", generator=g)
        return dsa.quantize_kv_cache(kv, fmt) if fmt != "native" else kv.bfloat16()[:, :, None]

    caches = [cache(), cache()]
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.randint(-1, W * PS, (B, 1, K), device="cuda", generator=g).int()
    kw = dict(block_table=torch.randperm(P, device="cuda", generator=g)[: B * W].view(B, W).int(),
              topk_length=torch.randint(0, K + 1, (B,), device="cuda", generator=g).int(),
              sink=torch.randn(H, device="cuda", generator=g))
    plan = dsa.sparse_decode_plan(q, caches[0], pos, **kw, return_lse=True, backend="triton")
    for c in caches + caches:
        _same(plan(q, c, pos, **kw), dsa.sparse_decode(q, c, pos, **kw, return_lse=True, backend="triton"))
    assert all(run is not None for _, _, run in tdecode._DECODE._compiled.values())


@pytest.mark.skipif(CUDA or not TRITON_IMPORTABLE, reason="the CPU run of the bench (Triton's launches stubbed)")
def test_decode_host_bench_runs_on_cpu(tmp_path):
    """bench/decode_host.py measures every path on CPU and leaves the launchers as it found them."""
    import json

    from bench import decode_host
    from dsa.triton import decode as tdecode

    before = (tdecode._DECODE.fn, tdecode.sm_count)
    res = decode_host.main(["--formats", "fp8_v32", "--batches", "1", "--heads", "64", "--calls", "3", "--reps", "1",
                            "--out", str(tmp_path)])
    (row,) = res["rows"]
    assert res["stubbed"] and row["backend"] == "triton" and row["splits"] > 1  # 132 SMs: split, merged
    assert all(row[f"{p}_us"] > 0 for p in ("function", "plan", "plan_out", "launches"))
    assert json.loads((tmp_path / "decode_host.json").read_text())["rows"][0]["B"] == 1
    assert (tdecode._DECODE.fn, tdecode.sm_count) == before
