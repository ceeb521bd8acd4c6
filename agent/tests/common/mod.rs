//! What the agent's broker tests share: a real mosquitto on a free port, the fixed test keys and
//! the clock, agent configs and signed releases, the agent run in this process, and the pieces
//! of a stand-in coordinator (a client, its poll loop, block replies). Each test file uses part
//! of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flotilla_agent::{AgentError, Config};
use flotilla_protocol::{
    envelope, hex, ActionBody, ActionKind, Artifact, BlockReply, BlockRequest, DesiredAction,
    DeviceId, DeviceState, Message, ReleaseManifest, Report, SignedBlob, SigningKey, Topics,
};
use rumqttc::{AsyncClient, Event, EventLoop, MqttOptions, Packet, Publish, QoS};
use tokio::sync::mpsc;
use tokio::task::{JoinError, JoinHandle};
use tokio::time::error::Elapsed;
use tokio_util::sync::CancellationToken;

pub const TIMEOUT: Duration = Duration::from_secs(30);

/// The test key with every byte `seed`.
pub fn key(seed: u8) -> SigningKey {
    SigningKey::from_bytes(&[seed; 32])
}

pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Starts mosquitto on a free port, or `None` (with a notice) when it is not installed.
pub fn find_mosquitto() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/local/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join("mosquitto"))
        .find(|p| p.is_file())
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

pub struct Broker {
    child: tokio::process::Child,
    pub port: u16,
}

impl Broker {
    /// Kills the broker (SIGKILL) and waits for it to exit: its clients lose their connections
    /// at once, and its port is free again.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}

pub async fn start_broker(dir: &Path) -> Option<Broker> {
    let bin = mosquitto_or_notice()?;
    // Another test may take the probed port before mosquitto binds it; then try another.
    for _ in 0..5 {
        if let Some(broker) = spawn_broker(&bin, dir, free_port()).await {
            return Some(broker);
        }
    }
    panic!("mosquitto could not bind a free port in five tries");
}

/// Starts mosquitto again on `port` (after [`Broker::kill`]): a broker that comes back, with no
/// retained messages and no sessions.
pub async fn restart_broker(dir: &Path, port: u16) -> Broker {
    let bin = find_mosquitto().expect("mosquitto ran before");
    spawn_broker(&bin, dir, port)
        .await
        .unwrap_or_else(|| panic!("mosquitto could not bind port {port} again"))
}

/// The mosquitto binary, or `None` with a notice when it is not installed (a failure where CI
/// asks for every tool).
fn mosquitto_or_notice() -> Option<PathBuf> {
    let Some(bin) = find_mosquitto() else {
        let notice = "SKIPPED: mosquitto not found on PATH or in /usr/sbin";
        // CI installs Mosquitto: there a missing one is a failure.
        if std::env::var("FLOTILLA_REQUIRE_TOOLS").is_ok_and(|v| v == "1") {
            panic!("{notice} (FLOTILLA_REQUIRE_TOOLS=1)");
        }
        // Straight to stderr: the test harness hides eprintln! of a passing test.
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), "\n!!!! {notice}");
        return None;
    };
    Some(bin)
}

/// Runs mosquitto on `port`; `None` if it exited instead of listening (the port was taken).
async fn spawn_broker(bin: &Path, dir: &Path, port: u16) -> Option<Broker> {
    let conf = dir.join("mosquitto.conf");
    std::fs::write(
        &conf,
        format!("listener {port} 127.0.0.1\nallow_anonymous true\n"),
    )
    .expect("write conf");
    let mut child = tokio::process::Command::new(bin)
        .arg("-c")
        .arg(&conf)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start mosquitto");
    let listening = tokio::time::timeout(TIMEOUT, async {
        loop {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return false;
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
                return matches!(child.try_wait(), Ok(None));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("mosquitto did not start listening within 30s");
    listening.then_some(Broker { child, port })
}

/// The text of an agent config for `device` on the broker at `port`, keeping its data in
/// `dir/agent-data` and trusting test key 1 for releases and test key 2 for the coordinator;
/// `rest` adds the targets and whatever other tables the test needs.
pub fn config_text(port: u16, dir: &Path, device: &str, rest: &str) -> String {
    format!(
        r#"
device_id = "{device}"
hardware_id = "pi4"
data_dir = "{data}"
[broker]
host = "127.0.0.1"
port = {port}
keep_alive = "5s"
[trust]
release_keys = ["{rk}"]
coordinator_keys = ["{ck}"]
{rest}"#,
        data = dir.join("agent-data").display(),
        rk = hex::encode(key(1).verifying_key().as_bytes()),
        ck = hex::encode(key(2).verifying_key().as_bytes()),
    )
}

/// [`config_text`], validated.
pub fn config(port: u16, dir: &Path, device: &str, rest: &str) -> Config {
    Config::from_toml(&config_text(port, dir, device, rest)).expect("test config is valid")
}

/// Release `{name}-{counter}` (version `{counter}.0`) for pi4 devices, valid for an hour: one
/// artifact, `file`, holding `bytes` for the target `target`.
pub fn release(
    name: &str,
    counter: u64,
    file: &str,
    target: &str,
    bytes: &[u8],
) -> ReleaseManifest {
    ReleaseManifest {
        name: format!("{name}-{counter}"),
        version: format!("{counter}.0"),
        counter,
        hardware: vec!["pi4".into()],
        artifacts: vec![Artifact {
            name: file.into(),
            target: target.into(),
            size: bytes.len() as u64,
            sha256: flotilla_protocol::sha256(bytes),
        }],
        created_at: now(),
        expires_at: now() + 3600,
    }
}

/// An install of `release`, its manifest signed by the release key (test key 1).
pub fn install(release: &ReleaseManifest, kind: ActionKind) -> ActionBody {
    ActionBody::Install {
        manifest: SignedBlob::sign(&key(1), envelope::to_bytes(release)),
        kind,
        window: None,
    }
}

/// The desired action `action_id` for `device` in rollout `r1`, valid for an hour, signed by
/// the coordinator key (test key 2).
pub fn sign_action(device: &str, action_id: &str, body: ActionBody) -> SignedBlob {
    let action = DesiredAction {
        action_id: action_id.into(),
        device_id: device.into(),
        rollout_id: "r1".into(),
        issued_at: now(),
        expires_at: now() + 3600,
        body,
    };
    SignedBlob::sign(&key(2), envelope::to_bytes(&action))
}

/// An agent run in this process by [`flotilla_agent::run`].
pub struct Agent {
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), AgentError>>,
}

/// Runs the agent with `config` in a task of this process.
pub fn run_agent(config: Config) -> Agent {
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(flotilla_agent::run(config, shutdown.clone()));
    Agent { shutdown, task }
}

impl Agent {
    /// Cancels the agent's shutdown token and waits for its task, for [`TIMEOUT`] at most.
    pub async fn stop(self) -> Result<Result<Result<(), AgentError>, JoinError>, Elapsed> {
        self.shutdown.cancel();
        tokio::time::timeout(TIMEOUT, self.task).await
    }
}

/// Collects reports until `done` says stop; returns them all.
pub async fn reports_until(
    rx: &mut mpsc::Receiver<Report>,
    what: &str,
    done: impl Fn(&Report) -> bool,
) -> Vec<Report> {
    let mut seen = Vec::new();
    let result = tokio::time::timeout(TIMEOUT, async {
        while let Some(r) = rx.recv().await {
            let stop = done(&r);
            seen.push(r);
            if stop {
                return;
            }
        }
    })
    .await;
    assert!(
        result.is_ok(),
        "no {what} report within 30s; reports so far: {seen:#?}"
    );
    seen
}

/// A client named `name` of the broker at `port`, for packets as large as the protocol's,
/// subscribed to `topics`.
pub async fn client(
    port: u16,
    name: &str,
    topics: impl IntoIterator<Item = String>,
) -> (AsyncClient, EventLoop) {
    let mut options = MqttOptions::new(name, "127.0.0.1", port);
    options.set_max_packet_size(
        flotilla_protocol::MAX_PACKET_SIZE,
        flotilla_protocol::MAX_PACKET_SIZE,
    );
    let (client, eventloop) = AsyncClient::new(options, 100);
    for topic in topics {
        client
            .subscribe(topic, QoS::AtLeastOnce)
            .await
            .expect("subscribe");
    }
    (client, eventloop)
}

/// Publishes `desired` retained for `device`, as the coordinator does.
pub async fn set_desired(client: &AsyncClient, device: &DeviceId, desired: SignedBlob) {
    client
        .publish(
            Topics::default().desired(device),
            QoS::AtLeastOnce,
            true,
            envelope::encode(&Message::Desired(desired)),
        )
        .await
        .expect("publish desired");
}

/// The next publish the client receives; a lost connection is waited out (rumqttc reconnects).
pub async fn next_publish(eventloop: &mut EventLoop) -> Publish {
    loop {
        match eventloop.poll().await {
            Ok(Event::Incoming(Packet::Publish(p))) => return p,
            Ok(_) => {}
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Publishes `reply` on `topic` from a task of its own: a stand-in never waits on its client
/// inside its poll loop.
pub fn send_block(client: &AsyncClient, topic: String, reply: BlockReply) {
    let client = client.clone();
    tokio::spawn(async move {
        let _ = client
            .publish(
                topic,
                QoS::AtLeastOnce,
                false,
                envelope::encode(&Message::Block(reply)),
            )
            .await;
    });
}

/// The bytes of `data` that `request` asks for, cut short at its end.
pub fn block(data: &[u8], request: &BlockRequest) -> Vec<u8> {
    let start = (request.offset as usize).min(data.len());
    let end = (start + request.length as usize).min(data.len());
    data[start..end].to_vec()
}

/// Plays the coordinator for one device: publishes `desired` retained, serves `served` as the
/// artifact, and forwards the agent's reports.
pub async fn coordinator(
    port: u16,
    device: &str,
    desired: SignedBlob,
    served: Vec<u8>,
) -> mpsc::Receiver<Report> {
    coordinator_with(
        port,
        device,
        desired,
        served,
        Arc::new(Mutex::new(Vec::new())),
        None,
    )
    .await
}

/// Like [`coordinator`], also recording every requested offset in `asked` and forwarding
/// device states to `states`.
pub async fn coordinator_with(
    port: u16,
    device: &str,
    desired: SignedBlob,
    served: Vec<u8>,
    asked: Arc<Mutex<Vec<u64>>>,
    states: Option<mpsc::Sender<DeviceState>>,
) -> mpsc::Receiver<Report> {
    stand_in(port, device, desired, served, asked, states, false).await
}

/// Like [`coordinator`], but the first answer to every block is a bad one, as a client on the
/// broker would send: `Unavailable` for even blocks, an empty block for odd ones. Records every
/// requested offset in `asked`.
pub async fn coordinator_bad_first(
    port: u16,
    device: &str,
    desired: SignedBlob,
    served: Vec<u8>,
    asked: Arc<Mutex<Vec<u64>>>,
) -> mpsc::Receiver<Report> {
    stand_in(port, device, desired, served, asked, None, true).await
}

async fn stand_in(
    port: u16,
    device: &str,
    desired: SignedBlob,
    served: Vec<u8>,
    asked: Arc<Mutex<Vec<u64>>>,
    states: Option<mpsc::Sender<DeviceState>>,
    bad_first: bool,
) -> mpsc::Receiver<Report> {
    let topics = Topics::default();
    let id = DeviceId::new(device).expect("device id");
    // A client id of its own per stand-in: one started after a broker restart must not take
    // turns with the first, which reconnects under its id.
    static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (client, mut eventloop) = client(
        port,
        &format!("test-coordinator-{device}-{n}"),
        [topics.report(&id), topics.fetch(&id), topics.state(&id)],
    )
    .await;
    set_desired(&client, &id, desired).await;
    let (tx, rx) = mpsc::channel(1000);
    let block_topic = topics.block(&id);
    tokio::spawn(async move {
        loop {
            let p = next_publish(&mut eventloop).await;
            match envelope::decode(&p.payload).map(flotilla_protocol::device::plain) {
                Ok(Message::Report(r)) => {
                    let _ = tx.send(r).await;
                }
                Ok(Message::State(state)) => {
                    if let Some(states) = &states {
                        let _ = states.try_send(state);
                    }
                }
                Ok(Message::Fetch(req)) => {
                    let first = asked.lock().is_ok_and(|mut a| {
                        let first = !a.contains(&req.offset);
                        a.push(req.offset);
                        first
                    });
                    let block_no = req.offset / u64::from(req.length.max(1));
                    let reply = match (bad_first && first, block_no % 2) {
                        (true, 0) => BlockReply::Unavailable {
                            sha256: req.sha256,
                            offset: req.offset,
                            reason: "forged".into(),
                        },
                        (true, _) => BlockReply::Data {
                            sha256: req.sha256,
                            offset: req.offset,
                            data: Vec::new(),
                        },
                        (false, _) => BlockReply::Data {
                            sha256: req.sha256,
                            offset: req.offset,
                            data: block(&served, &req),
                        },
                    };
                    send_block(&client, block_topic.clone(), reply);
                }
                _ => {}
            }
        }
    });
    rx
}
