"""Host-side helpers shared by the CuTe DSL ops (forward and backward).

* ``dsl_reason()``: whether the CuTe DSL imports, asked once per process.
* ``head_blocks(HG)`` / ``int32_reason(args)``: the tiles of a kv head's
  query heads, and whether an attention call's tiles, kv rows and K fit the
  kernels' int32 indices.
* ``arch_of(device)`` / ``arch_reason(device, what, arch)``: the tensors'
  GPU architecture, and whether it is the one a kernel is written for
  (``sm90_reason`` for SM90).
* ``compile_kernel(kernel, pointers, scalars)``: a kernel compiled for calls through
  TVM-FFI; a call passes ``address(tensor)`` for each pointer, Python
  numbers for the scalars and ``stream_handle(device)`` last, so no argument
  object is made per call (the DSL's own call path took ~100 µs a launch).
* ``cutlass_dtype``: the CuTe type of a q dtype.
* ``zero_row(device, dtype, D)``: the cached row of zeros that invalid slots
  gather (``dsa.cute.rules.slot_source``), per device, never made by a
  CUDA-graph capture.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

# (device, dtype, D) -> the zero row invalid slots read
_ZEROS: Dict[tuple, torch.Tensor] = {}


HEADS_PER_CTA = 64  # query heads of an attention tile: the M of one wgmma


def head_blocks(HG: int, block_h: int = HEADS_PER_CTA) -> int:
    """Tiles a kv head's ``HG`` query heads take: one padded tile below ``block_h``."""
    return max(1, HG // block_h)


def int32_reason(a) -> Optional[str]:
    """Why a sparse attention call's sizes overflow the cute kernels' int32
    indices (None if they fit): its tiles (T x kv heads x 64-head blocks, a
    kv head of fewer heads one padded tile), its kv rows (N x kv heads), K."""
    tiles = a.T * a.G * head_blocks(a.H // a.G)
    if tiles >= 2**31 or a.N * a.G >= 2**31 or a.K >= 2**31:
        return "T x H_kv x head blocks (the tiles), N x H_kv and K must fit in int32"
    return None


@functools.lru_cache(maxsize=1)
def dsl_reason() -> Optional[str]:
    """Why the CuTe DSL cannot be used in this process (None if it can).
    Asked once: a failed import is not retried on every call."""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"CuTe DSL (nvidia-cutlass-dsl) is not importable: {type(e).__name__}: {e}"
    try:
        import tvm_ffi  # noqa: F401
    except Exception as e:
        return (f"apache-tvm-ffi, through which the cute kernels are called, is not importable: "
                f"{type(e).__name__}: {e}")
    return None


# The compute capabilities each architecture's kernels are written for, and
# how a reason names it.
ARCHS: Dict[str, Tuple[Tuple[int, int], ...]] = {"sm90": ((9, 0),), "sm100": ((10, 0), (10, 3))}
_ARCH_NAMES = {"sm90": "SM90 (Hopper)", "sm100": "SM100 (Blackwell, capability 10.0 or 10.3)"}


def arch_of(device: torch.device) -> Optional[str]:
    """The architecture ("sm90", "sm100") of a CUDA device, None for any
    other device or GPU (and where this process has no CUDA to ask)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    cap = tuple(torch.cuda.get_device_capability(device))
    return next((name for name, caps in ARCHS.items() if cap in caps), None)


_NAMES: Dict[tuple, str] = {}


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name``, asked once per device: the key of the measured placements."""
    key = (device.type, device.index)
    if key not in _NAMES:
        _NAMES[key] = torch.cuda.get_device_name(device)
    return _NAMES[key]


def arch_reason(device: torch.device, what: str, arch: str) -> Optional[str]:
    """Why ``what`` (e.g. "the cute sparse attention kernel") cannot run on
    ``device``: not CUDA, or not of architecture ``arch`` (None when it is)."""
    if device.type != "cuda":
        return f"tensors are on '{device.type}'; the cute kernels need a CUDA GPU"
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) not in ARCHS[arch]:
        return f"{what} is written for {_ARCH_NAMES[arch]}; this GPU is SM{cap[0]}{cap[1]}"
    return None


def sm90_reason(device: torch.device, what: str) -> Optional[str]:
    """``arch_reason`` for SM90."""
    return arch_reason(device, what, "sm90")


def alignment_reason(a, names: Sequence[str]) -> Optional[str]:
    """Why a's tensors ``names`` cannot be read by 16-byte copies (None when
    each starts 16-byte aligned)."""
    for name in names:
        if getattr(a, name).data_ptr() % 16:
            return f"{name} is not 16-byte aligned"
    return None


def cutlass_dtype(dt: torch.dtype):
    """The CuTe DSL type of a 16-bit q dtype (None for any other dtype)."""
    import cutlass

    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}.get(dt)


def compile_kernel(kernel, pointers: Sequence[Tuple[object, int]], scalars: Sequence[object], options: str = ""):
    """``kernel`` (a CuTe DSL kernel object whose call takes pointers, then
    scalars, then the stream) compiled for calls through TVM-FFI.

    pointers: the (CuTe element type, assumed byte alignment) of each pointer
    argument; scalars: the CuTe type (``cutlass.Int32``, ``Int64``,
    ``Float32``) of each scalar.  The compiled function is called as
    ``fn(*addresses, *numbers, stream_handle(device))``: integer addresses
    (``address``), Python numbers, the integer stream handle.  Alignment is
    promised, not checked: each op's ``supports`` checks what it assumes.
    options: more ``cute.compile`` options (``--keep-ptx``)."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    # the addresses only carry types and alignments here
    ptrs = tuple(make_ptr(ty, align * 64, cute.AddressSpace.gmem, assumed_align=align) for ty, align in pointers)
    opts = " ".join(o for o in ("--enable-tvm-ffi", options) if o)
    return cute.compile(kernel, *ptrs, *(ty(0) for ty in scalars), cuda.CUstream(0), options=opts)


def address(t: torch.Tensor) -> int:
    """The pointer argument of a built kernel's call: t's address."""
    return t.data_ptr()


def stream_handle(device: torch.device) -> int:
    """The handle of torch's current stream on CUDA ``device`` (the last
    argument of a built kernel's call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._C._cuda_getCurrentRawStream(index)


def zero_row(device: torch.device, dtype: torch.dtype, D: int) -> torch.Tensor:
    """The source row of every invalid slot: gathering zeros keeps whatever
    is stored in unreferenced kv rows out of a tile.  Made once per (device,
    dtype, D) and kept for the process."""
    key = (device, dtype, D)
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = _zero_row(D, dtype, device)
    return z


def _zero_row(D: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A row of D zeros, never made by a CUDA-graph capture.

    Under capture an allocation on the capturing stream comes from the
    graph's private pool and its zero fill only runs at replay: every eager
    call before the first replay would read garbage from the row, and the
    row would be recycled with the graph.  So a row first needed during a
    capture is made outside it (``_outside_capture``)."""
    make = functools.partial(torch.zeros, D, dtype=dtype, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _outside_capture(make, device)
    return make()


def _outside_capture(make: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    """make() on a side stream that is not captured, the host waiting for it.

    The capture pool takes only allocations on streams of the capture, so
    the side stream's come from the ordinary pool and its kernels run at
    once.  Relaxed capture mode lets this thread do what global mode forbids
    while another stream captures (the allocator's cudaMalloc, the wait)."""
    with _relaxed_capture_mode():
        side = torch.cuda.Stream(device)
        with torch.cuda.stream(side):
            t = make()
        side.synchronize()
    return t


@contextlib.contextmanager
def _relaxed_capture_mode() -> Iterator[None]:
    import cuda.bindings.runtime as rt

    err, prev = rt.cudaThreadExchangeStreamCaptureMode(rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed)
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaThreadExchangeStreamCaptureMode: {err}")
    try:
        yield
    finally:
        rt.cudaThreadExchangeStreamCaptureMode(prev)
