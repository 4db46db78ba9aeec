"""Sparse decode against FlashMLA's FP8 sparse decode, in one process, on the same caches (H200).

    python3 -m pip install --no-deps --target /tmp/site .devpeers/sgl_flash_mla-*.whl
    PYTHONPATH=/tmp/site:$PWD python3 bench/decode_peers.py [--out DIR] [--formats fp8_v32,fp8_model1]
        [--batches 1,32,128] [--heads 64,128] [--cache-lens 8192,32768] [--no-sweep]

One query token a sequence, top-k K = 2048 distinct positions of the
sequence's cache (ascending, as dsa.topk_indices gives them), pages of 64
tokens scattered over the pool by a random block table, a sink. Each row
times, eagerly and as a CUDA-graph replay (``triton.testing.do_bench``
medians, warmup 25 ms, rep 100 ms):

- ``flashmla``: ``flash_mla_with_kvcache(q, cache, None, None, 512, meta,
  indices=slots, is_fp8_kvcache=True, attn_sink=sink)`` on the FP8 cache,
  its indices the physical slots page * 64 + offset (``use_legacy=True``
  first: SM90 is on FlashMLA's legacy side);
- ``dsa_fp8_bt``: ``dsa.sparse_decode`` on the same cache with the block
  table and logical positions (what a serving engine holds);
- ``dsa_fp8_bt_plan``: the same call through ``dsa.sparse_decode_plan``
  (made once, called each time): the serving path's host time;
- ``dsa_fp8``: the same with FlashMLA's physical slots;
- ``dsa_bf16``: the dequantised cache in bf16, paged, block table;
- ``sparse_attention``: ``dsa.sparse_attention`` on that bf16 cache as a flat
  [N, D] kv with physical slots (the path the issue measured);
- ``cute_fp8_bt`` / ``cute_fp8`` / ``cute_bf16_bt``: the rows ``dsa_fp8_bt``,
  ``dsa_fp8`` and ``dsa_bf16_bt`` with ``backend="cute"`` (the CuTe SM90
  decode, ``dsa.cute.decode``); where the format's default build is lockstep
  (``dsa.cute.decode_sm90.LOCKSTEP_CACHES``), ``cute_fp8_bt_lockstep`` and
  ``cute_fp8_bt_staggered`` time ``dsa.cute.decode.forward`` as built by
  default and built staggered.

Per row: milliseconds, GB/s (bytes of the K gathered rows in the cache's
format, q and out) and the fraction of 4.24 TB/s, the host microseconds a
call takes (bench/decode_host.py's method: eager calls while the stream is
held behind a sleeping kernel, so that no call waits for the device), and
the relative L2 error of out
against the float64 reference on the dequantised cache. With the sweep
(default), B = 1 and 32 also time dsa's FP8 decode at forced split counts
(``dsa.triton.decode.forward(a, splits=s)``), the evidence for the split rule,
and the cute decode at the split counts of ``--cute-splits`` (default the
same sweep; ``cute_fp8_bt_splitsS`` rows, ``dsa.cute.decode.forward(a,
splits=s)``), the evidence for its rule and for ``dsa.cute.decode.PLACEMENT``.
A peer that is not installed or refuses a shape is a row with the reason.
Prints a table; ``--out DIR`` writes DIR/decode_peers.json.

    compute-sanitizer --tool memcheck python3 bench/decode_peers.py --sanitize

runs only the cute decode on small hostile calls (block tables with -1 and
pages past the pool, positions out of range both ways, seq_lens and
topk_length cutting rows, every split count) for the memory checker.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any, Callable, Dict, Optional

import torch
import triton

import dsa
from dsa import _checks
from dsa.cute import decode as cdecode
from dsa.cute import decode_sm90 as csm90
from dsa.kv_cache import FORMATS
from dsa.triton import decode as tdecode

from decode_host import host_us_cuda  # bench/, the script's folder
from harness import graphed  # bench/, the script's folder

PAGE = 64
K = 2048
HBM_TBS = 4.24  # the H200's measured achievable HBM bandwidth, TB/s
SWEEP = (1, 2, 4, 8, 16, 32)


def bench(fn: Callable[[], Any]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def host_us(fn: Callable[[], Any]) -> float:
    """Host microseconds of one call (the minimum of decode_host.host_us_cuda's samples)."""
    return host_us_cuda(fn, calls=100, reps=10)[0]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def problem(fmt: str, B: int, H: int, L: int, seed: int = 0) -> Dict[str, Any]:
    """Caches of B sequences of L tokens (pages scattered by a block table), q, top-k positions, sink."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    f = FORMATS[fmt]
    per_seq = L // PAGE
    P = B * per_seq
    cache = torch.empty(P, PAGE, f.bytes_per_token, dtype=torch.uint8, device=dev)
    step = max(1, (1 << 27) // (PAGE * f.D))  # pages quantised at once (fp32 staging of ~512 MB)
    for p0 in range(0, P, step):
        p1 = min(P, p0 + step)
        cache[p0:p1] = dsa.quantize_kv_cache(torch.randn(p1 - p0, PAGE, f.D, device=dev, generator=g), fmt)
    bt = torch.randperm(P, device=dev, generator=g).view(B, per_seq).int()
    keys = torch.rand(B, L, device=dev, generator=g)
    pos = keys.topk(K, dim=-1).indices.sort(dim=-1).values.int().view(B, 1, K)
    slots = (bt.long().gather(1, pos.view(B, K).long() // PAGE) * PAGE + pos.view(B, K).long() % PAGE)
    q = torch.randn(B, 1, H, f.D, device=dev, dtype=torch.bfloat16, generator=g)
    sink = torch.randn(H, device=dev, generator=g)
    return dict(fmt=fmt, q=q, cache=cache, bt=bt, pos=pos, slots=slots.int().view(B, 1, K), sink=sink,
                scale=f.D ** -0.5)


def dequantised_bf16(pb: Dict[str, Any]) -> torch.Tensor:
    """The cache dequantised (exact in bf16 for dsa's quantiser), paged [P, 64, 1, D]."""
    c = pb["cache"]
    out = torch.empty(c.shape[0], PAGE, 1, FORMATS[pb["fmt"]].D, dtype=torch.bfloat16, device=c.device)
    step = 1 << 10
    for p0 in range(0, c.shape[0], step):
        out[p0:p0 + step, :, 0] = dsa.dequantize_kv_cache(c[p0:p0 + step], pb["fmt"]).bfloat16()
    return out


def flashmla_fn(pb: Dict[str, Any]) -> Callable[[], Any]:
    try:
        import flash_mla
    except ImportError:
        if "/tmp/site" not in sys.path and os.path.isdir("/tmp/site"):
            sys.path.insert(0, "/tmp/site")
        import flash_mla
    cache = pb["cache"].view(pb["cache"].shape[0], PAGE, 1, -1)
    errors = []
    for legacy in (True, False):
        meta = flash_mla.get_mla_metadata()[0]

        def run(meta=meta, legacy=legacy):
            return flash_mla.flash_mla_with_kvcache(pb["q"], cache, None, None, 512, meta, softmax_scale=pb["scale"],
                                                    is_fp8_kvcache=True, indices=pb["slots"], attn_sink=pb["sink"],
                                                    use_legacy=legacy)[0]
        try:
            run()
            torch.cuda.synchronize()
            return run
        except Exception as e:  # the other side of the wheel may serve this GPU
            errors.append(f"use_legacy={legacy}: {type(e).__name__}: {str(e)[:160]}")
    raise RuntimeError("; ".join(errors))


def measure(row: Dict[str, Any], name: str, build: Callable[[], Callable[[], Any]], nbytes: int,
            ref: Optional[torch.Tensor]) -> Optional[Callable[[], Any]]:
    try:
        fn = build()
        out = fn()
        torch.cuda.synchronize()
        eager = bench(fn)
        replay = graphed(fn)
        graph = bench(replay)
        host = host_us(fn)
    except Exception as e:  # a missing or refusing peer is a row, not a crash
        row[name] = f"{type(e).__name__}: {str(e)[:240]}"
        print(f"  {name:18s} {row[name]}")
        return None
    res = dict(eager_ms=eager, graph_ms=graph, host_us=host, gbps=nbytes / graph / 1e6,
               frac_hbm=nbytes / graph / 1e6 / (HBM_TBS * 1e3))
    if ref is not None:
        res["rel_l2"] = rel_l2(out.view_as(ref), ref)
    row[name] = res
    print(f"  {name:18s} graph {graph * 1e3:8.1f} us  eager {eager * 1e3:8.1f} us  host {host:6.1f} us  "
          f"{res['gbps']:7.0f} GB/s ({res['frac_hbm']:.2f})" + (f"  rel_l2 {res['rel_l2']:.2e}" if ref is not None
                                                                 else ""))
    return fn


@contextlib.contextmanager
def staggered():
    """The cute decode built staggered on every cache while inside (plans
    made inside are dropped on the way out)."""
    keep = csm90.LOCKSTEP_CACHES
    csm90.LOCKSTEP_CACHES = ()
    cdecode._PLANS.clear()
    try:
        yield
    finally:
        csm90.LOCKSTEP_CACHES = keep
        cdecode._PLANS.clear()


def run_row(fmt: str, B: int, H: int, L: int, sweep: bool, cute_splits=SWEEP) -> Dict[str, Any]:
    pb = problem(fmt, B, H, L)
    f = FORMATS[fmt]
    q, cache, bt, pos, slots, sink, scale = (pb[k] for k in ("q", "cache", "bt", "pos", "slots", "sink", "scale"))
    row: Dict[str, Any] = dict(format=fmt, B=B, H=H, cache_len=L, K=K, page=PAGE, D=f.D, d_v=512)
    print(f"{fmt} B={B} H={H} cache_len={L} K={K}")
    kv16 = dequantised_bf16(pb)
    # float64 on the dequantised cache: the reference backend dequantises the gathered rows exactly
    ref = dsa.sparse_decode(q.double(), cache, pos, block_table=bt, sink=sink, sm_scale=scale, backend="reference")
    io = q.numel() * 2 + B * H * 512 * 2
    fp8_bytes = B * K * f.bytes_per_token + io
    bf16_bytes = B * K * f.D * 2 + io
    measure(row, "flashmla", lambda: flashmla_fn(pb), fp8_bytes, ref)
    measure(row, "dsa_fp8_bt", lambda: (lambda: dsa.sparse_decode(q, cache, pos, block_table=bt, sink=sink,
                                                                   sm_scale=scale)), fp8_bytes, ref)
    plan = dsa.sparse_decode_plan(q, cache, pos, block_table=bt, sink=sink, sm_scale=scale)
    measure(row, "dsa_fp8_bt_plan", lambda: (lambda: plan(q, cache, pos, block_table=bt, sink=sink)), fp8_bytes, ref)
    measure(row, "dsa_fp8", lambda: (lambda: dsa.sparse_decode(q, cache, slots, sink=sink, sm_scale=scale)),
            fp8_bytes, ref)
    measure(row, "dsa_bf16_bt", lambda: (lambda: dsa.sparse_decode(q, kv16, pos, block_table=bt, sink=sink,
                                                                    sm_scale=scale)), bf16_bytes, ref)
    measure(row, "cute_fp8_bt", lambda: (lambda: dsa.sparse_decode(q, cache, pos, block_table=bt, sink=sink,
                                                                    sm_scale=scale, backend="cute")), fp8_bytes, ref)
    measure(row, "cute_fp8", lambda: (lambda: dsa.sparse_decode(q, cache, slots, sink=sink, sm_scale=scale,
                                                                 backend="cute")), fp8_bytes, ref)
    measure(row, "cute_bf16_bt", lambda: (lambda: dsa.sparse_decode(q, kv16, pos, block_table=bt, sink=sink,
                                                                     sm_scale=scale, backend="cute")),
            bf16_bytes, ref)
    if fmt in csm90.LOCKSTEP_CACHES:
        # the cute decode as built by default (lockstep) and staggered (both consumers computing S, one
        # half stage of loads in flight), each called through dsa.cute.decode.forward
        la, _ = _checks.sparse_decode_args(q, cache, pos, bt, None, None, sink, scale, None, None)
        measure(row, "cute_fp8_bt_lockstep", lambda: (lambda: cdecode.forward(la)[0]), fp8_bytes, ref.view(B, H, -1))
        with staggered():
            measure(row, "cute_fp8_bt_staggered", lambda: (lambda: cdecode.forward(la)[0]), fp8_bytes,
                    ref.view(B, H, -1))
    flat, q2, s2 = kv16.view(-1, f.D), q.view(B, H, f.D), slots.view(B, K)
    measure(row, "sparse_attention", lambda: (lambda: dsa.sparse_attention(q2, flat, s2, sink=sink, sm_scale=scale)),
            bf16_bytes, ref.view(B, H, -1))
    a, _ = _checks.sparse_decode_args(q, cache, pos, bt, None, None, sink, scale, None, None)
    row["dsa_splits"] = tdecode.plan(a).splits
    if sweep and B <= 32:
        for s in SWEEP:
            measure(row, f"dsa_fp8_bt_splits{s}", lambda s=s: (lambda: tdecode.forward(a, splits=s)[0]), fp8_bytes,
                    ref.view(B, H, -1))
    if cute_splits:
        row["cute_splits"] = cdecode.plan(a).splits if cdecode.supports(a) is None else None
        a16, _ = _checks.sparse_decode_args(q, kv16, pos, bt, None, None, sink, scale, None, None)
        for s in cute_splits:
            for name, args, nbytes in (("cute_fp8_bt", a, fp8_bytes), ("cute_bf16_bt", a16, bf16_bytes)):
                measure(row, f"{name}_splits{s}", lambda s=s, args=args: (lambda: cdecode.forward(args, splits=s)[0]),
                        nbytes, ref.view(B, H, -1))
    fm = row.get("flashmla")
    for ours_name, key in (("dsa_fp8_bt", "speedup"), ("cute_fp8_bt", "cute_speedup"),
                           ("cute_bf16_bt", "cute_bf16_speedup")):
        ours = row.get(ours_name)
        if isinstance(fm, dict) and isinstance(ours, dict):
            row[f"{key}_graph"] = fm["graph_ms"] / ours["graph_ms"]
            row[f"{key}_eager"] = fm["eager_ms"] / ours["eager_ms"]
            print(f"  {ours_name} vs flashmla: {row[f'{key}_graph']:.2f}x (graphs), {row[f'{key}_eager']:.2f}x (eager)")
    del pb, kv16, ref
    torch.cuda.empty_cache()
    return row


def sanitize() -> None:
    """The cute decode on small hostile calls, at every split count, for
    ``compute-sanitizer --tool memcheck``: block tables with -1 and pages past
    the pool, positions negative and far past the table, seq_lens cutting
    rows (one to nothing), topk_length 0, short, past K and negative, a
    padded page stride; FlashMLA-style slots out of range both ways."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    B, H, P, W, K = 6, 128, 24, 5, 320
    caches = {"native": torch.randn(P, PAGE, 1, 576, device=dev, generator=g).bfloat16()}
    for fmt in ("fp8_v32", "fp8_model1"):  # padded pages: 48 bytes past each
        f = FORMATS[fmt]
        pad = torch.zeros(P, PAGE * f.bytes_per_token + 48, dtype=torch.uint8, device=dev)
        pad[:, : PAGE * f.bytes_per_token] = dsa.quantize_kv_cache(
            torch.randn(P, PAGE, f.D, device=dev, generator=g), fmt).view(P, -1)
        caches[fmt] = pad[:, : PAGE * f.bytes_per_token].view(P, PAGE, f.bytes_per_token)
    bt = torch.randint(0, P, (B, W), device=dev, generator=g).int()
    bt[0, 0], bt[1, 2], bt[2, 4] = -1, P, 2**31 - 1
    pos = torch.randint(0, W * PAGE, (B, 1, K), device=dev, generator=g).int()
    pos[0, 0, ::5], pos[1, 0, 1::7], pos[2, 0, 2::9] = -1, W * PAGE, 2**31 - 1
    seq_lens = torch.tensor([W * PAGE, 0, 100, 1, W * PAGE - 7, 64], dtype=torch.int32, device=dev)
    tl = torch.tensor([K, 0, 65, -4, K + 50, 129], dtype=torch.int32, device=dev)
    slots = torch.randint(-P * PAGE, 2 * P * PAGE, (B, 1, K), device=dev, generator=g).int()
    sink = torch.randn(H, device=dev, generator=g)
    for fmt, cache in caches.items():
        D = 576 if fmt == "native" else FORMATS[fmt].D
        q = torch.randn(B, 1, H, D, device=dev, generator=g).bfloat16()
        calls = {"block table": (pos, bt, seq_lens), "slots": (slots, None, None)}
        for what, (idx, table, lens) in calls.items():
            try:
                a, _ = _checks.sparse_decode_args(q, cache, idx, table, lens, tl, sink, None, None, None)
            except ValueError as e:
                print(f"sanitize {fmt} {what}: {e}")
                continue
            why = cdecode.supports(a)
            if why is not None:
                print(f"sanitize {fmt} {what}: not served ({why})")
                continue
            for s in (None, 1, 2, 3, 5):
                out, lse = cdecode.forward(a, splits=s)
                torch.cuda.synchronize()
                print(f"sanitize {fmt} {what} splits={s}: NaN in out {bool(out.isnan().any())}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--formats", default="fp8_v32")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--heads", default="64,128")
    p.add_argument("--cache-lens", default="8192,32768")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--cute-splits", default=",".join(map(str, SWEEP)),
                   help="forced split counts of the cute decode to time (empty: none)")
    p.add_argument("--sanitize", action="store_true", help="only the small hostile cute calls (compute-sanitizer)")
    args = p.parse_args()
    if args.sanitize:
        sanitize()
        return
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    cute_splits = [] if args.no_sweep else ints(args.cute_splits)
    rows = [run_row(fmt, B, H, L, not args.no_sweep, [s for s in cute_splits if B <= 32])
            for fmt in args.formats.split(",") for H in ints(args.heads) for L in ints(args.cache_lens)
            for B in ints(args.batches)]
    print("\nformat       H  cache_len    B   flashmla us  dsa_fp8_bt us  cute_fp8_bt us  cute_bf16_bt us  "
          "triton/fm  cute/fm  dsa host us  plan host us  cute host us")
    for r in rows:
        fm, ours, plan, cute8, cute16 = (r.get(k) for k in ("flashmla", "dsa_fp8_bt", "dsa_fp8_bt_plan", "cute_fp8_bt",
                                                             "cute_bf16_bt"))
        fmt_us = lambda x: f"{x['graph_ms'] * 1e3:11.1f}" if isinstance(x, dict) else f"{'n/a':>11s}"  # noqa: E731
        sp = lambda k: f"{r[k]:9.2f}" if k in r else f"{'n/a':>9s}"  # noqa: E731
        host = lambda x: f"{x['host_us']:11.1f}" if isinstance(x, dict) else f"{'n/a':>11s}"  # noqa: E731
        print(f"{r['format']:10s} {r['H']:3d} {r['cache_len']:10d} {r['B']:4d} {fmt_us(fm)}   {fmt_us(ours)}   "
              f"{fmt_us(cute8)}    {fmt_us(cute16)}  {sp('speedup_graph')} {sp('cute_speedup_graph')}  "
              f"{host(ours)}   {host(plan)}   {host(cute8)}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_peers.json"), "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           rows=rows), fh, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
