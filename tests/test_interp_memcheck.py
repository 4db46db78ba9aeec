"""The interpreter's address check (interp_memcheck.py) finds accesses one
element out of range and nothing in range, with masks as bools or integers."""

from __future__ import annotations

import pytest
import torch

from conftest import INTERPRETING

pytestmark = pytest.mark.skipif(not INTERPRETING, reason="checks the Triton interpreter (CPU only)")

if INTERPRETING:
    import triton
    import triton.language as tl

    import interp_memcheck

    @triton.jit
    def _shift_kernel(src, dst, n, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
        # dst[o + SHIFT] = src[o] + 1 for o < n
        o = tl.arange(0, BLOCK)
        m = o < n
        tl.store(dst + o + SHIFT, tl.load(src + o, mask=m) + 1, mask=m)

    @triton.jit
    def _gather_kernel(src, idx, dst, BLOCK: tl.constexpr):
        # dst[o] = src[idx[o]], unmasked: idx decides the addresses read
        o = tl.arange(0, BLOCK)
        tl.store(dst + o, tl.load(src + tl.load(idx + o)))

    @triton.jit
    def _count_kernel(counts, bins, n, BLOCK: tl.constexpr):
        # counts[bins[o]] += 1 for o < n; the mask is an int32 tensor
        o = tl.arange(0, BLOCK)
        m = (o < n).to(tl.int32)
        tl.atomic_add(counts + tl.load(bins + o), 1, mask=m != 0)


def test_in_range_is_silent():
    src, dst = torch.arange(8.0), torch.zeros(9)
    _shift_kernel[(1,)](src, dst, 8, SHIFT=1, BLOCK=16)  # the last store lands on dst[8]
    assert interp_memcheck.take() == []
    assert torch.equal(dst[1:], src + 1)
    counts = torch.zeros(4, dtype=torch.int32)
    _count_kernel[(1,)](counts, torch.tensor([3, 0, 3, 1, 7, 7, 7, 7], dtype=torch.int32), 4, BLOCK=8)
    assert interp_memcheck.take() == []  # the masked-off bins (7) are never touched
    assert counts.tolist() == [1, 1, 0, 2]


def test_a_store_one_past_the_end():
    src, dst = torch.arange(8.0), torch.zeros(8)
    _shift_kernel[(1,)](src, dst, 8, SHIFT=1, BLOCK=16)
    (found,) = interp_memcheck.take()
    assert found.startswith("_shift_kernel: store of 1 element(s)")
    assert "0 bytes past the end of dst (32 bytes)" in found
    assert "_shift_kernel:" in found.split("; at ")[1]  # the kernel line that stored


def test_a_load_before_the_start():
    src, dst = torch.arange(8.0), torch.zeros(4)
    _gather_kernel[(1,)](src, torch.tensor([0, 7, -1, 3], dtype=torch.int32), dst, BLOCK=4)
    (found,) = interp_memcheck.take()
    assert found.startswith("_gather_kernel: load of 1 element(s)") and "4 bytes before src" in found


def test_an_atomic_out_of_range():
    counts = torch.zeros(4, dtype=torch.int32)
    _count_kernel[(1,)](counts, torch.tensor([3, 0, 4, 1], dtype=torch.int32), 4, BLOCK=4)
    (found,) = interp_memcheck.take()
    assert found.startswith("_count_kernel: atomic of 1 element(s)") and "past the end of counts" in found
