//! Device signatures with their costly half done before the run (`--sign-ahead`).
//!
//! An ed25519 signature over M by secret scalar `a` (public key A) is `R || S` with `R = r·B`
//! and `S = r + H(R || A || M)·a mod l`. The multiplication `r·B` is most of a signature's cost;
//! RFC 8032 derives `r` from the message, but a verifier only checks `S·B = R + H(R || A || M)·A`,
//! so any `r` used once gives a valid signature, and the coordinator checks it exactly as it
//! checks an agent's (with `verify_strict`). [`Nonces`] computes `(r, R)` pairs before the
//! simulator connects (every core, a fresh random salt per process, each pair handed out once);
//! a device message then costs one SHA-512 and a scalar multiply-add to sign instead of a point
//! multiplication. When the pairs run out, signing falls back to the ordinary deterministic
//! signature ([`flotilla_protocol::device::sign`]).
//!
//! This is what keeps the simulator's CPU below the coordinator's in `bench/fleet.sh`: the
//! devices' signing moves ahead of the timed span, the coordinator's checks stay in it.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use curve25519_dalek::edwards::EdwardsPoint;
use curve25519_dalek::scalar::{clamp_integer, Scalar};
use flotilla_protocol::{envelope, DeviceMessage, SignedBlob, SigningKey};
use rand_core::{OsRng, RngCore};
use sha2::{Digest, Sha512};

/// A device's key in the form signing with a prepared nonce needs.
#[derive(Clone)]
pub struct DeviceSigner {
    /// The clamped secret scalar `a` (RFC 8032's `s`).
    scalar: Scalar,
    /// The public key A.
    public: [u8; 32],
}

impl DeviceSigner {
    pub fn new(key: &SigningKey) -> DeviceSigner {
        let hash = Sha512::digest(key.to_bytes());
        let mut low = [0u8; 32];
        low.copy_from_slice(&hash[..32]);
        DeviceSigner {
            scalar: Scalar::from_bytes_mod_order(clamp_integer(low)),
            public: key.verifying_key().to_bytes(),
        }
    }

    /// `message` signed with the prepared nonce `nonce` (which must never be used again).
    fn sign(&self, nonce: &Nonce, payload: Vec<u8>) -> SignedBlob {
        let mut h = Sha512::new();
        h.update(nonce.point);
        h.update(self.public);
        h.update(&payload);
        let mut wide = [0u8; 64];
        wide.copy_from_slice(&h.finalize());
        let k = Scalar::from_bytes_mod_order_wide(&wide);
        let s = k * self.scalar + nonce.scalar;
        let mut signature = Vec::with_capacity(64);
        signature.extend_from_slice(&nonce.point);
        signature.extend_from_slice(s.as_bytes());
        SignedBlob {
            payload,
            signer: self.public,
            signature,
        }
    }
}

/// One prepared nonce: `r` and the compressed `R = r·B`.
struct Nonce {
    scalar: Scalar,
    point: [u8; 32],
}

/// A pool of prepared nonces, each handed out once.
pub struct Nonces {
    pool: Vec<Nonce>,
    next: AtomicUsize,
}

impl Nonces {
    /// An empty pool: every signature is the ordinary one.
    pub fn none() -> Nonces {
        Nonces {
            pool: Vec::new(),
            next: AtomicUsize::new(0),
        }
    }

    /// `count` nonces, computed on `threads` threads. Each `r` is SHA-512 over a random salt of
    /// this process and the nonce's index, reduced mod l: never the same twice.
    pub fn prepare(count: usize, threads: usize) -> Nonces {
        let mut salt = [0u8; 32];
        OsRng.fill_bytes(&mut salt);
        let threads = threads.max(1);
        let chunk = count.div_ceil(threads).max(1);
        let mut pool = Vec::with_capacity(count);
        std::thread::scope(|scope| {
            let parts: Vec<_> = (0..count)
                .step_by(chunk)
                .map(|start| {
                    let end = (start + chunk).min(count);
                    scope.spawn(move || (start..end).map(|i| nonce(&salt, i)).collect::<Vec<_>>())
                })
                .collect();
            for part in parts {
                pool.extend(part.join().unwrap_or_default());
            }
        });
        Nonces {
            pool,
            next: AtomicUsize::new(0),
        }
    }

    /// How many were prepared.
    pub fn len(&self) -> usize {
        self.pool.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pool.is_empty()
    }

    /// How many were handed out.
    pub fn used(&self) -> usize {
        self.next.load(Relaxed).min(self.pool.len())
    }

    /// Signs a device message: with the next prepared nonce while there is one, else the
    /// ordinary way. Returns the blob and whether a prepared nonce signed it.
    pub fn sign(
        &self,
        key: &SigningKey,
        signer: &DeviceSigner,
        message: &DeviceMessage,
    ) -> (SignedBlob, bool) {
        if !self.pool.is_empty() {
            let i = self.next.fetch_add(1, Relaxed);
            if let Some(nonce) = self.pool.get(i) {
                return (signer.sign(nonce, envelope::to_bytes(message)), true);
            }
        }
        (flotilla_protocol::device::sign(key, message), false)
    }
}

fn nonce(salt: &[u8; 32], index: usize) -> Nonce {
    let mut h = Sha512::new();
    h.update(b"flotilla-fleetsim nonce\0");
    h.update(salt);
    h.update((index as u64).to_le_bytes());
    let mut wide = [0u8; 64];
    wide.copy_from_slice(&h.finalize());
    let scalar = Scalar::from_bytes_mod_order_wide(&wide);
    Nonce {
        point: EdwardsPoint::mul_base(&scalar).compress().to_bytes(),
        scalar,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_protocol::{device, Report};

    fn report(seq: u64) -> DeviceMessage {
        DeviceMessage::Report(Report {
            device_id: "sim-000001".into(),
            seq,
            action_id: "fleet:1:sim-000001".into(),
            rollout_id: "fleet".into(),
            phase: flotilla_protocol::Phase::Ready,
            at: 1_700_000_000,
        })
    }

    #[test]
    fn signatures_made_ahead_verify_like_the_agents() {
        let key = SigningKey::from_bytes(&[7; 32]);
        let signer = DeviceSigner::new(&key);
        let nonces = Nonces::prepare(3, 2);
        assert_eq!(nonces.len(), 3);
        for seq in 1..=4 {
            let (blob, ahead) = nonces.sign(&key, &signer, &report(seq));
            // Three with the prepared nonces, then the ordinary signature.
            assert_eq!(ahead, seq <= 3);
            let opened = device::open(&blob, &key.verifying_key()).expect("verifies strictly");
            assert_eq!(opened, report(seq));
        }
        assert_eq!(nonces.used(), 3);
    }

    #[test]
    fn a_signature_made_ahead_covers_the_bytes_and_the_key() {
        let key = SigningKey::from_bytes(&[7; 32]);
        let nonces = Nonces::prepare(2, 1);
        let (mut blob, _) = nonces.sign(&key, &DeviceSigner::new(&key), &report(1));
        let other = SigningKey::from_bytes(&[8; 32]);
        assert!(device::open(&blob, &other.verifying_key()).is_err());
        let last = blob.payload.len() - 1;
        blob.payload[last] ^= 1;
        assert!(device::open(&blob, &key.verifying_key()).is_err());
    }

    #[test]
    fn no_two_nonces_are_the_same() {
        let nonces = Nonces::prepare(64, 3);
        let mut points: Vec<[u8; 32]> = nonces.pool.iter().map(|n| n.point).collect();
        points.sort_unstable();
        points.dedup();
        assert_eq!(points.len(), 64);
    }
}
