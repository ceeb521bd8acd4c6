//! Any JSON an integration reads from the events topics: a decision trace entry
//! (`events/log`, structured fields beside the message) and a rollout status
//! (`events/rollouts/{name}`). Each parses to a value or an error, and a parsed value writes back
//! and parses again to the same value.
#![no_main]

use flotilla_protocol::control::{RolloutStatus, TraceEntry};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(entry) = serde_json::from_slice::<TraceEntry>(data) {
        let again: TraceEntry =
            serde_json::from_slice(&serde_json::to_vec(&entry).expect("writes")).expect("reads");
        assert_eq!(again, entry);
    }
    if let Ok(status) = serde_json::from_slice::<RolloutStatus>(data) {
        let _ = serde_json::to_vec(&status).expect("writes");
    }
});
