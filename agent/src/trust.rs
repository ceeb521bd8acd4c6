//! Trust checks: whether a desired action and the release it carries may be acted on at all.
//!
//! The broker is shared infrastructure, so nothing is trusted because of the topic it came on.
//! Every check here is a pure function that returns a [`Refusal`] with a reason an operator can
//! act on ("action is for device dev-2, this is dev-1"); a refused action applies nothing.
//!
//! Also here: the trust file `<data_dir>/trust`, holding the installed release counter and the
//! last trusted time, written atomically and mirrored in sled. The agent's notion of "now" is
//! `max(system clock, last trusted time)`, so a clock that jumps back cannot bring an expired
//! action back to life.

use std::path::{Path, PathBuf};

use flotilla_protocol::{
    envelope, hex, ActionBody, DesiredAction, ReleaseManifest, SignedBlob, UnixTime, VerifyingKey,
};
use serde::{Deserialize, Serialize};

use crate::config::Config;

/// Why an action was refused. The text goes into `Phase::Refused { reason }`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal(pub String);

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Verifies the coordinator's signature over the exact bytes received, then decodes them.
pub fn verify_desired(
    blob: &SignedBlob,
    coordinator_keys: &[VerifyingKey],
) -> Result<DesiredAction, Refusal> {
    let bytes = blob
        .verify("desired action", coordinator_keys)
        .map_err(|e| Refusal(e.to_string()))?;
    envelope::from_bytes("desired action", bytes).map_err(|e| Refusal(e.to_string()))
}

/// Checks that a verified action is for this device and has not expired.
pub fn check_action(action: &DesiredAction, device_id: &str, now: UnixTime) -> Result<(), Refusal> {
    if action.device_id != device_id {
        return Err(Refusal(format!(
            "action is for device {}, this is {device_id}",
            action.device_id
        )));
    }
    if action.expires_at <= now {
        return Err(Refusal(format!("action expired at {}", action.expires_at)));
    }
    Ok(())
}

/// Everything the release checks need to know about this device.
#[derive(Debug, Clone, Copy)]
pub struct DeviceFacts<'a> {
    pub hardware_id: &'a str,
    pub installed_counter: u64,
    pub now: UnixTime,
    pub release_keys: &'a [VerifyingKey],
    pub config: &'a Config,
}

/// Verifies a release manifest (signature by a trusted release key, expiry, hardware, counter,
/// a configured target for every artifact) and returns it decoded.
pub fn check_manifest(
    blob: &SignedBlob,
    facts: &DeviceFacts<'_>,
) -> Result<ReleaseManifest, Refusal> {
    let bytes = blob
        .verify("release manifest", facts.release_keys)
        .map_err(|e| Refusal(e.to_string()))?;
    let manifest: ReleaseManifest =
        envelope::from_bytes("release manifest", bytes).map_err(|e| Refusal(e.to_string()))?;
    if manifest.expires_at <= facts.now {
        return Err(Refusal(format!(
            "release {} expired at {}",
            manifest.name, manifest.expires_at
        )));
    }
    if !manifest.hardware.is_empty() && !manifest.hardware.iter().any(|h| h == facts.hardware_id) {
        return Err(Refusal(format!(
            "release {} is for hardware {}, this is {}",
            manifest.name,
            manifest.hardware.join(", "),
            facts.hardware_id
        )));
    }
    if manifest.counter <= facts.installed_counter {
        return Err(Refusal(format!(
            "release counter {} is not higher than installed {}",
            manifest.counter, facts.installed_counter
        )));
    }
    if manifest.artifacts.is_empty() {
        return Err(Refusal(format!(
            "release {} has no artifacts",
            manifest.name
        )));
    }
    for a in &manifest.artifacts {
        if facts.config.target(&a.target).is_none() {
            return Err(Refusal(format!(
                "artifact {}: no target named {:?} is configured on this device",
                a.name, a.target
            )));
        }
    }
    Ok(manifest)
}

/// Runs every check on a signed desired action. `Ok` carries the action and, for installs, the
/// verified manifest.
pub fn check_all(
    blob: &SignedBlob,
    config: &Config,
    installed_counter: u64,
    now: UnixTime,
) -> Result<(DesiredAction, Option<ReleaseManifest>), Refusal> {
    let action = verify_desired(blob, &config.trust.coordinator_keys)?;
    check_action(&action, config.device_id.as_str(), now)?;
    let manifest = match &action.body {
        ActionBody::Install { manifest, .. } => Some(check_manifest(
            manifest,
            &DeviceFacts {
                hardware_id: &config.hardware_id,
                installed_counter,
                now,
                release_keys: &config.trust.release_keys,
                config,
            },
        )?),
        _ => None,
    };
    Ok((action, manifest))
}

/// The sha256 comparison at the end of a download, worded for the report.
pub fn check_digest(artifact: &str, expected: &[u8; 32], got: &[u8; 32]) -> Result<(), Refusal> {
    if expected == got {
        Ok(())
    } else {
        Err(Refusal(format!(
            "artifact {artifact}: sha256 mismatch (expected {}, got {})",
            hex::encode(expected),
            hex::encode(got)
        )))
    }
}

/// What the trust file holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrustState {
    /// Counter of the installed release; only higher counters are installed.
    pub installed_counter: u64,
    /// The latest time the agent has trusted; the clock never goes back before it.
    pub last_trusted_time: UnixTime,
}

impl TrustState {
    /// `max(system time, last trusted time)`.
    pub fn now(&self, system: UnixTime) -> UnixTime {
        system.max(self.last_trusted_time)
    }

    /// The higher of two states, field by field: the file and sled can disagree after a crash
    /// between their writes, and the safe answer is the stricter one.
    pub fn merge(self, other: TrustState) -> TrustState {
        TrustState {
            installed_counter: self.installed_counter.max(other.installed_counter),
            last_trusted_time: self.last_trusted_time.max(other.last_trusted_time),
        }
    }

    /// Text form of the trust file: two `key = value` lines, readable by an operator.
    pub fn to_text(&self) -> String {
        format!(
            "installed_counter = {}\nlast_trusted_time = {}\n",
            self.installed_counter, self.last_trusted_time
        )
    }

    /// Parses the trust file; `None` names the first bad line.
    pub fn from_text(text: &str) -> Result<TrustState, String> {
        let mut state = TrustState::default();
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let (key, value) = line
                .split_once('=')
                .ok_or_else(|| format!("line {line:?} is not key = value"))?;
            let value: u64 = value
                .trim()
                .parse()
                .map_err(|_| format!("line {line:?}: value is not a number"))?;
            match key.trim() {
                "installed_counter" => state.installed_counter = value,
                "last_trusted_time" => state.last_trusted_time = value,
                other => return Err(format!("unknown key {other:?}")),
            }
        }
        Ok(state)
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
    use flotilla_protocol::{ActionKind, Artifact, SigningKey};

    pub(crate) fn key(seed: u8) -> SigningKey {
        SigningKey::from_bytes(&[seed; 32])
    }

    pub(crate) fn config() -> Config {
        let text = crate::config::DEFAULT_CONFIG
            .replacen(
                "release_keys = [\"0000000000000000000000000000000000000000000000000000000000000000\"]",
                &format!("release_keys = [\"{}\"]", hex::encode(key(1).verifying_key().as_bytes())),
                1,
            )
            .replacen(
                "coordinator_keys = [\"0000000000000000000000000000000000000000000000000000000000000000\"]",
                &format!("coordinator_keys = [\"{}\"]", hex::encode(key(2).verifying_key().as_bytes())),
                1,
            );
        Config::from_toml(&text).expect("test config")
    }

    pub(crate) fn manifest(counter: u64) -> ReleaseManifest {
        ReleaseManifest {
            name: "app-2".into(),
            version: "2.0".into(),
            counter,
            hardware: vec!["pi4".into()],
            artifacts: vec![Artifact {
                name: "app.bin".into(),
                target: "app".into(),
                size: 3,
                sha256: flotilla_protocol::sha256(b"abc"),
            }],
            created_at: 10,
            expires_at: 1_000,
        }
    }

    pub(crate) fn desired(
        device: &str,
        expires_at: u64,
        manifest: &ReleaseManifest,
        release_key: &SigningKey,
    ) -> DesiredAction {
        DesiredAction {
            action_id: "act-1".into(),
            device_id: device.into(),
            rollout_id: "r1".into(),
            issued_at: 10,
            expires_at,
            body: ActionBody::Install {
                manifest: SignedBlob::sign(release_key, envelope::to_bytes(manifest)),
                kind: ActionKind::Forced,
                window: None,
            },
        }
    }

    fn sign(action: &DesiredAction, k: &SigningKey) -> SignedBlob {
        SignedBlob::sign(k, envelope::to_bytes(action))
    }

    fn refusal(blob: &SignedBlob, installed: u64) -> String {
        check_all(blob, &config(), installed, 100)
            .expect_err("refused")
            .0
    }

    #[test]
    fn good_action_passes() {
        let blob = sign(&desired("dev-1", 500, &manifest(5), &key(1)), &key(2));
        let (action, manifest) = check_all(&blob, &config(), 4, 100).expect("accepted");
        assert_eq!(action.action_id, "act-1");
        assert_eq!(manifest.map(|m| m.counter), Some(5));
    }

    #[test]
    fn unknown_coordinator_key() {
        let blob = sign(&desired("dev-1", 500, &manifest(5), &key(1)), &key(9));
        let r = refusal(&blob, 0);
        assert!(
            r.starts_with("desired action is signed by unknown key "),
            "{r}"
        );
    }

    #[test]
    fn tampered_action() {
        let mut blob = sign(&desired("dev-1", 500, &manifest(5), &key(1)), &key(2));
        let last = blob.payload.len() - 1;
        blob.payload[last] ^= 1;
        assert!(refusal(&blob, 0).contains("signature does not verify"));
    }

    #[test]
    fn unknown_release_key() {
        let blob = sign(&desired("dev-1", 500, &manifest(5), &key(7)), &key(2));
        let r = refusal(&blob, 0);
        assert!(
            r.starts_with("release manifest is signed by unknown key "),
            "{r}"
        );
    }

    #[test]
    fn other_device() {
        let blob = sign(&desired("dev-2", 500, &manifest(5), &key(1)), &key(2));
        assert_eq!(
            refusal(&blob, 0),
            "action is for device dev-2, this is dev-1"
        );
    }

    #[test]
    fn expired_action() {
        let blob = sign(&desired("dev-1", 100, &manifest(5), &key(1)), &key(2));
        assert_eq!(refusal(&blob, 0), "action expired at 100");
    }

    #[test]
    fn lower_counter() {
        let blob = sign(&desired("dev-1", 500, &manifest(3), &key(1)), &key(2));
        assert_eq!(
            refusal(&blob, 5),
            "release counter 3 is not higher than installed 5"
        );
        assert_eq!(
            refusal(&blob, 3),
            "release counter 3 is not higher than installed 3"
        );
    }

    #[test]
    fn wrong_hardware_and_missing_target() {
        let mut m = manifest(5);
        m.hardware = vec!["x86".into()];
        let blob = sign(&desired("dev-1", 500, &m, &key(1)), &key(2));
        assert_eq!(
            refusal(&blob, 0),
            "release app-2 is for hardware x86, this is pi4"
        );
        let mut m = manifest(5);
        m.artifacts[0].target = "bootloader".into();
        let blob = sign(&desired("dev-1", 500, &m, &key(1)), &key(2));
        assert!(refusal(&blob, 0).contains("no target named \"bootloader\""));
    }

    #[test]
    fn tampered_artifact_digest() {
        let r = check_digest(
            "app.bin",
            &flotilla_protocol::sha256(b"abc"),
            &flotilla_protocol::sha256(b"abd"),
        )
        .expect_err("mismatch");
        assert!(
            r.0.starts_with("artifact app.bin: sha256 mismatch (expected ba7816bf"),
            "{r}"
        );
    }

    #[test]
    fn clock_never_goes_back() {
        let t = TrustState {
            installed_counter: 1,
            last_trusted_time: 1_000,
        };
        assert_eq!(t.now(500), 1_000);
        assert_eq!(t.now(2_000), 2_000);
    }

    #[test]
    fn trust_file_round_trips() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(read_trust_file(dir.path()), TrustState::default());
        let t = TrustState {
            installed_counter: 7,
            last_trusted_time: 1234,
        };
        write_trust_file(dir.path(), &t).expect("write");
        assert_eq!(read_trust_file(dir.path()), t);
        assert_eq!(
            t.merge(TrustState {
                installed_counter: 9,
                last_trusted_time: 5
            }),
            TrustState {
                installed_counter: 9,
                last_trusted_time: 1234
            }
        );
    }
}
