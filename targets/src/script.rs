//! The `script` target: hands every step to a user's executable, so containers, packages or a
//! co-processor's firmware can be updated without writing Rust.
//!
//! # Contract (the full text is in `docs/targets.md`)
//!
//! - Invocation: `<script> <subcommand>` with `subcommand` one of `check`, `stage`, `activate`,
//!   `confirm`, `rollback`; working directory = `FLOTILLA_STATE_DIR`; stdin is empty.
//! - Environment: `FLOTILLA_SCRIPT_API=1`, `FLOTILLA_ACTION_ID`, `FLOTILLA_RELEASE`,
//!   `FLOTILLA_ARTIFACT_NAME`, `FLOTILLA_STATE_DIR`; `FLOTILLA_ARTIFACT` (path of the verified
//!   artifact) for `stage`; `FLOTILLA_PHASE` (how far the action got) for `rollback`; plus the
//!   operator's own variables from the configuration.
//! - Reply: the last non-empty line of stdout is `{"ok": true, "message": "...", "reboot":
//!   false}` (every field optional), or stdout is empty. Earlier lines are logged.
//! - Exit codes: `0` ok, `1` failed, `2` not supported (fine for `check` and `confirm`, an
//!   error for the others), `3` temporary failure (try again later). Anything else is a failure.
//! - Each subcommand has a timeout; past it the script and everything it started are killed.
//!
//! # Bookkeeping
//!
//! The target keeps `<state_dir>/flotilla-script-state` (action, phase, whether activation asked
//! for a reboot) and enforces the [`UpdateTarget`] contract itself, so a script only does the
//! work: `activate` without a successful `stage` is refused without running the script, a
//! rollback for an action that never ran here is `NothingToRollBack`, and a repeated `confirm`
//! or `rollback` after it succeeded does not run the script again. Staging a new action replaces
//! the record: one step back is kept, like an A/B pair.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde::Deserialize;
use tracing::{debug, info};

use crate::error::TargetError;
use crate::fs::{atomic_write, create_private_dir, read_state_file, state_lines};
use crate::process::{self, check_executable, last_line, RunError};
use crate::target::{ActionContext, Activation, UpdateTarget};

/// Name of the bookkeeping record in the state directory; scripts must not use names that
/// start with `flotilla-`.
const STATE_FILE: &str = "flotilla-script-state";
/// Version of the contract, passed as `FLOTILLA_SCRIPT_API`.
const API_VERSION: &str = "1";

/// How long each subcommand may run before it is killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScriptTimeouts {
    /// `check`; default 1 minute.
    pub check: Duration,
    /// `stage` (may copy or unpack a large artifact); default 30 minutes.
    pub stage: Duration,
    /// `activate`; default 10 minutes.
    pub activate: Duration,
    /// `confirm`; default 1 minute.
    pub confirm: Duration,
    /// `rollback`; default 10 minutes.
    pub rollback: Duration,
}

impl Default for ScriptTimeouts {
    fn default() -> Self {
        Self {
            check: Duration::from_secs(60),
            stage: Duration::from_secs(30 * 60),
            activate: Duration::from_secs(10 * 60),
            confirm: Duration::from_secs(60),
            rollback: Duration::from_secs(10 * 60),
        }
    }
}

impl ScriptTimeouts {
    /// The same timeout for every subcommand.
    pub fn all(timeout: Duration) -> Self {
        Self {
            check: timeout,
            stage: timeout,
            activate: timeout,
            confirm: timeout,
            rollback: timeout,
        }
    }

    fn of(&self, sub: Subcommand) -> Duration {
        match sub {
            Subcommand::Check => self.check,
            Subcommand::Stage => self.stage,
            Subcommand::Activate => self.activate,
            Subcommand::Confirm => self.confirm,
            Subcommand::Rollback => self.rollback,
        }
    }
}

/// How a [`ScriptTarget`] is set up; the agent's configuration fills it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScriptConfig {
    /// The executable, by absolute path.
    pub path: PathBuf,
    /// A directory for the script and the target's record (created if missing; its parent
    /// must exist). Passed as `FLOTILLA_STATE_DIR` and used as the working directory.
    pub state_dir: PathBuf,
    /// Per-subcommand timeouts.
    pub timeouts: ScriptTimeouts,
    /// Extra environment for the script (site settings such as a compose project directory).
    /// Names starting with `FLOTILLA_` are reserved.
    pub env: BTreeMap<String, String>,
    /// Program and arguments that reboot the device when the script's reply says `"reboot":
    /// true`; `None` leaves rebooting to the agent's operator.
    pub reboot_command: Option<Vec<String>>,
}

impl ScriptConfig {
    /// A configuration with default timeouts, no extra environment and no reboot command.
    pub fn new(path: PathBuf, state_dir: PathBuf) -> Self {
        Self {
            path,
            state_dir,
            timeouts: ScriptTimeouts::default(),
            env: BTreeMap::new(),
            reboot_command: None,
        }
    }
}

/// An update target driven by a user's executable.
///
/// See the [module documentation](self) and `docs/targets.md` for the contract.
#[derive(Debug, Clone)]
pub struct ScriptTarget {
    config: ScriptConfig,
}

impl ScriptTarget {
    /// A target for `config`. Checks the configuration only; the script first runs at `check`.
    pub fn new(config: ScriptConfig) -> Result<Self, TargetError> {
        if !config.path.is_absolute() {
            return Err(TargetError::InvalidConfig {
                field: "path",
                value: config.path.display().to_string(),
                reason: "the script must be given by absolute path".to_owned(),
            });
        }
        if config.state_dir.as_os_str().is_empty() {
            return Err(TargetError::InvalidConfig {
                field: "state_dir",
                value: String::new(),
                reason: "the script target needs a directory for its state".to_owned(),
            });
        }
        let t = &config.timeouts;
        for (name, timeout) in [
            ("check", t.check),
            ("stage", t.stage),
            ("activate", t.activate),
            ("confirm", t.confirm),
            ("rollback", t.rollback),
        ] {
            if timeout.is_zero() {
                return Err(TargetError::InvalidConfig {
                    field: "timeouts",
                    value: format!("{name} = 0s"),
                    reason: "every subcommand needs a timeout above zero".to_owned(),
                });
            }
        }
        for name in config.env.keys() {
            let valid = !name.is_empty()
                && !name.starts_with(|c: char| c.is_ascii_digit())
                && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !valid || name.starts_with("FLOTILLA_") {
                return Err(TargetError::InvalidConfig {
                    field: "env",
                    value: name.clone(),
                    reason: "variable names are letters, digits and '_', and FLOTILLA_* is \
                             reserved for the contract"
                        .to_owned(),
                });
            }
        }
        if let Some(cmd) = &config.reboot_command {
            if cmd.first().is_none_or(|p| p.trim().is_empty()) {
                return Err(TargetError::InvalidConfig {
                    field: "reboot_command",
                    value: format!("{cmd:?}"),
                    reason: "name a program such as [\"systemctl\", \"reboot\"], or leave it out"
                        .to_owned(),
                });
            }
        }
        Ok(Self { config })
    }

    /// The script.
    pub fn path(&self) -> &Path {
        &self.config.path
    }

    /// The state directory.
    pub fn state_dir(&self) -> &Path {
        &self.config.state_dir
    }

    fn state_path(&self) -> PathBuf {
        self.config.state_dir.join(STATE_FILE)
    }

    fn read_state(&self) -> Result<Option<ScriptState>, TargetError> {
        read_state_file(self.state_path(), ScriptState::parse)
    }

    fn write_state(&self, state: &ScriptState) -> io::Result<()> {
        atomic_write(self.state_path(), state.encode())
    }

    fn ensure_state_dir(&self) -> io::Result<()> {
        create_private_dir(&self.config.state_dir)
    }

    /// Runs one subcommand and interprets its exit code and reply.
    fn invoke(
        &self,
        sub: Subcommand,
        ctx: &ActionContext,
        extra: &[(&str, &str)],
    ) -> Result<Reply, TargetError> {
        let fail = |reason: String, temporary: bool| TargetError::Script {
            script: self.config.path.clone(),
            subcommand: sub.name(),
            reason,
            temporary,
        };
        let timeout = self.config.timeouts.of(sub);
        let mut cmd = Command::new(&self.config.path);
        cmd.arg(sub.name())
            .current_dir(&self.config.state_dir)
            .envs(&self.config.env)
            .env("FLOTILLA_SCRIPT_API", API_VERSION)
            .env("FLOTILLA_ACTION_ID", &ctx.action_id)
            .env("FLOTILLA_RELEASE", &ctx.release)
            .env("FLOTILLA_ARTIFACT_NAME", &ctx.artifact_name)
            .env("FLOTILLA_STATE_DIR", &self.config.state_dir)
            .envs(extra.iter().copied());
        debug!(script = %self.config.path.display(), subcommand = sub.name(), action_id = %ctx.action_id, "running update script");
        let out = process::run(&mut cmd, None, timeout).map_err(|e| match e {
            RunError::TimedOut { .. } => fail(
                format!(
                    "ran longer than its timeout of {}s: {e}",
                    timeout.as_secs_f64()
                ),
                false,
            ),
            e => fail(e.to_string(), false),
        })?;
        let stderr_tail = last_line(&out.stderr);
        let reply = parse_reply(&out.stdout);
        let describe = |message: Option<&str>, code: &str| {
            let mut text = message
                .filter(|m| !m.trim().is_empty())
                .map(str::to_owned)
                .or_else(|| stderr_tail.clone())
                .unwrap_or_else(|| "it gave no reason".to_owned());
            text.push_str(&format!(" ({code})"));
            if let (Some(tail), Some(m)) = (&stderr_tail, message) {
                if !m.trim().is_empty() && !text.contains(tail.as_str()) {
                    text.push_str(&format!("; last stderr line: {tail}"));
                }
            }
            text
        };
        let Some(code) = out.status.code() else {
            return Err(fail(describe(None, &format!("{}", out.status)), false));
        };
        match (code, reply) {
            (0, Ok(reply)) if reply.ok != Some(false) => {
                if let Some(message) = reply.message.as_deref().filter(|m| !m.is_empty()) {
                    info!(script = %self.config.path.display(), subcommand = sub.name(), message, "update script");
                }
                Ok(reply)
            }
            (0, Ok(reply)) => Err(fail(
                describe(reply.message.as_deref(), "exit code 0 with \"ok\": false"),
                false,
            )),
            (0, Err(bad)) => Err(fail(
                format!("exited 0 but its reply is not the documented JSON: {bad}"),
                false,
            )),
            (2, _) if sub.may_be_unsupported() => {
                debug!(
                    subcommand = sub.name(),
                    "update script does not support it; nothing to do"
                );
                Ok(Reply::default())
            }
            (2, reply) => Err(fail(
                describe(
                    reply.ok().and_then(|r| r.message).as_deref(),
                    "exit code 2: the script does not support this subcommand",
                ),
                false,
            )),
            (3, reply) => Err(fail(
                describe(
                    reply.ok().and_then(|r| r.message).as_deref(),
                    "exit code 3: temporary failure",
                ),
                true,
            )),
            (1, reply) => Err(fail(
                describe(reply.ok().and_then(|r| r.message).as_deref(), "exit code 1"),
                false,
            )),
            (code, reply) => Err(fail(
                describe(
                    reply.ok().and_then(|r| r.message).as_deref(),
                    &format!("exit code {code}, not one of the documented 0-3"),
                ),
                false,
            )),
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
        if state.phase == Phase::RolledBack {
            debug!(action_id, "script update already rolled back");
            return Ok(activation(state.reboot));
        }
        let reply = self.invoke(
            Subcommand::Rollback,
            ctx,
            &[("FLOTILLA_PHASE", state.phase.as_str())],
        )?;
        let reboot = reply.reboot.unwrap_or(false);
        self.write_state(&ScriptState {
            phase: Phase::RolledBack,
            reboot,
            ..state
        })
        .map_err(|source| TargetError::Rollback {
            path: self.state_path(),
            source,
        })?;
        info!(action_id, script = %self.config.path.display(), "script update rolled back");
        Ok(activation(reboot))
    }
}

impl UpdateTarget for ScriptTarget {
    fn kind(&self) -> &'static str {
        "script"
    }

    fn check(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        ctx.validate_action_id()?;
        check_executable(&self.config.path, "the update script")?;
        self.ensure_state_dir()
            .map_err(|source| TargetError::Check {
                path: self.config.state_dir.clone(),
                source,
            })?;
        self.read_state()?;
        self.invoke(Subcommand::Check, ctx, &[])?;
        Ok(())
    }

    fn stage(&self, ctx: &ActionContext, artifact: &Path) -> Result<(), TargetError> {
        let action_id = ctx.validate_action_id()?;
        if let Some(state) = self.read_state()?.filter(|s| s.action_id == action_id) {
            if !matches!(state.phase, Phase::Staging | Phase::Staged) {
                return Err(TargetError::AlreadyActivated {
                    action_id: action_id.to_owned(),
                    path: self.config.path.clone(),
                });
            }
        }
        match fs::metadata(artifact) {
            Ok(meta) if meta.is_file() => {}
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
        }
        self.ensure_state_dir()
            .map_err(|source| TargetError::Stage {
                path: self.config.state_dir.clone(),
                source,
            })?;
        let mut state = ScriptState {
            action_id: action_id.to_owned(),
            phase: Phase::Staging,
            reboot: false,
        };
        let write = |state: &ScriptState| {
            self.write_state(state)
                .map_err(|source| TargetError::Stage {
                    path: self.state_path(),
                    source,
                })
        };
        write(&state)?;
        let artifact_text = artifact.to_string_lossy();
        self.invoke(
            Subcommand::Stage,
            ctx,
            &[("FLOTILLA_ARTIFACT", artifact_text.as_ref())],
        )?;
        state.phase = Phase::Staged;
        write(&state)?;
        info!(action_id, release = %ctx.release, script = %self.config.path.display(), "staged script update");
        Ok(())
    }

    fn activate(&self, ctx: &ActionContext) -> Result<Activation, TargetError> {
        let action_id = ctx.validate_action_id()?;
        let state = match self.read_state()? {
            Some(state) if state.action_id == action_id => state,
            _ => {
                return Err(TargetError::NotStaged {
                    action_id: action_id.to_owned(),
                    path: self.config.path.clone(),
                })
            }
        };
        match state.phase {
            Phase::Staging => {
                return Err(TargetError::NotStaged {
                    action_id: action_id.to_owned(),
                    path: self.config.path.clone(),
                })
            }
            Phase::RolledBack => {
                return Err(TargetError::RolledBack {
                    action_id: action_id.to_owned(),
                    path: self.config.path.clone(),
                })
            }
            Phase::Activated | Phase::Confirmed => return Ok(activation(state.reboot)),
            Phase::Staged | Phase::Activating => {}
        }
        let write = |state: &ScriptState| {
            self.write_state(state)
                .map_err(|source| TargetError::Activate {
                    path: self.state_path(),
                    source,
                })
        };
        // Recorded first, so a rollback after a crash inside the script tells it activation
        // may have half happened.
        write(&ScriptState {
            phase: Phase::Activating,
            ..state.clone()
        })?;
        let reply = self.invoke(Subcommand::Activate, ctx, &[])?;
        let reboot = reply.reboot.unwrap_or(false);
        write(&ScriptState {
            phase: Phase::Activated,
            reboot,
            ..state
        })?;
        info!(action_id, release = %ctx.release, reboot, script = %self.config.path.display(), "activated script update");
        Ok(activation(reboot))
    }

    fn confirm(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        let action_id = ctx.validate_action_id()?;
        let not_activated = || TargetError::NotActivated {
            action_id: action_id.to_owned(),
            path: self.config.path.clone(),
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
                    path: self.config.path.clone(),
                })
            }
            Phase::Staging | Phase::Staged | Phase::Activating => return Err(not_activated()),
            Phase::Activated => {}
        }
        self.invoke(Subcommand::Confirm, ctx, &[])?;
        self.write_state(&ScriptState {
            phase: Phase::Confirmed,
            ..state
        })
        .map_err(|source| TargetError::Confirm {
            path: self.state_path(),
            source,
        })?;
        info!(action_id, release = %ctx.release, script = %self.config.path.display(), "confirmed script update");
        Ok(())
    }

    fn rollback(&self, ctx: &ActionContext) -> Result<(), TargetError> {
        self.roll_back(ctx).map(|_| ())
    }

    fn rollback_activation(&self, ctx: &ActionContext) -> Result<Activation, TargetError> {
        self.roll_back(ctx)
    }

    fn reboot(&self) -> Result<(), TargetError> {
        let Some((program, args)) = self
            .config
            .reboot_command
            .as_deref()
            .and_then(<[String]>::split_first)
        else {
            return Err(TargetError::Reboot {
                command: String::new(),
                reason: format!(
                    "the script {} asked for a reboot but no reboot_command is configured",
                    self.config.path.display()
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

    /// The target cannot know whether a script's `activate` may run twice; a crash inside it
    /// fails the action and rolls back (the script's `rollback` gets `FLOTILLA_PHASE=activating`).
    fn activate_is_repeatable(&self) -> bool {
        false
    }
}

fn activation(reboot: bool) -> Activation {
    if reboot {
        Activation::RebootRequired
    } else {
        Activation::Done
    }
}

/// The subcommands of the contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Subcommand {
    Check,
    Stage,
    Activate,
    Confirm,
    Rollback,
}

impl Subcommand {
    fn name(self) -> &'static str {
        match self {
            Subcommand::Check => "check",
            Subcommand::Stage => "stage",
            Subcommand::Activate => "activate",
            Subcommand::Confirm => "confirm",
            Subcommand::Rollback => "rollback",
        }
    }

    /// Exit code 2 means "nothing to do" for these; for the others the step cannot happen.
    fn may_be_unsupported(self) -> bool {
        matches!(self, Subcommand::Check | Subcommand::Confirm)
    }
}

/// The script's JSON reply; every field is optional.
#[derive(Debug, Default, Deserialize)]
struct Reply {
    ok: Option<bool>,
    message: Option<String>,
    reboot: Option<bool>,
}

/// The reply on the last non-empty line of stdout; empty stdout is an empty reply.
fn parse_reply(stdout: &[u8]) -> Result<Reply, String> {
    let Some(line) = last_line(stdout) else {
        return Ok(Reply::default());
    };
    serde_json::from_str(&line).map_err(|e| {
        let shown: String = line.chars().take(200).collect();
        format!("last stdout line {shown:?}: {e}")
    })
}

/// Where an action stands, as this target recorded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Staging,
    Staged,
    Activating,
    Activated,
    Confirmed,
    RolledBack,
}

impl Phase {
    fn as_str(self) -> &'static str {
        match self {
            Phase::Staging => "staging",
            Phase::Staged => "staged",
            Phase::Activating => "activating",
            Phase::Activated => "activated",
            Phase::Confirmed => "confirmed",
            Phase::RolledBack => "rolled-back",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "staging" => Phase::Staging,
            "staged" => Phase::Staged,
            "activating" => Phase::Activating,
            "activated" => Phase::Activated,
            "confirmed" => Phase::Confirmed,
            "rolled-back" => Phase::RolledBack,
            _ => return None,
        })
    }
}

/// The bookkeeping record, plain `key=value` text.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ScriptState {
    action_id: String,
    phase: Phase,
    /// The step that brought the action to `phase` asked for a reboot.
    reboot: bool,
}

impl ScriptState {
    fn encode(&self) -> String {
        format!(
            "# flotilla script target state; written atomically, do not edit\n\
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
    use std::os::unix::fs::PermissionsExt;

    /// A script in a temp dir whose body is `body` (a `case "$1"` in sh).
    struct Fixture {
        dir: tempfile::TempDir,
    }

    impl Fixture {
        fn new(body: &str) -> Self {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("update.sh");
            fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("script");
            fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod");
            Self { dir }
        }

        fn config(&self) -> ScriptConfig {
            ScriptConfig::new(
                self.dir.path().join("update.sh"),
                self.dir.path().join("state"),
            )
        }

        fn target(&self) -> ScriptTarget {
            ScriptTarget::new(self.config()).expect("config")
        }

        fn artifact(&self) -> PathBuf {
            let path = self.dir.path().join("artifact");
            fs::write(&path, "payload").expect("artifact");
            path
        }
    }

    fn ctx() -> ActionContext {
        ActionContext::new("act-7", "app-2.0", "app.tar")
    }

    #[test]
    fn the_script_sees_the_documented_environment() {
        let f = Fixture::new(
            r#"env | grep '^FLOTILLA_' | sort > "$FLOTILLA_STATE_DIR/env-$1"; echo '{"ok": true}'"#,
        );
        let t = f.target();
        t.check(&ctx()).expect("check");
        t.stage(&ctx(), &f.artifact()).expect("stage");
        let env = fs::read_to_string(f.dir.path().join("state/env-stage")).expect("env");
        for expected in [
            "FLOTILLA_ACTION_ID=act-7".to_owned(),
            "FLOTILLA_RELEASE=app-2.0".to_owned(),
            "FLOTILLA_ARTIFACT_NAME=app.tar".to_owned(),
            "FLOTILLA_SCRIPT_API=1".to_owned(),
            format!("FLOTILLA_ARTIFACT={}", f.artifact().display()),
            format!(
                "FLOTILLA_STATE_DIR={}",
                f.dir.path().join("state").display()
            ),
        ] {
            assert!(env.lines().any(|l| l == expected), "{expected} in:\n{env}");
        }
        let check_env = fs::read_to_string(f.dir.path().join("state/env-check")).expect("env");
        assert!(!check_env.contains("FLOTILLA_ARTIFACT="), "{check_env}");
    }

    #[test]
    fn exit_codes_map_to_documented_outcomes() {
        let f = Fixture::new(
            r#"case "$1" in
  check) exit 2 ;;
  stage) echo 'disk full on /data' >&2; exit 1 ;;
  *) exit 2 ;;
esac"#,
        );
        let t = f.target();
        t.check(&ctx())
            .expect("exit 2 on check means nothing to check");
        let err = t.stage(&ctx(), &f.artifact()).expect_err("stage fails");
        let msg = err.to_string();
        assert!(msg.contains("stage failed"), "{msg}");
        assert!(
            msg.contains("disk full on /data"),
            "stderr's last line: {msg}"
        );
        assert!(msg.contains("exit code 1"), "{msg}");
    }

    #[test]
    fn a_temporary_failure_is_marked_as_such() {
        let f = Fixture::new(r#"echo '{"ok": false, "message": "registry unreachable"}'; exit 3"#);
        let err = f.target().check(&ctx()).expect_err("temporary");
        assert!(
            matches!(
                err,
                TargetError::Script {
                    temporary: true,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("registry unreachable"), "{err}");
    }

    #[test]
    fn an_unsupported_step_that_matters_is_an_error() {
        let f = Fixture::new(r#"case "$1" in stage) exit 0 ;; *) exit 2 ;; esac"#);
        let t = f.target();
        t.stage(&ctx(), &f.artifact()).expect("stage");
        let err = t.activate(&ctx()).expect_err("unsupported activate");
        assert!(err.to_string().contains("does not support"), "{err}");
    }

    #[test]
    fn a_reply_that_is_not_json_is_reported() {
        let f = Fixture::new(r#"echo 'all good'"#);
        let err = f.target().check(&ctx()).expect_err("bad reply");
        assert!(err.to_string().contains("not the documented JSON"), "{err}");
        assert!(err.to_string().contains("all good"), "{err}");
    }

    #[test]
    fn ok_false_with_exit_zero_is_a_failure() {
        let f = Fixture::new(r#"echo 'progress...'; echo '{"ok": false, "message": "no space"}'"#);
        let err = f.target().check(&ctx()).expect_err("not ok");
        assert!(err.to_string().contains("no space"), "{err}");
    }

    #[test]
    fn a_hanging_script_is_killed_at_its_timeout() {
        let f = Fixture::new(r#"echo 'waiting for lock' >&2; sleep 60"#);
        let mut config = f.config();
        config.timeouts = ScriptTimeouts::all(Duration::from_millis(300));
        let err = ScriptTarget::new(config)
            .expect("config")
            .check(&ctx())
            .expect_err("timeout");
        let msg = err.to_string();
        assert!(msg.contains("timeout"), "{msg}");
        assert!(msg.contains("waiting for lock"), "{msg}");
    }

    #[test]
    fn a_reboot_request_is_passed_on() {
        let f = Fixture::new(
            r#"case "$1" in activate) echo '{"ok": true, "reboot": true}' ;; *) echo '{}' ;; esac"#,
        );
        let t = f.target();
        t.stage(&ctx(), &f.artifact()).expect("stage");
        assert_eq!(
            t.activate(&ctx()).expect("activate"),
            Activation::RebootRequired
        );
        let err = t.reboot().expect_err("no reboot command");
        assert!(err.to_string().contains("no reboot_command"), "{err}");
    }

    #[test]
    fn bad_configurations_name_the_field() {
        let f = Fixture::new("exit 0");
        let mut relative = f.config();
        relative.path = PathBuf::from("update.sh");
        let err = ScriptTarget::new(relative).expect_err("relative");
        assert!(
            err.to_string().contains("invalid path \"update.sh\""),
            "{err}"
        );
        let mut reserved = f.config();
        reserved.env.insert("FLOTILLA_ACTION_ID".into(), "x".into());
        let err = ScriptTarget::new(reserved).expect_err("reserved");
        assert!(err.to_string().contains("invalid env"), "{err}");
        let mut zero = f.config();
        zero.timeouts.stage = Duration::ZERO;
        let err = ScriptTarget::new(zero).expect_err("zero");
        assert!(err.to_string().contains("stage = 0s"), "{err}");
    }

    #[test]
    fn a_script_that_is_not_executable_is_refused_at_check() {
        let f = Fixture::new("exit 0");
        fs::set_permissions(
            f.dir.path().join("update.sh"),
            fs::Permissions::from_mode(0o644),
        )
        .expect("chmod");
        let err = f.target().check(&ctx()).expect_err("not executable");
        assert!(
            err.to_string().contains("must be an executable file"),
            "{err}"
        );
    }

    #[test]
    fn state_record_round_trips_and_rejects_damage() {
        let state = ScriptState {
            action_id: "a1".into(),
            phase: Phase::Activating,
            reboot: true,
        };
        assert_eq!(ScriptState::parse(&state.encode()), Ok(state));
        for bad in [
            "",
            "action=a1\n",
            "action=a1\nphase=x\n",
            "action=a/b\nphase=staged\n",
        ] {
            assert!(ScriptState::parse(bad).is_err(), "{bad:?}");
        }
    }
}
