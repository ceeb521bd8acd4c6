//! Device signatures checked in batches on the verify-ahead workers (decision 0063).
//!
//! A worker takes what is waiting in its queue, up to [`MAX_BATCH`] events, and checks the
//! signatures of the device messages among them with one ed25519 batch verification
//! (`ed25519_dalek::verify_batch`): one multiscalar multiplication for the batch instead of one
//! double-base multiplication per signature. When the batch fails, each signature is checked on
//! its own with `verify_strict`, which finds the bad ones; after a failed batch the next batch
//! is checked one by one, and batching resumes once a batch passes whole, so a flood of forged
//! signatures costs what it cost before batching, not half again as much.
//!
//! What a passing batch proves: every signature in it satisfies the ed25519 equation (up to the
//! curve's small torsion) under the key its message names, which only that key's holder can
//! make. Keys of small order are refused before the batch, as `verify_strict` refuses them,
//! since under such a key anyone could make a signature pass. A batch never accepts a
//! signature for a key whose secret the sender lacks; it may accept one that its own signer
//! crafted to fail `verify_strict` (a non-canonical or torsioned `R`), which gains that signer
//! nothing it could not sign anyway.

use ed25519_dalek::{Signature, VerifyingKey};
use flotilla_protocol::SignedBlob;

/// Most signatures checked in one batch: past this, a batch saves little more per signature
/// and a failing one costs more to sort out.
pub const MAX_BATCH: usize = 64;

/// How a worker checks the signatures of one batch: together while batches pass, one by one
/// after a batch failed.
#[derive(Debug, Default)]
pub struct BatchVerifier {
    one_by_one: bool,
}

impl BatchVerifier {
    /// Whether each of `items` (a signed blob and the key it names) verifies.
    pub fn verify(&mut self, items: &[(&SignedBlob, VerifyingKey)]) -> Vec<bool> {
        let mut ok = vec![false; items.len()];
        let mut candidates = Vec::with_capacity(items.len());
        for (n, (blob, key)) in items.iter().enumerate() {
            // What verify_strict refuses before any arithmetic: a key of small order, and a
            // signature that is not 64 bytes.
            if key.is_weak() {
                continue;
            }
            if let Ok(bytes) = <[u8; 64]>::try_from(blob.signature.as_slice()) {
                candidates.push((n, Signature::from_bytes(&bytes)));
            }
        }
        if candidates.len() >= 2 && !self.one_by_one {
            let messages: Vec<&[u8]> = candidates
                .iter()
                .map(|(n, _)| items[*n].0.payload.as_slice())
                .collect();
            let signatures: Vec<Signature> = candidates.iter().map(|(_, s)| *s).collect();
            let keys: Vec<VerifyingKey> = candidates.iter().map(|(n, _)| items[*n].1).collect();
            if ed25519_dalek::verify_batch(&messages, &signatures, &keys).is_ok() {
                for (n, _) in &candidates {
                    ok[*n] = true;
                }
                return ok;
            }
        }
        for (n, signature) in &candidates {
            let (blob, key) = &items[*n];
            ok[*n] = key.verify_strict(&blob.payload, signature).is_ok();
        }
        // Batch again once everything checked one by one passed.
        self.one_by_one = candidates.iter().any(|(n, _)| !ok[*n]);
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_protocol::{device, BlockRequest, DeviceMessage, SigningKey};

    fn signed(seed: u8, n: u64) -> (SignedBlob, VerifyingKey) {
        let key = SigningKey::from_bytes(&[seed; 32]);
        let blob = device::sign(
            &key,
            &DeviceMessage::Fetch {
                device_id: format!("dev-{seed}").as_str().into(),
                request: BlockRequest {
                    sha256: [seed; 32],
                    offset: n,
                    length: 1,
                },
            },
        );
        (blob, key.verifying_key())
    }

    fn check(verifier: &mut BatchVerifier, items: &[(SignedBlob, VerifyingKey)]) -> Vec<bool> {
        let refs: Vec<(&SignedBlob, VerifyingKey)> = items.iter().map(|(b, k)| (b, *k)).collect();
        verifier.verify(&refs)
    }

    #[test]
    fn a_batch_of_good_signatures_passes_and_a_forged_one_is_found_among_them() {
        let mut verifier = BatchVerifier::default();
        let mut items: Vec<_> = (0..40).map(|n| signed(n as u8 + 1, n)).collect();
        assert!(check(&mut verifier, &items).iter().all(|ok| *ok));
        items[17].0.signature[5] ^= 1; // forged
        items[30].0.payload[0] ^= 1; // altered after signing
        let ok = check(&mut verifier, &items);
        for (n, ok) in ok.iter().enumerate() {
            assert_eq!(*ok, n != 17 && n != 30, "signature {n}");
        }
    }

    #[test]
    fn a_signature_under_another_key_short_signatures_and_weak_keys_fail() {
        let mut verifier = BatchVerifier::default();
        let mut items: Vec<_> = (0..8).map(|n| signed(n as u8 + 1, n)).collect();
        items[2].1 = items[3].1; // someone else's key
        items[4].0.signature.truncate(63);
        // The identity point: a key of small order, under which anyone can "sign".
        let mut identity = [0u8; 32];
        identity[0] = 1;
        items[6].1 = VerifyingKey::from_bytes(&identity).expect("decompresses");
        let ok = check(&mut verifier, &items);
        assert_eq!(ok, [true, true, false, true, false, true, false, true]);
    }

    #[test]
    fn after_a_failed_batch_signatures_are_checked_one_by_one_until_all_pass_again() {
        let mut verifier = BatchVerifier::default();
        let mut items: Vec<_> = (0..10).map(|n| signed(n as u8 + 1, n)).collect();
        items[0].0.signature[0] ^= 1;
        check(&mut verifier, &items);
        assert!(verifier.one_by_one, "a forged signature turns batching off");
        items[0].0.signature[0] ^= 1;
        assert!(check(&mut verifier, &items).iter().all(|ok| *ok));
        assert!(!verifier.one_by_one, "a clean batch turns it back on");
    }
}
