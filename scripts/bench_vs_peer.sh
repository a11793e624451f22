#!/usr/bin/env bash
# DPO step time and peak memory, fedpo vs the PyTorch + PEFT peer, same machine, same run.
#
#   scripts/bench_vs_peer.sh [OUT_DIR]
#
# Needs the peer's Python environment (see ../shared/bench/README.md):
#   python3 -m venv /tmp/peer-venv && /tmp/peer-venv/bin/pip install torch transformers peft safetensors
# Environment: PEER_PY (default /tmp/peer-venv/bin/python), PEER_SCRIPT (default
# ../shared/bench/dpo_step_bench.py), STEPS (default 8), SHAPES ("tiny distilgpt2"),
# REPEATS (default 1), FEDPO_DTYPES (fedpo's --compute-dtype values, default "f32 bf16"),
# PEER_BF16 (1, the default: also run the peer under --autocast-bf16, PyTorch's fastest
# CPU mode where oneDNN has AVX512-BF16 or AMX; 0: f32 only).
# Each configuration runs fedpo at every FEDPO_DTYPES value and the peer in f32 and (with
# PEER_BF16) bf16 autocast, each with and without --logits-to-keep; the first table puts
# fedpo's fastest precision against the peer's fastest configuration.
# The programs alternate per configuration so background load hits both alike; the
# peer runs with the tuned glibc allocator settings, i.e. at its best. With REPEATS=n each
# program runs n times per configuration, the order swapped every repeat, and the tables
# take each program's run with the lowest median: on a shared host a burst of someone
# else's load can slow one 30-second run by a quarter, and the same rule for both keeps
# the comparison fair. Every run's median is printed first.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/runs/bench}"
peer_py="${PEER_PY:-/tmp/peer-venv/bin/python}"
peer_script="${PEER_SCRIPT:-$root/../shared/bench/dpo_step_bench.py}"
steps="${STEPS:-8}"
shapes="${SHAPES:-tiny distilgpt2}"
repeats="${REPEATS:-1}"
fedpo_dtypes="${FEDPO_DTYPES:-f32 bf16}"
peer_bf16="${PEER_BF16:-1}"
mkdir -p "$out"
cargo build --release -p fedpo-device --manifest-path "$root/Cargo.toml" >&2
fedpo="$root/target/release/fedpo-device"

# fedpo-DTYPE-...: fedpo at that compute dtype (f32 also times its matmuls, for the bound
# tables); peer-...: f32; peer-keep: f32 with --logits-to-keep; peer-bf16 and
# peer-bf16-keep: the same under bf16 autocast.
peer_variants="peer peer-keep"
[ "$peer_bf16" = 1 ] && peer_variants="$peer_variants peer-bf16 peer-bf16-keep"
run_fedpo() {
  for dtype in $fedpo_dtypes; do
    local gemm=(); [ "$dtype" = f32 ] && gemm=(--gemm)
    "$fedpo" bench "${flags[@]}" --compute-dtype "$dtype" "${gemm[@]}" > "$out/fedpo-$dtype-$shape-$mode-r$r.json"
  done
}
run_peer() {
  for variant in $peer_variants; do
    local extra=()
    [ "$variant" = peer ] && extra+=(--gemm)  # f32 matmul speeds, for the bound tables
    case "$variant" in *keep) extra+=(--logits-to-keep) ;; esac
    case "$variant" in *bf16*) extra+=(--autocast-bf16) ;; esac
    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=17179869184 "$peer_py" "$peer_script" "${flags[@]}" "${extra[@]}" \
      > "$out/$variant-$shape-$mode-r$r.json"
  done
}
for r in $(seq 1 "$repeats"); do
  for shape in $shapes; do
    for mode in trainable frozen; do
      flags=(--pairs 4 --prompt-len 64 --resp-len 64 --steps "$steps")
      [ "$shape" = tiny ] && flags+=(--tiny)
      [ "$mode" = frozen ] && flags+=(--base-frozen)
      echo "== repeat $r: $shape $mode" >&2
      if [ $((r % 2)) = 1 ]; then run_fedpo; run_peer; else run_peer; run_fedpo; fi
    done
  done
done

python3 - "$out" "$shapes" "$repeats" "$fedpo_dtypes" "$peer_variants" <<'PY'
import json, os, shutil, sys
out, shapes, repeats = sys.argv[1], sys.argv[2].split(), int(sys.argv[3])
fedpo = [f"fedpo-{d}" for d in sys.argv[4].split()]
peers = sys.argv[5].split()
def load(name):
    with open(os.path.join(out, name)) as f:
        return json.load(f)
print("Every run's median s/step (repeat 1, 2, ...); the tables below take each program's fastest:")
print()
for shape in shapes:
    for mode in ("trainable", "frozen"):
        cells = []
        for prog in fedpo + peers:
            runs = [f"{out}/{prog}-{shape}-{mode}-r{r}.json" for r in range(1, repeats + 1)]
            medians = [json.load(open(path))["seconds_per_step_median"] for path in runs]
            best = min(range(repeats), key=lambda i: medians[i])
            shutil.copyfile(runs[best], f"{out}/{prog}-{shape}-{mode}.json")
            cells.append(f"{prog} " + " / ".join(f"{m:.3f}" for m in medians))
        print(f"- {shape} {mode}: " + "; ".join(cells))
        if "fedpo-f32" in fedpo:  # the bound tables read fedpo's f32 run under this name
            shutil.copyfile(f"{out}/fedpo-f32-{shape}-{mode}.json", f"{out}/fedpo-{shape}-{mode}.json")
print()
head = " | ".join(f"{p} s/step" for p in fedpo + peers)
print(f"| shape | mode | {head} | fedpo's best vs the peer's best | fedpo best RSS MB | peer best RSS MB | RSS ratio |")
print("|---|---|" + "---|" * (len(fedpo) + len(peers)) + "---|---|---|---|")
for shape in shapes:
    for mode in ("trainable", "frozen"):
        runs = {p: load(f"{p}-{shape}-{mode}.json") for p in fedpo + peers}
        s = {p: r["seconds_per_step_median"] for p, r in runs.items()}
        fb = min(fedpo, key=s.get); pb = min(peers, key=s.get)
        cells = " | ".join(f"{s[p]:.3f}" for p in fedpo + peers)
        frss, prss = runs[fb]["peak_rss_mb"], runs[pb]["peak_rss_mb"]
        print(f"| {shape} | {mode} | {cells} | {s[pb]/s[fb]:.2f}x ({fb} vs {pb}) | {frss:.0f} | {prss:.0f} | {frss/prss:.2f} |")
print()
PY

if ! echo " $fedpo_dtypes " | grep -q " f32 "; then exit 0; fi
python3 - "$out" "$shapes" <<'PY'
import json, sys, os
out, shapes = sys.argv[1], sys.argv[2].split()
def load(name):
    with open(os.path.join(out, name)) as f:
        return json.load(f)
def peer_shape_bound(p):
    # fedpo's `seconds_at_shape_speeds` over the peer's forward parts: every matmul kind at
    # the speed measured at its own shape (c_attn, c_fc, the head)
    parts, trainable = p["flops_detail"]["parts_forward"], p["base_trainable"]
    attn, mlp, head = (g["gflops_best"] for g in p["gemm"][1:4])
    base = 3.0 if trainable else 2.0
    linear = parts["linear"] * base * (4 / 12 / attn + 8 / 12 / mlp)
    small = (parts["attention"] + parts["lora"]) * 3.0 / attn
    return (linear + small + parts["lm_head"] * base / head) / 1e9
print()
print("| shape | mode | fedpo matmul GFLOP/s (2048^3) | fedpo bound s/step | fedpo fraction of bound | peer sgemm GFLOP/s (2048^3) | peer bound s/step | peer fraction of bound |")
print("|---|---|---|---|---|---|---|---|")
for shape in shapes:
    for mode in ("trainable", "frozen"):
        f = load(f"fedpo-{shape}-{mode}.json"); p = load(f"peer-{shape}-{mode}.json")
        print(f"| {shape} | {mode} | {f['gemm'][0]['gflops_best']:.0f} | {f['lower_bound_seconds_per_step_at_2048_sgemm']:.3f} "
              f"| {f['fraction_of_sgemm_bound']:.0%} | {p['gemm'][0]['gflops_best']:.0f} "
              f"| {p['lower_bound_seconds_per_step_at_2048_sgemm']:.3f} | {p['fraction_of_sgemm_bound']:.0%} |")
print()
print("Bound at each shape's measured speed (c_attn, c_fc and head GFLOP/s):")
print()
print("| shape | mode | fedpo GFLOP/s c_attn / c_fc / head | fedpo bound s/step | fedpo fraction of bound | peer GFLOP/s c_attn / c_fc / head | peer bound s/step | peer fraction of bound |")
print("|---|---|---|---|---|---|---|---|")
for shape in shapes:
    for mode in ("trainable", "frozen"):
        f = load(f"fedpo-{shape}-{mode}.json"); p = load(f"peer-{shape}-{mode}.json")
        speeds = lambda r: " / ".join(f"{g['gflops_best']:.0f}" for g in r["gemm"][1:4])
        pb = peer_shape_bound(p)
        print(f"| {shape} | {mode} | {speeds(f)} | {f['lower_bound_seconds_per_step_at_shape_sgemm']:.3f} "
              f"| {f['fraction_of_shape_bound']:.0%} | {speeds(p)} | {pb:.3f} | {pb / p['seconds_per_step_median']:.0%} |")
print()
print("fedpo's bound with every matmul of its step (forward, input and weight gradients) at its own shape:")
print()
print("| shape | mode | fedpo s/step | bound s/step | fraction of bound | threads busy | slowest shapes (GFLOP/s) |")
print("|---|---|---|---|---|---|---|")
for shape in shapes:
    for mode in ("trainable", "frozen"):
        f = load(f"fedpo-{shape}-{mode}.json")
        slow = sorted(f["gemm_step_shapes"], key=lambda g: g["gflops_best"])[:3]
        slow = ", ".join(f"{g['matmul']} {g['gflops_best']:.0f}" for g in slow)
        busy = f.get("threads_busy")
        busy = f"{busy:.2f} of {f['threads']}" if busy is not None else "–"
        print(f"| {shape} | {mode} | {f['seconds_per_step_median']:.3f} | {f['lower_bound_seconds_per_step_at_step_shapes']:.3f} "
              f"| {f['fraction_of_step_shape_bound']:.0%} | {busy} | {slow} |")
PY
