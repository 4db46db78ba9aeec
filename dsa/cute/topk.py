"""Host side of the CuTe DSL top-k (``dsa.cute.topk_sm90``,
``dsa.cute.topk_stream_sm90``): what it serves, its builds, and the call.

Two kernels: rows of up to ``RESIDENT_MAX`` keys go to the resident radix
select (``topk_sm90``: the row in shared memory, a build per ``BUCKETS``
entry, the smallest that holds S), longer rows to the streaming one
(``topk_stream_sm90``: the row read once, candidates in shared memory; any
S).  k up to ``K_MAX``.  Rows must start 16-byte aligned (fp32 S a multiple
of 4, 16-bit S of 8) for the vector loads.  Larger k and other layouts are
declined with the reason, and Triton serves them.  Builds are compiled once
per process and configuration.

Placement under ``backend="auto"``: ``PLACEMENT`` lists, per GPU name, the
row lengths S where the same process measured the cute kernel ahead of
Triton; elsewhere auto declines with the reason, and ``backend="cute"``
runs the kernel wherever it serves the call.
"""

from __future__ import annotations

import functools
from typing import Dict, Optional, Tuple

import torch

from dsa._args import TopkArgs
from dsa.cute.host import address, compile_kernel, device_name, sm90_reason, stream_handle

# (s_max, threads, min_blocks): the row lengths a build holds, the smallest
# first, its CTA size and launch bound.  H200, fp32, k 1024 / 2048, one
# process (bench/RESULTS.md C103): 4096 keys 256 threads at 6 CTAs an SM
# 0.0661 / 0.0694 ms (4096 rows) against 0.0665 / 0.0722 unbounded and
# 0.077-0.092 at 128 or 512 threads; 8192 keys 256 threads 0.1103 / 0.1084
# against 0.133 at 512; 16384 keys 512 threads 0.2228 / 0.2167 against
# 0.2397 / 0.2321 at 256 and 0.33 at 1024.
# Rows past RESIDENT_MAX stream; the longer buckets remain for tuning builds
# (``config(..., stream=False)``).
BUCKETS = ((4096, 256, 6), (8192, 256, 0), (16384, 512, 0), (32768, 512, 0), (49152, 512, 0))
RESIDENT_MAX = 8192
# The streaming build: threads a CTA, 4-key vectors a thread per round,
# launch bound (3 CTAs an SM, 80 registers).  H200, fp32, k 2048 / 1024, one
# process (bench/RESULTS.md C108), ms: 4096 x 16384 0.2069 / 0.1838 against
# the resident build's 0.2218 / 0.2166; 4096 x 8192 0.1585 / 0.1381 against
# 0.1100 / 0.1080 (the appends' loop, C111, took the streaming build to
# 0.2121 / 0.1780 at 4096 x 16384 in C112; the sample in shared memory, C114,
# to 0.2061 / 0.1772).  The sample's threshold at an 11-bit prefix edge,
# aiming at 1.25 k candidates (``coarse``, ``margin4`` 5: one digit pass a row
# fewer, and no second read of randn rows of 65536 keys in
# bench/sample_threshold_sim.py), C116, one process, ms, against the 22-bit
# threshold at 1.5 k: 65536^2 causal 4.004 / 4.136 (k 2048), 3.515 / 3.671
# (k 1024); 8192 x 32768 0.5174 / 0.5332, 0.4578 / 0.4791; 4096 x 16384
# 0.1888 / 0.2064, 0.1651 / 0.1764.  Two vectors a thread at 4 CTAs an SM,
# 128 threads at 4, no L2 prefetch, the 22-bit threshold at 1.25 k, a
# persistent grid or L2 warmed a wave of rows ahead were level or slower
# (C107-C108, C112-C113, C115).
STREAM = dict(threads=256, vectors=4, min_blocks=3, coarse=True, margin4=5)
K_MAX = 4096
K_BUCKETS = (1024, 2048, K_MAX)  # the output slots a build holds in shared memory
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# GPU name -> the (lo, hi) ranges of S (row length, columns) where the cute
# top-k measured faster than Triton, k 1024 and 2048, fp32.  H200 (C108, one
# process, ms, cute / Triton, k 2048 and k 1024): 4096 x 4096 0.0651 / 0.0819,
# 0.0695 / 0.0804; 4096 x 8192 0.1100 / 0.2539, 0.1080 / 0.2487; 4096 x 16384
# 0.2069 / 0.2535, 0.1838 / 0.2661; 8192 x 32768 0.5762 / 0.7417, 0.5096 /
# 0.6823; 32768^2 causal (row ends) 1.544 / 1.990, 1.375 / 1.778; 65536^2
# causal 4.494 / 6.708, 3.910 / 6.264; 4096 x 131072 (C112) 0.7543 / 1.2484,
# 0.7273 / 1.0672 (C114: 0.7407 / 1.2492, 0.7361 / 1.0680).  Longer rows are
# not measured yet.
PLACEMENT: Dict[str, Tuple[Tuple[int, int], ...]] = {"NVIDIA H200": ((4096, 131072),)}
NOT_MEASURED = "no measurement of the cute top-k on this GPU yet"


def bucket(S: int) -> Optional[Tuple[int, int, int]]:
    """(s_max, threads, min_blocks) of the build for rows of S keys (None: none holds them)."""
    return next((b for b in BUCKETS if S <= b[0]), None)


def supports(a: TopkArgs) -> Optional[str]:
    """Why the cute top-k does not serve ``a`` (None when it does)."""
    s = a.scores
    why = sm90_reason(s.device, "the cute top-k kernel")
    if why is not None:
        return why
    if s.dtype not in DTYPES:
        return f"the cute top-k takes fp32 / fp16 / bf16 scores, got {s.dtype}"
    S = s.shape[1]
    if a.topk > K_MAX:
        return f"the cute top-k takes k up to {K_MAX}, got {a.topk}"
    if (S * s.element_size()) % 16 or s.data_ptr() % 16:
        return "the cute top-k loads 16-byte vectors: rows must start 16-byte aligned (S * itemsize % 16 == 0)"
    return None


def k_bucket(k: int) -> int:
    """The output slots of the build for k."""
    return next(b for b in K_BUCKETS if k <= b)


def streams(S: int) -> bool:
    """Whether rows of S keys go to the streaming kernel."""
    return S > RESIDENT_MAX


def config(dtype: torch.dtype, S: int, k: int, has_end: bool, stream: Optional[bool] = None, **kw):
    """The build for rows of S keys (a ``TopkSm90Config``, or a
    ``TopkStreamSm90Config`` where ``stream``, by default ``streams(S)``);
    ``kw`` overrides its fields (tuning)."""
    import cutlass

    from dsa.cute.topk_sm90 import TopkSm90Config
    from dsa.cute.topk_stream_sm90 import TopkStreamSm90Config

    if streams(S) if stream is None else stream:
        fields = dict(STREAM, k_max=k_bucket(k), has_end=has_end)
        fields.update(kw)
        return TopkStreamSm90Config(_cute_dtype(dtype, cutlass), **fields)
    s_max, threads, min_blocks = bucket(S)
    fields = dict(s_max=s_max, k_max=k_bucket(k), has_end=has_end, threads=threads, min_blocks=min_blocks)
    fields.update(kw)
    return TopkSm90Config(_cute_dtype(dtype, cutlass), **fields)


def placement_reason(a: TopkArgs) -> Optional[str]:
    """Why auto leaves ``a`` to Triton (None where ``PLACEMENT`` names cute)."""
    ranges = PLACEMENT.get(device_name(a.scores.device))
    if ranges is None:
        return NOT_MEASURED
    S = a.scores.shape[1]
    if any(lo <= S <= hi for lo, hi in ranges):
        return None
    if S > max(hi for _, hi in ranges):
        return f"the cute top-k is not measured on this GPU for rows of {S} columns (ahead for S in {list(ranges)})"
    return f"Triton measured faster on this GPU for rows of {S} columns (cute ahead for S in {list(ranges)})"


def placed_note(a: TopkArgs) -> str:
    """The sentence explain() prints for a call auto sends to cute."""
    return f"measured faster than Triton on this GPU for rows of {a.scores.shape[1]} columns"


def _kernel(cfg):
    from dsa.cute.topk_sm90 import TopkSm90
    from dsa.cute.topk_stream_sm90 import TopkStreamSm90, TopkStreamSm90Config

    return TopkStreamSm90(cfg) if isinstance(cfg, TopkStreamSm90Config) else TopkSm90(cfg)


@functools.lru_cache(maxsize=None)
def _compiled(cfg, device_index: int):
    return compile_kernel(_kernel(cfg), _pointer_types(cfg.dtype), _scalar_types())


def _cute_dtype(dtype: torch.dtype, cutlass):
    return {torch.float32: cutlass.Float32, torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}[dtype]


def _pointer_types(dt):
    from cutlass import Int32

    # scores, ends, indices, lengths (alignments the kernel assumes of the bases)
    return ((dt, 16), (Int32, 4), (Int32, 4), (Int32, 4))


def _scalar_types():
    from cutlass import Int32

    return (Int32, Int32, Int32)  # R, S, k


@functools.lru_cache(maxsize=None)
def _shipped(dtype: torch.dtype, s_max: int, k_max: int, has_end: bool, device_index: int):
    """The compiled shipped build (``config``'s) of a bucket (s_max 0: the
    streaming build): a call looks it up without making a config."""
    return _compiled(config(dtype, s_max, k_max, has_end, stream=s_max == 0), device_index)


def launch(scores: torch.Tensor, k: int, indices: torch.Tensor, lengths: torch.Tensor,
           ends: Optional[torch.Tensor] = None, cfg=None) -> None:
    """Top-k of each row of ``scores`` [R, S] into ``indices`` [R, k] and
    ``lengths`` [R] (int32, contiguous); ``ends`` int32 [R] or None; ``cfg``
    another build than ``config``'s (tuning)."""
    R, S = scores.shape
    dev = scores.device
    index = dev.index if dev.index is not None else 0
    if cfg is None:
        fn = _shipped(scores.dtype, 0 if streams(S) else bucket(S)[0], k_bucket(k), ends is not None, index)
    else:
        fn = _compiled(cfg, index)
    a_idx = address(indices)
    fn(address(scores), a_idx if ends is None else address(ends), a_idx, address(lengths), R, S, k,
       stream_handle(dev))


def topk(a: TopkArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    """scores [R, S] -> (indices [R, k] int32, lengths [R] int32)."""
    R = a.scores.shape[0]
    indices = torch.empty((R, a.topk), dtype=torch.int32, device=a.scores.device)
    lengths = torch.empty((R,), dtype=torch.int32, device=a.scores.device)
    launch(a.scores, a.topk, indices, lengths, a.row_ends)
    return indices, lengths


def compile_offline(dtype: torch.dtype, S: int = 4096, k: int = 2048, has_end: bool = True,
                    options: str = "--keep-ptx", **kw):
    """Compile the build for rows of S keys without a GPU (``CUTE_DSL_ARCH=sm_90a``), for CI and inspection."""
    cfg = config(dtype, S, k, has_end, **kw)
    return compile_kernel(_kernel(cfg), _pointer_types(cfg.dtype), _scalar_types(), options)
