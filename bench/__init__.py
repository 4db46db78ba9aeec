"""Benchmark suite of ``dsa`` (pytest-benchmark; see bench/README.md).

Run ``pytest bench/ --benchmark-only --benchmark-json=bench.json`` on a CUDA
machine, then ``python -m bench.plot bench.json -o bench.png``. On a machine
without CUDA every benchmark is skipped. This package is not part of the
installed library and is never run by CI (CI runs ``pytest tests``).
"""
