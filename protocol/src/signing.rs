//! ed25519 signing and verification over the exact bytes received.
//!
//! A [`SignedBlob`] carries the encoded bytes of a message, the signer's public key and the
//! signature. Verification checks the signature over those bytes with `verify_strict` against the
//! caller's trusted keys and only then decodes them, so nothing is ever re-encoded to be verified.
//!
//! A [`MultiSignedBlob`] carries several signatures over the same bytes; it is accepted when
//! enough distinct trusted keys signed it (a threshold), which is how the root keys approve a
//! keys document (see [`keys`](crate::keys)).

use ed25519_dalek::{Signer, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};

use crate::hex;

/// Encoded message bytes with a signature over exactly those bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignedBlob {
    /// The postcard encoding of the signed message.
    pub payload: Vec<u8>,
    /// The signer's public key.
    pub signer: [u8; 32],
    /// 64 bytes of ed25519 signature.
    pub signature: Vec<u8>,
}

/// Why a signature was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("{what} is signed by unknown key {key}")]
    UnknownKey { what: &'static str, key: String },
    #[error("{what} has a malformed signature ({len} bytes, expected 64)")]
    Malformed { what: &'static str, len: usize },
    #[error("{what} signature does not verify against key {key}")]
    Invalid { what: &'static str, key: String },
}

impl SignedBlob {
    /// Signs `payload` with `key`.
    pub fn sign(key: &SigningKey, payload: Vec<u8>) -> Self {
        let signature = key.sign(&payload).to_bytes().to_vec();
        Self {
            payload,
            signer: key.verifying_key().to_bytes(),
            signature,
        }
    }

    /// Verifies the signature against the trusted keys and returns the signed bytes.
    /// `what` names the message in errors ("release manifest", "desired action").
    pub fn verify(
        &self,
        what: &'static str,
        trusted: &[VerifyingKey],
    ) -> Result<&[u8], SignatureError> {
        let key = trusted
            .iter()
            .find(|k| k.as_bytes() == &self.signer)
            .ok_or_else(|| SignatureError::UnknownKey {
                what,
                key: hex::encode(&self.signer),
            })?;
        let bytes: [u8; 64] =
            self.signature
                .as_slice()
                .try_into()
                .map_err(|_| SignatureError::Malformed {
                    what,
                    len: self.signature.len(),
                })?;
        let signature = ed25519_dalek::Signature::from_bytes(&bytes);
        key.verify_strict(&self.payload, &signature)
            .map_err(|_| SignatureError::Invalid {
                what,
                key: hex::encode(&self.signer),
            })?;
        Ok(&self.payload)
    }
}

/// One key's signature inside a [`MultiSignedBlob`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeySignature {
    /// The signer's public key.
    pub signer: [u8; 32],
    /// 64 bytes of ed25519 signature over the blob's payload.
    pub signature: Vec<u8>,
}

/// Encoded message bytes with any number of signatures over exactly those bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MultiSignedBlob {
    /// The postcard encoding of the signed message.
    pub payload: Vec<u8>,
    pub signatures: Vec<KeySignature>,
}

/// Why a threshold of signatures was not met.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ThresholdError {
    #[error("{what} has a malformed signature by {role} {key} ({len} bytes, expected 64)")]
    Malformed {
        what: &'static str,
        role: &'static str,
        key: String,
        len: usize,
    },
    #[error("{what} signature by {role} {key} does not verify")]
    Invalid {
        what: &'static str,
        role: &'static str,
        key: String,
    },
    #[error("{what} is signed by {valid} {role}(s), it needs {threshold}{}", ignored_text(.ignored, .role))]
    TooFew {
        what: &'static str,
        role: &'static str,
        valid: usize,
        threshold: usize,
        /// Signers that are not among the trusted keys, in hex.
        ignored: Vec<String>,
    },
}

fn ignored_text(ignored: &[String], role: &str) -> String {
    if ignored.is_empty() {
        String::new()
    } else {
        format!(
            " (ignored signatures by keys that are not a {role}: {})",
            ignored.join(", ")
        )
    }
}

impl MultiSignedBlob {
    /// Signs `payload` with every key in `keys`.
    pub fn sign(keys: &[&SigningKey], payload: Vec<u8>) -> Self {
        let mut blob = Self {
            payload,
            signatures: Vec::new(),
        };
        for key in keys {
            blob.add_signature(key);
        }
        blob
    }

    /// Adds `key`'s signature over the payload (signers sign one after another, offline).
    pub fn add_signature(&mut self, key: &SigningKey) {
        self.signatures.push(KeySignature {
            signer: key.verifying_key().to_bytes(),
            signature: key.sign(&self.payload).to_bytes().to_vec(),
        });
    }

    /// Returns the signed bytes when at least `threshold` distinct keys of `trusted` signed them
    /// (a threshold of 0 counts as 1: nothing unsigned is ever accepted). A signature by a
    /// trusted key that does not verify refuses the whole blob, because it means the bytes or
    /// the signature were changed; signatures by other keys are ignored and named in the error
    /// if too few remain. `what` names the message and `role` the trusted keys in errors.
    pub fn verify_threshold(
        &self,
        what: &'static str,
        role: &'static str,
        trusted: &[VerifyingKey],
        threshold: usize,
    ) -> Result<&[u8], ThresholdError> {
        let mut counted: Vec<[u8; 32]> = Vec::new();
        let mut ignored = Vec::new();
        for s in &self.signatures {
            let Some(key) = trusted.iter().find(|k| k.as_bytes() == &s.signer) else {
                ignored.push(hex::encode(&s.signer));
                continue;
            };
            let bytes: [u8; 64] =
                s.signature
                    .as_slice()
                    .try_into()
                    .map_err(|_| ThresholdError::Malformed {
                        what,
                        role,
                        key: hex::encode(&s.signer),
                        len: s.signature.len(),
                    })?;
            let signature = ed25519_dalek::Signature::from_bytes(&bytes);
            key.verify_strict(&self.payload, &signature)
                .map_err(|_| ThresholdError::Invalid {
                    what,
                    role,
                    key: hex::encode(&s.signer),
                })?;
            if !counted.contains(&s.signer) {
                counted.push(s.signer);
            }
        }
        let threshold = threshold.max(1);
        if counted.len() < threshold {
            return Err(ThresholdError::TooFew {
                what,
                role,
                valid: counted.len(),
                threshold,
                ignored,
            });
        }
        Ok(&self.payload)
    }
}

/// Generates a new signing key from the operating system's random source.
pub fn generate_key() -> SigningKey {
    SigningKey::generate(&mut rand_core::OsRng)
}

/// The text form of a secret key file: the 32-byte seed in hex.
pub fn secret_key_to_text(key: &SigningKey) -> String {
    format!("{}\n", hex::encode(key.as_bytes()))
}

/// The text form of a public key file.
pub fn public_key_to_text(key: &VerifyingKey) -> String {
    format!("{}\n", hex::encode(key.as_bytes()))
}

/// Why a key file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("not a key: {0}")]
    Hex(#[from] hex::HexError),
    #[error("not a valid ed25519 public key")]
    InvalidPoint,
}

/// Parses a secret key file's text.
pub fn secret_key_from_text(text: &str) -> Result<SigningKey, KeyError> {
    Ok(SigningKey::from_bytes(&hex::decode_array::<32>(text)?))
}

/// Parses a public key file's text.
pub fn public_key_from_text(text: &str) -> Result<VerifyingKey, KeyError> {
    VerifyingKey::from_bytes(&hex::decode_array::<32>(text)?).map_err(|_| KeyError::InvalidPoint)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(seed: u8) -> SigningKey {
        SigningKey::from_bytes(&[seed; 32])
    }

    #[test]
    fn verifies_with_trusted_key() {
        let k = key(1);
        let blob = SignedBlob::sign(&k, b"hello".to_vec());
        assert_eq!(
            blob.verify("test", &[key(2).verifying_key(), k.verifying_key()]),
            Ok(&b"hello"[..])
        );
    }

    #[test]
    fn refuses_unknown_key_and_tampering() {
        let blob = SignedBlob::sign(&key(1), b"hello".to_vec());
        let err = blob
            .verify("release manifest", &[key(2).verifying_key()])
            .expect_err("unknown");
        assert!(err.to_string().contains("unknown key"), "{err}");

        let mut tampered = blob.clone();
        tampered.payload[0] ^= 1;
        assert!(matches!(
            tampered.verify("x", &[key(1).verifying_key()]),
            Err(SignatureError::Invalid { .. })
        ));
        let mut short = blob;
        short.signature.pop();
        assert!(matches!(
            short.verify("x", &[key(1).verifying_key()]),
            Err(SignatureError::Malformed { .. })
        ));
    }

    #[test]
    fn key_text_round_trips() {
        let k = key(7);
        let back = secret_key_from_text(&secret_key_to_text(&k)).expect("parses");
        assert_eq!(back.as_bytes(), k.as_bytes());
        let pk = public_key_from_text(&public_key_to_text(&k.verifying_key())).expect("parses");
        assert_eq!(pk, k.verifying_key());
        assert!(public_key_from_text("nothex").is_err());
    }

    #[test]
    fn threshold_counts_distinct_trusted_signers() {
        let roots = [
            key(1).verifying_key(),
            key(2).verifying_key(),
            key(3).verifying_key(),
        ];
        let two = MultiSignedBlob::sign(&[&key(1), &key(3)], b"keys".to_vec());
        assert_eq!(
            two.verify_threshold("doc", "root key", &roots, 2),
            Ok(&b"keys"[..])
        );

        // The same key twice is one signature.
        let twice = MultiSignedBlob::sign(&[&key(1), &key(1)], b"keys".to_vec());
        let err = twice
            .verify_threshold("doc", "root key", &roots, 2)
            .expect_err("one signer");
        assert_eq!(
            err.to_string(),
            "doc is signed by 1 root key(s), it needs 2"
        );

        // A stranger's signature does not count and is named.
        let stranger = MultiSignedBlob::sign(&[&key(1), &key(9)], b"keys".to_vec());
        let err = stranger
            .verify_threshold("doc", "root key", &roots, 2)
            .expect_err("stranger");
        assert!(
            err.to_string().contains(&format!(
                "ignored signatures by keys that are not a root key: {}",
                hex::encode(key(9).verifying_key().as_bytes())
            )),
            "{err}"
        );

        // Unsigned never passes, whatever the threshold.
        let none = MultiSignedBlob::sign(&[], b"keys".to_vec());
        assert!(none.verify_threshold("doc", "root key", &roots, 0).is_err());

        // Tampered bytes: a root signature that no longer verifies refuses the blob.
        let mut tampered = two;
        tampered.payload[0] ^= 1;
        assert!(matches!(
            tampered.verify_threshold("doc", "root key", &roots, 1),
            Err(ThresholdError::Invalid { .. })
        ));
    }
}
