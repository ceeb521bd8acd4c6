//! Token buckets over whole seconds: the rate limits of the operator gate (`operators.rs`) and
//! of enrollment attempts (`enrollment.rs`).
//!
//! Time is the service's `now` in Unix seconds, an argument like everywhere else in the gate
//! and the registry, so limits are tested without a clock. A bucket holds up to `burst` tokens
//! and gains `count` every `per` seconds; each admitted event takes one. A clock that steps back
//! refills nothing until it has passed the last refill again.

/// How many events a bucket admits: `count` every `per` seconds, up to `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub count: u64,
    pub per: u64,
    pub burst: u64,
}

impl Rate {
    /// `count` a second, with a burst of `burst_seconds` seconds' worth (at least one).
    pub fn per_second(count: u32, burst_seconds: u64) -> Rate {
        let count = u64::from(count.max(1));
        Rate {
            count,
            per: 1,
            burst: count.saturating_mul(burst_seconds).max(1),
        }
    }

    /// `count` a minute, with a burst of `burst` (at least one).
    pub fn per_minute(count: u32, burst: u32) -> Rate {
        Rate {
            count: u64::from(count.max(1)),
            per: 60,
            burst: u64::from(burst.max(1)),
        }
    }

    /// The whole seconds a drained bucket takes to fill up again.
    pub fn refill_seconds(&self) -> u64 {
        (self.burst * self.per).div_ceil(self.count)
    }
}

/// One bucket. Tokens are kept multiplied by `per`, so a refill of a fraction of a token a
/// second is exact.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    scaled: u64,
    at: u64,
}

impl Bucket {
    /// A full bucket at `now`.
    pub fn full(rate: &Rate, now: u64) -> Bucket {
        Bucket {
            scaled: rate.burst.saturating_mul(rate.per),
            at: now,
        }
    }

    fn refill(&mut self, rate: &Rate, now: u64) {
        if now > self.at {
            let gained = (now - self.at).saturating_mul(rate.count);
            let cap = rate.burst.saturating_mul(rate.per);
            self.scaled = self.scaled.saturating_add(gained).min(cap);
            self.at = now;
        }
    }

    /// Whether a token is there to take at `now`.
    pub fn ready(&mut self, rate: &Rate, now: u64) -> bool {
        self.refill(rate, now);
        self.scaled >= rate.per
    }

    /// Takes a token if there is one.
    pub fn take(&mut self, rate: &Rate, now: u64) -> bool {
        if !self.ready(rate, now) {
            return false;
        }
        self.scaled -= rate.per;
        true
    }

    /// The whole tokens there are at `now`.
    pub fn tokens(&mut self, rate: &Rate, now: u64) -> u64 {
        self.refill(rate, now);
        self.scaled / rate.per
    }

    /// Whether the bucket is full again at `now`: it remembers nothing a new one would not.
    pub fn is_full(&mut self, rate: &Rate, now: u64) -> bool {
        self.refill(rate, now);
        self.scaled >= rate.burst.saturating_mul(rate.per)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_admits_its_burst_then_its_rate() {
        let rate = Rate::per_second(3, 2);
        let mut b = Bucket::full(&rate, 100);
        let admitted = (0..100).filter(|_| b.take(&rate, 100)).count();
        assert_eq!(admitted, 6, "the burst: two seconds' worth");
        assert_eq!((0..100).filter(|_| b.take(&rate, 101)).count(), 3);
        // A long pause refills up to the burst, not beyond.
        assert_eq!((0..100).filter(|_| b.take(&rate, 1000)).count(), 6);
        // A clock that steps back refills nothing.
        assert!(!b.take(&rate, 900));
        assert!(!b.take(&rate, 1000));
        assert!(b.take(&rate, 1001));
    }

    #[test]
    fn a_rate_per_minute_refills_a_fraction_each_second() {
        let rate = Rate::per_minute(6, 2);
        let mut b = Bucket::full(&rate, 0);
        assert!(b.take(&rate, 0) && b.take(&rate, 0));
        assert!(!b.take(&rate, 0));
        assert!(!b.take(&rate, 9), "one every ten seconds");
        assert!(b.take(&rate, 10));
        assert!(!b.is_full(&rate, 20));
        assert!(b.is_full(&rate, 30));
        assert_eq!(rate.refill_seconds(), 20);
    }
}
