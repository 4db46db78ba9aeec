"""Indexer benchmarks: dense ``indexer_scores`` and fused ``indexer_topk``.

``indexer_topk`` must never hold the [S_q, S_k] score matrix (16 GiB at the
largest shape): each benchmark records the peak memory above what was live
before the call (``peak_extra_bytes``, the input sets included in that base)
beside the size the matrix would have (``score_matrix_bytes``).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List

import pytest
import torch

from bench import backends, counts, cudnn_peer, harness, inputs, torch_peer
from bench.shapes import INDEXER, INDEXER_TOPK


def _cases(shapes) -> List[Any]:
    return [pytest.param(s, b, id=f"{s.name}-{b}") for s in shapes for b in backends.BACKENDS]


def _input_bytes(s: Dict[str, Any]) -> int:
    return sum(s[n].numel() * s[n].element_size() for n in ("q", "k", "weights"))


def _qkw(s: Dict[str, Any]):
    return s["q"], s["k"], s["weights"]


def _cudnn_weights(sets: List[Dict[str, Any]]) -> None:
    # cuDNN's indexer takes bf16 head weights; convert outside the timed call.
    for s in sets:
        s.setdefault("weights_bf16", s["weights"].to(torch.bfloat16))


def _scores_call(backend: str, shape: Any, s: Dict[str, Any]):
    q, k, w = s["q"], s["k"], s["weights"]
    if backend in backends.DSA_BACKENDS:
        f = backends.dsa().indexer_scores
        return functools.partial(f, q, k, w, ratio=shape.ratio, causal=shape.causal, backend=backend)
    if backend == "torch":
        return functools.partial(torch_peer.indexer_scores, q, k, w, ratio=shape.ratio, causal=shape.causal)
    if not shape.causal:
        pytest.skip("cudnn: its indexer applies the causal mask; this shape is non-causal")
    return functools.partial(cudnn_peer.indexer_scores, q, k, s["weights_bf16"], ratio=shape.ratio)


@pytest.mark.parametrize("shape,backend", _cases(INDEXER))
def test_indexer_scores(benchmark, shape, backend):
    shape = harness.resolve(shape)
    backends.skip_unless_runnable(backend, shape)
    dev = harness.device()
    sets = inputs.indexer_sets(shape, dev)
    if backend == "cudnn":
        _cudnn_weights(sets)
    calls = [_scores_call(backend, shape, s) for s in sets]
    pairs = counts.visible_pairs(shape.S_q, shape.S_k, shape.ratio, shape.causal)
    with torch.no_grad():
        harness.run(
            benchmark,
            harness.Rotation(calls),
            dev,
            op="indexer_scores",
            shape=shape,
            backend=backend,
            flops=counts.indexer_flops(shape.H_i, shape.D_i, pairs),
            nbytes=counts.indexer_bytes(shape.S_q, shape.S_k, shape.H_i, shape.D_i),
            metric="tflops",
            sets=len(sets),
            label=backend,
            skip_on=backends.skip_on(backend),
            extra={
                "visible_pairs": pairs,
                "auto_explain": backends.auto_explain(
                    "indexer_scores", *_qkw(sets[0]), ratio=shape.ratio, causal=shape.causal
                ),
            },
        )


@pytest.mark.parametrize("torch_deterministic", [False, True], ids=["atomic", "torch-deterministic"])
@pytest.mark.parametrize("shape", INDEXER, ids=[s.name for s in INDEXER])
def test_indexer_scores_bwd(benchmark, shape, torch_deterministic):
    """The dense backward op (``dsa::indexer_scores_bwd``, Triton) on the forward's shapes, a fresh fp32
    dscores a set: 6 * H_i * D_i FLOPs a visible pair (the recomputed dots, dq and dk) either way, so the
    rows compare directly. Under ``torch.use_deterministic_algorithms(True)`` dk is a second pass by key
    (``_dense_dk_kernel``) instead of atomics; torch's fill of new memory is left off while timing."""
    import torch.utils.deterministic

    from dsa import _checks, ops

    backend = "triton"
    shape = harness.resolve(shape)
    backends.skip_unless_runnable(backend, shape)
    dev = harness.device()
    calls = []
    for s in inputs.indexer_sets(shape, dev):
        a, _ = _checks.indexer_args(*_qkw(s), shape.ratio, 1.0, shape.causal, None, None, None, None)
        dscores = torch.randn(a.q.shape[0], a.max_seqlen_k, device=dev)
        calls.append(functools.partial(ops.indexer_scores_bwd, a, dscores, backend))
    pairs = counts.visible_pairs(shape.S_q, shape.S_k, shape.ratio, shape.causal)
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(torch_deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        harness.run(
            benchmark, harness.Rotation(calls), dev, op="indexer_scores_bwd", shape=shape, backend=backend,
            flops=3 * counts.indexer_flops(shape.H_i, shape.D_i, pairs), nbytes=None, metric="tflops",
            sets=len(calls), label=backend, skip_on=backends.skip_on(backend),
            extra={"visible_pairs": pairs, "torch_deterministic": torch_deterministic},
        )
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _topk_call(backend: str, shape: Any, s: Dict[str, Any]):
    q, k, w = s["q"], s["k"], s["weights"]
    kw = {"ratio": shape.ratio, "causal": shape.causal}
    if backend in backends.DSA_BACKENDS:
        f = backends.dsa().indexer_topk
        return functools.partial(f, q, k, w, shape.topk, return_lengths=True, backend=backend, **kw)
    if backend == "torch":
        return functools.partial(torch_peer.indexer_topk, q, k, w, shape.topk, **kw)
    if shape.score_matrix_bytes > cudnn_peer.MAX_SCORE_MATRIX_BYTES:
        pytest.skip(
            f"cudnn: composing its indexer and top-k would materialise the "
            f"{shape.score_matrix_bytes / 2**30:.0f} GiB score matrix (its fused path is SM100-only, not wired here)"
        )
    if not shape.causal:
        pytest.skip("cudnn: its indexer applies the causal mask; this shape is non-causal")
    rows = torch.arange(1, shape.S_q + 1, device=q.device)
    seq_lens = (rows // shape.ratio).clamp(0, shape.S_k).to(torch.int32)
    return functools.partial(
        cudnn_peer.indexer_topk, q, k, s["weights_bf16"], shape.topk, seq_lens, ratio=shape.ratio
    )


@pytest.mark.parametrize("shape,backend", _cases(INDEXER_TOPK))
def test_indexer_topk(benchmark, shape, backend):
    shape = harness.resolve(shape)
    backends.skip_unless_runnable(backend, shape)
    dev = harness.device()
    sets = inputs.indexer_sets(shape, dev)
    if backend == "cudnn":
        _cudnn_weights(sets)
    calls = [_topk_call(backend, shape, s) for s in sets]
    pairs = counts.visible_pairs(shape.S_q, shape.S_k, shape.ratio, shape.causal)
    with torch.no_grad():
        harness.run(
            benchmark,
            harness.Rotation(calls),
            dev,
            op="indexer_topk",
            shape=shape,
            backend=backend,
            flops=counts.indexer_flops(shape.H_i, shape.D_i, pairs),
            nbytes=counts.indexer_topk_bytes(shape.S_q, shape.S_k, shape.H_i, shape.D_i, shape.topk),
            metric="tflops",
            sets=len(sets),
            label=backend,
            skip_on=backends.skip_on(backend),
            extra={
                "visible_pairs": pairs,
                "score_matrix_bytes": shape.score_matrix_bytes,
                "input_bytes_per_set": _input_bytes(sets[0]),
                "output_bytes": shape.S_q * (shape.topk + 1) * 4,
                "auto_explain": backends.auto_explain(
                    "indexer_topk", *_qkw(sets[0]), shape.topk, ratio=shape.ratio, causal=shape.causal,
                    return_lengths=True,
                ),
            },
        )
