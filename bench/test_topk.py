"""Top-k benchmarks: ``topk_indices`` over fp32 scores [rows, cols].

Memory-bound: the plotted number is GB/s (scores read once, indices and
lengths written once); there is no FLOP count.
"""

from __future__ import annotations

import functools
from typing import Any, List

import pytest
import torch

from bench import backends, counts, cudnn_peer, harness, inputs, torch_peer
from bench.shapes import TOPK


def _cases() -> List[Any]:
    return [pytest.param(s, b, id=f"{s.name}-{b}") for s in TOPK for b in backends.BACKENDS]


def _call(backend: str, shape: Any, scores: torch.Tensor):
    if backend in backends.DSA_BACKENDS:
        f = backends.dsa().topk_indices
        return functools.partial(f, scores, shape.k, return_lengths=True, backend=backend)
    if backend == "torch":
        return functools.partial(torch_peer.topk_indices, scores, shape.k)
    seq_lens = torch.full((shape.rows,), shape.cols, dtype=torch.int32, device=scores.device)
    return functools.partial(cudnn_peer.topk_indices, scores, shape.k, seq_lens)


@pytest.mark.parametrize("shape,backend", _cases())
def test_topk_indices(benchmark, shape, backend):
    shape = harness.resolve(shape)
    backends.skip_unless_runnable(backend, shape)
    dev = harness.device()
    sets = inputs.topk_sets(shape, dev)
    calls = [_call(backend, shape, s["scores"]) for s in sets]
    with torch.no_grad():
        harness.run(
            benchmark,
            harness.Rotation(calls),
            dev,
            op="topk_indices",
            shape=shape,
            backend=backend,
            flops=None,
            nbytes=counts.topk_bytes(shape.rows, shape.cols, shape.k),
            metric="gbps",
            sets=len(sets),
            label=backend,
            skip_on=backends.skip_on(backend),
            extra={
                "auto_explain": backends.auto_explain(
                    "topk_indices", sets[0]["scores"], shape.k, return_lengths=True
                )
            },
        )
