# A private PostgreSQL for the benchmarks (sourced by bench/fleet.sh after bench/lib.sh): its own
# cluster in a directory of the work directory (tmpfs unless DATA_ON_DISK=1, like the
# coordinator's data), on a free loopback port, trusting the `flotilla` user, as
# tests/src/postgres.rs starts one for the tests. Unlike the tests' cluster, `fsync` stays on:
# the benchmark measures what an operator gets. As root, the cluster belongs to `postgres` and
# its tools run through `runuser -u postgres --` (PostgreSQL refuses to run as root).

# The directory holding initdb and pg_ctl: on PATH, or Debian's /usr/lib/postgresql/<major>/bin.
pg_bin_dir() {
  local d
  d="$(dirname "$(command -v initdb 2>/dev/null || echo /nonexistent/x)")"
  if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then echo "$d"; return; fi
  d="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)"
  [ -n "$d" ] && [ -x "$d/initdb" ] || die "PostgreSQL not found (apt-get install postgresql)"
  echo "$d"
}

pg_tool() {
  local tool="$1"; shift
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$pg_bin/$tool" "$@"
  else
    "$pg_bin/$tool" "$@"
  fi
}

# start_pg DIR: a fresh cluster in DIR/pg, started; sets pg_dir, pg_port, pg_url, pg_pid.
start_pg() {
  pg_bin="${pg_bin:-$(pg_bin_dir)}"
  pg_dir="$1/pg"
  mkdir -p "$pg_dir"
  if [ "$(id -u)" = 0 ]; then
    # The postgres user must reach its directory inside the (root-only) work directory.
    chmod 711 "$work" "$1"
    chown postgres: "$pg_dir"
  fi
  pg_tool initdb -D "$pg_dir/data" --auth=trust -U flotilla -E UTF8 --no-sync >"$pg_dir/initdb.log" 2>&1 \
    || die "initdb failed: $(tail -3 "$pg_dir/initdb.log")"
  pg_port=$(free_port)
  pg_tool pg_ctl -D "$pg_dir/data" -l "$pg_dir/postgres.log" \
    -o "-p $pg_port -k $pg_dir -c listen_addresses=127.0.0.1" -w -t 60 start >/dev/null \
    || die "PostgreSQL did not start: $(tail -3 "$pg_dir/postgres.log")"
  pg_pid=$(head -1 "$pg_dir/data/postmaster.pid")
  pg_url="postgres://flotilla@127.0.0.1:$pg_port/postgres"
  pg_running+=("$pg_dir")
}

stop_pg() {
  [ -n "${pg_dir:-}" ] && [ -e "$pg_dir/data/postmaster.pid" ] &&
    pg_tool pg_ctl -D "$pg_dir/data" -m immediate -w stop >/dev/null 2>&1 || true
}

# Every cluster this run started is stopped at exit (lib.sh's cleanup runs pg_cleanup if set).
pg_running=()
pg_cleanup() {
  local d
  for d in "${pg_running[@]}"; do
    [ -e "$d/data/postmaster.pid" ] && pg_tool pg_ctl -D "$d/data" -m immediate -w stop >/dev/null 2>&1 || true
  done
}

# The server's memory in KiB: the proportional set size (shared buffers counted once, not once
# per process) of the postmaster and every process it started (backends, checkpointer, WAL
# writer...), and the plain RSS sum beside it (which counts shared memory in each process).
pg_sum_kb() {
  local file="$1" field="$2" p total=0 v
  for p in "$pg_pid" $(pgrep -P "$pg_pid"); do
    v=$(awk -v f="$field" '$1 == f {print $2}' "/proc/$p/$file" 2>/dev/null || echo 0)
    total=$((total + ${v:-0}))
  done
  echo "$total"
}
pg_pss_kb() { pg_sum_kb smaps_rollup "Pss:"; }
pg_rss_kb() { pg_sum_kb status "VmRSS:"; }

# The `[store]` section of coordinator ID on the running cluster (default lease timings:
# ttl 15, renew 5, margin 3).
pg_store_conf() {
  printf '[store]\nurl = "%s"\ncoordinator_id = "%s"\n' "$pg_url" "$1"
}

# The database's size on disk (pg_size_pretty), tables, indexes and TOAST.
pg_db_size() {
  local psql="$pg_bin/psql"
  [ -x "$psql" ] || psql=psql
  "$psql" -X -A -t -h 127.0.0.1 -p "$pg_port" -U flotilla -d postgres \
    -c "SELECT pg_size_pretty(pg_database_size('postgres'))" 2>/dev/null || echo "?"
}

# User + system CPU seconds of the server so far: the postmaster, its running processes, and
# the backends that already exited (the postmaster's reaped children, cutime + cstime).
pg_cpu_s() {
  local p t ticks=0
  t=$(getconf CLK_TCK)
  ticks=$(awk '{print $14 + $15 + $16 + $17}' "/proc/$pg_pid/stat")
  for p in $(pgrep -P "$pg_pid"); do
    ticks=$((ticks + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)))
  done
  awk -v a="$ticks" -v t="$t" 'BEGIN {printf "%.2f", a / t}'
}
