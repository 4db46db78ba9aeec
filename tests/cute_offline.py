"""Ahead-of-time compilation of the CuTe DSL kernels for the CPU tests.

``ptx_counts("dsa.cute.sparse_attention:compile_offline", calls, needles,
"sm_90a", tmp_path)`` compiles each call in one fresh process with
``CUTE_DSL_ARCH`` set (the DSL reads it at import) and returns, per call
name, how often each needle occurs in the PTX.  A call is ``(name, args,
kwargs)``; an argument "torch.<dtype>" stands for that torch dtype.  The
backward's builds go through
``"dsa.cute.sparse_attention_bwd:compile_offline_backward"`` the same way.
``HAVE_DSL`` (the DSL imports), ``SM90`` (an SM90 GPU is here) and ``ROOT``
(the repository) are shared by the cute tests.
"""

from __future__ import annotations

import json
import os
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

_SCRIPT = r"""
import importlib, json, os, sys, torch
target, needles, calls = json.loads(sys.argv[1])
module, function = target.split(":")
build = getattr(importlib.import_module(module), function)
res = {}
for name, args, kwargs in calls:
    args = [getattr(torch, a[6:]) if isinstance(a, str) and a.startswith("torch.") else a for a in args]
    ptx = build(*args, **kwargs).artifacts.PTX
    if len(ptx) < 4096 and os.path.exists(ptx):  # with a dump directory: the file's path
        ptx = open(ptx).read()
    res[name] = {k: ptx.count(k) for k in needles}
print("RESULT" + json.dumps(res))
"""


def ptx_counts(target: str, calls: Sequence[Tuple[str, list, dict]], needles: Iterable[str], arch: str,
               tmp_path) -> Dict[str, Dict[str, int]]:
    """{call name: {needle: occurrences in its PTX}}; fails the test with the
    compiler's stderr when the compile fails."""
    env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_DUMP_DIR=str(tmp_path), PYTHONPATH=ROOT)
    spec = json.dumps([target, list(needles), [list(c) for c in calls]])
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, spec], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])
