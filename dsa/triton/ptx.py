"""Scattered stores that keep their operands' layout.

``tl.store`` to scattered addresses is given a layout of its own by Triton's
coalescing pass, so a value computed in another layout (the 4-keys-a-thread
layout of a vectorized load) is first converted through shared memory: a
round trip, barriers and registers. As ``tl.inline_asm_elementwise``, the
same predicated PTX store runs in the operands' layout. The helper takes
``ASM`` (``enabled(tensor)`` at launch) and is ``tl.store`` where PTX cannot
run: the interpreter's CPU tensors and ROCm. Both forms store the same
elements.

Not used for atomics: one ``red.global.add.f32`` per element of an MMA
accumulator made the indexer KL backward 1.9x slower than Triton's
vectorized atomics after the shared-memory conversion (bench/notes_indexer.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def enabled(t: torch.Tensor) -> bool:
    """Whether the helpers may emit PTX for kernels on ``t``'s device."""
    return t.is_cuda and torch.version.hip is None


@triton.jit
def store_i32(ptr, val, mask, ASM: tl.constexpr):
    """tl.store(ptr, val, mask=mask) for int32 ``val``."""
    if ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r,r", [ptr, val, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, val, mask=mask)

