//! Any payload on the control topic: the signed wrapper and the JSON request inside it parse to
//! a value or an error, the key and signature checks answer, and nothing panics.
#![no_main]

use flotilla_protocol::control::ControlRequest;
use flotilla_protocol::operator::{check_reply_to, SignedRequest};
use flotilla_protocol::Topics;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(signed) = serde_json::from_slice::<SignedRequest>(data) else {
        return;
    };
    if let Ok(key) = signed.public_key() {
        let _ = signed.verify_with(&key);
    }
    if let Ok(request) = serde_json::from_str::<ControlRequest>(&signed.request) {
        let _ = check_reply_to(&Topics::default(), &request.reply_to);
        let _ = request.command.required_role();
        // What was parsed can be written back (replies echo parts of it).
        let _ = serde_json::to_vec(&request);
    }
});
