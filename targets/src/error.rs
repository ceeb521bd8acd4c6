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

    /// A target's configuration cannot be used; nothing was touched.
    #[error("invalid {field} {value:?}: {reason}")]
    InvalidConfig {
        /// The configuration field, as an operator writes it (e.g. `slots`).
        field: &'static str,
        /// The value found there.
        value: String,
        /// Why it cannot be used.
        reason: String,
    },

    /// Reading or writing the boot-control environment failed.
    #[error("boot control through {backend} failed: {reason}")]
    BootControl {
        /// The backend and where it keeps its state, e.g. `U-Boot environment (/etc/fw_env.config)`.
        backend: String,
        /// What went wrong, including the tool's own message.
        reason: String,
    },

    /// After the reboot the bootloader did not keep the new slot: it fell back to the old one,
    /// so the update never came up.
    #[error(
        "the bootloader fell back to slot {booted} after trying slot {tried} for action \
         {action_id}; the new image did not come up"
    )]
    FellBack {
        /// The action whose slot was tried.
        action_id: String,
        /// The slot the update was written to.
        tried: String,
        /// The slot the bootloader booted instead.
        booted: String,
    },

    /// The slot switch is committed but the device has not rebooted into the new slot yet.
    #[error(
        "action {action_id} switched the boot slot to {slot}, but the device still runs slot \
         {running}; reboot before confirming"
    )]
    RebootPending {
        /// The action.
        action_id: String,
        /// The slot the bootloader will try next.
        slot: String,
        /// The slot the device runs now.
        running: String,
    },

    /// Rebooting the device failed.
    #[error("cannot reboot the device with {command:?}: {reason}")]
    Reboot {
        /// The reboot command as configured.
        command: String,
        /// Why it failed.
        reason: String,
    },

    /// A script target's subcommand failed.
    #[error("{script} {subcommand} failed: {reason}")]
    Script {
        /// The script.
        script: PathBuf,
        /// The subcommand that failed (`check`, `stage`, ...).
        subcommand: &'static str,
        /// What the script said (its message, or the last line of its stderr) and its exit code.
        reason: String,
        /// The script reported a temporary failure (exit code 3): trying again later may work.
        temporary: bool,
    },

    /// A Mender update module failed in one of its states, or answered outside the protocol.
    #[error("update module {module} {state} failed: {reason}")]
    UpdateModule {
        /// The module.
        module: PathBuf,
        /// The state or query it was called with (`ArtifactInstall`, `SupportsRollback`, ...).
        state: &'static str,
        /// What it said (the last line of stderr, else of stdout) and its exit status.
        reason: String,
    },

    /// SWUpdate, or a command the swupdate target runs for a step, failed.
    #[error("swupdate {step} failed: {reason}")]
    Swupdate {
        /// The step: `install`, `confirm`, `rollback` or `reboot`.
        step: &'static str,
        /// What failed, with SWUpdate's own error lines or the command's last line.
        reason: String,
    },

    /// RAUC (its `rauc` client or its service), or the reboot command, failed for a step.
    #[error("rauc {step} failed: {reason}")]
    Rauc {
        /// The step: `status`, `install`, `mark-good`, `rollback` or `reboot`.
        step: &'static str,
        /// What failed, with RAUC's own error line (`LastError: ...`) or the command's last line.
        reason: String,
    },
}
