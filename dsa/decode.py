"""Sparse decode for serving: a few query rows a sequence against a paged, possibly FP8, KV cache.

    out = sparse_decode(q, kv_cache, indices, block_table=bt, seq_lens=lens, topk_length=n)

The computation is sparse attention's (docs/semantics.md, "Sparse decode"):
the same scores, sink and lse, on the rows that ``indices`` address in the
cache, dequantised when the cache is FP8 (:mod:`dsa.kv_cache`). The op is
``dsa::sparse_decode`` (:mod:`dsa.ops.decode`); the Triton backend splits each
row's slots over several programs when the rows alone would leave the GPU
idle, and merges the parts by their lse.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

from torch import Tensor

from dsa import _checks, ops

Backend = str  # "auto" | "reference" | "triton" | "cute"


def _decode(q, kv_cache, indices, block_table, seq_lens, topk_length, sink, sm_scale, d_v, cache_format,
            return_lse, backend):
    _checks.flag("return_lse", return_lse)
    _checks.backend_arg(backend)
    return _checks.sparse_decode_args(q, kv_cache, indices, block_table, seq_lens, topk_length, sink, sm_scale,
                                      d_v, cache_format)


def sparse_decode(
    q: Tensor, kv_cache: Tensor, indices: Tensor, *, block_table: Optional[Tensor] = None,
    seq_lens: Optional[Tensor] = None, topk_length: Optional[Tensor] = None, sink: Optional[Tensor] = None,
    sm_scale: Optional[float] = None, d_v: Optional[int] = None, cache_format: Optional[str] = None,
    return_lse: bool = False, backend: Backend = "auto",
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Sparse attention of a few query rows per sequence over a KV cache (forward only).

    q: [B, S_q, H, D] (S_q query rows of each of B sequences, e.g. 1, or 2-4
    with speculative decoding) or [T, H, D] (each row its own sequence);
    bf16 / fp16 (fp32 on the reference and Triton backends).

    kv_cache, by ``cache_format`` (None infers it from the dtype and the bytes a token):

    - ``"native"``, q's dtype: flat [N, D] or [N, H_kv, D], or paged
      [num_pages, page_size, H_kv, D];
    - ``"fp8_v32"`` (656 B a token, D = 576) or ``"fp8_model1"`` (584 B a
      token, D = 512): uint8 / int8 / float8_e4m3fn [num_pages, page_size,
      bytes] or [num_pages, page_size, 1, bytes], as written by
      :func:`dsa.quantize_kv_cache` (FlashMLA's layouts). Pages may be padded.

    indices: [B, S_q, K] / [T, K] (an H_kv axis before K for a native cache
    with H_kv > 1) int32 (int64 accepted). Without ``block_table`` an index is
    a row of a flat cache or the slot page * page_size + offset of a paged
    one (FlashMLA's convention); with ``block_table`` [B, max_pages] int32 it
    is a position within the row's sequence, whose slot is
    block_table[b, index // page_size] * page_size + index % page_size.
    ``seq_lens`` [B] (with a block table) makes positions >= seq_lens[b]
    invalid. Invalid slots (-1, out of range, past topk_length, a page
    outside the cache) are never read.

    topk_length: [B, S_q] or [B] (batched) / [T] (packed) int32; sink: [H]
    fp32; sm_scale defaults to 1/sqrt(D), d_v to min(D, 512).

    Returns out [..., H, d_v] in q's dtype and, with ``return_lse``, lse
    [..., H] fp32 (natural log, sink excluded, +inf on a row with no valid slot).
    """
    a, layout = _decode(q, kv_cache, indices, block_table, seq_lens, topk_length, sink, sm_scale, d_v, cache_format,
                        return_lse, backend)
    out, lse = ops.call(ops.sparse_decode, a, backend)
    out = layout.unpack(out)
    return (out, layout.unpack(lse)) if return_lse else out


# public name -> (the public function, its preparation, the ops it runs), for dsa.explain
EXPLAIN = {"sparse_decode": (sparse_decode, _decode, ("sparse_decode",))}
