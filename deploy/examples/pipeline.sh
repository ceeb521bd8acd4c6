#!/bin/sh
# A release pipeline step over the coordinator's HTTP API (docs/operations.md, "The HTTP API"):
# start a rollout and wait until it ends; exit 0 only when it finished.
#
#   FLOTILLA_OPERATOR_KEY=/etc/ci/release-bot.key \
#   FLOTILLA_API=https://coordinator.example.net:8443 deploy/examples/pipeline.sh fw-2-4
#
# Needs `flotilla` (to sign each request with the operator's key), curl and jq. Each request is
# signed right before it is sent: a signed request is good once, within the clock window.
set -eu
rollout=${1:?usage: pipeline.sh ROLLOUT}
api=${FLOTILLA_API:-http://127.0.0.1:8080}/api/v1/control
every=${FLOTILLA_POLL_SECONDS:-10}

# call '<command JSON>': prints the coordinator's reply; fails with its error.
call() {
  flotilla operator sign "$1" |
    curl -sS --fail-with-body -H 'Content-Type: application/json' --data-binary @- "$api"
}

reply=$(call "{\"command\":\"start_rollout\",\"rollout\":\"$rollout\"}") || {
  echo "cannot start $rollout: $reply" >&2
  exit 1
}
echo "started $rollout"
while :; do
  # Without paging, the status is the rollout's summary: its size does not grow with the fleet.
  reply=$(call "{\"command\":\"rollout_status\",\"rollout\":\"$rollout\"}") || {
    echo "cannot read $rollout: $reply" >&2
    exit 1
  }
  state=$(printf '%s' "$reply" | jq -r .result.state)
  echo "$rollout: $state"
  case "$state" in
    finished) exit 0 ;;
    stopped | failed) exit 1 ;;
  esac
  sleep "$every"
done
