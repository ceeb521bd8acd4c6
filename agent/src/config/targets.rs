//! The `[[target]]` tables of the agent's configuration: the raw settings and their validation
//! into a [`TargetKind`], one arm per kind. Errors name the table and the field
//! (`target[1].slots`), like the rest of the configuration.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use flotilla_targets::{
    AbConfig, AbTarget, BootControlKind, MenderModuleConfig, MenderModuleTarget, RaucConfig,
    RaucTarget, ScriptConfig, ScriptTarget, ScriptTimeouts, SwupdateConfig, SwupdateTarget,
    TargetError,
};
use serde::Deserialize;

use super::{invalid, parse_duration, ConfigError, TargetKind};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTarget {
    pub(super) name: String,
    kind: String,
    /// file: the file replaced; script: the executable; swupdate: the swupdate program; rauc:
    /// the rauc program.
    path: Option<PathBuf>,
    /// ab, script, mender-module, swupdate, rauc: where the target keeps its state; default
    /// `<data_dir>/targets/<name>`.
    state_dir: Option<PathBuf>,
    /// ab: the two slots.
    slots: Option<Vec<PathBuf>>,
    /// ab: `uboot`, `grub` or `file`.
    bootctl: Option<String>,
    /// ab: the environment file (grub, file) or `fw_env.config` (uboot).
    bootctl_path: Option<PathBuf>,
    /// ab and rauc (default `["systemctl", "reboot"]`), script, mender-module (optional), swupdate (with
    /// `reboot`).
    reboot_command: Option<Vec<String>>,
    /// script, mender-module: per-subcommand timeouts; swupdate, rauc: `activate` (the
    /// install).
    timeouts: Option<RawTimeouts>,
    /// script: extra environment.
    env: Option<BTreeMap<String, String>>,
    /// mender-module: the module, a name in /usr/share/mender/modules/v3 or an absolute path.
    module: Option<String>,
    /// mender-module: the artifact's file name in the tree's `files/`.
    payload_file: Option<String>,
    /// mender-module: more files for `files/`, name -> content.
    files: Option<BTreeMap<String, String>>,
    /// swupdate: arguments before `-i <image>`, e.g. `["-k", "/etc/swupdate.pem"]`.
    args: Option<Vec<String>>,
    /// swupdate: the image only runs after a reboot (it writes a rootfs copy).
    reboot: Option<bool>,
    /// swupdate: runs at confirm (e.g. marks the new copy good in the bootloader).
    confirm_command: Option<Vec<String>>,
    /// swupdate: runs at rollback of an installed image (e.g. switches the bootloader back).
    rollback_command: Option<Vec<String>>,
    /// swupdate: a running SWUpdate daemon's install socket, e.g. `/tmp/sockinstctrl`.
    socket: Option<PathBuf>,
    /// swupdate: the daemon's progress socket; default `swupdateprog` beside `socket`.
    progress_socket: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTimeouts {
    check: Option<String>,
    stage: Option<String>,
    activate: Option<String>,
    confirm: Option<String>,
    rollback: Option<String>,
}

/// Where GRUB keeps its environment block unless `bootctl_path` says otherwise.
const DEFAULT_GRUBENV: &str = "/boot/grub/grubenv";

/// Validates one `[[target]]` table; `field` names its fields in errors (`target[1].slots`).
pub(super) fn target_kind(
    t: &RawTarget,
    data_dir: &Path,
    field: &dyn Fn(&str) -> String,
) -> Result<TargetKind, ConfigError> {
    let only_for = |name: &str, present: bool, kinds: &str| {
        if present {
            Err(invalid(
                field(name),
                format!("is not a setting of kind {:?} (only of {kinds})", t.kind),
            ))
        } else {
            Ok(())
        }
    };
    let absolute = |name: &str, path: &Path, what: &str| {
        if path.is_absolute() && path.file_name().is_some() {
            Ok(())
        } else {
            Err(invalid(
                field(name),
                format!("{path:?}: must be an absolute path to {what}"),
            ))
        }
    };
    let state_dir = || -> Result<PathBuf, ConfigError> {
        match &t.state_dir {
            Some(dir) => {
                absolute("state_dir", dir, "a directory")?;
                Ok(dir.clone())
            }
            None => Ok(data_dir.join("targets").join(&t.name)),
        }
    };
    let reboot_command = |cmd: &Vec<String>| {
        if cmd.first().is_none_or(|p| p.trim().is_empty()) {
            Err(invalid(
                field("reboot_command"),
                format!(
                    "{cmd:?}: name a program and its arguments, e.g. [\"systemctl\", \"reboot\"]"
                ),
            ))
        } else {
            Ok(cmd.clone())
        }
    };
    // The target's own checks name the field without the table; add it.
    let from_target = |e: TargetError| match e {
        TargetError::InvalidConfig {
            field: f,
            value,
            reason,
        } => invalid(field(f), format!("{value:?}: {reason}")),
        other => invalid(field("kind"), other.to_string()),
    };
    if t.kind != "swupdate" {
        for (name, present) in [
            ("args", t.args.is_some()),
            ("reboot", t.reboot.is_some()),
            ("confirm_command", t.confirm_command.is_some()),
            ("rollback_command", t.rollback_command.is_some()),
            ("socket", t.socket.is_some()),
            ("progress_socket", t.progress_socket.is_some()),
        ] {
            only_for(name, present, "\"swupdate\"")?;
        }
    }
    let command = |name: &str, cmd: &Vec<String>| {
        if cmd.first().is_none_or(|p| p.trim().is_empty()) {
            Err(invalid(
                field(name),
                format!("{cmd:?}: name a program and its arguments"),
            ))
        } else {
            Ok(cmd.clone())
        }
    };
    if t.kind != "mender-module" {
        for (name, present) in [
            ("module", t.module.is_some()),
            ("payload_file", t.payload_file.is_some()),
            ("files", t.files.is_some()),
        ] {
            only_for(name, present, "\"mender-module\"")?;
        }
    }
    let timeouts = || -> Result<ScriptTimeouts, ConfigError> {
        let mut timeouts = ScriptTimeouts::default();
        if let Some(raw) = &t.timeouts {
            for (name, text, slot) in [
                ("check", &raw.check, &mut timeouts.check),
                ("stage", &raw.stage, &mut timeouts.stage),
                ("activate", &raw.activate, &mut timeouts.activate),
                ("confirm", &raw.confirm, &mut timeouts.confirm),
                ("rollback", &raw.rollback, &mut timeouts.rollback),
            ] {
                let Some(text) = text else { continue };
                let name = field(&format!("timeouts.{name}"));
                let timeout = parse_duration(&name, text)?;
                if timeout.is_zero() {
                    return Err(invalid(name, format!("{text:?}: must be more than 0")));
                }
                *slot = timeout;
            }
        }
        Ok(timeouts)
    };
    // swupdate, rauc: only `timeouts.activate`, the install.
    let install_timeout = || -> Result<Option<std::time::Duration>, ConfigError> {
        let Some(raw) = &t.timeouts else {
            return Ok(None);
        };
        for (name, text) in [
            ("check", &raw.check),
            ("stage", &raw.stage),
            ("confirm", &raw.confirm),
            ("rollback", &raw.rollback),
        ] {
            if text.is_some() {
                return Err(invalid(
                    field(&format!("timeouts.{name}")),
                    format!(
                        "kind {:?} takes only timeouts.activate (the install)",
                        t.kind
                    ),
                ));
            }
        }
        let Some(text) = &raw.activate else {
            return Ok(None);
        };
        let name = field("timeouts.activate");
        let timeout = parse_duration(&name, text)?;
        if timeout.is_zero() {
            return Err(invalid(name, format!("{text:?}: must be more than 0")));
        }
        Ok(Some(timeout))
    };
    match t.kind.as_str() {
        "file" => {
            for (name, present) in [
                ("state_dir", t.state_dir.is_some()),
                ("slots", t.slots.is_some()),
                ("bootctl", t.bootctl.is_some()),
                ("bootctl_path", t.bootctl_path.is_some()),
                ("reboot_command", t.reboot_command.is_some()),
                ("timeouts", t.timeouts.is_some()),
                ("env", t.env.is_some()),
            ] {
                only_for(name, present, "\"ab\", \"script\" or \"swupdate\"")?;
            }
            let Some(path) = &t.path else {
                return Err(invalid(field("path"), "is required for kind \"file\""));
            };
            absolute("path", path, "a file")?;
            Ok(TargetKind::File { path: path.clone() })
        }
        "ab" => {
            only_for(
                "path",
                t.path.is_some(),
                "\"file\", \"script\" or \"swupdate\"",
            )?;
            only_for(
                "timeouts",
                t.timeouts.is_some(),
                "\"script\", \"mender-module\" or \"swupdate\"",
            )?;
            only_for("env", t.env.is_some(), "\"script\"")?;
            let slots = match t.slots.as_deref() {
                Some([a, b]) => [a.clone(), b.clone()],
                Some(other) => {
                    return Err(invalid(
                        field("slots"),
                        format!("{other:?}: needs exactly two devices or image files, slot a and slot b"),
                    ))
                }
                None => {
                    return Err(invalid(
                        field("slots"),
                        "is required for kind \"ab\": the two devices, e.g. [\"/dev/mmcblk0p2\", \"/dev/mmcblk0p3\"]",
                    ))
                }
            };
            for slot in &slots {
                absolute("slots", slot, "a block device or an image file")?;
            }
            let bootctl = match (t.bootctl.as_deref(), &t.bootctl_path) {
                (Some("uboot"), config) => BootControlKind::UBoot {
                    config: config.clone(),
                },
                (Some("grub"), env_file) => BootControlKind::Grub {
                    env_file: env_file
                        .clone()
                        .unwrap_or_else(|| PathBuf::from(DEFAULT_GRUBENV)),
                },
                (Some("file"), Some(path)) => BootControlKind::File { path: path.clone() },
                (Some("file"), None) => {
                    return Err(invalid(
                        field("bootctl_path"),
                        "is required with bootctl = \"file\": the file the boot script reads",
                    ))
                }
                (Some(other), _) => {
                    return Err(invalid(
                        field("bootctl"),
                        format!("{other:?}: supported are \"uboot\", \"grub\" and \"file\""),
                    ))
                }
                (None, _) => {
                    return Err(invalid(
                        field("bootctl"),
                        "is required for kind \"ab\": \"uboot\", \"grub\" or \"file\"",
                    ))
                }
            };
            if let Some(path) = &t.bootctl_path {
                absolute("bootctl_path", path, "a file")?;
            }
            let config = AbConfig {
                slots,
                bootctl,
                state_dir: state_dir()?,
                reboot_command: match &t.reboot_command {
                    Some(cmd) => reboot_command(cmd)?,
                    None => vec!["systemctl".to_owned(), "reboot".to_owned()],
                },
            };
            AbTarget::new(config.clone()).map_err(from_target)?;
            Ok(TargetKind::Ab(config))
        }
        "script" => {
            for (name, present) in [
                ("slots", t.slots.is_some()),
                ("bootctl", t.bootctl.is_some()),
                ("bootctl_path", t.bootctl_path.is_some()),
            ] {
                only_for(name, present, "\"ab\"")?;
            }
            let Some(path) = &t.path else {
                return Err(invalid(
                    field("path"),
                    "is required for kind \"script\": the update script",
                ));
            };
            absolute("path", path, "an executable")?;
            let config = ScriptConfig {
                path: path.clone(),
                state_dir: state_dir()?,
                timeouts: timeouts()?,
                env: t.env.clone().unwrap_or_default(),
                reboot_command: t.reboot_command.as_ref().map(reboot_command).transpose()?,
            };
            ScriptTarget::new(config.clone()).map_err(from_target)?;
            Ok(TargetKind::Script(config))
        }
        "mender-module" => {
            for (name, present) in [
                ("path", t.path.is_some()),
                ("slots", t.slots.is_some()),
                ("bootctl", t.bootctl.is_some()),
                ("bootctl_path", t.bootctl_path.is_some()),
                ("env", t.env.is_some()),
            ] {
                only_for(name, present, "\"file\", \"ab\" or \"script\"")?;
            }
            let Some(module) = t.module.as_deref() else {
                return Err(invalid(
                    field("module"),
                    "is required for kind \"mender-module\": e.g. \"single-file\" or an absolute path",
                ));
            };
            let config = MenderModuleConfig {
                module: MenderModuleConfig::module_path(module).map_err(from_target)?,
                state_dir: state_dir()?,
                payload_file: t.payload_file.clone(),
                files: t.files.clone().unwrap_or_default(),
                timeouts: timeouts()?,
                reboot_command: t.reboot_command.as_ref().map(reboot_command).transpose()?,
            };
            MenderModuleTarget::new(config.clone()).map_err(from_target)?;
            Ok(TargetKind::MenderModule(config))
        }
        "swupdate" => {
            for (name, present) in [
                ("slots", t.slots.is_some()),
                ("bootctl", t.bootctl.is_some()),
                ("bootctl_path", t.bootctl_path.is_some()),
            ] {
                only_for(name, present, "\"ab\"")?;
            }
            only_for("env", t.env.is_some(), "\"script\"")?;
            let mut config = SwupdateConfig::new(state_dir()?);
            if let Some(path) = &t.path {
                absolute("path", path, "the swupdate program")?;
                config.program = path.clone();
            }
            config.args = t.args.clone().unwrap_or_default();
            for (name, socket) in [
                ("socket", &t.socket),
                ("progress_socket", &t.progress_socket),
            ] {
                if let Some(socket) = socket {
                    absolute(name, socket, "SWUpdate's socket")?;
                }
            }
            config.socket = t.socket.clone();
            config.progress_socket = t.progress_socket.clone();
            if let Some(timeout) = install_timeout()? {
                config.install_timeout = timeout;
            }
            config.reboot = t.reboot.unwrap_or(false);
            config.reboot_command = match &t.reboot_command {
                Some(cmd) => Some(reboot_command(cmd)?),
                None if config.reboot => Some(vec!["systemctl".to_owned(), "reboot".to_owned()]),
                None => None,
            };
            config.confirm_command = t
                .confirm_command
                .as_ref()
                .map(|c| command("confirm_command", c))
                .transpose()?;
            config.rollback_command = t
                .rollback_command
                .as_ref()
                .map(|c| command("rollback_command", c))
                .transpose()?;
            SwupdateTarget::new(config.clone()).map_err(from_target)?;
            Ok(TargetKind::Swupdate(config))
        }
        "rauc" => {
            for (name, present) in [
                ("slots", t.slots.is_some()),
                ("bootctl", t.bootctl.is_some()),
                ("bootctl_path", t.bootctl_path.is_some()),
            ] {
                only_for(name, present, "\"ab\"; RAUC's system.conf names the slots")?;
            }
            only_for("env", t.env.is_some(), "\"script\"")?;
            let mut config = RaucConfig::new(state_dir()?);
            if let Some(path) = &t.path {
                absolute("path", path, "the rauc program")?;
                config.program = path.clone();
            }
            if let Some(timeout) = install_timeout()? {
                config.install_timeout = timeout;
            }
            if let Some(cmd) = &t.reboot_command {
                config.reboot_command = reboot_command(cmd)?;
            }
            RaucTarget::new(config.clone()).map_err(from_target)?;
            Ok(TargetKind::Rauc(config))
        }
        other => Err(invalid(
            field("kind"),
            format!(
                "{other:?}: supported kinds are \"file\", \"ab\", \"script\", \"mender-module\", \
                 \"swupdate\" and \"rauc\""
            ),
        )),
    }
}
