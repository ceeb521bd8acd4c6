//! A coordinator standing by on a shared store (`shared.rs`): warm, silent while another leads.
//!
//! A standby connects to the broker exactly as the leader does, with the same subscriptions,
//! and keeps what it reads of the fleet (`warm.rs`): every device's last state, checked
//! against a snapshot of the enrollments read from the store (refreshed while states wait for
//! one), and the last desired action this coordinator's key signed for it. When it comes to
//! lead, it hands the link and that view to the service (`lead.rs`, `takeover.rs`): no
//! reconnect, no re-read of the retained messages of the whole fleet.
//!
//! A client must get exactly one answer per control request, the leader's. So while the lease
//! is live a standby says nothing; when no coordinator holds it, a standby answers every
//! request with who led last and since when, so the CLI does not wait out its timeout in
//! silence (and `flotilla status` gets the coordinators and the lease). A standby publishes
//! nothing else, and writes nothing.
//!
//! Reports and block requests are the leader's: a standby only keeps those of the last few
//! seconds (the lease's time-to-live and two renewals), so that one sent while no coordinator
//! led reaches the new leader at once.

use std::sync::Arc;
use std::time::Duration;

use flotilla_protocol::control::{Command, ControlReply};
use flotilla_protocol::{Topic, Topics, VerifyingKey};
use flotilla_rollout::engine::Engine;
use flotilla_rollout::zoneinfo::SystemZones;
use rumqttc::QoS;
use tokio_util::sync::CancellationToken;

use crate::service::config::Config;
use crate::service::config_store::PostgresConfig;
use crate::service::enrollment::Enrollment;
use crate::service::error::ServiceError;
use crate::service::http;
use crate::service::lead::{open_link, Handover, LeaderLink};
use crate::service::leadership::{self, Leadership, LeaseView, Role};
use crate::service::metrics::Metrics;
use crate::service::metrics_leader::LeaderCollector;
use crate::service::mqtt::LinkEvent;
use crate::service::operators::Gate;
use crate::service::state::now;
use crate::service::store::postgres::{Fence, Lease, PgBackend, PgSettings};
use crate::service::store::Store;
use crate::service::warm::Warm;

/// How often a standby reads the enrollments again while states wait for a snapshot that
/// accepts them (devices enrolled since the last one).
const REFRESH_EVERY: Duration = Duration::from_secs(10);

/// How standing by ended.
pub(super) enum Standby {
    /// This coordinator leads now; with what the standby kept, unless it could not keep
    /// everything (then the leader reads the broker again).
    Lead(Option<Box<Handover>>),
    /// The process is stopping.
    Stop,
}

/// Stands by until this coordinator leads or `shutdown` is cancelled, keeping the fleet's
/// states and desired actions warm and answering control requests only while no coordinator
/// leads.
pub(super) async fn standby(
    config: &Config,
    pg: &PostgresConfig,
    settings: &PgSettings,
    lease: &Arc<Lease>,
    coordinator: VerifyingKey,
    shutdown: &CancellationToken,
) -> Result<Standby, ServiceError> {
    let (me, renew_every) = (pg.coordinator_id.as_str(), pg.lease.renew_every);
    let mut role = lease.watch();
    if lease.leads() {
        return Ok(Standby::Lead(None));
    }
    // A standby's `/metrics` says it stands by (`flotilla_leader 0`), and its epoch; the
    // endpoint closes when it leads (the leader opens its own) or stops.
    let metrics_token = shutdown.child_token();
    let _metrics_stop = metrics_token.clone().drop_guard();
    let mut metrics = Metrics::new();
    let leadership: Arc<dyn Leadership> = lease.clone();
    metrics.register_collector(LeaderCollector::boxed(leadership));
    // A scrape waits for a snapshot of the engine; a standby has none to give, so it answers
    // with an empty one at once.
    let nothing = Engine::new(SystemZones);
    // Its `/metrics` says nothing is loading: a standby holds no registry.
    metrics.refresh(&nothing, &Default::default(), Default::default(), true);
    let mut scrapes = tokio::time::interval(Duration::from_millis(100));
    // The API answers 503 and names this standby: clients ask the leader.
    let unavailable =
        format!("{me} is a standby: the coordinator that leads answers (flotilla status names it)");
    if let Err(e) = http::start(
        config,
        &metrics.endpoint(),
        None,
        unavailable,
        &metrics_token,
    )
    .await
    {
        tracing::warn!(error = %e, "a standby serves no metrics and no HTTP API");
    }
    let topics = Topics::new(&config.broker.topic_root);
    let mut gate = Gate::new(
        config.operators.clone(),
        config.clock_window,
        topics.clone(),
        now(),
    )
    .with_limits(config.control_limits);
    let reader = Enrollments::open(settings).await;
    // Long enough to cover a dead leader's last moments and the time before another leads.
    let window = pg.lease.ttl + pg.lease.renew_every * 2;
    let mut warm = Warm::new(&reader.read().await.unwrap_or_default(), window);
    let mut refresh = tokio::time::interval(REFRESH_EVERY);
    refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut link = open_link(config, &topics)?;
    let outcome = loop {
        let lane_open = link.lane_open.load(std::sync::atomic::Ordering::SeqCst);
        let (topic, payload, checked) = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break Standby::Stop,
            changed = role.changed() => {
                if changed.is_err() {
                    link.close().await;
                    return Err(ServiceError::SharedStore {
                        reason: "the lease task stopped".to_owned(),
                    });
                }
                if matches!(*role.borrow_and_update(), Role::Leader { .. }) {
                    break Standby::Lead(None);
                }
                continue;
            }
            _ = scrapes.tick() => {
                if metrics.wanted() {
                    metrics.refresh(&nothing, &Default::default(), Default::default(), true);
                }
                continue;
            }
            _ = refresh.tick() => {
                let behind = warm.is_complete().is_err() || link.inbox.dropped() > 0;
                if !(behind || warm.has_unchecked()) {
                    continue;
                }
                let Some(enrollments) = reader.read().await else { continue };
                if behind {
                    // Something was not kept (a fleet enrolling faster than the snapshots, a
                    // full inbox): read the fleet again now, on a new link, against this
                    // snapshot, rather than at takeover.
                    tracing::info!(reason = warm.is_complete().err().unwrap_or("the link dropped messages"),
                        "the standby's view of the fleet fell behind: reading the broker's retained messages again");
                    link.close().await;
                    warm = Warm::new(&enrollments, window);
                    link = open_link(config, &topics)?;
                } else {
                    warm.refresh(&enrollments);
                }
                continue;
            }
            request = link.control.recv(), if lane_open => match request {
                Some(LinkEvent::Publish { topic, payload }) => (topic, payload, None),
                _ => continue,
            },
            arrival = link.incoming.recv() => match arrival {
                Some(arrival) => match arrival.event {
                    LinkEvent::Publish { topic, payload } => (topic, payload, arrival.checked),
                    LinkEvent::Connected => {
                        link.loading.connected();
                        link.lane_open.store(true, std::sync::atomic::Ordering::SeqCst);
                        continue;
                    }
                    // A standby publishes no marker (it publishes nothing while another leads):
                    // the new leader does, when it takes over (`takeover.rs`).
                    LinkEvent::Subscribed | LinkEvent::Disconnected { .. } => continue,
                },
                None => {
                    // The link stopped (it reconnects by itself otherwise): start again, cold.
                    link.close().await;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    warm = Warm::new(&reader.read().await.unwrap_or_default(), window);
                    link = open_link(config, &topics)?;
                    continue;
                }
            },
        };
        match topics.parse(&topic) {
            Some(Topic::State(id)) => warm.observe_state(id.as_str(), &payload, checked),
            Some(Topic::Desired(id)) => warm.observe_desired(id.as_str(), &payload, &coordinator),
            Some(Topic::Report(_) | Topic::Fetch(_)) => {
                warm.observe_recent(&topic, &payload, std::time::Instant::now());
            }
            Some(Topic::ControlRequest) => {
                answer(&mut gate, &link, lease, pg, &payload, me, renew_every).await;
            }
            _ => {}
        }
    };
    if !matches!(outcome, Standby::Lead(_)) {
        link.close().await;
        return Ok(outcome);
    }
    if link.inbox.dropped() > 0 {
        warm.lose(format!(
            "the link dropped {} incoming messages",
            link.inbox.dropped()
        ));
    }
    match warm.is_complete() {
        Ok(()) => Ok(Standby::Lead(Some(Box::new(Handover {
            link,
            kept: warm.take(std::time::Instant::now()),
        })))),
        Err(why) => {
            tracing::warn!(reason = %why,
                "the standby's view of the fleet is incomplete: reading the broker again");
            link.close().await;
            Ok(Standby::Lead(None))
        }
    }
}

/// Answers a control request while standing by: nothing while the lease is live (the leader
/// answers); otherwise that nobody leads, or, for `coordinators`, who is there.
async fn answer(
    gate: &mut Gate,
    link: &LeaderLink,
    lease: &Arc<Lease>,
    pg: &PostgresConfig,
    payload: &[u8],
    me: &str,
    renew_every: Duration,
) {
    let view = lease.status().lease;
    if view.as_ref().is_some_and(LeaseView::is_live) {
        return; // the leader answers
    }
    let refused = |id: String, error: String| ControlReply {
        id,
        ok: false,
        error: Some(error),
        result: serde_json::Value::Null,
        loading: false,
    };
    let (reply_to, reply) = match gate.check(payload, now()) {
        // `flotilla status` still shows the coordinators and the lease.
        Ok(authorized) if authorized.request.command == Command::Coordinators => {
            let info = leadership::info(lease.status(), pg.url.clone());
            (
                authorized.request.reply_to,
                ControlReply {
                    id: authorized.request.id,
                    ok: true,
                    error: None,
                    result: serde_json::to_value(info).unwrap_or_default(),
                    loading: false,
                },
            )
        }
        Ok(authorized) => (
            authorized.request.reply_to,
            refused(
                authorized.request.id,
                leaderless(view.as_ref(), me, renew_every),
            ),
        ),
        Err(refusal) => match refusal.reply_to {
            Some(reply_to) => (
                reply_to,
                refused(refusal.id.unwrap_or_default(), refusal.reason),
            ),
            None => return,
        },
    };
    let bytes = serde_json::to_vec(&reply).unwrap_or_default();
    let _ = link
        .client
        .publish(reply_to, QoS::AtLeastOnce, false, bytes)
        .await;
}

/// What a standby answers while no coordinator leads.
fn leaderless(view: Option<&LeaseView>, me: &str, renew_every: Duration) -> String {
    match view {
        Some(v) if v.epoch > 0 => format!(
            "no coordinator leads since {}; the last leader was {} (lease epoch {}); {me} \
             stands by and takes over within {} s",
            flotilla_rollout::window::utc_text(v.expires_at),
            v.holder,
            v.epoch,
            renew_every.as_secs()
        ),
        _ => format!(
            "no coordinator leads this store yet; {me} stands by and takes over within {} s",
            renew_every.as_secs()
        ),
    }
}

/// The standby's read-only view of the store's enrollments.
struct Enrollments {
    store: Option<Arc<Store>>,
}

impl Enrollments {
    /// Connects to the store for reading; without it the standby keeps states unchecked.
    async fn open(settings: &PgSettings) -> Enrollments {
        let settings = settings.clone();
        let opened =
            tokio::task::spawn_blocking(move || PgBackend::connect(&settings, Fence::NoLiveLease))
                .await;
        let store = match opened {
            Ok(Ok(backend)) => Some(Arc::new(Store::on(Box::new(backend)))),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "a standby cannot read the enrollments: it checks \
                    device states when it leads");
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, "a standby cannot read the enrollments");
                None
            }
        };
        Enrollments { store }
    }

    /// Every enrollment, or `None` when the store cannot be read now.
    async fn read(&self) -> Option<Vec<Enrollment>> {
        let store = self.store.clone()?;
        match tokio::task::spawn_blocking(move || store.list_enrollments()).await {
            Ok(Ok(enrollments)) => Some(enrollments),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "a standby could not read the enrollments");
                None
            }
            Err(_) => None,
        }
    }
}
