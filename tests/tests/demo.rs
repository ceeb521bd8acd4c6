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

/// How a demo is ended: from outside by a signal or its reader closing stdout, or from inside
/// by a panic (the test hook FLOTILLA_DEMO_PANIC_AFTER).
#[derive(Clone, Copy)]
enum End {
    Signal(&'static str),
    ClosedPipe,
    Panic,
}

/// Starts a demo with its temporary directory under a TMPDIR of its own, waits until its 3
/// agents run (and, for a closed pipe, until it printed that they registered), ends it as
/// `end` says and returns its exit status and its stderr, once every one of its agents is gone
/// and nothing is left in that TMPDIR, secret keys included (or panics saying what was left).
fn end_demo(end: End) -> (std::process::ExitStatus, String) {
    use std::io::BufRead as _;
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut command = Command::new(bin("flotilla"));
    command
        .args(["demo", "--devices", "3"])
        .env("FLOTILLA_AGENT_BIN", bin("flotilla-agent"))
        .env("TMPDIR", tmp.path())
        .stderr(std::process::Stdio::piped());
    match end {
        End::Signal(_) => command.arg("--json").stdout(std::process::Stdio::null()),
        End::ClosedPipe => command.stdout(std::process::Stdio::piped()),
        // The demo panics as soon as its agents run: the test cannot wait to see them, the
        // demo's last words say how many it stopped.
        End::Panic => command
            .arg("--json")
            .env("FLOTILLA_DEMO_PANIC_AFTER", "agents-started")
            .stdout(std::process::Stdio::null()),
    };
    let mut demo = command.spawn().expect("start flotilla demo");
    // Read on the side, so a full pipe never holds the demo up.
    let mut stderr_pipe = demo.stderr.take().expect("stderr");
    let stderr = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr_pipe, &mut text);
        text
    });
    let needle = tmp.path().to_string_lossy().into_owned();
    let agents = || -> Vec<String> {
        processes_mentioning(&needle)
            .into_iter()
            .filter(|cmd| cmd.contains("flotilla-agent"))
            .collect()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !matches!(end, End::Panic) && agents().len() < 3 {
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
    assert!(
        keys_written || matches!(end, End::Panic),
        "the demo wrote its keys under TMPDIR"
    );

    match end {
        End::Signal(signal) => {
            Command::new("kill")
                .args([&format!("-{signal}"), &demo.id().to_string()])
                .status()
                .expect("send the signal");
        }
        End::ClosedPipe => {
            // Read up to the line after which it writes again, then stop reading, as `head`.
            let stdout = demo.stdout.take().expect("stdout");
            let mut lines = std::io::BufReader::new(stdout).lines();
            loop {
                match lines.next() {
                    Some(Ok(line)) if line.contains("agents registered") => break,
                    Some(Ok(_)) => {}
                    other => panic!("the demo's output ended early: {other:?}"),
                }
            }
        }
        End::Panic => {}
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    let status = loop {
        if let Some(status) = demo.try_wait().expect("wait") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = demo.kill();
            panic!("the demo did not stop within 15s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let stderr = stderr.join().unwrap_or_default();
    assert_eq!(
        stderr.contains("panicked"),
        matches!(end, End::Panic),
        "{stderr}"
    );
    let left = agents();
    assert!(left.is_empty(), "agents left running: {left:?}");
    let remaining: Vec<_> = std::fs::read_dir(tmp.path())
        .expect("list TMPDIR")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    assert!(
        remaining.is_empty(),
        "the temporary directory with the keys is removed: {remaining:?}\n{stderr}"
    );
    (status, stderr)
}

/// issue 10, case 12: a demo stopped with SIGTERM used to leave its agents running and its
/// temporary directory, secret keys included, behind.
#[test]
fn a_demo_stopped_with_sigterm_stops_its_agents_and_removes_its_keys() {
    let (status, _) = end_demo(End::Signal("TERM"));
    assert_eq!(status.code(), Some(143), "exit code for SIGTERM");
}

/// Issue 24: a closed terminal (SIGHUP) cleans up as SIGTERM does.
#[test]
fn a_demo_whose_terminal_closes_stops_its_agents_and_removes_its_keys() {
    let (status, _) = end_demo(End::Signal("HUP"));
    assert_eq!(status.code(), Some(129), "exit code for SIGHUP");
}

/// Issue 24: `flotilla demo | head` closes the demo's stdout while it runs. It used to die on
/// the closed pipe and leave its agents and its directory behind; it ends quietly now (exit 0,
/// no panic), agents stopped and directory removed.
#[test]
fn a_demo_whose_reader_stops_reading_stops_its_agents_and_removes_its_keys() {
    let (status, _) = end_demo(End::ClosedPipe);
    assert_eq!(
        status.code(),
        Some(0),
        "a closed pipe ends the demo quietly"
    );
}

/// Issue 24: a panic aborts a release build, so no destructor runs. The demo's panic hook stops
/// its agents and removes its directory first, and the demo then aborts in every build (the
/// test runs whichever build it was built with and sees the same).
#[test]
fn a_demo_that_panics_stops_its_agents_and_removes_its_keys() {
    use std::os::unix::process::ExitStatusExt as _;
    let (status, stderr) = end_demo(End::Panic);
    assert_eq!(
        status.signal(),
        Some(6),
        "a panic aborts the demo: {stderr}"
    );
    assert!(
        stderr.contains("demo: panicked; stopped 3 agents, removed "),
        "the demo says what it cleaned up: {stderr}"
    );
    // Its embedded broker went with it: nothing listens on the port it printed.
    let broker = stderr
        .split("embedded MQTT broker on ")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .unwrap_or_else(|| panic!("the demo printed its broker's address: {stderr}"));
    assert!(
        std::net::TcpStream::connect(broker).is_err(),
        "the demo's broker on {broker} is stopped"
    );
}
