"""The SM100 (Blackwell) cute tier, checked without an SM100 GPU.

* Offline compilation (CPU, CI): every served configuration is compiled for
  sm_100a in one subprocess (``CUTE_DSL_ARCH=sm_100a``); its PTX must hold
  the tcgen05 instructions the design rests on, ptxas must report no spills,
  and the launch's shared memory must be the kernel's own figure, within
  the 227 KB of an SM100 CTA.
* The gate (CPU, faked device): the capability table, then the self-check
  at first use, run with stand-in kernels against the real Triton kernels
  (interpreted): a wrong stand-in is caught, warned about once and
  disabled, and auto keeps Triton; a correct one is chosen; DSA_DISABLE_CUTE
  wins; a measured SM100 placement table that says Triton wins too; an SM90
  GPU takes the SM90 path as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import types
import warnings

import pytest
import torch

import dsa
import dsa.reference
from cute_offline import HAVE_DSL, compile_reports, fake_launch
from dsa import selector
from dsa._args import SparseAttnArgs, Unsupported
from dsa.cute import gate, host, placement

needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl is not installed")

# --------------------------------------------------------------------------
# offline compilation for sm_100a

# name, dtype, D, H, G, has_len, has_sink: H 64 / 128 x D 512 / 576, both dtypes, GQA, with and without
# topk_length and sink
FWD_CONFIGS = [
    ("h128_d576_bf16", "torch.bfloat16", 576, 128, 1, True, True),
    ("h128_d512_fp16_gqa", "torch.float16", 512, 256, 2, False, False),
    ("h64_d512_bf16", "torch.bfloat16", 512, 64, 1, True, True),
    ("h64_d576_fp16", "torch.float16", 576, 64, 1, True, False),
]
IDX_CONFIGS = [  # name, q dtype, weights dtype, causal, one sequence
    ("indexer_bf16_causal_varlen", "torch.bfloat16", "torch.float32", True, False),
    ("indexer_fp16_dense_single", "torch.float16", "torch.bfloat16", False, True),
]
FWD_NEEDLES = ("tcgen05.mma.cta_group::1.kind::f16", "tcgen05.ld.sync.aligned.32x32b", "tcgen05.st.sync.aligned",
               "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.commit", "tcgen05.fence::before_thread_sync",
               "tcgen05.fence::after_thread_sync", "tcgen05.wait::ld", "cp.async.cg.shared.global",
               "cp.async.wait_group", "fence.proxy.async", "mbarrier.try_wait", "max.NaN.f32")


def _dsa_warning(match: str):
    """pytest.warns for the gate's warning, with the Triton interpreter's own
    warnings ignored inside it (pytest.warns records every warning and
    re-emits the others, past the configured module filters)."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        with pytest.warns(RuntimeWarning, match=match) as caught, warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="triton.runtime.interpreter")
            yield caught
    return ctx()


# name, dtype, D, H, G, has_len, deterministic: the backward at H 64 / 128 (per kv head) x D 512 / 576, both
# dtypes, GQA, with and without topk_length, both modes of deterministic
BWD_CONFIGS = [
    ("bwd_h128_d576_bf16", "torch.bfloat16", 576, 128, 1, True, False),
    ("bwd_h64_d512_fp16", "torch.float16", 512, 64, 1, False, False),
    ("bwd_h128_d512_bf16_gqa", "torch.bfloat16", 512, 256, 2, True, False),
    ("bwd_h64_d576_bf16_det", "torch.bfloat16", 576, 64, 1, True, True),
]
BWD_NEEDLES = ("tcgen05.mma.cta_group::1.kind::f16", "tcgen05.ld.sync.aligned.32x32b", "tcgen05.ld.sync.aligned.16x256b",
               "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.commit", "tcgen05.fence::before_thread_sync",
               "tcgen05.fence::after_thread_sync", "tcgen05.wait::ld", "cp.async.cg.shared.global",
               "fence.proxy.async", "mbarrier.try_wait", "red.relaxed.gpu.global.add.L2::cache_hint.v4.f32",
               "st.global.v4.f32", "createpolicy", "shfl.sync.bfly", "ex2.approx", "st.local", "ld.local")
# the two-CTA backward (bf16, H128, D576; K, T and the launch shape are runtime values, so one build a mode
# serves every K): name, dtype, has_len, deterministic
PAIR_CONFIGS = [("pair_h128_d576_bf16", "torch.bfloat16", True, False),
                ("pair_h128_d576_bf16_det", "torch.bfloat16", False, True)]
PAIR_MMA = "tcgen05.mma.cta_group::2.kind::f16"
PAIR_COMMIT = "tcgen05.commit.cta_group::2.mbarrier::arrive::one.shared::cluster.multicast::cluster.b64"
PAIR_NEEDLES = (PAIR_MMA, PAIR_COMMIT, "tcgen05.mma.cta_group::1", "tcgen05.alloc.cta_group::2",
                "tcgen05.dealloc.cta_group::2", "tcgen05.relinquish_alloc_permit.cta_group::2",
                "mapa.shared::cluster", "st.shared::cluster.v4.b32", "fence.proxy.async.shared::cluster",
                "mbarrier.arrive.release.cluster.shared::cluster", "mbarrier.try_wait.parity.acquire.cluster",
                "barrier.cluster.arrive", "tcgen05.ld.sync.aligned.32x32b", "red.global.add.f32", "st.global.f32",
                "red.relaxed.gpu.global.add.v4.f32", "cp.async.cg.shared.global", "ex2.approx", "st.local",
                "ld.local")
IDX_NEEDLES = ("tcgen05.mma.cta_group::1.kind::f16", "tcgen05.ld.sync.aligned.32x32b", "tcgen05.alloc",
               "tcgen05.dealloc", "tcgen05.commit", "cp.async.bulk.tensor.2d", "mbarrier.arrive.expect_tx",
               "max.NaN.f32", "bar.sync")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Every served configuration compiled for sm_100a in one process."""
    calls = [(c[0], "dsa.cute.sm100.sparse_attention:compile_offline", list(c[1:]), {}) for c in FWD_CONFIGS]
    calls += [(c[0], "dsa.cute.sm100.indexer:compile_offline", list(c[1:]), {}) for c in IDX_CONFIGS]
    calls += [(c[0], "dsa.cute.sm100.sparse_attention:compile_offline_backward", list(c[1:]), {})
              for c in BWD_CONFIGS]
    calls += [(c[0], "dsa.cute.sm100.sparse_attention:compile_offline_pair", list(c[1:]), {}) for c in PAIR_CONFIGS]
    return compile_reports(calls, sorted(set(FWD_NEEDLES + IDX_NEEDLES + BWD_NEEDLES + PAIR_NEEDLES)), "sm_100a",
                           tmp_path_factory.mktemp("sm100"))


def _assert_fits(name: str, r: dict, smem: int) -> None:
    """ptxas reported no spills, and the launch asks for the kernel's own
    shared-memory figure ``smem``, within the 227 KB of an SM100 CTA."""
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (name, r)
    assert r["smem"] == smem <= 227 * 1024 == r["smem_limit"], (name, r)


@needs_dsl
@pytest.mark.parametrize("cfg", FWD_CONFIGS, ids=[c[0] for c in FWD_CONFIGS])
def test_forward_compiles_for_sm100_with_tcgen05(reports, cfg):
    from dsa.cute.sm100.sparse_attention_fwd import smem_bytes

    name, dt, D, H, G, has_len, has_sink = cfg
    r = reports[name]
    n = r["needles"]
    # S = Q K^T: two N = 32 atoms per 16 columns of D; O += P V: two N = 256 atoms per 16 slots
    assert n["tcgen05.mma.cta_group::1.kind::f16"] >= 2 * (D // 16) + 2 * (64 // 16), (name, n)
    assert n["tcgen05.alloc"] == 1 and n["tcgen05.dealloc"] == 1, (name, n)
    assert n["tcgen05.ld.sync.aligned.32x32b"] >= 2, (name, n)  # S, and O for the rescale and the epilogue
    assert n["tcgen05.st.sync.aligned"] >= 1, (name, n)  # the rescaled O
    assert n["tcgen05.commit"] >= 3, (name, n)  # S ready, Q free, P V retired
    assert n["tcgen05.wait::ld"] >= 2, (name, n)
    assert n["tcgen05.fence::before_thread_sync"] >= 3 and n["tcgen05.fence::after_thread_sync"] >= 3, (name, n)
    assert n["cp.async.cg.shared.global"] >= 2 * 4 * (D // 64), (name, n)  # the gather and Q
    assert n["cp.async.wait_group"] >= 1 and n["fence.proxy.async"] >= 2, (name, n)  # copies and P to the async proxy
    assert n["max.NaN.f32"] >= 32, (name, n)  # row maxima propagate NaN
    _assert_fits(name, r, smem_bytes(D, 512, getattr(torch, dt[6:]).itemsize))


@needs_dsl
@pytest.mark.parametrize("cfg", IDX_CONFIGS, ids=[c[0] for c in IDX_CONFIGS])
def test_indexer_compiles_for_sm100_with_tcgen05_and_tma(reports, cfg):
    from dsa.cute.sm100.indexer_fwd import smem_bytes

    name, dt = cfg[0], cfg[1]
    r = reports[name]
    n = r["needles"]
    assert n["tcgen05.mma.cta_group::1.kind::f16"] >= 128 // 16, (name, n)  # M 128 keys, N 256, one per 16 dims
    assert n["tcgen05.alloc"] == 1 and n["tcgen05.dealloc"] == 1, (name, n)
    assert n["tcgen05.ld.sync.aligned.32x32b"] >= 4 * 2, (name, n)  # 4 queries x 2 chunks of 32 heads
    assert n["tcgen05.commit"] >= 3, (name, n)  # key stage free, accumulator ready, Q free
    assert n["cp.async.bulk.tensor.2d"] >= 2 and n["mbarrier.arrive.expect_tx"] >= 2, (name, n)  # Q and keys by TMA
    assert n["max.NaN.f32"] >= 4 * 64, (name, n)  # relu keeps a NaN
    assert n["bar.sync"] >= 2, (name, n)
    _assert_fits(name, r, smem_bytes(getattr(torch, dt[6:]).itemsize))


@needs_dsl
@pytest.mark.parametrize("cfg", BWD_CONFIGS, ids=[c[0] for c in BWD_CONFIGS])
def test_backward_compiles_for_sm100_with_tcgen05(reports, cfg):
    from dsa.cute.sm100.sparse_attention_bwd import smem_bytes

    name, dt, D, H, G, has_len, det = cfg
    r = reports[name]
    n = r["needles"]
    chunks = D // 64
    # a K-step loop of two N-atoms for each of S, dP, dQ (and its RoPE part), and each dKV chunk's dS^T Q and,
    # for value chunks, P^T dO
    assert n["tcgen05.mma.cta_group::1.kind::f16"] == 2 * (3 + (D > 512) + chunks + 512 // 64), (name, n)
    assert n["tcgen05.alloc"] == 1 and n["tcgen05.dealloc"] == 1, (name, n)
    # S and dP in two 16-column loads each, dQ in 32-column loads (8, and 1 for the RoPE part)
    assert n["tcgen05.ld.sync.aligned.32x32b"] == 4 + 8 + (D > 512), (name, n)
    assert n["tcgen05.ld.sync.aligned.16x256b"] == 2 * chunks, (name, n)  # each dKV chunk: two 16-lane halves
    # S ready, stage free, dQ ready, each chunk ready, dS / P free, Q / dO free
    assert n["tcgen05.commit"] == 5 + chunks, (name, n)
    assert n["tcgen05.wait::ld"] >= 3, (name, n)
    assert n["tcgen05.fence::before_thread_sync"] >= 4 and n["tcgen05.fence::after_thread_sync"] >= 5, (name, n)
    assert n["cp.async.cg.shared.global"] >= 4 * chunks, (name, n)  # the gather, Q and dO
    assert n["fence.proxy.async"] >= 2 and n["mbarrier.try_wait"] >= 8, (name, n)
    assert n["ex2.approx"] >= 32, (name, n)  # P of a thread's 32 slots
    # dkv: per thread and 64-column chunk, eight whole-line four-float adds (under the L2 policy) or stores,
    # after sixteen shuffles that swap half-lines between the quads of a row pair
    assert n["red.relaxed.gpu.global.add.L2::cache_hint.v4.f32"] == (0 if det else 8 * chunks), (name, n)
    assert n["st.global.v4.f32"] == (8 * chunks if det else 0), (name, n)
    assert n["createpolicy"] == (0 if det else 1), (name, n)
    assert n["shfl.sync.bfly"] >= 16 * chunks, (name, n)
    assert n["st.local"] == 0 and n["ld.local"] == 0, (name, n)
    assert r["registers"] <= 128, (name, r)  # 13 warps: 4 on one scheduler, 16K registers each
    _assert_fits(name, r, smem_bytes(D, 512, getattr(torch, dt[6:]).itemsize))


@needs_dsl
@pytest.mark.parametrize("cfg", PAIR_CONFIGS, ids=[c[0] for c in PAIR_CONFIGS])
def test_pair_backward_compiles_for_sm100_with_cta_group_2(reports, cfg):
    """The two-CTA backward: every MMA a cta_group::2 MMA, issued from the
    leader and committed to both CTAs' barriers; P / dS and the dKV rounds'
    operands exchanged with mapa + st.shared::cluster; no spills."""
    from dsa.cute.sm100.sparse_attention_bwd_pair import smem_bytes

    name, dt, has_len, det = cfg
    r = reports[name]
    n = r["needles"]
    # K-step loops: S (the 512 latent columns, the D = 64 tail as its own round), dP; dQ's two N = 256 rounds
    # and its tail; dKV: five column-chunk pairs x two rounds of 64 heads x (dS^T Q, and P^T dO for value chunks)
    assert n[PAIR_MMA] == 3 + 3 + 5 * 2 + 4 * 2 and n["tcgen05.mma.cta_group::1"] == 0, (name, n)
    # S ready, the stage's two frees, Q free, dQ ready, each ring use and dKV chunk, dS free, the last
    assert n[PAIR_COMMIT] == 3 + 2 + 18 + 5 + 1 + 1, (name, n)
    for needle in ("tcgen05.alloc.cta_group::2", "tcgen05.dealloc.cta_group::2",
                   "tcgen05.relinquish_alloc_permit.cta_group::2"):
        assert n[needle] == 1, (name, needle, n)
    # the exchanges: a thread's P and dS rows into the B tile of the CTA whose slots they are (4 stores each),
    # and the rounds' Q / dO chunks into both CTAs' ring slots (34 chunks of 4 stores a thread)
    assert n["st.shared::cluster.v4.b32"] == 2 * 4 + 34 * 4, (name, n)
    assert n["mapa.shared::cluster"] >= n["st.shared::cluster.v4.b32"] + 4, (name, n)
    assert n["fence.proxy.async.shared::cluster"] >= 2, (name, n)
    assert n["mbarrier.arrive.release.cluster.shared::cluster"] >= 8, (name, n)
    assert n["mbarrier.try_wait.parity.acquire.cluster"] >= 1 and n["barrier.cluster.arrive"] == 2, (name, n)
    # S and dP in two 16-column loads each, dq in nine 32-column loads, each dKV accumulator in one
    assert n["tcgen05.ld.sync.aligned.32x32b"] == 4 + 9 + 5, (name, n)
    assert n["cp.async.cg.shared.global"] >= 9 * 2 + 5 * 4, (name, n)  # the score and dQ stages, Q and dO
    assert n["ex2.approx"] >= 32, (name, n)
    # dkv: a column of five chunks x 32 slots a thread, added (or stored per slot); a split row's dq added in fp32
    assert n["red.global.add.f32"] == (0 if det else 5 * 32) and n["st.global.f32"] == (5 * 32 if det else 0)
    assert n["red.relaxed.gpu.global.add.v4.f32"] == (0 if det else 9 * 8), (name, n)
    assert n["st.local"] == 0 and n["ld.local"] == 0, (name, n)
    assert r["registers"] <= 128, (name, r)
    _assert_fits(name, r, smem_bytes())


@pytest.mark.parametrize("K", [128, 512, 1024, 1152, 2048])
def test_pair_launch_shape_for_every_k(K):
    """One compiled two-CTA kernel serves every K (a runtime value): a short
    batch's rows are split over the idle clusters (whole blocks, none
    empty), a long one runs one cluster per row, persistent."""
    pytest.importorskip("cutlass")
    from dsa.cute.sm100.sparse_attention import pair_launch_shape

    blocks = -(-K // 64)
    for T, clusters in ((1, 74), (3, 74), (74, 74), (5000, 74), (2, 3)):
        n_cl, parts, per = pair_launch_shape(T, 1, K, clusters, split=True)
        assert 1 <= parts <= blocks and (parts - 1) * per < blocks <= parts * per, (T, parts, per)
        assert n_cl == min(clusters, T * parts)
        if T >= clusters:
            assert parts == 1 and n_cl == clusters
        else:  # at least half the clusters busy (whole blocks a part round the split down)
            assert 2 * T * parts >= min(clusters, T * blocks), (T, parts, per)
        assert pair_launch_shape(T, 1, K, clusters, split=False) == (min(clusters, T), 1, blocks)


# --------------------------------------------------------------------------
# the capability gate


@pytest.mark.parametrize("cap,arch", [((10, 0), "sm100"), ((10, 3), "sm100"), ((9, 0), "sm90"), ((12, 0), None),
                                      ((8, 0), None), ((10, 1), None)])
def test_architecture_by_capability(monkeypatch, cap, arch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    dev = torch.device("cuda", 0)
    assert host.arch_of(dev) == arch
    assert host.arch_of(torch.device("cpu")) is None
    why = host.arch_reason(dev, "the kernel", "sm100")
    assert (why is None) == (arch == "sm100")
    if why is not None:
        assert f"this GPU is SM{cap[0]}{cap[1]}" in why and "10.0 or 10.3" in why


def _fake_args(**kw):
    """A stand-in for canonical arguments on CUDA device 0."""
    q = types.SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cuda", 0), data_ptr=lambda: 1024)
    return types.SimpleNamespace(q=q, **kw)


def test_sm90_gpu_takes_the_sm90_path(monkeypatch, tmp_path):
    """On an H200 nothing changes: the SM90 hook decides, the SM100 one is never asked."""
    from dsa.cute import sm100
    from dsa.cute import sparse_attention as cute_sa

    asked = []
    monkeypatch.setattr(sm100, "backend_op", lambda *a, **k: asked.append(a))
    monkeypatch.setattr(cute_sa, "supports", lambda a: None)
    entry = dict(dtype="bfloat16", D=576, HG=128, K=2048, T=4, backend="cute", cute_ms=1.0, triton_ms=2.0)
    path = tmp_path / "placement_sm90.json"
    path.write_text(json.dumps({"device": "NVIDIA H200", "entries": [entry]}))
    monkeypatch.setattr(placement, "TABLE", str(path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    args = _fake_args(D=576, H=128, G=1, K=2048, T=4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    chosen = dsa.cute.backend_op("sparse_attention_fwd", args, auto=True)
    assert chosen.fn is cute_sa.forward and "placement table entry" in chosen.note and not asked
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    dsa.cute.backend_op("sparse_attention_fwd", args, auto=True)
    assert len(asked) == 1


# --------------------------------------------------------------------------
# the self-check at first use, with stand-in kernels on CPU


def _call_inputs(dtype=torch.float16, H=64, D=512, N=96):
    """A small call of a served static shape (fp16: the interpreted Triton
    kernel computes bf16 wrongly)."""
    g = torch.Generator().manual_seed(3)
    T, K = 5, 64
    q = torch.randn(T, H, D, generator=g).to(dtype)
    kv = torch.randn(N, D, generator=g).to(dtype)
    idx = torch.randint(-4, N + 4, (T, K), generator=g, dtype=torch.int32)
    tl = torch.tensor([64, 3, 0, -1, 100], dtype=torch.int32)
    sink = torch.randn(H, generator=g)
    return (q, kv, idx), dict(d_v=512, sink=sink, topk_length=tl)


def _reference(a: SparseAttnArgs):
    return dsa.reference.backend_op("sparse_attention_fwd", a)(a)


class StandIn:
    """A stand-in for the SM100 forward (its signature: args, grid config),
    counting its calls; ``corrupt`` turns the reference's result into the
    stand-in's."""

    def __init__(self, corrupt=None, compute=_reference):
        self.calls = 0
        self.corrupt, self.compute = corrupt, compute

    def __call__(self, a, config=None):
        self.calls += 1
        out, lse = self.compute(a)
        return self.corrupt(out, lse) if self.corrupt else (out, lse)


@pytest.fixture
def sm100(monkeypatch, tmp_path):
    """CPU tensors routed as on an SM100 GPU with no placement table; the
    kernel's device checks pass (the stand-ins run on CPU); no verdicts yet."""
    pytest.importorskip("triton")
    if not HAVE_DSL:
        pytest.skip("nvidia-cutlass-dsl is not installed")
    from dsa.cute.sm100 import sparse_attention as sm100_sa

    monkeypatch.setattr(host, "arch_of", lambda device: "sm100")
    monkeypatch.setattr(selector, "_device_type", lambda args: "cuda")
    monkeypatch.setattr(sm100_sa, "supports", lambda a: None)
    monkeypatch.setattr(gate, "_VERDICTS", {})
    monkeypatch.setattr(placement, "TABLE_SM100", str(tmp_path / "absent.json"))
    monkeypatch.delenv("DSA_DISABLE_CUTE", raising=False)
    monkeypatch.delenv("DSA_BACKEND", raising=False)

    def use(standin):
        monkeypatch.setattr(sm100_sa, "forward", standin)
        return standin

    return use


def _triton(a):
    from dsa.triton.sparse_attention import forward

    return forward(a)


WRONG = {
    "scaled": StandIn(lambda out, lse: (out * 1.1, lse)),
    # reads the slots past topk_length: the hostile problem's NaN rows leak into out
    "ignores_topk_length": StandIn(compute=lambda a: _reference(
        SparseAttnArgs(a.q, a.kv, a.indices, None, a.sink, a.sm_scale, a.d_v))),
    # a maximum that drops NaN: the NaN query row's out is finite
    "drops_nan": StandIn(lambda out, lse: (torch.nan_to_num(out), lse)),
    "empty_row_lse_zero": StandIn(lambda out, lse: (out, torch.where(lse == float("inf"), 0.0, lse))),
}


CAUGHT_BY = {"scaled": "out: relative L2 error", "ignores_topk_length": "out: NaN at",
             "drops_nan": "out: NaN at", "empty_row_lse_zero": "lse: +inf at"}


@pytest.mark.parametrize("kind", list(WRONG))
def test_wrong_kernel_is_caught_disabled_and_auto_keeps_triton(sm100, kind):
    standin = sm100(StandIn(WRONG[kind].corrupt, WRONG[kind].compute))
    args, kw = _call_inputs()
    with _dsa_warning("failed its self-check against Triton") as caught:
        text = dsa.explain("sparse_attention", *args, **kw)
    assert len([w for w in caught if str(w.message).startswith("dsa: ")]) == 1
    assert "sparse_attention_fwd: backend 'triton'" in text, text
    assert f"cute: self-check at first use failed: {CAUGHT_BY[kind]}" in text, text
    assert "disabled for the process" in text, text
    assert standin.calls == 1  # the self-check's run; the call itself never reached it
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="dsa: ")  # warned once: the verdict is kept
        out = dsa.sparse_attention(*args, **kw)
        assert torch.equal(out, dsa.sparse_attention(*args, backend="triton", **kw))
        with pytest.raises(ValueError, match="self-check at first use failed"):
            dsa.sparse_attention(*args, backend="cute", **kw)
    assert standin.calls == 1


def test_correct_kernel_is_upgraded(sm100):
    standin = sm100(StandIn())
    args, kw = _call_inputs()
    text = dsa.explain("sparse_attention", *args, **kw)
    assert "sparse_attention_fwd: backend 'cute'" in text, text
    assert "self-check at first use passed: relative L2 error" in text and "same NaN/inf positions" in text, text
    assert "no placement table ships for this GPU" in text and "auto upgrades" in text, text
    # the backward's own checks are not faked here (CPU tensors): Triton keeps it
    assert "sparse_attention_bwd: backend 'triton'" in text
    assert standin.calls == 1
    out = dsa.sparse_attention(*args, **kw)
    assert standin.calls == 2  # the call itself went to the kernel
    q, kv, idx = args
    ref = dsa.sparse_attention(*args, backend="reference", **kw)
    assert torch.equal(out, ref)


def test_each_configuration_is_checked_once(sm100):
    standin = sm100(StandIn())
    args, kw = _call_inputs()
    dsa.sparse_attention(*args, **kw)
    dsa.sparse_attention(*args, **kw)
    assert standin.calls == 1 + 2
    kw2 = dict(kw, sink=None)  # another compiled configuration: its own check
    dsa.sparse_attention(*args, **kw2)
    assert standin.calls == 3 + 2
    assert len(gate.verdicts()) == 2 and all(v.passed for _, v in gate.verdicts())


def test_dsa_disable_cute_wins(sm100, monkeypatch):
    standin = sm100(StandIn())
    monkeypatch.setenv("DSA_DISABLE_CUTE", "1")
    args, kw = _call_inputs()
    text = dsa.explain("sparse_attention", *args, **kw)
    assert "backend 'triton'" in text and "disabled by DSA_DISABLE_CUTE=1" in text, text
    dsa.sparse_attention(*args, **kw)
    assert standin.calls == 0 and gate.verdicts() == []


def test_a_check_that_raises_fails(sm100):
    def broken(a, config=None):
        raise RuntimeError("launch failed")

    sm100(broken)
    args, kw = _call_inputs()
    with _dsa_warning("launch failed"):
        text = dsa.explain("sparse_attention", *args, **kw)
    assert "the check raised RuntimeError: launch failed" in text and "backend 'triton'" in text, text


def _measured_table(monkeypatch, tmp_path, table: str, backend: str = "triton"):
    """A placement table ``placement.<table>`` measured on this (faked) B200
    whose one entry, _call_inputs' shape, names ``backend``; returns
    (write(backend), its entry)."""
    entry = dict(dtype="float16", D=512, HG=64, K=64, T=5, backend=backend, cute_ms=2.0, triton_ms=1.0)
    path = tmp_path / f"{table}.json"

    def write(backend: str) -> None:
        path.write_text(json.dumps({"device": "NVIDIA B200", "entries": [dict(entry, backend=backend)]}))
        placement._load.cache_clear()

    write(backend)
    monkeypatch.setattr(placement, table, str(path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B200")
    return write


def test_measured_sm100_table_decides_before_the_check(sm100, monkeypatch, tmp_path):
    standin = sm100(StandIn())
    args, kw = _call_inputs()
    write = _measured_table(monkeypatch, tmp_path, "TABLE_SM100")
    text = dsa.explain("sparse_attention", *args, **kw)
    assert "says triton is faster" in text and "backend 'triton'" in text, text
    assert standin.calls == 0  # the table said Triton: no check needed
    write("cute")
    text = dsa.explain("sparse_attention", *args, **kw)
    assert "backend 'cute'" in text and "placement table entry" in text and "self-check at first use passed" in text
    # measured on another GPU: the self-check decides alone
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B300")
    text = dsa.explain("sparse_attention", *args, **kw)
    assert "measured on NVIDIA B200; this GPU is NVIDIA B300" in text and "backend 'cute'" in text, text
    placement._load.cache_clear()


def test_check_first_needed_under_capture_runs_outside_it(monkeypatch):
    ran = []

    def outside(run, device):
        ran.append(device)
        return run()

    monkeypatch.setattr(gate, "_VERDICTS", {})
    monkeypatch.setattr(host, "_outside_capture", outside)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    dev = torch.device("cuda", 0)
    x = torch.ones(3)
    v = gate.verdict("key", lambda: [(x, x.clone())], ["x"], dev, "a kernel")
    assert v.passed and ran == [dev]


def test_compare_names_what_differs():
    a = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 2.0])
    assert gate.compare([(a, a.clone())], ["out"]).passed
    for b, what in ((torch.tensor([1.0, 0.0, float("inf"), -float("inf"), 2.0]), "NaN"),
                    (torch.tensor([1.0, float("nan"), 3.0, -float("inf"), 2.0]), "+inf"),
                    (torch.tensor([1.0, float("nan"), float("inf"), 0.0, 2.0]), "-inf"),
                    (torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 2.1]), "relative L2")):
        v = gate.compare([(b, a)], ["out"])
        assert not v.passed and what in v.detail and v.detail.startswith("out: "), v.detail
    assert not gate.compare([(a[:2], a)], ["lse"]).passed


# --------------------------------------------------------------------------
# the hostile problem holds what the self-check relies on


@needs_dsl
@pytest.mark.parametrize("has_len,has_sink,G", [(True, True, 1), (False, False, 2)])
def test_hostile_problem_exercises_every_rule(has_len, has_sink, G):
    import cutlass

    from dsa.cute.sm100.sparse_attention import SELF_CHECK_K, SELF_CHECK_N, hostile_problem
    from dsa.cute.sm100.sparse_attention_fwd import RESCALE_LOG2, FwdSm100Config

    cfg = FwdSm100Config(cutlass.Float16, 512, 512, 64 * G, G, has_len, has_sink)
    a = hostile_problem(cfg, torch.device("cpu"))
    assert (a.H, a.G, a.D, a.K, a.q.dtype) == (64 * G, G, 512, SELF_CHECK_K, torch.float16)
    assert (a.topk_length is not None) == has_len and (a.sink is not None) == has_sink
    idx = a.indices.long()
    assert (idx == -1).any() and (idx == SELF_CHECK_N).any() and (idx == 2**31 - 1).any()
    out, lse = _reference(a)
    nan_rows = torch.isnan(out).any(-1)
    assert nan_rows.sum() == 1 and nan_rows[-1, a.H // 2]  # only the NaN query head
    # token 5: every slot invalid, a NaN query head among its heads: an empty row all the same
    assert torch.isnan(a.q[5, a.H // 2].float()).all() and (out[5] == 0).all() and (lse[5] == float("inf")).all()
    if has_len:
        L = a.topk_length.long()
        assert (L > SELF_CHECK_K).any() and (L < 0).any() and (L == 0).any()
        assert (lse == float("inf")).all(-1).sum() == 3  # the tokens with no valid slot
        # the NaN kv rows sit right past topk_length: reading them would poison the row
        leaked = _reference(SparseAttnArgs(a.q, a.kv, a.indices, None, a.sink, a.sm_scale, a.d_v))[0]
        assert torch.isnan(leaked).any(-1).sum() > nan_rows.sum()
    if has_sink:
        assert torch.isinf(a.sink).sum() == 2 and (a.sink == 3.0e38).any()
        assert (out[:, 0] == 0).all()  # sink +inf: the sink takes everything
    # the maximum grows along the row by more than 2^8 for the even heads (O is rescaled in flight)
    ok = (idx[0, 0] >= 0) & (idx[0, 0] < SELF_CHECK_N - 2)
    s = (a.kv[idx[0, 0].clamp(0, SELF_CHECK_N - 1), 0].float() @ a.q[0, 0].float()) * a.sm_scale * 1.4427
    s = torch.where(ok, s, -float("inf"))
    assert s[-64:].max() - s[:64].max() > 2 * RESCALE_LOG2


# --------------------------------------------------------------------------
# the lean indexer's gate


def _indexer_reference(a):
    return dsa.reference.backend_op("indexer_scores", a)(a)


@pytest.fixture
def sm100_indexer(sm100, monkeypatch):
    """As ``sm100``, for the indexer: a GPU of 2 SMs, the kernel's own checks pass."""
    from dsa.cute.sm100 import indexer

    monkeypatch.setattr(indexer, "supports", lambda a: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(multi_processor_count=2))

    def use(scores):
        calls = []

        def counted(a):
            calls.append(a)
            return scores(a)

        def launch(a, out, blk_cum, r0, r1):  # the kernel's launcher, as indexer_topk drives it
            out[: r1 - r0] = counted(a)[r0:r1]

        monkeypatch.setattr(indexer, "scores", counted)
        monkeypatch.setattr(indexer, "launch_scores", launch)
        return calls

    return use


def _indexer_inputs(Tq=9):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, Tq, 64, 128, generator=g).half()
    k = torch.randn(2, 40, 128, generator=g).half()
    w = torch.randn(2, Tq, 64, generator=g)
    return (q, k, w), dict(ratio=2, q_offsets=torch.tensor([30, -3]), sm_scale=128 ** -0.5)


def test_indexer_correct_kernel_is_upgraded(sm100_indexer):
    calls = sm100_indexer(_indexer_reference)
    args, kw = _indexer_inputs()
    text = dsa.explain("indexer_scores", *args, **kw)
    assert "indexer_scores: backend 'cute'" in text, text
    assert "self-check at first use passed" in text and "its grid fills the GPU" in text, text
    assert len(calls) == 1
    s = dsa.indexer_scores(*args, **kw)
    assert torch.equal(s, dsa.indexer_scores(*args, backend="reference", **kw))
    # indexer_topk runs the same (already checked) kernel through the chunked top-k driver
    idx, n = dsa.indexer_topk(*args, 5, return_lengths=True, **kw)
    ref_idx, ref_n = dsa.topk_indices(s, 5, return_lengths=True, backend="triton")
    assert torch.equal(idx, ref_idx) and torch.equal(n, ref_n)
    assert len(gate.verdicts()) == 1


def test_indexer_wrong_kernel_is_caught(sm100_indexer):
    def arithmetic_mask(a):
        """Masks by adding -inf: the hostile problem's NaN keys past every window come out NaN."""
        dense = _indexer_reference(dataclasses.replace(a, causal=False))
        visible = torch.isfinite(_indexer_reference(a))
        return dense + torch.where(visible, 0.0, -float("inf"))

    sm100_indexer(arithmetic_mask)
    args, kw = _indexer_inputs()
    with _dsa_warning("failed its self-check"):
        text = dsa.explain("indexer_scores", *args, **kw)
    assert "indexer_scores: backend 'triton'" in text and "self-check at first use failed: scores: NaN at" in text
    with pytest.raises(ValueError, match="self-check at first use failed"):
        dsa.indexer_topk(*args, 5, backend="cute", **kw)


def test_indexer_keeps_triton_where_its_grid_does_not_fill_the_gpu(sm100_indexer, monkeypatch):
    calls = sm100_indexer(_indexer_reference)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(multi_processor_count=148))
    args, kw = _indexer_inputs()
    text = dsa.explain("indexer_topk", *args, 5, **kw)
    assert "5 query blocks of 4 do not fill the 148 SMs; the Triton indexer serves this call" in text, text
    assert "indexer_topk: backend 'triton'" in text and not calls  # no self-check needed


@needs_dsl
@pytest.mark.parametrize("single,causal", [(False, True), (True, True), (False, False)])
def test_indexer_hostile_problem(single, causal):
    import cutlass

    from dsa.cute.sm100.indexer import hostile_problem
    from dsa.cute.sm100.indexer_fwd import IndexerSm100Config

    a = hostile_problem(IndexerSm100Config(cutlass.BFloat16, cutlass.Float32, causal, single), torch.device("cpu"))
    assert (a.q.shape[1:], a.k.shape[1], a.batch) == ((64, 128), 128, 1 if single else 3)
    s = _indexer_reference(a)
    assert not torch.isnan(s).any()  # NaN keys exist only where no query sees them
    assert a.max_seqlen_k > int(torch.diff(a.cu_seqlens_k).max())  # columns past every sequence
    if causal:
        assert torch.isnan(a.k.float()).any()
        if not single:
            assert (s == -float("inf")).all(-1).any()  # rows that see no key
        dense = _indexer_reference(dataclasses.replace(a, causal=False))
        assert torch.isnan(dense).any()  # those keys share computed tiles with visible ones


# --------------------------------------------------------------------------
# the backward: its gate with stand-in kernels on CPU, its host side


def _kernel_numerics(a: SparseAttnArgs, out, lse, dout, add_mask=False, ignore_length=False):
    """dq, dkv and dsink as the SM100 backward computes them, in torch: the
    Triton preprocess's per-row terms, then ``_kernel_slots``.  add_mask:
    padded slots masked by adding -inf to the score (a NaN query row's
    padded slots then give NaN) instead of the kernel's select;
    ignore_length: every slot below K read."""
    from dsa.triton.sparse_attention import preprocess

    delta, lg2den, dsink_part = preprocess(a, out.contiguous(), lse.contiguous(), dout.contiguous())
    dq, slot, valid, rows = _kernel_slots(a, lg2den, delta, dout, add_mask, ignore_length)
    dkv = torch.zeros(a.N * a.G, a.D)
    dkv.index_add_(0, (rows * a.G + torch.arange(a.G)[None, :, None])[valid], slot.sum(2)[valid])
    dsink = dsink_part.sum(0) if dsink_part is not None else None
    return dq, dkv.view(a.N, a.G, a.D).to(a.kv.dtype), dsink


def _kernel_slots(a: SparseAttnArgs, lg2den, delta, dout, add_mask=False, ignore_length=False):
    """What the kernel computes from the per-row terms: dq [T, H, D] (q's
    dtype) and each slot's dkv row per head block, slot [T, G, HB, K, D]
    fp32, with P and dS rounded to q's dtype; and the slots' validity and
    kv rows [T, G, K]."""
    from dsa._rules import LOG2E

    T, H, G, K, D, N = a.T, a.H, a.G, a.K, a.D, a.N
    HG, dv = H // G, a.d_v
    L = torch.full((T,), K) if a.topk_length is None or ignore_length else a.topk_length.long().clamp(0, K)
    idx = a.indices.long()
    valid = (torch.arange(K)[None, None] < L[:, None, None]) & (idx >= 0) & (idx < N)   # [T, G, K]
    rows = torch.where(valid, idx, 0)
    kvg = torch.where(valid[..., None], a.kv.float()[rows, torch.arange(G)[None, :, None]], 0.0)  # [T, G, K, D]
    q4, do4 = a.q.float().view(T, G, HG, D), dout.float().view(T, G, HG, dv)
    s = torch.einsum("tghd,tgkd->tghk", q4, kvg)
    dp = torch.einsum("tghd,tgkd->tghk", do4, kvg[..., :dv])
    x = s * (a.sm_scale * LOG2E) - lg2den.view(T, G, HG, 1)
    ok = valid[:, :, None]
    if add_mask:
        x = x + torch.where(ok, 0.0, -float("inf"))
    p = torch.exp2(x)
    ds = p * (dp - delta.view(T, G, HG, 1)) * a.sm_scale
    if not add_mask:
        p, ds = torch.where(ok, p, 0.0), torch.where(ok, ds, 0.0)
    p, ds = p.to(a.q.dtype).float(), ds.to(a.q.dtype).float()
    dq = torch.einsum("tghk,tgkd->tghd", ds, kvg).reshape(T, H, D).to(a.q.dtype)
    HB = HG // 64
    slot = torch.einsum("tgbhk,tgbhd->tgbkd", ds.view(T, G, HB, 64, K), q4.view(T, G, HB, 64, D))
    slot[..., :dv] += torch.einsum("tgbhk,tgbhd->tgbkd", p.view(T, G, HB, 64, K), do4.view(T, G, HB, 64, dv))
    return dq, slot, valid, rows


class BwdStandIn:
    """A stand-in for the SM100 backward (its signature: args, out, lse, dout,
    grid config), counting its calls; ``corrupt`` turns the kernel-like
    result into the stand-in's."""

    def __init__(self, corrupt=None, **numerics):
        self.calls = 0
        self.corrupt, self.numerics = corrupt, numerics

    def __call__(self, a, out, lse, dout, config=None):
        self.calls += 1
        res = _kernel_numerics(a, out, lse, dout, **self.numerics)
        return self.corrupt(*res) if self.corrupt else res


# (inputs' fingerprint, op) -> the interpreted Triton kernel's result, shared by the module's tests
_TRITON_RUNS: dict = {}


def _fingerprint(*tensors):
    return tuple((tuple(x.shape), x.dtype, float(x.double().nan_to_num(posinf=7.0, neginf=-7.0).sum()))
                 for x in tensors if x is not None)


@pytest.fixture
def triton_once(monkeypatch):
    """The Triton forward and backward run once per distinct input in this
    module (the self-checks of several tests share one hostile problem);
    the deterministic backward's result is the other mode's (they differ in
    the order of fp32 sums only, and interpreted it takes ~20 s)."""
    from dsa.triton import sparse_attention as triton_sa

    forward, backward = triton_sa.forward, triton_sa.backward

    def once(op, fn, key, *args):
        if (op, key) not in _TRITON_RUNS:
            _TRITON_RUNS[op, key] = fn(*args)
        return _TRITON_RUNS[op, key]

    def fwd(a, config=None):
        return once("fwd", forward, _fingerprint(a.q, a.kv, a.indices, a.topk_length, a.sink), a)

    def bwd(a, out, lse, dout, config=None):
        a = dataclasses.replace(a, deterministic=False)
        return once("bwd", backward, _fingerprint(a.q, a.kv, a.indices, a.topk_length, a.sink, out, lse, dout),
                    a, out, lse, dout)

    monkeypatch.setattr(triton_sa, "forward", fwd)
    monkeypatch.setattr(triton_sa, "backward", bwd)


@pytest.fixture
def sm100_bwd(sm100, triton_once, monkeypatch):
    """As ``sm100``, with a correct forward stand-in and the backward's own
    checks passed; ``use(standin)`` installs the backward's stand-in."""
    from dsa.cute.sm100 import sparse_attention as sm100_sa

    forward = sm100(StandIn())
    monkeypatch.setattr(sm100_sa, "supports_backward", lambda a: None)

    def use(standin):
        monkeypatch.setattr(sm100_sa, "backward", standin)
        return standin

    use.forward = forward
    return use


BWD_WRONG = {
    "scaled_dq": (dict(corrupt=lambda dq, dkv, ds: (dq * 1.1, dkv, ds)), "dq: relative L2 error"),
    # reads the slots past topk_length: the hostile problem's NaN rows reach dq and dkv
    "ignores_topk_length": (dict(ignore_length=True), "dq: NaN at"),
    # masks padded slots by adding -inf: the NaN query head of the token with no valid slot gets a NaN dq
    "adds_the_mask": (dict(add_mask=True), "dq: NaN at"),
    # dkv accumulated onto a buffer that was not zeroed
    "dkv_not_zeroed": (dict(corrupt=lambda dq, dkv, ds: (dq, dkv + 0.25, ds)), "dkv: relative L2 error"),
    # dsink without the sink fold: exp(sink - lse) of the +inf sink times Delta = 0 is NaN
    "dsink_unfolded": (dict(corrupt=lambda dq, dkv, ds: (dq, dkv, torch.where(torch.arange(ds.numel()) == 0,
                                                                             float("nan"), ds))), "dsink: NaN at"),
}


def _bwd_inputs(deterministic=False):
    args, kw = _call_inputs()
    return args, dict(kw, deterministic=deterministic)


@pytest.mark.parametrize("kind", list(BWD_WRONG))
def test_wrong_backward_is_caught_disabled_and_auto_keeps_triton(sm100_bwd, kind):
    numerics, caught_by = BWD_WRONG[kind]
    standin = sm100_bwd(BwdStandIn(**numerics))
    args, kw = _bwd_inputs()
    with _dsa_warning("failed its self-check against Triton") as caught:
        text = dsa.explain("sparse_attention", *args, **kw)
    assert len([w for w in caught if str(w.message).startswith("dsa: ")]) == 1
    assert "sparse_attention_fwd: backend 'cute'" in text, text
    assert "sparse_attention_bwd: backend 'triton'" in text, text
    assert f"cute: self-check at first use failed: {caught_by}" in text, text
    assert standin.calls == 1
    q, kv, idx = args
    q, kv = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="dsa: ")  # warned once: the verdict is kept
        dsa.sparse_attention(q, kv, idx, **kw).float().square().sum().backward()
        with pytest.raises(ValueError, match="self-check at first use failed"):
            dsa.sparse_attention(q, kv, idx, backend="cute", **kw).float().sum().backward()
    assert standin.calls == 1  # Triton ran the backward


@pytest.mark.parametrize("deterministic", [False, True])
def test_correct_backward_is_upgraded(sm100_bwd, deterministic):
    standin = sm100_bwd(BwdStandIn())
    args, kw = _bwd_inputs(deterministic)
    text = dsa.explain("sparse_attention", *args, **kw)
    assert "sparse_attention_bwd: backend 'cute'" in text, text
    bwd = text[text.index("sparse_attention_bwd: backend"):]
    assert "self-check at first use passed: relative L2 error" in bwd and "auto upgrades" in bwd, text
    assert standin.calls == 1
    q, kv, idx = args
    sink = kw["sink"].clone().requires_grad_(True)
    grads = []
    for backend in ("auto", "triton"):
        x, y = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
        out = dsa.sparse_attention(x, y, idx, backend=backend, **dict(kw, sink=sink))
        out.float().square().sum().backward()
        grads.append((x.grad, y.grad, sink.grad.clone()))
        sink.grad = None
    assert standin.calls == 2  # the call's backward went to the kernel
    for got, want, name in zip(grads[0], grads[1], ("dq", "dkv", "dsink")):
        assert gate.compare([(got, want)], [name]).passed, name
    keys = [k for k, _ in gate.verdicts() if k[0] == "sparse_attention_bwd"]
    assert len(keys) == 1 and keys[0][1].deterministic == deterministic


def test_backward_configurations_are_checked_once_each(sm100_bwd):
    standin = sm100_bwd(BwdStandIn())
    args, kw = _bwd_inputs()
    for det in (False, True, False, True):  # two compiled configurations
        dsa.explain("sparse_attention", *args, **dict(kw, deterministic=det))
    assert standin.calls == 2
    assert sorted(k[1].deterministic for k, v in gate.verdicts() if k[0] == "sparse_attention_bwd") == [False, True]


def test_dsa_disable_cute_wins_for_the_backward(sm100_bwd, monkeypatch):
    standin = sm100_bwd(BwdStandIn())
    monkeypatch.setenv("DSA_DISABLE_CUTE", "1")
    args, kw = _bwd_inputs()
    text = dsa.explain("sparse_attention", *args, **kw)
    assert "sparse_attention_bwd: backend 'triton'" in text and "disabled by DSA_DISABLE_CUTE=1" in text, text
    q, kv, idx = args
    dsa.sparse_attention(q.clone().requires_grad_(True), kv, idx, **kw).float().sum().backward()
    assert standin.calls == 0 and sm100_bwd.forward.calls == 0 and gate.verdicts() == []


def test_a_backward_check_that_raises_fails(sm100_bwd):
    def broken(a, out, lse, dout, config=None):
        raise RuntimeError("launch failed")

    sm100_bwd(broken)
    args, kw = _bwd_inputs()
    with _dsa_warning("launch failed"):
        text = dsa.explain("sparse_attention", *args, **kw)
    bwd = text[text.index("sparse_attention_bwd: backend"):]
    assert "the check raised RuntimeError: launch failed" in bwd and "backend 'triton'" in bwd, text


def test_measured_sm100_backward_table_decides(sm100_bwd, monkeypatch, tmp_path):
    standin = sm100_bwd(BwdStandIn())
    args, kw = _bwd_inputs()
    write = _measured_table(monkeypatch, tmp_path, "TABLE_SM100_BWD")
    text = dsa.explain("sparse_attention", *args, **kw)
    bwd = text[text.index("sparse_attention_bwd: backend"):]
    assert "backend 'triton'" in bwd and "says triton is faster" in bwd, text
    assert "sparse_attention_fwd: backend 'cute'" in text  # the forward's own (absent) table
    assert standin.calls == 0
    write("cute")
    text = dsa.explain("sparse_attention", *args, **kw)
    bwd = text[text.index("sparse_attention_bwd: backend"):]
    assert "backend 'cute'" in bwd and "placement table entry" in bwd and "self-check at first use passed" in bwd
    assert standin.calls == 1
    placement._load.cache_clear()


@needs_dsl
def test_backward_hostile_problem_and_reference(triton_once):
    """The backward's self-check problem: the forward's hostile problem with
    sinks, out and lse from the Triton forward; the reference is the Triton
    backward, and a kernel computing as the SM100 one does agrees with it."""
    import cutlass

    from dsa.cute.sm100 import sparse_attention as sm100_sa
    from dsa.cute.sm100.sparse_attention_bwd import BwdSm100Config

    cfg = BwdSm100Config(cutlass.Float16, 512, 512, 64, 1, True, False)
    seen = []

    def kernel(a, out, lse, dout):
        seen.append(a)
        return _kernel_numerics(a, out, lse, dout)

    pairs = sm100_sa.self_check_backward(cfg, torch.device("cpu"), kernel=kernel)
    (a,) = seen
    assert not a.deterministic and a.sink is not None and torch.isinf(a.sink).sum() == 2
    v = gate.compare(pairs, ("dq", "dkv", "dsink"))
    assert v.passed, v.detail
    (dq, _), (dkv, _), (dsink, _) = pairs
    assert (dq[5] == 0).all() and (dq[1] == 0).all() and (dq[2] == 0).all()  # tokens with no valid slot
    assert torch.isnan(dq[-1, a.H // 2]).all() and torch.isnan(dsink[a.H // 2])  # the NaN query head
    assert not torch.isnan(dkv[-2:]).any()  # the NaN kv rows only slots past topk_length name


def _fragment_order(x: torch.Tensor) -> torch.Tensor:
    """dkv rows [..., D] in the kernel's fragment order (``natural_columns`` inverted)."""
    *lead, D = x.shape
    return x.reshape(*lead, D // 16, 2, 4, 2).transpose(-3, -2).reshape(*lead, D)


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_host_flow_with_an_emulated_launch(monkeypatch, deterministic):
    """``backward``'s host side on CPU with the launch emulated as the kernel
    writes: dq rows of the launch's tokens, dkv added (fragment order) into
    the zeroed accumulator, or, deterministic, each valid slot's row stored
    at [head block, token - t0, g, slot] of the per-slot buffer [HB, tc, G,
    K, D] of the launch's tc tokens; several token chunks a call.  The result is the kernel-like computation's."""
    from dsa.cute.sm100 import sparse_attention as sm100_sa
    from dsa.triton import segment_sum

    monkeypatch.setattr(segment_sum, "WORKSPACE_BYTES", 3 * 2 * 64 * 512 * 4)  # 3 tokens a chunk: 2 chunks
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())  # CPU tensors stand in
    args, kw = _call_inputs(H=128, N=24)  # few kv rows: the interpreted segment_sum runs a program per row
    q, kv, idx = args
    a = SparseAttnArgs(q, kv.view(-1, 1, 512), idx.view(5, 1, -1), kw["topk_length"], kw["sink"], 512 ** -0.5, 512,
                       deterministic)
    out, lse = _reference(a)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(q.dtype)
    want = _kernel_numerics(a, out, lse, dout)
    launches = []

    def launch(a, dout_, lg2den, delta, dq, dkv_buf, t0, tc, grid):
        launches.append((t0, tc))
        r = slice(t0, t0 + tc)
        part = dataclasses.replace(a, q=a.q[r], indices=a.indices[r], topk_length=a.topk_length[r])
        dq[r], slot, valid, rows = _kernel_slots(part, lg2den[r], delta[r], dout_[r])
        if not deterministic:  # added into the accumulator, as the kernel's adds do
            dkv_buf.view(-1, a.D).index_add_(0, (rows * a.G + torch.arange(a.G)[None, :, None])[valid],
                                             _fragment_order(slot.sum(2)[valid]))
            return
        dkv_buf.fill_(float("nan"))  # invalid slots' rows are never written, never read
        HB = a.H // a.G // 64
        buf = dkv_buf[:HB * tc * a.G * a.K].view(HB, tc, a.G, a.K, a.D)  # the launch's tokens only
        for t, g, j in valid.nonzero().tolist():
            buf[:, t, g, j] = _fragment_order(slot[t, g, :, j])

    monkeypatch.setattr(sm100_sa, "_launch_backward", launch)
    dq, dkv, dsink = sm100_sa.backward(a, out, lse, dout)
    assert launches == ([(0, 3), (3, 2)] if deterministic else [(0, 5)])
    assert torch.equal(dq, want[0]) and torch.equal(dsink, want[2])
    assert gate.compare([(dkv, want[1])], ["dkv"]).passed and dkv.dtype == a.kv.dtype


def test_backward_launch_offsets_every_token_pointer(monkeypatch):
    """The launch over tokens [t0, t0 + tc) passes pointers that start at
    token t0 (the kernel counts tc tokens), under a's device, with the
    shared zero row and the current stream."""
    pytest.importorskip("cutlass")
    from dsa.cute.sm100 import sparse_attention as sm100_sa

    events, launched, zero = fake_launch(monkeypatch, sm100_sa, 512)
    args, kw = _call_inputs()
    q, kv, idx = args
    a = SparseAttnArgs(q, kv.view(-1, 1, 512), idx.view(5, 1, -1), kw["topk_length"], None, 0.5, 512)
    lg2den, delta = torch.zeros(5, 64), torch.ones(5, 64)
    dout, dq, buf = torch.zeros(5, 64, 512), torch.zeros_like(q), torch.zeros(3, 512)
    sm100_sa._launch_backward(a, dout, lg2den, delta, dq, buf, 2, 3, sm100_sa.GridConfig(ctas=7))
    (x,) = launched
    for got, whole in zip(x[:8], (q, a.kv, a.indices, a.topk_length, dout, lg2den, delta, dq)):
        if whole is a.kv:
            assert got is a.kv
        else:
            assert got.data_ptr() == whole[2:].data_ptr() and got.shape[0] == 3
    assert x[8] is buf and x[9] is zero and int(x[10]) == 3 and int(x[15]) == 7 and x[-1] == "stream"
    dev = q.device
    assert events == [("enter", dev), ("zero_row", dev, q.dtype, 512), ("stream", dev), ("exit", dev)]


def test_backward_is_declined_off_sm100_and_for_shapes_it_does_not_serve(monkeypatch):
    pytest.importorskip("cutlass")
    from dsa.cute.sm100 import sparse_attention as sm100_sa

    args, kw = _call_inputs()
    q, kv, idx = args
    a = SparseAttnArgs(q, kv.view(-1, 1, 512), idx.view(5, 1, -1), None, None, 0.5, 512)
    assert "CUDA" in sm100_sa.supports_backward(a)
    monkeypatch.setattr(sm100_sa, "arch_reason", lambda device, what, arch: None)
    assert sm100_sa.supports_backward(a) is None
    assert "multiple of 64" in sm100_sa.supports_backward(dataclasses.replace(a, q=q[:, :32]))
    assert "bf16 or fp16" in sm100_sa.supports_backward(dataclasses.replace(a, q=q.float(), kv=a.kv.float()))
    assert "d_v=448" in sm100_sa.supports_backward(dataclasses.replace(a, d_v=448))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(host, "arch_of", lambda device: "sm100")
    with pytest.raises(Unsupported, match="multiple of 64"):
        dsa.cute.backend_op("sparse_attention_bwd", dataclasses.replace(a, q=q[:, :32]), auto=True)


# --------------------------------------------------------------------------
# the two-CTA backward: routing, explain, its gate, its host launch


def _pair_inputs(deterministic=False):
    """A small call of the two-CTA kernel's static shape: bf16, 128 heads, D 576."""
    g = torch.Generator().manual_seed(5)
    T, K, N, H, D = 4, 64, 80, 128, 576
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    kv = torch.randn(N, D, generator=g).to(torch.bfloat16)
    idx = torch.randint(-4, N + 4, (T, K), generator=g, dtype=torch.int32)
    tl = torch.tensor([64, 3, 0, 100], dtype=torch.int32)
    sink = torch.randn(H, generator=g)
    return (q, kv, idx), dict(d_v=512, sink=sink, topk_length=tl, deterministic=deterministic)


class PairStandIn:
    """A stand-in for the SM100 backward entry (a, out, lse, dout, grid
    options) computing the reference's gradients; ``corrupt`` as BwdStandIn's."""

    def __init__(self, corrupt=None):
        self.calls, self.corrupt = 0, corrupt

    def __call__(self, a, out, lse, dout, config=None, pair=None):
        self.calls += 1
        res = dsa.reference.sparse_attention_bwd(dataclasses.replace(a, deterministic=False), out, lse, dout)
        return self.corrupt(*res) if self.corrupt else res


@pytest.fixture
def sm100_pair(sm100, monkeypatch):
    """As ``sm100``, with the reference standing in for the Triton kernels
    (the interpreter computes bf16 wrongly and D 576 / 128 heads slowly) and
    a correct forward stand-in; ``use(standin)`` installs the backward's."""
    from dsa.cute.sm100 import sparse_attention as sm100_sa
    from dsa.triton import sparse_attention as triton_sa

    monkeypatch.setattr(triton_sa, "forward", lambda a, config=None: dsa.reference.sparse_attention_fwd(a))
    monkeypatch.setattr(triton_sa, "backward", lambda a, out, lse, dout, config=None:
                        dsa.reference.sparse_attention_bwd(dataclasses.replace(a, deterministic=False), out, lse,
                                                           dout))
    monkeypatch.setattr(sm100_sa, "supports_backward", lambda a: None)
    sm100(StandIn())

    def use(standin):
        monkeypatch.setattr(sm100_sa, "backward", standin)
        return standin

    return use


@pytest.mark.parametrize("deterministic", [False, True])
def test_pair_kernel_serves_h128_d576_bf16_and_explain_names_it(sm100_pair, deterministic):
    """H128 / D576 / bf16 backward calls route to the two-CTA kernel's config
    (its own self-check key), which passes the gate with a correct kernel:
    explain() names the kernel; the self-check runs both launch shapes."""
    from dsa.cute.sm100.sparse_attention_bwd_pair import PairBwdSm100Config

    standin = sm100_pair(PairStandIn())
    args, kw = _pair_inputs(deterministic)
    text = dsa.explain("sparse_attention", *args, **kw)
    bwd = text[text.index("sparse_attention_bwd: backend"):]
    assert "backend 'cute'" in bwd and "the two-CTA SM100 backward" in bwd, text
    assert "self-check at first use passed" in bwd, text
    assert standin.calls == 2  # one self-check: a cluster per row, then split rows
    keys = [k for k, _ in gate.verdicts() if k[0] == "sparse_attention_bwd"]
    assert len(keys) == 1 and isinstance(keys[0][1], PairBwdSm100Config)
    assert keys[0][1].deterministic == deterministic


def test_pair_kernel_wrong_result_is_caught(sm100_pair):
    standin = sm100_pair(PairStandIn(corrupt=lambda dq, dkv, ds: (dq, dkv * 1.1, ds)))
    args, kw = _pair_inputs()
    with _dsa_warning("failed its self-check against Triton"):
        text = dsa.explain("sparse_attention", *args, **kw)
    bwd = text[text.index("sparse_attention_bwd: backend"):]
    # not cute (on CPU bf16 the reference then serves: the interpreter declines bf16)
    assert "backend 'cute'" not in bwd and "cute: self-check at first use failed: dkv: relative L2" in bwd, text
    assert standin.calls == 2


def test_other_backward_shapes_keep_the_generic_kernel(monkeypatch):
    pytest.importorskip("cutlass")
    from dsa.cute.sm100 import sparse_attention as sm100_sa
    from dsa.cute.sm100.sparse_attention_bwd import BwdSm100Config
    from dsa.cute.sm100.sparse_attention_bwd_pair import PairBwdSm100Config

    args, kw = _pair_inputs()
    q, kv, idx = args
    a = SparseAttnArgs(q, kv.view(-1, 1, 576), idx.view(4, 1, -1), kw["topk_length"], kw["sink"], 0.5, 512)
    assert isinstance(sm100_sa.backward_config(a), PairBwdSm100Config)
    assert "two-CTA" in sm100_sa.kernel_name(sm100_sa.backward_config(a))
    others = [dataclasses.replace(a, q=q.half(), kv=a.kv.half()),                    # fp16
              dataclasses.replace(a, q=q[:, :64]),                                    # 64 heads
              dataclasses.replace(a, q=q[..., :512], kv=a.kv[..., :512]),             # D 512
              dataclasses.replace(a, q=torch.cat([q, q], 1), kv=torch.cat([a.kv, a.kv], 1),
                                  indices=torch.cat([a.indices, a.indices], 1))]     # GQA: 128 heads per kv head
    kinds = [type(sm100_sa.backward_config(x)) for x in others]
    assert kinds == [BwdSm100Config, BwdSm100Config, BwdSm100Config, PairBwdSm100Config]


@pytest.mark.parametrize("K,T,deterministic", [(128, 2, False), (1152, 3, False), (2048, 40, False),
                                               (512, 2, True), (1024, 3, True)])
def test_pair_launch_passes_k_and_the_launch_shape(monkeypatch, K, T, deterministic):
    """The two-CTA launch over tokens [t0, t0 + tc): pointers from token t0,
    K, the clusters and the split as runtime scalars (one compiled kernel for
    every K); a split launch adds dq into a zeroed fp32 workspace and casts
    it into dq; the deterministic mode never splits."""
    pytest.importorskip("cutlass")
    from dsa.cute.sm100 import sparse_attention as sm100_sa

    events, launched, zero = fake_launch(monkeypatch, sm100_sa, 576)
    g = torch.Generator().manual_seed(K)
    q = torch.randn(T + 1, 128, 576, generator=g).to(torch.bfloat16)
    kv = torch.randn(50, 1, 576, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 50, (T + 1, 1, K), generator=g, dtype=torch.int32)
    a = SparseAttnArgs(q, kv, idx, None, None, 0.5, 512, deterministic)
    lg2den, delta = torch.zeros(T + 1, 128), torch.ones(T + 1, 128)
    dout, dq, buf = torch.zeros(T + 1, 128, 512), torch.full_like(q, 7.0), torch.zeros(3, 576)
    sm100_sa._launch_pair(a, dout, lg2den, delta, dq, buf, 1, T, sm100_sa.PairGrid(clusters=8))
    (x,) = launched
    assert x[1] is kv and x[3] is idx  # no topk_length: the indices stand in for it, never read
    for got, whole in zip(x[:8], (q, None, idx, None, dout, lg2den, delta, dq)):
        if whole is not None:
            assert got.data_ptr() == whole[1:].data_ptr() and got.shape[0] == T
    assert x[8] is buf and x[9] is zero
    n_cl, parts, per = sm100_sa.pair_launch_shape(T, 1, K, 8, not deterministic)
    assert [int(x[i]) for i in (11, 12, 13, 16, 17, 18)] == [T, 50, K, n_cl, parts, per]
    assert x[-1] == "stream"
    if parts > 1:  # dq came from the (zeroed, here untouched) workspace
        assert tuple(x[10].shape) == (T, 128, 576) and x[10].dtype == torch.float32
        assert (dq[1:] == 0).all() and (dq[0] == 7).all()
    else:
        assert x[10] is buf and (dq == 7).all()
    assert deterministic <= (parts == 1)


@pytest.mark.parametrize("deterministic,split", [(False, False), (False, True), (True, False)])
def test_pair_host_flow_with_an_emulated_launch(monkeypatch, deterministic, split):
    """``backward``'s host side for the two-CTA kernel on CPU, the kernel
    emulated as it writes: dq in q.dtype, or, split, each part's dq added
    into the fp32 workspace (then cast); dkv added in fragment order, or,
    deterministic, each valid slot's row (128 heads summed) stored at
    [token - t0, g, slot] of the one-part buffer, several token chunks a
    call.  The result is the kernel-like computation's."""
    pytest.importorskip("cutlass")
    from dsa.cute.sm100 import sparse_attention as sm100_sa
    from dsa.triton import segment_sum

    T, K, N = 5, 192, 24
    monkeypatch.setattr(segment_sum, "WORKSPACE_BYTES", 3 * K * 576 * 4)  # 3 tokens a chunk: 2 chunks
    fake_launch(monkeypatch, sm100_sa, 576)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(T, 128, 576, generator=g).to(torch.bfloat16)
    kv = torch.randn(N, 1, 576, generator=g).to(torch.bfloat16)
    idx = torch.randint(-3, N + 3, (T, 1, K), generator=g, dtype=torch.int32)
    tl = torch.tensor([192, 3, 0, 100, 150], dtype=torch.int32)
    a = SparseAttnArgs(q, kv, idx, tl, torch.randn(128, generator=g), 576 ** -0.5, 512, deterministic)
    out, lse = dsa.reference.sparse_attention_fwd(a)
    dout = torch.randn(out.shape, generator=g).to(q.dtype)
    want = _kernel_numerics(a, out, lse, dout)
    shapes = []

    def emulate(builder, config, device, pointers, scalars):
        def run(qq, kv_, ii, ll, do, lg2den, delta, dq, buf, zero_, dqacc, T_, N_, K_, s2, s, n_cl, parts, per, st):
            tc, parts, per = int(T_), int(parts), int(per)
            shapes.append((tc, parts, per))
            part = SparseAttnArgs(qq, kv_, ii, ll, None, a.sm_scale, 512, deterministic)
            for p in range(parts):  # a part's blocks: the other slots read as invalid
                keep = (torch.arange(K) // 64 >= p * per) & (torch.arange(K) // 64 < (p + 1) * per)
                sub = dataclasses.replace(part, indices=torch.where(keep, ii, -1))
                dq_p, slot, valid, rows = _kernel_slots(sub, lg2den, delta, do)
                if parts > 1:
                    dqacc += dq_p.float()
                else:
                    dq.copy_(dq_p)
                if not deterministic:
                    buf.view(-1, 576).index_add_(0, rows[valid], _fragment_order(slot.sum(2)[valid]))
                    continue
                view = buf[:tc * K].view(tc, 1, K, 576)
                for t, g_, j in valid.nonzero().tolist():
                    view[t, g_, j] = _fragment_order(slot[t, g_, :, j].sum(0))
        return run

    monkeypatch.setattr(sm100_sa, "_compiled", emulate)
    dq, dkv, dsink = sm100_sa.backward(a, out, lse, dout, pair=sm100_sa.PairGrid(clusters=16, split=split))
    assert shapes == ([(3, 1, 3), (2, 1, 3)] if deterministic else [(5, 3, 1)] if split else [(5, 1, 3)])
    v = gate.compare([(dq, want[0]), (dkv, want[1]), (dsink, want[2])], ["dq", "dkv", "dsink"])
    assert v.passed, v.detail
    assert dkv.dtype == a.kv.dtype and dq.dtype == a.q.dtype


def test_pair_operand_bookkeeping_emulated():
    """The two-CTA kernel's operand and accumulator bookkeeping, emulated in
    torch with its own index functions: each CTA's dQ stage (``kd_column``),
    a cta_group::2 MMA (M rows from the CTA that holds them, each half of N
    from one CTA's B at the same offsets, this CTA's rows of both halves in
    its TMEM: lanes r and r + 64, ``check_pair_rows``), the epilogue's dq
    columns (``_dq_col``), the dKV pairs (chunk 2 j + r of CTA r, B halves
    of 32 slots), the reducer's columns in fragment order
    (``fragment_position``) and the host's reorder: dq = dS K and dkv =
    dS^T Q + P^T dO come out."""
    pytest.importorskip("cutlass")
    from dsa.cute.sm100 import sparse_attention_bwd_pair as pair
    from dsa.cute.sparse_attention_bwd import natural_columns

    g = torch.Generator().manual_seed(7)
    H, S, D, dv = 128, 64, 576, 512
    ds, p, kb = torch.randn(H, S, generator=g), torch.randn(H, S, generator=g), torch.randn(S, D, generator=g)
    q, do = torch.randn(H, D, generator=g), torch.randn(H, dv, generator=g)
    kernel = object.__new__(pair.SparseAttnBwdSm100Pair)
    kernel.D = D

    def mma2(a_rows, b_halves):
        """A cta_group::2 MMA: a_rows[r] [64, K] of CTA r, b_halves[r] [N / 2, K] of CTA r -> each CTA's
        TMEM [128 lanes, N / 2]: its rows against both halves of N."""
        tmem = []
        for r in range(2):
            c = torch.cat([a_rows[r] @ b.T for b in b_halves], 1)          # [64, N]
            h = c.shape[1] // 2
            tmem.append(torch.cat([c[:, :h], c[:, h:]], 0))                # lanes r, r + 64
        return tmem

    # dQ: the stage of CTA r holds kd_column(cc, r) .. + 64 of every slot as chunk cc
    stage = [torch.cat([kb[:, pair.kd_column(cc, r):pair.kd_column(cc, r) + 64] for cc in range(5)], 1)
             for r in range(2)]
    a = [ds[64 * r:64 * r + 64] for r in range(2)]
    rounds = [mma2(a, [stage[r][:, 128 * jj:128 * jj + 128].T for r in range(2)]) for jj in range(2)]
    tail = mma2(a, [stage[r][:, 256:320].T for r in range(2)])
    dq = torch.full((H, D), float("nan"))
    for r in range(2):
        tm = torch.cat([rounds[0][r], rounds[1][r], tail[r]], 1)           # TMEM columns [0, 320)
        for w in range(4):
            for lane in range(32):
                row, half = 32 * (w % 2) + lane, w // 2
                for c in range(9):
                    tcol = pair.DQ_COL + 32 * c if c < 8 else pair.DQT_COL + 32 * half
                    col = kernel._dq_col(c, half)
                    dq[64 * r + row, col:col + 32] = tm[32 * w + lane, tcol:tcol + 32]
    assert torch.allclose(dq, ds @ kb, atol=1e-4)

    # dKV: pair j, CTA r's rows are chunk 2 j + r's columns; B halves are slots [32 r, 32 r + 32) of all heads
    buf = torch.zeros(S, D)
    for j in range(pair.PAIRS):
        chunks = [min(2 * j + r, 8) for r in range(2)]                      # CTA 1's fifth: never read
        qa = [q[:, 64 * c:64 * c + 64].T for c in chunks]                  # [64 columns, 128 heads]
        acc = mma2(qa, [ds[:, 32 * r:32 * r + 32].T for r in range(2)])
        if 2 * j + 1 < dv // 64:
            da = [do[:, 64 * c:64 * c + 64].T for c in chunks]
            acc = [x + y for x, y in zip(acc, mma2(da, [p[:, 32 * r:32 * r + 32].T for r in range(2)]))]
        for r in range(2):
            c = 2 * j + r
            if c >= pair.N_CHUNKS:
                continue
            for w in range(4):
                for lane in range(32):
                    mcol, sh = 32 * (w % 2) + lane, w // 2
                    pos = pair.fragment_position(64 * c + mcol)
                    buf[32 * sh:32 * sh + 32, pos] += acc[r][32 * w + lane, :32]
    want = ds.T @ q
    want[:, :dv] += p.T @ do
    assert torch.allclose(natural_columns(buf, torch.float32), want, atol=1e-3)
