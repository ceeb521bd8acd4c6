//! The `file` target: replaces one file atomically and keeps the previous one for rollback.
//!
//! # Layout on disk
//!
//! Everything the target remembers lives in a state directory beside the destination, so it is on
//! the same file system (renames stay atomic) and survives restarts:
//!
//! ```text
//! /etc/app/app.conf                    the destination, what the device runs with
//! /etc/app/app.conf.flotilla/          state directory (mode 0700: it holds copies of the file)
//!     staged-<action>                  the verified artifact, copied by `stage`
//!     previous-<action>                the destination as it was before <action> activated
//!     activated                        marker: which action activated, whether there was a
//!                                      previous file, its mode and owner, and the phase
//! ```
//!
//! # Why the marker
//!
//! `activate` is two steps: save the current file, then rename the staged file over it. A crash
//! between or inside them makes the agent call `activate` again, and a naive second call would
//! save the *new* content as "previous", destroying the only way back. The marker (written
//! atomically, after the previous copy is safe on disk and before the switch) is the commit
//! point: once it names an action, that action's previous copy is never written again, and a
//! repeated `activate` only finishes the rename if it has not happened yet.
//!
//! The previous copy is named after its action rather than plain `previous` so that an activation
//! interrupted before its marker is written cannot overwrite the copy an earlier, committed
//! action still relies on; stale copies are swept once the marker has moved on.
//!
//! # Transitions of the marker
//!
//! ```text
//! no marker, or another action's --activate--> activated --confirm--> confirmed
//!                                                  |                      |
//!                                                  +-------rollback-------+--> rolled-back
//! ```
//!
//! One agent process updates a given destination at a time; two processes driving the same file
//! concurrently are not supported.

use std::ffi::OsStr;
use std::fs::{self, File, Metadata, Permissions};
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tracing::{debug, info, warn};

use crate::error::TargetError;
use crate::fs::{
    atomic_copy, atomic_rename, atomic_write, create_private_dir, fsync_dir, parent_dir,
    read_state_file, state_lines, TEMP_MARKER,
};
use crate::target::{ActionContext, Activation, UpdateTarget};

/// Name of the marker file inside the state directory.
const MARKER: &str = "activated";
/// Scratch copy of the previous file during a rollback; a copy (not a rename of the previous
/// file itself) so that a rollback interrupted after the switch can simply be run again.
const RESTORING: &str = "restoring";
/// Mode of a destination that did not exist before: world-readable, owner-writable, like most
/// files an update installs.
const DEFAULT_MODE: u32 = 0o644;

/// Replaces one file atomically, keeping the previous content for rollback.
///
/// See the [module documentation](self) for the layout and the crash-safety argument.
#[derive(Debug, Clone)]
pub struct FileTarget {
    dest: PathBuf,
    state_dir: PathBuf,
}

impl FileTarget {
    /// A target for the file at `dest`. Nothing is touched until a step is called; a `dest`
    /// that does not name a file (`/`, `..`) is reported by every step.
    pub fn new(dest: PathBuf) -> Self {
        let mut state_dir = dest.clone().into_os_string();
        state_dir.push(".flotilla");
        Self {
            dest,
            state_dir: PathBuf::from(state_dir),
        }
    }

    /// The file this target replaces.
    pub fn dest(&self) -> &Path {
        &self.dest
    }

    /// Where this target keeps staged, previous and marker files (`<dest>.flotilla`).
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    fn staged_path(&self, action_id: &str) -> PathBuf {
        self.state_dir.join(format!("staged-{action_id}"))
    }

    fn previous_name(action_id: &str) -> String {
        format!("previous-{action_id}")
    }

    fn previous_path(&self, action_id: &str) -> PathBuf {
        self.state_dir.join(Self::previous_name(action_id))
    }

    fn marker_path(&self) -> PathBuf {
        self.state_dir.join(MARKER)
    }

    fn require_file_dest(&self) -> Result<(), TargetError> {
        match self.dest.file_name() {
            Some(_) => Ok(()),
            None => Err(TargetError::NotUpdatable {
                path: self.dest.clone(),
                reason: "it does not name a file".to_owned(),
            }),
        }
    }

    /// The marker, if an action was ever activated here.
    fn read_marker(&self) -> Result<Option<Marker>, TargetError> {
        read_state_file(self.marker_path(), Marker::parse)
    }

    fn write_marker(&self, marker: &Marker) -> io::Result<()> {
        atomic_write(self.marker_path(), marker.encode(&self.dest))
    }

    /// Creates the state directory if needed, durably (its entry in the parent directory must
    /// survive a power cut, or the staged file would vanish with it).
    fn ensure_state_dir(&self) -> io::Result<()> {
        create_private_dir(&self.state_dir)
    }

    /// Removes leftovers we own (staged and previous copies, restore scratch, temp files of
    /// interrupted writes) except `keep`. Best effort: garbage never decides whether an update
    /// succeeds, so failures are logged, not returned.
    fn sweep(&self, keep: &[&str]) {
        let entries = match fs::read_dir(&self.state_dir) {
            Ok(entries) => entries,
            Err(e) => {
                if e.kind() != io::ErrorKind::NotFound {
                    warn!(dir = %self.state_dir.display(), error = %e, "cannot list update state to clean it up");
                }
                return;
            }
        };
        let mut removed = false;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let ours = name.starts_with("staged-")
                || name.starts_with("previous-")
                || name == RESTORING
                || name.contains(TEMP_MARKER);
            if !ours || keep.contains(&name) {
                continue;
            }
            match fs::remove_file(entry.path()) {
                Ok(()) => removed = true,
                Err(e) => {
                    warn!(path = %entry.path().display(), error = %e, "cannot remove stale update file")
                }
            }
        }
        if removed {
            if let Err(e) = fsync_dir(&self.state_dir) {
                warn!(dir = %self.state_dir.display(), error = %e, "cannot sync update state directory");
            }
        }
    }

    /// First half of `activate`: keep the current destination as `previous-<action>`, give the
    /// staged file its final mode and owner, and commit the marker. After this returns, the
    /// previous copy for this action is never touched again.
    fn save_previous(&self, ctx: &ActionContext, action_id: &str) -> Result<Marker, TargetError> {
        let current = match fs::symlink_metadata(&self.dest) {
            Ok(meta) => Some(meta),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(source) => {
                return Err(TargetError::Activate {
                    path: self.dest.clone(),
                    source,
                })
            }
        };
        let (previous, mode, owner) = match current {
            Some(meta) if !meta.is_file() => {
                return Err(TargetError::NotUpdatable {
                    path: self.dest.clone(),
                    reason: not_a_file(&meta),
                })
            }
            Some(meta) => {
                let path = self.previous_path(action_id);
                atomic_copy(&self.dest, &path)
                    .map_err(|source| TargetError::Activate { path, source })?;
                (
                    Previous::Present,
                    meta.mode() & 0o7777,
                    Some(Owner {
                        uid: meta.uid(),
                        gid: meta.gid(),
                    }),
                )
            }
            None => (Previous::Absent, DEFAULT_MODE, None),
        };
        let marker = Marker {
            action_id: action_id.to_owned(),
            // The marker is line-based; a release name is informational and must not break it.
            release: ctx.release.replace(['\n', '\r'], " "),
            phase: Phase::Activated,
            previous,
            mode,
            owner,
        };
        // Before the commit point on purpose: if the owner cannot be given (an unprivileged
        // agent, a file owned by someone else), the action fails while it is still only staged,
        // and a rollback just discards it instead of tripping over the same chown.
        let staged = self.staged_path(action_id);
        apply_metadata(&staged, &marker).map_err(|source| TargetError::Activate {
            path: staged,
            source,
        })?;
        self.write_marker(&marker)
            .map_err(|source| TargetError::Activate {
                path: self.marker_path(),
                source,
            })?;
        Ok(marker)
    }

    /// Gives `path` the old file's mode and owner and renames it over the destination. Used for
    /// both directions: staged -> dest and restoring -> dest.
    fn put_in_place(&self, path: &Path, marker: &Marker) -> io::Result<()> {
        apply_metadata(path, marker)?;
        atomic_rename(path, &self.dest)
    }

    /// Puts back what was there before `marker`'s action activated.
    fn restore(&self, marker: &Marker) -> Result<(), TargetError> {
        match marker.previous {
            Previous::Present => {
                let previous = self.previous_path(&marker.action_id);
                let restoring = self.state_dir.join(RESTORING);
                atomic_copy(&previous, &restoring).map_err(|source| TargetError::Rollback {
                    path: previous,
                    source,
                })?;
                self.put_in_place(&restoring, marker)
                    .map_err(|source| TargetError::Rollback {
                        path: self.dest.clone(),
                        source,
                    })
            }
            Previous::Absent => {
                match fs::remove_file(&self.dest) {
                    Ok(()) => {}
                    // Already gone: a repeated rollback, or activation never got to the rename.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(source) => {
                        return Err(TargetError::Rollback {
                            path: self.dest.clone(),
                            source,
                        })
                    }
                }
                let dir = parent_dir(&self.dest);
                fsync_dir(dir).map_err(|source| TargetError::Rollback {
                    path: dir.to_path_buf(),
                    source,
                })
            }
        }
    }
}

impl UpdateTarget for FileTarget {
    fn kind(&self) -> &'static str {
        "file"
    }

    fn check(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        ctx.validate_action_id()?;
        self.require_file_dest()?;
        let dir = parent_dir(&self.dest);
        match fs::metadata(dir) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => {
                return Err(TargetError::NotUpdatable {
                    path: dir.to_path_buf(),
                    reason: "it is not a directory".to_owned(),
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(TargetError::NotUpdatable {
                    path: dir.to_path_buf(),
                    reason: "the directory of the file to update does not exist".to_owned(),
                })
            }
            Err(source) => {
                return Err(TargetError::Check {
                    path: dir.to_path_buf(),
                    source,
                })
            }
        }
        match fs::symlink_metadata(&self.dest) {
            Ok(meta) if !meta.is_file() => {
                return Err(TargetError::NotUpdatable {
                    path: self.dest.clone(),
                    reason: not_a_file(&meta),
                })
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(TargetError::Check {
                    path: self.dest.clone(),
                    source,
                })
            }
        }
        match fs::symlink_metadata(&self.state_dir) {
            Ok(meta) if meta.is_dir() => probe_writable(&self.state_dir, "probe")?,
            Ok(_) => {
                return Err(TargetError::NotUpdatable {
                    path: self.state_dir.clone(),
                    reason: "flotilla keeps its update state for this file here, but something \
                             else is in the way; move it elsewhere"
                        .to_owned(),
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(TargetError::Check {
                    path: self.state_dir.clone(),
                    source,
                })
            }
        }
        // The rename into place needs write access to the directory itself; a read-only root
        // file system is the classic edge-device surprise.
        let mut probe_name = self.dest.file_name().unwrap_or_default().to_os_string();
        probe_name.push(".flotilla-check");
        probe_writable(dir, &probe_name)?;
        // Damaged state would stop activate or rollback later; better to say so before staging.
        self.read_marker()?;
        Ok(())
    }

    fn stage(&self, ctx: &ActionContext, artifact: &Path) -> Result<(), TargetError> {
        let action_id = ctx.validate_action_id()?;
        self.require_file_dest()?;
        let marker = self.read_marker()?;
        if marker.as_ref().is_some_and(|m| m.action_id == action_id) {
            return Err(TargetError::AlreadyActivated {
                action_id: action_id.to_owned(),
                path: self.dest.clone(),
            });
        }
        // Look at the artifact before creating anything, so a bad one leaves no trace.
        match fs::metadata(artifact) {
            Ok(meta) if meta.is_file() => {}
            Ok(meta) => {
                return Err(TargetError::Stage {
                    path: artifact.to_path_buf(),
                    source: io::Error::new(io::ErrorKind::InvalidInput, not_a_file(&meta)),
                })
            }
            Err(source) => {
                return Err(TargetError::Stage {
                    path: artifact.to_path_buf(),
                    source,
                })
            }
        }
        self.ensure_state_dir()
            .map_err(|source| TargetError::Stage {
                path: self.state_dir.clone(),
                source,
            })?;
        // Abandoned stages and interrupted writes of earlier actions would otherwise pile up on
        // a device with little storage. The committed action's previous copy must stay.
        let keep = marker.as_ref().map(|m| Self::previous_name(&m.action_id));
        self.sweep(&keep.iter().map(String::as_str).collect::<Vec<_>>());

        let staged = self.staged_path(action_id);
        // A repeated stage simply replaces the staged copy: nothing live depends on it yet.
        let bytes = atomic_copy(artifact, &staged).map_err(|source| TargetError::Stage {
            path: staged.clone(),
            source,
        })?;
        info!(
            action_id,
            release = %ctx.release,
            dest = %self.dest.display(),
            bytes,
            "staged file update"
        );
        Ok(())
    }

    fn activate(&self, ctx: &ActionContext) -> Result<Activation, TargetError> {
        let action_id = ctx.validate_action_id()?;
        self.require_file_dest()?;
        let staged = self.staged_path(action_id);
        let staged_exists = exists(&staged).map_err(|source| TargetError::Activate {
            path: staged.clone(),
            source,
        })?;

        let marker = match self.read_marker()? {
            Some(marker) if marker.action_id == action_id => {
                if marker.phase == Phase::RolledBack {
                    return Err(TargetError::RolledBack {
                        action_id: action_id.to_owned(),
                        path: self.dest.clone(),
                    });
                }
                // A repeated call: the previous copy is already committed. Never save again,
                // or the new content would become "previous".
                debug!(action_id, dest = %self.dest.display(), "activation already committed");
                marker
            }
            _ => {
                if !staged_exists {
                    return Err(TargetError::NotStaged {
                        action_id: action_id.to_owned(),
                        path: self.dest.clone(),
                    });
                }
                self.save_previous(ctx, action_id)?
            }
        };

        if staged_exists {
            self.put_in_place(&staged, &marker)
                .map_err(|source| TargetError::Activate {
                    path: self.dest.clone(),
                    source,
                })?;
            info!(action_id, release = %ctx.release, dest = %self.dest.display(), "activated file update");
        } else {
            // The rename is atomic: no staged file means it already happened.
            debug!(action_id, dest = %self.dest.display(), "file update already in place");
        }
        let previous = Self::previous_name(action_id);
        self.sweep(&[previous.as_str()]);
        Ok(Activation::Done)
    }

    fn confirm(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        let action_id = ctx.validate_action_id()?;
        self.require_file_dest()?;
        let not_activated = || TargetError::NotActivated {
            action_id: action_id.to_owned(),
            path: self.dest.clone(),
        };
        let Some(marker) = self.read_marker()? else {
            return Err(not_activated());
        };
        if marker.action_id != action_id {
            return Err(not_activated());
        }
        match marker.phase {
            Phase::RolledBack => Err(TargetError::RolledBack {
                action_id: action_id.to_owned(),
                path: self.dest.clone(),
            }),
            Phase::Confirmed => {
                debug!(action_id, dest = %self.dest.display(), "file update already confirmed");
                Ok(())
            }
            Phase::Activated => {
                let staged = self.staged_path(action_id);
                let staged_exists = exists(&staged).map_err(|source| TargetError::Confirm {
                    path: staged.clone(),
                    source,
                })?;
                if staged_exists {
                    // The switch never happened (activate was interrupted and not repeated):
                    // confirming would report as installed what the device is not running.
                    return Err(not_activated());
                }
                self.write_marker(&Marker {
                    phase: Phase::Confirmed,
                    ..marker
                })
                .map_err(|source| TargetError::Confirm {
                    path: self.marker_path(),
                    source,
                })?;
                // Keep the previous copy: a later signed rollback may return to it.
                let previous = Self::previous_name(action_id);
                self.sweep(&[previous.as_str()]);
                info!(action_id, release = %ctx.release, dest = %self.dest.display(), "confirmed file update");
                Ok(())
            }
        }
    }

    fn rollback(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        let action_id = ctx.validate_action_id()?;
        self.require_file_dest()?;
        match self.read_marker()? {
            Some(marker) if marker.action_id == action_id => {
                if marker.phase == Phase::RolledBack {
                    debug!(action_id, dest = %self.dest.display(), "file update already rolled back");
                    return Ok(());
                }
                // Restoring is repeatable (copy, then rename), so a crash anywhere before the
                // marker below just means doing it again.
                self.restore(&marker)?;
                self.write_marker(&Marker {
                    phase: Phase::RolledBack,
                    ..marker
                })
                .map_err(|source| TargetError::Rollback {
                    path: self.marker_path(),
                    source,
                })?;
                // The previous content is live again; nothing is left to return to.
                self.sweep(&[]);
                info!(action_id, release = %ctx.release, dest = %self.dest.display(), "rolled back file update");
                Ok(())
            }
            _ => {
                let staged = self.staged_path(action_id);
                match fs::remove_file(&staged) {
                    Ok(()) => {
                        // Staged but never activated: the running file was never touched.
                        fsync_dir(&self.state_dir).map_err(|source| TargetError::Rollback {
                            path: self.state_dir.clone(),
                            source,
                        })?;
                        info!(action_id, dest = %self.dest.display(), "discarded staged file update that was never activated");
                        Ok(())
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        // Never undo another action's update on this one's behalf.
                        Err(TargetError::NothingToRollBack {
                            path: self.dest.clone(),
                        })
                    }
                    Err(source) => Err(TargetError::Rollback {
                        path: staged,
                        source,
                    }),
                }
            }
        }
    }

    fn activate_is_repeatable(&self) -> bool {
        true
    }

    /// The installed file: a new version of it often shares most of its blocks.
    fn block_sources(&self) -> Vec<PathBuf> {
        if self.dest.is_file() {
            vec![self.dest.clone()]
        } else {
            Vec::new()
        }
    }
}

/// Gives the file at `path` the mode and owner recorded in `marker` and makes that durable.
/// Repeatable: a second call finds nothing to change.
fn apply_metadata(path: &Path, marker: &Marker) -> io::Result<()> {
    let file = File::open(path)?;
    if let Some(owner) = marker.owner {
        let meta = file.metadata()?;
        // chown only when needed: it needs privileges, and it clears setuid bits (which is why
        // it comes before the chmod).
        if (meta.uid(), meta.gid()) != (owner.uid, owner.gid) {
            std::os::unix::fs::fchown(&file, Some(owner.uid), Some(owner.gid))?;
        }
    }
    file.set_permissions(Permissions::from_mode(marker.mode))?;
    // Mode and owner live in the inode; make them durable before the name flips.
    file.sync_all()
}

/// Does `path` exist? Unlike `Path::exists`, an I/O error is an error, not "no".
fn exists(path: &Path) -> io::Result<bool> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Why something that should be a regular file is not, in an operator's words.
fn not_a_file(meta: &Metadata) -> String {
    let file_type = meta.file_type();
    if file_type.is_dir() {
        "it is a directory; the file target replaces a single file".to_owned()
    } else if file_type.is_symlink() {
        "it is a symbolic link; configure the file it points to instead".to_owned()
    } else {
        "it is not a regular file".to_owned()
    }
}

/// Creates and removes a scratch file in `dir`: the only reliable way to learn whether we may
/// write there (permissions, ACLs, read-only mounts).
fn probe_writable(dir: &Path, name: impl AsRef<OsStr>) -> Result<(), TargetError> {
    let probe = dir.join(name.as_ref());
    let check = |source| TargetError::Check {
        path: dir.to_path_buf(),
        source,
    };
    fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&probe)
        .map_err(check)?;
    fs::remove_file(&probe).map_err(check)
}

/// Where an action stands on this target, as recorded in the marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Activated,
    Confirmed,
    RolledBack,
}

impl Phase {
    fn as_str(self) -> &'static str {
        match self {
            Phase::Activated => "activated",
            Phase::Confirmed => "confirmed",
            Phase::RolledBack => "rolled-back",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "activated" => Some(Phase::Activated),
            "confirmed" => Some(Phase::Confirmed),
            "rolled-back" => Some(Phase::RolledBack),
            _ => None,
        }
    }
}

/// Whether the destination existed before the action activated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Previous {
    /// Kept as `previous-<action>`; rollback restores it.
    Present,
    /// Rollback removes the destination.
    Absent,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Owner {
    uid: u32,
    gid: u32,
}

/// The commit record of an activation. Plain `key=value` text so an operator can read it with
/// `cat` on a device without tools.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Marker {
    action_id: String,
    release: String,
    phase: Phase,
    previous: Previous,
    /// Mode given to the file put in place (the old file's, or the default).
    mode: u32,
    /// Owner given to the file put in place; `None` keeps the agent's own.
    owner: Option<Owner>,
}

impl Marker {
    fn encode(&self, dest: &Path) -> String {
        let mut text = format!(
            "# flotilla file target state for {}; written atomically, do not edit\n\
             action={}\nrelease={}\nphase={}\nprevious={}\nmode={:04o}\n",
            dest.display(),
            self.action_id,
            self.release,
            self.phase.as_str(),
            match self.previous {
                Previous::Present => "present",
                Previous::Absent => "absent",
            },
            self.mode,
        );
        if let Some(owner) = self.owner {
            text.push_str(&format!("owner={}:{}\n", owner.uid, owner.gid));
        }
        text
    }

    fn parse(text: &str) -> Result<Self, String> {
        let (mut action_id, mut release, mut phase, mut previous, mut mode, mut owner) =
            (None, None, None, None, None, None);
        for entry in state_lines(text) {
            let (key, value) = entry?;
            match key {
                "action" => action_id = Some(value.to_owned()),
                "release" => release = Some(value.to_owned()),
                "phase" => {
                    phase = Some(
                        Phase::parse(value).ok_or_else(|| format!("unknown phase {value:?}"))?,
                    )
                }
                "previous" => {
                    previous = Some(match value {
                        "present" => Previous::Present,
                        "absent" => Previous::Absent,
                        _ => {
                            return Err(format!(
                                "previous must be present or absent, not {value:?}"
                            ))
                        }
                    })
                }
                "mode" => {
                    mode = Some(
                        u32::from_str_radix(value, 8)
                            .ok()
                            .filter(|m| *m <= 0o7777)
                            .ok_or_else(|| format!("mode {value:?} is not an octal file mode"))?,
                    )
                }
                "owner" => {
                    owner = Some(
                        value
                            .split_once(':')
                            .and_then(|(uid, gid)| {
                                Some(Owner {
                                    uid: uid.parse().ok()?,
                                    gid: gid.parse().ok()?,
                                })
                            })
                            .ok_or_else(|| format!("owner {value:?} is not uid:gid"))?,
                    )
                }
                // Unknown keys come from a newer agent; ignoring them keeps a downgrade working.
                _ => {}
            }
        }
        let action_id: String = action_id.ok_or("no action= line")?;
        // The id names files we read and remove; a tampered marker must not steer that.
        ActionContext::new(action_id.as_str(), "", "")
            .validate_action_id()
            .map_err(|e| e.to_string())?;
        Ok(Marker {
            action_id,
            release: release.unwrap_or_default(),
            phase: phase.ok_or("no phase= line")?,
            previous: previous.ok_or("no previous= line")?,
            mode: mode.ok_or("no mode= line")?,
            owner,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A destination in a fresh directory, optionally with initial content.
    struct Fixture {
        dir: tempfile::TempDir,
        dest: PathBuf,
    }

    impl Fixture {
        fn new(initial: Option<&str>) -> Self {
            let dir = tempfile::tempdir().expect("tempdir");
            let dest = dir.path().join("app.conf");
            if let Some(content) = initial {
                fs::write(&dest, content).expect("seed dest");
            }
            Self { dir, dest }
        }

        /// A fresh instance, as a restarted agent would build it.
        fn target(&self) -> FileTarget {
            FileTarget::new(self.dest.clone())
        }

        fn artifact(&self, content: &str) -> PathBuf {
            let path = self.dir.path().join(format!("artifact-{}", content.len()));
            fs::write(&path, content).expect("write artifact");
            path
        }

        fn content(&self) -> Option<String> {
            match fs::read_to_string(&self.dest) {
                Ok(s) => Some(s),
                Err(e) if e.kind() == io::ErrorKind::NotFound => None,
                Err(e) => panic!("read dest: {e}"),
            }
        }

        fn mode(&self) -> u32 {
            fs::metadata(&self.dest).expect("dest").permissions().mode() & 0o7777
        }

        fn state_files(&self) -> Vec<String> {
            let mut names: Vec<String> = fs::read_dir(self.target().state_dir())
                .expect("state dir")
                .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        }

        fn install(&self, id: &str, content: &str) {
            let (t, c) = (self.target(), ctx(id));
            t.stage(&c, &self.artifact(content)).expect("stage");
            t.activate(&c).expect("activate");
            t.confirm(&c).expect("confirm");
        }
    }

    fn ctx(id: &str) -> ActionContext {
        ActionContext::new(id, "fw-2.4.0", "app.conf")
    }

    #[test]
    fn new_file_keeps_the_mode_of_the_file_it_replaces() {
        let f = Fixture::new(Some("old"));
        fs::set_permissions(&f.dest, Permissions::from_mode(0o600)).expect("chmod");
        let artifact = f.artifact("new");
        fs::set_permissions(&artifact, Permissions::from_mode(0o755)).expect("chmod");
        let (t, c) = (f.target(), ctx("a1"));
        t.stage(&c, &artifact).expect("stage");
        t.activate(&c).expect("activate");
        assert_eq!(f.content().as_deref(), Some("new"));
        assert_eq!(f.mode(), 0o600);
    }

    #[test]
    fn owner_and_setuid_mode_of_the_old_file_survive_update_and_rollback() {
        let f = Fixture::new(Some("old"));
        // Only root may give a file away; elsewhere there is nothing to observe.
        if let Err(e) = std::os::unix::fs::chown(&f.dest, Some(4242), Some(4343)) {
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
            eprintln!("skipped: not running as root");
            return;
        }
        fs::set_permissions(&f.dest, Permissions::from_mode(0o4750)).expect("chmod");
        let owner_and_mode = |f: &Fixture| {
            let meta = fs::metadata(&f.dest).expect("dest");
            (meta.uid(), meta.gid(), meta.mode() & 0o7777)
        };
        let (t, c) = (f.target(), ctx("a1"));
        t.stage(&c, &f.artifact("new")).expect("stage");
        t.activate(&c).expect("activate");
        assert_eq!(f.content().as_deref(), Some("new"));
        assert_eq!(owner_and_mode(&f), (4242, 4343, 0o4750));
        t.rollback(&c).expect("rollback");
        assert_eq!(f.content().as_deref(), Some("old"));
        assert_eq!(owner_and_mode(&f), (4242, 4343, 0o4750));
    }

    #[test]
    fn a_file_that_did_not_exist_gets_mode_0644() {
        let f = Fixture::new(None);
        let artifact = f.artifact("new");
        fs::set_permissions(&artifact, Permissions::from_mode(0o600)).expect("chmod");
        let (t, c) = (f.target(), ctx("a1"));
        t.stage(&c, &artifact).expect("stage");
        t.activate(&c).expect("activate");
        assert_eq!(f.mode(), 0o644);
    }

    #[test]
    fn rollback_restores_the_old_mode_too() {
        let f = Fixture::new(Some("old"));
        fs::set_permissions(&f.dest, Permissions::from_mode(0o640)).expect("chmod");
        let (t, c) = (f.target(), ctx("a1"));
        t.stage(&c, &f.artifact("new")).expect("stage");
        t.activate(&c).expect("activate");
        fs::set_permissions(&f.dest, Permissions::from_mode(0o777)).expect("chmod");
        t.rollback(&c).expect("rollback");
        assert_eq!(f.content().as_deref(), Some("old"));
        assert_eq!(f.mode(), 0o640);
    }

    #[test]
    fn crash_after_the_commit_point_resumes_and_rollback_returns_the_original() {
        let f = Fixture::new(Some("original"));
        let c = ctx("a1");
        let before_crash = f.target();
        before_crash.stage(&c, &f.artifact("new")).expect("stage");
        // Killed right after the marker was written, before the rename.
        before_crash.save_previous(&c, "a1").expect("first half");
        assert_eq!(f.content().as_deref(), Some("original"));

        let restarted = f.target();
        restarted.activate(&c).expect("repeated activate");
        assert_eq!(f.content().as_deref(), Some("new"));
        restarted.rollback(&c).expect("rollback");
        assert_eq!(f.content().as_deref(), Some("original"));
    }

    #[test]
    fn crash_before_the_commit_point_does_not_spoil_the_earlier_update() {
        let f = Fixture::new(Some("v1"));
        f.install("a1", "v2");
        let c = ctx("a2");
        f.target()
            .stage(&c, &f.artifact("v3 longer"))
            .expect("stage");
        // Killed while saving the previous copy for a2: the marker still names a1.
        atomic_copy(&f.dest, f.target().previous_path("a2")).expect("partial activate");

        let restarted = f.target();
        restarted
            .rollback(&c)
            .expect("a2 never switched: discard it");
        assert_eq!(f.content().as_deref(), Some("v2"));
        // A later signed rollback of a1 still goes back to v1, not to a copy of v2.
        restarted.rollback(&ctx("a1")).expect("rollback a1");
        assert_eq!(f.content().as_deref(), Some("v1"));
    }

    #[test]
    fn a_confirmed_update_can_still_be_rolled_back_later() {
        let f = Fixture::new(Some("old"));
        f.install("a1", "new");
        assert_eq!(f.state_files(), ["activated", "previous-a1"]);
        f.target().rollback(&ctx("a1")).expect("signed rollback");
        assert_eq!(f.content().as_deref(), Some("old"));
        assert_eq!(
            f.state_files(),
            ["activated"],
            "no copies left once rolled back"
        );
    }

    #[test]
    fn the_next_update_rolls_back_to_the_previous_release_not_the_first() {
        let f = Fixture::new(Some("v1"));
        f.install("a1", "v2");
        f.install("a2", "v3 bigger");
        assert_eq!(f.state_files(), ["activated", "previous-a2"]);
        let t = f.target();
        t.rollback(&ctx("a2")).expect("rollback");
        assert_eq!(f.content().as_deref(), Some("v2"));
        // Only one step back is kept, and another action's rollback is not performed for it.
        let err = t.rollback(&ctx("a1")).expect_err("a1 is not the latest");
        assert!(
            matches!(err, TargetError::NothingToRollBack { .. }),
            "{err}"
        );
        assert_eq!(f.content().as_deref(), Some("v2"));
    }

    #[test]
    fn rollback_confirm_and_activate_repeat_safely() {
        let f = Fixture::new(Some("old"));
        let (t, c) = (f.target(), ctx("a1"));
        t.stage(&c, &f.artifact("new")).expect("stage");
        t.activate(&c).expect("activate");
        t.confirm(&c).expect("confirm");
        t.confirm(&c).expect("confirm again");
        assert_eq!(t.activate(&c).expect("activate again"), Activation::Done);
        assert_eq!(f.content().as_deref(), Some("new"));
        t.rollback(&c).expect("rollback");
        t.rollback(&c).expect("rollback again");
        assert_eq!(f.content().as_deref(), Some("old"));
    }

    #[test]
    fn a_rolled_back_action_cannot_be_activated_confirmed_or_staged_again() {
        let f = Fixture::new(Some("old"));
        let (t, c) = (f.target(), ctx("a1"));
        t.stage(&c, &f.artifact("new")).expect("stage");
        t.activate(&c).expect("activate");
        t.rollback(&c).expect("rollback");
        assert!(matches!(
            t.activate(&c),
            Err(TargetError::RolledBack { .. })
        ));
        assert!(matches!(t.confirm(&c), Err(TargetError::RolledBack { .. })));
        assert!(matches!(
            t.stage(&c, &f.artifact("newer")),
            Err(TargetError::AlreadyActivated { .. })
        ));
        assert_eq!(f.content().as_deref(), Some("old"));
    }

    #[test]
    fn activate_without_stage_changes_nothing() {
        let f = Fixture::new(Some("old"));
        let err = f.target().activate(&ctx("a1")).expect_err("not staged");
        assert!(matches!(&err, TargetError::NotStaged { action_id, .. } if action_id == "a1"));
        assert!(err.to_string().contains("must be staged"), "{err}");
        assert_eq!(f.content().as_deref(), Some("old"));
    }

    #[test]
    fn confirm_of_an_action_that_never_switched_is_refused() {
        let f = Fixture::new(Some("old"));
        let (t, c) = (f.target(), ctx("a1"));
        assert!(matches!(
            t.confirm(&c),
            Err(TargetError::NotActivated { .. })
        ));
        t.stage(&c, &f.artifact("new")).expect("stage");
        t.save_previous(&c, "a1").expect("interrupted activate");
        assert!(matches!(
            t.confirm(&c),
            Err(TargetError::NotActivated { .. })
        ));
        assert_eq!(f.content().as_deref(), Some("old"));
    }

    #[test]
    fn staging_twice_keeps_the_last_artifact_and_cleans_up() {
        let f = Fixture::new(Some("old"));
        let (t, c) = (f.target(), ctx("a1"));
        t.stage(&c, &f.artifact("first")).expect("stage");
        t.stage(&c, &f.artifact("second!")).expect("stage again");
        // An abandoned stage of another action is swept when a new one starts.
        t.stage(&ctx("a2"), &f.artifact("x")).expect("stage a2");
        t.stage(&c, &f.artifact("second!")).expect("stage a1 again");
        assert_eq!(f.state_files(), ["staged-a1"]);
        t.activate(&c).expect("activate");
        assert_eq!(f.content().as_deref(), Some("second!"));
        assert_eq!(f.state_files(), ["activated", "previous-a1"]);
    }

    #[test]
    fn leftovers_of_interrupted_writes_are_swept() {
        let f = Fixture::new(Some("old"));
        let t = f.target();
        t.ensure_state_dir().expect("state dir");
        fs::write(t.state_dir().join(".staged-a0.flotilla-tmp.99.0"), "junk").expect("junk");
        fs::write(t.state_dir().join(RESTORING), "junk").expect("junk");
        fs::write(t.state_dir().join("notes.txt"), "operator's").expect("foreign");
        t.stage(&ctx("a1"), &f.artifact("new")).expect("stage");
        assert_eq!(f.state_files(), ["notes.txt", "staged-a1"]);
    }

    #[test]
    fn hostile_action_ids_create_nothing() {
        let f = Fixture::new(Some("old"));
        let t = f.target();
        let c = ctx("../../evil");
        assert!(matches!(
            t.check(&c),
            Err(TargetError::InvalidActionId { .. })
        ));
        assert!(matches!(
            t.stage(&c, &f.artifact("x")),
            Err(TargetError::InvalidActionId { .. })
        ));
        assert!(matches!(
            t.activate(&c),
            Err(TargetError::InvalidActionId { .. })
        ));
        assert!(!t.state_dir().exists());
    }

    #[test]
    fn damaged_state_is_reported_and_nothing_is_changed() {
        let f = Fixture::new(Some("old"));
        let t = f.target();
        t.ensure_state_dir().expect("state dir");
        fs::write(t.state_dir().join(MARKER), "action=../x\nphase=activated\n").expect("junk");
        for err in [
            t.check(&ctx("a1")).expect_err("check"),
            t.rollback(&ctx("a1")).expect_err("rollback"),
            t.stage(&ctx("a1"), &f.artifact("new")).expect_err("stage"),
        ] {
            assert!(matches!(err, TargetError::CorruptState { .. }), "{err}");
            assert!(err.to_string().contains("is damaged"), "{err}");
        }
        assert_eq!(f.content().as_deref(), Some("old"));
    }

    #[test]
    fn check_accepts_a_writable_destination_and_leaves_no_trace() {
        let f = Fixture::new(Some("old"));
        f.target().check(&ctx("a1")).expect("check");
        let absent = Fixture::new(None);
        absent
            .target()
            .check(&ctx("a1"))
            .expect("check of a new file");
        let names: Vec<_> = fs::read_dir(f.dir.path()).expect("dir").collect();
        assert_eq!(names.len(), 1, "only app.conf");
    }

    #[test]
    fn check_refuses_what_it_cannot_replace() {
        let f = Fixture::new(None);
        let c = ctx("a1");

        let missing_dir = FileTarget::new(f.dir.path().join("no/such/dir/app.conf"));
        let err = missing_dir.check(&c).expect_err("missing dir");
        assert!(err.to_string().contains("does not exist"), "{err}");

        fs::create_dir(&f.dest).expect("mkdir");
        let err = f.target().check(&c).expect_err("directory");
        assert!(err.to_string().contains("is a directory"), "{err}");

        let link = f.dir.path().join("link.conf");
        std::os::unix::fs::symlink(&f.dest, &link).expect("symlink");
        let err = FileTarget::new(link).check(&c).expect_err("symlink");
        assert!(err.to_string().contains("symbolic link"), "{err}");

        let err = FileTarget::new(PathBuf::from("/"))
            .check(&c)
            .expect_err("root");
        assert!(matches!(err, TargetError::NotUpdatable { .. }), "{err}");
    }

    #[test]
    fn marker_round_trips_and_rejects_damage() {
        let marker = Marker {
            action_id: "a1".to_owned(),
            release: "fw-2.4.0".to_owned(),
            phase: Phase::Confirmed,
            previous: Previous::Present,
            mode: 0o4755,
            owner: Some(Owner {
                uid: 1000,
                gid: 100,
            }),
        };
        let text = marker.encode(Path::new("/etc/app.conf"));
        assert_eq!(Marker::parse(&text), Ok(marker.clone()));
        let without_owner = Marker {
            owner: None,
            previous: Previous::Absent,
            ..marker
        };
        let text = without_owner.encode(Path::new("/etc/app.conf"));
        assert_eq!(Marker::parse(&text), Ok(without_owner));

        for bad in [
            "",
            "phase=activated\nprevious=absent\nmode=0644\n",
            "action=a1\nphase=done\nprevious=absent\nmode=0644\n",
            "action=a1\nphase=activated\nprevious=maybe\nmode=0644\n",
            "action=a1\nphase=activated\nprevious=absent\nmode=999\n",
            "action=a1\nphase=activated\nprevious=absent\nmode=0644\nowner=root\n",
            "action=a1\ngarbage\n",
        ] {
            assert!(Marker::parse(bad).is_err(), "{bad:?} must be rejected");
        }
    }
}
