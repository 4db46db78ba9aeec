"""A/B of two trees of the package in one process, on the same inputs (CUDA).

    python bench/ab.py --snapshot REV DIR     # on a machine with git: DIR/dsa_before = REV's dsa/
    PYTHONPATH=$PWD:DIR python bench/ab.py --before dsa_before [--rounds 3]

The snapshot copies REV's ``dsa/`` into ``DIR/dsa_before`` with its imports and
its ``torch.library`` namespace renamed, so both trees load side by side.
Each case is timed with ``triton.testing.do_bench`` (median, warmup 25 ms, rep
100 ms) on fresh ``torch.randn`` inputs, the two trees alternating for
``--rounds`` rounds; the best median of each is kept. Cases: the V3.2 sparse
attention forward (auto and Triton) and Triton backward, the S16384 indexer
scores and the 4096 x 16384 top-k (k 2048).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys


def snapshot(rev: str, out_dir: str) -> None:
    dest = os.path.join(out_dir, "dsa_before")
    files = subprocess.check_output(["git", "ls-tree", "-r", "--name-only", rev, "dsa/"], text=True).split()
    for path in files:
        data = subprocess.check_output(["git", "show", f"{rev}:{path}"])
        target = os.path.join(dest, os.path.relpath(path, "dsa"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if path.endswith(".py"):
            text = data.decode()
            text = re.sub(r"\bdsa::", "dsa_before::", text)
            text = re.sub(r"\b(from|import) dsa\b", r"\1 dsa_before", text)
            text = re.sub(r"([\"'])dsa\.", r"\1dsa_before.", text)
            text = re.sub(r"\bdsa\.(?=[a-z_])", "dsa_before.", text)
            data = text.encode()
        with open(target, "wb") as f:
            f.write(data)
    print(f"{len(files)} files of {rev} in {dest}")


def _cases(torch):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    bf = torch.bfloat16

    def randn(*shape, dtype=bf, grad=False):
        return torch.randn(*shape, generator=g, device=dev, dtype=dtype).requires_grad_(grad)

    T, N, H, D, K = 4096, 8192, 128, 576, 2048
    keys = torch.rand(T, N, generator=g, device=dev)
    idx = keys.topk(K, dim=-1).indices.sort(dim=-1).values.int()
    del keys
    attn = dict(q=randn(T, H, D, grad=True), kv=randn(N, D, grad=True), idx=idx, dout=randn(T, H, 512))
    S = 16384
    ind = dict(q=randn(1, S, 64, 128), k=randn(1, S, 128), w=randn(1, S, 64, dtype=torch.float32))
    scores = randn(4096, 16384, dtype=torch.float32)
    return attn, ind, scores


def _runners(pkg, attn, ind, scores, torch):
    a, i = attn, ind

    def fwd(backend):
        return lambda: pkg.sparse_attention(a["q"], a["kv"], a["idx"], backend=backend)

    def bwd():
        out = pkg.sparse_attention(a["q"], a["kv"], a["idx"], backend="triton")
        return lambda: torch.autograd.grad(out, (a["q"], a["kv"]), a["dout"], retain_graph=True)

    flops_fwd = 2 * 4096 * 128 * 2048 * (576 + 512)
    flops_bwd = 2 * 4096 * 128 * 2048 * (3 * 576 + 2 * 512)
    return {
        "V3.2 fwd auto": (fwd("auto"), flops_fwd),
        "V3.2 fwd triton": (fwd("triton"), flops_fwd),
        "V3.2 bwd triton": (bwd(), flops_bwd),
        "indexer S16384": (lambda: pkg.indexer_scores(i["q"], i["k"], i["w"], sm_scale=0.088), None),
        "topk 4096x16384 k2048": (lambda: pkg.topk_indices(scores, 2048), None),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--snapshot", nargs=2, metavar=("REV", "DIR"))
    p.add_argument("--before", default="dsa_before")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.snapshot:
        return snapshot(*args.snapshot)
    import torch
    import triton

    pkgs = {"before": importlib.import_module(args.before), "after": importlib.import_module("dsa")}
    attn, ind, scores = _cases(torch)
    runners = {name: _runners(pkg, attn, ind, scores, torch) for name, pkg in pkgs.items()}
    best = {name: {} for name in pkgs}
    for r in range(args.rounds):
        for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
            for case, (fn, _) in runners[name].items():
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                best[name][case] = min(ms, best[name].get(case, float("inf")))
    print(f"{'case':<24} {'before ms':>10} {'after ms':>10} {'after/before':>12} {'TFLOP/s after':>14}")
    for case, (_, flops) in runners["after"].items():
        b, a = best["before"][case], best["after"][case]
        tf = f"{flops / a / 1e9:.1f}" if flops else "-"
        print(f"{case:<24} {b:>10.4f} {a:>10.4f} {a / b:>12.4f} {tf:>14}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
