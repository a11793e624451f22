#!/usr/bin/env python3
"""Compares two metrics.jsonl files of the same job, record by record.

Timings, byte counts and memory peaks are left out (they differ from run to run, and
byte counts embed transfer ids). Every other value must match: strings, integers and
lists exactly, floats within a relative tolerance (default 1e-12), since a float sum may
take its terms in the order updates arrived. Prints the largest relative float difference
per key and exits 1 if anything differs.

    python3 scripts/compare_metrics.py before/metrics.jsonl after/metrics.jsonl [--rtol 1e-12]
"""
import argparse
import json
import sys

SKIP = ("seconds", "bytes", "peak_rss", "time", "duration", "elapsed", "wall")


def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if not any(s in k for s in SKIP)}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x


def compare(a, b, path, rtol, worst, problems):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                problems.append(f"{path}.{k}: only in {'the first' if k in a else 'the second'}")
            else:
                compare(a[k], b[k], f"{path}.{k}", rtol, worst, problems)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (p, q) in enumerate(zip(a, b)):
            compare(p, q, f"{path}[{i}]", rtol, worst, problems)
    elif isinstance(a, float) and isinstance(b, (int, float)) or isinstance(b, float) and isinstance(a, int):
        rel = abs(a - b) / max(abs(a), abs(b), 1e-300)
        key = path.split(".")[-1].split("[")[0]
        worst[key] = max(worst.get(key, 0.0), rel)
        if rel > rtol:
            problems.append(f"{path}: {a!r} vs {b!r} (relative {rel:.2e})")
    elif a != b:
        problems.append(f"{path}: {a!r} vs {b!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("first")
    ap.add_argument("second")
    ap.add_argument("--rtol", type=float, default=1e-12)
    args = ap.parse_args()
    load = lambda p: [strip(json.loads(line)) for line in open(p) if line.strip()]
    a, b = load(args.first), load(args.second)
    problems, worst = [], {}
    if len(a) != len(b):
        problems.append(f"{len(a)} records vs {len(b)}")
    for i, (p, q) in enumerate(zip(a, b)):
        compare(p, q, f"record {i}", args.rtol, worst, problems)
    print(f"{len(a)} and {len(b)} records compared (timings, byte counts and memory peaks left out)")
    differing = {k: v for k, v in worst.items() if v > 0}
    if differing:
        print("largest relative float differences: " + ", ".join(f"{k} {v:.1e}" for k, v in sorted(differing.items())))
    else:
        print("every float identical")
    for p in problems[:20]:
        print("DIFFERS " + p)
    print("SAME" if not problems else f"DIFFERENT ({len(problems)} values)")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
