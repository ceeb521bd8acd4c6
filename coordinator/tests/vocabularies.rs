//! The examples of the four reference documents (hawkBit deployment groups, Rancher Fleet
//! partitions, KubeFleet rolling updates and KubeFleet staged update runs), plus the policies no
//! single document defines, run through `flotilla plan --json` for the grouping and
//! `flotilla simulate --json` for the behaviour over time. Each test asserts the numbers the
//! document gives, as an operator would read them in the plan and the timeline.
//!
//! Specs, outcomes files and the small fleets the documents name live in `tests/fixtures/`;
//! large uniform fleets are generated here.

use std::fs;
use std::process::{Command, Output};

use serde_json::{json, Value};

// ---------------------------------------------------------------------------------------------
// Running the binary

/// The binary under test. `FLOTILLA_BIN` overrides it for checkouts that share one target
/// directory, where `target/debug/flotilla` may have been linked from another checkout.
fn flotilla(args: &[&str]) -> Output {
    let bin =
        std::env::var_os("FLOTILLA_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_flotilla").into());
    Command::new(bin).args(args).output().expect("run flotilla")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The path of a file under `tests/fixtures/`.
fn fixture(name: &str) -> String {
    format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// A fleet file: a fixture, or one generated into a temporary directory.
struct Fleet {
    path: String,
    _dir: Option<tempfile::TempDir>,
}

impl Fleet {
    fn fixture(name: &str) -> Fleet {
        Fleet {
            path: fixture(name),
            _dir: None,
        }
    }

    /// `n` devices `dev-000`, `dev-001`, … with the labels `labels(i)` gives device `i`.
    fn generated(n: usize, labels: impl Fn(usize) -> Value) -> Fleet {
        let devices: Vec<Value> = (0..n)
            .map(|i| json!({"id": format!("dev-{i:03}"), "labels": labels(i)}))
            .collect();
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("fleet.json");
        fs::write(&path, Value::Array(devices).to_string()).expect("write fleet");
        Fleet {
            path: path.to_string_lossy().into_owned(),
            _dir: Some(dir),
        }
    }

    /// `n` devices without labels.
    fn plain(n: usize) -> Fleet {
        Fleet::generated(n, |_| json!({}))
    }
}

/// `flotilla plan --json`; the plan must be accepted.
fn plan(spec: &str, fleet: &Fleet) -> Value {
    let spec = fixture(spec);
    let out = flotilla(&["plan", "--spec", &spec, "--fleet", &fleet.path, "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    serde_json::from_str(&stdout(&out)).expect("plan json")
}

/// `flotilla plan` as a table, with its exit code and both outputs.
fn plan_text(spec: &str, fleet: &Fleet) -> (i32, String, String) {
    let spec = fixture(spec);
    let out = flotilla(&["plan", "--spec", &spec, "--fleet", &fleet.path]);
    (
        out.status.code().expect("exit code"),
        stdout(&out),
        stderr(&out),
    )
}

/// Group names and sizes of a plan.
fn sizes(plan: &Value) -> Vec<(String, usize)> {
    plan["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .map(|g| {
            (
                g["name"].as_str().expect("name").to_owned(),
                g["devices"].as_array().expect("devices").len(),
            )
        })
        .collect()
}

fn named(sizes: &[(&str, usize)]) -> Vec<(String, usize)> {
    sizes.iter().map(|(n, s)| ((*n).to_owned(), *s)).collect()
}

/// `flotilla simulate --json`: the exit code and the report.
fn simulate(spec: &str, fleet: &Fleet, outcomes: Option<&str>, extra: &[&str]) -> (i32, Report) {
    let spec = fixture(spec);
    let outcomes = outcomes.map(fixture);
    let mut args = vec![
        "simulate",
        "--spec",
        &spec,
        "--fleet",
        &fleet.path,
        "--json",
    ];
    if let Some(o) = &outcomes {
        args.extend(["--outcomes", o.as_str()]);
    }
    args.extend_from_slice(extra);
    let out = flotilla(&args);
    let code = out.status.code().expect("exit code");
    let json = serde_json::from_str(&stdout(&out))
        .unwrap_or_else(|e| panic!("{e}: {}\n{}", stdout(&out), stderr(&out)));
    (code, Report(json))
}

/// A simulation report with the questions the tests ask of it.
struct Report(Value);

impl Report {
    fn timeline(&self) -> Vec<(u64, String)> {
        self.0["timeline"]
            .as_array()
            .expect("timeline")
            .iter()
            .map(|t| {
                (
                    t["at"].as_u64().expect("at"),
                    t["message"].as_str().expect("message").to_owned(),
                )
            })
            .collect()
    }

    /// When the first timeline entry containing `needle` happened.
    fn at(&self, needle: &str) -> Option<u64> {
        self.timeline()
            .into_iter()
            .find(|(_, m)| m.contains(needle))
            .map(|(at, _)| at)
    }

    /// The messages containing `needle`, with their times.
    fn entries(&self, needle: &str) -> Vec<(u64, String)> {
        self.timeline()
            .into_iter()
            .filter(|(_, m)| m.contains(needle))
            .collect()
    }

    /// Group names in the order their "started with" entries appear, with the time.
    fn group_starts(&self) -> Vec<(String, u64)> {
        self.timeline()
            .into_iter()
            .filter(|(_, m)| m.starts_with("group ") && m.contains(" started with "))
            .map(|(at, m)| (m.split(' ').nth(1).unwrap_or("").to_owned(), at))
            .collect()
    }

    fn phase(&self, device: &str) -> String {
        self.0["devices"][device]
            .as_str()
            .unwrap_or_else(|| panic!("no device {device}"))
            .to_owned()
    }

    fn state(&self) -> &str {
        self.0["rollout"]["state"].as_str().expect("state")
    }

    fn end(&self) -> (u64, String) {
        (
            self.0["end"]["at"].as_u64().expect("end.at"),
            self.0["end"]["reason"]
                .as_str()
                .expect("end.reason")
                .to_owned(),
        )
    }

    /// Unix seconds of the start of the run (the rollout was created then).
    fn start(&self) -> u64 {
        self.0["rollout"]["trace"][0]["at"]
            .as_u64()
            .expect("trace[0].at")
    }

    /// Seconds from the start at which a device's first attempt was sent.
    fn started(&self, device: &str) -> Option<u64> {
        let start = self.start();
        self.0["rollout"]["groups"]
            .as_array()
            .expect("groups")
            .iter()
            .find_map(|g| g["device_details"][device]["started_at"].as_u64())
            .map(|at| at - start)
    }

    /// The device ids in the order they were started, with the time.
    fn start_order(&self) -> Vec<(String, u64)> {
        let mut all: Vec<(String, u64)> = self.0["devices"]
            .as_object()
            .expect("devices")
            .keys()
            .filter_map(|d| self.started(d).map(|at| (d.clone(), at)))
            .collect();
        all.sort_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
        all
    }

    /// How many devices were started at `at` seconds.
    fn started_at(&self, at: u64) -> usize {
        self.start_order().iter().filter(|(_, t)| *t == at).count()
    }

    fn count_phase(&self, phase: &str) -> usize {
        self.0["devices"]
            .as_object()
            .expect("devices")
            .values()
            .filter(|p| *p == phase)
            .count()
    }

    fn group_state(&self, group: &str) -> String {
        self.0["rollout"]["groups"]
            .as_array()
            .expect("groups")
            .iter()
            .find(|g| g["name"] == group)
            .unwrap_or_else(|| panic!("no group {group}"))["state"]
            .as_str()
            .expect("state")
            .to_owned()
    }
}

// ---------------------------------------------------------------------------------------------
// hawkBit deployment groups (hawkbit-rollout-data-model)

#[test]
fn hawkbit_30_targets_split_15_and_15() {
    let fleet = Fleet::plain(30);
    let plan = plan("hawkbit/half-then-rest.toml", &fleet);
    assert_eq!(sizes(&plan), named(&[("half", 15), ("rest", 15)]));
    assert_eq!(plan["groups"][0]["devices"][0], "dev-000");
    assert_eq!(plan["groups"][1]["devices"][0], "dev-015");
    assert_eq!(plan["unassigned"], json!([]));

    // "The deployment actions of the first group will be started immediately all other
    // deployment actions will be scheduled."
    let (code, report) = simulate("hawkbit/half-then-rest.toml", &fleet, None, &[]);
    assert_eq!(code, 0, "{}", report.0);
    assert_eq!(report.started_at(0), 15, "only the first group at once");
    assert_eq!(report.started("dev-015"), Some(30));
    assert_eq!(
        report.group_starts(),
        [("half".to_owned(), 0), ("rest".to_owned(), 30)]
    );
    assert_eq!(report.state(), "finished");
    assert_eq!(report.count_phase("ready"), 30);
}

#[test]
fn hawkbit_count_splits_evenly_earlier_groups_taking_the_remainder() {
    let plan30 = plan("hawkbit/count-3.toml", &Fleet::plain(30));
    assert_eq!(
        sizes(&plan30),
        named(&[("group-1", 10), ("group-2", 10), ("group-3", 10)])
    );
    let plan32 = plan("hawkbit/count-3.toml", &Fleet::plain(32));
    assert_eq!(
        sizes(&plan32),
        named(&[("group-1", 11), ("group-2", 11), ("group-3", 10)])
    );

    let (code, report) = simulate("hawkbit/count-3.toml", &Fleet::plain(30), None, &[]);
    assert_eq!(code, 0, "{}", report.0);
    assert_eq!(
        report.group_starts(),
        [
            ("group-1".to_owned(), 0),
            ("group-2".to_owned(), 30),
            ("group-3".to_owned(), 60)
        ]
    );
}

#[test]
fn hawkbit_error_condition_pauses_only_above_its_threshold() {
    let fleet = Fleet::plain(30);
    // 1 of 15 failed is 6.7%, not more than 10%: the success condition (90%) releases the rest.
    let (code, report) = simulate(
        "hawkbit/half-then-rest.toml",
        &fleet,
        Some("hawkbit/one-fails.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 0, "{}", report.0);
    assert!(report.entries("failed >").is_empty(), "{}", report.0);
    assert_eq!(
        report.at("group half succeeded: 14 of 15 ready >= 90%"),
        Some(60)
    );
    assert_eq!(report.started("dev-015"), Some(60));
    assert_eq!(report.phase("dev-003"), "failed");
    assert_eq!(report.state(), "finished");

    // 2 of 15 is 13.3%: the error action pauses the whole rollout at the second failure.
    let (code, report) = simulate(
        "hawkbit/half-then-rest.toml",
        &fleet,
        Some("hawkbit/two-fail.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 2, "paused is not finished");
    assert_eq!(
        report.entries("failed >"),
        [(
            50,
            "group half paused rollout fw-2-4: 2 of 15 failed > 10%".to_owned()
        )]
    );
    assert_eq!(report.state(), "paused");
    assert_eq!(
        report.phase("dev-015"),
        "scheduled",
        "the rest never starts"
    );
    assert_eq!(report.group_state("rest"), "scheduled");
}

#[test]
fn hawkbit_success_action_pause_holds_until_the_operator_resumes() {
    let fleet = Fleet::plain(30);
    let (code, report) = simulate(
        "hawkbit/success-pause.toml",
        &fleet,
        Some("hawkbit/resume.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 0, "{}", report.0);
    assert_eq!(
        report.at("group half succeeded; its success action paused rollout fw-2-4"),
        Some(60)
    );
    assert_eq!(report.at("resumed by operator"), Some(3600));
    assert_eq!(
        report.started("dev-015"),
        Some(3600),
        "the rest starts on resume"
    );
    assert_eq!(report.end(), (3660, "done".to_owned()));

    // Without the operator, the run ends paused with the rest still scheduled.
    let (code, report) = simulate("hawkbit/success-pause.toml", &fleet, None, &[]);
    assert_eq!(code, 2);
    assert_eq!(report.state(), "paused");
    assert_eq!(report.phase("dev-029"), "scheduled");
}

#[test]
fn hawkbit_download_only_counts_as_success() {
    let fleet = Fleet::plain(10);
    let (code, report) = simulate("hawkbit/download-only.toml", &fleet, None, &[]);
    assert_eq!(code, 0, "{}", report.0);
    assert_eq!(
        report.at("group group-1 succeeded: 5 of 5 ready >= 100%"),
        Some(30)
    );
    assert_eq!(
        report.at("rollout fw-2-4 finished: 10 of 10 devices ready, 0 failed"),
        Some(60)
    );
}

#[test]
fn hawkbit_dynamic_rollout_is_accepted_and_keeps_a_group_open() {
    let fleet = Fleet::plain(30);
    let plan = plan("hawkbit/dynamic.toml", &fleet);
    // The engine adds the dynamic group; the plan does not contain it.
    assert_eq!(sizes(&plan), named(&[("half", 15), ("rest", 15)]));

    let (code, report) = simulate("hawkbit/dynamic.toml", &fleet, None, &[]);
    assert_eq!(
        report.at(
            "created for release fw-2.4.0: 30 devices in 3 groups (half 15, rest 15, dynamic 0)"
        ),
        Some(0)
    );
    assert_eq!(report.at("group dynamic started with 0 devices"), Some(60));
    assert_eq!(report.count_phase("ready"), 30);
    // A dynamic rollout waits for late devices: it stays running, so the run ends idle.
    assert_eq!(report.state(), "running");
    assert_eq!(report.end().1, "idle");
    assert_eq!(code, 2);
}
