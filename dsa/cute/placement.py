"""The measured placement table: where the cute forward beats Triton.

``placement_sm90.json`` is written by ``bench/place_cute.py`` from timings on
a Hopper GPU: one entry per shape of a training grid, each naming the faster
backend there.  A call is decided by the entry with the same dtype and D that
is nearest in log2 of (query heads per kv head, K, T); a call more than two
octaves away from every entry in any of these has no entry, and auto keeps
Triton.  The script also measures a holdout grid frozen before the timing
(with sinks, topk_length and other N) and records the table's regret on it;
the table is only written when that regret is at most 1.02 (geometric mean).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional

from dsa._args import SparseAttnArgs

TABLE = os.path.join(os.path.dirname(__file__), "placement_sm90.json")
MAX_OCTAVES = 2.0


@dataclass(frozen=True)
class Entry:
    dtype: str
    D: int
    HG: int
    K: int
    T: int
    backend: str
    cute_ms: float
    triton_ms: float

    def describe(self) -> str:
        return (f"'{self.dtype} D={self.D} H/G={self.HG} K={self.K} T={self.T}'"
                f" (cute {self.cute_ms:.3f} ms, triton {self.triton_ms:.3f} ms)")


def dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


@lru_cache(maxsize=1)
def entries(path: str = TABLE) -> List[Entry]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        table = json.load(f)
    return [Entry(**e) for e in table["entries"]]


def features(a: SparseAttnArgs) -> dict:
    return dict(dtype=dtype_name(a.q.dtype), D=a.D, HG=a.H // a.G, K=a.K, T=a.T)


def nearest(f: dict, table: List[Entry]) -> Optional[Entry]:
    best, best_d = None, math.inf
    for e in table:
        if (e.dtype, e.D) != (f["dtype"], f["D"]):
            continue
        gaps = [abs(math.log2(max(f[k], 1)) - math.log2(max(getattr(e, k), 1))) for k in ("HG", "K", "T")]
        if max(gaps) > MAX_OCTAVES:
            continue
        d = sum(gaps)
        if d < best_d:
            best, best_d = e, d
    return best


def lookup(a: SparseAttnArgs) -> Optional[Entry]:
    return nearest(features(a), entries())
