//! `flotilla demo`, run as a newcomer would run it: the exit code and the JSON summary say what
//! happened to every device and group.

use std::process::Command;

use flotilla_tests::bin;
use serde_json::Value;

fn demo(args: &[&str]) -> (i32, Value) {
    let output = Command::new(bin("flotilla"))
        .arg("demo")
        .arg("--json")
        .args(args)
        .env("FLOTILLA_AGENT_BIN", bin("flotilla-agent"))
        .output()
        .expect("run flotilla demo");
    let code = output.status.code().expect("exit code");
    let summary = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "demo printed no JSON summary ({e}); exit {code}\nstdout: {}\nstderr: {}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (code, summary)
}

fn devices_in_phase<'a>(summary: &'a Value, phase: &str) -> Vec<&'a str> {
    summary["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .filter(|d| d["phase"] == phase)
        .map(|d| d["id"].as_str().expect("id"))
        .collect()
}

#[test]
fn one_failing_agent_stays_within_the_threshold_and_the_rollout_finishes() {
    let (code, summary) = demo(&[]);
    assert_eq!(code, 0, "{summary:#}");
    assert_eq!(summary["state"], "finished");
    assert_eq!(summary["devices"].as_array().expect("devices").len(), 12);
    assert_eq!(
        devices_in_phase(&summary, "failed"),
        ["dev-01"],
        "{summary:#}"
    );
    assert_eq!(devices_in_phase(&summary, "ready").len(), 11, "{summary:#}");
    let failed = &summary["devices"][0];
    assert!(
        failed["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("health check"),
        "{failed}"
    );
    assert_ne!(
        failed["installed"], summary["release"],
        "the failed device rolled back"
    );
    let groups = summary["groups"].as_array().expect("groups");
    assert_eq!(groups.len(), 3);
    assert!(
        groups.iter().all(|g| g["state"] == "finished"),
        "{summary:#}"
    );
    for d in summary["devices"].as_array().expect("devices") {
        if d["phase"] == "ready" {
            assert_eq!(d["installed"], summary["release"], "{d}");
        }
    }
}

#[test]
fn two_failing_agents_cross_the_threshold_and_pause_the_rollout() {
    let (code, summary) = demo(&["--fail", "2", "--devices", "6"]);
    assert_eq!(code, 2, "{summary:#}");
    assert_eq!(summary["state"], "paused");
    let groups = summary["groups"].as_array().expect("groups");
    assert_eq!(groups[0]["state"], "error", "{summary:#}");
    assert_eq!(
        groups[1]["state"], "scheduled",
        "the next group never started: {summary:#}"
    );
    assert_eq!(groups[2]["state"], "scheduled");
    let decisions = summary["decisions"].to_string();
    assert!(
        decisions.contains("failed >"),
        "the decision names the numbers: {decisions}"
    );
}

#[test]
fn impossible_arguments_are_refused_with_a_reason() {
    let output = Command::new(bin("flotilla"))
        .args(["demo", "--devices", "2"])
        .output()
        .expect("run demo");
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("at least 3 devices"));
}
