"""The cute tier's host logic on CPU: the placement table's guards, the
feasibility check, the compile cache's key, the zero row under CUDA-graph
capture, the cached DSL probe, and the shared device helpers' host-side
arithmetic (tile schedule, block counts, barrier ids, phases).

No GPU: the device, its name and capture state are faked with monkeypatch.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import re
import types
import warnings

import pytest
import torch

import dsa
from cute_offline import HAVE_DSL
from dsa._args import SparseAttnArgs, Unsupported
from dsa.cute import host, placement
from dsa.cute import sparse_attention as cute_sa

needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl is not installed")

GOOD_ENTRY = dict(dtype="bfloat16", D=576, HG=128, K=2048, T=4, backend="cute", cute_ms=1.0, triton_ms=2.0)


def _args(T=4, H=128, D=576, K=2048, N=64):
    q = torch.zeros(T, H, D, dtype=torch.bfloat16)
    kv = torch.zeros(N, 1, D, dtype=torch.bfloat16)
    idx = torch.zeros(T, 1, K, dtype=torch.int32)
    return SparseAttnArgs(q, kv, idx, None, None, D ** -0.5, 512, False)


def _write(tmp_path, doc, name="placement_sm90.json"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


@pytest.fixture
def cute_serves(monkeypatch):
    """The kernel 'serves' every call (its own checks need an SM90 GPU)."""
    monkeypatch.setattr(cute_sa, "supports", lambda a: None)


def _auto_reason(args) -> str:
    with pytest.raises(Unsupported) as e:
        dsa.cute.backend_op("sparse_attention_fwd", args, auto=True)
    return str(e.value)


# --------------------------------------------------------------------------
# the placement table: unreadable or from another GPU means no table

BAD_TABLES = {
    "bad-json": '{"device": "NVIDIA H200", "entries": [',
    "not-an-object": "[1, 2, 3]",
    "no-entries": {"device": "NVIDIA H200"},
    "no-device": {"entries": [GOOD_ENTRY]},
    "entry-missing-field": {"device": "NVIDIA H200", "entries": [{k: v for k, v in GOOD_ENTRY.items() if k != "K"}]},
    "entry-unknown-field": {"device": "NVIDIA H200", "entries": [dict(GOOD_ENTRY, speed=3)]},
    "entry-wrong-type": {"device": "NVIDIA H200", "entries": [dict(GOOD_ENTRY, K="2048")]},
    "entry-bad-backend": {"device": "NVIDIA H200", "entries": [dict(GOOD_ENTRY, backend="cudnn")]},
}


@pytest.mark.parametrize("doc", list(BAD_TABLES.values()), ids=list(BAD_TABLES))
def test_unreadable_placement_table_warns_once_and_auto_keeps_triton(tmp_path, monkeypatch, cute_serves, doc):
    path = _write(tmp_path, doc)
    monkeypatch.setattr(placement, "TABLE", path)
    with pytest.warns(RuntimeWarning, match="placement table unreadable") as caught:
        assert placement.entries() == []
    assert path in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read once: no second warning
        why = _auto_reason(_args())
        assert placement.entries() == []
    assert why.startswith("placement table unreadable: ") and path in why, why


def test_placement_table_of_another_gpu_is_not_used(tmp_path, monkeypatch, cute_serves):
    path = _write(tmp_path, {"device": "NVIDIA H200", "entries": [GOOD_ENTRY]})
    monkeypatch.setattr(placement, "TABLE", path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H20")
    why = _auto_reason(_args())
    assert "placement table measured on NVIDIA H200; this GPU is NVIDIA H20" in why, why

    # the same table on the GPU it was measured on decides
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    chosen = dsa.cute.backend_op("sparse_attention_fwd", _args(), auto=True)
    assert "placement table entry" in chosen.note


def test_explain_names_the_other_gpu(tmp_path, monkeypatch, cute_serves):
    """What explain() prints: the selector's reasons carry cute's sentence."""
    from dsa import selector

    path = _write(tmp_path, {"device": "NVIDIA H200", "entries": [GOOD_ENTRY]})
    monkeypatch.setattr(placement, "TABLE", path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H800")
    monkeypatch.setattr(selector, "_device_type", lambda args: "cuda")
    monkeypatch.delenv("DSA_DISABLE_CUTE", raising=False)
    monkeypatch.delenv("DSA_BACKEND", raising=False)
    text = selector.select("sparse_attention_fwd", _args()).describe("sparse_attention")
    assert "cute: placement table measured on NVIDIA H200; this GPU is NVIDIA H800" in text, text


def test_missing_placement_table_keeps_triton(tmp_path, monkeypatch, cute_serves):
    monkeypatch.setattr(placement, "TABLE", str(tmp_path / "absent.json"))
    assert placement.entries() == []
    assert "no placement table ships" in _auto_reason(_args())


def test_shipped_placement_table_names_its_gpu():
    if not os.path.exists(placement.TABLE):
        pytest.skip("no placement table shipped")
    table = placement.load()
    assert table.problem is None and table.entries
    assert table.device and table.device.startswith("NVIDIA")


# --------------------------------------------------------------------------
# the CuTe DSL probe runs once


def _dsl_reason_without(monkeypatch, package: str, calls: int = 1):
    """dsl_reason() asked ``calls`` times while importing ``package`` fails
    (fresh, then the cache cleared again): (the answers, the failed imports)."""
    real_import = builtins.__import__
    attempts = []

    def fake_import(name, *args, **kwargs):
        if name == package or name.startswith(package + "."):
            attempts.append(name)
            raise ImportError(f"no {package} here")
        return real_import(name, *args, **kwargs)

    host.dsl_reason.cache_clear()
    monkeypatch.setattr(builtins, "__import__", fake_import)
    try:
        answers = [host.dsl_reason() for _ in range(calls)]
    finally:
        monkeypatch.undo()
        host.dsl_reason.cache_clear()
    return answers, attempts


def test_failed_cutlass_import_is_not_retried(monkeypatch):
    (first, second), attempts = _dsl_reason_without(monkeypatch, "cutlass", calls=2)
    assert first == second and "not importable" in first and "no cutlass here" in first
    assert len(attempts) == 1, attempts


def test_a_missing_tvm_ffi_is_the_reason(monkeypatch):
    """The kernels are called through TVM-FFI: without apache-tvm-ffi the cute
    tier declines with that reason (the DSL itself importing)."""
    (why,), _ = _dsl_reason_without(monkeypatch, "tvm_ffi")
    if HAVE_DSL:
        assert "apache-tvm-ffi" in why and "no tvm_ffi here" in why, why
    else:
        assert "CuTe DSL" in why, why


@needs_dsl
def test_compile_kernel_builds_for_tvm_ffi_with_typed_arguments(monkeypatch):
    """compile_kernel asks for the TVM-FFI build (the calls pass integer
    addresses and Python numbers), pointers of the given types and
    alignments, scalars of the given types and a stream last."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    seen = []
    monkeypatch.setattr(cute, "compile", lambda kernel, *args, **kw: seen.append((kernel, args, kw)) or "fn")
    fn = host.compile_kernel("kernel", [(cutlass.BFloat16, 16), (cutlass.Int32, 4)],
                             [cutlass.Int32, cutlass.Float32], "--keep-ptx")
    (kernel, args, kw), = seen
    assert fn == "fn" and kernel == "kernel"
    assert kw["options"].split() == ["--enable-tvm-ffi", "--keep-ptx"]
    p0, p1, s0, s1, stream = args
    assert p0.dtype is cutlass.BFloat16 and p0._assumed_align == 16 and p1.dtype is cutlass.Int32
    assert p1._assumed_align == 4 and p0.memspace == cute.AddressSpace.gmem
    assert isinstance(s0, cutlass.Int32) and isinstance(s1, cutlass.Float32) and isinstance(stream, cuda.CUstream)


# --------------------------------------------------------------------------
# what the kernel can implement


@needs_dsl
@pytest.mark.parametrize("dtype,D,d_v,H,G,match", [
    ("BFloat16", 576, 512, 128, 1, None),
    ("Float16", 512, 512, 128, 2, None),
    ("BFloat16", 512, 512, 64, 1, None),
    ("Float32", 512, 512, 64, 1, "is not bf16 or fp16"),
    ("BFloat16", 640, 512, 64, 1, "D=640"),
    ("BFloat16", 576, 576, 64, 1, "d_v=576"),
    ("BFloat16", 512, 512, 32, 1, None),   # a tensor-parallel shard: one padded tile
    ("BFloat16", 576, 576 - 64, 32, 2, None),
    ("BFloat16", 512, 512, 48, 1, "48 query heads per kv head.*multiple of 64, or one of"),
    ("BFloat16", 512, 512, 192, 2, "96 query heads per kv head"),
    ("BFloat16", 512, 512, 128, 3, "do not split"),
])
def test_can_implement(dtype, D, d_v, H, G, match):
    import cutlass

    from dsa.cute.sparse_attention_sm90 import SparseAttnFwdSm90

    dt = getattr(cutlass, dtype)
    why = SparseAttnFwdSm90.can_implement(dt, D, d_v, H, G)
    if match is None:
        assert why is None
        SparseAttnFwdSm90(dt, D, d_v, H, G, True, True)
    else:
        assert why is not None and re.search(match, why), why
        with pytest.raises(ValueError, match=match):
            SparseAttnFwdSm90(dt, D, d_v, H, G, True, True)


@needs_dsl
def test_shared_memory_of_both_head_dims_fits():
    from dsa.cute.sparse_attention_sm90 import SMEM_LIMIT, smem_bytes

    # D 576: Q and two stages of 576 columns with P0 in the RoPE columns use
    # the whole 227 KB; D 512 needs P0 a buffer of its own.
    assert smem_bytes(576, 512, 2) == SMEM_LIMIT
    assert smem_bytes(512, 512, 2) < SMEM_LIMIT
    assert smem_bytes(640, 512, 2) > SMEM_LIMIT


def _fake_cuda_args(device_index=0, **kw):
    """A stand-in for SparseAttnArgs on an SM90 device."""
    q = types.SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cuda", device_index),
                              data_ptr=lambda: 1024)
    base = dict(q=q, kv=types.SimpleNamespace(dtype=torch.bfloat16, data_ptr=lambda: 2048), D=576, d_v=512,
                H=128, G=1, T=4, N=64, K=2048, topk_length=None, sink=None, deterministic=False,
                kernel_dtype_reason=lambda: None)
    base.update(kw)
    return types.SimpleNamespace(**base)


@needs_dsl
def test_supports_asks_the_kernel(monkeypatch):
    from dsa.cute.sparse_attention_sm90 import SparseAttnFwdSm90

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert cute_sa.supports(_fake_cuda_args()) is None
    assert "multiple of 64" in cute_sa.supports(_fake_cuda_args(H=96))
    assert "not bf16 or fp16" in cute_sa.supports(_fake_cuda_args(
        q=types.SimpleNamespace(dtype=torch.float32, device=torch.device("cuda", 0), data_ptr=lambda: 0),
        kv=types.SimpleNamespace(dtype=torch.float32, data_ptr=lambda: 0)))
    monkeypatch.setattr(SparseAttnFwdSm90, "can_implement", staticmethod(lambda *a: "the kernel's own reason"))
    assert cute_sa.supports(_fake_cuda_args()) == "the kernel's own reason"


# --------------------------------------------------------------------------
# the compile cache: one entry per (kernel config, device)


@needs_dsl
def test_compiled_kernels_are_cached_per_config_and_device(monkeypatch):
    import cutlass.cute as cute

    compiled = []

    def fake_compile(kernel, *args, **kwargs):
        compiled.append(kernel.config)
        return object()

    monkeypatch.setattr(cute, "compile", fake_compile)
    monkeypatch.setattr(cute_sa, "_COMPILED", {})
    a0, a1 = _fake_cuda_args(0), _fake_cuda_args(1)
    f0 = cute_sa._compiled(a0)
    f1 = cute_sa._compiled(a1)
    assert f0 is not f1 and len(compiled) == 2  # same config, another device: compiled again
    assert cute_sa._compiled(_fake_cuda_args(0)) is f0
    assert cute_sa._compiled(_fake_cuda_args(1)) is f1
    f2 = cute_sa._compiled(_fake_cuda_args(0, sink=object()))
    assert f2 is not f0 and len(compiled) == 3 and compiled[2].has_sink
    assert compiled[0] == cute_sa.kernel_config(a0) and compiled[0] == compiled[1]


# --------------------------------------------------------------------------
# the zero row is never made by a CUDA-graph capture


def test_zero_row_first_needed_under_capture_is_made_outside_it(monkeypatch):
    made = []

    def outside(make, device):
        made.append(device)
        return torch.zeros(8)

    monkeypatch.setattr(host, "_outside_capture", outside)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    dev = torch.device("cuda", 1)
    assert torch.equal(host._zero_row(8, torch.bfloat16, dev), torch.zeros(8))
    assert made == [dev]
    # a CPU row (never captured) is made in place
    row = host._zero_row(8, torch.float16, torch.device("cpu"))
    assert made == [dev] and row.dtype == torch.float16 and not row.any()


def test_outside_capture_makes_on_a_waited_side_stream_in_relaxed_mode(monkeypatch):
    events = []

    class FakeStream:
        def __init__(self, device):
            events.append(("stream", device))

        def synchronize(self):
            events.append("synchronize")

    @contextlib.contextmanager
    def fake_use(stream):
        events.append("enter stream")
        yield
        events.append("leave stream")

    @contextlib.contextmanager
    def fake_relaxed():
        events.append("relaxed")
        yield
        events.append("restored")

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", fake_use)
    monkeypatch.setattr(host, "_relaxed_capture_mode", fake_relaxed)
    dev = torch.device("cuda", 0)
    out = host._outside_capture(lambda: events.append("make") or torch.ones(2), dev)
    assert torch.equal(out, torch.ones(2))
    assert events == ["relaxed", ("stream", dev), "enter stream", "make", "leave stream", "synchronize",
                      "restored"]


def test_zero_rows_are_cached_per_device_dtype_and_D(monkeypatch):
    monkeypatch.setattr(host, "_ZEROS", {})
    cpu = torch.device("cpu")
    z = host.zero_row(cpu, torch.bfloat16, 512)
    assert z.shape == (512,) and z.dtype == torch.bfloat16 and not z.any()
    assert host.zero_row(cpu, torch.bfloat16, 512) is z
    assert host.zero_row(cpu, torch.bfloat16, 576) is not z
    assert host.zero_row(cpu, torch.float16, 512) is not z


# --------------------------------------------------------------------------
# the shared device modules' host-side arithmetic


@needs_dsl
def test_tile_schedule_covers_every_tile_once_head_blocks_fastest():
    from dsa.cute.scheduler import TileScheduler, tile_count

    T, G, HB, grid = 5, 2, 3, 4
    n = tile_count(T, G, HB)
    seen = []
    for cta in range(grid):
        s = TileScheduler(cta, n, grid, G, HB)
        for tile_id in range(s.first, s.n_tiles, s.stride):
            row, t, g, hblk = s.decode(tile_id)
            assert row == t * G + g
            seen.append((tile_id, t, g, hblk))
    seen.sort()
    assert [x[1:] for x in seen] == [(t, g, h) for t in range(T) for g in range(G) for h in range(HB)]


@needs_dsl
@pytest.mark.parametrize("n_tiles, grid", [(1, 4), (4, 4), (9, 4), (12, 4), (13, 4), (1000, 132), (8192, 132)])
def test_snake_order_runs_every_tile_once(n_tiles, grid):
    """``snake_position`` maps the positions a persistent grid walks onto
    its tiles one to one (the last, partial round reversed within itself),
    every CTA keeping its own positions' count."""
    from dsa.cute.scheduler import snake_position

    def select(c, a, b):
        return a if c else b

    runs = {c: [snake_position(p, grid, n_tiles, min, select) for p in range(c, n_tiles, grid)] for c in range(grid)}
    assert sorted(x for r in runs.values() for x in r) == list(range(n_tiles))
    for r in range(-(-n_tiles // grid)):
        width = min(grid, n_tiles - r * grid)
        got = [snake_position(r * grid + j, grid, n_tiles, min, select) for j in range(width)]
        assert got == [r * grid + (width - 1 - j if r % 2 else j) for j in range(width)]


@needs_dsl
def test_snake_order_over_descending_lengths_evens_the_ctas_out():
    """The point of the ordered build: tiles of rows uniform in [0, K] over a
    persistent grid.  Round-robin in token order leaves the busiest CTA
    well over the mean (the cost a tile: a fixed part and its slot blocks);
    the snake over tokens by descending length (``token_order``) within 2%."""
    from dsa.cute.scheduler import snake_position

    g = torch.Generator().manual_seed(0)
    T, HB, grid, K = 4096, 2, 132, 2048
    length = torch.randint(0, K + 1, (T,), generator=g)
    cost = (4 + (length + 63) // 64).repeat_interleave(HB)   # tiles head blocks fastest
    order = torch.argsort(length, descending=True)
    sorted_cost = cost.view(T, HB)[order].reshape(-1)
    plain = torch.zeros(grid, dtype=torch.long)
    snake = torch.zeros(grid, dtype=torch.long)
    for p in range(T * HB):
        plain[p % grid] += cost[p]
        snake[p % grid] += sorted_cost[snake_position(p, grid, T * HB, min, lambda c, a, b: a if c else b)]
    mean = cost.sum().item() / grid
    assert plain.max().item() / mean > 1.05
    assert snake.max().item() / mean < 1.02


def test_token_order_only_where_a_persistent_grid_has_rounds_to_even(monkeypatch):
    """``token_order``: None while ``ORDER_ROUNDS`` is None, without
    topk_length, for one CTA a tile and for at most ``ORDER_ROUNDS`` (4 by
    default) rounds of tiles; else the tokens by descending length (lengths
    outside [0, K] sort as given)."""
    length = torch.tensor([5, 70, -1, 64, 0, 200, 3, 9], dtype=torch.int32)
    call = lambda **kw: types.SimpleNamespace(**dict(dict(T=8, H=128, G=1, topk_length=length), **kw))  # noqa: E731
    assert cute_sa.ORDER_ROUNDS == 4
    assert cute_sa.token_order(call(), 4) is None and cute_sa.token_order(call(), 3) is not None  # 16 tiles
    monkeypatch.setattr(cute_sa, "ORDER_ROUNDS", None)
    assert cute_sa.token_order(call(), 1) is None
    monkeypatch.setattr(cute_sa, "ORDER_ROUNDS", 2)
    assert cute_sa.token_order(call(topk_length=None), 2) is None
    assert cute_sa.token_order(call(), 2**31 - 1) is None          # GridConfig(persistent=False)
    assert cute_sa.token_order(call(), 8) is None                  # 16 tiles: two rounds of 8
    order = cute_sa.token_order(call(), 5)                         # 16 tiles: more than two rounds of 5
    assert order.tolist() == [5, 1, 3, 7, 0, 6, 4, 2] and order.dtype == torch.int64
    assert cute_sa.token_order(call(H=16, G=1), 5) is None         # 8 padded tiles: one a token


@needs_dsl
def test_block_count_ends_at_the_last_valid_block():
    from dsa.cute.rules import block_count

    assert [block_count(L, 64) for L in (0, 1, 64, 65, 128, 2048)] == [0, 1, 1, 2, 2, 32]


@needs_dsl
def test_named_barrier_ids_are_checked_and_phases_alternate():
    from dsa.cute.pipeline import NamedBarrier, freed_phase, named_barriers, phase

    with pytest.raises(ValueError, match="1..15"):
        named_barriers(NamedBarrier("Bad", {"A": 0}))
    with pytest.raises(ValueError, match="unique"):
        named_barriers(NamedBarrier("Dup", {"A": 1, "B": 1}))
    ok = named_barriers(NamedBarrier("Ok", {"A": 1, "B": 15}))
    assert [int(m) for m in ok] == [1, 15]
    assert [phase(n) for n in range(4)] == [0, 1, 0, 1]
    # before its n-th fill a producer waits for the release of use n - 1
    assert [freed_phase(n) for n in range(1, 5)] == [phase(n - 1) for n in range(1, 5)]


def test_int32_sizes_count_padded_tiles():
    """A kv head of 16 query heads is one whole tile: 2^28 tokens of 8 such kv
    heads are 2^31 tiles (T * H / 64 would count a quarter of them)."""
    from dsa.cute.host import int32_reason

    call = lambda **kw: types.SimpleNamespace(**dict(dict(T=2**28, H=128, G=8, N=1, K=2048), **kw))  # noqa: E731
    assert "must fit in int32" in int32_reason(call())
    assert int32_reason(call(T=2**28 - 1)) is None
    assert int32_reason(call(G=1, T=2**26)) is None              # 2 tiles a token of 128 heads
    assert "must fit in int32" in int32_reason(call(G=1, T=2**30))
    assert "must fit in int32" in int32_reason(call(T=1, N=2**28))  # N x H_kv rows
    assert "must fit in int32" in int32_reason(call(T=1, K=2**31))
