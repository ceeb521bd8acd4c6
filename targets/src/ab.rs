//! The `ab` target: writes an image into the inactive slot of an A/B pair, switches the boot slot
//! through a [`BootControl`] backend, confirms after the reboot, and notices when the bootloader
//! fell back.
//!
//! # Flow
//!
//! ```text
//! stage     the image streams from the artifact into the slot the device does NOT run
//!           (a block device, or an image file in tests), with a fixed buffer, then fsync
//! activate  one boot-environment write: flotilla_slot=<new>, upgrade_available=1,
//!           bootcount=0, bootlimit=1 (try once) -> Activation::RebootRequired
//! (reboot)  the bootloader tries the new slot once; if it never gets confirmed, the next boot
//!           falls back to the old slot (see crate::bootctl for the boot script contract)
//! confirm   from the new boot, with a new target instance: the new slot is running ->
//!           upgrade_available=0, bootcount=0. The old slot is running -> error: the bootloader
//!           fell back (the agent reports Failed { rolled_back: true })
//! rollback  flotilla_slot=<old>, upgrade_available=0 -> RebootRequired if the new slot runs
//! ```
//!
//! Which slot runs comes from the backend (`flotilla_booted`, written by the boot script).
//!
//! # State on disk
//!
//! `<state_dir>/ab-state` is a small `key=value` record, replaced atomically: the action, its
//! phase, the slot it came from and the slot it wrote. Its phases:
//!
//! ```text
//! staging --(image written and synced)--> staged --activate--> activated --confirm--> confirmed
//!    \                                       \                     \                    |
//!     +---------------------------------------+------rollback-------+--------------------+--> rolled-back
//! ```
//!
//! The record is written *before* the first byte goes into the inactive slot: that slot holds
//! the previous release, the only way back for the action that installed the running one. Once
//! staging of a new action begins, a rollback of the older action is refused
//! (`NothingToRollBack`) instead of booting a half-written slot. Only one step back is kept.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tracing::{debug, info};

use crate::bootctl::{BootControl, BootControlKind, BootEnv, Slot};
use crate::error::TargetError;
use crate::fs::{atomic_write, create_private_dir, parent_dir, read_state_file, state_lines};
use crate::process::{self, last_line};
use crate::target::{ActionContext, Activation, UpdateTarget};

/// Name of the state record inside the state directory.
const STATE_FILE: &str = "ab-state";
/// Size of the one buffer an image is streamed through.
const COPY_BUFFER: usize = 1024 * 1024;
/// How long the reboot command may take to return.
const REBOOT_TIMEOUT: Duration = Duration::from_secs(120);

/// How an [`AbTarget`] is set up; the agent's configuration fills it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbConfig {
    /// Slot `a` and slot `b`: block devices (`/dev/mmcblk0p2`) or, in tests, image files.
    pub slots: [PathBuf; 2],
    /// Where the boot slot is switched.
    pub bootctl: BootControlKind,
    /// Where the target keeps its state record (created if missing; its parent must exist).
    pub state_dir: PathBuf,
    /// Program and arguments that reboot the device, e.g. `["systemctl", "reboot"]`.
    pub reboot_command: Vec<String>,
}

/// An A/B slot pair switched through a boot-control backend.
///
/// See the [module documentation](self) for the flow and the state record.
#[derive(Debug)]
pub struct AbTarget {
    slots: [PathBuf; 2],
    bootctl: Box<dyn BootControl>,
    state_dir: PathBuf,
    reboot_command: Vec<String>,
}

impl AbTarget {
    /// A target for `config`. Checks the configuration only; nothing on the device is read or
    /// written until a step is called.
    pub fn new(config: AbConfig) -> Result<Self, TargetError> {
        let AbConfig {
            slots,
            bootctl,
            state_dir,
            reboot_command,
        } = config;
        for slot in &slots {
            if slot.as_os_str().is_empty() {
                return Err(TargetError::InvalidConfig {
                    field: "slots",
                    value: format!("{slots:?}"),
                    reason: "both slots must name a block device or image file".to_owned(),
                });
            }
        }
        if slots[0] == slots[1] {
            return Err(TargetError::InvalidConfig {
                field: "slots",
                value: format!("{slots:?}"),
                reason: "slot a and slot b must be different devices".to_owned(),
            });
        }
        if state_dir.as_os_str().is_empty() {
            return Err(TargetError::InvalidConfig {
                field: "state_dir",
                value: String::new(),
                reason: "the A/B target needs a directory for its state record".to_owned(),
            });
        }
        if reboot_command.first().is_none_or(|p| p.trim().is_empty()) {
            return Err(TargetError::InvalidConfig {
                field: "reboot_command",
                value: format!("{reboot_command:?}"),
                reason: "an A/B update only goes live after a reboot; name a program such as \
                         [\"systemctl\", \"reboot\"]"
                    .to_owned(),
            });
        }
        Ok(Self {
            slots,
            bootctl: bootctl.open(),
            state_dir,
            reboot_command,
        })
    }

    /// The device of `slot`.
    pub fn slot_path(&self, slot: Slot) -> &Path {
        &self.slots[slot.index()]
    }

    /// Where the state record lives.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// The slot the device runs now, as the boot-control backend reports it.
    pub fn running_slot(&self) -> Result<Slot, TargetError> {
        let env = self.bootctl.read()?;
        self.running(&env)
    }

    fn running(&self, env: &BootEnv) -> Result<Slot, TargetError> {
        env.running().ok_or_else(|| TargetError::BootControl {
            backend: self.bootctl.describe(),
            reason: "flotilla_booted is not set, so the slot the device runs is unknown; the \
                     boot script must set flotilla_booted to the slot it boots (see \
                     docs/targets.md)"
                .to_owned(),
        })
    }

    fn state_path(&self) -> PathBuf {
        self.state_dir.join(STATE_FILE)
    }

    fn read_state(&self) -> Result<Option<AbState>, TargetError> {
        read_state_file(self.state_path(), AbState::parse)
    }

    fn write_state(&self, state: &AbState) -> io::Result<()> {
        atomic_write(self.state_path(), state.encode())
    }

    fn ensure_state_dir(&self) -> io::Result<()> {
        create_private_dir(&self.state_dir)
    }

    /// How many bytes `slot` can hold: a block device's size, or unlimited for an image file.
    fn slot_capacity(&self, slot: Slot) -> Result<Option<u64>, TargetError> {
        let path = self.slot_path(slot);
        let meta = fs::metadata(path).map_err(|source| TargetError::Check {
            path: path.to_path_buf(),
            source,
        })?;
        let file_type = meta.file_type();
        if file_type.is_file() {
            Ok(None)
        } else if file_type.is_block_device() {
            let mut dev = File::open(path).map_err(|source| TargetError::Check {
                path: path.to_path_buf(),
                source,
            })?;
            let size = dev
                .seek(SeekFrom::End(0))
                .map_err(|source| TargetError::Check {
                    path: path.to_path_buf(),
                    source,
                })?;
            Ok(Some(size))
        } else {
            Err(TargetError::NotUpdatable {
                path: path.to_path_buf(),
                reason: format!(
                    "slot {slot} must be a block device or an image file, and this is neither"
                ),
            })
        }
    }

    /// Streams `artifact` into `slot` through one fixed buffer and syncs it. Returns the size.
    fn write_slot(&self, slot: Slot, artifact: &Path, expected: u64) -> Result<u64, TargetError> {
        let path = self.slot_path(slot);
        let stage_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| TargetError::Stage { path, source }
        };
        let mut src = File::open(artifact).map_err(stage_err(artifact))?;
        // No truncate: a block device cannot be truncated, and an image file is cut to size
        // below, after the new content is in.
        let mut dst = OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(stage_err(path))?;
        let mut buf = vec![0u8; COPY_BUFFER];
        let mut written: u64 = 0;
        loop {
            let n = match src.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(stage_err(artifact)(e)),
            };
            dst.write_all(&buf[..n]).map_err(stage_err(path))?;
            written += n as u64;
        }
        if written != expected {
            return Err(TargetError::Stage {
                path: artifact.to_path_buf(),
                source: io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("the artifact changed while it was written: {expected} bytes expected, {written} read"),
                ),
            });
        }
        if dst.metadata().map_err(stage_err(path))?.is_file() {
            dst.set_len(written).map_err(stage_err(path))?;
        }
        dst.sync_all().map_err(stage_err(path))?;
        Ok(written)
    }

    /// Rollback, answering whether the old slot runs now or after a reboot.
    fn roll_back(&self, ctx: &ActionContext) -> Result<Activation, TargetError> {
        let action_id = ctx.validate_action_id()?;
        let state = match self.read_state()? {
            Some(state) if state.action_id == action_id => state,
            _ => {
                return Err(TargetError::NothingToRollBack {
                    path: self.state_dir.clone(),
                })
            }
        };
        let rollback_err = |path: PathBuf| move |source| TargetError::Rollback { path, source };
        let mut env = self.bootctl.read()?;
        let running = self.running(&env)?;
        if env.slot != Some(state.from) || env.upgrade_available || env.bootcount != 0 {
            env.slot = Some(state.from);
            env.upgrade_available = false;
            env.bootcount = 0;
            self.bootctl.commit(&env)?;
        }
        if state.phase != Phase::RolledBack {
            self.write_state(&AbState {
                phase: Phase::RolledBack,
                ..state.clone()
            })
            .map_err(rollback_err(self.state_path()))?;
            info!(action_id, slot = %state.from, "A/B update rolled back");
        } else {
            debug!(action_id, "A/B update already rolled back");
        }
        Ok(if running == state.from {
            Activation::Done
        } else {
            Activation::RebootRequired
        })
    }
}

impl UpdateTarget for AbTarget {
    fn kind(&self) -> &'static str {
        "ab"
    }

    fn check(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        let action_id = ctx.validate_action_id()?;
        for slot in [Slot::A, Slot::B] {
            self.slot_capacity(slot)?;
        }
        match fs::metadata(&self.state_dir) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => {
                return Err(TargetError::NotUpdatable {
                    path: self.state_dir.clone(),
                    reason: "the A/B state directory is not a directory".to_owned(),
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let parent = parent_dir(&self.state_dir);
                if !parent.is_dir() {
                    return Err(TargetError::NotUpdatable {
                        path: self.state_dir.clone(),
                        reason: format!("its parent directory {} does not exist", parent.display()),
                    });
                }
            }
            Err(source) => {
                return Err(TargetError::Check {
                    path: self.state_dir.clone(),
                    source,
                })
            }
        }
        let state = self.read_state()?;
        let env = self.bootctl.read()?;
        let running = self.running(&env)?;
        if env.upgrade_available && state.as_ref().is_none_or(|s| s.action_id != action_id) {
            return Err(TargetError::NotUpdatable {
                path: self.slot_path(running.other()).to_path_buf(),
                reason: format!(
                    "slot {} is still on trial (upgrade_available=1); confirm or roll back the \
                     update in progress first",
                    env.slot.unwrap_or(running)
                ),
            });
        }
        Ok(())
    }

    fn stage(&self, ctx: &ActionContext, artifact: &Path) -> Result<(), TargetError> {
        let action_id = ctx.validate_action_id()?;
        let state = self.read_state()?;
        if let Some(s) = state.as_ref().filter(|s| s.action_id == action_id) {
            if !matches!(s.phase, Phase::Staging | Phase::Staged) {
                return Err(TargetError::AlreadyActivated {
                    action_id: action_id.to_owned(),
                    path: self.slot_path(s.to).to_path_buf(),
                });
            }
        }
        let size = match fs::metadata(artifact) {
            Ok(meta) if meta.is_file() => meta.len(),
            Ok(_) => {
                return Err(TargetError::Stage {
                    path: artifact.to_path_buf(),
                    source: io::Error::new(io::ErrorKind::InvalidInput, "it is not a regular file"),
                })
            }
            Err(source) => {
                return Err(TargetError::Stage {
                    path: artifact.to_path_buf(),
                    source,
                })
            }
        };
        let env = self.bootctl.read()?;
        let running = self.running(&env)?;
        if env.upgrade_available {
            return Err(TargetError::NotUpdatable {
                path: self.slot_path(running.other()).to_path_buf(),
                reason: "a slot is still on trial (upgrade_available=1); confirm or roll back \
                         the update in progress first"
                    .to_owned(),
            });
        }
        let to = running.other();
        if let Some(capacity) = self.slot_capacity(to)? {
            if size > capacity {
                return Err(TargetError::Stage {
                    path: artifact.to_path_buf(),
                    source: io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!(
                            "the image is {size} bytes but slot {to} ({}) holds only {capacity}",
                            self.slot_path(to).display()
                        ),
                    ),
                });
            }
        }
        self.ensure_state_dir()
            .map_err(|source| TargetError::Stage {
                path: self.state_dir.clone(),
                source,
            })?;
        let mut record = AbState {
            action_id: action_id.to_owned(),
            release: ctx.release.replace(['\n', '\r'], " "),
            phase: Phase::Staging,
            from: running,
            to,
            size,
        };
        // Committed before the first byte: from here on the older action's way back is gone.
        self.write_state(&record)
            .map_err(|source| TargetError::Stage {
                path: self.state_path(),
                source,
            })?;
        let written = self.write_slot(to, artifact, size)?;
        record.phase = Phase::Staged;
        self.write_state(&record)
            .map_err(|source| TargetError::Stage {
                path: self.state_path(),
                source,
            })?;
        info!(action_id, release = %ctx.release, slot = %to, bytes = written, "staged A/B image");
        Ok(())
    }

    fn activate(&self, ctx: &ActionContext) -> Result<Activation, TargetError> {
        let action_id = ctx.validate_action_id()?;
        let not_staged = || TargetError::NotStaged {
            action_id: action_id.to_owned(),
            path: self.state_dir.clone(),
        };
        let state = match self.read_state()? {
            Some(state) if state.action_id == action_id => state,
            _ => return Err(not_staged()),
        };
        match state.phase {
            Phase::Staging => return Err(not_staged()),
            Phase::RolledBack => {
                return Err(TargetError::RolledBack {
                    action_id: action_id.to_owned(),
                    path: self.slot_path(state.to).to_path_buf(),
                })
            }
            Phase::Confirmed => return Ok(Activation::Done),
            Phase::Staged | Phase::Activated => {}
        }
        let mut env = self.bootctl.read()?;
        let running = self.running(&env)?;
        let mark_activated = |state: &AbState| {
            if state.phase == Phase::Activated {
                return Ok(());
            }
            self.write_state(&AbState {
                phase: Phase::Activated,
                ..state.clone()
            })
            .map_err(|source| TargetError::Activate {
                path: self.state_path(),
                source,
            })
        };
        if running == state.to {
            if env.slot == Some(state.to) {
                // A power cut after the switch: the new slot already runs (on trial).
                mark_activated(&state)?;
                return Ok(Activation::Done);
            }
            return Err(TargetError::NotUpdatable {
                path: self.slot_path(state.to).to_path_buf(),
                reason: format!(
                    "slot {} runs but the bootloader is set to boot slot {}; the boot \
                     environment was changed behind flotilla's back",
                    state.to,
                    env.slot.map_or("(none)", Slot::name)
                ),
            });
        }
        if env.slot == Some(state.to) && env.upgrade_available {
            debug!(action_id, slot = %state.to, "A/B switch already committed");
        } else if state.phase == Phase::Activated {
            // It was switched, and the old slot runs with the switch gone: the bootloader fell
            // back. Switching again would loop through a broken image.
            return Err(TargetError::FellBack {
                action_id: action_id.to_owned(),
                tried: state.to.name().to_owned(),
                booted: running.name().to_owned(),
            });
        } else {
            env.slot = Some(state.to);
            env.upgrade_available = true;
            env.bootcount = 0;
            env.bootlimit = Some(1);
            self.bootctl.commit(&env)?;
            info!(action_id, release = %ctx.release, slot = %state.to, "A/B slot switched; reboot to try it");
        }
        mark_activated(&state)?;
        Ok(Activation::RebootRequired)
    }

    fn confirm(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        let action_id = ctx.validate_action_id()?;
        let state = match self.read_state()? {
            Some(state) if state.action_id == action_id => state,
            _ => {
                return Err(TargetError::NotActivated {
                    action_id: action_id.to_owned(),
                    path: self.state_dir.clone(),
                })
            }
        };
        match state.phase {
            Phase::Confirmed => return Ok(()),
            Phase::RolledBack => {
                return Err(TargetError::RolledBack {
                    action_id: action_id.to_owned(),
                    path: self.slot_path(state.to).to_path_buf(),
                })
            }
            Phase::Staging | Phase::Staged => {
                return Err(TargetError::NotActivated {
                    action_id: action_id.to_owned(),
                    path: self.slot_path(state.to).to_path_buf(),
                })
            }
            Phase::Activated => {}
        }
        let mut env = self.bootctl.read()?;
        let running = self.running(&env)?;
        if running != state.to {
            if env.slot == Some(state.to) && env.upgrade_available {
                return Err(TargetError::RebootPending {
                    action_id: action_id.to_owned(),
                    slot: state.to.name().to_owned(),
                    running: running.name().to_owned(),
                });
            }
            return Err(TargetError::FellBack {
                action_id: action_id.to_owned(),
                tried: state.to.name().to_owned(),
                booted: running.name().to_owned(),
            });
        }
        env.slot = Some(state.to);
        env.upgrade_available = false;
        env.bootcount = 0;
        self.bootctl.commit(&env)?;
        self.write_state(&AbState {
            phase: Phase::Confirmed,
            ..state
        })
        .map_err(|source| TargetError::Confirm {
            path: self.state_path(),
            source,
        })?;
        info!(action_id, release = %ctx.release, slot = %running, "confirmed A/B update");
        Ok(())
    }

    fn rollback(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        self.roll_back(ctx).map(|_| ())
    }

    fn rollback_activation(&self, ctx: &ActionContext) -> Result<Activation, TargetError> {
        self.roll_back(ctx)
    }

    fn reboot(&self) -> Result<(), TargetError> {
        let command = self.reboot_command.join(" ");
        let Some((program, args)) = self.reboot_command.split_first() else {
            return Err(TargetError::Reboot {
                command,
                reason: "no reboot command is configured".to_owned(),
            });
        };
        info!(command, "rebooting to switch A/B slots");
        let out =
            process::run(Command::new(program).args(args), None, REBOOT_TIMEOUT).map_err(|e| {
                TargetError::Reboot {
                    command: command.clone(),
                    reason: e.to_string(),
                }
            })?;
        if out.status.success() {
            Ok(())
        } else {
            Err(TargetError::Reboot {
                command,
                reason: format!(
                    "it failed ({}): {}",
                    out.status,
                    last_line(&out.stderr).unwrap_or_else(|| "it printed no error".to_owned())
                ),
            })
        }
    }

    fn activate_is_repeatable(&self) -> bool {
        true
    }

    /// The running slot (the installed release) and the other one (usually the release before):
    /// both are read only, at the block size of the new image.
    fn block_sources(&self) -> Vec<PathBuf> {
        match self.running_slot() {
            Ok(running) => vec![
                self.slot_path(running).to_owned(),
                self.slot_path(running.other()).to_owned(),
            ],
            Err(_) => Vec::new(),
        }
    }
}

/// Where an action stands on this slot pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Staging,
    Staged,
    Activated,
    Confirmed,
    RolledBack,
}

impl Phase {
    fn as_str(self) -> &'static str {
        match self {
            Phase::Staging => "staging",
            Phase::Staged => "staged",
            Phase::Activated => "activated",
            Phase::Confirmed => "confirmed",
            Phase::RolledBack => "rolled-back",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "staging" => Phase::Staging,
            "staged" => Phase::Staged,
            "activated" => Phase::Activated,
            "confirmed" => Phase::Confirmed,
            "rolled-back" => Phase::RolledBack,
            _ => return None,
        })
    }
}

/// The state record. Plain `key=value` text, readable with `cat` on a device.
#[derive(Debug, Clone, PartialEq, Eq)]
struct AbState {
    action_id: String,
    release: String,
    phase: Phase,
    /// The slot that ran when the action was staged: where a rollback returns.
    from: Slot,
    /// The slot the image was written to.
    to: Slot,
    /// Bytes of the image.
    size: u64,
}

impl AbState {
    fn encode(&self) -> String {
        format!(
            "# flotilla A/B target state; written atomically, do not edit\n\
             action={}\nrelease={}\nphase={}\nfrom={}\nto={}\nsize={}\n",
            self.action_id,
            self.release,
            self.phase.as_str(),
            self.from,
            self.to,
            self.size
        )
    }

    fn parse(text: &str) -> Result<Self, String> {
        let (mut action_id, mut release, mut phase, mut from, mut to, mut size) =
            (None, None, None, None, None, None);
        for entry in state_lines(text) {
            let (key, value) = entry?;
            let bad = || format!("{key}={value:?} is not valid");
            match key {
                "action" => {
                    ActionContext::new(value, "", "")
                        .validate_action_id()
                        .map_err(|_| bad())?;
                    action_id = Some(value.to_owned());
                }
                "release" => release = Some(value.to_owned()),
                "phase" => phase = Some(Phase::parse(value).ok_or_else(bad)?),
                "from" => from = Some(Slot::parse(value).ok_or_else(bad)?),
                "to" => to = Some(Slot::parse(value).ok_or_else(bad)?),
                "size" => size = Some(value.parse::<u64>().map_err(|_| bad())?),
                _ => return Err(format!("unknown key {key:?}")),
            }
        }
        let missing = |key: &str| format!("{key}= is missing");
        let (from, to) = (
            from.ok_or_else(|| missing("from"))?,
            to.ok_or_else(|| missing("to"))?,
        );
        if from == to {
            return Err(format!("from={from} and to={to} name the same slot"));
        }
        Ok(Self {
            action_id: action_id.ok_or_else(|| missing("action"))?,
            release: release.unwrap_or_default(),
            phase: phase.ok_or_else(|| missing("phase"))?,
            from,
            to,
            size: size.ok_or_else(|| missing("size"))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootctl::FileBootControl;

    struct Device {
        dir: tempfile::TempDir,
    }

    impl Device {
        fn new() -> Self {
            let dir = tempfile::tempdir().expect("tempdir");
            fs::write(dir.path().join("slot-a.img"), b"release one").expect("slot a");
            fs::write(dir.path().join("slot-b.img"), b"").expect("slot b");
            fs::write(
                dir.path().join("bootenv"),
                "flotilla_slot=a\nflotilla_booted=a\n",
            )
            .expect("env");
            Self { dir }
        }

        fn config(&self) -> AbConfig {
            let p = self.dir.path();
            AbConfig {
                slots: [p.join("slot-a.img"), p.join("slot-b.img")],
                bootctl: BootControlKind::File {
                    path: p.join("bootenv"),
                },
                state_dir: p.join("state"),
                reboot_command: vec!["true".to_owned()],
            }
        }

        fn target(&self) -> AbTarget {
            AbTarget::new(self.config()).expect("valid config")
        }

        fn boot(&self) -> Option<Slot> {
            FileBootControl::new(self.dir.path().join("bootenv"))
                .simulate_boot()
                .expect("boot")
        }

        fn artifact(&self, content: &[u8]) -> PathBuf {
            let path = self.dir.path().join("download");
            fs::write(&path, content).expect("artifact");
            path
        }

        fn env(&self) -> String {
            fs::read_to_string(self.dir.path().join("bootenv")).expect("env")
        }
    }

    fn ctx(id: &str) -> ActionContext {
        ActionContext::new(id, "os-2.0", "rootfs.img")
    }

    #[test]
    fn bad_configurations_are_refused_naming_the_field() {
        let d = Device::new();
        let same = AbConfig {
            slots: [d.dir.path().join("x"), d.dir.path().join("x")],
            ..d.config()
        };
        let err = AbTarget::new(same).expect_err("same slots");
        assert!(err.to_string().contains("invalid slots"), "{err}");
        let no_reboot = AbConfig {
            reboot_command: vec![],
            ..d.config()
        };
        let err = AbTarget::new(no_reboot).expect_err("no reboot");
        assert!(err.to_string().contains("invalid reboot_command"), "{err}");
    }

    #[test]
    fn block_sources_are_the_running_slot_then_the_other() {
        let d = Device::new();
        let p = d.dir.path();
        assert_eq!(
            d.target().block_sources(),
            [p.join("slot-a.img"), p.join("slot-b.img")]
        );
        fs::write(p.join("bootenv"), "flotilla_slot=a\n").expect("env");
        assert!(
            d.target().block_sources().is_empty(),
            "no running slot known, no sources"
        );
    }

    #[test]
    fn a_boot_script_that_does_not_record_the_booted_slot_is_named() {
        let d = Device::new();
        fs::write(d.dir.path().join("bootenv"), "flotilla_slot=a\n").expect("env");
        let err = d.target().check(&ctx("x")).expect_err("unknown slot");
        assert!(
            err.to_string().contains("flotilla_booted is not set"),
            "{err}"
        );
    }

    #[test]
    fn activation_arms_a_single_trial_and_confirm_commits_it() {
        let d = Device::new();
        let c = ctx("act-1");
        let t = d.target();
        t.check(&c).expect("check");
        t.stage(&c, &d.artifact(b"release two")).expect("stage");
        assert_eq!(
            fs::read(d.dir.path().join("slot-b.img")).expect("b"),
            b"release two"
        );
        assert_eq!(
            t.activate(&c).expect("activate"),
            Activation::RebootRequired
        );
        let env = d.env();
        for line in [
            "flotilla_slot=b",
            "upgrade_available=1",
            "bootcount=0",
            "bootlimit=1",
        ] {
            assert!(env.lines().any(|l| l == line), "{line} in {env}");
        }
        let err = t.confirm(&c).expect_err("not rebooted yet");
        assert!(matches!(err, TargetError::RebootPending { .. }), "{err}");

        assert_eq!(d.boot(), Some(Slot::B));
        let after = d.target();
        assert_eq!(after.running_slot().expect("running"), Slot::B);
        after.confirm(&c).expect("confirm");
        assert!(
            d.env().lines().any(|l| l == "upgrade_available=0"),
            "{}",
            d.env()
        );
        assert_eq!(d.boot(), Some(Slot::B), "stays on b after confirm");
    }

    #[test]
    fn a_fallback_is_reported_with_the_slot_the_bootloader_chose() {
        let d = Device::new();
        let c = ctx("act-2");
        let t = d.target();
        t.stage(&c, &d.artifact(b"broken")).expect("stage");
        t.activate(&c).expect("activate");
        d.boot(); // slot b is tried and hangs before the agent confirms
        d.boot(); // the bootloader gives up on it
        let err = d.target().confirm(&c).expect_err("fell back");
        assert!(matches!(err, TargetError::FellBack { .. }), "{err}");
        assert!(err.to_string().contains("fell back to slot a"), "{err}");
        let err = d.target().activate(&c).expect_err("no second try");
        assert!(matches!(err, TargetError::FellBack { .. }), "{err}");
        assert_eq!(
            d.target().rollback_activation(&c).expect("rollback"),
            Activation::Done,
            "the old slot already runs"
        );
    }

    #[test]
    fn a_trial_in_progress_blocks_a_new_stage() {
        let d = Device::new();
        let t = d.target();
        t.stage(&ctx("first"), &d.artifact(b"one")).expect("stage");
        t.activate(&ctx("first")).expect("activate");
        let err = t.check(&ctx("second")).expect_err("trial pending");
        assert!(err.to_string().contains("still on trial"), "{err}");
        let err = t
            .stage(&ctx("second"), &d.artifact(b"two"))
            .expect_err("trial pending");
        assert!(err.to_string().contains("still on trial"), "{err}");
    }

    #[test]
    fn staging_a_new_action_forgets_the_older_way_back() {
        let d = Device::new();
        let first = ctx("first");
        let t = d.target();
        t.stage(&first, &d.artifact(b"two")).expect("stage");
        t.activate(&first).expect("activate");
        d.boot();
        d.target().confirm(&first).expect("confirm");
        // The next action writes slot a, which held the way back for `first`.
        d.target()
            .stage(&ctx("second"), &d.artifact(b"three"))
            .expect("stage");
        let err = d.target().rollback(&first).expect_err("way back is gone");
        assert!(
            matches!(err, TargetError::NothingToRollBack { .. }),
            "{err}"
        );
        assert!(
            d.env().contains("flotilla_slot=b"),
            "still boots b: {}",
            d.env()
        );
    }

    #[test]
    fn a_slot_that_is_neither_device_nor_file_is_refused() {
        let d = Device::new();
        let mut config = d.config();
        config.slots[1] = d.dir.path().to_path_buf();
        let t = AbTarget::new(config).expect("config");
        let err = t.check(&ctx("x")).expect_err("a directory is not a slot");
        assert!(
            err.to_string().contains("slot b must be a block device"),
            "{err}"
        );
    }

    #[test]
    fn state_record_round_trips_and_rejects_damage() {
        let state = AbState {
            action_id: "a1".to_owned(),
            release: "os-2".to_owned(),
            phase: Phase::Activated,
            from: Slot::A,
            to: Slot::B,
            size: 42,
        };
        assert_eq!(AbState::parse(&state.encode()), Ok(state));
        for bad in [
            "",
            "action=a1\nphase=staged\nfrom=a\nto=a\nsize=1\n",
            "action=../x\nphase=staged\nfrom=a\nto=b\nsize=1\n",
            "action=a1\nphase=done\nfrom=a\nto=b\nsize=1\n",
            "action=a1\nphase=staged\nfrom=a\nto=b\n",
        ] {
            assert!(AbState::parse(bad).is_err(), "{bad:?} must be rejected");
        }
    }

    #[test]
    fn the_reboot_command_failure_is_reported() {
        let d = Device::new();
        let config = AbConfig {
            reboot_command: vec![
                "sh".into(),
                "-c".into(),
                "echo not permitted >&2; exit 1".into(),
            ],
            ..d.config()
        };
        let err = AbTarget::new(config)
            .expect("config")
            .reboot()
            .expect_err("fails");
        assert!(err.to_string().contains("not permitted"), "{err}");
        d.target()
            .reboot()
            .expect("`true` reboots nothing and succeeds");
    }
}
