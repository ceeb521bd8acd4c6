#!/usr/bin/env bash
# CI check of the Debian packages (.ci/run calls it; needs root for dpkg -i and --purge):
#
#  1. builds the amd64 packages (deploy/deb/build.sh: release binaries),
#  2. lintian: no error and no warning (what is overridden says why, in the package's
#     usr/share/lintian/overrides),
#  3. installs them with dpkg -i and checks what the maintainer scripts did (system user, data
#     directory, the coordinator's key, the conffiles are the default configs, the agent's unit
#     left disabled until configured, the coordinator's enabled),
#  4. systemd-analyze verify on the installed units (works without systemd as PID 1),
#  5. runs the installed binaries from /usr/bin: `flotilla demo` (an embedded broker on a free
#     port, the installed flotilla-agent processes, a three-group rollout that must finish with
#     every device ready), and the packaged coordinator command line (the unit's ExecStart, as
#     the unit's user, with the packaged config) against a test Mosquitto on a free port,
#     and the agent upgrading itself: a release whose artifact is a newer flotilla-agent .deb,
#     installed by the packaged /usr/lib/flotilla/agent-deb.sh through a `script` target, with
#     the installed agent restarted mid-action as systemd would (see step 5c),
#  6. purges them and checks that nothing is left but the system user `flotilla` (Debian
#     policy keeps users),
#  7. builds the arm64 and armhf packages when their cross builds are there (ARM=1 makes a
#     missing one an error) and lists their contents,
#  8. builds the agent again together with the coordinator and fails when it is more than
#     AGENT_BUILD_GAP bytes (default 49152) larger than the packaged one: one agent binary
#     however it is built (docs/decisions/0065-one-agent-binary.md).
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
dpkg -i "$agent_deb" "$coord_deb" | tee "$work/dpkg-i.log"
[ -x /usr/bin/flotilla ] && [ -x /usr/bin/flotilla-agent ] || fail "binaries not in /usr/bin"
/usr/bin/flotilla-agent print-default-config | cmp -s - /etc/flotilla/agent.toml ||
  fail "/etc/flotilla/agent.toml is not what flotilla-agent print-default-config prints"
/usr/bin/flotilla-agent check-config --config /etc/flotilla/agent.toml
[ "$(stat -c %a /etc/flotilla/agent.toml)" = 600 ] || fail "agent.toml is not 0600"
[ -d /var/lib/flotilla-agent ] || fail "no /var/lib/flotilla-agent"
# The CLI's completions and man page: present, and what the installed binary makes.
/usr/bin/flotilla completions bash | cmp -s - /usr/share/bash-completion/completions/flotilla ||
  fail "the packaged bash completion is not what flotilla completions bash prints"
[ -s /usr/share/zsh/vendor-completions/_flotilla ] && [ -s /usr/share/fish/vendor_completions.d/flotilla.fish ] ||
  fail "no zsh or fish completion in the package"
zcat /usr/share/man/man1/flotilla.1.gz | grep '^\.TH flotilla 1' >/dev/null || fail "no flotilla(1) man page"
bash -c 'source /usr/share/bash-completion/completions/flotilla && complete -p flotilla' >/dev/null ||
  fail "the bash completion does not register for flotilla"
getent passwd flotilla >/dev/null || fail "postinst made no system user flotilla"
[ "$(stat -c %U:%G /var/lib/flotilla)" = flotilla:flotilla ] || fail "/var/lib/flotilla is not flotilla's"
[ "$(stat -c %U:%a /var/lib/flotilla/keys/coordinator.key)" = flotilla:600 ] ||
  fail "the coordinator's key is not the flotilla user's alone"
dpkg-query -W -f='${Conffiles}\n' flotilla-agent flotilla | grep /etc/flotilla/coordinator.toml >/dev/null ||
  fail "coordinator.toml is not a conffile"
# The agent's unit stays disabled until the operator has configured the agent (an agent on the
# default config would start at every boot and fail); postinst says what to do. The
# coordinator's, which runs on its default config, is enabled.
wants=/etc/systemd/system/multi-user.target.wants
[ ! -e "$wants/flotilla-agent.service" ] || fail "the agent's unit is enabled on the default config"
[ -L "$wants/flotilla.service" ] || fail "the coordinator's unit is not enabled"
grep -q 'then: systemctl enable --now flotilla-agent.service' "$work/dpkg-i.log" ||
  fail "postinst did not say how to enable the agent once configured"
[ -x /usr/lib/flotilla/agent-deb.sh ] || fail "no /usr/lib/flotilla/agent-deb.sh"

step "4. systemd-analyze verify"
verify=$(systemd-analyze verify /lib/systemd/system/flotilla-agent.service \
  /lib/systemd/system/flotilla.service 2>&1) || fail "systemd-analyze verify: $verify"
[ -z "$verify" ] || fail "systemd-analyze verify complained: $verify"
grep -qx 'Type=notify' /lib/systemd/system/flotilla-agent.service || fail "agent unit is not Type=notify"

step "5a. a rollout by the installed binaries: /usr/bin/flotilla demo with /usr/bin/flotilla-agent"
# --keep: step 5c rolls the agent's own upgrade out to one of these devices.
(cd "$work" && TMPDIR="$work" /usr/bin/flotilla demo --devices 3 --fail 0 --json --timeout 120 --keep \
  >demo.json 2>demo.log) || fail "flotilla demo: $(tail -n 20 "$work/demo.log")"
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
# Its Environment= lines (RUST_LOG, MALLOC_ARENA_MAX): single words, no quoting to undo.
unit_env=$(sed -n 's/^Environment=//p' /lib/systemd/system/flotilla.service)
# The unit's command as its user (setpriv execs it: the signal reaches the coordinator itself),
# with the unit's environment and the broker on the free port instead of 127.0.0.1:1883.
# shellcheck disable=SC2086
setpriv --reuid=flotilla --regid=flotilla --init-groups env $unit_env FLOTILLA_BROKER="127.0.0.1:$port" $exec_start \
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

step "5c. the agent upgrades itself: a newer flotilla-agent .deb by the packaged agent-deb.sh"
# What docs/operations.md, "Upgrading the agent with flotilla", tells operators to do, with the
# installed binaries: the same release binary packaged again as a newer version, a release whose
# artifact is that .deb for a `script` target running /usr/lib/flotilla/agent-deb.sh, and a
# rollout to one device. No systemd runs here, so three stand-ins play its part:
#  - a supervisor loop runs /usr/bin/flotilla-agent and starts it again when it exits
#    (Restart=always), counting the restarts;
#  - `systemd-run --unit=U --on-active=S CMD` runs CMD after S seconds in a session of its own
#    (setsid), so it outlives the agent as a transient unit does, and `systemctl is-active U.timer
#    U.service` answers while it waits or runs; `systemctl stop U.timer` cancels it;
#  - `dpkg -i` of flotilla-agent then stops the running agent (SIGTERM, SIGKILL after 60 s:
#    TimeoutStopSec) and waits for it to exit, as the postinst's `deb-systemd-invoke restart`
#    does under systemd (without /run/systemd/system it leaves the agent alone).
self_start=$SECONDS
selfup="$work/selfup"
shims="$selfup/shims"
units="$selfup/units"
mkdir -p "$selfup" "$shims" "$units"
old_version=$(dpkg-query -W -f '${Version}' flotilla-agent)
new_version="${old_version%-*}-2"
dpkg --compare-versions "$new_version" gt "$old_version" || fail "$new_version is not newer than $old_version"
deploy/deb/build.sh --arch amd64 --out "$selfup" --no-build --only flotilla-agent \
  --deb-version "$new_version" >/dev/null
new_deb="$selfup/flotilla-agent_${new_version}_amd64.deb"
[ "$(dpkg-deb -f "$new_deb" Version)" = "$new_version" ] || fail "build.sh --deb-version made no $new_deb"

cat >"$shims/systemd-run" <<EOF
#!/bin/sh
unit= delay=0
while [ \$# -gt 0 ]; do
  case "\$1" in
    --unit=*) unit=\${1#--unit=} ;;
    --on-active=*) delay=\${1#--on-active=} ;;
    --collect) ;;
    -*) echo "systemd-run (CI stand-in): \$1 is not supported" >&2; exit 1 ;;
    *) break ;;
  esac
  shift
done
[ -n "\$unit" ] || { echo "systemd-run (CI stand-in): no --unit" >&2; exit 1; }
echo "\$unit \$*" >>"$units/scheduled"
: >"$units/\$unit"
setsid /bin/sh -c 'sleep "\$1"; u=\$2; shift 2
  [ -e "$units/\$u" ] || exit 0
  "\$@" >>"$units/\$u.log" 2>&1; echo \$? >"$units/\$u.rc"; rm -f "$units/\$u"' \\
  sh "\$delay" "\$unit" "\$@" </dev/null >/dev/null 2>&1 &
EOF
cat >"$shims/systemctl" <<EOF
#!/bin/sh
case "\$1" in
  is-active)
    shift
    for u in "\$@"; do
      case "\$u" in --quiet) continue ;; esac
      [ -e "$units/\${u%.*}" ] && exit 0
    done
    exit 3 ;;
  stop)
    # A pending transient timer: its command does not run.
    case "\$2" in *.timer) rm -f "$units/\${2%.timer}" ;; esac ;;
  *) echo "systemctl (CI stand-in): \$* is not supported" >&2; exit 1 ;;
esac
EOF
cat >"$shims/dpkg" <<EOF
#!/bin/sh
/usr/bin/dpkg "\$@" || exit \$?
case " \$* " in *" -i "*) ;; *) exit 0 ;; esac
echo "\$*" >>"$units/installs"
# The postinst's restart under systemd: stop the agent, the supervisor starts it again.
pid=\$(cat "$selfup/agent.pid")
kill -TERM "\$pid" 2>/dev/null || exit 0
for _ in \$(seq 1 600); do kill -0 "\$pid" 2>/dev/null || exit 0; sleep 0.1; done
kill -KILL "\$pid" 2>/dev/null || true
EOF
chmod 0755 "$shims/systemd-run" "$shims/systemctl" "$shims/dpkg"

# The coordinator and a device of step 5a's demo (kept; README, "Your first rollout"): dev-01,
# given the agent target, a soak longer than the install's delay and a label of its own (the
# other two stay offline).
kept=$(sed -n 's/^kept //p' "$work/demo.log")
[ -d "$kept" ] || fail "flotilla demo --keep kept no directory: $(tail -n 20 "$work/demo.log")"
selfup_port=$(sed -n 's/^embedded = "127.0.0.1:\([0-9]*\)"$/\1/p' "$kept/coordinator.toml")
agent_conf="$kept/agents/dev-01/agent.toml"
sed -i -e 's/^soak = .*/soak = "6s"/' -e 's/^fleet = "demo"$/fleet = "demo"\nupgrade = "self"/' "$agent_conf"
bad_version="${old_version%-*}-3"
# The health check of a bad new agent (the way back, below): it fails in an agent started from
# a configured $bad_version; the agent that runs while dpkg replaces its binary (its
# /proc/PID/exe then "(deleted)") is not the new one.
cat >"$selfup/not-bad.sh" <<EOF
#!/bin/sh
[ "\$(dpkg-query -W -f '\${Status} \${Version}' flotilla-agent)" != "install ok installed $bad_version" ] ||
  readlink /proc/\$PPID/exe | grep deleted >/dev/null
EOF
cat >>"$agent_conf" <<EOF
[[target]]
name = "agent"
kind = "script"
path = "/usr/lib/flotilla/agent-deb.sh"
env = { AGENT_DEB_DELAY = "1" }
[[health.check]]
name = "agent-starts"
command = ["/usr/bin/flotilla-agent", "--version"]
timeout = "5s"
[[health.check]]
name = "not-the-bad-agent"
command = ["/bin/sh", "$selfup/not-bad.sh"]
timeout = "5s"
EOF
/usr/bin/flotilla-agent check-config --config "$agent_conf" >/dev/null ||
  fail "the device's config with the agent target does not check"
(cd "$kept" && exec /usr/bin/flotilla serve --config coordinator.toml >serve.log 2>&1) &
pids+=($!)
wait_port "$selfup_port" "the demo's coordinator (embedded broker)"
(
  cd "$kept"
  while [ ! -e "$selfup/stop" ]; do
    PATH="$shims:$PATH" RUST_LOG=info /usr/bin/flotilla-agent run --config "$agent_conf" \
      >>"$selfup/agent.log" 2>&1 &
    echo $! >"$selfup/agent.pid"
    wait $! && code=0 || code=$?
    [ -e "$selfup/stop" ] || echo "exit $code" >>"$selfup/restarts"
    sleep 0.2
  done
) &
supervisor=$!
pids+=("$supervisor")

cli() {
  (cd "$kept" && FLOTILLA_BROKER="127.0.0.1:$selfup_port" FLOTILLA_OPERATOR_KEY=keys/demo.key \
    /usr/bin/flotilla "$@")
}
online=
for _ in $(seq 1 300); do
  online=$(cli devices --select upgrade=self --json 2>/dev/null |
    python3 -c 'import json,sys; print(" ".join(d["id"] for d in json.load(sys.stdin) if d["online"]))' \
    2>/dev/null || true)
  [ "$online" = dev-01 ] && break
  sleep 0.2
done
[ "$online" = dev-01 ] || fail "dev-01 did not come online with its new label: $(tail -n 20 "$selfup/agent.log")"

# Releases the .deb $3 as $1 (counter $2) and rolls it out to dev-01; sets $state (the
# rollout's, once settled) and $device (dev-01's phase, installed release and failure reason, as
# the running agent reports them).
roll_out() {
  cli release create --data-dir coordinator --key keys/release.key --name "$1" \
    --version "$(dpkg-deb -f "$3" Version)" --counter "$2" --hardware demo-board \
    --artifact "agent=$3" >"$selfup/release-$1.log" 2>&1 ||
    fail "release create $1: $(cat "$selfup/release-$1.log")"
  printf 'name = "%s"\nrelease = "%s"\nselect = "upgrade=self"\n[groups]\ncount = 1\n%s\n%s\n' \
    "roll-$1" "$1" 'success = { threshold = "80%", action = "next" }' \
    'error = { threshold = "20%", action = "pause" }' >"$selfup/$1.toml"
  cli rollout create --spec "$selfup/$1.toml" >/dev/null || fail "rollout create roll-$1"
  cli rollout start "roll-$1" >/dev/null || fail "rollout start roll-$1"
  state=
  for _ in $(seq 1 600); do
    state=$(cli rollout status "roll-$1" --json 2>/dev/null |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])' 2>/dev/null || true)
    case "$state" in finished | paused | stopped | failed) break ;; esac
    sleep 0.2
  done
  device=$(cli devices --select upgrade=self --json | python3 -c 'import json,sys
d = [d for d in json.load(sys.stdin) if d["id"] == "dev-01"][0]
print(d["phase"], d["installed"], d["reason"] or "")')
}
settled() { # unit: its stand-in transient unit has run
  for _ in $(seq 1 300); do
    [ -e "$units/$1" ] || return 0
    sleep 0.1
  done
  fail "$1 did not run within 30 s: $(cat "$units/$1.log" 2>/dev/null)"
}
agent_version() { dpkg-query -W -f '${Version}' flotilla-agent; }
count() { # file: its lines (0 without it)
  if [ -e "$1" ]; then wc -l <"$1"; else echo 0; fi
}

rollout_start=$SECONDS
roll_out agent-next 10 "$new_deb"
rollout_took=$((SECONDS - rollout_start))
[ "$state" = finished ] || fail "the self-upgrade rollout is $state, not finished:
$(cli rollout status roll-agent-next 2>&1 | tail -n 20)
agent log: $(grep -i -E 'error|warn|fail' "$selfup/agent.log" | tail -n 20)
installs: $(cat "$units"/*.log 2>/dev/null | tail -n 20)"
[ "$device" = "ready agent-next " ] || fail "dev-01 is \"$device\", not ready with agent-next installed"
[ "$(agent_version)" = "$new_version" ] ||
  fail "dpkg-query shows flotilla-agent $(agent_version), not $new_version"
[ "$(count "$selfup/restarts")" = 1 ] ||
  fail "the agent was restarted $(count "$selfup/restarts") times, not once: $(cat "$selfup/restarts")"
# Mid-action: the restarted agent found the action in its soak and went on from there.
sed 's/\x1b\[[0-9;]*m//g' "$selfup/agent.log" | grep 'resuming.*state=Confirming' >/dev/null ||
  fail "the restarted agent did not resume the action in its soak: $(grep -E 'resuming|action finished' "$selfup/agent.log")"
[ "$(count "$units/scheduled")" = 1 ] && [ "$(count "$units/installs")" = 1 ] ||
  fail "the install ran more than once: scheduled $(cat "$units/scheduled"); installed $(cat "$units/installs")"
echo "deb: flotilla-agent $old_version -> $new_version by a rollout in $rollout_took s," \
  "the agent restarted once mid-action"

# The way back: a newer agent whose health check fails (the check below fails in an agent
# started from an installed $bad_version) is rolled back, and the script reinstalls the package
# the last upgrade installed.
deploy/deb/build.sh --arch amd64 --out "$selfup" --no-build --only flotilla-agent \
  --deb-version "$bad_version" >/dev/null
rollout_start=$SECONDS
roll_out agent-bad 11 "$selfup/flotilla-agent_${bad_version}_amd64.deb"
settled flotilla-agent-downgrade
rollout_took=$((SECONDS - rollout_start))
[ "$state" = paused ] && [ "${device%% *}" = failed ] ||
  fail "a failing new agent: the rollout is $state (not paused), dev-01 \"$device\" (not failed)"
case "$device" in *not-the-bad-agent*) ;; *) fail "dev-01 failed for another reason: $device" ;; esac
[ "$(agent_version)" = "$new_version" ] ||
  fail "after the rollback dpkg-query shows flotilla-agent $(agent_version), not $new_version"
[ "$(count "$selfup/restarts")" = 3 ] ||
  fail "the agent was restarted $(count "$selfup/restarts") times, not 3 (install, reinstall): $(cat "$selfup/restarts")"
echo "deb: flotilla-agent $bad_version failed its health check and was rolled back to" \
  "$new_version in $rollout_took s (dev-01: ${device#* * })"

touch "$selfup/stop"
kill -TERM "$(cat "$selfup/agent.pid")" 2>/dev/null || true
wait "$supervisor" || true
echo "deb: the agent's self-upgrade and its rollback took $((SECONDS - self_start)) s"

step "6. dpkg --purge"
dpkg --purge flotilla-agent flotilla
left=()
for path in /usr/bin/flotilla /usr/bin/flotilla-agent /usr/lib/flotilla /etc/flotilla /var/lib/flotilla \
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
  if ! rustup target list --installed 2>/dev/null | grep -x "$triple" >/dev/null ||
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
step "8. one agent however it is built: the package's agent against a build beside the coordinator"
# Cargo builds each dependency once per build with the union of the features every package in
# it asks for, so `cargo build --release` of the agent together with the coordinator makes a
# different agent from the package's `-p flotilla-agent` (docs/decisions/0065-one-agent-binary.md).
# The two must stay within AGENT_BUILD_GAP bytes (stripped, x86-64): about 33 KB is known and
# accepted (19 KB of layout from crates the agent does not call, and 13 KB of clap's `color` and
# tracing-subscriber's `ansi`, which the coordinator asks for and the agent leaves out to stay
# under 3 MiB on aarch64); a feature that pulls code into the agent only in the workspace build
# (as tracing-subscriber's `init` once did, +156 KB) is not.
# `--bin flotilla-agent` builds only the agent, with the features both packages ask for (the
# coordinator's own binary is not linked again). With --target of the host, as build.sh builds,
# so the coordinator's dependencies built for its package are used again. Last step: it rebuilds
# target/TRIPLE/release/flotilla-agent, which no step above may use after it.
gap_limit=${AGENT_BUILD_GAP:-49152}
dpkg-deb --fsys-tarfile "$agent_deb" | tar -xO ./usr/bin/flotilla-agent >"$work/agent-alone"
alone=$(stat -c %s "$work/agent-alone")
together_start=$SECONDS
host_triple=$(rustc -vV | sed -n 's/^host: //p')
cargo build --release --target "$host_triple" -p flotilla-agent -p flotilla-coordinator --bin flotilla-agent
# Stripped as build.sh strips the packaged one (.comment and .note out too).
cp "$target_dir/$host_triple/release/flotilla-agent" "$work/agent-together"
strip --remove-section=.comment --remove-section=.note "$work/agent-together"
together=$(stat -c %s "$work/agent-together")
gap=$((together - alone))
echo "deb: flotilla-agent stripped: $alone bytes alone (the package), $together bytes built with the coordinator: $gap bytes apart (at most $gap_limit; that build took $((SECONDS - together_start)) s)"
[ "${gap#-}" -le "$gap_limit" ] ||
  fail "the agent built with the coordinator is $gap bytes larger than the packaged one (more than $gap_limit): a dependency feature the coordinator asks for now reaches the agent (docs/decisions/0065-one-agent-binary.md)"

step "done"
