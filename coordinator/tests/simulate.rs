//! `flotilla plan` and `flotilla simulate` as an operator runs them: files in, a plan or a
//! timeline out, and the exit code a script can branch on.

use std::fs;
use std::process::{Command, Output};

use serde_json::Value;

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

/// Ten devices, dev-000 and dev-001 labelled canary, the rest prod.
fn fleet_json(n: usize) -> String {
    let devices: Vec<Value> = (0..n)
        .map(|i| {
            let env = if i < 2 { "canary" } else { "prod" };
            serde_json::json!({"id": format!("dev-{i:03}"), "labels": {"env": env}, "hardware_id": "pi4"})
        })
        .collect();
    Value::Array(devices).to_string()
}

struct Files {
    dir: tempfile::TempDir,
}

impl Files {
    fn new(spec: &str, outcomes: &str) -> Files {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(
            dir.path().join("spec.toml"),
            format!("name = \"fw-2-4\"\nrelease = \"fw-2.4.0\"\n{spec}"),
        )
        .expect("spec");
        fs::write(dir.path().join("fleet.json"), fleet_json(10)).expect("fleet");
        fs::write(dir.path().join("outcomes.toml"), outcomes).expect("outcomes");
        Files { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_string_lossy().into_owned()
    }

    fn simulate(&self, extra: &[&str]) -> Output {
        let (spec, fleet, outcomes) = (
            self.path("spec.toml"),
            self.path("fleet.json"),
            self.path("outcomes.toml"),
        );
        let mut args = vec![
            "simulate",
            "--spec",
            &spec,
            "--fleet",
            &fleet,
            "--outcomes",
            &outcomes,
        ];
        args.extend_from_slice(extra);
        flotilla(&args)
    }

    fn simulate_json(&self, extra: &[&str]) -> (i32, Value) {
        let mut args = vec!["--json"];
        args.extend_from_slice(extra);
        let out = self.simulate(&args);
        let code = out.status.code().expect("exit code");
        let json = serde_json::from_str(&stdout(&out))
            .unwrap_or_else(|e| panic!("{e}: {}\n{}", stdout(&out), stderr(&out)));
        (code, json)
    }
}

fn timeline(report: &Value) -> Vec<(u64, String)> {
    report["timeline"]
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

const THREE_GROUPS: &str = "[groups]\n\
    [[groups.group]]\nname = \"canary\"\nselect = \"env=canary\"\n\
    [[groups.group]]\nname = \"half\"\npercent = 50\n\
    [[groups.group]]\nname = \"rest\"\n";

#[test]
fn hawkbit_three_groups_all_ready_finish_in_order() {
    let files = Files::new(THREE_GROUPS, "default = { ready_after = \"2m\" }\n");
    let (code, report) = files.simulate_json(&[]);
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["rollout"]["state"], "finished");
    let started: Vec<(u64, String)> = timeline(&report)
        .into_iter()
        .filter(|(_, m)| m.contains(" started with "))
        .collect();
    let names: Vec<&str> = started
        .iter()
        .map(|(_, m)| m.split(' ').nth(1).unwrap_or(""))
        .collect();
    assert_eq!(names, ["canary", "half", "rest"]);
    // Each group starts when the one before it is ready, two scripted minutes later.
    let times: Vec<u64> = started.iter().map(|(at, _)| *at).collect();
    assert_eq!(times, [0, 120, 240]);
    assert_eq!(report["devices"].as_object().expect("devices").len(), 10);
    assert!(report["devices"]
        .as_object()
        .expect("devices")
        .values()
        .all(|p| p == "ready"));
}

#[test]
fn a_failing_canary_pauses_the_rollout() {
    let files = Files::new(
        &THREE_GROUPS.replace(
            "[groups]\n",
            "[groups]\nerror = { threshold = \"10%\", action = \"pause\" }\n",
        ),
        "[[device]]\nid = \"dev-001\"\nfail_after = \"45s\"\nreason = \"health check nginx failed\"\n",
    );
    let (code, report) = files.simulate_json(&[]);
    assert_eq!(code, 2, "paused is not finished");
    assert_eq!(report["rollout"]["state"], "paused");
    let paused = timeline(&report)
        .into_iter()
        .find(|(_, m)| m.contains("failed >"))
        .expect("a pause in the timeline");
    assert_eq!(
        paused,
        (
            45,
            "group canary paused rollout fw-2-4: 1 of 2 failed > 10%".to_owned()
        )
    );
    assert_eq!(report["devices"]["dev-001"], "failed");
    assert_eq!(
        report["devices"]["dev-005"], "scheduled",
        "nothing else started"
    );
}

#[test]
fn text_timestamps_follow_the_scripted_delays() {
    let files = Files::new(
        "[groups]\ncount = 2\n",
        "default = { ready_after = \"90s\" }\n\
         [[device]]\nselect = \"env=canary\"\nready_after = \"5m\"\n",
    );
    let out = files.simulate(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    // group-1 is dev-000..dev-004: the canaries take five minutes, so group-2 starts at 5:00 and
    // its prod devices are ready 90 seconds later.
    assert!(
        text.contains("+00:00:00  group group-1 started with 5 devices"),
        "{text}"
    );
    assert!(
        text.contains("+00:05:00  group group-2 started with 5 devices"),
        "{text}"
    );
    assert!(
        text.contains("+00:06:30  rollout fw-2-4 finished: 10 of 10 devices ready"),
        "{text}"
    );
    assert!(text.contains("dev-009  ready"), "{text}");
}

#[test]
fn a_silent_device_does_not_hold_the_run_forever() {
    let files = Files::new(
        "[groups]\ncount = 2\n",
        "[[device]]\nid = \"dev-002\"\nsilent = true\n",
    );
    let (code, report) = files.simulate_json(&["--until", "2h"]);
    assert_eq!(code, 2, "still waiting at the end");
    assert_eq!(report["rollout"]["state"], "running");
    assert_eq!(report["devices"]["dev-002"], "issued");
    assert_eq!(report["devices"]["dev-007"], "scheduled");
    assert!(report["end"]["at"].as_u64().expect("end") <= 7200);
}

#[test]
fn operator_stop_cancels_the_devices_still_working() {
    let files = Files::new(
        "[groups]\ncount = 2\n",
        "default = { ready_after = \"10m\" }\n[[operator]]\nat = \"2m\"\ncommand = \"stop\"\n",
    );
    let (code, report) = files.simulate_json(&[]);
    assert_eq!(code, 2);
    assert_eq!(report["rollout"]["state"], "stopped");
    assert_eq!(report["devices"]["dev-000"], "canceled");
    assert!(timeline(&report).contains(&(
        120,
        "stopped by operator; canceled 5 device actions, 5 devices not started stay as they are"
            .to_owned()
    )));
}

#[test]
fn bad_files_exit_1_naming_the_field() {
    let files = Files::new(
        "[groups]\ncount = 2\n",
        "[[device]]\nid = \"dev-001\"\nfail_after = \"soon\"\n",
    );
    let out = files.simulate(&[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("device[0].fail_after: \"soon\""),
        "{}",
        stderr(&out)
    );
    fs::write(
        files.dir.path().join("fleet.json"),
        r#"[{"id": "a"}, {"id": "a"}]"#,
    )
    .expect("fleet");
    let out = files.simulate(&[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("fleet[1].id: \"a\" is already used by fleet[0]"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn plan_prints_groups_as_json_and_as_a_table() {
    let files = Files::new(THREE_GROUPS, "");
    let (spec, fleet) = (files.path("spec.toml"), files.path("fleet.json"));
    let out = flotilla(&["plan", "--spec", &spec, "--fleet", &fleet, "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let plan: Value = serde_json::from_str(&stdout(&out)).expect("json");
    let groups: Vec<(String, usize)> = plan["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .map(|g| {
            (
                g["name"].as_str().expect("name").to_owned(),
                g["devices"].as_array().expect("devices").len(),
            )
        })
        .collect();
    assert_eq!(
        groups,
        [
            ("canary".to_owned(), 2),
            ("half".to_owned(), 4),
            ("rest".to_owned(), 4)
        ]
    );
    assert_eq!(plan["groups"][0]["devices"][0], "dev-000");
    assert_eq!(plan["unassigned"], serde_json::json!([]));

    let out = flotilla(&["plan", "--spec", &spec, "--fleet", &fleet]);
    let table = stdout(&out);
    assert!(
        table.lines().next().is_some_and(|l| l.starts_with("GROUP")),
        "{table}"
    );
    assert!(table.contains("dev-000, dev-001"), "{table}");
    assert!(table.contains("10 devices in 3 groups"), "{table}");

    let missing = files.path("nope.json");
    let out = flotilla(&["plan", "--spec", &spec, "--fleet", &missing]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("cannot read fleet file"),
        "{}",
        stderr(&out)
    );
}

/// A spec whose canary stage waits for an approval; the syntax follows the staged vocabulary.
const APPROVAL_STAGES: &str = "[staged]\n\
    [[staged.stage]]\nname = \"canary\"\nselect = \"env=canary\"\nafter = { approval = true }\n\
    [[staged.stage]]\nname = \"prod\"\nselect = \"env=prod\"\n";

#[test]
fn an_approval_holds_the_next_stage_until_the_operator_approves() {
    let files = Files::new(
        APPROVAL_STAGES,
        "default = { ready_after = \"1m\" }\n[[operator]]\nat = \"2h\"\napprove = \"fw-2-4-canary\"\n",
    );
    let (code, report) = files.simulate_json(&[]);
    assert_eq!(code, 0, "{report}");
    let prod = timeline(&report)
        .into_iter()
        .find(|(_, m)| m.contains("prod started"))
        .expect("prod starts");
    assert_eq!(prod.0, 7200, "prod waits for the approval at 2h");
}

#[test]
fn next_refuses_at_an_approval_and_next_with_skip_approval_passes_it() {
    let files = Files::new(
        APPROVAL_STAGES,
        "default = { ready_after = \"1m\" }\n\
         [[operator]]\nat = \"1h\"\ncommand = \"next\"\n\
         [[operator]]\nat = \"2h\"\ncommand = \"next\"\nskip_approval = true\n",
    );
    let (code, report) = files.simulate_json(&[]);
    assert_eq!(code, 0, "{report}");
    let lines = timeline(&report);
    let refused = lines
        .iter()
        .find(|(_, m)| m.contains("operator next refused"))
        .expect("a plain next is refused at the approval");
    assert_eq!(refused.0, 3600, "{refused:?}");
    assert!(refused.1.contains("approval"), "{refused:?}");
    let prod = lines
        .iter()
        .find(|(_, m)| m.contains("prod started"))
        .expect("prod starts");
    assert_eq!(prod.0, 7200, "prod starts at the skip at 2h");
    assert!(
        lines
            .iter()
            .any(|(_, m)| m.contains("given by operator via next")),
        "the timeline says who passed the approval: {lines:?}"
    );
}

#[test]
fn skip_approval_belongs_to_next_only() {
    let files = Files::new(
        APPROVAL_STAGES,
        "[[operator]]\nat = \"1h\"\ncommand = \"pause\"\nskip_approval = true\n",
    );
    let out = files.simulate(&[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("operator[0].skip_approval: only with command = \"next\""),
        "{}",
        stderr(&out)
    );
}

#[test]
fn an_unapproved_stage_waits_until_the_horizon() {
    let files = Files::new(APPROVAL_STAGES, "default = { ready_after = \"1m\" }\n");
    let (code, report) = files.simulate_json(&["--until", "1d"]);
    assert_eq!(code, 2);
    assert_eq!(report["devices"]["dev-005"], "scheduled");
}

#[test]
fn a_timed_wait_delays_the_next_stage_by_its_duration() {
    let files = Files::new(
        &APPROVAL_STAGES.replace("after = { approval = true }", "after = { wait = \"1h\" }"),
        "default = { ready_after = \"1m\" }\n",
    );
    let (code, report) = files.simulate_json(&[]);
    assert_eq!(code, 0, "{report}");
    let prod = timeline(&report)
        .into_iter()
        .find(|(_, m)| m.contains("prod started"))
        .expect("prod starts");
    // Two canary devices one at a time (max_concurrency 1): ready at 1m and 2m, then the 1h wait.
    assert_eq!(prod.0, 120 + 3600);
}

#[test]
fn no_outcomes_file_means_every_device_is_ready_after_30s() {
    let files = Files::new("[groups]\ncount = 2\n", "");
    let (spec, fleet) = (files.path("spec.toml"), files.path("fleet.json"));
    let out = flotilla(&["simulate", "--spec", &spec, "--fleet", &fleet, "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let report: Value = serde_json::from_str(&stdout(&out)).expect("json");
    assert_eq!(report["end"]["at"], 60);
}
