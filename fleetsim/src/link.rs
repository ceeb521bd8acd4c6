//! The MQTT link: one task owns the rumqttc event loop, only polls it and hands what arrives on
//! as [`LinkEvent`]s; everything else publishes through the [`AsyncClient`]. rumqttc reconnects
//! when polled after an error; the poll task waits 1 s first and counts the reconnects.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use flotilla_protocol::{BROKER_PACKET_LIMIT, CLIENT_PACKET_LIMIT};
use rumqttc::{AsyncClient, Event, Packet};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Requests rumqttc queues before `publish` waits: enough for a burst of many devices' reports.
const REQUEST_CAPACITY: usize = 10_000;

/// What the link tells its owner.
#[derive(Debug)]
pub enum LinkEvent {
    /// A connection is up (the first, or again after a loss): subscribe now (clean session).
    Connected,
    /// The broker granted a subscription.
    Subscribed,
    Publish {
        topic: String,
        payload: Vec<u8>,
        /// Set by the broker on a retained message delivered because of a new subscription,
        /// never on one forwarded live.
        retain: bool,
    },
    /// The connection was lost; rumqttc reconnects.
    Lost(String),
}

/// Counters the poll task keeps.
#[derive(Debug, Default)]
pub struct LinkCounters {
    /// PubAcks received: publishes the broker has taken.
    pub acked: AtomicU64,
    /// Connections lost (not counting the orderly disconnect at the end).
    pub lost: AtomicU64,
    /// Set before the orderly disconnect.
    pub closing: std::sync::atomic::AtomicBool,
}

/// Connects as `client_id` and starts the poll task; it stops with `shutdown`.
pub fn start(
    connection: &flotilla_mqtt::Connection,
    client_id: &str,
    inflight: u16,
    shutdown: CancellationToken,
) -> (
    AsyncClient,
    mpsc::UnboundedReceiver<LinkEvent>,
    Arc<LinkCounters>,
) {
    let mut options = connection.options(client_id);
    options
        .set_clean_session(true)
        .set_keep_alive(Duration::from_secs(30))
        .set_max_packet_size(CLIENT_PACKET_LIMIT, BROKER_PACKET_LIMIT)
        .set_inflight(inflight.max(1));
    let (client, mut eventloop) = AsyncClient::new(options, REQUEST_CAPACITY);
    // Without it Nagle's algorithm and delayed ACKs hold small publishes back ~40 ms.
    let mut network = rumqttc::NetworkOptions::new();
    network.set_tcp_nodelay(true);
    eventloop.set_network_options(network);
    let (tx, rx) = mpsc::unbounded_channel();
    let counters = Arc::new(LinkCounters::default());
    let c = counters.clone();
    tokio::spawn(async move {
        loop {
            let event = tokio::select! {
                _ = shutdown.cancelled() => break,
                e = eventloop.poll() => e,
            };
            let forward = match event {
                Ok(Event::Incoming(Packet::ConnAck(_))) => LinkEvent::Connected,
                Ok(Event::Incoming(Packet::SubAck(_))) => LinkEvent::Subscribed,
                Ok(Event::Incoming(Packet::Publish(p))) => LinkEvent::Publish {
                    topic: p.topic,
                    payload: p.payload.to_vec(),
                    retain: p.retain,
                },
                Ok(Event::Incoming(Packet::PubAck(_))) => {
                    c.acked.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Ok(_) => continue,
                Err(_) if c.closing.load(Ordering::Relaxed) => break,
                Err(e) => {
                    c.lost.fetch_add(1, Ordering::Relaxed);
                    let _ = tx.send(LinkEvent::Lost(e.to_string()));
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                    continue;
                }
            };
            if tx.send(forward).is_err() {
                break;
            }
        }
    });
    (client, rx, counters)
}
