//! [`TargetError`]: what can go wrong while updating a target, worded for a device operator.
//!
//! One variant per operation that failed, carrying the path involved and the underlying error.
//! Messages include the underlying error so that a log line on its own tells the whole story
//! ("cannot stage the update (/var/lib/flotilla/dl/app.conf): No such file or directory").

use std::io;
use std::path::PathBuf;

/// Why an [`UpdateTarget`](crate::UpdateTarget) step failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TargetError {
    /// The action id cannot be used to name files on the device.
    #[error(
        "action id {action_id:?} cannot be used on this device: it must be 1 to 160 letters, \
         digits, '.', '_', '-', '@' or ':' and must not start with '.'"
    )]
    InvalidActionId {
        /// The id as received.
        action_id: String,
    },

    /// The destination cannot take an update, for a reason that is not an I/O error
    /// (it is a directory, its directory is missing, ...).
    #[error("{path} cannot take an update: {reason}")]
    NotUpdatable {
        /// What is in the way.
        path: PathBuf,
        /// Why, in words.
        reason: String,
    },

    /// Checking whether the destination can take an update failed.
    #[error("{path} cannot take an update now: {source}")]
    Check {
        /// What was being checked.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },

    /// Preparing the update failed; the running system is untouched.
    #[error("cannot stage the update ({path}): {source}")]
    Stage {
        /// The artifact or the staged copy, whichever failed.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },

    /// `activate` was called for an action that has nothing staged.
    #[error("action {action_id} has nothing staged for {path}; it must be staged before it is activated")]
    NotStaged {
        /// The action.
        action_id: String,
        /// The destination.
        path: PathBuf,
    },

    /// `stage` was called for an action that was already activated.
    #[error("action {action_id} was already activated on {path}; it cannot be staged again")]
    AlreadyActivated {
        /// The action.
        action_id: String,
        /// The destination.
        path: PathBuf,
    },

    /// Switching to the staged content failed.
    #[error("cannot activate the update ({path}): {source}")]
    Activate {
        /// The file that could not be read, written or renamed.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },

    /// `confirm` was called for an action that is not the one activated.
    #[error("action {action_id} is not activated on {path}; there is nothing to confirm")]
    NotActivated {
        /// The action.
        action_id: String,
        /// The destination.
        path: PathBuf,
    },

    /// `activate` or `confirm` was called for an action that was already rolled back.
    #[error(
        "action {action_id} was rolled back on {path}; it cannot be activated or confirmed again"
    )]
    RolledBack {
        /// The action.
        action_id: String,
        /// The destination.
        path: PathBuf,
    },

    /// Committing the activation failed.
    #[error("cannot confirm the update ({path}): {source}")]
    Confirm {
        /// The file that could not be written.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },

    /// Returning to the previous content failed.
    #[error("cannot roll back ({path}): {source}")]
    Rollback {
        /// The file that could not be read, written, renamed or removed.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },

    /// A rollback was requested for an action that was never activated on this target, so
    /// there is no previous content to return to.
    #[error("nothing to roll back on {path}: this action never replaced it")]
    NothingToRollBack {
        /// The destination.
        path: PathBuf,
    },

    /// The target's own state on disk could not be read.
    #[error("cannot read the update state {path}: {source}")]
    ReadState {
        /// The state file.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },

    /// The target's own state on disk is damaged (edited by hand, or a file system fault).
    #[error(
        "the update state {path} is damaged ({reason}); fix or remove it to let updates \
         continue (removing it forgets what can be rolled back)"
    )]
    CorruptState {
        /// The state file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}
