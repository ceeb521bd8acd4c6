//! Any payload on the control topic: the JSON request parser returns a request or an error,
//! never panics.
#![no_main]

use flotilla_protocol::control::ControlRequest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = serde_json::from_slice::<ControlRequest>(data) {
        // What was parsed can be written back (replies echo parts of it).
        let _ = serde_json::to_vec(&request);
    }
});
