"""Rows for bench/RESULTS.md from a pytest-benchmark JSON of this suite.

    python -m bench.rows bench.json --commit abc1234 --command "make bench ..."

One markdown row per benchmark (the backward of a fwd+bwd benchmark gets a
row of its own, from ``bwd_ms``), in the column order of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json


def rows(doc: dict, commit: str, command: str) -> list:
    date = (doc.get("datetime") or "")[:10]
    out = []
    for b in doc["benchmarks"]:
        e = b["extra_info"]
        metric = e.get("metric", "tflops")
        unit = "TFLOP/s" if metric == "tflops" else "GB/s"
        head = f"| {date} | {commit} | {e.get('device', '?')} |"
        shape = e["shape"] + (" deterministic" if e.get("deterministic") else "")
        out.append(f"{head} {e['op']} | {shape} | {e['backend']} | {command} | {e['median_ms']:.4g} | {e[metric]:.1f} {unit} |")
        if "bwd_ms" in e:
            op = e["op"].replace("fwd_bwd", "bwd")
            out.append(f"{head} {op} | {shape} | {e['backend']} | {command} | {e['bwd_ms']:.4g} | {e['bwd_tflops']:.1f} TFLOP/s |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json")
    p.add_argument("--commit", required=True)
    p.add_argument("--command", default="make bench")
    args = p.parse_args()
    with open(args.json) as f:
        print("\n".join(rows(json.load(f), args.commit, args.command)))


if __name__ == "__main__":
    main()
