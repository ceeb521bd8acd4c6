//! One path per command: `POST /api/v1/commands/{command}` (decision 0060). Each takes exactly
//! what `POST /api/v1/control` takes, the signed envelope, and runs it the same way (the same
//! gate, roles, replay protection and trace); the path only has to agree with the command
//! inside the signed request, so a pipeline's logs and a proxy's rules can tell commands apart.
//! A request whose command differs from the path's is answered `400`, naming both.

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use flotilla_protocol::operator::SignedRequest;

use crate::service::http::state::{is_json, read_body, refused, Api};

/// Where the per-command paths start; the command's wire name follows.
pub const PREFIX: &str = "/api/v1/commands/";

/// The per-command route, added to `router`.
pub fn routes(router: Router<Api>) -> Router<Api> {
    router.route("/api/v1/commands/:command", post(run))
}

/// Whether the signed request in `payload` runs `command`: `Err` says what is wrong.
pub fn agrees(command: &str, payload: &[u8]) -> Result<(), String> {
    let signed: SignedRequest = serde_json::from_slice(payload).map_err(|e| {
        format!("malformed request: not a signed request ({{\"request\", \"key\", \"signature\"}}): {e}")
    })?;
    let request: serde_json::Value = serde_json::from_str(&signed.request)
        .map_err(|e| format!("malformed request: `request` is not JSON: {e}"))?;
    match request.get("command").and_then(|c| c.as_str()) {
        Some(inside) if inside == command => Ok(()),
        Some(inside) => Err(format!(
            "the path names command {command:?} but the signed request is {inside:?}: post it to \
             {PREFIX}{inside} or /api/v1/control"
        )),
        None => Err(format!(
            "malformed request: the signed request names no command (the path names {command:?})"
        )),
    }
}

async fn run(
    State(api): State<Api>,
    Path(command): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    if !is_json(&headers) {
        return refused(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "a control request is JSON: send it with Content-Type: application/json".into(),
        );
    }
    let payload = match read_body(body).await {
        Ok(bytes) => bytes,
        Err(answer) => return answer,
    };
    if let Err(why) = agrees(&command, &payload) {
        return refused(StatusCode::BAD_REQUEST, why);
    }
    api.run_signed(&payload).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope(request: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "request": request,
            "key": "00",
            "signature": "00",
        }))
        .expect("json")
    }

    #[test]
    fn the_path_must_name_the_signed_command() {
        let pause =
            envelope(r#"{"id":"1","reply_to":"r","command":"pause_rollout","rollout":"fw-2"}"#);
        assert_eq!(agrees("pause_rollout", &pause), Ok(()));
        let wrong = agrees("stop_rollout", &pause).expect_err("another command");
        assert!(
            wrong.contains("\"stop_rollout\"") && wrong.contains("\"pause_rollout\""),
            "names both: {wrong}"
        );
        let unnamed = agrees("stop_rollout", &envelope(r#"{"id":"1"}"#)).expect_err("no command");
        assert!(unnamed.contains("names no command"), "{unnamed}");
        let junk = agrees("stop_rollout", b"{\"request\":").expect_err("junk");
        assert!(
            junk.starts_with("malformed request: not a signed request"),
            "{junk}"
        );
        let inner = agrees("stop_rollout", &envelope("not json")).expect_err("inner junk");
        assert!(inner.contains("`request` is not JSON"), "{inner}");
    }
}
