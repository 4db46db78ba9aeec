"""Plot a pytest-benchmark JSON of this suite: throughput per shape per backend.

    python -m bench.plot bench.json [-o bench.png] [--metric auto|tflops|gbps]

One panel per metric, side by side: TFLOP/s for compute-bound ops (sparse
attention, indexer, indexer_topk; forward+backward entries also yield a "bwd"
group from ``bwd_tflops``) and GB/s for memory-bound ones (top-k), as grouped
bars (one group per op and shape, one bar per backend), with the measured
device ceilings drawn as dashed horizontal lines. It also prints the numbers as a table.
Only the standard library is needed to read the JSON; matplotlib is imported
when the PNG is drawn, so the suite itself never needs it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

# Measured on the lent H200 (KINDS.md, 2026-10/11): an 8192^3 bf16 matmul on
# random data ran at 769-798 TFLOP/s; a device-to-device copy moved ~4.24 TB/s
# counting bytes read plus bytes written.
CEILING_TFLOPS = 794.0
CEILING_GBPS = 4240.0

BACKEND_ORDER = ("reference", "triton", "cute", "torch", "cudnn")
UNITS = {"tflops": "TFLOP/s", "gbps": "GB/s"}


def entries(doc: Dict[str, Any], metric: str = "auto") -> List[Dict[str, Any]]:
    """Rows {group, backend, metric, value, median_ms} from a benchmark JSON."""
    rows = []
    for b in doc.get("benchmarks", []):
        info = b.get("extra_info") or {}
        if "op" not in info or "shape" not in info:
            continue  # not one of this suite's benchmarks
        m = info.get("metric", "tflops") if metric == "auto" else metric
        backend = info.get("backend", "?")
        group = f"{info['op']} {info['shape']}"
        rows.append(_row(group, backend, m, info.get(m), info.get("median_ms")))
        if info.get("bwd_tflops") is not None and m == "tflops":
            bgroup = f"{info['op'].replace('fwd_bwd', 'bwd')} {info['shape']}"
            rows.append(_row(bgroup, backend, m, info["bwd_tflops"], info.get("bwd_ms")))
    return [r for r in rows if r["value"] is not None]


def _row(group: str, backend: str, metric: str, value: Optional[float], ms: Optional[float]) -> Dict[str, Any]:
    return {"group": group, "backend": backend, "metric": metric, "value": value, "median_ms": ms}


def _ordered(values: Sequence[str], order: Sequence[str]) -> List[str]:
    seen = list(dict.fromkeys(values))
    return sorted(seen, key=lambda v: (order.index(v) if v in order else len(order), seen.index(v)))


def table(rows: List[Dict[str, Any]]) -> str:
    lines = [f"{'group':<48} {'backend':<10} {'median ms':>10} {'value':>10}"]
    for r in rows:
        ms = f"{r['median_ms']:.4f}" if r["median_ms"] is not None else "-"
        lines.append(
            f"{r['group']:<48} {r['backend']:<10} {ms:>10} {r['value']:>10.1f} {UNITS.get(r['metric'], r['metric'])}"
        )
    return "\n".join(lines)


def _title(doc: Dict[str, Any]) -> str:
    devices = sorted({(b.get("extra_info") or {}).get("device", "?") for b in doc.get("benchmarks", [])})
    commit = (doc.get("commit_info") or {}).get("id") or "?"
    date = doc.get("datetime", "")[:19]
    return f"dsa benchmarks — {', '.join(devices)} — commit {str(commit)[:12]} — {date}"


def plot(doc: Dict[str, Any], out: str, metric: str = "auto", ceilings: Optional[Dict[str, float]] = None) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("bench.plot: drawing the PNG needs matplotlib (pip install matplotlib)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ceilings = ceilings or {"tflops": CEILING_TFLOPS, "gbps": CEILING_GBPS}
    rows = entries(doc, metric)
    if not rows:
        raise SystemExit("bench.plot: no benchmark of this suite with a value in the JSON")
    metrics = _ordered([r["metric"] for r in rows], ("tflops", "gbps"))
    backends = _ordered([r["backend"] for r in rows], BACKEND_ORDER)
    colors = {b: f"C{i}" for i, b in enumerate(backends)}

    panels: List[Tuple[str, List[str]]] = []
    for m in metrics:
        groups = list(dict.fromkeys(r["group"] for r in rows if r["metric"] == m))
        panels.append((m, groups))
    n_groups = [len(g) for _, g in panels]
    width = min(48.0, 3.0 + 0.22 * sum(n_groups) * max(2, len(backends)))
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(width, 6.0),
        squeeze=False,
        constrained_layout=True,
        gridspec_kw={"width_ratios": [n + 1 for n in n_groups]},
    )
    bar_w = 0.8 / len(backends)
    for ax, (m, groups) in zip(axes[0], panels):
        for j, b in enumerate(backends):
            xs, ys = [], []
            for i, g in enumerate(groups):
                v = [r["value"] for r in rows if r["metric"] == m and r["group"] == g and r["backend"] == b]
                if v:
                    xs.append(i - 0.4 + bar_w * (j + 0.5))
                    ys.append(v[-1])
            if xs:
                ax.bar(xs, ys, bar_w, label=b, color=colors[b])
        if m in ceilings:
            ax.axhline(ceilings[m], color="k", ls="--", lw=1)
            ax.text(len(groups) - 0.5, ceilings[m], f"ceiling {ceilings[m]:g} {UNITS[m]}",
                    va="bottom", ha="right", fontsize=8)
            ax.set_ylim(top=ceilings[m] * 1.12)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups, rotation=30, ha="right", fontsize=8)
        ax.set_xlim(-0.6, len(groups) - 0.4)
        ax.set_ylabel(UNITS.get(m, m))
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(_title(doc), fontsize=10)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plot", description=__doc__.splitlines()[0])
    p.add_argument("json", help="pytest-benchmark JSON (--benchmark-json output)")
    p.add_argument("-o", "--out", default=None, help="PNG to write (default: <json stem>.png)")
    p.add_argument("--metric", choices=("auto", "tflops", "gbps"), default="auto",
                   help="auto: each op's own metric (TFLOP/s, or GB/s for top-k)")
    p.add_argument("--ceiling-tflops", type=float, default=CEILING_TFLOPS)
    p.add_argument("--ceiling-gbps", type=float, default=CEILING_GBPS)
    args = p.parse_args(argv)
    try:
        with open(args.json) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench.plot: cannot read {args.json}: {e}") from None
    out = args.out or (args.json[:-5] if args.json.endswith(".json") else args.json) + ".png"
    print(table(entries(doc, args.metric)))
    plot(doc, out, args.metric, {"tflops": args.ceiling_tflops, "gbps": args.ceiling_gbps})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
