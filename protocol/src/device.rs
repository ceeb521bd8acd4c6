//! Device identity on the wire: signing a [`DeviceMessage`] with the device's key, checking one
//! over the exact bytes received, and the enrollment-token proof.
//!
//! A device signs the postcard bytes of a [`DeviceMessage`] and sends them as
//! [`Message::Device`](crate::Message::Device). The receiver checks the signature with
//! `verify_strict` over the bytes as they arrived and only then decodes them; nothing is
//! re-encoded to be verified. Which key is the right one is the receiver's decision (the
//! coordinator's enrollment): [`open`] checks against a key the caller chose, [`open_self_signed`]
//! only proves that whoever sent the bytes holds the key named in them (how a coordinator
//! learns the key of a device that is not enrolled yet).
//!
//! ```
//! use flotilla_protocol::{device, DeviceMessage, BlockRequest, SigningKey};
//! let key = SigningKey::from_bytes(&[1; 32]);
//! let message = DeviceMessage::Fetch {
//!     device_id: "dev-1".into(),
//!     request: BlockRequest { sha256: [0; 32], offset: 0, length: 4096 },
//! };
//! let blob = device::sign(&key, &message);
//! assert_eq!(device::open(&blob, &key.verifying_key()), Ok(message));
//! ```

use ed25519_dalek::{SigningKey, VerifyingKey};

use crate::envelope::{self, DecodeError, Message};
use crate::messages::{DeviceMessage, Digest};
use crate::signing::{SignatureError, SignedBlob};

/// Names a device message in signature errors.
const WHAT: &str = "device message";

/// Why a signed device message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceMessageError {
    #[error(transparent)]
    Signature(#[from] SignatureError),
    #[error("device message names signer {key}, which is not an ed25519 public key")]
    BadSigner { key: String },
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

/// Signs a device message with the device's key.
pub fn sign(key: &SigningKey, message: &DeviceMessage) -> SignedBlob {
    SignedBlob::sign(key, envelope::to_bytes(message))
}

/// Checks the signature against `key` (the device's accepted key) over the bytes received, then
/// decodes them.
pub fn open(blob: &SignedBlob, key: &VerifyingKey) -> Result<DeviceMessage, DeviceMessageError> {
    let bytes = blob.verify(WHAT, std::slice::from_ref(key))?;
    Ok(envelope::from_bytes(WHAT, bytes)?)
}

/// Checks the signature against the key the blob names and decodes the message: proof that the
/// sender holds that key, nothing more. Returns the key with the message.
pub fn open_self_signed(
    blob: &SignedBlob,
) -> Result<(VerifyingKey, DeviceMessage), DeviceMessageError> {
    let key =
        VerifyingKey::from_bytes(&blob.signer).map_err(|_| DeviceMessageError::BadSigner {
            key: crate::hex::encode(&blob.signer),
        })?;
    let message = open(blob, &key)?;
    Ok((key, message))
}

/// What a device puts in its signed state to show it knows an enrollment token: sha256 over a
/// domain tag, the token, the device id and the device's public key, each length-prefixed. The
/// token itself never crosses the (shared) broker, and a proof seen there is useless with any
/// other key or device id.
pub fn enrollment_proof(token: &str, device_id: &str, key: &VerifyingKey) -> Digest {
    let mut bytes = Vec::with_capacity(64 + token.len() + device_id.len());
    bytes.extend_from_slice(b"flotilla enrollment v1\0");
    for part in [token.as_bytes(), device_id.as_bytes(), key.as_bytes()] {
        bytes.extend_from_slice(&(part.len() as u64).to_le_bytes());
        bytes.extend_from_slice(part);
    }
    use sha2::Digest as _;
    sha2::Sha256::digest(&bytes).into()
}

/// For watchers and test tools: the content of a signed device message as the unsigned
/// message of the same kind, opened with the key it names (which proves only that the sender
/// holds that key, not that it is the device's enrolled key). Other messages pass unchanged, as
/// does a device message whose signature or content does not check out.
pub fn plain(message: Message) -> Message {
    let Message::Device(blob) = &message else {
        return message;
    };
    match open_self_signed(blob) {
        Ok((_, DeviceMessage::State { state, .. })) => Message::State(state),
        Ok((_, DeviceMessage::Report(report)))
        | Ok((_, DeviceMessage::ReportWithBytes { report, .. })) => Message::Report(report),
        Ok((_, DeviceMessage::Fetch { request, .. })) => Message::Fetch(request),
        Err(_) => message,
    }
}

/// A short, stable name for a device key in tables and logs: the first 16 hex digits.
pub fn fingerprint(key: &[u8; 32]) -> String {
    crate::hex::encode(&key[..8])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::Phase;
    use crate::messages::{BlockRequest, Report};

    fn key(seed: u8) -> SigningKey {
        SigningKey::from_bytes(&[seed; 32])
    }

    fn report() -> DeviceMessage {
        DeviceMessage::Report(Report {
            device_id: "dev-1".into(),
            seq: 1,
            action_id: "a".into(),
            rollout_id: "r".into(),
            phase: Phase::Ready,
            at: 5,
        })
    }

    #[test]
    fn opens_only_with_the_signing_key() {
        let blob = sign(&key(1), &report());
        assert_eq!(open(&blob, &key(1).verifying_key()), Ok(report()));
        assert!(matches!(
            open(&blob, &key(2).verifying_key()),
            Err(DeviceMessageError::Signature(
                SignatureError::UnknownKey { .. }
            ))
        ));
        let (k, m) = open_self_signed(&blob).expect("self-signed");
        assert_eq!((k, m), (key(1).verifying_key(), report()));
    }

    #[test]
    fn a_signature_moved_to_another_key_or_changed_bytes_fails() {
        let mut blob = sign(&key(1), &report());
        // The attacker names their own key but keeps the device's signature.
        blob.signer = key(2).verifying_key().to_bytes();
        assert!(matches!(
            open_self_signed(&blob),
            Err(DeviceMessageError::Signature(
                SignatureError::Invalid { .. }
            ))
        ));
        let mut blob = sign(&key(1), &report());
        let last = blob.payload.len() - 1;
        blob.payload[last] ^= 1;
        assert!(open(&blob, &key(1).verifying_key()).is_err());
        // Signed garbage is refused at decoding, after the signature.
        let garbage = SignedBlob::sign(&key(1), vec![0xff; 3]);
        assert!(matches!(
            open(&garbage, &key(1).verifying_key()),
            Err(DeviceMessageError::Decode(_))
        ));
    }

    #[test]
    fn enrollment_proof_binds_token_device_and_key() {
        let k1 = key(1).verifying_key();
        let p = enrollment_proof("tok", "dev-1", &k1);
        assert_eq!(p, enrollment_proof("tok", "dev-1", &k1));
        assert_ne!(p, enrollment_proof("tok2", "dev-1", &k1));
        assert_ne!(p, enrollment_proof("tok", "dev-2", &k1));
        assert_ne!(p, enrollment_proof("tok", "dev-1", &key(2).verifying_key()));
        // Length prefixes: moving a character between token and id changes the proof.
        assert_ne!(
            enrollment_proof("to", "kdev-1", &k1),
            enrollment_proof("tok", "dev-1", &k1)
        );
    }

    #[test]
    fn device_ids_and_names() {
        let fetch = DeviceMessage::Fetch {
            device_id: "dev-9".into(),
            request: BlockRequest {
                sha256: [0; 32],
                offset: 0,
                length: 1,
            },
        };
        assert_eq!(fetch.device_id(), "dev-9");
        assert_eq!(fetch.name(), "block request");
        assert_eq!(report().device_id(), "dev-1");
        assert_eq!(fingerprint(&[0xab; 32]), "abababababababab");
    }
}
