//! Any bytes on a device topic: the envelope decoder returns a message or an error, never
//! panics, and a decoded message encodes back to bytes that decode to the same message.
#![no_main]

use flotilla_protocol::envelope;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = envelope::decode(data) {
        let again = envelope::decode(&envelope::encode(&message));
        assert_eq!(
            again.as_ref(),
            Ok(&message),
            "re-encoding changed the message"
        );
    }
});
