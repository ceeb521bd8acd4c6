//! `flotilla operator sign`: prints a signed control request, the envelope the HTTP API
//! (`POST /api/v1/control`) and the MQTT control topic take, for a pipeline that sends it with
//! curl:
//!
//! ```text
//! flotilla --operator-key ci.key operator sign '{"command":"start_rollout","rollout":"fw-2"}' |
//!   curl --fail-with-body -H 'Content-Type: application/json' --data-binary @- \
//!     https://coordinator:8443/api/v1/control
//! ```
//!
//! The request is stamped now and carries a fresh nonce: sign right before sending, once per
//! send (a copy sent twice is refused as a replay, one sent after the clock window as stale).

use std::path::Path;

use flotilla_protocol::control::{Command, ControlRequest};
use flotilla_protocol::operator::{new_nonce, SignedRequest};
use flotilla_protocol::topics::Topics;

use crate::service::keys::{self, KeysError};

/// Why no request was signed.
#[derive(Debug, thiserror::Error)]
pub enum SignError {
    #[error("the command is not a control command: {reason}; e.g. '{{\"command\":\"rollout_status\",\"rollout\":\"fw-2\"}}' (docs/protocol.md lists them)")]
    Command { reason: String },
    #[error(transparent)]
    Key(#[from] KeysError),
}

/// Signs `command` (JSON with a `command` field and its own fields) with the key at `key`, for a
/// coordinator whose topic root is `root`; returns the envelope as one line of JSON.
pub fn sign(key: &Path, root: &str, command: &str, now: u64) -> Result<String, SignError> {
    let command: Command = serde_json::from_str(command).map_err(|e| SignError::Command {
        reason: e.to_string(),
    })?;
    let key = keys::load_secret_key(key)?;
    let id = format!("http-{}", new_nonce());
    // The gate checks reply_to on every request; over HTTP the answer comes back on the same
    // connection and nothing is published there.
    let reply_to = Topics::new(root).control_reply(&id);
    let request = ControlRequest::new(id, reply_to, now, new_nonce(), command);
    let signed = SignedRequest::sign(&key, &request);
    // Plain strings: serializing cannot fail.
    Ok(serde_json::to_string(&signed).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_protocol::operator::check_reply_to;

    #[test]
    fn signs_a_request_the_gate_can_read_and_names_a_bad_command() {
        let dir = tempfile::tempdir().expect("tempdir");
        let written = keys::keygen(dir.path(), &["ci".to_owned()], false).expect("keygen");
        let text = sign(
            &written[0].secret,
            "fleet",
            r#"{"command":"pause_rollout","rollout":"fw-2"}"#,
            1_000,
        )
        .expect("signed");
        let signed: SignedRequest = serde_json::from_str(&text).expect("an envelope");
        let key = signed.public_key().expect("key");
        assert_eq!(
            flotilla_protocol::hex::encode(key.as_bytes()),
            written[0].public_hex
        );
        let request: ControlRequest =
            serde_json::from_str(signed.verify_with(&key).expect("verifies")).expect("request");
        assert_eq!(request.command.name(), "pause_rollout");
        assert_eq!(request.at, 1_000);
        check_reply_to(&Topics::new("fleet"), &request.reply_to).expect("a reply topic");
        let err = sign(&written[0].secret, "fleet", r#"{"command":"pause"}"#, 1).expect_err("bad");
        assert!(err.to_string().contains("not a control command"), "{err}");
    }
}
