"""The one registry of named benchmark shapes.

Every benchmark in this folder takes its problem sizes from here, so a shape
has one name across ops, backends, JSON files and plots. Sizes follow
the shape table of docs/semantics.md (V3.2, V4-pro, V4-flash, GLM-style
H64/D576):

* sparse attention, packed MQA layout: q [T, H, D], kv [N, D],
  indices [T, K] (distinct random rows of kv, ascending, as ``topk_indices``
  returns them), ``topk_length`` [T] only for the half-valid variant;
* indexer, batched layout with B = 1: q [1, S_q, H_i, D_i], k [1, S_k, D_i],
  weights [1, S_q, H_i] fp32, causal with ``ratio``;
* top-k: fp32 scores [rows, cols];
* indexer_topk: the indexer shapes plus ``topk``.

All inputs are bf16 (weights and sink fp32). ``reference`` marks the shapes
where the ``reference`` backend is timed too (it is plain chunked PyTorch in
fp32 arithmetic: too slow for the large shapes; ``V3.2-T512`` is the reduced
case that gives it a forward+backward; set ``DSA_BENCH_REFERENCE=1`` to time
it everywhere). ``smoke()`` gives a tiny shape with the same flags, used only
by the private CPU smoke mode (``DSA_BENCH_SMOKE=1``, see conftest.py; fp32
there, since the Triton interpreter computes bf16 wrongly).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Tuple


@dataclass(frozen=True)
class AttnShape:
    """Sparse attention: T query rows of H heads over an N-row latent KV."""

    name: str
    T: int
    N: int
    H: int
    D: int
    d_v: int
    K: int
    sink: bool = False
    half_valid: bool = False  # topk_length[t] ~ uniform integer in [0, K]
    backward: bool = True  # also benchmark forward+backward (not for decode)
    reference: bool = False

    def smoke(self) -> "AttnShape":
        # Multiples of 16 (what tensor-core tiles need); D > d_v kept when it holds.
        d = 48 if self.D > self.d_v else 32
        return dataclasses.replace(self, T=6, N=64, H=4, D=d, d_v=32, K=16)

    @property
    def params(self) -> Dict[str, object]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class IndexerShape:
    """Lightning indexer: S_q queries of H_i heads against S_k shared keys."""

    name: str
    S_q: int
    S_k: int
    H_i: int = 64
    D_i: int = 128
    ratio: int = 1
    causal: bool = True
    topk: int = 0  # > 0 only for indexer_topk shapes
    reference: bool = False

    def smoke(self) -> "IndexerShape":
        s_k = 32
        return dataclasses.replace(
            self, S_q=s_k * self.ratio, S_k=s_k, H_i=4, D_i=16, topk=8 if self.topk else 0
        )

    @property
    def score_matrix_bytes(self) -> int:
        """Bytes of the dense fp32 [S_q, S_k] score matrix (what indexer_topk avoids)."""
        return self.S_q * self.S_k * 4

    @property
    def params(self) -> Dict[str, object]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class TopkShape:
    """Top-k over the last dim of fp32 scores [rows, cols]."""

    name: str
    rows: int
    cols: int
    k: int
    reference: bool = False

    def smoke(self) -> "TopkShape":
        return dataclasses.replace(self, rows=8, cols=64, k=8)

    @property
    def params(self) -> Dict[str, object]:
        return dataclasses.asdict(self)


# --- sparse attention ---------------------------------------------------------

SPARSE_ATTENTION: Tuple[AttnShape, ...] = (
    AttnShape("V3.2", T=4096, N=8192, H=128, D=576, d_v=512, K=2048),
    AttnShape("V4-pro", T=8192, N=8192, H=128, D=512, d_v=512, K=1152, sink=True),
    AttnShape("V4-flash", T=8192, N=8192, H=64, D=512, d_v=512, K=640, sink=True),
    AttnShape("H64-D576-K2048", T=4096, N=8192, H=64, D=576, d_v=512, K=2048),
    AttnShape("V3.2-half", T=4096, N=8192, H=128, D=576, d_v=512, K=2048, half_valid=True),
    # V3.2 over 8 GPUs of tensor parallelism: 16 query heads per GPU.
    AttnShape("V3.2-TP16", T=4096, N=8192, H=16, D=576, d_v=512, K=2048),
    # A reduced V3.2 (T=512) where the reference backend's forward+backward fits in time.
    AttnShape("V3.2-T512", T=512, N=8192, H=128, D=576, d_v=512, K=2048, reference=True),
    # Decode: 128 sequences x 1 query token, gathering from a 65536-row KV pool.
    AttnShape(
        "decode-B128",
        T=128,
        N=65536,
        H=128,
        D=576,
        d_v=512,
        K=2048,
        backward=False,
        reference=True,
    ),
)

# --- indexer ------------------------------------------------------------------

INDEXER: Tuple[IndexerShape, ...] = (
    IndexerShape("S4096-r1", S_q=4096, S_k=4096, ratio=1, reference=True),
    IndexerShape("S16384-r1", S_q=16384, S_k=16384, ratio=1),
    IndexerShape("Sq16384-Sk4096-r4", S_q=16384, S_k=4096, ratio=4),
)

# --- top-k --------------------------------------------------------------------

TOPK: Tuple[TopkShape, ...] = (
    TopkShape("4096x4096-k2048", rows=4096, cols=4096, k=2048, reference=True),
    TopkShape("4096x16384-k2048", rows=4096, cols=16384, k=2048),
)

# --- fused indexer + top-k ----------------------------------------------------
# Ratio 4 is V4's compressed KV, so topk is V4-pro's indexer top-k (1024).
# The 131072 x 32768 shape's dense score matrix would be 16 GiB: no backend or
# peer may allocate one, and the benchmark records the peak extra memory.

INDEXER_TOPK: Tuple[IndexerShape, ...] = (
    IndexerShape("Sq16384-Sk4096-r4-k1024", S_q=16384, S_k=4096, ratio=4, topk=1024, reference=True),
    IndexerShape("Sq131072-Sk32768-r4-k1024", S_q=131072, S_k=32768, ratio=4, topk=1024),
)

REGISTRY: Dict[str, Tuple[object, ...]] = {
    "sparse_attention": SPARSE_ATTENTION,
    "indexer_scores": INDEXER,
    "topk_indices": TOPK,
    "indexer_topk": INDEXER_TOPK,
}


def all_shapes() -> List[Tuple[str, object]]:
    """(op, shape) for every registered shape, in registry order."""
    return [(op, s) for op, shapes in REGISTRY.items() for s in shapes]


def _check_unique_names() -> None:
    for op, shapes in REGISTRY.items():
        names = [s.name for s in shapes]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"bench/shapes.py: duplicate {op} shape names {sorted(dup)}")


_check_unique_names()
