//! What the routes share: the metrics, the service loop's inbox while this coordinator leads,
//! the browser sessions and the live events.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use flotilla_protocol::control::ControlReply;
use http_body_util::{BodyExt, Limited};
use tokio::sync::{broadcast, mpsc, oneshot};

use crate::service::http::control::{HttpAnswer, HttpControl};
use crate::service::http::session::Sessions;
use crate::service::metrics::Endpoint;

/// The largest request body read (a control request with a strategy's TOML fits many times).
pub const MAX_BODY: usize = 256 * 1024;
/// How long a client may take to send its body.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a request waits for the service loop's answer.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(20);

/// One live event for the event streams: its kind (`rollout`, `approval`, `trace`) and JSON.
pub type LiveEvent = Arc<(&'static str, String)>;

/// The routes' shared state.
#[derive(Clone)]
pub struct Api {
    pub metrics: Option<Endpoint>,
    /// The service loop's inbox; `None` on a standby.
    pub control: Option<mpsc::Sender<HttpControl>>,
    /// Said instead of an answer when `control` is `None`.
    pub unavailable: String,
    pub sessions: Arc<Sessions>,
    /// Live events from the service loop; `None` on a standby.
    pub events: Option<broadcast::Sender<LiveEvent>>,
    /// Event streams open now.
    pub streams: Arc<AtomicUsize>,
    /// Whether the listener is HTTPS (session cookies are `Secure` then).
    pub secure: bool,
    /// The MQTT topic root, which the console's signed requests name in their reply topics.
    pub topic_root: String,
    /// The artifact store served at `/artifacts/{sha256}`; `None` serves none.
    pub artifacts: Option<std::path::PathBuf>,
}

impl Api {
    /// A state that serves metrics only (`[metrics] listen`), or nothing but refusals.
    pub fn metrics_only(metrics: Option<Endpoint>) -> Api {
        Api {
            metrics,
            control: None,
            unavailable: "this listener serves /metrics only".into(),
            sessions: Arc::default(),
            events: None,
            streams: Arc::default(),
            secure: false,
            topic_root: flotilla_protocol::topics::DEFAULT_ROOT.to_owned(),
            artifacts: None,
        }
    }

    /// Runs a signed control request (the envelope's bytes) through the service loop's
    /// operator gate: its answer as JSON with its status, or why there is none.
    pub async fn run_signed(&self, payload: &[u8]) -> Response {
        let (answer, answered) = oneshot::channel();
        let request = HttpControl::Signed {
            payload: payload.to_vec(),
            answer,
        };
        match self.ask(request, answered).await {
            Ok(HttpAnswer { status, reply }) => (status, Json(reply)).into_response(),
            Err(answer) => answer,
        }
    }

    /// Hands `request` to the service loop and waits for what comes back on `answered`, or the
    /// answer that says why there is none.
    pub async fn ask<T>(
        &self,
        request: HttpControl,
        answered: oneshot::Receiver<T>,
    ) -> Result<T, Response> {
        let Some(inbox) = &self.control else {
            return Err(refused(
                StatusCode::SERVICE_UNAVAILABLE,
                self.unavailable.clone(),
            ));
        };
        if let Err(e) = inbox.try_send(request) {
            let why = match e {
                mpsc::error::TrySendError::Full(_) => {
                    "the coordinator has too many HTTP requests waiting; try again shortly"
                }
                mpsc::error::TrySendError::Closed(_) => "the coordinator is not leading any more",
            };
            return Err(refused(StatusCode::SERVICE_UNAVAILABLE, why.into()));
        }
        match tokio::time::timeout(ANSWER_TIMEOUT, answered).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(_)) => Err(refused(
                StatusCode::SERVICE_UNAVAILABLE,
                "the coordinator stopped leading before it answered; ask the leader again".into(),
            )),
            Err(_) => Err(refused(
                StatusCode::GATEWAY_TIMEOUT,
                format!(
                    "no answer within {} s; the request may still take effect: look before you \
                     repeat it",
                    ANSWER_TIMEOUT.as_secs()
                ),
            )),
        }
    }
}

/// An error in the shape every API answer has, so a client reads one shape.
pub fn refused(status: StatusCode, error: String) -> Response {
    let reply = ControlReply {
        id: String::new(),
        ok: false,
        error: Some(error),
        result: serde_json::Value::Null,
        loading: false,
    };
    (status, Json(reply)).into_response()
}

/// The body, at most [`MAX_BODY`] bytes within [`BODY_TIMEOUT`], or the answer that says why not.
pub async fn read_body(body: Body) -> Result<Bytes, Response> {
    // A body that says it is too large is refused before a byte of it is read: a client that
    // sent `Expect: 100-continue` (curl does, for large bodies) gets the answer without sending
    // it at all.
    use axum::body::HttpBody as _;
    let announced = body.size_hint().lower();
    if announced > MAX_BODY as u64 {
        return Err(refused(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is {announced} bytes, larger than {MAX_BODY} bytes"),
        ));
    }
    match tokio::time::timeout(BODY_TIMEOUT, Limited::new(body, MAX_BODY).collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(refused(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than {MAX_BODY} bytes"),
        )),
        Ok(Err(e)) => Err(refused(
            StatusCode::BAD_REQUEST,
            format!("cannot read the request body: {e}"),
        )),
        Err(_) => Err(refused(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the body did not arrive within {} s",
                BODY_TIMEOUT.as_secs()
            ),
        )),
    }
}

/// Whether the request says its body is JSON (`Content-Type: application/json`), which a
/// cross-site form cannot send.
pub fn is_json(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().unwrap_or_default().trim() == "application/json")
}
