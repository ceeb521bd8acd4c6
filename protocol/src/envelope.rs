//! The versioned envelope around every device-facing payload.
//!
//! Wire form: postcard of `(version: u16, message: Message)`. A receiver reads the version first
//! and refuses versions it does not speak with an error that says so, instead of misreading the
//! rest. Decoding never panics, whatever the bytes (see `tests/fuzz.rs`).

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::messages::{BlockReply, BlockRequest, DeviceState, Report};
use crate::signing::SignedBlob;

/// The protocol version this crate speaks.
pub const PROTOCOL_VERSION: u16 = 1;

/// Largest payload flotilla publishes or accepts on device topics, in bytes. Brokers and clients
/// must be configured to carry at least this much.
pub const MAX_PACKET_SIZE: usize = 256 * 1024;

/// The largest MQTT packet a broker should accept from any client: a [`MAX_PACKET_SIZE`] payload
/// with room for its topic and headers. The shipped Mosquitto config sets `max_packet_size` to
/// this, and the embedded broker limits payloads to it, so no client can leave a larger message
/// (retained) for the others.
pub const BROKER_PACKET_LIMIT: usize = MAX_PACKET_SIZE + 4096;

/// The largest packet flotilla's clients read. Above anything a broker that enforces
/// [`BROKER_PACKET_LIMIT`] on packets (Mosquitto) or on payloads (rumqttd: plus a topic of up
/// to 64 KiB) can deliver, so no message it forwards makes a client drop its connection (and,
/// retained, drop it again on every reconnect). What is larger than [`MAX_PACKET_SIZE`] is
/// dropped and counted after it was read.
pub const CLIENT_PACKET_LIMIT: usize = BROKER_PACKET_LIMIT + 64 * 1024 + 64;

/// Every device-facing message. Variants are only ever appended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Message {
    /// A signed [`DesiredAction`](crate::DesiredAction), on `devices/{id}/desired`.
    Desired(SignedBlob),
    Report(Report),
    State(DeviceState),
    Fetch(BlockRequest),
    Block(BlockReply),
    /// A [`DeviceMessage`](crate::DeviceMessage) signed with the device's own key, on the
    /// device's `state`, `report` or `fetch` topic. Replaces the unsigned `Report`, `State` and
    /// `Fetch`, which a coordinator ignores.
    Device(SignedBlob),
    /// A block request to a peer, on that peer's `peer-fetch` topic.
    PeerFetch(crate::messages::PeerFetch),
}

impl Message {
    /// The message's name, for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Desired(_) => "desired action",
            Message::Report(_) => "report",
            Message::State(_) => "device state",
            Message::Fetch(_) => "block request",
            Message::Block(_) => "block reply",
            Message::Device(_) => "signed device message",
            Message::PeerFetch(_) => "peer block request",
        }
    }
}

/// Why bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("empty payload")]
    Empty,
    #[error("unsupported protocol version {found} (this build speaks {PROTOCOL_VERSION})")]
    Version { found: u16 },
    #[error("malformed {what}: {reason}")]
    Malformed { what: &'static str, reason: String },
    #[error("malformed {what}: {count} unexpected trailing bytes")]
    TrailingBytes { what: &'static str, count: usize },
}

/// Encodes a message in the current protocol version.
pub fn encode(message: &Message) -> Vec<u8> {
    to_bytes(&(PROTOCOL_VERSION, message))
}

/// Decodes an envelope, checking the version first.
pub fn decode(bytes: &[u8]) -> Result<Message, DecodeError> {
    if bytes.is_empty() {
        return Err(DecodeError::Empty);
    }
    let (version, rest): (u16, &[u8]) =
        postcard::take_from_bytes(bytes).map_err(|e| DecodeError::Malformed {
            what: "envelope",
            reason: e.to_string(),
        })?;
    if version != PROTOCOL_VERSION {
        return Err(DecodeError::Version { found: version });
    }
    from_bytes("message", rest)
}

/// Encodes a value with postcard. Used for the signed payloads (manifests, desired actions).
pub fn to_bytes<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    // postcard only fails on types it cannot represent (sequences of unknown length), which
    // flotilla's types never are.
    postcard::to_stdvec(value).expect("flotilla's wire types always encode")
}

/// Decodes a value with postcard, refusing trailing bytes. `what` names it in errors.
pub fn from_bytes<T: DeserializeOwned>(what: &'static str, bytes: &[u8]) -> Result<T, DecodeError> {
    let (value, rest) = postcard::take_from_bytes(bytes).map_err(|e| DecodeError::Malformed {
        what,
        reason: e.to_string(),
    })?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes {
            what,
            count: rest.len(),
        });
    }
    Ok(value)
}
