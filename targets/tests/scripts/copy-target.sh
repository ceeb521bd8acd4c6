#!/bin/sh
# Update script used by the conformance suite: replaces the file $DEST the way the file target
# does, through the script contract (docs/targets.md). It keeps the previous file per action
# in $FLOTILLA_STATE_DIR so rollback can put it back.
#
# If $FAIL_CONFIRM_FILE names an existing file, `confirm` fails: the suite uses that to play a
# service that did not come up.
set -eu

dir=$FLOTILLA_STATE_DIR
id=$FLOTILLA_ACTION_ID

reply() {
    printf '{"ok": true, "message": "%s", "reboot": false}\n' "$1"
}

case "${1:-}" in
check)
    [ -d "$(dirname "$DEST")" ] || { echo "the directory of $DEST does not exist" >&2; exit 1; }
    reply "ready to update $DEST"
    ;;
stage)
    cp "$FLOTILLA_ARTIFACT" "$dir/staging.tmp"
    mv "$dir/staging.tmp" "$dir/staged-$id"
    reply "staged $FLOTILLA_ARTIFACT_NAME"
    ;;
activate)
    # Save what is there once per action, so a repeated activate never saves the new file.
    if [ ! -e "$dir/previous-$id" ] && [ ! -e "$dir/absent-$id" ]; then
        if [ -e "$DEST" ]; then
            cp "$DEST" "$dir/previous.tmp"
            mv "$dir/previous.tmp" "$dir/previous-$id"
        else
            touch "$dir/absent-$id"
        fi
    fi
    if [ -e "$dir/staged-$id" ]; then
        cp "$dir/staged-$id" "$DEST.tmp"
        mv "$DEST.tmp" "$DEST"
        rm -f "$dir/staged-$id"
    fi
    reply "activated $FLOTILLA_RELEASE"
    ;;
confirm)
    if [ -n "${FAIL_CONFIRM_FILE:-}" ] && [ -e "$FAIL_CONFIRM_FILE" ]; then
        echo "the service did not come up with $FLOTILLA_RELEASE" >&2
        exit 1
    fi
    reply "confirmed $FLOTILLA_RELEASE"
    ;;
rollback)
    rm -f "$dir/staged-$id"
    if [ -e "$dir/previous-$id" ]; then
        cp "$dir/previous-$id" "$DEST.tmp"
        mv "$DEST.tmp" "$DEST"
    elif [ -e "$dir/absent-$id" ]; then
        rm -f "$DEST"
    fi
    reply "rolled back from phase $FLOTILLA_PHASE"
    ;;
*)
    echo "unknown subcommand ${1:-(none)}" >&2
    exit 2
    ;;
esac
