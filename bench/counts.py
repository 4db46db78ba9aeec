"""FLOP and byte counts behind the TFLOP/s and GB/s in ``extra_info``.

FLOPs count only useful work, on valid slots / visible pairs:

* sparse attention forward: ``2 * H * (D + d_v)`` per valid slot and query
  row (QK^T over D, PV over d_v), i.e. ``2*T*H*K*(D+d_v)`` when all are valid;
* sparse attention backward: ``2 * H * (3*D + 2*d_v)`` per valid slot
  (recomputed S, dP = dO V^T, dQ, dK, dV);
* indexer: ``2 * H_i * D_i`` per visible (query, key) pair (the head-weighted
  sum is not counted).

Bytes are the fewest a kernel must move through device memory: every input
read once (for sparse attention, each *distinct* referenced KV row once),
every output written once. ``gather_bytes`` is the KV traffic of reading each
valid slot's row once per query row, what a kernel without cross-row reuse
moves; it gives ``gather_gbps``.
"""

from __future__ import annotations


def attn_fwd_flops(H: int, D: int, d_v: int, valid_slots: float) -> float:
    """valid_slots: sum over query rows (and kv heads) of valid slots."""
    return 2.0 * H * (D + d_v) * valid_slots


def attn_bwd_flops(H: int, D: int, d_v: int, valid_slots: float) -> float:
    return 2.0 * H * (3 * D + 2 * d_v) * valid_slots


def attn_fwd_bytes(
    T: int, H: int, D: int, d_v: int, K: int, unique_rows: float, elem: int = 2, with_length: bool = False
) -> float:
    q = T * H * D * elem
    kv = unique_rows * D * elem
    idx = T * K * 4 + (T * 4 if with_length else 0)
    out = T * H * d_v * elem
    return float(q + kv + idx + out)


def attn_bwd_bytes(
    T: int, H: int, D: int, d_v: int, K: int, unique_rows: float, elem: int = 2, with_length: bool = False
) -> float:
    # reads q, kv rows, indices, out, dout, lse; writes dq, dkv rows
    q = 2 * T * H * D * elem  # q read, dq written
    kv = 2 * unique_rows * D * elem  # kv read, dkv written
    idx = T * K * 4 + (T * 4 if with_length else 0)
    o = 2 * T * H * d_v * elem  # out, dout
    lse = T * H * 4
    return float(q + kv + idx + o + lse)


def gather_bytes(D: int, valid_slots: float, elem: int = 2) -> float:
    return float(valid_slots * D * elem)


def visible_pairs(S_q: int, S_k: int, ratio: int, causal: bool, q_offset: int = 0) -> int:
    """Number of (query, key) pairs the indexer's causal rule lets through.

    Query i sees keys j < clamp((q_offset + i + 1) // ratio, 0, S_k).
    """
    if not causal:
        return S_q * S_k
    total = 0
    for i in range(S_q):  # S_q <= ~1e5 here: a plain loop is fast enough
        total += min(max((q_offset + i + 1) // ratio, 0), S_k)
    return total


def indexer_flops(H_i: int, D_i: int, pairs: float) -> float:
    return 2.0 * H_i * D_i * pairs


def indexer_bytes(S_q: int, S_k: int, H_i: int, D_i: int, elem: int = 2, w_elem: int = 4) -> float:
    return float(S_q * H_i * D_i * elem + S_k * D_i * elem + S_q * H_i * w_elem + S_q * S_k * 4)


def topk_bytes(rows: int, cols: int, k: int, with_lengths: bool = True) -> float:
    return float(rows * cols * 4 + rows * k * 4 + (rows * 4 if with_lengths else 0))


def indexer_topk_bytes(
    S_q: int, S_k: int, H_i: int, D_i: int, k: int, elem: int = 2, w_elem: int = 4
) -> float:
    return float(S_q * H_i * D_i * elem + S_k * D_i * elem + S_q * H_i * w_elem + S_q * k * 4 + S_q * 4)

