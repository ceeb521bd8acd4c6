//! The coordinator's Prometheus endpoint: what it counts, served on `GET /metrics` by the
//! coordinator's HTTP server (`service/http`: `[metrics] listen` for metrics alone, `[http]
//! listen` beside the API; both off by default).
//!
//! ```text
//!  service loop ── hooks (one line each in the service) ──> Metrics: counters, histograms
//!       │                                                   │ (prometheus-client registry)
//!       └─ between inputs, if a scrape asked: Snapshot ──> Shared <── scrape task: encode,
//!          (rollouts, devices by phase, totals)                    answer, close
//! ```
//!
//! Counters and histograms are updated where things happen (a message in or out, a malformed
//! payload, a refused request, a block served, an input decided). What follows from the
//! engine's state (rollouts by state, devices by phase per rollout and group) and the totals
//! the service keeps anyway (ignored device messages, store failures, repairs) is not updated
//! per event: a scrape asks for a [`Snapshot`], the service loop builds one as soon as it is done
//! with the input at hand (a message, a control request, its one-second tick) and hands it over,
//! and the scrape answers with it, or with the previous one if the loop is stuck on one input
//! for longer than [`FRESH_WAIT`]. Counting the devices walks every device slot and every
//! accepted device once (about 7 ms for a 100k-device rollout's slots, release build), so it is
//! done at most every [`COUNTS_EVERY`]; a snapshot in between has those counts as last made and
//! everything else fresh. Nothing the HTTP side does ever waits on, or
//! blocks, the service loop; the loop only swaps an `Arc` under a lock nobody holds for long.
//!
//! How connections are bounded (timeouts, a cap, idle connections making room for a scrape) is
//! the server's business (`http/server.rs`, `http/slots.rs`). Every metric is documented in docs/operations.md ("Metrics").

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flotilla_protocol::control::{TraceEntry, TraceKind};
use flotilla_protocol::{BlockReply, ByteCounts, Topics};
use flotilla_rollout::engine::Engine;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::sync::Notify;

use crate::service::enrollment::Ignored;
use crate::service::metrics_limits::LimitCounts;
use crate::service::mqtt::InboxStats;
use crate::service::operators::GateCounts;
use crate::service::tokens::AttemptCounts;

/// How long a scrape waits for the service loop's fresh snapshot before it answers with the
/// previous one.
pub const FRESH_WAIT: Duration = Duration::from_secs(2);

/// The per-device counts of a snapshot (every rollout's slots by phase, the accepted devices
/// without a state) are made at most this often: each is a pass over the fleet, tens of
/// milliseconds of the service loop at 100k devices. A scrape in between gets them as last
/// counted, with every other figure fresh; so a client that scrapes in a loop cannot hold up
/// the loop (a benchmark polling twice every 50 ms doubled a restart's registry time).
pub const COUNTS_EVERY: Duration = Duration::from_secs(1);

/// Seconds: 100 µs to 10 s, for how long one input takes the service loop.
const DECISION_BUCKETS: [f64; 15] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    10.0,
];

fn decision_histogram() -> Histogram {
    Histogram::new(DECISION_BUCKETS)
}

/// The kind of a topic, the `topic` label of the message counters. Worked out from the topic
/// text without allocating, since every message in and out is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopicKind {
    State,
    Report,
    Fetch,
    Desired,
    Block,
    ControlRequest,
    ControlReply,
    RolloutEvent,
    ApprovalEvent,
    EventLog,
    /// Not a flotilla topic under this root.
    Other,
}

impl TopicKind {
    const ALL: [TopicKind; 11] = [
        TopicKind::State,
        TopicKind::Report,
        TopicKind::Fetch,
        TopicKind::Desired,
        TopicKind::Block,
        TopicKind::ControlRequest,
        TopicKind::ControlReply,
        TopicKind::RolloutEvent,
        TopicKind::ApprovalEvent,
        TopicKind::EventLog,
        TopicKind::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            TopicKind::State => "state",
            TopicKind::Report => "report",
            TopicKind::Fetch => "fetch",
            TopicKind::Desired => "desired",
            TopicKind::Block => "block",
            TopicKind::ControlRequest => "control_request",
            TopicKind::ControlReply => "control_reply",
            TopicKind::RolloutEvent => "rollout_event",
            TopicKind::ApprovalEvent => "approval_event",
            TopicKind::EventLog => "event_log",
            TopicKind::Other => "other",
        }
    }

    /// The kind of `topic` under `topics`' root. The shapes are those of
    /// [`Topics::parse`], without checking ids: a message is counted before it is judged.
    pub fn of(topics: &Topics, topic: &str) -> TopicKind {
        let Some(rest) = topic
            .strip_prefix(topics.prefix())
            .and_then(|r| r.strip_prefix('/'))
        else {
            return TopicKind::Other;
        };
        let mut parts = rest.split('/');
        let shape = (parts.next(), parts.next(), parts.next(), parts.next());
        match shape {
            (Some("devices"), Some(_), Some(leaf), None) => match leaf {
                "state" => TopicKind::State,
                "report" => TopicKind::Report,
                "fetch" => TopicKind::Fetch,
                "desired" => TopicKind::Desired,
                "block" => TopicKind::Block,
                _ => TopicKind::Other,
            },
            (Some("control"), Some("request"), None, None) => TopicKind::ControlRequest,
            (Some("control"), Some("reply"), Some(_), None) => TopicKind::ControlReply,
            (Some("events"), Some("rollouts"), Some(_), None) => TopicKind::RolloutEvent,
            (Some("events"), Some("approvals"), Some(_), None) => TopicKind::ApprovalEvent,
            (Some("events"), Some("log"), None, None) => TopicKind::EventLog,
            _ => TopicKind::Other,
        }
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|k| *k == self).unwrap_or(0)
    }
}

/// Why an incoming payload was malformed: the `reason` label of
/// `flotilla_messages_malformed_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Malformed {
    /// Larger than a message may be.
    TooLarge,
    /// Not a flotilla topic under this root.
    UnknownTopic,
    /// Not a flotilla envelope.
    Undecodable,
    /// A valid envelope of the wrong kind for its topic.
    WrongKind,
    /// A marker on the coordinator's marker topic without this connection's nonce.
    BadMarker,
}

impl Malformed {
    const ALL: [Malformed; 5] = [
        Malformed::TooLarge,
        Malformed::UnknownTopic,
        Malformed::Undecodable,
        Malformed::WrongKind,
        Malformed::BadMarker,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Malformed::TooLarge => "too_large",
            Malformed::UnknownTopic => "unknown_topic",
            Malformed::Undecodable => "undecodable",
            Malformed::WrongKind => "wrong_kind",
            Malformed::BadMarker => "bad_marker",
        }
    }
}

/// The kinds of refusal the operator gate names first in its reason (`operators.rs`,
/// `Refusal::reason`), as label values; anything else counts as `other`.
const REFUSALS: [(&str, &str); 9] = [
    ("rate limited", "rate_limited"),
    ("unsigned request", "unsigned"),
    ("malformed request", "malformed"),
    ("unknown key", "unknown_key"),
    ("wrong signature", "wrong_signature"),
    ("clock skew", "clock_skew"),
    ("replayed request", "replayed"),
    ("not allowed", "not_allowed"),
    ("invalid reply_to", "invalid_reply_to"),
];

/// The `reason` label of a refusal's reason text.
pub fn refusal_kind(reason: &str) -> &'static str {
    REFUSALS
        .iter()
        .find(|(prefix, _)| reason.starts_with(prefix))
        .map_or("other", |(_, label)| label)
}

/// What the service loop measures and counts. Owned by the loop; the scrape side reads the
/// same counters through the registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Arc<Registry>,
    shared: Arc<Shared>,
    received: Vec<Counter>,
    published: Vec<Counter>,
    malformed: Vec<Counter>,
    refused: Family<[(&'static str, &'static str); 1], Counter>,
    block_bytes: Counter,
    /// Artifact bytes the coordinator's own HTTP origin sent (`GET /artifacts/{sha256}`),
    /// counted by the HTTP server through the [`Endpoint`].
    http_bytes: Counter,
    block_replies: Family<[(&'static str, &'static str); 1], Counter>,
    device_bytes: Family<[(&'static str, &'static str); 1], Counter>,
    connects: Counter,
    disconnects: Counter,
    decisions: Family<[(&'static str, &'static str); 1], Histogram>,
    transitions: Histogram,
    /// What the operator gate's and enrollment's rate limits refused (`metrics_limits.rs`).
    limits: LimitCounts,
    /// When the input being handled was taken up, and when it published its first desired
    /// action: a group started by this input took from one to the other.
    input_started: Option<Instant>,
    first_desired: Option<Instant>,
}

/// Observes how long an input took the service loop when dropped
/// (`flotilla_rollout_decision_seconds`).
#[derive(Debug)]
#[must_use = "the input is measured until this is dropped"]
pub struct InputTimer {
    started: Instant,
    histogram: Histogram,
}

impl Drop for InputTimer {
    fn drop(&mut self) {
        self.histogram.observe(self.started.elapsed().as_secs_f64());
    }
}

/// What the engine and the service hold, as a scrape shows it.
///
/// The default is what a scrape shows before the service loop hands over its first snapshot:
/// no rollouts, nothing counted, and the registry still loading, since no retained state has
/// been read yet (a coordinator reading its store, or one whose loop is still busy with the
/// retained burst).
#[derive(Debug)]
pub struct Snapshot {
    /// Counted at most every [`COUNTS_EVERY`]; shared with the snapshots in between.
    pub rollouts: Arc<Vec<RolloutRow>>,
    pub ignored: BTreeMap<Ignored, u64>,
    pub unpublishable: u64,
    pub desired_repairs: u64,
    pub store_write_failures: u64,
    pub device_actions_held_back: u64,
    pub store_failing: bool,
    pub registry_loading: bool,
}

impl Default for Snapshot {
    fn default() -> Self {
        Snapshot {
            rollouts: Arc::default(),
            ignored: BTreeMap::new(),
            unpublishable: 0,
            desired_repairs: 0,
            store_write_failures: 0,
            device_actions_held_back: 0,
            store_failing: false,
            registry_loading: true,
        }
    }
}

/// One rollout in a [`Snapshot`].
#[derive(Debug)]
pub struct RolloutRow {
    pub name: String,
    pub release: String,
    pub state: String,
    pub strategy: String,
    /// Group name, and the number of devices in each phase (only phases with devices).
    pub groups: Vec<(String, BTreeMap<String, u64>)>,
}

/// The totals of the service that a [`Snapshot`] carries.
#[derive(Debug, Default, Clone, Copy)]
pub struct Totals {
    pub unpublishable: u64,
    pub desired_repairs: u64,
    pub store_write_failures: u64,
    pub device_actions_held_back: u64,
    pub store_failing: bool,
    pub registry_loading: bool,
}

/// Between the service loop and the scrapes.
#[derive(Debug, Default)]
struct Shared {
    snapshot: Mutex<Arc<Snapshot>>,
    /// A scrape is waiting for a fresh snapshot.
    wanted: AtomicBool,
    fresh: Notify,
    inbox: Mutex<Option<InboxStats>>,
    /// A service loop answers requests for fresh snapshots.
    attached: AtomicBool,
    /// When the last snapshot counted the devices ([`COUNTS_EVERY`]).
    counted_at: Mutex<Option<Instant>>,
}

impl Shared {
    fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// The rollout states, so that `flotilla_rollouts` shows every state, with zero where none is.
const ROLLOUT_STATES: [&str; 9] = [
    "creating",
    "ready",
    "scheduled",
    "starting",
    "running",
    "paused",
    "stopped",
    "finished",
    "failed",
];

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let received = Family::<[(&'static str, &'static str); 1], Counter>::default();
        registry.register(
            "flotilla_messages_received",
            "MQTT messages the coordinator received, by topic kind",
            received.clone(),
        );
        let published = Family::<[(&'static str, &'static str); 1], Counter>::default();
        registry.register(
            "flotilla_messages_published",
            "MQTT messages the coordinator queued for the broker, by topic kind",
            published.clone(),
        );
        let malformed = Family::<[(&'static str, &'static str); 1], Counter>::default();
        registry.register(
            "flotilla_messages_malformed",
            "Incoming payloads dropped as malformed, by reason",
            malformed.clone(),
        );
        let refused = Family::default();
        registry.register(
            "flotilla_control_requests_refused",
            "Control requests the operator gate refused, by reason",
            refused.clone(),
        );
        let block_bytes = Counter::default();
        registry.register(
            "flotilla_artifact_block_bytes_served",
            "Artifact bytes sent to devices in block replies",
            block_bytes.clone(),
        );
        let http_bytes = Counter::default();
        registry.register(
            "flotilla_artifact_http_bytes_served",
            "Artifact bytes sent by the coordinator's HTTP origin (GET /artifacts/{sha256})",
            http_bytes.clone(),
        );
        let block_replies = Family::default();
        registry.register(
            "flotilla_artifact_block_replies",
            "Block replies sent to devices, by result (data or unavailable)",
            block_replies.clone(),
        );
        let device_bytes = Family::default();
        registry.register(
            "flotilla_device_bytes",
            "Bytes devices reported for their finished actions, by source (coordinator, peer, local, http)",
            device_bytes.clone(),
        );
        let connects = Counter::default();
        registry.register(
            "flotilla_link_connects",
            "Times the coordinator's MQTT link connected (the first connect and every reconnect)",
            connects.clone(),
        );
        let disconnects = Counter::default();
        registry.register(
            "flotilla_link_disconnects",
            "Times the coordinator's MQTT link lost its connection",
            disconnects.clone(),
        );
        let decisions =
            Family::<[(&'static str, &'static str); 1], Histogram>::new_with_constructor(
                decision_histogram as fn() -> Histogram,
            );
        registry.register(
            "flotilla_rollout_decision_seconds",
            "How long the service loop took over one input, from taking it up to its effects \
             queued for the broker, by input",
            decisions.clone(),
        );
        let transitions = Histogram::new(DECISION_BUCKETS);
        registry.register(
            "flotilla_update_run_group_transition_seconds",
            "From taking up the input that started a group to the group's first desired \
             action queued for the broker",
            transitions.clone(),
        );
        let shared = Arc::new(Shared::default());
        registry.register_collector(Box::new(SnapshotCollector {
            shared: shared.clone(),
        }));
        let limits = LimitCounts::default();
        registry.register_collector(limits.collector());
        let each = |family: &Family<[(&'static str, &'static str); 1], Counter>,
                    label: &'static str,
                    values: &mut dyn Iterator<Item = &'static str>| {
            values
                .map(|v| family.get_or_create(&[(label, v)]).clone())
                .collect::<Vec<Counter>>()
        };
        Metrics {
            received: each(
                &received,
                "topic",
                &mut TopicKind::ALL.iter().map(|k| k.name()),
            ),
            published: each(
                &published,
                "topic",
                &mut TopicKind::ALL.iter().map(|k| k.name()),
            ),
            malformed: each(
                &malformed,
                "reason",
                &mut Malformed::ALL.iter().map(|m| m.name()),
            ),
            registry: Arc::new(registry),
            shared,
            refused,
            block_bytes,
            http_bytes,
            block_replies,
            device_bytes,
            connects,
            disconnects,
            decisions,
            transitions,
            limits,
            input_started: None,
            first_desired: None,
        }
    }

    /// Adds another part's collector (`coverage.rs`) to what scrapes show; before the
    /// [`Metrics::endpoint`] is taken, or it is not added.
    pub fn register_collector(&mut self, collector: Box<dyn Collector>) {
        if let Some(registry) = Arc::get_mut(&mut self.registry) {
            registry.register_collector(collector);
        }
    }

    /// The scrape side: what `GET /metrics` answers with.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint {
            registry: self.registry.clone(),
            shared: self.shared.clone(),
            http_bytes: self.http_bytes.clone(),
        }
    }

    /// A service loop serves fresh snapshots from now on ([`Metrics::refresh`] when
    /// [`Metrics::wanted`]); scrapes also read the link inbox's counts
    /// (`flotilla_link_incoming_dropped_total`).
    pub fn attach(&self, inbox: InboxStats) {
        self.shared.attached.store(true, Ordering::Release);
        *self
            .shared
            .inbox
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(inbox);
    }

    /// Scrapes show what the operator gate and the enrollment attempt limits refused.
    pub fn watch_limits(&self, gate: Arc<GateCounts>, attempts: Arc<AttemptCounts>) {
        self.limits.watch(gate, attempts);
    }

    /// A message arrived on `topic`: counts it and measures the input until the returned timer
    /// is dropped.
    pub fn received(&mut self, topics: &Topics, topic: &str) -> InputTimer {
        let kind = TopicKind::of(topics, topic);
        self.received[kind.index()].inc();
        self.input(kind.name())
    }

    /// Measures the input `name` (`tick`, `connect`, or a topic kind) until the returned timer
    /// is dropped.
    pub fn input(&mut self, name: &'static str) -> InputTimer {
        let started = Instant::now();
        self.input_started = Some(started);
        self.first_desired = None;
        InputTimer {
            started,
            histogram: self.decisions.get_or_create(&[("input", name)]).clone(),
        }
    }

    /// A message on `topic` was queued for the broker.
    pub fn published(&mut self, topics: &Topics, topic: &str) {
        let kind = TopicKind::of(topics, topic);
        self.published[kind.index()].inc();
        if kind == TopicKind::Desired && self.first_desired.is_none() {
            self.first_desired = Some(Instant::now());
        }
    }

    /// An incoming payload was dropped as malformed.
    pub fn malformed(&mut self, why: Malformed) {
        if let Some(counter) = self
            .malformed
            .get(Malformed::ALL.iter().position(|m| *m == why).unwrap_or(0))
        {
            counter.inc();
        }
    }

    /// The operator gate refused a control request for `reason`.
    pub fn refused(&mut self, reason: &str) {
        self.refused
            .get_or_create(&[("reason", refusal_kind(reason))])
            .inc();
    }

    /// A block reply went to a device.
    pub fn block(&mut self, reply: &BlockReply) {
        let result = match reply {
            BlockReply::Data { data, .. } => {
                self.block_bytes.inc_by(data.len() as u64);
                "data"
            }
            BlockReply::Unavailable { .. } => "unavailable",
        };
        self.block_replies
            .get_or_create(&[("result", result)])
            .inc();
    }

    /// A device's final report said where its bytes came from.
    pub fn device_bytes(&mut self, bytes: &ByteCounts) {
        for (source, n) in [
            ("coordinator", bytes.coordinator),
            ("peer", bytes.from_peers()),
            ("local", bytes.local),
            ("http", bytes.from_http()),
        ] {
            self.device_bytes
                .get_or_create(&[("source", source)])
                .inc_by(n);
        }
    }

    /// The link connected (first or again).
    pub fn connected(&mut self) -> InputTimer {
        self.connects.inc();
        self.input("connect")
    }

    /// The link lost its connection.
    pub fn disconnected(&mut self) {
        self.disconnects.inc();
    }

    /// A trace entry went out: a group that started under the current input, after a desired
    /// action went out, is a group transition.
    pub fn traced(&mut self, entry: &TraceEntry) {
        if entry.kind != TraceKind::GroupStarted {
            return;
        }
        if let (Some(from), Some(to)) = (self.input_started, self.first_desired) {
            self.transitions
                .observe(to.saturating_duration_since(from).as_secs_f64());
        }
    }

    /// Whether a scrape waits for a fresh snapshot; the service loop then calls
    /// [`Metrics::refresh`].
    pub fn wanted(&self) -> bool {
        self.shared.wanted.load(Ordering::Acquire)
    }

    /// Whether the snapshot made now counts the devices again: none was counted in the last
    /// [`COUNTS_EVERY`]. When it says yes, the counting is taken as done at `now`.
    pub fn counts_due(&self, now: Instant) -> bool {
        let mut at = self
            .shared
            .counted_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match *at {
            Some(then) if now.saturating_duration_since(then) < COUNTS_EVERY => false,
            _ => {
                *at = Some(now);
                true
            }
        }
    }

    /// Hands a fresh snapshot of the engine and the service's totals to the waiting scrapes.
    /// With `count` false the rollouts' device counts are the last snapshot's
    /// ([`Metrics::counts_due`]).
    pub fn refresh(
        &self,
        engine: &Engine,
        ignored: &BTreeMap<Ignored, u64>,
        totals: Totals,
        count: bool,
    ) {
        self.shared.wanted.store(false, Ordering::Release);
        let rollouts = if count {
            Arc::new(rollout_rows(engine))
        } else {
            self.shared.snapshot().rollouts.clone()
        };
        let snapshot = Arc::new(snapshot(rollouts, ignored, totals));
        *self
            .shared
            .snapshot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = snapshot;
        self.shared.fresh.notify_waiters();
    }
}

/// Counts every rollout's devices by group and phase; a pass over the slots, done only when a
/// scrape asks, at most every [`COUNTS_EVERY`].
fn rollout_rows(engine: &Engine) -> Vec<RolloutRow> {
    engine
        .rollouts()
        .map(|r| RolloutRow {
            name: r.name.clone(),
            release: r.release.name.clone(),
            state: r.state.to_string(),
            strategy: r.spec.vocabulary().to_owned(),
            groups: r
                .groups
                .iter()
                .map(|g| {
                    let mut phases: BTreeMap<String, u64> = BTreeMap::new();
                    for slot in g.slots.values() {
                        let phase = slot.phase_name();
                        match phases.get_mut(phase) {
                            Some(n) => *n += 1,
                            None => {
                                phases.insert(phase.to_owned(), 1);
                            }
                        }
                    }
                    (g.name.clone(), phases)
                })
                .collect(),
        })
        .collect()
}

fn snapshot(
    rollouts: Arc<Vec<RolloutRow>>,
    ignored: &BTreeMap<Ignored, u64>,
    totals: Totals,
) -> Snapshot {
    Snapshot {
        rollouts,
        ignored: ignored.clone(),
        unpublishable: totals.unpublishable,
        desired_repairs: totals.desired_repairs,
        store_write_failures: totals.store_write_failures,
        device_actions_held_back: totals.device_actions_held_back,
        store_failing: totals.store_failing,
        registry_loading: totals.registry_loading,
    }
}

/// Encodes the snapshot's gauges and totals at scrape time.
#[derive(Debug)]
struct SnapshotCollector {
    shared: Arc<Shared>,
}

impl SnapshotCollector {
    fn counter(
        encoder: &mut DescriptorEncoder,
        name: &str,
        help: &str,
        value: u64,
    ) -> Result<(), std::fmt::Error> {
        let counter = ConstCounter::new(value);
        let metric = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
        counter.encode(metric)
    }
}

impl Collector for SnapshotCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let snap = self.shared.snapshot();
        let gauge = ConstGauge::new(0i64).metric_type();

        let mut by_state: BTreeMap<&str, i64> = ROLLOUT_STATES.iter().map(|s| (*s, 0)).collect();
        for r in snap.rollouts.iter() {
            *by_state.entry(r.state.as_str()).or_default() += 1;
        }
        let mut metric = encoder.encode_descriptor(
            "flotilla_rollouts",
            "Rollouts the coordinator holds, by state",
            None,
            gauge,
        )?;
        for (state, n) in &by_state {
            ConstGauge::new(*n).encode(metric.encode_family(&[("state", *state)])?)?;
        }

        let mut metric = encoder.encode_descriptor(
            "flotilla_rollout_info",
            "One per rollout: its release, state and strategy vocabulary (always 1)",
            None,
            gauge,
        )?;
        for r in snap.rollouts.iter() {
            let labels = [
                ("rollout", r.name.as_str()),
                ("release", r.release.as_str()),
                ("state", r.state.as_str()),
                ("strategy", r.strategy.as_str()),
            ];
            ConstGauge::new(1i64).encode(metric.encode_family(&labels)?)?;
        }

        let mut metric = encoder.encode_descriptor(
            "flotilla_rollout_devices",
            "Devices of a rollout's group in each phase (phases without devices are left out)",
            None,
            gauge,
        )?;
        for r in snap.rollouts.iter() {
            for (group, phases) in &r.groups {
                for (phase, n) in phases {
                    let labels = [
                        ("rollout", r.name.as_str()),
                        ("group", group.as_str()),
                        ("phase", phase.as_str()),
                    ];
                    let n = i64::try_from(*n).unwrap_or(i64::MAX);
                    ConstGauge::new(n).encode(metric.encode_family(&labels)?)?;
                }
            }
        }

        let counter = ConstCounter::new(0u64).metric_type();
        let mut metric = encoder.encode_descriptor(
            "flotilla_device_messages_ignored",
            "Device messages ignored by the enrollment checks, by reason",
            None,
            counter,
        )?;
        for (why, n) in &snap.ignored {
            let reason = why.name().replace(' ', "_");
            ConstCounter::new(*n).encode(metric.encode_family(&[("reason", reason.as_str())])?)?;
        }

        Self::counter(
            &mut encoder,
            "flotilla_messages_unpublishable",
            "Messages not published: a topic or a size the broker would refuse",
            snap.unpublishable,
        )?;
        Self::counter(
            &mut encoder,
            "flotilla_desired_repairs",
            "Retained desired topics found holding something else and published again",
            snap.desired_repairs,
        )?;
        Self::counter(
            &mut encoder,
            "flotilla_store_write_failures",
            "Writes to the store that failed",
            snap.store_write_failures,
        )?;
        Self::counter(
            &mut encoder,
            "flotilla_device_actions_held_back",
            "Device actions not published because the store could not be written",
            snap.device_actions_held_back,
        )?;
        let failing = ConstGauge::new(i64::from(snap.store_failing));
        let metric = encoder.encode_descriptor(
            "flotilla_store_failing",
            "1 while the store cannot be written (changes refused, device actions held back)",
            None,
            failing.metric_type(),
        )?;
        failing.encode(metric)?;
        let loading = ConstGauge::new(i64::from(snap.registry_loading));
        let metric = encoder.encode_descriptor(
            "flotilla_registry_loading",
            "1 while the retained device states delivered after a (re)connect are still being read",
            None,
            loading.metric_type(),
        )?;
        loading.encode(metric)?;

        let inbox = self
            .shared
            .inbox
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        if let Some(inbox) = inbox {
            Self::counter(
                &mut encoder,
                "flotilla_link_incoming_dropped",
                "Incoming messages dropped because the coordinator was behind (its inbox full)",
                inbox.dropped(),
            )?;
            Self::counter(
                &mut encoder,
                "flotilla_link_incoming_oversized",
                "Incoming messages dropped unread because they were larger than a message may be",
                inbox.oversized(),
            )?;
            let queued = ConstGauge::new(i64::try_from(inbox.queued_bytes()).unwrap_or(i64::MAX));
            let metric = encoder.encode_descriptor(
                "flotilla_link_inbox_bytes",
                "Bytes of incoming messages waiting for the service loop",
                None,
                queued.metric_type(),
            )?;
            queued.encode(metric)?;
        }
        Ok(())
    }
}

/// The content type of the OpenMetrics text format, which Prometheus reads.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The scrape side of [`Metrics`]: cheap to clone, one per connection.
#[derive(Debug, Clone)]
pub struct Endpoint {
    registry: Arc<Registry>,
    shared: Arc<Shared>,
    http_bytes: Counter,
}

impl Endpoint {
    /// Counts `n` artifact bytes sent by the HTTP origin.
    pub fn http_artifact_bytes(&self, n: u64) {
        self.http_bytes.inc_by(n);
    }

    /// The metrics as OpenMetrics text, with a snapshot taken after this call when the loop
    /// answers within [`FRESH_WAIT`].
    pub async fn render(&self) -> String {
        let fresh = self.shared.fresh.notified();
        tokio::pin!(fresh);
        fresh.as_mut().enable();
        if self.shared.attached.load(Ordering::Acquire) {
            self.shared.wanted.store(true, Ordering::Release);
            let _ = tokio::time::timeout(FRESH_WAIT, fresh).await;
        }
        let mut text = String::new();
        // Writing into a String cannot fail; an encoder error would be a bug in a collector.
        if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            tracing::error!(error = %e, "cannot encode the metrics");
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_kinds_follow_the_topic_shapes() {
        let topics = Topics::new("site-a/flotilla");
        let id = flotilla_protocol::DeviceId::new("dev-1").expect("id");
        let cases = [
            (topics.state(&id), TopicKind::State),
            (topics.report(&id), TopicKind::Report),
            (topics.fetch(&id), TopicKind::Fetch),
            (topics.desired(&id), TopicKind::Desired),
            (topics.block(&id), TopicKind::Block),
            (topics.rollout_event("r1"), TopicKind::RolloutEvent),
            (topics.approval_event("a1"), TopicKind::ApprovalEvent),
            (topics.event_log(), TopicKind::EventLog),
            (
                "site-a/flotilla/v1/control/request".to_owned(),
                TopicKind::ControlRequest,
            ),
            (
                "site-a/flotilla/v1/control/reply/cli-1".to_owned(),
                TopicKind::ControlReply,
            ),
            (
                "flotilla/v1/devices/dev-1/state".to_owned(),
                TopicKind::Other,
            ),
            (
                "site-a/flotilla/v1/devices/dev-1/state/x".to_owned(),
                TopicKind::Other,
            ),
            ("site-a/flotilla/v1".to_owned(), TopicKind::Other),
        ];
        for (topic, kind) in cases {
            assert_eq!(TopicKind::of(&topics, &topic), kind, "{topic}");
        }
    }

    #[test]
    fn refusals_are_labelled_by_their_kind() {
        assert_eq!(
            refusal_kind("clock skew: request at 10, coordinator at 99"),
            "clock_skew"
        );
        assert_eq!(
            refusal_kind("not allowed: viewer may not start"),
            "not_allowed"
        );
        assert_eq!(refusal_kind("something new"), "other");
    }

    fn loading_gauge(text: &str) -> &str {
        text.lines()
            .find_map(|l| l.strip_prefix("flotilla_registry_loading "))
            .expect("the gauge is always shown")
    }

    #[tokio::test]
    async fn a_scrape_before_the_first_snapshot_says_the_registry_is_loading() {
        // A dashboard polling flotilla_registry_loading during a restart must not see 0 (done)
        // before the coordinator has read a single retained state.
        let metrics = Metrics::new();
        let endpoint = metrics.endpoint();
        assert_eq!(loading_gauge(&endpoint.render().await), "1");

        let engine = Engine::new(flotilla_rollout::zoneinfo::SystemZones);
        let totals = |registry_loading| Totals {
            unpublishable: 0,
            desired_repairs: 0,
            store_write_failures: 0,
            device_actions_held_back: 0,
            store_failing: false,
            registry_loading,
        };
        metrics.refresh(&engine, &BTreeMap::new(), totals(true), true);
        assert_eq!(loading_gauge(&endpoint.render().await), "1");
        // Between two countings of the devices the flag is still fresh.
        metrics.refresh(&engine, &BTreeMap::new(), totals(false), false);
        assert_eq!(
            loading_gauge(&endpoint.render().await),
            "0",
            "the marker came back"
        );
    }

    #[test]
    fn the_devices_are_counted_at_most_once_a_second_however_often_scrapes_ask() {
        let metrics = Metrics::new();
        let start = Instant::now();
        assert!(metrics.counts_due(start), "the first snapshot counts");
        for ms in [1, 50, 500, 999] {
            assert!(
                !metrics.counts_due(start + Duration::from_millis(ms)),
                "a scrape {ms} ms later gets the last counts"
            );
        }
        assert!(metrics.counts_due(start + COUNTS_EVERY));
        assert!(!metrics.counts_due(start + COUNTS_EVERY + Duration::from_millis(10)));
    }

    #[tokio::test]
    async fn a_standby_says_it_loads_nothing() {
        // What `standby.rs` hands over before its first scrape: an empty engine, no totals.
        let metrics = Metrics::new();
        let nothing = Engine::new(flotilla_rollout::zoneinfo::SystemZones);
        metrics.refresh(&nothing, &BTreeMap::new(), Totals::default(), true);
        assert_eq!(loading_gauge(&metrics.endpoint().render().await), "0");
    }
}
