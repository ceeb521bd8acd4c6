//! Enrollment tokens: how strong one must be (the config refuses weaker ones), how a fresh one
//! is made (`flotilla enrollment token`), and how many attempts to show one the coordinator
//! checks ([`Attempts`], used by the enrollment registry). Decision 0041.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use flotilla_protocol::hex;

use crate::service::rate::{Bucket, Rate};

/// The fewest bits of entropy an enrollment token may have.
pub const TOKEN_MIN_BITS: f64 = 128.0;

/// Enrollment attempts checked a second, all devices together, unless configured.
pub const ATTEMPTS_PER_SECOND: u32 = 20;
/// Enrollment attempts checked a minute for one device id, unless configured.
pub const DEVICE_ATTEMPTS_PER_MINUTE: u32 = 6;
/// How many enrollment attempts one device id may make at once.
pub const DEVICE_ATTEMPT_BURST: u32 = 3;

/// A fresh one-time enrollment token: 32 bytes from the operating system's random source (an
/// ed25519 seed is exactly that), in hex: 256 bits, where the config asks for 128.
pub fn new_token() -> String {
    hex::encode(flotilla_protocol::signing::generate_key().as_bytes())
}

/// Why a token is too weak, if it is: an estimate of its entropy from its length and the
/// kinds of characters in it (hex digits count 4 bits each; otherwise the classes used: digits,
/// lower and upper case letters, other printable characters), and a refusal of the obviously
/// non-random (one character for half of it, a pattern repeated). The estimate is an upper
/// bound for a token a person made up; `flotilla enrollment token` makes 256 random bits.
pub fn token_strength(token: &str) -> Result<f64, String> {
    let len = token.chars().count();
    if token.trim() != token || token.chars().any(|c| c.is_control()) {
        return Err("it has spaces at its ends or control characters".into());
    }
    let hex = token.chars().all(|c| c.is_ascii_hexdigit());
    let alphabet: u32 = if hex {
        16
    } else {
        let has = |is: fn(&char) -> bool| token.chars().any(|c| is(&c));
        [
            (has(char::is_ascii_digit), 10),
            (has(char::is_ascii_lowercase), 26),
            (has(char::is_ascii_uppercase), 26),
            (token.chars().any(|c| !c.is_ascii_alphanumeric()), 33),
        ]
        .iter()
        .filter(|(used, _)| *used)
        .map(|(_, n)| n)
        .sum()
    };
    let bits = len as f64 * f64::from(alphabet.max(2)).log2();
    let chars: Vec<char> = token.chars().collect();
    let mut counts: HashMap<char, usize> = HashMap::new();
    for c in &chars {
        *counts.entry(*c).or_default() += 1;
    }
    let most = counts.values().copied().max().unwrap_or(0);
    if len > 0 && most * 2 > len {
        return Err("one character makes up more than half of it".into());
    }
    if let Some(period) =
        (1..=len / 2).find(|p| chars.iter().skip(*p).zip(&chars).all(|(a, b)| a == b))
    {
        return Err(format!("it repeats a pattern of {period} characters"));
    }
    if bits < TOKEN_MIN_BITS {
        return Err(format!(
            "it has {len} characters of {alphabet} kinds, about {} bits",
            bits.floor()
        ));
    }
    Ok(bits)
}

/// Enrollment attempts by result, for `/metrics` (`flotilla_enrollment_attempts_total`).
#[derive(Debug, Default)]
pub struct AttemptCounts {
    /// The proof matched an unused token.
    pub accepted: AtomicU64,
    /// The proof matched no unused token.
    pub failed: AtomicU64,
    /// Not checked (yet): over the attempt limits.
    pub limited: AtomicU64,
}

impl AttemptCounts {
    pub fn get(&self) -> [(&'static str, u64); 3] {
        [
            ("accepted", self.accepted.load(Ordering::Relaxed)),
            ("failed", self.failed.load(Ordering::Relaxed)),
            ("limited", self.limited.load(Ordering::Relaxed)),
        ]
    }
}

/// The enrollment attempt limits: all devices together, and each device id.
#[derive(Debug)]
pub struct Attempts {
    global_rate: Rate,
    device_rate: Rate,
    global: Option<Bucket>,
    /// Only devices that attempted lately: a bucket that is full again is forgotten.
    devices: HashMap<String, Bucket>,
    pub counts: Arc<AttemptCounts>,
}

impl Attempts {
    pub fn new(per_second: u32, device_per_minute: u32) -> Attempts {
        Attempts {
            global_rate: Rate::per_second(per_second, 10),
            device_rate: Rate::per_minute(device_per_minute, DEVICE_ATTEMPT_BURST),
            global: None,
            devices: HashMap::new(),
            counts: Arc::default(),
        }
    }

    fn global(&mut self, now: u64) -> &mut Bucket {
        let rate = self.global_rate;
        self.global.get_or_insert_with(|| Bucket::full(&rate, now))
    }

    /// Whether an attempt of any device could be checked now.
    pub fn has_room(&mut self, now: u64) -> bool {
        let rate = self.global_rate;
        self.global(now).ready(&rate, now)
    }

    /// Whether a held-back attempt may be checked now: only while more than half a second's
    /// worth is left, so fresh attempts (a device that just came up) keep the other half
    /// however many wait.
    pub fn has_spare(&mut self, now: u64) -> bool {
        let rate = self.global_rate;
        self.global(now).tokens(&rate, now) > rate.count / 2
    }

    pub fn device_ready(&mut self, device: &str, now: u64) -> bool {
        let rate = self.device_rate;
        self.devices
            .get_mut(device)
            .is_none_or(|b| b.ready(&rate, now))
    }

    /// Takes an attempt for `device` if both limits allow it; counts it as limited if not.
    pub fn admit(&mut self, device: &str, now: u64) -> bool {
        if !self.device_ready(device, now) || !self.has_room(now) {
            self.counts.limited.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let (global_rate, device_rate) = (self.global_rate, self.device_rate);
        self.global(now).take(&global_rate, now);
        // Live buckets are bounded by the global rate times a device bucket's refill time;
        // forget the full ones before the map grows past twice that.
        let live = global_rate.burst + global_rate.count * device_rate.refill_seconds();
        if self.devices.len() as u64 >= 2 * live {
            self.devices.retain(|_, b| !b.is_full(&device_rate, now));
        }
        self.devices
            .entry(device.to_owned())
            .or_insert_with(|| Bucket::full(&device_rate, now))
            .take(&device_rate, now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_usual_tools_make_passes_and_made_up_tokens_do_not() {
        for strong in [
            new_token().as_str(),
            "3f9c2a7e1b5d48c06a9e7f21d4c3b8a5",
            "q3Vb1y0kQ0mC2w8dXr5nRg==",
        ] {
            let bits = token_strength(strong).unwrap_or_else(|e| panic!("{strong}: {e}"));
            assert!(bits >= TOKEN_MIN_BITS, "{strong}: {bits}");
        }
        for (weak, why) in [
            ("hunter22", "about 41 bits"),
            ("0123456789abcdef", "about 64 bits"),
            (
                "service-test-token",
                "18 characters of 59 kinds, about 105 bits",
            ),
            ("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "more than half"),
            (
                "0123456789abcdef0123456789abcdef",
                "a pattern of 16 characters",
            ),
        ] {
            let err = token_strength(weak).expect_err(weak);
            assert!(err.contains(why), "{weak}: {err}");
        }
    }
}
