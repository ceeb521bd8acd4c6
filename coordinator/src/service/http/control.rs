//! A control request that arrived over HTTP, on its way to the service loop, and its answer on
//! the way back. The loop checks it with the same operator gate as a request from MQTT and runs
//! it with the same code; only where the reply goes differs ([`Replier`]).

use axum::http::StatusCode;
use flotilla_protocol::control::{Command, ControlReply};
use tokio::sync::{mpsc, oneshot};

use crate::service::http::session::Session;

/// Requests waiting for the service loop; one more is answered `503` at once.
pub const QUEUE: usize = 64;
/// Live events an event stream may fall behind by before it is cut off.
pub const EVENTS: usize = 512;

/// What the HTTP side asks of the service loop.
#[derive(Debug)]
pub enum HttpControl {
    /// A signed control request, as the client sent it: run as one from MQTT.
    Signed {
        payload: Vec<u8>,
        answer: oneshot::Sender<HttpAnswer>,
    },
    /// A signed `login` request: checked by the gate like any other; the session it opens is
    /// stored under `digest` (its token's sha256) and answered, so the HTTP side holds it too.
    Login {
        payload: Vec<u8>,
        digest: String,
        answer: oneshot::Sender<Result<Session, HttpAnswer>>,
    },
    /// A session ended (logged out): removed from the store.
    Logout {
        digest: String,
        answer: oneshot::Sender<HttpAnswer>,
    },
    /// A read on behalf of a session's operator: only commands a viewer may run.
    Read {
        operator: String,
        command: Command,
        answer: oneshot::Sender<HttpAnswer>,
    },
}

/// The reply and the status it goes out with.
#[derive(Debug)]
pub struct HttpAnswer {
    pub status: StatusCode,
    pub reply: ControlReply,
}

/// The loop's end of the channel, and the handlers'.
pub fn channel() -> (mpsc::Sender<HttpControl>, mpsc::Receiver<HttpControl>) {
    mpsc::channel(QUEUE)
}

/// Where a control reply goes: the MQTT topic the request named, or the HTTP client waiting.
#[derive(Debug)]
pub enum Replier {
    Topic(String),
    Http(oneshot::Sender<HttpAnswer>),
}

/// The HTTP status of a refusal by the operator gate, from its reason's first words.
pub fn refusal_status(reason: &str) -> StatusCode {
    let starts = |prefix: &str| reason.starts_with(prefix);
    if starts("not allowed") {
        StatusCode::FORBIDDEN
    } else if starts("rate limited") {
        StatusCode::TOO_MANY_REQUESTS
    } else if starts("unsigned request")
        || starts("unknown key")
        || starts("wrong signature")
        || starts("clock skew")
        || starts("replayed request")
    {
        StatusCode::UNAUTHORIZED
    } else {
        StatusCode::BAD_REQUEST
    }
}

/// The HTTP status of a command's answer: `200` when it was done, `409` when the command was
/// understood but refused in the rollout's or device's state (the reason says why), `503` while
/// the coordinator cannot take changes (loading, a store it cannot write).
pub fn reply_status(reply: &ControlReply) -> StatusCode {
    match &reply.error {
        None if reply.ok => StatusCode::OK,
        Some(error) if reply.loading || error.contains("could not be stored") => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        Some(error) if error.starts_with("no ") => StatusCode::NOT_FOUND,
        _ => StatusCode::CONFLICT,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_map_to_the_status_a_client_expects() {
        for (reason, status) in [
            ("unsigned request: ...", 401),
            (
                "unknown key ab12: no operator of this coordinator has it",
                401,
            ),
            ("wrong signature: ...", 401),
            ("clock skew: request made at 1 but ...", 401),
            (
                "replayed request: nonce \"n\" of operator ana was already used",
                401,
            ),
            (
                "not allowed: operator vic has role viewer, stop_rollout needs operator",
                403,
            ),
            (
                "rate limited: operator vic (viewer) sent more than 20 requests a second",
                429,
            ),
            ("malformed request: not JSON: ...", 400),
            ("invalid reply_to: ...", 400),
        ] {
            assert_eq!(refusal_status(reason).as_u16(), status, "{reason}");
        }
    }

    #[test]
    fn answers_map_to_done_missing_refused_or_unavailable() {
        let reply = |ok: bool, error: Option<&str>, loading: bool| ControlReply {
            id: "1".into(),
            ok,
            error: error.map(str::to_owned),
            result: serde_json::Value::Null,
            loading,
        };
        assert_eq!(reply_status(&reply(true, None, false)), StatusCode::OK);
        assert_eq!(
            reply_status(&reply(false, Some("no rollout named \"x\""), false)),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            reply_status(&reply(
                false,
                Some("rollout fw-2 is finished: cannot pause"),
                false
            )),
            StatusCode::CONFLICT
        );
        assert_eq!(
            reply_status(&reply(false, Some("still reading the fleet"), true)),
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
}
