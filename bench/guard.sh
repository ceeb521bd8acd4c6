#!/usr/bin/env bash
# What the MQTT size guard costs a link (decision 0039): the CPU time one link spends per
# message it receives and per message it sends, connected to the broker directly and through the
# guard, in turns, on a Mosquitto of its own (plain TCP on loopback, the shipped queue settings).
# Receiving: small messages like device states (300 B); sending: small ones like desired
# actions (600 B) and artifact blocks (64 KiB). Each run is one process per side; the CPU time
# is the measured link's only. Prints; asserts nothing.
#
# Usage: bench/guard.sh [ROUNDS]   (default 3; CARGO_TARGET_DIR, RESULTS as for the others)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}"
export PATH="$PATH:/usr/sbin"
bench=guard.sh
profile=release
mkdir -p bench/results
results="${RESULTS:-bench/results/guard-$(date -u +%Y-%m-%d).txt}"
: >"$results"
# shellcheck source=bench/lib.sh
. bench/lib.sh
cargo build -q --release --manifest-path bench/guard/Cargo.toml
b="$CARGO_TARGET_DIR/release/flotilla-guard-bench"
make_work guard
port=$(free_port)
broker_conf "$port" >"$work/mosquitto.conf"
mosquitto -c "$work/mosquitto.conf" >"$work/mosquitto.log" 2>&1 &
pids+=($!)
wait_port "$port"
say "size guard, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"

# Starts a reader role in the background and waits until it has subscribed.
start_reader() {
  local out="$1"; shift
  "$b" "$@" >"$out" &
  reader=$!
  for _ in $(seq 200); do grep -q ready "$out" 2>/dev/null && return 0; sleep 0.05; done
  die "$* did not subscribe"
}

for round in $(seq "${1:-3}"); do
  for mode in direct guarded; do
    start_reader "$work/receive" receive "$port" 200000 "$mode"
    "$b" publish "$port" 200000 300
    wait "$reader"
    say "round $round: $(grep -v ready "$work/receive")"
    for size in 600 65536; do
      count=$(( size > 1000 ? 5000 : 200000 ))
      start_reader "$work/drain" drain "$port" "$count"
      say "round $round: $("$b" send "$port" "$count" "$size" "$mode")"
      wait "$reader"
    done
  done
done
echo "results: $results"
