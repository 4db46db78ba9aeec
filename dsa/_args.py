"""Canonical arguments handed to every backend.

The public API (``dsa/api.py``) checks user input once (``dsa/_checks.py``) and
reduces every layout to one canonical form, so a backend implements each op
exactly once:

* sparse attention: the packed layout with an explicit kv-head axis and
  global kv rows;
* indexer: the packed (varlen) layout with ``cu_seqlens``; the batched layout
  is the special case of equal-length sequences;
* top-k: a 2-D ``[R, S]`` score matrix.

Backends receive these dataclasses and may assume every tensor is contiguous
and on one device, and every size is non-zero (empty problems never reach a
backend).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch


@functools.lru_cache(maxsize=None)
def field_names(cls) -> tuple:
    """The field names of an argument dataclass, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(cls))


class Unsupported(Exception):
    """Raised by a backend's hook when it cannot serve a call; the message says why."""


class _SlotSizes:
    """The sizes of a problem over top-k slots: q [T, H, D], indices [T, ..., K]
    and N rows to address (each class says where N comes from)."""

    N: int

    @property
    def T(self) -> int:
        return self.q.shape[0]

    @property
    def H(self) -> int:
        return self.q.shape[1]

    @property
    def D(self) -> int:
        return self.q.shape[2]

    @property
    def K(self) -> int:
        return self.indices.shape[-1]

    @property
    def empty(self) -> bool:
        """No row, slot, key or head: answered without a kernel."""
        return self.T == 0 or self.K == 0 or self.N == 0 or self.H == 0


@dataclass(frozen=True)
class SparseAttnArgs(_SlotSizes):
    """Sparse attention (MLA in MQA/GQA form) in the canonical packed layout.

    q:           [T, H, D]   bf16 / fp16 / fp32
    kv:          [N, G, D]   same dtype as q; G = H_kv, H % G == 0
    indices:     [T, G, K]   int32, global rows of kv; any value allowed
                 (slot j is valid iff j < clamp(topk_length[t], 0, K) and
                 0 <= indices[t, g, j] < N)
    topk_length: [T] int32 or None (all K slots may be valid)
    sink:        [H] fp32 or None (None means no sink term)
    sm_scale:    softmax scale on q.k
    d_v:         V is kv[..., :d_v]; d_v <= D
    deterministic: backward must be bitwise reproducible
    """

    q: torch.Tensor
    kv: torch.Tensor
    indices: torch.Tensor
    topk_length: Optional[torch.Tensor]
    sink: Optional[torch.Tensor]
    sm_scale: float
    d_v: int
    deterministic: bool = False

    N = property(lambda self: self.kv.shape[0], doc="rows of kv")
    G = property(lambda self: self.kv.shape[1], doc="kv heads (H_kv)")

    def kernel_dtype_reason(self) -> Optional[str]:
        """Why the dtypes the kernels read directly (int32 indices and
        topk_length, fp32 sink) do not hold (None if they do)."""
        if self.indices.dtype != torch.int32:
            return f"indices dtype {self.indices.dtype} is not int32"
        if self.topk_length is not None and self.topk_length.dtype != torch.int32:
            return f"topk_length dtype {self.topk_length.dtype} is not int32"
        if self.sink is not None and self.sink.dtype != torch.float32:
            return f"sink dtype {self.sink.dtype} is not fp32"
        return None


@dataclass(frozen=True)
class SparseDecodeArgs(_SlotSizes):
    """Sparse decode over a (paged, possibly FP8) KV cache, canonical form.

    q:            [T, H, D]   bf16 / fp16 / fp32 (fp64 on the reference); T = B * rows_per_seq
    kv:           the cache, its last dims contiguous, any page stride:
                  ``native``: [P, page_size, G, D] in q's dtype (a flat cache
                  [N, G, D] is P = N pages of one row);
                  ``fp8_v32`` / ``fp8_model1``: uint8 [P, page_size, bytes]
                  (dsa.kv_cache), G = 1
    indices:      [T, G, K] int32; without block_table the cache slot
                  page * page_size + offset, with it the position within the
                  row's sequence; any value allowed (invalid slots are never read)
    topk_length:  [T] (per row) or [B] (per sequence, B = T / rows_per_seq) int32, or None
    block_table:  [B, W] int32 or None: page of logical page i of sequence b
    seq_lens:     [B] int32 or None (only with block_table): positions >= seq_lens[b] are invalid
    sink:         [H] fp32 or None
    sm_scale, d_v: as in SparseAttnArgs (V = the dequantised row's first d_v values)
    cache_format: "native", "fp8_v32" or "fp8_model1"
    rows_per_seq: query rows of a sequence (row t belongs to sequence t // rows_per_seq)

    Slot j of row t (sequence b) is valid iff j < clamp(topk_length, 0, K),
    0 <= indices[t, g, j] < N (N = P * page_size, or W * page_size with a
    block table) and, with a block table, indices < seq_lens[b] and the page
    block_table[b, indices // page_size] is in [0, P).
    """

    q: torch.Tensor
    kv: torch.Tensor
    indices: torch.Tensor
    topk_length: Optional[torch.Tensor]
    block_table: Optional[torch.Tensor]
    seq_lens: Optional[torch.Tensor]
    sink: Optional[torch.Tensor]
    sm_scale: float
    d_v: int
    cache_format: str
    rows_per_seq: int

    num_pages = property(lambda self: self.kv.shape[0], doc="pages of the cache (P)")
    page_size = property(lambda self: self.kv.shape[1], doc="tokens a page")
    G = property(lambda self: self.kv.shape[2] if self.kv.dim() == 4 else 1, doc="kv heads (H_kv)")

    @property
    def N(self) -> int:
        """How many slots an index may address."""
        pages = self.block_table.shape[1] if self.block_table is not None else self.num_pages
        return pages * self.page_size if self.num_pages else 0

    @property
    def len_div(self) -> int:
        """Rows sharing one topk_length entry: 1, or rows_per_seq for per-sequence lengths."""
        return 1 if self.topk_length is None else self.T // max(1, self.topk_length.shape[0])

    @functools.cached_property
    def shape_key(self) -> tuple:
        """Everything but the tensors' values that a backend's choice and launch depend on (hashable)."""
        return (self.q.dtype, self.q.device, self.T, self.H, self.D, self.kv.dtype, self.G, self.page_size, self.K,
                self.d_v, self.cache_format, self.indices.dtype, *(None if t is None else t.dtype for t in (
                    self.topk_length, self.block_table, self.seq_lens, self.sink)))

    def kernel_dtype_reason(self) -> Optional[str]:
        """Why the dtypes the kernels read directly do not hold (None if they do)."""
        for name in ("indices", "topk_length", "block_table", "seq_lens"):
            t = getattr(self, name)
            if t is not None and t.dtype != torch.int32:
                return f"{name} dtype {t.dtype} is not int32"
        if self.sink is not None and self.sink.dtype != torch.float32:
            return f"sink dtype {self.sink.dtype} is not fp32"
        return None


class _Sequences:
    """What the packed-sequence problems (indexer, dense target) share: the
    batch size and the empty rule; ``keys`` is each class's key tensor."""

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1

    @property
    def empty(self) -> bool:
        """No query row, key, column or head: answered without a kernel."""
        return self.q.shape[0] == 0 or self.keys.shape[0] == 0 or self.max_seqlen_k == 0 or self.q.shape[1] == 0


@dataclass(frozen=True)
class IndexerArgs(_Sequences):
    """Lightning indexer in the canonical packed layout.

    q:             [Tq, H_i, D_i]  bf16 / fp16 / fp32
    k:             [Tk, D_i]       same dtype as q (one key shared by all heads)
    weights:       [Tq, H_i]       bf16 / fp16 / fp32
    cu_seqlens_q:  [B+1] int32, cu_seqlens_q[-1] == Tq
    cu_seqlens_k:  [B+1] int32, cu_seqlens_k[-1] == Tk
    q_offsets:     [B] int64, absolute position of each sequence's first query
                   (clamped by the checks so that q_offsets + i + 1 cannot
                   overflow; the visible keys are those of the given value)
    max_seqlen_k:  columns of the score matrix (>= every sequence's S_k)
    ratio, causal, sm_scale: as in docs/semantics.md, "Indexer"

    Query i (local to sequence b) sees key j (local) iff j < S_k[b] and, when
    causal, j < clamp((q_offsets[b] + i + 1) // ratio, 0, S_k[b]).
    """

    q: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    q_offsets: torch.Tensor
    max_seqlen_k: int
    ratio: int
    causal: bool
    sm_scale: float

    keys = property(lambda self: self.k, doc="the key tensor")


@dataclass(frozen=True)
class TopkArgs:
    """Top-k over the last dim of a 2-D score matrix.

    scores:   [R, S] fp32 / bf16 / fp16, contiguous
    topk:     number of slots per row (may exceed S; the row is padded with -1)
    row_ends: [R] int32, contiguous, or None (whole rows): row r is its first
              clamp(row_ends[r], 0, S) scores, the rest counting as -inf
    """

    scores: torch.Tensor
    topk: int
    row_ends: Optional[torch.Tensor] = None

    @property
    def empty(self) -> bool:
        """No row, column or slot: answered without a kernel."""
        return self.scores.shape[0] == 0 or self.scores.shape[1] == 0 or self.topk == 0


@dataclass(frozen=True)
class SparseIndexerArgs(_SlotSizes):
    """The indexer on the top-k slots of sparse attention (indexer training).

    q:           [T, H_i, D_i]  bf16 / fp16 / fp32
    k:           [N, D_i]       same dtype as q (one key shared by all heads)
    weights:     [T, H_i]       bf16 / fp16 / fp32
    indices:     [T, K]         int32, global rows of k; any value allowed
                 (slot j is valid iff j < clamp(topk_length[t], 0, K) and
                 0 <= indices[t, j] < N, the rule of sparse attention)
    topk_length: [T] int32 or None (all K slots may be valid)
    sm_scale:    scale of the logits
    deterministic: the k gradient must be bitwise reproducible

    logits[t, j] = sm_scale * sum_h weights[t, h] * relu(q[t, h] . k[indices[t, j]])
    on valid slots, -inf elsewhere.
    """

    q: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor
    topk_length: Optional[torch.Tensor]
    sm_scale: float
    deterministic: bool = False

    N = property(lambda self: self.k.shape[0], doc="rows of k")


_DENSE_TARGET_DOC = """The dense attention target of the indexer's warm-up stage, packed.

    q:            [Tq, H, D]  bf16 / fp16 / fp32
    kv:           [Tk, D]     same dtype as q (MQA, no sink)
    cu_seqlens_q, cu_seqlens_k, q_offsets, max_seqlen_k, ratio, causal:
                  as in :class:`IndexerArgs` (the indexer's visibility rule)
    sm_scale:     softmax scale on q.kv

    target[i, j] = (1/H) sum_h softmax over visible j of sm_scale * q[i, h] . kv[j].
    """

# The indexer's fields with the main attention's kv in place of the key and
# no weights: its sequence fields are IndexerArgs' own, in the same order.
DenseTargetArgs = dataclasses.make_dataclass(
    "DenseTargetArgs",
    [("q", "torch.Tensor"), ("kv", "torch.Tensor")]
    + [(f.name, f.type) for f in dataclasses.fields(IndexerArgs) if f.name not in ("q", "k", "weights")],
    bases=(_Sequences,),
    frozen=True,
    namespace={"__module__": __name__, "__doc__": _DENSE_TARGET_DOC, "keys": property(lambda self: self.kv)},
)
