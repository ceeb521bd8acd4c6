//! The `flotilla` command line: what an operator types, and everything that runs on the
//! operator's side of the broker.
//!
//! - [`args`]: clap definitions of every subcommand and flag; [`help_scope`]: which global
//!   settings each command's help shows.
//! - [`accept`]: `flotilla devices accept`: the key it pins, given or confirmed on a terminal.
//! - [`commands`]: what each subcommand does; [`run`] dispatches.
//! - [`client`]: the control client, JSON requests over MQTT with a reply topic.
//! - [`login_lock`]: one connection per broker login from this machine at a time.
//! - [`out`]: stdout that ends a command quietly when the pipe it writes to closes.
//! - [`view`]: tables and progress bars for rollouts, devices and approvals; [`json`]: `--json`
//!   output, each Unix time with its RFC 3339 twin.
//! - [`watch`]: `rollout status NAME --watch` and `rollout start NAME --wait`.
//! - [`fleetfile`]: `flotilla plan` and the fleet files it reads.
//! - [`simulate`]: `flotilla simulate`, the engine in virtual time.
//! - [`demo`]: `flotilla demo`, an embedded broker, a coordinator and real agents on one box;
//!   [`demo_cleanup`]: its agents stopped and its directory removed on a panic too.
//!
//! `plan` and `simulate` use the rollout crate alone; the other commands talk to a coordinator
//! through [`client`], or start one (`serve`, `demo`) from [`crate::service`].

pub mod accept;
pub mod args;
pub mod client;
pub mod commands;
pub mod demo;
pub mod demo_cleanup;
pub mod fleetfile;
pub mod generate;
pub mod help_scope;
pub mod json;
pub mod login_lock;
pub mod migrate;
pub mod out;
pub mod sign;
pub mod simulate;
pub mod store;
pub mod view;
pub mod watch;

pub use args::{Cli, Cmd};
pub use commands::{run, CliError};
