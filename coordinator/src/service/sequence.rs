//! The per-device order of desired actions.
//!
//! Every desired action the coordinator signs for a device carries an `issued_at` strictly
//! greater than that of the action before it, so `issued_at` is a per-device sequence that only
//! grows, and an agent refuses any action older than the last one it accepted: a captured
//! install re-published after `rollout stop` is older than the cancel that stop published, and
//! is refused (docs/security.md, "Replay of desired actions"; decision 0011).
//!
//! The sequence follows the clock (`issued_at` stays a time in seconds, so expiry and the
//! agent's trusted time keep their meaning) and runs ahead of it only by the number of actions
//! a device gets within one second. The last value per device is kept in the store, so a
//! restart never issues a lower one.
//!
//! One exception: a last value more than [`AHEAD_LIMIT`] ahead of the clock was issued while the
//! clock was wrong (agents refuse actions issued further ahead of their own clock than their
//! `max_clock_skew`, default 1h, so they never accepted it). Continuing above it would keep every
//! later action as far ahead, refused too; the sequence starts again from the clock instead.

use std::collections::HashMap;

/// How far ahead of the clock the sequence may run before it is taken for a clock glitch.
pub const AHEAD_LIMIT: u64 = 10 * 60;

/// The last `issued_at` signed for each device.
#[derive(Debug, Default)]
pub struct ActionSequence {
    last: HashMap<String, u64>,
}

impl ActionSequence {
    /// Continues from the values the store kept.
    pub fn new(last: HashMap<String, u64>) -> Self {
        Self { last }
    }

    /// An action signed for `device` with this key and this `issued_at` is out there (read
    /// back from the broker's retained `desired` topic): the next one must be newer. This is
    /// how a coordinator that takes over a shared store continues above the last leader's
    /// sequence even where the last leader could not store it before it died.
    pub fn observe(&mut self, device: &str, issued_at: u64) {
        match self.last.get_mut(device) {
            Some(last) if *last >= issued_at => {}
            Some(last) => *last = issued_at,
            None => {
                self.last.insert(device.to_owned(), issued_at);
            }
        }
    }

    /// The `issued_at` for the next action to `device`: `now`, or one more than the last one
    /// when the clock has not moved past it.
    pub fn next(&mut self, device: &str, now: u64) -> u64 {
        let at = match self.last.get(device) {
            Some(&last) if last >= now && last - now < AHEAD_LIMIT => last.saturating_add(1),
            Some(&last) if last >= now => {
                tracing::warn!(
                    %device,
                    last,
                    now,
                    "the last action for this device was issued {}s ahead of the clock; \
                     starting again from the clock",
                    last - now
                );
                now
            }
            _ => now,
        };
        self.last.insert(device.to_owned(), at);
        at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_in_one_second_get_increasing_times() {
        let mut seq = ActionSequence::default();
        assert_eq!(seq.next("dev-1", 100), 100);
        assert_eq!(
            seq.next("dev-1", 100),
            101,
            "a second action in the same second"
        );
        assert_eq!(seq.next("dev-1", 100), 102);
        assert_eq!(
            seq.next("dev-2", 100),
            100,
            "each device has its own sequence"
        );
        assert_eq!(
            seq.next("dev-1", 200),
            200,
            "the clock takes over once it is ahead"
        );
    }

    #[test]
    fn a_restart_continues_above_the_stored_value_even_when_the_clock_went_back() {
        let mut seq = ActionSequence::new(HashMap::from([("dev-1".to_owned(), 500)]));
        assert_eq!(seq.next("dev-1", 400), 501);
    }

    #[test]
    fn an_action_read_back_from_the_broker_moves_the_sequence_past_it() {
        let mut seq = ActionSequence::new(HashMap::from([("dev-1".to_owned(), 500)]));
        seq.observe("dev-1", 520);
        seq.observe("dev-1", 510);
        seq.observe("dev-2", 530);
        assert_eq!(
            seq.next("dev-1", 400),
            521,
            "above what the last leader published"
        );
        assert_eq!(
            seq.next("dev-2", 400),
            531,
            "a device the store did not know yet"
        );
    }

    /// issue 10, case 5: a month issued ahead while the clock was wrong does not keep every
    /// later action a month ahead.
    #[test]
    fn a_value_far_ahead_of_the_clock_is_a_glitch_and_the_clock_takes_over() {
        let month = 30 * 86_400;
        let mut seq = ActionSequence::new(HashMap::from([("dev-1".to_owned(), 1_000 + month)]));
        assert_eq!(seq.next("dev-1", 1_000), 1_000);
        assert_eq!(seq.next("dev-1", 1_000), 1_001);
    }
}
