"""sparse_decode against the float64 brute force: every rule of the "Sparse decode"
section of docs/semantics.md, on every backend: flat and paged native caches,
block tables, both FP8 layouts, the quantiser, the split path and its merge.

Sizes stay tiny for the Triton interpreter; the FP8 rows are the formats'
own (D = 576 / 512). On CPU the interpreter is taken to have 8 SMs, so these
few rows run split over several programs and merged.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import bruteforce as bf
from gpu_checks import assert_replays_without_sync
import dsa
from dsa import _checks
from dsa.triton import decode as tdecode

INF = float("inf")
FP8 = {"fp8_v32": 576, "fp8_model1": 512}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(shape, case, gen, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(case.dtype).to(case.device)


def ints(values, device, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def fp8_cache(fmt, P, PS, gen, device, pad=0) -> torch.Tensor:
    """A quantised cache of P pages; with ``pad``, each page is followed by ``pad`` bytes of NaN (0x7F)
    in memory: the page stride is past the page's bytes, and nothing there may be read."""
    cache = dsa.quantize_kv_cache(torch.randn(P, PS, FP8[fmt], generator=gen) * 2, fmt).to(device)
    if pad:  # on the device: a copy there would be contiguous
        page = cache[0].numel()
        buf = torch.full((P, page + pad), 0x7F, dtype=torch.uint8, device=device)
        buf[:, :page] = cache.view(P, page)
        cache = buf[:, :page].view(P, PS, -1)
    return cache


def run_and_check(call, case, q, cache, idx, cache_format="native", **kw):
    out, lse = call(dsa.sparse_decode, q, cache, idx, return_lse=True, backend=case.backend, **kw)
    assert out.dtype == q.dtype and lse.dtype in (torch.float32, torch.float64)
    exp = bf.sparse_decode(q, cache, idx, cache_format=cache_format, **kw)
    bf.assert_close(out, exp["out"], case.dtype, "out")
    bf.assert_close(lse, exp["lse"], max(case.dtype, torch.float32, key=lambda d: torch.finfo(d).bits), "lse")
    return out, lse, exp


# --------------------------------------------------------------------------
# layouts


@pytest.mark.parametrize("batched", [True, False])
def test_flat_native_cache(case, call, batched):
    gen = _gen(1)
    B, S, H, D, N, K = 2, 2, 3, 32, 40, 24
    lead = (B, S) if batched else (B * S,)
    q = rand((*lead, H, D), case, gen)
    kv = rand((N, D), case, gen)
    idx = torch.randint(-3, N + 3, (*lead, K), generator=gen).int().to(case.device)
    tl = ints([[24, 9], [0, 17]] if batched else [24, 9, 0, 17], case.device)
    run_and_check(call, case, q, kv, idx, d_v=16, topk_length=tl, sink=rand((H,), case, gen).float())


def test_paged_native_gqa(case, call):
    gen = _gen(2)
    B, S, H, G, D, P, PS, K = 2, 1, 4, 2, 32, 5, 4, 12
    q = rand((B, S, H, D), case, gen)
    kv = rand((P, PS, G, D), case, gen)
    idx = torch.randint(-2, P * PS + 2, (B, S, G, K), generator=gen).int().to(case.device)
    run_and_check(call, case, q, kv, idx, d_v=32, sm_scale=0.3)


def test_block_table(case, call):
    """Logical positions through a block table: -1 and out-of-range pages, positions past
    seq_lens or past the table, per-sequence topk_length."""
    gen = _gen(3)
    B, S, H, D, P, PS, K = 3, 2, 2, 32, 6, 4, 14
    q = rand((B, S, H, D), case, gen)
    kv = rand((P, PS, 1, D), case, gen)
    bt = ints([[4, -1, 0, 9], [1, 5, 2, 3], [3, 3, -7, 0]], case.device)
    lens = ints([15, 16, 9], case.device)
    idx = torch.randint(-2, 4 * PS + 3, (B, S, K), generator=gen).int().to(case.device)
    run_and_check(call, case, q, kv, idx, d_v=16, block_table=bt, seq_lens=lens, topk_length=ints([14, 6, 0], case.device),
                  sink=rand((H,), case, gen).float())
    run_and_check(call, case, q, kv, idx, d_v=16, block_table=bt)  # no seq_lens: the table's width bounds


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_cache(case, call, fmt):
    gen = _gen(4)
    B, S, H, P, PS, K = 2, 2, 3, 5, 4, 20
    cache = fp8_cache(fmt, P, PS, gen, case.device)
    q = rand((B, S, H, FP8[fmt]), case, gen)
    idx = torch.randint(-2, P * PS + 2, (B, S, K), generator=gen).int().to(case.device)
    run_and_check(call, case, q, cache, idx, cache_format=fmt, sink=rand((H,), case, gen).float(),
                  topk_length=ints([[20, 7], [13, 1]], case.device))


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_block_table_and_padded_pages(fast_case, call, fmt):
    case = fast_case
    gen = _gen(5)
    B, S, H, P, PS, K = 2, 1, 2, 4, 4, 12
    cache = fp8_cache(fmt, P, PS, gen, case.device, pad=48)
    assert not cache.is_contiguous() and cache.stride(0) % 16 == 0
    q = rand((B, S, H, FP8[fmt]), case, gen)
    idx = torch.randint(-1, 3 * PS, (B, S, K), generator=gen).int().to(case.device)
    bt = ints([[2, 0, 3], [1, -1, 2]], case.device)
    run_and_check(call, case, q, cache, idx, cache_format=fmt, block_table=bt, seq_lens=ints([10, 12], case.device))
    # the same cache as FlashMLA stores it: [P, page_size, 1, bytes] float8_e4m3fn
    q1 = q[:1]
    run_and_check(call, case, q1, cache.view(torch.float8_e4m3fn)[:, :, None], idx[:1], cache_format=fmt)


@pytest.mark.parametrize("S", [1, 2, 3, 4])
def test_rows_per_sequence(fast_case, call, S):
    """Speculative decoding: S query rows a sequence, one length per sequence or per row."""
    case = fast_case
    gen = _gen(6)
    B, H, D, P, PS, K = 2, 2, 32, 4, 4, 10
    q = rand((B, S, H, D), case, gen)
    kv = rand((P, PS, 1, D), case, gen)
    idx = torch.randint(0, 3 * PS, (B, S, K), generator=gen).int().to(case.device)
    bt = ints([[3, 1, 0], [2, 0, 1]], case.device)
    run_and_check(call, case, q, kv, idx, d_v=16, block_table=bt, topk_length=ints([10, 3], case.device))
    per_row = torch.arange(B * S, dtype=torch.int32).view(B, S).to(case.device) * 3 - 1
    run_and_check(call, case, q, kv, idx, d_v=16, block_table=bt, topk_length=per_row)


# --------------------------------------------------------------------------
# the contract's edge cases


def flat_problem(case, seed, T, H, N, K, low=0, D=32):
    """q [T, H, D], a flat kv [N, D] and indices [T, K] drawn from [low, N), in the case's dtype and device."""
    gen = _gen(seed)
    q, kv = rand((T, H, D), case, gen), rand((N, D), case, gen)
    return q, kv, torch.randint(low, N, (T, K), generator=gen).int().to(case.device)


def test_topk_length_regimes(fast_case, call):
    case = fast_case
    K = 12
    q, kv, idx = flat_problem(case, 7, T=5, H=2, N=30, K=K)
    out, lse, _ = run_and_check(call, case, q, kv, idx, d_v=16, topk_length=ints([0, -3, K + 5, 2, K], case.device))
    assert torch.isposinf(lse[:2]).all() and (out[:2] == 0).all()


def test_empty_rows_and_sink_extremes(fast_case, call):
    """A row with no valid slot: out 0, lse +inf, whatever the sink. Sinks +inf, huge, -inf, finite."""
    case = fast_case
    N = 16
    q, kv, idx = flat_problem(case, 8, T=3, H=4, N=N, K=8)
    idx[1] = -1
    idx[2, ::2] = N + 100
    sink = torch.tensor([INF, 3e38, -INF, 0.5], device=case.device)
    out, lse, _ = run_and_check(call, case, q, kv, idx, d_v=16, sink=sink)
    assert torch.isposinf(lse[1]).all() and (out[1] == 0).all()
    assert (out[:, :2] == 0).all() and torch.isfinite(out).all()


def test_poison_outside_the_referenced_rows(fast_case, call):
    """NaN / Inf in cache rows, pages and scales that no valid slot reads reaches no output."""
    case = fast_case
    gen = _gen(9)
    B, H, P, PS, K = 2, 2, 4, 4, 8
    q = rand((B, 1, H, 32), case, gen)
    kv = rand((P, PS, 1, 32), case, gen)
    kv[0] = float("nan")  # page 0: only -1 block-table entries and invalid slots point there
    kv[2, 3] = INF
    bt = ints([[1, 2], [3, -1]], case.device)
    idx = ints([[[0, 1, 2, 4, 5, 6, 99, -1]], [[0, 1, 2, 3, 4, 5, 6, 7]]], case.device)  # (2, 3) is slot 7 of seq 0
    out, _, _ = run_and_check(call, case, q, kv, idx, d_v=16, block_table=bt, seq_lens=ints([7, 8], case.device))
    assert torch.isfinite(out).all()
    cache = fp8_cache("fp8_model1", P, PS, gen, case.device).clone()
    nan_token = cache.view(P, -1)
    nan_token[0] = 0x7F  # page 0: every byte 0x7F, a NaN e4m3 value
    nan_token[2, PS * 576 + 8 * 3: PS * 576 + 8 * 3 + 7] = 255  # token (2, 3): NaN scales
    qf = rand((B, 1, H, 512), case, gen)
    out, _, _ = run_and_check(call, case, qf, cache, idx, cache_format="fp8_model1", block_table=bt,
                              seq_lens=ints([7, 8], case.device))
    assert torch.isfinite(out).all()


def test_nan_in_q_and_in_a_valid_row_propagates(fast_case, call):
    case = fast_case
    q, kv, idx = flat_problem(case, 10, T=3, H=2, N=12, K=6, low=1)
    q[0, 1, 3] = float("nan")
    idx[2, 0] = 0
    kv[0, 5] = float("nan")
    out, lse, _ = run_and_check(call, case, q, kv, idx, d_v=16)
    assert torch.isnan(out[0, 1]).all() and torch.isnan(lse[0, 1]) and torch.isfinite(out[1]).all()
    assert torch.isnan(out[2]).any()


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_triton_splits_without_valid_slots(splits):
    """Forced split counts, with splits that hold no valid slot (past the row's length, or all invalid):
    the merge gives the brute force's result."""
    gen = _gen(11)
    T, H, D, N, K = 3, 3, 32, 64, 48
    q, kv = torch.randn(T, H, D, generator=gen), torch.randn(N, D, generator=gen)
    idx = torch.randint(0, N, (T, K), generator=gen).int()
    idx[0, 16:32] = -1  # the second 16-slot block of row 0 is invalid
    idx[1] = -1
    tl = ints([40, 48, 5], "cpu")
    sink = torch.tensor([0.3, INF, -INF])
    a, _ = _checks.sparse_decode_args(q, kv, idx, None, None, tl, sink, None, 16, None)
    out, lse = tdecode.forward(a, splits=splits)
    assert tdecode.plan(a, splits).splits == min(splits, 3)
    exp = bf.sparse_decode(q, kv, idx, topk_length=tl, sink=sink, d_v=16)
    bf.assert_close(out, exp["out"], torch.float32, "out")
    bf.assert_close(lse, exp["lse"], torch.float32, "lse")


@pytest.mark.parametrize("what", ["B", "K", "pages", "table"])
def test_empty_problems(fast_case, call, what):
    case = fast_case
    gen = _gen(12)
    B, H, D, P, PS, K = 2, 2, 32, 3, 4, 5
    B, K, P, W = (0 if what == "B" else B), (0 if what == "K" else K), (0 if what == "pages" else P), \
        (0 if what == "table" else 2)
    q = rand((B, 1, H, D), case, gen)
    kv = rand((P, PS, 1, D), case, gen)
    idx = torch.zeros(B, 1, K, dtype=torch.int32, device=case.device)
    bt = torch.zeros(B, W, dtype=torch.int32, device=case.device)
    out, lse = call(dsa.sparse_decode, q, kv, idx, block_table=bt, d_v=16, return_lse=True, backend=case.backend)
    assert out.shape == (B, 1, H, 16) and (out == 0).all() and torch.isposinf(lse).all()


def test_int64_indices_and_tables(fast_case, call):
    """int64 values beyond int32 stay invalid (no wrap onto a valid slot or page)."""
    case = fast_case
    gen = _gen(13)
    B, H, D, P, PS, K = 2, 2, 32, 4, 4, 6
    q = rand((B, 1, H, D), case, gen)
    kv = rand((P, PS, 1, D), case, gen)
    idx = torch.tensor([[[0, 2**32 + 1, 5, -(2**32) + 3, 7, 1]], [[2**33, 2, 3, 4, 1, 0]]], device=case.device)
    bt = torch.tensor([[2**32 + 1, 1], [3, 0]], device=case.device)
    lens = torch.tensor([2**40, 6], device=case.device)
    run_and_check(call, case, q, kv, idx, d_v=16, block_table=bt, seq_lens=lens,
                  topk_length=torch.tensor([2**40, 5], device=case.device))


# --------------------------------------------------------------------------
# the quantiser and the dequantisation


@pytest.mark.parametrize("fmt", list(FP8))
def test_quantize_is_the_contracts(fmt):
    """quantize_kv_cache writes the brute force's bytes (tiny, zero, huge and negative tiles included), and
    dequantize_kv_cache reads them back as the brute force does, exactly."""
    gen = _gen(14)
    x = torch.randn(2, 3, FP8[fmt], generator=gen) * torch.tensor([1e-7, 1.0, 3e4]).view(1, 3, 1)
    x[0, 1, :64] = 0.0
    x[1, 0, 5] = -0.0
    cache = dsa.quantize_kv_cache(x, fmt)
    assert cache.dtype == torch.uint8 and cache.shape == (2, 3, bf.FP8_LAYOUTS[fmt]["bytes"])
    assert np.array_equal(cache.numpy(), bf.quantize_fp8(x, fmt))
    deq = dsa.dequantize_kv_cache(cache, fmt)
    assert deq.dtype == torch.float32 and np.array_equal(deq.double().numpy(), bf.fp8_cache_rows(cache, fmt))
    rel = bf.rel_l2(deq[:, 1], x[:, 1])
    assert rel < 0.04, rel  # e4m3's 3 mantissa bits


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="cache_format"):
        dsa.quantize_kv_cache(torch.zeros(1, 2, 576), "fp8_v4")
    with pytest.raises(ValueError, match="kv"):
        dsa.quantize_kv_cache(torch.zeros(1, 2, 512), "fp8_v32")
    with pytest.raises(TypeError, match="kv"):
        dsa.quantize_kv_cache(torch.zeros(1, 2, 576, dtype=torch.int32), "fp8_v32")


# --------------------------------------------------------------------------
# the split rule, and sparse attention through the split kernels


@pytest.mark.parametrize("BN", [64, 32])
@pytest.mark.parametrize("B,H,splits", [(1, 64, 32), (1, 128, 32), (32, 64, 4), (32, 128, 2), (128, 64, 1),
                                        (128, 128, 1)])
def test_split_plan_fills_one_wave(B, H, splits, BN):
    """At the issue's shapes on a 132-SM H200 (64 heads a program, K = 2048 in blocks of BN, at least 64
    slots a split)."""
    programs = B * (H // 64)
    S, chunk = tdecode.split_plan(programs, 2048, BN, 132)
    assert S == splits and programs * S <= max(132, programs) and chunk * S >= 2048 and chunk % BN == 0
    assert tdecode.split_plan(1, 2048, BN, 132, splits=64) == (2048 // BN, BN)  # forced: down to one block


def test_sparse_attention_of_few_rows_through_the_split_kernels():
    """What a CUDA sparse_attention forward of few rows runs (dsa.triton.decode.attention_forward), here
    under the interpreter: the packed call as a decode over its flat kv, split and merged."""
    gen = _gen(15)
    T, H, G, D, N, K = 2, 4, 2, 32, 50, 40
    q, kv = torch.randn(T, H, D, generator=gen), torch.randn(N, G, D, generator=gen)
    idx = torch.randint(-1, N + 1, (T, G, K), generator=gen).int()
    sink, tl = torch.randn(H, generator=gen), ints([40, 19], "cpu")
    a, _ = _checks.sparse_attention_args(q, kv, idx, None, 16, sink, tl, False)
    d = tdecode.as_decode(a)
    assert tdecode.plan(d).splits > 1
    out, lse = tdecode.forward(d)
    exp = bf.sparse_attention(q, kv, idx, d_v=16, sink=sink, topk_length=tl)
    bf.assert_close(out, exp["out"], torch.float32, "out")
    bf.assert_close(lse, exp["lse"], torch.float32, "lse")


# --------------------------------------------------------------------------
# errors and explain


def _decode_inputs(**over):
    g = _gen(16)
    base = dict(q=torch.randn(2, 1, 4, 32, generator=g), kv_cache=torch.randn(3, 4, 1, 32, generator=g),
                indices=torch.zeros(2, 1, 5, dtype=torch.int32))
    base.update(over)
    return base


@pytest.mark.parametrize("exc,arg,over,kw", [
    (ValueError, "kv_cache", dict(kv_cache=torch.zeros(3, 4, 1, 32, dtype=torch.float16)), {}),
    (ValueError, "kv_cache", dict(kv_cache=torch.zeros(3, 4, 600, dtype=torch.uint8)), {}),
    (ValueError, "kv_cache", dict(kv_cache=torch.zeros(3, 4, 656, dtype=torch.uint8)), dict(cache_format="native")),
    (ValueError, "kv_cache", {}, dict(cache_format="fp8_v32")),
    (ValueError, "cache_format", {}, dict(cache_format="fp8")),
    (TypeError, "cache_format", {}, dict(cache_format=3)),
    (ValueError, "q", dict(kv_cache=torch.zeros(3, 4, 656, dtype=torch.uint8)), {}),  # D 32 != 576
    (ValueError, "block_table", dict(kv_cache=torch.randn(12, 32)), dict(block_table=torch.zeros(2, 3, dtype=torch.int32))),
    (ValueError, "block_table", {}, dict(block_table=torch.zeros(3, 3, dtype=torch.int32))),
    (ValueError, "seq_lens", {}, dict(seq_lens=torch.zeros(2, dtype=torch.int32))),
    (ValueError, "seq_lens", {}, dict(block_table=torch.zeros(2, 3, dtype=torch.int32),
                                      seq_lens=torch.zeros(3, dtype=torch.int32))),
    (ValueError, "topk_length", {}, dict(topk_length=torch.zeros(3, dtype=torch.int32))),
    (ValueError, "topk_length", dict(q=torch.randn(2, 4, 32), indices=torch.zeros(2, 5, dtype=torch.int32)),
     dict(topk_length=torch.zeros(2, 1, dtype=torch.int32))),
    (ValueError, "indices", dict(indices=torch.zeros(2, 2, 5, dtype=torch.int32)), {}),
    (ValueError, "kv_cache", dict(kv_cache=torch.randn(3, 4, 3, 32)), {}),  # 3 kv heads do not divide 4
    (ValueError, "d_v", {}, dict(d_v=64)),
    (TypeError, "sink", {}, dict(sink=torch.zeros(4, dtype=torch.float16))),
    (TypeError, "indices", dict(indices=torch.zeros(2, 1, 5)), {}),
])
def test_decode_bad_input(exc, arg, over, kw):
    with pytest.raises(exc, match=arg):
        dsa.sparse_decode(**_decode_inputs(**over), backend="reference", **kw)
    with pytest.raises(exc, match=arg):  # explain checks the same way
        dsa.explain("sparse_decode", **_decode_inputs(**over), **kw)


def test_explain_and_triton_reasons():
    gen = _gen(17)
    cache = fp8_cache("fp8_v32", 2, 4, gen, "cpu")
    q = torch.randn(1, 1, 2, 576, generator=gen)
    idx = torch.zeros(1, 1, 4, dtype=torch.int32)
    text = dsa.explain("sparse_decode", q, cache, idx)
    assert "sparse_decode: backend 'reference'" in text and "fp8_v32" in text
    # d_v = 64 cuts a 128-value scale tile: the Triton kernels decline with that reason
    with pytest.raises(ValueError, match="scale tiles"):
        dsa.sparse_decode(q, cache, idx, d_v=64, backend="triton")
    out = dsa.sparse_decode(q, cache, idx, d_v=64, backend="reference")
    exp = bf.sparse_decode(q, cache, idx, d_v=64, cache_format="fp8_v32")
    bf.assert_close(out, exp["out"], torch.float32, "out")


def test_decode_takes_the_fast_path(monkeypatch):
    """The public call skips the torch.library dispatcher in eager mode, with the op's result."""
    from dsa import ops

    calls = []
    through = ops.sparse_decode.op
    monkeypatch.setattr(ops.sparse_decode, "op", lambda *a: calls.append(1) or through(*a))
    inputs = _decode_inputs()
    out = dsa.sparse_decode(**inputs, backend="reference")
    assert calls == []
    a, _ = _checks.sparse_decode_args(inputs["q"], inputs["kv_cache"], inputs["indices"], None, None, None, None,
                                      None, None, None)
    via_op, _ = ops.sparse_decode(a, "reference")
    assert calls == [1] and torch.equal(out.view_as(via_op), via_op)


def test_compile_fullgraph():
    torch._dynamo.reset()
    gen = _gen(18)
    q = torch.randn(2, 2, 2, 32, generator=gen)
    kv = torch.randn(3, 4, 1, 32, generator=gen)
    idx = torch.randint(-1, 8, (2, 2, 5), generator=gen).int()
    bt = ints([[2, 0], [1, -1]], "cpu")

    def fn(q, kv, idx, bt):
        return dsa.sparse_decode(q, kv, idx, block_table=bt, d_v=16, return_lse=True, backend="reference")

    try:
        eager = fn(q, kv, idx, bt)
        compiled = torch.compile(fn, fullgraph=True)(q, kv, idx, bt)
    finally:
        torch._dynamo.reset()
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------
# GPU: CUDA graphs, no host sync, the model shapes


def _gpu_problem(fmt, B=4, S=1, H=64, K=256, P=64, PS=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    D = FP8.get(fmt, 576)
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(P, PS, D, device="cuda", generator=g)
    cache = dsa.quantize_kv_cache(kv, fmt) if fmt != "native" else kv.bfloat16()[:, :, None]
    bt = torch.randperm(P, device="cuda", generator=g)[: B * 4].view(B, 4).int()
    idx = torch.randint(-1, 4 * PS, (B, S, K), device="cuda", generator=g).int()
    tl = torch.randint(0, K + 1, (B,), device="cuda", generator=g).int()
    sink = torch.randn(H, device="cuda", generator=g)
    return q, cache, idx, dict(block_table=bt, topk_length=tl, sink=sink, return_lse=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["native", "fp8_v32", "fp8_model1"])
def test_cuda_graph_replay_and_no_sync(fmt):
    q, cache, idx, kw = _gpu_problem(fmt)
    assert_replays_without_sync(lambda: dsa.sparse_decode(q, cache, idx, **kw), q)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["native", "fp8_v32", "fp8_model1"])
@pytest.mark.parametrize("B,H", [(1, 64), (1, 128), (32, 128)])
def test_model_shapes_against_reference(fmt, B, H):
    q, cache, idx, kw = _gpu_problem(fmt, B=B, H=H, K=2048, P=128)
    out, lse = dsa.sparse_decode(q, cache, idx, backend="triton", **kw)
    ref, ref_lse = dsa.sparse_decode(q.float(), cache if fmt != "native" else cache.float(), idx,
                                     backend="reference", **kw)
    assert bf.rel_l2(out, ref) < 1e-2
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))


# --------------------------------------------------------------------------
# the launcher that skips Triton's per-call binding


def test_launcher_spec_holds_tritons_specialization():
    """Two arguments with equal arg_spec (and dtype) get equal Triton specializations."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from dsa.triton.launch import arg_spec

    buf = torch.zeros(64, dtype=torch.uint8)
    values = [1, 0, 16, 17, -16, 2**31 - 16, 2**31, 2**40 + 1, 2**63, -(2**31), -(2**31) - 16, 0.5, None,
              buf, buf[1:], buf[16:], buf[8:]]
    tritons = {}
    for v in values:
        spec = (getattr(v, "dtype", None), arg_spec(v))
        got = native_specialize_impl(BaseBackend, v, False, True, True)
        assert tritons.setdefault(spec, got) == got, (v, spec, got, tritons[spec])


def test_launcher_calls_the_compiled_kernel_directly():
    from dsa.triton.launch import Launcher

    calls = []

    class Compiled:
        packed_metadata = object()

        def __getitem__(self, grid):
            return lambda *args: calls.append(("direct", grid, args))

    class Jit:
        arg_names = ["x", "n", "A", "B"]

        def __getitem__(self, grid):
            def run(*args, **kw):
                calls.append(("jit", grid, args, kw))
                return Compiled()
            return run

    launch = Launcher(Jit())
    x = torch.zeros(32)
    consts = dict(A=3, B=(1, 2), num_warps=4)
    launch((2,), (x, 32), consts, "k")
    launch((3,), (x, 48), consts, "k")  # same specialization: the compiled kernel, constexprs appended
    launch((3,), (x[1:], 48), consts, "k")  # another alignment: through the JIT again
    launch((3,), (x, 17), consts, "k")  # another int class
    assert [c[0] for c in calls] == ["jit", "direct", "jit", "jit"]
    assert calls[1] == ("direct", (3,), (x, 48, 3, (1, 2)))


def test_direct_launch_follows_tritons_runner():
    """direct_launch repeats what Triton's runner passes to its C launcher (read from Triton's own
    source, so that a change there fails here), less the hooks' metadata, and only without hooks."""
    import inspect

    from triton.backends.nvidia.driver import CudaLauncher
    from triton.compiler.compiler import CompiledKernel

    from dsa.triton import launch as tl

    runner = " ".join(inspect.getsource(CompiledKernel.__getitem__).split())
    assert ("self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata, launch_metadata, "
            "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *args)") in runner
    call = " ".join(inspect.getsource(CudaLauncher.__call__).split())
    assert ("self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, "
            "global_scratch, profile_scratch, *args)") in call
    assert "if size > 0:" in call  # no scratch: None is passed

    calls = []

    class Launch:
        launch_cooperative_grid, launch_pdl, global_scratch_size, profile_scratch_size = False, True, 0, 0

        def launch(self, *args):
            calls.append(args)

    class Kernel:
        run, function, packed_metadata = Launch(), 77, (4, 1, 0)

    run = tl.direct_launch(Kernel())
    run((3, 2, 1), 555, (1024, 7), ("c",))
    assert calls == [(3, 2, 1, 555, 77, False, True, None, None, (4, 1, 0), None, None, None, 1024, 7, "c")]
    Kernel.run.global_scratch_size = 8  # a kernel that needs scratch memory takes the runner
    assert tl.direct_launch(Kernel()) is None
    assert tl.direct_launch(object()) is None
    assert not tl._hooked()
    hook = lambda meta: None  # noqa: E731
    tl.knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert tl._hooked()
    finally:
        tl.knobs.runtime.launch_enter_hook.remove(hook)
    assert not tl._hooked()
