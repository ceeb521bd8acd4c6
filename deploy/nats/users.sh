#!/bin/sh
# Writes the users and permissions of a flotilla NATS cluster (users.conf, included by
# cluster.conf) from a directory of passwords, one file per login: SECRETS_DIR/NAME.password.
#
#   users.sh SECRETS_DIR [NAME...] > users.conf
#
# Each NAME without a password file gets a new random one first (give that file to the device
# or person). The role comes from the name, as in the Mosquitto ACL (deploy/mosquitto/acl):
#
#   flotilla-coordinator    every flotilla topic; and flotilla-coordinator-control, with the
#                           same password, for its control connection (decision 0066): reads
#                           control requests, writes control replies
#   flotilla-operator*      control requests, its own login's control replies, the events
#   flotilla-observer*      the events, read only
#   flotilla-monitor*       every flotilla topic, read only
#   anything else           a device, its user name its device id: writes its own report,
#                           state and fetch, reads its own desired and block
#
# NATS names MQTT topics as subjects (flotilla/v1/x becomes flotilla.v1.x), so the permissions
# below are subjects. A subscription at QoS 1 also needs $MQTT.sub.> (the subject the server
# delivers it on); MQTT clients cannot subscribe to $MQTT topics themselves, and every login is
# MQTT only, so that grant reads nothing of anyone else's. Nothing else of NATS's internal
# subjects is needed: retained messages and sessions are stored by the server itself. Decision
# 0061 records how this set was found. Topics assume the default root "flotilla"; NATS 2.9 does
# not carry MQTT topics with a dot, so device ids with one are refused here.
#
# After a change, reload every node: nats-server --signal reload (or systemctl reload
# nats-server). Passwords are in the clear in users.conf: keep it, and SECRETS_DIR, readable
# by the nats user alone.
set -eu
[ $# -ge 1 ] || { echo "usage: $0 SECRETS_DIR [NAME...] > users.conf" >&2; exit 2; }
secrets=$1
shift
umask 077
mkdir -p "$secrets"

valid() {
  case "$1" in
    '' | .* | *[!A-Za-z0-9_-]*) return 1 ;;
  esac
  [ ${#1} -le 128 ]
}

for name in "$@"; do
  valid "$name" || {
    echo "$0: $name: a login name is letters, digits, '-' and '_' (NATS 2.9 carries no dot in a topic)" >&2
    exit 1
  }
  [ -f "$secrets/$name.password" ] || openssl rand -hex 24 > "$secrets/$name.password"
done

root=flotilla.v1
sub_qos1='"$MQTT.sub.>"'
# An MQTT filter a/# matches a itself too: NATS subscribes to both a.> and a.
events="\"$root.events\", \"$root.events.>\""
user() { # name password publish-permission subscribe-permission
  printf '    { user: "%s", password: "%s", allowed_connection_types: ["MQTT"],\n' "$1" "$2"
  printf '      permissions: { publish: %s, subscribe: %s } }\n' "$3" "$4"
}

echo "# flotilla: NATS users, made by users.sh from $secrets; do not edit by hand."
echo "authorization {"
echo "  users: ["
found=0
for file in "$secrets"/*.password; do
  [ -f "$file" ] || continue
  name=$(basename "$file" .password)
  valid "$name" || { echo "$0: $file: not a valid login name" >&2; exit 1; }
  password=$(cat "$file")
  case "$password" in
    '' | *'"'* | *'\'* | *' '*)
      echo "$0: $file: a password is one word without quotes or backslashes" >&2
      exit 1
      ;;
  esac
  case "$name" in
    flotilla-coordinator)
      user "$name" "$password" "{ allow: [\"$root.>\"] }" \
        "{ allow: [\"$root\", \"$root.>\", $sub_qos1] }"
      # Its control connection (decision 0066): the same password, requests in, replies out.
      user "$name-control" "$password" "{ allow: [\"$root.control.reply.>\"] }" \
        "{ allow: [\"$root.control.request\", $sub_qos1] }"
      ;;
    flotilla-coordinator-control)
      echo "$0: $file: flotilla-coordinator-control is made from flotilla-coordinator's password; remove this file" >&2
      exit 1
      ;;
    flotilla-operator*)
      user "$name" "$password" "{ allow: [\"$root.control.request\"] }" \
        "{ allow: [\"$root.control.reply.$name\", $events, $sub_qos1] }"
      ;;
    flotilla-observer*)
      user "$name" "$password" '{ deny: [">"] }' \
        "{ allow: [$events, $sub_qos1] }"
      ;;
    flotilla-monitor*)
      user "$name" "$password" '{ deny: [">"] }' \
        "{ allow: [\"$root\", \"$root.>\", $sub_qos1] }"
      ;;
    flotilla-*)
      echo "$0: $name: no such flotilla role (coordinator, operator*, observer*, monitor*)" >&2
      exit 1
      ;;
    *)
      device="$root.devices.$name"
      user "$name" "$password" \
        "{ allow: [\"$device.report\", \"$device.state\", \"$device.fetch\"] }" \
        "{ allow: [\"$device.desired\", \"$device.block\", $sub_qos1] }"
      ;;
  esac
  found=$((found + 1))
done
echo "  ]"
echo "}"
[ "$found" -gt 0 ] || { echo "$0: no *.password files in $secrets" >&2; exit 1; }
