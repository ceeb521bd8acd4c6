#!/usr/bin/env bash
# How much memory sled keeps after a record is rewritten many times, with and without handing the
# writing thread's deferred frees to sled's collector after each flush (bench/sled-frees,
# docs/decisions/0034-sled-deferred-frees.md). Four cases, each in a process of its own: the
# whole rollout as one record (RECORD_BYTES, default 4,500,000, a 100k-device rollout) or one
# record per changed device (DEVICES, default 30,000, a fifth of them a save), frees left or
# flushed.
#
# Usage: bench/sled-frees.sh [SAVES]   (default 45; CARGO_TARGET_DIR, RESULTS as for the others)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}"
mkdir -p bench/results
results="${RESULTS:-bench/results/sled-frees-$(date -u +%Y-%m-%d).txt}"
cargo build -q --release --manifest-path bench/sled-frees/Cargo.toml
{
  echo "sled deferred frees, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
  "$CARGO_TARGET_DIR/release/flotilla-sled-frees" "${1:-45}"
} | tee "$results"
echo "results: $results"
