//! The MQTT link: the only code that touches rumqttc.
//!
//! One task owns the [`rumqttc::EventLoop`] and does nothing but poll it and translate what
//! arrives into [`LinkEvent`]s on a channel; it never publishes and waits inside that loop (a
//! full request channel would then deadlock the client), and it never waits on the event
//! channel either: while the agent is busy, events wait in `Undelivered`, which a third task
//! hands on as the agent catches up (a newer desired
//! action replaces an older one, block replies are dropped and asked for again, acknowledgements
//! beyond a bound are dropped and their reports re-sent), so the event loop keeps draining the
//! client's requests and a flood of messages cannot stall the agent. A second task takes [`Outgoing`]
//! messages from the domain code and hands them to the client. rumqttc reconnects when polled
//! after an error; the poll task sleeps 1s, 2s, ... up to 10s between failed attempts.
//!
//! Without a connection nothing is queued (decision 0037). rumqttc reads its request channel
//! only while connected, so requests queued meanwhile would fill it, the writer would wait for
//! room, the link's channel would fill behind it, and everything sending through the link would
//! wait with it; a fetcher asking for its blocks again every 10 s did that within minutes, and
//! shutdown then waited forever. So the writer drops what it is given while no connection is up
//! (the agent publishes its state and its outbox again on [`LinkEvent::Connected`], the fetcher
//! asks again for what it lacks), and a connection error empties the client's channel too, so
//! nothing stale goes out on the next connection. Against a broker that is connected but takes
//! nothing, [`LinkHandle::stop_waiting_on`] makes senders give up once the agent stops.
//!
//! Peer requests (`peer-fetch`) skip the agent loop: the poll task hands each to the peer
//! server's bounded [`PeerInbox`] without waiting, and a full inbox drops (and counts) it, so a
//! flood of them never delays the device's own messages. Replies to peers go out as
//! [`Outgoing::PeerBlock`] on the requester's `peer-block/{this device}` topic.
//!
//! Report acknowledgements: rumqttc tells which packet id a publish got
//! (`Outgoing::Publish(pkid)`) in the order requests were queued, and later `PubAck(pkid)`. The
//! writer records, in queue order, whether each publish was a report (and its `seq`); the poll
//! task pairs the two and emits [`LinkEvent::ReportAcked`]. A connection loss drops every
//! pending publish (clean session), so the pairing restarts on each connection and the outbox
//! is re-sent; the coordinator ignores duplicate `seq`s.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flotilla_protocol::{
    device, envelope, BlockReply, BlockRequest, BypassedPeer, ByteCounts, DeviceId, DeviceMessage,
    DeviceState, Digest, Message, PeerFetch, Report, SignedBlob, SigningKey, Topic, Topics,
    BROKER_PACKET_LIMIT, CLIENT_PACKET_LIMIT,
};
use rumqttc::{AsyncClient, Event, LastWill, Packet, QoS};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::Config;

/// What the link tells the agent.
#[derive(Debug, Clone)]
pub enum LinkEvent {
    /// A new connection is up (after the first connect and after every reconnect).
    Connected,
    Desired(SignedBlob),
    Block(BlockReply),
    /// A block reply from peer `peer`, on `peer-block/{peer}` (the topic names the source).
    PeerBlock {
        peer: String,
        reply: BlockReply,
    },
    /// The broker acknowledged the report with this `seq`.
    ReportAcked(u64),
}

/// What the agent asks the link to send.
#[derive(Debug, Clone)]
pub enum Outgoing {
    /// Subscribe to this device's desired and block topics.
    Subscribe,
    Report(Report),
    /// Retained.
    State(DeviceState),
    Fetch(BlockRequest),
    /// A final report with the action's bytes by source ([`DeviceMessage::ReportWithBytes`]).
    ReportWithBytes {
        report: Report,
        bytes: ByteCounts,
        bypassed: Vec<BypassedPeer>,
    },
    /// A block request to peer `peer`, on its `peer-fetch` topic (not a device message: the
    /// grant inside it is what the peer checks).
    PeerFetch {
        peer: DeviceId,
        fetch: PeerFetch,
    },
    /// A block (or a refusal) for the peer `to`, on `peer_block(to, this device)`. Unsigned,
    /// like the artifact server's replies: the requester checks the block against its hash.
    PeerBlock {
        to: DeviceId,
        reply: BlockReply,
    },
}

/// Where the link hands the peer requests it receives: a bounded queue that never makes the
/// link wait; a request that finds it full is dropped and counted (the peer asks another
/// source).
#[derive(Debug, Clone)]
pub struct PeerInbox {
    tx: mpsc::Sender<PeerFetch>,
    dropped: Arc<AtomicU64>,
}

impl PeerInbox {
    /// An inbox holding up to `capacity` requests, and its receiving end.
    pub fn new(capacity: usize) -> (Self, mpsc::Receiver<PeerFetch>) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        (
            Self {
                tx,
                dropped: Arc::new(AtomicU64::new(0)),
            },
            rx,
        )
    }

    /// Queues `fetch` if there is room; returns whether it was queued.
    pub fn offer(&self, fetch: PeerFetch) -> bool {
        match self.tx.try_send(fetch) {
            Ok(()) => true,
            Err(_) => {
                let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
                if n.is_power_of_two() {
                    tracing::warn!(
                        dropped_total = n,
                        "peer requests arrive faster than they are served; dropping some"
                    );
                }
                false
            }
        }
    }

    /// Requests dropped so far because the inbox was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// Handle for sending through the link.
#[derive(Debug, Clone)]
pub struct LinkHandle {
    tx: mpsc::Sender<Outgoing>,
    malformed: Arc<AtomicU64>,
    /// Once cancelled, [`send`](Self::send) no longer waits for room.
    stop: CancellationToken,
}

impl LinkHandle {
    /// Queues a message; waits only while the queue is full, and not at all once the token
    /// given to [`stop_waiting_on`](Self::stop_waiting_on) is cancelled (the message is then
    /// dropped if it does not fit). Errors only after shutdown.
    pub async fn send(&self, message: Outgoing) {
        tokio::select! {
            biased;
            sent = self.tx.send(message) => if sent.is_err() {
                tracing::debug!("link is shut down; message dropped");
            },
            _ = self.stop.cancelled() => {
                tracing::debug!("stopping, and the link queue is full; message dropped");
            }
        }
    }

    /// Makes [`send`](Self::send) stop waiting for room in the queue once `stop` is cancelled,
    /// in this handle and the clones made from it afterwards: whatever stops the agent must not
    /// wait on a broker that takes nothing. A report dropped then stays in the outbox, and
    /// everything else is sent afresh after the next start.
    pub fn stop_waiting_on(mut self, stop: CancellationToken) -> Self {
        self.stop = stop;
        self
    }

    /// Queues a message without waiting; dropped (and logged) if the queue is full. For
    /// progress reports, which the next one supersedes.
    pub fn try_send(&self, message: Outgoing) {
        if self.tx.try_send(message).is_err() {
            tracing::debug!("link queue full; message dropped");
        }
    }

    /// A handle whose messages go to `tx` instead of a broker (for tests of the domain code).
    pub fn from_channel(tx: mpsc::Sender<Outgoing>) -> Self {
        Self {
            tx,
            malformed: Arc::new(AtomicU64::new(0)),
            stop: CancellationToken::new(),
        }
    }

    /// Malformed payloads received so far.
    pub fn malformed_count(&self) -> u64 {
        self.malformed.load(Ordering::Relaxed)
    }
}

/// The last will: this device's state with `online: false`.
pub fn offline_state(config: &Config) -> DeviceState {
    DeviceState {
        device_id: config.device_id.to_string(),
        hardware_id: config.hardware_id.clone(),
        labels: config.labels.clone(),
        installed: None,
        current: None,
        online: false,
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        at: 0,
    }
}

/// Signs what the device sends with its own key ([`crate::identity`]).
#[derive(Clone)]
pub struct Signer {
    key: SigningKey,
    /// Proof of the configured enrollment token, carried in every state.
    enrollment: Option<Digest>,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret key.
        f.debug_struct("Signer")
            .field(
                "key",
                &flotilla_protocol::hex::encode(self.key.verifying_key().as_bytes()),
            )
            .finish()
    }
}

impl Signer {
    pub fn new(config: &Config, key: SigningKey) -> Self {
        let enrollment = config.enrollment_token.as_deref().map(|token| {
            device::enrollment_proof(token, config.device_id.as_str(), &key.verifying_key())
        });
        Self { key, enrollment }
    }

    /// The envelope bytes of a signed state.
    pub fn state(&self, state: DeviceState) -> Vec<u8> {
        self.encode(&DeviceMessage::State {
            state,
            enrollment: self.enrollment,
        })
    }

    /// The envelope bytes of a signed device message.
    pub fn encode(&self, message: &DeviceMessage) -> Vec<u8> {
        envelope::encode(&Message::Device(device::sign(&self.key, message)))
    }
}

/// Starts the link's tasks. They stop when `shutdown` is cancelled. Everything the link sends
/// is signed by `signer`.
pub fn start(
    config: &Config,
    signer: Signer,
    shutdown: CancellationToken,
) -> (LinkHandle, mpsc::Receiver<LinkEvent>) {
    start_with(config, signer, None, shutdown)
}

/// [`start`], handing peer requests to `peers` (without it they are ignored: serving is off).
pub fn start_with(
    config: &Config,
    signer: Signer,
    peers: Option<PeerInbox>,
    shutdown: CancellationToken,
) -> (LinkHandle, mpsc::Receiver<LinkEvent>) {
    let topics = Topics::new(&config.broker.topic_root);
    let id = config.device_id.clone();
    // The client id is the device id, so a broker ACL can tie the client to its own topics
    // (`%c`); address, credentials and TLS come from flotilla-mqtt.
    // Through flotilla-mqtt's size guard: a message larger than the link reads arrives as a
    // stand-in, counted as malformed and dropped, so no message on the broker can keep the
    // device disconnected.
    let mut setup = config.broker.connection().link(id.to_string());
    if let Some(e) = setup.guard_error() {
        tracing::warn!(error = %e, "the MQTT link connects without its size guard");
    }
    setup
        .options
        .set_clean_session(true)
        .set_keep_alive(config.broker.keep_alive)
        .set_max_packet_size(CLIENT_PACKET_LIMIT, BROKER_PACKET_LIMIT)
        .set_last_will(LastWill::new(
            topics.state(&id),
            signer.state(offline_state(config)),
            QoS::AtLeastOnce,
            true,
        ));
    let flotilla_mqtt::Link {
        client,
        eventloop,
        guard,
    } = setup.start(64);
    let (out_tx, out_rx) = mpsc::channel(64);
    let (event_tx, event_rx) = mpsc::channel(256);
    let malformed = Arc::new(AtomicU64::new(0));
    let session = Session::default();

    tokio::spawn(writer(
        client.clone(),
        signer,
        topics.clone(),
        id.clone(),
        out_rx,
        session.clone(),
        shutdown.clone(),
    ));
    tokio::spawn(poll(
        (eventloop, guard, client.clone()),
        topics,
        id,
        event_tx,
        session,
        malformed.clone(),
        peers,
        shutdown,
    ));
    (
        LinkHandle {
            tx: out_tx,
            malformed,
            stop: CancellationToken::new(),
        },
        event_rx,
    )
}

/// What the writer and the poll task share about the current connection.
#[derive(Debug, Clone, Default)]
struct Session {
    /// A connection is up: set on every ConnAck, cleared on every connection error.
    connected: Arc<AtomicBool>,
    /// Which queued publish was which report (`Some(seq)`), in queue order.
    tags: Arc<Mutex<VecDeque<Option<u64>>>>,
}

impl Session {
    fn is_up(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    fn tag(&self, tag: Option<u64>) {
        if let Ok(mut t) = self.tags.lock() {
            t.push_back(tag);
        }
    }

    fn next_tag(&self) -> Option<u64> {
        self.tags
            .lock()
            .ok()
            .and_then(|mut t| t.pop_front())
            .flatten()
    }

    fn up(&self) {
        self.connected.store(true, Ordering::Release);
    }

    fn down(&self) {
        self.connected.store(false, Ordering::Release);
        if let Ok(mut t) = self.tags.lock() {
            t.clear();
        }
    }
}

/// Takes what the agent sends and queues it in the MQTT client, signed. Without a connection
/// nothing is queued: the client reads its request queue only while connected, so it would fill
/// up (the fetcher asks for its blocks again every 10 s), this task would wait for room, and so
/// would everything that sends through the link, shutdown included. Nothing dropped here is
/// lost: after the next `Connected` the agent publishes its state and its outbox again, the
/// fetcher asks again for every block it lacks, and a peer asks again for a block it did not get.
async fn writer(
    client: AsyncClient,
    signer: Signer,
    topics: Topics,
    id: DeviceId,
    mut rx: mpsc::Receiver<Outgoing>,
    session: Session,
    shutdown: CancellationToken,
) {
    let mut dropped = 0u64;
    loop {
        let message = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = rx.recv() => match m { Some(m) => m, None => break },
        };
        if !session.is_up() {
            dropped += 1;
            if dropped.is_power_of_two() {
                tracing::debug!(
                    dropped_total = dropped,
                    "no connection to the broker: not queued, sent afresh after the reconnect"
                );
            }
            continue;
        }
        let (topic, retain, tag, payload, what) = match message {
            Outgoing::Subscribe => {
                for filter in topics.agent_filters(&id) {
                    let subscribed = tokio::select! {
                        _ = shutdown.cancelled() => return,
                        s = client.subscribe(filter, QoS::AtLeastOnce) => s,
                    };
                    if let Err(e) = subscribed {
                        tracing::warn!("cannot subscribe: {e}");
                    }
                }
                continue;
            }
            Outgoing::Report(r) => (
                topics.report(&id),
                false,
                Some(r.seq),
                signer.encode(&DeviceMessage::Report(r)),
                "a report".to_owned(),
            ),
            Outgoing::ReportWithBytes {
                report,
                bytes,
                bypassed,
            } => (
                topics.report(&id),
                false,
                Some(report.seq),
                signer.encode(&DeviceMessage::ReportWithBytes {
                    report,
                    bytes,
                    bypassed,
                }),
                "a report".to_owned(),
            ),
            Outgoing::PeerFetch { peer, fetch } => (
                topics.peer_fetch(&peer),
                false,
                None,
                envelope::encode(&Message::PeerFetch(fetch)),
                format!("a block request to peer {peer}"),
            ),
            Outgoing::State(state) => (
                topics.state(&id),
                true,
                None,
                signer.encode(&DeviceMessage::State {
                    state,
                    enrollment: signer.enrollment,
                }),
                "the device state".to_owned(),
            ),
            Outgoing::PeerBlock { to, reply } => (
                topics.peer_block(&to, &id),
                false,
                None,
                envelope::encode(&Message::Block(reply)),
                format!("a block for peer {to}"),
            ),
            Outgoing::Fetch(request) => (
                topics.fetch(&id),
                false,
                None,
                signer.encode(&DeviceMessage::Fetch {
                    device_id: id.to_string(),
                    request,
                }),
                "a block request".to_owned(),
            ),
        };
        session.tag(tag);
        let queued = tokio::select! {
            _ = shutdown.cancelled() => break,
            q = client.publish(topic, QoS::AtLeastOnce, retain, payload) => q,
        };
        if let Err(e) = queued {
            tracing::warn!("cannot queue {what}: {e}");
        }
    }
    // Leave cleanly so the broker does not publish the last will for an orderly stop: the
    // agent publishes its offline state itself before this.
    let _ = client.try_disconnect();
}

#[allow(clippy::too_many_arguments)]
async fn poll(
    (mut eventloop, guard, client): (rumqttc::EventLoop, flotilla_mqtt::Guard, AsyncClient),
    topics: Topics,
    id: DeviceId,
    events: mpsc::Sender<LinkEvent>,
    session: Session,
    malformed: Arc<AtomicU64>,
    peers: Option<PeerInbox>,
    shutdown: CancellationToken,
) {
    let mut backoff = Duration::from_secs(1);
    // packet id -> report seq, for publishes sent on this connection.
    let mut pending: HashMap<u16, u64> = HashMap::new();
    let mut subscriptions = Resubscribe::default();
    let undelivered = Arc::new(Mutex::new(Undelivered::default()));
    let backlog = Arc::new(tokio::sync::Notify::new());
    tokio::spawn(deliver_backlog(
        undelivered.clone(),
        backlog.clone(),
        events.clone(),
        shutdown.clone(),
    ));
    loop {
        let event = tokio::select! {
            _ = shutdown.cancelled() => break,
            e = eventloop.poll() => e,
        };
        let forward = match event {
            Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                tracing::info!(code = ?ack.code, "connected to broker");
                backoff = Duration::from_secs(1);
                pending.clear();
                subscriptions.connected(topics.agent_filters(&id));
                session.up();
                Some(LinkEvent::Connected)
            }
            Ok(Event::Incoming(Packet::Publish(p))) if p.topic == flotilla_mqtt::DROPPED_TOPIC => {
                if let Some(d) = flotilla_mqtt::dropped(&p) {
                    let reason = format!(
                        "{} bytes, more than the {CLIENT_PACKET_LIMIT} bytes the link reads; \
                         dropped unread",
                        d.bytes
                    );
                    malformed_payload(&d.topic, &reason, &malformed);
                }
                None
            }
            Ok(Event::Incoming(Packet::Publish(p)))
                if matches!(topics.parse(&p.topic), Some(Topic::PeerFetch(_))) =>
            {
                if let Some(fetch) = decode_peer_fetch(&topics, &id, &p.topic, &p.payload) {
                    match &peers {
                        Some(inbox) => {
                            inbox.offer(fetch);
                        }
                        None => tracing::debug!("serving peers is off; peer request ignored"),
                    }
                } else {
                    malformed_payload(&p.topic, "not a peer request for this device", &malformed);
                }
                None
            }
            Ok(Event::Incoming(Packet::Publish(p))) => {
                decode(&topics, &id, &p.topic, &p.payload, &malformed)
            }
            Ok(Event::Incoming(Packet::PubAck(ack))) => {
                pending.remove(&ack.pkid).map(LinkEvent::ReportAcked)
            }
            Ok(Event::Outgoing(rumqttc::Outgoing::Subscribe(pkid))) => {
                subscriptions.sent(pkid);
                None
            }
            Ok(Event::Incoming(Packet::SubAck(ack))) => {
                let essential = [topics.desired(&id), topics.block(&id)];
                subscriptions.acked(&ack, &essential, &client);
                None
            }
            Ok(Event::Outgoing(rumqttc::Outgoing::Publish(pkid))) => {
                if let Some(seq) = session.next_tag() {
                    pending.insert(pkid, seq);
                }
                None
            }
            Ok(_) => None,
            Err(e) => {
                let e = guard.explain(&e);
                tracing::warn!("broker connection: {e}; retrying in {backoff:?}");
                // Everything queued is dropped with the session (the clean session drops it
                // on the broker's side anyway): what the writer queued before it saw the
                // connection gone goes too, so nothing stale waits for the next connection.
                // The outbox is re-sent on the next ConnAck.
                session.down();
                subscriptions.lost();
                eventloop.clean();
                eventloop.pending.clear();
                pending.clear();
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(10));
                None
            }
        };
        let Some(event) = forward else { continue };
        let Ok(mut waiting) = undelivered.lock() else {
            break;
        };
        if waiting.offer(event, &events) {
            backlog.notify_one();
        }
    }
    // What the client already wrote (the offline state, a DISCONNECT) reaches the broker.
    drop(eventloop);
    guard.finish(Duration::from_secs(1)).await;
}

/// Which filter each SUBSCRIBE in flight is for, so a refused one can be asked for again. A NATS
/// cluster refuses a QoS 1 subscription while JetStream elects leaders after a node's death
/// (docs/decisions/0061): the device's own desired and block topics are asked for again (1 s,
/// doubling to 10 s, at most [`Resubscribe::TRIES`] times a connection); peer topics, which a
/// central broker's ACL refuses for good, are not.
#[derive(Default)]
struct Resubscribe {
    /// Filters in the order their SUBSCRIBEs go out on this connection.
    expected: VecDeque<String>,
    in_flight: HashMap<u16, String>,
    tries: u32,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Resubscribe {
    const TRIES: u32 = 10;

    fn connected(&mut self, filters: Vec<String>) {
        self.lost();
        self.expected = filters.into();
    }

    fn lost(&mut self) {
        for task in self.tasks.drain(..) {
            task.abort();
        }
        self.expected.clear();
        self.in_flight.clear();
        self.tries = 0;
    }

    fn sent(&mut self, pkid: u16) {
        if let Some(filter) = self.expected.pop_front() {
            self.in_flight.insert(pkid, filter);
        }
    }

    fn acked(&mut self, ack: &rumqttc::SubAck, essential: &[String], client: &AsyncClient) {
        let Some(filter) = self.in_flight.remove(&ack.pkid) else {
            return;
        };
        let refused = ack
            .return_codes
            .iter()
            .any(|c| matches!(c, rumqttc::SubscribeReasonCode::Failure));
        if !refused || !essential.contains(&filter) {
            return;
        }
        if self.tries >= Self::TRIES {
            tracing::error!(filter, "the broker refused the subscription {} times; nothing arrives on it until the next connection", Self::TRIES);
            return;
        }
        let wait = Duration::from_secs(1 << self.tries.min(3)).min(Duration::from_secs(10));
        self.tries += 1;
        tracing::warn!(
            filter,
            "the broker refused the subscription; asking again in {wait:?}"
        );
        self.expected.push_back(filter.clone());
        let client = client.clone();
        self.tasks.push(tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            let _ = client.subscribe(filter, QoS::AtLeastOnce).await;
        }));
    }
}

/// Hands the events that found the agent's channel full to the agent loop, in the background, so
/// the poll task never waits for it.
async fn deliver_backlog(
    undelivered: Arc<Mutex<Undelivered>>,
    backlog: Arc<tokio::sync::Notify>,
    events: mpsc::Sender<LinkEvent>,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = backlog.notified() => {}
        }
        loop {
            let next = undelivered.lock().ok().and_then(|mut u| u.take());
            let Some(event) = next else { break };
            if events.send(event).await.is_err() {
                return;
            }
        }
    }
}

/// Events the agent loop has not taken yet because its channel was full. Bounded: it holds at
/// most one reconnect, the newest desired action and [`MAX_UNDELIVERED_ACKS`] acknowledgements.
#[derive(Debug, Default)]
struct Undelivered {
    connected: bool,
    acks: VecDeque<u64>,
    desired: Option<SignedBlob>,
}

/// Acknowledgements kept while the agent is busy; an older one dropped only means its report
/// stays in the outbox and is sent again after the next reconnect.
const MAX_UNDELIVERED_ACKS: usize = 1024;

impl Undelivered {
    fn is_empty(&self) -> bool {
        !self.connected && self.acks.is_empty() && self.desired.is_none()
    }

    /// Sends `event` now if the channel has room and nothing older waits; keeps it otherwise.
    /// Returns whether something now waits for [`deliver_backlog`].
    fn offer(&mut self, event: LinkEvent, events: &mpsc::Sender<LinkEvent>) -> bool {
        let event = if self.is_empty() {
            match events.try_send(event) {
                Ok(()) => return false,
                Err(mpsc::error::TrySendError::Full(event)) => event,
                Err(mpsc::error::TrySendError::Closed(_)) => return false,
            }
        } else {
            event
        };
        match event {
            LinkEvent::Connected => self.connected = true,
            LinkEvent::Desired(blob) => {
                // Level-triggered: only the newest desired action matters.
                if self.desired.replace(blob).is_some() {
                    tracing::debug!("agent busy: an older desired action was superseded");
                }
            }
            LinkEvent::ReportAcked(seq) => {
                if self.acks.len() == MAX_UNDELIVERED_ACKS {
                    self.acks.pop_front();
                }
                self.acks.push_back(seq);
            }
            // The fetcher asks again for a block it did not get.
            LinkEvent::Block(_) | LinkEvent::PeerBlock { .. } => {
                tracing::debug!("agent is not keeping up with blocks; one dropped")
            }
        }
        !self.is_empty()
    }

    /// The next waiting event, in the order the agent needs them: a reconnect first (it
    /// resubscribes and re-sends the outbox), then acknowledgements, then the desired action.
    fn take(&mut self) -> Option<LinkEvent> {
        if std::mem::take(&mut self.connected) {
            return Some(LinkEvent::Connected);
        }
        if let Some(seq) = self.acks.pop_front() {
            return Some(LinkEvent::ReportAcked(seq));
        }
        self.desired.take().map(LinkEvent::Desired)
    }
}

/// Unix seconds of the last malformed-payload log line.
static MALFORMED_LOGGED: AtomicU64 = AtomicU64::new(0);

/// Counts a malformed payload and logs the first, then at most one a minute: garbage must not
/// flood the log.
fn malformed_payload(topic: &str, reason: &str, malformed: &AtomicU64) {
    let n = malformed.fetch_add(1, Ordering::Relaxed) + 1;
    let now = crate::trust::system_now();
    let last = MALFORMED_LOGGED.load(Ordering::Relaxed);
    if (n == 1 || now.saturating_sub(last) >= 60)
        && MALFORMED_LOGGED
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        let topic: String = topic.chars().take(200).collect();
        tracing::warn!(
            topic,
            malformed_total = n,
            "ignoring malformed payload: {reason} (next such line in a minute at the earliest)"
        );
    }
}

/// A peer request on this device's `peer-fetch` topic, if that is what the payload is. Its grant
/// is checked by the peer server, not here.
fn decode_peer_fetch(
    topics: &Topics,
    id: &DeviceId,
    topic: &str,
    payload: &[u8],
) -> Option<PeerFetch> {
    if payload.len() > BROKER_PACKET_LIMIT {
        return None;
    }
    match (topics.parse(topic), envelope::decode(payload)) {
        (Some(Topic::PeerFetch(d)), Ok(Message::PeerFetch(fetch))) if &d == id => Some(fetch),
        _ => None,
    }
}

/// Decodes an incoming publish; malformed payloads are logged and counted, never fatal.
fn decode(
    topics: &Topics,
    id: &DeviceId,
    topic: &str,
    payload: &[u8],
    malformed: &AtomicU64,
) -> Option<LinkEvent> {
    let bad = |reason: String| {
        malformed_payload(topic, &reason, malformed);
        None
    };
    if payload.len() > BROKER_PACKET_LIMIT {
        return bad(format!(
            "{} bytes, more than the {BROKER_PACKET_LIMIT} bytes a message may have",
            payload.len()
        ));
    }
    let expected = match topics.parse(topic) {
        Some(t @ (Topic::Desired(_) | Topic::Block(_) | Topic::PeerBlock { .. })) => t,
        _ => return bad("unexpected topic".into()),
    };
    if payload.is_empty() && matches!(expected, Topic::Desired(_)) {
        // A cleared retained message: nothing desired.
        return None;
    }
    match (expected, envelope::decode(payload)) {
        (Topic::Desired(d), Ok(Message::Desired(blob))) if &d == id => {
            Some(LinkEvent::Desired(blob))
        }
        (Topic::Block(d), Ok(Message::Block(reply))) if &d == id => Some(LinkEvent::Block(reply)),
        (Topic::PeerBlock { device, source }, Ok(Message::Block(reply))) if &device == id => {
            Some(LinkEvent::PeerBlock {
                peer: source.to_string(),
                reply,
            })
        }
        (_, Ok(other)) => bad(format!("unexpected {} on this topic", other.name())),
        (_, Err(e)) => bad(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// issue 10, case 2: while the agent loop is busy, the poll task keeps what it cannot hand
    /// over without waiting, bounded: one reconnect, every acknowledgement up to a bound, and
    /// only the newest of many desired actions.
    #[test]
    fn a_busy_agent_loop_never_makes_the_poll_task_wait() {
        let (tx, mut rx) = mpsc::channel(1);
        let mut waiting = Undelivered::default();
        let blob = |n: u8| SignedBlob {
            payload: vec![n],
            signer: [0; 32],
            signature: Vec::new(),
        };
        assert!(
            !waiting.offer(LinkEvent::ReportAcked(1), &tx),
            "sent at once"
        );
        assert!(
            waiting.offer(LinkEvent::Desired(blob(1)), &tx),
            "kept: the channel is full"
        );
        for n in 2..=200 {
            waiting.offer(LinkEvent::Desired(blob(n)), &tx);
        }
        waiting.offer(LinkEvent::Connected, &tx);
        waiting.offer(LinkEvent::ReportAcked(2), &tx);
        waiting.offer(
            LinkEvent::Block(BlockReply::Unavailable {
                sha256: [0; 32],
                offset: 0,
                reason: String::new(),
            }),
            &tx,
        );
        assert!(matches!(rx.try_recv(), Ok(LinkEvent::ReportAcked(1))));
        let mut order = Vec::new();
        while let Some(event) = waiting.take() {
            order.push(match event {
                LinkEvent::Connected => "connected".to_owned(),
                LinkEvent::ReportAcked(seq) => format!("ack {seq}"),
                LinkEvent::Desired(b) => format!("desired {}", b.payload[0]),
                LinkEvent::Block(_) | LinkEvent::PeerBlock { .. } => "block".to_owned(),
            });
        }
        assert_eq!(order, ["connected", "ack 2", "desired 200"]);
    }

    #[test]
    fn malformed_payloads_are_counted_not_fatal() {
        let topics = Topics::default();
        let id = DeviceId::new("dev-1").expect("id");
        let counter = AtomicU64::new(0);
        assert!(decode(
            &topics,
            &id,
            &topics.desired(&id),
            b"\x01\x00garbage",
            &counter
        )
        .is_none());
        let report = Message::Fetch(BlockRequest {
            sha256: [0; 32],
            offset: 0,
            length: 1,
        });
        assert!(decode(
            &topics,
            &id,
            &topics.block(&id),
            &envelope::encode(&report),
            &counter
        )
        .is_none());
        assert_eq!(counter.load(Ordering::Relaxed), 2);

        let reply = Message::Block(BlockReply::Data {
            sha256: [1; 32],
            offset: 0,
            data: vec![1],
        });
        assert!(matches!(
            decode(
                &topics,
                &id,
                &topics.block(&id),
                &envelope::encode(&reply),
                &counter
            ),
            Some(LinkEvent::Block(_))
        ));
        assert_eq!(counter.load(Ordering::Relaxed), 2);
    }

    /// Peer requests reach the peer server only when well formed and addressed to this device;
    /// anything else on the topic is counted as malformed, and a full inbox drops and counts.
    #[test]
    fn peer_requests_are_checked_and_a_full_inbox_drops_them() {
        let topics = Topics::default();
        let id = DeviceId::new("dev-1").expect("id");
        let fetch = PeerFetch {
            grant: SignedBlob {
                payload: vec![1],
                signer: [0; 32],
                signature: vec![0; 64],
            },
            request: BlockRequest {
                sha256: [0; 32],
                offset: 0,
                length: 1,
            },
        };
        let payload = envelope::encode(&Message::PeerFetch(fetch.clone()));
        let topic = topics.peer_fetch(&id);
        assert_eq!(
            decode_peer_fetch(&topics, &id, &topic, &payload),
            Some(fetch.clone())
        );
        let other = topics.peer_fetch(&DeviceId::new("dev-2").expect("id"));
        assert_eq!(decode_peer_fetch(&topics, &id, &other, &payload), None);
        assert_eq!(decode_peer_fetch(&topics, &id, &topic, b"\x01junk"), None);
        let huge = vec![0u8; BROKER_PACKET_LIMIT + 1];
        assert_eq!(decode_peer_fetch(&topics, &id, &topic, &huge), None);
        let block = envelope::encode(&Message::Block(BlockReply::Unavailable {
            sha256: [0; 32],
            offset: 0,
            reason: String::new(),
        }));
        assert_eq!(decode_peer_fetch(&topics, &id, &topic, &block), None);

        let (inbox, mut rx) = PeerInbox::new(2);
        assert!(inbox.offer(fetch.clone()));
        assert!(inbox.offer(fetch.clone()));
        assert!(!inbox.offer(fetch.clone()), "a full inbox never waits");
        assert_eq!(inbox.dropped(), 1);
        assert_eq!(rx.try_recv().ok(), Some(fetch));
    }
}
