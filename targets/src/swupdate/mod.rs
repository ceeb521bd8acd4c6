//! The `swupdate` target: installs a `.swu` image with SWUpdate, through a running SWUpdate
//! daemon's IPC socket or with `swupdate -i`, so devices whose images are built for SWUpdate
//! (files, raw partitions, a dual-copy rootfs) update through flotilla's rollouts.
//!
//! # Mapping (the full text is in `docs/targets.md`)
//!
//! - `check`: the `swupdate` program is an executable file and the state directory is usable.
//! - `stage`: the artifact must look like a `.swu` (a `newc`/`crc` cpio archive whose first
//!   member is `sw-description`, read from its first header only); it is copied into the state
//!   directory. Nothing runs yet: SWUpdate checks the signature and the hardware compatibility
//!   when it installs.
//! - `activate`: with `socket` set and a daemon listening there, the staged image goes to the
//!   daemon ([`daemon`]; its progress and messages go to the agent's log as they come).
//!   Otherwise (no `socket`, or nothing listens there: logged) `swupdate <args> -i <staged
//!   .swu>`, with the configured arguments (typically `-k cert.pem -H board:1.0`), every line it
//!   prints going to the agent's log. Either way a refusal carries SWUpdate's own error
//!   messages ("Signature verification failed", "Compatible SW not found", "HASH mismatch").
//!   With `reboot = true` (the image writes a rootfs copy) the answer is
//!   [`Activation::RebootRequired`] and the configured reboot command runs after the agent saved
//!   its state.
//! - `confirm`: the configured `confirm_command` (e.g. clearing a bootloader's upgrade
//!   variable), or nothing.
//! - `rollback`: before an install ran, the staged image is discarded. After one, the configured
//!   `rollback_command` runs (e.g. switching the bootloader back to the other copy); SWUpdate has
//!   no generic rollback, so without one a rollback of an installed image is refused with that
//!   reason. An install SWUpdate refused needs no undoing from flotilla: SWUpdate only writes
//!   what the image names, and checks signatures and compatibility before writing anything.
//!
//! # Layout
//!
//! - this file: configuration, the steps, the bookkeeping, `swupdate -i` and its error lines.
//! - [`daemon`]: the install through a running daemon's sockets.
//! - [`ipc`]: the byte layout of SWUpdate 2022.12's IPC messages, without I/O.
//!
//! Decision records 0048 (`swupdate -i`) and 0052 (the socket) say why. Installs are serialised
//! within the agent: SWUpdate binds fixed names (`@NotifyServer`), and its daemon takes one
//! install at a time.
//!
//! # Bookkeeping
//!
//! `<state_dir>/flotilla-swupdate-state` (action, phase, whether the last step needs a reboot)
//! and `<state_dir>/flotilla-swupdate.swu` (the staged image, kept until the action is confirmed
//! or rolled back). Every step is safe to call again after a kill -9: an interrupted install is
//! repeated from the start, as SWUpdate expects after a power cut (a daemon still busy with the
//! interrupted one is waited for first).

use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::{debug, info, warn};

use flotilla_protocol::artifact_type::{ArtifactType, Ends, HEAD_LEN};

use crate::error::TargetError;
use crate::fs::{atomic_copy, atomic_write, create_private_dir, read_state_file, state_lines};
use crate::process::{self, check_executable, last_line, LineSink, RunError};
use crate::target::{ActionContext, Activation, UpdateTarget};

pub(crate) mod daemon;
pub(crate) mod ipc;

use daemon::{DaemonError, DaemonInstall};

/// The bookkeeping record in the state directory.
const STATE_FILE: &str = "flotilla-swupdate-state";
/// The staged image in the state directory.
const STAGED_FILE: &str = "flotilla-swupdate.swu";
/// SWUpdate binds fixed socket names (`@NotifyServer`, `$TMPDIR/sockinstctrl`): two installs at
/// once would take them from each other, and the daemon refuses a second one.
static INSTALL_LOCK: Mutex<()> = Mutex::new(());

/// How a [`SwupdateTarget`] is set up; the agent's configuration fills it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwupdateConfig {
    /// The `swupdate` program, by absolute path (Debian: `/usr/bin/swupdate`).
    pub program: PathBuf,
    /// Arguments before `-i <image>`, e.g. `["-k", "/etc/swupdate/cert.pem", "-H",
    /// "board:1.0"]`.
    pub args: Vec<String>,
    /// The target's own directory: its record and the staged image (created if missing).
    pub state_dir: PathBuf,
    /// How long one install may run before SWUpdate is killed; default 30 minutes.
    pub install_timeout: Duration,
    /// How long the confirm, rollback and reboot commands may run; default 5 minutes.
    pub command_timeout: Duration,
    /// The image writes something that only runs after a reboot (a rootfs copy): `activate`
    /// and `rollback` then answer [`Activation::RebootRequired`].
    pub reboot: bool,
    /// Program and arguments that reboot the device; required with `reboot`.
    pub reboot_command: Option<Vec<String>>,
    /// Runs at `confirm`, e.g. `["fw_setenv", "upgrade_available", "0"]`.
    pub confirm_command: Option<Vec<String>>,
    /// Runs at `rollback` of an installed image, e.g. switching the bootloader back.
    pub rollback_command: Option<Vec<String>>,
    /// A running SWUpdate daemon's install socket (`/tmp/sockinstctrl` for Debian's): when
    /// something listens there, images are installed through it instead of `swupdate -i`.
    pub socket: Option<PathBuf>,
    /// The daemon's progress socket, for the log; default `swupdateprog` beside `socket`.
    pub progress_socket: Option<PathBuf>,
}

impl SwupdateConfig {
    /// Debian's `swupdate`, no arguments, default timeouts, no reboot and no commands.
    pub fn new(state_dir: PathBuf) -> Self {
        Self {
            program: PathBuf::from("/usr/bin/swupdate"),
            args: Vec::new(),
            state_dir,
            install_timeout: Duration::from_secs(30 * 60),
            command_timeout: Duration::from_secs(5 * 60),
            reboot: false,
            reboot_command: None,
            confirm_command: None,
            rollback_command: None,
            socket: None,
            progress_socket: None,
        }
    }

    /// The progress socket to follow: the configured one, or `swupdateprog` beside `socket`
    /// (SWUpdate puts both in `$TMPDIR`).
    pub fn progress_socket(&self) -> Option<PathBuf> {
        self.progress_socket.clone().or_else(|| {
            self.socket
                .as_ref()
                .and_then(|s| s.parent())
                .map(|dir| dir.join("swupdateprog"))
        })
    }
}

/// An update target that installs `.swu` images with SWUpdate.
///
/// See the [module documentation](self) and `docs/targets.md` for the mapping.
#[derive(Debug, Clone)]
pub struct SwupdateTarget {
    config: SwupdateConfig,
}

impl SwupdateTarget {
    /// A target for `config`. Checks the configuration only; SWUpdate first runs at `activate`.
    pub fn new(config: SwupdateConfig) -> Result<Self, TargetError> {
        let invalid = |field: &'static str, value: String, reason: &str| {
            Err(TargetError::InvalidConfig {
                field,
                value,
                reason: reason.to_owned(),
            })
        };
        if !config.program.is_absolute() {
            return invalid(
                "path",
                config.program.display().to_string(),
                "the swupdate program must be given by absolute path",
            );
        }
        if config.state_dir.as_os_str().is_empty() {
            return invalid(
                "state_dir",
                String::new(),
                "the swupdate target needs a directory for its state",
            );
        }
        if let Some(arg) = config.args.iter().find(|a| {
            matches!(
                a.as_str(),
                "-i" | "--image"
                    | "-d"
                    | "--download"
                    | "-u"
                    | "--suricatta"
                    | "-w"
                    | "--webserver"
            )
        }) {
            return invalid(
                "args",
                arg.clone(),
                "the target passes the image with -i itself; other image sources do not belong here",
            );
        }
        for (name, timeout) in [
            ("install_timeout", config.install_timeout),
            ("command_timeout", config.command_timeout),
        ] {
            if timeout.is_zero() {
                return invalid(name, "0s".to_owned(), "must be more than 0");
            }
        }
        for (name, cmd) in [
            ("reboot_command", &config.reboot_command),
            ("confirm_command", &config.confirm_command),
            ("rollback_command", &config.rollback_command),
        ] {
            if let Some(cmd) = cmd {
                if cmd.first().is_none_or(|p| p.trim().is_empty()) {
                    return invalid(
                        name,
                        format!("{cmd:?}"),
                        "name a program and its arguments, or leave it out",
                    );
                }
            }
        }
        for (name, socket) in [
            ("socket", &config.socket),
            ("progress_socket", &config.progress_socket),
        ] {
            if let Some(socket) = socket {
                if !socket.is_absolute() || socket.file_name().is_none() {
                    return invalid(
                        name,
                        socket.display().to_string(),
                        "must be an absolute path to SWUpdate's socket",
                    );
                }
            }
        }
        if config.reboot && config.reboot_command.is_none() {
            return invalid(
                "reboot_command",
                String::new(),
                "is required with reboot = true, e.g. [\"systemctl\", \"reboot\"]",
            );
        }
        Ok(Self { config })
    }

    /// The state directory.
    pub fn state_dir(&self) -> &Path {
        &self.config.state_dir
    }

    fn state_path(&self) -> PathBuf {
        self.config.state_dir.join(STATE_FILE)
    }

    fn staged_path(&self) -> PathBuf {
        self.config.state_dir.join(STAGED_FILE)
    }

    fn read_state(&self) -> Result<Option<SwuState>, TargetError> {
        read_state_file(self.state_path(), SwuState::parse)
    }

    fn write_state(&self, state: &SwuState) -> io::Result<()> {
        atomic_write(self.state_path(), state.encode())
    }

    fn fail(step: &'static str, reason: impl Into<String>) -> TargetError {
        TargetError::Swupdate {
            step,
            reason: reason.into(),
        }
    }

    /// Installs the staged image: through the daemon when `socket` is set and it listens there,
    /// otherwise with `swupdate -i`.
    fn install(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        let _one_at_a_time = INSTALL_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let Some(socket) = &self.config.socket else {
            return self.install_with_program(ctx);
        };
        info!(action_id = %ctx.action_id, release = %ctx.release, socket = %socket.display(), "installing through SWUpdate's daemon");
        let progress_socket = self.config.progress_socket();
        let staged = self.staged_path();
        let result = DaemonInstall {
            socket,
            progress_socket: progress_socket.as_deref(),
            image: &staged,
            timeout: self.config.install_timeout,
            action_id: &ctx.action_id,
        }
        .run();
        let reason = match result {
            Ok(()) => return Ok(()),
            Err(DaemonError::NotListening(e)) => {
                warn!(
                    action_id = %ctx.action_id,
                    socket = %socket.display(),
                    "no SWUpdate daemon listens on the socket ({e}); installing with {} -i instead",
                    self.config.program.display()
                );
                return self.install_with_program(ctx);
            }
            Err(DaemonError::Failed(messages)) => format!(
                "SWUpdate refused or failed the image: {}",
                pick_reason(&messages).unwrap_or_else(|| "it sent no error message".to_owned())
            ),
            Err(DaemonError::Refused(why)) => {
                format!("SWUpdate's daemon refused the install request: {why}")
            }
            Err(DaemonError::TimedOut) => format!(
                "SWUpdate's daemon did not finish within install_timeout ({}s)",
                self.config.install_timeout.as_secs()
            ),
            Err(DaemonError::Io { what, source }) => {
                format!("{}: {what}: {source}", socket.display())
            }
            Err(DaemonError::Protocol(why)) => format!("{}: {why}", socket.display()),
        };
        Err(Self::fail("install", reason))
    }

    /// Runs `swupdate <args> -i <staged>`, logging its lines as they come.
    fn install_with_program(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        let staged = self.staged_path();
        let mut cmd = Command::new(&self.config.program);
        cmd.args(&self.config.args).arg("-i").arg(&staged);
        let action_id = ctx.action_id.clone();
        let sink: LineSink = Arc::new(move |line: &str| {
            if line.contains("[ERROR]") {
                warn!(action_id = %action_id, "swupdate: {line}");
            } else {
                info!(action_id = %action_id, "swupdate: {line}");
            }
        });
        info!(action_id = %ctx.action_id, release = %ctx.release, program = %self.config.program.display(), "installing with SWUpdate");
        let out = process::run_following(&mut cmd, None, self.config.install_timeout, Some(sink))
            .map_err(|e| {
            let reason = match e {
                RunError::TimedOut { .. } => format!(
                    "{} ran longer than install_timeout ({}s): {e}",
                    self.config.program.display(),
                    self.config.install_timeout.as_secs()
                ),
                e => format!("{}: {e}", self.config.program.display()),
            };
            Self::fail("install", reason)
        })?;
        if out.status.success() {
            return Ok(());
        }
        if reported_success(&out.stdout, &out.stderr) && !self.runs_postupdate() {
            warn!(
                action_id = %ctx.action_id,
                status = %out.status,
                "SWUpdate reported the install successful but exited with an error; taking its \
                 report (SWUpdate before 2024.12 can lose the final status of a small image)"
            );
            return Ok(());
        }
        Err(Self::fail(
            "install",
            format!(
                "SWUpdate refused or failed the image: {} ({})",
                swupdate_error(&out.stdout, &out.stderr),
                out.status
            ),
        ))
    }

    /// SWUpdate's own post-update command (`-p`) also decides its exit code; then only the exit
    /// code counts.
    fn runs_postupdate(&self) -> bool {
        self.config
            .args
            .iter()
            .any(|a| a == "-p" || a.starts_with("--postupdate"))
    }

    /// Runs one of the configured commands with the action in its environment.
    fn run_command(
        &self,
        step: &'static str,
        cmd: &[String],
        ctx: Option<(&ActionContext, &str)>,
    ) -> Result<(), TargetError> {
        let Some((program, args)) = cmd.split_first() else {
            return Ok(());
        };
        let mut command = Command::new(program);
        command.args(args);
        if let Some((ctx, phase)) = ctx {
            command
                .env("FLOTILLA_ACTION_ID", &ctx.action_id)
                .env("FLOTILLA_RELEASE", &ctx.release)
                .env("FLOTILLA_PHASE", phase);
        }
        let shown = cmd.join(" ");
        let out = process::run(&mut command, None, self.config.command_timeout)
            .map_err(|e| Self::fail(step, format!("{shown:?}: {e}")))?;
        if out.status.success() {
            return Ok(());
        }
        let why = last_line(&out.stderr)
            .or_else(|| last_line(&out.stdout))
            .unwrap_or_else(|| "it gave no reason".to_owned());
        Err(Self::fail(
            step,
            format!("{shown:?} failed: {why} ({})", out.status),
        ))
    }

    fn remove_staged(&self) -> io::Result<()> {
        match fs::remove_file(self.staged_path()) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    fn roll_back(&self, ctx: &ActionContext) -> Result<Activation, TargetError> {
        let action_id = ctx.validate_action_id()?;
        let state = match self.read_state()? {
            Some(state) if state.action_id == action_id => state,
            _ => {
                return Err(TargetError::NothingToRollBack {
                    path: self.config.state_dir.clone(),
                })
            }
        };
        let reboot = match state.phase {
            Phase::RolledBack => return Ok(activation(state.reboot)),
            Phase::Staging | Phase::Staged => false,
            Phase::Failed if self.config.rollback_command.is_none() => {
                warn!(
                    action_id,
                    "SWUpdate failed this install; no rollback_command is configured, so nothing \
                     more is undone"
                );
                false
            }
            Phase::Installing | Phase::Failed | Phase::Installed | Phase::Confirmed => {
                let Some(cmd) = &self.config.rollback_command else {
                    return Err(Self::fail(
                        "rollback",
                        "not supported: SWUpdate has no generic rollback and no rollback_command \
                         is configured (with a dual-copy image, switch the bootloader back to the \
                         other copy)",
                    ));
                };
                self.run_command("rollback", cmd, Some((ctx, state.phase.as_str())))?;
                self.config.reboot
            }
        };
        let rolled = |source| TargetError::Rollback {
            path: self.config.state_dir.clone(),
            source,
        };
        self.remove_staged().map_err(rolled)?;
        self.write_state(&SwuState {
            phase: Phase::RolledBack,
            reboot,
            ..state
        })
        .map_err(rolled)?;
        info!(action_id, reboot, "SWUpdate update rolled back");
        Ok(activation(reboot))
    }
}

impl UpdateTarget for SwupdateTarget {
    fn kind(&self) -> &'static str {
        "swupdate"
    }

    fn check(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        ctx.validate_action_id()?;
        check_executable(&self.config.program, "the swupdate program")?;
        create_private_dir(&self.config.state_dir).map_err(|source| TargetError::Check {
            path: self.config.state_dir.clone(),
            source,
        })?;
        self.read_state()?;
        Ok(())
    }

    fn stage(&self, ctx: &ActionContext, artifact: &Path) -> Result<(), TargetError> {
        let action_id = ctx.validate_action_id()?;
        if let Some(state) = self.read_state()?.filter(|s| s.action_id == action_id) {
            if !matches!(state.phase, Phase::Staging | Phase::Staged) {
                return Err(TargetError::AlreadyActivated {
                    action_id: action_id.to_owned(),
                    path: self.config.state_dir.clone(),
                });
            }
        }
        check_swu_header(artifact)?;
        let stage_err = |path: PathBuf| move |source| TargetError::Stage { path, source };
        create_private_dir(&self.config.state_dir)
            .map_err(stage_err(self.config.state_dir.clone()))?;
        let mut state = SwuState {
            action_id: action_id.to_owned(),
            phase: Phase::Staging,
            reboot: false,
        };
        self.write_state(&state)
            .map_err(stage_err(self.state_path()))?;
        atomic_copy(artifact, self.staged_path()).map_err(stage_err(artifact.to_path_buf()))?;
        state.phase = Phase::Staged;
        self.write_state(&state)
            .map_err(stage_err(self.state_path()))?;
        info!(action_id, release = %ctx.release, "staged SWUpdate image");
        Ok(())
    }

    fn activate(&self, ctx: &ActionContext) -> Result<Activation, TargetError> {
        let action_id = ctx.validate_action_id()?;
        let not_staged = || TargetError::NotStaged {
            action_id: action_id.to_owned(),
            path: self.config.state_dir.clone(),
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
                    path: self.config.state_dir.clone(),
                })
            }
            Phase::Installed | Phase::Confirmed => return Ok(activation(state.reboot)),
            Phase::Staged | Phase::Installing | Phase::Failed => {}
        }
        let write = |phase: Phase, reboot: bool| {
            self.write_state(&SwuState {
                action_id: action_id.to_owned(),
                phase,
                reboot,
            })
            .map_err(|source| TargetError::Activate {
                path: self.state_path(),
                source,
            })
        };
        // Recorded first: a rollback after a crash inside SWUpdate knows it may have written.
        write(Phase::Installing, false)?;
        if let Err(e) = self.install(ctx) {
            write(Phase::Failed, false)?;
            return Err(e);
        }
        write(Phase::Installed, self.config.reboot)?;
        info!(action_id, release = %ctx.release, reboot = self.config.reboot, "SWUpdate installed the image");
        Ok(activation(self.config.reboot))
    }

    fn confirm(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        let action_id = ctx.validate_action_id()?;
        let not_activated = || TargetError::NotActivated {
            action_id: action_id.to_owned(),
            path: self.config.state_dir.clone(),
        };
        let state = match self.read_state()? {
            Some(state) if state.action_id == action_id => state,
            _ => return Err(not_activated()),
        };
        match state.phase {
            Phase::Confirmed => return Ok(()),
            Phase::RolledBack => {
                return Err(TargetError::RolledBack {
                    action_id: action_id.to_owned(),
                    path: self.config.state_dir.clone(),
                })
            }
            Phase::Installed => {}
            _ => return Err(not_activated()),
        }
        if let Some(cmd) = &self.config.confirm_command {
            self.run_command("confirm", cmd, Some((ctx, state.phase.as_str())))?;
        }
        let confirm_err = |source| TargetError::Confirm {
            path: self.config.state_dir.clone(),
            source,
        };
        self.write_state(&SwuState {
            phase: Phase::Confirmed,
            ..state
        })
        .map_err(confirm_err)?;
        self.remove_staged().map_err(confirm_err)?;
        info!(action_id, release = %ctx.release, "confirmed SWUpdate update");
        Ok(())
    }

    fn rollback(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        self.roll_back(ctx).map(|_| ())
    }

    fn rollback_activation(&self, ctx: &ActionContext) -> Result<Activation, TargetError> {
        self.roll_back(ctx)
    }

    fn reboot(&self) -> Result<(), TargetError> {
        let Some(cmd) = &self.config.reboot_command else {
            return Err(TargetError::Reboot {
                command: String::new(),
                reason: "the swupdate target has no reboot_command configured".to_owned(),
            });
        };
        debug!(command = ?cmd, "rebooting after SWUpdate");
        self.run_command("reboot", cmd, None)
            .map_err(|e| TargetError::Reboot {
                command: cmd.join(" "),
                reason: e.to_string(),
            })
    }

    /// An interrupted install is run again from the start: SWUpdate writes what the image names
    /// from the beginning each time, and a dual-copy image only writes the copy not running.
    fn activate_is_repeatable(&self) -> bool {
        true
    }
}

fn activation(reboot: bool) -> Activation {
    if reboot {
        Activation::RebootRequired
    } else {
        Activation::Done
    }
}

/// Refuses anything that is not a `.swu` from its first cpio header alone: magic `070701` or
/// `070702` (SWUpdate reads the `newc` and `crc` formats) and `sw-description` as the first
/// member's name. The signature and hashes are SWUpdate's to check.
fn check_swu_header(artifact: &Path) -> Result<(), TargetError> {
    let stage_err = |source| TargetError::Stage {
        path: artifact.to_path_buf(),
        source,
    };
    let invalid = |why: String| stage_err(io::Error::new(io::ErrorKind::InvalidData, why));
    let file = File::open(artifact).map_err(stage_err)?;
    let meta = file.metadata().map_err(stage_err)?;
    if !meta.is_file() {
        return Err(invalid(
            "not a SWUpdate image (.swu): it is not a regular file".to_owned(),
        ));
    }
    // The same check `release create --artifact-type NAME=swu` makes.
    let mut head = Vec::with_capacity(HEAD_LEN);
    file.take(HEAD_LEN as u64)
        .read_to_end(&mut head)
        .map_err(stage_err)?;
    ArtifactType::Swu
        .check_content(Ends {
            head: &head,
            tail: None,
            len: meta.len(),
        })
        .map_err(invalid)
}

/// SWUpdate's installer announced success ("SWUPDATE successful !") and printed no error.
///
/// SWUpdate before 2024.12 (Debian 12 ships 2022.12) can exit 1 after installing a small image
/// successfully: its `-i` client asks the daemon part for the status before the install started
/// and takes "idle" for a failure (fixed upstream by "swupdate_async_start: fix race condition").
/// The installer's own announcement is what happened.
fn reported_success(stdout: &[u8], stderr: &[u8]) -> bool {
    let (out, err) = (
        String::from_utf8_lossy(stdout),
        String::from_utf8_lossy(stderr),
    );
    let said = |needle: &str| out.contains(needle) || err.contains(needle);
    said("SWUPDATE successful") && !said("[ERROR]")
}

/// SWUpdate's own reason for a failed install: its `[ERROR]` lines without the generic ones
/// ("SWUpdate *failed* !", "Image invalid or corrupted. Not installing ..."), or those if there is
/// nothing else, or the last line it printed. SWUpdate sometimes runs two messages together on one
/// line, so messages are split at each `[ERROR]`.
pub(crate) fn swupdate_error(stdout: &[u8], stderr: &[u8]) -> String {
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(stderr),
        String::from_utf8_lossy(stdout)
    );
    let mut messages: Vec<String> = Vec::new();
    for line in text.lines() {
        for part in line.split("[ERROR]").skip(1) {
            // "[ERROR] : SWUPDATE failed [0] ERROR : HASH mismatch ..." -> "HASH mismatch ..."
            let mut m = part.trim().trim_start_matches(':').trim();
            if let Some(rest) = m.strip_prefix("SWUPDATE failed") {
                m = rest.trim();
                if let Some(end) = m.strip_prefix('[').and_then(|r| r.find(']')) {
                    m = m[end + 2..].trim();
                }
            }
            m = m.strip_prefix("ERROR :").unwrap_or(m).trim();
            let m: String = m.chars().take(300).collect();
            if !m.is_empty() && !messages.contains(&m) {
                messages.push(m);
            }
        }
    }
    pick_reason(&messages)
        .or_else(|| last_line(stderr))
        .or_else(|| last_line(stdout))
        .unwrap_or_else(|| "it printed no error".to_owned())
}

/// The reason out of SWUpdate's error messages: the specific ones, without the generic ones
/// ("SWUpdate *failed* !", "Image invalid or corrupted. Not installing ...", "Installation
/// failed !"), or those if there is nothing else.
pub(crate) fn pick_reason(messages: &[String]) -> Option<String> {
    const GENERIC: [&str; 3] = [
        "SWUpdate *failed*",
        "Image invalid or corrupted",
        "Installation failed",
    ];
    let shorten = |m: &String| m.chars().take(300).collect::<String>();
    let specific: Vec<String> = messages
        .iter()
        .filter(|m| !GENERIC.iter().any(|g| m.starts_with(g)))
        .map(shorten)
        .collect();
    if !specific.is_empty() {
        return Some(specific.join("; "));
    }
    if !messages.is_empty() {
        return Some(messages.iter().map(shorten).collect::<Vec<_>>().join("; "));
    }
    None
}

/// Where an action stands, as this target recorded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Staging,
    Staged,
    Installing,
    Failed,
    Installed,
    Confirmed,
    RolledBack,
}

impl Phase {
    fn as_str(self) -> &'static str {
        match self {
            Phase::Staging => "staging",
            Phase::Staged => "staged",
            Phase::Installing => "installing",
            Phase::Failed => "failed",
            Phase::Installed => "installed",
            Phase::Confirmed => "confirmed",
            Phase::RolledBack => "rolled-back",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "staging" => Phase::Staging,
            "staged" => Phase::Staged,
            "installing" => Phase::Installing,
            "failed" => Phase::Failed,
            "installed" => Phase::Installed,
            "confirmed" => Phase::Confirmed,
            "rolled-back" => Phase::RolledBack,
            _ => return None,
        })
    }
}

/// The bookkeeping record, plain `key=value` text.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SwuState {
    action_id: String,
    phase: Phase,
    /// The step that brought the action to `phase` needs a reboot to take effect.
    reboot: bool,
}

impl SwuState {
    fn encode(&self) -> String {
        format!(
            "# flotilla swupdate target state; written atomically, do not edit\n\
             action={}\nphase={}\nreboot={}\n",
            self.action_id,
            self.phase.as_str(),
            self.reboot
        )
    }

    fn parse(text: &str) -> Result<Self, String> {
        let (mut action_id, mut phase, mut reboot) = (None, None, false);
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
                "phase" => phase = Some(Phase::parse(value).ok_or_else(bad)?),
                "reboot" => reboot = value.parse::<bool>().map_err(|_| bad())?,
                _ => return Err(format!("unknown key {key:?}")),
            }
        }
        Ok(Self {
            action_id: action_id.ok_or("action= is missing")?,
            phase: phase.ok_or("phase= is missing")?,
            reboot,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_specific_error_lines_are_kept_and_the_generic_ones_dropped() {
        let stderr = b"C0E6:error:1700009E:CMS routines:verification failure\n\
            [ERROR] : SWUPDATE failed [0] ERROR : Signature verification failed\n\
            [ERROR] : SWUPDATE failed [0] ERROR : Compatible SW not found\n\
            [ERROR] : SWUPDATE failed [1] Image invalid or corrupted. Not installing ...\n\
            [ERROR] : SWUPDATE failed [0] ERROR : SWUpdate *failed* ![ERROR] : SWUPDATE failed [0] ERROR : Checksum WRONG ! Computed 0x434c, it should be 0x4344\n";
        assert_eq!(
            swupdate_error(b"[INFO ] : SWUPDATE started", stderr),
            "Signature verification failed; Compatible SW not found; Checksum WRONG ! Computed \
             0x434c, it should be 0x4344"
        );
        let only_generic =
            b"[ERROR] : SWUPDATE failed [1] Image invalid or corrupted. Not installing ...\n\
            [ERROR] : SWUPDATE failed [0] ERROR : SWUpdate *failed* !\n";
        assert_eq!(
            swupdate_error(b"", only_generic),
            "Image invalid or corrupted. Not installing ...; SWUpdate *failed* !"
        );
        assert_eq!(
            swupdate_error(
                b"",
                b"Error: SWUpdate is built for signed images, provide a public key file.\n"
            ),
            "Error: SWUpdate is built for signed images, provide a public key file."
        );
    }

    #[test]
    fn success_is_what_the_installer_announced_without_errors() {
        let ok = b"[INFO ] : SWUPDATE started :  Software Update started !\n\
            [INFO ] : SWUPDATE successful ! SWUPDATE successful !\n";
        assert!(reported_success(ok, b""));
        assert!(!reported_success(
            ok,
            b"[ERROR] : SWUPDATE failed [0] ERROR : Post-update command failed\n"
        ));
        assert!(!reported_success(
            b"[INFO ] : No SWUPDATE running :  Waiting for requests...\n",
            b""
        ));
    }

    #[test]
    fn only_a_cpio_archive_starting_with_sw_description_is_staged() {
        let dir = tempfile::tempdir().expect("tempdir");
        let header = |magic: &str, name: &str| {
            let mut h = format!(
                "{magic}{}{:08X}{}",
                "0".repeat(88),
                name.len() + 1,
                "0".repeat(8)
            )
            .into_bytes();
            h.extend_from_slice(name.as_bytes());
            h.push(0);
            h
        };
        let good = dir.path().join("good.swu");
        fs::write(&good, header("070702", "sw-description")).expect("write");
        check_swu_header(&good).expect("a .swu header");
        for (name, bytes, why) in [
            ("tar", b"ustar\0".repeat(30), "cpio header"),
            ("odc", header("070707", "sw-description"), "cpio header"),
            ("first", header("070701", "rootfs.ext4"), "sw-description"),
            (
                "longer",
                header("070701", "sw-description.sig"),
                "sw-description",
            ),
            ("short", b"0707".to_vec(), "cpio header"),
        ] {
            let path = dir.path().join(name);
            fs::write(&path, bytes).expect("write");
            let err = check_swu_header(&path).expect_err(name).to_string();
            assert!(
                err.contains("not a SWUpdate image") && err.contains(why),
                "{name}: {err}"
            );
        }
    }

    #[test]
    fn settings_that_cannot_work_are_refused_naming_the_field() {
        let base = SwupdateConfig::new(PathBuf::from("/var/lib/flotilla/swu"));
        let field_of = |config: SwupdateConfig| match SwupdateTarget::new(config) {
            Err(TargetError::InvalidConfig { field, .. }) => field,
            other => panic!("expected a refusal, got {other:?}"),
        };
        assert_eq!(
            field_of(SwupdateConfig {
                program: "swupdate".into(),
                ..base.clone()
            }),
            "path"
        );
        assert_eq!(
            field_of(SwupdateConfig {
                args: vec!["-i".into(), "/tmp/x.swu".into()],
                ..base.clone()
            }),
            "args"
        );
        assert_eq!(
            field_of(SwupdateConfig {
                reboot: true,
                ..base.clone()
            }),
            "reboot_command"
        );
        assert_eq!(
            field_of(SwupdateConfig {
                rollback_command: Some(vec![]),
                ..base.clone()
            }),
            "rollback_command"
        );
        SwupdateTarget::new(base).expect("the defaults are valid");
    }
}
