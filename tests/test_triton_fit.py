"""Every Triton kernel fits every target GPU at the model shapes (compiled offline, no GPU).

For each target (sm_80, 86, 89, 90, 100, 120) the tile picker of each op
chooses its config from that target's limits (dsa.triton.fit.LIMITS), and the
kernel compiled for the target at that config must need no more shared memory
per block than the target has: a launch there would fit. On sm_90 the picks
are the configs measured on the H200 (the defaults before fitting existed).

The compiles run in subprocesses outside the interpreter (TRITON_INTERPRET=0:
the kernels are then JIT functions), one per pair of targets, all started at
once; ``python tests/test_triton_fit.py 80 90`` prints one target pair's table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CAPS = (80, 86, 89, 90, 100, 120)

# (H, D, d_v, K, sink) of the sparse attention shapes
ATTENTION = {
    "V3.2": (128, 576, 512, 2048, False),
    "V4-pro": (128, 512, 512, 1152, True),
    "V4-flash": (64, 512, 512, 640, True),
    "H16/D576": (16, 576, 512, 2048, False),
    "H32/D576": (32, 576, 512, 2048, False),
}
# (H, cache format, D, d_v, block table) of the sparse decode shapes (K = 2048, pages of 64)
DECODE = {
    "V3.2 fp8": (128, "fp8_v32", 576, 512, True),
    "V4 fp8 H64": (64, "fp8_model1", 512, 512, True),
    "V4 fp8 H128": (128, "fp8_model1", 512, 512, False),
    "V3.2 bf16": (128, "native", 576, 512, True),
}
INDEXER = (64, 128, 2048)  # H_i, D_i, K
TOPK = {"topk list path": 65536, "topk resident": 4096}  # row length of each top-k route
TOPK_K = 2048
FULL_COMPILE_CAPS = (80, 90)
SM90_V32_BWD_SPILL = 764  # bytes of spill stores ptxas reports for the shipped sm_90 V3.2 backward

# What sm_90 ran before the picker (TileConfig fields BH, BN, CW, warps, stages).
SM90_ATTENTION = {
    ("V3.2", "fwd"): (64, 64, 128, 8, 2), ("V3.2", "bwd"): (64, 32, 128, 8, 1),
    ("V4-pro", "fwd"): (64, 64, 128, 8, 2), ("V4-pro", "bwd"): (64, 64, 128, 8, 1),
    ("V4-flash", "fwd"): (64, 64, 128, 8, 2), ("V4-flash", "bwd"): (64, 64, 128, 8, 1),
    ("H16/D576", "fwd"): (16, 64, 128, 4, 2), ("H16/D576", "bwd"): (16, 64, 64, 4, 2, True),
    ("H32/D576", "fwd"): (32, 64, 128, 4, 2, True), ("H32/D576", "bwd"): (32, 32, 128, 8, 1),
}


def _rows(caps):
    """[(target, kernel, shape, config, shared bytes, limit)] for the given targets."""
    import torch

    from dsa._args import IndexerArgs, SparseAttnArgs, SparseDecodeArgs, SparseIndexerArgs
    from dsa.kv_cache import FORMATS
    from dsa.triton import decode, fit, indexer, indexer_bwd, segment_sum, sparse_attention as sa, topk, training

    def mt(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    def attn(H, D, d_v, K, sink):
        return SparseAttnArgs(q=mt(4, H, D), kv=mt(64, 1, D), indices=mt(4, 1, K, dtype=torch.int32),
                              topk_length=mt(4, dtype=torch.int32), sink=mt(H, dtype=torch.float32) if sink else None,
                              sm_scale=0.1, d_v=d_v)

    def dec(H, fmt, D, d_v, paged):
        kv = mt(8, 64, 1, D) if fmt == "native" else mt(8, 64, FORMATS[fmt].bytes_per_token, dtype=torch.uint8)
        return SparseDecodeArgs(q=mt(2, H, D), kv=kv, indices=mt(2, 1, 2048, dtype=torch.int32),
                                topk_length=mt(2, dtype=torch.int32), block_table=mt(2, 32, dtype=torch.int32)
                                if paged else None, seq_lens=None, sink=mt(H, dtype=torch.float32), sm_scale=0.1,
                                d_v=d_v, cache_format=fmt, rows_per_seq=1)

    Hi, Di, Ki = INDEXER
    i32 = dict(dtype=torch.int32)
    ia = IndexerArgs(q=mt(4, Hi, Di), k=mt(64, Di), weights=mt(4, Hi, dtype=torch.float32),
                     cu_seqlens_q=mt(2, **i32), cu_seqlens_k=mt(2, **i32), q_offsets=mt(1, **i32), max_seqlen_k=64,
                     sm_scale=0.1, causal=True, ratio=1)
    sia = SparseIndexerArgs(q=mt(4, Hi, Di), k=mt(64, Di), weights=mt(4, Hi, dtype=torch.float32),
                            indices=mt(4, Ki, **i32), topk_length=mt(4, **i32), sm_scale=0.1)
    rows = []
    for cap in caps:
        tgt = fit.Target.of(cap)

        def add(kernel, shape, cfg, why, specs):
            if cfg is None:
                rows.append((cap, kernel, shape, None, why, tgt.limits.smem_per_block))
                return
            need = max(fit.shared_bytes(s, tgt) for s in specs)
            rows.append((cap, kernel, shape, cfg if isinstance(cfg, str) else repr(cfg), need,
                         tgt.limits.smem_per_block))

        for name, shape in ATTENTION.items():
            a = attn(*shape)
            for bwd in (False, True):
                cfg, why = sa.pick(a, bwd, tgt)
                add("sparse_attn_bwd" if bwd else "sparse_attn_fwd", name, cfg, why,
                    [sa.kernel_spec(a, cfg, bwd)] if cfg else [])
                if name == "V3.2" and bwd and cap in FULL_COMPILE_CAPS and cfg is not None:
                    # the allocation-only path against the whole compile, down to the binary
                    full, regs, spill = fit.register_use(sa.kernel_spec(a, cfg, bwd), tgt)
                    rows.append((cap, "full compile", name, repr(cfg), full, rows[-1][4], regs, spill))
            if name == "V3.2":
                add("bwd_preprocess", name, "fixed", "", [sa.preprocess_spec(a), sa.preprocess_spec(a, True)])
        for name, shape in DECODE.items():  # both launch forms (one split, parts) and the merge
            d = dec(*shape)
            cfg, why = decode.pick(d, tgt)
            add("sparse_decode", name, cfg, why, [decode.kernel_spec(d, cfg, split, tgt) for split in (False, True)]
                + [decode.combine_spec(d, 32)] if cfg else [])
        cfg, why = indexer.pick(ia, tgt)
        add("indexer_scores", "H64/D128", cfg, why, [indexer.scores_spec(ia, cfg)] if cfg else [])
        for what, K in (("indexer_scores_bwd", 64), ("sparse_indexer_bwd / KL bwd", Ki)):
            cfg, why = indexer_bwd.pick(ia.q, ia.weights.dtype, K, tgt)
            modes = [indexer_bwd.MODE_DENSE] if K == 64 else [indexer_bwd.MODE_SPARSE, indexer_bwd.MODE_KL]
            specs = [indexer_bwd.bwd_spec(torch.bfloat16, torch.float32, Hi, Di, cfg, mode=m) for m in modes]
            if K != 64:  # deterministic=True: dk rows stored at their grouped positions
                specs.append(indexer_bwd.bwd_spec(torch.bfloat16, torch.float32, Hi, Di, cfg,
                                                  dk_mode=indexer_bwd.DK_GROUPED))
            elif cfg:  # torch.use_deterministic_algorithms: the main pass without dk, then dk by key
                specs += [indexer_bwd.bwd_spec(torch.bfloat16, torch.float32, Hi, Di, cfg,
                                               mode=indexer_bwd.MODE_DENSE, dk_mode=indexer_bwd.DK_NONE),
                          indexer_bwd.dense_dk_spec(torch.bfloat16, torch.float32, Hi, Di)]
            add(what, f"H64/D128 K{K}", cfg, why, specs if cfg else [])
        cfg, why = training.pick_indexer_fwd(sia, tgt)
        add("sparse_indexer_fwd / KL fwd", "H64/D128 K2048", cfg, why,
            [training.indexer_fwd_spec(torch.bfloat16, torch.float32, Hi, Di, cfg, kl=kl) for kl in (False, True)]
            if cfg else [])
        for shape, (H, D, K) in {"V3.2": (128, 576, 2048), "H64/D128": (Hi, Di, Ki)}.items():
            cfg, why = training.pick_target(mt(4, H, D), H, 1, D, K, tgt)
            add("attention_target", f"{shape} K{K}", cfg, why,
                [training.target_spec(torch.bfloat16, H, 1, D, cfg, implicit=imp, lse_pass=imp)
                 for imp in (False, True)] if cfg else [])
        seg = [segment_sum.spec(D, parts, bd) for D, parts, bd in ((576, 2, 64), (128, 1, 128))]
        seg.append(segment_sum.spec(128, 1, 128, gather=False, src="*bf16"))  # bf16 rows (the bench's floor)
        add("segment_sum", "dkv D576 / dk D128 (fp32, bf16 rows)", "fixed", "", seg)
        for what, S in TOPK.items():  # every kernel of the route, fp32 scores
            route, why = topk.pick(S, TOPK_K, torch.float32, tgt)
            add(what, f"{S} cols k{TOPK_K}", route, why,
                topk.route_specs(route, torch.float32, True) if route else [])
    return rows


@pytest.fixture(scope="module")
def table():
    """All targets' rows: the subprocesses (one per two targets) run side by side."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=root)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *map(str, CAPS[i:i + 2])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(0, len(CAPS), 2)]
    rows = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
        rows += [tuple(r) for r in json.loads(out.strip().splitlines()[-1])]
    return rows


def test_every_kernel_fits_every_target(table):
    fits = [r for r in table if r[1] != "full compile"]
    bad = [r for r in fits if r[3] is None or r[4] > r[5]]
    assert not bad, "\n".join(map(str, bad))
    assert {r[0] for r in fits} == set(CAPS)
    assert len(fits) == len(CAPS) * (2 * len(ATTENTION) + len(DECODE) + 8 + len(TOPK))


def test_fitted_shared_memory_is_the_compilers(table):
    """fit.shared_bytes stops after the shared-memory allocation; the full
    compile (PTX and binary) reports the same bytes. The V3.2 backward's
    register spills stay within what sm_90 ships (764 B at 255 registers)."""
    full = [r for r in table if r[1] == "full compile"]
    assert len(full) == len(FULL_COMPILE_CAPS)
    for cap, _, _, _, compiled, fitted, regs, spill in full:
        assert compiled == fitted, cap
        assert regs <= 255 and spill <= SM90_V32_BWD_SPILL, (cap, regs, spill)


def test_sm90_picks_are_the_measured_defaults(table):
    got = {(r[2], r[1][-3:]): r[3] for r in table if r[0] == 90 and r[1].startswith("sparse_attn_")}
    for (shape, kind), (BH, BN, CW, w, s, *kar) in SM90_ATTENTION.items():
        assert got[(shape, kind)] == (f"TileConfig(BH={BH}, BN={BN}, CW={CW}, num_warps={w}, num_stages={s}, "
                                      f"skew=False, prefetch=True, keys_as_rows={bool(kar)})"), (shape, kind)
    other = {r[1]: r[3] for r in table if r[0] == 90 and not r[1].startswith("sparse_attn_")}
    assert "BN=64, NCOLS=256, num_warps=8, num_stages=3" in other["indexer_scores"]
    assert "BK=64, num_warps=4, num_stages=1, keys_as_rows=True" in other["sparse_indexer_bwd / KL bwd"]
    assert "BK=64, BD=128, num_warps=4, num_stages=3" in other["sparse_indexer_fwd / KL fwd"]
    from dsa.triton import topk

    assert other["topk list path"] == repr(("list", topk._list_plan(TOPK["topk list path"], TOPK_K)))
    assert other["topk resident"] == repr(("resident", (4096, topk._resident_config(4096))))


def test_heads_per_program_is_a_knob(table):
    """Where the measured 64 heads a program cannot fit (sm_80's and sm_89's
    backward at D = 576), fewer heads a program are chosen, not a failure."""
    picks = {(r[0], r[1], r[2]): r[3] for r in table}
    assert "BH=64" in picks[(90, "sparse_attn_bwd", "V3.2")]
    assert "BH=64" not in picks[(89, "sparse_attn_bwd", "V3.2")]


@pytest.mark.gpu
def test_the_device_picks_what_its_capability_row_says():
    """On a GPU the limits come from the driver, and the picks at the model
    shapes are the table's picks for its capability; each pick launches."""
    import torch

    from dsa._args import SparseAttnArgs
    from dsa.triton import fit, sparse_attention as sa

    dev = torch.device("cuda")
    tgt = fit.device_target(torch.empty(1, device=dev))
    optin = getattr(torch.cuda.get_device_properties(dev), "shared_memory_per_block_optin", None)
    assert optin is None or tgt.limits.smem_per_block == optin
    table = fit.Target.of(tgt.capability)
    for H, D, d_v, K, sink in ATTENTION.values():
        def make(device):
            def t(*shape, dtype=torch.bfloat16):
                return torch.zeros(*shape, dtype=dtype, device=device)
            return SparseAttnArgs(q=t(2, H, D), kv=t(64, 1, D), indices=t(2, 1, K, dtype=torch.int32),
                                  topk_length=None, sink=t(H, dtype=torch.float32) if sink else None,
                                  sm_scale=0.1, d_v=d_v)
        a = make(dev)
        for bwd in (False, True):
            if table.limits.smem_per_block == tgt.limits.smem_per_block:
                # the picks are memoized by capability and limit, the same for both: compute each afresh
                fit._PICKED.clear()
                want = sa.pick(make("meta"), bwd, table)[0]
                fit._PICKED.clear()
                assert sa.pick(a, bwd)[0] == want, (H, D, bwd)
        out, lse = sa.forward(a)
        dq, dkv, _ = sa.backward(a, out, lse, torch.ones_like(out))
        torch.cuda.synchronize()
        assert torch.isfinite(dq).all() and torch.isfinite(dkv).all()


if __name__ == "__main__":
    print(json.dumps(_rows([int(c) for c in sys.argv[1:]])))
