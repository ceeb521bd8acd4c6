//! Signed operator control requests (docs/protocol.md, "Signed requests").
//!
//! An operator signs the exact UTF-8 bytes of a control request's JSON text with an ed25519 key.
//! The MQTT payload carries that text as a string, next to the public key and the signature:
//!
//! ```json
//! {"request": "{\"id\":\"1\",\"reply_to\":\"…\",\"at\":1700000000,\"nonce\":\"…\",\"command\":\"start_rollout\",\"rollout\":\"fw-2-4\"}",
//!  "key": "<operator public key, 64 hex digits>",
//!  "signature": "<ed25519 signature over the bytes of request, 128 hex digits>"}
//! ```
//!
//! The request text is verified as received and only then parsed; nothing is re-serialized to
//! be verified. Its `at` (Unix seconds) and `nonce` sit inside the signed bytes, so the
//! coordinator can refuse stale and replayed requests. Which [`Role`] each command needs is
//! [`Command::required_role`].
//!
//! ```
//! use flotilla_protocol::control::{Command, ControlRequest, PageQuery};
//! use flotilla_protocol::operator::SignedRequest;
//! use flotilla_protocol::SigningKey;
//!
//! let key = SigningKey::from_bytes(&[7; 32]);
//! let request = ControlRequest::new("1", "flotilla/v1/control/reply/me", 1_700_000_000, "n-1",
//!     Command::ListDevices { page: PageQuery::first(100) });
//! let signed = SignedRequest::sign(&key, &request);
//! let text = signed.verify_with(&signed.public_key().unwrap()).unwrap();
//! assert_eq!(serde_json::from_str::<ControlRequest>(text).unwrap(), request);
//! ```

use ed25519_dalek::{Signer as _, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};

use crate::control::{Command, ControlRequest};
use crate::hex;

/// The MQTT payload of a signed control request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignedRequest {
    /// The exact JSON text of a [`ControlRequest`]; the signature covers its UTF-8 bytes.
    pub request: String,
    /// The operator's ed25519 public key, 64 lower- or upper-case hex digits.
    pub key: String,
    /// The ed25519 signature over `request`'s bytes, 128 hex digits.
    pub signature: String,
}

/// Why a signed request's key or signature was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestSignatureError {
    #[error("malformed key {key:?}: expected an ed25519 public key as 64 hex digits")]
    Key { key: String },
    #[error("malformed signature: expected 128 hex digits ({reason})")]
    Signature { reason: String },
    #[error(
        "wrong signature: the signature does not verify over the request bytes with key {key}"
    )]
    Invalid { key: String },
}

impl SignedRequest {
    /// Serializes `request` to JSON once and signs exactly those bytes.
    pub fn sign(key: &SigningKey, request: &ControlRequest) -> SignedRequest {
        // A request of strings, numbers and string maps always serializes.
        let text = serde_json::to_string(request).unwrap_or_default();
        Self::sign_text(key, text)
    }

    /// Signs request text as it is (for clients that build the JSON themselves).
    pub fn sign_text(key: &SigningKey, text: String) -> SignedRequest {
        let signature = key.sign(text.as_bytes()).to_bytes();
        SignedRequest {
            request: text,
            key: hex::encode(key.verifying_key().as_bytes()),
            signature: hex::encode(&signature),
        }
    }

    /// The public key the request names (not yet trusted).
    pub fn public_key(&self) -> Result<VerifyingKey, RequestSignatureError> {
        let bad = || RequestSignatureError::Key {
            key: self.key.chars().take(80).collect(),
        };
        let bytes = hex::decode_array::<32>(&self.key).map_err(|_| bad())?;
        VerifyingKey::from_bytes(&bytes).map_err(|_| bad())
    }

    /// Verifies the signature over the bytes of `request` with `key` (`verify_strict`) and
    /// returns the request text, still unparsed.
    pub fn verify_with(&self, key: &VerifyingKey) -> Result<&str, RequestSignatureError> {
        let bytes = hex::decode_array::<64>(&self.signature).map_err(|e| {
            RequestSignatureError::Signature {
                reason: e.to_string(),
            }
        })?;
        let signature = ed25519_dalek::Signature::from_bytes(&bytes);
        key.verify_strict(self.request.as_bytes(), &signature)
            .map_err(|_| RequestSignatureError::Invalid {
                key: hex::encode(key.as_bytes()),
            })?;
        Ok(&self.request)
    }
}

/// A fresh nonce: 16 random bytes from the operating system, in hex.
pub fn new_nonce() -> String {
    use rand_core::RngCore as _;
    let mut bytes = [0u8; 16];
    rand_core::OsRng.fill_bytes(&mut bytes);
    hex::encode(&bytes)
}

/// What an operator may do. Each role may do everything the roles before it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Read-only: statuses and lists.
    Viewer,
    /// Drives rollouts: create, start, pause, resume, stop, next, retry, approve.
    Operator,
    /// Everything: devices, device groups, strategies.
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }

    /// Parses `viewer`, `operator` or `admin`.
    pub fn parse(text: &str) -> Option<Role> {
        match text {
            "viewer" => Some(Role::Viewer),
            "operator" => Some(Role::Operator),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Command {
    /// The command's name on the wire (`start_rollout`).
    pub fn name(&self) -> &'static str {
        match self {
            Command::CreateRollout { .. } => "create_rollout",
            Command::StartRollout { .. } => "start_rollout",
            Command::PauseRollout { .. } => "pause_rollout",
            Command::ResumeRollout { .. } => "resume_rollout",
            Command::StopRollout { .. } => "stop_rollout",
            Command::DeleteRollout { .. } => "delete_rollout",
            Command::RolloutStatus { .. } => "rollout_status",
            Command::ListDevices { .. } => "list_devices",
            Command::ListReleases { .. } => "list_releases",
            Command::Approve { .. } => "approve",
            Command::Deny { .. } => "deny",
            Command::Login => "login",
            Command::TriggerNext { .. } => "trigger_next",
            Command::RetryRollout { .. } => "retry_rollout",
            Command::DeleteDevice { .. } => "delete_device",
            Command::CreateStrategy { .. } => "create_strategy",
            Command::ListStrategies { .. } => "list_strategies",
            Command::ShowStrategy { .. } => "show_strategy",
            Command::CreateGroup { .. } => "create_group",
            Command::ListGroups { .. } => "list_groups",
            Command::DeleteGroup { .. } => "delete_group",
            Command::ListApprovals { .. } => "list_approvals",
            Command::PendingDevices { .. } => "pending_devices",
            Command::AcceptDevice { .. } => "accept_device",
            Command::RejectDevice { .. } => "reject_device",
            Command::RevokeDevice { .. } => "revoke_device",
            Command::ShowDevice { .. } => "show_device",
            Command::Backup => "backup",
            Command::Coordinators => "coordinators",
        }
    }

    /// The least role that may run this command (the table in docs/security.md).
    pub fn required_role(&self) -> Role {
        match self {
            Command::RolloutStatus { .. }
            | Command::ListDevices { .. }
            | Command::ListReleases { .. }
            | Command::ListApprovals { .. }
            | Command::ListStrategies { .. }
            | Command::ShowStrategy { .. }
            | Command::ListGroups { .. }
            | Command::PendingDevices { .. }
            | Command::ShowDevice { .. }
            | Command::Login
            | Command::Coordinators => Role::Viewer,
            Command::CreateRollout { .. }
            | Command::StartRollout { .. }
            | Command::PauseRollout { .. }
            | Command::ResumeRollout { .. }
            | Command::StopRollout { .. }
            | Command::Approve { .. }
            | Command::Deny { .. }
            | Command::TriggerNext { .. }
            | Command::RetryRollout { .. } => Role::Operator,
            Command::DeleteDevice { .. }
            | Command::DeleteRollout { .. }
            | Command::AcceptDevice { .. }
            | Command::RejectDevice { .. }
            | Command::RevokeDevice { .. }
            | Command::CreateStrategy { .. }
            | Command::CreateGroup { .. }
            | Command::DeleteGroup { .. }
            | Command::Backup => Role::Admin,
        }
    }
}

/// The longest `reply_to` topic the coordinator answers on, in bytes.
pub const MAX_REPLY_TO: usize = 256;

/// Checks a request's `reply_to` before anything is published on it: a control reply topic
/// under `topics`' root, at most [`MAX_REPLY_TO`] bytes, without MQTT wildcards or U+0000.
pub fn check_reply_to(topics: &crate::topics::Topics, reply_to: &str) -> Result<(), String> {
    let shown: String = reply_to.chars().take(80).collect();
    if reply_to.len() > MAX_REPLY_TO {
        return Err(format!(
            "reply_to {shown:?}… is {} bytes, longer than {MAX_REPLY_TO}",
            reply_to.len()
        ));
    }
    if let Some(bad) = reply_to.chars().find(|c| matches!(c, '+' | '#' | '\0')) {
        return Err(format!("reply_to {shown:?} contains {bad:?}"));
    }
    match topics.parse(reply_to) {
        Some(crate::topics::Topic::ControlReply(_)) => Ok(()),
        _ => Err(format!(
            "reply_to {shown:?} is not a control reply topic ({})",
            topics.control_reply("{client}")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::PageQuery;
    use crate::topics::Topics;

    fn request() -> ControlRequest {
        ControlRequest::new(
            "1",
            "flotilla/v1/control/reply/me",
            1_700_000_000,
            "nonce-1",
            Command::StartRollout {
                rollout: "fw-2-4".into(),
            },
        )
    }

    #[test]
    fn signs_the_exact_request_text() {
        let key = SigningKey::from_bytes(&[3; 32]);
        let signed = SignedRequest::sign(&key, &request());
        assert_eq!(signed.public_key(), Ok(key.verifying_key()));
        let text = signed.verify_with(&key.verifying_key()).expect("verifies");
        assert!(text.contains("\"at\":1700000000"), "{text}");
        assert!(text.contains("\"nonce\":\"nonce-1\""), "{text}");

        // The same request with one more space is other bytes: the signature no longer holds.
        let mut spaced = signed.clone();
        spaced.request = spaced.request.replacen(':', ": ", 1);
        assert!(matches!(
            spaced.verify_with(&key.verifying_key()),
            Err(RequestSignatureError::Invalid { .. })
        ));
        let other = SigningKey::from_bytes(&[4; 32]).verifying_key();
        let err = signed.verify_with(&other).expect_err("other key");
        assert!(err.to_string().starts_with("wrong signature"), "{err}");
        let mut short = signed;
        short.signature.truncate(10);
        assert!(matches!(
            short.verify_with(&key.verifying_key()),
            Err(RequestSignatureError::Signature { .. })
        ));
        short.key = "zz".into();
        assert!(short.public_key().is_err());
    }

    #[test]
    fn payload_json_is_three_strings() {
        let signed = SignedRequest::sign_text(&SigningKey::from_bytes(&[3; 32]), "{}".into());
        let json = serde_json::to_value(&signed).expect("encodes");
        assert_eq!(
            json.as_object()
                .map(|o| o.keys().cloned().collect::<Vec<_>>()),
            Some(vec!["key".into(), "request".into(), "signature".into()])
        );
        assert_eq!(json["key"].as_str().map(str::len), Some(64));
        assert_eq!(json["signature"].as_str().map(str::len), Some(128));
    }

    #[test]
    fn roles_are_ordered_and_every_command_has_one() {
        assert!(Role::Viewer < Role::Operator && Role::Operator < Role::Admin);
        assert_eq!(
            Command::ListDevices {
                page: PageQuery::default()
            }
            .required_role(),
            Role::Viewer
        );
        assert_eq!(
            Command::Approve { name: "a".into() }.required_role(),
            Role::Operator
        );
        assert_eq!(
            Command::DeleteDevice { device: "d".into() }.required_role(),
            Role::Admin
        );
        // Denying stops a rollout as stopping does; deleting takes its history; a login reads.
        let deny = Command::Deny {
            name: "a".into(),
            reason: None,
        };
        assert_eq!(deny.required_role(), Role::Operator);
        let delete = Command::DeleteRollout {
            rollout: "r".into(),
        };
        assert_eq!(delete.required_role(), Role::Admin);
        assert_eq!(Command::Login.required_role(), Role::Viewer);
        // A device's page reads; accepting and revoking it take an admin.
        let show = Command::ShowDevice { device: "d".into() };
        assert_eq!(show.required_role(), Role::Viewer);
        for role in [Role::Viewer, Role::Operator, Role::Admin] {
            assert_eq!(Role::parse(role.as_str()), Some(role));
        }
        assert_eq!(Role::parse("root"), None);
        // The wire name is the serde tag.
        let json = serde_json::to_value(Command::ListApprovals {
            page: PageQuery::default(),
        })
        .expect("encodes");
        assert_eq!(json["command"], "list_approvals");
    }

    #[test]
    fn reply_to_must_be_a_plain_reply_topic_under_the_root() {
        let t = Topics::default();
        assert!(check_reply_to(&t, "flotilla/v1/control/reply/cli-1").is_ok());
        for bad in [
            "flotilla/v1/control/reply/+",
            "flotilla/v1/control/reply/#",
            "flotilla/v1/control/reply/a\0b",
            "flotilla/v1/devices/d/desired",
            "other/v1/control/reply/x",
            "flotilla/v1/control/reply/",
        ] {
            assert!(check_reply_to(&t, bad).is_err(), "{bad:?}");
        }
        let long = format!("flotilla/v1/control/reply/{}", "x".repeat(300));
        let err = check_reply_to(&t, &long).expect_err("long");
        assert!(err.contains("longer than 256"), "{err}");
    }
}
