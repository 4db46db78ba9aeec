"""Ahead-of-time compilation of the CuTe DSL kernels for the CPU tests.

``ptx_counts("dsa.cute.sparse_attention:compile_offline", calls, needles,
"sm_90a", tmp_path)`` compiles each call in one fresh process with
``CUTE_DSL_ARCH`` set (the DSL reads it at import) and returns, per call
name, how often each needle occurs in the PTX, and under ``SERIALIZED``
whether ptxas serialised wgmma for lack of registers (remark C7512: no
spill shows it, and it costs a kernel 10% or more).  A call is ``(name,
args, kwargs)``; an argument "torch.<dtype>" stands for that torch dtype.  The
backward's builds go through
``"dsa.cute.sparse_attention_bwd:compile_offline_backward"`` the same way.
``compile_reports`` does the same and also returns what ptxas reported
(registers, spill stores and loads) and the dynamic shared memory the
launch asks for.  ``HAVE_DSL`` (the DSL imports), ``SM90`` (an SM90 GPU is
here), ``ROOT`` (the repository) and ``fake_launch`` (a host launcher run
without a GPU) are shared by the cute tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from typing import Dict, Iterable, Sequence, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    import cutlass  # noqa: F401

    HAVE_DSL = True
except Exception:  # not installed, or no usable install
    HAVE_DSL = False

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
SERIALIZED = "wgmma serialised (C7512)"  # ptx_counts' entry beside the needles

_SCRIPT = r"""
import importlib, json, os, sys, tempfile, torch
needles, calls, report = json.loads(sys.argv[1])
res = {}
for name, target, args, kwargs in calls:
    module, function = target.split(":")
    build = getattr(importlib.import_module(module), function)
    args = [getattr(torch, a[6:]) if isinstance(a, str) and a.startswith("torch.") else a for a in args]
    with tempfile.TemporaryFile(mode="w+") as err:
        # ptxas's report and remarks go to file descriptor 2: captured per compile
        kwargs = dict(kwargs, options="--keep-ptx remarks{ptx}")
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            compiled = build(*args, **kwargs)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        ptxas = err.read()
    ptx = compiled.artifacts.PTX
    if len(ptx) < 4096 and os.path.exists(ptx):  # with a dump directory: the file's path
        ptx = open(ptx).read()
    # per kernel: the text from one .entry to the next
    parts = ptx.split(".entry ")[1:]
    entries = {p_.split("(", 1)[0].strip(): {k: p_.count(k) for k in needles} for p_ in parts}
    res[name] = dict(needles={k: ptx.count(k) for k in needles}, entries=entries, ptxas=ptxas,
                     ir=str(compiled.ir_module) if report else "")
print("RESULT" + json.dumps(res))
"""


def _compile(calls: Sequence[Tuple[str, str, list, dict]], needles: Iterable[str], arch: str, tmp_path,
             report: bool) -> Dict[str, dict]:
    """Run the calls in one fresh process; fails the test with the compiler's
    stderr when a compile fails."""
    env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_DUMP_DIR=str(tmp_path), PYTHONPATH=ROOT)
    spec = json.dumps([list(needles), [list(c) for c in calls], report])
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, spec], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


def ptx_counts(target: str, calls: Sequence[Tuple[str, list, dict]], needles: Iterable[str], arch: str,
               tmp_path) -> Dict[str, Dict[str, int]]:
    """{call name: {needle: occurrences in its PTX, SERIALIZED: C7512 reported}}."""
    res = _compile([(name, target, args, kwargs) for name, args, kwargs in calls], needles, arch, tmp_path, False)
    return {name: dict(r["needles"], **{SERIALIZED: "C7512" in r["ptxas"]}) for name, r in res.items()}


def compile_reports(calls: Sequence[Tuple[str, str, list, dict]], needles: Iterable[str], arch: str,
                    tmp_path) -> Dict[str, dict]:
    """Each call ``(name, "module:function", args, kwargs)`` compiled in one
    fresh process -> {name: {"needles": {needle: count in the PTX},
    "entries": {kernel: {needle: count in its PTX}}, "spill_stores",
    "spill_loads", "registers": ptxas's figures, "wgmma_serialized":
    remark C7512 (``SERIALIZED``), "smem": the launch's
    dynamic shared memory in bytes, "smem_limit": the most the DSL lets the
    arch launch with, "kernels": how many it compiled}}.  A host
    function that launches several kernels reports the most registers and
    shared memory any of them takes and the spills of all.  A function takes
    an ``options`` keyword (the DSL's compile options)."""
    out = {}
    for name, r in _compile(calls, needles, arch, tmp_path, True).items():
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r["ptxas"])
        regs = re.findall(r"Used (\d+) registers", r["ptxas"])
        assert spills and regs, f"{name}: no ptxas report in {r['ptxas'][-2000:]!r}"
        limit = re.search(r"Max: (\d+) bytes", r["ir"])
        assert limit, f"{name}: the launch's shared-memory limit not found in the host IR"
        out[name] = dict(needles=r["needles"], entries=r["entries"], spill_stores=sum(int(a) for a, _ in spills),
                         spill_loads=sum(int(b) for _, b in spills), registers=max(int(x) for x in regs),
                         wgmma_serialized="C7512" in r["ptxas"],
                         kernels=len(regs), smem=max(_launch_smem(name, r["ir"])), smem_limit=int(limit.group(1)))
    return out


def _launch_smem(name: str, ir: str) -> list:
    """The dynamic shared memory each launch of the host function stores
    into its launch config (field 2, i64, of the struct cudaLaunchKernelEx
    takes)."""
    config = r"!llvm.struct<\(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32\)>"
    fields = re.findall(r"(%\d+) = llvm.getelementptr %\d+\[0, 2\] : \(!llvm.ptr\) -> !llvm.ptr, " + config, ir)
    assert fields, f"{name}: no launch config in the host IR"
    sizes = []
    for f in fields:
        value = re.search(r"llvm.store (%\d+), " + f + r" : i64", ir)
        const = value and re.search(re.escape(value.group(1)) + r" = llvm.mlir.constant\((\d+) : i64\)", ir)
        assert const, f"{name}: a launch's shared memory is not a constant in the host IR"
        sizes.append(int(const.group(1)))
    return sizes


def fake_launch(monkeypatch, module, D: int):
    """Run ``module``'s launcher (a cute host module) without a GPU: its
    pointer arguments are the tensors themselves (not their addresses), its compiled kernel records its
    arguments, and the device scope, the zero row (a [D] tensor of zeros)
    and the stream it takes are recorded.  Returns (events, launches, the
    zero row)."""
    events, launches = [], []
    zero = torch.zeros(D)

    @contextlib.contextmanager
    def device(d):
        events.append(("enter", d))
        yield
        events.append(("exit", d))

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(module, "zero_row", lambda d, dt, D: events.append(("zero_row", d, dt, D)) or zero)
    monkeypatch.setattr(module, "address", lambda t: t)
    monkeypatch.setattr(module, "stream_handle", lambda d: events.append(("stream", d)) or "stream")
    monkeypatch.setattr(module, "_compiled", lambda *a: lambda *x: launches.append(x))
    return events, launches, zero
