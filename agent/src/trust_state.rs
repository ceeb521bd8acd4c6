//! The trust state ([`TrustState`]) and the trust file `<data_dir>/trust` that holds it,
//! mirrored in sled: the installed release counter, the last trusted time, the last accepted
//! action's issue time and the keys of the last accepted keys document. [`crate::trust`]
//! explains what each one guards against, and re-exports everything here.
//!
//! Split from `trust` for the module layers: the store mirrors this state, so it sits below the
//! store, while `trust::install_keys` opens the store and sits above it.

use std::path::{Path, PathBuf};

use flotilla_protocol::{hex, KeyRing, UnixTime, VerifyingKey};
use serde::{Deserialize, Serialize};

use crate::config::TrustConfig;

/// What the trust file holds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrustState {
    /// Counter of the installed release; only higher counters are installed.
    pub installed_counter: u64,
    /// The latest time the agent has trusted; the clock never goes back before it.
    pub last_trusted_time: UnixTime,
    /// Issue time of the last accepted action; older actions are refused as replays.
    pub last_action_issued_at: UnixTime,
    /// The keys of the last accepted keys document; `None`: the configured keys.
    pub keys: Option<StoredKeys>,
}

/// An accepted key ring as the trust file keeps it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredKeys {
    pub version: u64,
    pub release_keys: Vec<[u8; 32]>,
    pub coordinator_keys: Vec<[u8; 32]>,
    pub root_keys: Vec<[u8; 32]>,
    pub root_threshold: u32,
}

impl StoredKeys {
    pub fn from_ring(ring: &KeyRing) -> Self {
        let bytes = |keys: &[VerifyingKey]| keys.iter().map(|k| k.to_bytes()).collect();
        StoredKeys {
            version: ring.version,
            release_keys: bytes(&ring.release_keys),
            coordinator_keys: bytes(&ring.coordinator_keys),
            root_keys: bytes(&ring.root_keys),
            root_threshold: ring.root_threshold,
        }
    }
}

/// The configured keys, as the key ring of version 0.
pub fn configured_ring(config: &TrustConfig) -> KeyRing {
    KeyRing {
        version: 0,
        release_keys: config.release_keys.clone(),
        coordinator_keys: config.coordinator_keys.clone(),
        root_keys: config.root_keys.clone(),
        root_threshold: config.root_threshold,
    }
}

impl TrustState {
    /// `max(system time, last trusted time)`, where trusted time counts only up to `skew`
    /// ahead of the system clock: time trusted from a coordinator whose clock had jumped ahead
    /// (before the bound existed) must not make every later action look expired.
    pub fn now(&self, system: UnixTime, skew: Option<u64>) -> UnixTime {
        system.max(capped(self.last_trusted_time, system, skew))
    }

    /// The issue time of the last accepted action, counted only up to `skew` ahead of the
    /// system clock, for the same reason as [`TrustState::now`].
    pub fn last_accepted(&self, system: UnixTime, skew: Option<u64>) -> UnixTime {
        capped(self.last_action_issued_at, system, skew)
    }

    /// The keys trusted now: the last accepted keys document's, else the configured ones.
    pub fn ring(&self, config: &TrustConfig) -> KeyRing {
        let Some(stored) = &self.keys else {
            return configured_ring(config);
        };
        // Keys are validated before they are stored; one that no longer parses (a hand-edited
        // file) is left out rather than trusted or allowed to stop the agent.
        let parse = |keys: &[[u8; 32]]| -> Vec<VerifyingKey> {
            keys.iter()
                .filter_map(|k| match VerifyingKey::from_bytes(k) {
                    Ok(key) => Some(key),
                    Err(_) => {
                        tracing::warn!("trust file: ignoring invalid key {}", hex::encode(k));
                        None
                    }
                })
                .collect()
        };
        KeyRing {
            version: stored.version,
            release_keys: parse(&stored.release_keys),
            coordinator_keys: parse(&stored.coordinator_keys),
            root_keys: parse(&stored.root_keys),
            root_threshold: stored.root_threshold,
        }
    }

    /// Records an accepted action's issue time: it becomes trusted time, and older actions are
    /// refused from now on. Returns whether anything changed.
    pub fn accept_action_at(&mut self, issued_at: UnixTime) -> bool {
        let before = (self.last_trusted_time, self.last_action_issued_at);
        self.last_trusted_time = self.last_trusted_time.max(issued_at);
        self.last_action_issued_at = self.last_action_issued_at.max(issued_at);
        before != (self.last_trusted_time, self.last_action_issued_at)
    }

    /// The stricter of two states, field by field: the file and sled can disagree after a
    /// crash between their writes (or one of them was lost), and the safe answer is the
    /// higher counter, the later times and the newer keys.
    pub fn merge(self, other: TrustState) -> TrustState {
        let version = |k: &Option<StoredKeys>| k.as_ref().map_or(0, |k| k.version);
        let keys = if version(&other.keys) > version(&self.keys) {
            other.keys
        } else {
            self.keys
        };
        TrustState {
            installed_counter: self.installed_counter.max(other.installed_counter),
            last_trusted_time: self.last_trusted_time.max(other.last_trusted_time),
            last_action_issued_at: self.last_action_issued_at.max(other.last_action_issued_at),
            keys,
        }
    }

    /// Text form of the trust file: `key = value` lines, readable by an operator. Keys of an
    /// accepted keys document follow as one `*_key = <hex>` line per key.
    pub fn to_text(&self) -> String {
        let mut out = format!(
            "installed_counter = {}\nlast_trusted_time = {}\nlast_action_issued_at = {}\n",
            self.installed_counter, self.last_trusted_time, self.last_action_issued_at
        );
        if let Some(k) = &self.keys {
            out.push_str(&format!(
                "keys_version = {}\nroot_threshold = {}\n",
                k.version, k.root_threshold
            ));
            for (name, keys) in [
                ("root_key", &k.root_keys),
                ("release_key", &k.release_keys),
                ("coordinator_key", &k.coordinator_keys),
            ] {
                for key in keys {
                    out.push_str(&format!("{name} = {}\n", hex::encode(key)));
                }
            }
        }
        out
    }

    /// Parses the trust file; the error names the first bad line.
    pub fn from_text(text: &str) -> Result<TrustState, String> {
        let mut state = TrustState::default();
        let mut keys = StoredKeys::default();
        let mut keys_version = None;
        let mut has_keys = false;
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let (key, value) = line
                .split_once('=')
                .ok_or_else(|| format!("line {line:?} is not key = value"))?;
            let (key, value) = (key.trim(), value.trim());
            let number = || -> Result<u64, String> {
                value
                    .parse()
                    .map_err(|_| format!("line {line:?}: value is not a number"))
            };
            let public_key = || -> Result<[u8; 32], String> {
                hex::decode_array::<32>(value).map_err(|e| format!("line {line:?}: {e}"))
            };
            match key {
                "installed_counter" => state.installed_counter = number()?,
                "last_trusted_time" => state.last_trusted_time = number()?,
                "last_action_issued_at" => state.last_action_issued_at = number()?,
                "keys_version" => keys_version = Some(number()?),
                "root_threshold" => {
                    keys.root_threshold = u32::try_from(number()?)
                        .map_err(|_| format!("line {line:?}: value is too large"))?;
                }
                "root_key" => keys.root_keys.push(public_key()?),
                "release_key" => keys.release_keys.push(public_key()?),
                "coordinator_key" => keys.coordinator_keys.push(public_key()?),
                other => return Err(format!("unknown key {other:?}")),
            }
            has_keys |= key.ends_with("_key") || key == "root_threshold";
        }
        match keys_version {
            Some(version) => {
                keys.version = version;
                state.keys = Some(keys);
            }
            None if has_keys => return Err("key lines without a keys_version line".into()),
            None => {}
        }
        Ok(state)
    }
}

/// `time`, but at most `skew` past `system` (no bound without a skew).
fn capped(time: UnixTime, system: UnixTime, skew: Option<u64>) -> UnixTime {
    match skew {
        Some(skew) => time.min(system.saturating_add(skew)),
        None => time,
    }
}

/// Path of the trust file.
pub fn trust_file(data_dir: &Path) -> PathBuf {
    data_dir.join("trust")
}

/// Reads the trust file; a missing file is the empty state, a damaged one is logged and read as
/// empty (sled's mirror still holds the values, and the two are merged).
pub fn read_trust_file(data_dir: &Path) -> TrustState {
    let path = trust_file(data_dir);
    match std::fs::read_to_string(&path) {
        Ok(text) => TrustState::from_text(&text).unwrap_or_else(|e| {
            tracing::warn!(
                "trust file {} is damaged ({e}); using the database's copy",
                path.display()
            );
            TrustState::default()
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => TrustState::default(),
        Err(e) => {
            tracing::warn!(
                "cannot read trust file {}: {e}; using the database's copy",
                path.display()
            );
            TrustState::default()
        }
    }
}

/// Writes the trust file atomically (temp file, fsync, rename, fsync the directory).
pub fn write_trust_file(data_dir: &Path, state: &TrustState) -> std::io::Result<()> {
    flotilla_targets::fs::atomic_write(trust_file(data_dir), state.to_text())
}

/// Seconds since the Unix epoch from the system clock (0 if the clock is before 1970).
pub fn system_now() -> UnixTime {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use flotilla_protocol::SigningKey;

    fn key(seed: u8) -> SigningKey {
        SigningKey::from_bytes(&[seed; 32])
    }

    #[test]
    fn clock_never_goes_back() {
        let t = TrustState {
            installed_counter: 1,
            last_trusted_time: 1_000,
            ..TrustState::default()
        };
        assert_eq!(t.now(500, None), 1_000);
        assert_eq!(t.now(2_000, None), 2_000);
        assert_eq!(t.now(500, Some(3600)), 1_000, "within the skew");
    }

    /// issue 10, case 5: time trusted from a coordinator whose clock was 30 days ahead (accepted
    /// before the bound existed) counts only up to the skew past the device's own clock, so the
    /// device does not take every later action for expired or replayed.
    #[test]
    fn trusted_time_far_ahead_of_the_device_clock_counts_only_up_to_the_skew() {
        let month = 30 * 86_400;
        let t = TrustState {
            last_trusted_time: 1_000 + month,
            last_action_issued_at: 1_000 + month,
            ..TrustState::default()
        };
        assert_eq!(t.now(1_000, Some(3600)), 4_600);
        assert_eq!(t.last_accepted(1_000, Some(3600)), 4_600);
        assert_eq!(
            t.now(1_000, None),
            1_000 + month,
            "\"off\" keeps the old rule"
        );
    }

    #[test]
    fn trust_file_round_trips() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(read_trust_file(dir.path()), TrustState::default());
        let t = TrustState {
            installed_counter: 7,
            last_trusted_time: 1234,
            last_action_issued_at: 1200,
            keys: Some(rotated_keys(3)),
        };
        write_trust_file(dir.path(), &t).expect("write");
        assert_eq!(read_trust_file(dir.path()), t);
        let other = TrustState {
            installed_counter: 9,
            last_trusted_time: 5,
            last_action_issued_at: 1300,
            keys: Some(rotated_keys(2)),
        };
        assert_eq!(
            t.clone().merge(other.clone()),
            TrustState {
                installed_counter: 9,
                last_trusted_time: 1234,
                last_action_issued_at: 1300,
                keys: Some(rotated_keys(3)),
            },
            "the newer keys win, whichever copy holds them"
        );
        assert_eq!(other.merge(t).keys, Some(rotated_keys(3)));
    }

    /// Keys as a keys document of `version` would leave them: coordinator key 3, roots 4 and 5.
    pub(crate) fn rotated_keys(version: u64) -> StoredKeys {
        StoredKeys {
            version,
            release_keys: vec![key(1).verifying_key().to_bytes()],
            coordinator_keys: vec![key(3).verifying_key().to_bytes()],
            root_keys: vec![
                key(4).verifying_key().to_bytes(),
                key(5).verifying_key().to_bytes(),
            ],
            root_threshold: 2,
        }
    }

    #[test]
    fn older_trust_files_still_read_and_damaged_key_lines_are_named() {
        // A trust file written before replays and rotation were tracked.
        let old = TrustState::from_text("installed_counter = 4\nlast_trusted_time = 99\n")
            .expect("reads");
        assert_eq!(
            old,
            TrustState {
                installed_counter: 4,
                last_trusted_time: 99,
                ..TrustState::default()
            }
        );
        assert_eq!(
            TrustState::from_text("coordinator_key = 00\n").expect_err("bad key"),
            "line \"coordinator_key = 00\": expected 64 hex digits, found 2"
        );
        assert_eq!(
            TrustState::from_text(&format!(
                "coordinator_key = {}\n",
                hex::encode(key(3).verifying_key().as_bytes())
            ))
            .expect_err("no version"),
            "key lines without a keys_version line"
        );
    }
}
