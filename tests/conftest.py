"""Shared test configuration for the dsa test suite.

* On a machine without CUDA, ``TRITON_INTERPRET=1`` is set here, at import
  time and before anything imports triton, so the Triton kernels run under
  the interpreter on CPU tensors (that is how CI tests them).
* torch.compile's caches go to a fresh directory for the session.
* The ``gpu`` marker tags tests that need CUDA; they are skipped when
  ``torch.cuda`` is unavailable.
* ``case`` parametrises a test over (device, backend, dtype): on CPU the
  backends are ``reference`` (float64, float32, float16) and ``triton``
  (float32, float16; only when triton is importable and interpreting); on
  CUDA (gpu-marked) ``reference``, ``triton`` and ``cute`` in bfloat16 and
  float16. bf16 never runs on CPU: the interpreter computes it wrongly.
* ``call`` runs a dsa function and turns the one "this backend has no kernel
  for this op (yet)" ``ValueError`` into a skip; every other error fails.
"""

from __future__ import annotations

import importlib.util
import os
import re
import tempfile
from dataclasses import dataclass

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # Must happen before triton is imported anywhere (dsa imports it lazily).
    os.environ["TRITON_INTERPRET"] = "1"
# torch.compile's on-disk caches do not key on a custom op's schema: a graph
# compiled against an earlier dsa could be replayed. The session compiles afresh.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="dsa-tests-inductor-")

import pytest  # noqa: E402

TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class Case:
    """One (device, backend, dtype) combination a test runs under."""

    device: str
    backend: str
    dtype: torch.dtype

    @property
    def low_precision(self) -> bool:
        return self.dtype in (torch.float16, torch.bfloat16)

    @property
    def id(self) -> str:
        return f"{self.device}-{self.backend}-{str(self.dtype).replace('torch.', '')}"


def _cases(cpu_reference_dtypes, cpu_triton_dtypes, gpu_dtypes):
    params = []
    for dt in cpu_reference_dtypes:
        c = Case("cpu", "reference", dt)
        params.append(pytest.param(c, id=c.id))
    if not CUDA and TRITON_IMPORTABLE:
        for dt in cpu_triton_dtypes:
            c = Case("cpu", "triton", dt)
            params.append(pytest.param(c, id=c.id))
    for backend in ("reference", "triton", "cute"):
        for dt in gpu_dtypes:
            c = Case("cuda", backend, dt)
            params.append(pytest.param(c, id=c.id, marks=pytest.mark.gpu))
    return params


# Every backend and dtype the contract promises.
ALL_CASES = _cases(
    (torch.float64, torch.float32, torch.float16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.float16),
)
# One dtype per backend, for the (slow) gradient-heavy and edge-case tests.
FAST_CASES = _cases((torch.float64,), (torch.float32,), (torch.bfloat16,))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: the test needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason="CUDA is not available")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=ALL_CASES)
def case(request) -> Case:
    return request.param


@pytest.fixture(params=FAST_CASES)
def fast_case(request) -> Case:
    return request.param


def _cpu_backend_params():
    names = ["reference"]
    if not CUDA and TRITON_IMPORTABLE:
        names.append("triton")
    return names


@pytest.fixture(params=_cpu_backend_params())
def backend(request) -> str:
    """A backend that can serve CPU tensors in this environment."""
    return request.param


# The backend declined because its kernel for this op does not exist (yet),
# or (cute) it cannot run here at all. Only these become skips.
_TRITON_MISSING = re.compile(
    r"triton.*(no kernel|not (yet )?(available|implemented|installed)|missing|no module)",
    re.IGNORECASE | re.DOTALL,
)
_CUTE_CANNOT_RUN = re.compile(r"(backend )?'?cute'? cannot run", re.IGNORECASE)


def skip_if_unavailable(exc: ValueError) -> None:
    msg = str(exc)
    if _TRITON_MISSING.search(msg) or _CUTE_CANNOT_RUN.search(msg):
        pytest.skip(f"backend not available: {msg}")


def _call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        skip_if_unavailable(e)
        raise


@pytest.fixture
def call():
    """``call(fn, *args, **kw)``: run fn; a missing-kernel ValueError skips."""
    return _call


@pytest.fixture(autouse=True)
def _fresh_choices():
    """Each test starts without kept backend choices: tests fake what the
    key of a kept choice cannot see (an architecture, a placement table,
    a backend's hook), which never changes within a real process."""
    from dsa import selector

    selector.forget()
    yield


# Under the interpreter every kernel's loads, stores and atomics are checked
# against the storages of its tensor arguments (interp_memcheck.py): an
# access out of range fails the test that made it.
INTERPRETING = not CUDA and TRITON_IMPORTABLE
if INTERPRETING:
    import interp_memcheck

    interp_memcheck.install()


@pytest.fixture(autouse=True)
def _addresses_in_range():
    if not INTERPRETING:
        yield
        return
    interp_memcheck.take()
    yield
    found = interp_memcheck.take()
    if found:
        pytest.fail(interp_memcheck.report(found), pytrace=False)


@pytest.fixture
def torch_deterministic(request):
    """torch.use_deterministic_algorithms(on) for the test, then the setting as it was; on is the
    fixture's parameter when parametrized indirectly, else True."""
    on = getattr(request, "param", True)
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(on)
    yield on
    torch.use_deterministic_algorithms(was, warn_only=warn_only)

