#!/usr/bin/env bash
# The peer benchmark: one site of 1, 4 and 16 agents on a site Mosquitto bridged to a central
# Mosquitto, the coordinator on the central one, peer sharing off and on (the same release, with
# block lists, and the same rollout but for its site policy). For each run: bytes the
# coordinator's block server sent, payload bytes that crossed the bridge (every device topic seen
# on the central broker), and seconds from the rollout's start to its last Ready.
#
# Usage: bench/peers.sh
# Environment: SIZES of the site (default "1 4 16"), BYTES (artifact size, default 4194304),
#              SHARING (default "off on"), RESULTS (default bench/results-peers.txt).
#
# It runs the `bench_site` test of tests/tests/peers.rs (real processes, debug build, as the
# other tests) once per configuration; a configuration that does not finish is reported as "not
# run", not as a number. Nothing here passes or fails on a number; docs/performance.md has the
# figures.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
export CARGO_TERM_COLOR=never
SIZES="${SIZES:-1 4 16}"
BYTES="${BYTES:-4194304}"
SHARING="${SHARING:-off on}"
results="${RESULTS:-$repo/bench/results-peers.txt}"

cargo build -q --bins || exit 1
cargo test -q -p flotilla-tests --test peers --no-run || exit 1

{
    echo "# bench/peers.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(nproc) cores; artifact of $BYTES bytes"
    printf '%-8s %-8s %18s %14s %12s\n' devices sharing coordinator_bytes bridge_bytes last_ready_s
} | tee "$results"

for n in $SIZES; do
    for sharing in $SHARING; do
        share=0
        [ "$sharing" = on ] && share=1
        log="$(mktemp /tmp/flotilla-peers-bench.XXXXXX)"
        PEER_BENCH_DEVICES="$n" PEER_BENCH_BYTES="$BYTES" PEER_BENCH_SHARE="$share" \
            cargo test -q -p flotilla-tests --test peers bench_site -- --ignored --exact \
            --nocapture >"$log" 2>&1
        line="$(grep '^RESULT ' "$log" | tail -1)"
        if [ -z "$line" ]; then
            printf '%-8s %-8s %s\n' "$n" "$sharing" "not run: no result, see the log below" | tee -a "$results"
            echo "  (its output: $log)"
            continue
        fi
        rm -f "$log"
        field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$line"; }
        printf '%-8s %-8s %18s %14s %12s\n' "$n" "$sharing" "$(field coordinator_bytes)" \
            "$(field bridge_bytes)" "$(field last_ready_s)" | tee -a "$results"
    done
done
