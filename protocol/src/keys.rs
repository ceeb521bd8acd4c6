//! Key rotation: the keys document and the key ring a device trusts.
//!
//! A [`KeysDocument`] replaces the release and coordinator keys (and optionally the root keys)
//! of every device that accepts it. It travels as a [`MultiSignedBlob`] signed offline by the
//! root keys, in a small file (`flotilla-agent keys install FILE`). A device accepts it only
//! when at least `root_threshold` of its *current* root keys signed the exact bytes and its
//! version is higher than the last one accepted, so an old document can never be replayed to
//! bring a retired key back.
//!
//! File form: postcard of `(PROTOCOL_VERSION, MultiSignedBlob)`, like the envelope.
//!
//! ```
//! use flotilla_protocol::keys::{KeyRing, KeysDocument};
//! use flotilla_protocol::signing::MultiSignedBlob;
//! use flotilla_protocol::{envelope, SigningKey};
//!
//! let root = |s: u8| SigningKey::from_bytes(&[s; 32]);
//! let ring = KeyRing {
//!     version: 0,
//!     release_keys: vec![root(7).verifying_key()],
//!     coordinator_keys: vec![root(8).verifying_key()],
//!     root_keys: vec![root(1).verifying_key(), root(2).verifying_key()],
//!     root_threshold: 2,
//! };
//! let doc = KeysDocument {
//!     version: 1,
//!     release_keys: vec![root(7).verifying_key().to_bytes()],
//!     coordinator_keys: vec![root(9).verifying_key().to_bytes()],
//!     root_keys: None,
//!     root_threshold: 2,
//! };
//! let signed = MultiSignedBlob::sign(&[&root(1), &root(2)], envelope::to_bytes(&doc));
//! let next = ring.accept(&signed).unwrap();
//! assert_eq!(next.coordinator_keys, vec![root(9).verifying_key()]);
//! assert!(next.accept(&signed).is_err()); // the same version again is a replay
//! ```

use ed25519_dalek::VerifyingKey;
use serde::{Deserialize, Serialize};

use crate::envelope::{self, DecodeError, PROTOCOL_VERSION};
use crate::hex;
use crate::signing::{MultiSignedBlob, ThresholdError};

/// The keys a device should trust from now on. Signed by the root keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeysDocument {
    /// Grows with every rotation; a device only accepts a version higher than its own.
    pub version: u64,
    /// Keys trusted to sign release manifests. At least one.
    pub release_keys: Vec<[u8; 32]>,
    /// Keys trusted to sign desired actions. At least one.
    pub coordinator_keys: Vec<[u8; 32]>,
    /// New root keys, or `None` to keep the current ones.
    pub root_keys: Option<Vec<[u8; 32]>>,
    /// Root signatures the *next* keys document needs, between 1 and the number of root keys.
    pub root_threshold: u32,
}

/// What a device trusts now: configured at first, then replaced by each accepted document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRing {
    /// The version of the last accepted keys document; 0 for the configured keys.
    pub version: u64,
    pub release_keys: Vec<VerifyingKey>,
    pub coordinator_keys: Vec<VerifyingKey>,
    /// Empty when key rotation is not configured.
    pub root_keys: Vec<VerifyingKey>,
    pub root_threshold: u32,
}

/// Why a keys document was refused. Nothing about the trusted keys changes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeysError {
    #[error("key rotation is not configured on this device ([trust] root_keys is empty)")]
    NoRootKeys,
    #[error(transparent)]
    Signatures(#[from] ThresholdError),
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("keys document version {version} is not newer than the accepted version {current}")]
    NotNewer { version: u64, current: u64 },
    #[error("keys document {field}: {reason}")]
    Field { field: String, reason: String },
}

/// Encodes a signed keys document as a file.
pub fn encode_file(signed: &MultiSignedBlob) -> Vec<u8> {
    envelope::to_bytes(&(PROTOCOL_VERSION, signed))
}

/// Decodes a keys document file, checking the protocol version first. Nothing is verified yet.
pub fn decode_file(bytes: &[u8]) -> Result<MultiSignedBlob, DecodeError> {
    if bytes.is_empty() {
        return Err(DecodeError::Empty);
    }
    let (version, rest): (u16, &[u8]) =
        postcard::take_from_bytes(bytes).map_err(|e| DecodeError::Malformed {
            what: "keys file",
            reason: e.to_string(),
        })?;
    if version != PROTOCOL_VERSION {
        return Err(DecodeError::Version { found: version });
    }
    envelope::from_bytes("keys file", rest)
}

impl KeyRing {
    /// Verifies a signed keys document against this ring's root keys and returns the ring it
    /// establishes. The signatures are checked over the exact bytes received, then the bytes
    /// are decoded and every field validated.
    pub fn accept(&self, signed: &MultiSignedBlob) -> Result<KeyRing, KeysError> {
        if self.root_keys.is_empty() {
            return Err(KeysError::NoRootKeys);
        }
        let bytes = signed.verify_threshold(
            "keys document",
            "root key",
            &self.root_keys,
            self.root_threshold as usize,
        )?;
        let doc: KeysDocument = envelope::from_bytes("keys document", bytes)?;
        if doc.version <= self.version {
            return Err(KeysError::NotNewer {
                version: doc.version,
                current: self.version,
            });
        }
        let root_keys = match &doc.root_keys {
            Some(keys) => parse_keys("root_keys", keys)?,
            None => self.root_keys.clone(),
        };
        if doc.root_threshold == 0 || doc.root_threshold as usize > root_keys.len() {
            return Err(KeysError::Field {
                field: "root_threshold".into(),
                reason: format!(
                    "{} is not between 1 and the {} root keys",
                    doc.root_threshold,
                    root_keys.len()
                ),
            });
        }
        Ok(KeyRing {
            version: doc.version,
            release_keys: parse_keys("release_keys", &doc.release_keys)?,
            coordinator_keys: parse_keys("coordinator_keys", &doc.coordinator_keys)?,
            root_keys,
            root_threshold: doc.root_threshold,
        })
    }
}

/// Parses one list of keys: at least one, each a valid ed25519 point, no duplicates.
fn parse_keys(field: &str, keys: &[[u8; 32]]) -> Result<Vec<VerifyingKey>, KeysError> {
    if keys.is_empty() {
        return Err(KeysError::Field {
            field: field.into(),
            reason: "needs at least one key".into(),
        });
    }
    let mut out = Vec::with_capacity(keys.len());
    for (i, k) in keys.iter().enumerate() {
        let bad = |reason: &str| KeysError::Field {
            field: format!("{field}[{i}]"),
            reason: format!("{}: {reason}", hex::encode(k)),
        };
        let key = VerifyingKey::from_bytes(k).map_err(|_| bad("not a valid ed25519 public key"))?;
        if out.contains(&key) {
            return Err(bad("listed twice"));
        }
        out.push(key);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::SigningKey;

    fn key(seed: u8) -> SigningKey {
        SigningKey::from_bytes(&[seed; 32])
    }

    fn ring() -> KeyRing {
        KeyRing {
            version: 3,
            release_keys: vec![key(7).verifying_key()],
            coordinator_keys: vec![key(8).verifying_key()],
            root_keys: vec![
                key(1).verifying_key(),
                key(2).verifying_key(),
                key(3).verifying_key(),
            ],
            root_threshold: 2,
        }
    }

    fn doc(version: u64) -> KeysDocument {
        KeysDocument {
            version,
            release_keys: vec![key(7).verifying_key().to_bytes()],
            coordinator_keys: vec![key(9).verifying_key().to_bytes()],
            root_keys: None,
            root_threshold: 2,
        }
    }

    fn signed(doc: &KeysDocument, by: &[&SigningKey]) -> MultiSignedBlob {
        MultiSignedBlob::sign(by, envelope::to_bytes(doc))
    }

    #[test]
    fn two_of_three_roots_rotate_the_coordinator_key() {
        let next = ring()
            .accept(&signed(&doc(4), &[&key(1), &key(3)]))
            .expect("accepted");
        assert_eq!(next.version, 4);
        assert_eq!(next.coordinator_keys, vec![key(9).verifying_key()]);
        assert_eq!(next.root_keys, ring().root_keys, "roots kept");
    }

    #[test]
    fn refusals_name_the_reason() {
        let err = |d: &KeysDocument, by: &[&SigningKey]| {
            ring()
                .accept(&signed(d, by))
                .expect_err("refused")
                .to_string()
        };
        assert_eq!(
            err(&doc(4), &[&key(1)]),
            "keys document is signed by 1 root key(s), it needs 2"
        );
        assert_eq!(
            err(&doc(3), &[&key(1), &key(2)]),
            "keys document version 3 is not newer than the accepted version 3"
        );
        let mut d = doc(4);
        d.root_threshold = 4;
        assert_eq!(
            err(&d, &[&key(1), &key(2)]),
            "keys document root_threshold: 4 is not between 1 and the 3 root keys"
        );
        let mut d = doc(4);
        d.coordinator_keys.clear();
        assert_eq!(
            err(&d, &[&key(1), &key(2)]),
            "keys document coordinator_keys: needs at least one key"
        );
        let mut d = doc(4);
        d.release_keys.push(d.release_keys[0]);
        assert!(err(&d, &[&key(1), &key(2)]).ends_with(": listed twice"));
        let mut none = ring();
        none.root_keys.clear();
        assert_eq!(
            none.accept(&signed(&doc(4), &[&key(1)])),
            Err(KeysError::NoRootKeys)
        );
    }

    #[test]
    fn new_roots_sign_the_next_document() {
        let mut d = doc(4);
        d.root_keys = Some(vec![key(5).verifying_key().to_bytes()]);
        d.root_threshold = 1;
        let next = ring()
            .accept(&signed(&d, &[&key(1), &key(2)]))
            .expect("accepted");
        assert!(next.accept(&signed(&doc(5), &[&key(1), &key(2)])).is_err());
        let mut d5 = doc(5);
        d5.root_threshold = 1;
        assert_eq!(
            next.accept(&signed(&d5, &[&key(5)])).map(|r| r.version),
            Ok(5)
        );
    }

    #[test]
    fn file_round_trips_and_checks_the_version() {
        let s = signed(&doc(4), &[&key(1), &key(2)]);
        let bytes = encode_file(&s);
        assert_eq!(decode_file(&bytes), Ok(s));
        let mut wrong = bytes;
        wrong[0] = 9;
        assert_eq!(decode_file(&wrong), Err(DecodeError::Version { found: 9 }));
        assert_eq!(decode_file(&[]), Err(DecodeError::Empty));
    }
}
