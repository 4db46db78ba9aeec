"""The contract's rules that every backend's host code applies, stated once.

``docs/semantics.md`` is the contract; these are its pieces that host code
(the reference backend, the op layer, the Triton and CuTe launchers) needs:

* the accumulation dtype: fp32, or fp64 for fp64 inputs;
* ``LOG2E``: kernels work in base 2, so natural-log scales are multiplied by it;
* slot validity: slot j of a row is valid iff ``j < clamp(topk_length, 0, K)``
  and ``0 <= index < N``;
* paged slots (``decode_slots``): an index is a cache slot ``page * page_size
  + offset``, or with a block table a position within the sequence that the
  table turns into one; a page or position out of range is an invalid slot;
* the indexer's dense rows: the keys a packed query row sees
  (``j < clamp((q_offset + i + 1) // ratio, 0, S_k)`` when causal);
* empty calls: a problem with no rows, slots or keys is answered without a
  kernel (each argument dataclass of :mod:`dsa._args` has ``empty``);
* deterministic gradients: duplicate destinations are summed in a fixed
  order (``segment_sum``);
* the boolean environment flags (``env_flag``): 1/true/yes/on, 0/false/no/off.

Device code states the same rules once per tier: ``dsa/triton/rules.py`` and
``dsa/cute/rules.py``.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

LOG2E = 1.4426950408889634


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype results are accumulated and returned in: fp64 for fp64, else fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def row_lengths(topk_length: Optional[torch.Tensor], K: int) -> Optional[torch.Tensor]:
    """clamp(topk_length, 0, K) as int64, or None (every slot in range)."""
    return None if topk_length is None else topk_length.long().clamp(0, K)


def slot_validity(
    indices: torch.Tensor, topk_length: Optional[torch.Tensor], n: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """valid [R, ..., K] bool and the indices with invalid slots set to 0 (int64).

    indices [R, ..., K] int (any value), topk_length [R] or None, n the number
    of rows an index may address.
    """
    idx = indices.long()
    K = idx.shape[-1]
    valid = (idx >= 0) & (idx < n)
    length = row_lengths(topk_length, K)
    if length is not None:
        valid &= torch.arange(K, device=idx.device) < length.view(-1, *([1] * (idx.dim() - 1)))
    return valid, torch.where(valid, idx, 0)


def decode_slots(a) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(valid [T, G, K] bool, page [T, G, K] int64, offset [T, G, K] int64) of
    a :class:`dsa._args.SparseDecodeArgs`; page and offset are 0 where invalid.

    Without a block table an index is the slot page * page_size + offset of
    the cache. With one it is a position p of the row's sequence b: valid
    only if p < seq_lens[b] (when given) and p // page_size < W, and then the
    slot is block_table[b, p // page_size] * page_size + p % page_size, valid
    only if that page is in [0, P)."""
    T, PS = a.T, a.page_size
    length = a.topk_length
    if length is not None and a.len_div > 1:
        length = length.repeat_interleave(a.len_div)
    valid, pos = slot_validity(a.indices, length, a.N)
    if a.block_table is not None:
        seq = torch.arange(T, device=pos.device) // a.rows_per_seq
        if a.seq_lens is not None:
            valid &= pos < a.seq_lens.long()[seq].view(T, 1, 1)
        page = a.block_table.long()[seq.view(T, 1, 1), torch.where(valid, pos // PS, 0)]
        valid &= (page >= 0) & (page < a.num_pages)
    else:
        page = pos // PS
    pos = torch.where(valid, pos, 0)
    return valid, torch.where(valid, page, 0), pos % PS


def visible_keys(pos: torch.Tensor, ratio: int, s_k) -> torch.Tensor:
    """The indexer's causal rule: a query at absolute position ``pos - 1`` sees
    keys j < clamp(pos // ratio, 0, s_k). pos int64 (q_offset + i + 1); s_k an
    int or an int64 tensor broadcast with pos."""
    return torch.minimum(torch.div(pos, ratio, rounding_mode="floor").clamp_min(0), torch.as_tensor(s_k, device=pos.device))


def dense_rows(a) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per packed query row: (global row of its sequence's first key, number of visible keys), int32.

    ``a`` is an IndexerArgs or DenseTargetArgs; key j (local) of query row i is
    visible iff j < limit[i], the indexer's causal rule.
    """
    Tq = a.q.shape[0]
    dev = a.q.device
    lens_q = torch.diff(a.cu_seqlens_q).long()
    seq = torch.repeat_interleave(torch.arange(a.batch, device=dev), lens_q, output_size=Tq)
    local = torch.arange(Tq, device=dev) - a.cu_seqlens_q.long()[seq]
    s_k = torch.diff(a.cu_seqlens_k).long()[seq]
    if a.causal:
        pos = a.q_offsets.long()[seq] + local + 1
        limit = visible_keys(pos, a.ratio, s_k)
    else:
        limit = s_k
    return a.cu_seqlens_k.long()[seq].to(torch.int32), limit.to(torch.int32)


def segment_sum(index: torch.Tensor, src: torch.Tensor, n: int) -> torch.Tensor:
    """out[i] = sum of src[m] over the m with index[m] == i: [n, *src.shape[1:]] in src.dtype.

    Bitwise reproducible on every device, unlike ``index_add_`` on CUDA
    (atomics add in whatever order the threads arrive): the entries are
    sorted by destination (stably), and each destination's run is summed by a
    segmented scan whose additions are fixed by the sorted positions alone.
    No atomics and no value read back to the host. index [M] int in [0, n).
    """
    M = index.shape[0]
    out = src.new_zeros((n + 1,) + tuple(src.shape[1:]))  # row n takes what is not a run's end
    if M == 0:
        return out[:n]
    key, order = torch.sort(index.long(), stable=True)
    x = src[order]
    bcast = (-1,) + (1,) * (src.dim() - 1)
    step = 1
    while step < M:  # after this step x[m] sums the last min(2 * step, run) entries of its run up to m
        same = (key[step:] == key[:-step]).view(bcast)
        x = torch.cat([x[:step], x[step:] + torch.where(same, x[:-step], 0)])
        step *= 2
    last = torch.ones(M, dtype=torch.bool, device=key.device)
    last[:-1] = key[1:] != key[:-1]
    # one writer per real destination; the rows that are not a run's end all land in row n
    out.index_copy_(0, torch.where(last, key, n), x)
    return out[:n]


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def env_flag(name: str) -> bool:
    """A boolean environment variable: 1/true/yes/on set it, 0/false/no/off/empty
    (or unset) do not, in any case; anything else raises ValueError naming it."""
    value = os.environ.get(name, "")
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}: expected one of {_TRUE} (set) or {_FALSE} (not set), got {value!r}")
