#!/usr/bin/env bash
# Fleet scale of one coordinator, measured beside a broker-only baseline in the same run.
#
# Usage (from anywhere): bench/fleet.sh [--sizes "1000 10000"] [--with-100k] [--debug]
# Environment: COORDINATOR_PROFILE (release, as shipped, or fleetsim: opt-level 3), PERF=1 (profile
#              the coordinator with perf; implies the fleetsim profile), KEEP=1 (keep the work
#              directory), DATA_ON_DISK=1 (data directories on disk instead of tmpfs),
#              CARGO_TARGET_DIR (default: <repo>/target), RESULTS (default
#              bench/results/fleet-<UTC date>.txt), FLEET_GROUPS (default 5), PHASES (agent|short,
#              default agent), TIMEOUT (per run, default 20m), MALLOC_STATS=1 (glibc's
#              per-arena figures after the rollout, via gdb: <results>.<n>.malloc.txt), HEAPTRACK=1
#              (the coordinator's heap profile until the restart: <results>.<n>.heaptrack.txt).
#
# Starts its own Mosquitto (deploy/mosquitto/mosquitto.conf with its TLS listeners, passwords and
# ACL replaced by one plain loopback listener), a coordinator (release build unless --debug) and
# flotilla-fleetsim, and for each fleet size prints:
#   - rollout wall time (first desired action to last final report, a 5-group [groups]
#     rollout, instant installs) beside the broker-only run moving the same desired actions,
#     reports and states through the same broker (fleetsim --baseline-groups);
#   - group transition latency p50/p99 (last final report of a group to the next group's first
#     desired action, as the devices see them) beside the baseline's;
#   - desired actions received per second while a group starts, beside the baseline's;
#   - coordinator RSS per managed device (VmRSS after the rollout, minus an empty
#     coordinator's, over the device count; VmHWM too);
#   - control request round trips (signed list_releases, every 200 ms) p50/p99 on the idle
#     coordinator and during the rollout;
#   - link drops (coordinator log "MQTT connection lost") and desired actions sent twice;
#   - the coordinator's CPU time (user + system) for the rollout and its whole life, and the
#     load average when each size starts (the machine may be shared);
#   - restart with every state retained: time to the first answered control request, to the
#     coordinator's end-of-retained marker coming back (`flotilla_registry_loading` 0), and to a
#     complete registry (the coordinator's `flotilla_messages_received_total{topic="state"}`
#     reaching the device count: every retained state read).
# Nothing here passes or fails on a number; docs/performance.md has the figures and the goals.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}"
export CARGO_TERM_COLOR=never
export PATH="$PATH:/usr/sbin"
sizes="1000 10000"
profile=release
while [ $# -gt 0 ]; do
  case "$1" in
    --sizes) sizes="$2"; shift 2 ;;
    --with-100k) sizes="$sizes 100000"; shift ;;
    --debug) profile=debug; shift ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "fleet.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
FLEET_GROUPS="${FLEET_GROUPS:-5}"
PHASES="${PHASES:-agent}"
TIMEOUT="${TIMEOUT:-20m}"
mkdir -p "$repo/bench/results"
results="${RESULTS:-$repo/bench/results/fleet-$(date -u +%Y-%m-%d).txt}"

bench=fleet.sh
# The coordinator as shipped (release profile). COORDINATOR_PROFILE=fleetsim (and PERF=1, which
# profiles the coordinator) build it with the fleetsim profile instead: opt-level 3 everywhere,
# thin LTO and symbols (the release profile builds the signature crates and the coordinator's own
# at opt-level 3 too, decision 0029).
if [ "$profile" = release ] && { [ -n "${PERF:-}" ] || [ "${COORDINATOR_PROFILE:-release}" = fleetsim ]; }; then
  profile=fleetsim
fi
# shellcheck source=bench/lib.sh
. "$repo/bench/lib.sh"
build_bins -p flotilla-coordinator
flotilla="$bin/flotilla"
make_work fleet
: >"$results"
kb() { awk -v k="$1:" '$1 == k {print $2}' "/proc/$2/status"; }

start_broker() {
  local dir="$1" port="$2"
  broker_conf "$port" >"$dir/mosquitto.conf"
  mosquitto -c "$dir/mosquitto.conf" >"$dir/mosquitto.log" 2>&1 &
  broker_pid=$!
  pids+=("$broker_pid")
  wait_port "$port"
}

# One site: keys, a release, an operator, the simulator's authorized keys, a coordinator config.
make_site() {
  local dir="$1" port="$2" n="$3"
  mkdir -p "$dir/keys"
  "$flotilla" keygen --out "$dir/keys" >/dev/null
  "$flotilla" operator keygen --out "$dir/keys" --name admin >/dev/null
  head -c 4096 /dev/urandom >"$dir/app.bin"
  "$flotilla" release create --data-dir "$dir/coordinator" --key "$dir/keys/release.key" \
    --name fw-2 --version 2.0.0 --counter 2 --hardware sim-board --artifact "app=$dir/app.bin" >/dev/null
  "$fleetsim" --count "$n" --write-authorized-keys "$dir/authorized_devices" >/dev/null
  coordinator_conf "$dir" "$port"
  cat >"$dir/spec.toml" <<EOF
name = "fleet"
release = "fw-2"
[groups]
count = $FLEET_GROUPS
success = { threshold = "100%", action = "next" }
EOF
}

start_coordinator() {
  local dir="$1"
  if [ -n "${HEAPTRACK:-}" ] && [ "$dir" = "$work/site-$n" ] && [ -z "${restarted:-}" ]; then
    # The first coordinator of each size under heaptrack (HEAPTRACK=1): its heap profile goes to
    # <results>.<n>.heaptrack.zst, and the largest consumers to <results>.<n>.heaptrack.txt.
    RUST_LOG=info heaptrack -o "$results.$n.heaptrack" "$flotilla" serve --config "$dir/coordinator.toml" >>"$dir/coordinator.log" 2>&1 &
    pids+=("$!")
    coordinator_pid=""
    for _ in $(seq 200); do
      coordinator_pid=$(pgrep -f -n "^$flotilla serve --config $dir/coordinator.toml" || true)
      [ -n "$coordinator_pid" ] && break
      sleep 0.05
    done
    [ -n "$coordinator_pid" ] || die "the coordinator did not start under heaptrack"
  else
    RUST_LOG=info "$flotilla" serve --config "$dir/coordinator.toml" >>"$dir/coordinator.log" 2>&1 &
    coordinator_pid=$!
  fi
  pids+=("$coordinator_pid")
}

# Stops the coordinator and waits until it is gone (under heaptrack it is not this shell's child).
stop_coordinator() {
  kill -TERM "$coordinator_pid" 2>/dev/null || true
  wait "$coordinator_pid" 2>/dev/null || true
  for _ in $(seq 600); do kill -0 "$coordinator_pid" 2>/dev/null || return 0; sleep 0.05; done
}

# User + system CPU seconds of a process so far.
cpu_s() { awk -v t="$(getconf CLK_TCK)" '{printf "%.2f", ($14 + $15) / t}' "/proc/$1/stat"; }

# Seconds from $1 (date +%s.%N) until the coordinator has read $2 retained states.
until_registry() {
  local since="$1" want="$2" got
  for _ in $(seq 6000); do
    got=$(curl -s "http://127.0.0.1:$metrics_port/metrics" 2>/dev/null |
      awk '/^flotilla_messages_received_total\{.*topic="state"/ {print $2}' || true)
    if [ -n "$got" ] && [ "${got%.*}" -ge "$want" ]; then
      awk -v a="$since" -v b="$(date +%s.%N)" 'BEGIN {printf "%.3f", b - a}'
      return
    fi
    sleep 0.05
  done
  echo "more than 300"
}

# Seconds from $1 until the coordinator says it has read every retained state (its own
# end-of-retained marker came back: flotilla_registry_loading 0); commands that change anything
# wait until then.
until_loaded() {
  local since="$1" got
  for _ in $(seq 6000); do
    got=$(curl -s "http://127.0.0.1:$metrics_port/metrics" 2>/dev/null |
      awk '/^flotilla_registry_loading / {print $2}' || true)
    if [ "$got" = "0" ]; then
      awk -v a="$since" -v b="$(date +%s.%N)" 'BEGIN {printf "%.3f", b - a}'
      return
    fi
    sleep 0.05
  done
  echo "more than 300"
}

cli() {
  "$flotilla" --broker "127.0.0.1:$port" --operator-key "$dir/keys/admin.key" "$@"
}

# Seconds until a control request is answered (a signed request every 20 ms).
until_answer() {
  "$fleetsim" --broker "127.0.0.1:$port" --probe-key "$dir/keys/admin.key" --first-answer \
    --timeout 5m 2>/dev/null | awk '{print $2}'
}

say "flotilla fleet benchmark, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $profile build, $FLEET_GROUPS groups, phases $PHASES, data in $(df --output=fstype "$work" | tail -1)"
say "$(mosquitto -h 2>/dev/null | head -1)"
say ""

for n in $sizes; do
  say "== $n devices (load $(cut -d' ' -f1-3 /proc/loadavg))"
  # The broker-only baseline: the same messages through a fresh broker of the same settings.
  dir="$work/base-$n"; mkdir -p "$dir"; port=$(free_port)
  start_broker "$dir" "$port"
  "$fleetsim" --broker "127.0.0.1:$port" --count "$n" --phases "$PHASES" --baseline-groups "$FLEET_GROUPS" \
    --timeout "$TIMEOUT" --progress 10s --summary "$dir/summary.json" >"$dir/summary.txt" 2>"$dir/fleetsim.log" \
    || die "baseline run failed: $(tail -3 "$dir/fleetsim.log")"
  kill "$broker_pid"; wait "$broker_pid" 2>/dev/null || true
  base="$dir/summary.txt"

  # The coordinator.
  dir="$work/site-$n"; mkdir -p "$dir"; port=$(free_port)
  start_broker "$dir" "$port"
  make_site "$dir" "$port" "$n"
  start_coordinator "$dir"
  until_answer >/dev/null
  empty_rss=$(kb VmRSS "$coordinator_pid")
  "$fleetsim" --broker "127.0.0.1:$port" --count "$n" --phases "$PHASES" \
    --coordinator-key "$dir/keys/coordinator.pub" --probe-key "$dir/keys/admin.key" --groups "$FLEET_GROUPS" \
    --until-done --timeout "$TIMEOUT" --progress 10s --summary "$dir/summary.json" \
    >"$dir/summary.txt" 2>"$dir/fleetsim.log" &
  sim_pid=$!
  pids+=("$sim_pid")
  # Registration: wait until the broker has taken every state and the coordinator has read
  # them all (create plans over the registered fleet; a partial registry is a partial rollout).
  for _ in $(seq 6000); do
    grep -q "every device's state is queued" "$dir/fleetsim.log" && break
    sleep 0.05
  done
  registered_s=$(until_registry "$(date +%s.%N)" "$n")
  registered_rss=$(kb VmRSS "$coordinator_pid")
  registered_cpu=$(cpu_s "$coordinator_pid")
  if [ -n "${PERF:-}" ]; then
    # A profile of the coordinator during the rollout (PERF=1): bench/results/fleet-<n>.perf.txt.
    perf record -F 499 -g -p "$coordinator_pid" -o "$dir/perf.data" >/dev/null 2>&1 &
    perf_pid=$!
  fi
  cli rollout create --spec "$dir/spec.toml" >"$dir/create.out" 2>&1 || true
  cli rollout start fleet >"$dir/start.out" 2>&1 || true
  wait "$sim_pid" || die "simulator failed at $n devices: $(tail -3 "$dir/fleetsim.log")"
  if [ -n "${PERF:-}" ]; then
    kill -INT "$perf_pid"; wait "$perf_pid" 2>/dev/null || true
    perf report -i "$dir/perf.data" --no-children --percent-limit 2 --stdio 2>/dev/null \
      | grep -v '^$' | head -80 >"$results.$n.perf.txt" || true
  fi
  after_rss=$(kb VmRSS "$coordinator_pid")
  if [ -n "${MALLOC_STATS:-}" ]; then
    # glibc's per-arena figures after the rollout (MALLOC_STATS=1, needs gdb):
    # bench/results/fleet-<n>.malloc.txt.
    gdb -p "$coordinator_pid" -batch -ex 'call (void) malloc_stats()' >/dev/null 2>&1 || true
    sleep 1
    { grep -A3 '^Arena\|^Total' "$dir/coordinator.log"; grep -E 'Rss|Anon' "/proc/$coordinator_pid/smaps_rollup"; } \
      >"$results.$n.malloc.txt" 2>/dev/null || true
  fi
  after_cpu=$(cpu_s "$coordinator_pid")
  hwm=$(kb VmHWM "$coordinator_pid")
  sim="$dir/summary.txt"
  drops=$(grep -c "MQTT connection lost" "$dir/coordinator.log" || true)

  say "registration:             the coordinator read every state $registered_s s after the broker had them all"
  say "rollout wall time:        $(field rollout_s "$sim") s   (broker-only $(field rollout_s "$base") s, ratio $(awk -v a="$(field rollout_s "$sim")" -v b="$(field rollout_s "$base")" 'BEGIN {printf "%.1f", a / b}')x)"
  say "group transition p50/p99: $(field transition_p50_ms "$sim") / $(field transition_p99_ms "$sim") ms over $(field transitions "$sim")   (broker-only $(field transition_p50_ms "$base") / $(field transition_p99_ms "$base") ms)"
  say "desired actions/s:        $(field desired_per_s "$sim")   (broker-only $(field desired_per_s "$base"))"
  say "coordinator RSS:          empty $((empty_rss / 1024)) MiB, registered $((registered_rss / 1024)) MiB, after the rollout $((after_rss / 1024)) MiB (peak $((hwm / 1024)) MiB)"
  say "  per managed device:     $(awk -v a="$after_rss" -v e="$empty_rss" -v n="$n" 'BEGIN {printf "%.2f", (a - e) * 1024 / n / 1024}') KiB after the rollout, $(awk -v a="$registered_rss" -v e="$empty_rss" -v n="$n" 'BEGIN {printf "%.2f", (a - e) * 1024 / n / 1024}') KiB registered"
  say "coordinator CPU:          $(awk -v a="$after_cpu" -v r="$registered_cpu" 'BEGIN {printf "%.2f", a - r}') s user+sys from registration to the end of the rollout, $after_cpu s in all; load now $(cut -d' ' -f1-3 /proc/loadavg)"
  say "control round trip p50/p99: idle $(field probe_idle_p50_ms "$sim") / $(field probe_idle_p99_ms "$sim") ms ($(field probe_idle "$sim")), during the rollout $(field probe_rollout_p50_ms "$sim") / $(field probe_rollout_p99_ms "$sim") ms ($(field probe_rollout "$sim")), unanswered $(field probe_unanswered "$sim")"
  say "devices ready/failed:     $(field ready "$sim") / $(field failed "$sim") of $n; desired $(field desired "$sim"), sent twice $(field desired_duplicates "$sim"), refused $(field refused "$sim")"
  say "link drops:               coordinator $drops, simulator $(field connections_lost "$sim")"
  say "create/start replies:     $(head -c 120 "$dir/create.out" | tr '\n' ' ') / $(head -c 120 "$dir/start.out" | tr '\n' ' ')"

  # Restart with every state retained (the largest size is the one that matters).
  stop_coordinator
  if [ -n "${HEAPTRACK:-}" ]; then
    for _ in $(seq 600); do [ -e "$results.$n.heaptrack.zst" ] && break; sleep 0.1; done
    sleep 2
    heaptrack_print -f "$results.$n.heaptrack.zst" --print-peaks --peak-limit 25 --print-allocators 0 \
      --print-leaks 0 --print-temporary 0 2>/dev/null | grep -v '^\s*$' | head -200 \
      >"$results.$n.heaptrack.txt" || true
  fi
  restarted=1
  restart_at=$(date +%s.%N)
  start_coordinator "$dir"
  until_registry "$restart_at" "$n" >"$dir/registry.out" &
  registry_pid=$!
  until_loaded "$restart_at" >"$dir/loaded.out" &
  loaded_pid=$!
  first=$(until_answer)
  wait "$registry_pid" || true
  wait "$loaded_pid" || true
  say "restart to first answer:  $first s with $n retained states; registry complete after $(cat "$dir/registry.out") s (CPU $(cpu_s "$coordinator_pid") s); marker back (changes accepted) after $(cat "$dir/loaded.out") s"
  # Where the restart's time went before the coordinator connected (its start-up log line).
  say "restart before connecting: $(grep 'coordinator starting' "$dir/coordinator.log" | tail -1 |
    grep -oE '(store_open_ms|rollouts_ms|other_records_ms|engine_ms)=[0-9]+' | tr '\n' ' ')"
  stop_coordinator
  restarted=""
  kill "$broker_pid"; wait "$broker_pid" 2>/dev/null || true
  cp "$sim" "$results.$n.fleetsim.txt"; cp "$base" "$results.$n.baseline.txt"
  say ""
done
say "results: $results"
