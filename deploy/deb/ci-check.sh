#!/usr/bin/env bash
# CI check of the Debian packages (.ci/run calls it; needs root for dpkg -i and --purge):
#
#  1. builds the amd64 packages (deploy/deb/build.sh: release binaries),
#  2. lintian: no error and no warning (what is overridden says why, in the package's
#     usr/share/lintian/overrides),
#  3. installs them with dpkg -i and checks what the maintainer scripts did (system user, data
#     directory, the coordinator's key, the conffiles are the default configs),
#  4. systemd-analyze verify on the installed units (works without systemd as PID 1),
#  5. runs the installed binaries from /usr/bin: `flotilla demo` (an embedded broker on a free
#     port, the installed flotilla-agent processes, a three-group rollout that must finish with
#     every device ready), and the packaged coordinator command line (the unit's ExecStart, as
#     the unit's user, with the packaged config) against a test Mosquitto on a free port,
#  6. purges them and checks that nothing is left but the system user `flotilla` (Debian
#     policy keeps users),
#  7. builds the arm64 and armhf packages when their cross builds are there (ARM=1 makes a
#     missing one an error) and lists their contents.
#
# Leaves the .deb files in $CARGO_TARGET_DIR/deb (target/deb). Prints how long each step took.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PATH:/usr/sbin:/sbin"

fail() {
  echo "deb: FAILED: $*" >&2
  exit 1
}
step_start=$SECONDS
step() {
  echo "deb: ($((SECONDS - step_start)) s) $*"
}
[ "$(id -u)" = 0 ] || fail "needs root (dpkg -i, dpkg --purge)"
for tool in dpkg-deb lintian systemd-analyze mosquitto readelf; do
  command -v "$tool" >/dev/null || fail "$tool is missing (.ci/run installs it)"
done
for pkg in flotilla flotilla-agent; do
  if dpkg -s "$pkg" >/dev/null 2>&1; then
    fail "$pkg is installed already: this check installs and purges it"
  fi
done

target_dir="${CARGO_TARGET_DIR:-target}"
case "$target_dir" in /*) ;; *) target_dir="$PWD/$target_dir" ;; esac
out="$target_dir/deb"
rm -rf "$out"
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
wait_port() { # port what
  for _ in $(seq 1 100); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  fail "$2 did not listen on $1 within 10 s"
}

step "1. build the amd64 packages (cargo build --release of flotilla-agent and flotilla)"
build_start=$SECONDS
deploy/deb/build.sh --arch amd64 --out "$out"
echo "deb: release build and packaging took $((SECONDS - build_start)) s"
agent_deb=$(ls "$out"/flotilla-agent_*_amd64.deb)
coord_deb=$(ls "$out"/flotilla_*_amd64.deb)

step "2. lintian"
lintian --fail-on error,warning --display-info "$agent_deb" "$coord_deb" ||
  fail "lintian found errors or warnings (above)"

step "3. dpkg -i"
dpkg -i "$agent_deb" "$coord_deb"
[ -x /usr/bin/flotilla ] && [ -x /usr/bin/flotilla-agent ] || fail "binaries not in /usr/bin"
/usr/bin/flotilla-agent print-default-config | cmp -s - /etc/flotilla/agent.toml ||
  fail "/etc/flotilla/agent.toml is not what flotilla-agent print-default-config prints"
/usr/bin/flotilla-agent check-config --config /etc/flotilla/agent.toml
[ "$(stat -c %a /etc/flotilla/agent.toml)" = 600 ] || fail "agent.toml is not 0600"
[ -d /var/lib/flotilla-agent ] || fail "no /var/lib/flotilla-agent"
getent passwd flotilla >/dev/null || fail "postinst made no system user flotilla"
[ "$(stat -c %U:%G /var/lib/flotilla)" = flotilla:flotilla ] || fail "/var/lib/flotilla is not flotilla's"
[ "$(stat -c %U:%a /var/lib/flotilla/keys/coordinator.key)" = flotilla:600 ] ||
  fail "the coordinator's key is not the flotilla user's alone"
dpkg-query -W -f='${Conffiles}\n' flotilla-agent flotilla | grep -q /etc/flotilla/coordinator.toml ||
  fail "coordinator.toml is not a conffile"

step "4. systemd-analyze verify"
verify=$(systemd-analyze verify /lib/systemd/system/flotilla-agent.service \
  /lib/systemd/system/flotilla.service 2>&1) || fail "systemd-analyze verify: $verify"
[ -z "$verify" ] || fail "systemd-analyze verify complained: $verify"
grep -qx 'Type=notify' /lib/systemd/system/flotilla-agent.service || fail "agent unit is not Type=notify"

step "5a. a rollout by the installed binaries: /usr/bin/flotilla demo with /usr/bin/flotilla-agent"
(cd "$work" && /usr/bin/flotilla demo --devices 3 --fail 0 --json --timeout 120 >demo.json 2>demo.log) ||
  fail "flotilla demo: $(tail -n 20 "$work/demo.log")"
grep -q '"state": "finished"' "$work/demo.json" || fail "the demo rollout did not finish: $(cat "$work/demo.json")"
[ "$(grep -c '"phase": "ready"' "$work/demo.json")" = 3 ] ||
  fail "not every device is ready: $(cat "$work/demo.json")"

step "5b. the packaged coordinator (the unit's ExecStart, as flotilla) against a test Mosquitto"
# Where systemd runs, postinst started the unit (on 127.0.0.1:1883): this run takes its place.
if [ -d /run/systemd/system ]; then systemctl stop flotilla.service; fi
port=$(free_port)
printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\nlog_dest stderr\n' "$port" >"$work/mosquitto.conf"
mosquitto -c "$work/mosquitto.conf" >"$work/mosquitto.log" 2>&1 &
pids+=($!)
wait_port "$port" mosquitto
exec_start=$(sed -n 's/^ExecStart=//p' /lib/systemd/system/flotilla.service)
# The unit's command as its user (setpriv execs it: the signal reaches the coordinator itself),
# with the broker on the free port instead of 127.0.0.1:1883.
setpriv --reuid=flotilla --regid=flotilla --init-groups env FLOTILLA_BROKER="127.0.0.1:$port" RUST_LOG=info $exec_start \
  >"$work/serve.log" 2>&1 &
serve=$!
pids+=("$serve")
connected=0
for _ in $(seq 1 100); do
  if grep -q "MQTT connected" "$work/serve.log"; then connected=1; break; fi
  kill -0 "$serve" 2>/dev/null || break
  sleep 0.1
done
[ "$connected" = 1 ] || fail "the packaged coordinator did not connect: $(tail -n 20 "$work/serve.log")"
[ -d /var/lib/flotilla/db ] || fail "the coordinator kept no store in /var/lib/flotilla"
kill -TERM "$serve"
wait "$serve" || fail "the coordinator did not stop cleanly on SIGTERM: $(tail -n 20 "$work/serve.log")"

step "6. dpkg --purge"
dpkg --purge flotilla-agent flotilla
left=()
for path in /usr/bin/flotilla /usr/bin/flotilla-agent /etc/flotilla /var/lib/flotilla \
  /var/lib/flotilla-agent /lib/systemd/system/flotilla.service \
  /lib/systemd/system/flotilla-agent.service /usr/share/doc/flotilla /usr/share/doc/flotilla-agent \
  /etc/systemd/system/multi-user.target.wants/flotilla.service \
  /etc/systemd/system/multi-user.target.wants/flotilla-agent.service; do
  [ -e "$path" ] && left+=("$path")
done
left+=($(ls /var/lib/systemd/deb-systemd-helper-enabled/ /var/lib/systemd/deb-systemd-helper-masked/ 2>/dev/null |
  grep flotilla || true))
[ ${#left[@]} = 0 ] || fail "left behind after purge: ${left[*]}"
if dpkg -s flotilla >/dev/null 2>&1 || dpkg -s flotilla-agent >/dev/null 2>&1; then
  fail "dpkg still knows the packages after purge"
fi
echo "deb: purged; kept, as Debian policy advises: the system user flotilla"

step "7. the arm64 and armhf packages"
for arch in arm64 armhf; do
  case "$arch" in
    arm64) triple=aarch64-unknown-linux-gnu ;;
    armhf) triple=armv7-unknown-linux-gnueabihf ;;
  esac
  if ! rustup target list --installed 2>/dev/null | grep -qx "$triple" ||
    ! command -v "$(sed -n "/\[target.$triple\]/{n;s/linker = \"\(.*\)\"/\1/p}" .cargo/config.toml)" >/dev/null; then
    [ "${ARM:-0}" = 1 ] && fail "no $triple toolchain for the $arch packages"
    echo "deb: SKIPPING $arch: no $triple toolchain (.ci/run installs it)" >&2
    continue
  fi
  deploy/deb/build.sh --arch "$arch" --out "$out"
  for deb in "$out"/*_"$arch".deb; do
    echo "deb: $(basename "$deb")"
    dpkg-deb -f "$deb" Package Version Architecture Depends | sed 's/^/deb:   /'
    dpkg-deb -c "$deb" | sed 's/^/deb:   /'
    dpkg-deb --fsys-tarfile "$deb" | tar -xO ./usr/bin/"$(dpkg-deb -f "$deb" Package)" >"$work/bin"
    echo "deb:   ELF machine: $(readelf -h "$work/bin" | sed -n 's/.*Machine: *//p')"
  done
done
step "done"
