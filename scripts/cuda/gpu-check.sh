#!/usr/bin/env bash
# The CUDA step against the CPU step of the same binary, and against PyTorch on the same GPU.
#
#   scripts/cuda/gpu-check.sh BINARY [PEER]     results under $OUT (default /tmp/gpu-check)
#
# BINARY is a `--features cuda` release build (scripts/cuda/toolchain.sh --link, then
# cargo build --release -p fedpo-device --features cuda); PEER is dpo_step_bench.py, the
# PyTorch peer, skipped when absent. It runs, for the tiny model and DistilGPT-2, the
# same seeded `train-local` on the CPU and on the GPU, in f32 and with bf16 compute, and
# compares loss, gradient norm and margin step by step, each precision against itself
# (f32: 1e-4 relative; bf16: 1e-2), then `bench --device cuda`
# beside the peer's `--device cuda`, with and without `--autocast-bf16`.
# summary.json says what held. GPU=cpu runs everything on the CPU, to try the script
# on a machine without a GPU.
set -uo pipefail
binary=${1:?usage: gpu-check.sh BINARY [PEER]}
peer=${2:-}
gpu=${GPU:-cuda}
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv
# cuBLAS and cuRAND: wherever the machine keeps them (a CUDA toolkit, or PyTorch's wheels)
lib_dir() { find /usr/local /usr/lib /opt "$HOME/.local" -xdev -name "$1" 2>/dev/null | head -1 | xargs -r dirname; }
export LD_LIBRARY_PATH="$(lib_dir 'libcublas.so.13'):$(lib_dir 'libcurand.so.10'):${LD_LIBRARY_PATH:-}"
export RUST_LOG=warn
ldd "$binary" | grep -E 'cuda|cublas|curand|not found'

train() { # name, device, args...
    local name=$1 device=$2; shift 2
    local started=$(date +%s.%N)
    timeout 240 "$binary" train-local --synthetic --seed 0 --device "$device" --out "$out/$name" "$@" \
        > "$out/$name.txt" 2>&1
    echo "$name: rc=$? $(echo "$(date +%s.%N) - $started" | bc) s"
}
tiny=(--model tiny --steps 8)
dg=(--model distilgpt2 --steps 4 --train-pairs 16 --heldout-pairs 8)
for device in cpu "$gpu"; do
    side=$([ "$device" = cpu ] && echo cpu || echo gpu)
    train "tiny-$side" "$device" "${tiny[@]}"
    train "tiny-$side-bf16" "$device" "${tiny[@]}" --compute-dtype bf16
    train "dg-$side" "$device" "${dg[@]}"
    train "dg-$side-bf16" "$device" "${dg[@]}" --compute-dtype bf16
done

bench() { # name, args...
    local name=$1; shift
    timeout 300 "$@" > "$out/$name.json" 2> "$out/$name.err"
    echo "$name: rc=$?"
}
for shape in "" "--base-frozen"; do
    tag=${shape:+-frozen}
    bench "bench-fedpo$tag" "$binary" bench --device "$gpu" $shape
    if [ -n "$peer" ] && [ -f "$peer" ]; then
        bench "bench-peer$tag" python3 "$peer" --device "$gpu" $shape
        bench "bench-peer-bf16$tag" python3 "$peer" --device "$gpu" --autocast-bf16 $shape
    fi
done

python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
def metrics(name):
    p = os.path.join(out, name, "metrics.jsonl")
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else None
summary = {"agreement": [], "bench": {}}
for cpu, gpu, tol in [("tiny-cpu", "tiny-gpu", 1e-4), ("tiny-cpu-bf16", "tiny-gpu-bf16", 1e-2),
                      ("dg-cpu", "dg-gpu", 1e-4), ("dg-cpu-bf16", "dg-gpu-bf16", 1e-2)]:
    a, b = metrics(cpu), metrics(gpu)
    row = {"cpu": cpu, "gpu": gpu, "tolerance": tol}
    if not a or not b or len(a) != len(b):
        row["held"] = False
        row["why"] = f"missing or unequal metrics: {len(a or [])} vs {len(b or [])} steps"
    else:
        worst = {}
        for k in ("loss", "grad_norm", "margin"):
            worst[k] = max(abs(p[k] - q[k]) / max(abs(p[k]), abs(q[k]), 1e-2) for p, q in zip(a, b))
        row["worst_relative"] = worst
        row["held"] = all(v <= tol for v in worst.values())
        row["seconds_per_step"] = {cpu: [round(r["seconds"], 4) for r in a], gpu: [round(r["seconds"], 4) for r in b]}
    summary["agreement"].append(row)
    print(f"{cpu} vs {gpu}: {'held' if row['held'] else 'FAILED'} {row.get('worst_relative', row.get('why'))}")
for name in sorted(os.listdir(out)):
    if name.startswith("bench-") and name.endswith(".json"):
        try:
            r = json.load(open(os.path.join(out, name)))
        except ValueError:
            continue
        keep = ("seconds_per_step_median", "peak_rss_mb", "gpu_peak_mib", "gpu_peak_mib_before_timed_steps",
                "peak_gpu_mb", "device", "gpu_name")
        summary["bench"][name[:-5]] = {k: r[k] for k in keep if k in r}
b = summary["bench"]
for tag in ("", "-frozen"):
    ours = b.get(f"bench-fedpo{tag}", {}).get("seconds_per_step_median")
    peers = [b.get(f"bench-peer{tag}", {}).get("seconds_per_step_median"),
             b.get(f"bench-peer-bf16{tag}", {}).get("seconds_per_step_median")]
    peers = [p for p in peers if p]
    if ours and peers:
        summary[f"speed_vs_peer_best{tag or '-trainable'}"] = min(peers) / ours
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps({k: v for k, v in summary.items() if k.startswith("speed")}))
PY
