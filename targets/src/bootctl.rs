//! Boot control: how the `ab` target tells the bootloader which slot to boot, and learns which
//! slot it did boot.
//!
//! # Variables
//!
//! Every backend is a small key-value store (the U-Boot environment, the GRUB environment block,
//! or a plain file) holding these variables, in the usual U-Boot bootcount style:
//!
//! | variable            | written by | meaning                                                        |
//! |---------------------|------------|----------------------------------------------------------------|
//! | `flotilla_slot`     | agent, bootloader on fallback | slot to boot next: `a` or `b`               |
//! | `upgrade_available` | agent, bootloader on fallback | `1`: the slot is on trial; `0`/unset: committed |
//! | `bootcount`         | bootloader (increments), agent (resets) | boots of the slot on trial so far |
//! | `bootlimit`         | agent      | boots allowed on trial before falling back (the agent writes `1`) |
//! | `flotilla_booted`   | bootloader | slot the bootloader actually booted this time                  |
//!
//! The boot script contract (what [`BootEnv::simulate_boot`] does, and what the U-Boot and GRUB
//! snippets in `docs/targets.md` implement):
//!
//! ```text
//! if upgrade_available == 1:
//!     bootcount += 1
//!     if bootcount > bootlimit:              # altbootcmd
//!         flotilla_slot = the other slot
//!         upgrade_available = 0; bootcount = 0
//! flotilla_booted = flotilla_slot           # saved only when it changes
//! boot flotilla_slot
//! ```
//!
//! A slot change is computed in memory as a [`BootEnv`] and committed by one
//! [`BootControl::commit`], a single write of the backend (`fw_setenv -s`, one
//! `grub-editenv set`, one atomic file replacement), so a power cut leaves either the old or the
//! new boot configuration, never a mix.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::error::TargetError;
use crate::fs::atomic_write;
use crate::process::{self, last_line};

/// Slot to boot next.
pub const VAR_SLOT: &str = "flotilla_slot";
/// Slot the bootloader booted this time; written only by the bootloader.
pub const VAR_BOOTED: &str = "flotilla_booted";
/// `1` while the slot in [`VAR_SLOT`] is on trial.
pub const VAR_UPGRADE_AVAILABLE: &str = "upgrade_available";
/// Boots of the slot on trial so far.
pub const VAR_BOOTCOUNT: &str = "bootcount";
/// Boots allowed on trial before the bootloader falls back.
pub const VAR_BOOTLIMIT: &str = "bootlimit";

/// How long a boot-control tool may take before it is considered hung.
const TOOL_TIMEOUT: Duration = Duration::from_secs(60);

/// One of the two slots of an A/B pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Slot {
    /// The first slot, `a`, index 0 of `AbConfig::slots`.
    A,
    /// The second slot, `b`, index 1.
    B,
}

impl Slot {
    /// The other slot of the pair.
    pub fn other(self) -> Self {
        match self {
            Slot::A => Slot::B,
            Slot::B => Slot::A,
        }
    }

    /// Index into the configured slot paths.
    pub fn index(self) -> usize {
        match self {
            Slot::A => 0,
            Slot::B => 1,
        }
    }

    /// The name used in the boot environment: `a` or `b`.
    pub fn name(self) -> &'static str {
        match self {
            Slot::A => "a",
            Slot::B => "b",
        }
    }

    /// Parses `a` or `b` (also `A`/`B`, as some boards' scripts write them).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim() {
            "a" | "A" => Some(Slot::A),
            "b" | "B" => Some(Slot::B),
            _ => None,
        }
    }
}

impl fmt::Display for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The boot-control variables, decoded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BootEnv {
    /// `flotilla_slot`: the slot to boot next; `None` on a board not set up for flotilla.
    pub slot: Option<Slot>,
    /// `flotilla_booted`: the slot the bootloader booted; `None` if the boot script does not
    /// record it (the `ab` target then refuses to work: it could not notice a fallback).
    pub booted: Option<Slot>,
    /// `upgrade_available == 1`: `slot` is on trial.
    pub upgrade_available: bool,
    /// `bootcount`; unset reads as 0.
    pub bootcount: u32,
    /// `bootlimit`; unset means the bootloader's default (1 try).
    pub bootlimit: Option<u32>,
}

impl BootEnv {
    /// Decodes the variables; an unparseable value is an error naming the variable and value.
    pub fn from_vars(vars: &BTreeMap<String, String>) -> Result<Self, String> {
        let get = |name: &str| vars.get(name).map(|v| v.trim()).filter(|v| !v.is_empty());
        let slot = |name: &str| -> Result<Option<Slot>, String> {
            get(name)
                .map(|v| Slot::parse(v).ok_or_else(|| format!("{name}={v:?} is not a or b")))
                .transpose()
        };
        let number = |name: &str| -> Result<Option<u32>, String> {
            get(name)
                .map(|v| {
                    v.parse::<u32>()
                        .map_err(|_| format!("{name}={v:?} is not a number"))
                })
                .transpose()
        };
        Ok(Self {
            slot: slot(VAR_SLOT)?,
            booted: slot(VAR_BOOTED)?,
            upgrade_available: match get(VAR_UPGRADE_AVAILABLE) {
                None | Some("0") => false,
                Some("1") => true,
                Some(v) => return Err(format!("{VAR_UPGRADE_AVAILABLE}={v:?} is not 0 or 1")),
            },
            bootcount: number(VAR_BOOTCOUNT)?.unwrap_or(0),
            bootlimit: number(VAR_BOOTLIMIT)?,
        })
    }

    /// The variables the agent owns, encoded: everything but `flotilla_booted`, which only the
    /// bootloader writes.
    pub fn agent_vars(&self) -> Vec<(&'static str, String)> {
        let mut vars = vec![
            (
                VAR_UPGRADE_AVAILABLE,
                u8::from(self.upgrade_available).to_string(),
            ),
            (VAR_BOOTCOUNT, self.bootcount.to_string()),
        ];
        if let Some(slot) = self.slot {
            vars.insert(0, (VAR_SLOT, slot.name().to_owned()));
        }
        if let Some(limit) = self.bootlimit {
            vars.push((VAR_BOOTLIMIT, limit.to_string()));
        }
        vars
    }

    /// The slot the device runs now: the one the bootloader says it booted. `None` when the
    /// boot script does not record it; guessing from `flotilla_slot` would mistake a pending
    /// or failed switch for a successful one.
    pub fn running(&self) -> Option<Slot> {
        self.booted
    }

    /// Does what the documented boot script does at power-on (see the [module docs](self)) and
    /// returns the slot it boots. Used by tests and demos to play the bootloader.
    pub fn simulate_boot(&mut self) -> Option<Slot> {
        if self.upgrade_available {
            self.bootcount = self.bootcount.saturating_add(1);
            if self.bootcount > self.bootlimit.unwrap_or(1) {
                self.slot = self.slot.map(Slot::other);
                self.upgrade_available = false;
                self.bootcount = 0;
            }
        }
        self.booted = self.slot;
        self.booted
    }

    fn all_vars(&self) -> Vec<(&'static str, String)> {
        let mut vars = self.agent_vars();
        if let Some(booted) = self.booted {
            vars.push((VAR_BOOTED, booted.name().to_owned()));
        }
        vars
    }
}

/// A store for the boot-control variables that the bootloader also reads.
pub trait BootControl: Send + Sync + fmt::Debug {
    /// The backend and where its state lives, for error messages and logs.
    fn describe(&self) -> String;

    /// All variables of the environment (at least flotilla's). A backend that has never been
    /// written reads as empty when it can tell (a missing file); otherwise it reports an error.
    fn load(&self) -> Result<BTreeMap<String, String>, TargetError>;

    /// Sets `vars` in one write of the backend, leaving other variables alone.
    fn store(&self, vars: &[(&'static str, String)]) -> Result<(), TargetError>;

    /// Reads and decodes flotilla's variables.
    fn read(&self) -> Result<BootEnv, TargetError> {
        BootEnv::from_vars(&self.load()?).map_err(|reason| TargetError::BootControl {
            backend: self.describe(),
            reason,
        })
    }

    /// Writes the agent's variables of `env` in one write.
    fn commit(&self, env: &BootEnv) -> Result<(), TargetError> {
        self.store(&env.agent_vars())
    }

    /// Plays the bootloader for one power-on (see [`BootEnv::simulate_boot`]) and writes the
    /// result, `flotilla_booted` included. For tests and demos only: a device's real bootloader
    /// does this.
    fn simulate_boot(&self) -> Result<Option<Slot>, TargetError> {
        let mut env = self.read()?;
        let booted = env.simulate_boot();
        self.store(&env.all_vars())?;
        Ok(booted)
    }
}

/// Which boot-control backend an `ab` target uses; the agent's configuration picks one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootControlKind {
    /// A plain `name=value` file: for tests, demos, and boards whose boot script reads a file.
    File {
        /// The file.
        path: PathBuf,
    },
    /// The U-Boot environment through `fw_printenv`/`fw_setenv` (package libubootenv-tool).
    UBoot {
        /// The `fw_env.config` describing where the environment lives; `None` uses the tools'
        /// default (`/etc/fw_env.config`).
        config: Option<PathBuf>,
    },
    /// A GRUB environment block through `grub-editenv` (package grub-common).
    Grub {
        /// The environment block, usually `/boot/grub/grubenv`.
        env_file: PathBuf,
    },
}

impl BootControlKind {
    /// The backend this names.
    pub fn open(&self) -> Box<dyn BootControl> {
        match self {
            BootControlKind::File { path } => Box::new(FileBootControl::new(path.clone())),
            BootControlKind::UBoot { config } => Box::new(UBootControl::new(config.clone())),
            BootControlKind::Grub { env_file } => Box::new(GrubControl::new(env_file.clone())),
        }
    }
}

/// Boot-control variables in a plain `name=value` file, replaced atomically on every write.
#[derive(Debug, Clone)]
pub struct FileBootControl {
    path: PathBuf,
}

impl FileBootControl {
    /// A backend keeping its variables in `path` (created on the first write).
    pub fn new(path: PathBuf) -> Self {
        Self { path }
    }

    fn error(&self, reason: String) -> TargetError {
        TargetError::BootControl {
            backend: self.describe(),
            reason,
        }
    }
}

impl BootControl for FileBootControl {
    fn describe(&self) -> String {
        format!("boot-control file {}", self.path.display())
    }

    fn load(&self) -> Result<BTreeMap<String, String>, TargetError> {
        let text = match fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
            Err(e) => return Err(self.error(format!("cannot read it: {e}"))),
        };
        parse_lines(&text).map_err(|reason| self.error(reason))
    }

    fn store(&self, vars: &[(&'static str, String)]) -> Result<(), TargetError> {
        let mut all = self.load()?;
        for (name, value) in vars {
            all.insert((*name).to_owned(), value.clone());
        }
        let text: String = all.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
        atomic_write(&self.path, text).map_err(|e| self.error(format!("cannot write it: {e}")))
    }
}

/// The U-Boot environment, through `fw_printenv` and `fw_setenv` from libubootenv-tool.
#[derive(Debug, Clone)]
pub struct UBootControl {
    config: Option<PathBuf>,
}

impl UBootControl {
    /// A backend using the environment described by `config` (`None`: `/etc/fw_env.config`).
    pub fn new(config: Option<PathBuf>) -> Self {
        Self { config }
    }

    fn tool(&self, name: &str) -> Command {
        let mut cmd = Command::new(name);
        if let Some(config) = &self.config {
            cmd.arg("-c").arg(config);
        }
        cmd
    }

    fn error(&self, reason: String) -> TargetError {
        TargetError::BootControl {
            backend: self.describe(),
            reason,
        }
    }
}

impl BootControl for UBootControl {
    fn describe(&self) -> String {
        match &self.config {
            Some(config) => format!("U-Boot environment ({})", config.display()),
            None => "U-Boot environment (/etc/fw_env.config)".to_owned(),
        }
    }

    fn load(&self) -> Result<BTreeMap<String, String>, TargetError> {
        let stdout =
            run_tool(&mut self.tool("fw_printenv"), None).map_err(|reason| self.error(reason))?;
        parse_lines(&String::from_utf8_lossy(&stdout)).map_err(|reason| self.error(reason))
    }

    fn store(&self, vars: &[(&'static str, String)]) -> Result<(), TargetError> {
        // `-s -` reads `name=value` lines from stdin and writes them all in one environment
        // write (redundant environments make it atomic).
        let script: String = vars.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
        let mut cmd = self.tool("fw_setenv");
        cmd.args(["-s", "-"]);
        run_tool(&mut cmd, Some(script.as_bytes())).map_err(|reason| self.error(reason))?;
        // fw_setenv exits 0 on some failures (an unreadable script, say): believe the read-back.
        verify(&self.load()?, vars).map_err(|reason| self.error(reason))
    }
}

/// A GRUB environment block, through `grub-editenv`.
#[derive(Debug, Clone)]
pub struct GrubControl {
    env_file: PathBuf,
}

impl GrubControl {
    /// A backend using the environment block `env_file` (created on the first write).
    pub fn new(env_file: PathBuf) -> Self {
        Self { env_file }
    }

    fn editenv(&self, args: &[&str]) -> Result<Vec<u8>, TargetError> {
        let mut cmd = Command::new("grub-editenv");
        cmd.arg(&self.env_file).args(args);
        run_tool(&mut cmd, None).map_err(|reason| self.error(reason))
    }

    fn error(&self, reason: String) -> TargetError {
        TargetError::BootControl {
            backend: self.describe(),
            reason,
        }
    }
}

impl BootControl for GrubControl {
    fn describe(&self) -> String {
        format!("GRUB environment {}", self.env_file.display())
    }

    fn load(&self) -> Result<BTreeMap<String, String>, TargetError> {
        if !exists(&self.env_file).map_err(|e| self.error(format!("cannot look at it: {e}")))? {
            return Ok(BTreeMap::new());
        }
        let stdout = self.editenv(&["list"])?;
        parse_lines(&String::from_utf8_lossy(&stdout)).map_err(|reason| self.error(reason))
    }

    fn store(&self, vars: &[(&'static str, String)]) -> Result<(), TargetError> {
        if !exists(&self.env_file).map_err(|e| self.error(format!("cannot look at it: {e}")))? {
            self.editenv(&["create"])?;
        }
        let assignments: Vec<String> = vars.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let mut args = vec!["set"];
        args.extend(assignments.iter().map(String::as_str));
        // One `set` rewrites the block once (grub-editenv writes a new file and renames it).
        self.editenv(&args)?;
        verify(&self.load()?, vars).map_err(|reason| self.error(reason))
    }
}

/// Runs a boot-control tool; its stdout, or an error with its exit status and last stderr line.
fn run_tool(cmd: &mut Command, stdin: Option<&[u8]>) -> Result<Vec<u8>, String> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let out = process::run(cmd, stdin, TOOL_TIMEOUT).map_err(|e| match e {
        process::RunError::Spawn(e) if e.kind() == io::ErrorKind::NotFound => {
            format!("{program} is not installed: {e}")
        }
        e => format!("{program} {e}"),
    })?;
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(format!(
            "{program} failed ({}): {}",
            out.status,
            last_line(&out.stderr).unwrap_or_else(|| "it printed no error".to_owned())
        ))
    }
}

/// Checks that every written variable reads back with its value.
fn verify(
    read_back: &BTreeMap<String, String>,
    vars: &[(&'static str, String)],
) -> Result<(), String> {
    for (name, value) in vars {
        let found = read_back.get(*name).map(String::as_str).unwrap_or("");
        if found != value {
            return Err(format!(
                "{name} was set to {value:?} but reads back as {found:?}; the environment was not written"
            ));
        }
    }
    Ok(())
}

/// Parses `name=value` lines (blank lines and `#` comments skipped).
fn parse_lines(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut vars = BTreeMap::new();
    for line in text.lines() {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, value)) = line.split_once('=') else {
            return Err(format!("line {line:?} is not name=value"));
        };
        vars.insert(name.trim().to_owned(), value.to_owned());
    }
    Ok(vars)
}

fn exists(path: &Path) -> io::Result<bool> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn env_decodes_and_names_bad_values() {
        let env = BootEnv::from_vars(&vars(&[
            ("flotilla_slot", "b"),
            ("flotilla_booted", "a"),
            ("upgrade_available", "1"),
            ("bootcount", "2"),
            ("bootdelay", "3"),
        ]))
        .expect("decodes");
        assert_eq!(env.slot, Some(Slot::B));
        assert_eq!(env.running(), Some(Slot::A));
        let unrecorded = BootEnv::from_vars(&vars(&[("flotilla_slot", "b")])).expect("decodes");
        assert_eq!(
            unrecorded.running(),
            None,
            "never guessed from flotilla_slot"
        );
        assert!(env.upgrade_available);
        assert_eq!((env.bootcount, env.bootlimit), (2, None));

        let err = BootEnv::from_vars(&vars(&[("flotilla_slot", "c")])).expect_err("bad slot");
        assert!(err.contains("flotilla_slot=\"c\""), "{err}");
        let err = BootEnv::from_vars(&vars(&[("bootcount", "x")])).expect_err("bad count");
        assert!(err.contains("bootcount=\"x\""), "{err}");
        let err = BootEnv::from_vars(&vars(&[("upgrade_available", "yes")])).expect_err("bad flag");
        assert!(err.contains("upgrade_available"), "{err}");
    }

    #[test]
    fn a_trial_boot_falls_back_after_the_limit() {
        let mut env = BootEnv {
            slot: Some(Slot::B),
            booted: Some(Slot::A),
            upgrade_available: true,
            bootcount: 0,
            bootlimit: Some(1),
        };
        assert_eq!(
            env.simulate_boot(),
            Some(Slot::B),
            "first try boots the new slot"
        );
        assert_eq!(env.bootcount, 1);
        assert_eq!(env.simulate_boot(), Some(Slot::A), "second boot falls back");
        assert!(!env.upgrade_available);
        assert_eq!(env.slot, Some(Slot::A));

        let mut committed = BootEnv {
            slot: Some(Slot::B),
            ..BootEnv::default()
        };
        assert_eq!(committed.simulate_boot(), Some(Slot::B));
        assert_eq!(
            committed.simulate_boot(),
            Some(Slot::B),
            "no trial, no fallback"
        );
    }

    #[test]
    fn file_backend_round_trips_and_keeps_other_variables() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("bootenv");
        fs::write(&path, "# board settings\nbootdelay=3\n").expect("seed");
        let ctl = FileBootControl::new(path.clone());
        let env = BootEnv {
            slot: Some(Slot::B),
            upgrade_available: true,
            bootlimit: Some(1),
            ..BootEnv::default()
        };
        ctl.commit(&env).expect("commit");
        assert_eq!(ctl.read().expect("read"), env);
        let text = fs::read_to_string(&path).expect("read file");
        assert!(text.contains("bootdelay=3\n"), "{text}");
        assert!(text.contains("flotilla_slot=b\n"), "{text}");
        assert!(
            !text.contains("flotilla_booted"),
            "the agent never writes it: {text}"
        );

        assert_eq!(ctl.simulate_boot().expect("boot"), Some(Slot::B));
        assert_eq!(ctl.read().expect("read").booted, Some(Slot::B));
    }

    #[test]
    fn file_backend_reports_damage_with_the_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("bootenv");
        fs::write(&path, "flotilla_slot=z\n").expect("seed");
        let err = FileBootControl::new(path.clone()).read().expect_err("bad");
        let msg = err.to_string();
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(msg.contains("flotilla_slot=\"z\""), "{msg}");
    }

    #[test]
    fn missing_tools_are_named_in_the_error() {
        let err =
            run_tool(&mut Command::new("fw_printenv-not-installed"), None).expect_err("missing");
        assert!(
            err.contains("fw_printenv-not-installed is not installed"),
            "{err}"
        );
    }
}
