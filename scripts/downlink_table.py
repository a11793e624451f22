#!/usr/bin/env python3
"""Bytes per device and round, both ways, and held-out accuracy, of every run of an
experiment directory (`fedpo-aggregator experiment ... --out DIR`): the compressed
downlink's table in docs/benchmarks.md.

    scripts/downlink_table.py runs/downlink

Down is `bytes_down` (every device receives the round's broadcast), up is the mean of
`bytes_up_by_device`; both are means over the training rounds, the first round's whole
download included. Held-out accuracy is the closing evaluation's mean over devices.
"""
import json
import pathlib
import sys


def runs(root):
    for metrics in sorted(pathlib.Path(root).glob("*/*/seed-*/metrics.jsonl")):
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        yield metrics.parts[-4], metrics.parts[-3], records


def main(root):
    print("| study | run | down B/device/round (round 1; later) | up B/device/round | held-out acc |")
    print("|---|---|---|---|---|")
    for study, run, records in runs(root):
        training = [r for r in records if not r.get("evaluation")]
        final = [r for r in records if r.get("evaluation")]
        if not training or not final:
            continue
        down = sum(r["bytes_down"] for r in training) / len(training)
        later = training[1:] or training
        later_down = sum(r["bytes_down"] for r in later) / len(later)
        ups = [v for r in training for v in r.get("bytes_up_by_device", {}).values()]
        up = sum(ups) / max(len(ups), 1)
        heldout = final[-1].get("heldout_acc", {})
        acc = sum(heldout.values()) / max(len(heldout), 1)
        print(
            f"| {study} | {run} | {down:,.0f} ({training[0]['bytes_down']:,}; {later_down:,.0f}) "
            f"| {up:,.0f} | {acc:.3f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/downlink")
