"""Checks the GPU tests of several files share."""

from __future__ import annotations

from typing import Callable, Tuple

import torch


def assert_replays_without_sync(fn: Callable[[], Tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor) -> None:
    """``fn() -> (out, lse)`` runs once (it compiles outside what is checked),
    again with any host synchronisation an error, then under CUDA-graph
    capture; after new values in ``q`` the graph's replay equals a fresh
    call bit for bit (the capture kept no value of the first q)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = fn()
    q.copy_(torch.randn_like(q))
    graph.replay()
    out, lse = fn()
    torch.cuda.synchronize()
    assert torch.equal(g_out, out) and torch.equal(g_lse, lse)
