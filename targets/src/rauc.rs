//! The `rauc` target: installs a RAUC bundle through RAUC's service, so devices whose A/B (or
//! A/B/recovery) slots RAUC manages update through flotilla's rollouts. RAUC's own slot handling
//! and bootloader integration do the A/B work; this target maps flotilla's steps onto them.
//!
//! # Mapping (the full text is in `docs/targets.md`)
//!
//! - `check`: the `rauc` program is an executable file, the state directory is usable and RAUC's
//!   service answers `rauc status` with a booted slot.
//! - `stage`: the artifact must end like a RAUC bundle (a big-endian 64-bit signature size that
//!   fits in the file); it is copied into the state directory. RAUC checks the signature against
//!   its keyring, the compatible string and the manifest when it installs.
//! - `activate`: `rauc install <staged bundle>`; the `rauc` client asks the service
//!   (`de.pengutronix.rauc.Installer.InstallBundle`), prints its `Progress` lines, which go to the
//!   agent's log, and on failure RAUC's `LastError`, which becomes the step's reason. RAUC writes
//!   the slot that is not booted and makes it primary; the answer is
//!   [`Activation::RebootRequired`] and the configured reboot command runs.
//! - `confirm`, first call (from the new boot): the booted slot must be the one RAUC installed
//!   to; if the device still runs the old one while the new one is primary and not bad, the
//!   reboot is still pending ([`TargetError::RebootPending`]); otherwise the bootloader fell back
//!   ([`TargetError::FellBack`]). Nothing is marked yet.
//! - `confirm`, second call (after the health soak): `rauc status mark-good booted`.
//! - `rollback`: before an install, the staged bundle is discarded. After a failed or
//!   interrupted install, and after a good one before the reboot, the booted (old) slot is made
//!   primary again (`rauc status mark-active <old>`): the old content runs, no reboot. From the
//!   new slot: `rauc status mark-bad booted` and `rauc status mark-active <old>`, then
//!   [`Activation::RebootRequired`]; the next start repeats the rollback, which then finds the old
//!   slot booted and answers [`Activation::Done`].
//!
//! # Why the `rauc` client and not D-Bus from the agent
//!
//! Decision record 0051: the `rauc` client *is* a D-Bus client of the service (it calls
//! `InstallBundle`, follows `Progress` and reads `LastError`; `rauc status mark-*` calls `Mark`),
//! it ships with every RAUC installation, and driving it keeps a D-Bus implementation out of the
//! agent. What a direct D-Bus client would add is written down there.
//!
//! # Bookkeeping
//!
//! `<state_dir>/flotilla-rauc-state` (action, phase, the slot booted when the install ran and the
//! slot RAUC installed to, whether a rollback needs a reboot) and `<state_dir>/flotilla-rauc.raucb`
//! (the staged bundle, removed once RAUC installed it). Every step is safe to call again after a
//! kill -9: an interrupted install runs again from the start (RAUC marks the target slot bad
//! before writing it, so a half-written slot is never booted), and the marks are idempotent.

use std::fs::{self, File};
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info, warn};

use flotilla_protocol::artifact_type::{ArtifactType, Ends};

use crate::error::TargetError;
use crate::fs::{atomic_copy, atomic_write, create_private_dir, read_state_file, state_lines};
use crate::process::{self, check_executable, last_line, LineSink, RunError};
use crate::target::{ActionContext, Activation, UpdateTarget};

/// The bookkeeping record in the state directory.
const STATE_FILE: &str = "flotilla-rauc-state";
/// The staged bundle in the state directory.
const STAGED_FILE: &str = "flotilla-rauc.raucb";

/// How a [`RaucTarget`] is set up; the agent's configuration fills it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaucConfig {
    /// The `rauc` program, by absolute path (Debian: `/usr/bin/rauc`). It reaches RAUC's service
    /// on the D-Bus system bus (`DBUS_SYSTEM_BUS_ADDRESS` if set in the agent's environment).
    pub program: PathBuf,
    /// The target's own directory: its record and the staged bundle (created if missing).
    pub state_dir: PathBuf,
    /// How long one install may run before the `rauc` client is killed; default 30 minutes.
    /// (RAUC's service finishes or fails the install on its own.)
    pub install_timeout: Duration,
    /// How long `rauc status` and the marks may take; default 2 minutes.
    pub command_timeout: Duration,
    /// Program and arguments that reboot the device; default `["systemctl", "reboot"]`.
    pub reboot_command: Vec<String>,
}

impl RaucConfig {
    /// Debian's `rauc`, default timeouts, `systemctl reboot`.
    pub fn new(state_dir: PathBuf) -> Self {
        Self {
            program: PathBuf::from("/usr/bin/rauc"),
            state_dir,
            install_timeout: Duration::from_secs(30 * 60),
            command_timeout: Duration::from_secs(2 * 60),
            reboot_command: vec!["systemctl".to_owned(), "reboot".to_owned()],
        }
    }
}

/// An update target that installs RAUC bundles through RAUC's service.
///
/// See the [module documentation](self) and `docs/targets.md` for the mapping.
#[derive(Debug, Clone)]
pub struct RaucTarget {
    config: RaucConfig,
}

impl RaucTarget {
    /// A target for `config`. Checks the configuration only; RAUC is first asked at `check`.
    pub fn new(config: RaucConfig) -> Result<Self, TargetError> {
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
                "the rauc program must be given by absolute path",
            );
        }
        if config.state_dir.as_os_str().is_empty() {
            return invalid(
                "state_dir",
                String::new(),
                "the rauc target needs a directory for its state",
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
        if config
            .reboot_command
            .first()
            .is_none_or(|p| p.trim().is_empty())
        {
            return invalid(
                "reboot_command",
                format!("{:?}", config.reboot_command),
                "name a program and its arguments, e.g. [\"systemctl\", \"reboot\"]",
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

    fn read_state(&self) -> Result<Option<RaucState>, TargetError> {
        read_state_file(self.state_path(), RaucState::parse)
    }

    fn write_state(&self, state: &RaucState, step: &'static str) -> Result<(), TargetError> {
        atomic_write(self.state_path(), state.encode()).map_err(|e| {
            Self::fail(
                step,
                format!("writing {}: {e}", self.state_path().display()),
            )
        })
    }

    fn fail(step: &'static str, reason: impl Into<String>) -> TargetError {
        TargetError::Rauc {
            step,
            reason: reason.into(),
        }
    }

    /// Runs `rauc <args>`, logging its lines with `sink` if given; RAUC's reason on failure.
    fn rauc(
        &self,
        step: &'static str,
        args: &[&str],
        timeout: Duration,
        sink: Option<LineSink>,
    ) -> Result<Vec<u8>, TargetError> {
        let mut cmd = Command::new(&self.config.program);
        cmd.args(args);
        // `rauc install` without the staged bundle's path: the reason stays short.
        let shown = std::iter::once("rauc")
            .chain(args.iter().copied().filter(|a| !a.starts_with('/')))
            .collect::<Vec<_>>()
            .join(" ");
        let out = process::run_following(&mut cmd, None, timeout, sink).map_err(|e| {
            let reason = match e {
                RunError::TimedOut { .. } => {
                    format!("{shown} ran longer than {}s: {e}", timeout.as_secs())
                }
                e => format!("{shown}: {e}"),
            };
            Self::fail(step, reason)
        })?;
        if out.status.success() {
            return Ok(out.stdout);
        }
        Err(Self::fail(
            step,
            format!(
                "{}: {} ({})",
                shown,
                rauc_error(&out.stdout, &out.stderr),
                out.status
            ),
        ))
    }

    /// RAUC's view of the slots (`rauc status --output-format=json`).
    fn status(&self) -> Result<RaucStatus, TargetError> {
        let out = self.rauc(
            "status",
            &["status", "--output-format=json"],
            self.config.command_timeout,
            None,
        )?;
        RaucStatus::parse(&out).map_err(|why| Self::fail("status", why))
    }

    /// `rauc status <mark> <slot>`, logged.
    fn mark(&self, mark: &str, slot: &str, step: &'static str) -> Result<(), TargetError> {
        self.rauc(
            step,
            &["status", mark, slot],
            self.config.command_timeout,
            None,
        )?;
        info!(mark, slot, "RAUC slot marked");
        Ok(())
    }

    /// Runs `rauc install <staged>`, logging RAUC's progress lines as they come.
    fn install(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        let staged = self.staged_path();
        let staged = staged.to_str().ok_or_else(|| {
            Self::fail(
                "install",
                format!("the state directory {} is not UTF-8", staged.display()),
            )
        })?;
        let action_id = ctx.action_id.clone();
        let sink: LineSink = Arc::new(move |line: &str| {
            if line.starts_with("LastError:") || line.contains("failed") {
                warn!(action_id = %action_id, "rauc: {line}");
            } else {
                info!(action_id = %action_id, "rauc: {line}");
            }
        });
        info!(action_id = %ctx.action_id, release = %ctx.release, "installing with RAUC");
        self.rauc(
            "install",
            &["install", staged],
            self.config.install_timeout,
            Some(sink),
        )
        .map(|_| ())
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
        let reboot = match (state.phase, state.from.as_deref()) {
            (Phase::RolledBack, from) => {
                if !state.reboot {
                    return Ok(Activation::Done);
                }
                let booted = self.status()?.booted;
                return Ok(if from == Some(booted.as_str()) {
                    Activation::Done
                } else {
                    Activation::RebootRequired
                });
            }
            (Phase::Staging | Phase::Staged, _) | (_, None) => false,
            (Phase::Installing | Phase::Failed | Phase::Installed, Some(from)) => {
                // The old slot still runs: make it primary again, whatever RAUC got to.
                let status = self.status()?;
                if status.primary.as_deref() != Some(from) {
                    self.mark("mark-active", from, "rollback")?;
                }
                status.booted != from
            }
            (Phase::Booted | Phase::Confirmed, Some(from)) => {
                let status = self.status()?;
                if status.booted != from {
                    self.mark("mark-bad", "booted", "rollback")?;
                }
                self.mark("mark-active", from, "rollback")?;
                status.booted != from
            }
        };
        self.remove_staged()
            .map_err(|e| Self::fail("rollback", format!("removing the staged bundle: {e}")))?;
        self.write_state(
            &RaucState {
                phase: Phase::RolledBack,
                reboot,
                ..state
            },
            "rollback",
        )?;
        info!(action_id, reboot, "RAUC update rolled back");
        Ok(if reboot {
            Activation::RebootRequired
        } else {
            Activation::Done
        })
    }
}

impl UpdateTarget for RaucTarget {
    fn kind(&self) -> &'static str {
        "rauc"
    }

    fn check(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        ctx.validate_action_id()?;
        check_executable(&self.config.program, "the rauc program")?;
        create_private_dir(&self.config.state_dir).map_err(|source| TargetError::Check {
            path: self.config.state_dir.clone(),
            source,
        })?;
        self.read_state()?;
        let status = self.status()?;
        debug!(booted = %status.booted, primary = ?status.primary, "RAUC answers");
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
        check_bundle_trailer(artifact)?;
        let stage_err = |path: PathBuf| move |source| TargetError::Stage { path, source };
        create_private_dir(&self.config.state_dir)
            .map_err(stage_err(self.config.state_dir.clone()))?;
        let mut state = RaucState::new(action_id, Phase::Staging);
        self.write_state(&state, "stage")?;
        atomic_copy(artifact, self.staged_path()).map_err(stage_err(artifact.to_path_buf()))?;
        state.phase = Phase::Staged;
        self.write_state(&state, "stage")?;
        info!(action_id, release = %ctx.release, "staged RAUC bundle");
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
            Phase::Installed => return Ok(Activation::RebootRequired),
            Phase::Booted | Phase::Confirmed => return Ok(Activation::Done),
            Phase::Staged | Phase::Installing | Phase::Failed => {}
        }
        // The slot that runs now is where a rollback returns to; an install repeated after a
        // crash keeps the first one recorded.
        let from = match state.from {
            Some(from) => from,
            None => self.status()?.booted,
        };
        let mut state = RaucState {
            phase: Phase::Installing,
            from: Some(from.clone()),
            ..state
        };
        // Recorded first: a rollback after a crash inside RAUC knows it may have switched.
        self.write_state(&state, "install")?;
        if let Err(e) = self.install(ctx) {
            state.phase = Phase::Failed;
            self.write_state(&state, "install")?;
            return Err(e);
        }
        let status = self.status()?;
        let to = match status.primary {
            Some(primary) if primary != from => primary,
            primary => {
                state.phase = Phase::Failed;
                self.write_state(&state, "install")?;
                return Err(Self::fail(
                    "install",
                    format!(
                        "RAUC installed the bundle but made no other slot primary (primary: {}, \
                         booted: {from}); is activate-installed=false in system.conf?",
                        primary.as_deref().unwrap_or("none")
                    ),
                ));
            }
        };
        state.phase = Phase::Installed;
        state.to = Some(to.clone());
        self.write_state(&state, "install")?;
        if let Err(e) = self.remove_staged() {
            warn!(action_id, "could not remove the installed bundle: {e}");
        }
        info!(action_id, release = %ctx.release, from, to, "RAUC installed the bundle; rebooting into it");
        Ok(Activation::RebootRequired)
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
        let (from, to) = match (state.phase, &state.from, &state.to) {
            (Phase::Confirmed, _, _) => return Ok(()),
            (Phase::RolledBack, _, _) => {
                return Err(TargetError::RolledBack {
                    action_id: action_id.to_owned(),
                    path: self.config.state_dir.clone(),
                })
            }
            (Phase::Installed | Phase::Booted, Some(from), Some(to)) => (from, to),
            _ => return Err(not_activated()),
        };
        let status = self.status()?;
        if &status.booted != to {
            let pending = status.booted == *from
                && state.phase == Phase::Installed
                && status.primary.as_deref() == Some(to.as_str())
                && status.boot_status(to) != Some("bad");
            if pending {
                return Err(TargetError::RebootPending {
                    action_id: action_id.to_owned(),
                    slot: to.clone(),
                    running: status.booted,
                });
            }
            return Err(TargetError::FellBack {
                action_id: action_id.to_owned(),
                tried: to.clone(),
                booted: status.booted,
            });
        }
        if state.phase == Phase::Installed {
            // The first confirm comes from the new boot, before the health soak: the slot is
            // marked good only by the one after it.
            self.write_state(
                &RaucState {
                    phase: Phase::Booted,
                    ..state.clone()
                },
                "confirm",
            )?;
            info!(action_id, slot = %to, "booted the slot RAUC installed; marking it good after the health checks");
            return Ok(());
        }
        self.mark("mark-good", "booted", "mark-good")?;
        self.write_state(
            &RaucState {
                phase: Phase::Confirmed,
                ..state.clone()
            },
            "confirm",
        )?;
        info!(action_id, release = %ctx.release, slot = %to, "confirmed RAUC update");
        Ok(())
    }

    fn rollback(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        self.roll_back(ctx).map(|_| ())
    }

    fn rollback_activation(&self, ctx: &ActionContext) -> Result<Activation, TargetError> {
        self.roll_back(ctx)
    }

    fn reboot(&self) -> Result<(), TargetError> {
        let cmd = &self.config.reboot_command;
        let shown = cmd.join(" ");
        let reboot_err = |reason: String| TargetError::Reboot {
            command: shown.clone(),
            reason,
        };
        let Some((program, args)) = cmd.split_first() else {
            return Err(reboot_err("no reboot_command configured".to_owned()));
        };
        debug!(command = ?cmd, "rebooting after RAUC");
        let out = process::run(
            Command::new(program).args(args),
            None,
            self.config.command_timeout,
        )
        .map_err(|e| reboot_err(e.to_string()))?;
        if out.status.success() {
            return Ok(());
        }
        let why = last_line(&out.stderr)
            .or_else(|| last_line(&out.stdout))
            .unwrap_or_else(|| "it gave no reason".to_owned());
        Err(reboot_err(format!("{why} ({})", out.status)))
    }

    /// An interrupted install is run again from the start: RAUC marks the slot it writes bad
    /// first and only makes it primary once the whole bundle is written.
    fn activate_is_repeatable(&self) -> bool {
        true
    }
}

/// Refuses anything that cannot be a RAUC bundle from its last 8 bytes alone (the check
/// `release create --artifact-type rootfs=rauc-bundle` makes too): every bundle ends with the
/// size of its CMS signature (big-endian u64), which must be more than 0 and fit in the file.
/// The signature itself is RAUC's to check, against its keyring.
fn check_bundle_trailer(artifact: &Path) -> Result<(), TargetError> {
    let stage_err = |source| TargetError::Stage {
        path: artifact.to_path_buf(),
        source,
    };
    let invalid = |why: String| stage_err(io::Error::new(io::ErrorKind::InvalidData, why));
    let mut file = File::open(artifact).map_err(stage_err)?;
    let meta = file.metadata().map_err(stage_err)?;
    if !meta.is_file() {
        return Err(invalid(
            "not a RAUC bundle: it is not a regular file".to_owned(),
        ));
    }
    let tail = if meta.len() >= 8 {
        let mut tail = [0u8; 8];
        file.seek(SeekFrom::End(-8)).map_err(stage_err)?;
        file.read_exact(&mut tail).map_err(stage_err)?;
        Some(tail)
    } else {
        None
    };
    ArtifactType::RaucBundle
        .check_content(Ends {
            head: &[],
            tail,
            len: meta.len(),
        })
        .map_err(invalid)
}

/// RAUC's own reason for a failure: the service's `LastError` as the `rauc` client prints it,
/// else the client's last error line (a missing service: "error creating proxy: ..."), else the
/// last line it printed.
pub(crate) fn rauc_error(stdout: &[u8], stderr: &[u8]) -> String {
    let (out, err) = (
        String::from_utf8_lossy(stdout),
        String::from_utf8_lossy(stderr),
    );
    let short = |s: &str| s.trim().chars().take(400).collect::<String>();
    if let Some(last) = out
        .lines()
        .chain(err.lines())
        .filter_map(|l| l.trim().strip_prefix("LastError:"))
        .next_back()
    {
        return short(last);
    }
    if let Some(line) = err
        .lines()
        .rev()
        .find(|l| l.contains("error") || l.contains("ERROR") || l.contains("failed"))
    {
        return short(line);
    }
    last_line(stderr)
        .or_else(|| last_line(stdout))
        .unwrap_or_else(|| "it printed no error".to_owned())
}

/// What `rauc status --output-format=json` says about the slots.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RaucStatus {
    /// The slot RAUC considers booted (state `booted`).
    booted: String,
    /// The slot the bootloader boots next (`boot_primary`), if RAUC knows it.
    primary: Option<String>,
    /// Each slot's name and `boot_status` (`good`, `bad`), where RAUC reports one.
    slots: Vec<(String, Option<String>)>,
}

impl RaucStatus {
    fn parse(json: &[u8]) -> Result<Self, String> {
        let value: serde_json::Value = serde_json::from_slice(json)
            .map_err(|e| format!("rauc status printed no JSON RAUC status: {e}"))?;
        let primary = value
            .get("boot_primary")
            .and_then(|p| p.as_str())
            .map(str::to_owned);
        let mut booted = None;
        let mut slots = Vec::new();
        for entry in value
            .get("slots")
            .and_then(|s| s.as_array())
            .ok_or("rauc status lists no slots")?
        {
            let Some((name, slot)) = entry.as_object().and_then(|o| o.iter().next()) else {
                continue;
            };
            if slot.get("state").and_then(|s| s.as_str()) == Some("booted") {
                booted = Some(name.clone());
            }
            let boot_status = slot
                .get("boot_status")
                .and_then(|s| s.as_str())
                .map(str::to_owned);
            slots.push((name.clone(), boot_status));
        }
        let booted = booted.ok_or(
            "RAUC finds no booted slot (the running system is none of system.conf's slots)",
        )?;
        Ok(Self {
            booted,
            primary,
            slots,
        })
    }

    fn boot_status(&self, slot: &str) -> Option<&str> {
        self.slots
            .iter()
            .find(|(name, _)| name == slot)
            .and_then(|(_, s)| s.as_deref())
    }
}

/// Where an action stands, as this target recorded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Staging,
    Staged,
    Installing,
    Failed,
    /// RAUC wrote the other slot and made it primary; the reboot into it is next.
    Installed,
    /// The device booted the new slot; not yet marked good.
    Booted,
    Confirmed,
    RolledBack,
}

impl Phase {
    const ALL: [(Phase, &'static str); 8] = [
        (Phase::Staging, "staging"),
        (Phase::Staged, "staged"),
        (Phase::Installing, "installing"),
        (Phase::Failed, "failed"),
        (Phase::Installed, "installed"),
        (Phase::Booted, "booted"),
        (Phase::Confirmed, "confirmed"),
        (Phase::RolledBack, "rolled-back"),
    ];

    fn as_str(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(p, _)| *p == self)
            .map_or("?", |(_, s)| s)
    }

    fn parse(s: &str) -> Option<Self> {
        Self::ALL.iter().find(|(_, n)| *n == s).map(|(p, _)| *p)
    }
}

/// The bookkeeping record, plain `key=value` text.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RaucState {
    action_id: String,
    phase: Phase,
    /// The slot that was booted when the install ran.
    from: Option<String>,
    /// The slot RAUC installed to (primary after the install).
    to: Option<String>,
    /// The rollback needs a reboot to take effect.
    reboot: bool,
}

impl RaucState {
    fn new(action_id: &str, phase: Phase) -> Self {
        Self {
            action_id: action_id.to_owned(),
            phase,
            from: None,
            to: None,
            reboot: false,
        }
    }

    fn encode(&self) -> String {
        let mut text = format!(
            "# flotilla rauc target state; written atomically, do not edit\n\
             action={}\nphase={}\nreboot={}\n",
            self.action_id,
            self.phase.as_str(),
            self.reboot
        );
        for (key, value) in [("from", &self.from), ("to", &self.to)] {
            if let Some(value) = value {
                text.push_str(&format!("{key}={value}\n"));
            }
        }
        text
    }

    fn parse(text: &str) -> Result<Self, String> {
        let mut state = RaucState::new("", Phase::Staging);
        let (mut action, mut phase) = (false, false);
        for entry in state_lines(text) {
            let (key, value) = entry?;
            let bad = || format!("{key}={value:?} is not valid");
            match key {
                "action" => {
                    ActionContext::new(value, "", "")
                        .validate_action_id()
                        .map_err(|_| bad())?;
                    state.action_id = value.to_owned();
                    action = true;
                }
                "phase" => {
                    state.phase = Phase::parse(value).ok_or_else(bad)?;
                    phase = true;
                }
                "reboot" => state.reboot = value.parse::<bool>().map_err(|_| bad())?,
                "from" | "to" => {
                    let slot_name = !value.is_empty()
                        && value
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
                    if !slot_name {
                        return Err(bad());
                    }
                    let field = if key == "from" {
                        &mut state.from
                    } else {
                        &mut state.to
                    };
                    *field = Some(value.to_owned());
                }
                _ => return Err(format!("unknown key {key:?}")),
            }
        }
        if !action {
            return Err("action= is missing".to_owned());
        }
        if !phase {
            return Err("phase= is missing".to_owned());
        }
        Ok(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raucs_last_error_is_the_reason() {
        let stdout = b"installing\n  0% Installing\n 40% Verifying signature failed.\n\
            100% Installing failed.\nLastError: signature verification failed: \
            error:1700009E:CMS routines::verification failure\nidle\n";
        assert_eq!(
            rauc_error(stdout, b"Installing `/x.raucb` failed\n"),
            "signature verification failed: error:1700009E:CMS routines::verification failure"
        );
        assert_eq!(
            rauc_error(
                b"",
                b"rauc-Message: x\n(rauc:1): rauc-WARNING **: error creating proxy: Could not connect\n"
            ),
            "(rauc:1): rauc-WARNING **: error creating proxy: Could not connect"
        );
        assert_eq!(rauc_error(b"", b""), "it printed no error");
    }

    #[test]
    fn the_status_names_the_booted_and_primary_slots() {
        let json = br#"{"compatible":"t","variant":"","booted":"A","boot_primary":"rootfs.1",
            "slots":[{"rootfs.1":{"class":"rootfs","state":"inactive","boot_status":"good"}},
                     {"rootfs.0":{"class":"rootfs","state":"booted","boot_status":"bad"}}]}"#;
        let status = RaucStatus::parse(json).expect("parses");
        assert_eq!(status.booted, "rootfs.0");
        assert_eq!(status.primary.as_deref(), Some("rootfs.1"));
        assert_eq!(status.boot_status("rootfs.0"), Some("bad"));
        let none_booted = br#"{"slots":[{"rootfs.0":{"state":"inactive"}}]}"#;
        assert!(RaucStatus::parse(none_booted)
            .expect_err("no booted slot")
            .contains("no booted slot"));
        assert!(RaucStatus::parse(b"Compatible: x").is_err());
    }

    #[test]
    fn the_state_record_round_trips_and_refuses_odd_slot_names() {
        let state = RaucState {
            action_id: "r@1:dev".to_owned(),
            phase: Phase::Booted,
            from: Some("rootfs.0".to_owned()),
            to: Some("rootfs.1".to_owned()),
            reboot: true,
        };
        assert_eq!(RaucState::parse(&state.encode()), Ok(state));
        assert!(RaucState::parse("action=a\nphase=booted\nfrom=../x y\n").is_err());
        assert!(RaucState::parse("action=a\n").is_err());
    }

    #[test]
    fn only_files_with_a_bundle_trailer_are_staged() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("b.raucb");
        let mut bundle = vec![0u8; 100];
        bundle.extend_from_slice(&50u64.to_be_bytes());
        fs::write(&path, &bundle).expect("write");
        check_bundle_trailer(&path).expect("a bundle's trailer");
        for bad in [b"garbage\n".to_vec(), {
            let mut b = vec![0u8; 100];
            b.extend_from_slice(&u64::MAX.to_be_bytes());
            b
        }] {
            fs::write(&path, &bad).expect("write");
            let e = check_bundle_trailer(&path).expect_err("not a bundle");
            assert!(e.to_string().contains("not a RAUC bundle"), "{e}");
        }
    }
}
