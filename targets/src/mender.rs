//! The `mender-module` target: runs an unchanged Mender update module (update module protocol
//! v3), so the modules a device already has (`single-file`, `directory`, `deb`, the community's)
//! install flotilla releases.
//!
//! # How the agent's steps map onto the module's states (full text in `docs/targets.md`)
//!
//! ```text
//! check     the module is an executable file; the state directory is usable (module not run)
//! stage     build the files tree <state_dir>/tree (version, header/, files/, tmp/), the verified
//!           artifact as files/<payload_file> beside the configured files; then Download,
//!           SupportsRollback, NeedsArtifactReboot
//! activate  ArtifactInstall; NeedsArtifactReboot "No" -> Done, "Yes"/"Automatic" -> RebootRequired
//! reboot    ArtifactReboot ("Yes") or the reboot_command ("Automatic");
//!           after a rollback: ArtifactRollbackReboot or the reboot_command
//! confirm   after a reboot, the first confirm is ArtifactVerifyReboot; then (after the health
//!           soak) ArtifactCommit, Cleanup
//! rollback  staged only: Cleanup. Installed: ArtifactRollback (if SupportsRollback is "Yes"),
//!           [ArtifactRollbackReboot, ArtifactVerifyRollbackReboot], ArtifactFailure, Cleanup
//! ```
//!
//! Every module call is recorded as an intent in `<state_dir>/flotilla-mender-state` before it
//! runs, so after a kill -9 the same state is called again (Mender's own client does the same
//! after a power cut) and nothing is skipped or done twice. `ArtifactInstall` is not repeated:
//! a crash inside it fails the action and the module gets `ArtifactRollback`, as in Mender.
//!
//! The tree is non-streaming: the payload is in `files/` before `Download` is called and there is
//! no `stream-next`, so a module that insists on streaming fails in `Download` with its own
//! error. The tree is removed after `Cleanup`, as Mender does; a committed update therefore
//! cannot be rolled back later (Mender modules have no state for that).

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tracing::{debug, info, warn};

use crate::error::TargetError;
use crate::fs::{atomic_copy, atomic_rename, atomic_write, create_private_dir, fsync_dir};
use crate::fs::{read_state_file, state_lines};
use crate::process::{self, check_executable, last_line, RunError};
use crate::script::ScriptTimeouts;
use crate::target::{ActionContext, Activation, UpdateTarget};

/// The record of the current action in the state directory.
const STATE_FILE: &str = "flotilla-mender-state";
/// The files tree handed to the module.
const TREE: &str = "tree";
/// Where a tree is built before it replaces [`TREE`].
const TREE_NEW: &str = "tree.new";
/// Where Debian's `mender-client` (and Mender's own images) keep the v3 modules.
pub const MODULES_DIR: &str = "/usr/share/mender/modules/v3";

/// How a [`MenderModuleTarget`] is set up; the agent's configuration fills it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MenderModuleConfig {
    /// The update module, by absolute path (`/usr/share/mender/modules/v3/single-file`).
    pub module: PathBuf,
    /// Where the target keeps its record and the files tree (created, mode 0700).
    pub state_dir: PathBuf,
    /// The name the artifact gets in `files/` (`single-file`: the `filename`; `directory`:
    /// `update.tar`). `None`: the manifest's name of the artifact.
    pub payload_file: Option<String>,
    /// More files written into `files/`, name -> content, e.g. `single-file`'s `dest_dir`,
    /// `filename` and `permissions`, which a Mender artifact carries beside its payload.
    pub files: BTreeMap<String, String>,
    /// Timeouts: `check` for the queries, `stage` for `Download`, `activate` for
    /// `ArtifactInstall` and `ArtifactReboot`, `confirm` for `ArtifactVerifyReboot`,
    /// `ArtifactCommit` and `Cleanup`, `rollback` for the rollback states.
    pub timeouts: ScriptTimeouts,
    /// Reboots the device when `NeedsArtifactReboot` answers `Automatic` (the module leaves the
    /// reboot to the updater). `None`: such a module cannot be used.
    pub reboot_command: Option<Vec<String>>,
}

impl MenderModuleConfig {
    /// The module an operator names: an absolute path, or the name of a module in
    /// [`MODULES_DIR`] (`single-file`).
    pub fn module_path(name: &str) -> Result<PathBuf, TargetError> {
        if name.starts_with('/') {
            Ok(PathBuf::from(name))
        } else if plain_file_name(name) {
            Ok(Path::new(MODULES_DIR).join(name))
        } else {
            Err(TargetError::InvalidConfig {
                field: "module",
                value: name.to_owned(),
                reason: format!(
                    "name a module in {MODULES_DIR} (e.g. \"single-file\") or give its absolute path"
                ),
            })
        }
    }

    /// A configuration with default timeouts, no extra files and no reboot command.
    pub fn new(module: PathBuf, state_dir: PathBuf) -> Self {
        Self {
            module,
            state_dir,
            payload_file: None,
            files: BTreeMap::new(),
            timeouts: ScriptTimeouts::default(),
            reboot_command: None,
        }
    }
}

/// An update target driven by a Mender update module. See the [module documentation](self).
#[derive(Debug, Clone)]
pub struct MenderModuleTarget {
    config: MenderModuleConfig,
}

/// Is `name` usable as one file name directly inside `files/`?
fn plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.contains('\0')
        && name.len() <= 255
}

impl MenderModuleTarget {
    /// A target for `config`. Checks the configuration only; the module first runs at `stage`.
    pub fn new(config: MenderModuleConfig) -> Result<Self, TargetError> {
        let invalid = |field, value: String, reason: &str| TargetError::InvalidConfig {
            field,
            value,
            reason: reason.to_owned(),
        };
        if !config.module.is_absolute() || config.module.file_name().is_none() {
            return Err(invalid(
                "module",
                config.module.display().to_string(),
                "name a module in /usr/share/mender/modules/v3 or give its absolute path",
            ));
        }
        if !config.state_dir.is_absolute() {
            return Err(invalid(
                "state_dir",
                config.state_dir.display().to_string(),
                "the mender-module target needs an absolute directory for its state",
            ));
        }
        if let Some(name) = &config.payload_file {
            if !plain_file_name(name) {
                return Err(invalid(
                    "payload_file",
                    name.clone(),
                    "must be one file name (no '/'), it is placed in the tree's files/",
                ));
            }
            if config.files.contains_key(name) {
                return Err(invalid(
                    "payload_file",
                    name.clone(),
                    "is also a key of files; the payload would overwrite it",
                ));
            }
        }
        for name in config.files.keys() {
            if !plain_file_name(name) {
                return Err(invalid(
                    "files",
                    name.clone(),
                    "each key must be one file name (no '/'), written into the tree's files/",
                ));
            }
        }
        let t = &config.timeouts;
        if [t.check, t.stage, t.activate, t.confirm, t.rollback]
            .iter()
            .any(Duration::is_zero)
        {
            return Err(invalid(
                "timeouts",
                format!("{t:?}"),
                "every timeout must be more than zero",
            ));
        }
        if let Some(cmd) = &config.reboot_command {
            if cmd.first().is_none_or(|p| p.trim().is_empty()) {
                return Err(invalid(
                    "reboot_command",
                    format!("{cmd:?}"),
                    "name a program such as [\"systemctl\", \"reboot\"], or leave it out",
                ));
            }
        }
        Ok(Self { config })
    }

    /// The module.
    pub fn module(&self) -> &Path {
        &self.config.module
    }

    /// The payload type written into the header: the module's file name, as in Mender.
    fn payload_type(&self) -> String {
        self.config
            .module
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    fn state_path(&self) -> PathBuf {
        self.config.state_dir.join(STATE_FILE)
    }

    fn tree(&self) -> PathBuf {
        self.config.state_dir.join(TREE)
    }

    fn read_state(&self) -> Result<Option<ModuleState>, TargetError> {
        read_state_file(self.state_path(), ModuleState::parse)
    }

    fn write_state(&self, state: &ModuleState) -> io::Result<()> {
        atomic_write(self.state_path(), state.encode())
    }

    /// Runs the module in `state` on the tree; returns its stdout on exit code 0.
    fn call(&self, state: &'static str, timeout: Duration) -> Result<String, TargetError> {
        let fail = |reason: String| TargetError::UpdateModule {
            module: self.config.module.clone(),
            state,
            reason,
        };
        debug!(module = %self.config.module.display(), state, "running update module");
        let tree = self.tree();
        let out = process::run(
            Command::new(&self.config.module)
                .arg(state)
                .arg(&tree)
                .current_dir(&self.config.state_dir),
            None,
            timeout,
        )
        .map_err(|e| match e {
            RunError::TimedOut { .. } => fail(format!(
                "ran longer than its timeout of {}s: {e}",
                timeout.as_secs_f64()
            )),
            e => fail(e.to_string()),
        })?;
        if out.status.success() {
            return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        // Modules write their errors to stderr, some (directory) to stdout.
        let said = last_line(&out.stderr)
            .or_else(|| last_line(&out.stdout))
            .unwrap_or_else(|| "it gave no reason".to_owned());
        Err(fail(format!("{said} ({})", out.status)))
    }

    /// A query whose answer is one of `allowed` (the first line of stdout, trimmed).
    fn query(&self, name: &'static str, allowed: &[&str]) -> Result<String, TargetError> {
        let out = self.call(name, self.config.timeouts.check)?;
        let answer = out.lines().next().unwrap_or("").trim().to_owned();
        if allowed.contains(&answer.as_str()) {
            Ok(answer)
        } else {
            Err(TargetError::UpdateModule {
                module: self.config.module.clone(),
                state: name,
                reason: format!(
                    "answered {:?}, not one of {allowed:?}",
                    answer.chars().take(100).collect::<String>()
                ),
            })
        }
    }

    /// Builds a fresh tree for `ctx` from `artifact`, replacing any earlier one.
    fn build_tree(
        &self,
        ctx: &ActionContext,
        artifact: &Path,
        previous_release: &str,
    ) -> io::Result<()> {
        let new = self.config.state_dir.join(TREE_NEW);
        remove_dir_if_present(&new)?;
        for dir in ["", "header", "files", "tmp"] {
            fs::create_dir(new.join(dir))?;
        }
        let ptype = self.payload_type();
        let provides = serde_json::json!({ "artifact_name": ctx.release });
        let header_info = serde_json::json!({
            "payloads": [{ "type": ptype }],
            "artifact_provides": provides,
            "artifact_depends": {},
        });
        let type_info = serde_json::json!({ "type": ptype, "artifact_provides": {} });
        let write = |name: &str, content: &str| atomic_write(new.join(name), content);
        write("version", "3\n")?;
        write("current_artifact_name", &format!("{previous_release}\n"))?;
        write("current_artifact_group", "\n")?;
        write("current_device_type", "\n")?;
        write("header/artifact_name", &format!("{}\n", ctx.release))?;
        write("header/artifact_group", "\n")?;
        write("header/payload_type", &format!("{ptype}\n"))?;
        write("header/header-info", &header_info.to_string())?;
        write("header/type-info", &type_info.to_string())?;
        write("header/meta-data", "{}")?;
        for (name, content) in &self.config.files {
            write(&format!("files/{name}"), content)?;
        }
        let payload = self
            .config
            .payload_file
            .clone()
            .unwrap_or_else(|| ctx.artifact_name.clone());
        if !plain_file_name(&payload) || self.config.files.contains_key(&payload) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "the artifact name {payload:?} cannot be the payload's file name in files/; \
                     set payload_file"
                ),
            ));
        }
        atomic_copy(artifact, new.join("files").join(&payload))?;
        for dir in ["header", "files", "tmp", ""] {
            fsync_dir(new.join(dir))?;
        }
        remove_dir_if_present(&self.tree())?;
        atomic_rename(&new, self.tree())
    }

    /// Removes the tree after `Cleanup`; a failure only leaves disk space used.
    fn remove_tree(&self) {
        if let Err(e) = remove_dir_if_present(&self.tree()) {
            warn!(tree = %self.tree().display(), "cannot remove the update module's files tree: {e}");
        }
    }

    /// Runs `Cleanup`, which only logs a failure: the outcome is already decided.
    fn cleanup(&self) {
        if let Err(e) = self.call("Cleanup", self.config.timeouts.confirm) {
            warn!("{e}");
        }
        self.remove_tree();
    }

    fn roll_back(&self, ctx: &ActionContext) -> Result<Activation, TargetError> {
        let action_id = ctx.validate_action_id()?;
        let mut state = match self.read_state()? {
            Some(state) if state.action_id == action_id => state,
            _ => {
                return Err(TargetError::NothingToRollBack {
                    path: self.config.state_dir.clone(),
                })
            }
        };
        let write = |state: &ModuleState| {
            self.write_state(state)
                .map_err(|source| TargetError::Rollback {
                    path: self.state_path(),
                    source,
                })
        };
        let timeout = self.config.timeouts.rollback;
        loop {
            let next = match state.phase {
                Phase::RolledBack => return Ok(Activation::Done),
                Phase::Committed | Phase::Committing | Phase::CleaningUp => {
                    return Err(TargetError::UpdateModule {
                        module: self.config.module.clone(),
                        state: "ArtifactRollback",
                        reason: format!(
                            "not called: action {action_id} was committed (ArtifactCommit) and \
                             Mender update modules cannot undo a committed update; install the \
                             previous release instead"
                        ),
                    })
                }
                // Nothing was installed: Mender only cleans up after a failed download.
                Phase::Staging | Phase::Staged => {
                    self.cleanup();
                    state.phase = Phase::RolledBack;
                    write(&state)?;
                    return Ok(Activation::Done);
                }
                Phase::Installing | Phase::Installed | Phase::Verified => {
                    if !state.supports_rollback {
                        // Mender's path for such a module: ArtifactFailure, Cleanup; the new
                        // content stays, and the device must say so.
                        state.phase = Phase::FailingWithoutRollback;
                        write(&state)?;
                        continue;
                    }
                    Phase::RollingBack
                }
                Phase::RollingBack => {
                    self.call("ArtifactRollback", timeout)?;
                    if state.reboot == Reboot::No {
                        Phase::Failing
                    } else {
                        Phase::RollbackRebooting
                    }
                }
                // Persisted before the reboot: back here, the reboot happened (or the agent was
                // only restarted; the module's verification tells).
                Phase::RollbackRebooting => {
                    state.phase = Phase::RollbackRebootPending;
                    write(&state)?;
                    return Ok(Activation::RebootRequired);
                }
                Phase::RollbackRebootPending => {
                    self.call("ArtifactVerifyRollbackReboot", timeout)?;
                    Phase::Failing
                }
                Phase::Failing | Phase::FailingWithoutRollback => {
                    if let Err(e) = self.call("ArtifactFailure", timeout) {
                        warn!("{e}");
                    }
                    self.cleanup();
                    let kept = state.phase == Phase::FailingWithoutRollback;
                    state.phase = if kept {
                        Phase::KeptAfterFailure
                    } else {
                        Phase::RolledBack
                    };
                    write(&state)?;
                    if kept {
                        continue;
                    }
                    info!(action_id, module = %self.config.module.display(), "update module rolled back");
                    return Ok(Activation::Done);
                }
                Phase::KeptAfterFailure => {
                    return Err(TargetError::UpdateModule {
                        module: self.config.module.clone(),
                        state: "SupportsRollback",
                        reason: format!(
                            "the module does not support rollback; ArtifactFailure and Cleanup \
                             ran and the content of action {action_id} stays installed"
                        ),
                    })
                }
            };
            state.phase = next;
            write(&state)?;
        }
    }
}

fn remove_dir_if_present(dir: &Path) -> io::Result<()> {
    match fs::remove_dir_all(dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

impl UpdateTarget for MenderModuleTarget {
    fn kind(&self) -> &'static str {
        "mender-module"
    }

    fn check(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        ctx.validate_action_id()?;
        check_executable(&self.config.module, "the update module")?;
        create_private_dir(&self.config.state_dir).map_err(|source| TargetError::Check {
            path: self.config.state_dir.clone(),
            source,
        })?;
        self.read_state()?;
        Ok(())
    }

    fn stage(&self, ctx: &ActionContext, artifact: &Path) -> Result<(), TargetError> {
        let action_id = ctx.validate_action_id()?;
        let previous = self.read_state()?;
        if let Some(state) = previous.as_ref().filter(|s| s.action_id == action_id) {
            if !matches!(state.phase, Phase::Staging | Phase::Staged) {
                return Err(TargetError::AlreadyActivated {
                    action_id: action_id.to_owned(),
                    path: self.config.module.clone(),
                });
            }
        }
        let stage_err = |path: PathBuf| move |source| TargetError::Stage { path, source };
        match fs::metadata(artifact) {
            Ok(meta) if meta.is_file() => {}
            Ok(_) => {
                return Err(stage_err(artifact.to_path_buf())(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "it is not a regular file",
                )))
            }
            Err(source) => return Err(stage_err(artifact.to_path_buf())(source)),
        }
        create_private_dir(&self.config.state_dir)
            .map_err(stage_err(self.config.state_dir.clone()))?;
        // What runs now, for current_artifact_name: the last release committed here.
        let installed = match &previous {
            Some(s) if s.action_id != action_id => match s.phase {
                Phase::Committed => s.release.clone(),
                _ => s.installed.clone(),
            },
            Some(s) => s.installed.clone(),
            None => String::new(),
        };
        let mut state = ModuleState {
            action_id: action_id.to_owned(),
            release: ctx.release.clone(),
            installed,
            phase: Phase::Staging,
            supports_rollback: false,
            reboot: Reboot::No,
        };
        self.write_state(&state)
            .map_err(stage_err(self.state_path()))?;
        self.build_tree(ctx, artifact, &state.installed)
            .map_err(stage_err(self.tree()))?;
        self.call("Download", self.config.timeouts.stage)?;
        state.supports_rollback = self.query("SupportsRollback", &["Yes", "No"])? == "Yes";
        state.reboot = match self
            .query("NeedsArtifactReboot", &["No", "Yes", "Automatic"])?
            .as_str()
        {
            "Yes" => Reboot::Module,
            "Automatic" => Reboot::Automatic,
            _ => Reboot::No,
        };
        if state.reboot == Reboot::Automatic && self.config.reboot_command.is_none() {
            return Err(TargetError::UpdateModule {
                module: self.config.module.clone(),
                state: "NeedsArtifactReboot",
                reason: "answered \"Automatic\": the device must be rebooted by the updater, \
                         and this target has no reboot_command"
                    .to_owned(),
            });
        }
        state.phase = Phase::Staged;
        self.write_state(&state)
            .map_err(stage_err(self.state_path()))?;
        info!(action_id, release = %ctx.release, module = %self.config.module.display(), "staged for the update module");
        Ok(())
    }

    fn activate(&self, ctx: &ActionContext) -> Result<Activation, TargetError> {
        let action_id = ctx.validate_action_id()?;
        let not_staged = || TargetError::NotStaged {
            action_id: action_id.to_owned(),
            path: self.config.module.clone(),
        };
        let mut state = match self.read_state()? {
            Some(state) if state.action_id == action_id => state,
            _ => return Err(not_staged()),
        };
        match state.phase {
            Phase::Staging => return Err(not_staged()),
            Phase::Staged | Phase::Installing => {}
            Phase::Installed | Phase::Verified | Phase::Committing | Phase::CleaningUp => {
                return Ok(activation(state.reboot))
            }
            Phase::Committed => return Ok(Activation::Done),
            _ => {
                return Err(TargetError::RolledBack {
                    action_id: action_id.to_owned(),
                    path: self.config.module.clone(),
                })
            }
        }
        let write = |state: &ModuleState| {
            self.write_state(state)
                .map_err(|source| TargetError::Activate {
                    path: self.state_path(),
                    source,
                })
        };
        state.phase = Phase::Installing;
        write(&state)?;
        self.call("ArtifactInstall", self.config.timeouts.activate)?;
        state.phase = Phase::Installed;
        write(&state)?;
        info!(action_id, release = %ctx.release, module = %self.config.module.display(), "update module installed");
        Ok(activation(state.reboot))
    }

    fn confirm(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        let action_id = ctx.validate_action_id()?;
        let not_activated = || TargetError::NotActivated {
            action_id: action_id.to_owned(),
            path: self.config.module.clone(),
        };
        let mut state = match self.read_state()? {
            Some(state) if state.action_id == action_id => state,
            _ => return Err(not_activated()),
        };
        let write = |state: &ModuleState| {
            self.write_state(state)
                .map_err(|source| TargetError::Confirm {
                    path: self.state_path(),
                    source,
                })
        };
        let timeout = self.config.timeouts.confirm;
        match state.phase {
            Phase::Committed => return Ok(()),
            Phase::Staging | Phase::Staged | Phase::Installing => return Err(not_activated()),
            // The agent's first confirm after the reboot: the module checks the new content
            // runs. ArtifactCommit waits for the confirm after the health soak, so a failed
            // soak can still roll back.
            Phase::Installed if state.reboot != Reboot::No => {
                self.call("ArtifactVerifyReboot", timeout)?;
                state.phase = Phase::Verified;
                write(&state)?;
                return Ok(());
            }
            Phase::Installed | Phase::Verified => {
                state.phase = Phase::Committing;
                write(&state)?;
            }
            Phase::Committing | Phase::CleaningUp => {}
            _ => {
                return Err(TargetError::RolledBack {
                    action_id: action_id.to_owned(),
                    path: self.config.module.clone(),
                })
            }
        }
        if state.phase == Phase::Committing {
            self.call("ArtifactCommit", timeout)?;
            state.phase = Phase::CleaningUp;
            write(&state)?;
        }
        self.cleanup();
        state.phase = Phase::Committed;
        state.installed = state.release.clone();
        write(&state)?;
        info!(action_id, release = %ctx.release, module = %self.config.module.display(), "update module committed");
        Ok(())
    }

    fn rollback(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        self.roll_back(ctx).map(|_| ())
    }

    fn rollback_activation(&self, ctx: &ActionContext) -> Result<Activation, TargetError> {
        self.roll_back(ctx)
    }

    fn reboot(&self) -> Result<(), TargetError> {
        let state = self.read_state()?;
        let rolling_back = state
            .as_ref()
            .is_some_and(|s| s.phase == Phase::RollbackRebootPending);
        match state.map(|s| s.reboot) {
            Some(Reboot::Module) => {
                let name = if rolling_back {
                    "ArtifactRollbackReboot"
                } else {
                    "ArtifactReboot"
                };
                self.call(name, self.config.timeouts.activate).map(|_| ())
            }
            _ => {
                let Some((program, args)) = self
                    .config
                    .reboot_command
                    .as_deref()
                    .and_then(<[String]>::split_first)
                else {
                    return Err(TargetError::Reboot {
                        command: String::new(),
                        reason: format!(
                            "the update module {} needs a reboot the updater does, and no \
                             reboot_command is configured",
                            self.config.module.display()
                        ),
                    });
                };
                let command = std::iter::once(program)
                    .chain(args)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(" ");
                let out = process::run(
                    Command::new(program).args(args),
                    None,
                    Duration::from_secs(120),
                )
                .map_err(|e| TargetError::Reboot {
                    command: command.clone(),
                    reason: e.to_string(),
                })?;
                if out.status.success() {
                    Ok(())
                } else {
                    Err(TargetError::Reboot {
                        command,
                        reason: last_line(&out.stderr).unwrap_or_else(|| out.status.to_string()),
                    })
                }
            }
        }
    }

    /// `ArtifactInstall` of most modules backs up what runs first; a second call would back up
    /// the new content. A crash inside it fails the action and the module gets
    /// `ArtifactRollback`.
    fn activate_is_repeatable(&self) -> bool {
        false
    }
}

fn activation(reboot: Reboot) -> Activation {
    if reboot == Reboot::No {
        Activation::Done
    } else {
        Activation::RebootRequired
    }
}

/// The module's answer to `NeedsArtifactReboot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reboot {
    /// "No".
    No,
    /// "Yes": the module reboots in `ArtifactReboot`.
    Module,
    /// "Automatic": the updater reboots (the `reboot_command`).
    Automatic,
}

impl Reboot {
    fn as_str(self) -> &'static str {
        match self {
            Reboot::No => "no",
            Reboot::Module => "module",
            Reboot::Automatic => "automatic",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "no" => Reboot::No,
            "module" => Reboot::Module,
            "automatic" => Reboot::Automatic,
            _ => return None,
        })
    }
}

/// Where an action stands. Phases ending in `-ing` are intents: the module state they name is
/// called (again) when the step finds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Staging,
    Staged,
    Installing,
    Installed,
    Verified,
    Committing,
    CleaningUp,
    Committed,
    RollingBack,
    RollbackRebooting,
    RollbackRebootPending,
    Failing,
    FailingWithoutRollback,
    RolledBack,
    KeptAfterFailure,
}

const PHASES: [(Phase, &str); 15] = [
    (Phase::Staging, "staging"),
    (Phase::Staged, "staged"),
    (Phase::Installing, "installing"),
    (Phase::Installed, "installed"),
    (Phase::Verified, "verified"),
    (Phase::Committing, "committing"),
    (Phase::CleaningUp, "cleaning-up"),
    (Phase::Committed, "committed"),
    (Phase::RollingBack, "rolling-back"),
    (Phase::RollbackRebooting, "rollback-rebooting"),
    (Phase::RollbackRebootPending, "rollback-reboot-pending"),
    (Phase::Failing, "failing"),
    (Phase::FailingWithoutRollback, "failing-without-rollback"),
    (Phase::RolledBack, "rolled-back"),
    (Phase::KeptAfterFailure, "kept-after-failure"),
];

impl Phase {
    fn as_str(self) -> &'static str {
        PHASES
            .iter()
            .find(|(p, _)| *p == self)
            .map_or("unknown", |(_, s)| s)
    }

    fn parse(s: &str) -> Option<Self> {
        PHASES.iter().find(|(_, n)| *n == s).map(|(p, _)| *p)
    }
}

/// The bookkeeping record, plain `key=value` text.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ModuleState {
    action_id: String,
    /// The release this action installs.
    release: String,
    /// The release committed here before it (for `current_artifact_name`); may be empty.
    installed: String,
    phase: Phase,
    supports_rollback: bool,
    reboot: Reboot,
}

impl ModuleState {
    fn encode(&self) -> String {
        format!(
            "# flotilla mender-module target state; written atomically, do not edit\n\
             action={}\nrelease={}\ninstalled={}\nphase={}\nsupports_rollback={}\nreboot={}\n",
            self.action_id,
            one_line(&self.release),
            one_line(&self.installed),
            self.phase.as_str(),
            self.supports_rollback,
            self.reboot.as_str(),
        )
    }

    fn parse(text: &str) -> Result<Self, String> {
        let (mut action_id, mut phase, mut reboot) = (None, None, None);
        let (mut release, mut installed, mut supports_rollback) =
            (String::new(), String::new(), false);
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
                "release" => release = value.to_owned(),
                "installed" => installed = value.to_owned(),
                "phase" => phase = Some(Phase::parse(value).ok_or_else(bad)?),
                "supports_rollback" => supports_rollback = value.parse().map_err(|_| bad())?,
                "reboot" => reboot = Some(Reboot::parse(value).ok_or_else(bad)?),
                _ => return Err(format!("unknown key {key:?}")),
            }
        }
        Ok(Self {
            action_id: action_id.ok_or("action= is missing")?,
            release,
            installed,
            phase: phase.ok_or("phase= is missing")?,
            supports_rollback,
            reboot: reboot.ok_or("reboot= is missing")?,
        })
    }
}

/// A release name kept on one line of the record (names come from a signed manifest, but a
/// newline would still break the record).
fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ").trim().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A module in a temp dir whose body is `body` (a `case "$1"` in sh), logging every call.
    struct Fixture {
        dir: tempfile::TempDir,
    }

    impl Fixture {
        fn new(body: &str) -> Self {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("module");
            let log = dir.path().join("calls");
            fs::write(
                &path,
                format!(
                    "#!/bin/sh\necho \"$1\" >> {}\nFILES=\"$2\"\n{body}\n",
                    log.display()
                ),
            )
            .expect("module");
            fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod");
            Self { dir }
        }

        fn target(&self) -> MenderModuleTarget {
            let mut config = MenderModuleConfig::new(
                self.dir.path().join("module"),
                self.dir.path().join("state"),
            );
            config.files.insert("dest_dir".into(), "/opt/app".into());
            MenderModuleTarget::new(config).expect("config")
        }

        fn artifact(&self) -> PathBuf {
            let path = self.dir.path().join("artifact");
            fs::write(&path, "payload").expect("artifact");
            path
        }

        fn calls(&self) -> Vec<String> {
            fs::read_to_string(self.dir.path().join("calls"))
                .unwrap_or_default()
                .lines()
                .map(str::to_owned)
                .collect()
        }
    }

    fn ctx() -> ActionContext {
        ActionContext::new("act-7", "app-2.0", "app.bin")
    }

    const YES_NO: &str = r#"case "$1" in
  SupportsRollback) echo Yes ;;
  NeedsArtifactReboot) echo No ;;
esac"#;

    #[test]
    fn the_tree_holds_the_header_and_files_the_module_reads() {
        let f = Fixture::new(&format!(
            "{YES_NO}\nif [ \"$1\" = ArtifactInstall ]; then cp -r \"$FILES\" \"$(dirname \"$0\")/seen\"; fi"
        ));
        let t = f.target();
        t.check(&ctx()).expect("check");
        t.stage(&ctx(), &f.artifact()).expect("stage");
        assert_eq!(t.activate(&ctx()).expect("activate"), Activation::Done);
        let seen = f.dir.path().join("seen");
        let read = |p: &str| fs::read_to_string(seen.join(p)).expect(p);
        assert_eq!(read("version"), "3\n");
        assert_eq!(read("files/app.bin"), "payload");
        assert_eq!(read("files/dest_dir"), "/opt/app");
        assert_eq!(read("header/artifact_name"), "app-2.0\n");
        assert!(read("header/type-info").contains("\"type\":\"module\""));
        assert!(seen.join("tmp").is_dir());
        t.confirm(&ctx()).expect("confirm");
        assert_eq!(
            f.calls(),
            [
                "Download",
                "SupportsRollback",
                "NeedsArtifactReboot",
                "ArtifactInstall",
                "ArtifactCommit",
                "Cleanup"
            ]
        );
        assert!(
            !f.dir.path().join("state/tree").exists(),
            "removed after Cleanup"
        );
    }

    #[test]
    fn a_failing_install_rolls_back_with_the_modules_error() {
        let f = Fixture::new(&format!(
            "{YES_NO}\n[ \"$1\" = ArtifactInstall ] && {{ echo 'disk full on /opt' >&2; exit 1; }}\nexit 0"
        ));
        let t = f.target();
        t.stage(&ctx(), &f.artifact()).expect("stage");
        let err = t.activate(&ctx()).expect_err("install fails");
        let msg = err.to_string();
        assert!(
            msg.contains("ArtifactInstall failed: disk full on /opt"),
            "{msg}"
        );
        t.rollback(&ctx()).expect("rollback");
        t.rollback(&ctx()).expect("rollback again is a no-op");
        assert_eq!(
            f.calls()[3..],
            [
                "ArtifactInstall",
                "ArtifactRollback",
                "ArtifactFailure",
                "Cleanup"
            ]
        );
    }

    #[test]
    fn a_reboot_module_verifies_after_the_reboot_and_commits_after_the_soak() {
        let f = Fixture::new(
            r#"case "$1" in SupportsRollback) echo Yes ;; NeedsArtifactReboot) echo Yes ;; esac"#,
        );
        let t = f.target();
        t.stage(&ctx(), &f.artifact()).expect("stage");
        assert_eq!(
            t.activate(&ctx()).expect("activate"),
            Activation::RebootRequired
        );
        t.reboot().expect("ArtifactReboot");
        t.confirm(&ctx()).expect("verify");
        t.confirm(&ctx()).expect("commit");
        assert_eq!(
            f.calls()[3..],
            [
                "ArtifactInstall",
                "ArtifactReboot",
                "ArtifactVerifyReboot",
                "ArtifactCommit",
                "Cleanup"
            ]
        );
        let err = t.rollback(&ctx()).expect_err("committed");
        assert!(
            err.to_string().contains("cannot undo a committed update"),
            "{err}"
        );
    }

    #[test]
    fn a_rollback_of_a_reboot_module_reboots_and_verifies() {
        let f = Fixture::new(
            r#"case "$1" in SupportsRollback) echo Yes ;; NeedsArtifactReboot) echo Yes ;; esac"#,
        );
        let t = f.target();
        t.stage(&ctx(), &f.artifact()).expect("stage");
        t.activate(&ctx()).expect("activate");
        assert_eq!(
            t.rollback_activation(&ctx()).expect("rollback"),
            Activation::RebootRequired
        );
        t.reboot().expect("ArtifactRollbackReboot");
        assert_eq!(
            t.rollback_activation(&ctx()).expect("after"),
            Activation::Done
        );
        assert_eq!(
            f.calls()[4..],
            [
                "ArtifactRollback",
                "ArtifactRollbackReboot",
                "ArtifactVerifyRollbackReboot",
                "ArtifactFailure",
                "Cleanup"
            ]
        );
    }

    #[test]
    fn a_module_without_rollback_says_the_new_content_stays() {
        let f = Fixture::new(
            r#"case "$1" in SupportsRollback) echo No ;; NeedsArtifactReboot) echo No ;; esac"#,
        );
        let t = f.target();
        t.stage(&ctx(), &f.artifact()).expect("stage");
        t.activate(&ctx()).expect("activate");
        let err = t.rollback(&ctx()).expect_err("cannot roll back");
        assert!(err.to_string().contains("stays installed"), "{err}");
        assert!(!f.calls().contains(&"ArtifactRollback".to_owned()));
        assert!(f
            .calls()
            .ends_with(&["ArtifactFailure".into(), "Cleanup".into()]));
    }

    #[test]
    fn a_query_answer_outside_the_protocol_is_refused() {
        let f = Fixture::new(r#"case "$1" in SupportsRollback) echo maybe ;; esac"#);
        let err = f
            .target()
            .stage(&ctx(), &f.artifact())
            .expect_err("bad answer");
        assert!(
            err.to_string()
                .contains("SupportsRollback failed: answered \"maybe\""),
            "{err}"
        );
    }

    #[test]
    fn bad_configurations_name_the_field() {
        let base = MenderModuleConfig::new("/m/single-file".into(), "/var/lib/x".into());
        let mut c = base.clone();
        c.module = "single-file".into();
        let err = MenderModuleTarget::new(c).expect_err("relative");
        assert!(err.to_string().starts_with("invalid module"), "{err}");
        let mut c = base.clone();
        c.files.insert("../etc/passwd".into(), "x".into());
        let err = MenderModuleTarget::new(c).expect_err("escaping");
        assert!(err.to_string().starts_with("invalid files"), "{err}");
        let mut c = base;
        c.payload_file = Some("dest_dir".into());
        c.files.insert("dest_dir".into(), "/opt".into());
        let err = MenderModuleTarget::new(c).expect_err("collision");
        assert!(err.to_string().starts_with("invalid payload_file"), "{err}");
    }

    #[test]
    fn state_record_round_trips_and_rejects_damage() {
        let state = ModuleState {
            action_id: "a1".into(),
            release: "app-2".into(),
            installed: "app-1".into(),
            phase: Phase::RollbackRebootPending,
            supports_rollback: true,
            reboot: Reboot::Automatic,
        };
        assert_eq!(ModuleState::parse(&state.encode()), Ok(state));
        for bad in ["", "action=a1\n", "action=a1\nphase=x\nreboot=no\n"] {
            assert!(ModuleState::parse(bad).is_err(), "{bad:?}");
        }
    }
}
