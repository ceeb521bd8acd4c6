//! The reads of the console's device pages: one device in detail, and the enrollment queue.
//!
//! ```text
//! GET /api/v1/devices/{id}   one device: summary, key fingerprint, actions (`show_device`)
//! GET /api/v1/enrollment     devices waiting for an operator, paged (`pending_devices`)
//! ```
//!
//! As every read, they need a session and run as the session's operator's viewer commands.

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use flotilla_protocol::control::{Command, PageQuery};

use crate::service::http::reads::{paged, read};
use crate::service::http::state::Api;

/// The device pages' routes, added to `router`.
pub fn routes(router: Router<Api>) -> Router<Api> {
    router
        .route("/api/v1/devices/:id", get(device))
        .route("/api/v1/enrollment", get(enrollment))
}

async fn device(
    State(api): State<Api>,
    headers: HeaderMap,
    Path(device): Path<String>,
) -> Response {
    read(&api, &headers, Command::ShowDevice { device }).await
}

async fn enrollment(
    State(api): State<Api>,
    headers: HeaderMap,
    Query(page): Query<PageQuery>,
) -> Response {
    let command = Command::PendingDevices { page: paged(page) };
    read(&api, &headers, command).await
}
