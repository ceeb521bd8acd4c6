//! The web console: one page, its script and its style, served from the binary (no build step,
//! nothing fetched from elsewhere). The page reads through the HTTP API with a session, follows
//! `/api/v1/events`, and signs every change with the operator's key in the browser (WebCrypto
//! Ed25519); the server has no other way in (decision 0058).

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

use crate::service::http::state::Api;

const PAGE: &str = include_str!("console/index.html");
const SCRIPT: &str = include_str!("console/app.js");
/// The pages beyond the rollouts, each a script of its own, loaded before `app.js`.
const DEVICES: &str = include_str!("console/devices.js");
const QUEUES: &str = include_str!("console/queues.js");
const RELEASES: &str = include_str!("console/releases.js");
const STYLE: &str = include_str!("console/style.css");

/// What the console's responses forbid: scripts and styles from anywhere but this server, any
/// framing (clickjacking), and sending the page's address elsewhere.
const POLICY: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; \
                      connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

/// The console's routes, added to `router`.
pub fn routes(router: Router<Api>) -> Router<Api> {
    router
        .route("/", get(|| async { Redirect::to("/console") }))
        .route("/console", get(page))
        .route("/console/app.js", get(script))
        .route("/console/devices.js", get(|| js(DEVICES)))
        .route("/console/queues.js", get(|| js(QUEUES)))
        .route("/console/releases.js", get(|| js(RELEASES)))
        .route("/console/style.css", get(style))
}

fn guarded(content_type: &'static str, body: String) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, POLICY),
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

async fn page(State(api): State<Api>) -> Response {
    // The topic root goes into the signed requests' reply topics; it is an id (no quotes or
    // angle brackets can be in it), escaped anyway.
    let root = api
        .topic_root
        .replace('&', "&amp;")
        .replace('"', "&quot;")
        .replace('<', "&lt;");
    guarded(
        "text/html; charset=utf-8",
        PAGE.replace("{{TOPIC_ROOT}}", &root),
    )
}

async fn script() -> Response {
    js(SCRIPT).await
}

async fn js(source: &'static str) -> Response {
    guarded("text/javascript; charset=utf-8", source.to_owned())
}

async fn style() -> Response {
    guarded("text/css; charset=utf-8", STYLE.to_owned())
}
