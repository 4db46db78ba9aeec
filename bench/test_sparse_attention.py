"""Sparse attention benchmarks: forward, and forward+backward.

Forward+backward is timed as one call (forward with autograd recording, then
``torch.autograd.grad`` of q, kv and sink against a random ``dout``); the same
test also times the training-mode forward alone and records the backward as
the difference of the two medians (``bwd_ms``, ``bwd_tflops``).
"""

from __future__ import annotations

import functools
import statistics
from typing import Any, Callable, Dict, List

import pytest
import torch

from bench import backends, counts, cudnn_peer, harness, inputs, torch_peer
from bench.shapes import SPARSE_ATTENTION


def _cases(backward: bool) -> List[Any]:
    return [
        pytest.param(s, b, id=f"{s.name}-{b}")
        for s in SPARSE_ATTENTION
        if s.backward or not backward
        for b in backends.BACKENDS
    ]


def _forward(backend: str) -> Callable[..., torch.Tensor]:
    """f(q, kv, indices, *, sm_scale, d_v, sink, topk_length) -> out."""
    if backend in backends.DSA_BACKENDS:
        return functools.partial(backends.dsa().sparse_attention, backend=backend)
    if backend == "torch":
        return torch_peer.sparse_attention
    if backend == "cudnn":
        return lambda *a, **kw: cudnn_peer.sparse_attention_fwd(*a, **kw)[0]
    raise ValueError(f"backend: unknown {backend!r}")


def _mean(sets: List[Dict[str, Any]], key: str) -> float:
    return statistics.fmean(s[key] for s in sets)


def _kwargs(shape: Any, s: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "sm_scale": shape.D**-0.5,
        "d_v": shape.d_v,
        "sink": s["sink"],
        "topk_length": s["topk_length"],
    }


def _explain(shape: Any, s: Dict[str, Any]) -> Any:
    return backends.auto_explain("sparse_attention", s["q"], s["kv"], s["indices"], **_kwargs(shape, s))


@pytest.mark.parametrize("shape,backend", _cases(backward=False))
def test_sparse_attention_fwd(benchmark, shape, backend):
    shape = harness.resolve(shape)
    backends.skip_unless_runnable(backend, shape)
    dev = harness.device()
    sets = inputs.sparse_attention_sets(shape, dev, grad=False)
    f = _forward(backend)
    calls = [functools.partial(f, s["q"], s["kv"], s["indices"], **_kwargs(shape, s)) for s in sets]

    valid, unique = _mean(sets, "valid_slots"), _mean(sets, "unique_rows")
    with_len = shape.half_valid
    gather = counts.gather_bytes(shape.D, valid)

    def gather_rate(info: Dict[str, Any]) -> None:
        info["gather_gbps"] = gather / (info["median_ms"] * 1e-3) / 1e9

    with torch.no_grad():
        harness.run(
            benchmark,
            harness.Rotation(calls),
            dev,
            op="sparse_attention.fwd",
            shape=shape,
            backend=backend,
            flops=counts.attn_fwd_flops(shape.H, shape.D, shape.d_v, valid),
            nbytes=counts.attn_fwd_bytes(shape.T, shape.H, shape.D, shape.d_v, shape.K, unique, with_length=with_len),
            metric="tflops",
            sets=len(sets),
            label=backend,
            skip_on=backends.skip_on(backend),
            extra={
                "valid_slots": valid,
                "unique_rows": unique,
                "gather_bytes": gather,
                "auto_explain": _explain(shape, sets[0]),
            },
            before_record=gather_rate,
        )


def _train_calls(backend: str, shape: Any, s: Dict[str, Any]):
    """(forward+backward call, training-mode forward call) for one input set."""
    kw = _kwargs(shape, s)
    if backend == "cudnn":
        fb = functools.partial(cudnn_peer.sparse_attention_fwd_bwd, s["q"], s["kv"], s["indices"], s["dout"], **kw)
        fw = functools.partial(cudnn_peer.sparse_attention_fwd, s["q"], s["kv"], s["indices"], **kw)
        return fb, fw
    f = _forward(backend)
    q = s["q"].detach().requires_grad_()
    kv = s["kv"].detach().requires_grad_()
    kw["sink"] = s["sink"].detach().requires_grad_() if s["sink"] is not None else None
    leaves = (q, kv) + ((kw["sink"],) if kw["sink"] is not None else ())
    indices, dout = s["indices"], s["dout"]

    def fwd():
        return f(q, kv, indices, **kw)

    def fwd_bwd():
        return torch.autograd.grad(fwd(), leaves, dout)

    return fwd_bwd, fwd


@pytest.mark.parametrize("shape,backend", _cases(backward=True))
def test_sparse_attention_fwd_bwd(benchmark, shape, backend):
    shape = harness.resolve(shape)
    backends.skip_unless_runnable(backend, shape)
    dev = harness.device()
    sets = inputs.sparse_attention_sets(shape, dev, grad=True)
    pairs = [_train_calls(backend, shape, s) for s in sets]
    fwd_bwd = harness.Rotation([fb for fb, _ in pairs])
    fwd = harness.Rotation([fw for _, fw in pairs])

    valid, unique = _mean(sets, "valid_slots"), _mean(sets, "unique_rows")
    with_len = shape.half_valid
    args = (shape.T, shape.H, shape.D, shape.d_v, shape.K, unique)
    f_flops = counts.attn_fwd_flops(shape.H, shape.D, shape.d_v, valid)
    b_flops = counts.attn_bwd_flops(shape.H, shape.D, shape.d_v, valid)
    f_bytes = counts.attn_fwd_bytes(*args, with_length=with_len)
    b_bytes = counts.attn_bwd_bytes(*args, with_length=with_len)

    def split_backward(info: Dict[str, Any]) -> None:
        f = harness.time_ms(fwd, dev)
        bwd_ms = info["median_ms"] - f["median_ms"]
        info.update(
            fwd_ms=f["median_ms"],
            fwd_p20_ms=f["p20_ms"],
            fwd_p80_ms=f["p80_ms"],
            bwd_ms=bwd_ms,
            fwd_flops=f_flops,
            bwd_flops=b_flops,
            fwd_tflops=f_flops / (f["median_ms"] * 1e-3) / 1e12,
            bwd_tflops=(b_flops / (bwd_ms * 1e-3) / 1e12) if bwd_ms > 0 else None,
            bwd_gbps=(b_bytes / (bwd_ms * 1e-3) / 1e9) if bwd_ms > 0 else None,
            bwd_method="median(fwd+bwd) - median(training-mode fwd), both do_bench",
        )

    harness.run(
        benchmark,
        fwd_bwd,
        dev,
        op="sparse_attention.fwd_bwd",
        shape=shape,
        backend=backend,
        flops=f_flops + b_flops,
        nbytes=f_bytes + b_bytes,
        metric="tflops",
        sets=len(sets),
        label=backend,
        skip_on=backends.skip_on(backend),
        extra={"valid_slots": valid, "unique_rows": unique, "auto_explain": _explain(shape, sets[0])},
        before_record=split_backward,
    )
