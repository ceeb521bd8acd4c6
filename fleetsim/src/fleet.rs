//! Who the simulated devices are and how each behaves: ids, keys, the authorized keys file, which
//! devices stay offline or fail, and the phases an action goes through. Pure: no I/O, no clock.
//!
//! Everything is derived from the seed and the device id, so two runs with the same seed play the
//! same fleet (the same keys, the same offline devices, the same failures), and a keys file
//! written by one run matches the devices of the next.

use flotilla_protocol::{Phase, SigningKey};

/// A range of simulated devices: `{prefix}{index}` for index in `first..first + count`, the
/// index zero-padded to `width` digits so ids sort like their indexes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fleet {
    pub prefix: String,
    pub first: u64,
    pub count: u64,
    pub width: usize,
    pub seed: String,
}

/// Why a fleet range is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FleetError {
    #[error("--count: must be at least 1")]
    Empty,
    #[error("--first/--count: the last index {last} has more than --id-width {width} digits")]
    TooWide { last: u64, width: usize },
    #[error("--id-prefix {prefix:?}: device ids made from it are not valid: {reason}")]
    BadPrefix { prefix: String, reason: String },
}

impl Fleet {
    pub fn new(
        prefix: &str,
        first: u64,
        count: u64,
        width: usize,
        seed: &str,
    ) -> Result<Fleet, FleetError> {
        if count == 0 {
            return Err(FleetError::Empty);
        }
        let last = first.saturating_add(count - 1);
        if last.to_string().len() > width {
            return Err(FleetError::TooWide { last, width });
        }
        let fleet = Fleet {
            prefix: prefix.to_owned(),
            first,
            count,
            width,
            seed: seed.to_owned(),
        };
        flotilla_protocol::validate_id("device id", &fleet.id(0)).map_err(|e| {
            FleetError::BadPrefix {
                prefix: prefix.to_owned(),
                reason: e.to_string(),
            }
        })?;
        Ok(fleet)
    }

    /// The id of the device in slot `slot` (0-based within the range).
    pub fn id(&self, slot: usize) -> String {
        format!(
            "{}{:0width$}",
            self.prefix,
            self.first + slot as u64,
            width = self.width
        )
    }

    /// The slot of `id` if it belongs to this range (other simulators' devices and real ones
    /// share the broker).
    pub fn slot(&self, id: &str) -> Option<usize> {
        let digits = id.strip_prefix(self.prefix.as_str())?;
        if digits.len() != self.width || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let index: u64 = digits.parse().ok()?;
        let slot = index.checked_sub(self.first)?;
        (slot < self.count).then_some(slot as usize)
    }

    pub fn len(&self) -> usize {
        self.count as usize
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The device's ed25519 key: sha256 over a domain tag, the seed and the id.
    pub fn key(&self, slot: usize) -> SigningKey {
        SigningKey::from_bytes(&self.digest("key", &self.id(slot), ""))
    }

    /// The coordinator's `[enrollment] authorized_keys` file for this range: one
    /// `<public key hex> <device id>` line per device.
    pub fn authorized_keys(&self) -> String {
        let mut text = format!(
            "# flotilla-fleetsim: {} devices {}..{} (seed {:?})\n",
            self.count,
            self.id(0),
            self.id(self.len() - 1),
            self.seed
        );
        for slot in 0..self.len() {
            let key = self.key(slot).verifying_key();
            text.push_str(&flotilla_protocol::hex::encode(key.as_bytes()));
            text.push(' ');
            text.push_str(&self.id(slot));
            text.push('\n');
        }
        text
    }

    /// Whether the device plays an offline one: its state says `online: false` and it ignores
    /// desired actions. `share` of the devices, chosen by the seed.
    pub fn is_offline(&self, slot: usize, share: f64) -> bool {
        share > 0.0 && self.unit("offline", &self.id(slot), "") < share
    }

    /// Whether the device fails this action (after activating, rolled back). `rate` of the
    /// actions, chosen by the seed, the device and the action id.
    pub fn fails(&self, slot: usize, action_id: &str, rate: f64) -> bool {
        rate > 0.0 && self.unit("fail", &self.id(slot), action_id) < rate
    }

    fn digest(&self, what: &str, id: &str, extra: &str) -> [u8; 32] {
        let mut bytes = Vec::with_capacity(64 + id.len() + extra.len());
        bytes.extend_from_slice(b"flotilla-fleetsim v1\0");
        for part in [what, self.seed.as_str(), id, extra] {
            bytes.extend_from_slice(&(part.len() as u64).to_le_bytes());
            bytes.extend_from_slice(part.as_bytes());
        }
        flotilla_protocol::sha256(&bytes)
    }

    /// A number in [0, 1) fixed by the seed and the parts.
    fn unit(&self, what: &str, id: &str, extra: &str) -> f64 {
        let d = self.digest(what, id, extra);
        let mut first = [0u8; 8];
        first.copy_from_slice(&d[..8]);
        (u64::from_le_bytes(first) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Which reports a device sends for an install.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Phases {
    /// What the agent reports for a forced install with health checks: accepted, downloading,
    /// verified, staged, activated, confirming, ready.
    Agent,
    /// Accepted and the final phase only.
    Short,
}

/// The phases of one install, in order; the last is terminal. A failing device fails after
/// activating, rolled back, as the agent does when its health checks fail.
pub fn install_phases(phases: Phases, total: u64, fails: bool) -> Vec<Phase> {
    let last = if fails {
        Phase::Failed {
            reason: "simulated failure (flotilla-fleetsim --fail-rate)".into(),
            rolled_back: true,
        }
    } else {
        Phase::Ready
    };
    match phases {
        Phases::Short => vec![Phase::Accepted, last],
        Phases::Agent => {
            let mut out = vec![
                Phase::Accepted,
                Phase::Downloading { done: total, total },
                Phase::Verified,
                Phase::Staged,
                Phase::Activated,
            ];
            if !fails {
                out.push(Phase::Confirming);
            }
            out.push(last);
            out
        }
    }
}

/// Percentile `p` (0..=100) of sorted values, nearest rank; `None` when empty.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet() -> Fleet {
        Fleet::new("sim-", 10, 5, 6, "s").expect("fleet")
    }

    #[test]
    fn ids_sort_like_indexes_and_map_back_to_their_slot() {
        let f = fleet();
        assert_eq!(f.id(0), "sim-000010");
        assert_eq!(f.id(4), "sim-000014");
        assert_eq!(f.slot("sim-000012"), Some(2));
        // Another simulator's range, another prefix, a malformed id: not ours.
        assert_eq!(f.slot("sim-000015"), None);
        assert_eq!(f.slot("sim-000009"), None);
        assert_eq!(f.slot("dev-000012"), None);
        assert_eq!(f.slot("sim-12"), None);
        assert_eq!(f.slot("sim-00001x"), None);
    }

    #[test]
    fn bad_ranges_name_the_flag() {
        assert_eq!(Fleet::new("sim-", 0, 0, 6, "s"), Err(FleetError::Empty));
        let err = Fleet::new("sim-", 999_999, 2, 6, "s").expect_err("too wide");
        assert!(err.to_string().contains("--id-width 6"), "{err}");
        let err = Fleet::new("a/b-", 0, 1, 6, "s").expect_err("bad prefix");
        assert!(err.to_string().starts_with("--id-prefix"), "{err}");
    }

    #[test]
    fn keys_are_repeatable_per_seed_and_differ_per_device() {
        let f = fleet();
        assert_eq!(f.key(1).to_bytes(), fleet().key(1).to_bytes());
        assert_ne!(f.key(1).to_bytes(), f.key(2).to_bytes());
        let other = Fleet::new("sim-", 10, 5, 6, "t").expect("fleet");
        assert_ne!(f.key(1).to_bytes(), other.key(1).to_bytes());
        // The same device in an overlapping range has the same key.
        let wider = Fleet::new("sim-", 0, 20, 6, "s").expect("fleet");
        assert_eq!(f.key(0).to_bytes(), wider.key(10).to_bytes());
    }

    #[test]
    fn authorized_keys_lists_every_device_with_its_key() {
        let f = fleet();
        let text = f.authorized_keys();
        let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(lines.len(), 5);
        let expected = format!(
            "{} sim-000013",
            flotilla_protocol::hex::encode(f.key(3).verifying_key().as_bytes())
        );
        assert_eq!(lines[3], expected);
    }

    #[test]
    fn offline_share_and_failure_rate_pick_about_that_many() {
        let f = Fleet::new("sim-", 0, 10_000, 6, "s").expect("fleet");
        let offline = (0..f.len()).filter(|&s| f.is_offline(s, 0.1)).count();
        assert!((800..1200).contains(&offline), "{offline}");
        let failing = (0..f.len()).filter(|&s| f.fails(s, "a-1", 0.05)).count();
        assert!((350..650).contains(&failing), "{failing}");
        assert_eq!((0..f.len()).filter(|&s| f.is_offline(s, 0.0)).count(), 0);
        assert_eq!(
            (0..f.len()).filter(|&s| f.fails(s, "a", 1.0)).count(),
            10_000
        );
    }

    #[test]
    fn install_phases_end_in_ready_or_a_rolled_back_failure() {
        let ok = install_phases(Phases::Agent, 7, false);
        let names: Vec<&str> = ok.iter().map(Phase::name).collect();
        assert_eq!(
            names,
            [
                "accepted",
                "downloading",
                "verified",
                "staged",
                "activated",
                "confirming",
                "ready"
            ]
        );
        let failed = install_phases(Phases::Agent, 7, true);
        assert!(matches!(
            failed.last(),
            Some(Phase::Failed {
                rolled_back: true,
                ..
            })
        ));
        assert!(failed.iter().filter(|p| p.is_terminal()).count() == 1);
        assert_eq!(install_phases(Phases::Short, 7, false).len(), 2);
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&[3.0], 99.0), Some(3.0));
        assert_eq!(percentile(&[], 50.0), None);
    }
}
