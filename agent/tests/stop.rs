//! Stopping a real agent process, and what a stop or a cancel leaves behind: SIGTERM ends the
//! agent within seconds however long its broker has been gone, and what it could not report then
//! goes out after the restart; a download stopped by a signed cancel leaves no partial file.
//!
//! Skipped with a notice when `mosquitto` is not installed (a failure in CI).

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::{
    config_text, coordinator, key, now, release, reports_until, restart_broker, set_desired,
    sign_action, start_broker, TIMEOUT,
};
use flotilla_protocol::{
    envelope, ActionBody, ActionKind, DesiredAction, DeviceId, Message, Phase, Report, SignedBlob,
    Topics,
};
use tokio::io::AsyncBufReadExt as _;
use tokio::sync::mpsc;

/// An agent config with a file target at `dest`, blocks of 1,000 bytes and `in_flight` of them
/// asked for at a time.
fn agent_config(port: u16, dir: &Path, device: &str, dest: &Path, in_flight: usize) -> String {
    let rest = format!(
        r#"
[[target]]
name = "app"
kind = "file"
path = "{dest}"
[download]
block_size = 1000
in_flight = {in_flight}
"#,
        dest = dest.display(),
    );
    config_text(port, dir, device, &rest)
}

fn artifact() -> Vec<u8> {
    (0..200_000u32).map(|i| (i % 251) as u8).collect()
}

fn install(bytes: &[u8], kind: ActionKind) -> ActionBody {
    common::install(&release("app", 2, "app.bin", "app", bytes), kind)
}

/// The agent binary with `config`, logging the streaming fetcher's debug lines to a pipe.
fn spawn_agent(config: &Path) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla-agent"))
        .args(["run", "--config"])
        .arg(config)
        .env_remove(flotilla_agent::fault::FAULT_VAR)
        .env("RUST_LOG", "info,flotilla_agent::fetch=debug")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start agent")
}

/// The agent's stderr, line by line, on a channel (kept reading so the agent never blocks on a
/// full pipe).
fn log_lines(agent: &mut tokio::process::Child) -> mpsc::UnboundedReceiver<String> {
    let stderr = agent.stderr.take().expect("stderr is piped");
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let _ = tx.send(line);
        }
    });
    rx
}

/// Runs the agent binary with `args` and `--config`; panics with its stderr if it fails.
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

/// Sends SIGTERM to `agent` and waits up to `within` for it to exit; its exit status, or `None`
/// if it was still running (it is then killed).
async fn sigterm(
    agent: &mut tokio::process::Child,
    within: Duration,
) -> Option<std::process::ExitStatus> {
    let pid = agent.id().expect("the agent runs").to_string();
    let sent = tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .expect("run kill");
    assert!(sent.success(), "kill -TERM {pid}");
    match tokio::time::timeout(within, agent.wait()).await {
        Ok(status) => Some(status.expect("wait for the agent")),
        Err(_) => {
            let _ = agent.kill().await;
            None
        }
    }
}

/// issue 19, item 11: agents that had been mid-download (at 0 bytes) with their broker gone for
/// long logged "signal received, shutting down" and went on retrying the broker until SIGKILL.
/// Their block requests, asked again every 10 s, had filled the link's queues (nothing drains
/// the MQTT client's request queue without a connection), the fetcher then waited for room
/// without looking at its stop token, and shutdown waited for the fetcher.
///
/// Here the broker is killed while a soft action waits for consent; consent is then given on
/// the device, so the download starts at 0 bytes and its first report cannot go out. Once the
/// fetcher has asked for its 64 blocks again three times (more than the old queues held), SIGTERM
/// must end the agent; after a restart with the broker back, the report it could not send goes
/// out and the install finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_an_agent_whose_broker_is_long_gone_mid_download() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(mut broker) = start_broker(dir.path()).await else {
        return;
    };
    let port = broker.port;
    let dest = dir.path().join("app.bin");
    std::fs::write(&dest, b"old version").expect("write old");
    let device = "dev-stop";
    let bytes = artifact();
    let desired = sign_action(device, "act-stop-1", install(&bytes, ActionKind::Soft));
    let mut reports = coordinator(port, device, desired.clone(), bytes.clone()).await;
    let config = dir.path().join("agent.toml");
    std::fs::write(&config, agent_config(port, dir.path(), device, &dest, 64))
        .expect("write config");
    let mut agent = spawn_agent(&config);
    let mut log = log_lines(&mut agent);

    let seen = reports_until(&mut reports, "waiting", |r| {
        matches!(r.phase, Phase::Waiting { .. })
    })
    .await;
    let waiting_seq = seen.last().map(|r| r.seq).expect("a waiting report");
    broker.kill().await;
    agent_cli(&["consent"], &config).await;

    // Each line is one more round of 64 block requests with nowhere to go.
    let rounds = tokio::time::timeout(Duration::from_secs(90), async {
        let mut rounds = 0;
        while let Some(line) = log.recv().await {
            if line.contains("asking for outstanding blocks again") {
                rounds += 1;
                if rounds == 3 {
                    break;
                }
            }
        }
        rounds
    })
    .await
    .expect("the fetcher did not ask for its blocks again three times within 90 s");
    assert_eq!(rounds, 3, "the agent's log ended");

    let status = sigterm(&mut agent, Duration::from_secs(15)).await;
    let status = status.expect("the agent did not stop within 15 s of SIGTERM");
    assert!(status.success(), "the agent's exit: {status}");

    // The broker is back (empty, as after a crash) and so is the coordinator.
    let _broker = restart_broker(dir.path(), port).await;
    let mut reports = coordinator(port, device, desired, bytes.clone()).await;
    let _agent = spawn_agent(&config);
    let seen: Vec<Report> = reports_until(&mut reports, "final", |r| r.phase.is_terminal()).await;
    assert!(
        seen.iter()
            .any(|r| r.seq == waiting_seq + 1
                && matches!(r.phase, Phase::Downloading { done: 0, .. })),
        "the report made while the broker was gone (seq {}) never arrived: {seen:#?}",
        waiting_seq + 1
    );
    // No health checks configured: installed, not known to be healthy.
    assert_eq!(
        seen.last().map(|r| r.phase.clone()),
        Some(Phase::Applied),
        "reports: {seen:#?}"
    );
    assert_eq!(std::fs::read(&dest).expect("read target"), bytes);
}

/// The signed cancel for `action_id`, as `rollout stop` publishes it.
fn cancel(device: &str, action_id: &str) -> SignedBlob {
    let action = DesiredAction {
        action_id: format!("{action_id}:cancel"),
        device_id: device.into(),
        rollout_id: "r1".into(),
        issued_at: now(),
        expires_at: now() + 3600,
        body: ActionBody::Cancel {
            action_id: action_id.into(),
        },
    };
    SignedBlob::sign(&key(2), envelope::to_bytes(&action))
}

/// The files in `dir` whose names end in `.part`.
fn part_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|name| name.ends_with(".part"))
                .collect()
        })
        .unwrap_or_default()
}

/// issue 19, item 12: a download stopped by the coordinator's signed cancel (what `rollout
/// stop` sends) left its 0-byte `.part` in the agent's data directory for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canceled_download_leaves_no_partial_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let dest = dir.path().join("app.bin");
    std::fs::write(&dest, b"old version").expect("write old");
    let device = "dev-cancel";
    let id = DeviceId::new(device).expect("device id");
    let topics = Topics::default();
    // A coordinator that sends the install and never serves a block: the download stays at 0.
    let (client, mut eventloop) = common::client(
        broker.port,
        "test-coordinator-dev-cancel",
        [topics.report(&id)],
    )
    .await;
    let (tx, mut reports) = mpsc::channel(1000);
    tokio::spawn(async move {
        loop {
            let p = common::next_publish(&mut eventloop).await;
            if let Ok(Message::Report(r)) =
                envelope::decode(&p.payload).map(flotilla_protocol::device::plain)
            {
                let _ = tx.send(r).await;
            }
        }
    });
    let bytes = artifact();
    set_desired(
        &client,
        &id,
        sign_action(device, "act-cancel-1", install(&bytes, ActionKind::Forced)),
    )
    .await;
    let config = dir.path().join("agent.toml");
    std::fs::write(
        &config,
        agent_config(broker.port, dir.path(), device, &dest, 4),
    )
    .expect("write config");
    let _agent = spawn_agent(&config);

    reports_until(&mut reports, "downloading", |r| {
        matches!(r.phase, Phase::Downloading { .. })
    })
    .await;
    let downloads = dir.path().join("agent-data").join("downloads");
    tokio::time::timeout(TIMEOUT, async {
        while part_files(&downloads).is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the download did not start a .part file within 30 s");

    set_desired(&client, &id, cancel(device, "act-cancel-1")).await;
    let seen = reports_until(&mut reports, "canceled", |r| r.phase.is_terminal()).await;
    assert_eq!(
        seen.last().map(|r| r.phase.clone()),
        Some(Phase::Canceled),
        "reports: {seen:#?}"
    );
    assert_eq!(
        part_files(&downloads),
        Vec::<String>::new(),
        "partial downloads left in {}",
        downloads.display()
    );
    assert_eq!(std::fs::read(&dest).expect("read"), b"old version");
}
