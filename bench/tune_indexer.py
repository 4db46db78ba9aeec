"""GPU tuning run for dsa/triton/indexer.py and dsa/triton/topk.py (one call).

    PYTHONPATH=$PWD python bench/tune_indexer.py [--quick] [--skip-scores | --scores-only] [--configs A,B]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python bench/tune_indexer.py --smoke   # CPU dry run

Times tile configs of the scores kernel and variants of the top-k kernel on
fresh random bf16 / fp32 inputs (do_bench median), checks each variant
against the default one, then times indexer_topk and measures its extra
memory at S_q=131072 / S_k=32768. Prints a table last; writes JSON to
$OUT/tune_indexer.json when $OUT is set.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import triton
from triton.testing import do_bench

from dsa._args import IndexerArgs, TopkArgs
from dsa.triton import indexer as ix
from dsa.triton import topk as tk

SMOKE = "--smoke" in sys.argv
DEV = "cpu" if SMOKE else "cuda"
H, D = (4, 16) if SMOKE else (64, 128)
SCALE = 64 if SMOKE else 1  # sizes are divided by this in the smoke run
RESULTS = []
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def bench(fn):
    if SMOKE:
        t = time.time()
        fn()
        return (time.time() - t) * 1e3
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def sz(n):
    return max(1, n // SCALE)


def make_args(S_q, S_k, ratio, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn((S_q, H, D), device=DEV, dtype=dtype, generator=g)
    k = torch.randn((S_k, D), device=DEV, dtype=dtype, generator=g)
    w = torch.randn((S_q, H), device=DEV, dtype=torch.float32, generator=g)
    cu = lambda n: torch.tensor([0, n], dtype=torch.int32, device=DEV)
    return IndexerArgs(q, k, w, cu(S_q), cu(S_k), torch.zeros(1, dtype=torch.int32, device=DEV),
                       S_k, ratio, True, D ** -0.5)


def visible_pairs(S_q, S_k, ratio):
    i = torch.arange(S_q, dtype=torch.int64)
    return int(torch.clamp((i + 1) // ratio, 0, S_k).sum())


def rel_l2(a, b):
    fin = torch.isfinite(b)
    if not torch.equal(torch.isneginf(a), torch.isneginf(b)):
        return float("inf")
    return ((a[fin].double() - b[fin].double()).norm() / b[fin].double().norm().clamp_min(1e-30)).item()


def section_scores(quick):
    shapes = [(sz(4096), sz(4096), 1), (sz(16384), sz(16384), 1), (sz(16384), sz(4096), 4)]
    cfgs = {
        "BN64_NC128_w4_s2": ix.IndexerConfig(64, 128, 4, 2),
        "BN64_NC128_w4_s3": ix.IndexerConfig(64, 128, 4, 3),
        "BN64_NC256_w4_s2": ix.IndexerConfig(64, 256, 4, 2),
        "BN128_NC64_w4_s3": ix.IndexerConfig(128, 64, 4, 3),
        "BN64_NC64_w4_s3": ix.IndexerConfig(64, 64, 4, 3),
        # 48 KB of shared memory and <= 128 registers: 4 programs an SM
        "BN64_NC128_w4_s1_r128": ix.IndexerConfig(64, 128, 4, 1, maxnreg=128),
        "BN64_NC64_w4_s2_r128": ix.IndexerConfig(64, 64, 4, 2, maxnreg=128),
        # two warpgroups sharing each key tile (4 queries a program: half the key
        # bytes a score); 128 registers, 99 / 113 KB (sm_90a)
        "BN64_NC256_w8_s2": ix.IndexerConfig(64, 256, 8, 2),
        "BN64_NC256_w8_s3": ix.IndexerConfig(64, 256, 8, 3),
    }
    if quick:
        cfgs = dict(list(cfgs.items())[:2])
    if "--configs" in sys.argv:  # --configs NAME,NAME
        keep = sys.argv[sys.argv.index("--configs") + 1].split(",")
        cfgs = {n: c for n, c in cfgs.items() if n in keep}
    default = ix._CONFIGS["mma"]
    totals = {}
    for S_q, S_k, ratio in shapes:
        a = make_args(S_q, S_k, ratio, seed=S_q + ratio)
        flop = 2 * H * D * visible_pairs(S_q, S_k, ratio)
        ix._CONFIGS["mma"] = default
        ref = ix.scores(a)
        for name, cfg in cfgs.items():
            ix._CONFIGS["mma"] = cfg
            try:
                out = ix.scores(a)
                err = rel_l2(out, ref)
                ms = bench(lambda: ix.scores(a))
            except Exception as e:  # noqa: BLE001 - keep the run going
                log(f"scores {name} failed: {e!r}")
                continue
            tf = flop / ms / 1e9
            totals[name] = totals.get(name, 0.0) + ms
            RESULTS.append(dict(op="scores", shape=f"{S_q}x{S_k} r{ratio}", variant=name, ms=ms, tflops=tf, err=err))
            log(f"scores {S_q}x{S_k} r{ratio} {name}: {ms:.3f} ms {tf:.0f} TFLOP/s err {err:.1e}")
        del ref
    ix._CONFIGS["mma"] = default
    if totals:
        best = min(totals, key=totals.get)
        ix._CONFIGS["mma"] = cfgs[best]
        log(f"best scores config: {best} ({totals[best]:.3f} ms over the shapes)")
        return best
    return None


def section_topk(quick):
    from tests.test_triton_topk import topk_contract

    RC = tk.ResidentConfig
    variants = {
        4096: [("w4", RC(4)), ("w8", RC(8)), ("w16", RC(16)), ("stream", None)],
        16384: [("w16", RC(16)), ("w8", RC(8)), ("w32", RC(32)), ("stream", None)],
    }
    best_cfg = {}
    for S, vs in variants.items():
        R, k = sz(4096), sz(2048)
        S = sz(S)
        x = torch.randn((R, S), device=DEV, dtype=torch.float32)
        ref_i, ref_l = topk_contract(x, k)
        xt = torch.randint(-50, 50, (R, S), device=DEV).float()  # ties, NaN, -inf, short rows
        xt[:, ::37] = float("nan")
        xt[:, 3::41] = float("-inf")
        xt[: R // 3, S // 3:] = float("-inf")
        ref_ti, ref_tl = topk_contract(xt, k)
        idx = torch.empty((R, k), dtype=torch.int32, device=DEV)
        lens = torch.empty((R,), dtype=torch.int32, device=DEV)
        times = {}
        for name, cfg in (vs[:2] if quick else vs):
            if cfg is None:
                fn = lambda: tk.launch(x, k, idx, lens, resident_max=0)
            else:
                fn = lambda cfg=cfg: tk.launch(x, k, idx, lens, config=cfg)
            try:
                idx.fill_(-7)
                if cfg is None:
                    tk.launch(xt, k, idx, lens, resident_max=0)
                else:
                    tk.launch(xt, k, idx, lens, config=cfg)
                ok_ties = torch.equal(idx, ref_ti) and torch.equal(lens, ref_tl)
                idx.fill_(-7)
                fn()
                ok = torch.equal(idx, ref_i) and torch.equal(lens, ref_l) and ok_ties
                ms = bench(fn)
            except Exception as e:  # noqa: BLE001
                log(f"topk {S} {name} failed: {e!r}")
                continue
            times[name] = (ms, cfg, ok)
            RESULTS.append(dict(op="topk", shape=f"{R}x{S} k{k}", variant=name, ms=ms, ok=ok))
            log(f"topk {R}x{S} k{k} {name}: {ms:.4f} ms ok={ok}")
        ms = bench(lambda: torch.topk(x, k, dim=1))
        RESULTS.append(dict(op="topk", shape=f"{R}x{S} k{k}", variant="torch.topk", ms=ms, ok=None))
        log(f"torch.topk {R}x{S}: {ms:.4f} ms")
        res = {n: v for n, v in times.items() if v[1] is not None and v[2]}
        if res:
            best_cfg[triton.next_power_of_2(S)] = res[min(res, key=lambda n: res[n][0])][1]
    if best_cfg:
        chosen = dict(best_cfg)
        orig = tk._resident_config

        def pick(block_s):
            return chosen.get(block_s) or orig(block_s)

        tk._resident_config = pick
        log(f"best topk configs: {chosen}")


def section_fused(quick):
    S_q, S_k, ratio, k = sz(16384), sz(4096), 4, sz(2048)
    a = make_args(S_q, S_k, ratio, seed=11)
    s = ix.scores(a)
    i1, l1 = ix.indexer_topk(a, k)
    i2, l2 = tk.topk(TopkArgs(s, k))
    same = torch.equal(i1, i2) and torch.equal(l1, l2)
    del s
    ms_s = bench(lambda: ix.scores(a))
    ms_f = bench(lambda: ix.indexer_topk(a, k))
    RESULTS.append(dict(op="indexer_topk", shape=f"{S_q}x{S_k} r{ratio} k{k}", variant="chunked",
                        ms=ms_f, ratio_to_scores=ms_f / ms_s, same_as_topk_of_scores=same))
    log(f"indexer_topk {S_q}x{S_k} r{ratio}: {ms_f:.3f} ms, scores {ms_s:.3f} ms, x{ms_f / ms_s:.2f}, exact={same}")
    del a
    if quick:
        return
    S_q, S_k = sz(131072), sz(32768)
    a = make_args(S_q, S_k, ratio, seed=12)
    sync = torch.cuda.synchronize if not SMOKE else (lambda: None)
    sync()
    if not SMOKE:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = 0 if SMOKE else torch.cuda.memory_allocated()
    t = time.time()
    idx, lens = ix.indexer_topk(a, k)
    sync()
    first = time.time() - t
    peak = 0 if SMOKE else torch.cuda.max_memory_allocated() - base
    out_bytes = idx.numel() * 4 + lens.numel() * 4
    t = time.time()
    idx, lens = ix.indexer_topk(a, k)
    sync()
    ms = (time.time() - t) * 1e3
    flop = 2 * H * D * visible_pairs(S_q, S_k, ratio)
    # spot check: a few rows against topk of their own scores, via a 1-row-per-sequence batch
    rows = torch.tensor([0, 3, sz(4095), sz(70000), S_q - 1], device=DEV)
    sub = IndexerArgs(a.q[rows].contiguous(), a.k.repeat(len(rows), 1),
                      a.weights[rows].contiguous(),
                      torch.arange(len(rows) + 1, device=DEV, dtype=torch.int32),
                      torch.arange(len(rows) + 1, device=DEV, dtype=torch.int32) * S_k,
                      rows.to(torch.int32), S_k, ratio, True, a.sm_scale)
    si, sl = tk.topk(TopkArgs(ix.scores(sub), k))
    spot = torch.equal(si, idx[rows]) and torch.equal(sl, lens[rows])
    RESULTS.append(dict(op="indexer_topk", shape=f"{S_q}x{S_k} r{ratio} k{k}", variant="chunked", ms=ms,
                        tflops_scores_part=flop / ms / 1e9, extra_bytes_incl_out=peak,
                        extra_bytes_excl_out=peak - out_bytes, spot_rows_exact=spot, first_call_s=first))
    log(f"indexer_topk {S_q}x{S_k}: {ms:.1f} ms ({flop / ms / 1e9:.0f} TFLOP/s of score work), "
        f"peak extra {peak / 2**30:.3f} GiB incl. outputs, {(peak - out_bytes) / 2**30:.3f} GiB excl., spot={spot}")


def main():
    quick = "--quick" in sys.argv
    log(torch.__version__, triton.__version__, "smoke" if SMOKE else torch.cuda.get_device_name())
    sections = (section_scores, section_topk, section_fused)
    if "--skip-scores" in sys.argv:
        sections = sections[1:]
    if "--scores-only" in sys.argv:
        sections = sections[:1]
    for sec in sections:
        try:
            sec(quick)
        except Exception:  # noqa: BLE001
            log(f"{sec.__name__} failed:\n{traceback.format_exc()}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "tune_indexer.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    print("\n| op | shape | variant | ms | TFLOP/s | check |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in RESULTS:
        tf = r.get("tflops") or r.get("tflops_scores_part")
        chk = r.get("err", r.get("ok", r.get("same_as_topk_of_scores", r.get("spot_rows_exact"))))
        extra = ""
        if "extra_bytes_excl_out" in r:
            extra = f" extra {r['extra_bytes_excl_out'] / 2**30:.3f} GiB (+out {r['extra_bytes_incl_out'] / 2**30:.3f})"
        if "ratio_to_scores" in r:
            extra = f" x{r['ratio_to_scores']:.2f} of scores"
        tfs = '' if tf is None else f'{tf:.0f}'
        print(f"| {r['op']} | {r['shape']} | {r['variant']} | {r['ms']:.4f} | {tfs} | {chk}{extra} |")


if __name__ == "__main__":
    main()
