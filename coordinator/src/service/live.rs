//! Live rollout events between engine ticks, for the HTTP API's event streams.
//!
//! A device report changes its rollout at once, but the engine emits the rollout's `Status` only
//! on its next tick, up to a second later (per report it would be O(fleet) work at 100,000
//! devices: engine/mod.rs). A console watching a canary wants the report sooner. So while
//! somebody follows `/api/v1/events`, the service notes the rollout of every verified report and,
//! every [`LIVE_EVERY`], sends the summary of each rollout noted since: a burst of reports makes
//! one event per rollout and period, not one per report. The page reads what it shows through
//! the API, so an event only has to say "this rollout changed". Nobody listening costs nothing.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::service::state::Service;

/// How often changed rollouts are told to the event streams between ticks.
pub(super) const LIVE_EVERY: Duration = Duration::from_millis(200);

/// Rollouts reported on since the last period, at most [`LiveChanges::LIMIT`] of them.
#[derive(Debug, Default)]
pub(super) struct LiveChanges {
    rollouts: BTreeSet<String>,
}

impl LiveChanges {
    /// More than this many rollouts changing within one period is no longer a view anyone
    /// reads; the tick's `Status` effects still tell every one of them.
    const LIMIT: usize = 1024;

    fn note(&mut self, rollout: &str) {
        if self.rollouts.len() < Self::LIMIT && !self.rollouts.contains(rollout) {
            self.rollouts.insert(rollout.to_owned());
        }
    }

    fn take(&mut self) -> BTreeSet<String> {
        std::mem::take(&mut self.rollouts)
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_of_reports_makes_one_event_per_rollout_and_period() {
        let mut changes = LiveChanges::default();
        for _ in 0..500 {
            changes.note("canary");
        }
        changes.note("fleet");
        assert_eq!(
            changes.take().into_iter().collect::<Vec<_>>(),
            vec!["canary", "fleet"]
        );
        assert!(changes.take().is_empty(), "nothing new, nothing sent");
    }

    #[test]
    fn reports_naming_many_rollouts_hold_a_bounded_set() {
        let mut changes = LiveChanges::default();
        for i in 0..10_000 {
            changes.note(&format!("rollout-{i}"));
        }
        assert_eq!(changes.take().len(), LiveChanges::LIMIT);
    }
}
