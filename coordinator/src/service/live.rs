//! Live rollout events between engine ticks, for the HTTP API's event streams.
//!
//! A device report changes its rollout at once, but the engine emits the rollout's `Status` only
//! on its next tick, up to a second later (per report it would be O(fleet) work at 100,000
//! devices: engine/mod.rs). A console watching a canary wants the report sooner. So while
//! somebody follows `/api/v1/events`, the service notes the rollout of every verified report and,
//! every [`LIVE_EVERY`], sends the summary of each rollout noted since: a burst of reports makes
//! one event per rollout and period, not one per report. The page reads what it shows through
//! the API, so an event only has to say "this rollout changed". Nobody listening costs nothing.

use std::time::Duration;

use crate::service::state::Service;

/// How often changed rollouts are told to the event streams between ticks.
pub(super) const LIVE_EVERY: Duration = Duration::from_millis(200);

impl Service {
    /// A verified report for `rollout` reached the engine.
    pub(super) fn note_live_report(&mut self, rollout: &str) {
        if self.live.receiver_count() > 0 && !rollout.is_empty() {
            self.live_changes.note(rollout);
        }
    }

    /// Sends a `rollout` event with the summary of every rollout reported on since the last
    /// call (one that no longer exists is skipped).
    pub(super) fn tell_live_changes(&mut self) {
        for name in self.live_changes.take() {
            if let Some(status) = self.engine.summary(&name) {
                let bytes = serde_json::to_vec(&status).unwrap_or_default();
                self.tell_live("rollout", &bytes);
            }
        }
    }
}
