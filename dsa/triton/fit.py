"""Tiles that fit the device: its limits, and the first ranked candidate that fits them.

Each Triton op module ranks its launch configurations, fastest first (the
first is the one measured best on an H200), and :func:`pick` takes the first
that fits the target GPU. A candidate fits when its tiles, compiled for the
target, need no more shared memory per block than the target offers: the
kernel is compiled once per (kernel, shape class, target), ahead of the launch,
through the same :class:`KernelSpec` the launch uses, so a launch never meets
Triton's ``OutOfResources``. When nothing fits, the op's ``supports`` check
declines with the reason (``auto`` then takes another backend).

A cheap estimate of a candidate's shared memory (the op module's own) gates
the compile: a candidate estimated over the limit is not compiled. On SM90
this is what kept today's choices (the estimate was the only check), and on
other targets it saves compiles; the compiled size has the last word.

The limits are a table keyed by compute capability, so tests and offline
tools can fit any target without a GPU; on a device, the driver's numbers
take precedence (:func:`device_target`). Registers are the same on every
target here (64K a multiprocessor, 255 a thread), so the warps and tiles
measured on the H200 keep their register budget; :func:`register_use`
reads what ptxas allocates and spills, for the offline tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Sequence, Tuple, TypeVar

import torch
import triton

C = TypeVar("C")

# Heads one program holds, bound by registers rather than shared memory, so
# stated here once for every target:
# * the indexer scores kernel puts (query, head) pairs on the MMA's N and
#   reduces the heads inside a thread: up to 256 heads;
# * the indexer training kernels (sparse logits, KL, every indexer backward)
#   and the attention target hold all of a row's heads as MMA rows, the
#   backward with its [heads, D_i] fp32 dq accumulator in registers: 128.
MAX_SCORE_HEADS = 256
MAX_ROW_HEADS = 128


@dataclass(frozen=True)
class DeviceLimits:
    """What one thread block may use on a GPU of this compute capability.

    smem_per_block: the opt-in maximum of shared memory per block, in bytes
    (``cudaDevAttrMaxSharedMemoryPerBlockOptin``). Registers: 64K 32-bit
    registers per SM and at most 255 a thread on every target here."""

    capability: int  # major * 10 + minor
    smem_per_block: int
    regs_per_block: int = 65536
    regs_per_thread: int = 255


# From NVIDIA's CUDA C++ Programming Guide (technical specifications per
# compute capability), as the driver reports them:
LIMITS: Dict[int, DeviceLimits] = {
    80: DeviceLimits(80, 166912),  # A100, A800, A30
    86: DeviceLimits(86, 101376),  # RTX 30xx, A10, A40, RTX A6000
    89: DeviceLimits(89, 101376),  # L4, L40S, RTX 40xx
    90: DeviceLimits(90, 232448),  # H100, H200, H20
    100: DeviceLimits(100, 232448),  # B200, GB200
    120: DeviceLimits(120, 101376),  # RTX 50xx, RTX PRO 6000 Blackwell
}


def limits_of(capability: int) -> DeviceLimits:
    """The table's limits for a capability; an unlisted one gets the nearest
    listed one below it (the smallest listed one below 80)."""
    if capability in LIMITS:
        return LIMITS[capability]
    lower = [c for c in LIMITS if c <= capability]
    base = LIMITS[max(lower)] if lower else LIMITS[min(LIMITS, key=lambda c: LIMITS[c].smem_per_block)]
    return DeviceLimits(capability, base.smem_per_block, base.regs_per_block, base.regs_per_thread)


@dataclass(frozen=True)
class Target:
    """A GPU to fit tiles to: its capability and limits."""

    capability: int
    limits: DeviceLimits

    @staticmethod
    def of(capability: int) -> "Target":
        return Target(capability, limits_of(capability))

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.capability, 32)


def device_target(t: torch.Tensor) -> Optional[Target]:
    """The target of ``t``'s CUDA device, with the driver's shared-memory limit;
    None off CUDA (the interpreter has no limits to fit)."""
    if t.device.type != "cuda" or torch.version.hip is not None:
        return None
    return _device_target(t.device.index if t.device.index is not None else torch.cuda.current_device())


_DEVICE_TARGETS: Dict[int, Target] = {}


def _device_target(index: int) -> Target:
    if index not in _DEVICE_TARGETS:
        major, minor = torch.cuda.get_device_capability(index)
        cap = major * 10 + minor
        props = triton.runtime.driver.active.utils.get_device_properties(index)
        base = limits_of(cap)
        limits = DeviceLimits(cap, int(props["max_shared_mem"]), base.regs_per_block, base.regs_per_thread)
        _DEVICE_TARGETS[index] = Target(cap, limits)
    return _DEVICE_TARGETS[index]


# ----------------------------------------------------------------------------
# What a launch compiles


def ptr(dtype: torch.dtype) -> str:
    """The signature type of a pointer to ``dtype``."""
    return "*" + {
        torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
        torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8",
    }[dtype]


@dataclass(frozen=True)
class KernelSpec:
    """One kernel at one configuration: what a launch passes besides the
    runtime arguments, and the runtime arguments' types for an offline compile.

    types: signature type by argument name for every non-constexpr argument
    (``ptr(dtype)``, "i32", "fp32"); arguments not named are "i32"."""

    fn: Any  # a triton.JITFunction
    types: Dict[str, str]
    constexprs: Dict[str, Any]
    num_warps: int
    num_stages: int
    options: Dict[str, Any] = field(default_factory=dict)  # e.g. maxnreg

    def launch_kwargs(self) -> Dict[str, Any]:
        return dict(self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages, **self.options)

    def key(self) -> Tuple:
        return (self.fn.__name__, tuple(sorted(self.types.items())), tuple(sorted(self.constexprs.items())),
                self.num_warps, self.num_stages, tuple(sorted(self.options.items())))


def _source(spec: KernelSpec):
    """The spec as Triton's ASTSource, pointers assumed 16-byte aligned as a
    launch on fresh torch tensors sees them."""
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, name in enumerate(spec.fn.arg_names):
        if name in spec.constexprs:
            continue
        sig[name] = spec.types.get(name, "i32")
        if sig[name].startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(spec.fn, sig, dict(spec.constexprs), attrs)


def _options(spec: KernelSpec) -> Dict[str, Any]:
    return dict(num_warps=spec.num_warps, num_stages=spec.num_stages, **spec.options)


def compile_for(spec: KernelSpec, target: Target):
    """The spec compiled for ``target`` down to the binary (no GPU needed)."""
    return triton.compile(_source(spec), target=target.gpu_target(), options=_options(spec))


def register_use(spec: KernelSpec, target: Target) -> Tuple[int, int, int]:
    """(shared bytes, registers a thread, bytes of spill stores) of the spec
    compiled for ``target``: a full compile (not memoized), the registers
    read from ptxas's own log, so no GPU is needed."""
    import contextlib
    import io
    import re

    from triton import knobs

    log = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True  # a cached binary has no log
        shared = compile_for(spec, target).metadata.shared
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    if regs is None:
        raise RuntimeError(f"no ptxas register report for {spec.fn.__name__}")
    return int(shared), int(regs.group(1)), int(spill.group(1)) if spill else 0


def _allocated_shared(spec: KernelSpec, target: Target) -> int:
    """Shared memory per block as the compiler allocates it, without lowering
    to LLVM, PTX and the binary (several times faster than compile_for): the
    TTIR and TTGIR stages, then the passes of Triton 3.6's ``make_llir`` up
    to the shared-memory allocation, whose result is the ``ttg.shared``
    attribute that the full compile reports as ``metadata.shared``."""
    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.nvidia.compiler import get_ptx_version_from_options
    from triton.compiler.compiler import make_backend

    src, gpu = _source(spec), target.gpu_target()
    backend = make_backend(gpu)
    options = backend.parse_options(_options(spec))
    stages: Dict[str, Any] = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(gpu, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    metadata = dict(target=gpu, **options.__dict__)
    module = stages["ttgir"](stages["ttir"](module, metadata), metadata)
    pm = ir.pass_manager(module.context)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    passes.ttgpuir.add_allocate_warp_groups(pm)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    ptx_version = get_ptx_version_from_options(options, gpu.arch)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, target.capability, ptx_version)
    pm.run(module, "fit")
    return int(module.get_int_attr("ttg.shared"))


_SHARED: Dict[Tuple, int] = {}


def shared_bytes(spec: KernelSpec, target: Target) -> int:
    """Shared memory per block of the spec compiled for ``target`` (memoized;
    through the full compile where the allocation alone cannot be run)."""
    key = (spec.key(), target.capability)
    if key not in _SHARED:
        try:
            _SHARED[key] = _allocated_shared(spec, target)
        except Exception:  # another Triton's pass layout: the full compile reports the same number
            _SHARED[key] = int(compile_for(spec, target).metadata.shared)
    return _SHARED[key]


_PICKED: Dict[Tuple, Tuple[Any, str]] = {}


def pick(
    candidates: Callable[[], Iterable[C]],
    spec_of: Callable[[C], KernelSpec],
    target: Optional[Target],
    key: Tuple,
    estimate: Optional[Callable[[C], int]] = None,
) -> Tuple[Optional[C], str]:
    """(the first of ``candidates()`` that fits ``target``, "") or (None, why not).

    ``key`` names the problem class the candidates and specs depend on (the
    choice is memoized under it and the target). Without a target (the
    interpreter) the first candidate is taken as is."""
    if target is None:
        return next(iter(candidates())), ""
    memo = (key, target.capability, target.limits.smem_per_block)
    if memo not in _PICKED:
        _PICKED[memo] = _first_fitting(list(candidates()), spec_of, target, estimate)
    return _PICKED[memo]


def _first_fitting(ranked, spec_of, target, estimate):
    limit = target.limits.smem_per_block
    smallest = None
    for cfg in ranked:
        if estimate is not None and estimate(cfg) > limit:
            continue
        need = shared_bytes(spec_of(cfg), target)
        if need <= limit:
            return cfg, ""
        smallest = need if smallest is None else min(smallest, need)
    name = spec_of(ranked[-1]).fn.__name__
    got = f"its smallest tiles need {smallest} B" if smallest is not None else "every tiling is estimated over it"
    return None, (f"triton: {name} does not fit sm_{target.capability}'s {limit} B of shared memory per block "
                  f"({got})")


def shrinking(cfg: C, knobs: Sequence[Tuple[str, int]]) -> Iterator[C]:
    """cfg, then each knob (field, floor) in turn stepped down to its floor,
    the earlier knobs staying at theirs: ``num_stages`` one at a time (fewer
    stages cost least), the tile sizes halved."""
    yield cfg
    for name, floor in knobs:
        while getattr(cfg, name) > floor:
            v = getattr(cfg, name)
            cfg = replace(cfg, **{name: v - 1 if name == "num_stages" else v // 2})
            yield cfg


def halvings(x: int, low: int) -> Iterable[int]:
    """x, x / 2, ... down to low (x itself when x <= low)."""
    yield x
    while x > low:
        x //= 2
        yield x
