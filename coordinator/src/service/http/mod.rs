//! The coordinator's HTTP server (`[http] listen`, and `[metrics] listen` for metrics alone):
//! hyper on the service's tokio runtime, over rustls when configured (decision 0055).
//!
//! - [`server`]: the accept loop: bounded connections, timeouts, TLS.
//! - [`slots`]: which connection makes room when all are taken.
//! - [`api`]: the routes: `/metrics`, `/api/openapi.json`, `POST /api/v1/control`.
//! - [`commands`]: `POST /api/v1/commands/{command}`, one path per control command.
//! - [`console`]: the web console: a page and its script, on the API and nothing else.
//! - [`artifacts`]: `GET /artifacts/{sha256}`, the artifact store with byte ranges (0062).
//! - [`control`]: an HTTP control request on its way to the service loop and back.
//! - [`reads`]: browser sessions, paged reads in a session's name, live events (SSE);
//!   [`reads_devices`]: the device pages' reads (one device, the enrollment queue).
//! - [`session`]: the session table and its cookie.
//! - [`state`]: what the routes share; bounded bodies; asking the service loop.
//! - [`tls`]: the server's certificate and key.

pub mod api;
pub mod artifacts;
pub mod commands;
pub mod console;
pub mod control;
#[cfg(test)]
mod load;
pub mod reads;
pub mod reads_devices;
pub mod server;
pub mod session;
pub mod slots;
pub mod state;
pub mod tls;

use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;

use crate::service::config::Config;
use crate::service::http::control::HttpControl;
use crate::service::metrics::Endpoint;

/// Why the HTTP server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Listen(#[from] server::ListenError),
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
}

/// What the HTTP API reaches while this coordinator leads.
#[derive(Debug, Clone)]
pub struct Leading {
    /// The service loop's inbox.
    pub control: mpsc::Sender<HttpControl>,
    /// Live events from the service loop, for event streams.
    pub events: broadcast::Sender<state::LiveEvent>,
    /// The sessions read from the store, still valid (`session::still_valid`), by digest.
    pub sessions: Vec<(String, session::Session)>,
}

/// Starts what `config` asks for, each server until `token` is cancelled: `[metrics] listen`
/// (metrics only) and `[http] listen` (metrics and the API). Without `leading` (a standby) the
/// API answers `503` with `unavailable`.
pub async fn start(
    config: &Config,
    metrics: &Endpoint,
    leading: Option<Leading>,
    unavailable: String,
    token: &CancellationToken,
) -> Result<(), StartError> {
    if let Some(addr) = config.metrics {
        let listener = server::bind_retrying(addr, "metrics.listen").await?;
        let router = api::router(state::Api::metrics_only(Some(metrics.clone())), false);
        tracing::info!(%addr, "serving metrics on http://{addr}/metrics");
        tokio::spawn(server::serve(
            listener,
            None,
            router,
            server::MAX_CONNECTIONS,
            token.clone(),
        ));
    }
    if let Some(http) = &config.http {
        let tls = http.tls.as_ref().map(tls::acceptor).transpose()?;
        let listener = server::bind_retrying(http.listen, "http.listen").await?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        tracing::info!(addr = %http.listen, "serving the HTTP API on {scheme}://{}/api/v1/control (and /metrics)", http.listen);
        let (control, events, sessions) = match leading {
            Some(Leading {
                control,
                events,
                sessions,
            }) => (Some(control), Some(events), sessions),
            None => (None, None, Vec::new()),
        };
        let state = state::Api {
            metrics: Some(metrics.clone()),
            control,
            unavailable,
            sessions: std::sync::Arc::new(session::Sessions::with(sessions)),
            events,
            streams: Default::default(),
            secure: tls.is_some(),
            topic_root: config.broker.topic_root.clone(),
            artifacts: Some(
                crate::service::releases::ReleaseStore::new(&config.data_dir).artifacts_dir(),
            ),
        };
        tokio::spawn(server::serve(
            listener,
            tls,
            api::router(state, true),
            server::MAX_CONNECTIONS,
            token.clone(),
        ));
    }
    Ok(())
}
