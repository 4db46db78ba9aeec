"""Indexer-training benchmarks: ``attention_target``, ``sparse_indexer_scores`` and ``indexer_kl_loss`` (forward + backward).

The V3.2 training step: T = 4096 query rows, K = 2048 distinct slots per row
(ascending, as ``topk_indices`` returns them) out of N = 8192 rows; the main
attention has H = 128 heads of D = 576, the indexer H_i = 64 heads of
D_i = 128 with fp32 head weights. FLOPs (all slots valid):

* attention_target: ``2 * T * H * K * D`` (the recomputed Q K^T);
* indexer_kl_loss forward + backward: ``2 * T * H_i * D_i * K`` forward plus
  ``6 * T * H_i * D_i * K`` backward (recomputed dots, dq, dk).

``extra_info`` also records ``peak_extra_bytes`` against ``input_bytes``
(the contract asks the KL loss for at most 2x its inputs).

Peer rows ``cudnn`` (bench/cudnn_peer.py, skipped when ``import cudnn``
fails): ``sparse_attn_score_recompute_wrapper`` for the target,
``sparse_indexer_score_recompute_wrapper`` (the softmax over the slots) for
the logits, and that recompute followed by ``indexer_backward_wrapper`` for
the KL step. cuDNN takes bf16 weights only: they are cast (and scaled by
sm_scale for the recompute) once, outside the timing; dsa keeps fp32 weights.
bench/training_peers.py times all of them in one process with
the gradients checked against float64.

``python bench/test_bench_training.py`` (CUDA) prints the same figures
without pytest-benchmark, plus a sweep of the kernel configs behind the
tables in dsa/triton/training.py and dsa/triton/indexer_bwd.py.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass
from typing import Any, Dict, List

import torch


@dataclass(frozen=True)
class TrainingShape:
    """One indexer-training step: sparse attention target + indexer KL loss on the same slots."""

    name: str
    T: int
    N: int
    K: int
    H: int = 128
    D: int = 576
    H_i: int = 64
    D_i: int = 128
    reference: bool = False

    def smoke(self) -> "TrainingShape":
        return dataclasses.replace(self, T=8, N=64, K=16, H=4, D=40, H_i=4, D_i=16)

    @property
    def params(self) -> Dict[str, object]:
        return dataclasses.asdict(self)

    @property
    def target_flops(self) -> float:
        return 2.0 * self.T * self.H * self.K * self.D

    @property
    def kl_flops(self) -> float:
        return 8.0 * self.T * self.H_i * self.D_i * self.K


TRAINING = (TrainingShape("V3.2", T=4096, N=8192, K=2048),)


def make_set(shape: TrainingShape, dev: torch.device, seed: int = 0) -> Dict[str, Any]:
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    bf16 = torch.bfloat16
    rnd = functools.partial(torch.randn, generator=g, device=dev)
    idx = torch.empty(shape.T, shape.K, dtype=torch.int32, device=dev)
    step = max(1, (64 << 20) // shape.N)
    for t0 in range(0, shape.T, step):  # K distinct rows per query row, ascending
        t1 = min(shape.T, t0 + step)
        keys = torch.rand(t1 - t0, shape.N, generator=g, device=dev)
        idx[t0:t1] = keys.topk(shape.K, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
    s = {
        "q": rnd(shape.T, shape.H, shape.D, dtype=bf16),
        "kv": rnd(shape.N, shape.D, dtype=bf16),
        "indices": idx,
        "q_i": rnd(shape.T, shape.H_i, shape.D_i, dtype=bf16),
        "k_i": rnd(shape.N, shape.D_i, dtype=bf16),
        "weights": rnd(shape.T, shape.H_i) * shape.H_i**-0.5,
    }
    # lse of the main attention over these slots (what sparse_attention(return_lse=True) gives)
    import dsa

    with torch.no_grad():
        s["lse"] = _lse(s["q"], s["kv"], idx, shape.D**-0.5)
        s["target"] = dsa.attention_target(s["q"], s["kv"], idx, s["lse"], backend="reference" if dev.type == "cpu" else "triton")
    return s


def _lse(q, kv, idx, sm_scale, rows: int = 64):
    out = torch.empty(q.shape[0], q.shape[1], device=q.device, dtype=torch.float32)
    for t0 in range(0, q.shape[0], rows):
        k = kv[idx[t0 : t0 + rows].long()].float()  # [C, K, D]
        s = torch.einsum("chd,ckd->chk", q[t0 : t0 + rows].float(), k) * sm_scale
        out[t0 : t0 + rows] = torch.logsumexp(s, -1)
    return out


def input_bytes(s: Dict[str, Any], names) -> int:
    return sum(s[n].numel() * s[n].element_size() for n in names)


def target_call(s, backend):
    if backend == "cudnn":
        from bench import cudnn_peer

        return functools.partial(cudnn_peer.attention_target, s["q"], s["kv"], s["indices"], s["lse"],
                                 sm_scale=s["q"].shape[-1] ** -0.5)
    import dsa

    return functools.partial(dsa.attention_target, s["q"], s["kv"], s["indices"], s["lse"], backend=backend)


def scores_call(s, backend):
    sm = s["q_i"].shape[-1] ** -0.5
    if backend == "cudnn":
        from bench import cudnn_peer

        w, ws = cudnn_peer.indexer_weights(s["weights"], sm)  # bf16, cast outside the timing
        return functools.partial(cudnn_peer.indexer_softmax, s["q_i"], s["k_i"], w, s["indices"],
                                 sm_scale=sm, scaled_weights=ws)
    import dsa

    return functools.partial(dsa.sparse_indexer_scores, s["q_i"], s["k_i"], s["weights"], s["indices"],
                             sm_scale=sm, backend=backend)


def kl_call(s, backend, deterministic=False):
    """One KL step (loss, then the gradients of q_i, k_i, weights); cuDNN's
    overwrites a copy of the target made once."""
    if backend == "cudnn":
        from bench import cudnn_peer

        sm = s["q_i"].shape[-1] ** -0.5
        tgt = s["target"].clone()
        w, ws = cudnn_peer.indexer_weights(s["weights"], sm)  # bf16, cast outside the timing
        return functools.partial(cudnn_peer.indexer_kl_step, s["q_i"], s["k_i"], w, s["indices"], tgt,
                                 sm_scale=sm, scaled_weights=ws)
    import dsa

    leaves = [s[n].detach().clone().requires_grad_() for n in ("q_i", "k_i", "weights")]

    def step():
        loss = dsa.indexer_kl_loss(
            *leaves, s["indices"], s["target"], sm_scale=leaves[0].shape[-1] ** -0.5,
            deterministic=deterministic, backend=backend,
        )
        return torch.autograd.grad(loss, leaves)

    return step


KL_INPUTS = ("q_i", "k_i", "weights", "indices", "target")

# --------------------------------------------------------------------------
# pytest-benchmark (bench/conftest.py skips everything without CUDA)

try:
    import pytest

    from bench import backends, harness
except ImportError:  # the __main__ mode needs neither
    pytest = None

if pytest is not None:

    def _cases(peers=("cudnn",)):
        return [pytest.param(s, b, id=f"{s.name}-{b}") for s in TRAINING for b in backends.DSA_BACKENDS + peers]

    def _forward_row(benchmark, shape, backend, op, call, flops, names):
        """One no-grad op on the training shape: its TFLOP/s, with the bytes
        of the inputs ``names`` and of a [T, K] fp32 output."""
        shape = harness.resolve(shape)
        backends.skip_unless_runnable(backend, shape)
        dev = harness.device()
        s = make_set(shape, dev)
        with torch.no_grad():
            harness.run(
                benchmark, harness.Rotation([call(s, backend)]), dev,
                op=op, shape=shape, backend=backend, flops=flops(shape),
                nbytes=float(input_bytes(s, names) + shape.T * shape.K * 4),
                metric="tflops", sets=1, label=backend, skip_on=backends.skip_on(backend),
            )

    @pytest.mark.parametrize("shape,backend", _cases())
    def test_attention_target(benchmark, shape, backend):
        _forward_row(benchmark, shape, backend, "attention_target", target_call, lambda sh: sh.target_flops,
                     ("q", "kv", "indices", "lse"))

    @pytest.mark.parametrize("shape,backend", _cases())
    def test_sparse_indexer_scores(benchmark, shape, backend):
        """The indexer logits on the slots (cuDNN: its softmax recompute, the softmax included)."""
        _forward_row(benchmark, shape, backend, "sparse_indexer_scores", scores_call, lambda sh: sh.kl_flops / 4,
                     KL_INPUTS[:4])

    @pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
    @pytest.mark.parametrize("shape,backend", _cases())
    def test_indexer_kl_loss_fwd_bwd(benchmark, shape, backend, deterministic):
        """The KL step; cuDNN's is its softmax recompute + indexer_backward_wrapper (SM90: not deterministic)."""
        shape = harness.resolve(shape)
        backends.skip_unless_runnable(backend, shape)
        if backend == "cudnn" and deterministic:
            pytest.skip("cudnn: deterministic=True is SM100-only (indexer_backward_wrapper)")
        dev = harness.device()
        s = make_set(shape, dev)
        harness.run(
            benchmark, harness.Rotation([kl_call(s, backend, deterministic)]), dev,
            op="indexer_kl_loss", shape=shape, backend=backend, flops=shape.kl_flops, nbytes=None,
            metric="tflops", sets=1, label=backend, skip_on=backends.skip_on(backend),
            extra={"input_bytes": input_bytes(s, KL_INPUTS), "deterministic": deterministic},
        )


# --------------------------------------------------------------------------
# python bench/test_bench_training.py: figures and a config sweep, no pytest needed


def _time(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100))


def _peak(fn, dev) -> int:
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    out = fn()
    torch.cuda.synchronize(dev)
    del out
    return int(torch.cuda.max_memory_allocated(dev) - base)


def _report(label: str, ms: float, flops: float, extra: str = "") -> None:
    print(f"{label:58s} {ms:8.3f} ms {flops / ms / 1e9:8.1f} TFLOP/s {extra}", flush=True)


def main(argv: List[str]) -> None:
    from dsa.triton import indexer_bwd, training

    dev = torch.device("cuda")
    shape = TRAINING[0]
    s = make_set(shape, dev)
    print(f"shape {shape}", flush=True)
    sweep = "--sweep" in argv

    # attention target
    orig = dict(training.TARGET_CONFIGS)
    configs = [orig[128]]
    if sweep:
        C = training.TrainingTileConfig
        configs += [  # slots as the MMA's rows, like the default
                    C(128, 64, 8, 3, keys_as_rows=True),
                    C(128, 32, 8, 4, keys_as_rows=True), C(64, 64, 4, 3, keys_as_rows=True),
                    C(64, 64, 8, 3, keys_as_rows=True),
                    # heads as the MMA's rows
                    C(64, 64, 4, 3), C(64, 64, 4, 4), C(64, 64, 8, 3),
                    # Q loaded once per row
                    C(32, 64, 8, 3, q_resident=True), C(64, 64, 8, 1, q_resident=True, keys_as_rows=True)]
    with torch.no_grad():
        ref = target_call(s, "triton")()
        for cfg in configs:
            training.TARGET_CONFIGS[128] = cfg
            try:
                out = target_call(s, "triton")()
                err = ((out - ref).norm() / ref.norm()).item()
                _report(f"attention_target {cfg}", _time(target_call(s, "triton")), shape.target_flops,
                        f"rel-vs-default {err:.1e}")
            except Exception as e:  # a config that does not compile (shared memory) is skipped
                print(f"attention_target {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        training.TARGET_CONFIGS.update(orig)

    # KL loss forward, backward, together
    inb = input_bytes(s, KL_INPUTS)
    fwd_cfgs = [training.INDEXER_FWD_CONFIG]
    bwd_cfgs = [indexer_bwd.BWD_CONFIG]
    if sweep:
        fwd_cfgs += [training.TrainingTileConfig(64, 0, 4, 4, keys_as_rows=True), training.TrainingTileConfig(128, 0, 8, 3, keys_as_rows=True),
                     # heads as the MMA's rows
                     training.TrainingTileConfig(32, 0, 4, 4), training.TrainingTileConfig(32, 0, 4, 3)]
        B = indexer_bwd.IndexerBwdConfig
        bwd_cfgs += [B(64, 4, 2, True), B(128, 4, 1, True), B(128, 8, 1, True),
                     # heads as the MMAs' rows
                     B(32, 4, 1), B(32, 4, 2)]
    import dsa

    leaves = [s[n].detach().clone().requires_grad_() for n in ("q_i", "k_i", "weights")]
    sc = shape.D_i**-0.5
    fwd = lambda: dsa.indexer_kl_loss(*leaves, s["indices"], s["target"], sm_scale=sc, backend="triton")  # noqa
    f0 = training.INDEXER_FWD_CONFIG
    for cfg in fwd_cfgs:
        training.INDEXER_FWD_CONFIG = cfg
        try:
            with torch.no_grad():
                _report(f"indexer_kl_loss fwd {cfg}", _time(fwd), shape.kl_flops / 4)
        except Exception as e:
            print(f"kl fwd {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    training.INDEXER_FWD_CONFIG = f0
    b0 = indexer_bwd.BWD_CONFIG
    loss = fwd()
    for cfg in bwd_cfgs:
        indexer_bwd.BWD_CONFIG = cfg
        try:
            bwd = lambda: torch.autograd.grad(loss, leaves, retain_graph=True)  # noqa: E731
            _report(f"indexer_kl_loss bwd {cfg}", _time(bwd), shape.kl_flops * 3 / 4)
        except Exception as e:
            print(f"kl bwd {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    indexer_bwd.BWD_CONFIG = b0
    for det in (False, True):
        step = kl_call(s, "triton", det)
        ms = _time(step)
        peak = _peak(step, dev)
        _report(f"indexer_kl_loss fwd+bwd deterministic={det}", ms, shape.kl_flops,
                f"peak extra {peak / 2**20:.0f} MiB = {peak / inb:.2f}x inputs ({inb / 2**20:.0f} MiB)")
        if det:
            a, b = step(), step()
            print("deterministic bitwise repeat:", all(torch.equal(x, y) for x, y in zip(a, b)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
