//! # flotilla-coordinator
//!
//! The coordinator service and the `flotilla` command line. The rollout logic itself (specs in
//! four vocabularies, the planner, the sans-I/O engine) is the `flotilla-rollout` crate; this
//! crate puts it to work:
//!
//! - [`service`]: `flotilla serve`. One task owns the engine and applies its effects in order
//!   (persist to sled, then sign and publish over MQTT); around it the MQTT link, the embedded
//!   broker, the artifact block server, the release store, keys and the config.
//! - [`cli`]: the `flotilla` command line: arguments, commands, the control client that talks to
//!   a running coordinator over MQTT, views, `plan`, `simulate` and `demo`.
//!
//! Layers point one way: `cli` -> `service` -> `flotilla_rollout` -> `flotilla_protocol`
//! (docs/architecture.md).

pub mod cli;
pub mod service;
