//! The persisted records of an action: its [`State`] in the update state machine, the
//! [`ActionRecord`] the store keeps per action id, and the [`RollbackPoint`] a signed rollback
//! returns to.
//!
//! Plain data, no I/O: the store ([`crate::store`]) persists these and the state machine
//! ([`crate::machine`]) moves an action from one state to the next, so both depend on this
//! module and neither on the other. Values are postcard in sled, which is not
//! self-describing: a record written by one build is read by the next, so new variants go at
//! the end, and a struct that gains a field keeps its old shape for reading
//! ([`LegacyActionRecord`]).

use flotilla_protocol::{DesiredAction, InstalledRelease, Phase, ReleaseManifest, SignedBlob};
use serde::{Deserialize, Serialize};

/// The persisted state of one action. `Idle` is the absence of a running action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum State {
    Accepted,
    Waiting {
        reason: String,
    },
    Downloading {
        artifact: u32,
        done: u64,
    },
    Verified,
    /// Intent: about to stage (or staging) artifact `artifact`.
    Staging {
        artifact: u32,
    },
    Staged,
    /// Intent: about to activate (or activating) artifact `artifact`.
    Activating {
        artifact: u32,
    },
    Activated,
    Confirming,
    Ready,
    Failed {
        reason: String,
        rolled_back: bool,
    },
    Refused {
        reason: String,
    },
    Canceled,
    Downloaded,
    /// Installed on a device without health checks: readiness cannot be tracked.
    Applied,
    /// Intent of a signed rollback: about to return (or returning) every target to what was
    /// there before `point.action_id`. Repeated after a crash (target rollbacks are repeatable).
    RollingBack {
        point: RollbackPoint,
    },
    /// Artifact `artifact` was activated and its target needs a reboot to make it live.
    /// Persisted before the reboot command runs; the next start confirms the boot.
    AwaitingReboot {
        artifact: u32,
    },
    /// The targets were rolled back after `reason`, and the old content is live only after a
    /// reboot. Persisted before the reboot command runs; the next start finishes as Failed.
    Reverting {
        reason: String,
    },
}

impl State {
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            State::Ready
                | State::Failed { .. }
                | State::Refused { .. }
                | State::Canceled
                | State::Downloaded
                | State::Applied
        )
    }

    /// The action may have changed a target: staged, switched or rolled back something. Before
    /// this an action has only downloaded, so it can end anywhere without touching a target.
    pub fn may_have_touched_targets(&self) -> bool {
        matches!(
            self,
            State::Staging { .. }
                | State::Staged
                | State::Activating { .. }
                | State::Activated
                | State::Confirming
                | State::AwaitingReboot { .. }
                | State::Reverting { .. }
                | State::RollingBack { .. }
        )
    }

    /// A signed cancel still applies: nothing has been switched over yet.
    pub fn is_cancelable(&self) -> bool {
        matches!(
            self,
            State::Accepted
                | State::Waiting { .. }
                | State::Downloading { .. }
                | State::Verified
                | State::Staging { .. }
                | State::Staged
        )
    }

    /// A short lower-case name, for logs, fault points and give-up reasons.
    pub fn name(&self) -> &'static str {
        match self {
            State::Accepted => "accepted",
            State::Waiting { .. } => "waiting",
            State::Downloading { .. } => "downloading",
            State::Verified => "verified",
            State::Staging { .. } => "staging",
            State::Staged => "staged",
            State::Activating { .. } => "activating",
            State::Activated => "activated",
            State::Confirming => "confirming",
            State::Ready => "ready",
            State::Failed { .. } => "failed",
            State::Refused { .. } => "refused",
            State::Canceled => "canceled",
            State::Downloaded => "downloaded",
            State::Applied => "applied",
            State::RollingBack { .. } => "rolling-back",
            State::AwaitingReboot { .. } => "awaiting-reboot",
            State::Reverting { .. } => "reverting",
        }
    }

    /// The phase reported for this state.
    pub fn phase(&self, manifest: Option<&ReleaseManifest>) -> Phase {
        match self {
            State::Accepted => Phase::Accepted,
            State::Waiting { reason } => Phase::Waiting {
                reason: reason.clone(),
            },
            State::Downloading { artifact, done } => {
                let sizes: Vec<u64> = manifest
                    .map(|m| m.artifacts.iter().map(|a| a.size).collect())
                    .unwrap_or_default();
                let before: u64 = sizes.iter().take(*artifact as usize).sum();
                Phase::Downloading {
                    done: before + done,
                    total: sizes.iter().sum(),
                }
            }
            State::Verified | State::Staging { .. } => Phase::Verified,
            State::Staged | State::Activating { .. } => Phase::Staged,
            State::Activated => Phase::Activated,
            State::Confirming => Phase::Confirming,
            State::Ready => Phase::Ready,
            State::Failed {
                reason,
                rolled_back,
            } => Phase::Failed {
                reason: reason.clone(),
                rolled_back: *rolled_back,
            },
            State::Refused { reason } => Phase::Refused {
                reason: reason.clone(),
            },
            State::Canceled => Phase::Canceled,
            State::Downloaded => Phase::Downloaded,
            State::Applied => Phase::Applied,
            // Not a phase of its own: a rollback is accepted, then ready or failed.
            State::RollingBack { .. } => Phase::Accepted,
            // The new content is switched on; it goes live (or is confirmed) after the reboot.
            State::AwaitingReboot { .. } => Phase::Activated,
            // An activation is still what runs until the reboot into the old content.
            State::Reverting { .. } => Phase::Activated,
        }
    }
}

/// Everything the agent remembers about one action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionRecord {
    pub action_id: String,
    pub rollout_id: String,
    /// The verified desired action (or, for a refusal, what it claimed).
    pub action: DesiredAction,
    /// The verified release manifest, for installs.
    pub manifest: Option<ReleaseManifest>,
    pub state: State,
    /// The desired action exactly as it was received, signature included (its manifest is in
    /// it, signed as received too): a stored action is verified again from these bytes before
    /// it is resumed (`resume.rs`). `None` in records written before it was kept
    /// ([`LegacyActionRecord`]), whose manifest alone can be verified again.
    pub signed: Option<SignedBlob>,
}

/// An [`ActionRecord`] as builds before decision 0036 wrote it, without the signed action, so
/// an agent updated in the middle of an action can still finish it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LegacyActionRecord {
    pub action_id: String,
    pub rollout_id: String,
    pub action: DesiredAction,
    pub manifest: Option<ReleaseManifest>,
    pub state: State,
}

impl From<LegacyActionRecord> for ActionRecord {
    fn from(old: LegacyActionRecord) -> Self {
        ActionRecord {
            action_id: old.action_id,
            rollout_id: old.rollout_id,
            action: old.action,
            manifest: old.manifest,
            state: old.state,
            signed: None,
        }
    }
}

impl ActionRecord {
    pub fn phase(&self) -> Phase {
        self.state.phase(self.manifest.as_ref())
    }

    /// The release's name; empty for an action without a manifest.
    pub fn release_name(&self) -> &str {
        self.manifest
            .as_ref()
            .map(|m| m.name.as_str())
            .unwrap_or("")
    }
}

/// What a signed rollback of the installed release returns to, recorded when an install
/// finishes: the action that installed it, the release it installed, and what was installed
/// before (with the installed counter as it was then).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollbackPoint {
    pub action_id: String,
    pub release: InstalledRelease,
    pub previous: Option<InstalledRelease>,
    pub previous_counter: u64,
    /// `(artifact name, target name)` of every artifact the action installed.
    pub artifacts: Vec<(String, String)>,
}
