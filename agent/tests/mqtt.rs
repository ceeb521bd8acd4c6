//! End-to-end test of the agent over a real mosquitto broker: the test plays the coordinator
//! (signs a release and a desired action, publishes it retained, serves artifact blocks from
//! memory) and watches the agent's reports.
//!
//! Skipped with a notice when `mosquitto` is not installed.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    config_text, coordinator, coordinator_bad_first, coordinator_with, key, now, release,
    reports_until, run_agent, sign_action, start_broker, TIMEOUT,
};
use flotilla_agent::Config;
use flotilla_protocol::{
    envelope, ActionBody, ActionKind, DesiredAction, DeviceId, Message, Phase, Report, SignedBlob,
    Topics,
};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use tokio::sync::mpsc;

fn agent_config(port: u16, dir: &Path, device: &str, dest: &Path) -> Config {
    Config::from_toml(&agent_config_text(port, dir, device, dest, 0)).expect("test config is valid")
}

fn agent_config_text(port: u16, dir: &Path, device: &str, dest: &Path, rate: u64) -> String {
    let rest = format!(
        r#"
[labels]
env = "test"
[[target]]
name = "app"
kind = "file"
path = "{dest}"
[health]
soak = "300ms"
interval = "100ms"
[[health.check]]
name = "app-runs"
command = ["/bin/sh", "-c", "test -s {dest}"]
timeout = "5s"
[download]
block_size = 1000
in_flight = 3
max_bytes_per_sec = {rate}
"#,
        dest = dest.display(),
    );
    config_text(port, dir, device, &rest)
}

fn desired(device: &str, action_id: &str, artifact: &[u8]) -> SignedBlob {
    sign_action(device, action_id, install(artifact, 2, ActionKind::Forced))
}

/// An install of release `app-{counter}` holding `artifact`, signed by the release key.
fn install(artifact: &[u8], counter: u64, kind: ActionKind) -> ActionBody {
    common::install(&release("app", counter, "app.bin", "app", artifact), kind)
}

/// Collects reports until one is terminal; returns them all.
async fn reports_until_final(rx: &mut mpsc::Receiver<Report>) -> Vec<Report> {
    reports_until(rx, "final", |r| r.phase.is_terminal()).await
}

fn artifact() -> Vec<u8> {
    (0..10_500u32).map(|i| (i % 253) as u8).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn installs_signed_release_and_reports_ready() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let dest = dir.path().join("app.bin");
    std::fs::write(&dest, b"old version").expect("write old");
    let device = "dev-ok";
    let bytes = artifact();
    let mut reports = coordinator(
        broker.port,
        device,
        desired(device, "act-ok-1", &bytes),
        bytes.clone(),
    )
    .await;

    let agent = run_agent(agent_config(broker.port, dir.path(), device, &dest));

    let seen = reports_until_final(&mut reports).await;
    let last = seen.last().map(|r| r.phase.clone());
    assert_eq!(last, Some(Phase::Ready), "reports: {seen:#?}");
    assert_eq!(
        std::fs::read(&dest).expect("read target"),
        bytes,
        "target holds the new artifact"
    );
    let phases: Vec<&str> = seen.iter().map(|r| r.phase.name()).collect();
    for expected in [
        "accepted",
        "downloading",
        "verified",
        "staged",
        "activated",
        "confirming",
        "ready",
    ] {
        assert!(
            phases.contains(&expected),
            "missing {expected} in {phases:?}"
        );
    }
    assert!(
        seen.windows(2).all(|w| w[0].seq < w[1].seq),
        "seq grows: {seen:#?}"
    );

    let result = agent
        .stop()
        .await
        .expect("agent stops within 30s")
        .expect("agent task");
    assert!(result.is_ok(), "agent ended with {result:?}");

    // The database remembers it across a restart.
    let status = flotilla_agent::status(&agent_config(broker.port, dir.path(), device, &dest))
        .expect("status");
    assert!(
        status.contains("installed: app-2 2.0 (counter 2)"),
        "{status}"
    );
    assert!(status.contains("phase: ready"), "{status}");
    assert!(
        status.contains("unacknowledged reports: 0"),
        "the broker acknowledged every report: {status}"
    );

    // Restarted, the agent receives the same retained action again: it only re-reports Ready.
    let last_seq = seen.last().map(|r| r.seq).unwrap_or(0);
    std::fs::write(&dest, b"changed by hand").expect("write");
    let agent = run_agent(agent_config(broker.port, dir.path(), device, &dest));
    let again = reports_until_final(&mut reports).await;
    let phases: Vec<&str> = again.iter().map(|r| r.phase.name()).collect();
    assert_eq!(phases, ["ready"], "nothing is applied twice: {again:#?}");
    assert!(again[0].seq > last_seq, "seq keeps growing across restarts");
    assert_eq!(std::fs::read(&dest).expect("read"), b"changed by hand");
    let _ = agent.stop().await;
}

/// issue 10, case 7: a single `Unavailable` or empty block reply, as anyone on the broker can
/// publish, used to fail the install. Every block's first answer here is bad; the agent discards
/// it, asks again after a backoff, and installs the right bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_block_replies_are_retried_and_the_install_succeeds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let dest = dir.path().join("app.bin");
    std::fs::write(&dest, b"old version").expect("write old");
    let device = "dev-badblocks";
    let bytes = artifact();
    let asked = Arc::new(Mutex::new(Vec::new()));
    let mut reports = coordinator_bad_first(
        broker.port,
        device,
        desired(device, "act-bad-1", &bytes),
        bytes.clone(),
        asked.clone(),
    )
    .await;
    let agent = run_agent(agent_config(broker.port, dir.path(), device, &dest));
    let seen = reports_until_final(&mut reports).await;
    assert_eq!(
        seen.last().map(|r| r.phase.clone()),
        Some(Phase::Ready),
        "reports: {seen:#?}"
    );
    assert_eq!(std::fs::read(&dest).expect("read target"), bytes);
    let asked = asked.lock().expect("asked").clone();
    let blocks = bytes.len().div_ceil(1000);
    for block in 0..blocks as u64 {
        assert!(
            asked.iter().filter(|&&o| o == block * 1000).count() >= 2,
            "block {block} was asked for again after its bad reply: {asked:?}"
        );
    }
    let _ = agent.stop().await;
}

/// issue 10, case 5: after one action from a coordinator whose clock was 30 days ahead, a device
/// used to take that time as trusted and refuse every later action for 30 days. The action is
/// now refused, naming both clocks, and the next correct action installs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_from_a_clock_far_ahead_is_refused_and_locks_nobody_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let dest = dir.path().join("app.bin");
    std::fs::write(&dest, b"old version").expect("write old");
    let device = "dev-clock";
    let bytes = artifact();
    let month = 30 * 86_400;
    let ahead = DesiredAction {
        action_id: "act-ahead".into(),
        device_id: device.into(),
        rollout_id: "r1".into(),
        issued_at: now() + month,
        expires_at: now() + month + 3600,
        body: install(&bytes, 2, ActionKind::Forced),
    };
    let mut reports = coordinator(
        broker.port,
        device,
        SignedBlob::sign(&key(2), envelope::to_bytes(&ahead)),
        bytes.clone(),
    )
    .await;
    let agent = run_agent(agent_config(broker.port, dir.path(), device, &dest));
    let seen = reports_until_final(&mut reports).await;
    let last = seen.last().expect("a report");
    assert_eq!(last.action_id, "act-ahead");
    let reason = last.phase.reason().unwrap_or_default();
    assert!(
        matches!(last.phase, Phase::Refused { .. })
            && reason.contains("ahead of this device's clock")
            && reason.contains("max_clock_skew"),
        "{:?}",
        last.phase
    );
    assert_eq!(std::fs::read(&dest).expect("read"), b"old version");

    // The coordinator's clock is fixed: its next action installs.
    publish_desired(broker.port, device, desired(device, "act-now", &bytes)).await;
    let seen = reports_until_final(&mut reports).await;
    assert_eq!(
        seen.last().map(|r| (r.action_id.as_str(), r.phase.clone())),
        Some(("act-now", Phase::Ready)),
        "{seen:#?}"
    );
    assert_eq!(std::fs::read(&dest).expect("read"), bytes);
    let _ = agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn action_for_another_device_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let dest = dir.path().join("app.bin");
    std::fs::write(&dest, b"old version").expect("write old");
    let device = "dev-refuse";
    let bytes = artifact();
    // Signed correctly, but addressed to another device and published on this one's topic.
    let mut reports = coordinator(
        broker.port,
        device,
        desired("dev-other", "act-x", &bytes),
        bytes,
    )
    .await;
    let agent = run_agent(agent_config(broker.port, dir.path(), device, &dest));
    let seen = reports_until_final(&mut reports).await;
    assert_eq!(
        seen.last().map(|r| r.phase.clone()),
        Some(Phase::Refused {
            reason: "action is for device dev-other, this is dev-refuse".into()
        })
    );
    assert_eq!(
        std::fs::read(&dest).expect("read"),
        b"old version",
        "nothing applied"
    );
    let _ = agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tampered_artifact_leaves_target_untouched() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let dest = dir.path().join("app.bin");
    std::fs::write(&dest, b"old version").expect("write old");
    let device = "dev-tampered";
    let bytes = artifact();
    let mut served = bytes.clone();
    served[4321] ^= 0x55;
    let mut reports = coordinator(
        broker.port,
        device,
        desired(device, "act-bad-1", &bytes),
        served,
    )
    .await;

    let agent = run_agent(agent_config(broker.port, dir.path(), device, &dest));

    let seen = reports_until_final(&mut reports).await;
    match seen.last().map(|r| &r.phase) {
        Some(Phase::Failed {
            reason,
            rolled_back: false,
        }) => {
            assert!(
                reason.starts_with("artifact app.bin: sha256 mismatch (expected "),
                "{reason}"
            )
        }
        other => panic!("expected a sha256 mismatch failure, got {other:?}; reports: {seen:#?}"),
    }
    assert_eq!(
        std::fs::read(&dest).expect("read target"),
        b"old version",
        "target is untouched"
    );
    let _ = agent.stop().await;
}

/// Kill -9 in the middle of a download, restart: the agent resumes where it was (never asking
/// for the start of the artifact again) and still ends Ready with the right bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumes_download_after_kill_9() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let dest = dir.path().join("app.bin");
    std::fs::write(&dest, b"old version").expect("write old");
    let device = "dev-resume";
    let bytes: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let asked = Arc::new(Mutex::new(Vec::new()));
    let (state_tx, mut states) = mpsc::channel(100);
    let mut reports = coordinator_with(
        broker.port,
        device,
        desired(device, "act-resume-1", &bytes),
        bytes.clone(),
        asked.clone(),
        Some(state_tx),
    )
    .await;
    // 50 kB/s: the download takes about four seconds, long enough to be killed in the middle.
    let config = dir.path().join("agent.toml");
    std::fs::write(
        &config,
        agent_config_text(broker.port, dir.path(), device, &dest, 50_000),
    )
    .expect("write config");
    let spawn_agent = || {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla-agent"))
            .args(["run", "--config"])
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start agent")
    };

    let mut agent = spawn_agent();
    let total = bytes.len() as u64;
    let progressed = tokio::time::timeout(TIMEOUT, async {
        while let Some(r) = reports.recv().await {
            if let Phase::Downloading { done, .. } = r.phase {
                if done * 10 >= total * 3 {
                    return done;
                }
            }
        }
        0
    })
    .await
    .expect("no download progress report past 30% within 30s");
    assert!(progressed > 0);
    agent.start_kill().expect("kill -9");
    let _ = agent.wait().await;
    // The broker publishes the last will once it notices the dead connection: from then on, no
    // request from the killed process can arrive.
    tokio::time::timeout(TIMEOUT, async {
        while let Some(s) = states.recv().await {
            if !s.online {
                return;
            }
        }
    })
    .await
    .expect("no offline last will within 30s");
    let before_restart = asked.lock().map(|a| a.len()).expect("lock");

    let _agent = spawn_agent();
    let seen = reports_until_final(&mut reports).await;
    assert_eq!(
        seen.last().map(|r| r.phase.clone()),
        Some(Phase::Ready),
        "reports: {seen:#?}"
    );
    assert_eq!(std::fs::read(&dest).expect("read target"), bytes);
    let after: Vec<u64> = asked
        .lock()
        .map(|a| a[before_restart..].to_vec())
        .expect("lock");
    let first = after
        .first()
        .copied()
        .expect("the restarted agent asked for blocks");
    assert!(first > 0, "resumed at offset {first}, not from the start");
    assert!(
        after.iter().all(|&o| o >= first),
        "never asked for the prefix it had: {after:?}"
    );
}

/// Runs the agent binary with `args`; returns its stdout, or panics with its stderr.
async fn agent_cli(args: &[&str], config: &Path) -> String {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla-agent"))
        .args(args)
        .arg("--config")
        .arg(config)
        .output()
        .await
        .expect("run flotilla-agent");
    assert!(
        out.status.success(),
        "flotilla-agent {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A soft action waits on the device until its user consents from the command line, while the
/// agent runs and holds the database; then it installs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soft_action_waits_for_consent_given_on_the_command_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let dest = dir.path().join("app.bin");
    std::fs::write(&dest, b"old version").expect("write old");
    let device = "dev-soft";
    let bytes = artifact();
    let mut reports = coordinator(
        broker.port,
        device,
        sign_action(device, "act-soft-1", install(&bytes, 2, ActionKind::Soft)),
        bytes.clone(),
    )
    .await;
    let config = dir.path().join("agent.toml");
    std::fs::write(
        &config,
        agent_config_text(broker.port, dir.path(), device, &dest, 0),
    )
    .expect("write config");
    let _agent = tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla-agent"))
        .args(["run", "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start agent");

    let waiting = tokio::time::timeout(TIMEOUT, async {
        while let Some(r) = reports.recv().await {
            if let Phase::Waiting { reason } = r.phase {
                return reason;
            }
        }
        String::new()
    })
    .await
    .expect("no waiting report within 30s");
    assert_eq!(
        waiting,
        "waiting for local consent (flotilla-agent consent act-soft-1)"
    );
    assert_eq!(std::fs::read(&dest).expect("read"), b"old version");

    let status = agent_cli(&["status"], &config).await;
    assert!(status.contains("the agent is running"), "{status}");
    assert!(
        status.contains("action: act-soft-1 (rollout r1)"),
        "{status}"
    );
    assert!(status.contains("phase: waiting"), "{status}");

    let said = agent_cli(&["consent"], &config).await;
    assert!(said.starts_with("consent given to act-soft-1"), "{said}");

    let seen = reports_until_final(&mut reports).await;
    assert_eq!(
        seen.last().map(|r| r.phase.clone()),
        Some(Phase::Ready),
        "reports: {seen:#?}"
    );
    assert_eq!(std::fs::read(&dest).expect("read"), bytes);
}

/// Replaces the retained desired action of `device`, as the coordinator does for a new action.
async fn publish_desired(port: u16, device: &str, desired: SignedBlob) {
    let topics = Topics::default();
    let id = DeviceId::new(device).expect("device id");
    let options = MqttOptions::new(format!("test-publisher-{device}"), "127.0.0.1", port);
    let (client, mut eventloop) = AsyncClient::new(options, 10);
    client
        .publish(
            topics.desired(&id),
            QoS::AtLeastOnce,
            true,
            envelope::encode(&Message::Desired(desired)),
        )
        .await
        .expect("publish desired");
    tokio::time::timeout(TIMEOUT, async {
        loop {
            if let Ok(Event::Incoming(Packet::PubAck(_))) = eventloop.poll().await {
                return;
            }
        }
    })
    .await
    .expect("the broker acknowledged the desired action");
}

/// A signed rollback over the broker: the file and the installed release go back to what the
/// device kept, and the rollback action is reported Ready under its own id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_rollback_returns_to_the_kept_release() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let dest = dir.path().join("app.bin");
    std::fs::write(&dest, b"factory version").expect("write old");
    let device = "dev-rollback";
    let bytes = artifact();
    let mut reports = coordinator(
        broker.port,
        device,
        desired(device, "act-install-1", &bytes),
        bytes.clone(),
    )
    .await;
    let config = agent_config(broker.port, dir.path(), device, &dest);
    let agent = run_agent(config.clone());
    let seen = reports_until_final(&mut reports).await;
    assert_eq!(seen.last().map(|r| r.phase.clone()), Some(Phase::Ready));
    assert_eq!(std::fs::read(&dest).expect("read"), bytes);

    publish_desired(
        broker.port,
        device,
        sign_action(
            device,
            "act-rollback-1",
            ActionBody::Rollback {
                action_id: "act-install-1".into(),
            },
        ),
    )
    .await;
    let seen = reports_until_final(&mut reports).await;
    let last = seen.last().expect("a report");
    assert_eq!(last.action_id, "act-rollback-1");
    assert_eq!(last.phase, Phase::Ready, "reports: {seen:#?}");
    assert_eq!(std::fs::read(&dest).expect("read"), b"factory version");

    let _ = agent.stop().await;
    let status = flotilla_agent::status(&config).expect("status");
    assert!(status.contains("installed: nothing recorded"), "{status}");
}

/// Writes an agent config file and returns its path.
fn write_config(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("agent.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

/// Starts the agent binary, with `FLOTILLA_FAULT` set to `fault` if given.
fn spawn_agent(config: &Path, fault: Option<&str>) -> tokio::process::Child {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla-agent"));
    command
        .args(["run", "--config"])
        .arg(config)
        .env_remove(flotilla_agent::fault::FAULT_VAR)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    if let Some(point) = fault {
        command.env(flotilla_agent::fault::FAULT_VAR, point);
    }
    command.spawn().expect("start agent")
}

/// A crash right after each persisted transition: the restarted agent finishes the install,
/// and the file ends up with exactly the new content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_every_persisted_transition_still_ends_ready() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let bytes = artifact();
    for point in [
        "after-accepted",
        "after-downloading",
        "after-verified",
        "after-staging",
        "after-staged",
        "after-activating",
        "after-activated",
        "after-confirming",
    ] {
        let sub = dir.path().join(point);
        std::fs::create_dir_all(&sub).expect("mkdir");
        let dest = sub.join("app.bin");
        std::fs::write(&dest, b"old version").expect("write old");
        let device = format!("dev-{point}");
        let mut reports = coordinator(
            broker.port,
            &device,
            desired(&device, &format!("act-{point}"), &bytes),
            bytes.clone(),
        )
        .await;
        let config = write_config(
            &sub,
            &agent_config_text(broker.port, &sub, &device, &dest, 0),
        );
        let status = tokio::time::timeout(TIMEOUT, spawn_agent(&config, Some(point)).wait())
            .await
            .expect("the agent stops at its fault point within 30s")
            .expect("wait");
        assert!(!status.success(), "{point}: the agent aborted ({status})");
        let _agent = spawn_agent(&config, None);
        let seen = reports_until_final(&mut reports).await;
        assert_eq!(
            seen.last().map(|r| r.phase.clone()),
            Some(Phase::Ready),
            "{point}: {seen:#?}"
        );
        assert_eq!(std::fs::read(&dest).expect("read"), bytes, "{point}");
    }
}

/// A config for the script target, through a wrapper that logs every subcommand with its action
/// id to `calls.log` before running the conformance suite's copy script.
fn script_config_text(port: u16, dir: &Path, device: &str, dest: &Path, rate: u64) -> String {
    let copy =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../targets/tests/scripts/copy-target.sh");
    let wrapper = dir.join("wrapper.sh");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\necho \"$1 $FLOTILLA_ACTION_ID\" >> {log}\nexec sh {copy} \"$@\"\n",
            log = dir.join("calls.log").display(),
            copy = copy.display()
        ),
    )
    .expect("write wrapper");
    let mut perms = std::fs::metadata(&wrapper).expect("stat").permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&wrapper, perms).expect("chmod");
    agent_config_text(port, dir, device, dest, rate).replace(
        &format!("kind = \"file\"\npath = \"{}\"", dest.display()),
        &format!(
            "kind = \"script\"\npath = \"{}\"\nenv = {{ DEST = \"{}\" }}",
            wrapper.display(),
            dest.display()
        ),
    )
}

/// What the coordinator saw across the restarts: sequence numbers from 1 with no gap, in order,
/// where a number seen again (a re-send of an unacknowledged report) carries the same phase.
fn assert_consistent_stream(name: &str, seen: &[Report]) {
    let mut phases: Vec<&Phase> = Vec::new();
    for r in seen {
        let seq = r.seq as usize;
        assert!(seq >= 1, "{name}: seq starts at 1: {seen:#?}");
        if seq <= phases.len() {
            assert_eq!(
                phases[seq - 1],
                &r.phase,
                "{name}: seq {seq} re-sent with another phase: {seen:#?}"
            );
            continue;
        }
        assert_eq!(
            seq,
            phases.len() + 1,
            "{name}: a gap before seq {seq}, a report was lost: {seen:#?}"
        );
        phases.push(&r.phase);
    }
}

/// How many times the script target ran `subcommand` for `action`.
fn calls(dir: &Path, subcommand: &str, action: &str) -> usize {
    std::fs::read_to_string(dir.join("calls.log"))
        .unwrap_or_default()
        .lines()
        .filter(|l| *l == format!("{subcommand} {action}"))
        .count()
}

/// Crashes at every persisted transition and SIGKILLs at pseudo-random moments during the
/// download: every run ends Ready, the file holds the new content, and the target's stage and
/// activate ran exactly once for the action, as its log shows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashes_never_make_the_target_stage_or_activate_twice() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let bytes: Vec<u8> = (0..120_000u32).map(|i| (i % 241) as u8).collect();
    let points = [
        "after-accepted",
        "after-downloading",
        "after-verified",
        "after-staging",
        "after-staged",
        "after-activating",
        "after-activated",
        "after-confirming",
    ];
    for (round, point) in points.iter().map(Some).chain([None]).enumerate() {
        let name = point.copied().unwrap_or("random-kills");
        let sub = dir.path().join(name);
        std::fs::create_dir_all(&sub).expect("mkdir");
        let dest = sub.join("app.bin");
        std::fs::write(&dest, b"old version").expect("write old");
        let device = format!("dev-{name}");
        let action = format!("act-{name}");
        let mut reports = coordinator(
            broker.port,
            &device,
            desired(&device, &action, &bytes),
            bytes.clone(),
        )
        .await;
        // Throttled to 40 kB/s so the random kills land in the middle of the download.
        let config = write_config(
            &sub,
            &script_config_text(broker.port, &sub, &device, &dest, 40_000),
        );
        match point {
            Some(point) => {
                let status =
                    tokio::time::timeout(TIMEOUT, spawn_agent(&config, Some(point)).wait())
                        .await
                        .expect("the agent stops at its fault point within 30s")
                        .expect("wait");
                assert!(!status.success(), "{point}: the agent aborted ({status})");
            }
            None => {
                // A small linear congruential sequence: different moments, the same every run.
                let mut seed = 0x2545_f491_u64 + round as u64;
                for _ in 0..3 {
                    seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    let after = Duration::from_millis(300 + (seed >> 33) % 900);
                    let mut agent = spawn_agent(&config, None);
                    tokio::time::sleep(after).await;
                    agent.start_kill().expect("kill -9");
                    let _ = agent.wait().await;
                }
            }
        }
        let _agent = spawn_agent(&config, None);
        let seen = reports_until_final(&mut reports).await;
        assert_consistent_stream(name, &seen);
        let content = std::fs::read(&dest).expect("read");
        match seen.last().map(|r| r.phase.clone()) {
            Some(Phase::Ready) => {
                assert_eq!(content, bytes, "{name}: Ready means the new content");
                assert_eq!(calls(&sub, "stage", &action), 1, "{name}: stage ran once");
                assert_eq!(
                    calls(&sub, "activate", &action),
                    1,
                    "{name}: activate ran once"
                );
            }
            // A crash while activating a target that cannot repeat activate: the agent cannot
            // know whether it ran, so it rolls back and says so instead of activating twice.
            Some(Phase::Failed {
                reason,
                rolled_back: true,
            }) if name == "after-activating" => {
                assert!(reason.contains("cannot repeat it"), "{name}: {reason}");
                assert_eq!(content, b"old version", "{name}: rolled back");
                assert_eq!(calls(&sub, "stage", &action), 1, "{name}: stage ran once");
                assert!(
                    calls(&sub, "activate", &action) <= 1,
                    "{name}: activate at most once"
                );
            }
            other => panic!("{name}: ended in {other:?}: {seen:#?}"),
        }
    }
}

/// An update that kills the agent during its health checks (a crash loop) is given up after
/// `store.max_restarts` restarts: rolled back and reported Failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_is_given_up_and_rolled_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let dest = dir.path().join("app.bin");
    std::fs::write(&dest, b"old version").expect("write old");
    let device = "dev-loop";
    let bytes = artifact();
    let mut reports = coordinator(
        broker.port,
        device,
        desired(device, "act-loop-1", &bytes),
        bytes.clone(),
    )
    .await;
    let text = agent_config_text(broker.port, dir.path(), device, &dest, 0);
    let check = format!(
        r#"command = ["/bin/sh", "-c", "test -s {}"]"#,
        dest.display()
    );
    assert!(text.contains(&check));
    // The health check kills its parent, the agent, like an update that crashes the device.
    let text = text.replace(&check, r#"command = ["/bin/sh", "-c", "kill -9 $PPID"]"#)
        + "[store]\nmax_restarts = 2\n";
    let config = write_config(dir.path(), &text);

    let mut starts = 0;
    let seen = loop {
        starts += 1;
        assert!(starts <= 5, "the agent never gave up");
        let mut agent = spawn_agent(&config, None);
        let finished = tokio::select! {
            r = reports_until_final(&mut reports) => Some(r),
            _ = agent.wait() => None,
        };
        if let Some(seen) = finished {
            break seen;
        }
    };
    assert_eq!(starts, 3, "first start plus two restarts");
    assert_eq!(
        seen.last().map(|r| r.phase.clone()),
        Some(Phase::Failed {
            reason: "gave up after 2 restarts in state confirming".into(),
            rolled_back: true
        }),
        "{seen:#?}"
    );
    assert_eq!(std::fs::read(&dest).expect("read"), b"old version");
}

/// A database damaged on disk is moved aside; the agent starts empty, tells the coordinator in
/// its report on the retained desired action, and leaves the installed release alone (the trust
/// file still holds its counter).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_database_is_moved_aside_and_reported() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let dest = dir.path().join("app.bin");
    std::fs::write(&dest, b"old version").expect("write old");
    let device = "dev-damaged";
    let bytes = artifact();
    let mut reports = coordinator(
        broker.port,
        device,
        desired(device, "act-damaged-1", &bytes),
        bytes.clone(),
    )
    .await;
    let config = write_config(
        dir.path(),
        &agent_config_text(broker.port, dir.path(), device, &dest, 0),
    );
    let mut agent = spawn_agent(&config, None);
    let seen = reports_until_final(&mut reports).await;
    assert_eq!(seen.last().map(|r| r.phase.clone()), Some(Phase::Ready));
    agent.start_kill().expect("kill -9");
    let _ = agent.wait().await;

    let data = dir.path().join("agent-data");
    let db = data.join("db");
    for name in ["conf", "db"] {
        std::fs::write(db.join(name), b"\xff\xfe not a sled file").expect("overwrite");
    }
    let _agent = spawn_agent(&config, None);
    let seen = reports_until_final(&mut reports).await;
    let last = seen.last().expect("a report");
    assert_eq!(last.action_id, "act-damaged-1");
    match &last.phase {
        Phase::Failed {
            reason,
            rolled_back: false,
        } => {
            assert!(reason.contains("could not be opened"), "{reason}");
            assert!(reason.contains("moved it to"), "{reason}");
            assert!(
                reason.ends_with(
                    "this action cannot be resumed: release counter 2 is not higher than installed 2"
                ),
                "{reason}"
            );
        }
        other => panic!("expected a failure naming the damage, got {other:?}"),
    }
    let aside = std::fs::read_dir(&data)
        .expect("list data dir")
        .filter_map(Result::ok)
        .any(|e| e.file_name().to_string_lossy().starts_with("db.corrupt-"));
    assert!(aside, "the damaged database is kept aside for inspection");
    assert_eq!(
        std::fs::read(&dest).expect("read"),
        bytes,
        "installed file kept"
    );
    let status = agent_cli(&["status"], &config).await;
    assert!(status.contains("last error: database"), "{status}");
}
