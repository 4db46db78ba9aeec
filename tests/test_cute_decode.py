"""The CuTe DSL SM90 sparse decode (dsa/cute/decode.py, dsa/cute/decode_sm90.py).

* CPU (CI): the shipped decode builds compiled ahead of time for sm_90a
  (``CUTE_DSL_ARCH=sm_90a``, fake pointers) in a subprocess: the PTX holds
  the Hopper instructions the design rests on and ptxas reports no spills.
  Two builds run in CI (each compile takes about 20 s on two cores); set
  ``DSA_TEST_CUTE_DECODE_BUILDS=1`` to compile every other build as well.
  Then the host logic without a GPU: the split plan, every reason
  ``supports`` gives, the measured placement and the selector hook, and the
  launch's arguments (pointers, scalars, workspace, merge) with the
  compiled kernel faked.
* GPU (``-m gpu``, an SM90 device): every rule of docs/semantics.md's
  "Sparse decode" against the float64 brute force (small problems) or the
  reference backend in float64 (model shapes), on native (bf16, fp16),
  fp8_v32 and fp8_model1 caches, outputs NaN-poisoned before each call, at forced split
  counts that put split boundaries inside and at the ends of rows; the FP8
  dequantisation bit for bit; CUDA-graph capture without a host sync.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

import pytest
import torch

import bruteforce as bf
import dsa
from cute_offline import HAVE_DSL, ROOT, SM90, compile_reports
from gpu_checks import assert_replays_without_sync
from dsa._args import SparseDecodeArgs, Unsupported
from dsa.cute import decode as cdec

INF = float("inf")
ALL_BUILDS = os.environ.get("DSA_TEST_CUTE_DECODE_BUILDS", "") not in ("", "0")
needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl is not installed")

# --------------------------------------------------------------------------
# offline compilation for sm_90a

# name, kwargs of dsa.cute.decode.compile_offline (bf16 q): the first CI_BUILDS run in CI
BUILDS = [
    # V3.2 heads, a paged bf16 cache through a block table and seq_lens, split
    ("native_bt_split_h128", dict(H=128, cache="native", page_size=64, has_bt=True, has_seqlen=True, split=True)),
    # the same on the FP8 cache: the producer dequantises while it gathers
    ("fp8_bt_split_h128", dict(H=128, cache="fp8_v32", page_size=64, has_bt=True, has_seqlen=True, split=True)),
    # the same, staggered (the lockstep build's alternative, which fp8_model1 runs)
    ("fp8_bt_split_h128_staggered", dict(H=128, cache="fp8_v32", page_size=64, has_bt=True, has_seqlen=True,
                                         split=True, lockstep=False)),
    # FP8 with FlashMLA's slots, one split, no length, no sink, H 64
    ("fp8_slots_h64", dict(H=64, cache="fp8_v32", page_size=64, has_len=False, has_sink=False, has_bt=False,
                           has_seqlen=False, split=False)),
    # fp8_model1 (V4): D 512, per-page e8m0 scales, H 64, block table, split; and slots, one split, H 128
    ("fp8_model1_bt_split_h64", dict(H=64, D=512, cache="fp8_model1", page_size=64, has_bt=True,
                                     has_seqlen=True, split=True)),
    ("fp8_model1_slots_h128", dict(H=128, D=512, cache="fp8_model1", page_size=64, has_bt=False,
                                   has_seqlen=False, split=False)),
    # FlashMLA-style slots, one split (the row finished in the kernel), no length, no sink
    ("native_slots_h64", dict(H=64, cache="native", page_size=64, has_len=False, has_sink=False, has_bt=False,
                              has_seqlen=False, split=False)),
    # a flat cache (pages of one row), GQA, D 512
    ("native_flat_gqa_d512", dict(H=128, G=2, D=512, cache="native", page_size=1, has_bt=False, has_seqlen=False,
                                  split=True)),
    # fp8_v32 lockstep with two producer warpgroups (512 threads) without crossover, split; and one split
    # without length or sink
    ("fp8_bt_split_h128_dual", dict(H=128, cache="fp8_v32", page_size=64, has_bt=True, has_seqlen=True,
                                    split=True, dual=True, crossover=False)),
    ("fp8_slots_h64_dual", dict(H=64, cache="fp8_v32", page_size=64, has_len=False, has_sink=False, has_bt=False,
                                has_seqlen=False, split=False, dual=True)),
    # crossover (clusters of two CTAs, each converting half of every block's rows for both; fp8_v32's
    # default at H 128, so fp8_bt_split_h128 above is one): FlashMLA's slots, split; and a block table,
    # one split, no topk_length, H 256 (two pairs of head blocks)
    ("fp8_slots_split_h128_crossover", dict(H=128, cache="fp8_v32", page_size=64, has_bt=False,
                                            has_seqlen=False, split=True, dual=True, crossover=True)),
    ("fp8_bt_h256_crossover", dict(H=256, cache="fp8_v32", page_size=64, has_len=False, has_bt=True,
                                   has_seqlen=False, split=False, dual=True, crossover=True)),
]
CI_BUILDS = 2
NEEDLES = ("wgmma.mma_async", "cp.async.cg.shared.global", "cp.async.mbarrier.arrive.noinc", "setmaxnreg.inc",
           "setmaxnreg.dec", "mbarrier.try_wait", "st.global.v2.b32", "st.local", "ld.local",
           "cvt.rn.f16x2.e4m3x2", "cvt.rn.bf16x2.f32", "mul.rn.f32", "fence.proxy.async.shared::cta",
           "ld.global.v4", "st.shared.v4", "prefetch.global.L2", "griddepcontrol.wait",
           "griddepcontrol.launch_dependents", "mul.rn.bf16x2", "st.async.shared::cluster", "mapa.shared::cluster",
           "barrier.cluster.arrive", "barrier.cluster.wait", "mbarrier.expect_tx",
           "mbarrier.arrive.shared::cluster", "cp.async.bulk.shared::cluster")


def _builds():
    return [pytest.param(b, id=b[0], marks=() if i < CI_BUILDS or ALL_BUILDS else pytest.mark.skip(
        reason="set DSA_TEST_CUTE_DECODE_BUILDS=1 to compile it")) for i, b in enumerate(BUILDS)]


@needs_dsl
@pytest.mark.parametrize("build", _builds())
def test_decode_compiles_offline(build, tmp_path):
    from dsa.cute.sparse_attention_sm90 import SMEM_LIMIT, smem_bytes

    from dsa.cute.decode_sm90 import regs_sum

    name, kw = build
    lockstep, dual, crossover = cdec.build_flags(kw["cache"], kw["H"] // kw.get("G", 1), kw.get("lockstep"),
                                                 kw.get("dual"), kw.get("crossover"))
    # compiled in a fresh process: the build this process expects, whatever that process's defaults
    kw = dict(kw, lockstep=lockstep, dual=dual, crossover=crossover)
    r = compile_reports([(name, "dsa.cute.decode:compile_offline", ["torch.bfloat16"], kw)], NEEDLES, "sm_90a",
                        tmp_path)[name]
    # a split build's host function launches the decode and its merge, an unsplit one the decode alone
    merges = [e for e in r["entries"] if "merge_kernel" in e]
    decodes = [e for e in r["entries"] if "merge_kernel" not in e]
    assert len(merges) == int(kw["split"]) and len(decodes) == 1 == r["kernels"] - len(merges), (name, r)
    n = r["entries"][decodes[0]]
    if merges:
        # the merge: 16-byte loads of the parts, a few in flight (unrolled), one 8-byte store of 4 outputs
        m = r["entries"][merges[0]]
        assert m["ld.global.v4"] >= 4 and m["st.global.v2.b32"] == 1 and m["wgmma.mma_async"] == 0, (name, m)
        # a programmatic dependent launch: the decode lets it start, the merge waits for the decode's end
        assert m["griddepcontrol.wait"] == 1 and r["entries"][decodes[0]]["griddepcontrol.launch_dependents"] == 1
    else:
        assert r["needles"]["griddepcontrol.launch_dependents"] == 0, (name, r)
    D = kw.get("D", 576)
    # S = Q K^T: D / 16 wgmma a block; O += P V: 4 a block and source of P
    assert n["wgmma.mma_async"] >= D // 16 + 4, (name, r)
    assert n["cp.async.cg.shared.global"] >= 1 and n["cp.async.mbarrier.arrive.noinc"] >= 5, (name, r)
    assert n["setmaxnreg.inc"] >= 1 and n["setmaxnreg.dec"] >= 1 and n["mbarrier.try_wait"] >= 2, (name, r)
    # the split build writes fp32 parts two columns at a time; the other finishes rows as the forward does
    assert (n["st.global.v2.b32"] > 0) == kw["split"], (name, r)
    if kw["cache"] != "native":
        # 16-byte loads of e4m3 bytes, converted (e4m3 -> f16, times the scale in fp32, one rounding to
        # bf16) and stored as 16-byte units, fenced for the consumers' wgmma; lines prefetched into L2
        for needle in ("ld.global.v4", "cvt.rn.f16x2.e4m3x2", "cvt.rn.bf16x2.f32", "st.shared.v4",
                       "fence.proxy.async.shared::cta", "prefetch.global.L2"):
            assert n[needle] > 0, (name, needle, r)
        # the two orders of a pair's conversion: fp8_v32's fp32 scales, fp32 products (two a pair);
        # fp8_model1's e8m0 scales (bf16 values), one bf16x2 product a pair
        cvt, bf16_mul, f32_mul = n["cvt.rn.f16x2.e4m3x2"], n["mul.rn.bf16x2"], n["mul.rn.f32"]
        if kw["cache"] == "fp8_model1":
            assert bf16_mul == cvt and f32_mul == 0, (name, r)
        else:
            assert bf16_mul == 0 and f32_mul == 2 * cvt, (name, r)
        # each 16-byte load: 8 conversions of two bytes, two 16-byte stores (a lockstep build issues a
        # half's loads at more places than it converts them: ahead of the waits)
        R = 64 // 16 // ((2 if dual else 1) * (2 if crossover else 1))  # rows of a block a producer thread
        if crossover:
            # also the RoPE units through registers (R at each of the two places an R half is stored); into
            # the other CTA by cp.async.bulk: a 64-column chunk a copy (4 + 5 a stage) and the masks with L0
            # and R1; the other CTA's bytes expected on each half's barrier, its consumer's releases
            # arriving here, the barriers of both CTAs initialised before either uses the other's and
            # neither leaving before both are done
            assert n["st.shared.v4"] == cvt // 4 + 2 * R and cvt >= 8 * 8, (name, r)
            assert n["st.async.shared::cluster"] == 0, (name, r)
            assert n["cp.async.bulk.shared::cluster"] == 2 * (4 + 5) + 2, (name, r)
            assert n["mbarrier.expect_tx"] == 4 and n["mapa.shared::cluster"] >= 2, (name, r)
            assert n["mbarrier.arrive.shared::cluster"] >= 3, (name, r)
            assert n["barrier.cluster.arrive"] >= 2 and n["barrier.cluster.wait"] >= 2, (name, r)
        else:
            assert n["st.shared.v4"] * 4 == cvt >= 8 * 8, r
            assert n["st.async.shared::cluster"] == 0 and n["barrier.cluster.wait"] == 0, (name, r)
        if not lockstep:
            assert cvt == 8 * n["ld.global.v4"], r
    else:
        assert n["cvt.rn.f16x2.e4m3x2"] == 0 and n["st.shared.v4"] == 0, (name, r)
    # crossover on FlashMLA's slots (no block table) spills 8 bytes in a producer, and still runs 1.07-1.12x as
    # fast as dual there (bench/RESULTS.md C230); every other build spills nothing
    spill = 8 if crossover and not kw["has_bt"] else 0
    assert r["spill_stores"] <= spill and r["spill_loads"] <= spill, (name, r)
    assert n["st.local"] == 0 and n["ld.local"] == 0, (name, r)
    # wgmma issued back to back: a consumer short of registers gets them serialised (C7512) without a spill,
    # 6-12.5% slower at B128 (lockstep consumer 0 at 200 or 192 registers, bench/RESULTS.md C206-C207)
    assert not r["wgmma_serialized"], (name, r)
    assert r["smem"] == smem_bytes(D, 512, 2) <= SMEM_LIMIT == r["smem_limit"], (name, r)
    # the warpgroups' setmaxnreg split fits what the CTA is launched with (else setmaxnreg.inc never returns):
    # 168 registers a thread at 384 threads, 128 at 512 (a second producer)
    wgs = 4 if dual else 3
    assert r["registers"] == 65536 // (128 * wgs) // 8 * 8, (name, r)
    assert regs_sum(kw["cache"], lockstep, dual) <= wgs * r["registers"], (name, r)


_UNITS_SCRIPT = r"""
import json, cutlass, cutlass.cute as cute
from dsa.cute.decode_sm90 import GROUP, DecodeSm90Config, SparseDecodeSm90
from dsa.cute.sparse_attention_sm90 import BN
res = {}

def byte(sk, row, col, s):  # the byte the consumers' view reads (row, col) of stage s from
    b = 2 * sk.outer((row, col, s))
    return b ^ (((b >> 7) & 7) << 4)  # the 128-byte swizzle, on byte addresses

def check(k, sk, key):  # plain Python, called at trace time: every coordinate is static
    wrong, written = [], {}
    tids = range(128) if not k.dual else [*range(128), *range(384, 512)]  # the producer warpgroups' threads
    # crossover: both CTAs of a cluster store into the same places of their own stages (and the other's)
    for tidx, rank in [(t, r) for t in tids for r in ((0, 1) if k.crossover else (None,))]:
        tid, first = k.producer_thread(tidx, rank)
        row, lane = (first or 0) + tid // 8, tid % 8
        for s in range(2):
            at = s * BN * k.D * 2
            units = k.nope_units(at, row, lane)
            for m in range(k.rows_per_thread()):
                for g in range(k.nope_view_cols() // GROUP):
                    for h in range(2):
                        for e in range(8):
                            col = GROUP * g + 16 * lane + 8 * h + e
                            b = byte(sk, row + 16 * m, col, s)
                            written[(s, row + 16 * m, col)] = written.get((s, row + 16 * m, col), 0) + 1
                            if b != units[h] + k.nope_offset(m, g) + 2 * e:
                                wrong.append((tidx, s, m, g, h, e))
                if k.dual or k.crossover:  # its RoPE unit's address is the build's own
                    for e in range(8):
                        col = k.fmt.d_nope + 8 * lane + e
                        written[(s, row + 16 * m, col)] = written.get((s, row + 16 * m, col), 0) + 1
                        if byte(sk, row + 16 * m, col, s) != k.rope_unit(at, row, lane) + m * 16 * 128 + 2 * e:
                            wrong.append((tidx, s, m, "rope", e))
    cols = k.D if k.dual or k.crossover else k.fmt.d_nope
    missed = [(s, r, c) for s in range(2) for r in range(BN) for c in range(cols) if written.get((s, r, c)) != 1]
    res[key] = (str(sk.inner), wrong[:5], missed[:5])

# the lockstep builds (the only ones that store directly), fp8_v32: one producer, two (each half the rows),
# and two in each CTA of a crossover cluster (each a quarter)
builds = {name: SparseDecodeSm90.from_config(DecodeSm90Config(cutlass.BFloat16, 576, 512, 128, 1, True, True,
                                                              "fp8_v32", 64, True, True, False, True, dual, xo))
          for name, dual, xo in (("lockstep", False, False), ("dual", True, False), ("crossover", True, True))}


@cute.jit
def probe():
    for name, k in builds.items():
        _, layouts = k.operands()  # the kernel's own layouts: layouts[1] is the K stages the wgmma reads
        check(k, layouts[1], name)


cute.compile(probe)
print("RESULT" + json.dumps(res))
"""


@needs_dsl
def test_direct_stores_land_where_the_wgmma_reads(tmp_path):
    """The lockstep producer's stores, a constant from two addresses placed
    once (``nope_units``, ``nope_offset``), hit for every thread, stage, row
    pass, group and value the byte the consumers' view of the stage (the
    kernel's own swizzled layout) reads that value from."""
    script = tmp_path / "units.py"  # the DSL compiles functions from their source file
    script.write_text(_UNITS_SCRIPT)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert res == {name: ["S<3,4,3>", [], []] for name in ("lockstep", "dual", "crossover")}, res


def _rn_bf16(x: torch.Tensor) -> torch.Tensor:
    """float64 x rounded once to bf16 (8 significant bits, ties to even;
    subnormal below 2^-126 in steps of 2^-133; past the largest bf16, inf),
    in float64: an emulation that never goes through fp32."""
    _, e = torch.frexp(x)
    step = torch.pow(2.0, torch.clamp(e - 8, min=-133).double())
    y = torch.round(x / step) * step
    big = (2 - 2.0 ** -7) * 2.0 ** 127
    return torch.where(y.abs() > big, torch.copysign(torch.full_like(y, float("inf")), y), y)


def test_bf16_product_order_is_exact_for_bf16_scales():
    """The FP8 decode's two orders of dequantisation: the contract's (an fp32
    product, rounded to bf16) and the bf16 one it takes for fp8_model1's e8m0
    scales (``e4m3x2_times_bf16x2``: the product of bf16 values, rounded
    once).  Over every finite e4m3 byte they agree bit for bit for any scale
    that is a bf16 value (low 16 bits zero), subnormal, negative and
    overflowing ones included, and not for others, which is why fp8_v32's
    fp32 scales keep the contract's order."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    e = codes.view(torch.float8_e4m3fn).double()[:, None]
    exps = torch.arange(-133, 128, dtype=torch.float64)
    ends = torch.tensor([0.0, 127 * 2.0 ** -133, (2 - 2.0 ** -7) * 2.0 ** 127])  # zero, subnormal, largest
    bf16_scales = torch.cat([torch.pow(2.0, exps), 1.5 * torch.pow(2.0, exps[(exps > -133) & (exps < 127)]),
                             -torch.pow(2.0, exps[::7]), ends])
    s = bf16_scales.float()
    assert torch.equal(s.view(torch.int32) & 0xFFFF, torch.zeros_like(s, dtype=torch.int32))
    contract = (e.float() * s[None, :]).bfloat16()
    ordered = _rn_bf16(e * s.double()[None, :]).bfloat16()
    assert torch.equal(contract.view(torch.int16), ordered.view(torch.int16))
    assert contract.isinf().any() and (contract.view(torch.int16) & 0x7F80 == 0).sum() > 1000  # inf, subnormals
    # a scale that is not a bf16 value, rounded to bf16 first, changes some products
    odd = torch.tensor([0.3, 1 / 3, 0.7 * 2.0 ** -100, 1e-39], dtype=torch.float32)
    assert (odd.view(torch.int32) & 0xFFFF != 0).all()
    contract = (e.float() * odd[None, :]).bfloat16().view(torch.int16)
    rounded_first = _rn_bf16(e * odd.bfloat16().double()[None, :]).bfloat16().view(torch.int16)
    assert ((contract != rounded_first).sum(0) > 0).all()


@needs_dsl
def test_register_splits_fit_the_launch():
    """Producer + two consumers' setmaxnreg targets within 3 x the launch's
    registers a thread: a split above it deadlocks the CTA (the consumers'
    setmaxnreg.inc waits for registers no warp will free)."""
    from dsa.cute.decode_sm90 import FP8_REGS, LOCKSTEP_REGS
    from dsa.cute.sparse_attention_sm90 import CONSUMER_REGS, LAUNCH_REGS, PRODUCER_REGS, THREADS

    assert LAUNCH_REGS == 168 and THREADS == 384
    for p, c in [(PRODUCER_REGS, CONSUMER_REGS), *FP8_REGS.values(), LOCKSTEP_REGS]:
        cs = (c, c) if isinstance(c, int) else c
        assert p % 8 == 0 and all(x % 8 == 0 for x in cs) and p + sum(cs) <= 3 * LAUNCH_REGS, (p, c)


# --------------------------------------------------------------------------
# host logic (CPU)


def _args(T=2, H=128, D=576, K=2048, P=8, PS=64, G=1, dtype=torch.bfloat16, fmt="native", bt_w: Optional[int] = 4,
          seq_lens=True, topk_length=True, sink=True, rows_per_seq=1, kv=None, indices=None) -> SparseDecodeArgs:
    """Canonical decode arguments on CPU tensors (values irrelevant)."""
    q = torch.zeros(T, H, D, dtype=dtype)
    if kv is None:
        kv = (torch.zeros(P, PS, G, D, dtype=dtype) if fmt == "native"
              else torch.zeros(P, PS, 656, dtype=torch.uint8))
    idx = indices if indices is not None else torch.zeros(T, G, K, dtype=torch.int32)
    B = T // rows_per_seq
    bt = torch.zeros(B, bt_w, dtype=torch.int32) if bt_w else None
    sl = torch.zeros(B, dtype=torch.int32) if bt_w and seq_lens else None
    tl = torch.zeros(T, dtype=torch.int32) if topk_length else None
    sk = torch.zeros(H) if sink else None
    return SparseDecodeArgs(q, kv, idx, tl, bt, sl, sk, D ** -0.5, min(D, 512), fmt, rows_per_seq)


@pytest.mark.parametrize("B,H,splits,S,chunk", [
    (1, 128, None, 16, 128),    # 2 tiles: as many splits as pairs of 64-slot blocks
    (1, 64, None, 16, 128),
    (32, 128, None, 2, 1024),   # 64 tiles: 2 splits, 128 of 132 SMs
    (32, 64, None, 4, 512),     # 32 tiles: 4 splits
    (128, 128, None, 1, 2048),  # 256 tiles: more than a wave, one split
    (128, 64, None, 1, 2048),
    (1, 128, 5, 5, 448),        # forced: 32 blocks over 5 splits of 7 blocks
    (1, 128, 100, 32, 64),      # forced past the block count: clamped
    (32, 128, 0, 1, 2048),      # forced below 1: clamped
])
def test_split_plan(B, H, splits, S, chunk):
    a = _args(T=B, H=H)
    assert cdec.split_plan(a, 132, splits) == (S, chunk)
    # every split starts inside the row, the last one ends at K
    assert (S - 1) * chunk < a.K <= S * chunk and chunk % cdec.BLOCK == 0


def test_split_plan_short_rows():
    assert cdec.split_plan(_args(T=1, H=64, K=100), 132) == (1, 128)  # not a pair of blocks: one split
    assert cdec.split_plan(_args(T=1, H=64, K=300), 132) == (3, 128)  # 5 blocks: splits of 128, 128, 44 slots
    assert cdec.split_plan(_args(T=1, H=64, K=100), 132, 2) == (2, 64)  # forced: blocks of one


def _padded_fp8(P, PS, pad):
    buf = torch.zeros(P, PS * 656 + pad, dtype=torch.uint8)
    return buf[:, : PS * 656].view(P, PS, 656)


def _padded_native(P, PS, D, pad, dtype=torch.bfloat16):
    buf = torch.zeros(P, PS * D + pad, dtype=dtype)
    return buf[:, : PS * D].view(P, PS, 1, D)


@pytest.mark.parametrize("what,kw,match", [
    ("fp32 q", dict(dtype=torch.float32), "bf16 or fp16"),
    ("32 heads", dict(H=32), "multiple of 64"),
    ("D 128", dict(D=128), "D in"),
    ("model1 D", dict(fmt="fp8_model1", kv=torch.zeros(4, 64, 584, dtype=torch.uint8)), "D = 512"),
    ("model1 fp16", dict(fmt="fp8_model1", D=512, dtype=torch.float16, kv=torch.zeros(4, 64, 584,
                                                                                  dtype=torch.uint8)), "bf16"),
    ("kv dtype", dict(kv=torch.zeros(4, 64, 1, 576, dtype=torch.float16)), "differs from q dtype"),
    ("int64 indices", dict(indices=torch.zeros(2, 1, 2048, dtype=torch.int64)), "int32"),
    ("page stride", dict(kv=_padded_native(4, 64, 576, 3)), "multiple of 16"),
    ("tokens apart", dict(kv=torch.zeros(4, 64, 2, 576, dtype=torch.bfloat16)[:, :, :1]), "contiguous"),
    ("int32 pages", dict(kv=torch.zeros(1, 64, 1, 576, dtype=torch.bfloat16).expand(2**25, 64, 1, 576)), "int32"),
    ("int32 table", dict(bt_w=2**25), "int32"),
    ("fp8 with fp16 q", dict(dtype=torch.float16, fmt="fp8_v32"), "bf16"),
    ("fp8 page stride", dict(fmt="fp8_v32", kv=_padded_fp8(4, 64, 8)), "multiple of 16"),
    ("fp8 D", dict(fmt="fp8_v32", D=512), "D = 576"),
])
def test_supports_reasons(what, kw, match):
    why = cdec.call_reason(_args(**kw))
    assert why is not None and match in why, (what, why)


def test_supports_serves_the_model_layouts():
    assert cdec.call_reason(_args()) is None
    assert cdec.call_reason(_args(bt_w=None, seq_lens=False, topk_length=False, sink=False)) is None
    assert cdec.call_reason(_args(dtype=torch.float16, H=64, D=512, G=1, PS=1, bt_w=None)) is None
    assert cdec.call_reason(_args(kv=_padded_native(4, 64, 576, 8))) is None  # a padded page stride, 16-byte aligned
    assert cdec.call_reason(_args(T=4, rows_per_seq=2)) is None
    assert cdec.call_reason(_args(fmt="fp8_v32")) is None
    assert cdec.call_reason(_args(fmt="fp8_v32", kv=_padded_fp8(4, 64, 48), bt_w=None, H=64)) is None
    assert cdec.call_reason(_args(fmt="fp8_model1", D=512, kv=torch.zeros(4, 64, 584, dtype=torch.uint8))) is None


@needs_dsl
def test_lockstep_is_the_fp8_v32_build():
    """fp8_v32 calls get the lockstep build (consumer 1 without S, the
    producer with two half stages of loads); the other caches the staggered
    one, and a lockstep build of another cache is refused with the reason."""
    from dsa.cute import decode_sm90 as d

    assert cdec.kernel_config(_args(fmt="fp8_v32"), True).lockstep is True
    assert cdec.kernel_config(_args(fmt="fp8_v32"), True).dual is ("fp8_v32" in d.DUAL_CACHES) is True
    assert cdec.kernel_config(_args(), True).lockstep is False
    assert cdec.kernel_config(_args(), True).dual is False
    a1 = _args(fmt="fp8_model1", D=512, kv=torch.zeros(4, 64, 584, dtype=torch.uint8))
    assert cdec.kernel_config(a1, False).lockstep is False
    assert cdec.kernel_config(a1, False).dual is False
    why = d.decode_reason(d.cutlass.BFloat16, 576, 512, 128, 1, "native", 64, True, True, lockstep=True)
    assert why is not None and "lockstep" in why
    with pytest.raises(ValueError, match="lockstep"):
        d.SparseDecodeSm90(d.cutlass.BFloat16, 512, 512, 64, 1, True, True, "fp8_model1", 64, True, True, True,
                           lockstep=True)
    # the two consumers' targets differ; with the producer's they fill the launch's registers
    p, (c0, c1) = d.warpgroup_regs("fp8_v32", lockstep=True)
    assert c1 < c0 and p + c0 + c1 == d.regs_sum("fp8_v32", True) == 3 * 168
    # two producers: the same consumers, and all four warpgroups fill 512 threads' 128 registers
    p2, cs2 = d.warpgroup_regs("fp8_v32", lockstep=True, dual=True)
    assert cs2 == (c0, c1) and 2 * p2 + c0 + c1 == d.regs_sum("fp8_v32", True, True) == 4 * 128
    why = d.decode_reason(d.cutlass.BFloat16, 576, 512, 128, 1, "fp8_v32", 64, True, True, dual=True)
    assert why is not None and "lockstep" in why


def test_crossover_builds(monkeypatch):
    """Crossover pairs 64-head blocks of a dual build: refused without two
    producers or a whole pair of head blocks a kv head; by default only on
    the caches of ``CROSSOVER_CACHES`` (fp8_v32), and there only where the
    heads pair up."""
    from dsa.cute import decode_sm90 as d

    bf = d.cutlass.BFloat16
    assert d.decode_reason(bf, 576, 512, 128, 1, "fp8_v32", 64, True, True, True, True, True) is None
    assert d.decode_reason(bf, 576, 512, 256, 1, "fp8_v32", 64, True, True, True, True, True) is None
    why = d.decode_reason(bf, 576, 512, 128, 1, "fp8_v32", 64, True, True, True, False, True)
    assert why is not None and "dual" in why
    why = d.decode_reason(bf, 576, 512, 64, 1, "fp8_v32", 64, True, True, True, True, True)
    assert why is not None and "pairs blocks of 64" in why
    assert d.CROSSOVER_CACHES == ("fp8_v32",)
    monkeypatch.setattr(d, "CROSSOVER_CACHES", ())
    assert cdec.kernel_config(_args(fmt="fp8_v32"), True).crossover is False
    monkeypatch.setattr(d, "CROSSOVER_CACHES", ("fp8_v32",))
    assert cdec.kernel_config(_args(fmt="fp8_v32"), True).crossover is True
    assert cdec.kernel_config(_args(fmt="fp8_v32", H=64), True).crossover is False
    assert cdec.kernel_config(_args(), True).crossover is False  # native: no lockstep, no dual
    # the other CTA's bytes a half: its 32 rows of the half's columns (4 or 5 chunks of 64), with the masks
    k = d.SparseDecodeSm90(bf, 576, 512, 128, 1, True, True, "fp8_v32", 64, True, True, False, True, True, True)
    assert [k.peer_bytes(h) for h in range(4)] == [32 * 256 * 2 + 128, 32 * 320 * 2, 32 * 256 * 2, 32 * 320 * 2 + 128]
    assert k.R == 1 and k.release_arrivals() == 132


def test_zero_row_sizes():
    """An invalid slot's row: a row of D; fp8_v32's token record; for
    fp8_model1, whose scales follow the page's records, up to token 0's."""
    assert cdec.zero_row_size(_args()) == 576
    assert cdec.zero_row_size(_args(fmt="fp8_v32")) == 656
    a = _args(fmt="fp8_model1", D=512, kv=torch.zeros(4, 16, 584, dtype=torch.uint8))
    assert cdec.zero_row_size(a) == 16 * 576 + 8


def test_supports_needs_an_sm90_gpu():
    why = cdec.supports(_args())
    assert why is not None and "CUDA" in why


def test_placement_declines_until_measured(monkeypatch):
    a = _args(T=32)
    monkeypatch.setattr(cdec, "device_name", lambda d: "NVIDIA H100")  # no row of the shipped table
    assert cdec.placement_reason(a) == cdec.NOT_MEASURED == "no measurement of the cute decode on this GPU yet"
    monkeypatch.setattr(cdec, "device_name", lambda d: "NVIDIA H200")
    # the shipped table: bf16 H128 measured cute-faster at B1..128; fp8_v32 at H64 too; fp8_model1 not measured
    assert cdec.placement_reason(a) is None
    assert cdec.placement_reason(_args(T=32, H=64, fmt="fp8_v32", kv=torch.zeros(8, 64, 656,
                                                                                dtype=torch.uint8))) is None
    assert "covers" in cdec.placement_reason(_args(T=32, H=64, D=512, fmt="fp8_model1",
                                                   kv=torch.zeros(8, 64, 584, dtype=torch.uint8)))
    monkeypatch.setattr(cdec, "PLACEMENT", {("NVIDIA H100", "native", 128, (1, 256)): "cute"})
    assert cdec.placement_reason(a) == cdec.NOT_MEASURED  # another GPU's measurement
    monkeypatch.setattr(cdec, "PLACEMENT", {("NVIDIA H200", "native", 128, (1, 16)): "cute",
                                            ("NVIDIA H200", "native", 128, (17, 64)): "triton"})
    assert "triton is faster" in cdec.placement_reason(a)
    assert cdec.placement_reason(_args(T=8)) is None
    assert "covers" in cdec.placement_reason(_args(T=128))
    assert "covers" in cdec.placement_reason(_args(T=8, H=64))


def test_backend_hook(monkeypatch):
    import dsa.cute as cute_backend
    from dsa.cute import host

    a = _args(T=8)
    monkeypatch.setattr(host, "arch_of", lambda d: "sm90")
    monkeypatch.setattr(cdec, "supports", lambda a: None)
    monkeypatch.setattr(cdec, "device_name", lambda d: "NVIDIA H100")
    assert cute_backend.backend_op("sparse_decode", a) is cdec.decode  # backend="cute" runs it
    with pytest.raises(Unsupported, match="no measurement of the cute decode on this GPU yet"):
        cute_backend.backend_op("sparse_decode", a, auto=True)
    monkeypatch.setattr(cdec, "device_name", lambda d: "NVIDIA H200")
    monkeypatch.setattr(cdec, "PLACEMENT", {("NVIDIA H200", "native", 128, (1, 16)): "cute"})
    chosen = cute_backend.backend_op("sparse_decode", a, auto=True)
    assert chosen.fn is cdec.decode and "measured faster" in chosen.note
    # auto's choice keeps the prepared launches (plans and sparse_decode call them, not a fresh build a call)
    assert chosen.prepare is cdec.prepare
    monkeypatch.setattr(cdec, "supports", lambda a: "the kernel's own reason")
    with pytest.raises(Unsupported, match="the kernel's own reason"):
        cute_backend.backend_op("sparse_decode", a)


@needs_dsl
@pytest.mark.parametrize("B,H,split", [(1, 128, True), (128, 128, False)])
@pytest.mark.parametrize("reuse", [False, True])
def test_launch_arguments(monkeypatch, B, H, split, reuse):
    """A prepared launch without a GPU: the compiled host function gets its
    pointers in order (the workspace when split, the zero row, then the
    merge's out and lse; stand-ins for absent inputs), the plan's scalars and
    the stream, in one call: the merge is its second kernel, and no Triton
    merge is launched; the plan is built once per key, a reused workspace
    once per prepare."""
    import cutlass

    launches, merges, zero = [], [], torch.zeros(576, dtype=torch.bfloat16)

    class Merge:
        def launch(self, *x):
            merges.append(x)

    monkeypatch.setattr(cdec, "_sm_count", lambda d: 132)
    monkeypatch.setattr(cdec, "stream_handle", lambda device: 7)
    monkeypatch.setattr(cdec, "zero_row", lambda d, dt, n: zero)
    monkeypatch.setattr(cdec, "_compiled", lambda p: lambda *x: launches.append((p, x)))
    from dsa.triton import decode as tdecode

    monkeypatch.setattr(tdecode, "_COMBINE", Merge())  # the Triton decode's merge: never launched here
    monkeypatch.setattr(cdec, "_PLANS", {})
    a = _args(T=B, H=H, P=6, bt_w=3, sink=False)
    run = cdec.decode.prepare(a, reuse)
    out = torch.empty(B, H, 512, dtype=torch.bfloat16)
    lse = torch.empty(B, H)
    for _ in range(2):
        run(a.q, a.kv, a.indices, a.topk_length, a.block_table, a.seq_lens, a.sink, out, lse)
    S, chunk = cdec.split_plan(a, 132)
    (p, x), (p2, x2) = launches
    assert not merges
    assert p is p2 and p.splits == S and p.config.split == split == (S > 1)
    ptrs, scalars, stream = x[:12], x[12:-1], x[-1]
    assert stream == 7 and all(type(v) is int for v in ptrs)  # TVM-FFI arguments: integer addresses
    types = cdec.pointer_types(p.config)
    assert len(types) == 12 and types[10] == (cutlass.BFloat16, 8) and types[11][0] is cutlass.Float32
    addr = [t.data_ptr() for t in (a.q, a.kv, a.indices, a.topk_length, a.block_table, a.seq_lens)]
    assert list(ptrs[:6]) == addr and ptrs[9] == zero.data_ptr()
    assert types[1][0] is cutlass.BFloat16 and ptrs[6] == ptrs[8]  # no sink: the parts' lse stands in
    if split:
        assert types[7][0] is cutlass.Float32 and ptrs[7] != out.data_ptr() and ptrs[8] != lse.data_ptr()
        if reuse:  # one workspace for every call (without reuse a freed one's address may come back)
            assert ptrs[7] == x2[7]
        assert (ptrs[10], ptrs[11]) == (out.data_ptr(), lse.data_ptr())  # what the merge writes
    else:
        assert types[7][0] is cutlass.BFloat16 and ptrs[7] == out.data_ptr() and ptrs[8] == lse.data_ptr()
        assert (ptrs[10], ptrs[11]) == (ptrs[7], ptrs[8])  # no merge: stand-ins
    T, K, P, stride, bt_w, ch, n_split, len_div, rps, scale, sms = scalars
    assert (int(T), int(K), int(P), int(stride), int(bt_w), int(ch), int(n_split)) == (B, 2048, 6, 64 * 576 * 2,
                                                                                        3, chunk, S)
    assert (int(len_div), int(rps), int(sms)) == (1, 1, 132)
    cdec.decode.prepare(_args(T=B, H=H, P=7, bt_w=3))  # a larger pool: another plan (P is a kernel argument)
    assert len(cdec._PLANS) == 2


def test_prepared_call_refuses_misaligned_tensors(monkeypatch):
    monkeypatch.setattr(cdec, "_sm_count", lambda d: 132)
    monkeypatch.setattr(cdec, "zero_row", lambda d, dt, n: torch.zeros(n, dtype=dt))
    monkeypatch.setattr(cdec, "stream_handle", lambda device: 7)
    monkeypatch.setattr(cdec, "_compiled", lambda p: lambda *x: None)
    if not HAVE_DSL:
        pytest.skip("nvidia-cutlass-dsl is not installed")
    a = _args(T=128)
    run = cdec.decode.prepare(a)
    q = torch.zeros(a.q.numel() + 1, dtype=torch.bfloat16)[1:].view_as(a.q)
    with pytest.raises(ValueError, match="16-byte aligned"):
        run(q, a.kv, a.indices, a.topk_length, a.block_table, a.seq_lens, a.sink,
            torch.empty(128, 128, 512, dtype=torch.bfloat16), torch.empty(128, 128))


# --------------------------------------------------------------------------
# GPU: the contract on the cute decode

gpu = pytest.mark.skipif(not (SM90 and HAVE_DSL), reason="needs an SM90 GPU and nvidia-cutlass-dsl")


def _poison():
    """Leave NaN in the caching allocator's free blocks, so that an output
    element the kernel fails to write shows as NaN."""
    x = torch.full((1 << 26,), float("nan"), device="cuda")
    del x


def _canonical(q, cache, idx, **kw):
    from dsa import _checks

    a, _ = _checks.sparse_decode_args(q, cache, idx, kw.get("block_table"), kw.get("seq_lens"),
                                      kw.get("topk_length"), kw.get("sink"), kw.get("sm_scale"), kw.get("d_v"),
                                      kw.get("cache_format"))
    return a


def _run(q, cache, idx, splits=None, **kw):
    """The cute decode at a forced split count (None: the plan's), outputs poisoned first."""
    a = _canonical(q, cache, idx, **kw)
    assert cdec.supports(a) is None, cdec.supports(a)
    _poison()
    out, lse = cdec.forward(a, splits)
    return out.view(*q.shape[:-1], a.d_v), lse.view(*q.shape[:-1])


def _check_bf(q, cache, idx, fmt="native", splits=(None,), **kw):
    """Against the float64 brute force at each split count; NaN only where it has NaN."""
    exp = bf.sparse_decode(q, cache, idx, cache_format=fmt, **kw)
    for s in splits:
        out, lse = _run(q, cache, idx, s, **kw)
        bf.assert_close(out, exp["out"], q.dtype, f"out splits={s}")
        bf.assert_close(lse, exp["lse"], q.dtype, f"lse splits={s}")
    return exp


def _native_paged(P, PS, D, gen, dtype=torch.bfloat16, G=1, pad=0):
    """[P, PS, G, D] on the GPU; with pad, each page is followed by pad elements of NaN (page stride padded)."""
    kv = torch.randn(P, PS, G, D, generator=gen).to(dtype)
    if not pad:
        return kv.cuda()
    buf = torch.full((P, PS * G * D + pad), float("nan"), dtype=dtype, device="cuda")
    buf[:, : PS * G * D] = kv.view(P, -1).cuda()
    return buf[:, : PS * G * D].view(P, PS, G, D)


dtypes = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


@pytest.mark.gpu
@gpu
@dtypes
@pytest.mark.parametrize("H", [64, 128])
def test_block_table_edge_cases(dtype, H):
    """A block table with -1 and out-of-range pages, seq_lens cutting rows,
    -1 / out-of-range / huge positions, topk_length 0, partial, past K and
    negative, NaN in every page no valid slot names, a padded page stride;
    at split counts that put boundaries inside and at the ends of rows."""
    gen = torch.Generator().manual_seed(1)
    B, PS, W, P, K, D = 6, 16, 6, 20, 200, 576
    q = torch.randn(B, 1, H, D, generator=gen).to(dtype).cuda()
    kv = _native_paged(P, PS, D, gen, dtype, pad=24)
    bt = torch.randint(0, P, (B, W), generator=gen, dtype=torch.int32)
    bt[0, 1] = -1
    bt[1, 2] = P
    bt[2, 0] = 2**31 - 1
    seq_lens = torch.tensor([W * PS, 40, 0, W * PS - 3, 17, 96], dtype=torch.int32)
    idx = torch.randint(0, W * PS, (B, 1, K), generator=gen, dtype=torch.int32)
    idx[0, 0, ::7] = -1
    idx[1, 0, ::5] = W * PS
    idx[3, 0, 1::9] = 2**31 - 1
    idx[4, 0, 10:40] = idx[4, 0, 40:70]  # duplicates are separate slots
    tl = torch.tensor([K, 63, 64, 65, 0, 1000], dtype=torch.int32)
    # NaN in every page no block table entry names
    named = torch.zeros(P, dtype=torch.bool)
    named[bt[(bt >= 0) & (bt < P)].long()] = True
    kv[~named.cuda()] = float("nan")
    sink = (torch.randn(H, generator=gen) * 2).cuda()
    kw = dict(block_table=bt.cuda(), seq_lens=seq_lens.cuda(), topk_length=tl.cuda(), sink=sink)
    exp = _check_bf(q, kv, idx.cuda(), splits=(None, 1, 2, 3, 4), **kw)
    assert torch.isinf(exp["lse"][2]).all() and torch.isinf(exp["lse"][4]).all()  # cut to nothing: empty rows


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("sink_value", [None, INF, -INF, 2.4e38, 0.5])
def test_slots_without_block_table_and_sinks(sink_value):
    """FlashMLA's slots (page * page_size + offset), -1 and past the pool,
    every slot invalid in one row; sink absent, +inf, -inf, overflowing and
    finite; splits of one block each."""
    gen = torch.Generator().manual_seed(2)
    T, H, P, PS, K, D = 4, 64, 8, 64, 256, 576
    q = torch.randn(T, H, D, generator=gen).to(torch.bfloat16).cuda()
    kv = _native_paged(P, PS, D, gen)
    idx = torch.randint(0, P * PS, (T, K), generator=gen, dtype=torch.int32)
    idx[1, ::3] = -1
    idx[2, ::4] = P * PS
    idx[3] = -7  # no valid slot
    sink = None if sink_value is None else torch.full((H,), sink_value, device="cuda")
    exp = _check_bf(q, kv, idx.cuda(), splits=(None, 1, 4), sink=sink)
    assert torch.isinf(exp["lse"][3]).all()


@pytest.mark.gpu
@gpu
@dtypes
def test_flat_gqa_and_rows_per_sequence(dtype):
    """A flat cache with two kv heads (D 512), and speculative rows: two
    query rows a sequence sharing a per-sequence topk_length."""
    gen = torch.Generator().manual_seed(3)
    N, K = 500, 192
    q = torch.randn(3, 2, 128, 512, generator=gen).to(dtype).cuda()
    kv = torch.randn(N, 2, 512, generator=gen).to(dtype).cuda()
    idx = torch.randint(-2, N + 2, (3, 2, 2, K), generator=gen, dtype=torch.int32).cuda()
    tl = torch.tensor([K, 70, 0], dtype=torch.int32).cuda()
    _check_bf(q, kv, idx, splits=(None, 1, 3), topk_length=tl)
    _check_bf(q, kv, idx, splits=(None,))


@pytest.mark.gpu
@gpu
def test_nan_in_q_and_in_a_valid_row_propagates():
    gen = torch.Generator().manual_seed(4)
    T, H, P, PS, K, D = 2, 64, 4, 64, 128, 576
    q = torch.randn(T, H, D, generator=gen).to(torch.bfloat16).cuda()
    kv = _native_paged(P, PS, D, gen)
    idx = torch.randint(0, P * PS, (T, K), generator=gen, dtype=torch.int32)
    unused = next(n for n in range(P * PS) if not (idx[0] == n).any())
    idx[1, 5] = unused  # a row only the second query names
    idx = idx.cuda()
    q[0, 3, 7] = float("nan")
    kv.view(-1, D)[unused] = float("nan")
    for s in (None, 1, 2):
        out, lse = _run(q, kv, idx, s)
        assert out[0, 3].isnan().all() and not out[0, :3].isnan().any() and not out[0, 4:].isnan().any()
        assert out[1].isnan().all()


def _model_slots(gen, B, H, K, PS, W):
    """A model-shape decode's slots: a random block table of W pages a
    sequence, K distinct ascending positions, ragged lengths (the first row
    full) and a sink -> (block table, positions [B, K] int64, indices
    [B, 1, K] int32, the call's keywords)."""
    bt = torch.randperm(B * W, device="cuda", generator=gen).view(B, W).int()
    pos = torch.rand(B, W * PS, device="cuda", generator=gen).topk(K, dim=-1).indices.sort(-1).values
    tl = torch.randint(0, K + 1, (B,), device="cuda", generator=gen).int()
    tl[0] = K
    sink = torch.randn(H, device="cuda", generator=gen)
    return bt, pos, pos.int().view(B, 1, K), dict(block_table=bt, topk_length=tl, sink=sink)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B,H", [(1, 64), (1, 128), (32, 64), (32, 128), (128, 64), (128, 128)])
def test_model_shapes_against_reference(B, H):
    """V3.2 shapes (K 2048, D 576, pages of 64 through a block table, a
    sink, ragged lengths) against the reference backend in float64, at the
    plan's split count and forced ones."""
    gen = torch.Generator(device="cuda").manual_seed(B + H)
    K, PS, W = 2048, 64, 64
    P = B * W
    q = torch.randn(B, 1, H, 576, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(P, PS, 1, 576, device="cuda", generator=gen).bfloat16()
    _, _, idx, kw = _model_slots(gen, B, H, K, PS, W)
    ref, ref_lse = dsa.sparse_decode(q.double(), kv.double(), idx, return_lse=True, backend="reference", **kw)
    for s in (None, 1, 3, 32):
        out, lse = _run(q, kv, idx, s, **kw)
        assert bf.rel_l2(out, ref) < 1e-2, s
        assert not out.isnan().any() and not lse.isnan().any()
        assert torch.allclose(lse.double(), ref_lse, rtol=1e-3, atol=1e-3), s


@pytest.mark.gpu
@gpu
def test_public_call_cuda_graph_and_no_sync():
    """backend="cute" through dsa.sparse_decode: no host sync, and a CUDA
    graph replay equals an eager call on new q (split and unsplit)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    for B in (1, 128):
        q = torch.randn(B, 1, 128, 576, device="cuda", generator=gen).bfloat16()
        kv = torch.randn(64, 64, 1, 576, device="cuda", generator=gen).bfloat16()
        bt = torch.randint(-1, 64, (B, 8), device="cuda", generator=gen).int()
        idx = torch.randint(-1, 8 * 64, (B, 1, 512), device="cuda", generator=gen).int()
        kw = dict(block_table=bt, sink=torch.randn(128, device="cuda"), return_lse=True, backend="cute")
        assert_replays_without_sync(lambda: dsa.sparse_decode(q, kv, idx, **kw), q)


@pytest.mark.gpu
@gpu
def test_auto_declines_with_the_reason(monkeypatch):
    """Without a measurement for this GPU auto keeps Triton and explain()
    says why; with one naming cute for the shape, auto takes cute."""
    q = torch.randn(1, 1, 128, 576, device="cuda").bfloat16()
    kv = torch.randn(4, 64, 1, 576, device="cuda").bfloat16()
    idx = torch.zeros(1, 1, 64, dtype=torch.int32, device="cuda")
    monkeypatch.setattr(cdec, "PLACEMENT", {})
    text = dsa.explain("sparse_decode", q, kv, idx)
    assert "backend 'triton'" in text and "cute: no measurement of the cute decode on this GPU yet" in text, text
    name = torch.cuda.get_device_name()
    monkeypatch.setattr(cdec, "PLACEMENT", {(name, "native", 128, (1, 1)): "cute"})
    text = dsa.explain("sparse_decode", q, kv, idx)
    assert "backend 'cute'" in text and "measured faster" in text, text
    with pytest.raises(ValueError, match="cute"):
        dsa.sparse_decode(q.float(), kv.float(), idx, backend="cute")


# --------------------------------------------------------------------------
# GPU: FP8 (fp8_v32) caches

NAN_BYTE = 0x7F  # e4m3 NaN
FP8 = {"fp8_v32": dict(D=576, bytes=656, record=656), "fp8_model1": dict(D=512, bytes=584, record=576)}
fp8_formats = pytest.mark.parametrize("fmt", list(FP8))


def _fp8_paged(fmt, P, PS, gen, pad=0, scale=2.0):
    """A quantised FP8 cache [P, PS, bytes] on the GPU; with pad, each page
    is followed by pad bytes of 0x7F (page stride padded, NaN if read)."""
    f = FP8[fmt]
    cache = dsa.quantize_kv_cache(torch.randn(P, PS, f["D"], generator=gen) * scale, fmt).cuda()
    if not pad:
        return cache
    buf = torch.full((P, PS * f["bytes"] + pad), NAN_BYTE, dtype=torch.uint8, device="cuda")
    buf[:, : PS * f["bytes"]] = cache.view(P, -1)
    return buf[:, : PS * f["bytes"]].view(P, PS, f["bytes"])


@pytest.mark.gpu
@gpu
@fp8_formats
@pytest.mark.parametrize("H", [64, 128])
def test_fp8_block_table_edge_cases(fmt, H):
    """The block-table edge cases on an fp8_v32 cache with padded pages:
    every page no table entry names is NaN bytes, one referenced token
    holds a NaN byte (the row naming it is NaN, the others not)."""
    gen = torch.Generator().manual_seed(6)
    B, PS, W, P, K = 6, 16, 6, 20, 200
    q = torch.randn(B, 1, H, FP8[fmt]["D"], generator=gen).bfloat16().cuda()
    cache = _fp8_paged(fmt, P, PS, gen, pad=48)
    bt = torch.randint(0, P, (B, W), generator=gen, dtype=torch.int32)
    bt[0, 1], bt[1, 2], bt[2, 0] = -1, P, 2**31 - 1
    seq_lens = torch.tensor([W * PS, 40, 0, W * PS - 3, 17, 96], dtype=torch.int32)
    idx = torch.randint(0, W * PS, (B, 1, K), generator=gen, dtype=torch.int32)
    idx[0, 0, ::7] = -1
    idx[1, 0, ::5] = W * PS
    idx[3, 0, 1::9] = 2**31 - 1
    tl = torch.tensor([K, 63, 64, 65, 0, 1000], dtype=torch.int32)
    named = torch.zeros(P, dtype=torch.bool)
    named[bt[(bt >= 0) & (bt < P)].long()] = True
    cache[~named.cuda()] = NAN_BYTE  # NaN values (and huge scales): never read
    # a NaN byte in the token only row 5 names (position 5 of sequence 5)
    idx[5, 0, 0] = 5
    page5 = int(bt[5, 0])
    cache[page5].reshape(-1)[5 * FP8[fmt]["record"] + 7] = NAN_BYTE  # NoPE byte 7 of the page's token 5
    others = [(b, j) for b in range(B) for j in range(K) if b != 5 and int(idx[b, 0, j]) // PS < W
              and int(bt[b, max(0, int(idx[b, 0, j])) // PS]) == page5 and int(idx[b, 0, j]) % PS == 5]
    for b, j in others:
        idx[b, 0, j] = -1
    sink = (torch.randn(H, generator=gen) * 2).cuda()
    kw = dict(block_table=bt.cuda(), seq_lens=seq_lens.cuda(), topk_length=tl.cuda(), sink=sink)
    exp = _check_bf(q, cache, idx.cuda(), fmt, splits=(None, 1, 2, 3, 4), **kw)
    assert exp["out"][5].isnan().all() and not exp["out"][:5].isnan().any()


def _exact_cache(fmt, P, PS, gen):
    """Every finite e4m3 byte over the tokens' NoPE values, random bf16 RoPE
    and four kinds of scales by token: powers of two from 2^-20 to 2^20 (fp32,
    or e8m0 bytes 107..147); scales that are not bf16 values (fp32: 0.3 times
    those) or e8m0's smallest (2^-127..2^-121, subnormal products); bf16
    values that are not powers of two, subnormal ones and zero (fp32); and
    negative powers of two with one tile of the first half not a bf16 value
    (fp32).  [P, PS, bytes] uint8."""
    f = FP8[fmt]
    L = bf.FP8_LAYOUTS[fmt]
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    pages = torch.zeros(P, PS * f["bytes"], dtype=torch.uint8)
    n_tiles = L["nope"] // L["tile"]
    for n in range(P * PS):
        p, o = divmod(n, PS)
        rec = pages[p, o * L["record"]:(o + 1) * L["record"]]
        rec[: L["nope"]] = codes[(torch.arange(L["nope"]) * 7 + n * 13) % len(codes)]
        exps = torch.tensor([(n * 5 + 3 * k) % 41 - 20 for k in range(n_tiles)], dtype=torch.float32)
        kind = n % 4
        if L["per_page"]:
            at = PS * L["record"] + 8 * o
            b = torch.arange(n_tiles) if kind == 1 else exps + 127
            pages[p, at:at + n_tiles] = b.to(torch.uint8)
        else:
            sc = torch.pow(2.0, exps)
            if kind == 1:
                sc = 0.3 * sc
            elif kind == 2:
                sc = torch.tensor([1.5 * 2.0 ** float(exps[0]), 2.0 ** -126, 2.0 ** -130, 0.0])
            elif kind == 3:
                sc = -sc
                sc[1] = sc[1] * 0.3
            rec[L["scale_at"]:L["scale_at"] + 4 * n_tiles] = sc.float().view(torch.uint8)
        rec[L["rope_at"]:L["rope_at"] + 128] = torch.randn(64, generator=gen).bfloat16().view(torch.uint8)
    return pages.view(P, PS, f["bytes"]).cuda()


@pytest.mark.gpu
@gpu
@fp8_formats
def test_fp8_dequantisation_is_exact(fmt):
    """One valid slot a row: out is that token's dequantised values, bit for
    bit (bf16 of the fp32 product), over every finite e4m3 byte and scales
    of several kinds (``_exact_cache``; fp8_model1's smallest e8m0 scales make
    bf16 subnormals of the bf16 products); lse checks its RoPE part (q is zero
    elsewhere)."""
    gen = torch.Generator().manual_seed(7)
    T, H, PS, P = 16, 64, 4, 4
    D = FP8[fmt]["D"]
    cache = _exact_cache(fmt, P, PS, gen)
    q = torch.zeros(T, H, D)
    q[:, :, D - 64:] = torch.randn(T, H, 64, generator=gen)
    q = q.bfloat16().cuda()
    slots = torch.full((T, 128), -1, dtype=torch.int32)
    slots[:, 37] = torch.arange(T) % (P * PS)  # one valid slot, inside the first block
    rows = dsa.dequantize_kv_cache(cache, fmt).view(P * PS, D)[slots[:, 37].long().cuda()]
    for s in (None, 1, 2):  # 2: the second split sees no valid slot
        out, lse = _run(q, cache, slots.cuda(), s)
        assert torch.equal(out, rows[:, None, :512].bfloat16().expand(T, H, 512)), s
        s_exp = (q.double()[:, :, D - 64:] * rows[:, None, D - 64:].double()).sum(-1)
        torch.testing.assert_close(lse.double(), s_exp * D ** -0.5, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@gpu
@fp8_formats
@pytest.mark.parametrize("B,H", [(1, 64), (1, 128), (32, 64), (32, 128), (128, 64), (128, 128)])
def test_fp8_model_shapes_against_reference(fmt, B, H):
    """The model shapes on an FP8 cache (K 2048, pages of 64 through a block
    table, a sink, ragged lengths) against the reference backend in float64,
    at the plan's split count and forced ones; FlashMLA-style slots too."""
    gen = torch.Generator(device="cuda").manual_seed(B * H)
    K, PS, W, D = 2048, 64, 64, FP8[fmt]["D"]
    P = B * W
    q = torch.randn(B, 1, H, D, device="cuda", generator=gen).bfloat16()
    cache = dsa.quantize_kv_cache(torch.randn(P, PS, D, device="cuda", generator=gen), fmt)
    bt, pos, idx, kw = _model_slots(gen, B, H, K, PS, W)
    ref, ref_lse = dsa.sparse_decode(q.double(), cache, idx, return_lse=True, backend="reference", **kw)
    slots = (bt.long().gather(1, pos.long() // PS) * PS + pos.long() % PS).int().view(B, 1, K)
    for s in (None, 1, 3, 32):
        for indices, extra in ((idx, dict(block_table=bt)), (slots, {})):
            out, lse = _run(q, cache, indices, s, topk_length=kw["topk_length"], sink=kw["sink"], **extra)
            assert bf.rel_l2(out, ref) < 1e-2, s
            assert not out.isnan().any() and not lse.isnan().any()
            assert torch.allclose(lse.double(), ref_lse, rtol=1e-3, atol=1e-3), s


@pytest.mark.gpu
@gpu
@fp8_formats
def test_fp8_cuda_graph_and_no_sync(fmt):
    gen = torch.Generator(device="cuda").manual_seed(8)
    D = FP8[fmt]["D"]
    for B in (1, 128):
        q = torch.randn(B, 1, 128, D, device="cuda", generator=gen).bfloat16()
        cache = dsa.quantize_kv_cache(torch.randn(64, 64, D, device="cuda", generator=gen), fmt)
        bt = torch.randint(-1, 64, (B, 8), device="cuda", generator=gen).int()
        idx = torch.randint(-1, 8 * 64, (B, 1, 512), device="cuda", generator=gen).int()
        kw = dict(block_table=bt, sink=torch.randn(128, device="cuda"), return_lse=True, backend="cute")
        assert_replays_without_sync(lambda: dsa.sparse_decode(q, cache, idx, **kw), q)
