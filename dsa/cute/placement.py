"""The measured placement table: where the cute forward beats Triton.

``placement_sm90.json`` is written by ``bench/place_cute.py`` from timings on
one GPU, named in its ``device`` field (``torch.cuda.get_device_name()``):
one entry per shape of a training grid, each naming the faster backend
there.  A call is decided by the entry with the same dtype, D and tile
class (fewer than ``FULL_TILE_HEADS`` query heads per kv head: both passes
pad them to one tile, which costs what a full one does, so those shapes
rank apart) that is nearest in log2 of (query heads per kv head, K, T); a
call more than two octaves away from every entry in any of these has no
entry, and auto keeps Triton.  The script also measures a holdout grid
frozen before the timing (with sinks, topk_length and other N) and records
the table's regret on it; the table is only written when that regret is at
most 1.02 (geometric mean).

``placement_sm100.json`` and ``placement_sm100_bwd.json`` are the SM100
tables of the forward and the backward (none is measured yet: without one,
the SM100 tier upgrades every served shape whose self-check passed,
``dsa.cute.sm100``).

The table decides only on a GPU of the name it was measured on: the SM90
parts differ in SM count, clocks and memory bandwidth (an H20 has 78 SMs to
an H200's 132), so the ranking of two kernels does not carry over.  On any
other GPU, and when the file is unreadable (a warning names the file and the
error, once), there is no table and auto keeps Triton.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Tuple

import torch

from dsa._args import SparseAttnArgs

TABLE = os.path.join(os.path.dirname(__file__), "placement_sm90.json")
TABLE_BWD = os.path.join(os.path.dirname(__file__), "placement_sm90_bwd.json")  # the backward's
TABLE_SM100 = os.path.join(os.path.dirname(__file__), "placement_sm100.json")  # none measured yet
TABLE_SM100_BWD = os.path.join(os.path.dirname(__file__), "placement_sm100_bwd.json")  # none measured yet
MAX_OCTAVES = 2.0
FULL_TILE_HEADS = 64  # query heads per kv head below which a cute tile is padded


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


@dataclass(frozen=True)
class Table:
    """A placement table file as read: its entries and the GPU it was
    measured on, or why it could not be read (``problem``; no entries)."""

    path: str
    entries: Tuple[Entry, ...] = ()
    device: Optional[str] = None
    problem: Optional[str] = None


def dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def _parse(path: str) -> Table:
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        raise ValueError("no list of 'entries'")
    device = doc.get("device")
    if not isinstance(device, str):
        raise ValueError("no 'device' naming the GPU it was measured on")
    entries = []
    for e in doc["entries"]:
        if not isinstance(e, dict):
            raise ValueError(f"entry {e!r} is not an object")
        entry = Entry(**e)  # a missing or unknown field raises TypeError
        for name in ("D", "HG", "K", "T"):
            if not isinstance(getattr(entry, name), int) or getattr(entry, name) <= 0:
                raise ValueError(f"entry {e!r}: {name} is not a positive integer")
        if entry.backend not in ("cute", "triton") or not isinstance(entry.dtype, str):
            raise ValueError(f"entry {e!r}: backend or dtype malformed")
        entries.append(entry)
    return Table(path, tuple(entries), device)


def load(path: Optional[str] = None) -> Table:
    """The table at ``path`` (default: the shipped ``TABLE``), read once.
    Missing: no entries.  Unreadable or malformed: no entries, ``problem``
    says why, and a warning once."""
    return _load(path or TABLE)


@lru_cache(maxsize=None)
def _load(path: str) -> Table:
    if not os.path.exists(path):
        return Table(path)
    try:
        return _parse(path)
    except (OSError, ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        problem = f"{path}: {type(e).__name__}: {e}"
        warnings.warn(f"dsa: placement table unreadable, auto keeps Triton: {problem}", RuntimeWarning,
                      stacklevel=3)
        return Table(path, problem=problem)


def entries(path: Optional[str] = None) -> List[Entry]:
    """The table's entries ([] when it is missing or unreadable)."""
    return list(load(path).entries)


def unusable(device: torch.device, path: Optional[str] = None) -> Optional[str]:
    """Why the table at ``path`` cannot decide calls on ``device`` (None if it can)."""
    why = table_reason(device, path)
    return None if why is None else f"{why}; backend='cute' runs the kernel"


def table_reason(device: torch.device, path: Optional[str] = None) -> Optional[str]:
    """``unusable``'s reason without its advice: unreadable, missing, or
    measured on another GPU (None when the table decides on ``device``)."""
    table = load(path)
    if table.problem is not None:
        return f"placement table unreadable: {table.problem}"
    if not table.entries:
        return ("no placement table ships for this GPU (bench/place_cute.py writes one only when its "
                "holdout regret is <= 1.02)")
    name = torch.cuda.get_device_name(device)
    if name != table.device:
        return (f"placement table measured on {table.device}; this GPU is {name} "
                "(bench/place_cute.py measures one for it)")
    return None


def features(a: SparseAttnArgs) -> dict:
    return dict(dtype=dtype_name(a.q.dtype), D=a.D, HG=a.H // a.G, K=a.K, T=a.T)


def nearest(f: dict, table: List[Entry]) -> Optional[Entry]:
    best, best_d = None, math.inf
    padded = f["HG"] < FULL_TILE_HEADS
    for e in table:
        if (e.dtype, e.D) != (f["dtype"], f["D"]) or (e.HG < FULL_TILE_HEADS) != padded:
            continue
        gaps = [abs(math.log2(max(f[k], 1)) - math.log2(max(getattr(e, k), 1))) for k in ("HG", "K", "T")]
        if max(gaps) > MAX_OCTAVES:
            continue
        d = sum(gaps)
        if d < best_d:
            best, best_d = e, d
    return best


def lookup(a: SparseAttnArgs, path: Optional[str] = None) -> Optional[Entry]:
    return nearest(features(a), list(load(path).entries))
