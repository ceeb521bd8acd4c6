//! The rate-limit ramp: how many devices a rollout may start right now.
//!
//! A token bucket whose refill rate grows with successes: `base` devices per minute at first,
//! multiplied by `factor` every time `every` more devices succeeded, never above `max`. Credit
//! accrues continuously at the current rate and is capped at one minute's worth (at least one
//! device), so a rollout that sat idle for hours (a closed maintenance window, a pause) does not
//! start a burst of devices when it wakes up. A new ramp holds credit for one device, so the
//! first device starts at once.
//!
//! The ramp is plain data and stored inside the rollout; it never reads a clock.
//!
//! ```
//! use flotilla_rollout::plan::RateLimit;
//! use flotilla_rollout::ramp::Ramp;
//!
//! let limit = RateLimit { base: 5.0, factor: 2.0, every: 10, max: Some(40.0) };
//! let mut ramp = Ramp::new(limit, 1_000);
//! assert_eq!(ramp.available(1_000, 0), 1);
//! ramp.take(1);
//! assert_eq!(ramp.next_at(1_000, 0), 1_012); // 5 per minute: one every 12 seconds
//! assert_eq!(ramp.rate(10), 10.0);
//! ```

use serde::{Deserialize, Serialize};

use crate::plan::RateLimit;

/// Guards floor() against 2.9999999 after many small additions.
const EPSILON: f64 = 1e-9;

/// A rate limit's state: the limit, the unused credit (devices) and when it was last updated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ramp {
    pub limit: RateLimit,
    /// Devices that may start now; fractional while it accrues.
    pub credit: f64,
    /// Unix seconds of the last accrual.
    pub updated: u64,
}

impl Ramp {
    pub fn new(limit: RateLimit, now: u64) -> Ramp {
        Ramp {
            limit,
            credit: 1.0,
            updated: now,
        }
    }

    /// Devices per minute after `successes` devices succeeded:
    /// `base * factor^(successes / every)`, capped at `max`.
    pub fn rate(&self, successes: usize) -> f64 {
        let RateLimit {
            base,
            factor,
            every,
            max,
        } = self.limit;
        let steps = if every == 0 {
            0
        } else {
            successes / every as usize
        };
        let cap = max.unwrap_or(f64::INFINITY);
        let rate = base * factor.powi(i32::try_from(steps).unwrap_or(i32::MAX));
        // 0 * inf is NaN: a zero base stays zero however many successes there are.
        let rate = if rate.is_nan() { 0.0 } else { rate.max(0.0) };
        rate.min(cap)
    }

    /// Most credit the bucket holds at `rate`: one minute's worth, at least one device.
    fn cap(rate: f64) -> f64 {
        rate.max(1.0)
    }

    /// Credit at `now` without changing the ramp.
    fn credit_at(&self, now: u64, successes: usize) -> f64 {
        let rate = self.rate(successes);
        let elapsed = now.saturating_sub(self.updated) as f64;
        (self.credit + elapsed * rate / 60.0).min(Self::cap(rate).max(self.credit))
    }

    /// Accrues credit since the last call at the current rate and returns how many devices may
    /// start now.
    pub fn available(&mut self, now: u64, successes: usize) -> usize {
        if now > self.updated {
            self.credit = self.credit_at(now, successes);
            self.updated = now;
        }
        if self.credit < 1.0 - EPSILON {
            return 0;
        }
        (self.credit + EPSILON).floor() as usize
    }

    /// Spends credit for `n` started devices. Taking more than is available borrows from the
    /// future: the next device waits until the debt is paid.
    pub fn take(&mut self, n: usize) {
        self.credit -= n as f64;
    }

    /// The earliest time at or after `now` when at least one more device may start; `u64::MAX`
    /// when the rate is zero.
    pub fn next_at(&self, now: u64, successes: usize) -> u64 {
        let credit = self.credit_at(now.max(self.updated), successes);
        if credit >= 1.0 - EPSILON {
            return now;
        }
        let rate = self.rate(successes);
        if rate <= 0.0 {
            return u64::MAX;
        }
        let wait = ((1.0 - credit) * 60.0 / rate - EPSILON).ceil().max(0.0);
        now.max(self.updated).saturating_add(wait as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_800_000_000;

    fn limit(base: f64, factor: f64, every: u32, max: Option<f64>) -> RateLimit {
        RateLimit {
            base,
            factor,
            every,
            max,
        }
    }

    /// Starts every device the ramp allows, second by second, over `[from, to)`.
    fn started(ramp: &mut Ramp, from: u64, to: u64, successes: usize) -> usize {
        let mut total = 0;
        for now in from..to {
            let n = ramp.available(now, successes);
            ramp.take(n);
            total += n;
        }
        total
    }

    #[test]
    fn five_per_minute_starts_five_per_minute() {
        let mut ramp = Ramp::new(limit(5.0, 2.0, 10, None), T0);
        assert_eq!(started(&mut ramp, T0, T0 + 60, 0), 5);
        assert_eq!(started(&mut ramp, T0 + 60, T0 + 120, 0), 5);
        assert_eq!(started(&mut ramp, T0 + 120, T0 + 720, 0), 50, "ten minutes");
    }

    #[test]
    fn rate_doubles_after_every_ten_successes_up_to_the_cap() {
        let ramp = Ramp::new(limit(5.0, 2.0, 10, Some(30.0)), T0);
        assert_eq!(ramp.rate(0), 5.0);
        assert_eq!(ramp.rate(9), 5.0);
        assert_eq!(ramp.rate(10), 10.0);
        assert_eq!(ramp.rate(25), 20.0);
        assert_eq!(ramp.rate(30), 30.0, "40 is capped at 30");
        assert_eq!(ramp.rate(1_000_000), 30.0);
        let uncapped = Ramp::new(limit(5.0, 2.0, 10, None), T0);
        assert_eq!(uncapped.rate(30), 40.0);

        let mut ramp = Ramp::new(limit(5.0, 2.0, 10, None), T0);
        let n = ramp.available(T0, 0);
        ramp.take(n);
        assert_eq!(
            started(&mut ramp, T0 + 1, T0 + 61, 10),
            10,
            "ten per minute after ten successes"
        );
    }

    #[test]
    fn no_burst_after_a_long_idle() {
        let mut ramp = Ramp::new(limit(5.0, 2.0, 10, None), T0);
        let n = ramp.available(T0, 0);
        ramp.take(n);
        assert_eq!(
            ramp.available(T0 + 6 * 3600, 0),
            5,
            "six idle hours give one minute's worth, not 1800"
        );
        let mut slow = Ramp::new(limit(0.5, 1.0, 1, None), T0);
        let n = slow.available(T0, 0);
        slow.take(n);
        assert_eq!(slow.available(T0 + 86_400, 0), 1, "at least one device");
    }

    #[test]
    fn next_at_says_when_the_next_device_may_start() {
        let mut ramp = Ramp::new(limit(5.0, 2.0, 10, None), T0);
        assert_eq!(ramp.next_at(T0, 0), T0, "the first device starts at once");
        let n = ramp.available(T0, 0);
        ramp.take(n);
        assert_eq!(ramp.next_at(T0, 0), T0 + 12);
        assert_eq!(ramp.next_at(T0 + 5, 0), T0 + 12);
        assert_eq!(ramp.next_at(T0, 10), T0 + 6, "faster after ten successes");
        assert_eq!(ramp.available(T0 + 11, 0), 0);
        assert_eq!(ramp.available(T0 + 12, 0), 1);
        let stopped = Ramp {
            credit: 0.0,
            ..Ramp::new(limit(0.0, 2.0, 10, None), T0)
        };
        assert_eq!(stopped.next_at(T0, 0), u64::MAX);
    }

    #[test]
    fn survives_a_round_trip_through_the_store() {
        let mut ramp = Ramp::new(limit(5.0, 1.5, 4, Some(60.0)), T0);
        let n = ramp.available(T0 + 30, 3);
        ramp.take(n);
        let json = serde_json::to_string(&ramp).expect("encodes");
        assert_eq!(serde_json::from_str::<Ramp>(&json).expect("decodes"), ramp);
    }
}
