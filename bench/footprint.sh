#!/usr/bin/env bash
# Footprint of the flotilla agent, measured beside Debian's mender-client in the same run.
#
# Usage (from anywhere, as root for apt-get and /etc/mender): bench/footprint.sh
# Environment: CARGO_TARGET_DIR (default: <repo>/target), ARTIFACT_MB (default 256),
#              VERIFY_RUNS (default 5), RESULTS (default bench/results.txt),
#              AGENT_FEATURES (cargo --features for the agent builds, e.g.
#              sled/miri_optimizations; default none),
#              BROKER_TLS=1 (run the site on the shipped deploy/mosquitto configuration: TLS,
#              passwords for the coordinator and the CLI, a client certificate for the agent),
#              MENDER=0 (skip the mender-client figures).
#
# Prints, and writes to bench/results.txt:
#   - stripped sizes of the release agent for aarch64 and x86-64;
#   - idle RSS of the x86-64 release agent connected to a Mosquitto broker;
#   - its peak RSS (VmHWM from /proc) while it downloads, verifies and installs an ARTIFACT_MB
#     artifact from a real coordinator;
#   - the speed of the agent's verification loop (bench/verify-speed) against sha256sum on the
#     same file, best of VERIFY_RUNS each with the file in the page cache;
#   - the same size and RSS figures for Debian's mender-client (daemon idle against an
#     unreachable server; peak of a standalone `mender install` of an ARTIFACT_MB artifact).
# Nothing here passes or fails on a number: it reports them. docs/performance.md has the figures.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}"
export CARGO_TERM_COLOR=never
export PATH="$PATH:/usr/sbin"
ARTIFACT_MB="${ARTIFACT_MB:-256}"
VERIFY_RUNS="${VERIFY_RUNS:-5}"
results="${RESULTS:-$repo/bench/results.txt}"
AGENT_FEATURES="${AGENT_FEATURES:-}"
BROKER_TLS="${BROKER_TLS:-0}"
MENDER="${MENDER:-1}"
feature_args=()
[ -z "$AGENT_FEATURES" ] || feature_args=(--features "$AGENT_FEATURES")

work="$(mktemp -d /tmp/flotilla-footprint.XXXXXX)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

: >"$results"
say() { echo "$*" | tee -a "$results"; }
die() { echo "footprint: $*" >&2; exit 1; }
kb() { awk -v k="$1" '/^'"$1"':/ {print $2}' "/proc/$2/status"; }
mib() { awk -v b="$1" 'BEGIN {printf "%.2f MiB", b / 1048576}'; }
kib_mib() { awk -v k="$1" 'BEGIN {printf "%.2f MiB", k / 1024}'; }
now() { date +%s.%N; }

say "# flotilla footprint, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
say "# host: $(uname -m), $(nproc) cores, $(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)"
say "# commit: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown), agent features: ${AGENT_FEATURES:-none}, broker TLS: $BROKER_TLS"

# ---- builds -------------------------------------------------------------------------------
echo "footprint: building (release agent x86-64 and aarch64, flotilla CLI, verify loop)" >&2
cargo build -q --release -p flotilla-agent "${feature_args[@]}"
cargo build -q --release -p flotilla-agent "${feature_args[@]}" --target aarch64-unknown-linux-gnu ||
  die "aarch64 build failed: rustup target add aarch64-unknown-linux-gnu; apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross"
cargo build -q -p flotilla-coordinator --bin flotilla
cargo build -q --release --manifest-path bench/verify-speed/Cargo.toml
agent="$CARGO_TARGET_DIR/release/flotilla-agent"
arm_agent="$CARGO_TARGET_DIR/aarch64-unknown-linux-gnu/release/flotilla-agent"
flotilla_bin="$CARGO_TARGET_DIR/debug/flotilla"
verify_bin="$CARGO_TARGET_DIR/release/flotilla-verify-speed"

say ""
say "## flotilla-agent"
say "size.aarch64: $(stat -c %s "$arm_agent") bytes ($(mib "$(stat -c %s "$arm_agent")"), stripped: $(file -b "$arm_agent" | grep -o 'not stripped\|stripped'))"
say "size.x86_64: $(stat -c %s "$agent") bytes ($(mib "$(stat -c %s "$agent")"))"

# ---- a site: Mosquitto, coordinator, one release agent ----------------------------------
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
port="$(free_port)"
agent_port="$port"
coordinator_login=""
agent_login=""
login_args=()
if [ "$BROKER_TLS" = 1 ]; then
  # The shipped configuration and ACL, on free loopback ports (as tests/src/secure.rs does).
  b="$work/broker"
  mkdir -p "$b"
  sh deploy/mosquitto/make-certs.sh "$b/tls" ca
  sh deploy/mosquitto/make-certs.sh "$b/tls" server broker DNS:localhost IP:127.0.0.1
  sh deploy/mosquitto/make-certs.sh "$b/tls" client bench-01
  : >"$b/passwords"
  for user in flotilla-coordinator flotilla-operator; do
    head -c 24 /dev/urandom | base64 >"$b/$user.password"
    mosquitto_passwd -b "$b/passwords" "$user" "$(cat "$b/$user.password")"
  done
  agent_port="$(free_port)"
  sed -e "s#^acl_file /etc/mosquitto/flotilla/acl#acl_file $repo/deploy/mosquitto/acl#" \
    -e "s#/etc/mosquitto/flotilla/#$b/#" -e "s#^persistence true#persistence false#" \
    -e "/^persistence_location/d" -e "s#^listener 8883\$#listener $port 127.0.0.1#" \
    -e "s#^listener 8884\$#listener $agent_port 127.0.0.1#" deploy/mosquitto/mosquitto.conf >"$work/mosquitto.conf"
  printf 'user root\nlog_dest stderr\n' >>"$work/mosquitto.conf"
  coordinator_login="username = \"flotilla-coordinator\"
password_file = \"$b/flotilla-coordinator.password\"
[broker.tls]
ca_file = \"$b/tls/ca.crt\""
  agent_login="[broker.tls]
ca_file = \"$b/tls/ca.crt\"
client_cert = \"$b/tls/bench-01.crt\"
client_key = \"$b/tls/bench-01.key\""
  login_args=(--username flotilla-operator --password-file "$b/flotilla-operator.password" --ca-file "$b/tls/ca.crt")
else
  printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\nlog_dest stderr\n' "$port" >"$work/mosquitto.conf"
fi
mosquitto -c "$work/mosquitto.conf" >"$work/mosquitto.log" 2>&1 &
pids+=($!)
for p in "$port" "$agent_port"; do
  for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && break
    sleep 0.1
  done
done
fl() { "$flotilla_bin" --broker "127.0.0.1:$port" "${login_args[@]}" "$@"; }

fl keygen --out "$work/keys" >/dev/null
head -c "$((ARTIFACT_MB * 1024 * 1024))" /dev/urandom >"$work/artifact.bin"
fl release create --data-dir "$work/coordinator" --key "$work/keys/release.key" --name fw-bench \
  --version 2.0.0 --counter 2 --hardware bench-board --artifact "app=$work/artifact.bin" >/dev/null
cat >"$work/coordinator.toml" <<EOF
data_dir = "$work/coordinator"
coordinator_key = "$work/keys/coordinator.key"
[broker]
host = "127.0.0.1"
port = $port
$coordinator_login
EOF
# Not through fl(): a backgrounded function is a subshell, and killing it would leave the
# coordinator running.
RUST_LOG=warn "$flotilla_bin" --broker "127.0.0.1:$port" serve --config "$work/coordinator.toml" >"$work/coordinator.log" 2>&1 &
pids+=($!)

mkdir -p "$work/agent"
echo "factory firmware" >"$work/agent/app.bin"
cat >"$work/agent/agent.toml" <<EOF
device_id = "bench-01"
hardware_id = "bench-board"
data_dir = "$work/agent/data"
[broker]
host = "127.0.0.1"
port = $agent_port
keep_alive = "30s"
$agent_login
[labels]
env = "bench"
[trust]
release_keys = ["$(cat "$work/keys/release.pub")"]
coordinator_keys = ["$(cat "$work/keys/coordinator.pub")"]
[[target]]
name = "app"
kind = "file"
path = "$work/agent/app.bin"
[health]
soak = "1s"
interval = "500ms"
[[health.check]]
name = "non-empty"
command = ["/usr/bin/test", "-s", "$work/agent/app.bin"]
timeout = "5s"
[download]
block_size = 65536
in_flight = 4
max_bytes_per_sec = 0
EOF
RUST_LOG=warn "$agent" run --config "$work/agent/agent.toml" >"$work/agent.log" 2>&1 &
agent_pid=$!
pids+=("$agent_pid")

online=""
for _ in $(seq 300); do
  if fl devices --json 2>/dev/null | python3 -c 'import json,sys; sys.exit(0 if any(d["id"]=="bench-01" and d["online"] for d in json.load(sys.stdin)) else 1)' 2>/dev/null; then
    online=1
    break
  fi
  sleep 0.2
done
[ -n "$online" ] || { tail -20 "$work/agent.log" "$work/coordinator.log" >&2; die "the agent did not come online"; }
# Let it settle: connection set up, retained messages read, state reported.
sleep 5
idle_rss="$(kb VmRSS "$agent_pid")"
say "rss.idle: $idle_rss kB ($(kib_mib "$idle_rss")), x86-64 release agent connected to Mosquitto$([ "$BROKER_TLS" = 1 ] && echo " over mutual TLS")"

cat >"$work/rollout.toml" <<EOF
name = "fw-bench-rollout"
release = "fw-bench"
[groups]
count = 1
success = { threshold = "100%", action = "next" }
error = { threshold = "50%", action = "pause" }
EOF
fl rollout create --spec "$work/rollout.toml" >/dev/null
started="$(now)"
fl rollout start fw-bench-rollout >/dev/null
state=""
for _ in $(seq 3000); do
  state="$(fl rollout status fw-bench-rollout --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])' 2>/dev/null || true)"
  case "$state" in finished | paused | stopped | error) break ;; esac
  sleep 0.5
done
finished="$(now)"
peak_rss="$(kb VmHWM "$agent_pid")"
after_rss="$(kb VmRSS "$agent_pid")"
[ "$state" = finished ] || { tail -20 "$work/agent.log" >&2; die "the rollout ended as '$state', not finished"; }
cmp -s "$work/artifact.bin" "$work/agent/app.bin" || die "the installed file differs from the artifact"
say "rss.peak_install_${ARTIFACT_MB}MiB: $peak_rss kB ($(kib_mib "$peak_rss")), VmHWM over the agent's life, install included"
say "rss.peak_minus_idle: $((peak_rss - idle_rss)) kB ($(kib_mib "$((peak_rss - idle_rss))"))"
say "rss.after_install: $after_rss kB ($(kib_mib "$after_rss"))"
say "install.wall_seconds: $(awk -v a="$started" -v b="$finished" 'BEGIN {printf "%.1f", b - a}') (rollout start to finished, incl. 1 s soak and status polling; informational)"

# ---- verify speed -------------------------------------------------------------------------
best() {
  local best_t="" t s e
  for _ in $(seq "$VERIFY_RUNS"); do
    s="$(now)"
    "$@" >/dev/null
    e="$(now)"
    t="$(awk -v a="$s" -v b="$e" 'BEGIN {print b - a}')"
    if [ -z "$best_t" ] || awk -v t="$t" -v b="$best_t" 'BEGIN {exit !(t < b)}'; then best_t="$t"; fi
  done
  echo "$best_t"
}
cat "$work/artifact.bin" >/dev/null
[ "$("$verify_bin" "$work/artifact.bin" | cut -d' ' -f1)" = "$(sha256sum "$work/artifact.bin" | cut -d' ' -f1)" ] ||
  die "the verify loop and sha256sum disagree on $work/artifact.bin"
t_agent="$(best "$verify_bin" "$work/artifact.bin")"
t_sum="$(best sha256sum "$work/artifact.bin")"
rate() { awk -v mb="$ARTIFACT_MB" -v t="$1" 'BEGIN {printf "%.0f MiB/s (%.3f s)", mb / t, t}'; }
say "verify.agent_loop: $(rate "$t_agent") for ${ARTIFACT_MB} MiB, best of $VERIFY_RUNS"
say "verify.sha256sum: $(rate "$t_sum") ($(sha256sum --version | head -n 1))"
say "verify.ratio: $(awk -v a="$t_agent" -v s="$t_sum" 'BEGIN {printf "%.2f", s / a}')x sha256sum's speed"
say "cpu.sha_extensions: $(grep -o -w -m1 sha_ni /proc/cpuinfo | head -n 1 || echo none)"

# ---- Debian's mender-client -----------------------------------------------------------------
if [ "$MENDER" = 0 ]; then
  echo "footprint: wrote $results (MENDER=0: no mender-client figures)" >&2
  exit 0
fi
say ""
say "## mender-client (Debian)"
mender_why=""
if ! command -v mender >/dev/null 2>&1 || ! command -v mender-artifact >/dev/null 2>&1 || [ ! -x /usr/bin/time ]; then
  echo "footprint: installing mender-client mender-artifact time" >&2
  if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends mender-client mender-artifact time >"$work/apt.log" 2>&1 ||
    { apt-get update -q >>"$work/apt.log" 2>&1 &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends mender-client mender-artifact time >>"$work/apt.log" 2>&1; }; }; then
    mender_why="apt-get install mender-client mender-artifact time failed: $(tail -n 1 "$work/apt.log")"
  fi
fi
if [ -n "$mender_why" ]; then
  say "mender: NOT MEASURED: $mender_why"
  exit 0
fi
mender_bin="$(command -v mender)"
say "mender.version: $(mender --version 2>&1 | head -n 1)"
say "mender.size.x86_64: $(stat -c %s "$mender_bin") bytes ($(mib "$(stat -c %s "$mender_bin")"), $(file -b "$mender_bin" | grep -o 'not stripped\|stripped'))"

m="$work/mender"
mkdir -p "$m/data/scripts" "$m/files" "$m/dest"
echo 3 >"$m/data/scripts/version"
echo "device_type=bench-board" >"$m/data/device_type"
echo '{"ServerURL":"http://127.0.0.1:9","UpdatePollIntervalSeconds":5,"InventoryPollIntervalSeconds":5,"RetryPollIntervalSeconds":5}' >"$m/mender.conf"
# mender reads the factory artifact name from this fixed path; created only when absent.
if [ ! -e /etc/mender/artifact_info ]; then
  mkdir -p /etc/mender && echo "artifact_name=factory" >/etc/mender/artifact_info
fi
mender_args=(--config "$m/mender.conf" --fallback-config "$m/mender.conf" --data "$m/data" --no-syslog)

mender "${mender_args[@]}" daemon >"$m/daemon.log" 2>&1 &
mender_pid=$!
pids+=("$mender_pid")
sleep 10
if kill -0 "$mender_pid" 2>/dev/null; then
  m_idle="$(kb VmRSS "$mender_pid")"
  say "mender.rss.idle: $m_idle kB ($(kib_mib "$m_idle")), 'mender daemon' 10 s after start, retrying an unreachable server"
  kill "$mender_pid" 2>/dev/null || true
else
  say "mender.rss.idle: NOT MEASURED: 'mender daemon' exited: $(tail -n 1 "$m/daemon.log")"
fi

cp "$work/artifact.bin" "$m/files/app.bin"
printf '%s' "$m/dest" >"$m/files/dest_dir"
printf 'app.bin' >"$m/files/filename"
printf '644' >"$m/files/permissions"
if mender-artifact write module-image -T single-file -t bench-board -n fw-bench -o "$m/app.mender" \
  -f "$m/files/app.bin" -f "$m/files/dest_dir" -f "$m/files/filename" -f "$m/files/permissions" \
  --compression none >"$m/artifact.log" 2>&1 &&
  /usr/bin/time -f '%M' -o "$m/maxrss" mender "${mender_args[@]}" install "$m/app.mender" >"$m/install.log" 2>&1 &&
  cmp -s "$work/artifact.bin" "$m/dest/app.bin"; then
  m_peak="$(tail -n 1 "$m/maxrss")"
  say "mender.rss.peak_install_${ARTIFACT_MB}MiB: $m_peak kB ($(kib_mib "$m_peak")), standalone 'mender install' of a local single-file artifact (max RSS of it and its children)"
  mender "${mender_args[@]}" commit >/dev/null 2>&1 || true
else
  say "mender.rss.peak_install_${ARTIFACT_MB}MiB: NOT MEASURED: $(tail -n 1 "$m/install.log" "$m/artifact.log" 2>/dev/null | tr '\n' ' ')"
fi
echo "footprint: wrote $results" >&2
