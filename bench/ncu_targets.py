"""One workload a call, for Nsight Compute: the kernels behind the missed targets.

    python bench/ncu_targets.py {topk|cute_topk|cute|klbwd}      (CUDA)

* topk: the resident top-k kernel on 4096 x 16384 fp32 torch.randn rows, k = 2048;
* cute_topk: the cute streaming top-k on 8192 x 32768 fp32 torch.randn rows, k = 2048;
* cute: the CuTe SM90 sparse attention forward at V3.2 (bench/tune_cute.py's inputs);
* klbwd: the indexer KL loss backward at the V3.2 training step
  (bench/test_bench_training.py's inputs).

Each runs its kernel three times (twice for klbwd), so that
``ncu --clock-control none --launch-skip 1 --launch-count 1 -k regex:NAME``
profiles a launch after the first. The kernel names: ``_topk_resident_kernel``,
``TopkStreamSm90`` and ``SparseAttnFwdSm90`` (within the CuTe DSL's names),
``_indexer_bwd_kernel``.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _topk_launches(launch, rows: int, cols: int) -> None:
    """Three launches of a top-k ``launch`` on fp32 torch.randn rows, k = 2048."""
    x = torch.randn(rows, cols, device="cuda")
    i = torch.empty(rows, 2048, dtype=torch.int32, device="cuda")
    n = torch.empty(rows, dtype=torch.int32, device="cuda")
    for _ in range(3):
        launch(x, 2048, i, n)


def topk() -> None:
    from dsa.triton import topk as tk

    _topk_launches(tk.launch, 4096, 16384)


def cute_topk() -> None:
    from dsa.cute import topk as ct

    _topk_launches(ct.launch, 8192, 32768)


def cute() -> None:
    import tune_cute as tc

    a, _ = tc.make("V3.2")
    for _ in range(3):
        tc.cute_sa.forward(a)


def klbwd() -> None:
    import test_bench_training as tb

    import dsa

    shape = tb.TRAINING[0]
    s = tb.make_set(shape, torch.device("cuda"))
    leaves = [s[n].detach().clone().requires_grad_() for n in ("q_i", "k_i", "weights")]
    loss = dsa.indexer_kl_loss(*leaves, s["indices"], s["target"], sm_scale=shape.D_i**-0.5, backend="triton")
    for _ in range(2):
        torch.autograd.grad(loss, leaves, retain_graph=True)


if __name__ == "__main__":
    {"topk": topk, "cute_topk": cute_topk, "cute": cute, "klbwd": klbwd}[sys.argv[1]]()
    torch.cuda.synchronize()
