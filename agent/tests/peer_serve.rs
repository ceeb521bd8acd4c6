//! A device serving its site's peers, end to end over a real mosquitto: an agent holding a
//! verified artifact answers `PeerFetch` requests with the right blocks on the requester's
//! `peer-block/{agent}` topic, and never answers a forged grant; and what it keeps to serve once
//! an action ends. Skipped with a notice when mosquitto is not installed.

mod common;

use std::path::Path;

use common::{
    coordinator, install, key, now, release, reports_until, run_agent, sign_action, start_broker,
    TIMEOUT,
};
use flotilla_agent::Config;
use flotilla_protocol::blocks::{block_range, BlockList, DEFAULT_BLOCK_SIZE};
use flotilla_protocol::{
    envelope, hex, ActionKind, BlockReply, BlockRequest, DeviceId, Message, PeerFetch, PeerGrant,
    SignedBlob, SigningKey, Topics,
};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use tokio::sync::mpsc;

const PEER: &str = "peer-serve-1";
const REQUESTER: &str = "peer-req-1";

fn config(port: u16, dir: &Path, peers: &str) -> Config {
    let rest = format!(
        r#"
[[target]]
name = "app"
kind = "file"
path = "{dest}"
[peers]
{peers}
"#,
        dest = dir.join("app.bin").display(),
    );
    common::config(port, dir, PEER, &rest)
}

fn grant(signer: &SigningKey, device: &str, digests: &[[u8; 32]]) -> SignedBlob {
    SignedBlob::sign(
        signer,
        envelope::to_bytes(&PeerGrant {
            device_id: device.into(),
            action_id: "act-1".into(),
            rollout_id: "r1".into(),
            sources: vec!["someone-else".into(), PEER.into()],
            digests: digests.to_vec(),
            expires_at: now() + 600,
        }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_serves_verified_blocks_to_the_granted_peer_and_ignores_forged_grants() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    // A verified download, as the fetcher leaves it: the artifact and its block list.
    let artifact: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let sha = hold(&dir.path().join("agent-data").join("downloads"), &artifact);
    let list = BlockList::compute(&artifact[..], DEFAULT_BLOCK_SIZE).expect("list");
    let list_sha = flotilla_protocol::sha256(list.as_bytes());

    let topics = Topics::default();
    let peer = DeviceId::new(PEER).expect("id");
    let mut options = MqttOptions::new(REQUESTER, "127.0.0.1", broker.port);
    options.set_max_packet_size(1 << 20, 1 << 20);
    let (client, eventloop) = AsyncClient::new(options, 64);
    // Every peer-block topic of every device, to see where replies go; and the agent's state,
    // to know when it listens.
    client
        .subscribe(
            format!("{}/devices/+/peer-block/+", topics.prefix()),
            QoS::AtLeastOnce,
        )
        .await
        .expect("subscribe");
    client
        .subscribe(topics.state(&peer), QoS::AtLeastOnce)
        .await
        .expect("subscribe");

    let mut received = receive(eventloop);

    let agent = run_agent(config(broker.port, dir.path(), "max_concurrent = 2"));

    tokio::time::timeout(TIMEOUT, async {
        loop {
            let (topic, payload) = next(&mut received).await;
            if topic == topics.state(&peer) && !payload.is_empty() {
                return;
            }
        }
    })
    .await
    .expect("the agent publishes its state within 30s");

    let ask = |grant: SignedBlob, sha256, offset, length| {
        envelope::encode(&Message::PeerFetch(PeerFetch {
            grant,
            request: BlockRequest {
                sha256,
                offset,
                length,
            },
        }))
    };
    let send = async |payload: Vec<u8>| {
        client
            .publish(topics.peer_fetch(&peer), QoS::AtLeastOnce, false, payload)
            .await
            .expect("publish");
    };
    // Junk first: garbage, another message kind, and a payload over the broker limit, none of
    // which may stop the agent from serving what follows.
    for i in 0..200u32 {
        send(i.to_le_bytes().repeat(i as usize % 50)).await;
    }
    send(envelope::encode(&Message::Block(BlockReply::Unavailable {
        sha256: sha,
        offset: 0,
        reason: "not a request".into(),
    })))
    .await;
    send(vec![7; flotilla_protocol::BROKER_PACKET_LIMIT + 1]).await;
    // Then a forged grant (signed by a key the agent does not trust) naming another device,
    // then one of ours for an unheld digest, then every block and the block list, each sent once
    // the reply to the one before arrived, so replies come in order.
    let forged = grant(&key(99), "attacker", &[sha]);
    send(ask(forged, sha, 0, DEFAULT_BLOCK_SIZE)).await;
    let good = grant(&key(2), REQUESTER, &[sha, list_sha, [5; 32]]);
    let mut requests = vec![ask(good.clone(), [5; 32], 0, DEFAULT_BLOCK_SIZE)];
    let blocks = list.len();
    for i in 0..blocks {
        let (offset, length) = block_range(i, artifact.len() as u64, DEFAULT_BLOCK_SIZE);
        requests.push(ask(good.clone(), sha, offset, length));
    }
    requests.push(ask(good, list_sha, 0, DEFAULT_BLOCK_SIZE));

    let mut replies = Vec::new();
    for request in requests {
        send(request).await;
        let reply = tokio::time::timeout(TIMEOUT, async {
            loop {
                let (topic, payload) = next(&mut received).await;
                if topic.contains("/peer-block/") {
                    return (topic, payload);
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no reply within 30s after {} replies", replies.len()));
        replies.push(reply);
    }

    let expected_topic = topics.peer_block(&DeviceId::new(REQUESTER).expect("id"), &peer);
    let mut decoded = Vec::new();
    for (topic, payload) in &replies {
        assert_eq!(
            topic, &expected_topic,
            "every reply goes to the granted device, from this peer"
        );
        match envelope::decode(payload).expect("a reply decodes") {
            Message::Block(reply) => decoded.push(reply),
            other => panic!("unexpected {}", other.name()),
        }
    }
    // The forged request got nothing, so the first reply is the refusal of the unheld digest.
    match &decoded[0] {
        BlockReply::Unavailable { sha256, reason, .. } => {
            assert_eq!(sha256, &[5; 32]);
            assert!(reason.contains("does not hold"), "{reason}");
        }
        other => panic!("expected a refusal first, got {other:?}"),
    }
    for i in 0..blocks {
        let (offset, length) = block_range(i, artifact.len() as u64, DEFAULT_BLOCK_SIZE);
        let want = &artifact[offset as usize..(offset + u64::from(length)) as usize];
        match &decoded[1 + i as usize] {
            BlockReply::Data {
                sha256,
                offset: at,
                data,
            } => {
                assert_eq!((sha256, *at), (&sha, offset));
                assert_eq!(data.as_slice(), want, "block {i} has the artifact's bytes");
            }
            other => panic!("block {i} not served: {other:?}"),
        }
    }
    match decoded.last() {
        Some(BlockReply::Data { sha256, data, .. }) => {
            assert_eq!(sha256, &list_sha);
            assert_eq!(data.as_slice(), list.as_bytes(), "the block list is served");
        }
        other => panic!("block list not served: {other:?}"),
    }

    let result = agent
        .stop()
        .await
        .expect("agent stops within 30s")
        .expect("agent task");
    assert!(result.is_ok(), "agent ended with {result:?}");
}

/// Polls the requester's event loop in a task of its own, handing on every publish received.
fn receive(mut eventloop: rumqttc::EventLoop) -> mpsc::UnboundedReceiver<(String, Vec<u8>)> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            match eventloop.poll().await {
                Ok(Event::Incoming(Packet::Publish(p))) => {
                    if tx.send((p.topic, p.payload.to_vec())).is_err() {
                        return;
                    }
                }
                Ok(_) => {}
                Err(e) => panic!("requester lost the broker: {e}"),
            }
        }
    });
    rx
}

/// The next publish the requester receives.
async fn next(received: &mut mpsc::UnboundedReceiver<(String, Vec<u8>)>) -> (String, Vec<u8>) {
    received
        .recv()
        .await
        .expect("the requester's event loop runs")
}

/// Writes a verified pair (artifact and block list) into `downloads` as the fetcher leaves it.
fn hold(downloads: &Path, artifact: &[u8]) -> [u8; 32] {
    std::fs::create_dir_all(downloads).expect("downloads");
    let sha = flotilla_protocol::sha256(artifact);
    let list = BlockList::compute(artifact, DEFAULT_BLOCK_SIZE).expect("list");
    std::fs::write(downloads.join(hex::encode(&sha)), artifact).expect("artifact");
    std::fs::write(
        downloads.join(format!("{}.blocks", hex::encode(&sha))),
        list.as_bytes(),
    )
    .expect("list");
    sha
}

/// When an action ends, its download is kept to serve and older verified downloads beyond
/// `keep_bytes` are removed, list and all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_action_keeps_its_download_and_removes_older_ones_beyond_the_bound() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let downloads = dir.path().join("agent-data").join("downloads");
    let old: Vec<u8> = (0..20_000u32).map(|i| (i % 241) as u8).collect();
    let old_sha = hold(&downloads, &old);
    let an_hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    for name in [
        hex::encode(&old_sha),
        format!("{}.blocks", hex::encode(&old_sha)),
    ] {
        std::fs::File::options()
            .write(true)
            .open(downloads.join(name))
            .and_then(|f| f.set_modified(an_hour_ago))
            .expect("age the old download");
    }
    let new: Vec<u8> = (0..10_500u32).map(|i| (i % 253) as u8).collect();
    let new_sha = flotilla_protocol::sha256(&new);
    // A forced install of the new artifact, signed by the test release and coordinator keys.
    let manifest = release("app", 2, "app.bin", "app", &new);
    let desired = sign_action(PEER, "act-keep-1", install(&manifest, ActionKind::Forced));
    let mut reports = coordinator(broker.port, PEER, desired, new.clone()).await;

    let agent = run_agent(config(broker.port, dir.path(), "keep_bytes = 15000"));
    let seen = reports_until(&mut reports, "final", |r| r.phase.is_terminal()).await;
    let last = seen
        .last()
        .map(|r| r.phase.clone())
        .expect("a final report within 30s");
    assert_eq!(last.name(), "applied", "the install succeeded");
    let old_path = downloads.join(hex::encode(&old_sha));
    tokio::time::timeout(TIMEOUT, async {
        while old_path.exists() {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the older download is removed once the action ends");
    assert!(
        !downloads
            .join(format!("{}.blocks", hex::encode(&old_sha)))
            .exists(),
        "its block list goes with it"
    );
    assert_eq!(
        std::fs::read(downloads.join(hex::encode(&new_sha))).expect("kept"),
        new,
        "the finished action's verified download is kept"
    );

    let result = agent
        .stop()
        .await
        .expect("agent stops within 30s")
        .expect("agent task");
    assert!(result.is_ok(), "agent ended with {result:?}");
}
