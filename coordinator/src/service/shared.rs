//! Coordinators that share one PostgreSQL store: one leads, the others stand by.
//!
//! Each `flotilla serve` with a `[store] url` starts the lease (`store/postgres/lease.rs`) and
//! stands by until it holds it (`standby.rs`): connected to the broker with the leader's
//! subscriptions, keeping the fleet's states and desired actions warm, silent while another
//! coordinator leads.
//!
//! Once it holds the lease, the coordinator connects its store with every write fenced by the
//! lease's epoch and runs the service exactly as a coordinator on sled does (`lead.rs`), from
//! what the last leader stored, on the standby's link and with what it kept
//! (`takeover.rs`). Losing the lease ends that run at once
//! ([`ServiceError::Deposed`]): nothing more is published or written, and the coordinator
//! stands by again. Decision 0044 has the argument why devices never act on a deposed leader.

use std::sync::Arc;

use flotilla_protocol::SigningKey;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::service::config::Config;
use crate::service::config_store::PostgresConfig;
use crate::service::error::ServiceError;
use crate::service::lead::lead;
use crate::service::leadership::Leadership;
use crate::service::standby::{standby, Standby};
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
    let mut handover = None;
    let result = loop {
        if handover.is_none() {
            let coordinator = key.verifying_key();
            match standby(&config, pg, &settings, &lease, coordinator, &shutdown).await {
                Ok(Standby::Lead(warm)) => handover = warm,
                Ok(Standby::Stop) => break Ok(()),
                Err(e) => break Err(e),
            }
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
                if !lease.leads() {
                    // Another coordinator leads by now: this view goes stale, start over.
                    if let Some(h) = handover.take() {
                        h.link.close().await;
                    }
                }
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
            handover.take(),
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
