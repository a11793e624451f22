#!/usr/bin/env python3
"""Bytes per device and round, both ways, and held-out accuracy, of every run of an
experiment directory (`fedpo-aggregator experiment ... --out DIR`): the compressed
downlink's table in docs/benchmarks.md.

    scripts/downlink_table.py runs/downlink

Down is `bytes_down` (every device receives the round's broadcast), up is the mean of
`bytes_up_by_device`; both are means over the training rounds, the first round's whole
download included, and over seeds. Held-out accuracy is the closing evaluation's mean
over devices, then its mean and standard deviation over seeds.
"""
import statistics
import json
import pathlib
import sys


def runs(root):
    """(study, run) -> the records of each seed's run."""
    grouped = {}
    for metrics in sorted(pathlib.Path(root).glob("*/*/seed-*/metrics.jsonl")):
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if any(r.get("evaluation") for r in records):
            grouped.setdefault((metrics.parts[-4], metrics.parts[-3]), []).append(records)
    return grouped


def mean(values):
    return sum(values) / max(len(values), 1)


def main(root):
    print("| study | run | seeds | down B/device/round (round 1; later) | up B/device/round | held-out acc |")
    print("|---|---|---|---|---|---|")
    for (study, run), seeds in runs(root).items():
        downs, firsts, laters, ups, accs = [], [], [], [], []
        for records in seeds:
            training = [r for r in records if not r.get("evaluation")]
            final = [r for r in records if r.get("evaluation")][-1]
            downs.append(mean([r["bytes_down"] for r in training]))
            firsts.append(training[0]["bytes_down"])
            laters.append(mean([r["bytes_down"] for r in training[1:] or training]))
            ups.extend(v for r in training for v in r.get("bytes_up_by_device", {}).values())
            accs.append(mean(list(final.get("heldout_acc", {}).values())))
        spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
        print(
            f"| {study} | {run} | {len(seeds)} | {mean(downs):,.0f} ({mean(firsts):,.0f}; {mean(laters):,.0f}) "
            f"| {mean(ups):,.0f} | {mean(accs):.3f} ± {spread:.3f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/downlink")
