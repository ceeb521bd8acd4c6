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
//!
//! Replays: an action id already handled is never applied again (the agent loop re-reports its
//! phase instead), and an action issued before the last accepted one is refused, so a captured
//! old action cannot be published again once a newer one was accepted. The last accepted issue
//! time lives in the trust file too.
//!
//! Key rotation: the trust file also holds the keys of the last accepted keys document
//! ([`flotilla_protocol::keys`]); once present they replace the configured release,
//! coordinator and root keys. [`install_keys`] checks a keys document against the current root
//! keys and persists it (`flotilla-agent keys install`, with the agent stopped).
//!
//! The trust state and its file ([`TrustState`], [`read_trust_file`], ...) are defined in the
//! private module `trust_state` and re-exported here: the store mirrors them, so they sit below
//! the store, while [`install_keys`] opens the store and sits above it.

use std::path::{Path, PathBuf};

use flotilla_protocol::artifact_type::ArtifactType;
use flotilla_protocol::manifest::Manifest;
use flotilla_protocol::{
    envelope, hex, keys, DecodeError, DesiredAction, KeyRing, KeysError, PeerGrant,
    ReleaseManifest, SignedBlob, UnixTime, VerifyingKey,
};

use crate::config::{Config, TargetConfig, TargetKind};
use crate::store::{self, StoreError};
pub use crate::trust_state::{
    configured_ring, read_trust_file, system_now, trust_file, write_trust_file, StoredKeys,
    TrustState,
};

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
/// a configured target for every artifact) and returns it decoded, with its block indexes when
/// it has them.
pub fn check_manifest(blob: &SignedBlob, facts: &DeviceFacts<'_>) -> Result<Manifest, Refusal> {
    let decoded = verify_manifest(blob, facts.release_keys)?;
    let manifest = &decoded.release;
    check_release_expiry(manifest, facts.now)?;
    check_hardware(manifest, facts.hardware_id)?;
    if manifest.counter <= facts.installed_counter {
        return Err(Refusal(format!(
            "release counter {} is not higher than installed {}",
            manifest.counter, facts.installed_counter
        )));
    }
    check_targets(&decoded, facts.config)?;
    Ok(decoded)
}

/// Verifies a release manifest's signature by one of `release_keys`, over the exact bytes, and
/// decodes it.
pub fn verify_manifest(
    blob: &SignedBlob,
    release_keys: &[VerifyingKey],
) -> Result<Manifest, Refusal> {
    let bytes = blob
        .verify("release manifest", release_keys)
        .map_err(|e| Refusal(e.to_string()))?;
    Manifest::decode(bytes).map_err(|e| Refusal(e.to_string()))
}

/// Refuses a release that expired at or before `now`.
pub fn check_release_expiry(manifest: &ReleaseManifest, now: UnixTime) -> Result<(), Refusal> {
    if manifest.expires_at <= now {
        return Err(Refusal(format!(
            "release {} expired at {}",
            manifest.name, manifest.expires_at
        )));
    }
    Ok(())
}

/// Refuses a release that names hardware ids, none of them this device's.
pub fn check_hardware(manifest: &ReleaseManifest, hardware_id: &str) -> Result<(), Refusal> {
    if !manifest.hardware.is_empty() && !manifest.hardware.iter().any(|h| h == hardware_id) {
        return Err(Refusal(format!(
            "release {} is for hardware {}, this is {hardware_id}",
            manifest.name,
            manifest.hardware.join(", "),
        )));
    }
    Ok(())
}

/// Refuses a release without artifacts, with one for a target this device does not have, or
/// with one typed for another kind of target than the one of that name here (decision 0054).
pub fn check_targets(full: &Manifest, config: &Config) -> Result<(), Refusal> {
    let manifest = &full.release;
    if manifest.artifacts.is_empty() {
        return Err(Refusal(format!(
            "release {} has no artifacts",
            manifest.name
        )));
    }
    for (position, a) in manifest.artifacts.iter().enumerate() {
        let Some(target) = config.target(&a.target) else {
            return Err(Refusal(format!(
                "artifact {}: no target named {:?} is configured on this device",
                a.name, a.target
            )));
        };
        if let Some(ty) = full.artifact_type(position) {
            check_type(&a.name, ty, target)?;
        }
    }
    Ok(())
}

/// A typed artifact goes to a target of the kind its type names: a RAUC bundle to `rauc`, a
/// `.swu` to `swupdate`, a Mender payload to a `mender-module` target running that module. A
/// `script` target takes every type (the script decides what it installs).
fn check_type(artifact: &str, ty: &ArtifactType, target: &TargetConfig) -> Result<(), Refusal> {
    let kind = match (&target.kind, ty) {
        (TargetKind::Script(_), _)
        | (TargetKind::Rauc(_), ArtifactType::RaucBundle)
        | (TargetKind::Swupdate(_), ArtifactType::Swu) => return Ok(()),
        (TargetKind::MenderModule(m), ArtifactType::MenderModule(module)) => {
            let runs = m
                .module
                .file_name()
                .map(|n| n.to_string_lossy().into_owned());
            if runs.as_deref() == Some(module.as_str()) {
                return Ok(());
            }
            return Err(Refusal(format!(
                "artifact {artifact} is a payload for the Mender update module {module:?}, and target {:?} runs {}",
                target.name,
                m.module.display()
            )));
        }
        (TargetKind::File { .. }, _) => "file",
        (TargetKind::Ab(_), _) => "ab",
        (TargetKind::MenderModule(_), _) => "mender-module",
        (TargetKind::Swupdate(_), _) => "swupdate",
        (TargetKind::Rauc(_), _) => "rauc",
    };
    Err(Refusal(format!(
        "artifact {artifact} is of type {ty}, for a {} target; target {:?} here is of kind {kind:?}",
        ty.target_kind(),
        target.name
    )))
}

/// The block indexes of a manifest that was checked when its action was accepted (the record
/// keeps the signed bytes): `None` for a manifest without them, or bytes that no longer decode.
pub fn manifest_blocks(blob: &SignedBlob) -> Option<Manifest> {
    Manifest::decode(&blob.payload).ok()
}

/// Verifies the peer grant of an `InstallWithPeers` against the coordinator keys the device
/// trusts, and checks that it was made for this device and this action. Its expiry is the
/// peers' concern: an expired grant only means the peers refuse, and the coordinator remains.
pub fn check_grant(
    blob: &SignedBlob,
    coordinator_keys: &[VerifyingKey],
    device_id: &str,
    action_id: &str,
) -> Result<PeerGrant, Refusal> {
    let bytes = blob
        .verify("peer grant", coordinator_keys)
        .map_err(|e| Refusal(e.to_string()))?;
    let grant: PeerGrant =
        envelope::from_bytes("peer grant", bytes).map_err(|e| Refusal(e.to_string()))?;
    if grant.device_id != device_id {
        return Err(Refusal(format!(
            "peer grant is for device {}, this is {device_id}",
            grant.device_id
        )));
    }
    if grant.action_id != action_id {
        return Err(Refusal(format!(
            "peer grant is for action {}, this is {action_id}",
            grant.action_id
        )));
    }
    Ok(grant)
}

/// Refuses an action issued before the last accepted one: a replay of a captured old action.
/// The coordinator issues each device's actions at strictly increasing times (a per-device
/// sequence, decision 0011), so the same time means the same action: delivered again, or kept
/// by a device whose database was lost, where the release counter check decides.
/// The same second is allowed, since a coordinator may issue several actions within it.
pub fn check_issued(action: &DesiredAction, last_accepted: UnixTime) -> Result<(), Refusal> {
    if action.issued_at < last_accepted {
        return Err(Refusal(format!(
            "action {} issued at {}, older than the last accepted action issued at {last_accepted}",
            action.action_id, action.issued_at
        )));
    }
    Ok(())
}

/// Refuses an action issued more than `skew` seconds ahead of this device's clock: the
/// coordinator's clock (or the device's) is wrong, and trusting that time would make every later
/// action look expired or replayed.
pub fn check_not_ahead(
    action: &DesiredAction,
    system: UnixTime,
    skew: Option<u64>,
) -> Result<(), Refusal> {
    match skew {
        Some(skew) if action.issued_at > system.saturating_add(skew) => Err(Refusal(format!(
            "action {} issued at {}, {}s ahead of this device's clock ({system}), more than \
             trust.max_clock_skew ({skew}s) allows: check the coordinator's and this device's clocks",
            action.action_id,
            action.issued_at,
            action.issued_at - system
        ))),
        _ => Ok(()),
    }
}

/// The checks every verified action passes, whatever its body: for this device, not expired,
/// not issued too far ahead of this device's clock, not older than the last accepted action.
/// `system` is the device's own clock.
pub fn check_timely(
    action: &DesiredAction,
    config: &Config,
    trust: &TrustState,
    system: UnixTime,
) -> Result<(), Refusal> {
    let skew = config.trust.max_clock_skew;
    check_action(action, config.device_id.as_str(), trust.now(system, skew))?;
    check_not_ahead(action, system, skew)?;
    check_issued(action, trust.last_accepted(system, skew))
}

/// Runs every check on a signed desired action against the keys and counters in `trust`; `system`
/// is the device's own clock. `Ok` carries the action and, for installs, the verified manifest.
pub fn check_all(
    blob: &SignedBlob,
    config: &Config,
    trust: &TrustState,
    system: UnixTime,
) -> Result<(DesiredAction, Option<ReleaseManifest>), Refusal> {
    let ring = trust.ring(&config.trust);
    let action = verify_desired(blob, &ring.coordinator_keys)?;
    check_timely(&action, config, trust, system)?;
    let now = trust.now(system, config.trust.max_clock_skew);
    let manifest = match action.body.install() {
        Some(install) => {
            if let Some(grant) = install.grant {
                check_grant(
                    grant,
                    &ring.coordinator_keys,
                    config.device_id.as_str(),
                    &action.action_id,
                )?;
            }
            let checked = check_manifest(
                install.manifest,
                &DeviceFacts {
                    hardware_id: &config.hardware_id,
                    installed_counter: trust.installed_counter,
                    now,
                    release_keys: &ring.release_keys,
                    config,
                },
            )?;
            Some(checked.release)
        }
        None => None,
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

/// Why `flotilla-agent keys install` did not install a keys document. Nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum InstallKeysError {
    #[error("cannot read keys file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("keys file {path}: {source}")]
    Decode { path: PathBuf, source: DecodeError },
    #[error("keys file {path} refused: {source}")]
    Refused { path: PathBuf, source: KeysError },
    #[error("cannot open the agent's state (stop the agent before installing keys): {0}")]
    Open(#[source] StoreError),
    #[error("cannot write trust file {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Installs a signed keys document from `file`: it must be signed by enough of the device's
/// current root keys and be newer than the keys it has. The accepted keys are written to the
/// trust file (atomically) and its mirror in the database, and the agent uses them from its
/// next start. The agent must be stopped (its database is locked while it runs).
pub fn install_keys(config: &Config, file: &Path) -> Result<KeyRing, InstallKeysError> {
    let bytes = std::fs::read(file).map_err(|source| InstallKeysError::Read {
        path: file.to_owned(),
        source,
    })?;
    let signed = keys::decode_file(&bytes).map_err(|source| InstallKeysError::Decode {
        path: file.to_owned(),
        source,
    })?;
    let (store, mut state, _) = store::open_data_dir(config).map_err(InstallKeysError::Open)?;
    let ring = state
        .ring(&config.trust)
        .accept(&signed)
        .map_err(|source| InstallKeysError::Refused {
            path: file.to_owned(),
            source,
        })?;
    state.keys = Some(StoredKeys::from_ring(&ring));
    write_trust_file(&config.data_dir, &state).map_err(|source| InstallKeysError::Write {
        path: trust_file(&config.data_dir),
        source,
    })?;
    store.set_trust(&state)?;
    Ok(ring)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::trust_state::tests::rotated_keys;
    use flotilla_protocol::{ActionBody, ActionKind, Artifact, SigningKey};

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

    fn installed(counter: u64) -> TrustState {
        TrustState {
            installed_counter: counter,
            ..TrustState::default()
        }
    }

    fn refusal(blob: &SignedBlob, counter: u64) -> String {
        check_all(blob, &config(), &installed(counter), 100)
            .expect_err("refused")
            .0
    }

    #[test]
    fn good_action_passes() {
        let blob = sign(&desired("dev-1", 500, &manifest(5), &key(1)), &key(2));
        let (action, manifest) = check_all(&blob, &config(), &installed(4), 100).expect("accepted");
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
    fn a_typed_artifact_goes_only_to_a_target_of_its_kind() {
        use flotilla_targets::{MenderModuleConfig, RaucConfig, ScriptConfig, SwupdateConfig};
        let dir = std::path::PathBuf::from("/var/lib/flotilla-agent/targets/x");
        let mender = |module: &str| MenderModuleConfig {
            module: MenderModuleConfig::module_path(module).expect("module"),
            state_dir: dir.clone(),
            payload_file: None,
            files: Default::default(),
            timeouts: Default::default(),
            reboot_command: None,
        };
        let target = |kind| TargetConfig {
            name: "app".into(),
            kind,
        };
        let rauc = target(TargetKind::Rauc(RaucConfig::new(dir.clone())));
        let swu = target(TargetKind::Swupdate(SwupdateConfig::new(dir.clone())));
        let single = target(TargetKind::MenderModule(mender("single-file")));
        let script = target(TargetKind::Script(ScriptConfig::new(
            "/bin/true".into(),
            dir.clone(),
        )));
        let file = target(TargetKind::File {
            path: "/opt/app".into(),
        });
        let module = |m: &str| ArtifactType::MenderModule(m.into());
        for (ty, target) in [
            (ArtifactType::RaucBundle, &rauc),
            (ArtifactType::Swu, &swu),
            (module("single-file"), &single),
            (ArtifactType::RaucBundle, &script),
            (module("deb"), &script),
        ] {
            assert!(check_type("x", &ty, target).is_ok(), "{ty} on {target:?}");
        }
        assert_eq!(
            check_type("update.raucb", &ArtifactType::RaucBundle, &swu)
                .expect_err("refused")
                .0,
            "artifact update.raucb is of type rauc-bundle, for a rauc target; target \"app\" here is of kind \"swupdate\""
        );
        let r = check_type("app.swu", &ArtifactType::Swu, &file).expect_err("refused");
        assert!(r.0.contains("of kind \"file\""), "{r}");
        let r = check_type("app.deb", &module("deb"), &single).expect_err("refused");
        assert_eq!(
            r.0,
            "artifact app.deb is a payload for the Mender update module \"deb\", and target \"app\" runs /usr/share/mender/modules/v3/single-file"
        );
    }

    #[test]
    fn a_typed_release_for_the_wrong_kind_of_target_is_refused_before_anything_is_fetched() {
        // The default configuration's "app" target is a file target.
        let typed = Manifest {
            types: Some(flotilla_protocol::manifest::ManifestTypes {
                artifacts: vec![Some(ArtifactType::RaucBundle)],
            }),
            ..Manifest::plain(manifest(5))
        };
        let mut action = desired("dev-1", 500, &manifest(5), &key(1));
        action.body = ActionBody::Install {
            manifest: SignedBlob::sign(&key(1), typed.encode()),
            kind: ActionKind::Forced,
            window: None,
        };
        let r = refusal(&sign(&action, &key(2)), 0);
        assert!(
            r.starts_with("artifact app.bin is of type rauc-bundle"),
            "{r}"
        );
        assert!(r.ends_with("of kind \"file\""), "{r}");
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
    fn rotated_keys_replace_the_configured_ones() {
        let state = TrustState {
            keys: Some(rotated_keys(1)),
            ..installed(4)
        };
        let by_new = sign(&desired("dev-1", 500, &manifest(5), &key(1)), &key(3));
        let (action, _) = check_all(&by_new, &config(), &state, 100).expect("new key accepted");
        assert_eq!(action.action_id, "act-1");
        let by_old = sign(&desired("dev-1", 500, &manifest(5), &key(1)), &key(2));
        let r = check_all(&by_old, &config(), &state, 100).expect_err("old key refused");
        assert!(
            r.0.starts_with("desired action is signed by unknown key "),
            "{r}"
        );
        // The configured keys are still what a device without a keys document trusts.
        assert!(check_all(&by_old, &config(), &installed(4), 100).is_ok());
    }

    #[test]
    fn an_action_older_than_the_last_accepted_is_a_replay() {
        let mut state = installed(4);
        assert!(state.accept_action_at(50));
        assert!(!state.accept_action_at(20), "an older time changes nothing");
        let blob = sign(&desired("dev-1", 500, &manifest(5), &key(1)), &key(2));
        assert_eq!(
            check_all(&blob, &config(), &state, 100)
                .expect_err("replay")
                .0,
            "action act-1 issued at 10, older than the last accepted action issued at 50"
        );
        let mut same_second = desired("dev-1", 500, &manifest(5), &key(1));
        same_second.issued_at = 50;
        assert!(check_all(&sign(&same_second, &key(2)), &config(), &state, 100).is_ok());
    }

    fn grant(device: &str, action: &str) -> PeerGrant {
        PeerGrant {
            device_id: device.into(),
            action_id: action.into(),
            rollout_id: "r1".into(),
            sources: vec!["dev-7".into(), "dev-8".into()],
            digests: vec![flotilla_protocol::sha256(b"abc")],
            expires_at: 900,
        }
    }

    /// An `InstallWithPeers` of `manifest` (with a block index) carrying `grant` signed by
    /// `grant_key`.
    fn with_peers(grant: &PeerGrant, grant_key: &SigningKey) -> SignedBlob {
        let plain = desired("dev-1", 500, &manifest(5), &key(1));
        let blocks = flotilla_protocol::manifest::ManifestBlocks {
            artifacts: vec![flotilla_protocol::blocks::BlockIndexRef {
                block_size: 65_536,
                sha256: [3; 32],
            }],
        };
        let signed = Manifest {
            release: manifest(5),
            blocks: Some(blocks),
            types: None,
        };
        let action = DesiredAction {
            body: ActionBody::InstallWithPeers {
                manifest: SignedBlob::sign(&key(1), signed.encode()),
                kind: ActionKind::Forced,
                window: None,
                grant: SignedBlob::sign(grant_key, envelope::to_bytes(grant)),
            },
            ..plain
        };
        sign(&action, &key(2))
    }

    #[test]
    fn an_install_with_peers_and_a_block_index_is_accepted_like_an_install() {
        let blob = with_peers(&grant("dev-1", "act-1"), &key(2));
        let (action, manifest) = check_all(&blob, &config(), &installed(4), 100).expect("accepted");
        assert_eq!(manifest.map(|m| m.counter), Some(5));
        let install = action.body.install().expect("an install");
        let blocks = manifest_blocks(install.manifest).expect("decodes");
        assert_eq!(blocks.block_index(0).map(|b| b.sha256), Some([3; 32]));
    }

    #[test]
    fn a_bad_grant_refuses_the_action_naming_why() {
        let r = refusal(&with_peers(&grant("dev-2", "act-1"), &key(2)), 0);
        assert_eq!(r, "peer grant is for device dev-2, this is dev-1");
        let r = refusal(&with_peers(&grant("dev-1", "act-9"), &key(2)), 0);
        assert_eq!(r, "peer grant is for action act-9, this is act-1");
        let r = refusal(&with_peers(&grant("dev-1", "act-1"), &key(1)), 0);
        assert!(r.starts_with("peer grant is signed by unknown key "), "{r}");
    }
}
