# Shared by the benchmarks that run a coordinator against a Mosquitto of their own (fleet.sh,
# download.sh). Source it after setting `bench` (the script's name, for messages), `profile`
# (release, fleetsim or debug) and `results` (the results file).

die() { echo "$bench: $*" >&2; exit 1; }

command -v mosquitto >/dev/null || die "mosquitto not found (apt-get install mosquitto)"

# The coordinator's environment as its systemd unit sets it (coordinator/flotilla.service):
# MALLOC_ARENA_MAX=2, two glibc malloc arenas (decision 0071). COORDINATOR_ARENAS=N sets another
# count, COORDINATOR_ARENAS=default leaves glibc's own (eight a core). Start the coordinator as
# `env "${coordinator_env[@]}" "$flotilla" serve ...`: env execs it, so $! is its pid.
case "${COORDINATOR_ARENAS:-2}" in
  default) coordinator_env=(-u MALLOC_ARENA_MAX) ;;
  *[!0-9]*) die "COORDINATOR_ARENAS is a number or default, not ${COORDINATOR_ARENAS}" ;;
  *) coordinator_env=("MALLOC_ARENA_MAX=${COORDINATOR_ARENAS:-2}") ;;
esac

# Builds PACKAGES in $profile and the simulator with fast signing (Cargo.toml, profile.fleetsim)
# so that the devices are not what is measured; sets $bin (the profile's binaries) and $fleetsim.
build_bins() {
  local flags=()
  case "$profile" in
    release) flags=(--release) ;;
    fleetsim) flags=(--profile fleetsim) ;;
  esac
  cargo build -q "${flags[@]}" "$@" --bins
  local sim_profile=fleetsim sim_dir=fleetsim
  [ "$profile" = debug ] && { sim_profile=dev; sim_dir=debug; }
  cargo build -q --profile "$sim_profile" -p flotilla-fleetsim --bins
  bin="$CARGO_TARGET_DIR/$profile"
  fleetsim="$CARGO_TARGET_DIR/$sim_dir/flotilla-fleetsim"
}

# A work directory, removed at exit (KEEP=1 keeps it), and every process in $pids killed. The
# coordinator flushes every store write (sled, fsync), and a flush on this shared VM's disk takes
# ~10-40 ms, which alone would set every figure: data directories go on tmpfs unless
# DATA_ON_DISK=1 (docs/performance.md has both).
make_work() {
  if [ -z "${DATA_ON_DISK:-}" ] && [ -d /dev/shm ]; then
    work="$(mktemp -d "/dev/shm/flotilla-$1.XXXXXX")"
  else
    work="$(mktemp -d "/tmp/flotilla-$1.XXXXXX")"
  fi
  pids=()
  trap cleanup EXIT
}
cleanup() {
  local status=$?
  # A NATS cluster (bench/nats.sh) records what it got to before it is killed.
  if declare -F nats_cleanup >/dev/null; then nats_cleanup "$status"; fi
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  # PostgreSQL clusters started by bench/pg.sh are not this shell's children.
  if declare -F pg_cleanup >/dev/null; then pg_cleanup; fi
  [ -n "${KEEP:-}" ] && echo "kept $work" >&2 || rm -rf "$work"
}

say() { echo "$*" | tee -a "$results"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
field() { awk -v k="$1:" '$1 == k {print $2}' "$2"; }
wait_port() {
  for _ in $(seq 200); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  die "nothing listens on $1"
}

# The shipped broker settings on plain loopback: everything but listeners, TLS, passwords, ACL
# and persistence location.
broker_conf() {
  local port="$1"
  grep -vE '^\s*(#|$|listener|cafile|certfile|keyfile|tls_version|require_certificate|use_identity_as_username|use_username_as_clientid|password_file|acl_file|allow_anonymous|persistence|persistence_location|per_listener_settings)' \
    deploy/mosquitto/mosquitto.conf || true
  echo "per_listener_settings false"
  echo "allow_anonymous true"
  echo "persistence false"
  echo "listener $port 127.0.0.1"
  # Sizing for a fleet over few connections (docs/operations.md): unless the shipped file sets
  # them, no queue limit and no Nagle delay.
  grep -q '^max_queued_messages' deploy/mosquitto/mosquitto.conf || echo "max_queued_messages 0"
  grep -q '^set_tcp_nodelay' deploy/mosquitto/mosquitto.conf || echo "set_tcp_nodelay true"
}

# A coordinator config in DIR/coordinator.toml: data and keys in DIR, the broker on PORT, the
# devices of DIR/authorized_devices pre-authorized, one admin operator (DIR/keys/admin.pub) and
# /metrics on a free port ($metrics_port).
coordinator_conf() {
  local dir="$1" port="$2"
  metrics_port=$(free_port)
  cat >"$dir/coordinator.toml" <<EOC
data_dir = "$dir/coordinator"
coordinator_key = "$dir/keys/coordinator.key"
[broker]
host = "127.0.0.1"
port = $port
[enrollment]
authorized_keys = "$dir/authorized_devices"
[[operators]]
name = "admin"
role = "admin"
key_file = "$dir/keys/admin.pub"
[metrics]
listen = "127.0.0.1:$metrics_port"
EOC
}
