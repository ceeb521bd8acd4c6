#!/usr/bin/env bash
# The console and the HTTP API with a large registered fleet, beside the MQTT control API.
#
# Usage (from anywhere): bench/console.sh [--sizes "10000"] [--with-100k] [--debug]
# Environment: KEEP=1 (keep the work directory), CARGO_TARGET_DIR (default: <repo>/target),
#              RESULTS (default bench/results/console-<UTC date>.txt), ROUNDS (requests per
#              figure, default 20), LOADS (page loads per figure, default 10), PROBES (probe
#              devices, default 4), PROBE_INSTALL (a probe device's install time, default 7s),
#              TIMEOUT (the fleet's rollout, default 30m), SIM_PROFILE (release, the default,
#              fleetsim, or debug: the simulator's build), FLEET_ROLLOUT (run, the default: the
#              fleet's rollout runs to its end; create: it is only created, its N devices
#              scheduled, which saves the rollout's time at 100k).
#
# Starts its own Mosquitto (as bench/fleet.sh: the shipped settings on one plain loopback
# listener), a coordinator (release build unless --debug) with `[http] listen` on a free loopback
# port, and flotilla-fleetsim with N devices (label bench=fleet), runs a 5-group rollout `fleet`
# over all of them to its end (so the rollout page has N devices with a history), and prints for
# each size:
#   1. the same first page on both APIs: `GET /api/v1/devices` (500 devices), `/api/v1/rollouts`
#      and `/api/v1/rollouts/fleet` (200 of its devices) with a session cookie, curl's
#      time_total, beside the same command on the MQTT control API over one connection (a
#      signed request and its reply, as the CLI sends it), p50/p99 over ROUNDS requests each;
#      and `flotilla devices --limit 500` end to end (process start, connect, sign, one page);
#   2. first render in a real browser: Debian's headless Chromium through ChromeDriver, logged
#      in with the operator's key file as a person does, from a blank page to the rollouts page's
#      row of `fleet` and to the rollout page's device rows being drawn, p50/p99 over LOADS loads;
#   3. live latency: PROBES more devices (label bench=probe, PROBE_INSTALL per install, so their
#      reports come about a second apart) in a rollout `probe` of one device per group; from each
#      probe report as a subscriber on the broker receives it to (a) the next `rollout` event of
#      `probe` on a plain server-sent events client and (b) the next redraw of the probe's device
#      rows in the browser (a MutationObserver), p50/p99/max.
# The load average is printed when each size starts: the machine may be shared, and every
# figure is wall clock on it. Nothing here passes or fails on a number; docs/performance.md has
# the figures and the goals. Needs mosquitto, mosquitto_sub, curl, python3, chromium and
# chromium-driver.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}"
export CARGO_TERM_COLOR=never
export PATH="$PATH:/usr/sbin"
sizes="10000"
profile=release
while [ $# -gt 0 ]; do
  case "$1" in
    --sizes) sizes="$2"; shift 2 ;;
    --with-100k) sizes="$sizes 100000"; shift ;;
    --debug) profile=debug; shift ;;
    -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
    *) echo "console.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
ROUNDS="${ROUNDS:-20}"
LOADS="${LOADS:-10}"
PROBES="${PROBES:-4}"
PROBE_INSTALL="${PROBE_INSTALL:-7s}"
TIMEOUT="${TIMEOUT:-30m}"
mkdir -p "$repo/bench/results"
results="${RESULTS:-$repo/bench/results/console-$(date -u +%Y-%m-%d).txt}"

bench=console.sh
# shellcheck source=bench/lib.sh
. "$repo/bench/lib.sh"
for tool in mosquitto_sub curl python3 /usr/bin/chromium /usr/bin/chromedriver; do
  command -v "$tool" >/dev/null || die "$tool not found (apt-get install mosquitto-clients curl python3 chromium chromium-driver)"
done
# The coordinator as shipped (release profile), and the simulator in the same profile by default:
# its signature crates are at opt-level 3 there too (decision 0029), so the devices sign fast
# enough not to be what is measured, and it reuses the coordinator's compiled dependencies.
# SIM_PROFILE=fleetsim builds it as bench/fleet.sh does.
if [ "${SIM_PROFILE:-release}" = fleetsim ] || [ "$profile" = debug ]; then
  build_bins -p flotilla-coordinator
elif [ "${SIM_PROFILE:-release}" = debug ]; then
  cargo build -q --release -p flotilla-coordinator --bins
  cargo build -q -p flotilla-fleetsim --bins
  bin="$CARGO_TARGET_DIR/release"
  fleetsim="$CARGO_TARGET_DIR/debug/flotilla-fleetsim"
else
  cargo build -q --release -p flotilla-coordinator -p flotilla-fleetsim --bins
  bin="$CARGO_TARGET_DIR/release"
  fleetsim="$bin/flotilla-fleetsim"
fi
# The browser and MQTT client (tests/examples/console_bench.rs); its own speed is not measured.
cargo build -q -p flotilla-tests --example console_bench
client="$CARGO_TARGET_DIR/debug/examples/console_bench"
flotilla="$bin/flotilla"
make_work console
: >"$results"
kb() { awk -v k="$1:" '$1 == k {print $2}' "/proc/$2/status"; }

# p50, p99 and the largest of the numbers on stdin (nearest rank), as "p50 / p99 (max M, n N)".
pcts() {
  sort -g | awk '{v[NR] = $1} END {
    if (NR == 0) { print "none"; exit }
    r50 = int(NR * 0.50); if (r50 < NR * 0.50) r50++; if (r50 < 1) r50 = 1
    r99 = int(NR * 0.99); if (r99 < NR * 0.99) r99++; if (r99 < 1) r99 = 1
    printf "%.1f / %.1f ms (max %.1f, n %d)", v[r50], v[r99], v[NR], NR }'
}

cli() {
  "$flotilla" --broker "127.0.0.1:$port" --operator-key "$dir/keys/admin.key" "$@"
}

# Seconds until a control request is answered (a signed request every 20 ms).
until_answer() {
  "$fleetsim" --broker "127.0.0.1:$port" --probe-key "$dir/keys/admin.key" --first-answer \
    --timeout 5m 2>/dev/null | awk '{print $2}'
}

# Waits until the coordinator has read $1 retained states (its metrics); the seconds it took.
until_registry() {
  local want="$1" since got
  since=$(date +%s.%N)
  for _ in $(seq 12000); do
    got=$(curl -s "http://127.0.0.1:$metrics_port/metrics" 2>/dev/null |
      awk '/^flotilla_messages_received_total\{.*topic="state"/ {print $2}' || true)
    if [ -n "$got" ] && [ "${got%.*}" -ge "$want" ]; then
      awk -v a="$since" -v b="$(date +%s.%N)" 'BEGIN {printf "%.3f", b - a}'
      return
    fi
    sleep 0.05
  done
  die "the coordinator read fewer than $want states within 10 minutes"
}

# Times ROUNDS GETs of $1 (a path) with the session cookie: curl's time_total in ms, one a line;
# the last answer in $dir/last.json. A status other than 200 stops the benchmark.
http_times() {
  local path="$1" out code
  for _ in $(seq "$ROUNDS"); do
    out=$(curl -sS -o "$dir/last.json" -b "$dir/cookies" -w '%{http_code} %{time_total}' \
      "http://127.0.0.1:$http_port$path")
    code=${out%% *}
    [ "$code" = 200 ] || die "GET $path answered $code: $(head -c 300 "$dir/last.json")"
    awk -v t="${out#* }" 'BEGIN {printf "%.3f\n", t * 1000}'
    # Well inside the admin key's rate limit: what is timed is the answer, not a refusal.
    sleep 0.1
  done
}

# The latencies of the probe's reports ($2, "unix-seconds topic" a line, as mosquitto_sub
# received them) to what followed, one figure in ms a line, "missed" when nothing did within 10 s:
#   sse FILE: the next `rollout` event of the probe (unix seconds a line) on the plain client;
#   dom FILE: the first redraw (unix seconds, a tab, "device=phase ..." a line) that shows the
#             reporting device at this report's phase or later. A device reports accepted,
#             downloading, verified, staged, activated, confirming, ready (fleetsim's agent
#             phases), and the coordinator sends a rollout's changes once a second, so a redraw
#             soon after a report may still be the previous report's.
latencies() {
  python3 - "$1" "$2" "$3" <<'EOF'
import bisect, collections, sys
mode, reports_file, after_file = sys.argv[1:4]
phases = ["accepted", "downloading", "verified", "staged", "activated", "confirming", "ready"]
reports, seen = [], collections.Counter()
for line in open(reports_file):
    if not line.strip():
        continue
    t, topic = line.split()[:2]
    device = topic.split("/")[-2]
    reports.append((float(t), device, seen[device]))
    seen[device] += 1
if mode == "sse":
    after = sorted(float(l.split()[0]) for l in open(after_file) if l.strip())
    for r, _, _ in reports:
        i = bisect.bisect_right(after, r)
        print("%.1f" % ((after[i] - r) * 1000) if i < len(after) and after[i] - r < 10 else "missed")
else:
    redraws = []
    for line in open(after_file):
        t, _, text = line.rstrip("\n").partition("\t")
        rows = dict(pair.split("=", 1) for pair in text.split() if "=" in pair)
        redraws.append((float(t), rows))
    for r, device, k in reports:
        hit = None
        for t, rows in redraws:
            shown = rows.get(device)
            if r < t < r + 10 and shown in phases and phases.index(shown) >= k:
                hit = t
                break
        print("%.1f" % ((hit - r) * 1000) if hit is not None else "missed")
EOF
}

start_broker() {
  broker_conf "$port" >"$dir/mosquitto.conf"
  mosquitto -c "$dir/mosquitto.conf" >"$dir/mosquitto.log" 2>&1 &
  broker_pid=$!
  pids+=("$broker_pid")
  wait_port "$port"
}

say "flotilla console benchmark, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores shared with whatever else runs (load $(cut -d' ' -f1-3 /proc/loadavg)), $profile build, data in $(df --output=fstype "$work" | tail -1)"
say "$(mosquitto -h 2>/dev/null | head -1); $(/usr/bin/chromium --version 2>/dev/null | head -1)"
say "figures are wall clock on this machine; p50 / p99 (max, n) over $ROUNDS requests or $LOADS page loads"
say ""

for n in $sizes; do
  say "== $n devices registered (load $(cut -d' ' -f1-3 /proc/loadavg))"
  dir="$work/site-$n"; mkdir -p "$dir/keys" "$dir/live"
  port=$(free_port); http_port=$(free_port)
  start_broker
  "$flotilla" keygen --out "$dir/keys" >/dev/null
  "$flotilla" operator keygen --out "$dir/keys" --name admin >/dev/null
  head -c 4096 /dev/urandom >"$dir/app.bin"
  "$flotilla" release create --data-dir "$dir/coordinator" --key "$dir/keys/release.key" \
    --name fw-2 --version 2.0.0 --counter 2 --hardware sim-board --artifact "app=$dir/app.bin" >/dev/null
  "$fleetsim" --count "$n" --write-authorized-keys "$dir/fleet.keys" >/dev/null
  "$fleetsim" --count "$PROBES" --id-prefix probe- --seed probe --write-authorized-keys "$dir/probe.keys" >/dev/null
  cat "$dir/fleet.keys" "$dir/probe.keys" >"$dir/authorized_devices"
  coordinator_conf "$dir" "$port"
  printf '[http]\nlisten = "127.0.0.1:%s"\n' "$http_port" >>"$dir/coordinator.toml"
  cat >"$dir/fleet.toml" <<EOF
name = "fleet"
release = "fw-2"
select = "bench=fleet"
[groups]
count = 5
success = { threshold = "100%", action = "next" }
EOF
  cat >"$dir/probe.toml" <<EOF
name = "probe"
release = "fw-2"
select = "bench=probe"
[groups]
count = $PROBES
success = { threshold = "100%", action = "next" }
EOF

  RUST_LOG=info "$flotilla" serve --config "$dir/coordinator.toml" >>"$dir/coordinator.log" 2>&1 &
  coordinator_pid=$!
  pids+=("$coordinator_pid")
  until_answer >/dev/null
  wait_port "$http_port"

  # The fleet, and the probe devices beside it; both wait for their rollouts.
  "$fleetsim" --broker "127.0.0.1:$port" --count "$n" --label bench=fleet \
    --coordinator-key "$dir/keys/coordinator.pub" --until-done --timeout "$TIMEOUT" --progress 10s \
    >"$dir/fleet.txt" 2>"$dir/fleet.log" &
  fleet_pid=$!
  pids+=("$fleet_pid")
  "$fleetsim" --broker "127.0.0.1:$port" --count "$PROBES" --id-prefix probe- --seed probe \
    --label bench=probe --install-time "$PROBE_INSTALL" --coordinator-key "$dir/keys/coordinator.pub" \
    --until-done --timeout "$TIMEOUT" --progress 0s >"$dir/probe.txt" 2>"$dir/probe.log" &
  probe_pid=$!
  pids+=("$probe_pid")
  registered=$(until_registry $((n + PROBES)))
  say "registration:             every state read $registered s after the simulators started; coordinator RSS $(($(kb VmRSS "$coordinator_pid") / 1024)) MiB"

  # The fleet's rollout to its end: N devices with a history on the rollout page.
  started=$(date +%s.%N)
  cli rollout create --spec "$dir/fleet.toml" >"$dir/create.out" 2>&1 || die "create fleet: $(cat "$dir/create.out")"
  if [ "${FLEET_ROLLOUT:-run}" = create ]; then
    say "rollout fleet:            created, not started: its $n devices scheduled"
  else
    cli rollout start fleet >"$dir/start.out" 2>&1 || die "start fleet: $(cat "$dir/start.out")"
    wait "$fleet_pid" || die "the fleet's simulator failed: $(tail -3 "$dir/fleet.log")"
    say "rollout fleet:            $(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}') s to its last device; coordinator RSS $(($(kb VmRSS "$coordinator_pid") / 1024)) MiB"
  fi
  cli rollout create --spec "$dir/probe.toml" >"$dir/create-probe.out" 2>&1 || die "create probe: $(cat "$dir/create-probe.out")"

  # 1. The same first pages on both APIs.
  FLOTILLA_OPERATOR_KEY="$dir/keys/admin.key" "$flotilla" operator sign '{"command":"login"}' |
    curl -sS -c "$dir/cookies" -H 'Content-Type: application/json' --data-binary @- \
      "http://127.0.0.1:$http_port/api/v1/session" >"$dir/login.json"
  grep -q '"operator":"admin"' "$dir/login.json" || die "login refused: $(cat "$dir/login.json")"
  token=$(awk '$6 == "flotilla_session" {print $7}' "$dir/cookies")
  say "-- the same first page on both APIs (load $(cut -d' ' -f1-3 /proc/loadavg))"
  declare -A http=() sizes_kb=()
  for what in "devices:/api/v1/devices?limit=500" "rollouts:/api/v1/rollouts?limit=200" "rollout:/api/v1/rollouts/fleet?limit=200"; do
    http[${what%%:*}]=$(http_times "${what#*:}" | pcts)
    sizes_kb[${what%%:*}]=$(($(stat -c %s "$dir/last.json") / 1024))
  done
  "$client" mqtt --broker-port "$port" --key "$dir/keys/admin.key" --rollout fleet --rounds "$ROUNDS" \
    >"$dir/mqtt.txt" 2>"$dir/mqtt.log" || die "the MQTT client failed: $(tail -3 "$dir/mqtt.log")"
  mq() { echo "$(field "mqtt_$1_p50_ms" "$dir/mqtt.txt") / $(field "mqtt_$1_p99_ms" "$dir/mqtt.txt") ms (n $(field "mqtt_$1_n" "$dir/mqtt.txt"))"; }
  say "devices, 500:             HTTP $(echo "${http[devices]}") (${sizes_kb[devices]} KiB)   MQTT $(mq devices)"
  say "rollouts, 200:            HTTP $(echo "${http[rollouts]}") (${sizes_kb[rollouts]} KiB)   MQTT $(mq rollouts)"
  say "rollout fleet, 200 devs:  HTTP $(echo "${http[rollout]}") (${sizes_kb[rollout]} KiB)   MQTT $(mq rollout)"
  cli_ms=$(for _ in $(seq 5); do
    a=$(date +%s%N)
    cli devices --json --page-size 500 --limit 500 >/dev/null 2>>"$dir/cli.log" || die "flotilla devices failed: $(tail -3 "$dir/cli.log")"
    echo $((($(date +%s%N) - a) / 1000000))
    sleep 0.1
  done | pcts)
  say "flotilla devices --limit 500, end to end (process, connect, sign, one page): $cli_ms"

  # 2 and 3. The browser: first renders, then the probe's rollout followed live.
  rm -f "$dir/live/ready" "$dir/live/stop"
  "$client" browser --url "http://127.0.0.1:$http_port" --key "$dir/keys/admin.key" --rollout fleet \
    --loads "$LOADS" --live probe --cookie "$token" --out "$dir/live" --stop "$dir/live/stop" \
    >"$dir/browser.txt" 2>"$dir/browser.log" &
  browser_pid=$!
  pids+=("$browser_pid")
  for _ in $(seq 3000); do
    [ -e "$dir/live/ready" ] && break
    kill -0 "$browser_pid" 2>/dev/null || die "the browser client failed: $(tail -5 "$dir/browser.log")"
    sleep 0.1
  done
  [ -e "$dir/live/ready" ] || die "the browser client was not ready within 5 minutes"
  say "-- first render in Chromium, from a blank page (load $(cut -d' ' -f1-3 /proc/loadavg))"
  br() { echo "$(field "$1_p50_ms" "$dir/browser.txt") / $(field "$1_p99_ms" "$dir/browser.txt") ms (n $(field "$1_n" "$dir/browser.txt"))"; }
  say "rollouts page:            $(br render_rollouts)   row: $(grep '^render_rollouts_row:' "$dir/browser.txt" | cut -d' ' -f2- | head -c 120)"
  say "rollout page (200 devs):  $(br render_rollout)   first row: $(grep '^render_rollout_row:' "$dir/browser.txt" | cut -d' ' -f2- | head -c 80)"

  mosquitto_sub -h 127.0.0.1 -p "$port" -q 1 -t 'flotilla/v1/devices/+/report' -F '%U %t' >"$dir/reports.times" 2>/dev/null &
  sub_pid=$!
  pids+=("$sub_pid")
  sleep 1
  cli rollout start probe >"$dir/start-probe.out" 2>&1 || die "start probe: $(cat "$dir/start-probe.out")"
  wait "$probe_pid" || die "the probe simulator failed: $(tail -3 "$dir/probe.log")"
  sleep 3
  touch "$dir/live/stop"
  wait "$browser_pid" || die "the browser client failed: $(tail -5 "$dir/browser.log")"
  kill "$sub_pid" 2>/dev/null || true
  grep -c . "$dir/reports.times" >/dev/null || die "no probe report was seen"
  latencies sse "$dir/reports.times" "$dir/live/sse.times" >"$dir/sse.ms"
  latencies dom "$dir/reports.times" "$dir/live/dom.times" >"$dir/dom.ms"
  say "-- a device report to the console, $(wc -l <"$dir/reports.times") reports of $PROBES probe devices (load $(cut -d' ' -f1-3 /proc/loadavg))"
  say "to the SSE event:         $(grep -v missed "$dir/sse.ms" | pcts), missed $(grep -c missed "$dir/sse.ms" || true)"
  say "to the browser's redraw:  $(grep -v missed "$dir/dom.ms" | pcts), missed $(grep -c missed "$dir/dom.ms" || true)"
  say "coordinator:              RSS $(($(kb VmRSS "$coordinator_pid") / 1024)) MiB, CPU $(awk -v t="$(getconf CLK_TCK)" '{printf "%.1f", ($14 + $15) / t}' "/proc/$coordinator_pid/stat") s user+sys in all"
  # The raw figures beside the results: the clients' outputs, each report's latencies.
  { echo "# console_bench browser"; cat "$dir/browser.txt"; echo "# console_bench mqtt"; cat "$dir/mqtt.txt"
    echo "# report (unix s, topic), to the SSE event (ms), to the redraw (ms)"
    paste -d' ' "$dir/reports.times" "$dir/sse.ms" "$dir/dom.ms"; } >"$results.$n.raw.txt"

  kill "$coordinator_pid" 2>/dev/null || true; wait "$coordinator_pid" 2>/dev/null || true
  kill "$broker_pid" 2>/dev/null || true; wait "$broker_pid" 2>/dev/null || true
  say ""
done
say "results: $results"
