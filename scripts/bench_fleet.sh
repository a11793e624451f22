#!/usr/bin/env bash
# Aggregation at fleet scale: fedpo-aggregator bench-fleet through a loopback Mosquitto
# (1,000 devices, f32 and int8 updates, and 20 devices for the memory baseline) and
# through the embedded rumqttd. Each run writes OUT/<run>/fleet_bench.json.
#
#   scripts/bench_fleet.sh [OUT] [DEVICES]
#
# Needs Debian's mosquitto (apt-get install mosquitto). EMBEDDED_DEVICES sets the embedded
# broker's fleet (default: DEVICES). With hundreds uploading at once, rumqttd and the
# aggregator's client can stall each other (see docs/benchmarks.md); such a run fails, the others go on.
set -euo pipefail
out=${1:-runs/bench-fleet}
devices=${2:-1000}
embedded_devices=${EMBEDDED_DEVICES:-$devices}
port=${MQTT_PORT:-18830}
cd "$(dirname "$0")/.."
cargo build --release -p fedpo-aggregator
bin=target/release/fedpo-aggregator
mkdir -p "$out"

# Two sockets per device; the broker queues a whole round of uploads for the aggregator
# (Mosquitto's default of 1,000 queued messages per client would drop most of them).
ulimit -n 8192 2>/dev/null || ulimit -n "$(ulimit -Hn)"
cat > "$out/mosquitto.conf" <<CONF
listener $port 127.0.0.1
allow_anonymous true
persistence false
max_queued_messages 100000
CONF
mosquitto -c "$out/mosquitto.conf" > "$out/mosquitto.log" 2>&1 &
broker=$!
trap 'kill $broker 2>/dev/null' EXIT
sleep 1

url=mqtt://127.0.0.1:$port
run() { # name, then bench-fleet flags
    local name=$1; shift
    echo "== $name"
    "$bin" bench-fleet --rounds 3 --out "$out/$name" "$@" > /dev/null 2> "$out/$name.log"
    grep -E '"(aggregator_peak_rss_mib|shared_set_mib)"|updates_per_second' "$out/$name/fleet_bench.json"
}
run mosquitto-20 --devices 20 --broker "$url"
run mosquitto-f32 --devices "$devices" --broker "$url"
run mosquitto-int8 --devices "$devices" --broker "$url" --update-codec int8
run embedded-f32 --devices "$embedded_devices" || echo "embedded-f32 failed; see $out/embedded-f32.log"
run embedded-int8 --devices "$embedded_devices" --update-codec int8 || echo "embedded-int8 failed; see $out/embedded-int8.log"
