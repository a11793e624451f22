#!/usr/bin/env bash
# Federation overhead: the share of each round spent outside local training, at the
# DistilGPT-2 size on loopback (embedded broker, 2 in-process devices), for several
# amounts of local work and update codecs. Prints one table row per round;
# OUT/<run>/metrics.jsonl keeps everything.
#
#   scripts/bench_overhead.sh [OUT] [LOCAL_STEPS...]      (default: runs/overhead 2 8 32)
#
# CODECS (default "f32 int8") sets the update codecs of the 2-step runs (run only when 2 is
# among LOCAL_STEPS); longer runs use f32.
# BROKER (e.g. mqtt://127.0.0.1:1883) runs through that broker instead of the embedded one.
# Four rounds: the first two write each checkpoint slot for the first time (fresh page
# cache pages, the slow case on a virtual machine), rounds 3 and 4 are the steady state.
# The share is 1 - (slowest device's local training) / (round seconds), as in docs/benchmarks.md.
# The learning rate is lowered to 0.01 so that 32 local steps stay finite on this tiny
# data set (at 0.1 a device diverges and the round waits for its deadline); it does not
# change what a step costs.
set -euo pipefail
out=${1:-runs/overhead}
shift || true
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(2 8 32)
read -r -a codecs <<< "${CODECS:-f32 int8}"
cd "$(dirname "$0")/.."
cargo build --release -p fedpo-aggregator
bin=target/release/fedpo-aggregator
mkdir -p "$out"

run() { # NAME LOCAL_STEPS CODEC
    local dir="$out/$1"
    rm -rf "$dir"
    "$bin" simulate ${BROKER:+--broker "$BROKER"} --model distilgpt2 --method feddpo --devices 2 --per-round 2 --rounds 4 \
        --train-pairs 8 --heldout-pairs 4 --batch-pairs 4 --local-steps "$2" --lr 0.01 --update-codec "$3" \
        --no-final-eval --out "$dir" > "$dir.log" 2>&1 || { echo "$1: failed, see $dir.log" >&2; return 0; }
    python3 - "$dir/metrics.jsonl" "$1" "$2" "$3" <<'PY'
import json, sys
path, name, steps, codec = sys.argv[1:]
for line in open(path):
    r = json.loads(line)
    train = max(r["train_seconds"].values())
    print(f"| {codec} | {steps} | {r['round']} | {r['seconds']:.2f} | {train:.2f} | "
          f"{r['seconds'] - train:.2f} | {100 * (1 - train / r['seconds']):.1f} % |")
PY
}

echo "| codec | local steps | round | round s | training s (slowest) | outside training s | overhead |"
echo "|---|---|---|---|---|---|---|"
for s in "${steps[@]}"; do
    if [ "$s" = 2 ]; then
        for codec in "${codecs[@]}"; do run "steps2-$codec" 2 "$codec"; done
    else
        run "steps$s-f32" "$s" f32
    fi
done
