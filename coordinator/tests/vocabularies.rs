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

// ---------------------------------------------------------------------------------------------
// Rancher Fleet partitions (rancher-fleet-rollout-strategy)

/// `n` devices; devices `slow` (a range of indexes) are labelled `speed=slow`.
fn fleet_with_slow(n: usize, slow: std::ops::Range<usize>) -> Fleet {
    Fleet::generated(
        n,
        |i| json!({"speed": if slow.contains(&i) { "slow" } else { "fast" }}),
    )
}

#[test]
fn fleet_50_clusters_one_partition_all_start_at_once() {
    let fleet = Fleet::plain(50);
    let plan = plan("rancher/max-unavailable-10.toml", &fleet);
    assert_eq!(sizes(&plan), named(&[("all", 50)]));
    // maxNew 50 and maxUnavailable 10% (in hundredths of a percent).
    assert_eq!(
        plan["groups"][0]["pace"],
        json!({"batch": 50, "gate": {"percent": 1000}, "concurrency": null})
    );

    // "deploys to all 50 clusters at once (batch behavior overrides maxUnavailable initially)".
    let (code, report) = simulate("rancher/max-unavailable-10.toml", &fleet, None, &[]);
    assert_eq!(code, 0, "{}", report.0);
    assert_eq!(report.started_at(0), 50);
    assert_eq!(
        report.at("group all: started 50 devices (50 of 50 started, 50 not ready)"),
        Some(0)
    );
    assert_eq!(
        report.at("rollout app-2 finished: 50 of 50 devices ready"),
        Some(30)
    );
}

#[test]
fn fleet_100_clusters_second_batch_waits_until_at_most_10_are_not_ready() {
    let fleet = fleet_with_slow(100, 40..50);
    let plan = plan("rancher/max-unavailable-10.toml", &fleet);
    assert_eq!(sizes(&plan), named(&[("all", 100)]));

    let (code, report) = simulate(
        "rancher/max-unavailable-10.toml",
        &fleet,
        Some("rancher/hundred-slow.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 0, "{}", report.0);
    // "deploys to 50 clusters at once".
    assert_eq!(report.started_at(0), 50);
    assert_eq!(report.started("dev-049"), Some(0));
    assert_eq!(
        report
            .at("waiting: group all: 50 of 100 not ready > 10 allowed (10%); the next batch waits"),
        Some(0)
    );
    // At 1 minute 11 of the first 50 are still not ready: more than 10, the batch waits. At 5
    // minutes dev-039 is ready and exactly 10 are not: the second batch starts.
    assert_eq!(report.started("dev-050"), Some(300));
    assert_eq!(report.started_at(300), 50);
    assert_eq!(
        report.at("group all: started 50 devices (100 of 100 started, 60 not ready)"),
        Some(300)
    );
    assert_eq!(
        report.at("group all succeeded: 10 of 100 not ready <= 10 allowed (10%)"),
        Some(360)
    );
    assert_eq!(report.end(), (600, "done".to_owned()));
}

#[test]
fn fleet_200_clusters_auto_partition_10_percent_makes_10_partitions_of_20() {
    let fleet = Fleet::plain(200);
    let plan = plan("rancher/auto-10-percent.toml", &fleet);
    let expected: Vec<(String, usize)> = (1..=10).map(|i| (format!("partition-{i}"), 20)).collect();
    assert_eq!(sizes(&plan), expected);
    assert_eq!(plan["groups"][9]["devices"][0], "dev-180");

    // With Fleet's default maxUnavailable of 100% every partition is Ready at once.
    let (code, report) = simulate("rancher/auto-10-percent.toml", &fleet, None, &[]);
    assert_eq!(code, 0, "{}", report.0);
    assert_eq!(report.started_at(0), 200);
}

#[test]
fn fleet_200_clusters_one_not_ready_partition_may_run_beside_the_next() {
    let fleet = Fleet::plain(200);
    let (code, report) = simulate("rancher/auto-10-percent-ready.toml", &fleet, None, &[]);
    assert_eq!(code, 0, "{}", report.0);
    // The first two partitions start together; each later one when an earlier one is Ready,
    // so at most 40 devices pull the release at a time.
    assert_eq!(report.started_at(0), 40);
    assert_eq!(report.started("dev-040"), Some(30));
    assert_eq!(report.started("dev-180"), Some(120));
    assert_eq!(
        report.at("group partition-2 started with 20 devices (group partition-1 is fully started and the unready-group budget allows it)"),
        Some(0)
    );
    let starts = report.start_order();
    let most = starts
        .iter()
        .map(|(_, t)| {
            starts
                .iter()
                .filter(|(_, u)| u <= t && t < &(u + 30))
                .count()
        })
        .max();
    assert_eq!(most, Some(40), "devices in flight at once");

    // "If one partition is NotReady, rollout can proceed to the next."
    let (code, report) = simulate(
        "rancher/auto-10-percent-ready.toml",
        &fleet,
        Some("rancher/one-partition-stuck.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 2, "dev-000 never becomes ready");
    assert_eq!(report.phase("dev-000"), "issued");
    assert_eq!(report.group_state("partition-1"), "running");
    assert_eq!(report.group_state("partition-10"), "finished");
    assert_eq!(report.count_phase("ready"), 199);

    // "If two or more partitions become NotReady, rollout pauses."
    let (code, report) = simulate(
        "rancher/auto-10-percent-ready.toml",
        &fleet,
        Some("rancher/two-partitions-stuck.outcomes.toml"),
        &["--until", "1d"],
    );
    assert_eq!(code, 2);
    assert_eq!(report.group_state("partition-1"), "running");
    assert_eq!(report.group_state("partition-2"), "running");
    assert_eq!(report.group_state("partition-3"), "scheduled");
    assert_eq!(report.phase("dev-040"), "scheduled");
    assert_eq!(report.count_phase("ready"), 38);
}

#[test]
fn fleet_strict_manual_partitions_wait_for_full_readiness() {
    let fleet = Fleet::generated(
        200,
        |i| json!({"stage": if i < 20 { "demoRollout" } else { "stable" }}),
    );
    let plan = plan("rancher/strict-manual.toml", &fleet);
    assert_eq!(sizes(&plan), named(&[("demoRollout", 20), ("stable", 180)]));
    assert_eq!(
        plan["groups"][1]["success"]["threshold"],
        json!({"all_but": {"count": 0}})
    );

    let (code, report) = simulate(
        "rancher/strict-manual.toml",
        &fleet,
        Some("rancher/strict-manual.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 0, "{}", report.0);
    // dev-007 is the last of demoRollout to be ready, at 5 minutes: only then does stable start.
    assert_eq!(
        report.group_starts(),
        [("demoRollout".to_owned(), 0), ("stable".to_owned(), 300)]
    );
    // Within stable, each batch of 50 waits until every device started so far is ready.
    assert_eq!(report.started_at(300), 50);
    assert_eq!(report.started_at(360), 50);
    assert_eq!(report.started_at(420), 50);
    assert_eq!(report.started_at(480), 30);
    assert_eq!(
        report.at("rollout app-2 finished: 200 of 200 devices ready"),
        Some(540)
    );
}

#[test]
fn fleet_230_clusters_at_25_percent_round_down_with_a_last_partition_of_2() {
    let plan = plan("rancher/default-25-percent.toml", &Fleet::plain(230));
    assert_eq!(
        sizes(&plan),
        named(&[
            ("partition-1", 57),
            ("partition-2", 57),
            ("partition-3", 57),
            ("partition-4", 57),
            ("partition-5", 2)
        ])
    );
    assert_eq!(plan["groups"][4]["devices"], json!(["dev-228", "dev-229"]));
}

#[test]
fn fleet_threshold_50_with_50_percent_makes_2_partitions_of_25() {
    let plan50 = plan("rancher/threshold-50.toml", &Fleet::plain(50));
    assert_eq!(
        sizes(&plan50),
        named(&[("partition-1", 25), ("partition-2", 25)])
    );
    // "Without setting autoPartitionThreshold, those 50 clusters would be in a single partition".
    let plan = plan("rancher/max-unavailable-10.toml", &Fleet::plain(50));
    assert_eq!(sizes(&plan), named(&[("all", 50)]));
    // Below the threshold: one partition.
    let plan49 = plan_text("rancher/threshold-50.toml", &Fleet::plain(49));
    assert_eq!(plan49.0, 0, "{}", plan49.2);
    assert!(plan49.1.contains("49 devices in 1 group"), "{}", plan49.1);
}

#[test]
fn fleet_defaults_make_4_partitions_of_50_that_proceed_regardless_of_readiness() {
    let fleet = Fleet::plain(200);
    let plan = plan("rancher/default-25-percent.toml", &fleet);
    assert_eq!(
        sizes(&plan),
        named(&[
            ("partition-1", 50),
            ("partition-2", 50),
            ("partition-3", 50),
            ("partition-4", 50)
        ])
    );
    assert_eq!(plan["groups"][0]["error"], Value::Null, "Fleet never fails");

    let (code, report) = simulate(
        "rancher/default-25-percent.toml",
        &fleet,
        Some("rancher/defaults.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 0, "{}", report.0);
    // "Because maxUnavailable is 100%, each partition is treated as Ready immediately."
    assert_eq!(report.started_at(0), 200);
    assert_eq!(
        report.at("group partition-1 succeeded: 50 of 50 not ready <= 50 allowed (100%)"),
        Some(0)
    );
    assert_eq!(report.phase("dev-000"), "failed");
    assert_eq!(
        report.at("rollout app-2 finished: 199 of 200 devices ready, 1 failed"),
        Some(3600)
    );
}

#[test]
fn fleet_waiting_on_not_ready_partitions_is_in_the_decision_trace() {
    let (_, report) = simulate(
        "rancher/auto-10-percent-ready.toml",
        &Fleet::plain(200),
        Some("rancher/two-partitions-stuck.outcomes.toml"),
        &["--until", "1d"],
    );
    // Two partitions are NotReady with one allowed: the operator should read why partition-3
    // does not start, as the batch gate, approvals, windows and the rate limit all say.
    let waits = report.entries("waiting: ");
    assert!(
        waits.iter().any(|(_, m)| m.contains("partition-3")
            || (m.contains("2 ") && m.contains("not ready") && m.contains("1 allowed"))),
        "{waits:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// KubeFleet RollingUpdate (kubefleet-safe-rollout)

#[test]
fn rolling_example_1_picks_3_of_4_and_updates_one_at_a_time() {
    let fleet = Fleet::fixture("rolling/four-prod.json");
    let plan = plan("rolling/example-1.toml", &fleet);
    assert_eq!(sizes(&plan), named(&[("rolling", 3)]));
    assert_eq!(
        plan["groups"][0]["devices"],
        json!(["cluster-1", "cluster-2", "cluster-3"])
    );
    assert_eq!(plan["groups"][0]["pace"]["concurrency"], 1);
    assert_eq!(plan["unassigned"], json!(["cluster-4"]));

    // "Once the deployment is updated on the first cluster, we will wait for the deployment's
    // availability to be true before rolling out to the other clusters."
    let (code, report) = simulate("rolling/example-1.toml", &fleet, None, &[]);
    assert_eq!(code, 0, "{}", report.0);
    assert_eq!(
        report.start_order(),
        [
            ("cluster-1".to_owned(), 0),
            ("cluster-2".to_owned(), 30),
            ("cluster-3".to_owned(), 60)
        ]
    );
    assert!(report.0["devices"].get("cluster-4").is_none(), "not picked");
}

#[test]
fn rolling_example_1_a_bad_release_stops_spreading_after_the_first_device() {
    let fleet = Fleet::fixture("rolling/four-prod.json");
    // "since we rolled out a bad image name update for the deployment its availability will
    // always be false and hence the rollout for the other two clusters will be stuck".
    for outcomes in [
        "rolling/bad-image.outcomes.toml",
        "rolling/never-available.outcomes.toml",
    ] {
        let (code, report) = simulate(
            "rolling/example-1.toml",
            &fleet,
            Some(outcomes),
            &["--until", "1d"],
        );
        assert_eq!(code, 2, "{outcomes}: stuck is not finished");
        assert_eq!(report.state(), "running", "{outcomes}");
        assert_eq!(report.phase("cluster-2"), "scheduled", "{outcomes}");
        assert_eq!(report.phase("cluster-3"), "scheduled", "{outcomes}");
        assert_eq!(
            report.at("waiting: group rolling: 1 of 1 allowed at once are not ready"),
            Some(0),
            "{outcomes}"
        );
        // Nothing else can happen without an operator, so the run ends early.
        assert_eq!(report.end().1, "idle", "{outcomes}");
    }
}

#[test]
fn rolling_max_surge_is_refused_with_the_reason() {
    let fleet = Fleet::fixture("rolling/four-prod.json");
    let (code, out, err) = plan_text("rolling/max-surge.toml", &fleet);
    assert_eq!(code, 1, "{out}");
    assert!(err.contains("rolling.max_surge = 1"), "{err}");
    assert!(err.contains("in place"), "{err}");
    assert!(err.contains("use max_unavailable"), "{err}");
}

#[test]
fn rolling_default_max_unavailable_25_percent_of_4_is_1() {
    let fleet = Fleet::fixture("rolling/four-prod.json");
    let plan = plan("rolling/defaults.toml", &fleet);
    assert_eq!(sizes(&plan), named(&[("rolling", 4)]));
    assert_eq!(plan["groups"][0]["pace"]["concurrency"], 1);

    let (code, report) = simulate("rolling/defaults.toml", &fleet, None, &[]);
    assert_eq!(code, 0, "{}", report.0);
    let times: Vec<u64> = report.start_order().into_iter().map(|(_, t)| t).collect();
    assert_eq!(times, [0, 30, 60, 90]);
}

#[test]
fn rolling_pick_n_percentage_is_of_n_not_of_the_devices_found() {
    // "target number of clusters […] For PickN, it's the number of clusters specified in the
    // ClusterResourcePlacement policy."
    let fleet = Fleet::plain(8);
    let plan = plan("rolling/pick-n-30.toml", &fleet);
    assert_eq!(sizes(&plan), named(&[("rolling", 8)]));
    assert_eq!(
        plan["groups"][0]["pace"]["concurrency"], 15,
        "50% of the 30 asked for"
    );
    let (code, report) = simulate("rolling/pick-n-30.toml", &fleet, None, &[]);
    assert_eq!(code, 0, "{}", report.0);
    assert_eq!(report.started_at(0), 8, "all 8 found start at once");
}

// ---------------------------------------------------------------------------------------------
// KubeFleet staged update runs (kubefleet-staged-update)

const STAGED: &str = "staged/example-strategy.toml";

fn staged_fleet() -> Fleet {
    Fleet::fixture("staged/example-fleet.json")
}

#[test]
fn staged_example_strategy_plans_stages_in_order_with_their_tasks() {
    let plan = plan(STAGED, &staged_fleet());
    assert_eq!(
        sizes(&plan),
        named(&[("staging", 2), ("canary", 1), ("production", 3)])
    );
    // sortingLabelKey order: order 1, 2, 3 are member5, member6, member4.
    assert_eq!(
        plan["groups"][2]["devices"],
        json!(["member5", "member6", "member4"])
    );
    assert_eq!(
        plan["groups"][0]["after"],
        json!({"approval": false, "wait": 3600})
    );
    assert_eq!(
        plan["groups"][1]["after"],
        json!({"approval": true, "wait": 0})
    );
    assert_eq!(
        plan["groups"][2]["after"],
        json!({"approval": true, "wait": 3600})
    );
    // "updates clusters within each stage one at a time".
    assert!(plan["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .all(|g| g["pace"]["concurrency"] == 1));
    assert_eq!(plan["unassigned"], json!(["member7"]));
}

#[test]
fn staged_example_run_starts_each_stage_after_its_approval_and_wait() {
    let (code, report) = simulate(
        STAGED,
        &staged_fleet(),
        Some("staged/example.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 0, "{}", report.0);
    // staging: member1 and member2 one at a time, ready at 1m and 2m; then the 1h TimedWait.
    // canary: member3 ready at 1h03m; then the approval, given at 2h.
    // production: by order, one at a time, ready at 2h03m; the approval comes at 2h30m, the
    // wait ends at 3h03m.
    assert_eq!(
        report.group_starts(),
        [
            ("staging".to_owned(), 0),
            ("canary".to_owned(), 3720),
            ("production".to_owned(), 7200)
        ]
    );
    assert_eq!(report.at("group staging: timed wait elapsed"), Some(3720));
    assert_eq!(
        report.start_order(),
        [
            ("member1".to_owned(), 0),
            ("member2".to_owned(), 60),
            ("member3".to_owned(), 3720),
            ("member5".to_owned(), 7200),
            ("member6".to_owned(), 7260),
            ("member4".to_owned(), 7320)
        ]
    );
    assert_eq!(
        report.at("approval example-run-canary requested after group canary"),
        Some(3780)
    );
    assert_eq!(
        report.at("approval example-run-production requested after group production"),
        Some(7380)
    );
    assert_eq!(
        report.at("approval example-run-production approved"),
        Some(9000)
    );
    assert_eq!(
        report.at("rollout example-run finished: 6 of 6 devices ready, 0 failed"),
        Some(7380 + 3600)
    );
    // The run ends with KubeFleet's Succeeded condition, and both approvals recorded.
    let conditions = report.0["rollout"]["conditions"]
        .as_array()
        .expect("conditions");
    assert!(
        conditions.iter().any(|c| c["type"] == "Succeeded"
            && c["status"] == true
            && c["reason"] == "UpdateRunSucceeded"),
        "{conditions:?}"
    );
    let approvals: Vec<(&str, bool)> = report.0["rollout"]["approvals"]
        .as_array()
        .expect("approvals")
        .iter()
        .map(|a| {
            (
                a["name"].as_str().expect("name"),
                a["approved"].as_bool().expect("approved"),
            )
        })
        .collect();
    assert_eq!(
        approvals,
        [
            ("example-run-canary", true),
            ("example-run-production", true)
        ]
    );
}

#[test]
fn staged_both_after_tasks_must_pass_so_a_late_approval_decides() {
    let (code, report) = simulate(
        STAGED,
        &staged_fleet(),
        Some("staged/late-approval.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 0, "{}", report.0);
    // The wait elapsed at 3h03m, the approval at 5h: the run finishes at the approval.
    assert_eq!(
        report.at("group production: timed wait elapsed"),
        Some(7380 + 3600)
    );
    assert_eq!(report.at("rollout example-run finished"), Some(5 * 3600));

    // Without the canary approval, production never starts (members ready after 30s: canary
    // starts at 1h01m and is ready at 1h01m30s).
    let (code, report) = simulate(STAGED, &staged_fleet(), None, &["--until", "1d"]);
    assert_eq!(code, 2);
    assert_eq!(report.group_state("canary"), "waiting");
    assert_eq!(report.phase("member5"), "scheduled");
    assert_eq!(
        report.at("waiting: group canary waits for approval: flotilla approve example-run-canary"),
        Some(3690)
    );
}

#[test]
fn staged_before_and_after_approvals_are_named_after_run_and_stage() {
    let (code, report) = simulate(
        "staged/before-approval.toml",
        &staged_fleet(),
        Some("staged/before-approval.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 0, "{}", report.0);
    assert_eq!(
        report.at("approval example-run-before-canary requested before group canary: flotilla approve example-run-before-canary"),
        Some(120)
    );
    assert_eq!(
        report.started("member3"),
        Some(600),
        "canary starts on the before approval"
    );
    assert_eq!(
        report.at("approval example-run-canary requested after group canary: flotilla approve example-run-canary"),
        Some(660)
    );
    assert_eq!(
        report.started("member5"),
        Some(1200),
        "production starts on the after approval"
    );
}

#[test]
fn staged_a_failed_device_fails_the_run() {
    let (code, report) = simulate(
        STAGED,
        &staged_fleet(),
        Some("staged/production-fails.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 2, "a failed run is not finished");
    assert_eq!(report.state(), "failed");
    assert_eq!(
        report.at("group production stopped rollout example-run: 1 of 3 failed > 0%"),
        Some(7320)
    );
    assert_eq!(report.phase("member4"), "canceled", "never started");
    let conditions = report.0["rollout"]["conditions"]
        .as_array()
        .expect("conditions");
    assert!(
        conditions
            .iter()
            .any(|c| c["type"] == "Failed" && c["status"] == true),
        "{conditions:?}"
    );
}

#[test]
fn staged_stored_strategy_must_be_resolved_and_sort_labels_must_be_integers() {
    let (code, _, err) = plan_text("staged/stored-strategy.toml", &staged_fleet());
    assert_eq!(code, 1);
    assert!(
        err.contains("names the stored strategy \"example-strategy\"")
            && err.contains("--strategy-file"),
        "{err}"
    );

    let fleet = Fleet::generated(2, |i| {
        if i == 0 {
            json!({"environment": "production", "order": "first"})
        } else {
            json!({"environment": "production", "order": "2"})
        }
    });
    let (code, _, err) = plan_text(STAGED, &fleet);
    assert_eq!(code, 1);
    for word in ["production", "dev-000", "order", "first"] {
        assert!(err.contains(word), "{word}: {err}");
    }
}

// ---------------------------------------------------------------------------------------------
// Beyond the four documents: rollout-wide policies

/// Ten devices, `dev-000` … `dev-009`; `[groups] count = 2` gives dev-000..004 and dev-005..009.
fn ten() -> Fleet {
    Fleet::plain(10)
}

#[test]
fn timeout_a_silent_device_times_out_and_counts_as_a_failure() {
    let (code, report) = simulate(
        "beyond/timeout.toml",
        &ten(),
        Some("beyond/silent.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 2);
    assert_eq!(
        report.entries("timed out"),
        [(
            600,
            "device dev-002 in group group-1 timed out: no answer within 10m".to_owned()
        )]
    );
    assert_eq!(
        report.at("group group-1 paused rollout fw-2-4: 1 of 5 failed > 10%"),
        Some(600)
    );
    assert_eq!(report.phase("dev-002"), "timed_out");
    assert_eq!(report.phase("dev-005"), "scheduled");
}

#[test]
fn retries_are_sent_at_the_backoff_times_doubling() {
    let (code, report) = simulate(
        "beyond/retry.toml",
        &ten(),
        Some("beyond/flaky.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 2, "dev-002 fails every attempt");
    // Attempt 1 fails at 10s; retry 1 after 30s (at 40s) fails at 50s; retry 2 after 60s (at
    // 1m50s) fails at 2m, and the failure counts.
    let retries: Vec<(u64, String)> = report.entries("device dev-002");
    assert_eq!(
        retries,
        [
            (
                10,
                "device dev-002 in group group-1: attempt 1 ended (disk full (rolled back)); retry 1 of 2 in 30s".to_owned()
            ),
            (40, "device dev-002 in group group-1: attempt 2 sent".to_owned()),
            (
                50,
                "device dev-002 in group group-1: attempt 2 ended (disk full (rolled back)); retry 2 of 2 in 1m".to_owned()
            ),
            (110, "device dev-002 in group group-1: attempt 3 sent".to_owned()),
        ]
    );
    assert_eq!(report.phase("dev-002"), "failed");
    assert_eq!(
        report.at(
            "group group-1 paused rollout fw-2-4: every device is done and 4 of 5 ready < 100%"
        ),
        Some(120)
    );
}

#[test]
fn offline_skip_leaves_an_offline_device_out_without_failing() {
    let (code, report) = simulate(
        "beyond/offline-skip.toml",
        &ten(),
        Some("beyond/offline-at-start.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 0, "{}", report.0);
    assert_eq!(
        report.at("device dev-007 skipped in group group-2: offline when its turn came"),
        Some(30)
    );
    assert_eq!(report.phase("dev-007"), "skipped");
    assert_eq!(
        report.at("group group-2 succeeded: 4 of 4 ready >= 100%"),
        Some(60)
    );
    assert_eq!(
        report.at("rollout fw-2-4 finished: 9 of 10 devices ready, 0 failed"),
        Some(60)
    );
}

#[test]
fn offline_fail_after_counts_a_vanished_device_timed_out_after_the_grace() {
    let (code, report) = simulate(
        "beyond/offline-fail.toml",
        &ten(),
        Some("beyond/vanishes.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 2);
    assert_eq!(
        report.at("device dev-001 in group group-1 timed out: offline for more than 10m"),
        Some(610)
    );
    assert_eq!(
        report.at("group group-1 stopped rollout fw-2-4: 1 of 5 failed >= 1"),
        Some(610)
    );
    assert_eq!(report.state(), "failed");
}

#[test]
fn rate_limit_spaces_starts_and_ramps_up_with_successes() {
    let (code, report) = simulate(
        "beyond/rate.toml",
        &ten(),
        Some("beyond/quick.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 0, "{}", report.0);
    assert_eq!(
        report.at("waiting: rate limit of 2.0 devices per minute"),
        Some(0)
    );
    let times: Vec<u64> = report.start_order().into_iter().map(|(_, t)| t).collect();
    // Two a minute (one every 30s); after 4 successes (the fourth is ready at 1m40s) four a
    // minute (one every 15s).
    assert_eq!(times[..8], [0, 30, 60, 90, 105, 120, 135, 150]);
}

#[test]
fn maintenance_window_nothing_starts_before_it_opens() {
    // The run starts at 20:00 UTC; the window opens at 02:00, six hours later.
    let (code, report) = simulate(
        "beyond/window.toml",
        &ten(),
        None,
        &["--start", "2027-01-15T20:00:00Z"],
    );
    assert_eq!(code, 0, "{}", report.0);
    assert_eq!(
        report.at("waiting: outside the maintenance windows"),
        Some(0)
    );
    let first = report.start_order()[0].1;
    assert_eq!(first, 6 * 3600, "the first device starts at 02:00");
    assert_eq!(report.started_at(6 * 3600), 5);
    assert_eq!(report.started("dev-005"), Some(6 * 3600 + 30));
    assert_eq!(report.end(), (6 * 3600 + 60, "done".to_owned()));

    // Started inside the window, the rollout goes at once.
    let (code, report) = simulate(
        "beyond/window.toml",
        &ten(),
        None,
        &["--start", "2027-01-15T02:30:00Z"],
    );
    assert_eq!(code, 0, "{}", report.0);
    assert_eq!(report.started_at(0), 5);
}

#[test]
fn maintenance_window_gates_retries_too() {
    // The window is 02:00-03:00 UTC and the run starts at 02:40. dev-002 fails 10 seconds after
    // its action arrives; its retry is due 30 minutes later, at 03:10:10, after the window
    // closed. It goes out when the next night's window opens, 02:00 the next day.
    let (code, report) = simulate(
        "beyond/window-retry.toml",
        &ten(),
        Some("beyond/flaky.outcomes.toml"),
        &["--start", "2027-01-15T02:40:00Z"],
    );
    assert_eq!(code, 2, "dev-002 fails its retry too: {}", report.0);
    let start = report.start();
    let sent = report.entries(" sent");
    assert!(!sent.is_empty(), "{}", report.0);
    for (at, message) in &sent {
        let time_of_day = (start + at) % 86_400;
        assert!(
            (2 * 3600..3 * 3600).contains(&time_of_day),
            "sent outside the 02:00-03:00 window at +{at}s: {message}"
        );
    }
    let next_night = 23 * 3600 + 20 * 60;
    assert_eq!(
        sent,
        [(
            next_night,
            "device dev-002 in group group-1: attempt 2 sent".to_owned()
        )]
    );
    assert_eq!(
        report.entries("retry waits"),
        [(
            30 * 60 + 10,
            "device dev-002 in group group-1: retry waits for the maintenance window, which opens at 2027-01-16T02:00:00Z".to_owned()
        )]
    );
    assert_eq!(report.phase("dev-002"), "failed");
}

#[test]
fn soak_the_next_group_starts_only_after_the_soak_time() {
    let (code, report) = simulate("beyond/soak.toml", &ten(), None, &[]);
    assert_eq!(code, 0, "{}", report.0);
    // Ready at 30s, soaked for 10 minutes: the group succeeds at 10m30s.
    assert_eq!(
        report.group_starts(),
        [("group-1".to_owned(), 0), ("group-2".to_owned(), 630)]
    );
    assert_eq!(report.end(), (1260, "done".to_owned()));
}

#[test]
fn decision_trace_states_the_numbers_behind_a_pause() {
    let fleet = Fleet::plain(40);
    let (code, out, _) = plan_text("beyond/canary-20.toml", &fleet);
    assert_eq!(code, 0);
    assert!(out.contains("> 10% failed -> pause"), "{out}");

    let (code, report) = simulate(
        "beyond/canary-20.toml",
        &fleet,
        Some("beyond/three-fail.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 2);
    // 2 of 20 failed is exactly 10%, not more: no pause at 2 minutes.
    assert_eq!(
        report.entries("failed >"),
        [(
            180,
            "group canary paused rollout fw-2-4: 3 of 20 failed > 10%".to_owned()
        )]
    );
    assert_eq!(report.state(), "paused");
    assert_eq!(report.phase("dev-020"), "scheduled");
}

#[test]
fn fleet_manual_partitions_of_40_proceed_once_at_most_4_are_not_ready() {
    let fleet = Fleet::generated(200, |i| {
        json!({
            "rack": (i / 40 + 1).to_string(),
            "speed": if i < 5 { "slow" } else { "fast" },
        })
    });
    let plan = plan("rancher/manual-40.toml", &fleet);
    let expected: Vec<(String, usize)> = (1..=5).map(|i| (format!("rack-{i}"), 40)).collect();
    assert_eq!(sizes(&plan), expected);

    let (code, report) = simulate(
        "rancher/manual-40.toml",
        &fleet,
        Some("rancher/manual-40.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 0, "{}", report.0);
    // "It deploys up to 50 BundleDeployments at once. So it deploys to all 40 clusters in the
    // partition in one batch." "Once ≤4 clusters are NotReady, [it] proceeds".
    assert_eq!(report.started_at(0), 40);
    assert_eq!(
        report.at("group rack-1 succeeded: 4 of 40 not ready <= 4 allowed (10%)"),
        Some(300)
    );
    assert_eq!(
        report.group_starts(),
        [
            ("rack-1".to_owned(), 0),
            ("rack-2".to_owned(), 300),
            ("rack-3".to_owned(), 360),
            ("rack-4".to_owned(), 420),
            ("rack-5".to_owned(), 480)
        ]
    );
    assert_eq!(report.end(), (600, "done".to_owned()));
}

#[test]
fn fleet_manual_partition_max_unavailable_overrides_the_rollout_one() {
    let fleet = Fleet::generated(
        60,
        |i| json!({"env": if i < 20 { "staging" } else { "prod" }}),
    );
    let plan = plan("rancher/document-partitions.toml", &fleet);
    assert_eq!(sizes(&plan), named(&[("demoRollout", 20), ("stable", 40)]));
    assert_eq!(plan["groups"][0]["pace"]["gate"], json!({"percent": 1000}));
    assert_eq!(plan["groups"][1]["pace"]["gate"], json!({"percent": 500}));
    let (_, table, _) = plan_text("rancher/document-partitions.toml", &fleet);
    assert!(table.contains("next batch at <= 10% not ready"), "{table}");
    assert!(table.contains("next batch at <= 5% not ready"), "{table}");
}

#[test]
fn rolling_max_unavailable_percentage_rounds_down_but_never_below_1() {
    for (n, concurrency) in [(3, 1), (4, 1), (11, 2), (20, 5)] {
        let fleet = Fleet::generated(n, |_| json!({"env": "prod"}));
        let plan = plan("rolling/defaults.toml", &fleet);
        assert_eq!(
            plan["groups"][0]["pace"]["concurrency"], concurrency,
            "25% of {n}"
        );
    }
}

#[test]
fn timeout_a_timed_out_device_is_retried_with_a_fresh_timeout() {
    let (code, report) = simulate(
        "beyond/timeout-retry.toml",
        &ten(),
        Some("beyond/silent.outcomes.toml"),
        &[],
    );
    assert_eq!(code, 2);
    assert_eq!(
        report.entries("device dev-002"),
        [
            (
                300,
                "device dev-002 in group group-1: attempt 1 ended (no answer within 5m); retry 1 of 1 in 30s".to_owned()
            ),
            (330, "device dev-002 in group group-1: attempt 2 sent".to_owned()),
            (
                630,
                "device dev-002 in group group-1 timed out: no answer within 5m".to_owned()
            ),
        ]
    );
    assert_eq!(report.phase("dev-002"), "timed_out");
}

#[test]
fn hawkbit_percentages_round_up_and_leave_the_rest_unassigned() {
    // dev-000 and dev-001 are canaries: 10% of 2 is 1; then 10% of the 9 left is 1.
    let fleet = Fleet::generated(
        10,
        |i| json!({"env": if i < 2 { "canary" } else { "prod" }}),
    );
    let plan = plan("hawkbit/small-shares.toml", &fleet);
    assert_eq!(sizes(&plan), named(&[("canary", 1), ("tenth", 1)]));
    assert_eq!(plan["groups"][0]["devices"], json!(["dev-000"]));
    assert_eq!(plan["groups"][1]["devices"], json!(["dev-001"]));
    assert_eq!(plan["unassigned"].as_array().map(Vec::len), Some(8));

    let (code, report) = simulate("hawkbit/small-shares.toml", &fleet, None, &[]);
    assert_eq!(code, 0, "{}", report.0);
    assert_eq!(
        report.at("rollout fw-2-4 finished: 2 of 2 devices ready"),
        Some(60)
    );
    assert!(
        report.0["devices"].get("dev-002").is_none(),
        "not rolled out"
    );
}

#[test]
fn waiting_messages_name_times_an_operator_can_read() {
    let (_, staged) = simulate(
        STAGED,
        &staged_fleet(),
        Some("staged/example.outcomes.toml"),
        &[],
    );
    let (_, window) = simulate(
        "beyond/window.toml",
        &ten(),
        None,
        &["--start", "2027-01-15T20:00:00Z"],
    );
    for (at, message) in staged
        .entries("waiting: ")
        .into_iter()
        .chain(window.entries("waiting: "))
    {
        assert!(
            !message.contains("18000"),
            "+{at}s: {message}: a bare Unix time, not a date an operator can read"
        );
    }
}
