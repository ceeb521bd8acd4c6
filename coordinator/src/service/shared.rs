//! Coordinators that share one PostgreSQL store: one leads, the others stand by.
//!
//! Each `flotilla serve` with a `[store] url` starts the lease (`store/postgres/lease.rs`) and
//! stands by until it holds it. A standby stays connected to the broker for one thing: a
//! client must get exactly one answer per control request, the leader's. So while the lease
//! is live a standby says nothing; when no coordinator holds it, a standby answers every
//! request with who led last and since when, so the CLI does not wait out its timeout in
//! silence.
//!
//! Once it holds the lease, the coordinator connects its store with every write fenced by the
//! lease's epoch and runs the service exactly as a coordinator on sled does (`lead.rs`), from
//! what the last leader stored. Losing the lease ends that run at once
//! ([`ServiceError::Deposed`]): nothing more is published or written, and the coordinator
//! stands by again. Decision 0044 has the argument why devices never act on a deposed leader.

use std::sync::Arc;
use std::time::Duration;

use flotilla_protocol::control::{Command, ControlReply};
use flotilla_protocol::{SigningKey, Topics};
use flotilla_rollout::engine::Engine;
use flotilla_rollout::zoneinfo::SystemZones;
use rumqttc::QoS;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::service::config::Config;
use crate::service::config_store::PostgresConfig;
use crate::service::error::ServiceError;
use crate::service::lead::lead;
use crate::service::leadership::{self, Leadership, LeaseView, Role};
use crate::service::metrics::{self, Metrics};
use crate::service::metrics_leader::LeaderCollector;
use crate::service::mqtt::{self, LinkEvent, LinkOptions};
use crate::service::operators::Gate;
use crate::service::state::now;
use crate::service::store::postgres::{Fence, Lease, PgBackend, PgSettings};
use crate::service::store::Store;

/// Runs a coordinator on a shared store until `shutdown` is cancelled: standing by, leading
/// when it holds the lease, standing by again when it loses it.
pub(crate) async fn serve_shared(
    config: &Config,
    pg: &PostgresConfig,
    key: SigningKey,
    shutdown: CancellationToken,
) -> Result<(), ServiceError> {
    let settings = pg_settings(pg);
    // Two coordinators with one client id would take each other's broker connection.
    let mut config = config.clone();
    config.broker.client_id = format!("{}-{}", config.broker.client_id, pg.coordinator_id);
    let lease = {
        let (settings, me, client, timing) = (
            settings.clone(),
            pg.coordinator_id.clone(),
            config.broker.client_id.clone(),
            pg.lease,
        );
        tokio::task::spawn_blocking(move || Lease::start(&settings, me, client, timing))
            .await
            .map_err(|e| ServiceError::SharedStore {
                reason: format!("the lease task failed: {e}"),
            })?
            .map_err(|e| ServiceError::SharedStore {
                reason: e.to_string(),
            })?
    };
    tracing::info!(coordinator = %pg.coordinator_id, store = %pg.url, client = %config.broker.client_id,
        lease_ttl_s = pg.lease.ttl.as_secs(), lease_renew_s = pg.lease.renew_every.as_secs(),
        "sharing the store with other coordinators: standing by until this one holds the lease");
    let result = loop {
        match standby(&config, pg, &lease, &shutdown).await {
            Ok(true) => {}
            Ok(false) => break Ok(()),
            Err(e) => break Err(e),
        }
        let opening = std::time::Instant::now();
        let connect = {
            let (settings, fence) = (settings.clone(), Fence::Lease(lease.clone()));
            tokio::task::spawn_blocking(move || PgBackend::connect(&settings, fence)).await
        };
        let backend = match connect {
            Ok(Ok(backend)) => backend,
            // The database went away between the lease and the store: try again shortly (the
            // lease runs out meanwhile if it stays away, and another coordinator may lead).
            Ok(Err(e)) => {
                tracing::warn!(coordinator = %pg.coordinator_id, error = %e,
                    "holds the lease but cannot open the store; trying again");
                tokio::time::sleep(pg.lease.renew_every).await;
                continue;
            }
            Err(e) => {
                break Err(ServiceError::SharedStore {
                    reason: format!("the store task failed: {e}"),
                })
            }
        };
        tracing::info!(coordinator = %pg.coordinator_id, epoch = lease.epoch(), "this coordinator leads now");
        let store = Store::on(Box::new(backend));
        let leadership: Arc<dyn Leadership> = lease.clone();
        // Every line the leader logs names it and its epoch: the log says who decided what.
        let span =
            tracing::info_span!("lead", coordinator = %pg.coordinator_id, epoch = lease.epoch());
        let run = lead(
            &config,
            key.clone(),
            store,
            leadership,
            opening,
            shutdown.clone(),
        );
        match run.instrument(span).await {
            Err(ServiceError::Deposed { epoch, reason }) => {
                tracing::warn!(coordinator = %pg.coordinator_id, epoch, %reason,
                    "stopped leading: nothing more is published or written; standing by again");
            }
            // Reading the store at the start of a run failed (the database went away): like
            // a lost lease, not a reason to stop the process.
            Err(
                e @ (ServiceError::LoadRollouts { .. }
                | ServiceError::LoadGroups { .. }
                | ServiceError::LoadSequence { .. }
                | ServiceError::LoadEnrollments { .. }),
            ) => {
                tracing::warn!(coordinator = %pg.coordinator_id, error = %e,
                    "stopped leading: the store could not be read; standing by again");
                tokio::time::sleep(pg.lease.renew_every).await;
            }
            other => break other,
        }
    };
    // A clean stop hands the lease over at once instead of after its time-to-live.
    let leaving = lease.clone();
    let _ = tokio::task::spawn_blocking(move || leaving.step_down()).await;
    result
}

/// The database connection a `[store]` section names.
pub(crate) fn pg_settings(pg: &PostgresConfig) -> PgSettings {
    PgSettings {
        url: pg.url.clone(),
        password: pg.password.clone(),
        ca_file: pg.ca_file.clone(),
        tls: pg.ca_file.is_some(),
        ..PgSettings::default()
    }
}

/// Stands by until this coordinator leads (`true`) or `shutdown` is cancelled (`false`),
/// answering control requests only while no coordinator leads.
async fn standby(
    config: &Config,
    pg: &PostgresConfig,
    lease: &Arc<Lease>,
    shutdown: &CancellationToken,
) -> Result<bool, ServiceError> {
    let (me, renew_every) = (pg.coordinator_id.as_str(), pg.lease.renew_every);
    let mut role = lease.watch();
    if lease.leads() {
        return Ok(true);
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
    let mut scrapes = tokio::time::interval(Duration::from_millis(100));
    if let Some(addr) = config.metrics {
        match metrics::bind_retrying(addr).await {
            Ok(listener) => {
                tokio::spawn(metrics::run(
                    listener,
                    metrics.endpoint(),
                    metrics_token.clone(),
                ));
            }
            Err(e) => tracing::warn!(error = %e, "a standby serves no metrics"),
        }
    }
    let topics = Topics::new(&config.broker.topic_root);
    let mut gate = Gate::new(
        config.operators.clone(),
        config.clock_window,
        topics.clone(),
        now(),
    )
    .with_limits(config.control_limits);
    let link_token = CancellationToken::new();
    let options = LinkOptions::with_connection(
        config.connection(),
        config.broker.client_id.clone(),
        vec![topics.control_request()],
    );
    let mut link = mqtt::start(options, link_token.clone());
    let outcome = loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break Ok(false),
            _ = scrapes.tick() => {
                if metrics.wanted() {
                    metrics.refresh(&nothing, &Default::default(), Default::default());
                }
            }
            changed = role.changed() => {
                if changed.is_err() {
                    break Err(ServiceError::SharedStore {
                        reason: "the lease task stopped".to_owned(),
                    });
                }
                if matches!(*role.borrow_and_update(), Role::Leader { .. }) {
                    break Ok(true);
                }
            }
            event = link.events.recv() => match event {
                Some(LinkEvent::Publish { topic, payload }) if topic == topics.control_request() => {
                    let view = lease.status().lease;
                    if view.as_ref().is_some_and(LeaseView::is_live) {
                        continue; // the leader answers
                    }
                    let (reply_to, reply) = match gate.check(&payload, now()) {
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
                            ControlReply {
                                id: authorized.request.id,
                                ok: false,
                                error: Some(leaderless(view.as_ref(), me, renew_every)),
                                result: serde_json::Value::Null,
                                loading: false,
                            },
                        ),
                        Err(refusal) => match refusal.reply_to {
                            Some(reply_to) => (
                                reply_to,
                                ControlReply {
                                    id: refusal.id.unwrap_or_default(),
                                    ok: false,
                                    error: Some(refusal.reason),
                                    result: serde_json::Value::Null,
                                    loading: false,
                                },
                            ),
                            None => continue,
                        },
                    };
                    let bytes = serde_json::to_vec(&reply).unwrap_or_default();
                    let _ = link.client.publish(reply_to, QoS::AtLeastOnce, false, bytes).await;
                }
                Some(_) => {}
                None => {
                    // The link ended (it reconnects by itself otherwise); start it again.
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    let options = LinkOptions::with_connection(
                        config.connection(),
                        config.broker.client_id.clone(),
                        vec![topics.control_request()],
                    );
                    link = mqtt::start(options, link_token.clone());
                }
            },
        }
    };
    link_token.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(2), link.task).await;
    outcome
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
