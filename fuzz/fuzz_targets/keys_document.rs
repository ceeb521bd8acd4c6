//! Any keys file handed to `flotilla-agent keys install`: decoding and checking it against a
//! device's key ring returns a new ring or a refusal, never panics, and never accepts a
//! document the device's root keys did not sign (the fuzzer cannot produce their signatures).
#![no_main]

use std::sync::OnceLock;

use flotilla_protocol::{envelope, keys, KeyRing, KeysDocument, SigningKey};
use libfuzzer_sys::fuzz_target;

/// Built once: deriving public keys costs more than a whole run of the decoder.
fn ring() -> &'static KeyRing {
    static RING: OnceLock<KeyRing> = OnceLock::new();
    RING.get_or_init(|| {
        let root = |seed: u8| SigningKey::from_bytes(&[seed; 32]).verifying_key();
        KeyRing {
            version: 1,
            release_keys: vec![root(7)],
            coordinator_keys: vec![root(8)],
            // Seeds no fixture signs with, so a seed corpus cannot hold their signatures.
            root_keys: vec![root(0xa1), root(0xa2), root(0xa3)],
            root_threshold: 2,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let ring = ring();
    if let Ok(signed) = keys::decode_file(data) {
        assert!(
            ring.accept(&signed).is_err(),
            "a keys document without root signatures was accepted"
        );
        let _ = envelope::from_bytes::<KeysDocument>("keys document", &signed.payload);
    }
    let _ = envelope::from_bytes::<KeysDocument>("keys document", data);
});
