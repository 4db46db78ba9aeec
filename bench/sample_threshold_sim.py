"""The streaming cute top-k's sampled threshold, simulated on the CPU.

    python bench/sample_threshold_sim.py [--rows 200]

For randn rows of L fp32 scores, the threshold ``dsa.cute.topk_stream_sm90``
takes from its sample (256 threads, one 4-key vector each, spread over the
row; the rank ``margin4 * 256 * k / L`` of the sampled order keys, rounded
down to its 22-bit prefix, or to its 11-bit prefix with ``coarse``), and
what follows from it: the candidates the stream keeps (the row's keys at or
above it) and the share of rows read a second time (fewer than k
candidates). No GPU: the kernel's arithmetic on the same keys.
"""

from __future__ import annotations

import argparse

import numpy as np

THREADS = 256


def order_keys(x: np.ndarray) -> np.ndarray:
    """The kernel's signed order keys of fp32 scores (no NaN or -inf here)."""
    b = x.astype(np.float32).view(np.int32)
    return np.where(b < 0, b ^ 0x7FFFFFFF, b)


def threshold(keys: np.ndarray, k: int, margin4: int, coarse: bool) -> int:
    """The sampled threshold of one row's order keys."""
    L = keys.size
    step = (L // 4) // THREADS * 4
    cols = (np.arange(THREADS) * step)[:, None] + np.arange(4)[None, :]
    sample = np.sort(keys[cols.ravel()])[::-1]
    rank = max(-(-(margin4 * THREADS * k) // L), 1)
    shift = 21 if coarse else 10
    return int(sample[min(rank, sample.size) - 1]) >> shift << shift


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print("k, L, threshold, margin4: candidates mean / p95, rows read twice")
    for k in (2048, 1024):
        for L in (8192, 16384, 32768, 65536):
            rows = [order_keys(rng.standard_normal(L)) for _ in range(args.rows)]
            for coarse in (False, True):
                for margin4 in (4, 5, 6):
                    n = np.array([(r >= threshold(r, k, margin4, coarse)).sum() for r in rows])
                    print(f"k {k} L {L:6d} {'coarse' if coarse else 'fine  '} margin4 {margin4}: "
                          f"{n.mean():6.0f} / {np.percentile(n, 95):6.0f}, {(n < k).mean():.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
