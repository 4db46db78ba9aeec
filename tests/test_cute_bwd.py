"""The CuTe DSL SM90 sparse attention backward.

* CPU (CI): the kernel compiles ahead of time for sm_90a with no GPU
  (``CUTE_DSL_ARCH=sm_90a``) in a subprocess, with wgmma, the cp.async
  gather and the dkv reduction (fp32 vector atomics, each value first
  rounded to its row's grid in the deterministic build) in its PTX, and so
  does the deterministic mode's slot-bound kernel; the host logic (what it serves, the
  per-row terms, the kv row of each slot) is checked against float64; the
  routing with a faked SM90 device: ``backend="cute"`` runs the backward,
  auto declines it with its reason, the compile cache's key, the launch
  under the device with the shared zero row.
* GPU (``-m gpu``, an SM90 device): dq, dkv and dsink against the float64
  reference at V3.2-like and V4-like shapes, GQA, every sink case, random
  topk_length (0, negative, past K), hostile indices, NaN in kv rows no valid
  slot reads; deterministic mode bitwise repeatable; the public path
  ``dsa.sparse_attention(..., backend="cute")`` forward and backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import types

import pytest
import torch

import bruteforce as bf
import dsa
from cute_offline import HAVE_DSL, SERIALIZED, SM90, fake_launch, ptx_counts
from dsa import reference as ref
from dsa._args import SparseAttnArgs, Unsupported
from dsa.cute import sparse_attention as cute_sa
from dsa.cute import sparse_attention_bwd as cbwd

INF = float("inf")
needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl is not installed")


# --------------------------------------------------------------------------
# ahead-of-time compilation (CPU)

_NEEDLES = (
    "wgmma.mma_async", "cp.async.cg.shared.global", "cp.async.mbarrier.arrive.noinc",
    "red.relaxed.gpu.global.add.v4.f32", "red.relaxed.gpu.global.add.L2::cache_hint.v4.f32", "createpolicy",
    "st.global.v4.f32", "st.global.L2::cache_hint.v4.f32", "shfl.sync", "cp.async.cg.shared.global.L2::cache_hint",
    "st.global.L2::cache_hint.b32",
    "setmaxnreg.inc", "setmaxnreg.dec", "mbarrier.try_wait", "bar.sync",
    "bar.arrive", "add.rn.f32", "sub.rn.f32", "%smid", "%clock64", "%globaltimer", "cp.async.bulk.tensor",
    "mbarrier.arrive.expect_tx")

_CONFIGS = [
    ("v32_bf16_len", "bfloat16", 576, 128, 1, True, False, {}),
    # the other build options: no L2 hint, every dkv chunk on warpgroup 1, Delta from the preprocess
    ("fp16_d512_h64_nohint", "float16", 512, 64, 1, False, False,
     {"evict_last": False, "c0_chunks": 0, "kernel_delta": False}),
    # the deterministic build: each value rounded to its row's grid before the add
    ("v32_bf16_det", "bfloat16", 576, 128, 1, True, True, {}),
    # a tensor-parallel shard: 16 heads a kv head, one tile padded to 64 rows
    ("tp16_bf16_len", "bfloat16", 576, 16, 1, True, False, {}),
    # the timeline build (bench_cute_bwd.py --timeline): the SM clock at a tile's marks
    ("v4_bf16_timeline", "bfloat16", 512, 64, 1, False, False, {"timeline": True}),
    # the dq stores from registers after the tile's last adds (the build before dq_early and dq_tma)
    ("v32_bf16_len_dq_late", "bfloat16", 576, 128, 1, True, False, {"dq_early": False, "dq_tma": False}),
    # dq_early's stores from registers rather than through the stage by TMA
    ("v32_bf16_len_dq_regs", "bfloat16", 576, 128, 1, True, False, {"dq_tma": False}),
    # Q, dO and out by the tensor memory accelerator (a padded tile keeps the cp.async)
    ("v32_bf16_tma", "bfloat16", 576, 128, 1, True, False, {"tma_rows": True}),
    ("tp32_bf16_tma", "bfloat16", 576, 32, 1, True, False, {"tma_rows": True}),
    # a timing build: the dkv chunks' wgmma left out, their adds kept
    ("v4_bf16_no_dkv_mma", "bfloat16", 512, 64, 1, False, False, {"dkv_mma": False}),
]


@needs_dsl
def test_sm90_backward_compiles_offline_with_hopper_instructions(tmp_path):
    calls = [(name, [f"torch.{dt}", D, H, G, has_len, det], {"build": build})
             for name, dt, D, H, G, has_len, det, build in _CONFIGS]
    res = ptx_counts("dsa.cute.sparse_attention_bwd:compile_offline_backward", calls, _NEEDLES, "sm_90a",
                     tmp_path)
    for name, dt, D, H, G, has_len, det, build in _CONFIGS:
        r = res[name]
        assert not r[SERIALIZED], (name, r)  # wgmma back to back, none serialised for lack of registers
        hint = build.get("evict_last", cbwd.BUILD["evict_last"])
        # per block: S (D / 16) and dP (d_v / 16) on consumer 0, dQ (4 a
        # tile, one tile on each consumer and the RoPE one), dkv (2 per value
        # chunk, 1 per RoPE chunk, and step of 16 real heads of the tile)
        steps = min(H // G, 64) // 16
        # kernel_delta (never in the deterministic build): Delta as dO out^T once a tile
        kd = build.get("kernel_delta", cbwd.BUILD["kernel_delta"]) and not det
        dkv_mma = build.get("dkv_mma", True)
        n_wgmma = (D // 16 + 512 // 16 + 2 * 4 + 4 * (D > 512) + dkv_mma * steps * (2 * 8 + (D > 512))
                   + kd * 512 // 16)
        assert r["wgmma.mma_async"] == n_wgmma, (name, r)
        assert r["cp.async.cg.shared.global"] >= D // 64 * 4, (name, r)  # the gather
        assert r["cp.async.mbarrier.arrive.noinc"] >= 2, (name, r)       # Q and dO; each block
        # per thread and 64-column chunk: 8 four-float adds, two rows of 16
        # floats; under the L2 policy made once a thread
        n_out = 8 * (D // 64)
        hints = build.get("l2_hints", cbwd.BUILD["l2_hints"])
        assert r["st.global.v4.f32"] == 0 and r["st.global.L2::cache_hint.v4.f32"] == 0, (name, r)
        assert r["red.relaxed.gpu.global.add.L2::cache_hint.v4.f32"] == (n_out if hint else 0), (name, r)
        assert r["red.relaxed.gpu.global.add.v4.f32"] == (0 if hint else n_out), (name, r)
        # deterministic: every added value first put on its row's grid by two adds
        assert r["add.rn.f32"] == r["sub.rn.f32"] == (4 * n_out if det else 0), (name, r)
        # evict-last for the adds (one in each consumer), evict-first for Q / dO and dq (l2_hints 3)
        assert r["createpolicy"] >= (2 if hint else 0) + bool(hints), (name, r)
        n_q = (D + 512 + kd * 512) // 64 * 4   # Q's, dO's (and out's) 16-byte copies a thread
        # tma_rows: those rows as 64 x 64 boxes by one warp's bulk copies instead, on a tile of 64 heads
        tma = build.get("tma_rows", False) and H // G >= 64
        dq_tma = build.get("dq_tma", cbwd.BUILD["dq_tma"]) and H // G >= 64  # dq's D / 64 boxes
        assert r["cp.async.bulk.tensor"] == tma * n_q // 4 + dq_tma * D // 64, (name, r)
        assert r["mbarrier.arrive.expect_tx"] == tma, (name, r)
        n_q *= not tma
        assert r["cp.async.cg.shared.global.L2::cache_hint"] == (n_q if hints & 1 else 0), (name, r)
        n_dq = 128 + 16 * (D > 512)  # dq words a thread: 64 a warpgroup, 16 more for the RoPE columns
        # in the loop's last block (unless by boxes) and for a row with none
        n_dq *= 1 + (build.get("dq_early", cbwd.BUILD["dq_early"]) and not dq_tma)
        assert r["st.global.L2::cache_hint.b32"] == (n_dq if hints & 2 else 0), (name, r)
        # 16 shuffles a chunk, one per float of the swapped halves of lines
        assert 16 * (D // 64) <= r["shfl.sync"] < 17 * (D // 64), (name, r)
        # two warpgroups of up to 255 registers: none moved between them
        assert r["setmaxnreg.inc"] == 0 and r["setmaxnreg.dec"] == 0, (name, r)
        assert r["mbarrier.try_wait"] >= 3, (name, r)
        # the dS / P hand-off between the consumers: written (READY), free again (FREE);
        # and warpgroup 0's Delta in shared memory (DELTA)
        assert r["bar.sync"] >= 2 + kd and r["bar.arrive"] >= 2, (name, r)
        # timeline: nine marks a tile from both clocks and the SM's id; no clock read in the other builds
        marks = build.get("timeline", False)
        assert r["%smid"] == marks and r["%clock64"] == r["%globaltimer"] == 9 * marks, (name, r)


@needs_dsl
def test_timeline_spans_read_each_thread_and_the_global_timer():
    """``bench_cute_bwd.timeline_spans``: one thread's spans from the SM clock,
    the spans across warpgroups and the gaps between an SM's tiles from the
    global timer (whose large values survive the float conversion), tiles
    without a block left out of the block spans, and the warpgroup clocks'
    disagreement counted."""
    from bench.bench_cute_bwd import timeline_spans
    from dsa.cute import sparse_attention_bwd_sm90 as k

    hz, t_ns = 2e9, 1_700_000_000_000_000_000  # 2 GHz; a global timer near today's
    # per tile: (sm, start us, Q, Delta, block 0, loop 0, end 0, hand-off, loop 1, end 1), us from its start;
    # block 0 at 0 for the tile without blocks; the SM clock of warpgroup 1 of tile 0 read 3 us early
    tiles = [(0, 0.0, 2, 3, 4, 10, 12, 5, 14, 16), (0, 17.0, 2, 3, 4, 10, 12, 5, 14, 16),
             (5, 0.0, 2, 3, 4, 10, 12, 5, 14, 16), (5, 18.0, 2, 3, None, 3, 5, None, 3, 6)]
    marks = torch.zeros((4, k.TL_N), dtype=torch.int64)
    order = (k.TL_Q, k.TL_DELTA, k.TL_BLOCK0, k.TL_LOOP0, k.TL_END0, k.TL_READY1, k.TL_LOOP1, k.TL_END1)
    for i, (sm, start, *at) in enumerate(tiles):
        marks[i, k.TL_SM] = sm
        marks[i, k.TL_START] = round((1000.0 + start) * 1e-6 * hz)
        marks[i, k.TL_NS + k.TL_START] = t_ns + round(start * 1e3)
        for mark, us_ in zip(order, at):
            if us_ is None:
                continue
            skew = 3.0 if i == 0 and mark in (k.TL_READY1, k.TL_LOOP1, k.TL_END1) else 0.0
            marks[i, mark] = round((1000.0 + start + us_ - skew) * 1e-6 * hz)
            marks[i, k.TL_NS + mark] = t_ns + round((start + us_) * 1e3)
    # the SMs' spans by their clocks: 33 us (SM 0, tiles from 0 to 33) and 24 (SM 5, 0 to 24); their
    # median (the upper of two) in a 0.033 ms kernel puts the clock at 2 GHz
    r = timeline_spans(marks, 0.033)
    assert r["hz"] == pytest.approx(hz, rel=1e-6) and r["sms"] == 2
    us = lambda v: r["us"](v.mean().item())  # noqa: E731
    assert us(r["part"]["Q, dO, out in"]) == pytest.approx(2.0)
    assert us(r["part"]["block 0 in"]) == pytest.approx(1.0)      # the tile without blocks left out
    assert us(r["part"]["wg0 blocks"]) == pytest.approx(6.0)
    assert us(r["part"]["wg1 dq store"]) == pytest.approx((2 + 2 + 2 + 3) / 4)
    assert r["cross"]["wg1 first hand-off"].mean().item() == pytest.approx(5000.0)
    assert r["cross"]["tile"].tolist() == [16000.0, 16000.0, 16000.0, 6000.0]
    assert r["gap_ns"] == pytest.approx((1000.0 + 2000.0) / 2)   # SM 0: 17 - 16 us; SM 5: 18 - 16 us
    assert r["early"] == pytest.approx(1 / 3) and r["early_ns"] == 0.0
    assert r["step"] == pytest.approx(1000.0)  # the closest two starts: 17 and 18 us


_BOUND_NEEDLES = ("wgmma.mma_async", "cp.async.cg.shared.global", "cp.async.mbarrier.arrive.noinc", "ex2.approx",
                  "st.global.v2.b32", "shfl.sync", "mbarrier.try_wait", "red.relaxed", "red.global.add", "atom.global",
                  "abs.bf16x2", "max.bf16x2", "abs.f16x2", "max.f16x2", "ld.shared.v4.b32")

# (name, dtype, D, H, G, has_len): heads a CTA, consumers
_BOUND_CONFIGS = [
    ("v32_bf16_len", "bfloat16", 576, 128, 1, True),   # 128 heads: two consumers, a ring of one block
    ("fp16_d512_h64", "float16", 512, 64, 1, False),   # one consumer, two blocks in the ring
    ("tp16_bf16", "bfloat16", 576, 16, 1, True),       # a shard: S^T's N is 16, no padding
    ("gqa_256x2_d512", "bfloat16", 512, 512, 2, False),  # 256 heads a kv head: two parts of 128
]


@needs_dsl
def test_slot_bound_kernel_compiles_offline_with_hopper_instructions(tmp_path):
    """The deterministic mode's bound kernel (``slot_bound_sm90``) for sm_90a:
    per consumer and block, D / 16 wgmma (S^T chunk by chunk, the chunk loop
    unrolled), the gather's 16-byte cp.async (Q once, then 4 a chunk, the
    producer's two-block step unrolled), max|q| on packed halves from 16-byte
    loads, one exp2 per accumulator element,
    the head sums across the quad, one 8-byte store of (X, Y) per slot, no
    atomics, no spill (the register split between producer and consumers
    included), within the shared memory the launch may take: two CTAs an
    SM for parts of up to 64 heads."""
    from cute_offline import compile_reports

    from dsa.cute.slot_bound_sm90 import SlotBoundSm90

    calls = [(name, "dsa.cute.sparse_attention_bwd:compile_offline_bound", [f"torch.{dt}", D, H, G, has_len], {})
             for name, dt, D, H, G, has_len in _BOUND_CONFIGS]
    res = compile_reports(calls, _BOUND_NEEDLES, "sm_90a", tmp_path)
    import cutlass

    for name, dt, D, H, G, has_len in _BOUND_CONFIGS:
        r, n = res[name], res[name]["needles"]
        k = SlotBoundSm90(cutlass.BFloat16 if dt == "bfloat16" else cutlass.Float16, D, H, G, has_len)
        # the block loop unrolled by two (two accumulators), each block's sums
        # in the next block's first chunk or after the loop
        assert n["wgmma.mma_async"] == 2 * k.consumers * D // 16, (name, n)
        q_copies = k.consumers * (k.hc // 16) * (D // 64)
        ring = 2 * 4 * (D // 64)
        assert q_copies + ring <= n["cp.async.cg.shared.global"] <= 2 * q_copies + ring, (name, n)
        assert n["ex2.approx"] == 4 * k.consumers * 64 * k.hc // 128, (name, n)
        assert n["st.global.v2.b32"] == 8 * k.consumers, (name, n)
        assert n["shfl.sync"] >= 8 * k.consumers, (name, n)
        assert n["red.relaxed"] == n["red.global.add"] == n["atom.global"] == 0, (name, n)
        # max|q| of the heads' weights: 16-byte loads of Q, abs and max on packed halves of its dtype
        half, other = ("bf16x2", "f16x2") if dt == "bfloat16" else ("f16x2", "bf16x2")
        assert n[f"abs.{half}"] == n[f"max.{half}"] > 0 and n[f"max.{other}"] == 0, (name, n)
        assert n["ld.shared.v4.b32"] >= n[f"max.{half}"] // 4, (name, n)
        # the 256-head GQA build (two parts, two consumers, G 2) keeps one word in local memory
        assert r["spill_stores"] <= (4 if name == "gqa_256x2_d512" else 0) and not r["wgmma_serialized"], (name, r)
        assert r["smem"] * k.ctas <= r["smem_limit"], (name, r)
    assert res["v32_bf16_len"]["smem"] > 200 * 1024  # Q [128, 576] and a ring of ten chunks


# --------------------------------------------------------------------------
# host logic (CPU)


def _args(T=4, N=32, H=64, G=1, D=576, K=64, dtype=torch.bfloat16, sink=False, length=False,
          device="cpu", deterministic=False, gen=None):
    gen = gen or torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    kv = torch.randn(N, G, D, generator=gen).to(dtype)
    idx = torch.randint(0, N, (T, G, K), generator=gen, dtype=torch.int32)
    tl = torch.randint(-3, K + 5, (T,), generator=gen, dtype=torch.int32) if length else None
    s = torch.randn(H, generator=gen) if sink else None
    a = SparseAttnArgs(q.to(device), kv.to(device), idx.to(device), None if tl is None else tl.to(device),
                       None if s is None else s.to(device), 1.0 / math.sqrt(D), 512, deterministic)
    return a


def test_supports_backward_needs_a_cuda_device():
    assert "CUDA" in cbwd.supports_backward(_args())
    with pytest.raises(ValueError, match="CUDA"):
        cbwd.backward(_args(), torch.zeros(4, 64, 512), torch.zeros(4, 64), torch.zeros(4, 64, 512))


@needs_dsl
def test_shape_reasons():
    assert cbwd.shape_reason(_args()) is None
    assert cbwd.shape_reason(_args(D=512, H=128, G=2)) is None
    assert "bf16 or fp16" in cbwd.shape_reason(_args(dtype=torch.float32))
    assert "D=256" in cbwd.shape_reason(_args(D=256))
    # 16 and 32 heads per kv head run as one padded tile; other counts below 64 do not
    assert cbwd.shape_reason(_args(H=32)) is None and cbwd.shape_reason(_args(H=16)) is None
    assert cbwd.shape_reason(_args(H=64, G=4)) is None
    assert "multiple of 64" in cbwd.shape_reason(_args(H=48))
    assert "multiple of 64" in cbwd.shape_reason(_args(H=128, G=16))
    assert "multiple of 64" in cbwd.shape_reason(_args(H=96))
    a = _args()
    mixed = SparseAttnArgs(a.q, a.kv.half(), a.indices, None, None, a.sm_scale, 512)
    assert "differs" in cbwd.shape_reason(mixed)
    short = SparseAttnArgs(a.q, a.kv, a.indices, None, None, a.sm_scale, 448)
    assert "d_v=448" in cbwd.shape_reason(short)


@pytest.mark.parametrize("D", [512, 576])
def test_natural_columns_undo_the_fragment_order(D):
    """The kernel writes column 8 h + 2 q + e of each 16-column group at
    4 q + 2 h + e (lane q of a quad holds columns 8 j + 2 q + {0, 1});
    natural_columns puts each back, in one pass to the output dtype."""
    nat = torch.randn(3, 2, D)
    frag = torch.empty_like(nat)
    for m in range(D // 16):
        for q in range(4):
            for h in range(2):
                for e in range(2):
                    frag[..., 16 * m + 4 * q + 2 * h + e] = nat[..., 16 * m + 8 * h + 2 * q + e]
    got = cbwd.natural_columns(frag, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.is_contiguous() and torch.equal(got, nat.to(torch.bfloat16))
    assert torch.equal(cbwd.natural_columns(frag, torch.float32), nat)


def test_dkv_copies_spread_the_adds_within_the_budget():
    """The deterministic backward's dkv copies: about ADDS_PER_COPY adds a kv
    row each (V3.2: 2048 adds a row over 8 copies of 512 tokens), never more
    copies than tokens or than COPY_BUDGET bytes hold, and every token's copy
    t // tokens-a-copy below the count."""
    def copies(**kw):
        return cbwd.dkv_copies(_fake_sm90_args(**kw))

    assert copies(T=4096, N=8192, K=2048) == (8, 512)
    assert copies(T=4096, N=8192, K=2048, H=64) == (4, 1024)     # one head block: half the adds
    assert copies(T=4, N=64, K=2048) == (1, 4)                    # 256 adds a row
    assert copies(T=4, N=16, K=2048) == (4, 1)                    # at most one copy a token
    assert copies(T=0, N=64, K=2048) == (1, 1)
    assert copies(T=100, N=1 << 20, K=16) == (1, 100)             # few adds a row: one copy
    big = copies(T=65536, N=1 << 17, K=2048)                      # 302 MB a copy: the budget caps them
    assert big[0] == cbwd.COPY_BUDGET // ((1 << 17) * 576 * 4) == 3
    for T in (1, 7, 100, 4097):
        n, tpc = copies(T=T, N=64, K=2048)
        assert (T - 1) // tpc == n - 1 if T else n == 1


def test_exact_dkv_host_steps(monkeypatch):
    """The deterministic SM90 backward's host side, kernels faked: the slot
    bounds from the preprocess's terms (its dO stats, not dO), the rows' grids for ``dkv_copies``
    copies, one launch over every token into zeroed copies with those grids,
    then the copies summed in order into kv's dtype (each fake launch adds
    its copy's index + 1 to it, so the sum shows every copy counted once)."""
    from dsa.triton import dkv_quanta

    monkeypatch.setattr(cbwd, "ADDS_PER_COPY", 4)
    a = _args(T=6, N=32, H=128, K=64, deterministic=True)
    copies, tpc = cbwd.dkv_copies(a)
    assert (copies, tpc) == (6, 1)
    calls = []
    dout, lg2den, delta = torch.randn(6, 128, 512), torch.randn(6, 128), torch.randn(6, 128)
    stats = torch.rand(6, 128, 2)
    xy = torch.rand(2, 6, 1, 64, 2)

    def bounds(a_, lg2, st, dl):
        calls.append("bounds")
        assert a_ is a and lg2 is lg2den and st is stats and dl is delta
        return xy

    def quanta(xy_, idx, length, vn, N, c, t):
        calls.append("quanta")
        assert xy_ is xy and idx is a.indices and length is None and vn.shape == (32, 1) and (N, c, t) == (32, 6, 1)
        return torch.full((c, N, 1), 3.0)

    def launch(a_, do, lg2, dl, dq, buf, t0, tc, magic, t):
        calls.append("launch")
        assert do is dout and (t0, tc, t) == (0, 6, 1) and magic.shape == (6, 32, 1) and buf.shape == (6, 32, 1, 576)
        assert not buf.any()
        buf += torch.arange(1.0, 7.0)[:, None, None, None]

    monkeypatch.setattr(cbwd, "slot_bounds", bounds)
    monkeypatch.setattr(dkv_quanta, "dkv_quanta", quanta)
    monkeypatch.setattr(cbwd, "_launch", launch)
    dkv = cbwd._exact_dkv(a, dout, stats, lg2den, delta, torch.empty_like(a.q))
    assert calls == ["bounds", "quanta", "launch"]
    assert dkv.dtype == a.kv.dtype and dkv.shape == (32, 1, 576) and torch.equal(dkv, torch.full_like(dkv, 21.0))


def test_exact_dkv_takes_the_forward_bounds(monkeypatch):
    """Given the forward's bounds, the deterministic backward's slot bounds
    come from them (``forward_bounds`` on their two views, with the
    preprocess's terms, q, topk_length and the scale) and the bound kernel
    does not run; bounds of the wrong size or dtype are refused."""
    from dsa.triton import dkv_quanta

    a = _args(T=5, N=32, H=128, K=100, deterministic=True)
    n = cute_sa.bound_numel(a)
    hs_shape, lv_shape = cute_sa.bound_shapes(a)
    assert hs_shape == (5, 1, 2, 2, 4, 64) and lv_shape == (5, 2, 128) and n == 5 * 2 * 2 * 256 + 5 * 2 * 128
    bounds = torch.arange(n, dtype=torch.float32)
    dout, lg2den, delta = torch.randn(5, 128, 512), torch.randn(5, 128), torch.randn(5, 128)
    stats = torch.rand(5, 128, 2)
    xy = torch.rand(2, 5, 1, 100, 2)
    calls = []

    def fwd_bounds(hs, lv, q, st, dl, lg2, length, K, scale):
        calls.append("forward_bounds")
        assert hs.shape == hs_shape and lv.shape == lv_shape and hs.data_ptr() == bounds.data_ptr()
        assert lv[0, 0, 0] == hs.numel() and q is a.q and st is stats and dl is delta and lg2 is lg2den
        assert length is None and K == 100 and scale == a.sm_scale
        return xy

    monkeypatch.setattr(cbwd, "slot_bounds", lambda *x: calls.append("bound kernel"))
    monkeypatch.setattr(dkv_quanta, "forward_bounds", fwd_bounds)
    monkeypatch.setattr(dkv_quanta, "dkv_quanta", lambda xy_, *rest: calls.append(xy_ is xy) or torch.ones(1, 32, 1))
    monkeypatch.setattr(cbwd, "_launch", lambda *x: calls.append("launch"))
    cbwd._exact_dkv(a, dout, stats, lg2den, delta, torch.empty_like(a.q), bounds)
    assert calls == ["forward_bounds", True, "launch"]
    for bad in (bounds[1:], bounds.double()):
        with pytest.raises(ValueError, match="bounds"):
            cbwd._exact_dkv(a, dout, stats, lg2den, delta, torch.empty_like(a.q), bad)


# --------------------------------------------------------------------------
# backend routing (CPU, a faked SM90 device)


def _fake_sm90_args(deterministic=False, q_ptr=1024, **kw):
    """A stand-in for SparseAttnArgs on an SM90 device (V3.2's shape)."""
    q = types.SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cuda", 0), data_ptr=lambda: q_ptr)
    base = dict(q=q, kv=types.SimpleNamespace(dtype=torch.bfloat16, data_ptr=lambda: 2048), D=576, d_v=512,
                H=128, G=1, T=4, N=64, K=2048, topk_length=None, sink=None, deterministic=deterministic,
                kernel_dtype_reason=lambda: None)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def _declined(args, auto: bool) -> str:
    with pytest.raises(Unsupported) as e:
        dsa.cute.backend_op("sparse_attention_bwd", args, auto=auto)
    return str(e.value)


@pytest.fixture
def no_bwd_table(monkeypatch, tmp_path):
    from dsa.cute import placement

    monkeypatch.setattr(placement, "TABLE_BWD", str(tmp_path / "absent.json"))


@needs_dsl
@pytest.mark.parametrize("deterministic", [False, True])
def test_backend_cute_runs_the_backward_and_auto_keeps_triton_without_a_table(sm90, no_bwd_table, deterministic):
    a = _fake_sm90_args(deterministic)
    assert dsa.cute.backend_op("sparse_attention_bwd", a, auto=False) is cbwd.backward
    why = _declined(a, auto=True)
    assert why.startswith("no placement table ships for this GPU") and "backend='cute' runs the kernel" in why


@needs_dsl
def test_auto_places_tensor_parallel_shards_by_their_own_entries(sm90, monkeypatch):
    """With the shipped tables on an H200: a V3.2 shard of 16 heads (T 4096)
    goes to the cute backward by a padded-tile entry and stays on the Triton
    forward, one of 32 heads takes the cute forward too, one at K 128 stays
    on Triton, and fp16 shards are placed by fp16 entries of their own."""
    from dsa.cute import sparse_attention as cute_sa

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    fwd = dsa.cute.backend_op("sparse_attention_fwd", _fake_sm90_args(H=32, T=4096), auto=True)
    assert fwd.fn is cute_sa.forward and "H/G=32 K=2048" in fwd.note, fwd.note
    with pytest.raises(Unsupported, match="says triton is faster"):
        dsa.cute.backend_op("sparse_attention_fwd", _fake_sm90_args(H=16, T=4096), auto=True)
    chosen = dsa.cute.backend_op("sparse_attention_bwd", _fake_sm90_args(H=16, T=4096), auto=True)
    assert chosen.fn is cbwd.backward and "H/G=16 K=2048" in chosen.note, chosen.note
    assert "says triton is faster" in _declined(_fake_sm90_args(H=16, T=8192, K=128), auto=True)
    fp16 = types.SimpleNamespace(dtype=torch.float16, device=torch.device("cuda", 0), data_ptr=lambda: 1024)
    kv16 = types.SimpleNamespace(dtype=torch.float16, data_ptr=lambda: 2048)
    chosen16 = dsa.cute.backend_op("sparse_attention_bwd", _fake_sm90_args(H=32, T=4096, q=fp16, kv=kv16), auto=True)
    assert chosen16.fn is cbwd.backward and "float16 D=576 H/G=32" in chosen16.note, chosen16.note


@needs_dsl
def test_auto_takes_the_cute_backward_where_its_table_says_so(sm90, monkeypatch, tmp_path):
    """The backward's own table (placement_sm90_bwd.json), measured on this
    GPU, decides auto by the nearest entry; the forward's table does not."""
    import json

    from dsa.cute import placement

    entry = dict(dtype="bfloat16", D=576, HG=128, K=2048, T=4096, cute_ms=14.2, triton_ms=48.4)
    doc = {"device": "NVIDIA H200", "entries": [dict(entry, backend="cute"),
                                                dict(entry, T=16, backend="triton", cute_ms=0.2, triton_ms=0.1)]}
    path = tmp_path / "bwd.json"
    path.write_text(json.dumps(doc))
    monkeypatch.setattr(placement, "TABLE_BWD", str(path))
    monkeypatch.setattr(placement, "TABLE", str(tmp_path / "absent.json"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    chosen = dsa.cute.backend_op("sparse_attention_bwd", _fake_sm90_args(T=2048), auto=True)
    assert chosen.fn is cbwd.backward and "'bfloat16 D=576 H/G=128 K=2048 T=4096'" in chosen.note, chosen.note
    why = _declined(_fake_sm90_args(T=8), auto=True)
    assert "T=16'" in why and "says triton is faster" in why, why
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H20")
    assert "measured on NVIDIA H200; this GPU is NVIDIA H20" in _declined(_fake_sm90_args(T=2048), auto=True)


@needs_dsl
def test_backward_the_kernel_cannot_serve_is_declined_with_its_reason(sm90, no_bwd_table, monkeypatch):
    for auto in (False, True):
        assert "multiple of 64" in _declined(_fake_sm90_args(H=96), auto)
        assert "D=256" in _declined(_fake_sm90_args(D=256), auto)
        assert "16-byte aligned" in _declined(_fake_sm90_args(q_ptr=1032), auto)
    from dsa.cute.sparse_attention_bwd_sm90 import SparseAttnBwdSm90

    monkeypatch.setattr(SparseAttnBwdSm90, "can_implement", staticmethod(lambda *a: "the kernel's own reason"))
    assert _declined(_fake_sm90_args(), auto=False) == "the kernel's own reason"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "SM80" in _declined(_fake_sm90_args(), auto=False)


@needs_dsl
def test_compiled_kernels_are_cached_per_config_and_device(monkeypatch):
    import cutlass.cute as cute

    configs = []
    monkeypatch.setattr(cute, "compile", lambda kernel, *args, **kw: configs.append(kernel.config) or object())
    monkeypatch.setattr(cbwd, "_COMPILED", {})
    on_1 = types.SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cuda", 1), data_ptr=lambda: 1024)
    calls = [_fake_sm90_args(), _fake_sm90_args(q=on_1), _fake_sm90_args(), _fake_sm90_args(deterministic=True)]
    fns = [cbwd._compiled(a) for a in calls]
    # the same config on another device is compiled again; a repeated call is not
    assert fns[2] is fns[0] and len({id(f) for f in fns}) == 3 and len(configs) == 3
    assert configs[0] == configs[1] == cbwd.kernel_config(calls[0]) and configs[2].deterministic
    monkeypatch.setattr(cbwd, "BUILD", dict(cbwd.BUILD, c0_chunks=0))  # a build option is part of the key
    assert cbwd._compiled(calls[0]) is not fns[0] and configs[3].c0_chunks == 0


def test_launch_runs_under_the_device_with_the_shared_zero_row(monkeypatch):
    """The zero row is dsa.cute.host's (made outside any CUDA-graph capture)
    and the pointers, stream and kernel are taken under a's device."""
    pytest.importorskip("cutlass")
    events, launched, zero = fake_launch(monkeypatch, cbwd, 576)
    a = _fake_sm90_args(indices="idx", sm_scale=0.5)
    cbwd._launch(a, "dout", "lg2den", "delta", "dq", "dkv", 0, 4, out="out")
    dev = a.q.device
    assert events == [("enter", dev), ("zero_row", dev, torch.bfloat16, 576), ("stream", dev), ("exit", dev)]
    (args,) = launched
    assert args[9] is zero and args[2] == "idx" and args[3] == "idx" and args[-1] == "stream"


def test_kernel_delta_launch_passes_out_and_needs_it(monkeypatch):
    """The kernel_delta build (the default) gets the forward's out as its
    last pointer and refuses a launch without it; the deterministic build
    never computes Delta itself (its grids need Delta before the kernel),
    and its builder refuses to."""
    pytest.importorskip("cutlass")
    from dsa.cute.sparse_attention_bwd_sm90 import SparseAttnBwdSm90

    assert cbwd.BUILD["kernel_delta"]
    events, launched, zero = fake_launch(monkeypatch, cbwd, 576)
    a = _fake_sm90_args(indices="idx", sm_scale=0.5)
    assert cbwd.kernel_config(a).kernel_delta
    assert not cbwd.kernel_config(_fake_sm90_args(deterministic=True)).kernel_delta
    with pytest.raises(ValueError, match="pass out"):
        cbwd._launch(a, "dout", "lg2den", "delta", "dq", "dkv", 0, 4)
    cbwd._launch(a, "dout", "lg2den", "delta", "dq", "dkv", 0, 4, out="out")
    (args,) = launched
    assert args[11] == "out" and args[6] == "delta" and args[-1] == "stream"
    import cutlass

    with pytest.raises(ValueError, match="kernel_delta serves the default build"):
        SparseAttnBwdSm90(cutlass.BFloat16, 576, 512, 128, 1, False, True, kernel_delta=True)


@pytest.mark.parametrize("sink", [False, True])
def test_kernel_delta_host_steps(monkeypatch, sink):
    """With kernel_delta the preprocess skips out and dO (delta=False) and
    the launch, given out contiguous and the call's config, writes Delta;
    dsink is then the sum of the preprocess's -p_sink times that Delta."""
    pytest.importorskip("cutlass")
    from dsa.triton import sparse_attention as tsa

    a = _args(T=3, N=16, H=64, K=64, sink=sink)
    out = torch.randn(64, 3, 512).transpose(0, 1)  # not contiguous: the launch gets a contiguous copy
    lse, dout = torch.randn(3, 64), torch.randn(3, 64, 512)
    delta_k = torch.randn(3, 64)  # what the fake kernel writes
    neg_psink = -torch.rand(3, 64)
    calls = []

    def preprocess(a_, o, l_, do, stats, delta=True):
        calls.append(("preprocess", delta))
        d = torch.full((3, 64), float("nan")) if not delta else torch.ones(3, 64)
        return d, torch.zeros(3, 64), (neg_psink.clone() if sink else None)

    def launch(a_, do, lg2, dl, dq, buf, t0, tc, magic=None, tpc=1, out=None, cfg=None):
        calls.append(("launch", out is not None))
        assert cfg == cbwd.kernel_config(a)  # made once a call, passed on
        assert out.is_contiguous() and torch.equal(out, out_ref)
        dl.copy_(delta_k)

    out_ref = out
    monkeypatch.setattr(tsa, "preprocess", preprocess)
    monkeypatch.setattr(cbwd, "_launch", launch)
    monkeypatch.setattr(cbwd, "supports_backward", lambda a: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    dq, dkv, dsink = cbwd.backward(a, out, lse, dout)
    assert calls == [("preprocess", False), ("launch", True)]
    if sink:
        torch.testing.assert_close(dsink, (neg_psink * delta_k).sum(0), rtol=0, atol=0)
    else:
        assert dsink is None


def test_other_ops_are_still_declined():
    with pytest.raises(Unsupported, match="no kernel for indexer_fwd"):
        dsa.cute.backend_op("indexer_fwd", _fake_sm90_args(), auto=False)


@needs_dsl
def test_explain_shows_why_auto_sends_the_backward_to_triton(monkeypatch, no_bwd_table):
    """explain() of a call the cute backward serves: under auto its reason is
    listed for cute; with backend="cute" both ops run on cute.  CPU tensors
    stand in for an SM90 GPU's (the device checks are faked)."""
    from dsa import selector

    monkeypatch.setattr(cbwd, "sm90_reason", lambda device, what: None)
    # the forward's auto choice reads the GPU's name: not under test here
    monkeypatch.setattr(cute_sa, "supports", lambda a: "the forward is not under test")
    monkeypatch.setattr(selector, "_device_type", lambda args: "cuda")
    for var in ("DSA_DISABLE_CUTE", "DSA_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(4, 64, 576, generator=gen).to(torch.bfloat16)
    kv = torch.randn(32, 576, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, 32, (4, 64), generator=gen, dtype=torch.int32)
    text = dsa.explain("sparse_attention", q, kv, idx)
    bwd = text[text.index("sparse_attention_bwd: backend"):]
    assert "sparse_attention_bwd: backend 'cute'" not in text, text
    assert "cute: no placement table ships for this GPU" in bwd, text
    monkeypatch.setattr(cute_sa, "supports", lambda a: None)
    text = dsa.explain("sparse_attention", q, kv, idx, backend="cute", deterministic=True)
    assert "sparse_attention_fwd: backend 'cute'" in text and "sparse_attention_bwd: backend 'cute'" in text, text


# --------------------------------------------------------------------------
# GPU

gpu = pytest.mark.skipif(not (SM90 and HAVE_DSL), reason="needs an SM90 GPU and nvidia-cutlass-dsl")


@pytest.fixture(autouse=True)
def _build(monkeypatch):
    """DSA_TEST_CUTE_BWD_BUILD (JSON, e.g. '{"c0_chunks": 0}') runs the GPU
    tests on another build of the kernel (sparse_attention_bwd.BUILD)."""
    extra = os.environ.get("DSA_TEST_CUTE_BWD_BUILD")
    if extra:
        monkeypatch.setattr(cbwd, "BUILD", dict(cbwd.BUILD, **json.loads(extra)))


def _poison(nbytes: int) -> None:
    """Leave NaN in freed blocks of the caching allocator, so that an output
    the kernel fails to write shows up as NaN."""
    x = torch.full((nbytes // 4 + 1,), float("nan"), device="cuda")
    del x


def _case(T, N, H, G, D, K, dtype, sink=None, lengths=None, hostile=False, nan_rows=False, seed=0,
          deterministic=False):
    """Arguments at a given shape.  Valid slots name rows of the first half
    of kv; with nan_rows the second half is NaN and every slot past
    topk_length names one of them.  hostile: out-of-range and duplicate
    indices among the slots."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    kv = torch.randn(N, G, D, generator=gen).to(dtype)
    clean = N // 2 if nan_rows else N
    idx = torch.randint(0, clean, (T, G, K), generator=gen, dtype=torch.int32)
    if hostile:
        idx[..., 8:24] = idx[..., 1:2]  # duplicates within a row
        idx[..., 0::7] = -5
        idx[..., 3::11] = N
        idx[..., 5::13] = 2**30
    tl = None
    if lengths is not None:
        tl = lengths.to(torch.int32)
        if nan_rows:
            past = torch.arange(K)[None, None, :] >= tl.clamp(0, K)[:, None, None]
            idx = torch.where(past, torch.randint(clean, N, (T, G, K), generator=gen, dtype=torch.int32), idx)
    if nan_rows:
        kv[clean:] = float("nan")
    s = None
    if sink is not None:
        s = torch.randn(H, generator=gen)
        for i, v in enumerate(sink):
            s[i] = v
    dev = "cuda"
    return SparseAttnArgs(q.to(dev), kv.to(dev), idx.to(dev), None if tl is None else tl.to(dev),
                          None if s is None else s.to(dev), 1.0 / math.sqrt(D), 512, deterministic)


def _f64(a: SparseAttnArgs) -> SparseAttnArgs:
    return SparseAttnArgs(a.q.double(), a.kv.double(), a.indices, a.topk_length,
                          None if a.sink is None else a.sink.double(), a.sm_scale, a.d_v)


def _run_and_check(a: SparseAttnArgs, seed=0):
    a64 = _f64(a)
    out64, lse64 = ref.sparse_attention_fwd(a64)
    gen = torch.Generator().manual_seed(seed + 100)
    dout = torch.randn(a.T, a.H, a.d_v, generator=gen).to(a.q.dtype).cuda()
    exp = ref.sparse_attention_bwd(a64, out64, lse64, dout.double())
    _poison(4 * (a.T * a.H * a.D + a.N * a.G * a.D))
    dq, dkv, dsink = cbwd.backward(a, out64.to(a.q.dtype), lse64.float(), dout)
    torch.cuda.synchronize()
    _report(dq, dkv, dsink, exp)
    assert dq.dtype == a.q.dtype and dkv.dtype == a.kv.dtype
    bf.assert_close(dq, exp[0], a.q.dtype, "dq")
    bf.assert_close(dkv, exp[1], a.q.dtype, "dkv")
    assert not torch.isnan(dq).any() and not torch.isnan(dkv).any()
    if a.sink is not None:
        assert dsink is not None and dsink.dtype == torch.float32
        bf.assert_close(dsink, exp[2], a.q.dtype, "dsink")
    else:
        assert dsink is None
    return dq, dkv, dsink, out64.to(a.q.dtype), lse64.float(), dout


def _check_bitwise_repeats(a: SparseAttnArgs, runs: int) -> None:
    """A deterministic call against float64, then runs - 1 more: every
    gradient bitwise equal to the first's."""
    dq, dkv, dsink, out, lse, dout = _run_and_check(a)
    for _ in range(runs - 1):
        dq2, dkv2, dsink2 = cbwd.backward(a, out, lse, dout)
        assert torch.equal(dq2, dq) and torch.equal(dkv2, dkv) and torch.equal(dsink2, dsink)


def _report(dq, dkv, dsink, exp):
    """Errors by column range (the consumers' shares) for a failing run's log."""
    for name, x, e in (("dq", dq, exp[0]), ("dkv", dkv, exp[1])):
        parts = []
        for c0, c1 in ((0, 256), (256, 512), (512, x.shape[-1])):
            if c1 > c0:
                xs, es = x[..., c0:c1].double().cpu(), e[..., c0:c1].cpu()
                parts.append(f"[{c0},{c1}) rel {bf.rel_l2(torch.nan_to_num(xs), es):.2e} nan {int(xs.isnan().sum())}")
        print(name, " ".join(parts))
    if dsink is not None:
        print("dsink rel", bf.rel_l2(dsink, exp[2]))


def _lengths(T, K, seed=3):
    gen = torch.Generator().manual_seed(seed)
    L = torch.randint(0, K + 1, (T,), generator=gen)
    L[0], L[1], L[2], L[3], L[4] = 0, -7, K + 100, 1, 65
    return L


@pytest.mark.gpu
@gpu
def test_v32_shape_full_rows_no_sink():
    a = _case(32, 4096, 128, 1, 576, 2048, torch.bfloat16)
    _run_and_check(a)


@pytest.mark.gpu
@gpu
def test_v32_shape_sinks_lengths_hostile_nan():
    T, K = 64, 2048
    a = _case(T, 4096, 128, 1, 576, K, torch.bfloat16, sink=[INF, -INF, 1e30, 3.4e38],
              lengths=_lengths(T, K), hostile=True, nan_rows=True)
    _run_and_check(a)


@pytest.mark.gpu
@gpu
def test_fp16_d512_h64_sink():
    a = _case(48, 2048, 64, 1, 512, 640, torch.float16, sink=[0.5, -INF])
    _run_and_check(a)


@pytest.mark.gpu
@gpu
def test_gqa_two_kv_heads_lengths_hostile():
    T, K = 40, 1152
    a = _case(T, 2048, 128, 2, 512, K, torch.bfloat16, sink=[INF], lengths=_lengths(T, K, 5), hostile=True,
              nan_rows=True)
    _run_and_check(a)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("H,G,D,dtype", [(16, 1, 576, torch.bfloat16), (32, 1, 576, torch.bfloat16),
                                         (32, 2, 512, torch.bfloat16), (16, 1, 576, torch.float16)],
                         ids=["h16", "h32", "gqa-2x16-d512", "h16-fp16"])
def test_tp_shard_heads_in_a_padded_tile(H, G, D, dtype):
    """16 or 32 query heads per kv head (a tensor-parallel shard) run as one
    64-row tile whose other rows are zero: every dq row written (the memory
    is NaN-poisoned), no padding row reaching dkv or dsink, and the last
    token's tile reading nothing past the tensors (its padding rows would
    lie past q's end)."""
    T, K = 24, 1152
    a = _case(T, 2048, H, G, D, K, dtype, sink=[INF, -INF, 1.0], lengths=_lengths(T, K, 11),
              hostile=True, nan_rows=True)
    _run_and_check(a)


@pytest.mark.gpu
@gpu
def test_tp_shard_deterministic_bitwise():
    T, K = 16, 1024
    a = _case(T, 1024, 16, 1, 576, K, torch.bfloat16, sink=[1.0], lengths=_lengths(T, K, 13), hostile=True,
              deterministic=True)
    _check_bitwise_repeats(a, 5)


@pytest.mark.gpu
@gpu
def test_deterministic_bitwise_over_runs(monkeypatch):
    # few adds a copy: twelve dkv copies of two tokens each
    monkeypatch.setattr(cbwd, "ADDS_PER_COPY", 8)
    assert cbwd.dkv_copies(_case(24, 1024, 128, 1, 576, 2048, torch.bfloat16)) == (12, 2)
    T, K = 24, 2048
    a = _case(T, 1024, 128, 1, 576, K, torch.bfloat16, sink=[1.0], lengths=_lengths(T, K, 7), hostile=True,
              deterministic=True)
    _check_bitwise_repeats(a, 10)


def _slot_terms(a: SparseAttnArgs, seed=0):
    """What the deterministic backward's bounds start from: (dout, the
    preprocess's lg2den, delta and dO stats), with float64 out and lse, and
    the weights [T, H, 2] in float64: max|dO_h| + |sm_scale| max|q_h|
    |Delta_h| and |sm_scale| max|q_h| ||dO_h||.  The stats are checked here:
    max|dO_h| exact, the norm within fp32 rounding of float64's."""
    from dsa.triton.sparse_attention import preprocess

    out64, lse64 = ref.sparse_attention_fwd(_f64(a))
    gen = torch.Generator().manual_seed(seed + 100)
    dout = torch.randn(a.T, a.H, a.d_v, generator=gen).to(a.q.dtype).cuda()
    stats = torch.full((a.T, a.H, 2), float("nan"), device="cuda")
    delta, lg2den, _ = preprocess(a, out64.to(a.q.dtype), lse64.float(), dout, stats)
    aq = abs(a.sm_scale) * a.q.double().abs().amax(-1)
    do = dout.double()
    assert torch.equal(stats[..., 0].double(), do.abs().amax(-1))
    assert torch.allclose(stats[..., 1].double(), do.norm(dim=-1), rtol=1e-5, atol=0)
    w = torch.stack([do.abs().amax(-1) + aq * delta.double().abs(), aq * do.norm(dim=-1)], -1)
    return dout, stats, lg2den, delta, w


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("H,G,D,dtype", [(128, 1, 576, torch.bfloat16), (64, 1, 512, torch.bfloat16),
                                          (64, 1, 512, torch.float16), (16, 1, 576, torch.bfloat16),
                                          (512, 2, 512, torch.bfloat16)],
                         ids=["h128", "h64-d512", "h64-d512-fp16", "h16", "gqa-256x2"])
def test_slot_bounds_against_float64_and_every_contribution(H, G, D, dtype):
    """The deterministic mode's slot bounds (``slot_bound_sm90``), output
    NaN-poisoned: X and Y of every valid slot equal the float64 head sums of
    P times the weights (the kernel's own, from Q in shared memory and the
    preprocess's dO stats; summed over the kernel's parts), and X + Y ||v_n||
    covers every column of the slot's float64 dkv contribution (the sum
    the backward adds), with sinks, topk_length, hostile indices and NaN in
    the rows no valid slot reads."""
    T, K = 12, 640
    a = _case(T, 1024, H, G, D, K, dtype, sink=[1.0, -INF, INF], lengths=_lengths(T, K, 17),
              hostile=True, nan_rows=True)
    dout, stats, lg2den, delta, w = _slot_terms(a)
    _poison(4 * 8 * T * G * K * 2)
    xy = cbwd.slot_bounds(a, lg2den, stats, delta)
    torch.cuda.synchronize()
    valid = _valid_slots(a)
    most, X, Y = _contributions(a, dout, lg2den, delta, valid, w)
    got = xy.double().sum(0)
    for name, x, e in (("X", got[..., 0], X), ("Y", got[..., 1], Y)):
        err = bf.rel_l2(x[valid], e[valid])
        assert err < 1e-4, (name, err)
    _assert_covers(a, xy, valid, most)


def _valid_slots(a: SparseAttnArgs) -> torch.Tensor:
    """[T, G, K] bool: slot j < clamp(topk_length, 0, K) and 0 <= index < N."""
    L = a.topk_length.long().clamp(0, a.K)
    idx = a.indices.long()
    return (torch.arange(a.K, device=idx.device)[None, None, :] < L[:, None, None]) & (idx >= 0) & (idx < a.N)


def _contributions(a: SparseAttnArgs, dout, lg2den, delta, valid, w=None):
    """float64 of each valid slot's dkv contribution (the sum the backward
    adds for it): (its largest column |value| [T, G, K], and with the
    weights w [T, H, 2] the head sums X = sum_h P w_h0, Y = sum_h P w_h1)."""
    T, G, K, HG = a.T, a.G, a.K, a.H // a.G
    safe = torch.where(valid, a.indices.long(), 0)
    most = torch.zeros(T, G, K, dtype=torch.float64, device=valid.device)
    X, Y = torch.zeros_like(most), torch.zeros_like(most)
    for g in range(G):
        heads = slice(g * HG, (g + 1) * HG)
        k = a.kv.double()[safe[:, g], g]                      # [T, K, D]
        q, do = a.q[:, heads].double(), dout[:, heads].double()
        S = torch.einsum("thd,tkd->thk", q, k) * a.sm_scale
        lg2 = lg2den[:, heads].double()
        P = torch.where(valid[:, g, None, :], torch.exp2(S * math.log2(math.e) - lg2[..., None]), 0.0)
        if w is not None:
            X[:, g] = torch.einsum("thk,th->tk", P, w[:, heads, 0].double())
            Y[:, g] = torch.einsum("thk,th->tk", P, w[:, heads, 1].double())
        dP = torch.einsum("thv,tkv->thk", do, k[..., :a.d_v])
        dS = P * (dP - delta[:, heads].double()[..., None]) * a.sm_scale
        c = torch.einsum("thk,thd->tkd", dS, q)
        c[..., :a.d_v] += torch.einsum("thk,thv->tkv", P, do)
        most[:, g] = c.abs().amax(-1)
    return most, X, Y


def _assert_covers(a: SparseAttnArgs, xy, valid, most) -> None:
    """xy [P, T, G, K, 2] (summed over P) written at every valid slot, and X +
    Y ||v_n|| covering the slot's largest float64 contribution ``most``."""
    from dsa.triton.dkv_quanta import value_norms

    got = xy.double().sum(0)
    assert not torch.isnan(got[valid]).any()
    safe = torch.where(valid, a.indices.long(), 0)
    vn = value_norms(a.kv, a.d_v).double()[safe, torch.arange(a.G, device=safe.device)[None, :, None]]
    bound = got[..., 0] + got[..., 1] * vn
    assert (most[valid] <= bound[valid] * (1 + 1e-4)).all()
    assert (bound[valid] > 0).any()


def _forward_levels(a: SparseAttnArgs, valid):
    """float64 of what the bounds build writes (``cute_sa.bound_views``):
    (head sums [T, G, HB, NB, 64], levels [T, NB, H]).  Block b is consumer
    b % 2's, whose row sum at b covers its own blocks b' <= b (b' = b mod 2):
    level = log2 of that sum of 2^(S scale log2(e)), p / l = 2^(S scale
    log2(e) - level)."""
    T, H, G, K = a.T, a.H, a.G, a.K
    HG, nb = H // G, -(-K // 64)
    HB = -(-HG // 64)
    safe = torch.where(valid, a.indices.long(), 0)
    s2 = torch.empty(T, H, K, dtype=torch.float64, device="cuda")
    for g in range(G):
        k = a.kv.double()[safe[:, g], g]
        s = torch.einsum("thd,tkd->thk", a.q[:, g * HG:(g + 1) * HG].double(), k) * a.sm_scale * math.log2(math.e)
        s2[:, g * HG:(g + 1) * HG] = torch.where(valid[:, g, None, :], s, -INF)
    blk = torch.arange(K, device="cuda") // 64
    levels = torch.full((T, nb, H), -INF, dtype=torch.float64, device="cuda")
    pl = torch.zeros(T, H, K, dtype=torch.float64, device="cuda")
    for b in range(nb):
        own = (blk <= b) & (blk % 2 == b % 2)
        lvl = torch.logsumexp(s2[..., own] * math.log(2), -1) / math.log(2)   # [T, H]
        levels[:, b] = lvl
        cols = blk == b
        pl[..., cols] = torch.where(lvl[..., None] > -INF, torch.exp2(s2[..., cols] - lvl[..., None]), 0.0)
    hs = torch.zeros(T, G, HB, nb * 64, dtype=torch.float64, device="cuda")
    for g in range(G):
        for hb in range(HB):
            h0 = g * HG + hb * 64
            hs[:, g, hb, :K] = pl[:, h0:min(h0 + 64, (g + 1) * HG)].sum(1)
    return hs.view(T, G, HB, nb, 64), levels


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("H,G,D,dtype", [(128, 1, 576, torch.bfloat16), (64, 1, 512, torch.float16),
                                          (16, 1, 576, torch.bfloat16), (256, 2, 512, torch.bfloat16)],
                         ids=["h128", "h64-d512-fp16", "h16", "gqa-128x2"])
def test_forward_bounds_against_float64_and_every_contribution(H, G, D, dtype):
    """The deterministic cute forward's bounds (its head sums and levels,
    NaN-poisoned before the call) against float64 on every block a row
    computes, and the bounds ``forward_bounds`` makes of them covering every
    column of each valid slot's float64 dkv contribution; out and lse equal
    to the default build's; sinks, topk_length, hostile indices and NaN in
    the rows no valid slot reads."""
    from dsa.triton.dkv_quanta import forward_bounds
    from dsa.triton.sparse_attention import preprocess

    T, K = 12, 640
    a = _case(T, 1024, H, G, D, K, dtype, sink=[1.0, -INF, INF], lengths=_lengths(T, K, 17), hostile=True,
              nan_rows=True, deterministic=True)
    _poison(4 * cute_sa.bound_numel(a))
    out, lse, bounds = cute_sa.forward(a)
    out0, lse0 = cute_sa.forward(dataclasses.replace(a, deterministic=False))
    torch.cuda.synchronize()
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    hs, levels = cute_sa.bound_views(a, bounds)
    L = a.topk_length.long().clamp(0, K)
    valid = _valid_slots(a)
    hs64, lv64 = _forward_levels(a, valid)
    done = torch.arange(hs.shape[3], device="cuda")[None, :] < (-(-L // 64))[:, None]   # [T, NB] blocks computed
    got = hs.double().sum(4)                                                             # the warps' partials
    sel = done[:, None, None, :, None].expand_as(got)
    assert not torch.isnan(got[sel]).any()
    assert bf.rel_l2(got[sel], hs64[sel]) < 1e-4
    lsel = done[..., None].expand_as(levels)
    fin = lsel & (lv64 > -INF)
    assert torch.equal(levels.double()[lsel & ~fin], lv64[lsel & ~fin])
    assert (levels.double()[fin] - lv64[fin]).abs().max() < 1e-3
    # the contributions they bound
    gen = torch.Generator().manual_seed(100)
    dout = torch.randn(T, H, a.d_v, generator=gen).to(dtype).cuda()
    stats = torch.empty((T, H, 2), device="cuda")
    delta, lg2den, _ = preprocess(a, out, lse, dout, stats)
    xy = forward_bounds(hs, levels, a.q, stats, delta, lg2den, a.topk_length, K, a.sm_scale)
    _assert_covers(a, xy, valid, _contributions(a, dout, lg2den, delta, valid)[0])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("H,D", [(128, 576), (64, 512)])
def test_deterministic_from_forward_bounds_bitwise_and_float64(H, D, monkeypatch):
    """The deterministic backward given the cute forward's bounds: against
    float64 (NaN-poisoned outputs), bitwise equal over 10 runs, within the
    rounding of the default's dkv and of the bound kernel's; dq bitwise the
    default's with Delta from the same preprocess (no atomics in dq)."""
    T, K = 24, 2048
    a = _case(T, 1024, H, 1, D, K, torch.bfloat16, sink=[1.0, -INF], lengths=_lengths(T, K, 7), hostile=True,
              nan_rows=True, deterministic=True)
    out, lse, bounds = cute_sa.forward(a)
    gen = torch.Generator().manual_seed(8)
    dout = torch.randn(T, H, a.d_v, generator=gen).to(a.q.dtype).cuda()
    _poison(4 * (T * H * D + a.N * D) * 8)
    dq, dkv, dsink = cbwd.backward(a, out, lse, dout, bounds)
    a64 = _f64(a)
    out64, lse64 = ref.sparse_attention_fwd(a64)
    exp = ref.sparse_attention_bwd(a64, out64, lse64, dout.double())
    bf.assert_close(dq, exp[0], a.q.dtype, "dq")
    bf.assert_close(dkv, exp[1], a.q.dtype, "dkv")
    bf.assert_close(dsink, exp[2], a.q.dtype, "dsink")
    for _ in range(9):
        r = cbwd.backward(a, out, lse, dout, bounds)
        assert torch.equal(r[0], dq) and torch.equal(r[1], dkv) and torch.equal(r[2], dsink)
    monkeypatch.setattr(cbwd, "BUILD", dict(cbwd.BUILD, kernel_delta=False))
    free = cbwd.backward(dataclasses.replace(a, deterministic=False), out, lse, dout)
    own = cbwd.backward(a, out, lse, dout)
    assert torch.equal(free[0], dq)
    assert bf.rel_l2(dkv.double(), free[1].double()) < 5e-3
    assert bf.rel_l2(own[1].double(), free[1].double()) < 5e-3


@pytest.mark.gpu
@gpu
def test_deterministic_dkv_is_the_sum_of_its_rounded_adds(monkeypatch):
    """The deterministic dkv against the non-deterministic one on the same
    call: within the rounding the rows' grids allow (each (copy, row) at most
    2^-22 of its bound a value), and bitwise equal over runs while the
    default's atomics are free to differ; dq bitwise the default's with
    Delta from the same preprocess."""
    T, K = 32, 2048
    a = _case(T, 2048, 128, 1, 576, K, torch.bfloat16, sink=[1.0], lengths=_lengths(T, K, 23), hostile=True)
    det = SparseAttnArgs(*[getattr(a, f) for f in ("q", "kv", "indices", "topk_length", "sink", "sm_scale",
                                                   "d_v")], True)
    out64, lse64 = ref.sparse_attention_fwd(_f64(a))
    gen = torch.Generator().manual_seed(5)
    dout = torch.randn(T, a.H, a.d_v, generator=gen).to(a.q.dtype).cuda()
    out, lse = out64.to(a.q.dtype), lse64.float()
    runs = [cbwd.backward(det, out, lse, dout) for _ in range(3)]
    monkeypatch.setattr(cbwd, "BUILD", dict(cbwd.BUILD, kernel_delta=False))
    free = cbwd.backward(a, out, lse, dout)
    for r in runs[1:]:
        assert all(torch.equal(x, y) for x, y in zip(r[:2], runs[0][:2]))
    assert torch.equal(runs[0][0], free[0])  # dq takes no atomics
    assert bf.rel_l2(runs[0][1].double(), free[1].double()) < 5e-3


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("deterministic,H", [(False, 128), (True, 128), (False, 16)],
                         ids=["h128", "h128-det", "tp16"])
def test_public_path_backend_cute_forward_and_backward(monkeypatch, deterministic, H):
    """dsa.sparse_attention(..., backend="cute") and autograd: the cute
    forward and the cute backward (counted) against the float64 reference,
    MQA kv [N, D] and indices [T, K], sinks, topk_length and hostile indices;
    16 heads (a tensor-parallel shard) a padded tile in both."""
    T, K = 32, 1024
    a = _case(T, 2048, H, 1, 576, K, torch.bfloat16, sink=[INF, -INF, 2.0], lengths=_lengths(T, K, 9),
              hostile=True, nan_rows=True, seed=4, deterministic=deterministic)
    ran = []
    backward = cbwd.backward

    def counted(*args):
        ran.append(len(args))
        return backward(*args)

    counted.takes_bounds = True
    monkeypatch.setattr(cbwd, "backward", counted)
    q = a.q.clone().requires_grad_(True)
    kv = a.kv[:, 0].clone().requires_grad_(True)
    sink = a.sink.clone().requires_grad_(True)
    gen = torch.Generator().manual_seed(41)
    dout = torch.randn(T, a.H, a.d_v, generator=gen).to(a.q.dtype).cuda()
    _poison(4 * (T * a.H * a.D + a.N * a.D))
    out = dsa.sparse_attention(q, kv, a.indices[:, 0], sink=sink, topk_length=a.topk_length, sm_scale=a.sm_scale,
                               deterministic=deterministic, backend="cute")
    out.backward(dout)
    torch.cuda.synchronize()
    assert ran == [5 if deterministic else 4]  # the deterministic forward's bounds reach the backward
    a64 = _f64(a)
    out64, lse64 = ref.sparse_attention_fwd(a64)
    dq64, dkv64, dsink64 = ref.sparse_attention_bwd(a64, out64, lse64, dout.double())
    bf.assert_close(out, out64, a.q.dtype, "out")
    bf.assert_close(q.grad, dq64, a.q.dtype, "dq")
    bf.assert_close(kv.grad, dkv64[:, 0], a.q.dtype, "dkv")
    bf.assert_close(sink.grad, dsink64, a.q.dtype, "dsink")
    assert not torch.isnan(q.grad).any() and not torch.isnan(kv.grad).any()
