//! What the agent's broker tests share: a real mosquitto on a free port, the fixed test keys and
//! the clock. Each test file uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flotilla_protocol::{
    envelope, BlockReply, DeviceId, DeviceState, Message, Report, SignedBlob, SigningKey, Topics,
};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use tokio::sync::mpsc;

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
    _child: tokio::process::Child,
    pub port: u16,
}

pub async fn start_broker(dir: &Path) -> Option<Broker> {
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
    // Another test may take the probed port before mosquitto binds it; then try another.
    for _ in 0..5 {
        let port = free_port();
        let conf = dir.join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!("listener {port} 127.0.0.1\nallow_anonymous true\n"),
        )
        .expect("write conf");
        let mut child = tokio::process::Command::new(&bin)
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
        if listening {
            return Some(Broker {
                _child: child,
                port,
            });
        }
    }
    panic!("mosquitto could not bind a free port in five tries");
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
    let mut options = MqttOptions::new(format!("test-coordinator-{device}"), "127.0.0.1", port);
    options.set_max_packet_size(
        flotilla_protocol::MAX_PACKET_SIZE,
        flotilla_protocol::MAX_PACKET_SIZE,
    );
    let (client, mut eventloop) = AsyncClient::new(options, 100);
    client
        .subscribe(topics.report(&id), QoS::AtLeastOnce)
        .await
        .expect("subscribe");
    client
        .subscribe(topics.fetch(&id), QoS::AtLeastOnce)
        .await
        .expect("subscribe");
    client
        .subscribe(topics.state(&id), QoS::AtLeastOnce)
        .await
        .expect("subscribe");
    client
        .publish(
            topics.desired(&id),
            QoS::AtLeastOnce,
            true,
            envelope::encode(&Message::Desired(desired)),
        )
        .await
        .expect("publish desired");
    let (tx, rx) = mpsc::channel(1000);
    let block_topic = topics.block(&id);
    tokio::spawn(async move {
        loop {
            let event = match eventloop.poll().await {
                Ok(e) => e,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Event::Incoming(Packet::Publish(p)) = event else {
                continue;
            };
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
                    let start = (req.offset as usize).min(served.len());
                    let end = (start + req.length as usize).min(served.len());
                    let block = req.offset / u64::from(req.length.max(1));
                    let reply = match (bad_first && first, block % 2) {
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
                            data: served[start..end].to_vec(),
                        },
                    };
                    let c = client.clone();
                    let topic = block_topic.clone();
                    // Publishing from a separate task: never wait on the client inside the poll loop.
                    tokio::spawn(async move {
                        let _ = c
                            .publish(
                                topic,
                                QoS::AtLeastOnce,
                                false,
                                envelope::encode(&Message::Block(reply)),
                            )
                            .await;
                    });
                }
                _ => {}
            }
        }
    });
    rx
}
