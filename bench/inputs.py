"""Fresh random input sets for each benchmark shape (never zeros).

Each shape gets ``n`` independent sets drawn on the benchmark device from a
generator seeded by the shape's name and the set number, so every backend and
every commit times the same data. Sets are cached for the next benchmark of
the same shape (backends of one shape run one after another), and only one
shape's sets are held at a time.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from bench import harness

_CACHE: Dict[Tuple[Any, ...], Any] = {}


def cached(key: Tuple[Any, ...], build: Callable[[], Any]) -> Any:
    if key not in _CACHE:
        _CACHE.clear()
        harness.free_memory()
        _CACHE[key] = build()
    return _CACHE[key]


def _generator(dev: torch.device, name: str, i: int) -> torch.Generator:
    g = torch.Generator(device=dev)
    g.manual_seed(zlib.crc32(f"{name}/{i}".encode()))
    return g


def _distinct_rows(T: int, N: int, K: int, g: torch.Generator, dev: torch.device) -> torch.Tensor:
    """[T, K] int32: K distinct rows of [0, N) per query row, ascending.

    Ascending is the order ``topk_indices`` returns, so the gather walks
    memory forward as it would in a model. Drawn in row chunks so the [rows, N]
    random keys stay under ~256 MiB.
    """
    out = torch.empty(T, K, dtype=torch.int32, device=dev)
    step = max(1, (64 << 20) // N)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        keys = torch.rand(t1 - t0, N, generator=g, device=dev)
        out[t0:t1] = keys.topk(K, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
    return out


def sparse_attention_sets(shape: Any, dev: torch.device, *, grad: bool) -> List[Dict[str, Any]]:
    """Sets of q [T,H,D], kv [N,D], indices [T,K], sink [H]?, topk_length [T]?, dout?"""
    dt = harness.dtype()
    set_bytes = (shape.T * shape.H * (shape.D + (shape.d_v if grad else 0)) + shape.N * shape.D) * 2
    n = harness.sets_that_fit(set_bytes)

    def build() -> List[Dict[str, Any]]:
        sets = []
        for i in range(n):
            g = _generator(dev, shape.name, i)
            s: Dict[str, Any] = {
                "q": torch.randn(shape.T, shape.H, shape.D, generator=g, device=dev, dtype=dt),
                "kv": torch.randn(shape.N, shape.D, generator=g, device=dev, dtype=dt),
                "indices": _distinct_rows(shape.T, shape.N, shape.K, g, dev),
                "sink": None,
                "topk_length": None,
            }
            if shape.sink:
                s["sink"] = torch.randn(shape.H, generator=g, device=dev, dtype=torch.float32)
            if shape.half_valid:
                s["topk_length"] = torch.randint(
                    0, shape.K + 1, (shape.T,), generator=g, device=dev, dtype=torch.int32
                )
            if grad:
                s["dout"] = torch.randn(shape.T, shape.H, shape.d_v, generator=g, device=dev, dtype=dt)
            s.update(_slot_stats(s["indices"], s["topk_length"], shape.N, shape.K))
            sets.append(s)
        return sets

    return cached(("sparse_attention", shape, grad, n, str(dev)), build)


def _slot_stats(indices: torch.Tensor, topk_length: Optional[torch.Tensor], N: int, K: int) -> Dict[str, float]:
    valid = (indices >= 0) & (indices < N)
    if topk_length is not None:
        slot = torch.arange(K, device=indices.device)
        valid &= slot[None, :] < topk_length.clamp(0, K)[:, None].to(slot.dtype)
    return {
        "valid_slots": float(valid.sum().item()),
        "unique_rows": float(torch.unique(indices[valid]).numel()),
    }


def indexer_sets(shape: Any, dev: torch.device) -> List[Dict[str, Any]]:
    """Sets of q [1,S_q,H_i,D_i] bf16, k [1,S_k,D_i] bf16, weights [1,S_q,H_i] fp32."""
    set_bytes = (shape.S_q * shape.H_i * shape.D_i + shape.S_k * shape.D_i) * 2 + shape.S_q * shape.H_i * 4
    n = harness.sets_that_fit(set_bytes)

    dt = harness.dtype()

    def build() -> List[Dict[str, Any]]:
        sets = []
        for i in range(n):
            g = _generator(dev, shape.name, i)
            q = torch.randn(1, shape.S_q, shape.H_i, shape.D_i, generator=g, device=dev, dtype=dt)
            k = torch.randn(1, shape.S_k, shape.D_i, generator=g, device=dev, dtype=dt)
            w = torch.randn(1, shape.S_q, shape.H_i, generator=g, device=dev, dtype=torch.float32)
            sets.append({"q": q, "k": k, "weights": w * shape.H_i**-0.5})
        return sets

    return cached(("indexer", shape, n, str(dev)), build)


def topk_sets(shape: Any, dev: torch.device) -> List[Dict[str, Any]]:
    """Sets of fp32 scores [rows, cols] ~ N(0, 1)."""
    n = harness.sets_that_fit(shape.rows * shape.cols * 4)

    def build() -> List[Dict[str, Any]]:
        return [
            {"scores": torch.randn(shape.rows, shape.cols, generator=_generator(dev, shape.name, i), device=dev)}
            for i in range(n)
        ]

    return cached(("topk", shape, n, str(dev)), build)
