//! One agent's download, measured from outside (`bench/download.sh`), and its broker-only
//! baseline.
//!
//! - [`stream`]: the baseline. The same bytes through the same broker as the artifact server
//!   sends them: `Message::Block(BlockReply::Data)` messages of one block each, QoS 1, from one
//!   publisher connection to one subscriber connection; timed from the first publish to the
//!   last block received. No requests, no signatures, no files: what the broker alone costs.
//! - [`watch`]: watches one real device's desired and report topics (never its block topic,
//!   which would double what the broker sends) and times, by when each message arrives here:
//!   the live desired action, the first `Downloading` report, `Verified` (every artifact
//!   downloaded and its sha256 checked) and the action's end (`Ready`, or whatever ended it).
//!   Reports count only if they verify against the device's key.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use flotilla_protocol::{
    device, envelope, BlockReply, DeviceId, DeviceMessage, Message, Phase, Topics, VerifyingKey,
};
use rumqttc::QoS;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::link::{self, LinkEvent};

/// QoS 1 publishes in flight on each connection: rumqttc's default, as the coordinator runs.
const INFLIGHT: u16 = 100;

/// What the baseline moved and how long it took.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamFigures {
    /// Block data bytes received by the subscriber.
    pub bytes: u64,
    pub messages: u64,
    /// The size of one full block's message on the wire (payload, envelope included).
    pub message_bytes: usize,
    pub seconds: f64,
}

impl std::fmt::Display for StreamFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "stream_bytes: {}", self.bytes)?;
        writeln!(f, "stream_messages: {}", self.messages)?;
        writeln!(f, "stream_message_bytes: {}", self.message_bytes)?;
        writeln!(f, "stream_s: {:.3}", self.seconds)?;
        writeln!(f, "stream_mb_s: {:.1}", mb_per_s(self.bytes, self.seconds))
    }
}

/// Megabytes (10^6 bytes) a second.
pub fn mb_per_s(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / 1e6 / seconds
    } else {
        0.0
    }
}

/// The block messages of a `bytes`-long artifact in `block`-sized pieces: (offset, length).
pub fn blocks(bytes: u64, block: u32) -> impl Iterator<Item = (u64, u32)> {
    let block = u64::from(block.max(1));
    (0..bytes.div_ceil(block)).map(move |i| {
        let offset = i * block;
        // At most `block`, which is a u32.
        (offset, (bytes - offset).min(block) as u32)
    })
}

/// The artifact server's reply for one block: what the baseline publishes.
pub fn block_message(offset: u64, data: &[u8]) -> Vec<u8> {
    envelope::encode(&Message::Block(BlockReply::Data {
        sha256: [0x5a; 32],
        offset,
        data: data.to_vec(),
    }))
}

async fn connected(
    events: &mut mpsc::UnboundedReceiver<LinkEvent>,
    what: &str,
) -> anyhow::Result<()> {
    loop {
        match events.recv().await {
            Some(LinkEvent::Connected) => return Ok(()),
            Some(LinkEvent::Lost(reason)) => anyhow::bail!("{what}: cannot connect: {reason}"),
            Some(_) => {}
            None => anyhow::bail!("{what}: the link stopped"),
        }
    }
}

async fn subscribed(
    events: &mut mpsc::UnboundedReceiver<LinkEvent>,
    what: &str,
) -> anyhow::Result<()> {
    loop {
        match events.recv().await {
            Some(LinkEvent::Subscribed) => return Ok(()),
            Some(LinkEvent::Lost(reason)) => anyhow::bail!("{what}: connection lost: {reason}"),
            Some(_) => {}
            None => anyhow::bail!("{what}: the link stopped"),
        }
    }
}

/// The broker-only baseline: `bytes` of block data in `block`-sized block replies, QoS 1, one
/// publisher to one subscriber. Fails if the subscriber has not received every byte within
/// `timeout` or a connection drops.
pub async fn stream(
    connection: &flotilla_mqtt::Connection,
    topic_root: &str,
    bytes: u64,
    block: u32,
    timeout: Duration,
) -> anyhow::Result<StreamFigures> {
    let stop = CancellationToken::new();
    let _stop_links = stop.clone().drop_guard();
    let pid = std::process::id();
    let device = DeviceId::new(format!("stream-baseline-{pid}"))?;
    let topic = Topics::new(topic_root).block(&device);
    let (sub, mut sub_events, _) = link::start(
        connection,
        &format!("fleetsim-stream-sub-{pid}"),
        INFLIGHT,
        stop.clone(),
    );
    connected(&mut sub_events, "subscriber").await?;
    sub.subscribe(&topic, QoS::AtLeastOnce).await?;
    subscribed(&mut sub_events, "subscriber").await?;
    let (publisher, mut pub_events, _) = link::start(
        connection,
        &format!("fleetsim-stream-pub-{pid}"),
        INFLIGHT,
        stop.clone(),
    );
    connected(&mut pub_events, "publisher").await?;
    let data: Vec<u8> = (0..block).map(|i| (i % 251) as u8).collect();
    let message_bytes = block_message(0, &data).len();

    let started = Instant::now();
    let publishing = {
        let topic = topic.clone();
        tokio::spawn(async move {
            for (offset, length) in blocks(bytes, block) {
                // Encoded per block, as the artifact server does.
                let payload = block_message(offset, &data[..length as usize]);
                publisher
                    .publish(topic.clone(), QoS::AtLeastOnce, false, payload)
                    .await?;
            }
            anyhow::Ok(())
        })
    };
    let mut received = 0u64;
    let mut messages = 0u64;
    let receiving = tokio::time::timeout(timeout, async {
        while received < bytes {
            match sub_events.recv().await {
                Some(LinkEvent::Publish {
                    topic: t, payload, ..
                }) if t == topic => {
                    if let Ok(Message::Block(BlockReply::Data { data, .. })) =
                        envelope::decode(&payload)
                    {
                        received += data.len() as u64;
                        messages += 1;
                    }
                }
                Some(LinkEvent::Lost(reason)) => {
                    anyhow::bail!("subscriber: connection lost after {received} bytes: {reason}")
                }
                Some(_) => {}
                None => anyhow::bail!("subscriber: the link stopped"),
            }
        }
        Ok(())
    })
    .await;
    let seconds = started.elapsed().as_secs_f64();
    match receiving {
        Ok(r) => r?,
        Err(_) => anyhow::bail!("{received} of {bytes} bytes received within {timeout:?}"),
    }
    publishing.await??;
    Ok(StreamFigures {
        bytes: received,
        messages,
        message_bytes,
        seconds,
    })
}

/// When each step of one device's action was seen, as Unix time in seconds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WatchFigures {
    /// The live (not retained) desired action.
    pub desired: Option<f64>,
    pub first_downloading: Option<f64>,
    pub verified: Option<f64>,
    /// The report that ended the action, and its phase.
    pub end: Option<f64>,
    pub end_phase: Option<String>,
    /// Bytes the device says it fetched from the coordinator (its final report).
    pub coordinator_bytes: Option<u64>,
    /// Bytes it says it fetched from HTTP(S) origins (its final report).
    pub http_bytes: Option<u64>,
}

impl WatchFigures {
    /// Takes one verified report seen at `at`; returns whether it ends the action.
    pub fn observe(&mut self, message: &DeviceMessage, at: f64) -> bool {
        let (report, bytes) = match message {
            DeviceMessage::Report(r) => (r, None),
            DeviceMessage::ReportWithBytes { report, bytes, .. } => (report, Some(bytes)),
            _ => return false,
        };
        if let Some(bytes) = bytes {
            self.coordinator_bytes = Some(bytes.coordinator);
            self.http_bytes = Some(
                bytes
                    .peers
                    .iter()
                    .filter(|(source, _)| source == flotilla_protocol::origin::HTTP_SOURCE)
                    .map(|(_, n)| n)
                    .sum(),
            );
        }
        match &report.phase {
            Phase::Downloading { .. } => {
                self.first_downloading.get_or_insert(at);
            }
            Phase::Verified => {
                self.verified.get_or_insert(at);
            }
            phase if phase.is_terminal() => {
                self.end = Some(at);
                self.end_phase = Some(phase_name(phase));
                return true;
            }
            _ => {}
        }
        false
    }

    /// Seconds from the desired action to `at`.
    fn since_desired(&self, at: Option<f64>) -> Option<f64> {
        Some(at? - self.desired?)
    }
}

fn phase_name(phase: &Phase) -> String {
    let debug = format!("{phase:?}");
    debug
        .split(|c: char| !c.is_alphanumeric())
        .next()
        .unwrap_or_default()
        .to_owned()
}

impl std::fmt::Display for WatchFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |v: Option<f64>| v.map_or("none".to_owned(), |v| format!("{v:.6}"));
        writeln!(f, "desired_unix: {}", show(self.desired))?;
        writeln!(
            f,
            "first_downloading_unix: {}",
            show(self.first_downloading)
        )?;
        writeln!(f, "verified_unix: {}", show(self.verified))?;
        writeln!(f, "end_unix: {}", show(self.end))?;
        writeln!(
            f,
            "desired_to_first_downloading_s: {}",
            show(self.since_desired(self.first_downloading))
        )?;
        writeln!(
            f,
            "desired_to_verified_s: {}",
            show(self.since_desired(self.verified))
        )?;
        writeln!(
            f,
            "desired_to_end_s: {}",
            show(self.since_desired(self.end))
        )?;
        writeln!(
            f,
            "end_phase: {}",
            self.end_phase.as_deref().unwrap_or("none")
        )?;
        let count = |b: Option<u64>| b.map_or("none".to_owned(), |b| b.to_string());
        writeln!(f, "coordinator_bytes: {}", count(self.coordinator_bytes))?;
        writeln!(f, "http_bytes: {}", count(self.http_bytes))
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Watches `device` until its action ends or `timeout` passes; says "watching" on stderr once
/// subscribed, so a script knows when to start the rollout. Returns what was seen either way.
pub async fn watch(
    connection: &flotilla_mqtt::Connection,
    topic_root: &str,
    device: &DeviceId,
    key: &VerifyingKey,
    timeout: Duration,
) -> anyhow::Result<WatchFigures> {
    let stop = CancellationToken::new();
    let _stop_link = stop.clone().drop_guard();
    let topics = Topics::new(topic_root);
    let (desired, report) = (topics.desired(device), topics.report(device));
    let (client, mut events, _) = link::start(
        connection,
        &format!("fleetsim-watch-{}", std::process::id()),
        INFLIGHT,
        stop.clone(),
    );
    connected(&mut events, "watcher").await?;
    client.subscribe(&desired, QoS::AtLeastOnce).await?;
    subscribed(&mut events, "watcher").await?;
    client.subscribe(&report, QoS::AtLeastOnce).await?;
    subscribed(&mut events, "watcher").await?;
    eprintln!("watching {device}");
    let mut figures = WatchFigures::default();
    let _ = tokio::time::timeout(timeout, async {
        while let Some(event) = events.recv().await {
            let LinkEvent::Publish {
                topic,
                payload,
                retain,
            } = event
            else {
                continue;
            };
            let at = unix_now();
            if topic == desired && !retain {
                figures.desired.get_or_insert(at);
            } else if topic == report {
                let Ok(Message::Device(blob)) = envelope::decode(&payload) else {
                    continue;
                };
                let Ok(message) = device::open(&blob, key) else {
                    continue;
                };
                if figures.observe(&message, at) {
                    return;
                }
            }
        }
    })
    .await;
    Ok(figures)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_protocol::{ByteCounts, Report};

    #[test]
    fn blocks_cover_the_artifact_once() {
        let all: Vec<_> = blocks(150_000, 65_536).collect();
        assert_eq!(all, [(0, 65_536), (65_536, 65_536), (131_072, 18_928)]);
        assert_eq!(blocks(0, 65_536).count(), 0);
        assert_eq!(blocks(65_536, 65_536).count(), 1);
    }

    #[test]
    fn a_block_message_is_what_the_artifact_server_sends() {
        let bytes = block_message(7, b"abc");
        match envelope::decode(&bytes) {
            Ok(Message::Block(BlockReply::Data { offset, data, .. })) => {
                assert_eq!((offset, data.as_slice()), (7, &b"abc"[..]));
            }
            other => panic!("not a block reply: {other:?}"),
        }
    }

    fn report(phase: Phase) -> DeviceMessage {
        DeviceMessage::Report(Report {
            device_id: "dev-1".into(),
            seq: 1,
            action_id: "a".into(),
            rollout_id: "r".into(),
            phase,
            at: 0,
        })
    }

    #[test]
    fn the_watch_times_each_step_from_the_desired_action() {
        let mut w = WatchFigures {
            desired: Some(100.0),
            ..WatchFigures::default()
        };
        let downloading = || report(Phase::Downloading { done: 1, total: 2 });
        assert!(!w.observe(&downloading(), 100.5));
        assert!(!w.observe(&downloading(), 101.0));
        assert!(!w.observe(&report(Phase::Verified), 104.0));
        let end = DeviceMessage::ReportWithBytes {
            report: match report(Phase::Ready) {
                DeviceMessage::Report(r) => r,
                _ => unreachable!(),
            },
            bytes: ByteCounts {
                coordinator: 42,
                peers: vec![(flotilla_protocol::origin::HTTP_SOURCE.to_owned(), 7)],
                ..ByteCounts::default()
            },
            bypassed: Vec::new(),
        };
        assert!(w.observe(&end, 110.0));
        let text = w.to_string();
        for line in [
            "desired_to_first_downloading_s: 0.500000",
            "desired_to_verified_s: 4.000000",
            "desired_to_end_s: 10.000000",
            "end_phase: Ready",
            "coordinator_bytes: 42",
            "http_bytes: 7",
        ] {
            assert!(text.contains(line), "{line} not in {text}");
        }
    }
}
