//! Throws many thousands of random, truncated and mutated inputs at every decoder. Each must
//! return an error or a value, never panic.

#[allow(dead_code)] // each test binary uses a different subset of the samples
mod samples;

use flotilla_protocol::control::ControlRequest;
use flotilla_protocol::operator::{check_reply_to, SignedRequest};
use flotilla_protocol::{
    device, envelope, keys, DesiredAction, DeviceMessage, KeyRing, KeysDocument, Message,
    MultiSignedBlob, ReleaseManifest, SigningKey, Topics,
};

/// A small deterministic generator so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn decode_all(bytes: &[u8]) {
    let _ = envelope::decode(bytes);
    let _ = envelope::from_bytes::<ReleaseManifest>("manifest", bytes);
    let _ = envelope::from_bytes::<DesiredAction>("desired action", bytes);
    let _ = serde_json::from_slice::<ControlRequest>(bytes);
    if let Ok(signed) = serde_json::from_slice::<SignedRequest>(bytes) {
        if let Ok(key) = signed.public_key() {
            let _ = signed.verify_with(&key);
        }
    }
    let _ = envelope::from_bytes::<KeysDocument>("keys document", bytes);
    let _ = envelope::from_bytes::<DeviceMessage>("device message", bytes);
    if let Ok(Message::Device(blob)) = envelope::decode(bytes) {
        let _ = device::open_self_signed(&blob);
        let _ = device::open(&blob, &root(7).verifying_key());
    }
    if let Ok(signed) = keys::decode_file(bytes) {
        let _ = ring().accept(&signed);
    }
    let _ = serde_json::from_slice::<flotilla_protocol::control::TraceEntry>(bytes);
    let _ = serde_json::from_slice::<flotilla_protocol::control::RolloutStatus>(bytes);
    if let Ok(text) = std::str::from_utf8(bytes) {
        let _ = Topics::default().parse(text);
        let _ = check_reply_to(&Topics::default(), text);
    }
}

fn root(seed: u8) -> SigningKey {
    SigningKey::from_bytes(&[seed; 32])
}

/// A device's key ring with two root keys, both needed.
fn ring() -> KeyRing {
    KeyRing {
        version: 1,
        release_keys: vec![root(7).verifying_key()],
        coordinator_keys: vec![root(8).verifying_key()],
        root_keys: vec![root(1).verifying_key(), root(2).verifying_key()],
        root_threshold: 2,
    }
}

/// A keys file the ring above accepts.
fn keys_file() -> Vec<u8> {
    let doc = KeysDocument {
        version: 2,
        release_keys: vec![root(7).verifying_key().to_bytes()],
        coordinator_keys: vec![root(9).verifying_key().to_bytes()],
        root_keys: None,
        root_threshold: 2,
    };
    let signed = MultiSignedBlob::sign(&[&root(1), &root(2)], envelope::to_bytes(&doc));
    keys::encode_file(&signed)
}

fn mutate(rng: &mut Rng, valid: &[u8]) -> Vec<u8> {
    let mut bytes = valid.to_vec();
    match rng.below(4) {
        0 => bytes.truncate(rng.below(valid.len() + 1)),
        1 => {
            for _ in 0..=rng.below(4) {
                if !bytes.is_empty() {
                    let i = rng.below(bytes.len());
                    bytes[i] = rng.next() as u8;
                }
            }
        }
        2 => {
            let i = rng.below(bytes.len() + 1);
            bytes.insert(i, rng.next() as u8);
        }
        _ => {
            if !bytes.is_empty() {
                let i = rng.below(bytes.len());
                bytes[i] = 0xff; // a huge varint length prefix
            }
        }
    }
    bytes
}

#[test]
fn random_bytes_never_panic() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..20_000 {
        let len = rng.below(300);
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        decode_all(&bytes);
    }
}

#[test]
fn mutated_valid_messages_never_panic() {
    let mut rng = Rng(42);
    let mut valid: Vec<Vec<u8>> = samples::messages().iter().map(envelope::encode).collect();
    valid.push(envelope::to_bytes(&samples::manifest()));
    valid.push(envelope::to_bytes(&samples::install()));
    valid.push(keys_file());
    for m in samples::device_messages() {
        valid.push(envelope::to_bytes(&m));
    }
    valid.push(br#"{"id":"1","reply_to":"r","command":"start_rollout","rollout":"x"}"#.to_vec());
    let mut decoded_ok = 0usize;
    for i in 0..60_000 {
        let bytes = mutate(&mut rng, &valid[i % valid.len()]);
        if envelope::decode(&bytes).is_ok() {
            decoded_ok += 1;
        }
        decode_all(&bytes);
    }
    // Some mutations leave a decodable message (a changed digit), most do not: both paths ran.
    assert!(
        decoded_ok > 0 && decoded_ok < 60_000,
        "decoded {decoded_ok}"
    );
}

#[test]
fn truncations_are_errors() {
    for m in samples::messages() {
        let bytes = envelope::encode(&m);
        for len in 0..bytes.len() {
            assert!(
                envelope::decode(&bytes[..len]).is_err(),
                "{} truncated to {len}",
                m.name()
            );
        }
    }
}

#[test]
fn wrong_version_is_named() {
    let mut bytes = envelope::encode(&samples::messages()[1]);
    bytes[0] = 2;
    let err = envelope::decode(&bytes).expect_err("version 2");
    assert!(
        err.to_string().contains("unsupported protocol version 2"),
        "{err}"
    );
}

#[test]
fn mutated_keys_files_are_never_accepted() {
    let valid = keys_file();
    let accepted = |bytes: &[u8]| {
        keys::decode_file(bytes)
            .ok()
            .and_then(|signed| ring().accept(&signed).ok())
    };
    let good = accepted(&valid).expect("the unmutated file is accepted");
    let mut rng = Rng(7);
    for _ in 0..5_000 {
        let bytes = mutate(&mut rng, &valid);
        // A mutation may only be accepted if it changed nothing that was signed (e.g. a
        // signature's encoding it cannot change without failing); what it establishes is
        // exactly what the root keys signed.
        if let Some(ring) = accepted(&bytes) {
            assert_eq!(ring, good, "a mutated keys file established other keys");
        }
    }
}

#[test]
fn mutated_signed_device_messages_open_only_as_signed() {
    let key = samples::key();
    let mut rng = Rng(11);
    for m in samples::device_messages() {
        let valid = envelope::encode(&Message::Device(device::sign(&key, &m)));
        for _ in 0..3_000 {
            let bytes = mutate(&mut rng, &valid);
            let Ok(Message::Device(blob)) = envelope::decode(&bytes) else {
                continue;
            };
            // Whatever was changed, a message that still opens is exactly the signed one.
            if let Ok(opened) = device::open(&blob, &key.verifying_key()) {
                assert_eq!(
                    opened, m,
                    "a mutated device message opened as something else"
                );
            }
            if let Ok((signer, opened)) = device::open_self_signed(&blob) {
                assert_eq!(signer, key.verifying_key(), "a signature by another key");
                assert_eq!(opened, m);
            }
        }
    }
}
