//! The MQTT link: the one place that owns a rumqttc event loop.
//!
//! The poll loop does nothing but forward. Incoming publishes and connection changes go out as
//! [`LinkEvent`]s on a tokio channel; outgoing publishes go in through clones of the
//! `rumqttc::AsyncClient`. Nothing in the loop awaits the client (the request channel could be
//! full, and the loop is what drains it), so subscriptions are sent from a spawned task.
//!
//! Sessions are clean (state is level-triggered through retained messages, ADR 0002), so the
//! link resubscribes on every ConnAck and tells its owner it (re)connected; the owner reissues
//! what it must. Connection failures are retried forever with a capped exponential backoff.
//!
//! How to reach the broker (address, credentials, TLS) is a [`flotilla_mqtt::Connection`],
//! shared with the agent; this module only adds what the coordinator's side needs.

use std::time::Duration;

use flotilla_mqtt::Connection;
use flotilla_protocol::{BROKER_PACKET_LIMIT, CLIENT_PACKET_LIMIT};
use rumqttc::{AsyncClient, Event, EventLoop, Packet, QoS, SubscribeFilter};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Queued outgoing requests the client can hold before `publish().await` waits. Large, because
/// a reissue after a reconnect queues one retained desired action per device in flight.
pub const REQUEST_CAPACITY: usize = 10_000;

const BACKOFF_START: Duration = Duration::from_millis(250);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// What the link reports to its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkEvent {
    /// A ConnAck arrived; subscriptions are being (re)sent.
    Connected,
    /// The broker acknowledged the subscriptions sent after the last ConnAck.
    Subscribed,
    /// The connection dropped; the link is retrying.
    Disconnected { reason: String },
    /// An incoming publish.
    Publish { topic: String, payload: Vec<u8> },
}

/// How to connect.
#[derive(Debug, Clone)]
pub struct LinkOptions {
    /// Address, credentials and TLS.
    pub connection: Connection,
    pub client_id: String,
    /// Filters subscribed (QoS 1) after every ConnAck.
    pub subscriptions: Vec<String>,
    pub keep_alive: Duration,
}

impl LinkOptions {
    /// Plain TCP to `host:port` as `{client_prefix}-{unique}`, 30 s keep alive.
    pub fn new(host: &str, port: u16, client_prefix: &str, subscriptions: Vec<String>) -> Self {
        Self::with_connection(
            Connection::plain(host, port),
            unique_client_id(client_prefix),
            subscriptions,
        )
    }

    /// Options for `connection` under exactly `client_id`, 30 s keep alive.
    pub fn with_connection(
        connection: Connection,
        client_id: String,
        subscriptions: Vec<String>,
    ) -> Self {
        Self {
            connection,
            client_id,
            subscriptions,
            keep_alive: Duration::from_secs(30),
        }
    }
}

/// A running link: publish through `client`, receive from `events`.
#[derive(Debug)]
pub struct MqttLink {
    pub client: AsyncClient,
    /// Unbounded on purpose: if the poll loop could block on a full event channel while its
    /// owner awaits `publish` on a full request channel, the two would wait on each other
    /// forever (a reissue to a large fleet during a burst of reconnecting devices does exactly
    /// that). Incoming traffic is bounded by the fleet's size, not by time.
    pub events: mpsc::UnboundedReceiver<LinkEvent>,
    pub task: JoinHandle<()>,
    pub client_id: String,
}

/// `{prefix}-{pid}-{nanos}-{counter}`: unique across processes and within one.
pub fn unique_client_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{}-{nanos:x}-{n}", std::process::id())
}

/// Starts the link on the current tokio runtime. It stops when `shutdown` is cancelled or the
/// receiver is dropped.
pub fn start(options: LinkOptions, shutdown: CancellationToken) -> MqttLink {
    let mut mqtt = options.connection.options(options.client_id.clone());
    mqtt.set_clean_session(true);
    mqtt.set_keep_alive(options.keep_alive);
    // Read anything a limited broker can deliver (an oversized packet would drop the link), send
    // nothing it would refuse.
    mqtt.set_max_packet_size(CLIENT_PACKET_LIMIT, BROKER_PACKET_LIMIT);
    mqtt.set_request_channel_capacity(REQUEST_CAPACITY);
    let (client, eventloop) = AsyncClient::new(mqtt, REQUEST_CAPACITY);
    let (tx, events) = mpsc::unbounded_channel();
    let client_id = options.client_id.clone();
    let task = tokio::spawn(run(options, client.clone(), eventloop, tx, shutdown));
    MqttLink {
        client,
        events,
        task,
        client_id,
    }
}

async fn run(
    options: LinkOptions,
    client: AsyncClient,
    mut eventloop: EventLoop,
    tx: mpsc::UnboundedSender<LinkEvent>,
    shutdown: CancellationToken,
) {
    let addr = options.connection.describe();
    let mut backoff = BACKOFF_START;
    loop {
        let event = tokio::select! {
            _ = shutdown.cancelled() => break,
            event = eventloop.poll() => event,
        };
        let forward = match event {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                backoff = BACKOFF_START;
                tracing::info!(broker = %addr, client = %options.client_id, "MQTT connected");
                subscribe(&client, &options.subscriptions);
                Some(LinkEvent::Connected)
            }
            Ok(Event::Incoming(Packet::SubAck(_))) => Some(LinkEvent::Subscribed),
            Ok(Event::Incoming(Packet::Publish(p))) => {
                // Topics are UTF-8 by the MQTT spec; rumqttc has already checked.
                Some(LinkEvent::Publish {
                    topic: p.topic,
                    payload: p.payload.to_vec(),
                })
            }
            Ok(_) => None,
            Err(e) => {
                let reason = e.to_string();
                tracing::warn!(broker = %addr, error = %reason, retry_in = ?backoff, "MQTT connection lost");
                if tx.send(LinkEvent::Disconnected { reason }).is_err() {
                    break;
                }
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
                None
            }
        };
        if let Some(event) = forward {
            if tx.send(event).is_err() {
                break;
            }
        }
    }
    // Best effort: tell the broker we are leaving so it does not wait out the keep alive.
    let _ = client.try_disconnect();
    let _ = tokio::time::timeout(Duration::from_millis(500), eventloop.poll()).await;
}

fn subscribe(client: &AsyncClient, filters: &[String]) {
    if filters.is_empty() {
        return;
    }
    let client = client.clone();
    let filters: Vec<SubscribeFilter> = filters
        .iter()
        .map(|f| SubscribeFilter::new(f.clone(), QoS::AtLeastOnce))
        .collect();
    // Spawned, not awaited: the poll loop must keep draining the request channel.
    tokio::spawn(async move {
        if let Err(e) = client.subscribe_many(filters).await {
            tracing::error!(error = %e, "MQTT subscribe could not be queued");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::broker::EmbeddedBroker;

    async fn next(link: &mut MqttLink) -> LinkEvent {
        tokio::time::timeout(Duration::from_secs(20), link.events.recv())
            .await
            .expect("event within timeout")
            .expect("link alive")
    }

    #[tokio::test]
    async fn subscribes_on_connect_and_forwards_publishes() {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr");
        let _broker = EmbeddedBroker::start(addr).expect("broker");
        let shutdown = CancellationToken::new();
        let options = LinkOptions::new("127.0.0.1", addr.port(), "test", vec!["a/+".into()]);
        let mut link = start(options, shutdown.clone());
        assert_eq!(next(&mut link).await, LinkEvent::Connected);
        assert_eq!(next(&mut link).await, LinkEvent::Subscribed);
        link.client
            .publish("a/b", QoS::AtLeastOnce, false, b"hi".to_vec())
            .await
            .expect("queue");
        assert_eq!(
            next(&mut link).await,
            LinkEvent::Publish {
                topic: "a/b".into(),
                payload: b"hi".to_vec()
            }
        );
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), link.task)
            .await
            .expect("stops")
            .expect("no panic");
    }

    #[test]
    fn client_ids_are_unique() {
        assert_ne!(unique_client_id("x"), unique_client_id("x"));
        assert!(unique_client_id("flotilla-coordinator").starts_with("flotilla-coordinator-"));
    }
}
