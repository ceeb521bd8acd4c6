//! Site budgets through `flotilla plan` and `flotilla simulate`, in each of the four
//! vocabularies: the plan names every site and its limits (the busy limit and the unavailable
//! limit), the simulated timeline says when a site holds devices back and which limit does, and
//! the final status shows each site and the bytes by source.

use std::fs;
use std::process::{Command, Output};

use serde_json::Value;

fn flotilla(args: &[&str]) -> Output {
    let bin =
        std::env::var_os("FLOTILLA_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_flotilla").into());
    Command::new(bin).args(args).output().expect("run flotilla")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// 16 devices at the harbour, 4 at the quarry, 1 without a site.
fn fleet_json() -> String {
    let mut devices = Vec::new();
    for i in 0..16 {
        devices.push(serde_json::json!({"id": format!("h{i:02}"), "labels": {"site": "harbour"}, "hardware_id": "pi4"}));
    }
    for i in 0..4 {
        devices.push(serde_json::json!({"id": format!("q{i:02}"), "labels": {"site": "quarry"}, "hardware_id": "pi4"}));
    }
    devices.push(serde_json::json!({"id": "x00", "labels": {}, "hardware_id": "pi4"}));
    Value::Array(devices).to_string()
}

/// Two busy per site, with peer sharing, in each vocabulary's words.
const SPECS: [(&str, &str); 4] = [
    (
        "groups",
        "[groups]\ncount = 1\n[groups.sites]\nlabel = \"site\"\nmax_running = 2\npeers = true\n",
    ),
    (
        "partitions",
        "[partitions]\n[partitions.sites]\nlabel = \"site\"\nmax_busy = 2\npeers = true\n",
    ),
    (
        "rolling",
        "[rolling]\nmax_unavailable = \"100%\"\n[rolling.sites]\nlabel = \"site\"\nmax_busy = 2\npeers = true\n",
    ),
    (
        "staged",
        "[staged]\n[[staged.stage]]\nname = \"all\"\nmax_concurrency = 100\n[staged.sites]\nlabel = \"site\"\nmax_concurrency = 2\npeers = true\n",
    ),
];

/// Two busy and three unavailable per site, every device soaking 5 minutes after it is ready,
/// in each vocabulary's words: soaking devices are not busy but still unavailable, so the
/// unavailable limit is what holds a site back once its first two devices are ready.
const UNAVAILABLE_SPECS: [(&str, &str); 4] = [
    (
        "groups",
        "[groups]\ncount = 1\n[groups.sites]\nlabel = \"site\"\nmax_running = 2\nmax_unavailable = 3\n",
    ),
    (
        "partitions",
        "[partitions]\n[partitions.sites]\nlabel = \"site\"\nmax_busy = 2\nmax_unavailable = 3\n",
    ),
    (
        "rolling",
        "[rolling]\nmax_unavailable = \"100%\"\n[rolling.sites]\nlabel = \"site\"\nmax_busy = 2\nmax_unavailable = 3\n",
    ),
    (
        "staged",
        "[staged]\n[[staged.stage]]\nname = \"all\"\nmax_concurrency = 100\n[staged.sites]\nlabel = \"site\"\nmax_concurrency = 2\nmax_unavailable = 3\n",
    ),
];

struct Files {
    dir: tempfile::TempDir,
}

impl Files {
    fn new(spec: &str) -> Files {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(
            dir.path().join("spec.toml"),
            format!("name = \"fw\"\nrelease = \"fw-2\"\n{spec}"),
        )
        .expect("spec");
        fs::write(dir.path().join("fleet.json"), fleet_json()).expect("fleet");
        Files { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_string_lossy().into_owned()
    }

    fn run(&self, command: &str, extra: &[&str]) -> Output {
        let (spec, fleet) = (self.path("spec.toml"), self.path("fleet.json"));
        let mut args = vec![command, "--spec", &spec, "--fleet", &fleet];
        args.extend_from_slice(extra);
        flotilla(&args)
    }
}

#[test]
fn plan_names_every_site_and_its_limits() {
    for (vocabulary, spec) in SPECS {
        let files = Files::new(spec);
        let out = files.run("plan", &[]);
        assert_eq!(out.status.code(), Some(0), "{vocabulary}: {out:?}");
        let text = stdout(&out);
        assert!(
            text.contains("site harbour: 16 devices, at most 2 busy, one seed fetches first and the others from peers (seed wait 600s)"),
            "{vocabulary}: {text}"
        );
        assert!(
            text.contains("site quarry: 4 devices, at most 2 busy"),
            "{vocabulary}: {text}"
        );
        assert!(
            text.contains("1 device without label site: in no site, no site limit applies"),
            "{vocabulary}: {text}"
        );
        let json: Value =
            serde_json::from_str(&stdout(&files.run("plan", &["--json"]))).expect("plan json");
        assert_eq!(
            json["sites"]["sites"],
            serde_json::json!([["harbour", 16], ["quarry", 4]]),
            "{vocabulary}"
        );
        assert_eq!(json["sites"]["policy"]["max_busy"], 2, "{vocabulary}");
    }
}

#[test]
fn simulate_shows_site_waits_site_lines_and_bytes_by_source() {
    for (vocabulary, spec) in SPECS {
        let files = Files::new(spec);
        let out = files.run("simulate", &["--artifact-size", "1000"]);
        assert_eq!(out.status.code(), Some(0), "{vocabulary}: {out:?}");
        let text = stdout(&out);
        // First the harbour waits for its seed, then for room.
        assert!(
            text.contains("waiting: site harbour: 15 waiting for seed h00 to hold the release"),
            "{vocabulary}: {text}"
        );
        assert!(
            text.contains("waiting: site harbour: 2 of 2 busy, 13 waiting"),
            "{vocabulary}: {text}"
        );
        // One seed per site fetched from the coordinator (and the device without a site); the
        // rest from peers.
        assert!(
            text.contains("  bytes: 3000 from the coordinator, 18000 from peers, 0 local"),
            "{vocabulary}: {text}"
        );
        assert!(
            text.contains("  site harbour: 0 of 2 busy, 0 waiting, peers h08 h09 h10 h11 h12 h13 h14 h15; bytes 1000 from the coordinator, 15000 from peers, 0 local"),
            "{vocabulary}: {text}"
        );

        let out = files.run("simulate", &["--artifact-size", "1000", "--json"]);
        let report: Value = serde_json::from_str(&stdout(&out)).expect("report json");
        let sites = report["rollout"]["sites"].as_array().expect("sites");
        assert_eq!(sites.len(), 2, "{vocabulary}");
        assert_eq!(sites[1]["name"], "quarry", "{vocabulary}");
        assert_eq!(sites[1]["total"], 4, "{vocabulary}");
        assert_eq!(sites[1]["bytes"]["peers"], 3000, "{vocabulary}");
        assert_eq!(
            report["rollout"]["bytes"]["coordinator"], 3000,
            "{vocabulary}"
        );
    }
}

#[test]
fn plan_and_simulate_show_the_unavailable_limit_holding_a_site_back() {
    for (vocabulary, table) in UNAVAILABLE_SPECS {
        let files = Files::new(&format!("soak = \"5m\"\n{table}"));
        let out = files.run("plan", &[]);
        assert_eq!(out.status.code(), Some(0), "{vocabulary}: {out:?}");
        let text = stdout(&out);
        assert!(
            text.contains("site harbour: 16 devices, at most 2 busy, at most 3 unavailable\n"),
            "{vocabulary}: {text}"
        );
        assert!(
            text.contains("site quarry: 4 devices, at most 2 busy, at most 3 unavailable\n"),
            "{vocabulary}: {text}"
        );
        let json: Value =
            serde_json::from_str(&stdout(&files.run("plan", &["--json"]))).expect("plan json");
        assert_eq!(
            json["sites"]["policy"]["max_unavailable"], 3,
            "{vocabulary}"
        );

        let out = files.run("simulate", &["--artifact-size", "1000"]);
        assert_eq!(out.status.code(), Some(0), "{vocabulary}: {out:?}");
        let text = stdout(&out);
        // h00 and h01 are ready after 30s and soak: no longer busy, still unavailable. One more
        // starts (three unavailable), and the rest of the harbour waits for the soak to end.
        assert!(
            text.contains("waiting: site harbour: 2 of 2 busy, 14 waiting"),
            "{vocabulary}: {text}"
        );
        assert!(
            text.contains("+00:00:30  waiting: site harbour: 3 of 3 unavailable, 13 waiting"),
            "{vocabulary}: {text}"
        );
        assert!(
            text.contains("rollout fw finished: 21 of 21 devices ready"),
            "{vocabulary}: {text}"
        );
        assert!(
            text.contains("  site harbour: 0 of 2 busy, 0 of 3 unavailable, 0 waiting; bytes 16000 from the coordinator, 0 from peers, 0 local\n"),
            "{vocabulary}: {text}"
        );

        let out = files.run("simulate", &["--artifact-size", "1000", "--json"]);
        let report: Value = serde_json::from_str(&stdout(&out)).expect("report json");
        let sites = report["rollout"]["sites"].as_array().expect("sites");
        assert_eq!(sites.len(), 2, "{vocabulary}");
        for site in sites {
            assert_eq!(site["max_unavailable"], 3, "{vocabulary}: {site}");
            assert_eq!(site["unavailable"], 0, "{vocabulary}: {site}");
        }
    }
}

#[test]
fn a_site_budget_in_another_vocabularys_words_is_refused_naming_the_key() {
    let files =
        Files::new("[partitions]\n[partitions.sites]\nlabel = \"site\"\nmax_concurrency = 2\n");
    let out = files.run("plan", &[]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("partitions.sites.max_concurrency: 2 is not a key of [partitions.sites]; this vocabulary calls it max_busy"),
        "{err}"
    );
}
