#!/usr/bin/env bash
# Fleet scale of one coordinator, measured beside a broker-only baseline in the same run.
#
# Usage (from anywhere): bench/fleet.sh [--sizes "1000 10000"] [--with-100k] [--debug]
#                                       [--stores "sled postgres"] [--no-failover]
# Headline: the coordinator's CPU per 1,000 devices rolled out (ms), with Mosquitto's and the
# simulator's for the same span.
# Environment: COORDINATOR_PROFILE (release, as shipped, or fleetsim: opt-level 3), PERF=1 (profile
#              the coordinator with perf; implies the fleetsim profile), KEEP=1 (keep the work
#              directory), DATA_ON_DISK=1 (data directories on disk instead of tmpfs),
#              CARGO_TARGET_DIR (default: <repo>/target), RESULTS (default
#              bench/results/fleet-<UTC date>.txt), FLEET_GROUPS (default 21: 20 transitions),
#              PHASES (agent|short, default agent), TIMEOUT (per run, default 20m), IDLE_PROBES
#              (default 200), SIGN_AHEAD (default 1; 0: the simulator signs as it sends),
#              PERF_RESTART=1 (profile the coordinator's restart, from its start to a complete
#              registry: <results>.<n>.<store>.restart.perf.txt; implies the fleetsim profile),
#              MALLOC_STATS=1 (glibc's
#              per-arena figures after the rollout, via gdb: <results>.<n>.<store>.malloc.txt),
#              HEAPTRACK=1 (the heap profile of the coordinator on sled until the restart:
#              <results>.<n>.heaptrack.txt),
#              BROKER (mosquitto, the default, or nats: a three-node NATS cluster, below),
#              BASELINE=0 (skip the broker-only run; its figures print empty),
#              COORDINATOR_ARENAS (glibc malloc arenas of the coordinator: 2, as its systemd
#              unit sets them, by default; a number, or default for glibc's own; bench/lib.sh).
#
# --stores "sled postgres" (default: sled) runs each size once per store, one after the other
# against the same broker settings and the same baseline, and prints the stores side by side.
# PostgreSQL is a private cluster the script starts (bench/pg.sh: initdb in the work directory,
# a free loopback port, fsync on), the coordinator on it with the default lease timings. With
# postgres among the stores, the largest size also runs a failover (unless --no-failover): a
# leader and a standby coordinator on one fresh database, the leader killed (SIGKILL) when
# group 3 of the rollout starts; it prints the time from the kill to the standby taking the
# lease, to the first desired action it publishes (as a subscriber on every device's `desired`
# topic sees it), and to its first answered control request, and whether the rollout finished
# with no desired action sent twice.
#
# Starts its own Mosquitto (deploy/mosquitto/mosquitto.conf with its TLS listeners, passwords and
# ACL replaced by one plain loopback listener), a coordinator (release build unless --debug) and
# flotilla-fleetsim, and for each fleet size prints:
#   - the headline: the coordinator's CPU (user + system) per 1,000 devices rolled out, from the
#     moment it has read every device's state to the end of the rollout, over n/1000, with the
#     broker's (Mosquitto's) and the simulator's CPU for the same span beside it (the simulator
#     prepares its signatures before connecting, fleetsim --sign-ahead, so that its share of
#     the two cores is small; SIGN_AHEAD=0 signs the ordinary way, for comparison);
#   - rollout wall time (first desired action to last final report, a FLEET_GROUPS-group
#     [groups] rollout, instant installs) beside the broker-only run moving the same desired
#     actions, reports and states through the same broker (fleetsim --baseline-groups), and
#     that run's simulator and Mosquitto CPU;
#   - group transition latency p50/p99 (last final report of a group to the next group's first
#     desired action, as the devices see them) and how many transitions it is over
#     (FLEET_GROUPS - 1: 20 by default), beside the baseline's;
#   - desired actions received per second while a group starts, beside the baseline's;
#   - coordinator RSS per managed device (VmRSS after the rollout, minus an empty
#     coordinator's, over the device count; VmHWM too);
#   - control request round trips (a signed list_releases), each with its p50/p99 and count:
#     idle (IDLE_PROBES requests one at a time, before the fleet registers: the coordinator has
#     nothing else to do), while registering (every 200 ms from the simulator's start until the
#     first desired action: the coordinator is reading the fleet's states) and busy (every
#     200 ms during the rollout);
#   - link drops (coordinator log "MQTT connection lost") and desired actions sent twice;
#   - the load average when each size starts and after each figure (the machine may be shared);
#   - restart with every state retained: time to the first answered control request, to the
#     coordinator's end-of-retained marker coming back (`flotilla_registry_loading` 0), and to a
#     complete registry (the coordinator's `flotilla_messages_received_total{topic="state"}`
#     reaching the device count: every retained state read), beside a plain `mosquitto_sub`
#     reading the same retained states from the same broker (the coordinator stopped).
# At the end, a table of the headline and the probe and transition percentiles per size.
#
# BROKER=nats runs the same against a three-node NATS cluster (bench/nats.sh) instead of
# Mosquitto: each node from the shipped deploy/nats files, its TLS and users replaced by a plain
# loopback MQTT listener without logins, JetStream and `stream_replicas` as shipped, its store in
# the work directory. The coordinator and the CLI use node 1, the simulator (and the broker-only
# baseline, both its connections) node 2, the restart's mosquitto_sub node 3. The broker's CPU
# is the three nodes' summed; each size also prints each node's RSS, CPU, store and log counts,
# and a failed run leaves <results>.nats-failure.txt (and .logs: the nodes' warnings by kind).
# Run with the sled store only so far; postgres and the failover use node 1 throughout.
# Nothing here passes or fails on a number; docs/performance.md has the figures and the goals.
#
# Bytes mode (issue 23): BYTES="mqtt http" (environment; any of none, mqtt, http) replaces the
# runs above: for each size (use --sizes 10000) and each mode, one rollout through a fresh broker
# and coordinator of a release whose one artifact is ARTIFACT_SIZE random bytes (default 262144,
# 256 KiB, 4 blocks), every simulated device downloading it before it reports Verified
# (fleetsim --download MODE, at most DOWNLOAD_AT_ONCE devices at a time, default 64):
#   - mqtt: signed block requests to the coordinator, blocks back through the broker;
#   - http: the release made with --url, the artifact's location on the coordinator's own
#     `GET /artifacts/{sha256}` ([http] listen on a free port), range requests from each device
#     (the block list, 128 bytes, still comes over MQTT, as the agent fetches it);
#   - none: no download (the ordinary run's instant installs), for reference.
# It prints, per mode and side by side: the coordinator's CPU and Mosquitto's from registration
# to the end of the rollout, the bytes through the broker in that span (Mosquitto's
# $SYS/broker/bytes/received and sent, sys_interval 1 s), block bytes the coordinator served over
# MQTT (flotilla_artifact_block_bytes_served_total), the bytes the coordinator's HTTP origin
# sent (flotilla_artifact_http_bytes_served_total), the bytes the devices reported from HTTP
# (flotilla_device_bytes_total{source="http"}; the simulator's own count of HTTP body bytes
# beside it), and the rollout's wall time.
# Results: RESULTS (default bench/results/fleet-<UTC date>-bytes.txt).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}"
export CARGO_TERM_COLOR=never
export PATH="$PATH:/usr/sbin"
sizes="1000 10000"
profile=release
stores=sled
failover=1
while [ $# -gt 0 ]; do
  case "$1" in
    --sizes) sizes="$2"; shift 2 ;;
    --with-100k) sizes="$sizes 100000"; shift ;;
    --debug) profile=debug; shift ;;
    --stores) stores="$2"; shift 2 ;;
    --no-failover) failover=""; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "fleet.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
FLEET_GROUPS="${FLEET_GROUPS:-21}"
PHASES="${PHASES:-agent}"
TIMEOUT="${TIMEOUT:-20m}"
IDLE_PROBES="${IDLE_PROBES:-200}"
SIGN_AHEAD="${SIGN_AHEAD:-1}"
BROKER="${BROKER:-mosquitto}"
case "$BROKER" in mosquitto|nats) ;; *) echo "fleet.sh: unknown BROKER $BROKER (mosquitto or nats)" >&2; exit 2 ;; esac
sign_ahead=()
if [ "$SIGN_AHEAD" = 1 ]; then sign_ahead=(--sign-ahead); fi
mkdir -p "$repo/bench/results"
results="${RESULTS:-$repo/bench/results/fleet-$(date -u +%Y-%m-%d).txt}"
BYTES="${BYTES:-}"
ARTIFACT_SIZE="${ARTIFACT_SIZE:-262144}"
DOWNLOAD_AT_ONCE="${DOWNLOAD_AT_ONCE:-64}"
for m in $BYTES; do
  case "$m" in none|mqtt|http) ;; *) echo "fleet.sh: unknown BYTES mode $m (none, mqtt or http)" >&2; exit 2 ;; esac
done
if [ -n "$BYTES" ]; then results="${RESULTS:-$repo/bench/results/fleet-$(date -u +%Y-%m-%d)-bytes.txt}"; fi

bench=fleet.sh
# The coordinator as shipped (release profile). COORDINATOR_PROFILE=fleetsim (and PERF=1, which
# profiles the coordinator) build it with the fleetsim profile instead: opt-level 3 everywhere,
# thin LTO and symbols (the release profile builds the signature crates and the coordinator's own
# at opt-level 3 too, decision 0029).
if [ "$profile" = release ] && { [ -n "${PERF:-}" ] || [ -n "${PERF_RESTART:-}" ] || [ "${COORDINATOR_PROFILE:-release}" = fleetsim ]; }; then
  profile=fleetsim
fi
for s in $stores; do
  case "$s" in sled|postgres) ;; *) echo "fleet.sh: unknown store $s (sled or postgres)" >&2; exit 2 ;; esac
done
# shellcheck source=bench/lib.sh
. "$repo/bench/lib.sh"
# shellcheck source=bench/pg.sh
. "$repo/bench/pg.sh"
broker_name=Mosquitto
if [ "$BROKER" = nats ]; then
  # shellcheck source=bench/nats.sh
  . "$repo/bench/nats.sh"
  broker_name="NATS (3 nodes summed)"
fi
case " $stores " in
  *" postgres "*)
    pg_bin=$(pg_bin_dir)
    command -v mosquitto_sub >/dev/null || die "mosquitto_sub not found (apt-get install mosquitto-clients)" ;;
esac
build_bins -p flotilla-coordinator
flotilla="$bin/flotilla"
make_work fleet
: >"$results"
kb() { awk -v k="$1:" '$1 == k {print $2}' "/proc/$2/status"; }

start_broker() {
  local dir="$1" port="$2"
  if [ "$BROKER" = nats ]; then start_nats "$dir" "$port"; return; fi
  broker_conf "$port" >"$dir/mosquitto.conf"
  mosquitto -c "$dir/mosquitto.conf" >"$dir/mosquitto.log" 2>&1 &
  broker_pid=$!
  pids+=("$broker_pid")
  wait_port "$port"
}

# The broker's CPU so far (user + system seconds): Mosquitto's, or the NATS nodes' summed.
broker_cpu_s() {
  if [ "$BROKER" = nats ]; then nats_cpu_s; else cpu_s "$broker_pid"; fi
}

stop_broker() {
  if [ "$BROKER" = nats ]; then stop_nats; return; fi
  kill "$broker_pid"; wait "$broker_pid" 2>/dev/null || true
}

# The MQTT port of the simulator (and the broker-only baseline), and of the restart's
# mosquitto_sub: the broker's, or NATS nodes 2 and 3 (the coordinator uses node 1).
fleet_port() {
  if [ "$BROKER" = nats ]; then echo "${nats_ports[2]}"; else echo "$port"; fi
}
sub_port() {
  if [ "$BROKER" = nats ]; then echo "${nats_ports[3]}"; else echo "$port"; fi
}

# The broker-only run's simulator. BASELINE=0 skips it (its figures print empty): for a size
# where the broker alone takes longer than the time at hand (the NATS cluster at 100k).
baseline_fleetsim() {
  if [ "${BASELINE:-1}" = 0 ]; then echo "skipped (BASELINE=0)" >&2; return 0; fi
  "$fleetsim" "$@"
}

# One site: keys, a release, an operator, the simulator's authorized keys, a coordinator config.
# Optional: $4, the artifact's size (default 4096); $5, a port on which the coordinator's own
# HTTP origin will listen, which the release then names as its artifact's location.
make_site() {
  local dir="$1" port="$2" n="$3" size="${4:-4096}" origin="${5:-}" flags=()
  mkdir -p "$dir/keys"
  "$flotilla" keygen --out "$dir/keys" >/dev/null
  "$flotilla" operator keygen --out "$dir/keys" --name admin >/dev/null
  head -c "$size" /dev/urandom >"$dir/app.bin"
  if [ -n "$origin" ]; then
    flags=(--url "app=http://127.0.0.1:$origin/artifacts/$(sha256sum "$dir/app.bin" | cut -d' ' -f1)")
  fi
  "$flotilla" release create --data-dir "$dir/coordinator" --key "$dir/keys/release.key" \
    --name fw-2 --version 2.0.0 --counter 2 --hardware sim-board --artifact "app=$dir/app.bin" "${flags[@]}" >/dev/null
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
    RUST_LOG=info env "${coordinator_env[@]}" heaptrack -o "$results.$n.heaptrack" "$flotilla" serve --config "$dir/coordinator.toml" >>"$dir/coordinator.log" 2>&1 &
    pids+=("$!")
    coordinator_pid=""
    for _ in $(seq 200); do
      coordinator_pid=$(pgrep -f -n "^$flotilla serve --config $dir/coordinator.toml" || true)
      [ -n "$coordinator_pid" ] && break
      sleep 0.05
    done
    [ -n "$coordinator_pid" ] || die "the coordinator did not start under heaptrack"
  else
    RUST_LOG=info env "${coordinator_env[@]}" "$flotilla" serve --config "$dir/coordinator.toml" >>"$dir/coordinator.log" 2>&1 &
    coordinator_pid=$!
  fi
  pids+=("$coordinator_pid")
}

# Starts flotilla-fleetsim with N devices for the site in DIR (more arguments are passed on),
# sets sim_pid, and waits until the broker has taken every device's state.
start_fleet() {
  local dir="$1" n="$2"
  shift 2
  "$fleetsim" --broker "127.0.0.1:$(fleet_port)" --count "$n" --phases "$PHASES" \
    --coordinator-key "$dir/keys/coordinator.pub" --groups "$FLEET_GROUPS" "${sign_ahead[@]}" "$@" \
    --until-done --timeout "$TIMEOUT" --progress 10s --summary "$dir/summary.json" \
    >"$dir/summary.txt" 2>"$dir/fleetsim.log" &
  sim_pid=$!
  pids+=("$sim_pid")
  for _ in $(seq 6000); do
    grep -q "every device's state is queued" "$dir/fleetsim.log" && break
    sleep 0.05
  done
}

# Stops the coordinator and waits until it is gone (under heaptrack it is not this shell's child).
stop_coordinator() {
  kill -TERM "$coordinator_pid" 2>/dev/null || true
  wait "$coordinator_pid" 2>/dev/null || true
  for _ in $(seq 600); do kill -0 "$coordinator_pid" 2>/dev/null || return 0; sleep 0.05; done
}

# User + system CPU seconds of a process so far (after the command name, which may hold spaces).
cpu_s() { sed 's/^.*) //' "/proc/$1/stat" | awk -v t="$(getconf CLK_TCK)" '{printf "%.2f", ($12 + $13) / t}'; }
# CPU milliseconds per 1,000 devices: seconds $1 over $2 devices.
per_k() { awk -v c="$1" -v n="$2" 'BEGIN {printf "%.0f", c * 1000 * 1000 / n}'; }
load() { cut -d' ' -f1-3 /proc/loadavg; }

# Seconds for a plain mosquitto_sub to read every device's retained state ($1 of them) from the
# broker on $port: the yardstick for the coordinator's "registry complete".
mosquitto_sub_s() {
  local want="$1" t0
  t0=$(date +%s.%N)
  if timeout 300 mosquitto_sub -h 127.0.0.1 -p "$(sub_port)" -q 1 -t 'flotilla/v1/devices/+/state' \
    -C "$want" >/dev/null 2>&1; then
    awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.3f", b - a}'
  else
    echo "more than 300"
  fi
}

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

# Round trips to the idle coordinator: IDLE_PROBES requests one at a time, into $dir/idle.txt.
idle_probes() {
  "$fleetsim" --broker "127.0.0.1:$port" --probe-key "$dir/keys/admin.key" \
    --idle-probes "$IDLE_PROBES" --timeout 5s >"$dir/idle.txt" 2>>"$dir/idle.log" || true
}

say "flotilla fleet benchmark, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, load $(load), $profile build, $FLEET_GROUPS groups, phases $PHASES, data in $(df --output=fstype "$work" | tail -1), stores: $stores, simulator signs $([ "$SIGN_AHEAD" = 1 ] && echo "ahead (--sign-ahead)" || echo "as it sends"), coordinator ${coordinator_env[*]}"
if [ "$BROKER" = nats ]; then
  say "nats-server $(nats-server --version | awk '{print $NF}'): three nodes on loopback from deploy/nats (no TLS, no logins), JetStream stream_replicas $(awk '/stream_replicas/ {print $2}' deploy/nats/cluster.conf); coordinator on node 1, simulator on node 2, restart's mosquitto_sub on node 3; broker CPU is the three nodes' summed"
else
say "$(mosquitto -h 2>/dev/null | head -1)"
fi
case " $stores " in *" postgres "*) say "$(pg_tool postgres --version) (private cluster, fsync on, default lease ttl 15 s, renew 5 s, margin 3 s)" ;; esac
say ""

# The figures of each store at the current size, for the side-by-side table: fig[store.name].
declare -A fig
# The headline rows of every size and store, printed again at the end.
headlines=()

# One rollout of N devices on STORE (sled or postgres), through a fresh broker, with its restart.
run_store() {
  local store="$1" n="$2"
  local empty_rss registered_s registered_rss registered_cpu after_rss after_cpu hwm sim drops
  local broker_registered broker_after sim_registered sim_after span_cpu broker_span sim_span idle
  local sub_s
  local pg_after_pss="" pg_after_rss=""
  say "-- $store"
  if [ "$store" = sled ]; then dir="$work/site-$n"; else dir="$work/pg-$n"; fi
  mkdir -p "$dir"; port=$(free_port)
  start_broker "$dir" "$port"
  make_site "$dir" "$port" "$n"
  if [ "$store" = postgres ]; then
    start_pg "$dir"
    pg_store_conf bench-a >>"$dir/coordinator.toml"
  fi
  start_coordinator "$dir"
  until_answer >/dev/null
  # The idle probe: before the fleet registers, nothing else for the coordinator to do.
  idle_probes
  idle="$dir/idle.txt"
  empty_rss=$(kb VmRSS "$coordinator_pid")
  # Registration: wait until the broker has taken every state and the coordinator has read
  # them all (create plans over the registered fleet; a partial registry is a partial rollout).
  start_fleet "$dir" "$n" --probe-key "$dir/keys/admin.key"
  registered_s=$(until_registry "$(date +%s.%N)" "$n")
  # The timed span starts here: the coordinator has read every state, the simulator has
  # prepared its signatures and registered, the broker holds the states.
  registered_rss=$(kb VmRSS "$coordinator_pid")
  registered_cpu=$(cpu_s "$coordinator_pid")
  broker_registered=$(broker_cpu_s)
  sim_registered=$(cpu_s "$sim_pid" 2>/dev/null || echo "")
  if [ -n "${PERF:-}" ]; then
    # A profile of the coordinator during the rollout (PERF=1): <results>.<n>.<store>.perf.txt.
    perf record -F 499 -g -p "$coordinator_pid" -o "$dir/perf.data" >/dev/null 2>&1 &
    perf_pid=$!
  fi
  cli rollout create --spec "$dir/spec.toml" >"$dir/create.out" 2>&1 || true
  cli rollout start fleet >"$dir/start.out" 2>&1 || true
  wait "$sim_pid" || die "simulator failed at $n devices on $store: $(tail -3 "$dir/fleetsim.log")"
  if [ -n "${PERF:-}" ]; then
    kill -INT "$perf_pid"; wait "$perf_pid" 2>/dev/null || true
    perf report -i "$dir/perf.data" --no-children --percent-limit 2 --stdio 2>/dev/null \
      | grep -v '^$' | head -80 >"$results.$n.$store.perf.txt" || true
  fi
  after_rss=$(kb VmRSS "$coordinator_pid")
  if [ "$store" = postgres ]; then
    pg_after_pss=$(pg_pss_kb); pg_after_rss=$(pg_rss_kb)
  fi
  if [ -n "${MALLOC_STATS:-}" ]; then
    # glibc's per-arena figures after the rollout (MALLOC_STATS=1, needs gdb):
    # <results>.<n>.<store>.malloc.txt.
    gdb -p "$coordinator_pid" -batch -ex 'call (void) malloc_stats()' >/dev/null 2>&1 || true
    sleep 1
    { grep -A3 '^Arena\|^Total' "$dir/coordinator.log"; grep -E 'Rss|Anon' "/proc/$coordinator_pid/smaps_rollup"; } \
      >"$results.$n.$store.malloc.txt" 2>/dev/null || true
  fi
  after_cpu=$(cpu_s "$coordinator_pid")
  broker_after=$(broker_cpu_s)
  hwm=$(kb VmHWM "$coordinator_pid")
  sim="$dir/summary.txt"
  # The simulator has exited: its CPU at the end is in its summary (its whole life).
  sim_after=$(field cpu_s "$sim")
  span_cpu=$(awk -v a="$after_cpu" -v r="$registered_cpu" 'BEGIN {printf "%.2f", a - r}')
  broker_span=$(awk -v a="$broker_after" -v r="$broker_registered" 'BEGIN {printf "%.2f", a - r}')
  sim_span=$(awk -v a="$sim_after" -v r="$sim_registered" 'BEGIN {if (a == "" || a == "-" || r == "") print "-"; else printf "%.2f", a - r}')
  drops=$(grep -c "MQTT connection lost" "$dir/coordinator.log" || true)

  say "HEADLINE coordinator CPU: $(per_k "$span_cpu" "$n") ms per 1,000 devices rolled out ($span_cpu s user+sys, registration to the end of the rollout); same span: $broker_name $(per_k "$broker_span" "$n") ms ($broker_span s), simulator $([ "$sim_span" = - ] && echo "-" || per_k "$sim_span" "$n") ms ($sim_span s); load $(load)"
  say "registration:             the coordinator read every state $registered_s s after the broker had them all"
  say "rollout wall time:        $(field rollout_s "$sim") s   (broker-only $(field rollout_s "$base") s, ratio $(awk -v a="$(field rollout_s "$sim")" -v b="$(field rollout_s "$base")" 'BEGIN {printf "%.1f", a / b}')x)"
  say "group transition p50/p99: $(field transition_p50_ms "$sim") / $(field transition_p99_ms "$sim") ms over $(field transitions "$sim") transitions, max $(field transition_max_ms "$sim") ms   (broker-only $(field transition_p50_ms "$base") / $(field transition_p99_ms "$base") ms over $(field transitions "$base"))"
  say "desired actions/s:        $(field desired_per_s "$sim")   (broker-only $(field desired_per_s "$base"))"
  say "coordinator RSS:          empty $((empty_rss / 1024)) MiB, registered $((registered_rss / 1024)) MiB, after the rollout $((after_rss / 1024)) MiB (peak $((hwm / 1024)) MiB)"
  say "  per managed device:     $(awk -v a="$after_rss" -v e="$empty_rss" -v n="$n" 'BEGIN {printf "%.2f", (a - e) * 1024 / n / 1024}') KiB after the rollout, $(awk -v a="$registered_rss" -v e="$empty_rss" -v n="$n" 'BEGIN {printf "%.2f", (a - e) * 1024 / n / 1024}') KiB registered"
  if [ "$store" = postgres ]; then
    say "PostgreSQL memory:        $((pg_after_pss / 1024)) MiB PSS (every server process, shared buffers once), $((pg_after_rss / 1024)) MiB RSS summed, after the rollout; database $(pg_db_size)"
  fi
  say "coordinator CPU:          $span_cpu s user+sys from registration to the end of the rollout, $after_cpu s in all; load now $(load)"
  say "simulator:                $(field cpu_s "$sim") s CPU in all ($sim_registered s before the span: keys, $(field nonces_prepared "$sim") nonces prepared, registration); $(field signed_ahead "$sim") messages signed ahead"
  if [ "$store" = postgres ]; then
    say "PostgreSQL CPU:           $(pg_cpu_s) s user+sys, every server process still running, since the cluster started"
  fi
  say "control round trip, idle (before the fleet registers): p50/p99 $(field probe_idle_p50_ms "$idle") / $(field probe_idle_p99_ms "$idle") ms over $(field probe_idle "$idle") requests one at a time (max $(field probe_idle_max_ms "$idle") ms, unanswered $(field probe_idle_unanswered "$idle"))"
  say "control round trip, busy (during the rollout): p50/p99 $(field probe_rollout_p50_ms "$sim") / $(field probe_rollout_p99_ms "$sim") ms over $(field probe_rollout "$sim") requests, one every 200 ms; unanswered $(field probe_unanswered "$sim") (every phase)"
  say "control round trip, while registering:         p50/p99 $(field probe_registering_p50_ms "$sim") / $(field probe_registering_p99_ms "$sim") ms over $(field probe_registering "$sim") requests (the fleet connecting and the coordinator reading its states)"
  say "devices ready/failed:     $(field ready "$sim") / $(field failed "$sim") of $n; desired $(field desired "$sim"), sent twice $(field desired_duplicates "$sim"), refused $(field refused "$sim")"
  say "link drops:               coordinator $drops, simulator $(field connections_lost "$sim")"
  if [ "$BROKER" = nats ]; then
    nats_nodes | while read -r line; do say "NATS $line"; done
    nats_log_summary "$results.$n.$store.nats-logs.txt"
  fi
  say "create/start replies:     $(head -c 120 "$dir/create.out" | tr '\n' ' ') / $(head -c 120 "$dir/start.out" | tr '\n' ' ')"
  fig[$store.rollout]=$(field rollout_s "$sim")
  fig[$store.per_s]=$(field desired_per_s "$sim")
  fig[$store.p99]=$(field transition_p99_ms "$sim")
  fig[$store.kib]=$(awk -v a="$after_rss" -v e="$empty_rss" -v n="$n" 'BEGIN {printf "%.2f", (a - e) / n}')
  fig[$store.cpu]=$(awk -v a="$after_cpu" -v r="$registered_cpu" 'BEGIN {printf "%.1f", a - r}')
  fig[$store.cpu_k]=$(per_k "$span_cpu" "$n")
  fig[$store.twice]=$(field desired_duplicates "$sim")
  fig[$store.pg_mib]=$([ -n "$pg_after_pss" ] && echo "$((pg_after_pss / 1024))" || echo "-")

  # Restart with every state retained (the largest size is the one that matters). A coordinator
  # on PostgreSQL steps down as it stops (SIGTERM) and takes the lease again at its first try.
  stop_coordinator
  if [ -n "${HEAPTRACK:-}" ] && [ "$store" = sled ]; then
    for _ in $(seq 600); do [ -e "$results.$n.heaptrack.zst" ] && break; sleep 0.1; done
    sleep 2
    heaptrack_print -f "$results.$n.heaptrack.zst" --print-peaks --peak-limit 25 --print-allocators 0 \
      --print-leaks 0 --print-temporary 0 2>/dev/null | grep -v '^\s*$' | head -200 \
      >"$results.$n.heaptrack.txt" || true
  fi
  # The yardstick for the restart: a plain mosquitto_sub reading the same retained states.
  sub_s=$(mosquitto_sub_s "$n")
  restarted=1
  restart_at=$(date +%s.%N)
  start_coordinator "$dir"
  if [ -n "${PERF_RESTART:-}" ]; then
    # A profile of the restarted coordinator until its registry is complete (PERF_RESTART=1):
    # <results>.<n>.<store>.restart.perf.txt.
    perf record -F 999 -g -p "$coordinator_pid" -o "$dir/restart.perf.data" >/dev/null 2>&1 &
    perf_pid=$!
  fi
  until_registry "$restart_at" "$n" >"$dir/registry.out" &
  registry_pid=$!
  until_loaded "$restart_at" >"$dir/loaded.out" &
  loaded_pid=$!
  first=$(until_answer)
  wait "$registry_pid" || true
  wait "$loaded_pid" || true
  if [ -n "${PERF_RESTART:-}" ]; then
    kill -INT "$perf_pid"; wait "$perf_pid" 2>/dev/null || true
    perf report -i "$dir/restart.perf.data" --no-children --percent-limit 1 --stdio 2>/dev/null \
      | grep -v '^$' | head -150 >"$results.$n.$store.restart.perf.txt" || true
  fi
  say "restart to first answer:  $first s with $n retained states; registry complete after $(cat "$dir/registry.out") s (CPU $(cpu_s "$coordinator_pid") s), mosquitto_sub read the same states in $sub_s s ($(awk -v a="$(cat "$dir/registry.out")" -v b="$sub_s" 'BEGIN {if (b + 0 > 0) printf "%.1fx", a / b; else print "-"}')); marker back (changes accepted) after $(cat "$dir/loaded.out") s; load $(load)"
  # Where the restart's time went before the coordinator connected (its start-up log line).
  say "restart before connecting: $(grep 'coordinator starting' "$dir/coordinator.log" | tail -1 |
    grep -oE '(store_open_ms|rollouts_ms|authorized_keys_ms|other_records_ms|engine_ms)=[0-9]+' | tr '\n' ' ')"
  fig[$store.first]=$first
  fig[$store.registry]=$(cat "$dir/registry.out")
  headlines+=("$(printf '%-8s %-8s %14s %10s %10s %16s %16s %14s %18s %8s %14s %s' "$n" "$store" \
    "$(per_k "$span_cpu" "$n")" "$(per_k "$broker_span" "$n")" "$([ "$sim_span" = - ] && echo - || per_k "$sim_span" "$n")" \
    "$(field probe_idle_p50_ms "$idle")/$(field probe_idle_p99_ms "$idle")" \
    "$(field probe_rollout_p50_ms "$sim")/$(field probe_rollout_p99_ms "$sim")" \
    "$(field transition_p50_ms "$sim")/$(field transition_p99_ms "$sim")" "$(field transitions "$sim")" \
    "$first" "$(cat "$dir/registry.out")/$sub_s" "$(load)")")
  stop_coordinator
  restarted=""
  [ "$store" = postgres ] && stop_pg
  stop_broker
  cp "$sim" "$results.$n.$store.fleetsim.txt"
  cp "$idle" "$results.$n.$store.idle.txt" 2>/dev/null || true
  say ""
}

# The stores side by side (postgres over sled: above 1 is slower or larger).
side_by_side() {
  local n="$1"
  ratio() { awk -v a="$1" -v b="$2" 'BEGIN {if (a == "" || b == "" || b + 0 == 0) print "-"; else printf "%.2fx", a / b}'; }
  row() { say "$(printf '%-34s %14s %14s %8s' "$1" "$2" "$3" "$4")"; }
  say "-- $n devices side by side (load $(cut -d' ' -f1-3 /proc/loadavg))"
  row "" sled postgres ratio
  row "rollout wall time (s)" "${fig[sled.rollout]}" "${fig[postgres.rollout]}" "$(ratio "${fig[postgres.rollout]}" "${fig[sled.rollout]}")"
  row "desired actions/s" "${fig[sled.per_s]}" "${fig[postgres.per_s]}" "$(ratio "${fig[postgres.per_s]}" "${fig[sled.per_s]}")"
  row "group transition p99 (ms)" "${fig[sled.p99]}" "${fig[postgres.p99]}" "$(ratio "${fig[postgres.p99]}" "${fig[sled.p99]}")"
  row "coordinator KiB/device after" "${fig[sled.kib]}" "${fig[postgres.kib]}" "$(ratio "${fig[postgres.kib]}" "${fig[sled.kib]}")"
  row "PostgreSQL server PSS (MiB)" "-" "${fig[postgres.pg_mib]}" ""
  row "coordinator CPU, rollout (s)" "${fig[sled.cpu]}" "${fig[postgres.cpu]}" "$(ratio "${fig[postgres.cpu]}" "${fig[sled.cpu]}")"
  row "coordinator CPU per 1,000 (ms)" "${fig[sled.cpu_k]}" "${fig[postgres.cpu_k]}" "$(ratio "${fig[postgres.cpu_k]}" "${fig[sled.cpu_k]}")"
  row "restart: first answer (s)" "${fig[sled.first]}" "${fig[postgres.first]}" "$(ratio "${fig[postgres.first]}" "${fig[sled.first]}")"
  row "restart: registry complete (s)" "${fig[sled.registry]}" "${fig[postgres.registry]}" "$(ratio "${fig[postgres.registry]}" "${fig[sled.registry]}")"
  row "desired actions sent twice" "${fig[sled.twice]}" "${fig[postgres.twice]}" ""
  say ""
}

# Failover at N devices: a leader (bench-a) and a standby (bench-b) on one fresh database, the
# same broker and the same coordinator key; the leader is killed (SIGKILL) when group 3 starts.
run_failover() {
  local n="$1" standby standby_pid sub_pid kill_at took_lease first_desired answer groups_before
  say "-- failover at $n devices (postgres; load $(cut -d' ' -f1-3 /proc/loadavg))"
  dir="$work/failover-$n"; mkdir -p "$dir"; port=$(free_port)
  start_broker "$dir" "$port"
  make_site "$dir" "$port" "$n"
  start_pg "$dir"
  pg_store_conf bench-a >>"$dir/coordinator.toml"
  # The standby: its own data directory with the leader's releases and artifacts, its own
  # metrics port, the same key, broker and database.
  standby="$dir/standby"
  mkdir -p "$standby"
  cp -r "$dir/coordinator/releases" "$dir/coordinator/artifacts" "$standby/" 2>/dev/null || true
  sed -e "s|^data_dir = .*|data_dir = \"$standby\"|" \
    -e "s|^listen = .*|listen = \"127.0.0.1:$(free_port)\"|" \
    -e 's|^coordinator_id = .*|coordinator_id = "bench-b"|' \
    "$dir/coordinator.toml" >"$dir/standby.toml"
  start_coordinator "$dir"
  until_answer >/dev/null
  RUST_LOG=info env "${coordinator_env[@]}" "$flotilla" serve --config "$dir/standby.toml" >>"$dir/standby.log" 2>&1 &
  standby_pid=$!
  pids+=("$standby_pid")
  # Every live (not retained) desired action, timestamped as the subscriber receives it.
  mosquitto_sub -h 127.0.0.1 -p "$port" -q 1 -R -t 'flotilla/v1/devices/+/desired' -F '%U' >"$dir/desired.times" 2>/dev/null &
  sub_pid=$!
  pids+=("$sub_pid")
  start_fleet "$dir" "$n"
  until_registry "$(date +%s.%N)" "$n" >/dev/null
  cli rollout create --spec "$dir/spec.toml" >"$dir/create.out" 2>&1 || true
  cli rollout start fleet >"$dir/start.out" 2>&1 || true
  # Group 3 of FLEET_GROUPS starts when more than 2/FLEET_GROUPS of the devices had theirs.
  groups_before=$((n * 2 / FLEET_GROUPS))
  for _ in $(seq 24000); do
    [ "$(wc -l <"$dir/desired.times")" -gt "$groups_before" ] && break
    kill -0 "$sim_pid" 2>/dev/null || break
    sleep 0.025
  done
  kill -KILL "$coordinator_pid"
  kill_at=$(date +%s.%N)
  local sent_before
  sent_before=$(wc -l <"$dir/desired.times")
  # Time to the new leader's first answered control request, from the kill.
  answer=$(until_answer)
  wait "$sim_pid" || say "simulator failed after the failover: $(tail -3 "$dir/fleetsim.log")"
  kill "$sub_pid" 2>/dev/null || true
  sim="$dir/summary.txt"
  # The standby's "leads now" line, by its log's UTC timestamp.
  took_lease=$(grep -m1 'this coordinator leads now' "$dir/standby.log" | grep -oE '^[0-9T:.-]+Z' || true)
  took_lease=$([ -n "$took_lease" ] && awk -v a="$kill_at" -v b="$(date -d "$took_lease" +%s.%N)" 'BEGIN {printf "%.3f", b - a}' || echo "never")
  # The new leader's first desired action: the first one received more than a second after the
  # kill (what the dead leader had already handed the broker arrives within milliseconds; the
  # standby cannot lead before the dead leader's lease ran out, seconds later).
  first_desired=$(awk -v k="$kill_at" '$1 > k + 1 {printf "%.3f", $1 - k; exit}' "$dir/desired.times")
  say "killed the leader:        after $sent_before desired actions of $n (group 3 of $FLEET_GROUPS starting)"
  say "standby took the lease:   $took_lease s after the kill"
  say "first desired action:     ${first_desired:-none} s after the kill (the new leader's, as a subscriber sees it)"
  say "first answered request:   $answer s after the kill"
  say "rollout wall time:        $(field rollout_s "$sim") s with the failover; desired actions/s $(field desired_per_s "$sim")"
  say "devices ready/failed:     $(field ready "$sim") / $(field failed "$sim") of $n; desired $(field desired "$sim"), sent twice (same action id) $(field desired_duplicates "$sim"), refused $(field refused "$sim"); live desired messages seen $(wc -l <"$dir/desired.times")"
  say "new leader's start:       $(grep 'coordinator starting' "$dir/standby.log" | tail -1 |
    grep -oE '(store_open_ms|rollouts_ms|authorized_keys_ms|other_records_ms|engine_ms)=[0-9]+' | tr '\n' ' ')"
  fig[failover.lease]=$took_lease
  fig[failover.desired]=${first_desired:-none}
  fig[failover.answer]=$answer
  kill "$standby_pid" 2>/dev/null || true; wait "$standby_pid" 2>/dev/null || true
  stop_pg
  stop_broker
  cp "$sim" "$results.$n.failover.fleetsim.txt"
  cp "$dir/standby.log" "$results.$n.failover.standby.log" 2>/dev/null || true
  say ""
}

# Bytes mode (BYTES="mqtt http"): one rollout of N devices that download, per mode.
bytes_site() {
  local dir="$1" port="$2" n="$3" mode="$4" origin=""
  http_port=$(free_port)
  if [ "$mode" = http ]; then origin="$http_port"; fi
  make_site "$dir" "$port" "$n" "$ARTIFACT_SIZE" "$origin"
  printf '[http]\nlisten = "127.0.0.1:%s"\n' "$http_port" >>"$dir/coordinator.toml"
}

# Mosquitto's $SYS byte counters ("received sent"), as it last published them.
broker_bytes() {
  timeout 5 mosquitto_sub -h 127.0.0.1 -p "$port" -C 2 -v \
    -t '$SYS/broker/bytes/received' -t '$SYS/broker/bytes/sent' 2>/dev/null |
    awk '$1 ~ /received$/ {r = $2} $1 ~ /sent$/ {s = $2} END {printf "%d %d", r, s}'
}
# The sum of the coordinator's /metrics lines that start with $1.
metric() {
  curl -s "http://127.0.0.1:$metrics_port/metrics" 2>/dev/null |
    awk -v m="$1" 'index($0, m) == 1 {s += $NF} END {printf "%d", s}'
}

run_bytes() {
  local n="$1" mode="$2" cpu0 broker0 bytes0 served0 origin0 http0 cpu1 broker1 bytes1 sim
  dir="$work/bytes-$mode-$n"; mkdir -p "$dir"; port=$(free_port)
  broker_conf "$port" >"$dir/mosquitto.conf"
  echo "sys_interval 1" >>"$dir/mosquitto.conf"
  mosquitto -c "$dir/mosquitto.conf" >"$dir/mosquitto.log" 2>&1 &
  broker_pid=$!
  pids+=("$broker_pid")
  wait_port "$port"
  bytes_site "$dir" "$port" "$n" "$mode"
  start_coordinator "$dir"
  until_answer >/dev/null
  start_fleet "$dir" "$n" --download "$mode" --download-at-once "$DOWNLOAD_AT_ONCE"
  until_registry "$(date +%s.%N)" "$n" >/dev/null
  sleep 1.5
  cpu0=$(cpu_s "$coordinator_pid"); broker0=$(cpu_s "$broker_pid"); bytes0=$(broker_bytes)
  served0=$(metric flotilla_artifact_block_bytes_served_total); origin0=$(metric flotilla_artifact_http_bytes_served_total); http0=$(metric 'flotilla_device_bytes_total{source="http"}')
  cli rollout create --spec "$dir/spec.toml" >"$dir/create.out" 2>&1 || true
  cli rollout start fleet >"$dir/start.out" 2>&1 || true
  wait "$sim_pid" || die "simulator failed at $n devices, --download $mode: $(tail -3 "$dir/fleetsim.log")"
  cpu1=$(cpu_s "$coordinator_pid"); broker1=$(cpu_s "$broker_pid")
  sleep 1.5
  bytes1=$(broker_bytes)
  sim="$dir/summary.txt"
  fig[$mode.coordinator]=$(awk -v a="$cpu1" -v b="$cpu0" 'BEGIN {printf "%.2f", a - b}')
  fig[$mode.broker]=$(awk -v a="$broker1" -v b="$broker0" 'BEGIN {printf "%.2f", a - b}')
  fig[$mode.received]=$(awk -v a="${bytes1% *}" -v b="${bytes0% *}" 'BEGIN {printf "%.1f", (a - b) / 1e6}')
  fig[$mode.sent]=$(awk -v a="${bytes1#* }" -v b="${bytes0#* }" 'BEGIN {printf "%.1f", (a - b) / 1e6}')
  fig[$mode.served]=$(awk -v a="$(metric flotilla_artifact_block_bytes_served_total)" -v b="$served0" 'BEGIN {printf "%.1f", (a - b) / 1e6}')
  fig[$mode.origin]=$(awk -v a="$(metric flotilla_artifact_http_bytes_served_total)" -v b="$origin0" 'BEGIN {printf "%.1f", (a - b) / 1e6}')
  fig[$mode.http]=$(awk -v a="$(metric 'flotilla_device_bytes_total{source="http"}')" -v b="$http0" 'BEGIN {printf "%.1f", (a - b) / 1e6}')
  fig[$mode.sim_mqtt]=$(awk -v a="$(field download_mqtt_bytes "$sim")" 'BEGIN {printf "%.1f", a / 1e6}')
  fig[$mode.sim_http]=$(awk -v a="$(field download_http_bytes "$sim")" 'BEGIN {printf "%.1f", a / 1e6}')
  fig[$mode.rollout]=$(field rollout_s "$sim")
  fig[$mode.simcpu]=$(field cpu_s "$sim")
  fig[$mode.ready]="$(field ready "$sim")/$(field failed "$sim")"
  say "-- $n devices, --download $mode: ready/failed $(field ready "$sim")/$(field failed "$sim"), downloads failed $(field download_failed "$sim"), rollout $(field rollout_s "$sim") s, coordinator CPU ${fig[$mode.coordinator]} s, Mosquitto ${fig[$mode.broker]} s, broker bytes in/out ${fig[$mode.received]}/${fig[$mode.sent]} MB, link drops $(grep -c 'MQTT connection lost' "$dir/coordinator.log" || true)/$(field connections_lost "$sim"); load $(load)"
  # The simulator's first warnings (a refused block names it), if any.
  { grep -m3 ' WARN \| ERROR ' "$dir/fleetsim.log" || true; } | sed 's/^/   fleetsim: /' | tee -a "$results"
  stop_coordinator
  kill "$broker_pid"; wait "$broker_pid" 2>/dev/null || true
  cp "$sim" "$results.$n.$mode.fleetsim.txt"
}

# The modes side by side at N devices.
bytes_table() {
  local n="$1" m f row
  say "== $n devices, artifact $ARTIFACT_SIZE bytes, $FLEET_GROUPS groups, at most $DOWNLOAD_AT_ONCE devices downloading at once (load $(load))"
  row="$(printf '%-44s' "")"; for m in $BYTES; do row="$row$(printf ' %12s' "$m")"; done; say "$row"
  for f in "rollout wall time (s)|rollout" "coordinator CPU, rollout (s)|coordinator" "Mosquitto CPU, rollout (s)|broker" \
    "broker bytes received (MB)|received" "broker bytes sent (MB)|sent" "coordinator MQTT block bytes (MB)|served" "coordinator HTTP origin bytes (MB)|origin" \
    "HTTP bytes, devices' reports (MB)|http" "simulator: MQTT block bytes (MB)|sim_mqtt" "simulator: HTTP body bytes (MB)|sim_http" \
    "simulator CPU, whole life (s)|simcpu" "devices ready/failed|ready"; do
    row="$(printf '%-44s' "${f%%|*}")"
    for m in $BYTES; do row="$row$(printf ' %12s' "${fig[$m.${f##*|}]}")"; done
    say "$row"
  done
  say ""
}

if [ -n "$BYTES" ]; then
  declare -A fig
  for n in $sizes; do
    fig=()
    for mode in $BYTES; do run_bytes "$n" "$mode"; done
    bytes_table "$n"
  done
  say "results: $results"
  exit 0
fi

largest=$(echo "$sizes" | tr ' ' '\n' | sort -n | tail -1)
for n in $sizes; do
  say "== $n devices (load $(cut -d' ' -f1-3 /proc/loadavg))"
  # The broker-only baseline: the same messages through a fresh broker of the same settings.
  dir="$work/base-$n"; mkdir -p "$dir"; port=$(free_port)
  start_broker "$dir" "$port"
  baseline_fleetsim --broker "127.0.0.1:$(fleet_port)" --count "$n" --phases "$PHASES" --baseline-groups "$FLEET_GROUPS" \
    "${sign_ahead[@]}" --timeout "$TIMEOUT" --progress 10s --summary "$dir/summary.json" >"$dir/summary.txt" 2>"$dir/fleetsim.log" \
    || die "baseline run failed: $(tail -3 "$dir/fleetsim.log")"
  base_broker_cpu=$(broker_cpu_s)
  if [ "$BROKER" = nats ]; then
    nats_nodes | while read -r line; do say "broker-only NATS $line"; done
  fi
  stop_broker
  base="$dir/summary.txt"
  say "broker-only run:          rollout $(field rollout_s "$base") s; CPU of its whole life: simulator $(field cpu_s "$base") s (the devices and the stand-in coordinator, $(field nonces_prepared "$base") nonces prepared ahead), $broker_name $base_broker_cpu s; load $(load)"
  cp "$base" "$results.$n.baseline.txt"

  fig=()
  for store in $stores; do run_store "$store" "$n"; done
  case " $stores " in *" sled "*) case " $stores " in *" postgres "*) side_by_side "$n" ;; esac ;; esac
  case " $stores " in
    *" postgres "*) [ -n "$failover" ] && [ "$n" = "$largest" ] && run_failover "$n" ;;
  esac
done
say "== headline per size and store (CPU in ms per 1,000 devices rolled out, registration to the end of the rollout; round trips and transitions p50/p99 in ms; restart in s)"
say "$(printf '%-8s %-8s %14s %10s %10s %16s %16s %14s %18s %8s %14s %s' devices store coordinator broker simulator "idle probe" "busy probe" transition "(transitions)" "1st answer" "registry/sub" "load at the end")"
for h in "${headlines[@]}"; do say "$h"; done
say ""
say "results: $results"
