//! Which of the global settings each command uses, so that its `--help` lists only those.
//!
//! The broker, login and operator-key settings are global: they are read from the environment as
//! well as the command line, and a shell that exports `FLOTILLA_BROKER` runs every command. Commands
//! that never reach a coordinator (key generation, releases, `plan`, `simulate`, the demo with its
//! own broker, ...) still accept them, so such a shell keeps working, but their help leaves them
//! out, and so do the completions and the man page.
//!
//! clap copies a global argument into every subcommand when it builds the command, unless the
//! subcommand already has an argument of that id; each command below gets a hidden copy first.

use clap::{Arg, Command};

/// The global settings of the broker connection: everything but the operator key.
const BROKER: [&str; 8] = [
    "broker",
    "topic_root",
    "username",
    "password_file",
    "ca_file",
    "tls",
    "client_cert",
    "client_key",
];

/// A command (as its path of subcommand names) and the global settings its help still shows.
/// Every command not named here uses them all.
const SCOPES: &[(&[&str], &[&str])] = &[
    (&["keygen"], &[]),
    (&["operator", "keygen"], &[]),
    // Signs with the operator key; sends nothing.
    (&["operator", "sign"], &["operator_key"]),
    (&["enrollment"], &[]),
    (&["keys"], &[]),
    (&["release"], &[]),
    // Connects to the broker as the coordinator; it signs its own messages.
    (&["serve"], &BROKER),
    (&["demo"], &[]),
    (&["plan"], &[]),
    (&["completions"], &[]),
    (&["man"], &[]),
    (&["simulate"], &[]),
    (&["restore"], &[]),
    (&["store"], &[]),
];

/// `root` with each scoped command's unused global settings hidden from its help.
pub fn scoped(root: Command) -> Command {
    let globals: Vec<Arg> = root
        .get_arguments()
        .filter(|arg| arg.is_global_set())
        .cloned()
        .collect();
    SCOPES.iter().fold(root, |root, (path, shown)| {
        hide_unused(root, path, &globals, shown)
    })
}

fn hide_unused(command: Command, path: &[&str], globals: &[Arg], shown: &[&str]) -> Command {
    match path.split_first() {
        Some((name, rest)) => {
            command.mut_subcommand(*name, |sub| hide_unused(sub, rest, globals, shown))
        }
        None => {
            debug_assert!(
                shown
                    .iter()
                    .all(|id| globals.iter().any(|arg| arg.get_id() == *id)),
                "{shown:?} names a setting that is not global"
            );
            globals
                .iter()
                .filter(|arg| !shown.contains(&arg.get_id().as_str()))
                .fold(command, |command, arg| command.arg(arg.clone().hide(true)))
        }
    }
}
