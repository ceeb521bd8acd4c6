# A three-node NATS cluster for the fleet benchmark (sourced by bench/fleet.sh after bench/lib.sh
# when BROKER=nats). Each node starts from the shipped deploy/nats files (node-N.conf including
# cluster.conf), transformed the way bench/lib.sh's broker_conf transforms the shipped Mosquitto
# configuration: the ports become free loopback ports, the routes point at the other nodes'
# loopback ports, the TLS blocks (routes and MQTT) and the users (include users.conf) go, so
# every client connects in plain MQTT without a login as it does to the benchmark's Mosquitto;
# JetStream and `stream_replicas` stay as shipped, the store in the work directory. The same
# edits as tests/src/nats.rs makes, which checks that the shipped file still has what it
# replaces.

nats_ports=(); nats_pids=(); nats_dir=""
command -v nats-server >/dev/null || die "nats-server not found (apt-get install nats-server)"
command -v mosquitto_pub >/dev/null || die "mosquitto_pub not found (apt-get install mosquitto-clients)"

# The shipped cluster.conf with the ports of node $2 (1-3) out of "client route mqtt" triples in
# $3.. (one per node), the JetStream store in $1; no TLS, no users.
nats_node_conf() {
  local store="$1" i="$2"
  shift 2
  local ports=("$@") mine client route mqtt k routes=()
  mine=(${ports[$((i - 1))]})
  client=${mine[0]}; route=${mine[1]}; mqtt=${mine[2]}
  for k in 1 2 3; do routes+=("$(echo "${ports[$((k - 1))]}" | cut -d' ' -f2)"); done
  local shipped="$repo/deploy/nats/cluster.conf" from
  for from in 'listen: 127.0.0.1:4222' 'store_dir: /var/lib/nats/jetstream' 'listen: 0.0.0.0:6222' \
    'listen: 0.0.0.0:8883' 'nats-1.example.net:6222' 'nats-2.example.net:6222' \
    'nats-3.example.net:6222' 'include users.conf' 'tls {' 'stream_replicas'; do
    grep -qF "$from" "$shipped" || die "deploy/nats/cluster.conf no longer has '$from'; update bench/nats.sh"
  done
  # Drops comments and every `tls { ... }` block (nested braces counted), then edits the ports.
  awk '
    /^[ \t]*#/ { next }
    skip > 0 { n = gsub(/\{/, "{"); m = gsub(/\}/, "}"); skip += n - m; next }
    /^[ \t]*tls[ \t]*\{/ { n = gsub(/\{/, "{"); m = gsub(/\}/, "}"); skip = n - m; next }
    /^[ \t]*include[ \t]+users\.conf/ { next }
    { print }
  ' "$shipped" | sed \
    -e "s|listen: 127.0.0.1:4222|listen: 127.0.0.1:$client|" \
    -e "s|store_dir: /var/lib/nats/jetstream|store_dir: \"$store\"|" \
    -e "s|listen: 0.0.0.0:6222|listen: 127.0.0.1:$route|" \
    -e "s|listen: 0.0.0.0:8883|listen: 127.0.0.1:$mqtt|" \
    -e "s|nats-1.example.net:6222|127.0.0.1:${routes[0]}|" \
    -e "s|nats-2.example.net:6222|127.0.0.1:${routes[1]}|" \
    -e "s|nats-3.example.net:6222|127.0.0.1:${routes[2]}|"
}

# start_nats DIR MQTT_PORT: the three nodes in DIR/nats-N, node 1's MQTT listener on MQTT_PORT
# (the coordinator's and the CLI's), nats_ports[1..3] the MQTT ports, nats_pids[1..3] the nodes;
# broker_pid is node 1. Waits until every node keeps an MQTT session (a QoS 1 subscription
# granted and a retained QoS 1 publish acknowledged): a node whose JetStream is not ready yet
# takes the TCP connection and drops the client.
start_nats() {
  local dir="$1" port1="$2" i triples=() node
  nats_dir="$dir"
  for i in 1 2 3; do
    if [ "$i" = 1 ]; then nats_ports[1]=$port1; else nats_ports[$i]=$(free_port); fi
    triples+=("$(free_port) $(free_port) ${nats_ports[$i]}")
  done
  for i in 1 2 3; do
    node="$dir/nats-$i"
    mkdir -p "$node/nats-flotilla"
    nats_node_conf "$node/jetstream" "$i" "${triples[@]}" >"$node/nats-flotilla/cluster.conf"
    cp "$repo/deploy/nats/node-$i.conf" "$node/node.conf"
    nats-server -c "$node/node.conf" >"$node/nats.log" 2>&1 &
    nats_pids[$i]=$!
    pids+=("${nats_pids[$i]}")
  done
  broker_pid=${nats_pids[1]}
  for i in 1 2 3; do wait_port "${nats_ports[$i]}"; done
  for _ in $(seq 600); do
    grep -q "metadata leader" "$dir"/nats-*/nats.log && break
    sleep 0.05
  done
  grep -q "metadata leader" "$dir"/nats-*/nats.log || die "the NATS cluster elected no JetStream leader within 30 s (logs in $dir/nats-*/nats.log)"
  for i in 1 2 3; do nats_ready "$i"; done
}

nats_ready() {
  local i="$1" p="${nats_ports[$1]}"
  for _ in $(seq 60); do
    if timeout 10 mosquitto_sub -h 127.0.0.1 -p "$p" -q 1 -i "ready-check-$i" \
        -t 'flotilla/v1/devices/+/state' -E >/dev/null 2>&1 &&
      timeout 10 mosquitto_pub -h 127.0.0.1 -p "$p" -q 1 -i "ready-check-$i" -r -n \
        -t flotilla/v1/ready-check >/dev/null 2>&1; then
      return 0
    fi
    sleep 0.5
  done
  die "NATS node $i (MQTT on $p) kept no MQTT session within 60 s: $(tail -5 "$nats_dir/nats-$i/nats.log")"
}

# The nodes' CPU (user + system seconds) summed.
nats_cpu_s() {
  local i total=0
  for i in 1 2 3; do
    total=$(awk -v a="$total" -v b="$(cpu_s "${nats_pids[$i]}" 2>/dev/null || echo 0)" 'BEGIN {printf "%.2f", a + b}')
  done
  echo "$total"
}

# One line per node: RSS, peak RSS, CPU, JetStream store size, warnings and errors logged.
nats_nodes() {
  local i p
  for i in 1 2 3; do
    p=${nats_pids[$i]}
    if kill -0 "$p" 2>/dev/null; then
      echo "node $i: RSS $(($(kb VmRSS "$p") / 1024)) MiB (peak $(($(kb VmHWM "$p") / 1024)) MiB), CPU $(cpu_s "$p") s, store $(du -sh "$nats_dir/nats-$i/jetstream" 2>/dev/null | cut -f1), log: $(grep -c '\[WRN\]' "$nats_dir/nats-$i/nats.log" || true) warnings, $(grep -c '\[ERR\]' "$nats_dir/nats-$i/nats.log" || true) errors"
    else
      echo "node $i: not running; log: $(grep -c '\[WRN\]' "$nats_dir/nats-$i/nats.log" || true) warnings, $(grep -c '\[ERR\]' "$nats_dir/nats-$i/nats.log" || true) errors"
    fi
  done
}

stop_nats() {
  local i
  for i in 1 2 3; do kill "${nats_pids[$i]}" 2>/dev/null || true; done
  for i in 1 2 3; do wait "${nats_pids[$i]}" 2>/dev/null || true; done
}

# The nodes' logs, summed up in <results>.<n>.nats-logs.txt: each kind of warning and error
# with its count (numbers and ids stripped), and each node's last lines.
nats_log_summary() {
  local out="$1" i
  for i in 1 2 3; do
    echo "== node $i"
    grep -E '\[(WRN|ERR)\]' "$nats_dir/nats-$i/nats.log" 2>/dev/null |
      sed -E 's/^\[[0-9]+\] [0-9/]+ [0-9:.]+ //; s/[0-9]+(\.[0-9]+)?/N/g; s/"[^"]*"/"..."/g' |
      sort | uniq -c | sort -rn | head -25
    echo "-- last lines"
    tail -15 "$nats_dir/nats-$i/nats.log" 2>/dev/null
  done >"$out"
}

# At exit (lib.sh's cleanup): when the run failed with the cluster up, what the cluster and the
# simulator had got to, into <results>.nats-failure.txt and printed.
nats_cleanup() {
  local status="$1" f
  [ "$status" != 0 ] && [ -n "${nats_dir:-}" ] || return 0
  f="$results.nats-failure.txt"
  {
    echo "the run failed (exit $status) at $(date -u +%H:%M:%SZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
    nats_nodes
    [ -n "${dir:-}" ] && [ -e "$dir/fleetsim.log" ] && { echo "-- simulator's last lines"; tail -8 "$dir/fleetsim.log"; }
    [ -n "${dir:-}" ] && [ -e "$dir/coordinator.log" ] &&
      echo "coordinator log: $(wc -l <"$dir/coordinator.log") lines, $(grep -c 'MQTT connection lost' "$dir/coordinator.log" || true) connections lost, $(grep -c ' WARN ' "$dir/coordinator.log" || true) warnings"
    [ -n "${metrics_port:-}" ] && echo "coordinator: $(curl -s "http://127.0.0.1:$metrics_port/metrics" 2>/dev/null |
      awk '/^flotilla_messages_received_total\{.*topic="state"/ {s = $2} /^flotilla_registry_loading / {l = $2} END {printf "states read %s, loading %s", s, l}')"
  } >"$f" 2>&1
  nats_log_summary "$f.logs"
  [ -n "${dir:-}" ] && [ -e "$dir/fleetsim.log" ] && cp "$dir/fleetsim.log" "$f.fleetsim.log"
  cat "$f" >&2
}
