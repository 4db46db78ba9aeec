"""Top-k and indexer -> top-k against their peers, on the same inputs, in one process.

    PYTHONPATH=$PWD python bench/topk_peers.py --out OUT [--indexer] [--variants] [--no-topk]
        [--shapes 3,4] [--ks 2048] [--indexer-shapes 0,1]

Top-k: fp32 scores [rows, cols] from torch.randn (causal shapes: row i keeps
min(cols, i + 1) scores, the rest -inf), k 2048 and 1024; timed: dsa
``topk_indices`` (triton backend), ``torch.topk`` and, when ``import cudnn``
works, cuDNN's ``indexer_top_k_wrapper`` (given each row's valid length).
Every dsa result is first checked for exact equality with the contract
(ascending positions, -1 padded, ties to the smaller position) on a spread
of rows. ``--variants`` adds dsa's other kernels (the resident kernel where
the row fits it) and list-path settings (see ``variants``), and the fused
indexer_topk's chunking settings (``INDEXER_VARIANTS``), each checked equal
to the default's result.

Indexer -> top-k (``--indexer``): H 64, D 128, bf16, causal; dsa's fused
``indexer_topk`` against cuDNN's ``indexer_forward_wrapper`` followed by
``indexer_top_k_wrapper``.

Times: triton.testing.do_bench(warmup=25, rep=100, median), ms. GB/s: the
scores' bytes (rows * cols * 4) over the time, and "valid": the bytes of
the visible scores only (what cuDNN, told the row lengths, reads). Indexer:
TFLOP/s of the scores (2 * H * D * visible pairs) over the whole time, and
the peak memory the call allocates beyond its inputs. Writes OUT/topk_peers.json and
OUT/topk_peers.png (time per row against row length, one line per method,
dense and causal apart).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

TOPK_SHAPES = [  # rows, cols, causal
    (4096, 4096, False),
    (4096, 16384, False),
    (8192, 32768, False),
    (32768, 32768, True),
    (65536, 65536, True),
]
TOPK_KS = (2048, 1024)
INDEXER_SHAPES = [  # S_q, S_k, ratio, k
    (32768, 32768, 1, 2048),
    (65536, 16384, 4, 1024),
    (65536, 65536, 1, 2048),
    (131072, 32768, 4, 1024),
]


def bench(fn: Callable[[], object]) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def causal_lengths(rows: int, cols: int, ratio: int, dev) -> torch.Tensor:
    i = torch.arange(rows, device=dev)
    return torch.clamp((i + 1) // ratio, max=cols).to(torch.int32)


def make_scores(rows: int, cols: int, causal: bool, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, cols, device="cuda", generator=gen)
    if causal:
        valid = causal_lengths(rows, cols, 1, x.device)
        col = torch.arange(cols, device=x.device)
        for r0 in range(0, rows, 4096):  # bounded temporaries
            r1 = min(rows, r0 + 4096)
            x[r0:r1].masked_fill_(col[None, :] >= valid[r0:r1, None], float("-inf"))
    return x


def contract(x: torch.Tensor, k: int):
    """The top-k contract in plain torch on a few rows (float64 sort)."""
    v = x.double()
    ok = ~torch.isnan(v) & (v != float("-inf"))
    v = torch.where(ok, v, torch.full_like(v, float("-inf")))
    order = torch.sort(v, dim=1, descending=True, stable=True).indices[:, :k]
    n = ok.sum(1).clamp(max=k)
    keep = torch.arange(order.shape[1], device=x.device)[None, :] < n[:, None]
    big = x.shape[1]
    order = torch.sort(torch.where(keep, order, torch.full_like(order, big)), dim=1).values
    out = torch.full((x.shape[0], k), -1, dtype=torch.int64, device=x.device)
    out[:, : order.shape[1]] = torch.where(order == big, torch.full_like(order, -1), order)
    return out.int(), n.int()


def check_rows(x: torch.Tensor, k: int, idx: torch.Tensor, lens: torch.Tensor) -> bool:
    R = x.shape[0]
    rows = sorted(set([0, 1, 2, k - 1, k, k + 1, R // 3, R // 2, R - 2, R - 1] +
                      torch.randint(0, R, (54,)).tolist()) & set(range(R)))
    sel = torch.tensor(rows, device=x.device)
    want_i, want_n = contract(x[sel], k)
    return torch.equal(idx[sel], want_i) and torch.equal(lens[sel], want_n)


def cudnn_wrappers() -> Optional[Dict[str, Callable]]:
    try:
        import cudnn  # noqa: F401
        from cudnn import deepseek_sparse_attention as cd
    except Exception as e:  # absent or broken: the peer is skipped
        print(f"cudnn: skipped ({type(e).__name__}: {e})", flush=True)
        return None
    return {"topk": cd.indexer_top_k_wrapper, "forward": cd.indexer_forward_wrapper}


def dsa_topk(x: torch.Tensor, k: int, **launch_kw):
    from dsa.triton import topk as tk

    if not launch_kw:  # the triton backend's op, as topk_indices calls it
        from dsa._args import TopkArgs

        return lambda: tk.topk(TopkArgs(x, k))
    idx = torch.empty((x.shape[0], k), dtype=torch.int32, device=x.device)
    lens = torch.empty((x.shape[0],), dtype=torch.int32, device=x.device)

    def run():
        tk.launch(x, k, idx, lens, **launch_kw)
        return idx, lens

    return run


def list_plan(cols: int, k: int, inline: bool, **kw):
    """The list plan of this shape with the build's select inline or not (the
    defaults of that choice), then ``kw``."""
    from dsa.triton import topk as tk

    saved = tk.LIST_INLINE_SELECT
    tk.LIST_INLINE_SELECT = inline
    try:
        plan = tk._list_plan(cols, k)
    finally:
        tk.LIST_INLINE_SELECT = saved
    return None if plan is None else dataclasses.replace(plan, **kw)


def variants(cols: int, k: int) -> Dict[str, dict]:
    """dsa's other kernels and list-path settings for this shape. The list
    path: ``sep`` = the build then a select kernel (the path before the
    inline select), ``inline`` = the build selects the lists of the block;
    ``rev`` / ``fwd`` = rows last first / first first; c = the build's chunk;
    pf = chunks prefetched to L2 ahead (sm_90+)."""
    from dsa.triton import topk as tk

    out: Dict[str, dict] = {}
    if cols <= tk.RESIDENT_MAX:
        out["dsa_resident"] = {"list_min": 1 << 40}
    if cols == 4096:  # the resident kernel's shape, by occupancy (sm_90a: 4 warps at 128 registers, 4 an SM)
        for w, nreg in ((8, 64), (2, 168)):  # 4 programs an SM of 8 warps; 6 of 2 warps (no spills either)
            out[f"dsa_resident_w{w}_r{nreg}"] = {"config": tk.ResidentConfig(num_warps=w, search="interp",
                                                                               maxnreg=nreg)}
    if list_plan(cols, k, True) is None:
        return out
    sep = list_plan(cols, k, False, reverse=False, prefetch=0)
    out["dsa_list_sep_fwd"] = {"plan": sep}  # the list path as it was before the inline select
    out["dsa_list_sep_rev_pf4"] = {"plan": dataclasses.replace(sep, reverse=True, prefetch=4)}
    inline = list_plan(cols, k, True, reverse=True, prefetch=4)
    for chunk in (1024, 2048):
        if chunk != inline.chunk:
            out[f"dsa_list_inline_c{chunk}"] = {"plan": dataclasses.replace(inline, chunk=chunk)}
    out["dsa_list_inline_fwd"] = {"plan": dataclasses.replace(inline, reverse=False)}
    for pf in (0, 8):
        out[f"dsa_list_inline_pf{pf}"] = {"plan": dataclasses.replace(inline, prefetch=pf)}
    if cols < tk.LIST_MIN:
        out["dsa_list"] = {"plan": list_plan(cols, k, tk.LIST_INLINE_SELECT)}
    return out


def run_topk(args, results: List[dict], cd) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for i, (rows, cols, causal) in enumerate(TOPK_SHAPES):
        if args.shapes is not None and i not in args.shapes:
            continue
        x = make_scores(rows, cols, causal, gen)
        nbytes = x.numel() * x.element_size()
        valid_bytes = (rows * (rows + 1) // 2 if causal else rows * cols) * x.element_size()  # causal: rows == cols
        seq = causal_lengths(rows, cols, 1, x.device) if causal else torch.full((rows,), cols, dtype=torch.int32,
                                                                                   device=x.device)
        for k in args.ks:
            name = f"{rows}x{cols}{' causal' if causal else ''}"
            methods: Dict[str, Callable] = {"dsa": dsa_topk(x, k)}
            if args.variants:
                for v, kw in variants(cols, k).items():
                    methods[v] = dsa_topk(x, k, **kw)
            methods["torch"] = lambda: torch.topk(x, k, dim=1)
            if cd is not None:
                methods["cudnn"] = lambda: cd["topk"](x, seq, k, next_n=1, return_val=False)
            row = {"shape": name, "rows": rows, "cols": cols, "causal": causal, "k": k, "ms": {}, "exact": {}}
            for m, fn in methods.items():
                try:
                    out = fn()
                    if m.startswith("dsa"):
                        torch.cuda.synchronize()
                        row["exact"][m] = check_rows(x, k, out[0], out[1])
                    row["ms"][m] = bench(fn)
                except Exception as e:  # one peer failing must not lose the table
                    row["ms"][m] = None
                    print(f"{name} k={k} {m}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            results.append(row)
            base = row["ms"].get("cudnn")
            for m, ms in row["ms"].items():
                if ms is None:
                    continue
                ratio = f"{ms / base:5.2f}x cudnn" if base else ""
                ex = row["exact"].get(m, "")
                print(f"topk {name:22s} k={k:5d} {m:24s} {ms:9.4f} ms {nbytes / ms / 1e6:8.1f} GB/s "
                      f"({valid_bytes / ms / 1e6:7.1f} valid) {ratio} {'exact=' + str(ex) if ex != '' else ''}",
                      flush=True)
        del x
        torch.cuda.empty_cache()


# indexer_topk's chunking settings (module attributes of dsa.triton.indexer /
# dsa.triton.topk): "old" is the path before buffered chunks and row ends.
INDEXER_VARIANTS = {
    "dsa_fused_old": dict(TOPK_BUFFERS=1, TOPK_ROW_ENDS=False, TOPK_CHUNK_FLOATS=1 << 25,
                          LIST_INLINE_SELECT=False, LIST_REVERSE=False, LIST_PREFETCH=0),
    "dsa_fused_pf0": dict(LIST_PREFETCH=0),
    "dsa_fused_ends_b1": dict(TOPK_BUFFERS=1),
    "dsa_fused_b2_noends": dict(TOPK_ROW_ENDS=False),
    "dsa_fused_b3": dict(TOPK_BUFFERS=3),
    "dsa_fused_b2_chunk25": dict(TOPK_CHUNK_FLOATS=1 << 25),
    "dsa_fused_b2_chunk27": dict(TOPK_CHUNK_FLOATS=1 << 27),
    "dsa_fused_inline": dict(LIST_INLINE_SELECT=True),
}


def with_settings(fn: Callable, settings: dict) -> Callable:
    """fn run with the given module attributes of dsa.triton.indexer / topk."""
    from dsa.triton import indexer as ix
    from dsa.triton import topk as tk

    def run():
        saved = {}
        for name, v in settings.items():
            mod = ix if hasattr(ix, name) and name.startswith("TOPK_") else tk
            saved[name] = (mod, getattr(mod, name))
            setattr(mod, name, v)
        try:
            return fn()
        finally:
            for name, (mod, v) in saved.items():
                setattr(mod, name, v)

    return run


def visible_pairs(sq: int, sk: int, ratio: int) -> int:
    """Visible (query, key) pairs of a causal sequence: sum of min(sk, (i + 1) // ratio)."""
    i = torch.arange(1, sq + 1, dtype=torch.int64)
    return int(torch.clamp(i // ratio, max=sk).sum())


def run_indexer(args, results: List[dict], cd) -> None:
    import dsa

    H, D = 64, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    for i, (sq, sk, ratio, k) in enumerate(INDEXER_SHAPES):
        if args.indexer_shapes is not None and i not in args.indexer_shapes:
            continue
        q = torch.randn(1, sq, H, D, device="cuda", generator=gen).bfloat16()
        kk = torch.randn(1, sk, D, device="cuda", generator=gen).bfloat16()
        w = torch.randn(1, sq, H, device="cuda", generator=gen).bfloat16()
        name = f"{sq}/{sk} ratio {ratio}"
        row = {"shape": name, "S_q": sq, "S_k": sk, "ratio": ratio, "k": k, "ms": {}}
        fused = lambda: dsa.indexer_topk(q, kk, w, k, ratio=ratio, backend="triton")  # noqa: E731
        methods = {"dsa_fused": fused}
        if args.variants:
            for v, settings in INDEXER_VARIANTS.items():
                methods[v] = with_settings(fused, settings)
        if cd is not None:
            seq = causal_lengths(sq, sk, ratio, q.device)

            def two_steps():
                s = cd["forward"](q, kk.unsqueeze(2), w, ratio=ratio)["scores"]
                return cd["topk"](s.flatten(0, 1), seq, k, next_n=1, return_val=False)

            methods["cudnn_two_steps"] = two_steps
        row["extra_mib"] = {}
        row["exact"] = {}
        want = None
        for m, fn in methods.items():
            try:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                out = fn()
                torch.cuda.synchronize()
                row["extra_mib"][m] = (torch.cuda.max_memory_allocated() - before) / 2**20
                if m.startswith("dsa"):  # every dsa variant equal to the default, bit for bit
                    want = out if want is None else want
                    row["exact"][m] = torch.equal(out, want)
                del out
                row["ms"][m] = bench(fn)
            except Exception as e:
                row["ms"][m] = None
                print(f"indexer {name} {m}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        del want
        results.append(row)
        base = row["ms"].get("cudnn_two_steps")
        flop = 2 * H * D * visible_pairs(sq, sk, ratio)
        for m, ms in row["ms"].items():
            if ms is not None:
                print(f"indexer_topk {name:22s} k={k:5d} {m:22s} {ms:9.3f} ms {flop / ms / 1e9:6.1f} TFLOP/s "
                      f"{f'{ms / base:5.2f}x cudnn' if base else '':11s} peak extra {row['extra_mib'][m]:7.0f} MiB "
                      f"{'exact=' + str(row['exact'][m]) if m in row['exact'] else ''}", flush=True)
        del q, kk, w
        torch.cuda.empty_cache()


def plot(results: List[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    ks = sorted({r["k"] for r in results if "cols" in r}, reverse=True)
    if not ks:
        return
    fig, axes = plt.subplots(1, len(ks), figsize=(6 * len(ks), 4.5), squeeze=False)
    for ax, k in zip(axes[0], ks):
        rows = [r for r in results if r.get("k") == k and "cols" in r]
        for m in ("dsa", "torch", "cudnn"):
            for causal, style in ((False, "-o"), (True, "--s")):
                # per row: the shapes differ in rows; causal rows hold half their columns on average
                pts = [(r["cols"], 1e3 * r["ms"][m] / r["rows"]) for r in rows
                       if r["ms"].get(m) and r["causal"] == causal]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{m}{' causal' if causal else ''}",
                            color={"dsa": "C0", "torch": "C1", "cudnn": "C2"}[m])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("row length (columns)")
        ax.set_ylabel("time per row (us)")
        ax.set_title(f"topk_indices, k={k}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="topk_peers_out")
    ap.add_argument("--indexer", action="store_true", help="also time the fused indexer_topk")
    ap.add_argument("--variants", action="store_true", help="also time dsa's other top-k kernels")
    ap.add_argument("--no-topk", action="store_true", help="skip the top-k table (with --indexer: only that)")
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    ap.add_argument("--shapes", type=ints, default=None, help="top-k shapes by index in TOPK_SHAPES, e.g. 3,4")
    ap.add_argument("--indexer-shapes", type=ints, default=None, help="indexer shapes by index in INDEXER_SHAPES")
    ap.add_argument("--ks", type=ints, default=list(TOPK_KS), help="top-k k values (default 2048,1024)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("topk_peers: needs a CUDA device")
        return 2
    os.makedirs(args.out, exist_ok=True)
    cd = cudnn_wrappers()
    results: List[dict] = []
    t0 = time.time()
    if not args.no_topk:
        run_topk(args, results, cd)
    if args.indexer:
        run_indexer(args, results, cd)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "seconds": time.time() - t0}
    with open(os.path.join(args.out, "topk_peers.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    plot(results, os.path.join(args.out, "topk_peers.png"))
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
