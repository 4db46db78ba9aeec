"""Context-parallel DSA: indexer top-k, then sparse attention, forward and
backward, with the sequence sharded over the ranks of a process group; every
rank checks its shard against the single-process call on the full sequence.

    python examples/context_parallel.py --world 2                 # CPU: spawns 2 gloo processes
    python examples/context_parallel.py --world 3 --ragged        # uneven shards
    torchrun --nproc-per-node 2 examples/context_parallel.py      # NCCL on GPUs, gloo without
    torchrun --nproc-per-node 2 examples/context_parallel.py --preset v32 --tokens 65536 --time

``--time`` also prints the all-gather and reduce-scatter times next to the
kernels' times (CUDA events on GPUs, the host clock on CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dsa
import dsa.distributed as dd

# (H, D, d_v, K, H_i, D_i): tiny for CPU, and DeepSeek V3.2
PRESETS = {"tiny": (4, 64, 32, 16, 2, 16), "v32": (128, 576, 512, 2048, 64, 128)}


def shard_sizes(tokens: int, world: int, ragged: bool):
    if not ragged:
        base = [tokens // world] * world
        base[-1] += tokens - sum(base)
        return base
    weights = list(range(1, world + 1))  # rank r holds about (r + 1) / sum shares
    sizes = [tokens * w // sum(weights) for w in weights]
    sizes[-1] += tokens - sum(sizes)
    return sizes


def full_inputs(args, device, dtype):
    """The same full-sequence tensors on every rank (one seed)."""
    H, D, d_v, K, H_i, D_i = PRESETS[args.preset]
    g = torch.Generator(device=device).manual_seed(0)
    T = args.tokens

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dt)

    return dict(q=rand(T, H, D), kv=rand(T, D), q_i=rand(T, H_i, D_i), k_i=rand(T, D_i),
                w=rand(T, H_i, dt=torch.float32), sink=rand(H, dt=torch.float32), dout=rand(T, H, d_v),
                d_v=d_v, K=K, sm_i=D_i**-0.5)


def leaf(x):
    return x.detach().clone().requires_grad_(True)


def step_distributed(x, sizes, rank, backend):
    """One rank's step: its shard of q, kv and the indexer's inputs."""
    lo, n = sum(sizes[:rank]), sizes[rank]
    sl = slice(lo, lo + n)
    q, kv, sink = leaf(x["q"][sl]), leaf(x["kv"][sl]), leaf(x["sink"])
    # issue the small key gather first: on NCCL collectives run in issue order,
    # so the indexer then waits for its keys only while the KV travels
    k_pending = dd.gather_kv(x["k_i"][sl], kv_sizes=sizes, async_op=True)
    kv_pending = dd.gather_kv(kv, kv_sizes=sizes, async_op=True)
    idx, lengths = dd.indexer_topk(x["q_i"][sl], k_pending, x["w"][sl], x["K"], q_sizes=sizes,
                                   sm_scale=x["sm_i"], return_lengths=True, backend=backend)
    out, lse = dd.sparse_attention(q, kv_pending, idx, d_v=x["d_v"], sink=sink, topk_length=lengths,
                                   return_lse=True, backend=backend)
    out.backward(x["dout"][sl])
    return dict(idx=idx, out=out.detach(), lse=lse, dq=q.grad, dkv=kv.grad, dsink=sink.grad)


def step_single(x, backend):
    q, kv, sink = leaf(x["q"]), leaf(x["kv"]), leaf(x["sink"])
    idx, lengths = dsa.indexer_topk(x["q_i"], x["k_i"], x["w"], x["K"], sm_scale=x["sm_i"], return_lengths=True,
                                    backend=backend)
    out, lse = dsa.sparse_attention(q, kv, idx, d_v=x["d_v"], sink=sink, topk_length=lengths, return_lse=True,
                                    backend=backend)
    out.backward(x["dout"])
    return dict(idx=idx, out=out.detach(), lse=lse, dq=q.grad, dkv=kv.grad, dsink=sink.grad)


def compare(mine, full, sizes, rank):
    """Max |error| / max |value| of each output of this rank's shard."""
    lo, n = sum(sizes[:rank]), sizes[rank]
    dist.all_reduce(mine["dsink"])  # each rank holds its own rows' share: the sum is the whole gradient
    errs = {"idx mismatches": (mine["idx"] != full["idx"][lo:lo + n]).sum().item()}
    for key in ("out", "lse", "dq", "dkv", "dsink"):
        want = full[key] if key == "dsink" else full[key][lo:lo + n]
        got, want = mine[key].double(), want.double()
        fin = torch.isfinite(want)
        scale = want[fin].abs().max().item() if fin.any() else 1.0
        errs[key] = ((got - want)[fin].abs().max().item() if fin.any() else 0.0) / max(scale, 1e-30)
        errs[key] += float((torch.isfinite(got) != fin).sum().item())  # +inf lse rows must match
    return errs


def _ms(fn, reps, cuda):
    """Mean ms of fn after a warm-up: CUDA events on GPUs, the host clock on CPU."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    for _ in range(reps):
        fn()
    if cuda:
        end.record()
    sync()
    return start.elapsed_time(end) / reps if cuda else (time.perf_counter() - t0) * 1e3 / reps


def timings(x, sizes, rank, backend, reps=10):
    """ms of the collectives and of the kernels on this rank's shard (CUDA events)."""
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    lo, n, m, world = sum(sizes[:rank]), sizes[rank], max(sizes), len(sizes)
    sl = slice(lo, lo + n)
    kv_pad, k_pad = x["kv"].new_zeros(m, *x["kv"].shape[1:]), x["k_i"].new_zeros(m, *x["k_i"].shape[1:])
    kv_pad[:n], k_pad[:n] = x["kv"][sl], x["k_i"][sl]
    kv_all, k_all = kv_pad.new_empty(world * m, *kv_pad.shape[1:]), k_pad.new_empty(world * m, *k_pad.shape[1:])
    q, kv = leaf(x["q"][sl]), leaf(x["kv"])
    offsets = torch.tensor([lo], device=q.device)
    idx, lengths = dsa.indexer_topk(x["q_i"][sl], x["k_i"], x["w"][sl], x["K"], sm_scale=x["sm_i"], q_offsets=offsets,
                                    return_lengths=True, backend=backend)
    out = dsa.sparse_attention(q, kv, idx, d_v=x["d_v"], sink=x["sink"], topk_length=lengths, backend=backend)
    jobs = {
        "k all-gather": lambda: all_gather(k_all, k_pad),
        "kv all-gather": lambda: all_gather(kv_all, kv_pad),
        "indexer top-k": lambda: dsa.indexer_topk(x["q_i"][sl], x["k_i"], x["w"][sl], x["K"], sm_scale=x["sm_i"],
                                                  q_offsets=offsets, backend=backend),
        "attention fwd": lambda: dsa.sparse_attention(q.detach(), kv.detach(), idx, d_v=x["d_v"], sink=x["sink"],
                                                      topk_length=lengths, backend=backend),
        "attention bwd": lambda: torch.autograd.grad(out, (q, kv), x["dout"][sl], retain_graph=True),
        "dkv reduce-scatter": lambda: reduce_scatter(kv_pad, kv_all),
        "whole step, fwd+bwd": lambda: step_distributed(x, sizes, rank, backend),
    }
    return {name: _ms(fn, reps, q.is_cuda) for name, fn in jobs.items()}


def worker(rank, world, args, init_method):
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        dtype = torch.bfloat16 if cuda else torch.float32
        x = full_inputs(args, device, dtype)
        sizes = shard_sizes(args.tokens, world, args.ragged)
        mine = step_distributed(x, sizes, rank, args.backend)
        full = step_single(x, args.backend)
        errs = compare(mine, full, sizes, rank)
        print(f"rank {rank}/{world}: {sizes[rank]} of {args.tokens} tokens, " +
              ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in errs.items()), flush=True)
        # bf16: each rank's partial dkv is rounded before the sum
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        bad = [k for k, v in errs.items() if v > (0 if k == "idx mismatches" else tol)]
        if bad:
            raise SystemExit(f"rank {rank}: {', '.join(bad)} differ from the single-process call (tolerance {tol})")
        if args.time:
            t = timings(x, sizes, rank, args.backend, reps=args.reps)
            print(f"rank {rank}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in t.items()), flush=True)
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--backend", default="auto")
    p.add_argument("--ragged", action="store_true", help="rank r holds about (r + 1) shares of the tokens")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even where GPUs exist")
    p.add_argument("--time", action="store_true", help="time the collectives, the kernels and the step")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton backend on CPU; read when triton is imported
    if "RANK" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "env://")
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args.world, args, f"file://{tmp}/rdzv"), nprocs=args.world, join=True)


if __name__ == "__main__":
    sys.exit(main())
