#!/usr/bin/env bash
# The coordinator's device-signature check, one by one against batches (decision 0063):
# instructions per signature under callgrind (the same on a busy or an idle machine) and wall
# time per signature. Usage: bench/sig-batch.sh [COUNT]; writes bench/results/sig-batch-<date>.txt.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
count=${1:-2048}
results=${RESULTS:-$repo/bench/results/sig-batch-$(date -u +%F).txt}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$repo/target}/sig-batch
cargo build --release --quiet --manifest-path "$repo/bench/sig-batch/Cargo.toml"
bin=$CARGO_TARGET_DIR/release/flotilla-sig-batch
mkdir -p "$(dirname "$results")"
{
  echo "# bench/sig-batch.sh $count on $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
  if command -v valgrind >/dev/null; then
    instructions() {
      valgrind --tool=callgrind --callgrind-out-file=/dev/null "$bin" "$count" "$1" 2>&1 |
        sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
    }
    setup=$(instructions setup)
    for mode in single batch:16 batch:64; do
      total=$(instructions "$mode")
      echo "instructions per signature, $mode: $(( (total - setup) / count ))"
    done
  else
    echo "valgrind not installed: no instruction counts"
  fi
  "$bin" "$count"
} | tee "$results"
