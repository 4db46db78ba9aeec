"""The CuTe DSL top-k (dsa.cute.topk): its builds compile for sm_90a, its
host logic, and on an SM90 GPU (``gpu`` marker) the contract against the
float64 brute force on rows that expose a wrong cut, tie or padding."""

from __future__ import annotations

import pytest
import torch

import dsa
from cute_offline import HAVE_DSL, SM90, compile_reports
from dsa._args import IndexerArgs, TopkArgs
from dsa.cute import topk as ct
from test_triton_topk import topk_contract

needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="CuTe DSL not importable")
INF = float("inf")
NAN = float("nan")


@needs_dsl
def test_builds_compile_for_sm90(tmp_path):
    """The smallest and largest fp32 buckets and a 16-bit build: one 16-byte
    (fp32) or 8-byte (16-bit) load a key vector, shared-memory histogram
    counts, no spills but the bounded build's few bytes, shared memory
    within the launch limit."""
    calls = [("f32_4096", "dsa.cute.topk:compile_offline", ["torch.float32"], dict(S=4096, k=2048)),
             ("f32_49152", "dsa.cute.topk:compile_offline", ["torch.float32"], dict(S=49152, k=4096, stream=False)),
             ("bf16_8192", "dsa.cute.topk:compile_offline", ["torch.bfloat16"], dict(S=8192, k=1024)),
             ("f32_stream", "dsa.cute.topk:compile_offline", ["torch.float32"], dict(S=65536, k=2048)),
             ("bf16_stream", "dsa.cute.topk:compile_offline", ["torch.bfloat16"], dict(S=131072, k=4096)),
             ("f32_fine_stream", "dsa.cute.topk:compile_offline", ["torch.float32"],
              dict(S=65536, k=2048, coarse=False, margin4=6))]
    needles = ("red.shared.add.u32", "ld.global.v4", "ld.global.v2", "st.shared.v4", "ld.shared.v4", "bar.sync",
               "shfl.sync.up", "setp.ge.f32", "cp.async.bulk.prefetch.L2")
    reports = compile_reports(calls, needles, "sm_90a", tmp_path)
    for name, r in reports.items():
        n = r["needles"]
        stream = name.endswith("stream")
        assert n["red.shared.add.u32"] > 0 and n["bar.sync"] > 0, (name, r)
        # the resident kernel stores its row's key vectors; the streaming one tests scores as fp32
        # against the threshold and prefetches rounds ahead into L2
        assert (n["st.shared.v4"] > 0) != stream, (name, r)
        assert (n["setp.ge.f32"] > 0) == stream and (n["cp.async.bulk.prefetch.L2"] > 0) == stream, (name, r)
        assert (n["ld.global.v4"] > 0) == name.startswith("f32"), (name, r)
        assert (n["ld.global.v2"] > 0) == name.startswith("bf16"), (name, r)
        # the 4096-key build is bounded to 6 CTAs an SM (40 registers): a few
        # bytes spilled, and still the fastest measured (bench/RESULTS.md C103)
        assert r["spill_stores"] <= (16 if name == "f32_4096" else 0), (name, r)
        assert r["smem"] <= r["smem_limit"], (name, r)
    # the shipped coarse threshold drops the sample's second digit pass: its count's barrier and its scan's two
    assert reports["f32_stream"]["needles"]["bar.sync"] == reports["f32_fine_stream"]["needles"]["bar.sync"] - 3


@needs_dsl
def test_every_bucket_is_a_valid_build():
    from dsa.cute.topk_sm90 import TopkSm90

    from dsa.cute.topk_stream_sm90 import TopkStreamSm90, smem_bytes

    for s_max, _, _ in ct.BUCKETS:
        for k in ct.K_BUCKETS:
            for dtype in ct.DTYPES:
                # raises on a bad split or too much shared memory
                TopkSm90(ct.config(dtype, s_max, k, True, stream=False))
    for k in ct.K_BUCKETS:
        for dtype in ct.DTYPES:
            cfg = ct.config(dtype, 10**6, k, False)
            TopkStreamSm90(cfg)
            # a buffer holds k entries and one round's
            assert cfg.cap == cfg.k_max + cfg.round and smem_bytes(cfg) < 100 * 1024


def test_rows_stream_above_the_resident_lengths():
    from dsa.cute.topk_stream_sm90 import TopkStreamSm90Config

    assert not ct.streams(ct.RESIDENT_MAX) and ct.streams(ct.RESIDENT_MAX + 4)
    assert ct.bucket(ct.RESIDENT_MAX) is not None
    assert isinstance(ct.config(torch.float32, 1 << 20, 2048, True), TopkStreamSm90Config)
    assert isinstance(ct.config(torch.float32, 4096, 2048, True, stream=True), TopkStreamSm90Config)
    assert not isinstance(ct.config(torch.float32, 4096, 2048, True), TopkStreamSm90Config)


def test_buckets():
    assert ct.bucket(1) == ct.BUCKETS[0] and ct.bucket(4096)[0] == 4096 and ct.bucket(4097)[0] == 8192
    assert all(len(b) == 3 for b in ct.BUCKETS)
    assert ct.bucket(ct.BUCKETS[-1][0] + 1) is None
    assert [ct.k_bucket(k) for k in (1, 1024, 1025, 2048, 4096)] == [1024, 1024, 2048, 2048, 4096]


def test_supports_reasons(monkeypatch):
    a = TopkArgs(torch.zeros(4, 4096), 2048)
    assert "CUDA" in ct.supports(a)  # tensors on the CPU
    monkeypatch.setattr(ct, "sm90_reason", lambda device, what: None)
    assert ct.supports(a) is None
    assert "fp32 / fp16 / bf16" in ct.supports(TopkArgs(torch.zeros(4, 4096, dtype=torch.float64), 8))
    assert ct.supports(TopkArgs(torch.zeros(2, 49152 + 4), 8)) is None  # long rows stream
    assert "k up to 4096" in ct.supports(TopkArgs(torch.zeros(2, 8192), 4097))
    assert "16-byte" in ct.supports(TopkArgs(torch.zeros(2, 4098), 8))
    assert "16-byte" in ct.supports(TopkArgs(torch.zeros(2, 4100, dtype=torch.bfloat16), 8))
    assert "16-byte" in ct.supports(TopkArgs(torch.zeros(2 * 4096 + 1)[1:].view(2, 4096), 8))


def test_shipped_placement_names_measured_lengths():
    # the H200's measured range: 4096 .. 131072 columns (bench/RESULTS.md C108, C112)
    assert ct.PLACEMENT["NVIDIA H200"] == ((4096, 131072),)


def test_placement(monkeypatch):
    a = TopkArgs(torch.zeros(4, 4096), 2048)
    monkeypatch.setattr(ct, "device_name", lambda device: "NVIDIA H100")
    monkeypatch.setattr(ct, "PLACEMENT", {"NVIDIA H200": ((2048, 8192),)})
    assert ct.placement_reason(a) == ct.NOT_MEASURED
    monkeypatch.setattr(ct, "device_name", lambda device: "NVIDIA H200")
    assert ct.placement_reason(a) is None
    assert "Triton measured faster" in ct.placement_reason(TopkArgs(torch.zeros(4, 1024), 2048))
    assert "not measured" in ct.placement_reason(TopkArgs(torch.zeros(4, 16384), 2048))


def test_cute_backend_on_cpu_says_why():
    with pytest.raises(ValueError, match="cute.*CUDA"):
        dsa.topk_indices(torch.randn(4, 64), 8, backend="cute")


def _hostile_rows(R: int, S: int, gen: torch.Generator) -> torch.Tensor:
    """Few distinct values (ties at every cut), NaN, +-inf, -0.0 / +0.0,
    rows with nothing or little selectable, and a row of one value."""
    x = torch.randint(-3, 4, (R, S), device="cuda", generator=gen).float()
    x[::3, ::7] = NAN
    x[1::3, ::5] = -INF
    x[2::3, ::11] = INF
    x[0] = -INF
    x[1] = NAN
    x[2, 1:] = -INF  # one selectable key
    x[3] = -0.0
    x[4, ::2] = 0.0
    x[5] = 1.5
    return x


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("S,k,dtype", [
    (128, 7, torch.float32), (4096, 2048, torch.float32), (4096, 4096, torch.bfloat16), (5000, 1, torch.float16),
    (8192, 1024, torch.float32), (16384, 2048, torch.float32), (16384, 300, torch.bfloat16),
    (32768, 2048, torch.float16), (49152, 4096, torch.float32), (49152, 2048, torch.bfloat16),
    (65536, 2048, torch.float32), (65540, 1024, torch.float32), (131072, 4096, torch.bfloat16)])
def test_gpu_contract(S, k, dtype):
    """randn rows (the cut inside a digit: all three passes), hostile rows
    (ties at the cut, early exits, rows with fewer than k valid keys), and
    row ends past, before and inside the row; outputs poisoned first."""
    if (S * torch.tensor([], dtype=dtype).element_size()) % 16:
        pytest.skip("rows not 16-byte aligned: declined (tested in test_supports_reasons)")
    gen = torch.Generator(device="cuda").manual_seed(S + k)
    R = 48
    for x in (torch.randn(R, S, device="cuda", generator=gen), _hostile_rows(R, S, gen)):
        x = x.to(dtype)
        ends = torch.randint(-5, S + 50, (R,), device="cuda", dtype=torch.int32, generator=gen)
        for e in (None, ends):
            idx = torch.full((R, k), 12345, dtype=torch.int32, device="cuda")
            lens = torch.full((R,), 12345, dtype=torch.int32, device="cuda")
            ct.launch(x, k, idx, lens, e)
            ref = x if e is None else x.masked_fill(
                torch.arange(S, device="cuda")[None, :] >= e.clamp(0, S)[:, None].long(), -INF)
            want_idx, want_len = topk_contract(ref, k)
            assert torch.equal(lens, want_len), (S, k, dtype, e is not None)
            assert torch.equal(idx, want_idx), (S, k, dtype, e is not None)


def _sample_columns(L: int, threads: int) -> torch.Tensor:
    """The columns the streaming kernel samples in a row of L keys (one 4-key vector a thread)."""
    start = torch.arange(threads) * ((L // 4) // threads) * 4
    return (start[:, None] + torch.arange(4)[None, :]).reshape(-1)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("S,k,build", [
    (1000, 7, {}), (6000, 300, {}), (12288, 2048, {}), (12288, 4096, {}), (40000, 2048, {}), (65536, 1, {}),
    (65536, 2048, {"vectors": 1, "prefetch": 0}), (65536, 1024, {"threads": 128, "margin4": 4}),
    (100000, 2048, {"min_blocks": 3, "samples": 2, "margin4": 8}), (65536, 2048, {"vectors": 2}),
    (20000, 1024, {"threads": 512, "vectors": 1}), (40000, 2048, {"coarse": False, "margin4": 6}),
    (65536, 1024, {"coarse": False, "margin4": 4})])
def test_gpu_stream_contract(S, k, build):
    """The streaming kernel on rows it holds whole (no sample), on long rows
    where the sample sets the threshold, and on rows made to defeat it: the
    sampled columns far above the rest (too few candidates: the row is
    streamed again from every key) and far below (every key a candidate:
    the buffer compacted again and again); hostile rows compact on ties.
    Row ends inside, before and past the row; outputs poisoned first."""
    gen = torch.Generator(device="cuda").manual_seed(S + k)
    R = 24
    cfg = ct.config(torch.float32, S, k, True, stream=True, **build)
    high = torch.randn(R, S, device="cuda", generator=gen)
    low = high.clone()
    cols = _sample_columns(S, cfg.threads).cuda()
    high[:, cols] = 1e30
    low[:, cols] = -1e30
    for x in (torch.randn(R, S, device="cuda", generator=gen), _hostile_rows(R, S, gen), high, low):
        ends = torch.randint(-5, S + 50, (R,), device="cuda", dtype=torch.int32, generator=gen)
        ends[: R // 2] = S  # the crafted rows' sample is that of the whole row
        for e in (None, ends):
            idx = torch.full((R, k), 12345, dtype=torch.int32, device="cuda")
            lens = torch.full((R,), 12345, dtype=torch.int32, device="cuda")
            ct.launch(x, k, idx, lens, e, cfg if e is not None else ct.config(torch.float32, S, k, False, stream=True,
                                                                              **build))
            ref = x if e is None else x.masked_fill(
                torch.arange(S, device="cuda")[None, :] >= e.clamp(0, S)[:, None].long(), -INF)
            want_idx, want_len = topk_contract(ref, k)
            assert torch.equal(lens, want_len), (S, k, build, e is not None)
            assert torch.equal(idx, want_idx), (S, k, build, e is not None)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
def test_gpu_public_cute_equals_triton():
    x = torch.randn(300, 8192, device="cuda")
    ends = torch.arange(300, device="cuda", dtype=torch.int32) * 31
    for e in (None, ends):
        a = dsa.topk_indices(x, 2048, row_ends=e, return_lengths=True, backend="cute")
        b = dsa.topk_indices(x, 2048, row_ends=e, return_lengths=True, backend="triton")
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.gpu
def test_gpu_triton_k1_with_row_ends_on_the_list_path():
    """k == 1 reaches the list build as a constant (Triton specialises 1):
    the row-ends sample plan must not call tensor methods on it."""
    x = torch.randn(64, 16384, device="cuda")
    ends = torch.randint(0, 16384, (64,), device="cuda", dtype=torch.int32)
    idx, lens = dsa.topk_indices(x, 1, row_ends=ends, return_lengths=True, backend="triton")
    ref = x.masked_fill(torch.arange(16384, device="cuda")[None, :] >= ends[:, None].long(), -INF)
    want_idx, want_len = topk_contract(ref, 1)
    assert torch.equal(idx, want_idx) and torch.equal(lens, want_len)


def _indexer_args(Tq: int, Tk: int, max_seqlen_k: int, device="cpu") -> IndexerArgs:
    return IndexerArgs(torch.randn(Tq, 4, 32, device=device), torch.randn(Tk, 32, device=device),
                       torch.randn(Tq, 4, device=device), torch.tensor([0, Tq], dtype=torch.int32, device=device),
                       torch.tensor([0, Tk], dtype=torch.int32, device=device),
                       torch.zeros(1, dtype=torch.int64, device=device), max_seqlen_k, 1, True, 0.1)


def test_indexer_topk_supports_and_placement(monkeypatch):
    from dsa.cute import indexer_topk as cix

    a = _indexer_args(8, 64, 64)
    assert "CUDA" in cix.supports(a)
    monkeypatch.setattr(cix, "sm90_reason", lambda device, what: None)
    assert cix.supports(a) is None
    assert "multiple of 4" in cix.supports(_indexer_args(8, 66, 66))
    monkeypatch.setattr(cix, "device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(cix, "PLACEMENT", {})
    assert cix.placement_reason(a) == cix.NOT_MEASURED
    monkeypatch.setattr(cix, "PLACEMENT", {"NVIDIA H200": ((32, 128),)})
    assert cix.placement_reason(a) is None and "cute top-k" in cix.placed_note(a)
    assert "measured faster or not measured" in cix.placement_reason(_indexer_args(8, 64, 256))
    assert "k above 4096" in cix.indexer_topk.note


def test_indexer_topk_routes_k_to_a_top_k_kernel(monkeypatch):
    """k up to the cute top-k's limit selects with it; above, with Triton's (the default launch)."""
    from dsa.cute import indexer_topk as cix
    from dsa.triton import indexer as ti

    seen = []
    monkeypatch.setattr(ti, "indexer_topk", lambda a, k, launch_topk=None: seen.append((k, launch_topk)))
    a = _indexer_args(8, 64, 64)
    cix.indexer_topk(a, ct.K_MAX)
    cix.indexer_topk(a, ct.K_MAX + 1)
    assert seen == [(ct.K_MAX, ct.launch), (ct.K_MAX + 1, None)]


def test_chunked_topk_takes_another_top_k_launch(monkeypatch):
    """The chunks' rows, their ends and the output rows reach the given launch."""
    from dsa.triton import indexer as ti

    monkeypatch.setattr(ti, "TOPK_CHUNK_FLOATS", 64)  # chunks of 2 rows at 32 columns: several chunks
    a = _indexer_args(5, 32, 32)
    calls = []

    def launch(scores, k, indices, lengths, ends=None):
        calls.append((scores.shape, indices.shape, None if ends is None else ends.shape))
        indices.fill_(len(calls))
        lengths.fill_(k)

    idx, lens = ti.chunked_topk(a, 1, 16, lambda *args: None, buffers=1, row_ends_=True, launch_topk=launch)
    assert calls == [((2, 32), (2, 1), (2,)), ((2, 32), (2, 1), (2,)), ((1, 32), (1, 1), (1,))]
    assert idx[:, 0].tolist() == [1, 1, 2, 2, 3] and lens.tolist() == [1] * 5


def test_indexer_topk_shipped_placement():
    from dsa.cute import indexer_topk as cix

    # measured at max_seqlen_k 16384, 32768 and 65536 (bench/RESULTS.md C109)
    assert cix.PLACEMENT["NVIDIA H200"] == ((16384, 65536),)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an SM90 GPU")
@pytest.mark.parametrize("sq,sk,ratio,k", [(2048, 2048, 1, 512), (4096, 8192, 4, 2048), (3000, 20000, 1, 1024),
                                           (1024, 12288, 1, 5000)])
def test_gpu_indexer_topk_cute_equals_triton(sq, sk, ratio, k):
    """The cute path's chunks (resident rows, streamed rows, and k above
    the cute top-k's limit) select exactly what the Triton op does."""
    gen = torch.Generator(device="cuda").manual_seed(sq + sk)
    q = torch.randn(1, sq, 8, 64, device="cuda", generator=gen).bfloat16()
    kk = torch.randn(1, sk, 64, device="cuda", generator=gen).bfloat16()
    w = torch.randn(1, sq, 8, device="cuda", generator=gen).bfloat16()
    a = dsa.indexer_topk(q, kk, w, k, ratio=ratio, return_lengths=True, backend="cute")
    b = dsa.indexer_topk(q, kk, w, k, ratio=ratio, return_lengths=True, backend="triton")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert "cute top-k" in dsa.explain("indexer_topk", q, kk, w, k, ratio=ratio, backend="cute")
