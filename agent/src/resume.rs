//! Whether a stored action may go on. The database is not trusted: an action found unfinished
//! in it (at start, or under the id of a desired action that arrives again) is verified again
//! before anything runs it, against the keys and the trust state of now (decision 0036).
//!
//! The database can lie in two ways. A damaged value fails its checksum (`store.rs`) and never
//! gets here. A damaged sled log goes back in time instead: its recovery stops at the first bad
//! entry, so an action can come back in a state it left long ago, from a release older than the
//! installed one. Its bytes are genuine, so its signatures verify; what gives it away is the
//! trust state, kept in the trust file outside the database:
//!
//! ```text
//! every stored action   the desired action kept as received verifies under the coordinator
//!                       keys trusted now and is the stored one; it names this device
//! an install            its manifest verifies under the release keys trusted now and is the
//!                       stored one; hardware and targets still fit; with its release counter
//!                       c and the installed counter i:
//!     c > i             goes on from its state
//!     c = i             goes on only from activated or confirming (it recorded its release as
//!                       installed and stopped before recording the end: it confirms and ends)
//!     c < i             never goes on
//! a rollback            accepted, or rolling back a point whose release or previous counter
//!                       is the installed counter (a crash after restoring it)
//! before any target was touched (accepted, waiting, downloading, verified):
//!                       neither the action nor its release has expired, and the action was not
//!                       issued before the last accepted one (a newer action superseded it)
//! ```
//!
//! Expiry does not apply once a target may have been touched: an action that has begun to
//! change the device finishes or rolls back through its own steps, and never stops half-way
//! because time passed. A refusal is the whole reason: the caller fails the action with it,
//! reports it, and touches no target (a record that may be older than the device's content
//! must not roll the device back either).
//!
//! Records written before the signed action was kept (`signed: None`) have only their
//! manifest verified again.

use flotilla_protocol::{ActionBody, KeyRing, UnixTime};

use crate::config::Config;
use crate::record::{ActionRecord, State};
use crate::trust::{self, Refusal, TrustState};

/// Checks a stored, unfinished action before it is resumed; `system` is the device's clock.
/// The refusal names the action, its state and why, for the action's `Failed` report.
pub fn check_stored(
    record: &ActionRecord,
    config: &Config,
    trust: &TrustState,
    system: UnixTime,
) -> Result<(), Refusal> {
    why_not(record, config, trust, system).map_err(|why| {
        Refusal(format!(
            "stored action {} (state {}) was not resumed: {why}; no target was touched",
            record.action_id,
            record.state.name()
        ))
    })
}

fn why_not(
    record: &ActionRecord,
    config: &Config,
    trust: &TrustState,
    system: UnixTime,
) -> Result<(), String> {
    let ring = trust.ring(&config.trust);
    check_signed(record, &ring)?;
    let action = &record.action;
    if action.device_id != config.device_id.as_str() {
        return Err(format!(
            "it is for device {}, this is {}",
            action.device_id, config.device_id
        ));
    }
    let skew = config.trust.max_clock_skew;
    let now = trust.now(system, skew);
    let untouched = !record.state.may_have_touched_targets();
    match (action.body.install(), &action.body) {
        (Some(install), _) => {
            let full =
                trust::verify_manifest(install.manifest, &ring.release_keys).map_err(|r| r.0)?;
            let signed = &full.release;
            if record.manifest.as_ref() != Some(signed) {
                return Err(
                    "its stored release differs from the signed manifest kept with it".into(),
                );
            }
            trust::check_hardware(signed, &config.hardware_id).map_err(|r| r.0)?;
            trust::check_targets(&full, config).map_err(|r| r.0)?;
            check_counter(&record.state, signed.counter, trust.installed_counter)?;
            if untouched {
                trust::check_release_expiry(signed, now).map_err(|r| r.0)?;
            }
        }
        (None, ActionBody::Rollback { .. }) => {
            if record.manifest.is_some() {
                return Err("a rollback's record holds a release".into());
            }
            check_rollback(&record.state, trust.installed_counter)?;
        }
        (None, _) => return Err("it is neither an install nor a rollback".into()),
    }
    if untouched {
        trust::check_action(action, config.device_id.as_str(), now).map_err(|r| r.0)?;
        trust::check_issued(action, trust.last_accepted(system, skew))
            .map_err(|r| format!("{r}, which superseded it"))?;
    }
    Ok(())
}

/// The desired action kept as received verifies and is the one the record describes.
fn check_signed(record: &ActionRecord, ring: &KeyRing) -> Result<(), String> {
    match &record.signed {
        Some(blob) => {
            let signed = trust::verify_desired(blob, &ring.coordinator_keys).map_err(|r| r.0)?;
            if signed != record.action {
                return Err("its stored action differs from the signed bytes kept with it".into());
            }
        }
        None => tracing::info!(
            action = record.action_id,
            "a record from an earlier build, without the signed action: only its release is \
             verified again"
        ),
    }
    if record.action.action_id != record.action_id || record.action.rollout_id != record.rollout_id
    {
        return Err(format!(
            "its record is for action {} of rollout {}, the action it holds is {} of rollout {}",
            record.action_id, record.rollout_id, record.action.action_id, record.action.rollout_id
        ));
    }
    Ok(())
}

/// The release counter rule: see the module documentation.
fn check_counter(state: &State, counter: u64, installed: u64) -> Result<(), String> {
    if counter > installed || (counter == installed && confirms_installed(state)) {
        return Ok(());
    }
    if counter < installed {
        return Err(format!(
            "its release counter {counter} is below the installed {installed}: the record is \
             older than what this device runs"
        ));
    }
    Err(format!(
        "its release counter {counter} is installed already, and state {} comes before that",
        state.name()
    ))
}

/// States from which an install whose release is recorded as installed may still go on: the
/// crash fell between recording the release and recording the end.
fn confirms_installed(state: &State) -> bool {
    matches!(state, State::Activated | State::Confirming)
}

/// A signed rollback goes on from `Accepted` (its own step checks the rollback point), or from
/// `RollingBack` while the point still describes the installed release (or, after a crash
/// between restoring the counter and recording the end, the release before it).
fn check_rollback(state: &State, installed: u64) -> Result<(), String> {
    match state {
        State::Accepted => Ok(()),
        State::RollingBack { point }
            if installed == point.release.counter || installed == point.previous_counter =>
        {
            Ok(())
        }
        State::RollingBack { point } => Err(format!(
            "it rolls release counter {} back to {}, and the installed counter is {installed}",
            point.release.counter, point.previous_counter
        )),
        other => Err(format!("a rollback is never in state {}", other.name())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::RollbackPoint;
    use crate::trust::tests::{config, desired, key, manifest};
    use flotilla_protocol::{envelope, DesiredAction, InstalledRelease, SignedBlob};

    /// An install of a release with `counter`, stored in `state` as the agent keeps it: the
    /// signed action beside what was decoded from it.
    fn stored(counter: u64, state: State) -> ActionRecord {
        let action = desired("dev-1", 500, &manifest(counter), &key(1));
        ActionRecord {
            action_id: action.action_id.clone(),
            rollout_id: action.rollout_id.clone(),
            manifest: Some(manifest(counter)),
            signed: Some(SignedBlob::sign(&key(2), envelope::to_bytes(&action))),
            action,
            state,
        }
    }

    fn installed(counter: u64) -> TrustState {
        TrustState {
            installed_counter: counter,
            ..TrustState::default()
        }
    }

    fn refusal(record: &ActionRecord, trust: &TrustState, system: UnixTime) -> String {
        check_stored(record, &config(), trust, system)
            .expect_err("not resumed")
            .0
    }

    const UNTOUCHED: [State; 4] = [
        State::Accepted,
        State::Verified,
        State::Downloading {
            artifact: 0,
            done: 1,
        },
        State::Waiting {
            reason: String::new(),
        },
    ];

    fn every_unfinished_state() -> Vec<State> {
        let mut states = UNTOUCHED.to_vec();
        states.extend([
            State::Staging { artifact: 0 },
            State::Staged,
            State::Activating { artifact: 0 },
            State::Activated,
            State::Confirming,
            State::AwaitingReboot { artifact: 0 },
            State::Reverting {
                reason: "health".into(),
            },
        ]);
        states
    }

    /// The finding: installed counter 12, the record of an action of release counter 2 comes
    /// back in any unfinished state: it never goes on, and the reason says why.
    #[test]
    fn an_action_of_a_release_older_than_the_installed_one_never_goes_on() {
        for state in every_unfinished_state() {
            let r = refusal(&stored(2, state.clone()), &installed(12), 100);
            assert_eq!(
                r,
                format!(
                    "stored action act-1 (state {}) was not resumed: its release counter 2 is \
                     below the installed 12: the record is older than what this device runs; \
                     no target was touched",
                    state.name()
                )
            );
        }
    }

    #[test]
    fn a_release_newer_than_the_installed_one_goes_on_from_every_state() {
        for state in every_unfinished_state() {
            assert_eq!(
                check_stored(&stored(5, state.clone()), &config(), &installed(4), 100),
                Ok(()),
                "{state:?}"
            );
        }
    }

    /// The crash between recording the release as installed and recording Ready: the action
    /// confirms and ends. From any earlier state the same counter means the record went back.
    #[test]
    fn the_installed_release_goes_on_only_to_confirm_and_end() {
        for state in every_unfinished_state() {
            let result = check_stored(&stored(5, state.clone()), &config(), &installed(5), 100);
            if matches!(state, State::Activated | State::Confirming) {
                assert_eq!(result, Ok(()), "{state:?}");
            } else {
                let r = result.expect_err("not resumed").0;
                assert!(
                    r.contains(&format!(
                        "its release counter 5 is installed already, and state {} comes before that",
                        state.name()
                    )),
                    "{r}"
                );
            }
        }
    }

    #[test]
    fn a_stored_action_that_differs_from_its_signed_bytes_is_not_resumed() {
        // Damage that kept the record decodable: another release in the decoded manifest.
        let mut r = stored(5, State::Staged);
        r.manifest = Some(manifest(6));
        assert!(refusal(&r, &installed(4), 100)
            .contains("its stored release differs from the signed manifest kept with it"),);
        // The decoded action says another kind of install than the signed one.
        let mut r = stored(5, State::Staged);
        r.action.expires_at = 900;
        assert!(refusal(&r, &installed(4), 100)
            .contains("its stored action differs from the signed bytes kept with it"));
        // A flipped bit in the signed bytes.
        let mut r = stored(5, State::Staged);
        if let Some(blob) = &mut r.signed {
            blob.payload[3] ^= 4;
        }
        assert!(refusal(&r, &installed(4), 100).contains("signature does not verify"));
        // The record kept under another action's id.
        let mut r = stored(5, State::Staged);
        r.action_id = "act-9".into();
        assert!(refusal(&r, &installed(4), 100).contains(
            "its record is for action act-9 of rollout r1, the action it holds is act-1"
        ));
    }

    #[test]
    fn a_stored_action_signed_by_a_key_no_longer_trusted_is_not_resumed() {
        let mut r = stored(5, State::Confirming);
        let action: DesiredAction = r.action.clone();
        r.signed = Some(SignedBlob::sign(&key(9), envelope::to_bytes(&action)));
        assert!(
            refusal(&r, &installed(4), 100).contains("desired action is signed by unknown key ")
        );
        let mut r = stored(5, State::Confirming);
        let bad_release = desired("dev-1", 500, &manifest(5), &key(8));
        r.signed = Some(SignedBlob::sign(&key(2), envelope::to_bytes(&bad_release)));
        r.action = bad_release;
        assert!(
            refusal(&r, &installed(4), 100).contains("release manifest is signed by unknown key ")
        );
    }

    /// Expiry and supersession end an action only before it may have touched a target.
    #[test]
    fn expiry_and_a_newer_action_stop_an_action_only_before_it_touched_a_target() {
        // `desired` expires at 500 (the manifest at 1000); the device's clock says 600.
        for state in every_unfinished_state() {
            let result = check_stored(&stored(5, state.clone()), &config(), &installed(4), 600);
            if state.may_have_touched_targets() {
                assert_eq!(result, Ok(()), "{state:?}");
            } else {
                let r = result.expect_err("expired").0;
                assert!(r.contains("action expired at 500"), "{r}");
            }
        }
        let superseded = TrustState {
            last_action_issued_at: 50,
            ..installed(4)
        };
        for state in UNTOUCHED {
            let r = refusal(&stored(5, state), &superseded, 100);
            assert!(
                r.contains(
                    "action act-1 issued at 10, older than the last accepted action issued at \
                     50, which superseded it"
                ),
                "{r}"
            );
        }
        assert_eq!(
            check_stored(&stored(5, State::Confirming), &config(), &superseded, 100),
            Ok(())
        );
    }

    #[test]
    fn a_record_from_an_earlier_build_has_its_release_verified() {
        let mut legacy = stored(5, State::Staged);
        legacy.signed = None;
        assert_eq!(check_stored(&legacy, &config(), &installed(4), 100), Ok(()));
        assert!(refusal(&legacy, &installed(12), 100).contains("below the installed 12"));
        let Some(install) = legacy.action.body.install() else {
            panic!("an install");
        };
        let mut tampered = install.manifest.clone();
        tampered.payload[2] ^= 1;
        if let ActionBody::Install { manifest, .. } = &mut legacy.action.body {
            *manifest = tampered;
        }
        assert!(refusal(&legacy, &installed(4), 100).contains("signature does not verify"));
    }

    #[test]
    fn a_rollback_goes_on_only_while_its_point_describes_the_installed_release() {
        let release = |counter| InstalledRelease {
            name: format!("app-{counter}"),
            version: "1".into(),
            counter,
        };
        let point = RollbackPoint {
            action_id: "act-0".into(),
            release: release(5),
            previous: Some(release(3)),
            previous_counter: 3,
            artifacts: vec![],
        };
        let mut action = desired("dev-1", 500, &manifest(5), &key(1));
        action.body = ActionBody::Rollback {
            action_id: "act-0".into(),
        };
        let record = |state| ActionRecord {
            action_id: "act-1".into(),
            rollout_id: "r1".into(),
            manifest: None,
            signed: Some(SignedBlob::sign(&key(2), envelope::to_bytes(&action))),
            action: action.clone(),
            state,
        };
        let rolling = record(State::RollingBack {
            point: point.clone(),
        });
        assert_eq!(
            check_stored(&rolling, &config(), &installed(5), 100),
            Ok(())
        );
        assert_eq!(
            check_stored(&rolling, &config(), &installed(3), 100),
            Ok(()),
            "restored, not yet recorded as done"
        );
        assert!(refusal(&rolling, &installed(12), 100)
            .contains("it rolls release counter 5 back to 3, and the installed counter is 12"));
        assert_eq!(
            check_stored(&record(State::Accepted), &config(), &installed(12), 100),
            Ok(())
        );
    }

    #[test]
    fn an_action_for_another_device_is_not_resumed() {
        let action = desired("dev-2", 500, &manifest(5), &key(1));
        let mut r = stored(5, State::Staged);
        r.signed = Some(SignedBlob::sign(&key(2), envelope::to_bytes(&action)));
        r.action = action;
        assert!(refusal(&r, &installed(4), 100).contains("it is for device dev-2, this is dev-1"));
    }
}
