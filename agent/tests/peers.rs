//! The agent fetching from peers over a real mosquitto: the test plays the coordinator (signs an
//! `InstallWithPeers` whose manifest signs a block list, serves the artifact and the list by
//! digest) and two peers of the site, one serving corrupt blocks and one serving good ones, on
//! the peer topics. The agent must install the right bytes, refuse the bad peer's blocks, and
//! report its bytes by source with the final report.
//!
//! Skipped with a notice when `mosquitto` is not installed.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::{
    block, key, next_publish, now, release, run_agent, send_block, set_desired, sign_action,
    start_broker, TIMEOUT,
};
use flotilla_agent::Config;
use flotilla_protocol::blocks::{BlockIndexRef, BlockList};
use flotilla_protocol::manifest::{Manifest, ManifestBlocks};
use flotilla_protocol::{
    device, envelope, ActionBody, ActionKind, BlockReply, BypassedPeer, ByteCounts, DeviceId,
    DeviceMessage, Digest, Message, PeerGrant, Phase, SignedBlob, Topic, Topics,
};
use tokio::sync::mpsc;

const BLOCK: u32 = 1024;

fn config(port: u16, dir: &Path, device: &str, dest: &Path, rate: u64) -> Config {
    let rest = format!(
        r#"
[[target]]
name = "app"
kind = "file"
path = "{dest}"
[download]
block_size = 1024
in_flight = 4
peer_timeout = "2s"
max_bytes_per_sec = {rate}
"#,
        dest = dest.display(),
    );
    common::config(port, dir, device, &rest)
}

/// An `InstallWithPeers` of `artifact`, whose manifest signs its block list, naming `peers`.
fn desired(device: &str, artifact: &[u8], list: &BlockList, peers: &[&str]) -> SignedBlob {
    let manifest = Manifest {
        release: release("app", 2, "app.bin", "app", artifact),
        blocks: Some(ManifestBlocks {
            artifacts: vec![BlockIndexRef {
                block_size: BLOCK,
                sha256: flotilla_protocol::sha256(list.as_bytes()),
            }],
        }),
        types: None,
    };
    let grant = PeerGrant {
        device_id: device.into(),
        action_id: "act-peers".into(),
        rollout_id: "r1".into(),
        sources: peers.iter().map(|p| (*p).to_owned()).collect(),
        digests: vec![flotilla_protocol::sha256(artifact)],
        expires_at: now() + 3600,
    };
    let body = ActionBody::InstallWithPeers {
        manifest: SignedBlob::sign(&key(1), manifest.encode()),
        kind: ActionKind::Forced,
        window: None,
        grant: SignedBlob::sign(&key(2), envelope::to_bytes(&grant)),
    };
    sign_action(device, "act-peers", body)
}

/// What the coordinator serves by digest: the artifact and its block list.
fn served(artifact: &[u8], list: &BlockList) -> HashMap<Digest, Vec<u8>> {
    HashMap::from([
        (flotilla_protocol::sha256(artifact), artifact.to_vec()),
        (
            flotilla_protocol::sha256(list.as_bytes()),
            list.as_bytes().to_vec(),
        ),
    ])
}

/// What the stand-ins saw: every final report with its bytes, and block requests by source.
#[derive(Debug)]
enum Seen {
    Final(Phase, Option<(ByteCounts, Vec<BypassedPeer>)>),
    Progress(u64),
    Asked(String),
}

/// Plays the coordinator (serving `files` by digest on the device's block topic) and the
/// peers (`good`: serves `files`; `bad`: flips a byte of every block), all on one client.
async fn stand_ins(
    port: u16,
    device: &str,
    desired: SignedBlob,
    files: HashMap<Digest, Vec<u8>>,
    good: &str,
    bad: &str,
) -> mpsc::Receiver<Seen> {
    let topics = Topics::default();
    let id = DeviceId::new(device).expect("id");
    let good_id = DeviceId::new(good).expect("id");
    let bad_id = DeviceId::new(bad).expect("id");
    let (client, mut eventloop) = common::client(
        port,
        &format!("stand-ins-{device}"),
        [
            topics.report(&id),
            topics.fetch(&id),
            topics.peer_fetch(&good_id),
            topics.peer_fetch(&bad_id),
        ],
    )
    .await;
    set_desired(&client, &id, desired).await;
    let (tx, rx) = mpsc::channel(10_000);
    tokio::spawn(async move {
        loop {
            let p = next_publish(&mut eventloop).await;
            let (request, reply_topic, source) =
                match (topics.parse(&p.topic), envelope::decode(&p.payload)) {
                    (Some(Topic::Report(_) | Topic::Fetch(_)), Ok(Message::Device(blob))) => {
                        match device::open_self_signed(&blob) {
                            Ok((_, DeviceMessage::Report(r))) if r.phase.is_terminal() => {
                                let _ = tx.send(Seen::Final(r.phase, None)).await;
                                continue;
                            }
                            Ok((_, DeviceMessage::Report(r))) => {
                                if let Phase::Downloading { done, .. } = r.phase {
                                    let _ = tx.send(Seen::Progress(done)).await;
                                }
                                continue;
                            }
                            Ok((
                                _,
                                DeviceMessage::ReportWithBytes {
                                    report,
                                    bytes,
                                    bypassed,
                                },
                            )) => {
                                let _ = tx
                                    .send(Seen::Final(report.phase, Some((bytes, bypassed))))
                                    .await;
                                continue;
                            }
                            Ok((_, DeviceMessage::Fetch { request, .. })) => {
                                (request, topics.block(&id), "coordinator".to_owned())
                            }
                            _ => continue,
                        }
                    }
                    (Some(Topic::PeerFetch(peer)), Ok(Message::PeerFetch(fetch))) => (
                        fetch.request,
                        topics.peer_block(&id, &peer),
                        peer.to_string(),
                    ),
                    _ => continue,
                };
            let _ = tx.send(Seen::Asked(source.clone())).await;
            let Some(file) = files.get(&request.sha256) else {
                continue;
            };
            let mut data = block(file, &request);
            if source == bad_id.as_str() {
                data[0] ^= 0xff;
            }
            let reply = BlockReply::Data {
                sha256: request.sha256,
                offset: request.offset,
                data,
            };
            send_block(&client, reply_topic, reply);
        }
    });
    rx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_come_from_the_good_peer_and_the_bad_peer_is_refused_per_block() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let dest = dir.path().join("app.bin");
    std::fs::write(&dest, b"old version").expect("write old");
    let device = "dev-peers";
    let artifact: Vec<u8> = (0..40 * BLOCK).map(|i| (i * 7 % 251) as u8).collect();
    let list = BlockList::compute(&artifact[..], BLOCK).expect("list");
    let mut seen = stand_ins(
        broker.port,
        device,
        desired(device, &artifact, &list, &["peer-bad", "peer-good"]),
        served(&artifact, &list),
        "peer-good",
        "peer-bad",
    )
    .await;
    let agent = run_agent(config(broker.port, dir.path(), device, &dest, 0));

    let mut asked: HashMap<String, usize> = HashMap::new();
    let last = tokio::time::timeout(TIMEOUT, async {
        while let Some(s) = seen.recv().await {
            match s {
                Seen::Asked(source) => *asked.entry(source).or_default() += 1,
                Seen::Final(phase, bytes) => return (phase, bytes),
                Seen::Progress(_) => {}
            }
        }
        panic!("the stand-ins stopped");
    })
    .await
    .expect("a final report within 30s");
    let _ = agent.stop().await;

    assert_eq!(std::fs::read(&dest).expect("read"), artifact, "right bytes");
    let (phase, bytes) = last;
    assert_eq!(
        phase,
        Phase::Applied,
        "installed (no health checks configured)"
    );
    let (bytes, bypassed) = bytes.expect("the final report carries bytes by source");
    assert_eq!(
        bypassed.iter().map(|b| b.peer.as_str()).collect::<Vec<_>>(),
        ["peer-bad"],
        "the final report names the bad peer: {bypassed:?}"
    );
    assert!(bypassed[0].reason.contains("hash"), "and why: {bypassed:?}");
    assert_eq!(
        bytes.peers,
        [("peer-good".to_owned(), artifact.len() as u64)],
        "every block from the good peer; asked: {asked:?}"
    );
    assert_eq!(
        bytes.coordinator,
        list.as_bytes().len() as u64,
        "only the block list came from the coordinator"
    );
    assert!(
        asked.get("peer-bad").copied().unwrap_or(0) <= 4,
        "the bad peer is bypassed after its first bad block: {asked:?}"
    );
}

/// An agent stopped half way through a block-indexed download keeps the blocks it has and the
/// bytes it counted: after the restart it asks only for the rest, and the final report's counts
/// add up to the artifact exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_download_keeps_its_blocks_and_its_byte_counts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let dest = dir.path().join("app.bin");
    let device = "dev-resume";
    let artifact: Vec<u8> = (0..60 * BLOCK).map(|i| (i * 11 % 239) as u8).collect();
    let blocks = artifact.len() / BLOCK as usize;
    let list = BlockList::compute(&artifact[..], BLOCK).expect("list");
    let mut seen = stand_ins(
        broker.port,
        device,
        desired(device, &artifact, &list, &["peer-good"]),
        served(&artifact, &list),
        "peer-good",
        "peer-bad",
    )
    .await;
    let mut asked = 0usize;
    // 20 KB/s: about three seconds for the artifact; stopped after a third of it.
    let agent = run_agent(config(broker.port, dir.path(), device, &dest, 20_000));
    tokio::time::timeout(TIMEOUT, async {
        while let Some(s) = seen.recv().await {
            match s {
                Seen::Asked(source) if source == "peer-good" => asked += 1,
                Seen::Progress(done) if done >= artifact.len() as u64 / 3 => return,
                Seen::Final(phase, _) => panic!("finished before it was stopped: {phase:?}"),
                _ => {}
            }
        }
    })
    .await
    .expect("a third downloaded within 30s");
    agent
        .stop()
        .await
        .expect("the agent stops")
        .expect("agent task")
        .expect("a clean stop");
    let before = asked;
    assert!(
        before < blocks,
        "stopped half way: {before} of {blocks} asked"
    );

    let agent = run_agent(config(broker.port, dir.path(), device, &dest, 0));
    let last = tokio::time::timeout(TIMEOUT, async {
        while let Some(s) = seen.recv().await {
            match s {
                Seen::Asked(source) if source == "peer-good" => asked += 1,
                Seen::Final(phase, bytes) => return (phase, bytes),
                _ => {}
            }
        }
        panic!("the stand-ins stopped");
    })
    .await
    .expect("a final report within 30s");
    let _ = agent.stop().await;

    assert_eq!(std::fs::read(&dest).expect("read"), artifact, "right bytes");
    assert_eq!(last.0, Phase::Applied);
    let (bytes, _) = last.1.expect("bytes by source");
    assert_eq!(
        bytes.peers,
        [("peer-good".to_owned(), artifact.len() as u64)],
        "counted once across the restart"
    );
    assert_eq!(bytes.coordinator, list.as_bytes().len() as u64);
    // Besides the blocks it lacked: those in flight at the stop, and those asked again when the
    // restarted agent's first connection came up (requests queued before it may be lost).
    let in_flight = 4;
    assert!(
        asked <= blocks + 2 * in_flight,
        "only the blocks it did not have were asked again: {asked} requests for {blocks} blocks \
         ({before} before the stop)"
    );
}
