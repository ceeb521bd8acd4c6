#!/usr/bin/env bash
# Wall time and peak memory of the offline tools, `flotilla plan` and `flotilla simulate`, over
# generated fleets of 100k and 1M devices in both fleet formats the tools read: the fleet file
# format (`{"id", "labels", "hardware_id"}`) and the output of `flotilla devices --json`.
#
# Usage: bench/offline.sh
# Environment: CARGO_TARGET_DIR (default: <repo>/target), SIZES (default "100000 1000000"),
#              SITE_SIZES (default "20000"; "" skips the site budget runs),
#              RUNS (best of; default 3), RESULTS (default bench/results-offline.txt),
#              FLOTILLA (a flotilla binary to measure instead of building the release one),
#              KEEP=1 (keep the generated files in the work directory).
#
# The fleet: 1% of devices `env=canary`, the rest `env=prod`, spread over 8 sites and 3 hardware
# ids, ids `dev-0000000`... in a shuffled order. The spec is a 4-group `[groups]` rollout
# (canary, half of site ber, the other sites, the rest); simulate uses the default outcome (every
# device ready 30 s after its action). Wall time and peak RSS come from GNU time (`%e`, `%M`).
# Nothing here passes or fails on a number: it reports them beside the goals of issue 12
# (plan of 1M < 1 s and < 500 MB; simulate of 1M < 10 s and < 1 GB). docs/performance.md has
# the figures.
#
# Site budgets: `simulate` of SITE_SIZES devices spread over 500 sites (label `site`), a 3-group
# `[groups]` spec with `[groups.sites] max_running = 2`, so most devices wait for their site
# (decision 0031). No goal; it shows that choosing the next device does not grow with the sites.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}"
export CARGO_TERM_COLOR=never
SIZES="${SIZES-100000 1000000}"
SITE_SIZES="${SITE_SIZES-20000}"
RUNS="${RUNS:-3}"
results="${RESULTS:-$repo/bench/results-offline.txt}"

if [ -z "${FLOTILLA:-}" ]; then
    cargo build --release -q -p flotilla-coordinator
    FLOTILLA="$CARGO_TARGET_DIR/release/flotilla"
fi

work="$(mktemp -d /tmp/flotilla-offline.XXXXXX)"
cleanup() { [ "${KEEP:-0}" = 1 ] && echo "files kept in $work" || rm -rf "$work"; }
trap cleanup EXIT

cat >"$work/spec.toml" <<'SPEC'
name = "fw-3-0"
release = "fw-3.0.0"
[groups]
error = { threshold = "5%" }
[[groups.group]]
name = "canary"
select = "env=canary"
[[groups.group]]
name = "ber-half"
select = "site=ber"
percent = 50
[[groups.group]]
name = "sites"
select = "site in (ber,muc,ham,fra)"
[[groups.group]]
name = "rest"
SPEC

cat >"$work/sites.toml" <<'SPEC'
name = "fw-3-0"
release = "fw-3.0.0"
[groups]
error = { threshold = "5%" }
[groups.sites]
label = "site"
max_running = 2
[[groups.group]]
name = "canary"
select = "env=canary"
[[groups.group]]
name = "half"
select = "site in (s001,s002,s003)"
percent = 50
[[groups.group]]
name = "rest"
SPEC

# fleet N FORMAT FILE [SITES]: FORMAT is "fleet" or "devices"; SITES > 0 names that many sites
# s000... instead of the eight cities.
fleet() {
    python3 - "$1" "$2" "$3" "${4:-0}" <<'PY'
import json, random, sys
n, fmt, path, nsites = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
rng = random.Random(12)
order = list(range(n))
rng.shuffle(order)
sites = ["ber", "muc", "ham", "fra", "par", "lyo", "mad", "rom"]
if nsites > 0:
    sites = [f"s{k:03d}" for k in range(nsites)]
hw = ["pi4", "pi5", "x86"]
with open(path, "w") as f:
    f.write("[\n")
    for k, i in enumerate(order):
        d = {"id": f"dev-{i:07d}",
             "labels": {"env": "canary" if i % 100 == 0 else "prod",
                        "site": sites[i % len(sites)], "rack": f"r{i % 40}"},
             "hardware_id": hw[i % len(hw)]}
        if fmt == "devices":
            d.update({"online": i % 50 != 0, "installed": "fw-2.9.1", "rollout": None,
                      "phase": None, "reason": None, "enrollment": "accepted"})
        f.write(("  " if k == 0 else ", ") + json.dumps(d) + "\n")
    f.write("]\n")
PY
}

# measure LABEL CMD...: best wall time, and the CPU time (user + system) and peak RSS of that
# run, over RUNS runs. CPU time shows what wall time would be on an idle machine.
measure() {
    local label="$1"
    shift
    local best_s="" best_kb="" best_cpu="" s kb user sys
    for _ in $(seq "$RUNS"); do
        /usr/bin/time -f '%e %M %U %S' -o "$work/time" "$@" >/dev/null 2>"$work/err" || {
            code=$?
            # simulate exits 2 when the rollout did not finish; anything else is a failure.
            if [ "$code" != 2 ]; then
                echo "$label failed ($code):" >&2
                cat "$work/err" >&2
                exit 1
            fi
        }
        read -r s kb user sys <"$work/time"
        if [ -z "$best_s" ] || awk "BEGIN{exit !($s < $best_s)}"; then
            best_s="$s"
            best_kb="$kb"
            best_cpu="$(awk "BEGIN{print $user + $sys}")"
        fi
    done
    printf '%-40s %8.2f s wall %8.2f s cpu %6d MB\n' "$label" "$best_s" "$best_cpu" \
        "$((best_kb / 1024))" | tee -a "$results.tmp"
}

: >"$results.tmp"
{
    echo "# bench/offline.sh, $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, best of $RUNS"
    echo "# $("$FLOTILLA" --version 2>/dev/null || echo flotilla), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), load $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "# goals: plan of 1M < 1 s and < 500 MB; simulate of 1M < 10 s and < 1 GB"
} | tee "$results.tmp"
for n in $SIZES; do
    for fmt in fleet devices; do
        file="$work/$fmt-$n.json"
        fleet "$n" "$fmt" "$file"
        size_mb=$(($(stat -c %s "$file") / 1048576))
        measure "plan     $n ($fmt, $size_mb MB)" \
            "$FLOTILLA" plan --spec "$work/spec.toml" --fleet "$file"
        measure "plan     $n ($fmt) --json" \
            "$FLOTILLA" plan --spec "$work/spec.toml" --fleet "$file" --json
        measure "simulate $n ($fmt)" \
            "$FLOTILLA" simulate --spec "$work/spec.toml" --fleet "$file"
        rm -f "$file"
    done
done
for n in $SITE_SIZES; do
    file="$work/sites-$n.json"
    fleet "$n" fleet "$file" 500
    measure "simulate $n in 500 sites, 2 running a site" \
        "$FLOTILLA" simulate --spec "$work/sites.toml" --fleet "$file"
    rm -f "$file"
done
mv "$results.tmp" "$results"
echo "written to $results"
