#!/bin/sh
# flotilla update script: switches the image of one docker compose service.
#
# The artifact is a small text file whose first line is an image reference, e.g.
#   registry.example.com/shop/app:2.4.0
# The script writes it into a compose override file next to the project's compose file and
# applies it; rollback puts the previous override back. It follows the script contract in
# docs/targets.md (subcommands, FLOTILLA_* environment, JSON reply, exit codes 0/1/2/3).
#
# Settings (the `env` table of the target's configuration):
#   COMPOSE_DIR      the compose project directory (required)
#   COMPOSE_SERVICE  the service to switch (default: app)
#   COMPOSE_APPLY    command run in COMPOSE_DIR after the override changes
#                    (default: docker compose -f docker-compose.yml -f flotilla.override.yml up -d)
#   COMPOSE_HEALTH   command run by `confirm`; it must exit 0 when the service is healthy
#                    (default: none, confirm always succeeds; the agent's own health checks
#                    decide anyway)
set -u

state=$FLOTILLA_STATE_DIR
id=$FLOTILLA_ACTION_ID
service=${COMPOSE_SERVICE:-app}
apply=${COMPOSE_APPLY:-docker compose -f docker-compose.yml -f flotilla.override.yml up -d}
override=${COMPOSE_DIR:-}/flotilla.override.yml

reply() { # ok message
    printf '{"ok": %s, "message": "%s", "reboot": false}\n' "$1" "$2"
}
fail() { # exit-code message
    echo "$2" >&2
    reply false "$2"
    exit "$1"
}

# Writes the override for image $1 atomically (temp file, sync, rename).
write_override() {
    tmp="$override.flotilla-tmp.$$"
    printf '# written by flotilla (%s); do not edit\nservices:\n  %s:\n    image: %s\n' \
        "$FLOTILLA_RELEASE" "$service" "$1" >"$tmp" || return 1
    sync "$tmp" 2>/dev/null || sync
    mv "$tmp" "$override"
}

run_apply() {
    (cd "$COMPOSE_DIR" && sh -c "$apply") >&2 || fail 1 "applying the compose override failed: $apply"
}

[ -n "${COMPOSE_DIR:-}" ] || fail 1 "COMPOSE_DIR is not set in the target's env table"

case "${1:-}" in
check)
    [ -d "$COMPOSE_DIR" ] || fail 1 "COMPOSE_DIR $COMPOSE_DIR does not exist"
    [ -w "$COMPOSE_DIR" ] || fail 1 "COMPOSE_DIR $COMPOSE_DIR is not writable"
    if [ -z "${COMPOSE_APPLY:-}" ] && ! command -v docker >/dev/null 2>&1; then
        fail 1 "docker is not installed"
    fi
    reply true "ready to switch service $service"
    ;;
stage)
    image=$(head -n 1 "$FLOTILLA_ARTIFACT") || fail 1 "cannot read $FLOTILLA_ARTIFACT"
    case "$image" in
    "" | *[!A-Za-z0-9._/:@-]*) fail 1 "artifact $FLOTILLA_ARTIFACT_NAME does not hold an image reference" ;;
    esac
    printf '%s\n' "$image" >"$state/staged-$id.tmp" && mv "$state/staged-$id.tmp" "$state/staged-$id" ||
        fail 1 "cannot keep the staged image reference in $state"
    reply true "staged $image"
    ;;
activate)
    [ -e "$state/staged-$id" ] || [ -e "$state/previous-$id" ] || [ -e "$state/absent-$id" ] ||
        fail 1 "nothing staged for action $id"
    # Keep what runs now once per action, so a repeated activate never saves the new image.
    if [ ! -e "$state/previous-$id" ] && [ ! -e "$state/absent-$id" ]; then
        if [ -e "$override" ]; then
            cp "$override" "$state/previous-$id.tmp" && mv "$state/previous-$id.tmp" "$state/previous-$id" ||
                fail 1 "cannot keep the previous override"
        else
            touch "$state/absent-$id" || fail 1 "cannot record that there was no override"
        fi
    fi
    if [ -e "$state/staged-$id" ]; then
        write_override "$(cat "$state/staged-$id")" || fail 1 "cannot write $override"
        rm -f "$state/staged-$id"
    fi
    run_apply
    reply true "service $service switched to $FLOTILLA_RELEASE"
    ;;
confirm)
    if [ -n "${COMPOSE_HEALTH:-}" ]; then
        (cd "$COMPOSE_DIR" && sh -c "$COMPOSE_HEALTH") >&2 || fail 1 "service $service is not healthy"
    fi
    # Keep only this action's way back; older ones can no longer be rolled back to.
    for f in "$state"/previous-* "$state"/absent-*; do
        case "$f" in *"-$id") ;; *) rm -f "$f" ;; esac
    done
    reply true "service $service confirmed on $FLOTILLA_RELEASE"
    ;;
rollback)
    rm -f "$state/staged-$id"
    if [ -e "$state/previous-$id" ]; then
        cp "$state/previous-$id" "$override.flotilla-tmp.$$" && mv "$override.flotilla-tmp.$$" "$override" ||
            fail 1 "cannot restore the previous override"
    elif [ -e "$state/absent-$id" ]; then
        rm -f "$override" || fail 1 "cannot remove $override"
    else
        reply true "action $id never switched the service; nothing to undo"
        exit 0
    fi
    run_apply
    reply true "service $service rolled back"
    ;;
*)
    fail 2 "unknown subcommand ${1:-(none)}"
    ;;
esac
