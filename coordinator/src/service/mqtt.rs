//! The MQTT link: the one place that owns a rumqttc event loop.
//!
//! The poll loop does nothing but forward. Incoming publishes and connection changes go into an
//! [`Inbox`]; outgoing publishes go in through clones of the `rumqttc::AsyncClient`. Nothing in
//! the loop awaits the client (the request channel could be full, and the loop is what drains
//! it), so subscriptions are sent from a spawned task; and the loop never waits on the inbox
//! either, so an owner blocked on a full request channel cannot stop the loop that empties it.
//!
//! The inbox is bounded by bytes ([`INBOX_BYTES`]): publishes beyond it are dropped and counted
//! (a flood, or an owner far behind), never a reason to block. Connection events are never
//! dropped; they are a few bytes each and at most a few per second.
//!
//! Sessions are clean (state is level-triggered through retained messages, ADR 0002), so the
//! link resubscribes on every ConnAck and tells its owner it (re)connected; the owner reissues
//! what it must. Connection failures are retried forever with a capped exponential backoff.
//!
//! A control lane: while it is open, publishes on one topic (the coordinator's control
//! requests) go into an inbox of their own ([`LinkOptions::lane`], [`MqttLink::lane`]), so
//! their owner reads them ahead of the burst of retained messages queued in the main inbox
//! after a (re)connect. The link opens the lane on every ConnAck; the owner closes it
//! ([`MqttLink::lane_open`]) once it has read the burst, and from then on those publishes take
//! their place in the main inbox, in arrival order with everything else. Within each inbox the
//! order is the order of arrival.
//!
//! How to reach the broker (address, credentials, TLS) is a [`flotilla_mqtt::Connection`],
//! shared with the agent; this module only adds what the coordinator's side needs. The link
//! goes through flotilla-mqtt's size guard: a message larger than the link reads
//! ([`CLIENT_PACKET_LIMIT`]) arrives as a stand-in, which is counted
//! ([`InboxStats::oversized`]), logged at most once a minute and dropped, on any broker.

use std::time::Duration;

use flotilla_mqtt::{Connection, Guard, Link};
use flotilla_protocol::{BROKER_PACKET_LIMIT, CLIENT_PACKET_LIMIT};
use rumqttc::{AsyncClient, Event, EventLoop, Packet, QoS, SubscribeFilter};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Queued outgoing requests the client can hold before `publish().await` waits. Large, because
/// a reissue after a reconnect queues one retained desired action per device in flight.
pub const REQUEST_CAPACITY: usize = 10_000;

/// Bytes of incoming payloads the inbox holds before it drops publishes: room for the retained
/// states of a large fleet arriving at once after a restart.
pub const INBOX_BYTES: usize = 128 * 1024 * 1024;

/// Bytes of incoming payloads the control lane holds before it drops publishes: control
/// requests are small and few; a flood of them is dropped and counted like any other.
pub const LANE_BYTES: usize = 4 * 1024 * 1024;

const BACKOFF_START: Duration = Duration::from_millis(250);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// How often refused subscriptions are asked for again on one connection (1 s, doubling to
/// 10 s: about 40 s in all). A NATS cluster refuses a QoS 1 subscription while JetStream
/// elects leaders after a node's death (decision 0061); an ACL's refusal stays, and after these
/// tries the link says so once and leaves it.
const SUBSCRIBE_RETRIES: u32 = 6;

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
    /// Publishes on exactly this topic go to [`MqttLink::lane`] instead of [`MqttLink::events`]
    /// while [`MqttLink::lane_open`] is set.
    pub lane: Option<String>,
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
            lane: None,
        }
    }

    /// The same options, with publishes on `topic` sent to the control lane.
    pub fn with_lane(mut self, topic: String) -> Self {
        self.lane = Some(topic);
        self
    }
}

/// A running link: publish through `client`, receive from `events`.
#[derive(Debug)]
pub struct MqttLink {
    pub client: AsyncClient,
    /// What arrived, in order. Bounded by bytes and never waited on by the poll loop: if the
    /// loop could block on a full inbox while its owner awaits `publish` on a full request
    /// channel, the two would wait on each other forever.
    pub events: Events,
    /// Publishes on [`LinkOptions::lane`], in order, read apart from `events` (empty without a
    /// lane).
    pub lane: Events,
    /// Whether the lane takes its publishes: set by the link on every ConnAck, cleared by the
    /// owner.
    pub lane_open: Arc<AtomicBool>,
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
    let mut setup = options.connection.link(options.client_id.clone());
    let mqtt = &mut setup.options;
    mqtt.set_clean_session(true);
    mqtt.set_keep_alive(options.keep_alive);
    // Read anything a limited broker can deliver, send nothing it would refuse; anything larger
    // the size guard replaces with a stand-in.
    mqtt.set_max_packet_size(CLIENT_PACKET_LIMIT, BROKER_PACKET_LIMIT);
    mqtt.set_request_channel_capacity(REQUEST_CAPACITY);
    if let Some(e) = setup.guard_error() {
        tracing::warn!(error = %e, "the MQTT link connects without its size guard: one message \
            larger than {CLIENT_PACKET_LIMIT} bytes on a broker without a packet-size limit \
            would disconnect it");
    }
    let Link {
        client,
        eventloop,
        guard,
    } = setup.start(REQUEST_CAPACITY);
    let tx = Inbox::new(INBOX_BYTES);
    let events = Events { inbox: tx.clone() };
    let lane_tx = Inbox::new(LANE_BYTES);
    let lane = Events {
        inbox: lane_tx.clone(),
    };
    let lane_open = Arc::new(AtomicBool::new(true));
    let client_id = options.client_id.clone();
    let task = tokio::spawn(run(
        options,
        client.clone(),
        (eventloop, guard),
        Inboxes {
            main: tx,
            lane: lane_tx,
            lane_open: Arc::clone(&lane_open),
        },
        shutdown,
    ));
    MqttLink {
        client,
        events,
        lane,
        lane_open,
        task,
        client_id,
    }
}

/// Where the poll loop puts what arrives.
struct Inboxes {
    main: Inbox,
    lane: Inbox,
    lane_open: Arc<AtomicBool>,
}

async fn run(
    options: LinkOptions,
    client: AsyncClient,
    (mut eventloop, guard): (EventLoop, Guard),
    inboxes: Inboxes,
    shutdown: CancellationToken,
) {
    let Inboxes {
        main: tx,
        lane,
        lane_open,
    } = inboxes;
    let addr = options.connection.describe();
    let mut backoff = BACKOFF_START;
    // The filters of the SUBSCRIBE in flight (its SubAck's codes follow their order), how often
    // refused ones were asked for again, and the task that asks.
    let mut pending: Vec<String> = Vec::new();
    let mut retries = 0;
    let mut retry: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        let event = tokio::select! {
            _ = shutdown.cancelled() => break,
            event = eventloop.poll() => event,
        };
        let forward = match event {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                backoff = BACKOFF_START;
                // The retained burst is on its way again: control requests go ahead of it.
                lane_open.store(true, Ordering::SeqCst);
                tracing::info!(broker = %addr, client = %options.client_id, "MQTT connected");
                if let Some(task) = retry.take() {
                    task.abort();
                }
                pending = options.subscriptions.clone();
                retries = 0;
                subscribe(&client, &pending);
                Some(LinkEvent::Connected)
            }
            Ok(Event::Incoming(Packet::SubAck(ack))) => {
                let first = retries == 0;
                let denied: Vec<String> = pending
                    .iter()
                    .zip(&ack.return_codes)
                    .filter(|(_, code)| matches!(code, rumqttc::SubscribeReasonCode::Failure))
                    .map(|(filter, _)| filter.clone())
                    .collect();
                if !denied.is_empty() && retries < SUBSCRIBE_RETRIES {
                    let wait =
                        Duration::from_secs(1 << retries.min(3)).min(Duration::from_secs(10));
                    retries += 1;
                    tracing::warn!(broker = %addr, client = %options.client_id,
                        "the broker refused {} of {} subscriptions ({}); asking again in {wait:?} \
                         (try {retries} of {SUBSCRIBE_RETRIES})",
                        denied.len(), pending.len(), denied.join(", "));
                    pending = denied;
                    let (client, filters) = (client.clone(), pending.clone());
                    retry = Some(tokio::spawn(async move {
                        tokio::time::sleep(wait).await;
                        subscribe(&client, &filters);
                    }));
                } else {
                    let user = options
                        .connection
                        .credentials
                        .as_ref()
                        .map(|c| c.username.as_str());
                    if let Some(text) = refused(&pending, &ack.return_codes, user) {
                        tracing::error!(broker = %addr, client = %options.client_id, "{text}");
                    }
                }
                // The owner hears of the first SubAck of a connection only: what it publishes
                // then (its end-of-retained marker) is queued behind that SubAck's retained
                // messages.
                first.then_some(LinkEvent::Subscribed)
            }
            Ok(Event::Incoming(Packet::Publish(p))) => match flotilla_mqtt::dropped(&p) {
                Some(dropped) => {
                    tx.oversized(&dropped);
                    None
                }
                // Topics are UTF-8 by the MQTT spec; rumqttc has already checked.
                None => Some(LinkEvent::Publish {
                    topic: p.topic,
                    payload: p.payload.to_vec(),
                }),
            },
            Ok(_) => None,
            Err(e) => {
                let reason = guard.explain(&e);
                tracing::warn!(broker = %addr, error = %reason, retry_in = ?backoff, "MQTT connection lost");
                if tx.push(LinkEvent::Disconnected { reason }).is_err() {
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
            let to_lane = matches!(&event, LinkEvent::Publish { topic, .. }
                if options.lane.as_deref() == Some(topic.as_str()))
                && lane_open.load(Ordering::SeqCst);
            let inbox = if to_lane { &lane } else { &tx };
            if inbox.push(event).is_err() {
                break;
            }
        }
    }
    if let Some(task) = retry.take() {
        task.abort();
    }
    tx.close();
    lane.close();
    // Best effort: tell the broker we are leaving so it does not wait out the keep alive.
    let _ = client.try_disconnect();
    let _ = tokio::time::timeout(Duration::from_millis(500), eventloop.poll()).await;
    drop(eventloop);
    guard.finish(Duration::from_millis(500)).await;
}

/// The link's side of the owner's queue: shared, bounded by payload bytes, and never waited on
/// by the poll loop. The owner takes events with [`Inbox::recv`].
#[derive(Debug, Clone)]
pub struct Inbox {
    shared: Arc<InboxShared>,
}

#[derive(Debug)]
struct InboxShared {
    state: Mutex<InboxState>,
    ready: Notify,
    limit: usize,
}

#[derive(Debug, Default)]
struct InboxState {
    queue: VecDeque<LinkEvent>,
    bytes: usize,
    dropped: u64,
    dropped_logged: Option<std::time::Instant>,
    /// Messages the size guard dropped unread, larger than the link reads.
    oversized: u64,
    oversized_logged: Option<std::time::Instant>,
    /// The poll loop has stopped; nothing more will come.
    closed: bool,
    /// The owner is gone; the poll loop should stop.
    abandoned: bool,
}

/// The owner dropped its inbox.
#[derive(Debug)]
pub struct Abandoned;

impl Inbox {
    pub fn new(limit: usize) -> Inbox {
        Inbox {
            shared: Arc::new(InboxShared {
                state: Mutex::new(InboxState::default()),
                ready: Notify::new(),
                limit,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, InboxState> {
        // Nothing panics while holding the lock; a poisoned one still holds consistent data.
        self.shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Queues an event without waiting. A publish that would take the inbox past its limit is
    /// dropped and counted (one log line a minute at most); other events always go in.
    pub fn push(&self, event: LinkEvent) -> Result<(), Abandoned> {
        let mut state = self.lock();
        if state.abandoned {
            return Err(Abandoned);
        }
        let size = match &event {
            LinkEvent::Publish { payload, topic } => payload.len() + topic.len(),
            _ => 0,
        };
        if size > 0 && state.bytes + size > self.shared.limit {
            state.dropped += 1;
            let now = std::time::Instant::now();
            if state
                .dropped_logged
                .is_none_or(|at| now.duration_since(at) >= Duration::from_secs(60))
            {
                state.dropped_logged = Some(now);
                tracing::warn!(dropped_total = state.dropped, limit_bytes = self.shared.limit,
                    "incoming messages dropped: the coordinator is behind (next such line in a minute at the earliest)");
            }
            return Ok(());
        }
        state.bytes += size;
        state.queue.push_back(event);
        drop(state);
        self.shared.ready.notify_one();
        Ok(())
    }

    /// The next event; `None` once the link has stopped and everything was taken.
    pub async fn recv(&mut self) -> Option<LinkEvent> {
        loop {
            {
                let mut state = self.lock();
                if let Some(event) = state.queue.pop_front() {
                    if let LinkEvent::Publish { payload, topic } = &event {
                        state.bytes -= payload.len() + topic.len();
                    }
                    return Some(event);
                }
                if state.closed {
                    return None;
                }
            }
            self.shared.ready.notified().await;
        }
    }

    /// Publishes dropped because the inbox was full, so far.
    pub fn dropped(&self) -> u64 {
        self.lock().dropped
    }

    /// Counts a message the size guard dropped unread, and logs it (at most one line a minute,
    /// naming the latest topic and size and the count).
    pub fn oversized(&self, dropped: &flotilla_mqtt::Dropped) {
        let mut state = self.lock();
        state.oversized += 1;
        let now = std::time::Instant::now();
        if state
            .oversized_logged
            .is_none_or(|at| now.duration_since(at) >= Duration::from_secs(60))
        {
            state.oversized_logged = Some(now);
            let topic: String = dropped.topic.chars().take(200).collect();
            tracing::warn!(
                topic,
                bytes = dropped.bytes,
                oversized_total = state.oversized,
                limit_bytes = CLIENT_PACKET_LIMIT,
                "incoming message dropped unread: larger than a message may be (next such line in \
                 a minute at the earliest)"
            );
        }
    }

    fn close(&self) {
        self.lock().closed = true;
        self.shared.ready.notify_one();
    }
}

/// The owner's end of the [`Inbox`]: dropping it stops the poll loop at its next event
/// instead of leaving it to fill an inbox nobody reads.
#[derive(Debug)]
pub struct Events {
    inbox: Inbox,
}

impl Events {
    /// The next event; `None` once the link has stopped and everything was taken.
    pub async fn recv(&mut self) -> Option<LinkEvent> {
        self.inbox.recv().await
    }

    /// Publishes dropped because the inbox was full, so far.
    pub fn dropped(&self) -> u64 {
        self.inbox.dropped()
    }

    /// A handle that reads the inbox's counts from elsewhere (the metrics endpoint).
    pub fn stats(&self) -> InboxStats {
        InboxStats {
            inbox: self.inbox.clone(),
        }
    }
}

/// An inbox and its owner's end without a link, for feeding a consumer of [`Events`] in tests.
#[cfg(test)]
pub(crate) fn inbox_pair(limit: usize) -> (Inbox, Events) {
    let inbox = Inbox::new(limit);
    let events = Events {
        inbox: inbox.clone(),
    };
    (inbox, events)
}

/// Reads an [`Inbox`]'s counts without taking events from it.
#[derive(Debug, Clone)]
pub struct InboxStats {
    inbox: Inbox,
}

impl InboxStats {
    /// Publishes dropped because the inbox was full, so far.
    pub fn dropped(&self) -> u64 {
        self.inbox.dropped()
    }

    /// Messages dropped unread because they were larger than the link reads, so far.
    pub fn oversized(&self) -> u64 {
        self.inbox.lock().oversized
    }

    /// Bytes of publishes waiting to be taken.
    pub fn queued_bytes(&self) -> usize {
        self.inbox.lock().bytes
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        self.inbox.lock().abandoned = true;
    }
}

/// What to say when the broker refused some of `filters` (a SUBACK failure code, usually its
/// ACL): which, and the user this link logged in as, since a wrong login (another program's
/// user) is the usual cause. `None` when every filter was granted.
pub fn refused(
    filters: &[String],
    codes: &[rumqttc::SubscribeReasonCode],
    user: Option<&str>,
) -> Option<String> {
    let refused: Vec<&str> = filters
        .iter()
        .zip(codes)
        .filter(|(_, code)| matches!(code, rumqttc::SubscribeReasonCode::Failure))
        .map(|(filter, _)| filter.as_str())
        .collect();
    if refused.is_empty() {
        return None;
    }
    let who = match user {
        Some(user) => format!("user {user:?}"),
        None => "no user (anonymous)".to_owned(),
    };
    Some(format!(
        "the broker refused {} of {} subscriptions ({}): logged in as {who}, which its ACL \
         does not let read them, so nothing arrives on them; check which user this program \
         logs in as and the broker's ACL",
        refused.len(),
        filters.len(),
        refused.join(", ")
    ))
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

    #[test]
    fn refused_subscriptions_are_named_with_the_user() {
        use rumqttc::SubscribeReasonCode::{Failure, Success};
        let filters = vec![
            "flotilla/v1/devices/+/state".to_owned(),
            "flotilla/v1/control/+".to_owned(),
        ];
        assert_eq!(
            refused(&filters, &[Success(QoS::AtLeastOnce); 2], Some("flotilla")),
            None
        );
        let text = refused(
            &filters,
            &[Failure, Success(QoS::AtLeastOnce)],
            Some("flotilla-operator"),
        )
        .expect("refused");
        assert!(
            text.starts_with(
                "the broker refused 1 of 2 subscriptions (flotilla/v1/devices/+/state): logged in \
                 as user \"flotilla-operator\""
            ),
            "{text}"
        );
        let text = refused(&filters, &[Failure, Failure], None).expect("refused");
        assert!(text.contains("no user (anonymous)"), "{text}");
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

    #[tokio::test]
    async fn a_full_inbox_drops_publishes_never_connection_events_and_never_waits() {
        let inbox = Inbox::new(100);
        let mut events = Events {
            inbox: inbox.clone(),
        };
        let publish = |n: u8| LinkEvent::Publish {
            topic: "t".into(),
            payload: vec![n; 60],
        };
        inbox.push(publish(1)).expect("owner alive");
        inbox
            .push(publish(2))
            .expect("over the limit: dropped, not an error");
        inbox
            .push(LinkEvent::Disconnected {
                reason: "gone".into(),
            })
            .expect("owner alive");
        assert_eq!(events.dropped(), 1);
        assert_eq!(events.recv().await, Some(publish(1)));
        assert!(matches!(
            events.recv().await,
            Some(LinkEvent::Disconnected { .. })
        ));
        inbox.push(publish(3)).expect("room again once taken");
        assert_eq!(events.recv().await, Some(publish(3)));
        inbox.close();
        assert_eq!(events.recv().await, None, "closed and empty");
        drop(events);
        assert!(inbox.push(publish(4)).is_err(), "the owner is gone");
    }

    #[test]
    fn client_ids_are_unique() {
        assert_ne!(unique_client_id("x"), unique_client_id("x"));
        assert!(unique_client_id("flotilla-coordinator").starts_with("flotilla-coordinator-"));
    }
}
