//! The rollouts reported on since live events were last sent (`live.rs`): a set with a bound,
//! kept apart from the service so the service's state can hold it without importing the module
//! that reads the service.

use std::collections::BTreeSet;

/// Rollouts reported on since the last period, at most [`LiveChanges::LIMIT`] of them.
#[derive(Debug, Default)]
pub(super) struct LiveChanges {
    rollouts: BTreeSet<String>,
}

impl LiveChanges {
    /// More than this many rollouts changing within one period is no longer a view anyone
    /// reads; the tick's `Status` effects still tell every one of them.
    const LIMIT: usize = 1024;

    pub(super) fn note(&mut self, rollout: &str) {
        if self.rollouts.len() < Self::LIMIT && !self.rollouts.contains(rollout) {
            self.rollouts.insert(rollout.to_owned());
        }
    }

    pub(super) fn take(&mut self) -> BTreeSet<String> {
        std::mem::take(&mut self.rollouts)
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
