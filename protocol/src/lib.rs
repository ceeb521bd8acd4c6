//! # flotilla-protocol
//!
//! The wire protocol between the flotilla coordinator, its agents and third-party integrations.
//! Plain data and pure functions: no I/O, no async runtime.
//!
//! - [`topics`]: every MQTT topic, built and parsed in one place.
//! - [`envelope`]: the versioned postcard envelope around device-facing messages.
//! - [`messages`]: release manifests, desired actions, reports, device states, artifact blocks.
//! - [`manifest`]: the signed manifest bytes, with their extension (block indexes, artifact types).
//! - [`artifact_type`]: what kind of payload an artifact is (RAUC bundle, SWUpdate image, Mender).
//! - [`blocks`]: per-block hashes: block lists and how blocks are cut.
//! - [`signing`]: ed25519 signatures over the exact bytes received.
//! - [`keys`]: key rotation: the keys document signed by a threshold of root keys.
//! - [`control`]: the JSON control requests, replies and status documents; [`trace`]: the
//!   decision trace entries they carry.
//! - [`device_view`]: one device in detail, as `show_device` answers it.
//! - [`operator`]: signed control requests, operator roles, the checks on `reply_to`.
//! - [`ids`]: the safe character set for ids that appear in topics.
//! - [`raw_bytes`]: bulk bytes (artifact blocks) serialized as one byte string.
//!
//! ```
//! use flotilla_protocol::{envelope, DeviceId, Message, Topics, BlockRequest};
//!
//! let topics = Topics::default();
//! let id = DeviceId::new("pi-17").unwrap();
//! let bytes = envelope::encode(&Message::Fetch(BlockRequest { sha256: [0; 32], offset: 0, length: 4096 }));
//! assert_eq!(topics.fetch(&id), "flotilla/v1/devices/pi-17/fetch");
//! assert!(matches!(envelope::decode(&bytes), Ok(Message::Fetch(_))));
//! ```

pub mod artifact_type;
pub mod blocks;
pub mod control;
pub mod device;
pub mod device_view;
pub mod envelope;
pub mod hex;
pub mod ids;
pub mod keys;
pub mod manifest;
pub mod messages;
pub mod operator;
pub mod origin;
pub mod raw_bytes;
pub mod signing;
pub mod topics;
pub mod trace;

pub use device::DeviceMessageError;
pub use envelope::{
    DecodeError, Message, BROKER_PACKET_LIMIT, CLIENT_PACKET_LIMIT, MAX_PACKET_SIZE,
    PROTOCOL_VERSION,
};
pub use ids::{validate_id, DeviceId, IdError};
pub use keys::{KeyRing, KeysDocument, KeysError};
pub use messages::*;
pub use signing::{MultiSignedBlob, SignatureError, SignedBlob};
pub use topics::{Topic, Topics};

pub use ed25519_dalek::{SigningKey, VerifyingKey};

/// sha256 of a byte slice.
pub fn sha256(bytes: &[u8]) -> Digest {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes).into()
}
