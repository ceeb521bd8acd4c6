//! The agent's path for a desired action: decode the envelope, verify the coordinator's
//! signature over the exact bytes, decode the action, then verify and decode the release
//! manifest it carries. Random bytes almost never carry a valid signature, so the fuzzer
//! mostly exercises the decoders and the refusal paths; none of them may panic.
#![no_main]

use std::sync::OnceLock;

use flotilla_protocol::{
    envelope, ActionBody, DesiredAction, Message, ReleaseManifest, SignedBlob, SigningKey,
    VerifyingKey,
};
use libfuzzer_sys::fuzz_target;

/// The (coordinator, release) keys the device trusts, derived once.
fn keys() -> &'static ([VerifyingKey; 1], [VerifyingKey; 1]) {
    static KEYS: OnceLock<([VerifyingKey; 1], [VerifyingKey; 1])> = OnceLock::new();
    KEYS.get_or_init(|| {
        let key = |seed: u8| SigningKey::from_bytes(&[seed; 32]).verifying_key();
        ([key(2)], [key(1)])
    })
}

fn verify(blob: &SignedBlob) {
    let (trusted, release) = keys();
    // The fuzzer cannot forge a signature; also decode unverified bytes so the action and
    // manifest decoders see the fuzzer's input.
    let bytes = blob
        .verify("desired action", trusted)
        .unwrap_or(&blob.payload);
    let Ok(action) = envelope::from_bytes::<DesiredAction>("desired action", bytes) else {
        return;
    };
    if let ActionBody::Install { manifest, .. } = &action.body {
        let bytes = manifest
            .verify("release manifest", release)
            .unwrap_or(&manifest.payload);
        let _ = envelope::from_bytes::<ReleaseManifest>("release manifest", bytes);
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(Message::Desired(blob)) = envelope::decode(data) {
        verify(&blob);
    }
    if let Ok(blob) = envelope::from_bytes::<SignedBlob>("signed blob", data) {
        verify(&blob);
    }
});
