//! The [`UpdateTarget`] trait: what the agent needs from anything it can update.
//!
//! The agent drives every target through the same steps, persisting its own state before each
//! one:
//!
//! ```text
//! check -> stage -> activate -> (health checks over the soak time) -> confirm
//!                        \                                        \-> rollback
//!                         \-> rollback (activate failed)
//! ```
//!
//! `activate` (and [`UpdateTarget::rollback_activation`]) may answer
//! [`Activation::RebootRequired`]: the content becomes live after the agent persists its state and
//! calls [`UpdateTarget::reboot`]. The agent then confirms from the new boot, with a new target
//! instance; an A/B target finds out there whether the bootloader kept the new slot.
//!
//! Because the agent persists *before* acting, a kill -9 or a power cut in the middle of a step
//! makes the restarted agent call the same step again for the same action. A target therefore
//! keys everything it remembers on [`ActionContext::action_id`], keeps that memory on disk (a new
//! process builds a new target instance), and makes each step it calls repeatable a no-op the
//! second time, or a completion of what the first call started.

use std::path::{Path, PathBuf};

use crate::error::TargetError;

/// The action a step belongs to. Targets key their on-disk state on `action_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionContext {
    /// The coordinator's id of this action; unique per device and stable across restarts.
    /// Targets may use it in file names, so it must match `[A-Za-z0-9._@:-]{1,160}` (the coordinator issues `{rollout}@{created}:{device}`) and not start
    /// with `.` (see [`ActionContext::validate_action_id`]).
    pub action_id: String,
    /// The release being installed, e.g. `fw-2.4.0`. Informational: recorded and logged.
    pub release: String,
    /// The manifest's name of the artifact this target receives.
    pub artifact_name: String,
}

impl ActionContext {
    /// Longest action id a target accepts; keeps derived file names well under `NAME_MAX`.
    pub const MAX_ACTION_ID_LEN: usize = 160;

    /// Builds a context.
    pub fn new(
        action_id: impl Into<String>,
        release: impl Into<String>,
        artifact_name: impl Into<String>,
    ) -> Self {
        Self {
            action_id: action_id.into(),
            release: release.into(),
            artifact_name: artifact_name.into(),
        }
    }

    /// Checks that the action id is safe to use as part of a file name, so a hostile or
    /// malformed id (`../../etc/passwd`) can never make a target write outside its state.
    pub fn validate_action_id(&self) -> Result<&str, TargetError> {
        let id = self.action_id.as_str();
        let safe = !id.is_empty()
            && id.len() <= Self::MAX_ACTION_ID_LEN
            && !id.starts_with('.')
            && id.bytes().all(|b| {
                b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'@' | b':')
            });
        if safe {
            Ok(id)
        } else {
            Err(TargetError::InvalidActionId {
                action_id: id.to_owned(),
            })
        }
    }
}

/// What [`UpdateTarget::activate`] left the device needing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// The new content is live; health checks can start now.
    Done,
    /// The new content becomes live after a reboot (e.g. an A/B slot switch); the agent reboots
    /// and confirms afterwards.
    RebootRequired,
}

/// Something the agent can update: a file, an A/B slot pair, a user script.
///
/// Synchronous on purpose: steps are disk-bound and short, and the agent calls them from
/// `spawn_blocking`. Implementations must be `Send + Sync` so one instance can be shared.
///
/// # Repeatability
///
/// A step that a target declares repeatable ([`stage_is_repeatable`](Self::stage_is_repeatable),
/// [`activate_is_repeatable`](Self::activate_is_repeatable)) may be called again for the same
/// action id after a crash anywhere inside it, from a new instance of the target, and must then
/// finish the job without doing it twice. `check`, `confirm` and `rollback` must always be
/// repeatable in that sense: the agent may repeat them after a crash without asking.
pub trait UpdateTarget: Send + Sync {
    /// Short name of the target kind, used in logs and reports (e.g. `"file"`).
    fn kind(&self) -> &'static str;

    /// Can this target take an update now? (Destination exists and is writable, nothing is in
    /// the way, earlier state is readable.) Changes nothing the running system uses.
    fn check(&self, ctx: &ActionContext) -> Result<(), TargetError>;

    /// Prepares the update from `artifact` (already verified against the signed manifest)
    /// without affecting the running system. The artifact file may be deleted afterwards.
    fn stage(&self, ctx: &ActionContext, artifact: &Path) -> Result<(), TargetError>;

    /// Switches to the content staged for `ctx.action_id`, remembering what was there before so
    /// that [`rollback`](Self::rollback) can return to it.
    fn activate(&self, ctx: &ActionContext) -> Result<Activation, TargetError>;

    /// Health checks passed: commit the activation of `ctx.action_id` and release what is only
    /// needed until then. The previous content stays available for a later signed rollback.
    fn confirm(&self, ctx: &ActionContext) -> Result<(), TargetError>;

    /// Returns to what was there before `ctx.action_id` was activated.
    ///
    /// `ctx.action_id` names the action whose activation is undone: after failed health checks
    /// that is the action itself; for a later signed rollback it is the action that installed
    /// the current content. If that action was staged but never activated, the running system is
    /// already as it was and only the staged content is discarded. If it was never activated
    /// here at all, this fails with [`TargetError::NothingToRollBack`] rather than undoing some
    /// other action's update.
    fn rollback(&self, ctx: &ActionContext) -> Result<(), TargetError>;

    /// [`rollback`](Self::rollback), also saying whether the old content is live now
    /// ([`Activation::Done`]) or only after a reboot ([`Activation::RebootRequired`], e.g. an A/B
    /// slot switched back while the new slot is still running).
    ///
    /// Added after `rollback` and provided, so existing targets and callers keep working: the
    /// default runs `rollback` and answers `Done`. Targets that need a reboot to go back
    /// override it, and their `rollback` does the same work and ignores the answer.
    fn rollback_activation(&self, ctx: &ActionContext) -> Result<Activation, TargetError> {
        self.rollback(ctx).map(|()| Activation::Done)
    }

    /// Reboots the device after a step answered [`Activation::RebootRequired`]. The caller
    /// persists its own state first: on success this may not return at all.
    ///
    /// The default fails, naming the target kind: targets that never ask for a reboot do not
    /// know how to do one.
    fn reboot(&self) -> Result<(), TargetError> {
        Err(TargetError::Reboot {
            command: String::new(),
            reason: format!(
                "the {} target has no reboot command configured",
                self.kind()
            ),
        })
    }

    /// Files or block devices this target can read that may share blocks with a new artifact
    /// (the content it runs now, the other slot of a pair), for adaptive downloads: the agent
    /// hashes their blocks and copies the ones a new artifact needs, each checked against its
    /// signed hash. The default is none.
    fn block_sources(&self) -> Vec<PathBuf> {
        Vec::new()
    }

    /// May the agent run `stage` a second time for one action after a crash?
    fn stage_is_repeatable(&self) -> bool {
        true
    }

    /// May the agent run `activate` a second time for one action after a crash? A target that
    /// says no is reported as failed (and rolled back) when a crash interrupts its activation.
    fn activate_is_repeatable(&self) -> bool;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(id: &str) -> ActionContext {
        ActionContext::new(id, "fw-2.4.0", "app.conf")
    }

    #[test]
    fn ordinary_action_ids_are_accepted() {
        for id in ["a", "act-0001", "r_2.4.0", "01HZX3K9"] {
            assert_eq!(ctx(id).validate_action_id().expect(id), id);
        }
        let longest = "a".repeat(ActionContext::MAX_ACTION_ID_LEN);
        assert!(ctx(&longest).validate_action_id().is_ok());
    }

    #[test]
    fn action_ids_that_could_escape_a_directory_are_refused() {
        let too_long = "a".repeat(ActionContext::MAX_ACTION_ID_LEN + 1);
        for id in [
            "",
            ".",
            "..",
            "../etc/passwd",
            "a/b",
            ".hidden",
            "a b",
            "é",
            &too_long,
        ] {
            let err = ctx(id).validate_action_id().expect_err(id);
            assert!(
                matches!(&err, TargetError::InvalidActionId { action_id } if action_id == id),
                "{id}: {err}"
            );
        }
    }
}
