"""The CuTe DSL tier: SM90 sparse attention forward and its placement table.

* CPU (CI): the kernel is compiled ahead of time for sm_90a with no GPU
  (``CUTE_DSL_ARCH=sm_90a``) in a subprocess, and its PTX must contain the
  Hopper instructions the design rests on (wgmma, cp.async with mbarrier
  completion, register reallocation); the placement lookup is checked on a
  synthetic table.
* GPU (``-m gpu``, an SM90 device): every validity rule of docs/semantics.md at the
  shapes the kernel serves (64 query heads per kv head, D 512 / 576,
  d_v 512), bf16 and fp16, against the float64 brute force.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import bruteforce as bf
import dsa
from cute_offline import HAVE_DSL, ROOT, SERIALIZED, SM90, ptx_counts
from dsa._args import SparseAttnArgs
from dsa.cute import placement

INF = float("inf")


# --------------------------------------------------------------------------
# ahead-of-time compilation (CPU)

_NEEDLES = ("wgmma.mma_async", "cp.async.cg.shared.global", "cp.async.mbarrier.arrive.noinc", "setmaxnreg.inc",
            "setmaxnreg.dec", "mbarrier.try_wait", "mbarrier.arrive.shared", "bar.arrive", "%clock64")

_CONFIGS = [  # name, dtype, D, H, G, has_len, has_sink, profile, refill
    ("v32_bf16", "torch.bfloat16", 576, 128, 1, True, True, False, True),
    ("v4_fp16_gqa", "torch.float16", 512, 128, 2, False, False, False, True),
    # bench/profile_cute.py's builds: cycle counters; each stage gathered once
    ("v32_bf16_profile", "torch.bfloat16", 576, 128, 1, True, False, True, True),
    ("v32_bf16_norefill", "torch.bfloat16", 576, 128, 1, False, False, False, False),
    # a tensor-parallel shard: 16 heads a kv head, one tile padded to 64 rows
    ("tp16_bf16_gqa", "torch.bfloat16", 576, 32, 2, True, True, False, True),
]


@pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl is not installed")
def test_sm90_kernel_compiles_offline_with_hopper_instructions(tmp_path):
    calls = [(c[0], list(c[1:7]), dict(profile=c[7], refill=c[8])) for c in _CONFIGS]
    res = ptx_counts("dsa.cute.sparse_attention:compile_offline", calls, _NEEDLES, "sm_90a", tmp_path)
    for name, dt, D, H, G, has_len, has_sink, profile, refill in _CONFIGS:
        r = res[name]
        assert not r[SERIALIZED], (name, r)  # wgmma back to back, none serialised for lack of registers
        # the cycle counters exist only in the profiling build
        assert (r["%clock64"] > 0) == profile, (name, r)
        # S = Q K^T: D / 16 wgmma per block; O += P V: 4 per block and stage.
        assert r["wgmma.mma_async"] >= D // 16 + 4, (name, r)
        assert r["cp.async.cg.shared.global"] >= D // 64 * 4, (name, r)  # the gather
        # Q, then each of the four half stages (L and R of two stages) signalled on its own
        assert r["cp.async.mbarrier.arrive.noinc"] >= 5, (name, r)
        # the consumers free each half and Q; the producer publishes each stage's mask
        assert r["mbarrier.arrive.shared"] >= 4 + 1 + 2, (name, r)
        assert r["bar.arrive"] >= 4, (name, r)  # the staggered hand-offs: maxima and P, both ways
        assert r["setmaxnreg.inc"] >= 1 and r["setmaxnreg.dec"] >= 1, (name, r)
        assert r["mbarrier.try_wait"] >= 2, (name, r)


_BOUND_NEEDLES = ("shfl.sync", "st.global.v2.b32", "lg2.approx", "wgmma.mma_async", "ld.global")


@pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl is not installed")
def test_sm90_bounds_and_ordered_builds_offline(tmp_path):
    """The deterministic mode's forward (``bounds``) for sm_90a against the
    default build of the same problem: the same products and shared memory;
    on top, at each of its three places (consumer 0 after the pair's P1 V1
    and for a last block alone, consumer 1 after its P1), the row sums over
    the quad and the reduce-scatter of the head sums (18 shuffles), one
    8-byte store of a lane's two column sums and a log2 a row for the
    levels; a spill of at most 16 bytes a thread (the consumers sit at
    their register limit); a padded fp16 tile the same way.  The ordered
    build (tiles in ``token_order``'s order) differs from the default by
    one global load a warpgroup (the tile's token), with no spill."""
    from cute_offline import compile_reports

    target = "dsa.cute.sparse_attention:compile_offline"
    calls = [("v32", target, ["torch.bfloat16", 576, 128, 1, True, True], dict(bounds=False)),
             ("v32_bounds", target, ["torch.bfloat16", 576, 128, 1, True, True], dict(bounds=True)),
             ("tp16_fp16_bounds", target, ["torch.float16", 576, 32, 2, True, False], dict(bounds=True)),
             ("v32_ordered", target, ["torch.bfloat16", 576, 128, 1, True, True], dict(ordered=True))]
    res = compile_reports(calls, _BOUND_NEEDLES, "sm_90a", tmp_path)
    base, n = res["v32"], res["v32"]["needles"]
    assert base["spill_stores"] == 0 and n["st.global.v2.b32"] == 0 and n["lg2.approx"] == 0, base
    assert not any(r["wgmma_serialized"] for r in res.values()), res
    r, o = res["v32_ordered"], res["v32_ordered"]["needles"]
    assert r["spill_stores"] == 0 and r["smem"] == base["smem"], r
    assert o["ld.global"] == n["ld.global"] + 3 and o["wgmma.mma_async"] == n["wgmma.mma_async"], (o, n)
    for name in ("v32_bounds", "tp16_fp16_bounds"):
        r, b = res[name], res[name]["needles"]
        assert b["wgmma.mma_async"] == n["wgmma.mma_async"], (name, b, n)
        assert b["shfl.sync"] - n["shfl.sync"] == 3 * 18, (name, b, n)
        assert b["st.global.v2.b32"] == 3 and b["lg2.approx"] == 3 * 2, (name, b)
        assert r["smem"] == base["smem"] and r["kernels"] == 1, (name, r)
        assert r["spill_stores"] <= 16 and not r["wgmma_serialized"], (name, r)


# --------------------------------------------------------------------------
# placement table lookup (CPU)


def _entry(**kw):
    base = dict(dtype="bfloat16", D=576, HG=128, K=2048, T=4096, backend="cute", cute_ms=1.0, triton_ms=2.0)
    base.update(kw)
    return placement.Entry(**base)


def _features(**kw):
    base = dict(dtype="bfloat16", D=576, HG=128, K=2048, T=4096)
    base.update(kw)
    return base


def test_placement_nearest_entry_decides():
    table = [_entry(K=2048, backend="cute"), _entry(K=512, backend="triton", cute_ms=3.0)]
    assert placement.nearest(_features(K=1800), table).backend == "cute"
    assert placement.nearest(_features(K=600), table).backend == "triton"


def test_placement_needs_matching_dtype_and_D():
    table = [_entry()]
    assert placement.nearest(_features(dtype="float16"), table) is None
    assert placement.nearest(_features(D=512), table) is None


def test_placement_padded_tiles_rank_apart():
    """Fewer than 64 query heads per kv head (one padded tile) and full tiles
    are decided only by entries of their own class, however near."""
    full, padded = _entry(HG=64, backend="cute"), _entry(HG=32, backend="triton", cute_ms=3.0)
    assert placement.nearest(_features(HG=64), [full, padded]).backend == "cute"
    assert placement.nearest(_features(HG=48), [full, padded]).backend == "triton"
    assert placement.nearest(_features(HG=16), [full]) is None
    assert placement.nearest(_features(HG=128), [padded]) is None


@pytest.mark.parametrize("op", ["fwd", "bwd"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_shipped_tables_cover_the_padded_tiles(op, dtype):
    """The shipped SM90 tables decide calls of 16 and 32 heads per kv head
    from their own measured entries, each dtype from its own: at K 2048,
    T 4096 the padded cute tile wins the backward at 16 and 32 heads and
    the forward at 32, where Triton's cost falls with the heads and the
    tile's does not; at K 128, T 8192 Triton wins both."""
    table = placement.entries(placement.TABLE if op == "fwd" else placement.TABLE_BWD)
    tp = [e for e in table if e.HG < placement.FULL_TILE_HEADS]
    assert {e.HG for e in tp} == {16, 32} and {e.dtype for e in tp} == {"bfloat16", "float16"}
    for e in tp:
        assert e.backend == ("cute" if e.cute_ms < e.triton_ms else "triton")
    got = placement.nearest(_features(dtype=dtype, HG=16, K=2048, T=4096), table)
    assert (got.HG, got.dtype) == (16, dtype) and got.backend == ("triton" if op == "fwd" else "cute")
    assert placement.nearest(_features(dtype=dtype, HG=32, K=2048, T=4096), table).backend == "cute"
    assert placement.nearest(_features(dtype=dtype, HG=16, K=128, T=8192), table).backend == "triton"


def test_placement_far_shapes_have_no_entry():
    table = [_entry(T=4096)]
    assert placement.nearest(_features(T=16384), table) is not None  # two octaves
    assert placement.nearest(_features(T=32768), table) is None      # three
    assert placement.nearest(_features(K=16384), table) is None


def test_placement_table_recorded_studies_are_consistent():
    """The studies kept in bench/placement: entries name the faster backend,
    and only a study whose holdout regret passed the gate is unmarked."""
    folder = os.path.join(ROOT, "bench", "placement")
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            doc = json.load(f)
        passed = doc["holdout"]["regret_geomean"] <= 1.02
        assert passed == (".rejected" not in name), name
        for e in doc["entries"]:
            assert e["backend"] == ("cute" if e["cute_ms"] < e["triton_ms"] else "triton"), (name, e)


def test_placement_shipped_table_is_well_formed():
    if not os.path.exists(placement.TABLE):
        pytest.skip("no placement table shipped")
    with open(placement.TABLE) as f:
        table = json.load(f)
    assert table["holdout"]["regret_geomean"] <= 1.02
    for e in placement.entries():
        assert e.backend in ("cute", "triton")
        faster = "cute" if e.cute_ms < e.triton_ms else "triton"
        assert e.backend == faster, e


def test_cute_declines_other_ops_with_reason():
    q = torch.zeros(2, 64, 512)
    with pytest.raises(ValueError, match="cute"):
        dsa.indexer_scores(q[:, :4, :32], q[:, 0, :32], torch.ones(2, 4), backend="cute")


# --------------------------------------------------------------------------
# GPU: the contract on cute


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rand(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).cuda()


def _indices(T, G, K, N, gen):
    rows = [torch.randperm(N, generator=gen)[:K] for _ in range(T * G)]
    return torch.stack(rows).reshape(T, G, K).to(torch.int32)


def _check(dtype, q, kv, idx, **kw):
    out, lse = dsa.sparse_attention(q, kv, idx, return_lse=True, backend="cute", **kw)
    exp = bf.sparse_attention(q, kv, idx, **kw)
    bf.assert_close(out, exp["out"], dtype, "out")
    bf.assert_close(lse, exp["lse"], torch.float32 if dtype == torch.float32 else dtype, "lse")
    return out, lse


@pytest.fixture(params=[(True, None), (False, None), (True, 1), (True, 3)],
                ids=["persistent-sms", "cta-per-tile", "persistent-1", "persistent-3"])
def grid(request, monkeypatch):
    """Every GPU test runs on the default grid (one CTA per SM), with one CTA
    per tile, and on persistent grids of 1 and 3 CTAs (every tile of a call
    in one CTA; tiles of different lengths in turn)."""
    from dsa.cute import sparse_attention as cute_sa

    persistent, ctas = request.param
    monkeypatch.setattr(cute_sa, "DEFAULT", cute_sa.GridConfig(persistent=persistent, ctas=ctas))
    return request.param


dtypes = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
gpu = pytest.mark.skipif(not (SM90 and HAVE_DSL), reason="needs an SM90 GPU and nvidia-cutlass-dsl")


@pytest.mark.gpu
@gpu
@pytest.mark.usefixtures("grid")
@dtypes
@pytest.mark.parametrize("H,G,D,K,T", [
    (64, 1, 512, 128, 3),      # V4-flash heads
    (128, 1, 576, 200, 2),     # V3.2 heads, K not a multiple of the 64-slot block
    (128, 2, 512, 64, 2),      # GQA: 64 heads per kv head
    (64, 1, 576, 1, 1),        # one slot, one token
])
def test_cute_matches_bruteforce(dtype, H, G, D, K, T):
    gen = _gen(H + D + K)
    N = 3 * K + 5
    q = _rand((T, H, D), dtype, gen)
    kv = _rand((N, G, D) if G > 1 else (N, D), dtype, gen)
    idx = _indices(T, G, K, N, gen).cuda()
    if G == 1:
        idx = idx[:, 0]
    _check(dtype, q, kv, idx)


@pytest.mark.gpu
@gpu
@pytest.mark.usefixtures("grid")
@dtypes
def test_cute_validity_rules(dtype):
    """topk_length in every regime, indices -1 / N / far out of range,
    duplicates, per-head sink, and NaN/Inf in every unreferenced kv row."""
    gen = _gen(7)
    T, H, D, K, N = 6, 64, 576, 150, 400
    q = _rand((T, H, D), dtype, gen)
    kv = _rand((N, D), dtype, gen)
    idx = _indices(T, 1, K, N, gen)[:, 0]
    idx[0, ::5] = -1
    idx[1, ::3] = N
    idx[2, 1::4] = 2**31 - 1
    idx[3, :40] = idx[3, 40:80]  # duplicates: separate slots
    used = torch.zeros(N, dtype=torch.bool)
    tl = torch.tensor([K, 0, 1, 77, 200, -5], dtype=torch.int32)
    for t in range(T):
        L = max(0, min(int(tl[t]), K))
        r = idx[t, :L]
        used[r[(r >= 0) & (r < N)].long()] = True
    kv_cpu = kv.cpu()
    kv_cpu[~used] = float("nan")
    kv_cpu[~used & (torch.arange(N) % 2 == 0)] = INF
    kv = kv_cpu.to(dtype).cuda()
    sink = (torch.randn(H, generator=gen) * 2).float().cuda()
    out, lse = _check(dtype, q, kv, idx.cuda(), topk_length=tl.cuda(), sink=sink)
    assert not out.isnan().any()
    assert torch.isinf(lse[1]).all() and torch.isinf(lse[5]).all()  # empty rows: +inf
    assert (out[1] == 0).all() and (out[5] == 0).all()


@pytest.mark.gpu
@gpu
@pytest.mark.usefixtures("grid")
@pytest.mark.parametrize("H,G,D,dtype", [(16, 1, 576, torch.bfloat16), (32, 1, 512, torch.bfloat16),
                                         (32, 2, 576, torch.bfloat16), (32, 1, 576, torch.float16)],
                         ids=["h16", "h32-d512", "gqa-2x16", "h32-fp16"])
def test_cute_tp_shard_heads_in_a_padded_tile(H, G, D, dtype):
    """16 or 32 query heads per kv head (a tensor-parallel shard) run as one
    64-row tile whose other rows are zero: every out and lse element of the
    real heads written (the memory is NaN-poisoned first), per-head sinks,
    topk_length and hostile indices, and the last token's tile reading
    nothing past q (its padding rows would lie past q's end)."""
    gen = _gen(H + G + D)
    T, K, N = 7, 300, 700
    q = _rand((T, H, D), dtype, gen)
    kv = _rand((N, G, D), dtype, gen)
    idx = _indices(T, G, K, N, gen)
    idx[0, :, ::5] = -1
    idx[1, :, ::3] = N
    tl = torch.tensor([K, 0, 1, 64, 65, 200, -5], dtype=torch.int32, device="cuda")
    sink = (torch.randn(H, generator=gen) * 2).float().cuda()
    sink[0], sink[H - 1] = INF, -INF
    for _ in range(2):
        junk = (torch.full((T, H, 512), float("nan"), dtype=dtype, device="cuda"),
                torch.full((T, H), float("nan"), device="cuda"))
        del junk
        out, lse = _check(dtype, q, kv, idx.cuda(), topk_length=tl, sink=sink)
        assert not out.isnan().any() and not lse.isnan().any()


@pytest.mark.gpu
@gpu
@pytest.mark.usefixtures("grid")
@dtypes
@pytest.mark.parametrize("value", [INF, 2.4e38, -INF])
def test_cute_sink_extremes(dtype, value):
    gen = _gen(11)
    T, H, D, K, N = 2, 64, 512, 64, 128
    q, kv = _rand((T, H, D), dtype, gen), _rand((N, D), dtype, gen)
    idx = _indices(T, 1, K, N, gen)[:, 0].cuda()
    sink = torch.full((H,), value, dtype=torch.float32, device="cuda")
    out, _ = _check(dtype, q, kv, idx, sink=sink)
    if value > 0:
        assert (out == 0).all()


@pytest.mark.gpu
@gpu
@pytest.mark.usefixtures("grid")
@dtypes
def test_cute_batched_layout_and_nan_propagation(dtype):
    gen = _gen(13)
    B, S, H, D, K, N = 2, 3, 64, 512, 96, 130
    q = _rand((B, S, H, D), dtype, gen)
    kv = _rand((B, N, D), dtype, gen)
    idx = torch.stack([_indices(S, 1, K, N, gen)[:, 0] for _ in range(B)]).cuda()
    _check(dtype, q, kv, idx)
    q2 = q.clone()
    q2[0, 1, 5, 3] = float("nan")
    out = dsa.sparse_attention(q2, kv, idx, backend="cute")
    assert out[0, 1, 5].isnan().all() and not out[0, 1, :5].isnan().any()


@pytest.mark.gpu
@gpu
@pytest.mark.usefixtures("grid")
def test_cute_writes_every_output_element():
    """Outputs come from torch.empty; poison the allocator's free memory with
    NaN first so that an unwritten element shows."""
    gen = _gen(17)
    T, H, D, K, N = 5, 128, 576, 130, 300
    q, kv = _rand((T, H, D), torch.bfloat16, gen), _rand((N, D), torch.bfloat16, gen)
    idx = _indices(T, 1, K, N, gen)[:, 0].cuda()
    tl = torch.tensor([0, 1, 64, 65, 130], dtype=torch.int32, device="cuda")
    for _ in range(3):
        junk = (torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda"),
                torch.full((T, H), float("nan"), device="cuda"))
        del junk
        out, lse = dsa.sparse_attention(q, kv, idx, topk_length=tl, return_lse=True, backend="cute")
        assert not out.isnan().any() and not lse.isnan().any()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("ctas", [1, 3, 7, 16])
def test_cute_ordered_tiles_give_the_plain_order_bits(ctas, monkeypatch):
    """With ``ORDER_ROUNDS`` set, a persistent grid with rows of unequal
    length takes its tiles by descending topk_length along the snake order
    (``token_order``): every
    out and lse element written (NaN-poisoned memory) and bitwise those of
    one CTA a tile in token order, which match the float64 brute force;
    lengths 0, negative, past K, partial blocks, GQA with two head blocks."""
    from dsa.cute import sparse_attention as cute_sa

    gen = _gen(31 + ctas)
    T, H, G, D, K, N = 37, 256, 2, 576, 300, 700
    q, kv = _rand((T, H, D), torch.bfloat16, gen), _rand((N, G, D), torch.bfloat16, gen)
    idx = _indices(T, G, K, N, gen).cuda()
    tl = torch.randint(0, K + 1, (T,), generator=gen, dtype=torch.int32)
    tl[:4] = torch.tensor([0, -3, K + 50, 65], dtype=torch.int32)
    tl = tl.cuda()
    sink = (torch.randn(H, generator=gen) * 2).float().cuda()
    a = SparseAttnArgs(q, kv, idx, tl, sink, D ** -0.5, 512, False)
    monkeypatch.setattr(cute_sa, "ORDER_ROUNDS", 2)
    assert cute_sa.token_order(a, ctas) is not None
    plain = cute_sa.forward(a, cute_sa.GridConfig(persistent=False))
    junk = (torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda"),
            torch.full((T, H), float("nan"), device="cuda"))
    del junk
    out, lse = cute_sa.forward(a, cute_sa.GridConfig(ctas=ctas))
    assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1])
    exp = bf.sparse_attention(q, kv, idx, topk_length=tl, sink=sink)
    bf.assert_close(out, exp["out"], torch.bfloat16, "out")


@pytest.mark.gpu
@gpu
def test_cute_profile_build_matches_and_counts():
    """The profiling build (bench/profile_cute.py) gives the plain build's
    bits, and its counters are consistent: every part within its loop."""
    from dsa.cute import sparse_attention as cute_sa
    from dsa.cute import sparse_attention_sm90 as k

    gen = _gen(19)
    T, H, D, K, N = 7, 128, 576, 300, 500
    q, kv = _rand((T, H, D), torch.bfloat16, gen), _rand((N, 1, D), torch.bfloat16, gen)
    idx = _indices(T, 1, K, N, gen).cuda()
    tl = torch.tensor([K, 0, 1, 64, 65, 299, 1000], dtype=torch.int32, device="cuda")
    a = SparseAttnArgs(q, kv, idx, tl, None, D ** -0.5, 512, False)
    cfg = cute_sa.GridConfig(ctas=3)  # several tiles a CTA
    out, lse = cute_sa.forward(a, cfg)
    prof = torch.zeros(3, k.THREADS // 32, k.PROF_N, dtype=torch.int64, device="cuda")
    out2, lse2 = cute_sa.forward(a, cfg, profile=prof)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    total = prof[:, :, k.PROF_TOTAL]
    assert (total > 0).all()
    consumer = prof[:, 4:, k.PROF_FULL:k.PROF_EPI + 1].sum(-1)
    producer = prof[:, :4, k.PROF_EMPTY:k.PROF_Q + 1].sum(-1)
    assert (prof >= 0).all() and (consumer <= total[:, 4:]).all() and (producer <= total[:, :4]).all()


@pytest.mark.gpu
@gpu
@pytest.mark.usefixtures("grid")
def test_cute_unserved_shape_raises_with_reason():
    gen = _gen(23)
    q, kv = _rand((2, 48, 512), torch.bfloat16, gen), _rand((64, 512), torch.bfloat16, gen)
    idx = _indices(2, 1, 64, 64, gen)[:, 0].cuda()
    with pytest.raises(ValueError, match="multiple of 64"):
        dsa.sparse_attention(q, kv, idx, backend="cute")
    text = dsa.explain("sparse_attention", q, kv, idx)
    assert "multiple of 64" in text, text


@pytest.mark.gpu
@gpu
@pytest.mark.usefixtures("grid")
def test_auto_follows_the_placement_table(monkeypatch):
    gen = _gen(29)
    T, H, D, K, N = 64, 128, 576, 512, 1024
    q, kv = _rand((T, H, D), torch.bfloat16, gen), _rand((N, D), torch.bfloat16, gen)
    idx = _indices(T, 1, K, N, gen)[:, 0].cuda()
    a = SparseAttnArgs(q, kv[:, None], idx[:, None], None, None, D ** -0.5, 512)
    entry = placement.lookup(a)
    text = dsa.explain("sparse_attention", q, kv, idx)
    unusable = placement.unusable(q.device)
    if unusable is not None:
        assert "backend 'triton'" in text and unusable in text, text
    elif entry is None:
        assert "no measured placement table entry" in text, text
    else:
        assert f"backend '{entry.backend}'" in text and "placement table entry" in text, text
    monkeypatch.setenv("DSA_DISABLE_CUTE", "1")
    text = dsa.explain("sparse_attention", q, kv, idx)
    assert "backend 'triton'" in text and "DSA_DISABLE_CUTE" in text, text


@pytest.mark.gpu
@gpu
def test_cute_zero_row_first_made_under_graph_capture(monkeypatch):
    """A zero row first needed while a CUDA graph captures must hold zeros
    for eager calls before the graph's first replay: the capture's pool is
    filled with NaN first (a graph sharing it, replayed), so a row made from
    that pool would show as NaN in every row with an invalid slot."""
    from dsa.cute import host

    gen = _gen(31)
    T, H, D, K, N = 4, 64, 576, 128, 300
    q, kv = _rand((T, H, D), torch.bfloat16, gen), _rand((N, D), torch.bfloat16, gen)
    idx = _indices(T, 1, K, N, gen)[:, 0]
    idx[:, ::3] = -1  # invalid slots read the zero row
    idx = idx.cuda()
    expected = dsa.sparse_attention(q, kv, idx, backend="cute")  # compiled, outside any capture
    assert not expected.isnan().any()
    monkeypatch.setattr(host, "_ZEROS", {})

    poison = torch.cuda.CUDAGraph()
    with torch.cuda.graph(poison):
        junk = [torch.full((1 << 19,), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(4)]
        junk += [torch.full((1 << 10,), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(64)]
        del junk
    poison.replay()
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=poison.pool()):
        captured = dsa.sparse_attention(q, kv, idx, backend="cute")
    assert len(host._ZEROS) == 1
    eager = dsa.sparse_attention(q, kv, idx, backend="cute")  # before any replay
    assert torch.equal(eager, expected)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, expected)
    assert torch.equal(dsa.sparse_attention(q, kv, idx, backend="cute"), expected)
