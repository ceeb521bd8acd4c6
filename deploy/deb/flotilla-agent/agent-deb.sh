#!/bin/sh
# flotilla `script` target that upgrades the agent itself: the release's artifact is a
# flotilla-agent .deb (docs/operations.md, "Upgrading the agent with flotilla"). Installed by
# the flotilla-agent package as /usr/lib/flotilla/agent-deb.sh; use it with
#
#   [[target]]
#   name = "agent"
#   kind = "script"
#   path = "/usr/lib/flotilla/agent-deb.sh"
#   # env = { AGENT_DEB_DELAY = "5" }   # seconds from `activate` to the install
#
# Two rules make a self-upgrade safe:
#  - dpkg runs outside the agent's cgroup, in a transient unit (systemd-run): the package's
#    postinst restarts flotilla-agent.service, and systemd stops a unit by killing every process
#    in its cgroup, so a dpkg run by the agent itself would be killed half way.
#  - `activate` only schedules the install AGENT_DEB_DELAY seconds ahead and returns: it is not
#    repeatable, and an agent restarted inside it fails the action. The restart then lands in
#    the health soak (make the soak longer than the delay and the install), and the new agent
#    resumes the action: a fresh soak, then `confirm`, which checks that the new version is the
#    one installed.
# `rollback` reinstalls the package that ran before, kept by the last upgrade this script made
# (installed.deb in the state directory; put the .deb you installed by hand there to have a way
# back from the first one). The target's contract (arguments, FLOTILLA_* variables, exit codes) is in docs/targets.md.
# This script runs as root, as the agent does; its files in FLOTILLA_STATE_DIR (0700, the
# agent's) never start with "flotilla-", which the target keeps for itself.
set -eu

state=${FLOTILLA_STATE_DIR:?FLOTILLA_STATE_DIR is not set: run by the flotilla agent only}
next="$state/next.deb"
installed="$state/installed.deb"
previous="$state/previous.deb"
delay=${AGENT_DEB_DELAY:-5}
upgrade=flotilla-agent-upgrade
downgrade=flotilla-agent-downgrade
# dpkg must never ask: the operator's edited agent.toml stays, a new default config of the
# package goes beside it as agent.toml.dpkg-dist.
dpkg_install="dpkg --force-confdef --force-confold -i"

version_of() { # .deb
  dpkg-deb -f "$1" Version
}

installed_version() {
  dpkg-query -W -f '${Version}' flotilla-agent
}

# A transient unit (its .timer while it waits, its .service while it runs) is still at work.
pending() { # unit
  systemctl is-active --quiet "$1.timer" "$1.service"
}

case "${1:-}" in
  check)
    command -v systemd-run >/dev/null || { echo "systemd-run is missing" >&2; exit 1; }
    ;;
  stage)
    package=$(dpkg-deb -f "$FLOTILLA_ARTIFACT" Package) ||
      { echo "the artifact is not a .deb" >&2; exit 1; }
    [ "$package" = flotilla-agent ] ||
      { echo "the artifact is the package $package, not flotilla-agent" >&2; exit 1; }
    cp "$FLOTILLA_ARTIFACT" "$next.tmp"
    mv "$next.tmp" "$next"
    echo "{\"message\": \"staged flotilla-agent $(version_of "$next")\"}"
    ;;
  activate)
    # The way back: the .deb the last upgrade installed, if it is what runs now.
    rm -f "$previous"
    if [ -e "$installed" ] && [ "$(version_of "$installed")" = "$(installed_version)" ]; then
      cp "$installed" "$previous"
    fi
    systemd-run --unit="$upgrade" --collect --on-active="$delay" \
      /bin/sh -c "$dpkg_install '$next' && cp '$next' '$installed'" >/dev/null
    echo "{\"message\": \"flotilla-agent $(version_of "$next") installs in $delay s\"}"
    ;;
  confirm)
    # The install may still wait for its timer or run (a slow one; with a soak longer than it,
    # the restart has come and gone before confirm runs).
    while pending "$upgrade"; do sleep 1; done
    want=$(version_of "$next")
    have=$(installed_version)
    [ "$have" = "$want" ] ||
      { echo "flotilla-agent $have is installed, not $want" >&2; exit 1; }
    echo "{\"message\": \"flotilla-agent $have installed\"}"
    ;;
  rollback)
    case "${FLOTILLA_PHASE:-}" in
      staging | staged)
        rm -f "$next" "$next.tmp"
        exit 0
        ;;
    esac
    # Before the install ran: cancel it. After: reinstall the previous package the same way.
    if pending "$upgrade"; then systemctl stop "$upgrade.timer" || true; fi
    while pending "$upgrade"; do sleep 1; done
    if [ "$(installed_version)" != "$(version_of "$next")" ]; then
      echo '{"message": "the new flotilla-agent was not installed: nothing to undo"}'
    elif [ -e "$previous" ]; then
      systemd-run --unit="$downgrade" --collect --on-active="$delay" \
        /bin/sh -c "$dpkg_install '$previous' && cp '$previous' '$installed'" >/dev/null
      echo "{\"message\": \"flotilla-agent $(version_of "$previous") reinstalls in $delay s\"}"
    else
      echo "no previous flotilla-agent .deb to go back to (the first upgrade by flotilla)" >&2
      exit 1
    fi
    ;;
  *)
    exit 2
    ;;
esac
