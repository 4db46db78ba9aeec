"""dsa.distributed on CPU with gloo: 2 and 4 spawned processes, equal to the
single-process call on the full sequence (forward and backward), on the
reference and Triton-interpreter backends.

One spawn of 4 processes serves every check (spawning is the slow part): the
default group runs the 4-rank checks, and a group of global ranks 1 and 3
the 2-rank ones (so group ranks differ from global ranks). The parent writes
the full inputs to a file, each rank runs its shard of every case and writes
its results, and the parent compares them with the single-process call.
Shards are ragged (7/5 and 5/3/0/4 tokens, an empty rank included) except in
the cases marked even.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dsa
import dsa.distributed as dd
from conftest import CUDA, INTERPRETING, TRITON_IMPORTABLE

T, H, D, D_V, K = 12, 2, 32, 16, 8
H_I, D_I = 2, 16
SIZES = {2: [7, 5], 4: [5, 3, 0, 4]}
PAIR = (1, 3)  # the global ranks of the 2-rank group
BACKENDS = ["reference"] + (["triton"] if TRITON_IMPORTABLE and not CUDA else [])
ATOL = 2e-5
# the interpreter is slow: Triton runs the cases that reach its kernels in new
# ways (ragged global rows, GQA, the indexer at both ratios); layouts, prefetch
# and size handling are the host's and run on the reference backend
TRITON_CASES = ("mqa", "gqa", "pipeline_r1", "pipeline_r2")


def _offsets(sizes):
    lo = [sum(sizes[:r]) for r in range(len(sizes))]
    return list(zip(lo, sizes))


def _key_sizes(q_sizes, ratio):
    """Compressed key j (tokens j*ratio .. (j+1)*ratio - 1) lives on the rank of its last token."""
    cum = [sum(q_sizes[:r]) for r in range(len(q_sizes) + 1)]
    return [cum[r + 1] // ratio - cum[r] // ratio for r in range(len(q_sizes))]


# --------------------------------------------------------------------------
# the cases: full-sequence inputs, built once in the parent


def _hostile_indices(gen, rows_shape, n):
    """Global rows with -1, rows just past n and one far out of range."""
    idx = torch.randint(-1, n + 2, (*rows_shape, K), generator=gen, dtype=torch.int32)
    idx.view(-1)[3] = 2**30
    return idx


def _sparse_case(gen, *, batch=None, groups=1, sink=True, lengths=True, even=False, prefetch=False,
                 give_sizes=False, deterministic=False):
    lead = () if batch is None else (batch,)
    kv_shape = (*lead, T, D) if groups == 1 else (*lead, T, groups, D)
    rows = (*lead, T) if groups == 1 else (*lead, T, groups)
    return {
        "kind": "sparse",
        "dim": 0 if batch is None else 1,
        "even": even,
        "prefetch": prefetch,
        "give_sizes": give_sizes,
        "q": torch.randn(*lead, T, H, D, generator=gen),
        "kv": torch.randn(kv_shape, generator=gen),
        "indices": _hostile_indices(gen, rows, T),
        "sink": torch.randn(H, generator=gen) if sink else None,
        "topk_length": torch.randint(-1, K + 2, (*lead, T), generator=gen, dtype=torch.int32) if lengths else None,
        "dout": torch.randn(*lead, T, H, D_V, generator=gen),
        "deterministic": deterministic,
    }


def _indexer_case(gen, *, ratio, topk, batch=None, pipeline=False, give_sizes=False):
    lead = () if batch is None else (batch,)
    n_k = T // ratio
    case = {
        "kind": "pipeline" if pipeline else "indexer",
        "dim": 0 if batch is None else 1,
        "ratio": ratio,
        "topk": topk,
        "give_sizes": give_sizes,
        "q_i": torch.randn(*lead, T, H_I, D_I, generator=gen),
        # mixed signs: relu zeroes many products, so ties at the cut are common
        "k_i": torch.randn(*lead, n_k, D_I, generator=gen),
        "w": torch.randn(*lead, T, H_I, generator=gen),
    }
    if pipeline:
        case.update(
            q=torch.randn(T, H, D, generator=gen),
            kv=torch.randn(n_k, D, generator=gen),
            sink=torch.randn(H, generator=gen),
            dout=torch.randn(T, H, D_V, generator=gen),
        )
    return case


def _cases():
    gen = torch.Generator().manual_seed(2026)
    cases = {
        "mqa": _sparse_case(gen),
        "mqa_even_prefetch": _sparse_case(gen, even=True, prefetch=True, lengths=False),
        "mqa_sizes_given_det": _sparse_case(gen, give_sizes=True, deterministic=True, sink=False),
        "gqa": _sparse_case(gen, groups=2),
        "batched": _sparse_case(gen, batch=2),
        "indexer_r1": _indexer_case(gen, ratio=1, topk=5),
        "indexer_r2": _indexer_case(gen, ratio=2, topk=4, give_sizes=True),
        "indexer_r1_batched": _indexer_case(gen, ratio=1, topk=3, batch=2),
        "pipeline_r1": _indexer_case(gen, ratio=1, topk=K, pipeline=True),
        "pipeline_r2": _indexer_case(gen, ratio=2, topk=4, pipeline=True, give_sizes=True),
    }
    return cases


def _backend_cases(cases, backend, device="cpu"):
    if backend == "reference" or device != "cpu":
        return cases
    return {n: c for n, c in cases.items() if n in TRITON_CASES}


def _on(c, device):
    """A case with its tensors on ``device``."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in c.items()}


# --------------------------------------------------------------------------
# what each rank runs


def _local(x, dim, lo, n):
    return None if x is None else x.narrow(dim, lo, n).clone()


def _leaf(x):
    return None if x is None else x.requires_grad_(True)


def _rank_sparse(c, group, rank, world, backend):
    sizes = [T // world] * world if c["even"] else SIZES[world]
    lo, n = _offsets(sizes)[rank]
    dim = c["dim"]
    q, kv = _leaf(_local(c["q"], dim, lo, n)), _leaf(_local(c["kv"], dim, lo, n))
    sink = _leaf(None if c["sink"] is None else c["sink"].clone())
    idx, tl = _local(c["indices"], dim, lo, n), _local(c["topk_length"], dim, lo, n)
    kv_arg = dd.gather_kv(kv, group=group, kv_sizes=sizes, dim=dim, async_op=True) if c["prefetch"] else kv
    out, lse = dd.sparse_attention(
        q, kv_arg, idx, group=group, kv_sizes=sizes if c["give_sizes"] else None, d_v=D_V, sink=sink, topk_length=tl,
        return_lse=True, deterministic=c["deterministic"], backend=backend,
    )
    (out * _local(c["dout"], dim, lo, n)).sum().backward()
    res = {"out": out, "lse": lse, "dq": q.grad, "dkv": kv.grad}
    if sink is not None:
        res["dsink"] = sink.grad
    return {k: v.detach() for k, v in res.items()}


def _rank_indexer(c, group, rank, world, backend):
    q_sizes = SIZES[world]
    k_sizes = _key_sizes(q_sizes, c["ratio"])
    (lo, n), (klo, kn) = _offsets(q_sizes)[rank], _offsets(k_sizes)[rank]
    dim = c["dim"]
    sizes = dict(q_sizes=q_sizes, k_sizes=k_sizes) if c["give_sizes"] else {}
    idx, lengths = dd.indexer_topk(
        _local(c["q_i"], dim, lo, n), _local(c["k_i"], dim, klo, kn), _local(c["w"], dim, lo, n), c["topk"],
        group=group, ratio=c["ratio"], return_lengths=True, backend=backend, **sizes,
    )
    res = {"idx": idx, "lengths": lengths}
    if c["kind"] == "pipeline":
        q, kv, sink = _leaf(_local(c["q"], 0, lo, n)), _leaf(_local(c["kv"], 0, klo, kn)), _leaf(c["sink"].clone())
        out, lse = dd.sparse_attention(
            q, kv, idx, group=group, kv_sizes=k_sizes if c["give_sizes"] else None, d_v=D_V, sink=sink,
            topk_length=lengths, return_lse=True, backend=backend,
        )
        (out * _local(c["dout"], 0, lo, n)).sum().backward()
        res.update(out=out.detach(), lse=lse, dq=q.grad, dkv=kv.grad, dsink=sink.grad)
    return res


def _rank_errors(group, rank, world):
    """Bad sizes raise ValueError on every rank before any collective starts."""
    kv = torch.randn(SIZES[world][rank], D)
    msgs = []
    for bad in ([1] * (world + 1), [s + 1 for s in SIZES[world]], [-1] * world):
        try:
            dd.gather_kv(kv, group=group, kv_sizes=bad)
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    # a gather along the packed token dim handed to a batched call: refused after
    # the (matched) gather was issued, so every rank still takes part in it
    pending = dd.gather_kv(kv, group=group, kv_sizes=SIZES[world], async_op=True)
    try:
        n = kv.shape[0]
        dd.sparse_attention(torch.randn(1, n, H, D), pending, torch.zeros(1, n, K, dtype=torch.int32), group=group)
        msgs.append(None)
    except ValueError as e:
        msgs.append(str(e))
    pending.wait()
    return msgs


def _run_all(cases, group, rank, world, backends=BACKENDS, device="cpu"):
    results = {"errors": _rank_errors(group, rank, world)} if device == "cpu" else {}
    for backend in backends:
        for name, c in _backend_cases(cases, backend, device).items():
            run = _rank_sparse if c["kind"] == "sparse" else _rank_indexer
            res = run(_on(c, device), group, rank, world, backend)
            results[backend, name] = {k: v.cpu() for k, v in res.items()}
    return results


def _in_group(backend, rank, world, tmp, work):
    """work() inside a process group.

    The rank's stderr goes to tmp/log{rank}.txt, with the Python stack of a
    fatal signal; a Python failure leaves its traceback in tmp/error{rank}.txt,
    and tmp/done{rank} marks a rank whose work (results saved) is complete.
    """
    log = open(f"{tmp}/log{rank}.txt", "w")
    os.dup2(log.fileno(), 2)
    faulthandler.enable(file=log)
    dist.init_process_group(
        backend, init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        work()
        open(f"{tmp}/done{rank}", "w").close()
        dist.barrier()  # no rank tears its group down while another still communicates
    except BaseException:
        with open(f"{tmp}/error{rank}.txt", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _child(rank, world, tmp):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported in this process

    def work():
        cases = torch.load(f"{tmp}/cases.pt")
        torch.save(_run_all(cases, None, rank, world), f"{tmp}/w{world}_rank{rank}.pt")
        pair = dist.new_group(list(PAIR))  # every rank takes part in creating it
        if rank in PAIR:
            sub = dist.get_rank(pair)
            torch.save(_run_all(cases, pair, sub, 2), f"{tmp}/w2_rank{sub}.pt")
        if INTERPRETING:  # the ranks' kernels are address-checked too (conftest)
            import interp_memcheck

            found = interp_memcheck.take()
            assert not found, interp_memcheck.report(found)

    _in_group("gloo", rank, world, tmp, work)


GPU_BACKENDS = ("reference", "triton")


def _nccl_child(rank, world, tmp):
    torch.cuda.set_device(rank)

    def work():
        cases = torch.load(f"{tmp}/cases.pt")
        results = _run_all(cases, None, rank, world, GPU_BACKENDS, f"cuda:{rank}")
        torch.save(results, f"{tmp}/w{world}_rank{rank}.pt")

    _in_group("nccl", rank, world, tmp, work)


# --------------------------------------------------------------------------
# the single-process results on the full sequence


def _full_sparse(c, backend, q, kv, indices, topk_length, dout):
    q, kv = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
    sink = None if c.get("sink") is None else c["sink"].clone().requires_grad_(True)
    out, lse = dsa.sparse_attention(
        q, kv, indices, d_v=D_V, sink=sink, topk_length=topk_length, return_lse=True,
        deterministic=c.get("deterministic", False), backend=backend,
    )
    (out * dout).sum().backward()
    res = {"out": out.detach(), "lse": lse, "dq": q.grad, "dkv": kv.grad}
    if sink is not None:
        res["dsink"] = sink.grad
    return res


def _full(c, backend):
    if c["kind"] == "sparse":
        return _full_sparse(c, backend, c["q"], c["kv"], c["indices"], c["topk_length"], c["dout"])
    idx, lengths = dsa.indexer_topk(c["q_i"], c["k_i"], c["w"], c["topk"], ratio=c["ratio"], return_lengths=True,
                                    backend=backend)
    res = {"idx": idx, "lengths": lengths}
    if c["kind"] == "pipeline":
        res.update(_full_sparse(c, backend, c["q"], c["kv"], idx, lengths, c["dout"]))
    return res


def _compare(name, c, full, ranks, world):
    q_sizes = [T // world] * world if c.get("even") else SIZES[world]
    kv_sizes = _key_sizes(q_sizes, c.get("ratio", 1))
    dim = c["dim"]
    for key, want in full.items():
        if key == "dsink":
            got = sum(r[key] for r in ranks)  # each rank holds its own rows' share
            torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5, msg=lambda m: f"{name} dsink: {m}")
            continue
        kv_like = key == "dkv"
        for rank, (lo, n) in enumerate(_offsets(kv_sizes if kv_like else q_sizes)):
            got, part = ranks[rank][key], want.narrow(dim, lo, n)
            if key in ("idx", "lengths"):
                assert torch.equal(got, part), f"{name} {key} rank {rank}: {got.tolist()} != {part.tolist()}"
            else:
                torch.testing.assert_close(got, part, atol=ATOL, rtol=1e-5, msg=lambda m: f"{name} {key} r{rank}: {m}")


def _logs(tmp):
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(tmp.glob("log*.txt")))


def _spawn(child, world, tmp, attempts=2):
    """``world`` processes running child(rank, world, tmp).

    A rank that raises fails the test with its traceback. A rank killed by a
    signal (the communication runtime aborting; our code raises) is told
    apart by the done markers: after every rank finished its work, the
    results stand and a warning carries the logs; before, the spawn runs
    once more, and fails with the logs if it dies again.
    """
    for attempt in range(attempts):
        for p in tmp.glob("*"):
            if p.name != "cases.pt":
                p.unlink()
        try:
            mp.spawn(child, args=(world, str(tmp)), nprocs=world, join=True)
            return
        except mp.ProcessExitedException as e:
            if e.signal_name is None:
                pytest.fail(f"a rank exited with code {e.exit_code}:\n{_logs(tmp)}")
            # the other ranks' errors, if any, are the lost peer's consequence
            if all((tmp / f"done{r}").exists() for r in range(world)):
                warnings.warn(f"a rank died after every rank's work was done ({e}):\n{_logs(tmp)}")
                return
            if attempt + 1 == attempts:
                pytest.fail(f"a rank died, {attempts} times ({e}):\n{_logs(tmp)}")
            warnings.warn(f"a rank died during its work ({e}), spawning again:\n{_logs(tmp)}")
        except Exception:
            errs = [p.read_text() for p in sorted(tmp.glob("error*.txt"))]
            pytest.fail("a rank failed:\n" + "\n".join(errs))


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """(cases, {world size: each group rank's results}) from one spawn of 4 processes."""
    cases = _cases()
    tmp = tmp_path_factory.mktemp("gloo")
    torch.save(cases, tmp / "cases.pt")
    _spawn(_child, 4, tmp)
    return cases, {w: [torch.load(tmp / f"w{w}_rank{r}.pt") for r in range(w)] for w in (2, 4)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_single_process(spawned, world, backend):
    cases, results = spawned
    ranks = results[world]
    for name, c in _backend_cases(cases, backend).items():
        full = _full(c, backend)
        _compare(name, c, full, [r[backend, name] for r in ranks], world)


@pytest.mark.parametrize("world", [2, 4])
def test_bad_sizes_raise_before_communicating(spawned, world):
    ranks = spawned[1][world]
    for r in ranks:
        too_many, wrong_own, negative, wrong_dim = r["errors"]
        assert wrong_dim is not None and "gathered along dim 0" in wrong_dim
        assert too_many is not None and "one per rank" in too_many
        assert wrong_own is not None and "local shard holds" in wrong_own
        assert negative is not None and "ints >= 0" in negative


def test_needs_an_initialised_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(ValueError, match="not initialised"):
        dd.sparse_attention(torch.randn(2, H, D), torch.randn(2, D), torch.zeros(2, K, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_gpus_match_one(tmp_path):
    """Every case on 2 GPUs over NCCL (rank r on cuda:r) against one call on cuda:0."""
    cases = _cases()
    torch.save(cases, tmp_path / "cases.pt")
    _spawn(_nccl_child, 2, tmp_path)
    ranks = [torch.load(tmp_path / f"w2_rank{r}.pt") for r in range(2)]
    for backend in GPU_BACKENDS:
        for name, c in cases.items():
            full = {k: v.cpu() for k, v in _full(_on(c, "cuda:0"), backend).items()}
            _compare(name, c, full, [r[backend, name] for r in ranks], 2)
