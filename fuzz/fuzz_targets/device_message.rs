//! Any payload on a device's state, report or fetch topic, as the coordinator reads it: the
//! envelope, the signed device message, the self-signed opening (enrollment) and the opening
//! against a known key. Each returns a value or an error and nothing panics; what opens
//! re-encodes to what was signed.
#![no_main]

use flotilla_protocol::{device, envelope, DeviceMessage, Message, SigningKey};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = envelope::from_bytes::<DeviceMessage>("device message", data);
    let Ok(Message::Device(blob)) = envelope::decode(data) else {
        return;
    };
    if let Ok((_, message)) = device::open_self_signed(&blob) {
        assert_eq!(envelope::to_bytes(&message), blob.payload, "opened bytes are what was signed");
    }
    let known = SigningKey::from_bytes(&[7; 32]).verifying_key();
    let _ = device::open(&blob, &known);
});
