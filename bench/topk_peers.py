"""Top-k and indexer -> top-k against their peers, on the same inputs, in one process.

    PYTHONPATH=$PWD python bench/topk_peers.py --out OUT [--indexer] [--variants] [--no-topk]
        [--shapes 3,4] [--ks 2048,1024] [--indexer-shapes 0,1] [--sweep] [--sweep-rows 4096]
        [--plot OUT.png] [--shape-budget 240]
    PYTHONPATH=$PWD python bench/topk_peers.py --replot OUT/topk_peers.json [--out DIR] [--plot P.png]
    PYTHONPATH=$PWD python bench/topk_peers.py --smoke --out DIR [--variants] [--sweep]

Top-k: fp32 scores [rows, cols] from torch.randn (causal shapes: row i keeps
min(cols, i + 1) scores, the rest -inf), every shape at k 2048 and 1024;
timed: dsa (the triton backend's op, as ``topk_indices`` runs it),
``dsa_cute`` (the cute kernel, on an SM90 GPU where it serves the shape),
``dsa_auto`` (the public call under auto), ``torch.topk`` and, when ``import cudnn`` works, cuDNN's
``indexer_top_k_wrapper`` (given each row's valid length). On causal shapes
``dsa_row_ends`` is given the same lengths as ``row_ends`` (it reads only
them, as cuDNN does) and ``dsa_whole_rows`` reads whole rows; dense shapes
have one ``dsa`` row. Every dsa result is first checked for exact equality
with the contract (ascending positions, -1 padded, ties to the smaller
position) on a spread of rows, and the public ``topk_indices`` call for
equality with the op. ``--variants`` adds dsa's other kernels (the resident
kernel where the row fits it) and list-path settings (see ``variants``;
causal shapes: with the row ends), and the fused indexer_topk's chunking
settings (``INDEXER_VARIANTS``), each checked.

Bandwidth: "read" is the bytes of scores a method has to read: the sum of
the row lengths x 4 where it is given them (dsa_row_ends, cuDNN), rows x
cols x 4 otherwise; GB/s = read / time, and its fraction of 4.24 TB/s (the
H200's measured copy rate, ``bench.plot.CEILING_GBPS``).

``--sweep``: dense rows, ``--sweep-rows`` of them (4096: 31 rows an SM of
the H200's 132 at every length, 2 GiB of scores at 131072), S = 4096 .. 131072
(powers of two), each k: dsa, cuDNN, torch.topk. Its plot (time and GB/s
against S; ``--plot``, default OUT/topk_sweep.png) needs matplotlib (the
device image has it); the same numbers go to OUT/topk_sweep.csv, and
``--replot`` draws the plots from a saved JSON anywhere matplotlib is.

Indexer -> top-k (``--indexer``): H 64, D 128, bf16, causal; dsa's fused
``indexer_topk`` (``dsa_fused``: Triton; ``dsa_fused_cute``: Triton's scores
and the cute top-k, where it serves the call) against cuDNN's
``indexer_forward_wrapper`` followed by ``indexer_top_k_wrapper``.

Times: triton.testing.do_bench(warmup=25, rep=100, median), ms. A shape
that has run ``--shape-budget`` seconds skips its remaining methods (named
in the output). Indexer: TFLOP/s of the scores (2 * H * D * visible pairs)
over the whole time, and the peak memory the call allocates beyond its
inputs. Writes OUT/topk_peers.json, OUT/topk_peers.csv and OUT/topk_peers.png
(time per row against row length, one line per method, dense and causal
apart). ``--smoke``: tiny shapes on the CPU under TRITON_INTERPRET=1 (host
clock, no peers but torch): checks the script end to end; its times mean
nothing.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional

if "--smoke" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.plot import CEILING_GBPS  # noqa: E402

TOPK_SHAPES = [  # rows, cols, causal
    (4096, 4096, False),
    (4096, 16384, False),
    (8192, 32768, False),
    (32768, 32768, True),
    (65536, 65536, True),
]
TOPK_KS = (2048, 1024)
SWEEP_COLS = (4096, 8192, 16384, 32768, 65536, 131072)
SWEEP_ROWS = 4096
INDEXER_SHAPES = [  # S_q, S_k, ratio, k
    (32768, 32768, 1, 2048),
    (65536, 16384, 4, 1024),
    (65536, 65536, 1, 2048),
    (131072, 32768, 4, 1024),
]
# --smoke: tiny versions (CPU, the interpreter)
SMOKE_SHAPES = [(16, 256, False), (24, 24, True)]
SMOKE_KS = (16, 5)
SMOKE_SWEEP_COLS = (64, 128)
SMOKE_SWEEP_ROWS = 8


class Env:
    """Where the run happens: the device, the timer and the synchronisation."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.dev = torch.device("cpu" if smoke else "cuda")

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def bench(self, fn: Callable[[], object]) -> float:
        if self.smoke:  # one call on the host clock: checks the path, measures nothing
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0)
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def causal_lengths(rows: int, cols: int, ratio: int, dev) -> torch.Tensor:
    i = torch.arange(rows, device=dev)
    return torch.clamp((i + 1) // ratio, max=cols).to(torch.int32)


def make_scores(rows: int, cols: int, causal: bool, gen: torch.Generator, dev) -> torch.Tensor:
    x = torch.randn(rows, cols, device=dev, generator=gen)
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


def dsa_topk(x: torch.Tensor, k: int, ends: Optional[torch.Tensor] = None, **launch_kw):
    """A call of dsa's top-k on x: the triton backend's op as topk_indices
    runs it (no keywords), else ``launch`` with the keywords; ``ends``: the
    rows' ends (row_ends)."""
    from dsa.triton import topk as tk

    if not launch_kw:
        from dsa._args import TopkArgs

        a = TopkArgs(x, k, ends)
        return lambda: tk.topk(a)
    idx = torch.empty((x.shape[0], k), dtype=torch.int32, device=x.device)
    lens = torch.empty((x.shape[0],), dtype=torch.int32, device=x.device)

    def run():
        tk.launch(x, k, idx, lens, ends=ends, **launch_kw)
        return idx, lens

    return run


def cute_methods(x: torch.Tensor, k: int, ends: Optional[torch.Tensor]) -> Dict[str, Callable]:
    """dsa's cute top-k on x (``dsa_cute``, where it serves the call) and
    the public call under auto (``dsa_auto``: whichever backend the
    selector takes); none without a CUDA device."""
    if x.device.type != "cuda":
        return {}
    import dsa
    from dsa._args import TopkArgs

    out: Dict[str, Callable] = {"dsa_auto": lambda: dsa.topk_indices(x, k, row_ends=ends, return_lengths=True)}
    try:
        from dsa.cute import topk as ct
    except Exception as e:  # the DSL absent: the Triton rows only
        print(f"dsa_cute: skipped ({type(e).__name__}: {e})", flush=True)
        return out
    a = TopkArgs(x, k, ends)
    why = ct.supports(a)
    if why is None:
        out["dsa_cute"] = lambda: ct.topk(a)
    else:
        print(f"dsa_cute: {why}", flush=True)
    return out


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


def variants(rows: int, cols: int, k: int) -> Dict[str, dict]:
    """dsa's other kernels and list-path settings for this shape. The list
    path: ``sep`` = the build then a select kernel (the path before the
    inline select), ``inline`` = the build selects the lists of the block;
    ``rev`` / ``fwd`` = rows last first / first first; c = the build's chunk;
    pf = chunks prefetched to L2 ahead (sm_90+). Then ``short_row_variants``."""
    from dsa.triton import topk as tk

    out: Dict[str, dict] = {}
    if cols <= tk.RESIDENT_MAX:
        out["dsa_resident"] = {"list_min": 1 << 40}
    if cols == 4096:  # the resident kernel's shape, by occupancy (sm_90a: 4 warps at 128 registers, 4 an SM)
        for w, nreg in ((8, 64), (2, 168)):  # 4 programs an SM of 8 warps; 6 of 2 warps (no spills either)
            out[f"dsa_resident_w{w}_r{nreg}"] = {"config": tk.ResidentConfig(num_warps=w, search="interp",
                                                                               maxnreg=nreg)}
    out.update(short_row_variants(rows, cols, k))
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


def short_row_variants(rows: int, cols: int, k: int) -> Dict[str, dict]:
    """The settings dsa/triton/topk.py selects by environment (defaults
    unchanged), each against the default route of this shape; the variable
    that selects it for every call is in the comment.

    * ``dsa_resident_evict`` (rows the resident kernel takes): the row load
      evict-first (DSA_TOPK_EVICT_FIRST=1).
    * list path: ``sample2x``: twice the plan's sample (the default's is
      1 / 8 of the row up to 32768 keys, 1 / 16 above; set for every call by
      DSA_TOPK_LIST_SAMPLE_FRACTION and _SAMPLE_MAX), a smaller select block
      at k 1024; ``batch{n}``: n rows a batch, their lists still in L2
      at the select (DSA_TOPK_LIST_BATCH_ROWS=n); ``build_w{w}``: the build
      on w warps (DSA_TOPK_LIST_BUILD_WARPS=w); ``select_w8``: the first
      select block on 8 warps, no register cap (DSA_TOPK_LIST_SELECT_WARPS=8);
      ``evict``: the build's chunk loads evict-first (DSA_TOPK_EVICT_FIRST=1);
      ``scaled_sample``: with row ends, rows of at most a quarter (half) of
      the columns sample a quarter (half) as many scores, the opposite of
      the default's choice (DSA_TOPK_LIST_SCALED_SAMPLE; the default scales
      above 32768 columns; whole rows are unchanged).
    """
    from dsa.triton import topk as tk

    out: Dict[str, dict] = {}
    if cols < tk.LIST_MIN:
        block_s = max(16, 1 << (cols - 1).bit_length())
        cfg = tk._resident_config(block_s)
        out["dsa_resident_evict"] = {"config": dataclasses.replace(cfg, evict_first=True)}
        return out
    plan = tk._list_plan(cols, k)
    if plan is None:
        return out
    bigger = tk._list_plan(cols, k, sample=2 * plan.sample)
    if bigger is not None:
        out["dsa_list_sample2x"] = {"plan": bigger}
    for n in (1024, 2048):
        if n < rows:
            out[f"dsa_list_batch{n}"] = {"plan": dataclasses.replace(plan, batch_rows=n)}
    for w in (2, 8):
        if w != plan.build_warps:
            out[f"dsa_list_build_w{w}"] = {"plan": dataclasses.replace(plan, build_warps=w)}
    if plan.select_warps == 4:
        out["dsa_list_select_w8"] = {"plan": dataclasses.replace(plan, select_warps=8, select_maxnreg=None)}
    out["dsa_list_evict"] = {"plan": dataclasses.replace(plan, evict_first=True)}
    flip = not plan.scaled_sample  # rows with ends
    out[f"dsa_list_{'scaled' if flip else 'whole'}_sample"] = {"plan": dataclasses.replace(plan, scaled_sample=flip)}
    if rows > 1024:
        out["dsa_list_batch1024_evict"] = {"plan": dataclasses.replace(plan, batch_rows=1024, evict_first=True)}
    return out


class Budget:
    """Seconds a shape may run (--shape-budget): past them its remaining
    methods are skipped, so one slow shape cannot eat the device call."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.time()

    def spent(self) -> bool:
        return time.time() - self.start > self.seconds

    def skip(self, row: dict, method: str, label: str) -> bool:
        """True (the method's time recorded as None, the skip printed) once the budget is spent."""
        if not self.spent():
            return False
        row["ms"][method] = None
        print(f"{label} {method}: skipped (the shape ran past --shape-budget {self.seconds:.0f} s)", flush=True)
        return True


def time_methods(env: Env, row: dict, x: torch.Tensor, k: int, methods: Dict[str, Callable],
                 read: Dict[str, int], budget: Budget) -> None:
    """Check (dsa) and time each method into row: ms, read bytes, GB/s, the
    fraction of the copy rate; a failing or skipped method gets None."""
    for key in ("ms", "exact", "read_bytes", "gbps", "peak_frac"):
        row.setdefault(key, {})
    for m, fn in methods.items():
        if budget.skip(row, m, f"{row['shape']} k={k}"):
            continue
        try:
            out = fn()
            if m.startswith("dsa"):
                env.sync()
                row["exact"][m] = check_rows(x, k, out[0], out[1])
            ms = env.bench(fn)
        except Exception as e:  # one peer failing must not lose the table
            row["ms"][m] = None
            print(f"{row['shape']} k={k} {m}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        row["ms"][m] = ms
        row["read_bytes"][m] = read[m]
        row["gbps"][m] = read[m] / ms / 1e6
        row["peak_frac"][m] = row["gbps"][m] / CEILING_GBPS


def report(kind: str, row: dict) -> None:
    base = row["ms"].get("cudnn")
    for m, ms in row["ms"].items():
        if ms is None:
            continue
        ratio = f"{ms / base:5.2f}x cudnn" if base else ""
        ex = row["exact"].get(m, "")
        mib = row["read_bytes"][m] / 2**20
        print(f"{kind} {row['shape']:22s} k={row['k']:5d} {m:30s} {ms:9.4f} ms read {mib:8.0f} "
              f"MiB {row['gbps'][m]:7.1f} GB/s {100 * row['peak_frac'][m]:5.1f}% of {CEILING_GBPS / 1e3:.2f} TB/s "
              f"{ratio:12s} {'exact=' + str(ex) if ex != '' else ''}", flush=True)


def public_equal(x: torch.Tensor, k: int, ends: Optional[torch.Tensor], out) -> bool:
    """Whether the public topk_indices (backend "triton") returns the op's result."""
    import dsa

    got = dsa.topk_indices(x, k, row_ends=ends, return_lengths=True, backend="triton")
    return torch.equal(got[0], out[0]) and torch.equal(got[1], out[1])


def run_topk(args, env: Env, results: List[dict], cd) -> None:
    gen = torch.Generator(device=env.dev).manual_seed(0)
    shapes = SMOKE_SHAPES if env.smoke else TOPK_SHAPES
    for i, (rows, cols, causal) in enumerate(shapes):
        if args.shapes is not None and i not in args.shapes:
            continue
        budget = Budget(args.shape_budget)
        x = make_scores(rows, cols, causal, gen, env.dev)
        el = x.element_size()
        seq = causal_lengths(rows, cols, 1, x.device) if causal else torch.full((rows,), cols, dtype=torch.int32,
                                                                                   device=x.device)
        whole, valid = rows * cols * el, int(seq.sum()) * el  # bytes of whole rows / of the rows' prefixes
        name = f"{rows}x{cols}{' causal' if causal else ''}"
        for k in args.ks:
            # causal: dsa told the rows' lengths (row_ends, as cuDNN is) and dsa on whole rows
            ends = seq if causal else None
            main = "dsa_row_ends" if causal else "dsa"
            methods: Dict[str, Callable] = {main: dsa_topk(x, k, ends)}
            read = {main: valid if causal else whole}
            if causal:
                methods["dsa_whole_rows"] = dsa_topk(x, k)
                read["dsa_whole_rows"] = whole
            for m, fn in cute_methods(x, k, ends).items():
                methods[m] = fn
                read[m] = valid if causal else whole
            if args.variants:
                for v, kw in variants(rows, cols, k).items():
                    v = f"{v}_row_ends" if causal else v
                    methods[v] = dsa_topk(x, k, ends, **kw)
                    read[v] = valid if causal else whole
            methods["torch"] = lambda: torch.topk(x, k, dim=1)
            read["torch"] = whole
            if cd is not None:
                methods["cudnn"] = lambda: cd["topk"](x, seq, k, next_n=1, return_val=False)
                read["cudnn"] = valid
            row = {"shape": name, "rows": rows, "cols": cols, "causal": causal, "k": k}
            time_methods(env, row, x, k, methods, read, budget)
            if row["ms"].get(main) is not None:
                row["public_equal"] = public_equal(x, k, ends, methods[main]())
                print(f"{name} k={k}: topk_indices(row_ends={'lengths' if causal else 'None'}) equals the op: "
                      f"{row['public_equal']}", flush=True)
            results.append(row)
            report("topk", row)
        del x
        if env.dev.type == "cuda":
            torch.cuda.empty_cache()


def run_sweep(args, env: Env, results: List[dict], cd) -> None:
    """Dense rows of every length of SWEEP_COLS: dsa, cuDNN, torch.topk."""
    gen = torch.Generator(device=env.dev).manual_seed(2)
    rows = args.sweep_rows or (SMOKE_SWEEP_ROWS if env.smoke else SWEEP_ROWS)
    for cols in SMOKE_SWEEP_COLS if env.smoke else SWEEP_COLS:
        budget = Budget(args.shape_budget)
        x = make_scores(rows, cols, False, gen, env.dev)
        seq = torch.full((rows,), cols, dtype=torch.int32, device=x.device)
        nbytes = x.numel() * x.element_size()
        for k in args.ks:
            methods: Dict[str, Callable] = {"dsa": dsa_topk(x, k), **cute_methods(x, k, None),
                                            "torch": lambda: torch.topk(x, k, dim=1)}
            if cd is not None:
                methods["cudnn"] = lambda: cd["topk"](x, seq, k, next_n=1, return_val=False)
            row = {"sweep": True, "shape": f"{rows}x{cols}", "rows": rows, "cols": cols, "causal": False, "k": k}
            time_methods(env, row, x, k, methods, {m: nbytes for m in methods}, budget)
            results.append(row)
            report("sweep", row)
        del x
        if env.dev.type == "cuda":
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
    "dsa_fused_whole_sample": dict(LIST_SCALED_SAMPLE=False),  # the default scales it above 32768 keys
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


def run_indexer(args, env: Env, results: List[dict], cd) -> None:
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
        try:  # Triton's scores, the cute top-k (where it serves the call: an SM90 GPU)
            dsa.explain("indexer_topk", q, kk, w, k, ratio=ratio, backend="cute")
            methods["dsa_fused_cute"] = lambda: dsa.indexer_topk(q, kk, w, k, ratio=ratio, backend="cute")
        except (ValueError, ImportError) as e:
            print(f"indexer {sq}/{sk} dsa_fused_cute: {e}", flush=True)
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
        budget = Budget(args.shape_budget)
        for m, fn in methods.items():
            if budget.skip(row, m, f"indexer {name}"):
                continue
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
                row["ms"][m] = env.bench(fn)
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


def _pyplot():
    """matplotlib's pyplot (Agg), or None where it is missing (then only the CSV is written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_shapes(results: List[dict], path: str) -> None:
    """Time per row against row length for the shapes' table, dense and causal apart."""
    plt = _pyplot()
    rows_all = [r for r in results if "cols" in r and not r.get("sweep")]
    ks = sorted({r["k"] for r in rows_all}, reverse=True)
    if plt is None or not ks:
        print("topk_peers.png: " + ("matplotlib missing: no plot" if plt is None else "no top-k rows"))
        return
    lines = (("dsa", False, "C0"), ("dsa_row_ends", True, "C0"), ("dsa_whole_rows", True, "C3"),
             ("torch", None, "C1"), ("cudnn", None, "C2"))
    fig, axes = plt.subplots(1, len(ks), figsize=(6 * len(ks), 4.5), squeeze=False)
    for ax, k in zip(axes[0], ks):
        rows = [r for r in rows_all if r["k"] == k]
        for m, only, color in lines:
            for causal, style in ((False, "-o"), (True, "--s")):
                if only is not None and only != causal:
                    continue
                # per row: the shapes differ in rows; causal rows hold half their columns on average
                pts = [(r["cols"], 1e3 * r["ms"][m] / r["rows"]) for r in rows
                       if r["ms"].get(m) and r["causal"] == causal]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color,
                            label=f"{m}{' causal' if causal and m in ('torch', 'cudnn') else ''}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("row length (columns)")
        ax.set_ylabel("time per row (us)")
        ax.set_title(f"topk_indices, k={k}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def plot_sweep(results: List[dict], path: str) -> None:
    """The sweep: time (top) and GB/s of scores read (bottom) against the row
    length, one panel per k; the copy rate as a dashed line."""
    plt = _pyplot()
    sweep = [r for r in results if r.get("sweep")]
    ks = sorted({r["k"] for r in sweep}, reverse=True)
    if plt is None or not ks:
        why = "matplotlib missing: no plot (the CSV has the numbers)" if plt is None else "no sweep rows"
        print(f"{path}: {why}")
        return
    fig, axes = plt.subplots(2, len(ks), figsize=(6 * len(ks), 8), squeeze=False)
    R = sweep[0]["rows"]
    for j, k in enumerate(ks):
        rows = sorted((r for r in sweep if r["k"] == k), key=lambda r: r["cols"])
        for m, color in (("dsa_cute", "C0"), ("dsa", "C3"), ("cudnn", "C2"), ("torch", "C1")):
            pts = [(r["cols"], r["ms"][m], r["gbps"][m]) for r in rows if r["ms"].get(m)]
            if pts:
                axes[0][j].plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=color, label=m)
                axes[1][j].plot([p[0] for p in pts], [p[2] for p in pts], "-o", color=color, label=m)
        axes[1][j].axhline(CEILING_GBPS, ls="--", color="grey", label=f"copy rate {CEILING_GBPS / 1e3:.2f} TB/s")
        for i, (ylabel, log) in enumerate((("time (ms)", True), ("GB/s of scores read", False))):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            if log:
                ax.set_yscale("log")
            ax.set_xlabel("row length S (columns)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"top-k of {R} dense fp32 rows, k={k}")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


CSV_FIELDS = ("table", "shape", "rows", "cols", "causal", "k", "method", "ms", "read_bytes", "gbps", "peak_frac",
              "exact")


def write_csv(results: List[dict], path: str) -> None:
    """One line per (top-k or sweep row, method)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in results:
            if "cols" not in r:
                continue
            for m, ms in r["ms"].items():
                w.writerow(dict(table="sweep" if r.get("sweep") else "topk", shape=r["shape"], rows=r["rows"],
                                cols=r["cols"], causal=r["causal"], k=r["k"], method=m, ms=ms,
                                read_bytes=r["read_bytes"].get(m), gbps=r["gbps"].get(m),
                                peak_frac=r["peak_frac"].get(m), exact=r["exact"].get(m, "")))
    print(f"wrote {path}")


def write_outputs(results: List[dict], out: str, sweep_png: Optional[str]) -> None:
    write_csv([r for r in results if not r.get("sweep")], os.path.join(out, "topk_peers.csv"))
    plot_shapes(results, os.path.join(out, "topk_peers.png"))
    if any(r.get("sweep") for r in results):
        write_csv([r for r in results if r.get("sweep")], os.path.join(out, "topk_sweep.csv"))
        plot_sweep(results, sweep_png or os.path.join(out, "topk_sweep.png"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="topk_peers_out")
    ap.add_argument("--indexer", action="store_true", help="also time the fused indexer_topk")
    ap.add_argument("--variants", action="store_true", help="also time dsa's other top-k kernels")
    ap.add_argument("--no-topk", action="store_true", help="skip the top-k table (with --indexer: only that)")
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    ap.add_argument("--shapes", type=ints, default=None, help="top-k shapes by index in TOPK_SHAPES, e.g. 3,4")
    ap.add_argument("--indexer-shapes", type=ints, default=None, help="indexer shapes by index in INDEXER_SHAPES")
    ap.add_argument("--ks", type=ints, default=None, help="top-k k values (default 2048,1024)")
    ap.add_argument("--sweep", action="store_true", help="time dense rows of 4096..131072 columns, and plot them")
    ap.add_argument("--sweep-rows", type=int, default=None, help=f"rows of the sweep (default {SWEEP_ROWS})")
    ap.add_argument("--plot", default=None, help="the sweep's plot (default OUT/topk_sweep.png)")
    ap.add_argument("--shape-budget", type=float, default=240.0,
                    help="seconds a shape may run before its remaining methods are skipped (default 240)")
    ap.add_argument("--replot", default=None, metavar="JSON", help="only the plots and CSVs of a saved run")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    if args.ks is None:
        args.ks = list(SMOKE_KS if args.smoke else TOPK_KS)
    os.makedirs(args.out, exist_ok=True)
    if args.replot:
        with open(args.replot) as f:
            write_outputs(json.load(f)["results"], args.out, args.plot)
        return 0
    if not args.smoke and not torch.cuda.is_available():
        print("topk_peers: needs a CUDA device (or --smoke, or --replot)")
        return 2
    if args.smoke and args.indexer:
        print("topk_peers: --indexer needs a CUDA device")
        return 2
    env = Env(args.smoke)
    cd = None if args.smoke else cudnn_wrappers()
    results: List[dict] = []
    t0 = time.time()
    if not args.no_topk:
        run_topk(args, env, results, cd)
    if args.sweep:
        run_sweep(args, env, results, cd)
    if args.indexer:
        run_indexer(args, env, results, cd)
    device = torch.cuda.get_device_name() if env.dev.type == "cuda" else "cpu (smoke)"
    meta = {"device": device, "torch": torch.__version__, "seconds": time.time() - t0}
    with open(os.path.join(args.out, "topk_peers.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    write_outputs(results, args.out, args.plot)
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
