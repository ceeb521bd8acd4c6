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

/// The processes whose command line mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|raw| String::from_utf8_lossy(&raw).replace('\0', " "))
        .filter(|cmd| cmd.contains(needle))
        .collect()
}

/// issue 10, case 12: a demo stopped with SIGTERM used to leave its agents running and its
/// temporary directory, secret keys included, behind.
#[test]
fn a_demo_stopped_with_sigterm_stops_its_agents_and_removes_its_keys() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut demo = Command::new(bin("flotilla"))
        .args(["demo", "--json", "--devices", "3"])
        .env("FLOTILLA_AGENT_BIN", bin("flotilla-agent"))
        .env("TMPDIR", tmp.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start flotilla demo");
    let needle = tmp.path().to_string_lossy().into_owned();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while processes_mentioning(&needle)
        .iter()
        .filter(|cmd| cmd.contains("flotilla-agent"))
        .count()
        < 3
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the demo's 3 agents did not start within 60s"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let keys_written = std::fs::read_dir(tmp.path())
        .expect("list TMPDIR")
        .filter_map(Result::ok)
        .any(|e| e.path().join("keys").join("release.key").exists());
    assert!(keys_written, "the demo wrote its keys under TMPDIR");

    Command::new("kill")
        .args(["-TERM", &demo.id().to_string()])
        .status()
        .expect("send SIGTERM");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    let status = loop {
        if let Some(status) = demo.try_wait().expect("wait") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = demo.kill();
            panic!("the demo did not stop within 15s of SIGTERM");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(143), "exit code for SIGTERM");
    let left: Vec<String> = processes_mentioning(&needle)
        .into_iter()
        .filter(|cmd| cmd.contains("flotilla-agent"))
        .collect();
    assert!(left.is_empty(), "agents left running: {left:?}");
    let remaining: Vec<_> = std::fs::read_dir(tmp.path())
        .expect("list TMPDIR")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    assert!(
        remaining.is_empty(),
        "the temporary directory with the keys is removed: {remaining:?}"
    );
}
