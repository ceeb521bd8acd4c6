//! The rate limit with an exponential ramp: devices started per minute, beginning at a base rate
//! and multiplied by a factor every time a number of devices succeeded. Pure and serializable:
//! it is stored inside the rollout, so a restart keeps the credit.

use serde::{Deserialize, Serialize};

use crate::plan::RateLimit;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ramp {
    pub limit: RateLimit,
    /// Devices that may start now (fractional credit accrues between calls).
    credit: f64,
    /// When the credit was last brought up to date.
    last: u64,
}

impl Ramp {
    /// A ramp whose first device may start at once.
    pub fn new(limit: RateLimit, now: u64) -> Ramp {
        Ramp {
            limit,
            credit: 1.0,
            last: now,
        }
    }

    /// Devices per minute after `successes` devices succeeded.
    pub fn rate(&self, successes: usize) -> f64 {
        let steps = successes / self.limit.every.max(1) as usize;
        let mut rate = self.limit.base * self.limit.factor.powi(steps.min(1000) as i32);
        if let Some(max) = self.limit.max {
            rate = rate.min(max);
        }
        rate.max(0.0)
    }

    /// How many devices may start now.
    pub fn available(&mut self, now: u64, successes: usize) -> usize {
        let rate = self.rate(successes);
        let elapsed = now.saturating_sub(self.last) as f64;
        self.last = self.last.max(now);
        let cap = rate.max(1.0);
        self.credit = (self.credit + elapsed * rate / 60.0).min(cap);
        self.credit.floor().max(0.0) as usize
    }

    /// Records that `n` devices started.
    pub fn take(&mut self, n: usize) {
        self.credit = (self.credit - n as f64).max(0.0);
    }

    /// When at least one more device may start.
    pub fn next_at(&self, now: u64, successes: usize) -> u64 {
        let rate = self.rate(successes);
        if self.credit >= 1.0 || rate <= 0.0 {
            return now;
        }
        let missing = 1.0 - self.credit;
        let secs = (missing * 60.0 / rate).ceil() as u64;
        (self.last + secs.max(1)).max(now)
    }
}
