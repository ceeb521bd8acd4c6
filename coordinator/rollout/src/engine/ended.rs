//! What ending a rollout did to its devices, counted, and the words the trace says it in.

use crate::text::{agree, count};

/// What ending a rollout (stop, or the stop and rollback error actions) did to its devices.
#[derive(Debug, Default)]
pub(crate) struct Ended {
    /// Sent a cancel: their action had not passed activation as far as the engine knows.
    pub canceled: usize,
    /// Never sent anything; they stay on the release they have.
    pub dropped: usize,
    /// Past activation: they finish on the new release (or fail) and say so in a report.
    pub finishing: usize,
    /// Ready and soaking: they count as ready now.
    pub soaked: usize,
    /// Waiting for a retry after a failed attempt: the failure counts, no retry comes.
    pub retries: usize,
}

impl Ended {
    /// The words of the trace: every device that was not done, and what became of it.
    pub fn describe(&self, release: &str) -> String {
        let mut parts = Vec::new();
        if self.canceled > 0 {
            parts.push(format!(
                "canceled {}",
                count(self.canceled, "device action")
            ));
        }
        if self.dropped > 0 {
            parts.push(format!(
                "{} not started {}",
                count(self.dropped, "device"),
                agree(self.dropped, "stays as it is", "stay as they are")
            ));
        }
        if self.finishing > 0 {
            parts.push(format!(
                "{} past activation cannot be canceled and {} on release {release}",
                count(self.finishing, "device"),
                agree(self.finishing, "finishes", "finish")
            ));
        }
        if self.soaked > 0 {
            parts.push(format!(
                "{} soaking {} as ready on release {release}",
                count(self.soaked, "device"),
                agree(self.soaked, "counts", "count")
            ));
        }
        if self.retries > 0 {
            parts.push(format!(
                "{} waiting for a retry {} as failed",
                count(self.retries, "device"),
                agree(self.retries, "counts", "count")
            ));
        }
        if parts.is_empty() {
            "no device action was unfinished".to_owned()
        } else {
            parts.join(", ")
        }
    }
}
