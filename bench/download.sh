#!/usr/bin/env bash
# One agent's download, measured beside the same bytes streamed through the same broker.
#
# Usage (from anywhere): bench/download.sh [--size BYTES] [--runs N] [--debug]
# Environment: SIZE (artifact bytes, default 134217728 = 128 MiB), RUNS (rollouts of each kind,
#              default 1), MODES (default "blocks no-blocks http"), IN_FLIGHT (the agent's
#              download.in_flight; default: the agent's own default), PERF=1 (profile the agent
#              and the coordinator with perf during the first download, both built in the
#              fleetsim profile for their symbols; bench/results/download-<date>.txt.<who>.perf.txt),
#              KEEP=1 (keep the work
#              directory), DATA_ON_DISK=1 (data directories on disk instead of tmpfs),
#              CARGO_TARGET_DIR (default: <repo>/target), RESULTS (default
#              bench/results/download-<UTC date>.txt), TIMEOUT (per rollout, default 10m).
#
# Starts its own Mosquitto (deploy/mosquitto/mosquitto.conf with its TLS listeners, passwords
# and ACL replaced by one plain loopback listener, TCP_NODELAY, as bench/fleet.sh), a coordinator
# and one real agent with a file target (release builds unless --debug), and for each mode:
#   - blocks:    a release made by `flotilla release create` (block lists, the default);
#   - no-blocks: one made with `--no-blocks` (the streaming fetcher, whole-file digest only);
#   - http:      one with block lists and `--url`: the artifact's location on an HTTP origin, the
#                coordinator's own `GET /artifacts/{sha256}` on its `[http] listen` (range
#                requests, decision 0062), so the agent fetches every block over HTTP;
# runs a one-device rollout of a fresh random artifact of SIZE bytes and prints, as
# flotilla-fleetsim --watch-device sees the device's topics: the desired action's publish to the
# first Downloading report, to Verified (every block fetched, written and checked, the whole
# file's sha256 checked), and to Ready; and `rollout start` to Ready. Download MB/s is SIZE over
# desired -> Verified. The agent keeps no earlier download (store.cache_bytes at its minimum),
# so the first run of a mode fetches onto a device holding nothing but its factory file, and
# every later one, with block lists, first scans the installed 128 MiB release for blocks it
# could copy (an adaptive download's first pass; none match, every artifact is random).
# Baseline, in the same run and through the same broker: flotilla-fleetsim --stream-bytes SIZE,
# the same bytes as block replies of the artifact server's size (64 KiB of data), QoS 1, from
# one publisher to one subscriber. The ratio is download MB/s over baseline MB/s (goal >= 0.5).
# For the http mode the baseline is `curl` fetching the same file from the same origin (the
# physical limit of that path on this machine; goal >= 0.8), the broker's beside it, and curl
# writing the file to the data's file system while openssl hashes it (curl | tee | openssl dgst -sha256):
# the least a downloader that checks what it writes must do.
# Nothing here passes or fails on a number; docs/performance.md has the figures.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}"
export CARGO_TERM_COLOR=never
export PATH="$PATH:/usr/sbin"
SIZE="${SIZE:-134217728}"
RUNS="${RUNS:-1}"
MODES="${MODES:-blocks no-blocks http}"
TIMEOUT="${TIMEOUT:-10m}"
profile=release
while [ $# -gt 0 ]; do
  case "$1" in
    --size) SIZE="$2"; shift 2 ;;
    --runs) RUNS="$2"; shift 2 ;;
    --debug) profile=debug; shift ;;
    -h|--help) sed -n '2,38p' "$0"; exit 0 ;;
    *) echo "download.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$repo/bench/results"
results="${RESULTS:-$repo/bench/results/download-$(date -u +%Y-%m-%d).txt}"

bench=download.sh
# The coordinator and the agent as shipped; the baseline and the watcher in the fleetsim profile
# (opt-level 3), as bench/fleet.sh runs the simulator. PERF=1 builds the coordinator and the
# agent in the fleetsim profile too: the release profile strips symbols (and builds the agent at
# opt-level "z", so the profile is of a faster agent than the one shipped).
if [ "$profile" = release ] && [ -n "${PERF:-}" ]; then
  profile=fleetsim
fi
# shellcheck source=bench/lib.sh
. "$repo/bench/lib.sh"
build_bins -p flotilla-coordinator -p flotilla-agent
flotilla="$bin/flotilla"
agent="$bin/flotilla-agent"
make_work download
: >"$results"
wait_log() {
  local pattern="$1" file="$2"
  for _ in $(seq 1200); do
    grep -q "$pattern" "$file" 2>/dev/null && return 0
    sleep 0.05
  done
  die "no \"$pattern\" in $file after 60 s"
}

dir="$work"
port=$(free_port)
broker_conf "$port" >"$dir/mosquitto.conf"
mosquitto -c "$dir/mosquitto.conf" >"$dir/mosquitto.log" 2>&1 &
pids+=("$!")
wait_port "$port"

# Keys, the agent's identity, the coordinator's config.
mkdir -p "$dir/keys" "$dir/agent"
"$flotilla" keygen --out "$dir/keys" >/dev/null
"$flotilla" operator keygen --out "$dir/keys" --name admin >/dev/null
device=bench-1
printf 'factory firmware\n' >"$dir/agent/app.bin"
cat >"$dir/agent/agent.toml" <<EOF
device_id = "$device"
hardware_id = "bench-board"
data_dir = "$dir/agent/data"
[broker]
host = "127.0.0.1"
port = $port
[labels]
bench = "download"
[trust]
release_keys = ["$(tr -d '[:space:]' <"$dir/keys/release.pub")"]
coordinator_keys = ["$(tr -d '[:space:]' <"$dir/keys/coordinator.pub")"]
[[target]]
name = "app"
kind = "file"
path = "$dir/agent/app.bin"
[health]
soak = "0s"
interval = "100ms"
[[health.check]]
name = "present"
command = ["/bin/sh", "-c", "test -s \"\$0\"", "$dir/agent/app.bin"]
timeout = "5s"
[store]
cache_bytes = 65536
[download]
max_bytes_per_sec = 0
EOF
[ -n "${IN_FLIGHT:-}" ] && printf 'in_flight = %s\n' "$IN_FLIGHT" >>"$dir/agent/agent.toml"
"$agent" check-config --config "$dir/agent/agent.toml" >/dev/null || die "agent config: $("$agent" check-config --config "$dir/agent/agent.toml" 2>&1)"
device_key=$("$agent" identity --config "$dir/agent/agent.toml" | tr -d '[:space:]')
echo "$device_key $device" >"$dir/authorized_devices"
coordinator_conf "$dir" "$port"
http_port=$(free_port)
printf '[http]\nlisten = "127.0.0.1:%s"\n' "$http_port" >>"$dir/coordinator.toml"

# One release per rollout, each a fresh random artifact (nothing the device holds to copy).
counter=1
declare -a rollouts=()
declare -A urls=()
for r in $(seq "$RUNS"); do
  for mode in $MODES; do
    counter=$((counter + 1))
    name="$mode-$r"
    head -c "$SIZE" /dev/urandom >"$dir/$name.bin"
    flags=()
    [ "$mode" = no-blocks ] && flags=(--no-blocks)
    if [ "$mode" = http ]; then
      urls[$name]="http://127.0.0.1:$http_port/artifacts/$(sha256sum "$dir/$name.bin" | cut -d' ' -f1)"
      flags=(--url "app=${urls[$name]}")
    fi
    "$flotilla" release create --data-dir "$dir/coordinator" --key "$dir/keys/release.key" \
      --name "$name" --version "2.0.$counter" --counter "$counter" --hardware bench-board \
      --artifact "app=$dir/$name.bin" "${flags[@]}" >/dev/null
    rm -f "$dir/$name.bin"
    printf 'name = "%s"\nrelease = "%s"\nselect = "bench=download"\n[groups]\ncount = 1\nsuccess = { threshold = "100%%", action = "next" }\n' \
      "$name" "$name" >"$dir/$name.toml"
    rollouts+=("$name")
  done
done

RUST_LOG=info "$flotilla" serve --config "$dir/coordinator.toml" >"$dir/coordinator.log" 2>&1 &
coordinator_pid=$!
pids+=("$coordinator_pid")
RUST_LOG=info "$agent" run --config "$dir/agent/agent.toml" >"$dir/agent/agent.log" 2>&1 &
agent_pid=$!
pids+=("$agent_pid")
cli() { "$flotilla" --broker "127.0.0.1:$port" --operator-key "$dir/keys/admin.key" "$@"; }
for _ in $(seq 600); do
  cli devices 2>/dev/null | grep "$device" >/dev/null && break
  sleep 0.1
done
cli devices 2>/dev/null | grep "$device" >/dev/null || die "the coordinator never saw $device: $(tail -3 "$dir/agent/agent.log")"

served() {
  curl -s "http://127.0.0.1:$metrics_port/metrics" 2>/dev/null |
    awk '/^flotilla_artifact_block_bytes_served_total/ {s += $2} END {printf "%d", s}'
}

say "flotilla download benchmark, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $profile build, data in $(df --output=fstype "$work" | tail -1)"
say "$(mosquitto -h 2>/dev/null | head -1); artifact $SIZE bytes; agent in_flight ${IN_FLIGHT:-default}"
say ""
printf '%-14s %10s %12s %12s %12s %10s %14s %8s\n' run to_first_s to_verified_s to_ready_s start_ready_s MB_s baseline_MB_s ratio | tee -a "$results"

stream() {
  "$fleetsim" --broker "127.0.0.1:$port" --stream-bytes "$SIZE" --timeout "$TIMEOUT" >"$dir/stream.txt" 2>"$dir/stream.log" \
    || die "baseline failed: $(tail -3 "$dir/stream.log")"
  field stream_mb_s "$dir/stream.txt"
}

# A process's CPU time (user + system) so far, seconds.
cpu_s() { awk -v t="$(getconf CLK_TCK)" '{printf "%.3f", ($14 + $15) / t}' "/proc/$1/stat"; }

# curl's rate for the same file from the same origin, MB/s.
curl_rate() {
  curl -sS -o /dev/null -w '%{speed_download}' "$1" | awk '{printf "%.1f", $1 / 1e6}'
}

# The same, written to a file in the data's file system and hashed on the way (curl | tee |
# openssl dgst -sha256, three processes): what a downloader that checks what it writes must do.
curl_checked_rate() {
  local t0 t1
  t0=$(date +%s.%N)
  curl -sS "$1" | tee "$dir/curl-checked.bin" | openssl dgst -sha256 >/dev/null
  t1=$(date +%s.%N)
  rm -f "$dir/curl-checked.bin"
  awk -v b="$SIZE" -v a="$t0" -v z="$t1" 'BEGIN {printf "%.1f", b / 1e6 / (z - a)}'
}

first=1
for name in "${rollouts[@]}"; do
  base=$(stream)
  mqtt_base="$base"
  if [ -n "${urls[$name]:-}" ]; then
    base=$(curl_rate "${urls[$name]}")
    checked=$(curl_checked_rate "${urls[$name]}")
  fi
  watch="$dir/$name.watch"
  "$fleetsim" --broker "127.0.0.1:$port" --watch-device "$device" --device-key "$device_key" \
    --timeout "$TIMEOUT" >"$watch" 2>"$watch.log" &
  watch_pid=$!
  pids+=("$watch_pid")
  wait_log "watching" "$watch.log"
  cli rollout create --spec "$dir/$name.toml" >"$dir/$name.create" 2>&1 || die "rollout create: $(cat "$dir/$name.create")"
  served_before=$(served)
  if [ -n "${PERF:-}" ] && [ "$first" = 1 ]; then
    perf record -F "${PERF_FREQ:-999}" -g -p "$agent_pid" -o "$dir/agent.perf" >/dev/null 2>&1 &
    perf_agent=$!
    perf record -F "${PERF_FREQ:-999}" -g -p "$coordinator_pid" -o "$dir/coordinator.perf" >/dev/null 2>&1 &
    perf_coordinator=$!
  fi
  agent_cpu=$(cpu_s "$agent_pid"); coordinator_cpu=$(cpu_s "$coordinator_pid")
  started=$(date +%s.%N)
  cli rollout start "$name" >"$dir/$name.start" 2>&1 || die "rollout start: $(cat "$dir/$name.start")"
  wait "$watch_pid" || die "watcher failed: $(tail -3 "$watch.log")"
  agent_cpu=$(awk -v a="$(cpu_s "$agent_pid")" -v b="$agent_cpu" 'BEGIN {printf "%.2f", a - b}')
  coordinator_cpu=$(awk -v a="$(cpu_s "$coordinator_pid")" -v b="$coordinator_cpu" 'BEGIN {printf "%.2f", a - b}')
  if [ -n "${PERF:-}" ] && [ "$first" = 1 ]; then
    kill -INT "$perf_agent" "$perf_coordinator"; wait "$perf_agent" "$perf_coordinator" 2>/dev/null || true
    for who in agent coordinator; do
      perf report -i "$dir/$who.perf" --no-children --percent-limit 1.5 --stdio 2>/dev/null \
        | grep -v '^$' | head -120 >"$results.$who.perf.txt" || true
    done
  fi
  first=0
  [ "$(field end_phase "$watch")" = Ready ] || die "$name ended $(field end_phase "$watch"), see $(tail -3 "$dir/agent/agent.log")"
  verified=$(field desired_to_verified_s "$watch")
  mbs=$(awk -v b="$SIZE" -v s="$verified" 'BEGIN {printf "%.1f", b / 1e6 / s}')
  printf '%-14s %10.3f %12.3f %12.3f %12.3f %10s %14s %8s\n' "$name" \
    "$(field desired_to_first_downloading_s "$watch")" "$verified" "$(field desired_to_end_s "$watch")" \
    "$(awk -v a="$started" -v b="$(field end_unix "$watch")" 'BEGIN {printf "%.3f", b - a}')" \
    "$mbs" "$base" "$(awk -v a="$mbs" -v b="$base" 'BEGIN {printf "%.2f", a / b}')" | tee -a "$results"
  echo "  $name: coordinator bytes $(field coordinator_bytes "$watch"), http bytes $(field http_bytes "$watch") (device's counts), block bytes served $(( $(served) - served_before )) (coordinator's metric), broker baseline $mqtt_base MB/s ($(field stream_s "$dir/stream.txt") s for $(field stream_messages "$dir/stream.txt") messages of $(field stream_message_bytes "$dir/stream.txt") bytes)" | tee -a "$results"
  if [ -n "${urls[$name]:-}" ]; then
    echo "  $name: baseline is curl from the same origin: $base MB/s" | tee -a "$results"
    echo "  $name: curl writing the file and hashing it on the way (curl | tee | openssl dgst -sha256): $checked MB/s" | tee -a "$results"
  fi
  # The transfer alone, as curl's figure is: from the first Downloading report (the block list
  # fetched, the first blocks asked) to Verified.
  transfer=$(awk -v v="$verified" -v f="$(field desired_to_first_downloading_s "$watch")" 'BEGIN {printf "%.3f", v - f}')
  transfer_mbs=$(awk -v b="$SIZE" -v s="$transfer" 'BEGIN {printf "%.1f", b / 1e6 / s}')
  echo "  $name: first Downloading -> Verified $transfer s, $transfer_mbs MB/s, $(awk -v a="$transfer_mbs" -v b="$base" 'BEGIN {printf "%.2f", a / b}')x the baseline" | tee -a "$results"
  if [ -n "${urls[$name]:-}" ]; then
    echo "  $name: the transfer is $(awk -v a="$transfer_mbs" -v b="$checked" 'BEGIN {printf "%.2f", a / b}')x curl writing and hashing" | tee -a "$results"
  fi
  echo "  $name: CPU from rollout start to Ready: agent $agent_cpu s, coordinator $coordinator_cpu s (user+sys)" | tee -a "$results"
  echo "  $name: the agent's peak RSS so far (VmHWM): $(awk '/VmHWM/ {print $2, $3}' "/proc/$agent_pid/status")" | tee -a "$results"
done
drops=$(grep -c "MQTT connection lost" "$dir/coordinator.log" || true)
say ""
say "link drops: coordinator $drops; load now $(cut -d' ' -f1-3 /proc/loadavg)"
say "results: $results"
