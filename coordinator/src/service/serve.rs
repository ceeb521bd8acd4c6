//! `flotilla serve`: the coordinator service around the sans-I/O engine.
//!
//! One task owns the [`Engine`] and feeds it everything: device states and reports from MQTT,
//! control requests, a one-second tick, and a reissue after every (re)connect. It applies the
//! engine's effects strictly in order, and persistence comes first: a `Save` is written and
//! flushed to sled before any desired action it justifies is published, so after a crash the
//! store never claims less than what devices were told (ADR 0003). A failed save stops the
//! service rather than publish past what is stored.
//!
//! Everything else is plumbing: the optional embedded broker, the MQTT link (`mqtt.rs`), the
//! artifact block server, and signing desired actions with the coordinator key. A malformed
//! payload is logged with its topic and reason, counted, and skipped; it never stops the loop.
//!
//! Control requests pass the operator gate (`operators.rs`) first: signed by a configured
//! operator key, inside the clock window, not a replay, within the operator's role. A refusal
//! is answered with its reason on a valid `reply_to`; the operator's name goes with an accepted
//! command into the engine, whose trace says who did what.
//!
//! After every (re)connect the service is *loading* until its end-of-retained marker comes back
//! (`loading.rs`, decision 0033): control requests are then read ahead of the retained burst
//! (the link's control lane, `mqtt.rs`), reads are answered at once marked `loading`, and every
//! other command is held, in order and bounded, until every retained state is read.
//!
//! Nothing a device sends reaches the engine unverified: states, reports and block requests are
//! signed device messages, checked against the device's enrolled key by the enrollment
//! [`Registry`] (`enrollment.rs`) before the engine or the block server sees them; everything
//! else is ignored and counted, with at most one log line per interval. Blocks go only to
//! devices that hold an action for the artifact or block list.
//!
//! An install the engine names peers for goes out as `InstallWithPeers` with a peer grant signed
//! by the coordinator key (`grants.rs`, docs/peers.md). A final report that says where its bytes
//! came from (`ReportWithBytes`) is handled as its report, and its bytes are counted by source
//! once per device and action ([`Service::observe_bytes`], `/metrics`).
//!
//! Day-2 operations (docs/operations.md) are control commands too: approvals, a manual start of
//! the next group, retrying failed devices, deleting a device, and the two kinds of named objects
//! the service keeps in its own store rather than in the engine: staged update strategies (TOML
//! text that staged rollout specs refer to by name) and device groups (named selectors). The
//! engine gets the full list of device groups at startup and after every change.

use flotilla_rollout::zoneinfo::SystemZones;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use flotilla_protocol::control::{
    Command, ControlReply, ControlRequest, DeviceGroupInfo, DeviceSummary, PageQuery, RolloutPage,
    StrategyInfo,
};
use flotilla_protocol::manifest::Manifest;
use flotilla_protocol::operator::Role;
use flotilla_protocol::{
    envelope, validate_id, ActionBody, ActionKind, BlockReply, BypassedPeer, ByteCounts,
    DesiredAction, DeviceId, DeviceMessage, Digest, Message, SignedBlob,
};
use flotilla_protocol::{
    SigningKey, Topic, Topics, VerifyingKey, BROKER_PACKET_LIMIT, MAX_PACKET_SIZE,
};
use rumqttc::{AsyncClient, QoS};
use tokio_util::sync::CancellationToken;

use crate::service::artifacts::BlockServer;
use crate::service::backup;
use crate::service::broker::{BrokerError, EmbeddedBroker};
use crate::service::config::Config;
use crate::service::enrollment::{self, Ignored, IgnoredLog, Registry};
use crate::service::grants;
use crate::service::keys::{self, KeysError};
use crate::service::loading::{self, Loading, MarkerSeen};
use crate::service::metrics::{self, Malformed, Metrics, Totals};
use crate::service::mqtt::{self, LinkEvent, LinkOptions};
use crate::service::operators::Gate;
use crate::service::page::Pager;
use crate::service::releases::{self, ReleaseStore};
use crate::service::seal::{Seal, SealCheck};
use crate::service::sequence::ActionSequence;
use crate::service::store::{self, Store, StoreError, StoredStrategy};
use crate::service::store_health::{self, StoreHealth};
use crate::service::verify::{self, Arrival, Checked, KeyCache};
use flotilla_rollout::engine::{cancel_action_id, Effect, Engine, ReleaseRef};
use flotilla_rollout::planner::DeviceGroup;
use flotilla_rollout::selector::Selector;
use flotilla_rollout::spec::RolloutSpec;

/// How often the engine's timers are evaluated.
const TICK: Duration = Duration::from_secs(1);

/// Control requests read from the lane in a row before a device message (or a tick) gets a turn.
const LANE_STREAK: u32 = 64;

/// At most one log line per this interval about ignored device messages.
const IGNORED_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Why the service stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Broker(#[from] BrokerError),
    #[error("embedded broker start-up task failed: {reason}")]
    BrokerTask { reason: String },
    #[error("cannot start the signature worker threads ([service] verify_threads = {threads}): {reason}")]
    VerifyThreads { threads: usize, reason: String },
    #[error("cannot load the coordinator key: {0}")]
    Key(#[from] KeysError),
    /// The store's own error already names the path.
    #[error("{source}")]
    OpenStore { path: PathBuf, source: StoreError },
    #[error("cannot load rollouts from {path}: {source}")]
    LoadRollouts { path: PathBuf, source: StoreError },
    #[error("cannot load device groups from {path}: {source}")]
    LoadGroups { path: PathBuf, source: StoreError },
    #[error("cannot load the per-device action sequence from {path}: {source}")]
    LoadSequence { path: PathBuf, source: StoreError },
    #[error(
        "the store at {} holds {stored} commits but {sealed} were acknowledged (its seal {}): \
         {} acknowledged writes are missing, the newest rollouts or device records may be lost. \
         Restore the latest backup (`flotilla restore`), or accept the store as it is with \
         `flotilla store reseal` (docs/operations.md, \"Backup and restore\")",
        path.display(), seal.display(), sealed - stored
    )]
    StoreLost {
        path: PathBuf,
        seal: PathBuf,
        stored: u64,
        sealed: u64,
    },
    #[error(
        "no room to open the store in {} ({reason}) and no reserve left to release: free some \
         space and start again",
        data_dir.display()
    )]
    NoRoom { data_dir: PathBuf, reason: String },
    #[error("cannot check the store's seal: {0}")]
    Seal(StoreError),
    #[error("the MQTT link to {addr} stopped unexpectedly")]
    LinkClosed { addr: String },
    #[error("cannot read the authorized device keys {path}: {reason}")]
    AuthorizedKeys { path: PathBuf, reason: String },
    #[error("cannot load device enrollments from {path}: {source}")]
    LoadEnrollments { path: PathBuf, source: StoreError },
    #[error(transparent)]
    Metrics(#[from] metrics::ListenError),
}

/// Seconds since the Unix epoch.
fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Runs the coordinator until `shutdown` is cancelled.
pub async fn serve(config: Config, shutdown: CancellationToken) -> Result<(), ServiceError> {
    let _broker = match config.broker.embedded {
        // The broker start polls its port with blocking connects; keep that off the runtime.
        Some(addr) => Some(
            tokio::task::spawn_blocking(move || EmbeddedBroker::start(addr))
                .await
                .map_err(|e| ServiceError::BrokerTask {
                    reason: e.to_string(),
                })??,
        ),
        None => None,
    };
    let key = keys::load_secret_key(&config.coordinator_key)?;
    let db = config.data_dir.join("db");
    // sled writes while it opens; an open that runs out of space can leave the store unreadable.
    // Errors other than a full disk (a missing or unwritable directory) are left to the store's
    // own open, which names them.
    let _ = std::fs::create_dir_all(&config.data_dir);
    match store_health::has_room(&config.data_dir) {
        Err(e) if store_health::is_no_space(&e) => {
            if store_health::release_reserve(&config.data_dir) {
                tracing::warn!(data_dir = %config.data_dir.display(), error = %e,
                    "the disk is full: released the reserve so the store can open; the coordinator refuses changes until there is room");
            } else {
                return Err(ServiceError::NoRoom {
                    data_dir: config.data_dir.clone(),
                    reason: e.to_string(),
                });
            }
        }
        _ => {}
    }
    let opening = std::time::Instant::now();
    let store = Store::open(&db).map_err(|source| ServiceError::OpenStore {
        path: db.clone(),
        source,
    })?;
    store_health::ensure_reserve(&config.data_dir);
    match store.check_seal().map_err(ServiceError::Seal)? {
        SealCheck::Lost { stored, sealed } => {
            return Err(ServiceError::StoreLost {
                path: db.clone(),
                seal: Seal::for_store(&db).path().to_owned(),
                stored,
                sealed,
            })
        }
        SealCheck::Unsealed if store.generation() > 0 => {
            tracing::warn!(store = %db.display(), "the store's seal is missing: lost writes cannot be detected until the next write seals it again");
        }
        SealCheck::Unsealed | SealCheck::Intact => {}
    }
    let opened_ms = opening.elapsed().as_millis();
    let rollouts = store
        .load_rollouts()
        .map_err(|source| ServiceError::LoadRollouts {
            path: db.clone(),
            source,
        })?;
    let rollouts_ms = opening.elapsed().as_millis() - opened_ms;
    let groups = store
        .list_groups()
        .map_err(|source| ServiceError::LoadGroups {
            path: db.clone(),
            source,
        })?;
    let issued = store
        .load_issued()
        .map_err(|source| ServiceError::LoadSequence {
            path: db.clone(),
            source,
        })?;
    let authorized = match &config.enrollment.authorized_keys {
        None => Vec::new(),
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| e.to_string())
            .and_then(|text| enrollment::parse_authorized_keys(&text))
            .map_err(|reason| ServiceError::AuthorizedKeys {
                path: path.clone(),
                reason,
            })?,
    };
    let load_enrollments = |source| ServiceError::LoadEnrollments {
        path: db.clone(),
        source,
    };
    let registry = Registry::new(
        store.list_enrollments().map_err(load_enrollments)?,
        authorized,
        config.enrollment.tokens.clone(),
        store.used_tokens().map_err(load_enrollments)?,
        config.enrollment.max_pending,
    );
    let loaded_ms = opening.elapsed().as_millis();
    let (rollout_count, group_count) = (rollouts.len(), groups.len());
    let mut engine = Engine::restore(rollouts, SystemZones);
    engine.set_device_groups(groups);
    // Where a restart's time goes before the coordinator connects (docs/performance.md).
    tracing::info!(rollouts = rollout_count, device_groups = group_count, enrollments = registry.all().count(),
        data_dir = %config.data_dir.display(), store_open_ms = opened_ms, rollouts_ms,
        other_records_ms = loaded_ms - opened_ms - rollouts_ms, engine_ms = opening.elapsed().as_millis() - loaded_ms,
        "coordinator starting");

    let topics = Topics::new(&config.broker.topic_root);
    let gate = Gate::new(
        config.operators.clone(),
        config.clock_window,
        topics.clone(),
        now(),
    );
    if gate.operator_count() == 0 {
        tracing::warn!("no [[operators]] configured: every control request will be refused");
    }
    let metrics = Metrics::new();
    if let Some(addr) = config.metrics {
        let listener = metrics::bind(addr).await?;
        tracing::info!(%addr, "serving metrics on http://{addr}/metrics");
        tokio::spawn(metrics::run(listener, metrics.endpoint(), shutdown.clone()));
    }
    // The link gets its own token: on shutdown the final effects must still be published.
    let link_token = CancellationToken::new();
    // A stable client id, so the broker's ACL can name the coordinator (and a second
    // coordinator started by mistake takes the connection over instead of running beside it).
    let mut filters = topics.coordinator_filters();
    filters.push(topics.desired_filter());
    // The coordinator's own marker (`loading.rs`) and a lane of its own for control requests.
    filters.push(topics.marker());
    let options = LinkOptions::with_connection(
        config.connection(),
        config.broker.client_id.clone(),
        filters,
    )
    .with_lane(topics.control_request());
    tracing::info!(broker = %options.connection.describe(), client = %options.client_id, "connecting to the MQTT broker");
    let link = mqtt::start(options, link_token.clone());
    let inbox = link.events.stats();
    metrics.attach(inbox.clone());
    let mqtt::MqttLink {
        client: link_client,
        events,
        lane: mut control,
        lane_open,
        task: link_task,
        ..
    } = link;
    let mut control_open = true;
    let mut lane_streak = 0u32;
    // Device signatures are checked on worker threads; the loop gets the events in order.
    let keys = Arc::new(KeyCache::new(verify::KEY_CACHE_CAPACITY));
    let mut incoming =
        verify::start(events, topics.clone(), config.verify_threads, keys).map_err(|e| {
            ServiceError::VerifyThreads {
                threads: config.verify_threads,
                reason: e.to_string(),
            }
        })?;
    tracing::info!(
        threads = config.verify_threads,
        "checking device signatures ahead of the service loop"
    );
    let releases = ReleaseStore::new(&config.data_dir);
    let mut service = Service {
        engine,
        store,
        verifying_key: key.verifying_key(),
        desired_known: 0,
        key,
        blocks: BlockServer::new(releases.artifacts_dir()),
        releases,
        manifests: HashMap::new(),
        sequence: ActionSequence::new(issued),
        topics,
        client: link_client,
        validity: config.action_validity,
        addr: config.broker_addr(),
        malformed: 0,
        malformed_logged: None,
        unpublishable: 0,
        repaired: HashMap::new(),
        desired_repairs: 0,
        gate,
        refused: 0,
        registry,
        ignored: IgnoredLog::new(IGNORED_LOG_INTERVAL),
        release_digests: HashMap::new(),
        holdings: HashMap::new(),
        bytes_counted: HashMap::new(),
        health: StoreHealth::default(),
        data_dir: config.data_dir.clone(),
        metrics,
        loading: Loading::new(loading::MAX_HELD, config.marker_timeout),
        lane_open,
    };

    let mut ticker = tokio::time::interval(TICK);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let result = loop {
        // Far enough never to fire when no marker is awaited (the branch is disabled then).
        let marker_due = service.loading.deadline();
        let marker_wait = marker_due.unwrap_or_else(|| tokio::time::Instant::now() + TICK * 3600);
        let step = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break Ok(()),
            // Control requests first: they must not wait behind a burst of device traffic. At
            // most LANE_STREAK in a row, so a flood of them cannot stall the device messages
            // (and the marker) behind them.
            request = control.recv(), if control_open && lane_streak < LANE_STREAK => match request {
                Some(LinkEvent::Publish { topic, payload }) => {
                    lane_streak += 1;
                    service.on_publish(&topic, &payload, None).await
                }
                Some(_) => Ok(()),
                None => {
                    control_open = false;
                    Ok(())
                }
            },
            event = incoming.recv() => match event {
                Some(event) => {
                    lane_streak = 0;
                    service.on_link_event(event).await
                }
                None => Err(ServiceError::LinkClosed { addr: service.addr.clone() }),
            },
            _ = tokio::time::sleep_until(marker_wait), if marker_due.is_some() => {
                service.marker_overdue().await
            }
            _ = ticker.tick() => {
                lane_streak = 0;
                let _timing = service.metrics.input("tick");
                let effects = service.engine.tick(now());
                match service.apply(effects).await {
                    Ok(()) => service.retry_store().await,
                    Err(e) => Err(e),
                }
            }
        };
        if let Err(e) = step {
            break Err(e);
        }
        service.refresh_metrics();
    };
    if result.is_ok() {
        // Persist whatever per-device progress the last tick has not saved yet.
        let effects = service.engine.tick(now());
        service.apply(effects).await?;
    }
    link_token.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(2), link_task).await;
    if service.health.is_failing() {
        // Closing a sled instance after a failed write can wait forever on a full disk; what
        // it acknowledged is on disk already.
        service.store.abandon();
    }
    tracing::info!(
        incoming_dropped = inbox.dropped(),
        store_write_failures = service.health.failures,
        device_actions_held_back = service.health.held_back,
        malformed_payloads = service.malformed,
        unpublishable = service.unpublishable,
        desired_repairs = service.desired_repairs,
        desired_recognised_unchecked = service.desired_known,
        refused_control_requests = service.refused,
        ignored_device_messages = service.ignored.total(),
        "coordinator stopped"
    );
    result
}

struct Service {
    engine: Engine,
    store: Store,
    key: SigningKey,
    /// `key`'s public half, decompressed once.
    verifying_key: VerifyingKey,
    /// Retained desired actions recognised as this coordinator's by their bytes, without a
    /// signature check (see [`Service::our_desired_action`]).
    desired_known: u64,
    releases: ReleaseStore,
    /// Signed manifests by release name. Release names are never reused, so a cached blob
    /// cannot go stale, and a group start does not re-read the file once per device.
    manifests: HashMap<String, SignedBlob>,
    /// The `issued_at` of the next action per device (see [`ActionSequence`]).
    sequence: ActionSequence,
    blocks: BlockServer,
    topics: Topics,
    client: AsyncClient,
    validity: u64,
    addr: String,
    malformed: u64,
    /// When the last malformed-payload line was logged.
    malformed_logged: Option<std::time::Instant>,
    /// Publishes dropped because the topic or the size could not go out (see [`Service::publish`]).
    unpublishable: u64,
    /// Device id -> when its retained `desired` topic was last repaired.
    repaired: HashMap<String, u64>,
    /// Retained `desired` topics found holding something else and published again.
    desired_repairs: u64,
    /// Checks who sent each control request and whether they may.
    gate: Gate,
    refused: u64,
    /// Device keys and enrollment: which signed device messages pass.
    registry: Registry,
    /// Device messages ignored (unsigned, another key, not accepted…), counted and rate-limited.
    ignored: IgnoredLog,
    /// The digests of each release (artifacts and block lists), for deciding who may fetch what.
    release_digests: HashMap<String, Vec<Digest>>,
    /// Device id -> the artifacts of the install its retained desired action (signed with this
    /// coordinator's key) names: what it published itself, and what it reads back from the
    /// retained `desired` topics (after a restart, or another instance with the same key).
    holdings: HashMap<String, Vec<Digest>>,
    /// Device id -> the action whose bytes by source were last counted.
    bytes_counted: HashMap<String, String>,
    /// Whether the store can be written (`store_health.rs`).
    health: StoreHealth,
    data_dir: PathBuf,
    /// Counters and timings for the metrics endpoint (`metrics.rs`).
    metrics: Metrics,
    /// Whether every retained state is read yet, and the commands waiting for it.
    loading: Loading<Held>,
    /// Whether control requests take the lane ahead of device traffic (`mqtt.rs`): while
    /// loading. Afterwards they are read in arrival order with everything else.
    lane_open: Arc<std::sync::atomic::AtomicBool>,
}

/// A control request that passed the gate and waits for the registry to be complete.
struct Held {
    request: ControlRequest,
    operator: String,
}

impl Service {
    /// Counts a malformed payload; logs the first and then at most one line a minute, so a
    /// flood of garbage cannot flood the log.
    fn reject(&mut self, topic: &str, why: Malformed, reason: &str) {
        self.malformed += 1;
        self.metrics.malformed(why);
        let now = std::time::Instant::now();
        if self
            .malformed_logged
            .is_none_or(|at| now.duration_since(at) >= Duration::from_secs(60))
        {
            self.malformed_logged = Some(now);
            let topic: String = topic.chars().take(200).collect();
            tracing::warn!(%topic, %reason, malformed_total = self.malformed,
                "ignoring malformed payload (next such line in a minute at the earliest)");
        }
    }

    /// Hands the metrics endpoint a fresh snapshot when a scrape waits for one.
    fn refresh_metrics(&self) {
        if self.metrics.wanted() {
            let totals = Totals {
                unpublishable: self.unpublishable,
                desired_repairs: self.desired_repairs,
                store_write_failures: self.health.failures,
                device_actions_held_back: self.health.held_back,
                store_failing: self.health.is_failing(),
                registry_loading: self.loading.is_loading(),
            };
            self.metrics
                .refresh(&self.engine, &self.ignored.total, totals);
        }
    }

    /// Where the bytes of a device's finished action came from. Counted by source for
    /// `/metrics`; this is the one place bytes by source enter the service.
    /// The engine keeps them per rollout and per site, and traces the peers the device bypassed.
    fn observe_bytes(
        &mut self,
        device: &str,
        action_id: &str,
        bytes: &ByteCounts,
        bypassed: &[BypassedPeer],
        now: u64,
    ) -> Vec<Effect> {
        // A report sent again (the agent repeats it until it is acknowledged) counts once.
        if self.bytes_counted.get(device).map(String::as_str) == Some(action_id) {
            return Vec::new();
        }
        self.bytes_counted
            .insert(device.to_owned(), action_id.to_owned());
        tracing::debug!(%device, %action_id, coordinator = bytes.coordinator,
            peers = bytes.from_peers(), local = bytes.local, "bytes by source");
        self.metrics.device_bytes(bytes);
        self.engine.observe_bytes(device, action_id, bytes.clone());
        self.engine
            .observe_bypassed(device, action_id, bypassed, now)
    }

    /// Counts an ignored device message; logs at most one line per interval.
    fn ignore(&mut self, topic: &str, why: Ignored) {
        if let Some(line) = self.ignored.count(why, topic, std::time::Instant::now()) {
            tracing::warn!(ignored_total = self.ignored.total(), "{line}");
        }
    }

    /// Stores a device's enrollment record. A failure puts the service into its failing-store
    /// mode; the recovery writes every enrollment again.
    /// The error is for an operator's reply.
    fn save_enrollment(&mut self, device: &str) -> Result<(), String> {
        let Some(record) = self.registry.get(device) else {
            return Ok(());
        };
        self.store.save_enrollment(record).map_err(|e| {
            self.store_failed(&e);
            format!(
                "cannot store the change: {e}; it holds in memory and is written when the store \
                 can be written again"
            )
        })
    }

    /// A store write under an operator's command failed: the store is failing from now on, and
    /// the operator gets the reason.
    fn write_failed(&mut self, error: StoreError) -> String {
        self.store_failed(&error);
        error.to_string()
    }

    /// A store write failed: from now on nothing that needs it goes out (`store_health.rs`).
    fn store_failed(&mut self, error: &StoreError) {
        if self.health.fail(error.to_string(), now()) {
            tracing::error!(store = %self.store.path().display(), %error,
                "the store cannot be written: refusing changes and holding back device actions until it can");
        }
    }

    /// While the store is failing, tries it again every few seconds: once there is room, it is
    /// reopened, everything in memory is written again, and each device is sent what it is owed.
    async fn retry_store(&mut self) -> Result<(), ServiceError> {
        if !self.health.attempt_due(std::time::Instant::now()) {
            return Ok(());
        }
        if let Err(e) = store_health::has_room(&self.data_dir) {
            self.health.fail(
                format!("no room in {}: {e}", self.data_dir.display()),
                now(),
            );
            return Ok(());
        }
        if let Err(e) = self.resave() {
            self.store_failed(&e);
            return Ok(());
        }
        let since = self.health.recovered().unwrap_or_default();
        store_health::ensure_reserve(&self.data_dir);
        tracing::info!(store = %self.store.path().display(), failed_for_s = now().saturating_sub(since),
            device_actions_held_back = self.health.held_back,
            "the store can be written again; every rollout and enrollment is saved, reissuing what each device is owed");
        let effects = self.engine.reissue(now());
        self.apply(effects).await
    }

    /// Reopens the store and writes every rollout, enrollment and used token held in memory.
    fn resave(&mut self) -> Result<(), StoreError> {
        self.store.reopen()?;
        for rollout in self.engine.rollouts() {
            self.store.save_rollout(rollout)?;
        }
        for record in self.registry.all() {
            self.store.save_enrollment(record)?;
        }
        let now = now();
        for token in self.registry.used_tokens() {
            self.store.use_token(token, now)?;
        }
        Ok(())
    }

    /// Records which digests `device` may fetch under the desired action `body`: the artifacts
    /// and block lists of an install (with or without peers), none for anything else (nothing,
    /// cancel, rollback to a kept release).
    fn hold(&mut self, device: &str, body: &ActionBody) {
        let digests = body
            .install()
            .and_then(|install| Manifest::decode(&install.manifest.payload).ok())
            .map(|m| releases::fetchable_digests(&m))
            .unwrap_or_default();
        if digests.is_empty() {
            self.holdings.remove(device);
        } else {
            self.holdings.insert(device.to_owned(), digests);
        }
    }

    /// A retained desired action read back from the broker: only one signed with this
    /// coordinator's key, for the device of its topic, counts.
    /// A device's retained `desired` topic changed (or was read back). Keeps the device's
    /// holdings for block requests, and when the topic holds something other than the action the
    /// engine owes the device (cleared, overwritten, or an older action replayed) returns the
    /// effects that publish it again, at most once per [`REPAIR_INTERVAL`] per device.
    fn on_desired(&mut self, id: &DeviceId, payload: &[u8]) -> Vec<Effect> {
        let found = self.our_desired_action(id, payload);
        match &found {
            Some(action) => self.hold(id.as_str(), &action.body),
            None if payload.is_empty() => {
                self.holdings.remove(id.as_str());
            }
            None => {}
        }
        let wanted = self.engine.reissue_device(id.as_str());
        let Some(owed) = wanted.last().and_then(effect_action_id) else {
            return Vec::new();
        };
        if found.as_ref().is_some_and(|a| a.action_id == owed) {
            return Vec::new();
        }
        let now = now();
        if self
            .repaired
            .get(id.as_str())
            .is_some_and(|&at| now < at.saturating_add(REPAIR_INTERVAL))
        {
            return Vec::new();
        }
        self.repaired.insert(id.as_str().to_owned(), now);
        self.desired_repairs += 1;
        tracing::warn!(
            device = %id,
            owed,
            found = found.as_ref().map_or("something else", |a| a.action_id.as_str()),
            repairs_total = self.desired_repairs,
            "the retained desired action is not the one this coordinator published; publishing it again"
        );
        wanted
    }

    /// The desired action in `payload` if this coordinator signed it for `id`. Bytes identical
    /// to the last ones published for the device (the echo of every publish, and after a
    /// restart the retained actions of a whole fleet) are known to be ours without a signature
    /// check; anything else is checked.
    fn our_desired_action(&mut self, id: &DeviceId, payload: &[u8]) -> Option<DesiredAction> {
        let Ok(Message::Desired(blob)) = envelope::decode(payload) else {
            return None;
        };
        let ours = self.store.published(id.as_str())
            == Some(store::published_digest(&self.verifying_key, payload));
        let bytes = if ours {
            self.desired_known += 1;
            blob.payload.as_slice()
        } else {
            blob.verify("desired action", &[self.verifying_key]).ok()?
        };
        let action = envelope::from_bytes::<DesiredAction>("desired action", bytes).ok()?;
        (action.device_id == id.as_str()).then_some(action)
    }

    /// Whether `device` holds an action for a release with this artifact: its retained desired
    /// action installs it, or it has a live slot in an active rollout of such a release.
    fn may_fetch(&mut self, device: &str, sha256: &Digest) -> bool {
        if self
            .holdings
            .get(device)
            .is_some_and(|held| held.contains(sha256))
        {
            return true;
        }
        let releases: Vec<String> = self
            .engine
            .device_releases(device)
            .into_iter()
            .map(str::to_owned)
            .collect();
        for release in releases {
            if self
                .release_digests(&release)
                .is_some_and(|d| d.contains(sha256))
            {
                return true;
            }
        }
        false
    }

    /// Every digest of a release a device may fetch (artifacts and block lists), cached.
    /// Release names are never reused, so the cache cannot go stale.
    fn release_digests(&mut self, release: &str) -> Option<&[Digest]> {
        if !self.release_digests.contains_key(release) {
            match self.releases.load_manifest(release) {
                Ok((_, manifest)) => {
                    let digests = releases::fetchable_digests(&manifest);
                    self.release_digests.insert(release.to_owned(), digests);
                }
                Err(e) => {
                    tracing::error!(%release, error = %e, "release unreadable");
                    return None;
                }
            }
        }
        self.release_digests.get(release).map(Vec::as_slice)
    }

    async fn on_link_event(&mut self, arrival: Arrival) -> Result<(), ServiceError> {
        let Arrival { event, checked } = arrival;
        match event {
            LinkEvent::Connected => {
                self.loading.connected();
                self.lane_open
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                let _timing = self.metrics.connected();
                // Retained desired actions may have been lost with a broker that restarted
                // without persistence; re-publishing them is idempotent.
                let effects = self.engine.reissue(now());
                self.apply(effects).await
            }
            LinkEvent::Disconnected { .. } => {
                self.metrics.disconnected();
                Ok(())
            }
            LinkEvent::Subscribed => {
                // Queued by the broker behind every retained message it delivers on subscribe.
                let nonce = self.loading.subscribed(tokio::time::Instant::now());
                self.publish(self.topics.marker(), false, nonce.into_bytes())
                    .await
            }
            LinkEvent::Publish { topic, payload } => {
                self.on_publish(&topic, &payload, checked).await
            }
        }
    }

    /// One publish from the link. `checked` is what a signature worker made of a device topic's
    /// payload (`verify.rs`); without it the payload is checked here.
    async fn on_publish(
        &mut self,
        topic: &str,
        payload: &[u8],
        checked: Option<Checked>,
    ) -> Result<(), ServiceError> {
        let _timing = self.metrics.received(&self.topics, topic);
        if payload.len() > BROKER_PACKET_LIMIT {
            let reason = format!(
                "{} bytes, more than the {BROKER_PACKET_LIMIT} bytes a message may have",
                payload.len()
            );
            self.reject(topic, Malformed::TooLarge, &reason);
            return Ok(());
        }
        let Some(parsed) = self.topics.parse(topic) else {
            self.reject(topic, Malformed::UnknownTopic, "not a flotilla topic");
            return Ok(());
        };
        let id = match &parsed {
            Topic::ControlRequest => return self.on_control(topic, payload).await,
            Topic::Marker => return self.on_marker(topic, payload).await,
            Topic::State(id) | Topic::Report(id) | Topic::Fetch(id) => id.clone(),
            Topic::Desired(id) => {
                let id = id.clone();
                let repair = self.on_desired(&id, payload);
                return self.apply(repair).await;
            }
            // Not subscribed to; a broker that forwards it anyway is not worth an error.
            _ => return Ok(()),
        };
        // An empty retained payload is how a device's state gets cleared: not malformed.
        if payload.is_empty() && matches!(parsed, Topic::State(_)) {
            return Ok(());
        }
        let checked = checked.unwrap_or_else(|| verify::check(payload, None));
        let (blob, opened) = match checked {
            Checked::Signed { blob, verified } => {
                let opened = verify::decode_verified(&blob, verified);
                (blob, opened)
            }
            Checked::Undecodable(reason) => {
                self.reject(topic, Malformed::Undecodable, &reason);
                return Ok(());
            }
            Checked::Unsigned => {
                self.ignore(topic, Ignored::Unsigned);
                return Ok(());
            }
            Checked::WrongKind(name) => {
                let reason = format!("unexpected {name} on this topic");
                self.reject(topic, Malformed::WrongKind, &reason);
                return Ok(());
            }
        };
        let expected = match parsed {
            Topic::State(_) => "device state",
            Topic::Report(_) => "report",
            _ => "block request",
        };
        let now = now();
        let verdict = self
            .registry
            .observe_checked(id.as_str(), expected, &blob, opened, now);
        if let Some(token) = &verdict.used_token {
            if let Err(e) = self.store.use_token(token, now) {
                self.store_failed(&e);
            }
        }
        if verdict.changed {
            // A failure is logged and retried by the store's recovery; nobody to answer here.
            let _ = self.save_enrollment(id.as_str());
        }
        if let Some(note) = &verdict.note {
            tracing::info!(device = %id, "{note}");
        }
        if let Some(why) = verdict.ignored {
            self.ignore(topic, why);
        }
        let Some(message) = verdict.accepted else {
            return Ok(());
        };
        // Only now, signed by the device's accepted key, does anything reach the engine: a
        // forged report's seq never counts.
        match message {
            DeviceMessage::State { state, .. } => {
                let effects = self.engine.observe_state(state, now);
                self.apply(effects).await
            }
            DeviceMessage::Report(report) => {
                let effects = self.engine.observe_report(report, now);
                self.apply(effects).await
            }
            DeviceMessage::ReportWithBytes {
                report,
                bytes,
                bypassed,
            } => {
                // The bytes first, so the status the report publishes counts them.
                let mut effects =
                    self.observe_bytes(id.as_str(), &report.action_id, &bytes, &bypassed, now);
                effects.extend(self.engine.observe_report(report, now));
                self.apply(effects).await
            }
            DeviceMessage::Fetch { request, .. } => {
                let reply = if self.may_fetch(id.as_str(), &request.sha256) {
                    self.blocks.serve(&request)
                } else {
                    self.ignore(topic, Ignored::NoAction);
                    BlockReply::Unavailable {
                        sha256: request.sha256,
                        offset: request.offset,
                        reason: format!(
                            "device {id} holds no action for artifact {}",
                            flotilla_protocol::hex::encode(&request.sha256)
                        ),
                    }
                };
                self.metrics.block(&reply);
                let bytes = envelope::encode(&Message::Block(reply));
                self.publish(self.topics.block(&id), false, bytes).await
            }
        }
    }

    async fn on_control(&mut self, topic: &str, payload: &[u8]) -> Result<(), ServiceError> {
        let authorized = match self.gate.check(payload, now()) {
            Ok(a) => a,
            Err(refusal) => {
                self.refused += 1;
                self.metrics.refused(&refusal.reason);
                tracing::warn!(%topic, reason = %refusal.reason, replied = refusal.reply_to.is_some(),
                    refused_total = self.refused, "refusing control request");
                // Only a reply_to that passed the checks (a plain reply topic under the root)
                // is ever published on; otherwise the refusal is logged and counted only.
                let Some(reply_to) = refusal.reply_to else {
                    return Ok(());
                };
                let reply = ControlReply {
                    id: refusal.id.unwrap_or_default(),
                    ok: false,
                    error: Some(refusal.reason),
                    result: serde_json::Value::Null,
                    loading: false,
                };
                return self.reply(reply_to, reply).await;
            }
        };
        let request = authorized.request;
        let operator = authorized.operator;
        tracing::info!(%operator, role = %authorized.role, command = request.command.name(),
            id = %request.id, "control request");
        // A command that changes anything may depend on the whole registry (a rollout plans
        // over every device): it waits until the retained states are read. Reads answer now,
        // marked as loading.
        if self.loading.is_loading() && request.command.required_role() != Role::Viewer {
            let held = self.loading.held();
            return match self.loading.hold(Held { request, operator }) {
                Ok(()) => {
                    tracing::info!(
                        held = held + 1,
                        "control request held until every retained device state is read"
                    );
                    Ok(())
                }
                Err(Held { request, .. }) => {
                    let reply = ControlReply {
                        id: request.id,
                        ok: false,
                        error: Some(format!(
                            "the coordinator is still reading the fleet's retained states and \
                             already holds {held} commands until it has; try again shortly"
                        )),
                        result: serde_json::Value::Null,
                        loading: true,
                    };
                    self.reply(request.reply_to, reply).await
                }
            };
        }
        self.run(request, &operator).await
    }

    /// Runs an accepted control request and replies.
    async fn run(&mut self, request: ControlRequest, operator: &str) -> Result<(), ServiceError> {
        let loading = self.loading.is_loading();
        let reply = match self.command(request.command, operator).await? {
            Ok(result) => ControlReply {
                id: request.id,
                ok: true,
                error: None,
                result,
                loading,
            },
            Err(error) => ControlReply {
                id: request.id,
                ok: false,
                error: Some(error),
                result: serde_json::Value::Null,
                loading,
            },
        };
        self.reply(request.reply_to, reply).await
    }

    /// A publish on the marker topic: this connection's marker ends the loading state.
    async fn on_marker(&mut self, topic: &str, payload: &[u8]) -> Result<(), ServiceError> {
        match self.loading.marker(payload) {
            MarkerSeen::Complete => {
                tracing::info!(
                    devices = self.engine.device_count(),
                    held = self.loading.held(),
                    "every retained device state is read"
                );
                self.release_held().await
            }
            MarkerSeen::Foreign => {
                self.reject(topic, Malformed::BadMarker, "not this connection's marker");
                Ok(())
            }
        }
    }

    /// The marker did not come back in time: the registry is taken as complete.
    async fn marker_overdue(&mut self) -> Result<(), ServiceError> {
        if !self.loading.expire(tokio::time::Instant::now()) {
            return Ok(());
        }
        tracing::warn!(
            timeout = ?self.loading.timeout(),
            devices = self.engine.device_count(),
            held = self.loading.held(),
            "the end-of-retained marker did not come back (an ACL refusing the marker topic?); \
             taking the registry as complete, it may miss devices whose states were not read yet"
        );
        self.release_held().await
    }

    /// Loading ended: control requests from now on come in arrival order with device traffic,
    /// and the commands held while loading run, in the order they arrived.
    async fn release_held(&mut self) -> Result<(), ServiceError> {
        self.lane_open
            .store(false, std::sync::atomic::Ordering::SeqCst);
        while let Some(Held { request, operator }) = self.loading.release() {
            self.run(request, &operator).await?;
        }
        Ok(())
    }

    /// Runs one control command. The outer error stops the service; the inner one is the
    /// operator's mistake and goes back in the reply.
    async fn command(
        &mut self,
        command: Command,
        by: &str,
    ) -> Result<Result<serde_json::Value, String>, ServiceError> {
        let writes = command.required_role() != Role::Viewer && !matches!(command, Command::Backup);
        if writes {
            if let Some(refusal) = self.health.refusal(self.store.path()) {
                return Ok(Err(refusal));
            }
        }
        let name = command.name();
        let (effects, answer) = match self.dispatch(command, by, now()) {
            Ok(done) => done,
            Err(e) => return Ok(Err(e)),
        };
        self.apply(effects).await?;
        if let Some(reason) = self.health.reason().filter(|_| writes) {
            // The write failed under this very command: say so, and what happens to it.
            return Ok(Err(format!(
                "{name} took effect in memory but could not be stored ({reason}); nothing it \
                 implies goes to devices until the store can be written again, and it is stored \
                 then"
            )));
        }
        Ok(match answer {
            Answer::Value(value) => Ok(value),
            // The summary: a reply to a command must not grow with the rollout.
            Answer::Status(name) => match self.engine.summary(&name) {
                Some(status) => Ok(json(&status)),
                None => Err(format!("no rollout named {name:?}")),
            },
            Answer::Approval(name) => Ok(self
                .engine
                .approvals()
                .into_iter()
                .find(|a| a.name == name)
                .map(|a| json(&a))
                .unwrap_or(serde_json::Value::Null)),
        })
    }

    /// Hands a command to the engine or the store on behalf of operator `by`, whom the
    /// engine's trace names. Returns the effects to apply and what to answer once they are
    /// applied, or the error for the reply; nothing here publishes.
    fn dispatch(
        &mut self,
        command: Command,
        by: &str,
        now: u64,
    ) -> Result<(Vec<Effect>, Answer), String> {
        let engine_error = |e: flotilla_rollout::engine::EngineError| e.to_string();
        let store_error = |e: StoreError| e.to_string();
        let status =
            |name: String, r: Result<Vec<Effect>, flotilla_rollout::engine::EngineError>| {
                r.map(|effects| (effects, Answer::Status(name)))
                    .map_err(engine_error)
            };
        let value = |v: serde_json::Value| Ok((Vec::new(), Answer::Value(v)));
        match command {
            Command::CreateRollout { spec } => {
                let spec = RolloutSpec::from_toml(&spec, &SystemZones)
                    .map_err(|e| format!("invalid rollout spec: {e}"))?;
                let spec = self.resolve_strategy(spec)?;
                let (blob, manifest) = self
                    .releases
                    .load(&spec.release)
                    .map_err(|e| e.to_string())?;
                self.manifests.insert(manifest.name.clone(), blob);
                let release = ReleaseRef {
                    name: manifest.name.clone(),
                    counter: manifest.counter,
                    hardware: manifest.hardware,
                };
                let name = spec.name.clone();
                let r = self.engine.create_rollout_by(spec, release, by, now);
                status(name, r)
            }
            Command::StartRollout { rollout } => {
                let r = self.engine.start_by(&rollout, by, now);
                status(rollout, r)
            }
            Command::PauseRollout { rollout } => {
                let r = self.engine.pause_by(&rollout, by, now);
                status(rollout, r)
            }
            Command::ResumeRollout { rollout } => {
                let r = self.engine.resume_by(&rollout, by, now);
                status(rollout, r)
            }
            Command::StopRollout { rollout } => {
                let r = self.engine.stop_by(&rollout, by, now);
                status(rollout, r)
            }
            Command::TriggerNext {
                rollout,
                skip_approval,
            } => {
                let r = self
                    .engine
                    .trigger_next_with(&rollout, by, skip_approval, now);
                status(rollout, r)
            }
            Command::RetryRollout { rollout, name } => {
                let new_name = name.unwrap_or_else(|| format!("{rollout}-retry"));
                validate_id("rollout name", &new_name).map_err(|e| format!("name: {e}"))?;
                let r = self
                    .engine
                    .retry_failed_by(&rollout, Some(new_name.clone()), by, now);
                status(new_name, r)
            }
            // Without paging fields, the reply an older client expects (refused by `reply`
            // when it does not fit in one message); with them, a page.
            Command::RolloutStatus {
                rollout: Some(name),
                page,
            } if page.is_paged() => value(json(&self.rollout_page(&name, &page)?)),
            Command::RolloutStatus {
                rollout: Some(name),
                ..
            } => match self.engine.status(&name) {
                Some(status) => value(json(&status)),
                None => Err(format!("no rollout named {name:?}")),
            },
            Command::RolloutStatus {
                rollout: None,
                page,
            } if page.is_paged() => {
                refuse_filters(&page, &["select", "group"], "rollouts")?;
                let states = page.phase.clone();
                let all = self
                    .engine
                    .summaries_after(page.after.as_deref())
                    .filter(|s| states.as_ref().is_none_or(|p| *p == s.state));
                value(json(
                    &Pager::new(&page, 0)?.collect(all, |s| s.name.clone()),
                ))
            }
            Command::RolloutStatus { rollout: None, .. } => {
                let all: Vec<_> = self.engine.summaries_after(None).collect();
                value(json(&all))
            }
            Command::ListDevices { page } if page.is_paged() => {
                value(json(&self.device_page(&page)?))
            }
            Command::ListDevices { .. } => value(json(&self.device_list())),
            Command::PendingDevices { page } if page.is_paged() => {
                refuse_filters(&page, &["phase", "group"], "pending devices")?;
                let select = selector(&page)?;
                let pending = self
                    .registry
                    .pending_after(page.after.as_deref())
                    .filter(|info| select.matches(&info.labels));
                let pager = Pager::new(&page, 0)?;
                value(json(&pager.collect(pending, |info| info.device.clone())))
            }
            Command::PendingDevices { .. } => value(json(&self.registry.pending())),
            Command::AcceptDevice { device, key } => {
                let state = self.registry.accept(&device, key.as_deref(), now)?;
                self.save_enrollment(&device)?;
                tracing::info!(%device, "device accepted by an operator");
                let effects = match state {
                    Some(state) => self.engine.observe_state(state, now),
                    None => Vec::new(),
                };
                let info = self.registry.info(&device);
                Ok((effects, Answer::Value(json(&info))))
            }
            Command::RejectDevice { device, key } => {
                self.registry.reject(&device, key.as_deref(), now)?;
                self.save_enrollment(&device)?;
                tracing::info!(%device, "device key rejected by an operator");
                value(json(&self.registry.info(&device)))
            }
            Command::RevokeDevice { device } => {
                self.registry.revoke(&device, now)?;
                self.save_enrollment(&device)?;
                tracing::info!(%device, "device revoked by an operator");
                // It leaves the rollouts not yet finished and its retained topics are cleared.
                let effects = match self.engine.delete_device(&device, now) {
                    Ok(effects) => effects,
                    Err(_) => vec![Effect::Forget {
                        device: device.clone(),
                    }],
                };
                let info = self.registry.info(&device);
                Ok((effects, Answer::Value(json(&info))))
            }
            Command::ListReleases { page } => {
                let all = self.releases.summaries().map_err(|e| e.to_string())?;
                value(named_list(all, &page, "releases", |r| r.name.clone())?)
            }
            Command::DeleteDevice { device } => {
                DeviceId::new(&device).map_err(|e| format!("device: {e}"))?;
                let effects = self
                    .engine
                    .delete_device_by(&device, by, now)
                    .map_err(engine_error)?;
                Ok((
                    effects,
                    Answer::Value(serde_json::json!({ "deleted": device })),
                ))
            }
            Command::Approve { name } => {
                let effects = self
                    .engine
                    .approve_by(&name, by, now)
                    .map_err(engine_error)?;
                Ok((effects, Answer::Approval(name)))
            }
            Command::ListApprovals { page } => {
                let all = self.engine.approvals();
                value(named_list(all, &page, "approvals", |a| a.name.clone())?)
            }
            Command::Backup => {
                let path = self
                    .data_dir
                    .join("backups")
                    .join(format!("flotilla-backup-{now}.jsonl"));
                let info = backup::write_backup(&self.store, &path, now, &self.key)
                    .map_err(|e| e.to_string())?;
                tracing::info!(%by, path = %info.path, records = info.records, "store backed up");
                value(json(&info))
            }
            Command::CreateStrategy { name, spec } => {
                check_strategy(&name, &spec)?;
                let all = self.store.list_strategies().map_err(store_error)?;
                if all.len() >= MAX_STRATEGIES && !all.iter().any(|s| s.name == name) {
                    return Err(format!(
                        "there are already {MAX_STRATEGIES} stored strategies, the most the \
                         coordinator keeps; delete one first"
                    ));
                }
                let stored = StoredStrategy { name, text: spec };
                self.store
                    .save_strategy(&stored)
                    .map_err(|e| self.write_failed(e))?;
                value(json(&strategy_info(stored)))
            }
            Command::ListStrategies { page } => {
                let all = self.store.list_strategies().map_err(store_error)?;
                let all: Vec<_> = all.into_iter().map(strategy_info).collect();
                value(named_list(all, &page, "strategies", |s| s.name.clone())?)
            }
            Command::ShowStrategy { name } => match self.store.load_strategy(&name) {
                Ok(Some(stored)) => value(json(&strategy_info(stored))),
                Ok(None) => Err(no_strategy(&name)),
                Err(e) => Err(e.to_string()),
            },
            Command::CreateGroup {
                name,
                select,
                labels,
            } => {
                let group = device_group(name, &select, labels)?;
                let all = self.store.list_groups().map_err(store_error)?;
                if all.len() >= MAX_GROUPS && !all.iter().any(|g| g.name == group.name) {
                    return Err(format!(
                        "there are already {MAX_GROUPS} device groups, the most the coordinator \
                         keeps; delete one first"
                    ));
                }
                self.store
                    .save_group(&group)
                    .map_err(|e| self.write_failed(e))?;
                self.refresh_device_groups().map_err(store_error)?;
                value(json(&group_info(&group)))
            }
            Command::ListGroups { page } => {
                let all = self.store.list_groups().map_err(store_error)?;
                let all: Vec<_> = all.iter().map(group_info).collect();
                value(named_list(all, &page, "device groups", |g| g.name.clone())?)
            }
            Command::DeleteGroup { name } => {
                let Some(group) = self.store.load_group(&name).map_err(store_error)? else {
                    return Err(format!("no device group named {name:?}"));
                };
                self.store
                    .delete_group(&name)
                    .map_err(|e| self.write_failed(e))?;
                self.refresh_device_groups().map_err(store_error)?;
                value(json(&group_info(&group)))
            }
        }
    }

    /// Every device: those the engine knows (accepted) and those waiting for, or refused by, an
    /// operator, each with its enrollment status. Devices that are not accepted show what their
    /// last state claims, never online.
    fn device_list(&self) -> Vec<DeviceSummary> {
        self.devices_after(None).collect()
    }

    /// [`Service::device_list`] after the device id `after`, in id order, read lazily from the
    /// engine's and the registry's sorted maps. The two are walked side by side, so a page costs
    /// its own devices (and the registry records between them), not the fleet.
    fn devices_after<'a>(
        &'a self,
        after: Option<&'a str>,
    ) -> impl Iterator<Item = DeviceSummary> + 'a {
        let mut known = self.engine.devices_after(after).peekable();
        let mut records = self.registry.all_after(after).peekable();
        std::iter::from_fn(move || loop {
            let next_known = known.peek().map(|d| d.id.as_str());
            let Some(record) = records.peek() else {
                let mut d = known.next()?;
                d.enrollment = self.registry.status_text(&d.id);
                return Some(d);
            };
            match next_known {
                Some(id) if id <= record.device.as_str() => {
                    if id == record.device {
                        records.next();
                    }
                    let mut d = known.next()?;
                    d.enrollment = self.registry.status_text(&d.id);
                    return Some(d);
                }
                _ => {
                    // A record the engine has no state for: waiting for, or refused by, an
                    // operator (or accepted and never heard from since).
                    let record = records.next()?;
                    if self.engine.device_labels(&record.device).is_some() {
                        continue;
                    }
                    let Some(info) = self.registry.info(&record.device) else {
                        continue;
                    };
                    return Some(DeviceSummary {
                        id: record.device.clone(),
                        hardware_id: info.hardware_id.unwrap_or_default(),
                        labels: info.labels,
                        online: false,
                        installed: None,
                        rollout: None,
                        phase: None,
                        reason: None,
                        enrollment: self.registry.status_text(&record.device),
                    });
                }
            }
        })
    }

    /// A page of `list_devices`: `select` and `phase` filter, `group` names a stored device
    /// group whose selector the devices must match.
    fn device_page(
        &self,
        page: &PageQuery,
    ) -> Result<flotilla_protocol::control::Page<DeviceSummary>, String> {
        let select = selector(page)?;
        let group = match &page.group {
            None => None,
            Some(name) => Some(
                self.store
                    .load_group(name)
                    .map_err(|e| e.to_string())?
                    .ok_or_else(|| format!("group: no device group named {name:?}"))?
                    .select,
            ),
        };
        let phase = page.phase.as_deref();
        let devices = self
            .devices_after(page.after.as_deref())
            .filter(|d| select.matches(&d.labels))
            .filter(|d| group.as_ref().is_none_or(|g| g.matches(&d.labels)))
            .filter(|d| phase.is_none_or(|p| d.phase.as_deref() == Some(p)));
        Ok(Pager::new(page, 0)?.collect(devices, |d| d.id.clone()))
    }

    /// A page of one rollout: its summary and a page of its devices; `group`, `phase` and
    /// `select` filter the devices.
    fn rollout_page(&self, name: &str, page: &PageQuery) -> Result<RolloutPage, String> {
        let status = self
            .engine
            .summary(name)
            .ok_or_else(|| format!("no rollout named {name:?}"))?;
        if let Some(group) = &page.group {
            if !status.groups.iter().any(|g| &g.name == group) {
                return Err(format!(
                    "group: rollout {name} has no group named {group:?}"
                ));
            }
        }
        let select = selector(page)?;
        let devices = self
            .engine
            .rollout_devices(name, page.after.as_deref())
            .ok_or_else(|| format!("no rollout named {name:?}"))?
            .filter(|d| page.group.as_ref().is_none_or(|g| *g == d.group))
            .filter(|d| page.phase.as_ref().is_none_or(|p| *p == d.detail.phase))
            .filter(|d| {
                select.is_everything()
                    || self
                        .engine
                        .device_labels(&d.id)
                        .is_some_and(|labels| select.matches(labels))
            });
        let reserved = serde_json::to_vec(&status).map_or(0, |v| v.len());
        let devices = Pager::new(page, reserved)?.collect(devices, |d| d.id.clone());
        Ok(RolloutPage {
            status,
            items: devices.items,
            next: devices.next,
        })
    }

    /// Gives the engine the stored device groups, all of them.
    fn refresh_device_groups(&mut self) -> Result<(), StoreError> {
        let groups = self.store.list_groups()?;
        self.engine.set_device_groups(groups);
        Ok(())
    }

    /// A staged spec names a stored strategy; the rollout gets its own resolved copy, so a later
    /// change to the stored strategy does not change a rollout already created (KubeFleet's
    /// strategy snapshot).
    fn resolve_strategy(&self, spec: RolloutSpec) -> Result<RolloutSpec, String> {
        let Some(name) = staged_strategy_name(&spec) else {
            return Ok(spec);
        };
        let stored = self
            .store
            .load_strategy(name)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| no_strategy(name))?;
        resolve_with(spec, &stored)
    }

    /// Applies effects in the engine's order. A failed save is fatal (see the module doc);
    /// a desired action that cannot be built is logged and skipped.
    async fn apply(&mut self, effects: Vec<Effect>) -> Result<(), ServiceError> {
        for effect in effects {
            match effect {
                Effect::Save(name) => {
                    if let Some(rollout) = self.engine.rollout(&name) {
                        if let Err(e) = self.store.save_rollout(rollout) {
                            self.store_failed(&e);
                        }
                    }
                }
                // Nothing may instruct a device ahead of the stored rollout that justifies it;
                // the recovery reissues what each device is owed.
                Effect::Desired { .. }
                | Effect::Rollback { .. }
                | Effect::Cancel { .. }
                | Effect::Forget { .. }
                    if self.health.is_failing() =>
                {
                    self.health.held_back += 1;
                }
                Effect::Desired {
                    device,
                    action_id,
                    rollout,
                    release,
                    action,
                    peers,
                } => {
                    let Some(manifest) = self.manifest(&release) else {
                        continue;
                    };
                    let digests = if peers.is_empty() {
                        Vec::new()
                    } else {
                        match self.release_digests(&release) {
                            Some(d) => d.to_vec(),
                            None => continue,
                        }
                    };
                    // The maintenance window the attempt was sent in, in UTC: the agent holds
                    // to it too, so an action it receives late waits for its window.
                    let window = self.engine.install_window(&rollout, &device);
                    let install = grants::Install {
                        device: &device,
                        action_id: &action_id,
                        rollout: &rollout,
                        manifest,
                        kind: action_kind(action),
                        window,
                        peers: &peers,
                        digests: &digests,
                    };
                    let key = self.key.clone();
                    let body = move |expires_at| grants::install_body(&key, install, expires_at);
                    self.publish_action_with(&device, action_id.clone(), rollout.clone(), body)
                        .await?;
                }
                Effect::Rollback {
                    device,
                    action_id,
                    rollout,
                    undo,
                } => {
                    let body = ActionBody::Rollback { action_id: undo };
                    self.publish_action(&device, action_id, rollout, body)
                        .await?;
                }
                Effect::Approval(approval) => {
                    let bytes = serde_json::to_vec(&approval).unwrap_or_default();
                    self.publish(self.topics.approval_event(&approval.name), true, bytes)
                        .await?;
                }
                Effect::Forget { device } => {
                    let Ok(id) = DeviceId::new(&device) else {
                        tracing::error!(%device, "engine asked to forget an invalid device id; skipped");
                        continue;
                    };
                    self.holdings.remove(&device);
                    // A signed "nothing to do", newer than anything the device was sent, replaces
                    // its retained action: a device that comes back finds no stale action, and a
                    // replayed older action is refused. The empty retained state deletes it, so
                    // nobody sees a stale state.
                    self.publish_action(
                        &device,
                        forget_action_id(&device),
                        String::new(),
                        ActionBody::Nothing,
                    )
                    .await?;
                    self.publish(self.topics.state(&id), true, Vec::new())
                        .await?;
                }
                Effect::Cancel {
                    device,
                    action_id,
                    rollout,
                } => {
                    // A cancel has its own id: an agent never acts twice on an id it knows, so a
                    // cancel under the id of the action it cancels would be dropped as a repeat.
                    let id = cancel_action_id(&action_id);
                    let body = ActionBody::Cancel { action_id };
                    self.publish_action(&device, id, rollout, body).await?;
                }
                Effect::Status(name) => {
                    // Counts and per-group summaries only: a retained message that grew with
                    // the rollout would outgrow what the broker and clients accept.
                    if let Some(status) = self.engine.summary(&name) {
                        let bytes = serde_json::to_vec(&status).unwrap_or_default();
                        self.publish(self.topics.rollout_event(&name), true, bytes)
                            .await?;
                    }
                }
                Effect::Snapshot(status) => {
                    let bytes = serde_json::to_vec(&status).unwrap_or_default();
                    self.publish(self.topics.rollout_event(&status.name), true, bytes)
                        .await?;
                }
                Effect::Trace(entry) => {
                    self.metrics.traced(&entry);
                    tracing::info!(rollout = %entry.rollout, "{}", entry.message);
                    let bytes = serde_json::to_vec(&entry).unwrap_or_default();
                    self.publish(self.topics.event_log(), false, bytes).await?;
                }
            }
        }
        Ok(())
    }

    /// The stored signed manifest of a release, cached.
    fn manifest(&mut self, release: &str) -> Option<SignedBlob> {
        if let Some(blob) = self.manifests.get(release) {
            return Some(blob.clone());
        }
        match self.releases.load(release) {
            Ok((blob, _)) => {
                self.manifests.insert(release.to_owned(), blob.clone());
                Some(blob)
            }
            Err(e) => {
                tracing::error!(%release, error = %e, "cannot publish desired actions: release unreadable");
                None
            }
        }
    }

    async fn publish_action(
        &mut self,
        device: &str,
        action_id: String,
        rollout_id: String,
        body: ActionBody,
    ) -> Result<(), ServiceError> {
        self.publish_action_with(device, action_id, rollout_id, |_| body)
            .await
    }

    /// Stamps, signs and publishes a desired action whose body depends on its expiry (a peer
    /// grant expires with its action).
    async fn publish_action_with(
        &mut self,
        device: &str,
        action_id: String,
        rollout_id: String,
        body: impl FnOnce(u64) -> ActionBody,
    ) -> Result<(), ServiceError> {
        let Ok(id) = DeviceId::new(device) else {
            tracing::error!(%device, "engine produced an action for an invalid device id; skipped");
            return Ok(());
        };
        let issued_at = self.sequence.next(device, now());
        if let Err(e) = self.store.save_issued(device, issued_at) {
            // Still strictly increasing while this process runs; only a restart could repeat it.
            self.store_failed(&e);
        }
        let expires_at = issued_at.saturating_add(self.validity);
        let action = DesiredAction {
            action_id,
            device_id: device.to_owned(),
            rollout_id,
            issued_at,
            expires_at,
            body: body(expires_at),
        };
        self.hold(device, &action.body);
        let blob = SignedBlob::sign(&self.key, envelope::to_bytes(&action));
        let bytes = envelope::encode(&Message::Desired(blob));
        let digest = store::published_digest(&self.verifying_key, &bytes);
        if let Err(e) = self.store.save_published(device, &digest) {
            // Harmless: the stored digest is of older bytes, which then get their signature checked.
            tracing::debug!(%device, error = %e, "could not record the digest of a published desired action");
        }
        self.publish(self.topics.desired(&id), true, bytes).await
    }

    /// Publishes on the link. A message that cannot go out (a topic with wildcards or U+0000, or
    /// more than [`MAX_PACKET_SIZE`] bytes) is logged, counted and dropped: rumqttc would refuse it,
    /// or the broker would drop the connection over it, and neither may stop the service. Only a
    /// closed link is an error.
    async fn publish(
        &mut self,
        topic: String,
        retain: bool,
        payload: Vec<u8>,
    ) -> Result<(), ServiceError> {
        if let Err(why) = publishable(&topic, payload.len()) {
            self.unpublishable += 1;
            tracing::warn!(
                topic = %topic.chars().take(200).collect::<String>(),
                unpublishable_total = self.unpublishable,
                "not publishing: {why}"
            );
            return Ok(());
        }
        self.metrics.published(&self.topics, &topic);
        self.client
            .publish(topic, QoS::AtLeastOnce, retain, payload)
            .await
            .map_err(|_| ServiceError::LinkClosed {
                addr: self.addr.clone(),
            })
    }

    /// Publishes a control reply; one too large for a message becomes an error reply saying so.
    async fn reply(&mut self, reply_to: String, reply: ControlReply) -> Result<(), ServiceError> {
        // A reply is plain data; serializing it cannot fail.
        let mut bytes = serde_json::to_vec(&reply).unwrap_or_default();
        if bytes.len() > MAX_PACKET_SIZE {
            let too_large = ControlReply {
                id: reply.id,
                ok: false,
                error: Some(format!(
                    "the reply is {} bytes, more than the {MAX_PACKET_SIZE} bytes one message may \
                     carry; ask for less",
                    bytes.len()
                )),
                result: serde_json::Value::Null,
                loading: reply.loading,
            };
            bytes = serde_json::to_vec(&too_large).unwrap_or_default();
        }
        self.publish(reply_to, false, bytes).await
    }
}

/// Bounds on what control requests can make the coordinator store (an admin's mistake or a
/// stolen admin key must not fill its disk).
const MAX_STRATEGIES: usize = 1_000;
const MAX_STRATEGY_BYTES: usize = 64 * 1024;
const MAX_GROUPS: usize = 1_000;
const MAX_GROUP_LABELS: usize = 64;
const MAX_SELECTOR_BYTES: usize = 4 * 1024;

/// How often a device's retained `desired` topic is repaired at most (see `Service::on_desired`).
const REPAIR_INTERVAL: u64 = 5;

/// The action id an effect publishes on a device's `desired` topic.
fn effect_action_id(effect: &Effect) -> Option<String> {
    match effect {
        Effect::Desired { action_id, .. } | Effect::Rollback { action_id, .. } => {
            Some(action_id.clone())
        }
        Effect::Cancel { action_id, .. } => Some(cancel_action_id(action_id)),
        _ => None,
    }
}

/// Why a message cannot be published, if it cannot: rumqttc refuses topics with wildcards, and
/// brokers drop the connection of a client that sends U+0000 in a topic or a packet larger than
/// they accept.
fn publishable(topic: &str, payload_len: usize) -> Result<(), String> {
    if topic.is_empty() || topic.len() > usize::from(u16::MAX) {
        return Err(format!("a topic of {} bytes", topic.len()));
    }
    if topic.contains(['+', '#', '\0']) {
        return Err("the topic contains a wildcard or U+0000".into());
    }
    if payload_len > MAX_PACKET_SIZE {
        return Err(format!(
            "{payload_len} bytes, more than the {MAX_PACKET_SIZE} bytes one message may carry"
        ));
    }
    Ok(())
}

/// What a command answers once its effects are applied.
enum Answer {
    /// The status of this rollout, read after the effects.
    Status(String),
    /// This approval request, read after the effects.
    Approval(String),
    Value(serde_json::Value),
}

/// The action id of the "nothing to do" that replaces a deleted device's action.
fn forget_action_id(device: &str) -> String {
    format!("forget:{device}")
}

fn no_strategy(name: &str) -> String {
    format!("no stored strategy named {name}; create it with `flotilla strategy create`")
}

fn strategy_info(stored: StoredStrategy) -> StrategyInfo {
    StrategyInfo {
        name: stored.name,
        spec: stored.text,
    }
}

fn group_info(group: &DeviceGroup) -> DeviceGroupInfo {
    DeviceGroupInfo {
        name: group.name.clone(),
        select: group.select.to_string(),
        labels: group.labels.clone(),
    }
}

/// Validates a `create_group` request into a device group, naming the field that is wrong.
fn device_group(
    name: String,
    select: &str,
    labels: BTreeMap<String, String>,
) -> Result<DeviceGroup, String> {
    validate_id("device group name", &name).map_err(|e| format!("name: {e}"))?;
    if select.len() > MAX_SELECTOR_BYTES {
        return Err(format!(
            "select: {} bytes, more than the {MAX_SELECTOR_BYTES} a selector may have",
            select.len()
        ));
    }
    if labels.len() > MAX_GROUP_LABELS {
        return Err(format!(
            "labels: {} labels, more than the {MAX_GROUP_LABELS} a group may have",
            labels.len()
        ));
    }
    let select = Selector::parse(select).map_err(|e| format!("select: {e}"))?;
    for (key, value) in &labels {
        check_label("labels: key", key)?;
        check_label(&format!("labels.{key}: value"), value)?;
    }
    Ok(DeviceGroup {
        name,
        select,
        labels,
    })
}

/// Label keys and values use the selector's character set, so a partition's `group_select`
/// can match them.
fn check_label(what: &str, text: &str) -> Result<(), String> {
    if text.is_empty() {
        return Err(format!("{what} must not be empty"));
    }
    if let Some(bad) = text
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/' | ':')))
    {
        return Err(format!(
            "{what} {text:?} contains {bad:?}; allowed are letters, digits, '.', '_', '-', '/' and ':'"
        ));
    }
    Ok(())
}

/// Checks a strategy before it is stored: a valid name, TOML, and at least one `[[stage]]`.
/// The stages themselves are validated when a staged rollout resolves the strategy.
fn check_strategy(name: &str, text: &str) -> Result<(), String> {
    validate_id("strategy name", name).map_err(|e| format!("name: {e}"))?;
    if text.len() > MAX_STRATEGY_BYTES {
        return Err(format!(
            "spec: {} bytes, more than the {MAX_STRATEGY_BYTES} a strategy may have",
            text.len()
        ));
    }
    flotilla_rollout::spec::StagedStrategy::from_toml(name, text)
        .map(|_| ())
        .map_err(|e| format!("spec: strategy {name}: {e}"))
}

/// The stored strategy a staged rollout spec names, if it names one.
fn staged_strategy_name(spec: &RolloutSpec) -> Option<&str> {
    spec.staged_strategy_name()
}

/// Snapshots the stored strategy a staged spec names into the spec (KubeFleet: a run keeps the
/// strategy as it was when the run was created).
fn resolve_with(mut spec: RolloutSpec, stored: &StoredStrategy) -> Result<RolloutSpec, String> {
    let strategy = flotilla_rollout::spec::StagedStrategy::from_toml(&stored.name, &stored.text)
        .map_err(|e| format!("stored strategy {}: {e}", stored.name))?;
    spec.resolve_strategy(&strategy);
    Ok(spec)
}

/// The selector a page query's `select` names (everything without one).
fn selector(page: &PageQuery) -> Result<Selector, String> {
    match &page.select {
        None => Ok(Selector::everything()),
        Some(text) => Selector::parse(text).map_err(|e| format!("select {text:?}: {e}")),
    }
}

/// A list of named things (at most a few thousand, each bounded): the whole list in name order
/// when unpaged, as older coordinators answered; a page of it after the cursor when paged.
fn named_list<T: serde::Serialize>(
    mut all: Vec<T>,
    page: &PageQuery,
    list: &str,
    name: impl Fn(&T) -> String,
) -> Result<serde_json::Value, String> {
    if !page.is_paged() {
        return Ok(json(&all));
    }
    all.sort_by_key(|item| name(item));
    refuse_filters(page, &["select", "phase", "group"], list)?;
    let after = page.after.as_deref();
    let rest = all
        .into_iter()
        .filter(|item| after.is_none_or(|a| name(item).as_str() > a));
    Ok(json(&Pager::new(page, 0)?.collect(rest, &name)))
}

/// Refuses the filters a list has nothing to apply to, naming them.
fn refuse_filters(page: &PageQuery, fields: &[&str], list: &str) -> Result<(), String> {
    for field in fields {
        let given = match *field {
            "select" => page.select.is_some(),
            "phase" => page.phase.is_some(),
            "group" => page.group.is_some(),
            _ => false,
        };
        if given {
            return Err(format!("{field}: not a filter of the list of {list}"));
        }
    }
    Ok(())
}

fn json<T: serde::Serialize>(value: &T) -> serde_json::Value {
    // The control types are plain data; converting them to a JSON value cannot fail.
    serde_json::to_value(value).unwrap_or(serde_json::Value::Null)
}

/// The protocol's action kind for a spec's action type.
fn action_kind(action: flotilla_rollout::plan::ActionType) -> ActionKind {
    use flotilla_rollout::plan::ActionType;
    match action {
        ActionType::Forced => ActionKind::Forced,
        ActionType::Soft => ActionKind::Soft,
        ActionType::DownloadOnly => ActionKind::DownloadOnly,
        ActionType::TimeForced { at } => ActionKind::TimeForced { at },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Approvals, strategies, device groups and releases: unpaged as before, paged in name
    /// order from the cursor, with no filter to apply.
    #[test]
    fn named_lists_page_in_name_order_and_refuse_filters() {
        let names = || {
            vec![
                "c".to_owned(),
                "a".to_owned(),
                "d".to_owned(),
                "b".to_owned(),
            ]
        };
        let unpaged =
            named_list(names(), &PageQuery::default(), "groups", Clone::clone).expect("unpaged");
        assert_eq!(unpaged, serde_json::json!(["c", "a", "d", "b"]));
        let first =
            named_list(names(), &PageQuery::first(3), "groups", Clone::clone).expect("first page");
        assert_eq!(
            first,
            serde_json::json!({"items": ["a", "b", "c"], "next": "c"})
        );
        let rest = PageQuery {
            after: Some("c".into()),
            ..PageQuery::first(3)
        };
        let last = named_list(names(), &rest, "groups", Clone::clone).expect("last page");
        assert_eq!(last, serde_json::json!({"items": ["d"]}));
        let filtered = PageQuery {
            phase: Some("ready".into()),
            ..PageQuery::first(3)
        };
        let err = named_list(names(), &filtered, "device groups", Clone::clone)
            .expect_err("no phase to filter by");
        assert_eq!(err, "phase: not a filter of the list of device groups");
    }

    /// issue 10, case 9: what a control request may make the coordinator store is bounded.
    #[test]
    fn strategies_and_groups_are_bounded_in_size() {
        let big = format!(
            "[[stage]]\nname = \"a\"\n# {}\n",
            "x".repeat(MAX_STRATEGY_BYTES)
        );
        let err = check_strategy("s1", &big).expect_err("too large");
        assert!(
            err.starts_with("spec: ") && err.contains("more than the"),
            "{err}"
        );
        let labels: BTreeMap<String, String> = (0..=MAX_GROUP_LABELS)
            .map(|i| (format!("k{i}"), "v".to_owned()))
            .collect();
        let err = device_group("g1".into(), "env=lab", labels).expect_err("too many labels");
        assert!(err.starts_with("labels: 65 labels"), "{err}");
        let err = device_group(
            "g1".into(),
            &"a".repeat(MAX_SELECTOR_BYTES + 1),
            BTreeMap::new(),
        )
        .expect_err("too long");
        assert!(err.starts_with("select: "), "{err}");
    }

    /// issue 10, case 1: what rumqttc would refuse (and the service used to take for a dead
    /// link) or a broker would disconnect over is never published.
    #[test]
    fn wildcards_nul_and_oversized_messages_are_not_published() {
        assert!(publishable("flotilla/v1/control/reply/cli-1", 100).is_ok());
        for topic in ["a/#", "a/+/b", "a\0b", ""] {
            assert!(publishable(topic, 1).is_err(), "{topic:?}");
        }
        assert!(publishable(&"t".repeat(70_000), 1).is_err());
        let err = publishable("flotilla/v1/events/log", MAX_PACKET_SIZE + 1).expect_err("too big");
        assert!(err.contains("more than the"), "{err}");
    }
    use flotilla_protocol::DeviceState;
    use rumqttc::{Event, EventLoop, MqttOptions, Packet};
    use std::collections::BTreeMap;

    const WAIT: Duration = Duration::from_secs(20);

    fn free_addr() -> std::net::SocketAddr {
        std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
    }

    fn device_client(port: u16) -> (AsyncClient, EventLoop) {
        let mut o = MqttOptions::new(mqtt::unique_client_id("fake-device"), "127.0.0.1", port);
        o.set_max_packet_size(1 << 20, 1 << 20);
        AsyncClient::new(o, 100)
    }

    /// The retained messages under `devices/{id}/`, by topic: a fresh subscription gets every
    /// retained message of its filter before anything published after it, so a probe message
    /// published once subscribed marks the end of them.
    async fn retained_under_device(port: u16, id: &DeviceId) -> BTreeMap<String, Vec<u8>> {
        let topics = Topics::default();
        let filter = format!("{}/devices/{id}/+", topics.prefix());
        let probe = format!("{}/devices/{id}/probe", topics.prefix());
        let (client, mut el) = device_client(port);
        client
            .subscribe(filter, QoS::AtLeastOnce)
            .await
            .expect("queue");
        let mut retained = BTreeMap::new();
        tokio::time::timeout(WAIT, async {
            loop {
                match el.poll().await.expect("connection") {
                    Event::Incoming(Packet::SubAck(_)) => client
                        .publish(probe.clone(), QoS::AtLeastOnce, false, b"probe".to_vec())
                        .await
                        .expect("queue"),
                    Event::Incoming(Packet::Publish(p)) if p.topic == probe => return,
                    Event::Incoming(Packet::Publish(p)) => {
                        retained.insert(p.topic.clone(), p.payload.to_vec());
                    }
                    _ => {}
                }
            }
        })
        .await
        .expect("probe came back");
        retained
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn forget_clears_the_retained_desired_and_state_topics() {
        let addr = free_addr();
        let _broker = tokio::task::spawn_blocking(move || EmbeddedBroker::start(addr))
            .await
            .expect("task")
            .expect("broker");
        let port = addr.port();
        let topics = Topics::default();
        let id = DeviceId::new("dev-9").expect("id");

        // The device has a retained state and a retained desired action.
        let (device, mut device_el) = device_client(port);
        let state = DeviceState {
            device_id: "dev-9".into(),
            hardware_id: "pi4".into(),
            labels: vec![],
            installed: None,
            current: None,
            online: true,
            agent_version: "test".into(),
            at: now(),
        };
        for (topic, payload) in [
            (topics.state(&id), envelope::encode(&Message::State(state))),
            (
                topics.desired(&id),
                b"stand-in for a signed action".to_vec(),
            ),
        ] {
            device
                .publish(topic, QoS::AtLeastOnce, true, payload)
                .await
                .expect("queue");
        }
        let mut acks = 0;
        tokio::time::timeout(WAIT, async {
            while acks < 2 {
                if let Event::Incoming(Packet::PubAck(_)) = device_el.poll().await.expect("poll") {
                    acks += 1;
                }
            }
        })
        .await
        .expect("retained messages stored");
        let before = retained_under_device(port, &id).await;
        assert_eq!(
            before.keys().cloned().collect::<Vec<_>>(),
            vec![topics.desired(&id), topics.state(&id)],
            "both retained before the device is forgotten"
        );

        // A watcher sees the clearing happen live, so the broker has processed it.
        let (watcher, mut watcher_el) = device_client(port);
        watcher
            .subscribe(
                format!("{}/devices/dev-9/+", topics.prefix()),
                QoS::AtLeastOnce,
            )
            .await
            .expect("queue");
        tokio::time::timeout(WAIT, async {
            while !matches!(
                watcher_el.poll().await.expect("poll"),
                Event::Incoming(Packet::SubAck(_))
            ) {}
        })
        .await
        .expect("watcher subscribed");

        let dir = tempfile::tempdir().expect("tempdir");
        let link_token = CancellationToken::new();
        let link = mqtt::start(
            LinkOptions::new("127.0.0.1", port, "forget-test", Vec::new()),
            link_token.clone(),
        );
        let releases = ReleaseStore::new(dir.path());
        let mut service = Service {
            engine: Engine::new(SystemZones),
            store: Store::open(dir.path().join("db")).expect("store"),
            key: SigningKey::from_bytes(&[7; 32]),
            verifying_key: SigningKey::from_bytes(&[7; 32]).verifying_key(),
            desired_known: 0,
            blocks: BlockServer::new(releases.artifacts_dir()),
            releases,
            manifests: HashMap::new(),
            sequence: ActionSequence::default(),
            topics: topics.clone(),
            client: link.client.clone(),
            validity: 60,
            addr: format!("127.0.0.1:{port}"),
            malformed: 0,
            malformed_logged: None,
            unpublishable: 0,
            repaired: HashMap::new(),
            desired_repairs: 0,
            gate: Gate::new(Vec::new(), 60, topics.clone(), now()),
            refused: 0,
            registry: Registry::default(),
            ignored: IgnoredLog::new(IGNORED_LOG_INTERVAL),
            release_digests: HashMap::new(),
            holdings: HashMap::new(),
            bytes_counted: HashMap::new(),
            health: StoreHealth::default(),
            data_dir: dir.path().to_owned(),
            metrics: Metrics::new(),
            loading: Loading::new(loading::MAX_HELD, loading::MARKER_TIMEOUT),
            lane_open: link.lane_open.clone(),
        };
        service
            .apply(vec![Effect::Forget {
                device: "dev-9".into(),
            }])
            .await
            .expect("applied");
        // Until the state is deleted and the desired topic holds a signed action (the watcher
        // first gets the retained messages from before).
        let (mut state_deleted, mut desired_replaced) = (false, false);
        tokio::time::timeout(WAIT, async {
            while !(state_deleted && desired_replaced) {
                if let Event::Incoming(Packet::Publish(p)) = watcher_el.poll().await.expect("poll")
                {
                    if p.topic == topics.state(&id) && p.payload.is_empty() {
                        state_deleted = true;
                    }
                    if p.topic == topics.desired(&id)
                        && matches!(envelope::decode(&p.payload), Ok(Message::Desired(_)))
                    {
                        desired_replaced = true;
                    }
                }
            }
        })
        .await
        .expect("the state deleted and the desired action replaced");

        // The desired action is not deleted but replaced by a signed "nothing to do", so a
        // replayed older action stays older than what the device was last told.
        let after = retained_under_device(port, &id).await;
        assert_eq!(
            after.keys().cloned().collect::<Vec<_>>(),
            vec![topics.desired(&id)],
            "only the desired topic stays retained: {after:?}"
        );
        let Ok(Message::Desired(blob)) = envelope::decode(&after[&topics.desired(&id)]) else {
            panic!("the retained desired topic holds a desired action");
        };
        let coordinator = SigningKey::from_bytes(&[7; 32]).verifying_key();
        let bytes = blob
            .verify("desired action", &[coordinator])
            .expect("signed by the coordinator");
        let action: DesiredAction =
            envelope::from_bytes("desired action", bytes).expect("a desired action");
        assert_eq!(action.body, ActionBody::Nothing);
        assert_eq!(action.device_id, "dev-9");
        link_token.cancel();
    }
}
