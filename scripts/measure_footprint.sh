#!/usr/bin/env bash
# Peak RSS of real training, for the footprint model behind --max-memory
# (crates/fedpo-device/src/memory/footprint.rs). Writes one JSON object per measurement to
# OUT (default fixtures/memory/peaks.jsonl), the file the footprint tests read:
#
#   scripts/measure_footprint.sh [OUT]
#
# - `fedpo-device bench`: tiny and DistilGPT-2, base trainable (pFedDPO) and frozen (LoRA
#   only), 1, 2, 4 and 8 pairs, 32+32, 64+64, 128+128 and 32+160 tokens (the fit's data);
# - `fedpo-device train-local` on DistilGPT-2 with long pairs (about 110-token prompts,
#   115 to 120-token responses): one pass or several (gradient accumulation), AdamW,
#   frozen embeddings, two rows per pair (FEDPO_SHARED_PROMPT=off), and bf16 compute (the
#   composed kernels);
# - one DistilGPT-2 federated round each (aggregator and device as separate processes on
#   an embedded broker): pFedDPO in one pass or in passes of 1, 2 and 4 pairs, with frozen
#   embeddings, FedDPO and shared LoRA, on 120 synthetic pairs (at most 71 tokens); and
#   pFedDPO with the round's starting model kept on disk (--start-on-disk), in one pass
#   and in passes of 1; and pFedDPO in bf16 (the composed kernels), in memory and on disk.
#
# Peaks are each process's maximum RSS from getrusage (bench, train-local's summary) or
# /usr/bin/time (the device of a round). About fifteen minutes on 2 cores.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/fixtures/memory/peaks.jsonl}"
cargo build --release -p fedpo-device -p fedpo-aggregator --manifest-path "$root/Cargo.toml" >&2
bin="$root/target/release"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$(dirname "$out")"
: > "$out"

# record SOURCE MODEL PARTITION FREEZE OPTIM BATCH MICRO SEQ RESP FEDERATED TOKENIZER SHARED_PROMPT COMPUTE PEAK_MIB
# (START_ON_DISK=true in the environment for a round that kept its start on disk)
record() {
    printf '{"source":"%s","model":"%s","partition":"%s","freeze_embeddings":%s,"optimizer":"%s","batch_pairs":%s,"micro_batch_pairs":%s,"seq_len":%s,"response_len":%s,"federated":%s,"tokenizer":%s,"shared_prompt":%s,"compute_dtype":"%s","peak_mib":%.1f,"start_on_disk":%s}\n' "$@" "${START_ON_DISK:-false}" >> "$out"
}
json_field() { sed -n "s/.*\"$1\": *\([0-9.]*\).*/\1/p" "$2" | head -1; }
# A `key=value` field of a log line (tracing colours the text even into a file).
log_field() { sed 's/\x1b\[[0-9;]*m//g' "$2" | sed -n "s/.*$1=\([0-9]*\).*/\1/p" | head -1; }

for model in tiny distilgpt2; do
  for mode in trainable frozen; do
    for pairs in 1 2 4 8; do
      for lens in "32 32" "64 64" "128 128" "32 160"; do
        set -- $lens
        flags=(--pairs "$pairs" --prompt-len "$1" --resp-len "$2" --warmup 1 --steps 1)
        [ "$model" = tiny ] && flags+=(--tiny)
        partition=pfeddpo
        [ "$mode" = frozen ] && { flags+=(--base-frozen); partition=shared-lora; }
        "$bin/fedpo-device" bench "${flags[@]}" > "$work/bench.json" 2>/dev/null
        echo "bench $model $mode $pairs pairs $1+$2" >&2
        record bench "$model" "$partition" false sgd "$pairs" "$pairs" $(($1 + $2)) "$2" false false true f32 \
            "$(json_field peak_rss_mb "$work/bench.json")"
      done
    done
  done
done

# Long pairs for train-local: 24 pairs of about 110 + 120 tokens of common words.
awk 'BEGIN { srand(1); n = split("the of and to in is that for it as was with be by on not he this are or his from at which but have an they you were her she there one all we their can has more when been other if will about into would some what so its time no only than them first also new could years now after", w, " ")
  for (i = 0; i < 24; i++) {
    p = w[int(rand() * n) + 1]; for (j = 1; j < 110; j++) p = p " " w[int(rand() * n) + 1]
    c = ""; for (j = 0; j < 120; j++) c = c " " w[int(rand() * n) + 1]
    r = ""; for (j = 0; j < 115; j++) r = r " " w[int(rand() * n) + 1]
    printf "{\"prompt\": \"%s\", \"chosen\": \"%s\", \"rejected\": \"%s\"}\n", p, c, r } }' > "$work/long.jsonl"

# local NAME MICRO OPTIM FREEZE SHARED_PROMPT COMPUTE
local_run() {
    local name=$1 micro=$2 optim=$3 freeze=$4 shared=$5 dtype=$6 flags=()
    [ "$freeze" = true ] && flags+=(--freeze-embeddings)
    FEDPO_SHARED_PROMPT=$([ "$shared" = true ] && echo on || echo off) "$bin/fedpo-device" train-local --model distilgpt2 \
        --data "$work/long.jsonl" --heldout-fraction 0.25 --max-len 256 --steps 1 --batch-pairs 8 \
        --micro-batch-pairs "$micro" --optim "$optim" --compute-dtype "$dtype" --max-memory 65536 "${flags[@]}" \
        --out "$work/$name" > "$work/$name.log" 2>&1
    local seq resp
    seq=$(log_field longest_sequence "$work/$name.log")
    resp=$(log_field longest_response "$work/$name.log")
    [ -n "$seq" ] && [ -n "$resp" ] || { echo "train-local $name logged no memory plan:" >&2; tail -5 "$work/$name.log" >&2; exit 1; }
    echo "train-local $name: $seq tokens, $resp response" >&2
    record train-local distilgpt2 pfeddpo "$freeze" "$optim" 8 "$micro" "$seq" "$resp" false true "$shared" "$dtype" \
        "$(json_field peak_rss_mib "$work/$name/summary.json")"
}
local_run one-pass 8 sgd false true f32
local_run passes-of-1 1 sgd false true f32
local_run passes-of-4 4 sgd false true f32
local_run adamw 8 adamw false true f32
local_run frozen-embeddings 8 sgd true true f32
local_run two-rows 8 sgd false false f32
local_run bf16 8 sgd false true bf16
local_run bf16-passes-of-1 1 sgd false true bf16

# round NAME PORT METHOD FREEZE MICRO COMPUTE [DEVICE_FLAG...]
round() {
    local name=$1 port=$2 method=$3 freeze=$4 micro=$5 compute=$6 agg_flags=()
    shift 6
    [ "$freeze" = true ] && agg_flags+=(--freeze-embeddings)
    "$bin/fedpo-aggregator" serve --embedded-broker "127.0.0.1:$port" --job mem --method "$method" --model distilgpt2 \
        --rounds 1 --per-round 1 --local-steps 2 --batch-pairs 8 --no-final-eval --out "$work/$name-agg" \
        "${agg_flags[@]}" > "$work/$name-agg.log" 2>&1 &
    local agg=$!
    sleep 3
    /usr/bin/time -v "$bin/fedpo-device" run --broker "mqtt://127.0.0.1:$port" --job mem --id dev-0 \
        --state-dir "$work/$name-dev" --synthetic-persona 0 --train-pairs 120 --heldout-pairs 40 --max-len 128 \
        --micro-batch-pairs "$micro" --compute-dtype "$compute" --max-memory 65536 "$@" > "$work/$name.log" 2>&1
    wait "$agg"
    local seq resp kib
    seq=$(log_field longest_sequence "$work/$name.log")
    resp=$(log_field longest_response "$work/$name.log")
    kib=$(sed -n 's/.*Maximum resident set size (kbytes): \([0-9]*\).*/\1/p' "$work/$name.log")
    [ -n "$seq" ] && [ -n "$kib" ] || { echo "round $name logged no memory plan or peak:" >&2; tail -5 "$work/$name.log" >&2; exit 1; }
    echo "round $name: $seq tokens, $resp response" >&2
    START_ON_DISK=$([ "${1:-}" = --start-on-disk ] && echo true || echo false) \
        record round distilgpt2 "$method" "$freeze" sgd 8 "$micro" "$seq" "$resp" true true true "$compute" "$(awk -v k="$kib" 'BEGIN { print k / 1024 }')"
}
round pfeddpo 18851 pfeddpo false 8 f32
round passes-of-1 18852 pfeddpo false 1 f32
round passes-of-2 18853 pfeddpo false 2 f32
round passes-of-4 18854 pfeddpo false 4 f32
round frozen-embeddings 18855 pfeddpo true 8 f32
round feddpo 18856 feddpo false 8 f32
round shared-lora 18857 shared-lora false 8 f32
round start-on-disk 18858 pfeddpo false 8 f32 --start-on-disk
round start-on-disk-passes-of-1 18859 pfeddpo false 1 f32 --start-on-disk
round bf16 18860 pfeddpo false 8 bf16
round bf16-start-on-disk 18861 pfeddpo false 8 bf16 --start-on-disk
echo "wrote $(wc -l < "$out") measurements to $out" >&2
