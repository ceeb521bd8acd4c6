//! The coordinator service around the sans-I/O engine, as it runs while it leads (always, on
//! sled; while it holds the lease, on a shared store: `shared.rs`). `serve.rs` starts it.
//!
//! One task owns the [`Engine`] and feeds it everything: device states and reports from MQTT,
//! control requests, a one-second tick, and a reissue after every (re)connect. It applies the
//! engine's effects strictly in order, and persistence comes first: a `Save` is written and
//! made durable in the store before any desired action it justifies is published, so after a crash the
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
//! Control requests arrive on an MQTT connection of their own (`control_link.rs`, decision
//! 0066) and are read ahead of device traffic, and their replies go out on it. After every
//! (re)connect the service is *loading* until its end-of-retained marker comes back
//! (`loading.rs`, decision 0033): reads are answered at once marked `loading`, and every other
//! command is held, in order and bounded, until every retained state is read. A coordinator
//! that logs in by certificate alone has no second login: its control requests take the main
//! link's lane (`mqtt.rs`) while loading, and their place in arrival order afterwards.
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
//! once per device and action (`observe_bytes` in `state.rs`, `/metrics`).
//!
//! Day-2 operations (docs/operations.md) are control commands too: approvals, a manual start of
//! the next group, retrying failed devices, deleting a device, and the two kinds of named objects
//! the service keeps in its own store rather than in the engine: staged update strategies (TOML
//! text that staged rollout specs refer to by name) and device groups (named selectors). The
//! engine gets the full list of device groups at startup and after every change.
//!
//! The service is split by concern, each file an `impl Service` block over the state in
//! `state.rs`: this file starts the service and runs its loop; `inbound.rs` takes what arrives
//! (device messages, retained desired actions read back, control requests, the marker);
//! `dispatch.rs` runs control commands; `lists.rs` answers the paged lists; `effects.rs` applies
//! the engine's effects (persist, sign, publish); `error.rs` says why the service stopped.

use flotilla_rollout::zoneinfo::SystemZones;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use flotilla_protocol::{SigningKey, Topics};
use rumqttc::AsyncClient;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::service::error::ServiceError;
use crate::service::state::{now, Held, Service, Unsaved};

use crate::service::artifacts::BlockServer;
use crate::service::config::Config;
use crate::service::control_link::{self, Side, Twins};
use crate::service::coverage::{self, Coverage};
use crate::service::enrollment::{self, IgnoredLog, Registry};
use crate::service::http;
use crate::service::leadership::{Leadership, Role};
use crate::service::live;
use crate::service::loading::{self, Loading};
use crate::service::metrics::Metrics;
use crate::service::metrics_leader::LeaderCollector;
use crate::service::mqtt::{self, Events, InboxStats, LinkEvent, LinkOptions};
use crate::service::operators::Gate;
use crate::service::releases::ReleaseStore;
use crate::service::sequence::ActionSequence;
use crate::service::store::Store;
use crate::service::store_health::StoreHealth;
use crate::service::verify::{self, KeyCache, Pipeline};
use crate::service::warm::Kept;
use flotilla_rollout::engine::Engine;

/// How often the engine's timers are evaluated.
const TICK: Duration = Duration::from_secs(1);

/// Control requests read from the lane in a row before a device message (or a tick) gets a turn.
const LANE_STREAK: u32 = 64;

/// At most one log line per this interval about ignored device messages.
const IGNORED_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Leads: loads everything from `store`, connects, and runs the service loop until `shutdown`
/// is cancelled or, on a shared store, the lease is lost ([`ServiceError::Deposed`]).
pub(super) async fn lead(
    config: &Config,
    key: SigningKey,
    store: Store,
    leadership: Arc<dyn Leadership>,
    opening: std::time::Instant,
    handover: Option<Box<Handover>>,
    shutdown: CancellationToken,
) -> Result<(), ServiceError> {
    let db = store.describe();
    let store_is_sled = store.sled_path().is_some();
    let opened_ms = opening.elapsed().as_millis();
    // The authorized keys file is parsed on a thread of its own while the store's records load:
    // each key is a point decompression, about 0.4 s for a file of 100k keys, as long as the
    // rest of the records together (docs/performance.md, "Where a restart's first second goes").
    let authorized = parse_authorized_keys_aside(config.enrollment.authorized_keys.clone());
    let rollouts = store
        .load_rollouts()
        .map_err(|source| ServiceError::LoadRollouts {
            store: db.clone(),
            source,
        })?;
    let rollouts_ms = opening.elapsed().as_millis() - opened_ms;
    let groups = store
        .list_groups()
        .map_err(|source| ServiceError::LoadGroups {
            store: db.clone(),
            source,
        })?;
    let issued = store
        .load_issued()
        .map_err(|source| ServiceError::LoadSequence {
            store: db.clone(),
            source,
        })?;
    let (authorized, authorized_keys_ms) = authorized.wait()?;
    let load_enrollments = |source| ServiceError::LoadEnrollments {
        store: db.clone(),
        source,
    };
    let registry = Registry::new(
        store.list_enrollments().map_err(load_enrollments)?,
        authorized,
        config.enrollment.tokens.clone(),
        store.used_tokens().map_err(load_enrollments)?,
        config.enrollment.max_pending,
    )
    .with_limits(
        config.enrollment.attempts_per_second,
        config.enrollment.device_attempts_per_minute,
    );
    let loaded_ms = opening.elapsed().as_millis();
    let (rollout_count, group_count) = (rollouts.len(), groups.len());
    let mut engine = Engine::restore(rollouts, SystemZones);
    engine.set_device_groups(groups);
    // Where coordinators share a store, the trace names which one decided.
    let status = leadership.status();
    if status.lease.is_some() {
        engine.set_decider(Some(format!(
            "{} at lease epoch {}",
            status.me,
            leadership.epoch()
        )));
    }
    // Where a restart's time goes before the coordinator connects (docs/performance.md).
    tracing::info!(rollouts = rollout_count, device_groups = group_count, enrollments = registry.all().count(),
        store = %db, epoch = leadership.epoch(), store_open_ms = opened_ms, rollouts_ms, authorized_keys_ms,
        other_records_ms = loaded_ms - opened_ms - rollouts_ms, engine_ms = opening.elapsed().as_millis() - loaded_ms,
        "coordinator starting");

    let topics = Topics::new(&config.broker.topic_root);
    let gate = Gate::new(
        config.operators.clone(),
        config.clock_window,
        topics.clone(),
        now(),
    )
    .with_limits(config.control_limits);
    if gate.operator_count() == 0 {
        tracing::warn!("no [[operators]] configured: every control request will be refused");
    }
    let mut metrics = Metrics::new();
    metrics.watch_limits(gate.counts(), registry.attempt_counts());
    let coverage = Coverage::new();
    metrics.register_collector(coverage.collector());
    metrics.register_collector(LeaderCollector::boxed(leadership.clone()));
    let metrics_token = shutdown.child_token();
    let _metrics_stop = metrics_token.clone().drop_guard();
    // Its own token: a leader that steps down closes its servers, so the ports are free when it
    // leads again.
    let (http_inbox, mut http_requests) = http::control::channel();
    let (live, _) = tokio::sync::broadcast::channel(http::control::EVENTS);
    let leading = http::Leading {
        control: http_inbox,
        events: live.clone(),
        sessions: http::session::load(&store, &config.operators),
    };
    http::start(
        config,
        &metrics.endpoint(),
        Some(leading),
        String::new(),
        &metrics_token,
    )
    .await?;
    let mut http_open = true;
    // The control connection first (`control_link.rs`): once the main one has subscribed (and
    // a client sees the coordinator's marker), a request on it is read.
    let (link, kept, direct) = match handover.map(|h| *h) {
        Some(Handover { link, kept }) => {
            let direct = control_link::open(config, &topics, link.token.clone()).await;
            (link, Some(kept), direct)
        }
        None => {
            let token = CancellationToken::new();
            let direct = control_link::open(config, &topics, token.clone()).await;
            (open_link_on(config, &topics, token)?, None, direct)
        }
    };
    let LeaderLink {
        client: link_client,
        mut incoming,
        mut control,
        lane_open,
        task: link_task,
        inbox,
        token: link_token,
        loading,
    } = link;
    metrics.attach(inbox.clone());
    let mut control_open = true;
    let (replies, replies_up) = match &direct {
        Some(d) => (Some(d.client.clone()), d.up),
        None => (None, false),
    };
    let twins = direct.as_ref().map(|_| Twins::default());
    let (mut direct, direct_task) = match direct {
        Some(d) => (Some(d.events), Some(d.task)),
        None => (None, None),
    };
    let mut lane_streak = 0u32;
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
        replies,
        replies_up,
        twins,
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
        loading,
        confirmed: None,
        coverage,
        lane_open,
        leadership: leadership.clone(),
        fenced: false,
        unsaved: Default::default(),
        live,
        live_changes: Default::default(),
    };
    if let Some(kept) = kept {
        service.take_over(kept).await?;
    }
    let mut role = leadership.watch();

    let mut ticker = tokio::time::interval(TICK);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut live_ticker = tokio::time::interval(live::LIVE_EVERY);
    live_ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let result = loop {
        // Far enough never to fire when no marker is awaited (the branch is disabled then).
        let marker_due = service.loading.deadline();
        let marker_wait = marker_due.unwrap_or_else(|| tokio::time::Instant::now() + TICK * 3600);
        let step = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break Ok(()),
            // Control requests first: they must not wait behind a burst of device traffic (on
            // their own connection always, decision 0066; in the main link's lane while loading
            // otherwise). At most LANE_STREAK in a row, so a flood of them cannot stall the
            // device messages (and the marker) behind them.
            request = next(&mut direct), if lane_streak < LANE_STREAK => match request {
                Some(LinkEvent::Publish { topic, payload }) => {
                    lane_streak += 1;
                    service.on_publish_via(Side::Control, &topic, &payload, None).await
                }
                Some(LinkEvent::Connected) => {
                    service.replies_up = true;
                    Ok(())
                }
                Some(LinkEvent::Disconnected { .. }) => {
                    service.replies_up = false;
                    Ok(())
                }
                Some(LinkEvent::Subscribed) => Ok(()),
                None => {
                    direct = None;
                    service.replies_up = false;
                    Ok(())
                }
            },
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
            // HTTP control requests share the control lane and its streak.
            request = http_requests.recv(), if http_open && lane_streak < LANE_STREAK => match request {
                Some(request) => {
                    lane_streak += 1;
                    service.on_http(request).await
                }
                None => {
                    http_open = false;
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
            // A shared store's lease lost: stop at once, before anything else is published.
            _ = role.changed() => match &*role.borrow_and_update() {
                Role::Leader { .. } => Ok(()),
                Role::Standby { .. } => Err(service.deposed("the lease was not renewed in time")),
            },
            _ = ticker.tick() => {
                lane_streak = 0;
                let _timing = service.metrics.input("tick");
                service.save_enrollments();
                let effects = service.engine.tick(now());
                match service.apply(effects).await {
                    Ok(()) => match service.retry_enrollments().await {
                        Ok(()) => service.retry_store().await,
                        Err(e) => Err(e),
                    },
                    Err(e) => Err(e),
                }
            }
            // Between ticks, only while someone follows the event streams.
            _ = live_ticker.tick(), if service.live.receiver_count() > 0 => {
                service.tell_live_changes();
                Ok(())
            }
        };
        if let Err(e) = step {
            break Err(e);
        }
        if service.unsaved.len() >= Unsaved::LIMIT {
            service.save_enrollments();
        }
        service.refresh_metrics();
    };
    if result.is_ok() && leadership.leads() {
        // Persist whatever enrollments and per-device progress the last tick has not saved yet.
        service.save_enrollments();
        let effects = service.engine.tick(now());
        service.apply(effects).await?;
    }
    link_token.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(2), link_task).await;
    if let Some(task) = direct_task {
        let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
    }
    if service.health.is_failing() && store_is_sled {
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

/// The next event of the control connection; never, without one.
async fn next(direct: &mut Option<Events>) -> Option<LinkEvent> {
    match direct {
        Some(events) => events.recv().await,
        None => std::future::pending().await,
    }
}

/// The leader's connection to the broker: the link, with device signatures checked ahead of
/// the loop ([`verify`]), and whether the retained messages it delivered are read yet.
pub(super) struct LeaderLink {
    pub(super) client: AsyncClient,
    pub(super) incoming: Pipeline,
    /// Control requests read ahead of the retained burst while loading (`mqtt.rs`). A leader
    /// reads them on a connection of its own too (`control_link.rs`).
    pub(super) control: Events,
    pub(super) lane_open: Arc<AtomicBool>,
    pub(super) task: JoinHandle<()>,
    pub(super) inbox: InboxStats,
    /// The link's own token: on shutdown the final effects must still be published.
    pub(super) token: CancellationToken,
    pub(super) loading: Loading<Held>,
}

impl LeaderLink {
    /// Disconnects, giving the link two seconds to send what is queued.
    pub(super) async fn close(self) {
        self.token.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(2), self.task).await;
    }
}

/// What a standby hands the service when it takes over (`standby.rs`): its link, subscribed
/// to everything the leader reads, and what it kept of the fleet from it (`warm.rs`).
pub(super) struct Handover {
    pub(super) link: LeaderLink,
    pub(super) kept: Kept,
}

/// Connects to the broker with everything a leader subscribes to: device messages, retained
/// desired actions, control requests (with a lane of their own) and the marker.
pub(super) fn open_link(config: &Config, topics: &Topics) -> Result<LeaderLink, ServiceError> {
    open_link_on(config, topics, CancellationToken::new())
}

/// [`open_link`], stopped by `token`.
fn open_link_on(
    config: &Config,
    topics: &Topics,
    token: CancellationToken,
) -> Result<LeaderLink, ServiceError> {
    // A stable client id, so the broker's ACL can name the coordinator (and a second
    // coordinator started by mistake takes the connection over instead of running beside it).
    // Control requests stay among its subscriptions beside the control connection's
    // (`control_link.rs`): a broker that refuses that login costs the head start, not the answers.
    let mut filters = topics.coordinator_filters();
    filters.push(topics.desired_filter());
    // The coordinator's own marker (`loading.rs`) and a lane of its own for control requests.
    filters.push(topics.marker());
    // What the broker says it dropped, where it says so (Mosquitto; `coverage.rs`). Only when
    // asked: rumqttd, for one, closes the connection of a client that subscribes to `$SYS`.
    if config.watch_sys_dropped && config.broker.embedded.is_none() {
        filters.push(coverage::SYS_DROPPED.to_owned());
    } else if config.watch_sys_dropped {
        tracing::warn!(
            "[service] watch_sys_dropped is ignored with the embedded broker: rumqttd closes the \
             connection of a client that subscribes to $SYS"
        );
    }
    let options = LinkOptions::with_connection(
        config.connection(),
        config.broker.client_id.clone(),
        filters,
    )
    .with_lane(topics.control_request());
    tracing::info!(broker = %options.connection.describe(), client = %options.client_id, "connecting to the MQTT broker");
    let link = mqtt::start(options, token.clone());
    let inbox = link.events.stats();
    // Device signatures are checked on worker threads; the loop gets the events in order.
    let keys = Arc::new(KeyCache::new(verify::KEY_CACHE_CAPACITY));
    let incoming = verify::start(link.events, topics.clone(), config.verify_threads, keys)
        .map_err(|e| ServiceError::VerifyThreads {
            threads: config.verify_threads,
            reason: e.to_string(),
        })?;
    tracing::info!(
        threads = config.verify_threads,
        "checking device signatures ahead of the service loop"
    );
    Ok(LeaderLink {
        client: link.client,
        incoming,
        control: link.lane,
        lane_open: link.lane_open,
        task: link.task,
        inbox,
        token,
        loading: Loading::new(loading::MAX_HELD, config.marker_timeout),
    })
}

/// The authorized keys file being parsed beside the store's records ([`lead`]).
enum AuthorizedKeysParse {
    /// Parsed already: no file configured, or no thread could be started.
    Ready(AuthorizedKeysParsed),
    Aside(std::thread::JoinHandle<AuthorizedKeysParsed>),
}

type AuthorizedKeysParsed = Result<(Vec<enrollment::AuthorizedKey>, u128), ServiceError>;

fn parse_authorized_keys_file(path: &Path) -> AuthorizedKeysParsed {
    let started = std::time::Instant::now();
    let keys = std::fs::read_to_string(path)
        .map_err(|e| e.to_string())
        .and_then(|text| enrollment::parse_authorized_keys(&text))
        .map_err(|reason| ServiceError::AuthorizedKeys {
            path: path.to_owned(),
            reason,
        })?;
    Ok((keys, started.elapsed().as_millis()))
}

/// Starts parsing the authorized keys file at `path` on a thread of its own.
fn parse_authorized_keys_aside(path: Option<PathBuf>) -> AuthorizedKeysParse {
    let Some(path) = path else {
        return AuthorizedKeysParse::Ready(Ok((Vec::new(), 0)));
    };
    let aside = path.clone();
    match std::thread::Builder::new()
        .name("flotilla-authorized-keys".to_owned())
        .spawn(move || parse_authorized_keys_file(&aside))
    {
        Ok(handle) => AuthorizedKeysParse::Aside(handle),
        Err(_) => AuthorizedKeysParse::Ready(parse_authorized_keys_file(&path)),
    }
}

impl AuthorizedKeysParse {
    /// The parsed keys and how long the parse took (ms), or why the file is refused.
    fn wait(self) -> AuthorizedKeysParsed {
        match self {
            AuthorizedKeysParse::Ready(parsed) => parsed,
            AuthorizedKeysParse::Aside(handle) => handle
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::broker::EmbeddedBroker;
    use crate::service::leadership::Sole;
    use flotilla_protocol::{envelope, ActionBody, DesiredAction, DeviceId, Message, SigningKey};
    use flotilla_rollout::engine::Effect;
    use rumqttc::QoS;

    use flotilla_protocol::DeviceState;
    use rumqttc::{Event, EventLoop, MqttOptions, Packet};
    use std::collections::BTreeMap;

    const WAIT: Duration = Duration::from_secs(20);

    #[test]
    fn the_authorized_keys_parsed_aside_refuse_a_bad_line_as_before() {
        let dir = tempfile::tempdir().expect("tempdir");
        let good = SigningKey::from_bytes(&[3; 32]).verifying_key();
        let path = dir.path().join("authorized_keys");
        std::fs::write(
            &path,
            format!(
                "# fleet keys\n{} dev-1\n",
                flotilla_protocol::hex::encode(good.as_bytes())
            ),
        )
        .expect("write");
        let (keys, _ms) = parse_authorized_keys_aside(Some(path.clone()))
            .wait()
            .expect("a good file");
        assert_eq!(keys.len(), 1);
        assert_eq!(keys[0].device.as_deref(), Some("dev-1"));

        // A point that is not on the curve: the coordinator does not start, naming file and line.
        let mut not_a_point = [0u8; 32];
        not_a_point[0] = 2;
        std::fs::write(
            &path,
            format!(
                "# fleet keys\n{}\n",
                flotilla_protocol::hex::encode(&not_a_point)
            ),
        )
        .expect("write");
        let message = match parse_authorized_keys_aside(Some(path.clone())).wait() {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a key that is no point is refused"),
        };
        assert!(
            message.contains("authorized_keys") && message.contains("line 2"),
            "{message}"
        );

        let missing = dir.path().join("missing");
        assert!(parse_authorized_keys_aside(Some(missing)).wait().is_err());
        assert!(parse_authorized_keys_aside(None)
            .wait()
            .expect("none")
            .0
            .is_empty());
    }

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
            replies: None,
            replies_up: false,
            twins: None,
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
            confirmed: None,
            coverage: Coverage::new(),
            lane_open: link.lane_open.clone(),
            leadership: Arc::new(Sole::new("test")),
            fenced: false,
            unsaved: Default::default(),
            live: tokio::sync::broadcast::channel(1).0,
            live_changes: Default::default(),
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
