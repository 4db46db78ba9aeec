"""The fused indexer top-k on SM90 with the cute top-k (``backend="cute"``).

``dsa.triton.indexer``'s scores kernel writes the score rows chunk by chunk
(extra memory O(S_q * k), as the Triton op), and ``dsa.cute.topk`` selects
each chunk's rows up to their window ends: the resident radix select for
rows of up to ``RESIDENT_MAX`` keys, the streaming one above.  The scores
are the Triton op's, and both top-k kernels are exact, so the result is the
Triton op's bit for bit.  k above the cute top-k's ``K_MAX`` selects with
Triton's top-k (the op's choice of backend cannot see k; ``placed_note``
and ``NOTE`` say so).

Placement under auto: ``PLACEMENT`` lists, per GPU name, the ranges of
max_seqlen_k where the same process measured this path ahead of the Triton
op (bench/topk_peers.py --indexer).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from dsa._args import IndexerArgs
from dsa.cute import topk as ct
from dsa.cute.host import device_name, sm90_reason

# H200 (bench/RESULTS.md C109, one process, H_i 64, D_i 128, causal, ms, this
# path / the Triton op / cuDNN's two steps): 32768 / 32768 ratio 1 k 2048
# 18.115 / 18.920 / 20.404; 65536 / 16384 ratio 4 k 1024 18.668 / 18.998 /
# 20.777; 65536 / 65536 k 2048 71.533 / 74.279 / 81.922; 131072 / 32768 ratio
# 4 k 1024 72.874 / 74.513 / 81.725.
PLACEMENT: Dict[str, Tuple[Tuple[int, int], ...]] = {"NVIDIA H200": ((16384, 65536),)}
NOT_MEASURED = "no measurement of the cute indexer top-k on this GPU yet"
NOTE = f"Triton's scores chunk by chunk, the cute top-k (k above {ct.K_MAX}: Triton's)"


def supports(a: IndexerArgs) -> Optional[str]:
    """Why this path does not serve ``a`` (None when it does)."""
    why = sm90_reason(a.q.device, "the cute top-k kernel")
    if why is not None:
        return why
    from dsa.triton import indexer as ti

    why = ti.supports(a)
    if why is not None:
        return why
    if a.max_seqlen_k % 4:
        return ("the cute top-k loads 16-byte vectors: the fp32 score rows (max_seqlen_k columns) "
                f"must be a multiple of 4 long, got {a.max_seqlen_k}")
    return None


def placement_reason(a: IndexerArgs) -> Optional[str]:
    """Why auto leaves ``a`` to the Triton op (None where ``PLACEMENT`` names this path)."""
    ranges = PLACEMENT.get(device_name(a.q.device))
    if ranges is None:
        return NOT_MEASURED
    S = a.max_seqlen_k
    if any(lo <= S <= hi for lo, hi in ranges):
        return None
    return f"the Triton op measured faster or not measured on this GPU at max_seqlen_k {S} (cute: {list(ranges)})"


def placed_note(a: IndexerArgs) -> str:
    """The sentence explain() prints for a call auto sends here."""
    return f"{NOTE}: measured faster than the Triton op on this GPU at max_seqlen_k {a.max_seqlen_k}"


def indexer_topk(a: IndexerArgs, topk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """-> (indices [Tq, topk] int32 local key positions, -1 padded; lengths [Tq] int32)."""
    from dsa.triton import indexer as ti

    return ti.indexer_topk(a, topk, launch_topk=ct.launch if topk <= ct.K_MAX else None)


indexer_topk.note = NOTE  # what explain() prints when backend="cute" names this path
